"""Server-side evidence: scrape vLLM's Prometheus `/metrics` around each load point and turn
two scrapes (plus gauge samples taken during the point) into deltas: token counters,
preemptions, finished requests, queue/prefill/decode means and windowed percentiles from
histogram bucket deltas, KV-cache usage, running and waiting requests.

Scrapes are stored as raw text while load runs and parsed afterwards with
`prometheus_client.parser`, so parsing never competes with the load for CPU.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, Field

# Counter samples (sample names, i.e. with `_total`).
GENERATION_TOKENS = "vllm:generation_tokens_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
PREEMPTIONS = "vllm:num_preemptions_total"
REQUEST_SUCCESS = "vllm:request_success_total"
# Gauges; older vLLM releases named the KV-cache gauge after the GPU.
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
# Histograms: short name -> family name.
HISTOGRAMS: dict[str, str] = {
    "ttft": "vllm:time_to_first_token_seconds",
    "itl": "vllm:inter_token_latency_seconds",
    "e2e": "vllm:e2e_request_latency_seconds",
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
    "decode": "vllm:request_decode_time_seconds",
}
_NOT_SUCCESS = frozenset({"abort", "error"})
QUANTILES: tuple[float, ...] = (0.5, 0.9, 0.95, 0.99)


@dataclass(frozen=True, slots=True)
class Scrape:
    """One raw `/metrics` answer and when it was taken (time.perf_counter())."""

    t: float
    text: str


class Metrics:
    """A parsed scrape: every sample value, summed over label sets that differ only in
    labels we do not key on (model, engine)."""

    def __init__(self, text: str) -> None:
        self.values: dict[str, float] = defaultdict(float)
        self.by_reason: dict[str, float] = defaultdict(float)
        self.buckets: dict[str, dict[float, float]] = defaultdict(lambda: defaultdict(float))
        self.names: set[str] = set()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                self.names.add(s.name)
                value = float(s.value)
                if s.name.endswith("_bucket") and "le" in s.labels:
                    self.buckets[s.name[: -len("_bucket")]][float(s.labels["le"])] += value
                    continue
                self.values[s.name] += value
                if s.name == REQUEST_SUCCESS and "finished_reason" in s.labels:
                    self.by_reason[s.labels["finished_reason"]] += value

    def get(self, name: str) -> float | None:
        """A sample's value (summed over label sets), or None if the server lacks it."""
        return self.values[name] if name in self.names else None


def parse_metrics(text: str) -> Metrics:
    """Parse Prometheus text exposition."""
    return Metrics(text)


async def fetch(client: httpx.AsyncClient) -> Scrape | None:
    """GET /metrics; None when the server has no metrics endpoint or does not answer."""
    try:
        resp = await client.get("/metrics")
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    return Scrape(t=time.perf_counter(), text=resp.text)


class HistogramWindow(BaseModel):
    """A server histogram over one load point: observations, mean and windowed quantiles
    (linear within buckets, as Prometheus' histogram_quantile)."""

    count: float
    mean_s: float | None = None
    p50: float | None = None
    p90: float | None = None
    p95: float | None = None
    p99: float | None = None


class ServerDelta(BaseModel):
    """What the server itself counted between the scrapes around one load point."""

    interval_s: float = Field(description="time between the two scrapes")
    generation_tokens: float | None = None
    prompt_tokens: float | None = None
    preemptions: float | None = None
    requests_succeeded: float | None = Field(
        None, description="requests finished for any reason but abort or error"
    )
    requests_by_reason: dict[str, float] = Field(default_factory=dict)
    queue_time_mean_s: float | None = None
    prefill_time_mean_s: float | None = None
    decode_time_mean_s: float | None = None
    histograms: dict[str, HistogramWindow] = Field(default_factory=dict)
    kv_cache_usage_peak: float | None = Field(
        None, description="highest KV-cache usage (fraction) seen in gauge samples"
    )
    kv_cache_usage_after: float | None = None
    running_peak: float | None = None
    waiting_peak: float | None = None
    gauge_samples: int = 0
    missing: list[str] = Field(
        default_factory=list, description="metrics this server did not expose"
    )


def _counter_delta(before: Metrics, after: Metrics, name: str) -> float | None:
    a, b = before.get(name), after.get(name)
    if b is None:
        return None
    if a is None:  # the series first appeared during the point: it counted from zero
        a = 0.0
    # A counter that went down means the server restarted: Prometheus counts from zero.
    return b - a if b >= a else b


