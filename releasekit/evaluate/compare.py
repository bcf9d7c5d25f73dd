"""Paired comparison of a candidate release's eval with a baseline's.

Per suite, items are paired on their ids. Pairs where either side is an `error` are left
out (and counted), as are ids present on one side only. On the remaining pairs:

- delta = candidate pass rate - baseline pass rate, with a paired (percentile) bootstrap
  confidence interval: resample item pairs with replacement `eval.bootstrap_samples` times
  from a generator seeded with `eval.seed`, at level `eval.confidence`;
- the same for the mean score (equal to the pass-rate delta for pass/fail scorers; differs
  for graded judge scores);
- an exact McNemar test: a two-sided binomial test (scipy.stats.binomtest, p = 1/2) on the
  discordant pairs, b = pass->fail and c = fail->pass; p = 1 when there are none;
- a non-inferiority verdict against the suite's `margin`, fixed in the manifest before the
  run: "non-inferior" if ci_low > -margin, "inferior" if ci_high < -margin, else
  "inconclusive".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
from pydantic import BaseModel, Field

from releasekit.evaluate.runner import EvalResult, ItemResult, SuiteNoise
from releasekit.evaluate.suites import Expected
from releasekit.spec.manifest import LoadedManifest

Verdict = Literal["non-inferior", "inferior", "inconclusive"]

_MAX_DRAW = 4_000_000  # indices drawn per bootstrap block: bounds memory for big suites


class FlippedItem(BaseModel):
    """An item whose verdict changed between baseline and candidate, with both answers."""

    id: str
    direction: Literal["pass->fail", "fail->pass"]
    vars: dict[str, str] = Field(default_factory=dict)
    expected: Expected = None
    baseline_output: str | None = None
    candidate_output: str | None = None
    baseline_detail: str = ""
    candidate_detail: str = ""


class SuiteComparison(BaseModel):
    """The paired comparison of one suite (see the module docstring)."""

    kind: str = ""
    n_paired: int
    baseline_pass_rate: float | None
    candidate_pass_rate: float | None
    delta: float | None
    ci_low: float | None
    ci_high: float | None
    score_delta: float | None = None
    score_ci_low: float | None = None
    score_ci_high: float | None = None
    mcnemar_p: float | None
    both_pass: int = 0
    both_fail: int = 0
    flipped_to_fail: list[str] = Field(default_factory=list)
    flipped_to_pass: list[str] = Field(default_factory=list)
    errors_baseline: int = 0
    errors_candidate: int = 0
    excluded_errors: int = Field(0, description="pairs left out: an error on either side")
    unpaired: int = Field(0, description="ids present in only one of the two results")
    margin: float
    verdict: Verdict
    same_suite_file: bool | None = Field(
        None, description="both evals read a suite file with the same sha256"
    )
    baseline_noise: SuiteNoise | None = None
    candidate_noise: SuiteNoise | None = None
    flips: list[FlippedItem] = Field(default_factory=list)


class Comparison(BaseModel):
    """Candidate vs baseline across suites; `verdict` is the worst suite verdict."""

    baseline_release_id: str | None
    candidate_release_id: str | None
    baseline_name: str = ""
    candidate_name: str = ""
    verdict: Verdict
    confidence: float
    bootstrap_samples: int
    seed: int
    suites: dict[str, SuiteComparison]
    missing_suites: list[str] = Field(
        default_factory=list, description="suites evaluated on one side only"
    )
    warnings: list[str] = Field(default_factory=list)


def mcnemar_exact(b: int, c: int) -> float:
    """Exact two-sided McNemar p-value from the discordant counts b and c."""
    if b + c == 0:
        return 1.0
    from scipy.stats import binomtest  # imported here: scipy adds ~0.4 s to CLI start-up

    return float(binomtest(b, b + c, 0.5, alternative="two-sided").pvalue)


def paired_bootstrap(
    candidate: Sequence[float] | np.ndarray,
    baseline: Sequence[float] | np.ndarray,
    *,
    samples: int,
    confidence: float,
    seed: int,
) -> tuple[float, float, float]:
    """Mean paired difference (candidate - baseline) and its percentile bootstrap CI.

    Pairs are resampled together, so the interval reflects the correlation between the two
    releases on the same items. Deterministic for a given `seed`.
    """
    cand = np.asarray(candidate, dtype=float)
    base = np.asarray(baseline, dtype=float)
    if cand.shape != base.shape or cand.ndim != 1 or cand.size == 0:
        raise ValueError("paired_bootstrap needs two equal-length, non-empty 1-d sequences")
    diff = cand - base
    n = diff.size
    rng = np.random.default_rng(seed)
    means = np.empty(samples)
    block = max(1, _MAX_DRAW // n)
    for start in range(0, samples, block):
        stop = min(samples, start + block)
        idx = rng.integers(0, n, size=(stop - start, n))
        means[start:stop] = diff[idx].mean(axis=1)
    alpha = 1.0 - confidence
    low, high = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    return float(diff.mean()), float(low), float(high)


def non_inferiority(ci_low: float | None, ci_high: float | None, margin: float) -> Verdict:
    """Verdict on candidate - baseline with the CI [ci_low, ci_high] against -margin."""
    if ci_low is None or ci_high is None:
        return "inconclusive"
    if ci_low > -margin:
        return "non-inferior"
    if ci_high < -margin:
        return "inferior"
    return "inconclusive"


def _flip(item_id: str, base: ItemResult, cand: ItemResult) -> FlippedItem:
    return FlippedItem(
        id=item_id,
        direction="pass->fail" if base.passed else "fail->pass",
        vars=cand.vars or base.vars,
        expected=cand.expected if cand.expected is not None else base.expected,
        baseline_output=base.output if base.output is not None else base.error,
        candidate_output=cand.output if cand.output is not None else cand.error,
        baseline_detail=base.detail or (base.error or ""),
        candidate_detail=cand.detail or (cand.error or ""),
    )


def compare_suite(
    candidate: Sequence[ItemResult],
    baseline: Sequence[ItemResult],
    *,
    margin: float,
    confidence: float,
    samples: int,
    seed: int,
) -> SuiteComparison:
    """Pair one suite's items on id and compare them (see the module docstring)."""
    cmap = {i.id: i for i in candidate}
    bmap = {i.id: i for i in baseline}
    common = [i for i in cmap if i in bmap]  # candidate order: stable, readable lists
    unpaired = len(set(cmap) ^ set(bmap))
    pairs = [
        (k, bmap[k], cmap[k])
        for k in common
        if bmap[k].outcome != "error" and cmap[k].outcome != "error"
    ]
    to_fail = [k for k, b, c in pairs if b.passed and not c.passed]
    to_pass = [k for k, b, c in pairs if c.passed and not b.passed]
    n = len(pairs)
    delta = ci_low = ci_high = s_delta = s_low = s_high = None
    b_rate = c_rate = None
    if n:
        cand_ok = np.array([c.passed for _, _, c in pairs], dtype=float)
        base_ok = np.array([b.passed for _, b, _ in pairs], dtype=float)
        b_rate, c_rate = float(base_ok.mean()), float(cand_ok.mean())
        delta, ci_low, ci_high = paired_bootstrap(
            cand_ok, base_ok, samples=samples, confidence=confidence, seed=seed
        )
        cand_s = np.array([_score(c) for _, _, c in pairs])
        base_s = np.array([_score(b) for _, b, _ in pairs])
        s_delta, s_low, s_high = paired_bootstrap(
            cand_s, base_s, samples=samples, confidence=confidence, seed=seed
        )
    flips = [_flip(k, b, c) for k, b, c in pairs if b.passed != c.passed]
    return SuiteComparison(
        n_paired=n,
        baseline_pass_rate=b_rate,
        candidate_pass_rate=c_rate,
        delta=delta,
        ci_low=ci_low,
        ci_high=ci_high,
        score_delta=s_delta,
        score_ci_low=s_low,
        score_ci_high=s_high,
        mcnemar_p=mcnemar_exact(len(to_fail), len(to_pass)) if n else None,
        both_pass=sum(b.passed and c.passed for _, b, c in pairs),
        both_fail=sum(not b.passed and not c.passed for _, b, c in pairs),
        flipped_to_fail=to_fail,
        flipped_to_pass=to_pass,
        errors_baseline=sum(i.outcome == "error" for i in baseline),
        errors_candidate=sum(i.outcome == "error" for i in candidate),
        excluded_errors=len(common) - n,
        unpaired=unpaired,
        margin=margin,
        verdict=non_inferiority(ci_low, ci_high, margin),
        flips=flips,
    )


