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
    "tpot": "vllm:request_time_per_output_token_seconds",
    # vLLM's API server times whole HTTP requests (prometheus-fastapi-instrumentator), front
    # end included; only the OpenAI generation routes are kept, under this family name.
    "http": "releasekit:openai_http_request_duration_seconds",
}
HTTP_FAMILY = "http_request_duration_seconds"
OPENAI_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions"})
# Families a server may lack without that being a problem (the cross-check says so itself).
_OPTIONAL = frozenset({"tpot", "http"})
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
                name = s.name
                if name.startswith(HTTP_FAMILY + "_"):
                    if s.labels.get("handler") not in OPENAI_ROUTES:
                        continue
                    name = HISTOGRAMS["http"] + name[len(HTTP_FAMILY) :]
                self.names.add(name)
                value = float(s.value)
                if name.endswith("_bucket") and "le" in s.labels:
                    self.buckets[name[: -len("_bucket")]][float(s.labels["le"])] += value
                    continue
                self.values[name] += value
                if name == REQUEST_SUCCESS and "finished_reason" in s.labels:
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
    # Bucket deltas (upper bound, cumulative count), kept in memory so windows of repeated
    # runs can be merged; not written to bench.json.
    buckets: list[tuple[float, float]] = Field(default_factory=list, exclude=True)
    sum_s: float | None = Field(None, exclude=True)


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
    in_system_peak: float | None = Field(
        None, description="highest running + waiting seen in one gauge sample"
    )
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


def histogram_count_above(bounds: Sequence[float], counts: Sequence[float], x: float) -> float:
    """How many observations lie above `x`, from cumulative bucket counts (`bounds` are the
    `le` values, ascending, the last may be +Inf), interpolating linearly within a bucket:
    the same reading of the buckets as `histogram_quantiles`, so a value at quantile q has
    (1 - q) of the count above it."""
    le = np.asarray(bounds, dtype=float)
    cum = np.maximum.accumulate(np.asarray(counts, dtype=float))
    if cum.size == 0 or cum[-1] <= 0:
        return 0.0
    total = float(cum[-1])
    finite = np.isfinite(le)
    xs = np.concatenate(([0.0], le[finite]))
    ys = np.concatenate(([0.0], cum[finite]))
    if x <= 0:
        return total
    if x >= xs[-1]:
        return total - float(ys[-1])  # only the +Inf bucket is above the last bound
    below = float(np.interp(x, xs, ys))
    return max(0.0, total - below)


def _histogram_window(before: Metrics, after: Metrics, family: str) -> HistogramWindow | None:
    count = _counter_delta(before, after, f"{family}_count")
    total = _counter_delta(before, after, f"{family}_sum")
    if count is None:
        return None
    b_after = after.buckets.get(family, {})
    b_before = before.buckets.get(family, {})
    bounds = sorted(b_after)
    deltas = [max(b_after[le] - b_before.get(le, 0.0), 0.0) for le in bounds]
    return _window(count, total, bounds, deltas)


def _window(
    count: float, total: float | None, bounds: list[float], counts: list[float]
) -> HistogramWindow:
    """The window of `count` observations summing to `total`, with its buckets' counts
    (by upper bound): the mean and the quantiles from them."""
    qs = histogram_quantiles(bounds, counts, QUANTILES) if count > 0 and bounds else [None] * 4
    return HistogramWindow(
        count=count,
        mean_s=(total / count) if (total is not None and count > 0) else None,
        p50=qs[0],
        p90=qs[1],
        p95=qs[2],
        p99=qs[3],
        buckets=list(zip(bounds, counts, strict=True)),
        sum_s=total,
    )


def _succeeded(before: Metrics, after: Metrics, reasons: dict[str, float]) -> float | None:
    # vLLM counts aborted and failed requests under request_success_total too.
    if not reasons:
        return _counter_delta(before, after, REQUEST_SUCCESS)
    return sum(v for r, v in reasons.items() if r not in _NOT_SUCCESS)


GAUGES: tuple[str, ...] = (RUNNING, WAITING, *KV_USAGE)


class GaugeValues:
    """The gauge samples of one scrape (summed over label sets), read line by line."""

    def __init__(self, values: dict[str, float]) -> None:
        self.values = values

    def get(self, name: str) -> float | None:
        """A gauge's value, or None if the scrape lacks it."""
        return self.values.get(name)


