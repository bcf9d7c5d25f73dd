"""An environment's record as promote and rollback read and move it: a release marked bad,
where a release was live, what an event records of its gates, and moving the record."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from releasekit.config import Settings
from releasekit.config.lanes import parent_env
from releasekit.errors import ReleasekitError
from releasekit.promote.gate_results import GateReport
from releasekit.promote.policy import read_policy
from releasekit.releases.assign import AssignResult, assign
from releasekit.releases.prompt_alias import PromptAliasResult, move_prompt_alias
from releasekit.stores.ledger import EventType, Ledger, LedgerRecord, open_ledger
from releasekit.stores.ledger.queries import SERVED_TYPES


def _open_ledger(settings: Settings, *, read_only: bool = False) -> Ledger:
    # Signed and anchored like every other writer (stores.ledger.open_ledger).
    return open_ledger(settings, read_only=read_only)


def marked_bad(ledger: Ledger, release_id: str) -> LedgerRecord | None:
    """The latest `mark_bad` event of a release (a rollback moved away from it), or None."""
    for rec in ledger.records(
        release=release_id, types=[EventType.MARK_BAD.value], newest_first=True
    ):
        if rec.to_release == release_id:
            return rec
    return None


def was_live_in(ledger: Ledger, release_id: str, env: str) -> bool:
    """True when the ledger shows `release_id` was ever put in place in `env` by promote or
    rollback (`SERVED_TYPES`); an `assign` record only moved a name, so it never counts
    (not for `requires`, a redeploy or `rollback --to`)."""
    return any(
        r.to_release == release_id
        for r in ledger.records(environment=env, live=True, types=SERVED_TYPES)
    )


def _gate_summary(report: GateReport) -> dict[str, Any]:
    """What a decision's event records of its gates: the verdict, the failed ones, and
    each gate's verdict with the figures it judged (what `releasekit audit replay`
    recomputes and compares)."""
    return {
        "passed": report.passed,
        "mode": report.mode,
        "failed": [g.name for g in report.failed],
        "advisory_failed": [g.name for g in report.advisory_failed],
        "against": report.live_release_id,
        "verdicts": [
            {
                "name": g.name,
                "kind": g.kind,
                "passed": g.passed,
                "advisory": g.advisory,
                "candidate": g.candidate,
                "live": g.live,
                "limit": g.limit,
            }
            for g in report.gates
        ],
    }


class RecordMove(BaseModel):
    """What moving the record did: the ledger event (with the MLflow model alias, via
    `assign`) and the prompt alias."""

    assign: AssignResult
    prompt_alias: PromptAliasResult | None = None
    warnings: list[str] = Field(default_factory=list)


def move_record(
    settings: Settings,
    release_id: str,
    *,
    env: str,
    reason: str,
    event_type: EventType,
    evidence: dict[str, Any],
    actor: str | None,
    previous_release_id: str | None,
    ledger: Ledger,
) -> RecordMove:
    """The one place promote and rollback move an environment's record: a live ledger
    event and the MLflow model alias (`releases.assign.assign`, both or neither), then the
    prompt alias (a failure there is a warning: the record already moved). The event
    carries the environment's policy and its source (`evidence["policy"]`; read here when
    the caller did not: a rollback records it without refusing, a way back must work)."""
    if "policy" not in evidence:
        cfg = settings.environments.get(parent_env(env))  # a lane's: its environment's
        if cfg is not None:
            evidence = {**evidence, "policy": read_policy(settings, env, cfg).evidence()}
    res = assign(
        settings,
        release_id,
        env=env,
        reason=reason,
        event_type=event_type.value,
        evidence=evidence,
        actor=actor,
        ledger=ledger,
    )
    move = RecordMove(assign=res)
    try:
        move.prompt_alias = move_prompt_alias(
            settings,
            env=env,
            release_id=release_id,
            previous_release_id=previous_release_id,
            ledger=ledger,
        )
    except ReleasekitError as exc:
        move.warnings.append(f"prompt alias not moved: {exc.message}")
    return move
