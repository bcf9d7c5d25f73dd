"""Load-test statistics, with the definitions of design.md: TTFT, ITL, TPOT, E2E, throughput,
error and timeout rates, goodput under the profile's SLOs, and the knee of a sweep.

- TTFT: request sent to first content chunk.
- ITL: gap between consecutive content chunks (pooled over a point's requests).
- TPOT: (E2E - TTFT) / (output tokens - 1), per request; undefined for one output token.
- E2E: request sent to last chunk.
- Goodput: completed requests per second that met every SLO of the profile.
- Knee: the highest load point of the unbroken run from the lightest load that *holds*: its
  SLOs hold (SLO attainment >= slo.attainment, failure rate <= slo.max_error_rate) with no
  reliability flag in at least `sweep.knee_share` of its repetitions (2 of 3 by default).

How far the client's figures can be trusted (the server's own figures beside them,
flags and findings) is the cross-check's: see `crosscheck`.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from statistics import median
from typing import Literal

import numpy as np
from pydantic import BaseModel, Field, computed_field

from releasekit.bench.crosscheck import (
    CrossCheck,
    PointFlag,
    bursty_request,
    cross_check,
)
from releasekit.bench.loadgen import RequestRecord
from releasekit.bench.scrape import ServerDelta, merge_deltas
from releasekit.spec.loadprofile import SLO

PERCENTILES: tuple[int, ...] = (50, 90, 95, 99)


class LatencySummary(BaseModel):
    """Percentiles and mean of one latency metric, in seconds (None when no data)."""

    n: int = 0
    p50: float | None = None
    p90: float | None = None
    p95: float | None = None
    p99: float | None = None
    mean: float | None = None


def summarize(values: Iterable[float]) -> LatencySummary:
    """p50/p90/p95/p99 (numpy's linear interpolation) and mean of a sample."""
    arr = np.fromiter(values, dtype=float)
    if arr.size == 0:
        return LatencySummary()
    p50, p90, p95, p99 = (float(v) for v in np.percentile(arr, PERCENTILES))
    return LatencySummary(
        n=int(arr.size), p50=p50, p90=p90, p95=p95, p99=p99, mean=float(arr.mean())
    )


def meets_slo(rec: RequestRecord, slo: SLO) -> bool:
    """A request is good when it completed and met every SLO the profile sets. TPOT is not
    defined for a one-token answer, so a TPOT SLO does not apply to one."""
    if rec.status != "ok":
        return False
    ttft, e2e, tpot = rec.ttft_s, rec.e2e_s, rec.tpot_s
    if slo.ttft_s is not None and (ttft is None or ttft > slo.ttft_s):
        return False
    if slo.e2e_s is not None and (e2e is None or e2e > slo.e2e_s):
        return False
    return not (slo.tpot_s is not None and tpot is not None and tpot > slo.tpot_s)


TpotSource = Literal["client", "engine", "none"]


class Spread(BaseModel):
    """min / median / max of one figure across the repetitions of a point, and the range
    left once the single most extreme run on each side is set aside (five runs or more)."""

    n: int
    min: float | None = None
    median: float | None = None
    max: float | None = None
    trimmed_min: float | None = Field(
        None, description="second lowest run (five runs or more): one outlying run set aside"
    )
    trimmed_max: float | None = Field(
        None, description="second highest run (five runs or more): one outlying run set aside"
    )

    def relative(self) -> float:
        """(max - min) / median, over the trimmed range where there is one (0 with fewer
        than two values): how far the runs disagree, one stray run on each side set aside
        once five or more ran."""
        lo = self.trimmed_min if self.trimmed_min is not None else self.min
        hi = self.trimmed_max if self.trimmed_max is not None else self.max
        if self.n < 2 or lo is None or hi is None or not self.median:
            return 0.0
        return (hi - lo) / abs(self.median)


TRIM_FROM_RUNS = 5
"""From this many runs, a point's spread sets aside its most extreme run on each side: one
stall of a shared host does not make the whole point unjudgeable."""

NOISE_KEYS: tuple[str, ...] = ("ttft_p95_s", "goodput")
"""The figures gates compare at the knee by default; a point whose runs disagree on one of
them beyond the profile's `settle_spread` runs again (`sweep.extra_runs`)."""


class RunSummary(BaseModel):
    """One repetition of a load point: its key figures, cross-check and flags."""

    repetition: int
    n: int
    ok: int
    duration_s: float
    request_throughput: float
    output_token_throughput: float
    goodput: float
    slo_attainment: float
    slo_ok: bool
    ttft_mean_s: float | None = None
    ttft_p50_s: float | None = None
    ttft_p95_s: float | None = None
    e2e_mean_s: float | None = None
    e2e_p95_s: float | None = None
    tpot_p50_s: float | None = Field(None, description="None when not measurable")
    tpot_p95_s: float | None = None
    tpot_source: TpotSource = "client"
    holds: bool = Field(False, description="SLOs held and no flag")
    check: CrossCheck | None = None
    flags: list[PointFlag] = Field(default_factory=list)
    findings: list[PointFlag] = Field(default_factory=list)


SPREAD_KEYS: tuple[str, ...] = (
    "output_token_throughput",
    "request_throughput",
    "goodput",
    "slo_attainment",
    "ttft_mean_s",
    "ttft_p95_s",
    "e2e_mean_s",
    "e2e_p95_s",
    "tpot_p50_s",
    "tpot_p95_s",
)


class PointResult(BaseModel):
    """Everything measured at one load point of a sweep, pooled over its repetitions; `runs`
    holds each repetition, `spread` their min/median/max, `flags` every run's flags."""

    load: float = Field(description="concurrency (closed loop) or arrival rate in req/s")
    mode: Literal["concurrency", "rate"]
    repetitions: int = 1
    n: int = Field(description="requests sent (warm-up excluded)")
    ok: int
    errors: int
    timeouts: int
    error_rate: float
    timeout_rate: float
    duration_s: float = Field(description="first request sent to last request finished")
    request_throughput: float = Field(description="completed requests per second")
    output_token_throughput: float = Field(
        description="client: output tokens of completed requests per second"
    )
    server_generation_tokens_per_s: float | None = Field(
        None,
        description="server: vllm:generation_tokens_total delta over the same interval "
        "(informative only: both sides count the server's tokens)",
    )
    output_tokens: int = 0
    prompt_tokens_mean: float | None = None
    chunks_per_token: float | None = Field(
        None, description="content events / output tokens; below 1 the server merged tokens"
    )
    deliveries_per_token: float | None = Field(
        None, description="separate arrivals of content / output tokens; low = bursts"
    )
    client_cpu_s: float | None = Field(None, description="CPU seconds the client used")
    client_cpu_share: float | None = Field(
        None, description="CPU seconds the client used per wall second during the point"
    )
    goodput: float = Field(description="requests per second that met every SLO")
    slo_attainment: float = Field(description="share of sent requests that met every SLO")
    slo_ok: bool = Field(description="the SLOs held in the stated share of repetitions")
    holds: bool = Field(
        False,
        description="SLOs held with no flag in at least `knee_share` of the repetitions",
    )
    runs_holding: int = Field(0, description="repetitions whose SLOs held with no flag")
    knee_share: float = Field(1.0, description="share of repetitions that must hold")
    tpot_measurable: bool = True
    tpot_source: TpotSource = Field(
        "client",
        description="where TPOT and ITL come from: the client's chunks, or the engine's "
        "histograms when the stream reached the client in bursts",
    )
    ttft: LatencySummary
    tpot: LatencySummary
    itl: LatencySummary
    e2e: LatencySummary
    top_errors: dict[str, int] = Field(default_factory=dict)
    server: ServerDelta | None = None
    check: CrossCheck | None = None
    flags: list[PointFlag] = Field(
        default_factory=list, description="every repetition's reliability flags"
    )
    findings: list[PointFlag] = Field(
        default_factory=list, description="every repetition's findings (bursty, underfilled)"
    )
    runs: list[RunSummary] = Field(default_factory=list)
    spread: dict[str, Spread] = Field(default_factory=dict)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def trusted(self) -> bool:
        """Enough repetitions carry no reliability flag (the knee rule's share): the point
        passed the cross-check."""
        if not self.runs:
            return not self.flags
        need = runs_needed(len(self.runs), self.knee_share)
        return sum(1 for r in self.runs if not r.flags) >= need


def runs_needed(repetitions: int, share: float) -> int:
    """How many of `repetitions` runs must hold for a point to hold (at least one)."""
    return max(1, math.ceil(share * repetitions - 1e-9))


def _engine_summary(server: ServerDelta | None, short: str) -> LatencySummary:
    """A latency summary from one of the engine's histogram windows (empty without one)."""
    w = server.histograms.get(short) if server is not None else None
    if w is None or w.count <= 0:
        return LatencySummary()
    return LatencySummary(n=int(w.count), p50=w.p50, p90=w.p90, p95=w.p95, p99=w.p99, mean=w.mean_s)


def _engine_tpot_ok(tpot: LatencySummary, slo: SLO) -> bool:
    """The TPOT SLO judged on the engine's figures: its windowed quantile at the attainment
    the profile asks for (p90 for 0.9, p95 for 0.95) within the SLO."""
    if slo.tpot_s is None:
        return True
    q = tpot.p95 if slo.attainment > 0.9 else tpot.p90
    return q is not None and q <= slo.tpot_s


def point_result(
    records: Sequence[RequestRecord],
    *,
    load: float,
    mode: Literal["concurrency", "rate"],
    duration_s: float,
    slo: SLO,
    server: ServerDelta | None = None,
    client_cpu_s: float | None = None,
    max_num_seqs: int | None = None,
    repetition: int = 0,
    client_lag_s: Sequence[float] = (),
    client_delay_s: float | None = None,
) -> PointResult:
    """Compute one run's statistics from its (non-warm-up) request records, cross-checked
    against the client's own lag and the server's delta over the same window."""
    recs = [r for r in records if not r.warmup]
    n = len(recs)
    done = [r for r in recs if r.status == "ok"]
    errors = sum(1 for r in recs if r.status == "error")
    timeouts = sum(1 for r in recs if r.status == "timeout")
    out_tokens = sum(r.output_tokens for r in done)
    chunks = sum(len(r.chunk_s) for r in done)
    dur = max(duration_s, 1e-9)
    error_rate = errors / n if n else 0.0
    timeout_rate = timeouts / n if n else 0.0
    server_rate: float | None = None
    if server is not None and server.generation_tokens is not None:
        server_rate = server.generation_tokens / dur
    prompt_tokens = [r.prompt_tokens for r in done if r.prompt_tokens is not None]
    failures = Counter(r.error or r.status for r in recs if r.status != "ok")
    cpu_share = (client_cpu_s / dur) if client_cpu_s is not None else None
    check, flags, findings = cross_check(
        done,
        load=load,
        mode=mode,
        server=server,
        max_num_seqs=max_num_seqs,
        repetition=repetition,
        client_lag_s=client_lag_s,
        client_delay_s=client_delay_s,
        client_cpu_share=cpu_share,
    )
    bursty = any(f.code == "bursty" for f in findings)
    source: TpotSource = "client"
    tpot, itl = LatencySummary(), LatencySummary()
    if not bursty:
        steady = [r for r in done if not bursty_request(r)]
        # A request delivered in a burst has no measurable TPOT or ITL, even on a point
        # that is not bursty as a whole: leave it out rather than report microseconds.
        tpot = summarize(t for r in steady if (t := r.tpot_s) is not None)
        itl = summarize(g for r in steady for g in r.itl_s)
    else:
        tpot, itl = _engine_summary(server, "tpot"), _engine_summary(server, "itl")
        source = "engine" if tpot.n else "none"
    # Per request: TTFT and E2E as the client saw them (front end included); TPOT only where
    # the client could see it. Bursty: the engine's TPOT is judged for the point instead.
    judge_slo = slo if not bursty else slo.model_copy(update={"tpot_s": None})
    good = sum(1 for r in recs if meets_slo(r, judge_slo))
    attainment = good / n if n else 0.0
    slo_ok = bool(
        n > 0 and attainment >= slo.attainment and error_rate + timeout_rate <= slo.max_error_rate
    )
    if bursty:
        slo_ok = slo_ok and _engine_tpot_ok(tpot, slo)
    result = PointResult(
        load=load,
        mode=mode,
        n=n,
        ok=len(done),
        errors=errors,
        timeouts=timeouts,
        error_rate=error_rate,
        timeout_rate=timeout_rate,
        duration_s=duration_s,
        request_throughput=len(done) / dur,
        output_token_throughput=out_tokens / dur,
        server_generation_tokens_per_s=server_rate,
        output_tokens=out_tokens,
        prompt_tokens_mean=float(np.mean(prompt_tokens)) if prompt_tokens else None,
        chunks_per_token=(chunks / out_tokens) if out_tokens else None,
        deliveries_per_token=check.deliveries_per_token,
        client_cpu_s=client_cpu_s,
        client_cpu_share=cpu_share,
        goodput=good / dur,
        slo_attainment=attainment,
        slo_ok=slo_ok,
        holds=slo_ok and not flags,
        runs_holding=int(slo_ok and not flags),
        tpot_measurable=source != "none",
        tpot_source=source,
        ttft=summarize(t for r in done if (t := r.ttft_s) is not None),
        tpot=tpot,
        itl=itl,
        e2e=summarize(t for r in done if (t := r.e2e_s) is not None),
        top_errors=dict(failures.most_common(5)),
        server=server,
        check=check,
        flags=flags,
        findings=findings,
    )
    result.runs = [run_summary(result, repetition)]
    return result


def run_summary(p: PointResult, repetition: int) -> RunSummary:
    """The key figures of a one-run PointResult."""
    return RunSummary(
        repetition=repetition,
        n=p.n,
        ok=p.ok,
        duration_s=p.duration_s,
        request_throughput=p.request_throughput,
        output_token_throughput=p.output_token_throughput,
        goodput=p.goodput,
        slo_attainment=p.slo_attainment,
        slo_ok=p.slo_ok,
        ttft_mean_s=p.ttft.mean,
        ttft_p50_s=p.ttft.p50,
        ttft_p95_s=p.ttft.p95,
        e2e_mean_s=p.e2e.mean,
        e2e_p95_s=p.e2e.p95,
        tpot_p50_s=p.tpot.p50 if p.tpot_measurable else None,
        tpot_p95_s=p.tpot.p95 if p.tpot_measurable else None,
        tpot_source=p.tpot_source,
        holds=p.slo_ok and not p.flags,
        check=p.check,
        flags=p.flags,
        findings=p.findings,
    )


def spread(values: Sequence[float | None]) -> Spread:
    """min / median / max of the present values."""
    present = sorted(v for v in values if v is not None)
    if not present:
        return Spread(n=0)
    trim = len(present) >= TRIM_FROM_RUNS
    return Spread(
        n=len(present),
        min=present[0],
        median=median(present),
        max=present[-1],
        trimmed_min=present[1] if trim else None,
        trimmed_max=present[-2] if trim else None,
    )


def noisy_keys(p: PointResult, limit: float) -> list[str]:
    """The figures of NOISE_KEYS on which the point's runs disagree by more than `limit`
    (relative spread, `Spread.relative`)."""
    return [k for k in NOISE_KEYS if k in p.spread and p.spread[k].relative() > limit]


def combine_runs(
    runs: Sequence[PointResult],
    records: Sequence[RequestRecord],
    *,
    slo: SLO,
    max_num_seqs: int | None = None,
    knee_share: float = 1.0,
) -> PointResult:
    """Pool the repetitions of one load point: statistics over every run's requests and the
    merged server window; the point holds when at least `knee_share` of its runs held their
    SLOs with no flag (each run judged alone); flags and findings are every run's;
    `spread` gives min/median/max of the key figures across runs."""
    if not runs:
        raise ValueError("combine_runs needs at least one run")
    summaries = [s for r in runs for s in r.runs]
    holding = sum(1 for s in summaries if s.holds)
    need = runs_needed(len(summaries), knee_share)
    if len(runs) == 1:
        only = runs[0]
        only.spread = {k: spread([getattr(only.runs[0], k)]) for k in SPREAD_KEYS}
        only.knee_share = knee_share
        only.runs_holding = holding
        only.holds = holding >= need
        return only
    first = runs[0]
    servers = [r.server for r in runs]
    merged = merge_deltas([s for s in servers if s is not None]) if all(servers) else None
    cpu = [r.client_cpu_s for r in runs]
    pooled = point_result(
        records,
        load=first.load,
        mode=first.mode,
        duration_s=sum(r.duration_s for r in runs),
        slo=slo,
        server=merged,
        client_cpu_s=sum(c for c in cpu if c is not None)
        if all(c is not None for c in cpu)
        else None,
        max_num_seqs=max_num_seqs,
    )
    lag = [
        v
        for r in runs
        if r.check is not None and r.check.client_lag_p95_s is not None
        for v in (r.check.client_lag_p95_s,)
    ]
    if pooled.check is not None and lag:
        # The pooled window keeps the worst run's client lag (the samples are per run).
        pooled.check.client_lag_p95_s = max(lag)
        pooled.check.client_lag_max_s = max(
            (r.check.client_lag_max_s or 0.0) for r in runs if r.check is not None
        )
        pooled.check.client_lag_samples = sum(
            r.check.client_lag_samples for r in runs if r.check is not None
        )
        delays = [
            (r.check.client_delay_mean_s, r.duration_s)
            for r in runs
            if r.check is not None and r.check.client_delay_mean_s is not None
        ]
        if delays:  # time-weighted over the runs
            total = sum(d for _, d in delays) or 1.0
            pooled.check.client_delay_mean_s = sum(v * d for v, d in delays) / total
    pooled.repetitions = len(runs)
    pooled.knee_share = knee_share
    pooled.runs_holding = holding
    pooled.holds = holding >= need
    pooled.slo_ok = sum(1 for s in summaries if s.slo_ok) >= need
    pooled.flags = [f for r in runs for f in r.flags]
    pooled.findings = [f for r in runs for f in r.findings]
    pooled.runs = summaries
    pooled.spread = {k: spread([getattr(s, k) for s in summaries]) for k in SPREAD_KEYS}
    if any(r.tpot_source != "client" for r in runs) and pooled.tpot_source == "client":
        # Some runs were bursty: report the engine's TPOT for the whole point, consistently.
        pooled.tpot = _engine_summary(merged, "tpot")
        pooled.itl = _engine_summary(merged, "itl")
        pooled.tpot_source = "engine" if pooled.tpot.n else "none"
        pooled.tpot_measurable = pooled.tpot_source != "none"
    return pooled


def find_knee(points: Sequence[PointResult]) -> PointResult | None:
    """The knee: the highest load of the unbroken run from the lightest load in which every
    point holds (SLOs held with no flag in at least the rule's share of its repetitions).

    Counting only the unbroken run from the lightest load keeps a lucky point past a
    broken or untrusted one (noise on a shared machine) from being reported as capacity.
    """
    knee: PointResult | None = None
    for p in sorted(points, key=lambda p: p.load):
        if not p.holds:
            break
        knee = p
    return knee


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f} ms"


