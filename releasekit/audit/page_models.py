"""What the auditor's page of one environment holds: what was live when, and each decision
with who made it, under which policy, on which gates and evidence, and its replay."""

from __future__ import annotations

import datetime as dt
from typing import Literal

from pydantic import BaseModel, Field

from releasekit.audit.models import DecisionReplay

CheckState = Literal["verified", "failed", "missing", "not linked"]
ReplayState = Literal["same", "different", "not replayable"]


class LiveSpan(BaseModel):
    """One stretch of the timeline: the release a live event put in place, until the next."""

    seq: int
    event_id: str
    type: str = Field(description="the event that put it in place (promote, rollback, ...)")
    release_id: str | None
    model_name: str | None = None
    model_version: str | None = None
    actor: str
    reason: str
    since: dt.datetime
    until: dt.datetime | None = Field(None, description="None: still live")


class GateRow(BaseModel):
    """One gate or live check of a decision, with its figures."""

    name: str
    kind: str = ""
    result: str = Field(description="pass, FAIL, 'fail (advisory)', breach, ...")
    passed: bool | None = None
    candidate: float | None = None
    live: float | None = Field(None, description="the live (stable) release's figure")
    limit: float | None = None
    rule: str = ""
    detail: str = ""


class GateReportCheck(BaseModel):
    """The gate report a decision links, checked against the verdicts its signed ledger
    record holds. Only a `verified` report's text is shown as data."""

    status: CheckState
    path: str | None = Field(None, description="the JSON as recorded")
    href: str | None = Field(None, description="the JSON, relative to the page")
    html_href: str | None = Field(None, description="its HTML page, relative to the page")
    detail: str = ""


class EvidenceFile(BaseModel):
    """One evidence file of the judged release: the digest its register event signed and
    whether the file on disk still has it."""

    path: str = Field(description="relative to the release's results folder")
    signed: str | None = None
    actual: str | None = None
    ok: bool
    problem: str | None = None


class EvidenceCheck(BaseModel):
    """The judged release's evidence against its verified register event."""

    release_id: str
    register_seq: int | None = None
    ok: bool
    problem: str | None = Field(None, description="what makes every file unverified")
    files: list[EvidenceFile] = Field(default_factory=list)


class Approval(BaseModel):
    """A signed approval of the release for the environment, recorded before the decision."""

    seq: int | None = None
    actor: str
    time: dt.datetime | None = None
    reason: str = ""


class RegistryLink(BaseModel):
    """Where the release lives in MLflow, as its register event names it."""

    model_name: str | None = None
    model_version: str | None = None
    run_id: str | None = None
    run_url: str | None = None
    model_url: str | None = None


class DecisionEntry(BaseModel):
    """One recorded decision in the environment and everything that bears on it."""

    seq: int
    event_id: str
    type: str
    action: str | None = Field(None, description="a shadow event's action, a rollback's trigger")
    time: dt.datetime
    actor: str
    reason: str
    release_id: str | None = Field(None, description="the release judged (or rolled back)")
    against: str | None = None
    live: bool
    policy_kind: str | None = None
    policy_commit: str | None = None
    policy_digest: str | None = None
    gates: list[GateRow] = Field(default_factory=list)
    gates_from: str = Field("", description="where the gate figures were read")
    gate_report: GateReportCheck | None = None
    evidence: EvidenceCheck | None = None
    approvals: list[Approval] = Field(default_factory=list)
    registry: RegistryLink | None = None
    replay: ReplayState = "not replayable"
    replay_checks: DecisionReplay | None = None
    replay_note: str = ""


class AuditPage(BaseModel):
    """The auditor's page of one environment."""

    environment: str
    generated_at: dt.datetime
    ledger_ok: bool
    ledger_problem: str | None = None
    records: int = Field(0, description="ledger records of the environment")
    timeline: list[LiveSpan] = Field(default_factory=list)
    decisions: list[DecisionEntry] = Field(default_factory=list)
    path: str | None = Field(None, description="where the page was written")