def gauge_values(text: str, names: Sequence[str] = GAUGES) -> GaugeValues:
    """The named gauges of a Prometheus text scrape, without parsing the rest of it."""
    values: dict[str, float] = {}
    for name in names:
        start = 0
        while (i := text.find(name, start)) >= 0:
            start = i + len(name)
            if i > 0 and text[i - 1] != "\n":
                continue
            nxt = text[start : start + 1]
            if nxt not in ("{", " "):
                continue
            end = text.find("\n", start)
            line = text[start : end if end >= 0 else len(text)]
            if nxt == "{":
                close = line.rfind("}")
                line = line[close + 1 :]
            parts = line.split()
            if not parts:
                continue
            try:
                values[name] = values.get(name, 0.0) + float(parts[0])
            except ValueError:
                continue
    return GaugeValues(values)


def _gauge(m: Metrics | GaugeValues, names: Sequence[str]) -> float | None:
    for n in names:
        v = m.get(n)
        if v is not None:
            return v
    return None


def _peak(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _in_system(m: Metrics | GaugeValues) -> float | None:
    running, waiting = m.get(RUNNING), m.get(WAITING)
    if running is None:
        return None
    return running + (waiting or 0.0)


def server_delta(before: Scrape, after: Scrape, samples: Sequence[Scrape] = ()) -> ServerDelta:
    """Deltas between two scrapes; `samples` are gauge scrapes taken during the point."""
    b, a = parse_metrics(before.text), parse_metrics(after.text)
    # Samples only feed gauge peaks: read just those lines (a full parse of every sample
    # would cost the client more than the load it sends).
    mid = [gauge_values(s.text) for s in samples]
    every: list[Metrics | GaugeValues] = [*mid, a]
    hist: dict[str, HistogramWindow] = {}
    missing: list[str] = []
    for short, family in HISTOGRAMS.items():
        w = _histogram_window(b, a, family)
        if w is None:
            if short not in _OPTIONAL:
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
        in_system_peak=_peak([_in_system(m) for m in every]),
        gauge_samples=len(mid),
        missing=missing,
    )


def _sum(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


def _merge_windows(windows: Sequence[HistogramWindow]) -> HistogramWindow:
    count = sum(w.count for w in windows)
    total = _sum([w.sum_s for w in windows])
    merged: dict[float, float] = defaultdict(float)
    for w in windows:
        for le, c in w.buckets:
            merged[le] += c
    bounds = sorted(merged)
    return _window(count, total, bounds, [merged[le] for le in bounds])


def merge_deltas(deltas: Sequence[ServerDelta]) -> ServerDelta:
    """One delta for several windows (repetitions of a load point): counters and intervals
    add up, histogram means and quantiles come from the pooled observations and buckets,
    peaks are the highest of any window."""
    if not deltas:
        raise ValueError("merge_deltas needs at least one delta")
    if len(deltas) == 1:
        return deltas[0]
    hist: dict[str, HistogramWindow] = {}
    for short in HISTOGRAMS:
        windows = [d.histograms[short] for d in deltas if short in d.histograms]
        if len(windows) == len(deltas):
            hist[short] = _merge_windows(windows)
    reasons: dict[str, float] = defaultdict(float)
    for d in deltas:
        for r, v in d.requests_by_reason.items():
            reasons[r] += v

    def mean(short: str) -> float | None:
        w = hist.get(short)
        return w.mean_s if w is not None else None

    return ServerDelta(
        interval_s=sum(d.interval_s for d in deltas),
        generation_tokens=_sum([d.generation_tokens for d in deltas]),
        prompt_tokens=_sum([d.prompt_tokens for d in deltas]),
        preemptions=_sum([d.preemptions for d in deltas]),
        requests_succeeded=_sum([d.requests_succeeded for d in deltas]),
        requests_by_reason=dict(sorted(reasons.items())),
        queue_time_mean_s=mean("queue"),
        prefill_time_mean_s=mean("prefill"),
        decode_time_mean_s=mean("decode"),
        histograms=hist,
        kv_cache_usage_peak=_peak([d.kv_cache_usage_peak for d in deltas]),
        kv_cache_usage_after=deltas[-1].kv_cache_usage_after,
        running_peak=_peak([d.running_peak for d in deltas]),
        waiting_peak=_peak([d.waiting_peak for d in deltas]),
        in_system_peak=_peak([d.in_system_peak for d in deltas]),
        gauge_samples=sum(d.gauge_samples for d in deltas),
        missing=sorted({m for d in deltas for m in d.missing}),
    )
