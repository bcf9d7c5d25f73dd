"""Load-test statistics, with the definitions of design.md: TTFT, ITL, TPOT, E2E, throughput,
error and timeout rates, goodput under the profile's SLOs, and the knee of a sweep.

- TTFT: request sent to first content chunk.
- ITL: gap between consecutive content chunks (pooled over a point's requests).
- TPOT: (E2E - TTFT) / (output tokens - 1), per request; undefined for one output token.
- E2E: request sent to last chunk.
- Goodput: completed requests per second that met every SLO of the profile.
- Knee: the highest load point whose SLOs hold (SLO attainment >= slo.attainment and
  failure rate, errors plus timeouts, <= slo.max_error_rate).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Literal

import numpy as np
from pydantic import BaseModel, Field

from releasekit.bench.loadgen import RequestRecord
from releasekit.bench.scrape import ServerDelta
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


class PointResult(BaseModel):
    """Everything measured at one load point of a sweep."""

    load: float = Field(description="concurrency (closed loop) or arrival rate in req/s")
    mode: Literal["concurrency", "rate"]
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
        None, description="server: vllm:generation_tokens_total delta over the same interval"
    )
    token_rate_ratio: float | None = Field(
        None, description="client output tok/s divided by server generation tok/s"
    )
    output_tokens: int = 0
    prompt_tokens_mean: float | None = None
    chunks_per_token: float | None = Field(
        None,
        description="content chunks / output tokens; below 1 the server merged tokens "
        "into fewer chunks (a slow reader)",
    )
    client_cpu_share: float | None = Field(
        None, description="CPU seconds the client used per wall second during the point"
    )
    goodput: float = Field(description="requests per second that met every SLO")
    slo_attainment: float = Field(description="share of sent requests that met every SLO")
    slo_ok: bool
    ttft: LatencySummary
    tpot: LatencySummary
    itl: LatencySummary
    e2e: LatencySummary
    top_errors: dict[str, int] = Field(default_factory=dict)
    server: ServerDelta | None = None


def point_result(
    records: Sequence[RequestRecord],
    *,
    load: float,
    mode: Literal["concurrency", "rate"],
    duration_s: float,
    slo: SLO,
    server: ServerDelta | None = None,
    client_cpu_s: float | None = None,
) -> PointResult:
    """Compute one point's statistics from its (non-warm-up) request records."""
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
    client_rate = out_tokens / dur
    server_rate: float | None = None
    if server is not None and server.generation_tokens is not None:
        server_rate = server.generation_tokens / dur
    prompt_tokens = [r.prompt_tokens for r in done if r.prompt_tokens is not None]
    failures = Counter(r.error or r.status for r in recs if r.status != "ok")
    return PointResult(
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
        output_token_throughput=client_rate,
        server_generation_tokens_per_s=server_rate,
        token_rate_ratio=(client_rate / server_rate) if server_rate else None,
        output_tokens=out_tokens,
        prompt_tokens_mean=float(np.mean(prompt_tokens)) if prompt_tokens else None,
        chunks_per_token=(chunks / out_tokens) if out_tokens else None,
        client_cpu_share=(client_cpu_s / dur) if client_cpu_s is not None else None,
        goodput=good / dur,
        slo_attainment=attainment,
        slo_ok=bool(
            n > 0
            and attainment >= slo.attainment
            and error_rate + timeout_rate <= slo.max_error_rate
        ),
        ttft=summarize(t for r in done if (t := r.ttft_s) is not None),
        tpot=summarize(t for r in done if (t := r.tpot_s) is not None),
        itl=summarize(g for r in done for g in r.itl_s),
        e2e=summarize(t for r in done if (t := r.e2e_s) is not None),
        top_errors=dict(failures.most_common(5)),
        server=server,
    )


def find_knee(points: Sequence[PointResult]) -> PointResult | None:
    """The knee: the highest load whose SLOs hold with every lower load holding too.

    Counting only the unbroken run from the lightest load keeps a lucky point past a
    broken one (noise on a shared machine) from being reported as capacity.
    """
    knee: PointResult | None = None
    for p in sorted(points, key=lambda p: p.load):
        if not p.slo_ok:
            break
        knee = p
    return knee