def histogram_quantiles(
    bounds: Sequence[float], counts: Sequence[float], quantiles: Sequence[float]
) -> list[float | None]:
    """Quantiles from cumulative bucket counts (`bounds` are the `le` values, ascending,
    the last may be +Inf), interpolating linearly within a bucket."""
    le = np.asarray(bounds, dtype=float)
    cum = np.maximum.accumulate(np.asarray(counts, dtype=float))
    if cum.size == 0 or cum[-1] <= 0:
        return [None for _ in quantiles]
    finite = np.isfinite(le)
    top = float(le[finite][-1]) if finite.any() else math.nan
    # Prepend the (0, 0) corner so the first bucket interpolates from zero.
    xs = np.concatenate(([0.0], cum[finite]))
    ys = np.concatenate(([0.0], le[finite]))
    out: list[float | None] = []
    for q in quantiles:
        rank = q * cum[-1]
        if not finite.any() or rank > xs[-1]:
            out.append(top if not math.isnan(top) else None)  # in the +Inf bucket
            continue
        # Leftmost bucket whose cumulative count reaches the rank.
        i = int(np.searchsorted(xs, rank, side="left"))
        if i == 0:
            out.append(float(ys[0]))
            continue
        lo_x, hi_x, lo_y, hi_y = xs[i - 1], xs[i], ys[i - 1], ys[i]
        frac = (rank - lo_x) / (hi_x - lo_x) if hi_x > lo_x else 1.0
        out.append(float(lo_y + frac * (hi_y - lo_y)))
    return out


def _histogram_window(before: Metrics, after: Metrics, family: str) -> HistogramWindow | None:
    count = _counter_delta(before, after, f"{family}_count")
    total = _counter_delta(before, after, f"{family}_sum")
    if count is None:
        return None
    b_after = after.buckets.get(family, {})
    b_before = before.buckets.get(family, {})
    bounds = sorted(b_after)
    deltas = [max(b_after[le] - b_before.get(le, 0.0), 0.0) for le in bounds]
    qs = histogram_quantiles(bounds, deltas, QUANTILES) if count > 0 else [None] * 4
    return HistogramWindow(
        count=count,
        mean_s=(total / count) if (total is not None and count > 0) else None,
        p50=qs[0],
        p90=qs[1],
        p95=qs[2],
        p99=qs[3],
    )


def _succeeded(before: Metrics, after: Metrics, reasons: dict[str, float]) -> float | None:
    # vLLM counts aborted and failed requests under request_success_total too.
    if not reasons:
        return _counter_delta(before, after, REQUEST_SUCCESS)
    return sum(v for r, v in reasons.items() if r not in _NOT_SUCCESS)


def _gauge(m: Metrics, names: Sequence[str]) -> float | None:
    for n in names:
        v = m.get(n)
        if v is not None:
            return v
    return None


def _peak(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def server_delta(before: Scrape, after: Scrape, samples: Sequence[Scrape] = ()) -> ServerDelta:
    """Deltas between two scrapes; `samples` are gauge scrapes taken during the point."""
    b, a = parse_metrics(before.text), parse_metrics(after.text)
    mid = [parse_metrics(s.text) for s in samples]
    every = [*mid, a]
    hist: dict[str, HistogramWindow] = {}
    missing: list[str] = []
    for short, family in HISTOGRAMS.items():
        w = _histogram_window(b, a, family)
        if w is None:
            missing.append(family)
        else:
            hist[short] = w
    for name in (GENERATION_TOKENS, PROMPT_TOKENS, PREEMPTIONS, REQUEST_SUCCESS, RUNNING, WAITING):
        if a.get(name) is None:
            missing.append(name)
    if _gauge(a, KV_USAGE) is None:
        missing.append(KV_USAGE[0])
    reasons = {
        r: v - b.by_reason.get(r, 0.0) if v >= b.by_reason.get(r, 0.0) else v
        for r, v in sorted(a.by_reason.items())
    }

    def mean(short: str) -> float | None:
        w = hist.get(short)
        return w.mean_s if w is not None else None

    return ServerDelta(
        interval_s=after.t - before.t,
        generation_tokens=_counter_delta(b, a, GENERATION_TOKENS),
        prompt_tokens=_counter_delta(b, a, PROMPT_TOKENS),
        preemptions=_counter_delta(b, a, PREEMPTIONS),
        requests_succeeded=_succeeded(b, a, reasons),
        requests_by_reason={r: v for r, v in reasons.items() if v},
        queue_time_mean_s=mean("queue"),
        prefill_time_mean_s=mean("prefill"),
        decode_time_mean_s=mean("decode"),
        histograms=hist,
        kv_cache_usage_peak=_peak([_gauge(m, KV_USAGE) for m in every]),
        kv_cache_usage_after=_gauge(a, KV_USAGE),
        running_peak=_peak([m.get(RUNNING) for m in every]),
        waiting_peak=_peak([m.get(WAITING) for m in every]),
        gauge_samples=len(mid),
        missing=missing,
    )
