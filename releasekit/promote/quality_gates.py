"""The quality gates: per suite, the paired comparison with the live release under the
environment's margin ceilings, or the pass-rate floors on a first promotion."""

from __future__ import annotations

from releasekit.config import EnvironmentConfig, Settings
from releasekit.errors import ReleasekitError
from releasekit.evaluate.compare import Comparison, compare
from releasekit.evaluate.comparison import parse_comparison
from releasekit.evaluate.runner import SuiteSummary
from releasekit.promote.context import ReleaseInfo
from releasekit.promote.evidence_gates import Evidence
from releasekit.promote.gate_results import GateResult
from releasekit.spec.manifest import LoadedManifest, Suite
from releasekit.stores.results import ReleasePaths


def margins_here(info: ReleaseInfo, policy: EnvironmentConfig) -> dict[str, tuple[float, float]]:
    """Per suite of the candidate's manifest: (the margin it is judged with here, the
    manifest's own). The environment's ceiling (`max_margin`) caps the manifest's margin:
    a release may make its quality bar stricter, never looser."""
    return {
        s.name: (min(s.margin, policy.margin_ceiling(s.name)), s.margin)
        for s in info.lm.manifest.eval.suites
    }


def _clamped(info: ReleaseInfo, margins: dict[str, tuple[float, float]]) -> LoadedManifest:
    """The candidate's loaded manifest with each suite's margin as judged here."""
    m = info.lm.manifest
    suites = [s.model_copy(update={"margin": margins[s.name][0]}) for s in m.eval.suites]
    ev = m.eval.model_copy(update={"suites": suites})
    return info.lm.model_copy(update={"manifest": m.model_copy(update={"eval": ev})})


def _comparison(
    settings: Settings,
    cand: Evidence,
    live: Evidence,
    margins: dict[str, tuple[float, float]],
) -> tuple[Comparison, str]:
    assert cand.eval is not None and live.eval is not None
    path = ReleasePaths.of(settings, cand.info.release_id).compare
    ve = cand.info.evidence
    if path.is_file() and ve is not None and not ve.problems_for("compare"):
        try:
            stored: Comparison | None = parse_comparison(ve.read_bytes("compare"), source=str(path))
        except ReleasekitError:
            stored = None
        if (
            stored is not None
            and stored.baseline_release_id == live.info.release_id
            and stored.candidate_release_id == cand.info.release_id
            and all(
                name in stored.suites and stored.suites[name].margin == here
                for name, (here, _) in margins.items()
            )
        ):
            return stored, "report"
    return compare(cand.eval, live.eval, _clamped(cand.info, margins)), "computed"


def _quality_relative(
    cmp: Comparison,
    cand: Evidence,
    margins: dict[str, tuple[float, float]],
    *,
    live_suites: set[str] | None = None,
) -> list[GateResult]:
    """One gate a suite the two releases share (`live_suites`: the live release's; a suite
    only the candidate has is judged by `_quality_absolute(..., only=...)`)."""
    gates: list[GateResult] = []
    conf = f"{100 * cmp.confidence:g}%"
    for name in [s.name for s in cand.info.lm.manifest.eval.suites] + [
        n for n in cmp.suites if n not in {s.name for s in cand.info.lm.manifest.eval.suites}
    ]:
        if live_suites is not None and name not in live_suites:
            continue
        sc = cmp.suites.get(name)
        if sc is None:
            gates.append(
                GateResult(
                    name=f"suite {name}",
                    kind="quality",
                    passed=False,
                    rule="the suite must be compared with the live release",
                    detail="missing_evidence: not in the comparison",
                )
            )
            continue
        ci = (
            f"delta {sc.delta:+.3f}, {conf} CI [{sc.ci_low:+.3f}, {sc.ci_high:+.3f}], "
            if sc.delta is not None and sc.ci_low is not None and sc.ci_high is not None
            else ""
        )
        flips = (
            f"{len(sc.flipped_to_fail)} pass->fail, {len(sc.flipped_to_pass)} fail->pass"
            + (f" (McNemar p={sc.mcnemar_p:.2g})" if sc.mcnemar_p is not None else "")
            + "; "
            if sc.n_paired
            else ""
        )
        gates.append(
            GateResult(
                name=f"suite {name}",
                kind="quality",
                passed=sc.passed,
                rule=(
                    f"non-inferior: lower bound of the {conf} interval of (candidate - live) "
                    f"pass rate above -{sc.margin:g}, with >= {sc.min_paired} paired items"
                ),
                candidate=sc.candidate_pass_rate,
                live=sc.baseline_pass_rate,
                limit=-sc.margin,
                detail=f"{sc.verdict.value}: {ci}{flips}n={sc.n_paired}"
                + (f"; {'; '.join(sc.reasons)}" if sc.reasons else "")
                + _clamp_note(margins.get(name)),
            )
        )
    return gates


