"""Diagnosis of a live service: what is wrong with an environment right now, ranked, each
finding with its evidence, likely cause, where to look and remedy (design.md, "Operating
knowledge to encode").

The judgement is plain data in, data out: `diagnose_window(window, baseline=..., change=...)`
reads a `LiveWindow` (per-window figures of the vLLM server and of the gateway, by the names
of releasekit.watch.windows.METRICS), a `Baseline` (the knee of the release's own load test)
and a `ChangeSummary` (the environment's most recent ledger change and its diff). `diagnose`
adds the lookups: what is live in the environment (the ledger), its bench result and the
diff against the release before it. Taking the window itself (two scrapes `window` seconds
apart) is the caller's: scraping lives in releasekit.watch, a layer above this package.

Method, as design.md writes it:

1. classify: performance (latency, memory, queueing) or quality (errors, negative feedback,
   with the last change as the suspect);
2. segment latency into gateway time (first token at the edge minus the engine's), intake
   (the engine's TTFT that queue and prefill do not explain: vLLM's API server front end),
   queueing (vLLM queue time, waiting requests), prefill and decode (vLLM's histograms;
   decode judged per token, by ITL), and name the segment that grew against the knee;
3. check the symptom table: memory pressure and preemptions, queueing behind too little
   capacity, slow decode, streaming that stutters between engine and client;
4. compare with the last change.

Every threshold is relative to the release's benchmark where it has the figure (`factor` x
the knee's value and at least `floor` above it), an absolute fallback otherwise; each finding
states the one it used. A window with too few requests is "not enough traffic to judge",
never healthy; a window in which a server restarted is not judged at all.

Where each part lives (all re-exported here): the inputs in `capacity.diagnose_inputs`,
the latency segments in `capacity.diagnose_segments`, the findings and the checks that need
no segment in `capacity.diagnose_findings`, the latency checks and the `Judge` that runs
them all in `capacity.diagnose_latency`, figures in words in `capacity.diagnose_text`, the
lookups in `capacity.diagnose_lookups`. This module puts them together into a `Diagnosis`.

Errors raised here:

    ReleasekitError
    └── DiagnoseError     the window cannot be judged: nothing scraped, no URL known for
                          the environment, a bad window length
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel, Field

from releasekit.capacity.diagnose_findings import (
    Category,
    Evidence,
    Finding,
    FindingKind,
    Severity,
    rank_findings,
)
from releasekit.capacity.diagnose_inputs import (
    Baseline,
    ChangeSummary,
    LiveWindow,
    Observed,
    Source,
    Thresholds,
    baseline_from_bench,
    key_figures,
)
from releasekit.capacity.diagnose_latency import Judge
from releasekit.capacity.diagnose_lookups import (
    LIVE_TYPES,
    LiveTargets,
    last_change,
    ledger_or_none,
    live_baseline,
    live_release,
    live_targets,
)
from releasekit.capacity.diagnose_segments import Segment, segment_latency
from releasekit.capacity.diagnose_text import healthy_line
from releasekit.config import Settings
from releasekit.errors import ReleasekitError
from releasekit.stores.ledger import Ledger

# -- errors ----------------------------------------------------------------------------------


class DiagnoseError(ReleasekitError):
    """Raised when a diagnosis cannot start or its window cannot be judged: no metrics URL
    known for the environment (nothing deployed, no --vllm-url), neither source answered
    both scrapes, or a window length that is not positive."""

    remedy = (
        "deploy the environment first (`releasekit promote`), or point diagnose at the "
        "servers with --vllm-url and --gateway-url"
    )


# -- the diagnosis ---------------------------------------------------------------------------

Verdict = Literal["healthy", "problems", "not_enough_traffic", "not_judged"]


class Diagnosis(BaseModel):
    """What `releasekit diagnose ENV` found. `verdict`: healthy, problems, not enough
    traffic to judge, or not judged (a server restarted in the window)."""

    env: str
    release_id: str | None = None
    window_s: float
    requests: float | None = None
    request_rate: float | None = None
    verdict: Verdict
    classification: Literal["performance", "quality", "performance+quality", "none"]
    summary: str
    findings: list[Finding] = Field(default_factory=list)
    segments: list[Segment] = Field(default_factory=list)
    key_figures: dict[str, float | None] = Field(default_factory=dict)
    baseline: Baseline | None = None
    last_change: ChangeSummary | None = None
    notes: list[str] = Field(default_factory=list)


def diagnose_window(
    window: LiveWindow,
    *,
    env: str,
    release_id: str | None = None,
    baseline: Baseline | None = None,
    change: ChangeSummary | None = None,
    thresholds: Thresholds | None = None,
    notes: Iterable[str] = (),
) -> Diagnosis:
    """Judge one live window against the release's benchmark knee: ranked findings, the
    latency segments, the key figures, and a one-line summary."""
    t = thresholds or Thresholds()
    all_notes = list(notes)
    all_notes += [f"{src} scrape failed: {p}" for src, p in window.scrape_errors.items()]
    if baseline is None:
        all_notes.append("no bench knee for the live release: absolute thresholds used")
    base_kw: dict[str, Any] = {
        "env": env,
        "release_id": release_id,
        "window_s": window.duration_s,
        "requests": window.requests,
        "baseline": baseline,
        "last_change": change,
    }
    if window.reset:
        return Diagnosis(
            **base_kw,
            verdict="not_judged",
            classification="none",
            summary=f"not judged: {', '.join(window.reset)} restarted during the window; "
            "run diagnose again",
            notes=all_notes,
        )
    j = Judge(window, baseline, change, t, env, release_id)
    j.run()
    findings = rank_findings(j.findings)
    keys = key_figures(window)
    cats = {f.category for f in findings}
    classification: Literal["performance", "quality", "performance+quality", "none"] = (
        "performance+quality"
        if cats == {"performance", "quality"}
        else "performance"
        if cats == {"performance"}
        else "quality"
        if cats == {"quality"}
        else "none"
    )
    if findings:
        verdict: Verdict = "problems"
        top = findings[0]
        more = f" (+{len(findings) - 1} more)" if len(findings) > 1 else ""
        summary = f"{classification} problem: {top.title}{more}"
    elif not j.enough:
        verdict = "not_enough_traffic"
        summary = (
            f"not enough traffic to judge: {j.requests:g} requests in "
            f"{window.duration_s:g} s (need {t.min_requests}); use a longer --window"
        )
    else:
        verdict = "healthy"
        summary = healthy_line(keys, baseline, j.requests)
    recent = change is not None and change.age_s is not None and change.age_s <= t.recent_change_s
    if recent and not any(f.category == "quality" for f in findings):
        all_notes.append(f"recent change: {j.suspect()[0]}")
    return Diagnosis(
        **base_kw,
        request_rate=keys["request_rate"],
        verdict=verdict,
        classification=classification,
        summary=summary,
        findings=findings,
        segments=j.segments,
        key_figures=keys,
        notes=all_notes + j.notes,
    )


def diagnose(
    settings: Settings,
    env: str,
    window: LiveWindow,
    *,
    release_id: str | None = None,
    ledger: Ledger | None = None,
    thresholds: Thresholds | None = None,
    now: dt.datetime | None = None,
) -> Diagnosis:
    """Diagnose `env` from a live window: the release live there (the ledger, unless
    `release_id` says), its bench knee as the healthy reference, and its most recent
    change with the diff against the release before it."""
    if window.requests is None and not window.vllm and not window.gateway:
        raise DiagnoseError(
            f"no metrics for {env}: "
            + ("; ".join(f"{k}: {v}" for k, v in window.scrape_errors.items()) or "nothing scraped")
        )
    notes: list[str] = []
    led = ledger or ledger_or_none(settings)
    change = None
    rid = release_id
    if led is None:
        notes.append("no ledger: the live release and its last change are unknown")
    else:
        try:
            rid = rid or live_release(settings, env, ledger=led)
            change = last_change(settings, env, ledger=led, now=now)
        finally:
            if ledger is None:
                led.close()
    base = None
    if rid is not None:
        base, why = live_baseline(settings, rid)
        if why:
            notes.append(why)
    else:
        notes.append(f"no release live in {env} per the ledger")
    return diagnose_window(
        window,
        env=env,
        release_id=rid,
        baseline=base,
        change=change,
        thresholds=thresholds,
        notes=notes,
    )


__all__ = [
    "LIVE_TYPES",
    "Baseline",
    "Category",
    "ChangeSummary",
    "DiagnoseError",
    "Diagnosis",
    "Evidence",
    "Finding",
    "FindingKind",
    "LiveTargets",
    "LiveWindow",
    "Observed",
    "Segment",
    "Severity",
    "Source",
    "Thresholds",
    "Verdict",
    "baseline_from_bench",
    "diagnose",
    "diagnose_window",
    "last_change",
    "live_baseline",
    "live_release",
    "live_targets",
    "segment_latency",
]
