"""What a diagnosis judges: the live window's figures (`LiveWindow`, by the names of
releasekit.watch.windows.METRICS, for the vLLM server and the gateway apart), the healthy
reference (`Baseline`, the knee of the release's own load test), the environment's last
change (`ChangeSummary`), and where the lines are drawn (`Thresholds`)."""

from __future__ import annotations

import datetime as dt
from typing import Literal

from pydantic import BaseModel, Field

from releasekit.bench.runner import BenchResult
from releasekit.bench.stats import PointResult

Source = Literal["vllm", "gateway", "bench", "ledger"]


class Observed(BaseModel):
    """One live figure over the window (the shape of releasekit.watch.windows.Figure)."""

    value: float | None = None
    source: str | None = None
    count: float = 0.0
    reason: str | None = None


class LiveWindow(BaseModel):
    """What the two scrapes saw: figures of the vLLM server alone (`vllm`) and of the
    gateway alone (`gateway`), by METRICS name, so that the engine's TTFT and the edge's can
    be set side by side."""

    duration_s: float = Field(gt=0)
    requests: float | None = Field(None, description="requests finished in the window")
    requests_source: str | None = None
    reset: list[str] = Field(default_factory=list, description="sources that restarted")
    scrape_errors: dict[str, str] = Field(default_factory=dict)
    vllm_url: str | None = None
    gateway_url: str | None = None
    vllm: dict[str, Observed] = Field(default_factory=dict)
    gateway: dict[str, Observed] = Field(default_factory=dict)

    def v(self, name: str) -> float | None:
        """A vLLM figure's value (None: no data)."""
        f = self.vllm.get(name)
        return None if f is None else f.value

    def g(self, name: str) -> float | None:
        """A gateway figure's value (None: no data)."""
        f = self.gateway.get(name)
        return None if f is None else f.value

    def count(self, source: Literal["vllm", "gateway"], name: str) -> float:
        """Observations behind a figure (0 when absent)."""
        f = (self.vllm if source == "vllm" else self.gateway).get(name)
        return 0.0 if f is None else f.count


class Baseline(BaseModel):
    """The healthy reference: the knee of the release's own load test (client figures from
    the load generator, server figures from vLLM's histograms over the same point)."""

    release_id: str | None = None
    load: float
    mode: str
    request_rate: float | None = None
    ttft_p95_s: float | None = None
    ttft_mean_s: float | None = None
    e2e_p95_s: float | None = None
    e2e_mean_s: float | None = None
    itl_mean_s: float | None = None
    itl_p95_s: float | None = None
    tpot_mean_s: float | None = None
    server_ttft_mean_s: float | None = None
    server_itl_mean_s: float | None = None
    queue_mean_s: float | None = None
    prefill_mean_s: float | None = None
    decode_mean_s: float | None = None
    kv_cache_usage_peak: float | None = None
    preemptions_per_s: float | None = None
    chunks_per_token: float | None = None
    prompt_tokens_mean: float | None = None
    error_rate: float | None = None
    slo_ttft_s: float | None = None
    slo_e2e_s: float | None = None
    slo_tpot_s: float | None = None
    slo_max_error_rate: float | None = None
    max_num_seqs: int | None = None


def _hist_mean(p: PointResult, name: str) -> float | None:
    if p.server is None:
        return None
    h = p.server.histograms.get(name)
    return None if h is None else h.mean_s


