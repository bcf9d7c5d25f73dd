"""Approvals: a person's recorded yes for a release to enter an environment.

An environment with `requires_approval = true` (releasekit.toml) takes a release only once
`releasekit approve RELEASE --env ENV --reason TEXT` recorded an `approve` ledger event for
it; the approver is the event's actor. `promote` then passes the "approved for ENV" gate,
which no `--force` carries past; without an approval it waits up to the environment's
`approval_wait_s` (or `--wait-approval`) for one, then refuses.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from pydantic import BaseModel

from releasekit.config import Settings
from releasekit.errors import ReleasekitError
from releasekit.promote.deploy import env_config
from releasekit.promote.gates import GateResult
from releasekit.releases.resolve import resolve_release
from releasekit.stores.ledger import Event, EventType, Ledger, LedgerRecord, open_ledger

APPROVAL_GATE_PREFIX = "approved for "


class ApprovalError(ReleasekitError):
    """Raised when an approval cannot be recorded: no reason given, or the release is not
    one the ledger knows."""

    remedy = "give --reason (why it may go), and a release id, name@version or manifest"


class ApprovalResult(BaseModel):
    """The recorded approval."""

    release_id: str
    environment: str
    approver: str
    reason: str
    required: bool
    record: LedgerRecord


def approve(
    settings: Settings,
    release_ref: str,
    *,
    env: str,
    reason: str,
    actor: str | None = None,
    ledger: Ledger | None = None,
) -> ApprovalResult:
    """Record that `actor` approves `release_ref` for `env` (an `approve` event)."""
    cfg = env_config(settings, env)
    if not reason.strip():
        raise ApprovalError("an approval needs --reason: say why the release may go")
    led = ledger or open_ledger(settings)
    rid = resolve_release(settings, release_ref, ledger=led).release_id
    live = led.live_at(env)
    rec = led.append(
        Event(
            type=EventType.APPROVE,
            environment=env,
            from_release=live.to_release if live else None,
            to_release=rid,
            reason=reason,
            evidence={"required": cfg.requires_approval},
            live=False,
            actor=actor,
        )
    )
    return ApprovalResult(
        release_id=rid,
        environment=env,
        approver=rec.actor,
        reason=reason,
        required=cfg.requires_approval,
        record=rec,
    )


def approval_for(ledger: Ledger, release_id: str, env: str) -> LedgerRecord | None:
    """The latest `approve` event of `release_id` for `env`, or None."""
    for rec in ledger.records(
        release=release_id, environment=env, types=[EventType.APPROVE.value], newest_first=True
    ):
        if rec.to_release == release_id:
            return rec
    return None


def wait_for_approval(
    ledger: Ledger,
    release_id: str,
    env: str,
    *,
    wait_s: float,
    poll_s: float = 1.0,
    sleep: Callable[[float], None] = time.sleep,
) -> LedgerRecord | None:
    """The approval, polling the ledger for up to `wait_s` seconds until one is recorded."""
    end = time.monotonic() + wait_s
    while True:
        rec = approval_for(ledger, release_id, env)
        if rec is not None or time.monotonic() >= end:
            return rec
        sleep(min(poll_s, max(0.0, end - time.monotonic())))


def approval_gate(env: str, rec: LedgerRecord | None, *, waited_s: float = 0.0) -> GateResult:
    """The "approved for ENV" gate (kind `approval`: never forced)."""
    if rec is not None:
        detail = f"approved by {rec.actor} at {rec.time:%Y-%m-%d %H:%M:%SZ}: {rec.reason}"
    else:
        waited = f" (waited {waited_s:.0f} s)" if waited_s else ""
        detail = f"no approval recorded{waited}; run `releasekit approve RELEASE --env {env}`"
    return GateResult(
        name=APPROVAL_GATE_PREFIX + env,
        kind="approval",
        passed=rec is not None,
        rule=f"{env} takes a release only after someone approved it (`releasekit approve`)",
        detail=detail,
    )
