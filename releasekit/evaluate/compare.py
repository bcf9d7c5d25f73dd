"""Paired comparison of a candidate release's eval with a baseline's: one verdict per suite
that counts failures, and the rule behind it in words.

Outcomes. Items are paired on their ids. An item that errors (a timeout, a 5xx, a malformed
response, a judge that gave no verdict) is a FAILURE of the release that produced it, unless
the item expects an error (`expect_error`), where an error counts as a pass. Leaving errors
out of the pairs would let a release that fails by erroring look non-inferior.

Statistics, per suite, on the n paired items, with a = both pass, b = fail->pass (candidate
passes, baseline fails), c = pass->fail, d = both fail:

- delta = candidate pass rate - baseline pass rate = (b - c) / n, with Newcombe's hybrid
  score interval for a difference of paired proportions (method 10, `newcombe_paired_interval`)
  at level `eval.confidence`. It stays honest with few items and with no flips (one item, no
  flip: about [-0.79, +0.79] at 95%), where a percentile bootstrap collapses to [0, 0];
- McNemar: an exact two-sided binomial test on b and c (`mcnemar_exact`);
- the mean score delta with a paired bootstrap (differs from delta only for graded judge
  scores; an unexpected error scores 0), seeded with `eval.seed`;
- error regression: of the items where exactly one side errored unexpectedly, x errored for
  the candidate only and y for the baseline only; the candidate errs more beyond noise when
  x > y and the one-sided exact binomial test P(X >= x | x + y, 1/2) is below 1 - confidence.

Verdicts (`Verdict`; a gate passes only `non_inferior` and `superior`, see `Verdict.passed`):

- missing_evidence: the suite was evaluated on one side only (or not at all though the
  candidate's manifest names it), the two evals read different suite files (sha256) or a
  digest was not recorded, a side has no item records or records that disagree with its
  summary, or some item ids are on one side only. No statistics are computed;
- error_regression: the error test above;
- inferior: the interval's upper bound is below -margin;
- insufficient_evidence: fewer than `min_paired` paired items (default 30), unless inferior;
- inconclusive: the interval contains -margin (touching it counts as containing it);
- non_inferior: the interval's lower bound is above -margin;
- superior: the interval's lower bound is above 0.

A suite with missing evidence is `missing_evidence`; otherwise it takes the worst verdict that
applies, in the order of `VERDICT_ORDER` (inferior first). The comparison takes the worst
suite verdict, and is `missing_evidence` when no suite was compared.

This module pairs the items and reaches the verdicts; the models and compare.json live in
`releasekit.evaluate.comparison`, the statistics in `releasekit.evaluate.paired_stats` and
the verdicts in `releasekit.evaluate.verdicts` (all re-exported here).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from releasekit.evaluate.comparison import (
    COMPARE_JSON,
    Comparison,
    EvidenceError,
    FlippedItem,
    SideCounts,
    SuiteComparison,
    dump_comparison,
    load_comparison,
    parse_comparison,
)
from releasekit.evaluate.paired_stats import (
    mcnemar_exact,
    more_errors_p,
    newcombe_paired_interval,
    paired_bootstrap,
    wilson_interval,
)
from releasekit.evaluate.runner import EvalResult, ItemResult, SuiteSummary
from releasekit.evaluate.sensitivity import MIN_BLOCKING_FLIPS
from releasekit.evaluate.verdicts import (
    DEFAULT_MIN_PAIRED,
    VERDICT_ORDER,
    Verdict,
    interval_verdict,
    rule_text,
    worst,
)
from releasekit.spec.manifest import LoadedManifest

# ---- pairing ---------------------------------------------------------------------------


def counts_as_pass(item: ItemResult) -> bool:
    """An item's verdict for the comparison: a pass, or an error on an item that expects
    one. A fail and any other error are failures."""
    return item.outcome == "pass" or (item.outcome == "error" and item.expect_error)


def _unexpected_error(item: ItemResult) -> bool:
    return item.outcome == "error" and not item.expect_error


def side_counts(items: Sequence[ItemResult], *, digest: str = "") -> SideCounts:
    """Count one side's outcomes in a suite (see SideCounts)."""
    n = len(items)
    passed = sum(counts_as_pass(i) for i in items)
    errors = sum(_unexpected_error(i) for i in items)
    return SideCounts(
        n=n,
        passed=passed,
        failed=sum(i.outcome == "fail" for i in items),
        errors=errors,
        expected_errors=sum(i.outcome == "error" and i.expect_error for i in items),
        pass_rate=passed / n if n else None,
        error_rate=errors / n if n else None,
        digest=digest,
    )