def _clamp_note(margin: tuple[float, float] | None) -> str:
    if margin is None or margin[0] == margin[1]:
        return ""
    return f"; the manifest's margin {margin[1]:g} is clamped to the environment's ceiling"


def _floor(s: Suite, policy: EnvironmentConfig) -> tuple[float | None, str]:
    """A suite's lowest pass rate on a first promotion: the environment's floor, raised
    (never lowered) by the manifest's `min_pass_rate`; and where it came from."""
    env_floor, own = policy.floor_for(s.name), s.min_pass_rate
    if env_floor is None and own is None:
        return None, ""
    if own is None or (env_floor is not None and env_floor >= own):
        return env_floor, "the environment's min_pass_rate"
    return own, "the manifest's min_pass_rate, stricter than the environment's"


def _quality_absolute(
    cand: Evidence, policy: EnvironmentConfig, *, only: list[str] | None = None
) -> list[GateResult]:
    """A gate a suite held to its floor: every suite when nothing is live; with `only`, the
    suites the live release lacks, which must have a floor (a new suite compared with
    nothing and held to nothing would pass whatever it scored)."""
    gates: list[GateResult] = []
    for s in cand.info.lm.manifest.eval.suites:
        if only is not None and s.name not in only:
            continue
        got = cand.eval.suites.get(s.name) if cand.eval else None
        rate = got.pass_rate if got else None
        need, source = _floor(s, policy)
        if only is not None:
            gates.append(_new_suite_gate(s, got, need, source))
            continue
        ok = got is not None and rate is not None and (need is None or rate >= need)
        gates.append(
            GateResult(
                name=f"suite {s.name}",
                kind="quality",
                passed=ok and not cand.eval_problems,
                rule=(
                    f"pass rate >= {need:g} ({source}; nothing live to compare with)"
                    if need is not None
                    else "evaluated on the locked suite (no min_pass_rate set; nothing live)"
                ),
                candidate=rate,
                limit=need,
                detail=(
                    f"{got.passed}/{got.n} passed, {got.errors} errors" if got else "not evaluated"
                ),
            )
        )
    return gates


def _new_suite_gate(
    s: Suite, got: SuiteSummary | None, need: float | None, source: str
) -> GateResult:
    """The gate of a suite the live release lacks: its pass rate against its floor."""
    rate = got.pass_rate if got else None
    what = f" (adapter {s.adapter})" if s.adapter else ""
    if need is None:
        return GateResult(
            name=f"suite {s.name}",
            kind="quality",
            passed=False,
            rule=f"a suite the live release lacks{what} is held to a floor",
            candidate=rate,
            detail="no floor: set eval.suites[].min_pass_rate (or the environment's "
            "min_pass_rate for it) to say what it must score",
        )
    return GateResult(
        name=f"suite {s.name}",
        kind="quality",
        passed=got is not None and rate is not None and rate >= need,
        rule=f"pass rate >= {need:g} ({source}; the live release lacks this suite{what})",
        candidate=rate,
        limit=need,
        detail=f"{got.passed}/{got.n} passed, {got.errors} errors" if got else "not evaluated",
    )
