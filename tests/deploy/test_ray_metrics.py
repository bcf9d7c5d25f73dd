"""Merging the replicas' /metrics pages into one fleet page (deploy/ray/metrics.py)."""

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
