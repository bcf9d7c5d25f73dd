"""Load-test statistics, with the definitions of design.md: TTFT, ITL, TPOT, E2E, throughput,
error and timeout rates, goodput under the profile's SLOs, and the knee of a sweep.

- TTFT: request sent to first content chunk.
- ITL: gap between consecutive content chunks (pooled over a point's requests).
- TPOT: (E2E - TTFT) / (output tokens - 1), per request; undefined for one output token.
- E2E: request sent to last chunk.
- Goodput: completed requests per second that met every SLO of the profile.
- Knee: the highest load point of the unbroken run from the lightest load whose SLOs hold
  in every repetition (SLO attainment >= slo.attainment and failure rate, errors plus
  timeouts, <= slo.max_error_rate) and that carries no reliability flag.

Every run of a point is cross-checked against the server's own figures (`cross_check`), and
a disagreement beyond the tolerances below is a flag, with the numbers:

- client_bound: the client's TTFT (or E2E) mean is more than max(20 %, 10 ms) above the
  mean of the server's histogram over the same window (vllm:time_to_first_token_seconds,
  vllm:e2e_request_latency_seconds `_sum`/`_count` deltas). The time went somewhere outside
  the engine, in the load client or the HTTP front end, so the point measures the client.
  The slack allows for what the engine's clock does not see (HTTP parsing, tokenising,
  detokenising, loopback): a millisecond or two when nothing queues, more under load.
- count_mismatch: the server's completed requests (vllm:request_success_total delta) and
  the client's ok count differ by more than max(1, 2 %): other traffic on the server, or
  a client that lost requests; either way the windows do not describe the same requests.
- bursty: content reached the client in fewer than 0.5 separate arrivals per output token
  over the point, or more than 10 % of its requests did so: streaming was delivered in
  bursts, so TTFT/ITL/TPOT describe the bursts, not the engine (TPOT is reported as not
  measurable).
- underfilled: in closed loop, the server's peak of vllm:num_requests_running (sampled
  during the point, at least four samples) stayed below half of min(concurrency,
  max-num-seqs): the requests the client counts as in flight were not running in the
  engine. Short points are not checked (the gauge is only as fresh as the front end's
  last pass over the engine's output).
- unverified: the server exposed no figures to check the client against.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from statistics import median
from typing import Literal

import numpy as np
from pydantic import BaseModel, Field

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


# Tolerances of the cross-check (see the module docstring).
LATENCY_REL_TOL = 0.20
LATENCY_ABS_TOL_S = 0.010
COUNT_ABS_TOL = 1
COUNT_REL_TOL = 0.02
BURST_DELIVERIES_PER_TOKEN = 0.5
BURSTY_SHARE_TOL = 0.10
UNDERFILL_FRACTION = 0.5
MIN_GAUGE_SAMPLES = 4

FlagCode = Literal["client_bound", "bursty", "count_mismatch", "underfilled", "unverified"]


class PointFlag(BaseModel):
    """A reason not to trust one run of a load point, with the numbers behind it."""

    code: FlagCode
    repetition: int | None = Field(None, description="the run it was raised on")
    message: str
    values: dict[str, float | None] = Field(default_factory=dict)


class CrossCheck(BaseModel):
    """The client's figures next to the server's own, for one window."""

    client_ttft_mean_s: float | None = None
    server_ttft_mean_s: float | None = None
    client_e2e_mean_s: float | None = None
    server_e2e_mean_s: float | None = None
    client_ok: int = 0
    server_succeeded: float | None = None
    running_peak: float | None = None
    expected_running: float | None = Field(
        None, description="min(concurrency, max-num-seqs): what the running gauge should reach"
    )
    gauge_samples: int = 0
    deliveries_per_token: float | None = Field(
        None, description="separate arrivals of content per output token (1: one per token)"
    )
    bursty_share: float | None = Field(
        None, description="share of requests (4+ tokens) delivered in bursts"
    )


class Spread(BaseModel):
    """min / median / max of one figure across the repetitions of a point."""

    n: int
    min: float | None = None
    median: float | None = None
    max: float | None = None


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
    tpot_p50_s: float | None = Field(None, description="None when not measurable (bursty)")
    check: CrossCheck | None = None
    flags: list[PointFlag] = Field(default_factory=list)


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
    slo_ok: bool = Field(description="the SLOs held in every repetition")
    tpot_measurable: bool = True
    ttft: LatencySummary
    tpot: LatencySummary
    itl: LatencySummary
    e2e: LatencySummary
    top_errors: dict[str, int] = Field(default_factory=dict)
    server: ServerDelta | None = None
    check: CrossCheck | None = None
    flags: list[PointFlag] = Field(default_factory=list)
    runs: list[RunSummary] = Field(default_factory=list)
    spread: dict[str, Spread] = Field(default_factory=dict)

    @property
    def trusted(self) -> bool:
        """No reliability flag on any repetition."""
        return not self.flags


def _mean(values: Iterable[float]) -> float | None:
    arr = list(values)
    return sum(arr) / len(arr) if arr else None


def _bursty(rec: RequestRecord) -> bool:
    return (
        rec.output_tokens >= 4 and rec.deliveries / rec.output_tokens < BURST_DELIVERIES_PER_TOKEN
    )


def _latency_gap(client: float, server: float) -> bool:
    return client - server > max(LATENCY_REL_TOL * server, LATENCY_ABS_TOL_S)


def cross_check(
    done: Sequence[RequestRecord],
    *,
    load: float,
    mode: Literal["concurrency", "rate"],
    server: ServerDelta | None,
    max_num_seqs: int | None = None,
    repetition: int | None = None,
) -> tuple[CrossCheck, list[PointFlag]]:
    """Check one window's completed requests against the server's own figures; the flags
    say where they disagree beyond the module's tolerances."""
    tokens = sum(r.output_tokens for r in done)
    deliveries = sum(r.deliveries for r in done)
    long = [r for r in done if r.output_tokens >= 4]
    check = CrossCheck(
        client_ttft_mean_s=_mean(t for r in done if (t := r.ttft_s) is not None),
        client_e2e_mean_s=_mean(t for r in done if (t := r.e2e_s) is not None),
        client_ok=len(done),
        deliveries_per_token=(deliveries / tokens) if tokens else None,
        bursty_share=(sum(1 for r in long if _bursty(r)) / len(long)) if long else None,
    )
    flags: list[PointFlag] = []

    def flag(code: FlagCode, message: str, **values: float | None) -> None:
        flags.append(PointFlag(code=code, repetition=repetition, message=message, values=values))

    dpt, share = check.deliveries_per_token, check.bursty_share
    if (dpt is not None and dpt < BURST_DELIVERIES_PER_TOKEN) or (
        share is not None and share > BURSTY_SHARE_TOL
    ):
        flag(
            "bursty",
            f"content arrived {dpt or 0:.2f} times per output token and "
            f"{(share or 0):.0%} of requests came in bursts (tolerance: "
            f"{BURST_DELIVERIES_PER_TOKEN:g} per token, {BURSTY_SHARE_TOL:.0%} of requests): "
            "streaming was delivered in bursts, TPOT and ITL are not measurable",
            deliveries_per_token=dpt,
            bursty_share=share,
        )
    if server is None:
        flag("unverified", "the server exposed no /metrics to check the client against")
        return check, flags
    ttft_w, e2e_w = server.histograms.get("ttft"), server.histograms.get("e2e")
    check.server_ttft_mean_s = ttft_w.mean_s if ttft_w is not None else None
    check.server_e2e_mean_s = e2e_w.mean_s if e2e_w is not None else None
    check.server_succeeded = server.requests_succeeded
    check.running_peak = server.running_peak
    check.gauge_samples = server.gauge_samples
    if mode == "concurrency":
        check.expected_running = float(min(load, max_num_seqs) if max_num_seqs else load)
    lacking = [
        name
        for name, v in (
            ("vllm:time_to_first_token_seconds", ttft_w),
            ("vllm:e2e_request_latency_seconds", e2e_w),
            ("vllm:request_success_total", server.requests_succeeded),
        )
        if v is None
    ]
    if lacking:
        flag("unverified", f"the server did not expose {', '.join(lacking)}")
    for what, c, s in (
        ("TTFT", check.client_ttft_mean_s, check.server_ttft_mean_s),
        ("E2E", check.client_e2e_mean_s, check.server_e2e_mean_s),
    ):
        if c is not None and s is not None and _latency_gap(c, s):
            flag(
                "client_bound",
                f"client {what} mean {c * 1000:.1f} ms is {(c - s) * 1000:.1f} ms above the "
                f"server's {s * 1000:.1f} ms (tolerance: max({LATENCY_REL_TOL:.0%}, "
                f"{LATENCY_ABS_TOL_S * 1000:g} ms)): requests waited outside the engine, in "
                "the load client or the HTTP front end",
                **{f"client_{what.lower()}_mean_s": c, f"server_{what.lower()}_mean_s": s},
            )
    succ = server.requests_succeeded
    if succ is not None and abs(succ - len(done)) > max(COUNT_ABS_TOL, COUNT_REL_TOL * len(done)):
        flag(
            "count_mismatch",
            f"the server completed {succ:g} requests in the window, the client {len(done)} "
            f"(tolerance: max({COUNT_ABS_TOL}, {COUNT_REL_TOL:.0%})): the server's figures "
            "describe other requests too, or the client lost some",
            server_succeeded=succ,
            client_ok=float(len(done)),
        )
    exp, peak = check.expected_running, server.running_peak
    if (
        exp is not None
        and peak is not None
        and server.gauge_samples >= MIN_GAUGE_SAMPLES
        and peak < UNDERFILL_FRACTION * exp
    ):
        flag(
            "underfilled",
            f"the server ran at most {peak:g} requests at once where min(concurrency, "
            f"max-num-seqs) is {exp:g} (tolerance: {UNDERFILL_FRACTION:.0%} of it, over "
            f"{server.gauge_samples} samples): requests the client counted as in flight "
            "were not running in the engine (held in the client or the HTTP front end)",
            running_peak=peak,
            expected_running=exp,
        )
    return check, flags


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
) -> PointResult:
    """Compute one run's statistics from its (non-warm-up) request records, cross-checked
    against the server's delta over the same window."""
    recs = [r for r in records if not r.warmup]
    n = len(recs)
    done = [r for r in recs if r.status == "ok"]
    errors = sum(1 for r in recs if r.status == "error")
    timeouts = sum(1 for r in recs if r.status == "timeout")
    good = sum(1 for r in recs if meets_slo(r, slo))
    out_tokens = sum(r.output_tokens for r in done)
    chunks = sum(len(r.chunk_s) for r in done)
    dur = max(duration_s, 1e-9)
    error_rate = errors / n if n else 0.0
    timeout_rate = timeouts / n if n else 0.0
    attainment = good / n if n else 0.0
    server_rate: float | None = None
    if server is not None and server.generation_tokens is not None:
        server_rate = server.generation_tokens / dur
    prompt_tokens = [r.prompt_tokens for r in done if r.prompt_tokens is not None]
    failures = Counter(r.error or r.status for r in recs if r.status != "ok")
    check, flags = cross_check(
        done, load=load, mode=mode, server=server, max_num_seqs=max_num_seqs, repetition=repetition
    )
    measurable = not any(f.code == "bursty" for f in flags)
    steady = [r for r in done if not _bursty(r)]
    slo_ok = bool(
        n > 0 and attainment >= slo.attainment and error_rate + timeout_rate <= slo.max_error_rate
    )
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
        client_cpu_share=(client_cpu_s / dur) if client_cpu_s is not None else None,
        goodput=good / dur,
        slo_attainment=attainment,
        slo_ok=slo_ok,
        tpot_measurable=measurable,
        ttft=summarize(t for r in done if (t := r.ttft_s) is not None),
        # A request delivered in a burst has no measurable TPOT or ITL, even on a point
        # that is not flagged as a whole: leave it out rather than report microseconds.
        tpot=summarize(t for r in steady if (t := r.tpot_s) is not None)
        if measurable
        else LatencySummary(),
        itl=summarize(g for r in steady for g in r.itl_s) if measurable else LatencySummary(),
        e2e=summarize(t for r in done if (t := r.e2e_s) is not None),
        top_errors=dict(failures.most_common(5)),
        server=server,
        check=check,
        flags=flags,
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
        check=p.check,
        flags=p.flags,
    )


