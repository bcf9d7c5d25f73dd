"""Merging the replicas' /metrics pages into one fleet page (deploy/ray/metrics.py), and the
core a replica claims for its vLLM worker (deploy/ray/replica.py)."""

from __future__ import annotations

from releasekit.deploy.ray.metrics import merge_expositions


def test_equal_series_are_summed_and_families_described_once() -> None:
    """Counters and buckets with the same labels add up; other labels stay apart; HELP and
    TYPE appear once."""
    a = (
        "# HELP vllm:request_success_total Requests.\n"
        "# TYPE vllm:request_success_total counter\n"
        'vllm:request_success_total{model_name="demo"} 3.0\n'
        'vllm:e2e_request_latency_seconds_bucket{le="0.3",model_name="demo"} 2.0\n'
    )
    b = (
        "# HELP vllm:request_success_total Requests.\n"
        "# TYPE vllm:request_success_total counter\n"
        'vllm:request_success_total{model_name="demo"} 4.0\n'
        'vllm:e2e_request_latency_seconds_bucket{le="0.3",model_name="demo"} 5.0\n'
        'vllm:request_success_total{model_name="other"} 1.0\n'
    )
    merged = merge_expositions([a, b]).splitlines()
    assert merged.count("# TYPE vllm:request_success_total counter") == 1
    assert 'vllm:request_success_total{model_name="demo"} 7.0' in merged
    assert 'vllm:e2e_request_latency_seconds_bucket{le="0.3",model_name="demo"} 7.0' in merged
    assert 'vllm:request_success_total{model_name="other"} 1.0' in merged


def test_special_values_and_junk_lines() -> None:
    """+Inf sums stay +Inf; lines that are not samples are dropped."""
    merged = merge_expositions(["x +Inf\nnot a sample line here\n", "x 1\n"])
    assert merged == "x +Inf\n"


def test_gauges_merge_by_kind_not_all_summed() -> None:
    """Two replicas' vLLM pages: requests running add up, KV-cache usage is the fullest
    replica's (not 0.9 + 0.3), an info gauge stays 1, start times and a summary's quantiles
    are not summed, while a summary's count is."""
    a = (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="demo"} 3.0\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        'vllm:kv_cache_usage_perc{engine="0",model_name="demo"} 0.9\n'
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="16"} 1.0\n'
        "# TYPE process_start_time_seconds gauge\n"
        "process_start_time_seconds 1000.0\n"
        "# TYPE lat summary\n"
        'lat{quantile="0.5"} 0.2\n'
        "lat_count 4.0\n"
        "# TYPE vllm:request_success_total counter\n"
        "vllm:request_success_total 3.0\n"
        "vllm:request_success_created 50.0\n"
    )
    b = a.replace(" 3.0\n", " 2.0\n").replace(" 0.9\n", " 0.3\n")
    b = b.replace(" 1000.0\n", " 1200.0\n").replace(" 0.2\n", " 0.7\n")
    b = b.replace(" 50.0\n", " 60.0\n")
    merged = merge_expositions([a, b]).splitlines()
    assert 'vllm:num_requests_running{engine="0",model_name="demo"} 5.0' in merged
    assert 'vllm:kv_cache_usage_perc{engine="0",model_name="demo"} 0.9' in merged
    assert 'vllm:cache_config_info{block_size="16"} 1.0' in merged
    assert "process_start_time_seconds 1200.0" in merged
    assert 'lat{quantile="0.5"} 0.7' in merged
    assert "lat_count 8.0" in merged
    assert "vllm:request_success_total 5.0" in merged
    assert "vllm:request_success_created 50.0" in merged
    # Order of the replicas does not matter for a max.
    assert (
        merge_expositions([b, a])
        .splitlines()
        .count('vllm:kv_cache_usage_perc{engine="0",model_name="demo"} 0.9')
        == 1
    )


def test_a_ratio_gauge_without_type_is_still_the_fullest() -> None:
    """A page without TYPE lines: the rule follows the name."""
    merged = merge_expositions(
        ["vllm:gpu_cache_usage_perc 0.25\n", "vllm:gpu_cache_usage_perc 0.5\n"]
    )
    assert merged == "vllm:gpu_cache_usage_perc 0.5\n"


def test_a_replica_claims_the_least_used_core_of_its_host() -> None:
    """Only live replicas on the same host count: a killed replica's stale claim and another
    machine's replicas leave their cores free."""
    from releasekit.deploy.ray.replica import choose_core
    from releasekit.serving.host import host_cores

    cores = host_cores()
    first = cores[0]
    claims = [
        {"replica": "a", "actor": "A", "host": "h", "core": first},
        {"replica": "dead", "actor": "D", "host": "h", "core": cores[-1]},
        {"replica": "far", "actor": "F", "host": "other", "core": cores[-1]},
    ]
    got = choose_core(claims, host="h", alive={"A", "F", "me"}, me="me")
    assert got == (cores[1] if len(cores) > 1 else first)
    # The killed replica's replacement on the same host: the survivor's core is taken.
    assert choose_core(claims[:1], host="h", alive={"A"}, me="new") != first or len(cores) == 1
    # Its own earlier claim does not count against it.
    mine = [{"replica": "me", "actor": "me", "host": "h", "core": first}]
    assert choose_core(mine, host="h", alive={"me"}, me="me") == first
