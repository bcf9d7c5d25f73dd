"""What a quantisation ladder found: one row per rung (its recipe, cost and quality against
the unquantised base, suite by suite and tag by tag) and the ladder's recommendation."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

RungStatus = Literal[
    "base", "passes", "inconclusive", "inferior", "not servable here", "failed", "not tried"
]
"""A rung's outcome: `passes` (every suite non-inferior or better), `inconclusive` (a suite
neither shown non-inferior nor inferior, or missing), `inferior` (some suite inferior),
`not servable here` (this host's vLLM cannot serve the scheme), `failed` (its build
failed), `not tried` (below the rung the ladder stopped at)."""


class SuiteDelta(BaseModel):
    """One suite of a rung against the base: the paired comparison's verdict and interval."""

    suite: str
    critical: bool = False
    verdict: str = Field(description="non_inferior, superior, inconclusive, inferior, ...")
    margin: float
    base_passed: int | None = None
    passed: int | None = None
    n: int | None = None
    delta: float | None = Field(None, description="candidate minus base pass rate")
    ci_low: float | None = None
    ci_high: float | None = None
    lost: list[str] = Field(default_factory=list, description="items that passed on the base")
    gained: list[str] = Field(default_factory=list, description="items that failed on the base")


class TagDelta(BaseModel):
    """One tag of a suite (e.g. `fact/number`): items passed on each side, lost and gained."""

    suite: str
    tag: str
    n: int
    base_passed: int
    passed: int
    lost: int
    gained: int


class RungRow(BaseModel):
    """One rung of the ladder: its release, what it costs, and what it loses."""

    name: str
    manifest: str = Field(description="the rung's manifest, relative to the project root")
    recipe: str = Field(description="the recipe in words")
    scheme: str
    status: RungStatus
    note: str | None = Field(None, description="why not servable, why the build failed, ...")
    recipe_notes: list[str] = Field(
        default_factory=list, description="what validation noticed about the recipe"
    )
    release_id: str | None = None
    reused: bool | None = Field(
        None, description="its build was up to date: nothing was rebuilt for the ladder"
    )
    weights_bytes: int | None = Field(None, description="bytes of the served weight files")
    weights_digest: str | None = None
    memory_bytes: int | None = Field(
        None, description="server memory once loaded (measured by the build's load test)"
    )
    measured_on: str | None = Field(None, description="the host its knee was measured on")
    knee_load: float | None = None
    knee_goodput: float | None = Field(None, description="requests/s meeting the SLOs at the knee")
    knee_tokens_per_s: float | None = Field(None, description="output tokens/s at the knee")
    good_rate: float | None = Field(
        None, description="share of answers that pass, pooled over the core suites"
    )
    cost_per_1k_good: float | None = Field(
        None, description="unit-hour price / (knee goodput x 3600 x good rate) x 1000"
    )
    cost_best_run_per_1k_good: float | None = Field(
        None,
        description="the same at the knee's best run (its highest goodput; from five runs, "
        "one stray run set aside): how low the runs themselves put the cost",
    )
    suites: list[SuiteDelta] = Field(default_factory=list)
    tags: list[TagDelta] = Field(default_factory=list)

    @property
    def short_id(self) -> str:
        """The release id's first 12 hex digits ('-' when not built)."""
        return self.release_id[:12] if self.release_id else "-"

    @property
    def eligible(self) -> bool:
        """It can be recommended: the base, or a rung whose every suite passes."""
        return self.status in ("base", "passes")

    def critical_losses(self) -> list[SuiteDelta]:
        """Its critical suites judged inferior."""
        return [
            s for s in self.suites if s.critical and s.verdict in ("inferior", "error_regression")
        ]


class LadderResult(BaseModel):
    """The ladder's table, where it stopped and what it recommends."""

    ladder: str = Field(description="the ladder file, relative to the project root")
    base: str = Field(description="the base (unquantised) manifest")
    host: str | None = Field(None, description="where the rungs' knees were measured")
    unit_cost_per_hour: float | None = None
    cost_tolerance: float
    critical_suites: list[str]
    rows: list[RungRow]
    stopped_at: str | None = Field(None, description="the rung the ladder stopped at")
    stop_reason: str | None = None
    recommended: str | None = Field(None, description="the recommended rung's name")
    recommended_manifest: str | None = None
    recommended_release_id: str | None = None
    recommendation: str = Field(description="why that rung, in one sentence")
    seconds: float = 0.0

    def row(self, name: str) -> RungRow:
        """The row of rung `name`."""
        return next(r for r in self.rows if r.name == name)
