"""The verdicts of a paired comparison: what each means for a gate, how they combine (worst
first), what an interval alone says against the margin, and the rule in words. The method
that reaches them is in `releasekit.evaluate.compare`."""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum

DEFAULT_MIN_PAIRED = 30
"""Paired items a suite needs before it can pass a gate (the demo's suites have 40-240)."""


class Verdict(StrEnum):
    """A suite's (or a whole comparison's) verdict; see `releasekit.evaluate.compare`."""

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