def spread(values: Sequence[float | None]) -> Spread:
    """min / median / max of the present values."""
    present = [v for v in values if v is not None]
    if not present:
        return Spread(n=0)
    return Spread(n=len(present), min=min(present), median=median(present), max=max(present))


def combine_runs(
    runs: Sequence[PointResult],
    records: Sequence[RequestRecord],
    *,
    slo: SLO,
    max_num_seqs: int | None = None,
) -> PointResult:
    """Pool the repetitions of one load point: statistics over every run's requests and the
    merged server window; the SLOs hold only if they held in every run; flags are every
    run's flags; `spread` gives min/median/max of the key figures across runs."""
    if not runs:
        raise ValueError("combine_runs needs at least one run")
    if len(runs) == 1:
        only = runs[0]
        only.spread = {k: spread([getattr(only.runs[0], k)]) for k in SPREAD_KEYS}
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
    summaries = [s for r in runs for s in r.runs]
    measurable = all(r.tpot_measurable for r in runs)
    pooled.repetitions = len(runs)
    pooled.slo_ok = all(r.slo_ok for r in runs)
    pooled.flags = [f for r in runs for f in r.flags]
    pooled.runs = summaries
    pooled.spread = {k: spread([getattr(s, k) for s in summaries]) for k in SPREAD_KEYS}
    if not measurable:
        pooled.tpot_measurable = False
        pooled.tpot = LatencySummary()
        pooled.itl = LatencySummary()
    return pooled


