"""What a replay reports: one check per replayed input or verdict, and one record per
replayed decision (shared by the gate replay and the judged-verdict replay)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

CheckStatus = Literal["same", "different", "not replayable"]


class Check(BaseModel):
    """One replayed input or verdict: what was recorded, what replay found, same or not."""

    name: str
    kind: str = Field(description="'record', 'policy', 'evidence', or the gate's kind")
    status: CheckStatus
    recorded: str | None = None
    replayed: str | None = None
    detail: str = ""


class DecisionReplay(BaseModel):
    """The replay of one recorded decision."""

    seq: int
    event_id: str
    type: str
    environment: str | None
    release_id: str | None
    against: str | None = Field(None, description="the release it was judged against")
    checks: list[Check] = Field(default_factory=list)

    @property
    def differences(self) -> list[Check]:
        """The checks that came out different."""
        return [c for c in self.checks if c.status == "different"]

    @property
    def same(self) -> bool:
        """No check came out different."""
        return not self.differences
