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
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, Field

from releasekit._support.digests import digest_obj
from releasekit.bench.runner import BenchResult, load_bench
from releasekit.bench.stats import PointResult
from releasekit.config import EnvironmentConfig, Settings
from releasekit.errors import ReleasekitError
from releasekit.evaluate.compare import Comparison, compare
from releasekit.evaluate.comparison import parse_comparison
from releasekit.evaluate.runner import ITEMS_JSONL, EvalResult, load_result, parse_result
from releasekit.promote.context import ReleaseInfo
from releasekit.spec.manifest import LoadedManifest, Suite
from releasekit.spec.measured import same_host
from releasekit.stores.results import ReleasePaths

GateKind = Literal["policy", "evidence", "quality", "perf", "approval", "shadow"]

DEFAULT_TOLERANCES: dict[str, float] = {"ttft_p95_s": 0.25, "goodput": 0.10}
"""Relative tolerances at the knee when the manifest names no gate for the metric."""

ALWAYS_BLOCK = frozenset({"policy", "approval"})
"""Gate kinds that block in every environment: a rolled-back release, a missing approval."""
PERF_BY_CANARY_NOTE = "advisory here: the canary steps judge performance on live traffic"
_HIGHER_BETTER = {"goodput", "output_token_throughput", "request_throughput", "load"}


class GateResult(BaseModel):
    """One gate: did it pass, on what numbers, by which rule."""

    name: str
    kind: GateKind
    passed: bool
    rule: str = Field(description="the rule, in words")
    candidate: float | None = None
    live: float | None = None
    limit: float | None = Field(None, description="the bound the candidate had to meet")
    detail: str = ""
    advisory: bool = Field(
        False,
        description="shown but not blocking: failed, and judged elsewhere (an environment "
        "whose canary steps judge performance live)",
    )
    against_live: bool = Field(
        False,
        description="a perf comparison with the live release at its knee load: the kind a "
        "canary judges on live traffic (`perf_by_canary`); the candidate's own knee and the "
        "manifest's thresholds are not",
    )

    @property
    def blocks(self) -> bool:
        """Failed, and not advisory."""
        return not self.passed and not self.advisory


class CurvePoint(BaseModel):
    """One load point of a latency-throughput curve."""

    load: float
    output_token_throughput: float
    goodput: float
    ttft_p95_s: float | None
    e2e_p95_s: float | None
    slo_ok: bool


class GateReport(BaseModel):
    """Every gate of one promotion attempt; `passed` when all pass."""

    environment: str
    candidate_release_id: str
    candidate_name: str
    live_release_id: str | None = None
    live_name: str | None = None
    mode: Literal["relative", "absolute"]
    passed: bool
    gates: list[GateResult]
    comparison_source: Literal["report", "computed"] | None = None
    comparison_rule: str | None = None
    comparison_path: str | None = Field(None, description="the candidate's compare report")
    candidate_curve: list[CurvePoint] = Field(default_factory=list)
    live_curve: list[CurvePoint] = Field(default_factory=list)
    candidate_knee: float | None = None
    live_knee: float | None = None
    policy_source: str | None = Field(
        None, description="where the environment's policy came from (revision, commit, digest)"
    )
    scaling: str | None = Field(
        None,
        description="a Ray environment's autoscaling plan for the candidate, one line: the "
        "replica range and the per-replica target derived from its knee",
    )
    created_at: dt.datetime = Field(default_factory=lambda: dt.datetime.now(dt.UTC))

    @property
    def failed(self) -> list[GateResult]:
        """The gates that failed and block (advisory ones are in `advisory_failed`)."""
        return [g for g in self.gates if g.blocks]

    @property
    def advisory_failed(self) -> list[GateResult]:
        """The gates that failed but are advisory here."""
        return [g for g in self.gates if not g.passed and g.advisory]

    def with_gates(self, extra: list[GateResult]) -> GateReport:
        """This report with `extra` gates first (policy), `passed` recomputed."""
        return self._with([*extra, *self.gates])

    def _with(self, gates: list[GateResult]) -> GateReport:
        """This report with `gates` instead, `passed` recomputed from them."""
        return self.model_copy(update={"gates": gates, "passed": not any(g.blocks for g in gates)})

    def advisory(self, kinds: Collection[str] | None, note: str) -> GateReport:
        """This report with its failed gates of `kinds` (None: every kind but policy and
        approval, which always block) advisory, `note` added to their detail. `passed`
        recomputed: the one rule for what blocks is `GateResult.blocks`."""

        def here(g: GateResult) -> bool:
            if g.passed or g.advisory or g.kind in ALWAYS_BLOCK:
                return False
            return kinds is None or g.kind in kinds

        gates = [
            g.model_copy(update={"advisory": True, "detail": f"{g.detail} ({note})"})
            if here(g)
            else g
            for g in self.gates
        ]
        return self._with(gates)

    def perf_judged_live(self) -> GateReport:
        """This report with its failed perf comparisons with the live release advisory
        (`against_live`): the release's canary steps judge them on live traffic instead
        (`perf_by_canary`). The SLOs at the candidate's own knee and the manifest's
        thresholds still block."""
        gates = [
            g.model_copy(update={"advisory": True, "detail": f"{g.detail} ({PERF_BY_CANARY_NOTE})"})
            if g.kind in ("perf", "evidence") and g.against_live and not g.passed and not g.advisory
            else g
            for g in self.gates
        ]
        return self._with(gates)


