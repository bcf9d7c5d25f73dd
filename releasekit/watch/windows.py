"""Metric windows: scrape Prometheus text exposition (vLLM's and the gateway's /metrics) with a
bounded time, and turn two scrapes into a `Window` of per-window figures from counter and
histogram-bucket deltas.

A figure carries its value, the source it came from (`vllm` or `gateway`), how many
observations it rests on, and, when it has no value, why ("no data"). A window never holds a
negative rate: a counter that went down (a server restart) makes the whole window a reset,
with no figures. The gateway's edge histograms (finer buckets, and what the client sees) are
preferred for TTFT and E2E when they have observations; vLLM's otherwise.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import httpx
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, Field

from releasekit._support.http import http_client
from releasekit.bench.scrape import (
    GENERATION_TOKENS,
    HISTOGRAMS,
    KV_USAGE,
    PREEMPTIONS,
    PROMPT_TOKENS,
    QUANTILES,
    REQUEST_SUCCESS,
    RUNNING,
    WAITING,
    histogram_count_above,
    histogram_quantiles,
)
from releasekit.deploy.ray.metrics import REPLICAS_GAUGE
from releasekit.errors import ReleasekitError

Source = Literal["vllm", "gateway"]

# The gateway's metric names: a contract with releasekit.deploy.gateway.
GW_REQUESTS = "releasekit_gateway_requests_total"  # {env,release,route,status}
GW_IN_FLIGHT = "releasekit_gateway_in_flight"  # {env,release}
GW_TTFT = "releasekit_gateway_ttft_seconds"  # histogram {env,release}
GW_E2E = "releasekit_gateway_e2e_seconds"  # histogram {env,release}
GW_UPSTREAM_WAIT = "releasekit_gateway_upstream_wait_seconds"  # histogram {env,release}
GW_QUEUE_WAIT = "releasekit_gateway_queue_wait_seconds"  # histogram {env}
GW_STREAM_CHUNKS = "releasekit_gateway_stream_chunks_total"  # {env,release}
GW_REJECTIONS = "releasekit_gateway_rejections_total"  # {env,reason}
GW_FEEDBACK = "releasekit_gateway_feedback_total"  # {env,release,score}

# Histogram short name -> (vLLM family, gateway family). None: that source has none.
LATENCY_FAMILIES: dict[str, tuple[str | None, str | None]] = {
    "ttft": (HISTOGRAMS["ttft"], GW_TTFT),
    "itl": (HISTOGRAMS["itl"], None),
    "tpot": (HISTOGRAMS["tpot"], None),  # engine-side time per output token
    "e2e": (HISTOGRAMS["e2e"], GW_E2E),
    "queue": (HISTOGRAMS["queue"], None),
    "prefill": (HISTOGRAMS["prefill"], None),
    "decode": (HISTOGRAMS["decode"], None),
    "gateway_queue": (None, GW_QUEUE_WAIT),
    "upstream_wait": (None, GW_UPSTREAM_WAIT),
}
_QUANTILE_SUFFIX = {q: f"p{round(q * 100)}" for q in QUANTILES}  # 0.95 -> p95

# Routes of the gateway that are not inference traffic (never counted as requests): paths,
# and the gateway's own `route` label for the model list.
NON_INFERENCE_ROUTES = frozenset({"/health", "/metrics", "/v1/models", "/version", "models"})
StatusClass = Literal["ok", "client_error", "error", "timeout", "abort"]


class MetricInfo(BaseModel):
    """What a window figure means: unit, description, and the sources that can supply it."""

    unit: str
    description: str
    sources: tuple[Source, ...]


def _catalogue() -> dict[str, MetricInfo]:
    out: dict[str, MetricInfo] = {}
    for short, (v, g) in LATENCY_FAMILIES.items():
        sources = tuple(s for s, fam in (("gateway", g), ("vllm", v)) if fam is not None)
        for q, suffix in _QUANTILE_SUFFIX.items():
            out[f"{short}_{suffix}_s"] = MetricInfo(
                unit="s", description=f"{short} {q:.0%} quantile over the window", sources=sources
            )
        out[f"{short}_mean_s"] = MetricInfo(
            unit="s", description=f"{short} mean over the window", sources=sources
        )
    both: tuple[Source, ...] = ("gateway", "vllm")
    out |= {
        "request_rate": MetricInfo(unit="1/s", description="requests per second", sources=both),
        "error_rate": MetricInfo(
            unit="ratio",
            description="share of requests that failed (gateway 5xx and timeouts, or vLLM "
            "finished_reason=error)",
            sources=both,
        ),
        "timeout_rate": MetricInfo(
            unit="ratio", description="share of requests that timed out", sources=("gateway",)
        ),
        "abort_rate": MetricInfo(
            unit="ratio",
            description="share of requests aborted (client gone, vLLM finished_reason=abort)",
            sources=both,
        ),
        "waiting_requests": MetricInfo(
            unit="requests", description="requests waiting at the window's end", sources=("vllm",)
        ),
        "waiting_requests_max": MetricInfo(
            unit="requests",
            description="larger of the waiting gauge at the window's start and end",
            sources=("vllm",),
        ),
        "running_requests": MetricInfo(
            unit="requests", description="requests running at the window's end", sources=("vllm",)
        ),
        "replicas": MetricInfo(
            unit="replicas",
            description="the release's replicas at the window's end (`ray` target: Ray "
            "scales them)",
            sources=("vllm",),
        ),
        "kv_cache_usage": MetricInfo(
            unit="ratio",
            description="KV-cache usage at the window's end (the fullest engine)",
            sources=("vllm",),
        ),
        "preemptions_per_s": MetricInfo(
            unit="1/s", description="preemptions per second", sources=("vllm",)
        ),
        "generation_tokens_per_s": MetricInfo(
            unit="tokens/s", description="output tokens per second", sources=("vllm",)
        ),
        "prompt_tokens_per_s": MetricInfo(
            unit="tokens/s", description="prompt tokens per second", sources=("vllm",)
        ),
        "in_flight": MetricInfo(
            unit="requests", description="requests in flight at the gateway", sources=("gateway",)
        ),
        "rejections_per_s": MetricInfo(
            unit="1/s", description="requests the gateway rejected per second", sources=("gateway",)
        ),
        "chunks_per_request": MetricInfo(
            unit="chunks",
            description="streamed chunks per request (few chunks: tokens arrive merged)",
            sources=("gateway",),
        ),
        "negative_feedback_rate": MetricInfo(
            unit="ratio",
            description="share of feedback on responses that was negative",
            sources=("gateway",),
        ),
    }
    return out


METRICS: dict[str, MetricInfo] = _catalogue()
"""Every figure a window can hold, by name (the names watch rules use)."""


class ScrapeError(ReleasekitError):
    """Raised when a /metrics endpoint does not answer usable Prometheus text in time
    (connection refused, timeout, non-200, oversize or unparseable body)."""

    remedy = "check that the server is up and that its /metrics answers (`curl URL`)"

    def __init__(self, url: str, problem: str) -> None:
        self.url = url
        self.problem = problem
        super().__init__(f"scrape of {url} failed: {problem}")


# --------------------------------------------------------------------------- scraping


def scrape(
    url: str,
    *,
    timeout_s: float = 5.0,
    client: httpx.Client | None = None,
    max_bytes: int = 32 * 1024 * 1024,
) -> str:
    """GET a /metrics URL and return its text. `timeout_s` bounds each connect and read, and
    the body as a whole (a server trickling bytes is cut off at the deadline); a server that
    stalls after the headers takes at most about twice `timeout_s`. Raises ScrapeError."""
    deadline = time.monotonic() + timeout_s
    own = client is None
    c = client or http_client()
    try:
        with c.stream("GET", url, timeout=httpx.Timeout(timeout_s)) as resp:
            if resp.status_code != 200:
                raise ScrapeError(url, f"HTTP {resp.status_code}")
            body = bytearray()
            for chunk in resp.iter_bytes():
                body += chunk
                if len(body) > max_bytes:
                    raise ScrapeError(url, f"body over {max_bytes} bytes")
                if time.monotonic() > deadline:
                    raise ScrapeError(url, f"timed out after {timeout_s:g} s")
        if time.monotonic() > deadline:
            raise ScrapeError(url, f"timed out after {timeout_s:g} s")
        return body.decode("utf-8", errors="replace")
    except httpx.TimeoutException as exc:
        raise ScrapeError(url, f"timed out after {timeout_s:g} s") from exc
    except httpx.HTTPError as exc:
        raise ScrapeError(url, f"{type(exc).__name__}: {exc}") from exc
    finally:
        if own:
            c.close()


SeriesKey = tuple[str, tuple[tuple[str, str], ...]]
"""A sample name and its sorted labels."""


@dataclass(frozen=True)
class Exposition:
    """One parsed /metrics answer: every sample by series, which series only go up
    (counters, histogram buckets/counts), each series' `_created` time, and the families."""

    samples: dict[SeriesKey, float]
    monotonic: frozenset[SeriesKey]
    created: dict[SeriesKey, float]
    families: frozenset[str]

    def has(self, family: str) -> bool:
        """Whether the exposition has any sample of `family` (a family name: no `_total`)."""
        return family in self.families

    def select(self, name: str, where: Mapping[str, str]) -> list[tuple[SeriesKey, float]]:
        """Series of sample `name` whose labels agree with `where` (a label the series lacks
        does not exclude it: `{env}`-only families pass a release filter)."""
        out = []
        for key, value in self.samples.items():
            if key[0] != name:
                continue
            labels = dict(key[1])
            if all(labels.get(k, v) == v for k, v in where.items()):
                out.append((key, value))
        return out