def _score(item: ItemResult) -> float:
    if item.outcome == "error":
        return 1.0 if item.expect_error else 0.0
    if item.score is not None:
        return float(item.score)
    return 1.0 if item.passed else 0.0


def _flip(item_id: str, base: ItemResult, cand: ItemResult) -> FlippedItem:
    return FlippedItem(
        id=item_id,
        direction="pass->fail" if counts_as_pass(base) else "fail->pass",
        vars=cand.vars or base.vars,
        expected=cand.expected if cand.expected is not None else base.expected,
        baseline_output=base.output if base.output is not None else base.error,
        candidate_output=cand.output if cand.output is not None else cand.error,
        baseline_detail=base.detail or (base.error or ""),
        candidate_detail=cand.detail or (cand.error or ""),
    )


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def compare_suite(
    candidate: Sequence[ItemResult],
    baseline: Sequence[ItemResult],
    *,
    margin: float,
    confidence: float,
    samples: int,
    seed: int,
    min_paired: int = DEFAULT_MIN_PAIRED,
) -> SuiteComparison:
    """Pair one suite's items on id and compare them (see the module docstring). Evidence
    about the suite files (digests, summaries) is checked by `compare`."""
    cmap = {i.id: i for i in candidate}
    bmap = {i.id: i for i in baseline}
    common = [k for k in cmap if k in bmap]  # candidate order: stable, readable lists
    unpaired = len(set(cmap) ^ set(bmap))
    base_counts, cand_counts = side_counts(baseline), side_counts(candidate)
    missing: list[str] = []
    if not candidate:
        missing.append("no item records for the candidate")
    if not baseline:
        missing.append("no item records for the baseline")
    if unpaired and candidate and baseline:
        missing.append(
            f"{unpaired} item ids are on one side only: both evals must cover the same items"
        )
    if missing:
        return SuiteComparison(
            verdict=Verdict.MISSING_EVIDENCE,
            reasons=missing,
            margin=margin,
            min_paired=min_paired,
            baseline=base_counts,
            candidate=cand_counts,
            unpaired=unpaired,
        )
    pairs = [(k, bmap[k], cmap[k]) for k in common]
    n = len(pairs)
    base_ok = np.array([counts_as_pass(b) for _, b, _ in pairs], dtype=bool)
    cand_ok = np.array([counts_as_pass(c) for _, _, c in pairs], dtype=bool)
    both_pass = int(np.sum(base_ok & cand_ok))
    both_fail = int(np.sum(~base_ok & ~cand_ok))
    to_fail = [k for (k, _, _), b, c in zip(pairs, base_ok, cand_ok, strict=True) if b and not c]
    to_pass = [k for (k, _, _), b, c in zip(pairs, base_ok, cand_ok, strict=True) if c and not b]
    delta = (len(to_pass) - len(to_fail)) / n
    ci_low, ci_high = newcombe_paired_interval(
        both_pass, len(to_pass), len(to_fail), both_fail, confidence=confidence
    )
    s_delta, s_low, s_high = paired_bootstrap(
        [_score(c) for _, _, c in pairs],
        [_score(b) for _, b, _ in pairs],
        samples=samples,
        confidence=confidence,
        seed=seed,
    )
    err_c = sum(_unexpected_error(c) and not _unexpected_error(b) for _, b, c in pairs)
    err_b = sum(_unexpected_error(b) and not _unexpected_error(c) for _, b, c in pairs)
    err_p = more_errors_p(err_c, err_b)
    regression = err_c > err_b and err_p < 1 - confidence

    by_interval = interval_verdict(ci_low, ci_high, margin)
    reasons: list[str] = []
    found = [by_interval]
    conf = f"{100 * confidence:g}%"
    if by_interval is Verdict.INFERIOR:
        reasons.append(
            f"the {conf} interval's upper bound {100 * ci_high:+.1f} pts is below "
            f"-{100 * margin:g} pts"
        )
    elif by_interval is Verdict.INCONCLUSIVE:
        reasons.append(f"the {conf} interval contains -{100 * margin:g} pts")
    if n < min_paired and by_interval is not Verdict.INFERIOR:
        found.append(Verdict.INSUFFICIENT_EVIDENCE)
        reasons.append(f"only {n} paired items; a verdict needs at least {min_paired}")
    if regression:
        found.append(Verdict.ERROR_REGRESSION)
        reasons.append(
            f"the candidate errors on {cand_counts.errors}/{cand_counts.n} items "
            f"({_pct(cand_counts.error_rate or 0.0)}) vs {base_counts.errors}/{base_counts.n} "
            f"for the baseline ({err_c} vs {err_b} where one side errored, "
            f"one-sided exact p = {err_p:.3g})"
        )
    verdict = worst(found)
    net = len(to_fail) - len(to_pass)
    if by_interval in (Verdict.INCONCLUSIVE, Verdict.INFERIOR) and net < MIN_BLOCKING_FLIPS:
        reasons.append(
            f"the verdict rests on {max(net, 0)} net flipped item(s), fewer than the "
            f"{MIN_BLOCKING_FLIPS} a suite should need to block: it is too small for its margin "
            "(`releasekit validate` prints what each suite can detect)"
        )
    if verdict.passed:
        reasons.append(
            f"the {conf} interval's lower bound {100 * ci_low:+.1f} pts is above "
            + ("0" if verdict is Verdict.SUPERIOR else f"-{100 * margin:g} pts")
        )
    return SuiteComparison(
        verdict=verdict,
        reasons=reasons,
        margin=margin,
        min_paired=min_paired,
        n_paired=n,
        baseline=base_counts,
        candidate=cand_counts,
        baseline_pass_rate=float(base_ok.mean()),
        candidate_pass_rate=float(cand_ok.mean()),
        delta=delta,
        ci_low=ci_low,
        ci_high=ci_high,
        interval_verdict=by_interval,
        score_delta=s_delta,
        score_ci_low=s_low,
        score_ci_high=s_high,
        mcnemar_p=mcnemar_exact(len(to_fail), len(to_pass)),
        both_pass=both_pass,
        both_fail=both_fail,
        flipped_to_fail=to_fail,
        flipped_to_pass=to_pass,
        errors_only_candidate=err_c,
        errors_only_baseline=err_b,
        error_regression_p=err_p,
        error_regression=regression,
        flips=[
            _flip(k, b, c)
            for (k, b, c), bo, co in zip(pairs, base_ok, cand_ok, strict=True)
            if bo != co
        ],
    )


