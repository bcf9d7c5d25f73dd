"""What a canary or shadow judge took, kept so that `releasekit audit replay` can judge
again: the checks as applied (after the environment's ceilings) and the two releases'
windows, cut to the figures and histograms those checks read.

    rec = judged_inputs(checks, canary_windows, stable_windows)   # into the event
    checks, cw, sw = replay_inputs(rec)                            # back, for the judge

A window holds counts, quantiles and latency histograms of the release's traffic: never
a prompt or an answer. Only the figures `rollout.judge` reads for the checks are kept
(the check's metric, and what decides the TTFT source: streamed chunks per request and
output tokens per second), so a record stays a few kilobytes.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from releasekit.rollout.judge import ReleaseWindows
from releasekit.spec.manifest import CanaryCheck
from releasekit.watch.windows import Window

_QUANTILE = re.compile(r"^(?P<short>[a-z0-9]+)_p\d+_s$")
_SOURCE_FIGURES = ("chunks_per_request", "generation_tokens_per_s")


def check_params(checks: Sequence[CanaryCheck]) -> list[dict[str, Any]]:
    """The checks as the judge applied them (every field, after clamping)."""
    return [c.model_dump(mode="json") for c in checks]


def _cut(w: Window | None, metrics: set[str], shorts: set[str]) -> dict[str, Any] | None:
    if w is None:
        return None
    keep = metrics | set(_SOURCE_FIGURES)
    out = w.model_copy(
        update={"figures": {k: v for k, v in w.figures.items() if k in keep}}
    ).model_dump(mode="json", exclude_none=True)
    # A window does not serialise its histograms; the judge's exceedance counts read them.
    out["histograms"] = {
        k: v.model_dump(mode="json") for k, v in w.histograms.items() if k in shorts
    }
    return out


def _cut_release(rw: ReleaseWindows, metrics: set[str], shorts: set[str]) -> dict[str, Any]:
    return {
        "release_id": rw.release_id,
        "edge": _cut(rw.edge, metrics, shorts),
        "engine": _cut(rw.engine, metrics, shorts),
        "engine_missing": rw.engine_missing,
    }


def judged_inputs(
    checks: Sequence[CanaryCheck], canary: ReleaseWindows, stable: ReleaseWindows
) -> dict[str, Any]:
    """The judge's inputs for one judgement: the applied checks and both windows (cut)."""
    metrics: set[str] = {str(c.metric) for c in checks}
    shorts = {m["short"] for c in checks if (m := _QUANTILE.match(c.metric))}
    return {
        "checks": check_params(checks),
        "canary": _cut_release(canary, metrics, shorts),
        "stable": _cut_release(stable, metrics, shorts),
    }


def replay_inputs(
    rec: dict[str, Any],
) -> tuple[list[CanaryCheck], ReleaseWindows, ReleaseWindows]:
    """The recorded checks and windows back as the judge takes them (ValueError when the
    record is not one `judged_inputs` made)."""
    checks = [CanaryCheck.model_validate(c) for c in rec["checks"]]
    return (
        checks,
        ReleaseWindows.model_validate(rec["canary"]),
        ReleaseWindows.model_validate(rec["stable"]),
    )