def _score(item: ItemResult) -> float:
    if item.score is not None:
        return float(item.score)
    return 1.0 if item.passed else 0.0


def _worst(verdicts: Sequence[Verdict]) -> Verdict:
    if "inferior" in verdicts:
        return "inferior"
    if "inconclusive" in verdicts or not verdicts:
        return "inconclusive"
    return "non-inferior"


def compare(candidate: EvalResult, baseline: EvalResult, lm: LoadedManifest) -> Comparison:
    """Compare a candidate's eval with its baseline's, suite by suite, with the statistics
    settings (seed, bootstrap samples, confidence) and margins of the candidate's manifest
    `lm`."""
    ev = lm.manifest.eval
    margins = {s.name: s.margin for s in ev.suites}
    suites: dict[str, SuiteComparison] = {}
    warnings: list[str] = []
    for name, summary in candidate.suites.items():
        if name not in baseline.suites:
            continue
        base_summary = baseline.suites[name]
        sc = compare_suite(
            candidate.suite_items(name),
            baseline.suite_items(name),
            margin=margins.get(name, summary.margin),
            confidence=ev.confidence,
            samples=ev.bootstrap_samples,
            seed=ev.seed,
        )
        same = None
        if summary.digest and base_summary.digest:
            same = summary.digest == base_summary.digest
            if not same:
                warnings.append(f"suite {name}: the two evals read different suite files")
        if sc.unpaired:
            warnings.append(f"suite {name}: {sc.unpaired} item ids are on one side only")
        if sc.excluded_errors:
            warnings.append(
                f"suite {name}: {sc.excluded_errors} pairs left out because of error items"
            )
        suites[name] = sc.model_copy(
            update={
                "kind": summary.kind,
                "same_suite_file": same,
                "candidate_noise": candidate.noise.suites.get(name) if candidate.noise else None,
                "baseline_noise": baseline.noise.suites.get(name) if baseline.noise else None,
            }
        )
    missing = sorted(set(candidate.suites) ^ set(baseline.suites))
    for name in missing:
        side = "candidate" if name in candidate.suites else "baseline"
        warnings.append(f"suite {name}: evaluated for the {side} only, not compared")
    return Comparison(
        baseline_release_id=baseline.release_id,
        candidate_release_id=candidate.release_id,
        baseline_name=baseline.name,
        candidate_name=candidate.name,
        verdict=_worst([s.verdict for s in suites.values()]),
        confidence=ev.confidence,
        bootstrap_samples=ev.bootstrap_samples,
        seed=ev.seed,
        suites=suites,
        missing_suites=missing,
        warnings=warnings,
    )
