"""Promotion gates over evidence: a candidate against the release live in the environment.

Gates, each with its numbers and its rule in words (`GateResult`):

- evidence: each release's eval, bench and comparison files are the ones its verified
  `register` ledger event signed (`releasekit.stores.verified`; a file that differs is
  named and not read), its project manifest was not edited after registration, and the two
  load tests were made on one host kind and core count ("benched on another host");
  each release's eval and bench results exist, were made for that release (their
  `release_id`), on the suites its lock pinned (suite-file sha256 + suite config = the lock's
  `eval/<suite>` digest) and on its locked load profile (`load/profile`). Against a live
  release, both must share every suite file (same sha256) and the load profile (same
  digest). Missing, stale or mismatched evidence fails, never passes.
- quality (one per suite): the paired comparison candidate vs the LIVE release
  (releasekit.evaluate.compare) with the candidate manifest's margins, each capped by the
  environment's ceiling (`max_margin`: a release may set a stricter bar, never a looser
  one); only `non_inferior` and `superior` pass. The candidate's report/compare.json is used
  when it is against the live release with the same margins; otherwise the comparison is
  computed from both releases' eval results.
- perf: the profile's SLOs hold at the candidate's knee (and the knee carries no
  reliability flag and, when the bench recorded it, is stable across repetitions); against
  a live release, at the live release's knee load the candidate's SLOs hold, TTFT p95 is
  at most live x (1 + tolerance) and goodput at least live x (1 - tolerance). Tolerances
  come from the manifest's gates on `bench.knee.ttft_p95_s` / `bench.knee.goodput`
  (`margin`, a fraction of the live value), else DEFAULT_TOLERANCES, never wider than the
  environment's ceiling (`max_perf_tolerance`). A tolerance widens to the LIVE release's
  run-to-run spread at that load, up to the environment's `max_perf_spread`; a spread above
  it on either release fails the comparison as an evidence gate ("too noisy to judge
  here"), never passes it.
- manifest gates with `kind: min | max` (a threshold) on any `eval.<suite>.pass_rate` or
  `bench.knee.<metric>`, and `max_increase` / `non_inferior` on other `bench.knee.*`
  metrics (relative to the live value).

With nothing live in the environment (`mode: absolute`), the candidate's own evidence must
hold: each suite evaluated on its locked file with pass rate >= its floor (the
environment's `min_pass_rate`, raised by the suite's own when set), and the SLOs at its knee.

The environment's policy (`releasekit.config.EnvironmentConfig`) is passed in; promote reads
it from a committed revision (`releasekit.promote.policy`).

The gates' verdicts and report live in `releasekit.promote.gate_results`, the evidence
read and its gates in `releasekit.promote.evidence_gates`, the perf gates in
`releasekit.promote.perf_gates`, the quality gates in `releasekit.promote.quality_gates`;
this module assembles them (`evaluate_gates`) and re-exports them.
"""

from __future__ import annotations

from releasekit.config import EnvironmentConfig, Settings
from releasekit.config.lanes import parent_env
from releasekit.promote.context import ReleaseInfo
from releasekit.promote.evidence_gates import (
    Evidence,
    _evidence_gate,
    _host_gate,
    _registered_gates,
    read_release_evidence,
)
from releasekit.promote.gate_results import (
    ALWAYS_BLOCK,
    PERF_BY_CANARY_NOTE,
    CurvePoint,
    GateKind,
    GateReport,
    GateResult,
)
from releasekit.promote.perf_gates import (
    DEFAULT_TOLERANCES,
    _knee_gates,
    _relative_perf,
    curve,
    point_metric,
    run_spread,
)
from releasekit.promote.quality_gates import (
    _comparison,
    _quality_absolute,
    _quality_relative,
    margins_here,
)
from releasekit.stores.results import ReleasePaths


def _threshold_gates(cand: Evidence) -> list[GateResult]:
    gates: list[GateResult] = []
    for g in cand.info.lm.manifest.gates:
        if g.kind not in ("min", "max") or g.threshold is None:
            continue
        value: float | None = None
        parts = g.metric.split(".")
        if parts[0] == "eval" and len(parts) == 3 and cand.eval is not None:
            s = cand.eval.suites.get(parts[1])
            value = getattr(s, parts[2], None) if s else None
        elif g.metric.startswith("bench.knee.") and cand.bench and cand.bench.knee:
            value = point_metric(cand.bench.knee, g.metric.removeprefix("bench.knee."))
        ok = value is not None and (
            value >= g.threshold if g.kind == "min" else value <= g.threshold
        )
        gates.append(
            GateResult(
                name=g.metric,
                kind="quality" if parts[0] == "eval" else "perf",
                passed=ok,
                rule=f"{g.metric} {'>=' if g.kind == 'min' else '<='} {g.threshold:g} "
                "(manifest gate)",
                candidate=float(value) if isinstance(value, int | float) else None,
                limit=g.threshold,
                detail="missing figure" if value is None else "",
            )
        )
    return gates


