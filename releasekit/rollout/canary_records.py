"""What a canary run records: each step as it ran, a check's breaching windows, and the
run's outcome (how fast traffic went back on a breach)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from releasekit.evaluate.agreement import Agreement
from releasekit.evaluate.answers import AnswerVerdict
from releasekit.rollout.judge import CheckResult, StepJudgement
from releasekit.watch.rules import Judgement

StepStatus = Literal["passed", "breached", "insufficient", "lease_lost", "gateway_error"]
RunOutcome = Literal[
    "passed", "breached", "insufficient", "lease_lost", "gateway_error", "baseline_failed"
]


class StepReport(BaseModel):
    """One step as it ran: its weight, how long, the traffic it saw and the last judgement."""

    index: int
    weight: float
    status: StepStatus
    started_at: float
    ended_at: float
    canary_requests: float = 0.0
    stable_requests: float = 0.0
    judgement: StepJudgement | None = None
    clean_judgements: int = Field(
        0, description="clean judgements in a row at the end (passing needs `sustain`)"
    )
    agreement: AnswerVerdict | Agreement | None = Field(
        None, description="the canary's answers against stable's, at the step's last judgement"
    )
    inputs: dict[str, Any] | None = Field(
        None, description="the last judgement's inputs, for replay (`rollout.inputs`)"
    )
    unconfirmed: StepJudgement | None = Field(
        None,
        description="a judgement whose live checks breached `sustain` times in a row and "
        "the disjoint window after it, judged on its own, did not repeat (a fresh server's "
        "start-up; `judgement` is a later window's)",
    )
    reason: str = ""


BREACH_RULE = "sustain+disjoint"
"""The abort rule a run's breaches were decided under, as its `canary_aborted` event
records it (`breach_rule`): `sustain` breaching judgements in a row, then the same check
breaching over a disjoint window judged on its own (`BreachRecord.confirmed_by`) unless it
stands without one (`BreachRecord.stands`). Events without `breach_rule` were decided on
the `sustain` run alone."""


class BreachRecord(BaseModel):
    """A check that breached: its consecutive breaching judgements (the windows), the
    stable figures they were compared with, and the disjoint window that confirmed it (or
    why it stands without one)."""

    metric: str
    judgements: list[Judgement]
    checks: list[CheckResult]
    confirmed_by: CheckResult | None = Field(
        None, description="the check over the disjoint window after the run, judged on its own"
    )
    stands: str = Field(
        "", description="why the breach stands without a disjoint window (empty: confirmed)"
    )


class CanaryRun(BaseModel):
    """What the canary steps did, and on a breach how fast traffic went back."""

    env: str
    release_id: str
    stable_release_ids: list[str]
    outcome: RunOutcome
    steps: list[StepReport] = Field(default_factory=list)
    breaches: list[BreachRecord] = Field(default_factory=list)
    reason: str = ""
    canary_served: int = Field(0, description="requests the canary took during the run")
    total_served: int = Field(0, description="requests every release took during the run")
    decide_to_zero_s: float | None = Field(
        None, description="from the decision to abort to the gateway answering with 0%"
    )
    window_to_zero_s: float | None = Field(
        None, description="from the end of the breaching window (its scrape) to 0%"
    )
    at_zero_at: float | None = None
    warmup_answered: int = Field(0, description="warm-up requests the canary answered")
    judged_against: str | None = Field(
        None, description="the route judged as stable: the live release's, or its fresh baseline"
    )
    baseline_warmup_answered: int = Field(
        0, description="warm-up requests a fresh baseline answered"
    )
    warmup_s: float | None = Field(None, description="how long the warm-up burst took")
    agreement: AnswerVerdict | Agreement | None = Field(
        None,
        description="the canary's answers against the live release's on the same requests "
        "(None: not compared), at the last judgement",
    )
    answers_from: str | None = Field(
        None, description="the label the copies to the live release went under"
    )
    pairs_read: int = Field(0, description="answer pairs read, judged or not")

    @property
    def canary_share(self) -> float | None:
        """Share of the requests served during the run that the canary served."""
        return self.canary_served / self.total_served if self.total_served else None
