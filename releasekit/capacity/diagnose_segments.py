"""Latency in segments: gateway time (first token at the edge minus the engine's), intake
(the engine's TTFT that queue and prefill do not explain: vLLM's API server front end),
queueing, prefill and decode (vLLM's histograms; decode judged per token, by ITL), each held
against the release's bench knee (`factor` x the knee and at least `floor` above it), or an
absolute line where the bench lacks the figure."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from releasekit.capacity.diagnose_inputs import Baseline, LiveWindow, Source, Thresholds
from releasekit.capacity.diagnose_text import seconds


class Segment(BaseModel):
    """One latency segment: its mean over the window, the knee's, and whether it grew."""

    name: Literal["gateway", "intake", "queue", "prefill", "decode"]
    live_s: float | None = None
    baseline_s: float | None = None
    source: Source | None = None
    share: float | None = Field(None, description="share of the segments' total")
    grew: bool = False
    rule: str = ""


def grew_past_knee(
    live: float | None, base: float | None, *, factor: float, floor: float, absolute: float
) -> tuple[bool, str]:
    """Whether `live` grew past the knee's `base` (or past `absolute` without one)."""
    if live is None:
        return False, "no data"
    if base is not None:
        line = max(base * factor, base + floor)
        return live > line, (
            f"> max({factor:g} x knee {seconds(base)}, knee + {seconds(floor)}) = {seconds(line)}"
        )
    return live > absolute, f"> {seconds(absolute)} (absolute: the bench has no figure)"


def difference(a: float | None, b: float | None) -> float | None:
    """a - b, or None when either is unknown."""
    return None if a is None or b is None else a - b


def itl_baseline(b: Baseline | None) -> float | None:
    """The knee's time between tokens: vLLM's ITL, else the client's ITL, else TPOT."""
    if b is None:
        return None
    return b.server_itl_mean_s or b.itl_mean_s or b.tpot_mean_s


def segment_latency(w: LiveWindow, b: Baseline | None, t: Thresholds) -> list[Segment]:
    """The window's latency in segments (gateway, intake, queue, prefill, decode), each
    against the knee's figure, with its share of the total and whether it grew."""
    f = t.factor
    edge_ttft = w.g("ttft_mean_s")
    eng_ttft = w.v("ttft_mean_s")
    gw_live = difference(edge_ttft, eng_ttft)
    gw_base = None
    if b is not None:
        gw_base = difference(b.ttft_mean_s, b.server_ttft_mean_s)
        if gw_base is not None:
            gw_base = max(gw_base, 0.0)
    if gw_live is None:
        gw_live = difference(w.g("e2e_mean_s"), w.v("e2e_mean_s"))
    if gw_live is not None:
        gw_live = max(gw_live, 0.0)
    decode_live = w.v("decode_mean_s")
    # The engine's TTFT counts from the API server's arrival; what queue and prefill do
    # not explain is the server's front end (HTTP, tokenisation, handing to the engine).
    queue_live, prefill_live = w.v("queue_mean_s"), w.v("prefill_mean_s")
    intake_live = difference(
        eng_ttft,
        None if queue_live is None or prefill_live is None else queue_live + prefill_live,
    )
    if intake_live is not None:
        intake_live = max(intake_live, 0.0)
    intake_base = None
    if b is not None and b.queue_mean_s is not None and b.prefill_mean_s is not None:
        intake_base = difference(b.server_ttft_mean_s, b.queue_mean_s + b.prefill_mean_s)
        if intake_base is not None:
            intake_base = max(intake_base, 0.0)
    specs: list[tuple[Any, float | None, float | None, Source, float, float]] = [
        ("gateway", gw_live, gw_base, "gateway", t.gateway_floor_s, t.gateway_abs_s),
        ("intake", intake_live, intake_base, "vllm", t.intake_floor_s, t.intake_abs_s),
        (
            "queue",
            w.v("queue_mean_s"),
            None if b is None else b.queue_mean_s,
            "vllm",
            t.queue_floor_s,
            t.queue_abs_s,
        ),
        (
            "prefill",
            w.v("prefill_mean_s"),
            None if b is None else b.prefill_mean_s,
            "vllm",
            t.prefill_floor_s,
            t.prefill_abs_s,
        ),
    ]
    segs: list[Segment] = []
    for name, live, base, src, floor, absolute in specs:
        grew, rule = grew_past_knee(live, base, factor=f, floor=floor, absolute=absolute)
        segs.append(
            Segment(
                name=name,
                live_s=live,
                baseline_s=base,
                source=src if live is not None else None,
                grew=grew,
                rule=rule,
            )
        )
    # Decode time scales with output length: whether it grew is judged per token (ITL).
    itl_live, itl_base = w.v("itl_mean_s"), itl_baseline(b)
    grew, rule = grew_past_knee(
        itl_live, itl_base, factor=f, floor=t.itl_floor_s, absolute=t.itl_abs_s
    )
    segs.append(
        Segment(
            name="decode",
            live_s=decode_live,
            baseline_s=None if b is None else b.decode_mean_s,
            source="vllm" if decode_live is not None else None,
            grew=grew,
            rule=f"per token: ITL {seconds(itl_live)} {rule}",
        )
    )
    total = sum(s.live_s for s in segs if s.live_s is not None)
    if total > 0:
        for s in segs:
            if s.live_s is not None:
                s.share = s.live_s / total
    return segs
