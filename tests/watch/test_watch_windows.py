"""Windows from real prometheus_client exposition: percentiles from bucket deltas, rates,
sources, counter resets, missing families, label filters and scrape faults."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from watchkit import AppServer, FaultyMetrics, Sim

from releasekit.watch.windows import (
    METRICS,
    ScrapeError,
    Snapshot,
    build_window,
    classify_status,
    parse_exposition,
    scrape,
)


def snap(sim: Sim, t: float, *, gateway: bool = True) -> Snapshot:
    return Snapshot(
        t=t,
        vllm=parse_exposition(sim.text("vllm")),
        gateway=parse_exposition(sim.text("gateway")) if gateway else None,
    )


def test_percentiles_interpolate_within_buckets_from_deltas_only() -> None:
    """p50/p95/p99 come from the bucket *deltas* of the window, interpolated linearly inside
    a bucket like histogram_quantile; observations before the window do not count."""
    reg = CollectorRegistry()
    h = Histogram(
        "vllm:time_to_first_token_seconds",
        "t",
        ["model_name", "engine"],
        buckets=(0.01, 0.1, 0.5, 1.0, 2.5),
        registry=reg,
    )
    c = Counter(
        "vllm:request_success", "s", ["model_name", "engine", "finished_reason"], registry=reg
    )
    for _ in range(1000):  # before the window: all slow, must not leak in
        h.labels("demo", "0").observe(2.0)
    before = Snapshot(t=0, vllm=parse_exposition(generate_latest(reg).decode()))
    for i in range(100):
        h.labels("demo", "0").observe(0.05 if i < 90 else 2.0)
        c.labels("demo", "0", "stop").inc()
    after = Snapshot(t=10, vllm=parse_exposition(generate_latest(reg).decode()))
    w = build_window(before, after)
    # rank 50 of 90 in (0.01, 0.1]: 0.01 + 0.09 * 50/90; rank 95 in (1, 2.5]: 1 + 1.5 * 5/10
    assert w.figures["ttft_p50_s"].value == pytest.approx(0.06)
    assert w.figures["ttft_p95_s"].value == pytest.approx(1.75)
    assert w.figures["ttft_p99_s"].value == pytest.approx(1.0 + 1.5 * 9 / 10)
    assert w.figures["ttft_mean_s"].value == pytest.approx((90 * 0.05 + 10 * 2.0) / 100)
    assert w.figures["ttft_p95_s"].source == "vllm"
    assert w.figures["ttft_p95_s"].count == 100
    assert w.figures["request_rate"].value == pytest.approx(10.0)
    assert w.requests == 100 and w.requests_source == "vllm"


def test_gateway_preferred_for_ttft_and_e2e_vllm_for_phases(sim: Sim) -> None:
    """With both sources, TTFT/E2E come from the gateway's finer edge histograms (and say so);
    ITL and queue/prefill/decode from vLLM; without the gateway, vLLM's are used."""
    a = snap(sim, 0)
    sim.serve(40, ttft=0.2, e2e=0.9, queue=0.4)
    b = snap(sim, 20)
    w = build_window(a, b, env="prod", release="r1")
    assert w.figures["ttft_p95_s"].source == "gateway"
    assert w.figures["e2e_p95_s"].source == "gateway"
    assert w.figures["itl_p95_s"].source == "vllm"
    assert w.figures["queue_mean_s"].source == "vllm"
    assert w.figures["queue_mean_s"].value == pytest.approx(0.4)
    # the gateway saw 0.202 s: inside its (0.1, 0.25] bucket
    assert 0.1 < w.figures["ttft_p50_s"].value <= 0.25  # type: ignore[operator]
    assert w.requests_source == "gateway"
    assert w.figures["request_rate"].value == pytest.approx(2.0)
    no_gw = build_window(snap(sim, 0, gateway=False), snap(sim, 1, gateway=False))
    assert no_gw.figures["ttft_p95_s"].source in ("vllm", None)


def test_error_abort_and_timeout_rates_from_gateway_statuses(sim: Sim) -> None:
    """Gateway 5xx and timeouts are errors, 499 aborts, 429 the client's; vLLM's
    finished_reason gives error/abort rates when there is no gateway."""
    a = snap(sim, 0)
    sim.serve(80)
    sim.serve(10, status="502")
    sim.serve(5, status="504")
    sim.serve(3, status="499", reason="abort")
    sim.serve(2, status="429")
    sim.serve(0)
    b = snap(sim, 10)
    w = build_window(a, b, env="prod", release="r1")
    assert w.requests == 100
    assert w.figures["error_rate"].value == pytest.approx(0.15)
    assert w.figures["timeout_rate"].value == pytest.approx(0.05)
    assert w.figures["abort_rate"].value == pytest.approx(0.03)
    v = build_window(snap(sim, 0, gateway=False), snap(sim, 0.5, gateway=False))
    assert v.requests == 0
    assert classify_status("503") == "error" and classify_status("429") == "client_error"
    assert classify_status("ok") == "ok" and classify_status("timeout") == "timeout"


def test_vllm_error_rate_from_finished_reason(sim: Sim) -> None:
    """Without a gateway, error and abort rates come from request_success_total's reasons."""
    a = snap(sim, 0, gateway=False)
    sim.serve(90)
    sim.serve(6, reason="error")
    sim.serve(4, reason="abort")
    b = snap(sim, 10, gateway=False)
    w = build_window(a, b)
    assert w.figures["error_rate"].value == pytest.approx(0.06)
    assert w.figures["abort_rate"].value == pytest.approx(0.04)
    assert w.figures["error_rate"].source == "vllm"