@dataclass
class Evidence:
    """One release's eval and bench results as read (None, with why, when unusable)."""

    info: ReleaseInfo
    eval: EvalResult | None = None
    bench: BenchResult | None = None
    eval_problems: list[str] = field(default_factory=list)
    bench_problems: list[str] = field(default_factory=list)


def read_release_evidence(settings: Settings, info: ReleaseInfo) -> Evidence:
    """Read and check a release's eval and bench results: first against the digests its
    verified register event signed (`info.evidence`, from `load_release`; a file that
    differs is a problem naming it, and is not read), then against its own lock."""
    paths = ReleasePaths.of(settings, info.release_id)
    ev = Evidence(info=info)
    ve = info.evidence
    unchecked = f"release {info.short_id}'s evidence was not checked against its register event"
    eval_signed = ve.problems_for("eval", "eval_items") if ve is not None else [unchecked]
    if eval_signed:
        ev.eval_problems += eval_signed
    elif ve is not None:
        try:
            if not (paths.eval.is_file() and (paths.eval_dir / ITEMS_JSONL).is_file()):
                ev.eval = load_result(paths.eval_dir)  # raises: names the missing file
            else:
                ev.eval = parse_result(
                    ve.read_bytes("eval"), ve.read_bytes("eval_items"), paths.eval_dir
                )
        except ReleasekitError as exc:
            ev.eval_problems.append(f"no usable eval results: {exc.message}")
    if ev.eval is not None:
        if ev.eval.release_id != info.release_id:
            ev.eval_problems.append(
                f"eval results are for release {str(ev.eval.release_id)[:12]}, not this one"
            )
        for s in info.lm.manifest.eval.suites:
            got = ev.eval.suites.get(s.name)
            if got is None:
                ev.eval_problems.append(f"suite {s.name} was not evaluated")
                continue
            locked = info.lock.inputs.get(f"eval/{s.name}")
            made = digest_obj(
                {"file": got.digest, "suite": s.model_dump(mode="json", exclude={"path"})}
            )
            if not got.digest or locked != made:
                ev.eval_problems.append(
                    f"suite {s.name} was evaluated on a file or config other than the locked one"
                )
    bench_signed = ve.problems_for("bench") if ve is not None else [unchecked]
    if bench_signed:
        ev.bench_problems += bench_signed
    elif ve is not None:
        try:
            if not paths.bench.is_file():
                ev.bench = load_bench(paths.bench_dir)  # raises: names the missing file
            else:
                ev.bench = BenchResult.model_validate_json(ve.read_bytes("bench"))
        except ReleasekitError as exc:
            ev.bench_problems.append(f"no usable bench results: {exc.message}")
        except ValueError as exc:
            first = str(exc).strip().splitlines()[0]
            ev.bench_problems.append(f"no usable bench results: unreadable {paths.bench}: {first}")
    if ev.bench is not None:
        if ev.bench.release_id != info.release_id:
            ev.bench_problems.append(
                f"bench results are for release {str(ev.bench.release_id)[:12]}, not this one"
            )
        if ev.bench.profile_digest != info.lock.inputs.get("load/profile"):
            ev.bench_problems.append("bench results were made with another load profile")
    return ev


def _registered_gates(cand: Evidence) -> list[GateResult]:
    """The candidate's manifest and comparison report are the ones its register event
    signed: a manifest edited after registration, or a compare.json / report.html that
    differs, fails as evidence (the comparison is then not taken from the file)."""
    info, gates = cand.info, []
    if info.edited_manifest is not None:
        gates.append(
            GateResult(
                name="manifest as registered",
                kind="evidence",
                passed=False,
                rule="the manifest's gates, environments, promotion and watch sections are "
                "the ones the release's register event signed",
                detail=info.edited_manifest,
            )
        )
    ve = info.evidence
    if ve is not None and ("compare" in ve.files or "report_html" in ve.files):
        probs = [p for k in ("compare", "report_html") if (p := ve.file_problem(k))]
        if probs:
            gates.append(
                GateResult(
                    name="comparison report (candidate)",
                    kind="evidence",
                    passed=False,
                    rule="the comparison report is the one the release's register event signed",
                    detail="; ".join(probs),
                )
            )
    return gates


