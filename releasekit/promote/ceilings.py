"""An environment's ceilings on the candidate's canary: a manifest only tightens.

The candidate's manifest sets its canary checks (`tolerance`, `slack`, `confidence`) and
the canary's `sustain`; its shadow comparisons are judged with the same checks. Each is
bounded by the environment's committed policy (`max_canary_tolerance`, `max_canary_slack`,
`max_canary_confidence`, `max_canary_sustain` in releasekit.toml): a looser value is
clamped to the ceiling and reported ("clamped by staging's policy: ..."), never silently.

    within = canary_within(canary, cfg, "staging")
    within.canary        # the steps as they run: every check within the ceilings
    within.note          # "clamped by staging's policy: ttft_p95_s tolerance 1000 -> 0.5"

A higher `confidence` loosens a check (a breach then needs a smaller p-value), so its
bound is a ceiling too. A canary that had to be clamped asked for more than the
environment allows: `perf_by_canary` does not stand in for its offline perf gates.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from releasekit.config import EnvironmentConfig
from releasekit.spec.manifest import Canary, CanaryCheck

CEILING_FIELDS = (
    "max_canary_tolerance",
    "max_canary_slack",
    "max_canary_confidence",
    "max_canary_sustain",
)
"""The environment's policy fields a canary is bounded by."""


class Clamp(BaseModel):
    """One value of the manifest's canary lowered to the environment's ceiling."""

    what: str = Field(description="e.g. 'ttft_p95_s tolerance', 'sustain'")
    asked: float
    applied: float

    def words(self) -> str:
        """'ttft_p95_s tolerance 1000 -> 0.5'."""
        return f"{self.what} {self.asked:g} -> {self.applied:g}"


def clamp_note(env: str, clamps: list[Clamp]) -> str:
    """'clamped by staging's policy: ttft_p95_s tolerance 1000 -> 0.5; sustain 9 -> 4'."""
    return f"clamped by {env}'s policy: " + "; ".join(c.words() for c in clamps)


class CanaryWithin(BaseModel):
    """The candidate's canary as it runs in one environment, and what was clamped."""

    environment: str
    canary: Canary
    clamps: list[Clamp] = Field(default_factory=list)

    @property
    def clamped(self) -> bool:
        """True when the manifest asked for more than the environment allows."""
        return bool(self.clamps)

    @property
    def note(self) -> str:
        """The clamps in words (empty when none)."""
        return clamp_note(self.environment, self.clamps) if self.clamps else ""


def checks_within(
    checks: list[CanaryCheck], cfg: EnvironmentConfig
) -> tuple[list[CanaryCheck], list[Clamp]]:
    """`checks` with each tolerance, slack and confidence at most the environment's
    ceiling, and the clamps that took."""
    out: list[CanaryCheck] = []
    clamps: list[Clamp] = []
    for c in checks:
        update: dict[str, float] = {}
        for field, ceiling in (
            ("tolerance", cfg.canary_tolerance_ceiling(c.metric)),
            ("slack", cfg.canary_slack_ceiling(c.metric)),
            ("confidence", cfg.max_canary_confidence),
        ):
            asked = float(getattr(c, field))
            if asked > ceiling:
                update[field] = ceiling
                clamps.append(Clamp(what=f"{c.metric} {field}", asked=asked, applied=ceiling))
        out.append(c.model_copy(update=update) if update else c)
    return out, clamps


def canary_within(canary: Canary, cfg: EnvironmentConfig, env: str) -> CanaryWithin:
    """`canary` bounded by `env`'s ceilings (`cfg`: the environment's committed policy),
    with what was clamped (module docstring)."""
    checks, clamps = checks_within(list(canary.checks), cfg)
    update: dict[str, object] = {}
    if clamps:
        update["checks"] = checks
    if canary.sustain > cfg.max_canary_sustain:
        update["sustain"] = cfg.max_canary_sustain
        clamps.append(Clamp(what="sustain", asked=canary.sustain, applied=cfg.max_canary_sustain))
    bounded = canary.model_copy(update=update) if update else canary
    return CanaryWithin(environment=env, canary=bounded, clamps=clamps)