def _family_of(sample_name: str) -> str:
    for suffix in ("_total", "_bucket", "_count", "_sum", "_created"):
        if sample_name.endswith(suffix):
            return sample_name[: -len(suffix)]
    return sample_name


def parse_exposition(text: str, *, url: str = "(text)") -> Exposition:
    """Parse Prometheus text exposition with prometheus_client's parser. Raises ScrapeError
    when the text does not parse."""
    samples: dict[SeriesKey, float] = {}
    monotonic: set[SeriesKey] = set()
    created: dict[SeriesKey, float] = {}
    families: set[str] = set()
    try:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                key: SeriesKey = (s.name, tuple(sorted(s.labels.items())))
                if s.name.endswith("_created"):
                    # The series' start time: a new value means the process restarted.
                    base = s.name[: -len("_created")]
                    created[(base, key[1])] = float(s.value)
                    continue
                families.add(_family_of(s.name) if fam.type != "gauge" else s.name)
                samples[key] = float(s.value)
                if fam.type == "counter" or (
                    fam.type == "histogram" and s.name.endswith(("_bucket", "_count"))
                ):
                    monotonic.add(key)
    except (ValueError, TypeError, IndexError) as exc:
        raise ScrapeError(url, f"not Prometheus text ({exc})") from exc
    return Exposition(samples, frozenset(monotonic), created, frozenset(families))