def evaluate_gates(
    settings: Settings,
    *,
    env: str,
    candidate: ReleaseInfo,
    live: ReleaseInfo | None,
    policy: EnvironmentConfig | None = None,
) -> GateReport:
    """Every evidence, quality and perf gate of promoting `candidate` over `live` (None:
    nothing live, absolute checks), under the environment's `policy` (default: the
    settings' `[environments.ENV]`, else the embedded defaults). Reads only; writes
    nothing."""
    policy = policy or settings.environments.get(parent_env(env)) or EnvironmentConfig(port=1)
    cand = read_release_evidence(settings, candidate)
    gates: list[GateResult] = [
        _evidence_gate("eval evidence (candidate)", cand.eval_problems, "eval results"),
        _evidence_gate("bench evidence (candidate)", cand.bench_problems, "bench results"),
        *_registered_gates(cand),
    ]
    report_kw: dict[str, object] = {}
    lev: Evidence | None = None
    if live is None:
        gates += _quality_absolute(cand, policy)
        if cand.bench is not None:
            gates += _knee_gates("candidate", cand.bench)
    else:
        lev = read_release_evidence(settings, live)
        gates += [
            _evidence_gate("eval evidence (live)", lev.eval_problems, "the live release's eval"),
            _evidence_gate("bench evidence (live)", lev.bench_problems, "the live release's bench"),
        ]
        if cand.eval is not None and lev.eval is not None:
            # A suite the live release has must be the candidate's too, on the same file; a
            # suite the live release lacks (a new one: an adapter's own) is held to its floor.
            diff = sorted(
                n
                for n in lev.eval.suites
                if (cand.eval.suites.get(n) and cand.eval.suites[n].digest)
                != lev.eval.suites[n].digest
            )
            new = sorted(n for n in cand.eval.suites if n not in lev.eval.suites)
            gates.append(
                GateResult(
                    name="same eval suites as live",
                    kind="evidence",
                    passed=not diff,
                    rule="both releases were evaluated on the same suite files (sha256); a "
                    "suite the live release lacks is held to its floor",
                    detail=(f"missing or mismatched evidence: {', '.join(diff)}" if diff else "ok")
                    + (f"; new: {', '.join(new)}" if new else ""),
                )
            )
            margins = margins_here(candidate, policy)
            cmp, source = _comparison(settings, cand, lev, margins)
            report_kw.update(
                comparison_source=source,
                comparison_rule=cmp.rule,
            )
            gates += _quality_relative(cmp, cand, margins, live_suites=set(lev.eval.suites))
            gates += _quality_absolute(cand, policy, only=new)
        else:
            gates.append(
                GateResult(
                    name="quality comparison",
                    kind="quality",
                    passed=False,
                    rule="paired comparison with the live release per suite",
                    detail="missing or mismatched evidence: no eval results on one side",
                )
            )
        if cand.bench is not None and lev.bench is not None:
            same = cand.bench.profile_digest == lev.bench.profile_digest
            gates.append(
                GateResult(
                    name="same load profile as live",
                    kind="evidence",
                    passed=same and cand.bench.profile_digest is not None,
                    rule="both releases were load-tested with the same profile (sha256)",
                    detail="ok" if same else "missing or mismatched evidence: profiles differ",
                )
            )
            gates += _knee_gates("candidate", cand.bench)
            host = _host_gate(cand, lev) if same else None
            if host is not None:
                gates.append(host)
            elif same:
                gates += _relative_perf(cand, lev, policy)
        else:
            gates.append(
                GateResult(
                    name="perf comparison",
                    kind="perf",
                    passed=False,
                    rule="SLOs, TTFT p95 and goodput at the knee against the live release",
                    detail="missing or mismatched evidence: no bench results on one side",
                )
            )
    gates += _threshold_gates(cand)
    compare_path = ReleasePaths.of(settings, candidate.release_id).report_dir / "report.html"
    linked = (
        compare_path.is_file()
        and candidate.evidence is not None
        and not candidate.evidence.problems_for("report_html")
    )
    return GateReport(
        environment=env,
        candidate_release_id=candidate.release_id,
        candidate_name=candidate.name,
        live_release_id=live.release_id if live else None,
        live_name=live.name if live else None,
        mode="absolute" if live is None else "relative",
        passed=all(g.passed for g in gates),
        gates=gates,
        comparison_path=str(compare_path) if linked else None,
        candidate_curve=curve(cand.bench),
        live_curve=curve(lev.bench) if lev else [],
        candidate_knee=cand.bench.knee.load if cand.bench and cand.bench.knee else None,
        live_knee=lev.bench.knee.load if lev and lev.bench and lev.bench.knee else None,
        **report_kw,  # type: ignore[arg-type]
    )


__all__ = [
    "ALWAYS_BLOCK",
    "DEFAULT_TOLERANCES",
    "PERF_BY_CANARY_NOTE",
    "CurvePoint",
    "Evidence",
    "GateKind",
    "GateReport",
    "GateResult",
    "curve",
    "evaluate_gates",
    "margins_here",
    "point_metric",
    "read_release_evidence",
    "run_spread",
]
