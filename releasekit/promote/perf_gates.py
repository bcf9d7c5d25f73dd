"""The perf gates: the SLOs at a knee, and the candidate against the live release at the
live knee load within a tolerance the environment caps and the live release's run-to-run
spread widens."""

from __future__ import annotations

from releasekit.bench.runner import BenchResult
from releasekit.bench.stats import PointResult
from releasekit.config import HIGHER_BETTER_PERF, EnvironmentConfig
from releasekit.promote.context import ReleaseInfo
from releasekit.promote.evidence_gates import Evidence
from releasekit.promote.gate_results import CurvePoint, GateResult

DEFAULT_TOLERANCES: dict[str, float] = {"ttft_p95_s": 0.25, "goodput": 0.10}
"""Relative tolerances at the knee when the manifest names no gate for the metric."""


def curve(bench: BenchResult | None) -> list[CurvePoint]:
    """The latency-throughput curve of a bench result, by load."""
    if bench is None:
        return []
    return [
        CurvePoint(
            load=p.load,
            output_token_throughput=p.output_token_throughput,
            goodput=p.goodput,
            ttft_p95_s=p.ttft.p95,
            e2e_p95_s=p.e2e.p95,
            slo_ok=p.slo_ok,
        )
        for p in sorted(bench.points, key=lambda p: p.load)
    ]


def point_metric(p: PointResult, metric: str) -> float | None:
    """A `bench.knee.<metric>` figure of one load point."""
    lat = {"ttft": p.ttft, "tpot": p.tpot, "e2e": p.e2e, "itl": p.itl}
    if metric.endswith("_p95_s") and metric[:-6] in lat:
        return lat[metric[:-6]].p95
    if metric.endswith("_p50_s") and metric[:-6] in lat:
        return lat[metric[:-6]].p50
    value = getattr(p, metric, None)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _knee_gates(label: str, bench: BenchResult) -> list[GateResult]:
    knee = bench.knee
    problems: list[str] = []
    if knee is None:
        problems.append(f"no knee: {bench.knee_stop or 'the sweep has no points'}")
    elif not knee.holds:
        codes = sorted({f.code for f in knee.flags})
        problems.append(
            f"the knee point held in only {knee.runs_holding} of {len(knee.runs) or 1} runs"
            + (f" (flagged: {', '.join(codes)})" if codes else "")
        )
    if knee is not None and "knee_stable" in bench.model_fields_set and not bench.knee_stable:
        per = ", ".join("none" if k is None else f"{k:g}" for k in bench.knee_by_repetition)
        problems.append(
            f"the knee is not stable across repetitions (per repetition: {per or 'one run'})"
        )
    slo = bench.slo
    words = ", ".join(
        f"{k} <= {v:g} s"
        for k, v in (("TTFT", slo.ttft_s), ("TPOT", slo.tpot_s), ("E2E", slo.e2e_s))
        if v
    )
    return [
        GateResult(
            name=f"SLOs hold at the knee ({label})",
            kind="perf",
            passed=not problems,
            rule=(
                f"some load point meets the profile's SLOs ({words}) for at least "
                f"{slo.attainment:.0%} of requests: {bench.knee_rule or 'in every run'}; "
                "and reruns agree on it"
            ),
            candidate=knee.load if knee else None,
            detail="; ".join(problems) or f"knee at load {knee.load:g}"
            if knee
            else "; ".join(problems),
        )
    ]


def run_spread(p: PointResult, metric: str) -> float:
    """(max - min) / median of `metric` over the runs of a load point, one outlying run on
    each side set aside from five runs (`Spread.relative`; 0 with fewer than two runs, or
    for a figure the runs do not record): the host's own noise there."""
    s = p.spread.get(metric)
    return 0.0 if s is None else s.relative()


def _tolerance(info: ReleaseInfo, metric: str, policy: EnvironmentConfig) -> tuple[float, str]:
    """The relative tolerance of a `bench.knee.<metric>` comparison and where it came from:
    the manifest's margin (or the default), never wider than the environment's ceiling."""
    tol, source = DEFAULT_TOLERANCES.get(metric, 0.0), "default"
    for g in info.lm.manifest.gates:
        if g.metric == f"bench.knee.{metric}" and g.kind in ("max_increase", "non_inferior"):
            if g.margin is not None:
                tol, source = g.margin, "manifest"
            break
    ceiling = policy.tolerance_ceiling(metric)
    if tol > ceiling:
        return ceiling, f"{source} tolerance {tol:g} clamped to the environment's ceiling"
    return tol, f"{source} tolerance"