def baseline_from_bench(bench: BenchResult) -> Baseline | None:
    """The knee of `bench` as a Baseline; None when the sweep has no knee."""
    k = bench.knee
    if k is None:
        return None
    s = k.server
    preempt = None
    if s is not None and s.preemptions is not None and s.interval_s > 0:
        preempt = s.preemptions / s.interval_s
    return Baseline(
        release_id=bench.release_id,
        load=k.load,
        mode=k.mode,
        request_rate=k.request_throughput,
        ttft_p95_s=k.ttft.p95,
        ttft_mean_s=k.ttft.mean,
        e2e_p95_s=k.e2e.p95,
        e2e_mean_s=k.e2e.mean,
        itl_mean_s=k.itl.mean,
        itl_p95_s=k.itl.p95,
        tpot_mean_s=k.tpot.mean,
        server_ttft_mean_s=_hist_mean(k, "ttft"),
        server_itl_mean_s=_hist_mean(k, "itl"),
        queue_mean_s=None if s is None else s.queue_time_mean_s,
        prefill_mean_s=None if s is None else s.prefill_time_mean_s,
        decode_mean_s=None if s is None else s.decode_time_mean_s,
        kv_cache_usage_peak=None if s is None else s.kv_cache_usage_peak,
        preemptions_per_s=preempt,
        chunks_per_token=k.chunks_per_token,
        prompt_tokens_mean=k.prompt_tokens_mean,
        error_rate=k.error_rate,
        slo_ttft_s=bench.slo.ttft_s,
        slo_e2e_s=bench.slo.e2e_s,
        slo_tpot_s=bench.slo.tpot_s,
        slo_max_error_rate=bench.slo.max_error_rate,
        max_num_seqs=bench.max_num_seqs,
    )


class ChangeSummary(BaseModel):
    """The environment's most recent live change (ledger) and what it changed."""

    seq: int
    event_type: str
    time: dt.datetime
    age_s: float | None = None
    actor: str
    reason: str
    from_release: str | None = None
    to_release: str | None = None
    changed: list[str] = Field(
        default_factory=list, description="what differs, one line per area (prompts, serving...)"
    )
    kinds: list[str] = Field(
        default_factory=list, description="areas that differ: prompts, model, quantisation..."
    )
    diff_command: str | None = None
    notes: list[str] = Field(default_factory=list)


class Thresholds(BaseModel):
    """Where diagnose draws its lines. `*_factor` and `*_floor_s` apply against the bench
    knee (live > factor x knee and live - knee > floor); `*_abs_s` when the bench lacks the
    figure."""

    min_requests: int = Field(10, description="fewer finished requests: not enough traffic")
    min_feedback: int = Field(5, description="fewer feedback scores: no feedback verdict")
    factor: float = Field(2.0, description="a segment grew when live > factor x the knee's")
    queue_floor_s: float = 0.05
    queue_abs_s: float = 0.5
    queue_share: float = Field(0.3, description="queue time's share of latency that dominates")
    prefill_floor_s: float = 0.05
    prefill_abs_s: float = 1.0
    itl_floor_s: float = 0.005
    itl_abs_s: float = 0.1
    gateway_floor_s: float = 0.1
    intake_floor_s: float = 0.1
    intake_abs_s: float = 0.5
    gateway_abs_s: float = 0.25
    gateway_queue_abs_s: float = 0.05
    kv_usage_high: float = 0.9
    preemptions_per_s: float = Field(0.0, description="more than this: preemptions happen")
    chunks_per_token_low: float = Field(
        0.5, description="fewer SSE chunks per output token: tokens arrive merged (bursts)"
    )
    stream_share_min: float = Field(0.5, description="share of streamed requests to judge chunks")
    error_rate_abs: float = Field(0.05, description="error-rate line without a bench SLO")
    negative_feedback_rate: float = 0.3
    recent_change_s: float = Field(
        24 * 3600.0, description="a change younger than this is named as a suspect"
    )


def key_figures(w: LiveWindow) -> dict[str, float | None]:
    """The figures a diagnosis reports whatever it finds: the gateway's where it has them,
    the vLLM server's otherwise, and the engine's own gauges."""

    def pick(name: str) -> float | None:
        g = w.g(name)
        return g if g is not None else w.v(name)

    return {
        "request_rate": pick("request_rate"),
        "error_rate": pick("error_rate"),
        "ttft_p95_s": pick("ttft_p95_s"),
        "e2e_p95_s": pick("e2e_p95_s"),
        "engine_ttft_p95_s": w.v("ttft_p95_s"),
        "queue_mean_s": w.v("queue_mean_s"),
        "itl_mean_s": w.v("itl_mean_s"),
        "waiting_requests_max": w.v("waiting_requests_max"),
        "running_requests": w.v("running_requests"),
        "kv_cache_usage": w.v("kv_cache_usage"),
        "preemptions_per_s": w.v("preemptions_per_s"),
        "negative_feedback_rate": w.g("negative_feedback_rate"),
    }