def _host_gate(cand: Evidence, live: Evidence) -> GateResult | None:
    """A failed evidence gate when the two releases were benched on different host kinds or
    core counts (or either bench records no host): their perf cannot be compared."""
    assert cand.bench is not None and live.bench is not None
    ch, lh = cand.bench.host, live.bench.host
    why = same_host(ch, lh)
    if why is None:
        return None
    where = "; ".join(
        f"{side}: {h.label if h is not None else 'no host recorded'}"
        for side, h in (("candidate", ch), ("live", lh))
    )
    return GateResult(
        name="benched on the same host kind as live",
        kind="evidence",
        against_live=True,
        passed=False,
        rule="a perf comparison is made only between load tests of one host kind (CPU "
        "vendor, model and instruction-set level, GPUs) and core count",
        detail=f"benched on another host ({why}; {where}): rebench live beside it, on "
        "the candidate's host kind and core count, or let a canary judge performance "
        "against live traffic",
    )


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


def _evidence_gate(name: str, problems: list[str], what: str) -> GateResult:
    return GateResult(
        name=name,
        kind="evidence",
        passed=not problems,
        rule=f"{what} must exist, be made for this release, on its locked inputs",
        detail="; ".join(problems) or "ok",
    )


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
    """(max - min) / median of `metric` over the repetitions of a load point (0 with fewer
    than two runs, or for a figure the runs do not record): the host's own noise there."""
    s = p.spread.get(metric)
    if s is None or s.n < 2 or s.min is None or s.max is None or not s.median:
        return 0.0
    return (s.max - s.min) / abs(s.median)


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
        rule=f"each release's run-to-run spread of {metric} at the live knee load "
        f"((max - min) / median of its runs) at most {cap:g} (max_perf_spread)",
        limit=cap,
        live=spreads.get("live"),
        candidate=spreads.get("candidate"),
        detail="too noisy to judge here ("
        + ", ".join(f"{side} spread {v:.2f}" for side, v in over.items())
        + f" > {cap:g}): a registered release's load test is the one its register event "
        "signed, so judge performance live (a canary step) or override it by name",
    )


def _relative_perf(cand: Evidence, live: Evidence, policy: EnvironmentConfig) -> list[GateResult]:
    assert cand.bench is not None and live.bench is not None
    gates: list[GateResult] = []
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
        higher = metric in _HIGHER_BETTER
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
                f"((max - min) / median of its runs; at most {cap:g})",
            )
        )
    return gates


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
    cmp: Comparison, cand: Evidence, margins: dict[str, tuple[float, float]]
) -> list[GateResult]:
    gates: list[GateResult] = []
    conf = f"{100 * cmp.confidence:g}%"
    for name in [s.name for s in cand.info.lm.manifest.eval.suites] + [
        n for n in cmp.suites if n not in {s.name for s in cand.info.lm.manifest.eval.suites}
    ]:
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


def _quality_absolute(cand: Evidence, policy: EnvironmentConfig) -> list[GateResult]:
    gates: list[GateResult] = []
    for s in cand.info.lm.manifest.eval.suites:
        got = cand.eval.suites.get(s.name) if cand.eval else None
        rate = got.pass_rate if got else None
        need, source = _floor(s, policy)
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
    policy = policy or settings.environments.get(env) or EnvironmentConfig(port=1)
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
            diff = sorted(
                n
                for n in {*cand.eval.suites, *lev.eval.suites}
                if (cand.eval.suites.get(n) and cand.eval.suites[n].digest)
                != (lev.eval.suites.get(n) and lev.eval.suites[n].digest)
            )
            gates.append(
                GateResult(
                    name="same eval suites as live",
                    kind="evidence",
                    passed=not diff,
                    rule="both releases were evaluated on the same suite files (sha256)",
                    detail=(f"missing or mismatched evidence: {', '.join(diff)}" if diff else "ok"),
                )
            )
            margins = margins_here(candidate, policy)
            cmp, source = _comparison(settings, cand, lev, margins)
            report_kw.update(
                comparison_source=source,
                comparison_rule=cmp.rule,
            )
            gates += _quality_relative(cmp, cand, margins)
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