@dataclass(frozen=True)
class Snapshot:
    """The sources scraped at (about) one time `t` (the watcher's clock, seconds)."""

    t: float
    vllm: Exposition | None = None
    gateway: Exposition | None = None
    errors: dict[str, str] = field(default_factory=dict)


# --------------------------------------------------------------------------- windows


class Figure(BaseModel):
    """One window figure. `value` None means no data, and `reason` says why."""

    value: float | None = None
    source: Source | None = None
    count: float = Field(0.0, description="requests or observations the figure rests on")
    reason: str | None = None

    @property
    def has_data(self) -> bool:
        """Whether the figure has a value."""
        return self.value is not None


class LatencyHistogram(BaseModel):
    """One latency histogram over a window (the source its quantiles came from): what a
    judgement needs beyond the quantiles, such as how many observations lie above a limit."""

    source: Source
    bounds: list[float]
    cumulative: list[float]

    @property
    def count(self) -> float:
        """Observations in the window."""
        return self.cumulative[-1] if self.cumulative else 0.0

    def count_above(self, x: float) -> float:
        """Observations above `x` (interpolated within its bucket, as the quantiles are)."""
        return histogram_count_above(self.bounds, self.cumulative, x)


class Window(BaseModel):
    """What happened between two scrapes: per-window figures by metric name (see METRICS)."""

    env: str | None = None
    release: str | None = None
    start: float
    end: float
    duration_s: float
    requests: float | None = Field(None, description="requests finished in the window")
    requests_source: Source | None = None
    reset: list[str] = Field(
        default_factory=list, description="sources whose counters went down (restarted)"
    )
    missing: list[str] = Field(default_factory=list, description="families a source lacked")
    figures: dict[str, Figure] = Field(default_factory=dict)
    histograms: dict[str, LatencyHistogram] = Field(
        default_factory=dict,
        exclude=True,
        description="latency histograms by short name (ttft, tpot, ...), not serialised",
    )

    def figure(self, metric: str) -> Figure:
        """The figure for `metric`, or a no-data figure saying why there is none."""
        if metric in self.figures:
            return self.figures[metric]
        if self.reset:
            return Figure(reason=f"reset: {', '.join(self.reset)} restarted in this window")
        return Figure(reason=f"no figure {metric} in this window")


