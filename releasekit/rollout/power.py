"""What a canary check can detect: its power at `min_samples`, stated before it runs.

A check breaches when the canary's count above its limit is unlikely at the limit
(`rollout.judge`: one-sided binomial test, p-value below `1 - confidence`). The limit
allows a share of the canary's observations above it: `1 - q` for a q-quantile (5% for a
p95), the limit's own rate for a rate check (`stable x (1 + tolerance) + slack`; stated
here with stable's rate at `stable_rate`, 0 by default, so the limit is the slack). From
that alone, for one judgement on `min_samples` observations:

- `breach_at`: the fewest of them above the limit that breach (None: no count can, the
  check never breaches at that sample);
- `detects`: the share above the limit that breaches with probability `power` (80%):
  a canary must be at least that far past its limit to be caught on that sample more
  often than not;
- `at_2x`, `at_3x`: the probability of a breach when the canary's true share above the
  limit is twice or three times what the limit allows.

These are per judgement. A step aborts on `sustain` breaching judgements in a row, each
over the step so far (so on more samples than the first), and passes on `sustain` clean
ones; a larger `min_samples` raises the first judgement's power.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, Field

from releasekit.spec.manifest import CanaryCheck

POWER = 0.8
_QUANTILE = re.compile(r"_p(?P<q>\d+)_s$")


class CheckPower(BaseModel):
    """One check's power at its `min_samples` (module docstring)."""

    metric: str
    samples: int = Field(description="observations the judgement rests on: min_samples")
    confidence: float
    allowed_share: float = Field(
        description="share of observations the limit allows above it (1 - q, or the rate)"
    )
    stable_rate: float | None = Field(
        None, description="rate checks: the stable figure the limit was worked out from"
    )
    breach_at: int | None = Field(
        None, description="fewest of `samples` above the limit that breach; None: none can"
    )
    power: float = POWER
    detects: float | None = Field(
        None, description="share above the limit that breaches with probability `power`"
    )
    at_2x: float | None = Field(None, description="P(breach) at twice the allowed share")
    at_3x: float | None = Field(None, description="P(breach) at three times the allowed share")

    @property
    def quantile(self) -> bool:
        """Whether the check is on a latency quantile (else a rate)."""
        return _QUANTILE.search(self.metric) is not None

    def cells(self) -> list[str]:
        """The row `--explain` and the README print: metric, samples, limit allows,
        breaches on, detects, P(breach) at 2x and 3x."""
        allows = f"{self.allowed_share:.0%}"
        if not self.quantile:
            allows += f" (stable at {self.stable_rate or 0:g})"
        return [
            self.metric,
            str(self.samples),
            allows,
            "never" if self.breach_at is None else f"{self.breach_at} of {self.samples}",
            "-" if self.detects is None else f"{self.detects:.0%}",
            "-" if self.at_2x is None else f"{self.at_2x:.0%}",
            "-" if self.at_3x is None else f"{self.at_3x:.0%}",
        ]

    def words(self) -> str:
        """The row in one sentence."""
        what = "requests above the limit" if self.quantile else "counted (errors, negative answers)"
        if self.breach_at is None:
            return (
                f"{self.metric}: at {self.samples} samples no count breaches at confidence "
                f"{self.confidence:g}: the check can never breach"
            )
        out = (
            f"{self.metric}: at {self.samples} samples a judgement breaches on "
            f"{self.breach_at} {what} ({self.allowed_share:.0%} allowed); it breaches "
            f"{self.power:.0%} of the time once {self.detects:.0%} are"
        )
        if self.at_2x is not None and self.at_3x is not None:
            out += f"; at 2x the allowed share {self.at_2x:.0%} of the time, at 3x {self.at_3x:.0%}"
        return out


POWER_COLUMNS = [
    "check",
    "samples",
    "limit allows",
    "breaches on",
    f"caught {POWER:.0%} of the time at",
    "P(breach) at 2x",
    "at 3x",
]


def allowed_share(check: CanaryCheck, stable_rate: float = 0.0) -> float:
    """The share of the canary's observations its limit allows above it."""
    m = _QUANTILE.search(check.metric)
    if m is not None:
        return 1 - int(m["q"]) / 100
    limit = stable_rate * (1 + check.tolerance) + check.slack
    return min(max(limit, 0.0), 1.0)


def breach_count(n: int, allowed: float, alpha: float) -> int | None:
    """The fewest of `n` above the limit whose one-sided binomial p-value (as the judge
    computes it) is below `alpha`; None when even `n` of `n` is not."""
    from scipy.stats import binom

    if n <= 0 or allowed >= 1.0:
        return None
    if allowed <= 0.0:
        return 1  # any count above a limit that allows none: p = 0
    for k in range(1, n + 1):
        if float(binom.sf(k - 1, n, allowed)) < alpha:
            return k
    return None


def check_power(check: CanaryCheck, *, stable_rate: float = 0.0) -> CheckPower:
    """`check`'s power for one judgement at its `min_samples` (module docstring)."""
    from scipy.stats import beta, binom

    n = check.min_samples
    allowed = allowed_share(check, stable_rate)
    k = breach_count(n, allowed, 1 - check.confidence)
    out = CheckPower(
        metric=check.metric,
        samples=n,
        confidence=check.confidence,
        allowed_share=allowed,
        stable_rate=None if _QUANTILE.search(check.metric) else stable_rate,
        breach_at=k,
    )
    if k is None:
        return out
    # P(Binomial(n, s) >= k) is the regularised incomplete beta I_s(k, n - k + 1).
    detects = float(beta.ppf(POWER, k, n - k + 1))
    at = {
        m: float(binom.sf(k - 1, n, min(m * allowed, 1.0))) if allowed > 0 else None for m in (2, 3)
    }
    return out.model_copy(update={"detects": detects, "at_2x": at[2], "at_3x": at[3]})


def policy_power(checks: list[CanaryCheck], *, stable_rate: float = 0.0) -> list[CheckPower]:
    """Every check's power, in the policy's order."""
    return [check_power(c, stable_rate=stable_rate) for c in checks]
