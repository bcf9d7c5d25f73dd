"""What the promotion gates decide: one gate's verdict (`GateResult`), the report of a
promotion attempt (`GateReport`) and the rules for what blocks where."""

from __future__ import annotations

import datetime as dt
from collections.abc import Collection
from typing import Literal

from pydantic import BaseModel, Field

GateKind = Literal["policy", "evidence", "quality", "perf", "approval", "shadow"]
ALWAYS_BLOCK = frozenset({"policy", "approval"})
"""Gate kinds that block in every environment: a rolled-back release, a missing approval."""
PERF_BY_CANARY_NOTE = "advisory here: the canary steps judge performance on live traffic"


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
