"""Walk a quantisation ladder: build each rung as a release (cached like any build), compare
it item by item with the unquantised base on every suite, price it, stop at the first rung
inferior on a critical suite, and recommend the cheapest rung above it (`decide`).

Every figure is read from the releases' evidence as their signed `register` events vouch for
it (`promote.evidence_gates.read_release_evidence`), the same files a promotion reads: every
row is a registered release that can be promoted as it stands."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from releasekit._support.files import write_atomic
from releasekit._support.progress import Progress
from releasekit.build.dvc import project_relative
from releasekit.config import Settings
from releasekit.errors import LadderError, ReleasekitError
from releasekit.evaluate.compare import compare, counts_as_pass
from releasekit.evaluate.runner import EvalResult
from releasekit.ladder.decide import (
    cost_per_1k_good,
    recommend,
    rung_status,
    stop_reason,
    stops_ladder,
)
from releasekit.ladder.models import LadderResult, RungRow, SuiteDelta, TagDelta
from releasekit.promote.context import load_release
from releasekit.promote.evidence_gates import read_release_evidence
from releasekit.spec.hostcaps import check_scheme
from releasekit.spec.ladder import (
    RECIPE_INPUTS,
    Ladder,
    Rung,
    derive_manifest,
    load_ladder,
    recipe_label,
    rung_manifest_path,
)
from releasekit.spec.lock import build_lock, serving_args
from releasekit.spec.manifest import LoadedManifest, load_manifest, parse_manifest
from releasekit.spec.quantrecipe import calibration_notes
from releasekit.stores.evidence import QuantiseSummary
from releasekit.stores.ledger import open_ledger

Builder = Callable[..., Any]
"""`releasekit.build.pipeline.build` (a stand-in in tests that cannot start vLLM)."""


def _serving(lm: LoadedManifest) -> tuple[dict[str, Any], dict[str, str]]:
    """What a server of the manifest runs with, but for the KV cache's dtype (part of the
    recipe: `quantisation.kv_cache_dtype`)."""
    args = {k: v for k, v in serving_args(lm.manifest).items() if k != "kv-cache-dtype"}
    return args, dict(lm.manifest.serving.env)


def prepare(
    settings: Settings, base_path: Path, ladder_path: Path
) -> tuple[LoadedManifest, Ladder, list[tuple[Rung, LoadedManifest]]]:
    """Load the base and the ladder, write the derived rung manifests (only where their
    bytes change), and check each rung differs from the base in its recipe alone.
    LadderError / ManifestError before anything is built."""
    base = load_manifest(base_path, root=settings.root)
    if base.manifest.quantisation.scheme != "none":
        raise LadderError(
            f"{project_relative(base.path, settings.root)}: the ladder's base must be "
            f"unquantised (scheme none), not {base.manifest.quantisation.scheme}: every rung "
            "is compared with it"
        )
    ladder = load_ladder(ladder_path)
    base_data = yaml.safe_load(base.path.read_text(encoding="utf-8"))
    base_inputs = build_lock(base).inputs
    rungs: list[tuple[Rung, LoadedManifest]] = []
    for rung in ladder.rungs:
        path = rung_manifest_path(ladder_path, rung)
        path = path if path.is_absolute() else settings.root / path
        if rung.quantisation is not None:
            text = derive_manifest(
                base_data,
                rung,
                base_path=project_relative(base.path, settings.root),
                ladder_path=project_relative(ladder_path, settings.root),
            )
            parse_manifest(yaml.safe_load(text), path=path)  # valid before it is written
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                path.parent.mkdir(parents=True, exist_ok=True)
                write_atomic(path, text.encode())
        lm = load_manifest(path, root=settings.root)
        if lm.manifest.name != rung.name:
            raise LadderError(
                f"rung {rung.name}: its manifest {project_relative(path, settings.root)} is named "
                f"{lm.manifest.name}; give the rung the manifest's name"
            )
        if lm.manifest.quantisation.scheme == "none":
            raise LadderError(
                f"rung {rung.name}: {project_relative(path, settings.root)} is not quantised"
            )
        inputs = build_lock(lm).inputs
        differ = sorted(
            k
            for k in set(inputs) | set(base_inputs)
            if not k.startswith(RECIPE_INPUTS)
            and k != "serving"
            and inputs.get(k) != base_inputs.get(k)
        )
        if _serving(lm) != _serving(base):
            differ.append("serving")
        if differ:
            raise LadderError(
                f"rung {rung.name}: {project_relative(path, settings.root)} differs from the "
                f"base in more than its recipe ({', '.join(differ[:6])}): a ladder compares "
                "recipes alone"
            )
        rungs.append((rung, lm))
    return base, ladder, rungs


def _tags(suite: str, cand: EvalResult, base: EvalResult) -> list[TagDelta]:
    """Per tag of a suite: items passed on each side, lost and gained (paired by id)."""
    b_items = {i.id: i for i in base.suite_items(suite)}
    acc: dict[str, list[int]] = {}
    for c in cand.suite_items(suite):
        b = b_items.get(c.id)
        if b is None:
            continue
        bp, cp = counts_as_pass(b), counts_as_pass(c)
        for tag in c.tags:
            n, bpass, cpass, lost, gained = acc.setdefault(tag, [0, 0, 0, 0, 0])
            acc[tag] = [
                n + 1,
                bpass + bp,
                cpass + cp,
                lost + (bp and not cp),
                gained + (cp and not bp),
            ]
    return [
        TagDelta(suite=suite, tag=t, n=v[0], base_passed=v[1], passed=v[2], lost=v[3], gained=v[4])
        for t, v in sorted(acc.items())
    ]


def _good_rate(ev: EvalResult, lm: LoadedManifest) -> float | None:
    """Share of answers that pass, pooled over the core suites (the business cases)."""
    core = {s.name for s in lm.manifest.eval.suites if s.kind == "core"}
    passed = sum(s.passed for n, s in ev.suites.items() if n in core)
    judged = sum(s.passed + s.failed for n, s in ev.suites.items() if n in core)
    return passed / judged if judged else None


def _measure(
    settings: Settings, row: RungRow, release_id: str, ledger: Any, price: float | None
) -> tuple[RungRow, EvalResult | None, LoadedManifest | None]:
    """Fill a built rung's row from its verified evidence; its eval for the comparison."""
    info = load_release(settings, release_id, ledger=ledger)
    ev = read_release_evidence(settings, info)
    row.release_id = release_id
    problems = ev.eval_problems + ev.bench_problems
    if info.evidence is not None and not info.evidence.problems_for("quantise"):
        try:
            q = QuantiseSummary.model_validate_json(info.evidence.read_bytes("quantise"))
            row.weights_bytes, row.weights_digest = q.size_after_bytes, q.weights_digest
        except (ReleasekitError, ValueError) as exc:
            problems.append(f"quantise.json: {exc}")
    best: float | None = None  # the knee's highest goodput run (one stray set aside)
    if ev.bench is not None:
        knee = ev.bench.knee
        row.memory_bytes = ev.bench.server_memory_bytes
        row.measured_on = ev.bench.host.label if ev.bench.host else None
        if knee is not None:
            row.knee_load, row.knee_goodput = knee.load, knee.goodput
            row.knee_tokens_per_s = knee.output_token_throughput
            runs = knee.spread.get("goodput")
            if runs is not None:
                best = runs.trimmed_max if runs.trimmed_max is not None else runs.max
    if ev.eval is not None:
        row.good_rate = _good_rate(ev.eval, info.lm)
    row.cost_per_1k_good = cost_per_1k_good(price, row.knee_goodput, row.good_rate)
    row.cost_best_run_per_1k_good = cost_per_1k_good(price, best, row.good_rate)
    if problems:
        row.note = "; ".join(problems[:2])
    return row, ev.eval, info.lm


