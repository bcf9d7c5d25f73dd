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
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import StrEnum
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from releasekit.errors import EvalError, InputMissingError
from releasekit.evaluate.runner import EvalResult, ItemResult, SuiteNoise, SuiteSummary
from releasekit.evaluate.suites import Expected
from releasekit.spec.manifest import LoadedManifest

DEFAULT_MIN_PAIRED = 30
"""Paired items a suite needs before it can pass a gate (the demo's suites have 40-240)."""

COMPARE_JSON = "compare.json"
"""The comparison's file name in a release's report folder."""

_MAX_DRAW = 4_000_000  # indices drawn per bootstrap block: bounds memory for big suites
_STRICT = ConfigDict(extra="forbid")


class EvidenceError(EvalError):
    """Raised when stored evidence (compare.json) cannot be read back by the strict model
    that wrote it: not JSON, an unknown field, a verdict spelled another way, or verdicts
    that contradict their own statistics."""

    remedy = (
        "do not edit evidence files by hand; rebuild the release's report "
        "(`releasekit eval MANIFEST` or `releasekit build MANIFEST`)"
    )


class Verdict(StrEnum):
    """A suite's (or a whole comparison's) verdict; see the module docstring."""

    SUPERIOR = "superior"
    NON_INFERIOR = "non_inferior"
    INCONCLUSIVE = "inconclusive"
    INSUFFICIENT_EVIDENCE = "insufficient_evidence"
    MISSING_EVIDENCE = "missing_evidence"
    ERROR_REGRESSION = "error_regression"
    INFERIOR = "inferior"

    @property
    def passed(self) -> bool:
        """True only for `non_inferior` and `superior`: everything else fails a gate."""
        return self in (Verdict.NON_INFERIOR, Verdict.SUPERIOR)


VERDICT_ORDER: tuple[Verdict, ...] = (
    Verdict.INFERIOR,
    Verdict.ERROR_REGRESSION,
    Verdict.MISSING_EVIDENCE,
    Verdict.INSUFFICIENT_EVIDENCE,
    Verdict.INCONCLUSIVE,
    Verdict.NON_INFERIOR,
    Verdict.SUPERIOR,
)
"""Worst first: the order in which verdicts combine."""


def worst(verdicts: Sequence[Verdict]) -> Verdict:
    """The worst of `verdicts` by `VERDICT_ORDER`; `missing_evidence` when there are none."""
    if not verdicts:
        return Verdict.MISSING_EVIDENCE
    return min(verdicts, key=VERDICT_ORDER.index)


def rule_text(*, confidence: float, min_paired: int) -> str:
    """The verdict rule in words, as the reports print it."""
    conf = f"{100 * confidence:g}%"
    alpha = f"{1 - confidence:.3g}"
    return (
        f"A suite is non-inferior if the lower bound of the {conf} interval of "
        f"(candidate - baseline) pass rate is above -margin, with at least {min_paired} "
        "paired items (superior if it is above 0); inferior if the upper bound is below "
        "-margin. An item that errors counts as a failure unless it expects an error. "
        "A candidate that errors on more items than the baseline (one-sided exact McNemar "
        f"test on the items where one side errored, p < {alpha}) is an error regression. "
        "A suite evaluated on one side only, or from different suite files, is missing "
        "evidence. Only non-inferior and superior pass a gate. Interval: Newcombe's hybrid "
        "score method 10 for paired proportions."
    )


class SideCounts(BaseModel):
    """One release's outcomes in one suite. `passed` includes the errors of items that
    expect one (`expected_errors`); `errors` are the other errors, counted as failures."""

    model_config = _STRICT

    n: int
    passed: int
    failed: int
    errors: int
    expected_errors: int = 0
    pass_rate: float | None = Field(description="passed / n: errors count as failures")
    error_rate: float | None = Field(description="errors / n")
    digest: str = Field("", description="sha256 of the suite file this side read")