def _too_noisy(metric: str, spreads: dict[str, float], cap: float) -> GateResult | None:
    """An evidence failure when either release's runs at the live knee spread wider than
    the environment's cap: the difference cannot be told from the host's noise there."""
    over = {side: v for side, v in spreads.items() if v > cap}
    if not over:
        return None
    return GateResult(
        name=f"{metric} at the knee",
        kind="evidence",
        passed=False,
        # A comparison with the live release at its knee: where canary steps judge
        # performance live (perf_by_canary), they judge this one too.
        against_live=True,
        rule=f"each release's run-to-run spread of {metric} at the live knee load "
        f"((max - min) / median of its runs, one outlying run each side set aside from five "
        f"runs) at most {cap:g} (max_perf_spread)",
        limit=cap,
        live=spreads.get("live"),
        candidate=spreads.get("candidate"),
        detail="too noisy to judge here ("
        + ", ".join(f"{side} spread {v:.2f}" for side, v in over.items())
        + f" > {cap:g}): a registered release's load test is the one its register event "
        "signed, so judge performance live (a canary step) or override it by name",
    )


def _one_load_test(cand: Evidence, live: Evidence) -> str:
    """'; one load test ...' when both releases' main sweeps are one measurement (one cites
    the other's, or both cite a third's: the same engine and load profile), else ''."""
    assert cand.bench is not None and live.bench is not None
    src = [
        b.measured_for.release_id if b.measured_for is not None else e.info.release_id
        for b, e in ((cand.bench, cand), (live.bench, live))
    ]
    if src[0] != src[1]:
        return ""
    return f"; one load test, release {src[0][:12]}'s (the same engine and load profile)"


def _relative_perf(cand: Evidence, live: Evidence, policy: EnvironmentConfig) -> list[GateResult]:
    assert cand.bench is not None and live.bench is not None
    gates: list[GateResult] = []
    one = _one_load_test(cand, live)
    lk = live.bench.knee
    if lk is None:
        gates.append(
            GateResult(
                name="live release has a knee",
                kind="evidence",
                passed=False,
                rule="the live release's bench must have a load point that holds its SLOs",
                detail="the live release's bench has no knee to compare with: "
                + (live.bench.knee_stop or "it has no load points"),
            )
        )
        return gates
    at = next((p for p in cand.bench.points if p.load == lk.load), None)
    gates.append(
        GateResult(
            name=f"SLOs hold at the live knee (load {lk.load:g})",
            kind="perf",
            against_live=True,
            passed=at is not None and at.holds,
            rule="at the live release's knee load the candidate holds under the same rule: "
            + (cand.bench.knee_rule or "SLOs met, unflagged, in every run"),
            candidate=at.slo_attainment if at else None,
            live=lk.slo_attainment,
            limit=live.bench.slo.attainment,
            detail=(
                "the candidate's sweep has no point at this load"
                if at is None
                else f"attainment {at.slo_attainment:.0%}, held in {at.runs_holding} of "
                f"{len(at.runs)} runs"
                + (f"; flags {', '.join(sorted({f.code for f in at.flags}))}" if at.flags else "")
                + one
            ),
        )
    )
    metrics = ["ttft_p95_s", "goodput"] + [
        g.metric.removeprefix("bench.knee.")
        for g in cand.info.lm.manifest.gates
        if g.metric.startswith("bench.knee.")
        and g.kind in ("max_increase", "non_inferior")
        and g.metric.removeprefix("bench.knee.") not in ("ttft_p95_s", "goodput")
    ]
    cap = policy.max_perf_spread
    for metric in dict.fromkeys(metrics):
        tol, how = _tolerance(cand.info, metric, policy)
        c = point_metric(at, metric) if at else None
        v = point_metric(lk, metric)
        higher = metric in HIGHER_BETTER_PERF
        c_spread = run_spread(at, metric) if at else 0.0
        l_spread = run_spread(lk, metric)
        noisy = _too_noisy(metric, {"candidate": c_spread, "live": l_spread}, cap)
        if noisy is not None:
            gates.append(noisy)
            continue
        # A difference within the live release's own run-to-run spread at this load is the
        # host's noise, not a regression: the tolerance widens to that spread (at most the
        # cap, above which the gate fails as evidence). The candidate's own erratic runs
        # never widen the tolerance on its regression.
        eff = max(tol, l_spread)
        limit = None if v is None else (v * (1 - eff) if higher else v * (1 + eff))
        ok = c is not None and limit is not None and (c >= limit if higher else c <= limit)
        how = f"{how} {tol:g}"
        if l_spread > tol:
            how += f", widened to the live release's run-to-run spread {l_spread:.2f}"
        rule = (
            f"{metric} at the live knee load >= live x (1 - {eff:.2f}) ({how})"
            if higher
            else f"{metric} at the live knee load <= live x (1 + {eff:.2f}) ({how})"
        )
        gates.append(
            GateResult(
                name=f"{metric} at the knee",
                kind="perf",
                against_live=True,
                passed=ok,
                rule=rule,
                candidate=c,
                live=v,
                limit=limit,
                detail="missing figure"
                if c is None or v is None
                else f"run-to-run spread: candidate {c_spread:.2f}, live {l_spread:.2f} "
                f"((max - min) / median of its runs; at most {cap:g}){one}",
            )
        )
    return gates