def test_counter_going_down_is_a_reset_not_a_negative_rate(sim: Sim) -> None:
    """A vLLM restart between two scrapes makes the window a reset: no figure has a value,
    none is negative, and each says why."""
    sim.serve(500, ttft=3.0)
    a = snap(sim, 0)
    sim.restart_vllm()
    sim.serve(5)
    b = snap(sim, 30)
    w = build_window(a, b)
    assert w.reset == ["vllm"]
    assert w.requests is None
    assert all(not f.has_data for f in (w.figure(m) for m in METRICS))
    assert "reset" in (w.figure("ttft_p95_s").reason or "")


def test_restart_that_outgrew_the_old_count_is_still_a_reset(sim: Sim) -> None:
    """A restart whose new counters already exceed the old ones is caught by `_created`."""
    sim.serve(2)
    a = snap(sim, 0)
    sim.restart_vllm()
    sim.serve(50)
    b = snap(sim, 30)
    assert build_window(a, b).reset == ["vllm"]


def test_missing_family_is_no_data_for_what_depends_on_it(sim: Sim) -> None:
    """A family absent from a scrape makes only its figures no data, named in `missing`."""
    a = snap(sim, 0, gateway=False)
    sim.serve(30)
    text = "\n".join(
        ln for ln in sim.text("vllm").splitlines() if "vllm:request_queue_time_seconds" not in ln
    )
    b = Snapshot(t=10, vllm=parse_exposition(text + "\n"))
    w = build_window(a, b)
    assert "vllm:request_queue_time_seconds" in w.missing
    assert not w.figures["queue_p95_s"].has_data
    assert "missing" in (w.figures["queue_p95_s"].reason or "")
    assert w.figures["ttft_p95_s"].has_data
    assert w.figures["request_rate"].value == pytest.approx(3.0)


def test_gateway_series_are_filtered_by_env_and_release(sim: Sim) -> None:
    """Traffic of another environment or release does not leak into the window."""
    a = snap(sim, 0)
    sim.serve(10, ttft=0.05)
    sim.serve(100, ttft=5.0, env="staging")
    sim.serve(100, ttft=5.0, release="r0")
    b = snap(sim, 10)
    w = build_window(a, b, env="prod", release="r1")
    assert w.requests == 10
    assert w.figures["ttft_p95_s"].value is not None
    assert w.figures["ttft_p95_s"].value < 0.1


def test_negative_feedback_rate(sim: Sim) -> None:
    """Negative feedback share over the window; no feedback at all is no data."""
    a = snap(sim, 0)
    sim.serve(20)
    b = snap(sim, 10)
    assert not build_window(a, b, env="prod").figures["negative_feedback_rate"].has_data
    sim.feedback("negative", 3)
    sim.feedback("positive", 7)
    c = snap(sim, 20)
    f = build_window(b, c, env="prod", release="r1").figures["negative_feedback_rate"]
    assert f.value == pytest.approx(0.3) and f.count == 10 and f.source == "gateway"


def test_gauges_kv_preemptions_and_waiting(sim: Sim) -> None:
    """Waiting is the gauge at the window's end (and the larger of start/end), KV usage the
    fullest engine, preemptions a per-second rate."""
    sim.v_waiting.labels("demo", "0").set(7)
    a = snap(sim, 0)
    sim.v_waiting.labels("demo", "0").set(2)
    sim.v_kv.labels("demo", "0").set(0.93)
    sim.v_preempt.labels("demo", "0").inc(20)
    sim.serve(10)
    b = snap(sim, 10)
    w = build_window(a, b)
    assert w.figures["waiting_requests"].value == 2
    assert w.figures["waiting_requests_max"].value == 7
    assert w.figures["kv_cache_usage"].value == pytest.approx(0.93)
    assert w.figures["preemptions_per_s"].value == pytest.approx(2.0)


def test_window_must_move_forward(sim: Sim) -> None:
    """Two snapshots at the same time are a programming error, not a window."""
    with pytest.raises(ValueError):
        build_window(snap(sim, 5), snap(sim, 5))


def test_garbage_text_is_a_scrape_error() -> None:
    """Text that is not Prometheus exposition raises ScrapeError naming the URL."""
    with pytest.raises(ScrapeError, match="not Prometheus text"):
        parse_exposition("this is { not metrics\n", url="http://x/metrics")


def test_scrape_is_bounded_in_time_and_reports_http_errors(sim: Sim) -> None:
    """A server that answers late is cut off at the timeout; a 500 is a ScrapeError."""
    fm = FaultyMetrics(sim)
    with AppServer(fm.app) as srv:
        assert "vllm:num_requests_waiting" in scrape(f"{srv.url}/vllm/metrics", timeout_s=5)
        fm.delay_s["vllm"] = 3.0
        with pytest.raises(ScrapeError, match="timed out"):
            scrape(f"{srv.url}/vllm/metrics", timeout_s=0.3)
        fm.delay_s.clear()
        fm.status["vllm"] = 500
        with pytest.raises(ScrapeError, match="HTTP 500"):
            scrape(f"{srv.url}/vllm/metrics", timeout_s=5)
    with pytest.raises(ScrapeError):
        scrape(f"{srv.url}/vllm/metrics", timeout_s=1)  # server gone: refused