class FlippedItem(BaseModel):
    """An item whose verdict changed between baseline and candidate, with both answers (an
    error's message stands in for the answer)."""

    model_config = _STRICT

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

    model_config = _STRICT

    kind: str = ""
    verdict: Verdict
    reasons: list[str] = Field(default_factory=list, description="why, in words")
    margin: float
    min_paired: int = DEFAULT_MIN_PAIRED
    n_paired: int = 0
    baseline: SideCounts | None = None
    candidate: SideCounts | None = None
    baseline_pass_rate: float | None = Field(None, description="over the paired items")
    candidate_pass_rate: float | None = Field(None, description="over the paired items")
    delta: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    interval_verdict: Verdict | None = Field(
        None, description="what the interval alone says against -margin (and 0)"
    )
    score_delta: float | None = None
    score_ci_low: float | None = None
    score_ci_high: float | None = None
    mcnemar_p: float | None = None
    both_pass: int = 0
    both_fail: int = 0
    flipped_to_fail: list[str] = Field(default_factory=list)
    flipped_to_pass: list[str] = Field(default_factory=list)
    errors_only_candidate: int = Field(0, description="pairs where only the candidate errored")
    errors_only_baseline: int = Field(0, description="pairs where only the baseline errored")
    error_regression_p: float | None = Field(
        None, description="one-sided exact test that the candidate errors more"
    )
    error_regression: bool = False
    unpaired: int = Field(0, description="ids present in only one of the two results")
    same_suite_file: bool | None = Field(
        None, description="both evals read a suite file with the same sha256"
    )
    baseline_noise: SuiteNoise | None = None
    candidate_noise: SuiteNoise | None = None
    flips: list[FlippedItem] = Field(default_factory=list)

    @property
    def passed(self) -> bool:
        """True when this suite passes a gate (`Verdict.passed`)."""
        return self.verdict.passed

    @model_validator(mode="after")
    def _consistent(self) -> SuiteComparison:
        # A verdict that its own numbers do not support is not evidence (hand-edited or
        # written by a bug): refuse it here, at construction and when read back.
        if not self.verdict.passed:
            return self
        lo = self.ci_low
        if self.n_paired < self.min_paired or lo is None or self.error_regression:
            raise ValueError(f"verdict {self.verdict.value} contradicts the statistics")
        bound = 0.0 if self.verdict is Verdict.SUPERIOR else -self.margin
        if not lo > bound:
            raise ValueError(f"verdict {self.verdict.value} contradicts ci_low {lo}")
        return self


class Comparison(BaseModel):
    """Candidate vs baseline across suites; `verdict` is the worst suite verdict and
    `passed` is what a gate reads."""

    model_config = _STRICT

    baseline_release_id: str | None
    candidate_release_id: str | None
    baseline_name: str = ""
    candidate_name: str = ""
    verdict: Verdict
    confidence: float
    interval: Literal["newcombe-hybrid-score-10"] = "newcombe-hybrid-score-10"
    min_paired: int = DEFAULT_MIN_PAIRED
    bootstrap_samples: int = Field(description="resamples for the score delta")
    seed: int
    rule: str = ""
    suites: dict[str, SuiteComparison]
    missing_suites: list[str] = Field(
        default_factory=list, description="suites not evaluated on both sides (missing_evidence)"
    )
    warnings: list[str] = Field(default_factory=list)

    @property
    def passed(self) -> bool:
        """True when every suite passes (`Verdict.passed` of the worst verdict)."""
        return self.verdict.passed

    def failing_suites(self) -> list[str]:
        """The names of the suites whose verdict fails a gate."""
        return [name for name, s in self.suites.items() if not s.passed]

    @model_validator(mode="after")
    def _consistent(self) -> Comparison:
        expected = worst([s.verdict for s in self.suites.values()])
        if self.verdict is not expected:
            raise ValueError(
                f"verdict {self.verdict.value} is not the worst suite verdict ({expected.value})"
            )
        return self


# ---- statistics ------------------------------------------------------------------------


def _z(confidence: float) -> float:
    from scipy.stats import norm  # imported here: scipy adds ~0.4 s to CLI start-up

    return float(norm.ppf(0.5 + confidence / 2))


def wilson_interval(x: int, n: int, *, confidence: float) -> tuple[float, float]:
    """Wilson's score interval for a proportion x/n (Wilson 1927), without continuity
    correction: (2np + z^2 -/+ z sqrt(z^2 + 4np(1-p))) / (2(n + z^2))."""
    if n <= 0 or not 0 <= x <= n:
        raise ValueError(f"wilson_interval needs 0 <= x <= n and n > 0, got x={x}, n={n}")
    z = _z(confidence)
    p = x / n
    centre = 2 * n * p + z * z
    half = z * math.sqrt(z * z + 4 * n * p * (1 - p))
    den = 2 * (n + z * z)
    return max(0.0, (centre - half) / den), min(1.0, (centre + half) / den)


