"""What a suite can tell at its margin: how many items must flip one way before the paired
comparison stops passing a release, and the smallest one-way loss it calls inferior.

Both come from the same interval and verdict rule the gates use (Newcombe's paired interval,
`interval_verdict`), applied to an assumed table: the baseline passes `round(n x rate)` items
and the candidate loses `k` of them, gaining none. A suite that can block on a single flip
decides on noise, not on evidence of harm; `validate` prints this for every suite and the
comparison says when a verdict rests on fewer flips than `MIN_BLOCKING_FLIPS`.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from releasekit.evaluate.paired_stats import newcombe_paired_interval
from releasekit.evaluate.verdicts import Verdict, interval_verdict
from releasekit.spec.manifest import LoadedManifest

MIN_BLOCKING_FLIPS = 3
"""One-way flips below which a blocking verdict is called fragile (decided by one or two
items): size such a suite up, or widen its margin."""


class SuiteSensitivity(BaseModel):
    """What one suite can detect at its margin (see the module docstring)."""

    suite: str
    n: int = Field(description="items in the suite file")
    margin: float
    assumed_pass_rate: float = Field(description="the baseline's pass rate assumed")
    flips_to_block: int | None = Field(
        None, description="fewest one-way flips whose verdict no longer passes"
    )
    flips_to_inferior: int | None = Field(None, description="fewest one-way flips called inferior")
    detectable_loss: float | None = Field(
        None, description="flips_to_inferior / n: the smallest loss the suite calls inferior"
    )

    @property
    def single_flip_blocks(self) -> bool:
        """True when one flipped item is enough to block a release."""
        return self.flips_to_block == 1

    @property
    def fragile(self) -> bool:
        """True when fewer than MIN_BLOCKING_FLIPS one-way flips can block."""
        return self.flips_to_block is not None and self.flips_to_block < MIN_BLOCKING_FLIPS

    def line(self) -> str:
        """One line for `validate`."""
        block = (
            "no loss blocks it"
            if self.flips_to_block is None
            else f"{self.flips_to_block} one-way flip{'s' if self.flips_to_block != 1 else ''}"
            " block"
        )
        inferior = (
            "no loss is called inferior"
            if self.detectable_loss is None
            else f"inferior from a loss of {100 * self.detectable_loss:.2g} points "
            f"({self.flips_to_inferior} flips)"
        )
        warn = (
            f"; fewer than {MIN_BLOCKING_FLIPS} flips can block: add items or widen the margin"
            if self.fragile
            else ""
        )
        return (
            f"{self.suite}: n={self.n}, margin {100 * self.margin:g} points (at a pass rate of "
            f"{100 * self.assumed_pass_rate:.3g}%): {block}; {inferior}{warn}"
        )


def suite_sensitivity(
    suite: str, n: int, margin: float, *, pass_rate: float = 0.9, confidence: float = 0.95
) -> SuiteSensitivity:
    """The sensitivity of a suite of `n` items at `margin`, for a baseline at `pass_rate`."""
    passing = min(n, max(0, round(n * pass_rate)))
    block: int | None = None
    inferior: int | None = None
    if n > 0:
        for k in range(passing + 1):
            lo, hi = newcombe_paired_interval(passing - k, 0, k, n - passing, confidence=confidence)
            verdict = interval_verdict(lo, hi, margin)
            if block is None and not verdict.passed:
                block = k
            if verdict is Verdict.INFERIOR:
                inferior = k
                break
    return SuiteSensitivity(
        suite=suite,
        n=n,
        margin=margin,
        assumed_pass_rate=pass_rate,
        flips_to_block=block,
        flips_to_inferior=inferior,
        detectable_loss=None if inferior is None else inferior / n,
    )


def manifest_sensitivity(lm: LoadedManifest, *, pass_rate: float = 0.9) -> list[SuiteSensitivity]:
    """The sensitivity of each of a manifest's suites (items counted in its file; a suite
    whose file cannot be read is left out: `validate` reports missing files itself)."""
    found: list[SuiteSensitivity] = []
    for suite in lm.manifest.eval.suites:
        try:
            text = lm.resolve(suite.path).read_text(encoding="utf-8")
        except OSError:
            continue
        n = sum(1 for line in text.splitlines() if line.strip())
        found.append(
            suite_sensitivity(
                suite.name,
                n,
                suite.margin,
                pass_rate=pass_rate,
                confidence=lm.manifest.eval.confidence,
            )
        )
    return found