# ---- whole comparison ------------------------------------------------------------------


def _summary_problem(summary: SuiteSummary, items: Sequence[ItemResult]) -> str | None:
    """Why a suite's summary and its item records disagree, or None."""
    got = (
        len(items),
        sum(i.outcome == "pass" for i in items),
        sum(i.outcome == "fail" for i in items),
        sum(i.outcome == "error" for i in items),
    )
    want = (summary.n, summary.passed, summary.failed, summary.errors)
    if got == want:
        return None
    return (
        f"the summary says n={want[0]} ({want[1]} pass, {want[2]} fail, {want[3]} error) "
        f"but the item records hold n={got[0]} ({got[1]} pass, {got[2]} fail, {got[3]} error)"
    )


def _side(result: EvalResult, name: str) -> SideCounts | None:
    summary = result.suites.get(name)
    if summary is None:
        return None
    return side_counts(result.suite_items(name), digest=summary.digest)


def _min_paired(lm: LoadedManifest, name: str, override: int | None) -> int:
    if override is not None:
        return override
    # Read through getattr: the manifest gains `min_paired` (per suite and in eval) later;
    # until then the default holds.
    for s in lm.manifest.eval.suites:
        if s.name == name and isinstance(getattr(s, "min_paired", None), int):
            return int(getattr(s, "min_paired"))  # noqa: B009
    value = getattr(lm.manifest.eval, "min_paired", None)
    return value if isinstance(value, int) else DEFAULT_MIN_PAIRED