def newcombe_paired_interval(
    a: int, b: int, c: int, d: int, *, confidence: float
) -> tuple[float, float]:
    """Interval for p1 - p2 = (b - c) / n from paired binary data: Newcombe's method 10
    (Newcombe 1998, Statistics in Medicine 17:2635-2650), the hybrid score interval.

    a = both positive, b = first positive only, c = second positive only, d = neither;
    n = a + b + c + d, p1 = (a + b) / n, p2 = (a + c) / n. With (l1, u1) and (l2, u2) the
    Wilson score limits of p1 and p2, and

        phi = C / sqrt((a+b)(c+d)(a+c)(b+d)),  C = max(ad - bc - n/2, 0) if ad > bc else ad - bc
        (phi = 0 when the denominator is 0),

    the limits are

        L = (p1 - p2) - sqrt((p1 - l1)^2 - 2 phi (p1 - l1)(u2 - p2) + (u2 - p2)^2)
        U = (p1 - p2) + sqrt((u1 - p1)^2 - 2 phi (u1 - p1)(p2 - l2) + (p2 - l2)^2).

    Newcombe's Table II examples reproduce: (36, 12, 2, 0) -> [0.0569, 0.3404];
    (53, 0, 0, 1) -> [-0.0729, 0.0729]; (0, 30, 0, 0) -> [0.8395, 1.0].
    """
    if min(a, b, c, d) < 0 or a + b + c + d == 0:
        raise ValueError(f"newcombe_paired_interval needs counts >= 0, n > 0: {(a, b, c, d)}")
    n = a + b + c + d
    p1, p2 = (a + b) / n, (a + c) / n
    l1, u1 = wilson_interval(a + b, n, confidence=confidence)
    l2, u2 = wilson_interval(a + c, n, confidence=confidence)
    den = (a + b) * (c + d) * (a + c) * (b + d)
    phi = 0.0
    if den:
        cross = a * d - b * c
        num = max(cross - n / 2, 0.0) if cross > 0 else float(cross)
        phi = num / math.sqrt(den)
    lo_sq = (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2
    hi_sq = (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2
    theta = p1 - p2
    return max(-1.0, theta - math.sqrt(max(lo_sq, 0.0))), min(
        1.0, theta + math.sqrt(max(hi_sq, 0.0))
    )


def mcnemar_exact(b: int, c: int) -> float:
    """Exact two-sided McNemar p-value from the discordant counts b and c."""
    if b + c == 0:
        return 1.0
    from scipy.stats import binomtest  # imported here: scipy adds ~0.4 s to CLI start-up

    return float(binomtest(b, b + c, 0.5, alternative="two-sided").pvalue)


def more_errors_p(only_candidate: int, only_baseline: int) -> float:
    """One-sided exact p-value that the candidate errs more often than the baseline, from
    the pairs where exactly one side errored: P(X >= only_candidate), X ~ Bin(total, 1/2)."""
    total = only_candidate + only_baseline
    if total == 0:
        return 1.0
    from scipy.stats import binomtest

    return float(binomtest(only_candidate, total, 0.5, alternative="greater").pvalue)


def paired_bootstrap(
    candidate: Sequence[float] | np.ndarray,
    baseline: Sequence[float] | np.ndarray,
    *,
    samples: int,
    confidence: float,
    seed: int,
) -> tuple[float, float, float]:
    """Mean paired difference (candidate - baseline) and its percentile bootstrap CI.

    Used for the graded score delta only (informative, never a verdict): with few items or
    no change it collapses to [0, 0]. Deterministic for a given `seed`.
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


def interval_verdict(ci_low: float, ci_high: float, margin: float) -> Verdict:
    """What an interval of candidate - baseline says against -margin: superior if its lower
    bound is above 0, non_inferior if above -margin, inferior if its upper bound is below
    -margin, else inconclusive."""
    if ci_low > 0:
        return Verdict.SUPERIOR
    if ci_low > -margin:
        return Verdict.NON_INFERIOR
    if ci_high < -margin:
        return Verdict.INFERIOR
    return Verdict.INCONCLUSIVE


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
    names = list(dict.fromkeys([*margins, *candidate.suites, *baseline.suites]))
    suites: dict[str, SuiteComparison] = {}
    warnings: list[str] = []
    for name in names:
        c_sum, b_sum = candidate.suites.get(name), baseline.suites.get(name)
        summary = c_sum or b_sum
        margin = margins.get(name, summary.margin if summary else 0.0)
        kind = kinds.get(name, summary.kind if summary else "")
        need = _min_paired(lm, name, min_paired)
        if c_sum is None or b_sum is None:
            side = (
                "not evaluated for either release"
                if summary is None
                else f"evaluated for the {'candidate' if c_sum else 'baseline'} only"
            )
            suites[name] = SuiteComparison(
                kind=kind,
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


# ---- reading back ----------------------------------------------------------------------


def _problems(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(document)"
        msg = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
        parts.append(f"{loc}: {msg}")
    return "; ".join(parts[:10]) + (f"; and {len(parts) - 10} more" if len(parts) > 10 else "")


def parse_comparison(data: str | bytes, *, source: str = "compare.json") -> Comparison:
    """Validate a comparison document with the strict model that wrote it. EvidenceError
    names each `field.path: problem` (an unknown field, a verdict spelled another way,
    a verdict its own numbers contradict)."""
    try:
        return Comparison.model_validate_json(data)
    except ValidationError as exc:
        raise EvidenceError(
            f"{source}: not a comparison releasekit wrote: {_problems(exc)}"
        ) from exc


def load_comparison(path: Path | str) -> Comparison:
    """Read a comparison back: `path` is a compare.json or a report folder holding one.
    InputMissingError if absent; EvidenceError if it is not exactly what releasekit writes."""
    p = Path(path)
    if p.is_dir():
        p = p / COMPARE_JSON
    if not p.is_file():
        raise InputMissingError(p, what="comparison (compare.json)")
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise EvidenceError(f"{p}: unreadable: {exc}") from exc
    return parse_comparison(data, source=str(p))


def dump_comparison(comparison: Comparison) -> bytes:
    """The compare.json bytes for `comparison` (what `load_comparison` reads back)."""
    return (comparison.model_dump_json(indent=2) + "\n").encode()


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
    "interval_verdict",
    "load_comparison",
    "mcnemar_exact",
    "more_errors_p",
    "newcombe_paired_interval",
    "paired_bootstrap",
    "parse_comparison",
    "side_counts",
    "wilson_interval",
    "worst",
]