def _holds(slo_ok: bool, flags: Sequence[PointFlag]) -> bool:
    return slo_ok and not flags


def find_knee(points: Sequence[PointResult]) -> PointResult | None:
    """The knee: the highest load whose SLOs hold in every repetition and that carries no
    reliability flag, with every lower load doing the same.

    Counting only the unbroken run from the lightest load keeps a lucky point past a
    broken or untrusted one (noise on a shared machine) from being reported as capacity.
    """
    knee: PointResult | None = None
    for p in sorted(points, key=lambda p: p.load):
        if not _holds(p.slo_ok, p.flags):
            break
        knee = p
    return knee


def knee_stop(points: Sequence[PointResult]) -> str | None:
    """Why the knee is where it is: the first point past it and what stopped the run
    (None when every point holds)."""
    for p in sorted(points, key=lambda p: p.load):
        if _holds(p.slo_ok, p.flags):
            continue
        where = f"{p.load:g}"
        if p.flags:
            codes = sorted({f.code for f in p.flags})
            return f"load {where} is not trusted ({', '.join(codes)})"
        broken = [s.repetition for s in p.runs if not s.slo_ok]
        if p.repetitions > 1:
            return f"load {where} broke its SLOs in repetition(s) {', '.join(map(str, broken))}"
        return f"load {where} broke its SLOs"
    return None


def knees_by_repetition(points: Sequence[PointResult]) -> list[float | None]:
    """The knee each repetition of the sweep would give on its own."""
    reps = max((len(p.runs) for p in points), default=0)
    out: list[float | None] = []
    for i in range(reps):
        knee: float | None = None
        for p in sorted(points, key=lambda p: p.load):
            run = next((s for s in p.runs if s.repetition == i), None)
            if run is None or not _holds(run.slo_ok, run.flags):
                break
            knee = p.load
        out.append(knee)
    return out


def knee_is_stable(points: Sequence[PointResult], knee: PointResult | None) -> bool:
    """True when at least two repetitions ran and each, on its own, gives the same knee."""
    per = knees_by_repetition(points)
    target = knee.load if knee is not None else None
    return len(per) >= 2 and all(k == target for k in per)