def compare(
    candidate: EvalResult,
    baseline: EvalResult,
    lm: LoadedManifest,
    *,
    min_paired: int | None = None,
) -> Comparison:
    """Compare a candidate's eval with its baseline's, suite by suite (see the module
    docstring), with the statistics settings (confidence, seed, bootstrap samples) and
    margins of the candidate's manifest `lm`.

    Every suite named by the candidate's manifest or by either eval gets a verdict: one
    evaluated on one side only, or from different suite files, is `missing_evidence`.
    `min_paired` overrides the minimum paired items per suite (default 30).
    """
    ev = lm.manifest.eval
    margins = {s.name: s.margin for s in ev.suites}
    kinds: dict[str, str] = {s.name: s.kind for s in ev.suites}
    adapters: dict[str, str | None] = {s.name: s.adapter for s in ev.suites}
    names = list(dict.fromkeys([*margins, *candidate.suites, *baseline.suites]))
    suites: dict[str, SuiteComparison] = {}
    warnings: list[str] = []
    for name in names:
        c_sum, b_sum = candidate.suites.get(name), baseline.suites.get(name)
        summary = c_sum or b_sum
        margin = margins.get(name, summary.margin if summary else 0.0)
        kind = kinds.get(name, summary.kind if summary else "")
        adapter = adapters.get(name, summary.adapter if summary else None)
        need = _min_paired(lm, name, min_paired)
        if c_sum is None or b_sum is None:
            side = (
                "not evaluated for either release"
                if summary is None
                else f"evaluated for the {'candidate' if c_sum else 'baseline'} only"
            )
            suites[name] = SuiteComparison(
                kind=kind,
                adapter=adapter,
                verdict=Verdict.MISSING_EVIDENCE,
                reasons=[f"suite {side}"],
                margin=margin,
                min_paired=need,
                candidate=_side(candidate, name),
                baseline=_side(baseline, name),
            )
            warnings.append(f"suite {name}: {side}, no comparison")
            continue
        sc = compare_suite(
            candidate.suite_items(name),
            baseline.suite_items(name),
            margin=margin,
            confidence=ev.confidence,
            samples=ev.bootstrap_samples,
            seed=ev.seed,
            min_paired=need,
        )
        problems: list[str] = []
        same: bool | None = None
        if not c_sum.digest or not b_sum.digest:
            which = " and ".join(
                side for side, s in (("candidate", c_sum), ("baseline", b_sum)) if not s.digest
            )
            problems.append(f"no suite-file digest recorded for the {which}")
        else:
            same = c_sum.digest == b_sum.digest
            if not same:
                problems.append(
                    f"the two evals read different suite files (sha256 {b_sum.digest[:12]} "
                    f"for the baseline, {c_sum.digest[:12]} for the candidate)"
                )
        for side, s, res in (("candidate", c_sum, candidate), ("baseline", b_sum, baseline)):
            problem = _summary_problem(s, res.suite_items(name))
            if problem:
                problems.append(f"{side}: {problem}")
        update: dict[str, object] = {
            "kind": kind,
            "adapter": adapter,
            "same_suite_file": same,
            "candidate_noise": candidate.noise.suites.get(name) if candidate.noise else None,
            "baseline_noise": baseline.noise.suites.get(name) if baseline.noise else None,
        }
        if sc.baseline is not None:
            update["baseline"] = sc.baseline.model_copy(update={"digest": b_sum.digest})
        if sc.candidate is not None:
            update["candidate"] = sc.candidate.model_copy(update={"digest": c_sum.digest})
        if problems and sc.verdict is not Verdict.MISSING_EVIDENCE:
            # The statistics are not evidence when the two sides did not run the same items.
            sc = SuiteComparison(
                verdict=Verdict.MISSING_EVIDENCE,
                reasons=problems,
                margin=margin,
                min_paired=need,
                baseline=sc.baseline,
                candidate=sc.candidate,
                unpaired=sc.unpaired,
            )
        elif problems:
            update["reasons"] = [*problems, *sc.reasons]
        sc = sc.model_copy(update=update)
        if sc.verdict is Verdict.MISSING_EVIDENCE:
            warnings += [f"suite {name}: {p}" for p in sc.reasons]
        suites[name] = sc
    missing = sorted(n for n in names if n not in candidate.suites or n not in baseline.suites)
    need_all = min_paired if min_paired is not None else _min_paired(lm, "", None)
    return Comparison(
        baseline_release_id=baseline.release_id,
        candidate_release_id=candidate.release_id,
        baseline_name=baseline.name,
        candidate_name=candidate.name,
        verdict=worst([s.verdict for s in suites.values()]),
        confidence=ev.confidence,
        min_paired=need_all,
        bootstrap_samples=ev.bootstrap_samples,
        seed=ev.seed,
        rule=rule_text(confidence=ev.confidence, min_paired=need_all),
        suites=suites,
        missing_suites=missing,
        warnings=warnings,
    )


__all__ = [
    "COMPARE_JSON",
    "DEFAULT_MIN_PAIRED",
    "VERDICT_ORDER",
    "Comparison",
    "EvidenceError",
    "FlippedItem",
    "SideCounts",
    "SuiteComparison",
    "Verdict",
    "compare",
    "compare_suite",
    "counts_as_pass",
    "dump_comparison",
    "interval_verdict",
    "load_comparison",
    "mcnemar_exact",
    "more_errors_p",
    "newcombe_paired_interval",
    "paired_bootstrap",
    "parse_comparison",
    "rule_text",
    "side_counts",
    "wilson_interval",
    "worst",
]
