"""Cross-checking a load window: the client's figures against its own lag and the server's.

The flags that make a run untrusted and the findings about the server come from here.

Where the time of a request goes (`CrossCheck`): the load client, the server's front end
(vLLM's API server: HTTP, tokenising, detokenising, SSE) and the engine (queue, prefill,
decode). Each is measured on its own side, never by subtracting one from another:

- the client measures itself: the lag of its own event loop (how late a periodic timer ran:
  every chunk it records is late by at most that much; `loadgen.LoopLag`), turned into the
  delay its stalls added to a random moment of the window, and its CPU share;
- the engine's figures come from vLLM's histograms (`vllm:time_to_first_token_seconds`,
  queue and prefill time, `_sum`/`_count` deltas over the same window);
- vLLM's API server also times whole requests at the HTTP level (prometheus-fastapi-
  instrumentator's `http_request_duration_seconds` for the OpenAI routes, front end
  included): the client's E2E should match it within the loopback and the client's lag.

The gap between the client's TTFT and the engine's is then the front end's share, reported
as its own segment (TTFT = front end + queue + prefill) and counted in the SLOs: every user
of the server waits for it.

Flags (a run with one does not count towards its point holding):

- client_bound: the load client itself fell behind: its own stalls added more than
  max(5 ms, 10 % of the TTFT mean it measured) to a random moment of the window, or its
  E2E mean is more than max(20 %, 10 ms) above the server's own HTTP-level E2E.
- count_mismatch: the server's completed requests (vllm:request_success_total delta) and
  the client's ok count differ by more than max(1, 2 %): other traffic on the server, or
  a client that lost requests; either way the windows do not describe the same requests.
- unverified: the server exposed no figures to check the client against.

Findings (reported with the numbers, not a reason to distrust the point):

- bursty: content reached the client in fewer than 0.5 separate arrivals per output token,
  or more than 10 % of requests did so: the front end merged tokens (the "streaming
  stutters" row of diagnose). The client's TPOT and ITL then describe bursts, so TPOT and
  ITL come from the engine's own histograms (`vllm:request_time_per_output_token_seconds`,
  `vllm:inter_token_latency_seconds`), labelled `engine`, and the TPOT SLO is judged on
  them. Without server figures either, TPOT is not measurable at all.
- underfilled: in closed loop, the server's peak of vllm:num_requests_running (at least four
  gauge samples) stayed below half of min(concurrency, max-num-seqs): requests waited in
  the front end before the engine saw them (their time is in the front-end segment).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal

import numpy as np
from pydantic import BaseModel, Field

from releasekit.bench.loadgen import RequestRecord
from releasekit.bench.scrape import ServerDelta

# Tolerances of the cross-check (see the module docstring).
LATENCY_REL_TOL = 0.20
LATENCY_ABS_TOL_S = 0.010
COUNT_ABS_TOL = 1
COUNT_REL_TOL = 0.02
BURST_DELIVERIES_PER_TOKEN = 0.5
BURSTY_SHARE_TOL = 0.10
UNDERFILL_FRACTION = 0.5
MIN_GAUGE_SAMPLES = 4

# The client's own lag: the delay its stalls added to a random moment, against this floor
# or this share of the TTFT mean the client measured, whichever is larger.
CLIENT_LAG_ABS_TOL_S = 0.005
CLIENT_LAG_REL_TOL = 0.10

FlagCode = Literal["client_bound", "bursty", "count_mismatch", "underfilled", "unverified"]
FLAG_CODES: frozenset[str] = frozenset({"client_bound", "count_mismatch", "unverified"})
"""Codes that make a run untrusted; the others are findings."""


class PointFlag(BaseModel):
    """A reason not to trust one run of a load point (`flags`), or a finding about the server
    (`findings`: bursty streaming, requests held in the front end), with the numbers."""

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
    client_lag_p50_s: float | None = Field(
        None, description="client: how late its event loop ran a periodic timer (median)"
    )
    client_lag_p95_s: float | None = None
    client_lag_max_s: float | None = None
    client_lag_samples: int = 0
    client_delay_mean_s: float | None = Field(
        None,
        description="client: delay its own stalls added to a random moment of the window, "
        "sum(lag^2) / (2 x window)",
    )
    client_cpu_share: float | None = Field(
        None, description="client: CPU seconds per wall second during the window"
    )
    server_http_e2e_mean_s: float | None = Field(
        None,
        description="vLLM's API server: HTTP-level duration of the OpenAI routes (front end "
        "included), mean over the window",
    )
    engine_queue_mean_s: float | None = None
    engine_prefill_mean_s: float | None = None
    front_end_ttft_s: float | None = Field(
        None,
        description="client TTFT mean minus the engine's: time in the server's front end "
        "(HTTP, tokenising, detokenising, streaming) before the first chunk",
    )


def _mean(values: Iterable[float]) -> float | None:
    arr = list(values)
    return sum(arr) / len(arr) if arr else None


def bursty_request(rec: RequestRecord) -> bool:
    """Whether a request (4+ output tokens) reached the client in bursts: fewer than
    `BURST_DELIVERIES_PER_TOKEN` separate arrivals per output token."""
    return (
        rec.output_tokens >= 4 and rec.deliveries / rec.output_tokens < BURST_DELIVERIES_PER_TOKEN
    )


def _latency_gap(client: float, server: float) -> bool:
    return client - server > max(LATENCY_REL_TOL * server, LATENCY_ABS_TOL_S)


def _pct(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if values else None


def cross_check(
    done: Sequence[RequestRecord],
    *,
    load: float,
    mode: Literal["concurrency", "rate"],
    server: ServerDelta | None,
    max_num_seqs: int | None = None,
    repetition: int | None = None,
    client_lag_s: Sequence[float] = (),
    client_delay_s: float | None = None,
    client_cpu_share: float | None = None,
) -> tuple[CrossCheck, list[PointFlag], list[PointFlag]]:
    """Check one window's completed requests against the client's own lag and the server's
    figures. Returns the check, the flags (reasons not to trust the window) and the findings
    (what the server did: bursty streaming, requests held before the engine)."""
    tokens = sum(r.output_tokens for r in done)
    deliveries = sum(r.deliveries for r in done)
    long = [r for r in done if r.output_tokens >= 4]
    ttfts = [t for r in done if (t := r.ttft_s) is not None]
    check = CrossCheck(
        client_ttft_mean_s=_mean(ttfts),
        client_e2e_mean_s=_mean(t for r in done if (t := r.e2e_s) is not None),
        client_ok=len(done),
        deliveries_per_token=(deliveries / tokens) if tokens else None,
        bursty_share=(sum(1 for r in long if bursty_request(r)) / len(long)) if long else None,
        client_lag_p50_s=_pct(client_lag_s, 50),
        client_lag_p95_s=_pct(client_lag_s, 95),
        client_lag_max_s=max(client_lag_s) if client_lag_s else None,
        client_lag_samples=len(client_lag_s),
        client_delay_mean_s=client_delay_s,
        client_cpu_share=client_cpu_share,
    )
    flags: list[PointFlag] = []
    findings: list[PointFlag] = []

    def flag(code: FlagCode, message: str, **values: float | None) -> None:
        item = PointFlag(code=code, repetition=repetition, message=message, values=values)
        (flags if code in FLAG_CODES else findings).append(item)

    delay, ttft_mean = client_delay_s, check.client_ttft_mean_s
    lag_tol = max(CLIENT_LAG_ABS_TOL_S, CLIENT_LAG_REL_TOL * (ttft_mean or 0.0))
    if delay is not None and delay > lag_tol:
        flag(
            "client_bound",
            f"the load client's own stalls added {delay * 1000:.1f} ms to a random moment "
            f"(its event loop ran up to {(check.client_lag_max_s or 0) * 1000:.0f} ms late; "
            f"tolerance: max({CLIENT_LAG_ABS_TOL_S * 1000:g} ms, {CLIENT_LAG_REL_TOL:.0%} of "
            f"its TTFT mean {(ttft_mean or 0) * 1000:.1f} ms)): the client itself fell "
            "behind, so it recorded chunks late",
            client_delay_mean_s=delay,
            client_lag_max_s=check.client_lag_max_s,
            client_cpu_share=client_cpu_share,
        )
    dpt, share = check.deliveries_per_token, check.bursty_share
    bursty = (dpt is not None and dpt < BURST_DELIVERIES_PER_TOKEN) or (
        share is not None and share > BURSTY_SHARE_TOL
    )
    if server is None:
        if bursty:
            flag(
                "bursty",
                f"content arrived {dpt or 0:.2f} times per output token and "
                f"{(share or 0):.0%} of requests came in bursts, and the server reports no "
                "TPOT of its own: TPOT and ITL are not measurable",
                deliveries_per_token=dpt,
                bursty_share=share,
            )
        flag("unverified", "the server exposed no /metrics to check the client against")
        return check, flags, findings
    ttft_w, e2e_w = server.histograms.get("ttft"), server.histograms.get("e2e")
    http_w = server.histograms.get("http")
    check.server_ttft_mean_s = ttft_w.mean_s if ttft_w is not None else None
    check.server_e2e_mean_s = e2e_w.mean_s if e2e_w is not None else None
    check.server_http_e2e_mean_s = http_w.mean_s if http_w is not None else None
    check.engine_queue_mean_s = server.queue_time_mean_s
    check.engine_prefill_mean_s = server.prefill_time_mean_s
    check.server_succeeded = server.requests_succeeded
    check.running_peak = server.running_peak
    check.gauge_samples = server.gauge_samples
    if check.client_ttft_mean_s is not None and check.server_ttft_mean_s is not None:
        check.front_end_ttft_s = max(0.0, check.client_ttft_mean_s - check.server_ttft_mean_s)
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
    if bursty:
        tpot_w = server.histograms.get("tpot")
        engine = (
            f"; the engine's own TPOT mean is {tpot_w.mean_s * 1000:.1f} ms"
            if tpot_w is not None and tpot_w.mean_s is not None
            else ""
        )
        flag(
            "bursty",
            f"content arrived {dpt or 0:.2f} times per output token and "
            f"{(share or 0):.0%} of requests came in bursts (tolerance: "
            f"{BURST_DELIVERIES_PER_TOKEN:g} per token, {BURSTY_SHARE_TOL:.0%} of requests): "
            f"the server's front end merged tokens, so TPOT and ITL are the engine's{engine}",
            deliveries_per_token=dpt,
            bursty_share=share,
        )
    c_e2e, h_e2e = check.client_e2e_mean_s, check.server_http_e2e_mean_s
    if c_e2e is not None and h_e2e is not None and _latency_gap(c_e2e, h_e2e):
        flag(
            "client_bound",
            f"client E2E mean {c_e2e * 1000:.1f} ms is {(c_e2e - h_e2e) * 1000:.1f} ms above "
            f"the server's own HTTP-level E2E {h_e2e * 1000:.1f} ms, front end included "
            f"(tolerance: max({LATENCY_REL_TOL:.0%}, {LATENCY_ABS_TOL_S * 1000:g} ms)): the "
            "time went in the client or on the loopback",
            client_e2e_mean_s=c_e2e,
            server_http_e2e_mean_s=h_e2e,
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
            f"the engine ran at most {peak:g} requests at once where min(concurrency, "
            f"max-num-seqs) is {exp:g} (below {UNDERFILL_FRACTION:.0%} of it, over "
            f"{server.gauge_samples} samples): requests waited in the server's front end "
            "before the engine saw them",
            running_peak=peak,
            expected_running=exp,
        )
    return check, flags, findings