def _why_run_failed(run: RunSummary, slo: SLO | None) -> str:
    if run.flags:
        return "flagged " + ", ".join(sorted({f.code for f in run.flags}))
    if slo is None:
        return "SLOs broken"
    bits = [f"attainment {run.slo_attainment:.0%} < {slo.attainment:.0%}"]
    if slo.ttft_s is not None and run.ttft_p95_s is not None and run.ttft_p95_s > slo.ttft_s:
        bits.append(f"TTFT p95 {_ms(run.ttft_p95_s)} > {_ms(slo.ttft_s)}")
    if slo.tpot_s is not None and run.tpot_p95_s is not None and run.tpot_p95_s > slo.tpot_s:
        bits.append(f"TPOT p95 ({run.tpot_source}) {_ms(run.tpot_p95_s)} > {_ms(slo.tpot_s)}")
    if run.n and run.ok < run.n:
        bits.append(f"{run.n - run.ok} of {run.n} failed")
    return "; ".join(bits)


def knee_stop(points: Sequence[PointResult], slo: SLO | None = None) -> str | None:
    """Why the knee is where it is: the first point past it, how many of its runs held
    against how many the rule needs, and what broke each run that did not, with the
    numbers (None when every point holds)."""
    for p in sorted(points, key=lambda p: p.load):
        if p.holds:
            continue
        reps = len(p.runs) or 1
        need = runs_needed(reps, p.knee_share)
        failed = [
            f"run {s.repetition + 1}: {_why_run_failed(s, slo)}" for s in p.runs if not s.holds
        ]
        return (
            f"load {p.load:g} held in {p.runs_holding} of {reps} runs (the rule needs {need})"
            + (f": {'; '.join(failed)}" if failed else "")
        )
    return None


def knees_by_repetition(
    points: Sequence[PointResult], repetitions: int | None = None
) -> list[float | None]:
    """The knee each of the sweep's `repetitions` (default: as many as every point ran)
    would give on its own; a point's extra runs, made where its repetitions disagreed, are
    not repetitions of the sweep."""
    reps = min((len(p.runs) for p in points), default=0)
    if repetitions is not None:
        reps = min(reps, repetitions)
    out: list[float | None] = []
    for i in range(reps):
        knee: float | None = None
        for p in sorted(points, key=lambda p: p.load):
            run = next((s for s in p.runs if s.repetition == i), None)
            if run is None or not run.holds:
                break
            knee = p.load
        out.append(knee)
    return out


def knee_is_stable(
    points: Sequence[PointResult],
    knee: PointResult | None,
    share: float = 1.0,
    repetitions: int | None = None,
) -> bool:
    """True when at least two repetitions ran and at least `share` of them, each on its own,
    give the same knee as the rule (with the default share 1: every one)."""
    per = knees_by_repetition(points, repetitions)
    target = knee.load if knee is not None else None
    if len(per) < 2:
        return False
    return sum(1 for k in per if k == target) >= runs_needed(len(per), share)