def _compare(
    row: RungRow, cand: EvalResult, base: EvalResult, lm: LoadedManifest, critical: set[str]
) -> None:
    cmp = compare(cand, base, lm)
    for name, sc in cmp.suites.items():
        row.suites.append(
            SuiteDelta(
                suite=name,
                critical=name in critical,
                verdict=str(sc.verdict.value),
                margin=sc.margin,
                base_passed=sc.baseline.passed if sc.baseline else None,
                passed=sc.candidate.passed if sc.candidate else None,
                n=sc.n_paired or None,
                delta=sc.delta,
                ci_low=sc.ci_low,
                ci_high=sc.ci_high,
                lost=list(sc.flipped_to_fail),
                gained=list(sc.flipped_to_pass),
            )
        )
        row.tags += _tags(name, cand, base)
    row.status = rung_status(row.suites)


def run_ladder(
    settings: Settings,
    base_path: Path,
    ladder_path: Path,
    *,
    builder: Builder,
    progress: Progress | None = None,
) -> LadderResult:
    """Build and judge every rung down to the first critical loss (see the module)."""
    started = time.monotonic()
    base, ladder, rungs = prepare(settings, base_path, ladder_path)
    critical = {s.name for s in base.manifest.eval.suites if s.critical}
    if not critical:  # nothing marked: every suite is one the business needs
        critical = {s.name for s in base.manifest.eval.suites}
    base_row = RungRow(
        name=base.manifest.name,
        manifest=project_relative(base.path, settings.root),
        recipe="unquantised",
        scheme="none",
        status="base",
    )
    built = builder(settings, base.path, progress=progress)
    base_row.reused = bool(built.up_to_date)
    ledger = open_ledger(settings, read_only=True)
    base_row, base_eval, _ = _measure(
        settings, base_row, built.release_id, ledger, ladder.unit_cost_per_hour
    )
    if base_eval is None:
        raise LadderError(
            f"the base {base.manifest.name} has no usable eval results ({base_row.note}): "
            "no rung can be compared with it"
        )
    rows = [base_row]
    stopped: RungRow | None = None
    for rung, lm in rungs:
        row = RungRow(
            name=rung.name,
            manifest=project_relative(lm.path, settings.root),
            recipe=recipe_label(lm.manifest.quantisation),
            scheme=lm.manifest.quantisation.scheme,
            status="not tried",
        )
        rows.append(row)
        if stopped is not None:
            row.note = f"below {stopped.name}, where the ladder stopped"
            continue
        check = check_scheme(lm, python=settings.python)
        if check.problems:
            row.status, row.note = "not servable here", check.problems[0]
            continue
        notes = calibration_notes(lm)
        try:
            result = builder(settings, lm.path, progress=progress)
        except ReleasekitError as exc:
            row.status, row.note = "failed", exc.message.splitlines()[0]
            continue
        row.reused = bool(result.up_to_date)
        row.recipe_notes = notes
        ledger = open_ledger(settings, read_only=True)
        row, cand_eval, cand_lm = _measure(
            settings, row, result.release_id, ledger, ladder.unit_cost_per_hour
        )
        if cand_eval is None or cand_lm is None:
            row.status = "inconclusive"
            continue
        _compare(row, cand_eval, base_eval, cand_lm, critical)
        if stops_ladder(row):
            stopped = row
    pick, why = recommend([r for r in rows], tolerance=ladder.cost_tolerance)
    return LadderResult(
        ladder=project_relative(ladder_path, settings.root),
        base=project_relative(base.path, settings.root),
        host=base_row.measured_on,
        unit_cost_per_hour=ladder.unit_cost_per_hour,
        cost_tolerance=ladder.cost_tolerance,
        critical_suites=sorted(critical),
        rows=rows,
        stopped_at=stopped.name if stopped else None,
        stop_reason=stop_reason(stopped) if stopped else None,
        recommended=pick.name if pick else None,
        recommended_manifest=pick.manifest if pick else None,
        recommended_release_id=pick.release_id if pick else None,
        recommendation=why,
        seconds=round(time.monotonic() - started, 1),
    )