def _resets(before: Exposition, after: Exposition) -> bool:
    for key in after.monotonic & before.monotonic:
        if after.samples[key] < before.samples[key]:
            return True
    for key, t in after.created.items():
        old = before.created.get(key)
        if old is not None and t != old:
            return True
    return False


@dataclass
class _Pair:
    """Deltas between two expositions of one source, restricted by a label filter."""

    before: Exposition
    after: Exposition
    where: Mapping[str, str]

    def delta(self, name: str, *, labels: Mapping[str, str] | None = None) -> float:
        where = {**self.where, **(labels or {})}
        total = 0.0
        for key, value in self.after.select(name, where):
            # A series that appeared in the window counted from zero.
            total += value - self.before.samples.get(key, 0.0)
        return max(total, 0.0)

    def delta_by(self, name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for key, value in self.after.select(name, self.where):
            out[dict(key[1]).get(label, "")] += value - self.before.samples.get(key, 0.0)
        return {k: max(v, 0.0) for k, v in out.items()}

    def gauge(self, name: str, *, how: Literal["sum", "max"], end: bool = True) -> float | None:
        exp = self.after if end else self.before
        values = [v for _, v in exp.select(name, self.where)]
        if not values:
            return None
        return sum(values) if how == "sum" else max(values)

    def histogram(self, family: str) -> tuple[float, float, list[float], list[float]]:
        """count, sum, bucket bounds and cumulative bucket deltas of `family`."""
        buckets: dict[float, float] = defaultdict(float)
        for key, value in self.after.select(f"{family}_bucket", self.where):
            le = float(dict(key[1]).get("le", "+Inf"))
            buckets[le] += value - self.before.samples.get(key, 0.0)
        bounds = sorted(buckets)
        return (
            self.delta(f"{family}_count"),
            self.delta(f"{family}_sum"),
            bounds,
            [max(buckets[b], 0.0) for b in bounds],
        )


# Gateway `status` words (besides HTTP codes) by class; alertrules builds its regexes from them.
TIMEOUT_STATUSES = frozenset({"504", "timeout", "timed_out", "upstream_timeout"})
ABORT_STATUSES = frozenset(
    {"499", "abort", "aborted", "cancelled", "canceled", "client_closed", "disconnected"}
)
ERROR_WORDS = frozenset({"error", "upstream_error", "failed", "failure"})
# `client_timeout`: a non-stream request that outlasted the gateway's first-byte timeout (its
# first byte follows the whole generation the client asked for): the client's, not a timeout.
CLIENT_WORDS = frozenset({"rejected", "bad_request", "unauthorized", "client_timeout"})


def classify_status(status: str) -> StatusClass:
    """Sort a gateway `status` label (an HTTP code or a word) into ok / client_error / error /
    timeout / abort. 429 and other 4xx are the client's (rate limits are policy, not a
    regression); 5xx are errors, 504 a timeout, 499 an abort (the client went away)."""
    s = status.strip().lower()
    if s in TIMEOUT_STATUSES:
        return "timeout"
    if s in ABORT_STATUSES:
        return "abort"
    if s.startswith("5") or s in ERROR_WORDS:
        return "error"
    if s.startswith("4") or s in CLIENT_WORDS:
        return "client_error"
    return "ok"


def _no_data(reason: str, source: Source | None = None, count: float = 0.0) -> Figure:
    return Figure(reason=reason, source=source, count=count)


def _latency_figures(
    short: str,
    pairs: Mapping[Source, _Pair | None],
    out: dict[str, Figure],
    missing: list[str],
    hists: dict[str, LatencyHistogram],
) -> None:
    vllm_family, gw_family = LATENCY_FAMILIES[short]
    chosen: tuple[Source, str, float, float, list[float], list[float]] | None = None
    why = []
    order: list[tuple[Source, str | None]] = [("gateway", gw_family), ("vllm", vllm_family)]
    for source, family in order:
        if family is None:
            continue
        pair = pairs.get(source)
        if pair is None:
            why.append(f"{source} not scraped")
            continue
        if not pair.after.has(family):
            missing.append(family)
            why.append(f"{family} missing")
            continue
        count, total, bounds, cum = pair.histogram(family)
        if count <= 0:
            why.append(f"no {family} observations")
            continue
        chosen = (source, family, count, total, bounds, cum)
        break
    names = [f"{short}_{sfx}_s" for sfx in _QUANTILE_SUFFIX.values()] + [f"{short}_mean_s"]
    if chosen is None:
        for n in names:
            out[n] = _no_data("; ".join(why) or "no source")
        return
    source, _family, count, total, bounds, cum = chosen
    hists[short] = LatencyHistogram(source=source, bounds=bounds, cumulative=cum)
    qs = histogram_quantiles(bounds, cum, list(_QUANTILE_SUFFIX))
    for (_q, sfx), v in zip(_QUANTILE_SUFFIX.items(), qs, strict=True):
        out[f"{short}_{sfx}_s"] = Figure(value=v, source=source, count=count)
    mean = total / count if math.isfinite(total) else None
    out[f"{short}_mean_s"] = Figure(value=mean, source=source, count=count)


def build_window(
    before: Snapshot, after: Snapshot, *, env: str | None = None, release: str | None = None
) -> Window:
    """The window between two snapshots. Gateway series are restricted to `env` and
    `release` (labels `env`, `release`) when given; vLLM's are summed over model and engine.

    A source that restarted (a counter went down, or a series' `_created` changed) makes the
    whole window a reset with no figures: a restart is neither a pass nor a breach. A source
    missing from either snapshot contributes nothing.
    """
    duration = after.t - before.t
    if duration <= 0:
        raise ValueError(f"window must move forward in time (got {duration:g} s)")
    w = Window(env=env, release=release, start=before.t, end=after.t, duration_s=duration)
    gw_where = {k: v for k, v in (("env", env), ("release", release)) if v is not None}
    pairs: dict[Source, _Pair | None] = {"vllm": None, "gateway": None}
    if before.vllm is not None and after.vllm is not None:
        pairs["vllm"] = _Pair(before.vllm, after.vllm, {})
    if before.gateway is not None and after.gateway is not None:
        pairs["gateway"] = _Pair(before.gateway, after.gateway, gw_where)
    for source, pair in pairs.items():
        if pair is not None and _resets(pair.before, pair.after):
            w.reset.append(source)
    if w.reset:
        return w

    figs: dict[str, Figure] = {}
    missing: list[str] = []
    vp, gp = pairs["vllm"], pairs["gateway"]

    # Requests and request-based rates: the gateway's view when it has one.
    gw_by_status: dict[str, float] | None = None
    if gp is not None and gp.after.has(_family_of(GW_REQUESTS)):
        by: dict[str, float] = defaultdict(float)
        for key, value in gp.after.select(GW_REQUESTS, gp.where):
            labels = dict(key[1])
            route = labels.get("route", "")
            if route in NON_INFERENCE_ROUTES or "feedback" in route:
                continue
            by[labels.get("status", "")] += value - gp.before.samples.get(key, 0.0)
        gw_by_status = {k: max(v, 0.0) for k, v in by.items()}
    elif gp is not None:
        missing.append(GW_REQUESTS)
    vllm_by_reason: dict[str, float] | None = None
    if vp is not None and vp.after.has(_family_of(REQUEST_SUCCESS)):
        vllm_by_reason = vp.delta_by(REQUEST_SUCCESS, "finished_reason")
    elif vp is not None:
        missing.append(REQUEST_SUCCESS)

    if gw_by_status is not None:
        w.requests, w.requests_source = sum(gw_by_status.values()), "gateway"
        classes: dict[str, float] = defaultdict(float)
        for status, n in gw_by_status.items():
            classes[classify_status(status)] += n
        n = w.requests
        if n > 0:
            err = classes["error"] + classes["timeout"]
            figs["error_rate"] = Figure(value=err / n, source="gateway", count=n)
            figs["timeout_rate"] = Figure(value=classes["timeout"] / n, source="gateway", count=n)
            figs["abort_rate"] = Figure(value=classes["abort"] / n, source="gateway", count=n)
    elif vllm_by_reason is not None:
        w.requests, w.requests_source = sum(vllm_by_reason.values()), "vllm"
        n = w.requests
        if n > 0:
            figs["error_rate"] = Figure(
                value=vllm_by_reason.get("error", 0.0) / n, source="vllm", count=n
            )
            figs["abort_rate"] = Figure(
                value=vllm_by_reason.get("abort", 0.0) / n, source="vllm", count=n
            )
    n_req = w.requests or 0.0
    if w.requests is not None:
        figs["request_rate"] = Figure(
            value=w.requests / duration, source=w.requests_source, count=n_req
        )
    for name in ("error_rate", "timeout_rate", "abort_rate"):
        figs.setdefault(name, _no_data("no requests in the window", count=n_req))

    for short in LATENCY_FAMILIES:
        _latency_figures(short, pairs, figs, missing, w.histograms)

    # vLLM gauges (summed over engines, KV usage: the fullest engine) and counters.
    if vp is not None:
        for fig, sample in (("waiting_requests", WAITING), ("running_requests", RUNNING)):
            end = vp.gauge(sample, how="sum")
            if end is None:
                missing.append(sample)
                figs[fig] = _no_data(f"{sample} missing")
                continue
            figs[fig] = Figure(value=end, source="vllm", count=n_req)
            if fig == "waiting_requests":
                start = vp.gauge(sample, how="sum", end=False)
                top = max(end, start) if start is not None else end
                figs["waiting_requests_max"] = Figure(value=top, source="vllm", count=n_req)
        replicas = vp.gauge(REPLICAS_GAUGE, how="sum")  # a `ray` release's fleet page
        if replicas is not None:
            figs["replicas"] = Figure(value=replicas, source="vllm", count=n_req)
        kv_name = next((k for k in KV_USAGE if vp.after.has(k)), None)
        if kv_name is None:
            missing.append(KV_USAGE[0])
        else:
            kv = vp.gauge(kv_name, how="max")
            figs["kv_cache_usage"] = Figure(value=kv, source="vllm", count=n_req)
        for fig, sample in (
            ("preemptions_per_s", PREEMPTIONS),
            ("generation_tokens_per_s", GENERATION_TOKENS),
            ("prompt_tokens_per_s", PROMPT_TOKENS),
        ):
            if not vp.after.has(_family_of(sample)):
                missing.append(sample)
                figs[fig] = _no_data(f"{sample} missing")
                continue
            figs[fig] = Figure(value=vp.delta(sample) / duration, source="vllm", count=n_req)

    # Gateway-only figures.
    if gp is not None:
        if gp.after.has(GW_IN_FLIGHT):
            figs["in_flight"] = Figure(
                value=gp.gauge(GW_IN_FLIGHT, how="sum"), source="gateway", count=n_req
            )
        if gp.after.has(_family_of(GW_REJECTIONS)):
            figs["rejections_per_s"] = Figure(
                value=gp.delta(GW_REJECTIONS) / duration, source="gateway", count=n_req
            )
        has_chunks = gp.after.has(_family_of(GW_STREAM_CHUNKS))
        if has_chunks and w.requests_source == "gateway" and n_req > 0:
            figs["chunks_per_request"] = Figure(
                value=gp.delta(GW_STREAM_CHUNKS) / n_req, source="gateway", count=n_req
            )
        if gp.after.has(_family_of(GW_FEEDBACK)):
            scores = gp.delta_by(GW_FEEDBACK, "score")
            total = sum(scores.values())
            if total > 0:
                figs["negative_feedback_rate"] = Figure(
                    value=scores.get("negative", 0.0) / total, source="gateway", count=total
                )
            else:
                figs["negative_feedback_rate"] = _no_data("no feedback in the window")
        else:
            missing.append(GW_FEEDBACK)

    # Anything still absent: say why, so a rule's evidence is readable.
    for name, info in METRICS.items():
        if name not in figs:
            scraped = [s for s in info.sources if pairs.get(s) is not None]
            figs[name] = _no_data(
                "no data from " + "/".join(info.sources)
                if scraped
                else f"{'/'.join(info.sources)} not scraped"
            )
    w.figures = figs
    w.missing = sorted(set(missing))
    return w
