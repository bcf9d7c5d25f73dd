"""Approvals: a person's signed yes for a release to enter an environment.

An environment with `requires_approval = true` (releasekit.toml) names its approvers by
public key (`approvers = ["<key id>", ...]`: keys committed under keys/ at the trust
commit, the same revision the ledger's trusted keys and the policy come from:
`releasekit.stores.trust`; the `approvers` list itself is read there too, never from this
command's settings). It takes a
release only once `releasekit approve RELEASE --env ENV --reason TEXT --key APPROVER.pem`
recorded an `approve` ledger event for it, signed with one of those keys. An approval
counts only when:

- its record is signed by a key the environment names as an approver, and the signature
  matches the record (an `approve` row written into the database without a key, or signed
  by any other trusted key such as the CI key, counts for nothing);
- that key is not the promoter's own (the key the promoting process signs with): nobody
  approves their own promotion.

`promote` then passes the "approved for ENV" gate, which no `--force` carries past; without
an approval it waits up to the environment's `approval_wait_s` (or `--wait-approval`) for one,
then refuses. `releasekit ledger verify` reports every release put live in such an
environment without a distinct approver.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel, Field

from releasekit._support.retry import RetryPolicy
from releasekit.config import Settings
from releasekit.config.lanes import parent_env
from releasekit.deploy.environments import env_config
from releasekit.errors import ReleasekitError, SignatureError
from releasekit.promote.gate_results import GateResult
from releasekit.releases.resolve import resolve_release
from releasekit.stores.ledger import (
    Event,
    EventType,
    Ledger,
    LedgerRecord,
    open_ledger,
    record_hash,
)
from releasekit.stores.ledger.schema import _evidence_text, format_time
from releasekit.stores.signing import ApproverSet, find_signer, verify_signature

APPROVAL_GATE_PREFIX = "approved for "


class ApprovalError(ReleasekitError):
    """Raised when an approval cannot be recorded: no reason given, the release is not one
    the ledger knows, or the signing key is not one of the environment's approvers."""

    remedy = (
        "give --reason (why it may go), a release id, name@version or manifest, and --key "
        "with your approver key (a key id the environment's `approvers` names)"
    )


class ApprovalResult(BaseModel):
    """The recorded approval."""

    release_id: str
    environment: str
    approver: str
    key_id: str | None = Field(None, description="the approver's key (the record's signer)")
    reason: str
    required: bool
    record: LedgerRecord
    warnings: list[str] = Field(default_factory=list)


class ApprovalCheck(BaseModel):
    """The approval that counts for a release and environment (None when none does), and
    why each newer `approve` record of it did not count."""

    record: LedgerRecord | None = None
    rejected: list[str] = Field(default_factory=list)


def approve(
    settings: Settings,
    release_ref: str,
    *,
    env: str,
    reason: str,
    key: Path | None = None,
    actor: str | None = None,
    ledger: Ledger | None = None,
) -> ApprovalResult:
    """Record that the holder of `key` (default: the configured signing key) approves
    `release_ref` for `env`: an `approve` event signed with that key. Where `env` names
    approvers, a key that is not one of them is refused (its approval would not count).
    An adapter lane's approval is its environment's (recorded for the environment)."""
    env = parent_env(env)
    cfg = env_config(settings, env)
    if not reason.strip():
        raise ApprovalError("an approval needs --reason: say why the release may go")
    try:  # the key promote signs with here, to warn about a self-approval
        own = find_signer(settings.root, path=settings.signing_key)
    except ReleasekitError:
        own = None
    if ledger is None:
        if key is not None:
            settings = settings.model_copy(update={"signing_key": key})
        led = open_ledger(settings)
    else:
        led = ledger
    kid = led.signer.key_id if led.signer is not None else None
    aset = led.approvers.get(env)
    if aset is not None and (aset.required or aset.keys):
        _check_approver(env, kid, aset, key=key)
    led.verified()
    rid = resolve_release(settings, release_ref, ledger=led).release_id
    live = led.live_at(env)
    rec = led.append(
        Event(
            type=EventType.APPROVE,
            environment=env,
            from_release=live.to_release if live else None,
            to_release=rid,
            reason=reason,
            evidence={"required": cfg.requires_approval, "key_id": kid},
            live=False,
            actor=actor,
        )
    )
    warnings = []
    if own is not None and kid == own.key_id:
        warnings.append(
            f"signed with {kid}, the key promote signs with here: a promotion signed with it "
            "does not count this approval (nobody approves their own promotion)"
        )
    return ApprovalResult(
        release_id=rid,
        environment=env,
        approver=rec.actor,
        key_id=rec.key_id,
        reason=reason,
        required=cfg.requires_approval,
        record=rec,
        warnings=warnings,
    )


def _check_approver(env: str, kid: str | None, aset: ApproverSet, *, key: Path | None) -> None:
    named = ", ".join(aset.key_ids) or "none"
    if not aset.keys:
        problems = f" ({'; '.join(aset.problems)})" if aset.problems else ""
        raise ApprovalError(
            f"{env} names no approver whose key is committed{problems}: no approval can count",
            remedy=f"commit each approver's keys/<key id>.pub and list the key ids in "
            f"`approvers` of [environments.{env}] in releasekit.toml",
        )
    if kid is None:
        raise ApprovalError(
            f"an approval for {env} must be signed with an approver's key (approvers: {named})",
            remedy="pass --key PATH to your approver key (`releasekit ledger keygen`)",
        )
    if kid not in aset.keys:
        where = f"the key {key}" if key is not None else "the configured signing key"
        raise ApprovalError(
            f"{where} ({kid}) is not an approver of {env} (approvers: {named}); its approval "
            "would not count",
            remedy="sign with your approver key (--key PATH), or have the key id added to "
            f"`approvers` of [environments.{env}] in a reviewed commit",
        )


def _promoter_key(ledger: Ledger) -> str | None:
    if ledger.signer is not None:
        return ledger.signer.key_id
    return ledger.acting_key_id


def _stored_hash(rec: LedgerRecord) -> str:
    """The chain hash of the record as stored (its contents, as the ledger hashed them)."""
    row = rec.model_dump()
    row["time"] = format_time(rec.time)
    row["evidence"] = _evidence_text(rec.evidence)
    return record_hash(row)


def why_not_counted(
    rec: LedgerRecord, aset: ApproverSet | None, *, env: str, promoter_key: str | None
) -> str | None:
    """Why the `approve` record `rec` does not count for `env` (None: it counts)."""
    if rec.key_id is None or rec.signature is None:
        return f"approval {rec.seq} is unsigned (written without an approver's key)"
    if aset is None or not aset.keys:
        return f"{env} names no approver whose key is committed"
    if rec.key_id not in aset.keys:
        return f"approval {rec.seq} is signed by key {rec.key_id}, not an approver of {env}"
    if _stored_hash(rec) != rec.hash:
        return f"approval {rec.seq} was edited: its contents do not match its hash"
    try:
        verify_signature(
            aset.keys,
            record_hash=rec.hash,
            key_id=rec.key_id,
            signature=rec.signature,
            seq=rec.seq,
        )
    except SignatureError as exc:
        return f"approval {rec.seq}: {exc.message}"
    if promoter_key is not None and rec.key_id == promoter_key:
        return (
            f"approval {rec.seq} is signed with the promoter's own key {rec.key_id}: nobody "
            "approves their own promotion"
        )
    return None


def check_approval(ledger: Ledger, release_id: str, env: str) -> ApprovalCheck:
    """The newest `approve` record of `release_id` for `env` that counts (signed by one of
    the environment's approvers, verified, not with the promoter's key), and why the newer
    ones did not. An adapter lane is approved as its environment is: a release approved
    for `staging` may go to `staging:<adapter>`."""
    env = parent_env(env)
    aset = ledger.approvers.get(env)
    promoter = _promoter_key(ledger)
    rejected: list[str] = []
    for rec in ledger.records(
        release=release_id, environment=env, types=[EventType.APPROVE.value], newest_first=True
    ):
        if rec.to_release != release_id:
            continue
        why = why_not_counted(rec, aset, env=env, promoter_key=promoter)
        if why is None:
            return ApprovalCheck(record=rec, rejected=rejected)
        rejected.append(why)
    return ApprovalCheck(rejected=rejected)


def approval_for(ledger: Ledger, release_id: str, env: str) -> LedgerRecord | None:
    """The latest `approve` event of `release_id` for `env` that counts, or None (see
    `check_approval`)."""
    return check_approval(ledger, release_id, env).record


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
    policy = RetryPolicy.poll(interval_s=poll_s, deadline_s=wait_s)
    return policy.call(lambda: approval_for(ledger, release_id, env), sleep=sleep)


def approval_gate(
    env: str,
    rec: LedgerRecord | None,
    *,
    waited_s: float = 0.0,
    rejected: list[str] | None = None,
) -> GateResult:
    """The "approved for ENV" gate (kind `approval`: never forced)."""
    if rec is not None:
        by = f" (key {rec.key_id})" if rec.key_id else ""
        detail = f"approved by {rec.actor}{by} at {rec.time:%Y-%m-%d %H:%M:%SZ}: {rec.reason}"
    else:
        waited = f" (waited {waited_s:.0f} s)" if waited_s else ""
        why = f"; {'; '.join(rejected)}" if rejected else ""
        detail = (
            f"no approval by one of {env}'s approvers (other than the promoter) recorded"
            f"{waited}{why}; run `releasekit approve RELEASE --env {env} --key APPROVER.pem`"
        )
    return GateResult(
        name=APPROVAL_GATE_PREFIX + env,
        kind="approval",
        passed=rec is not None,
        rule=f"{env} takes a release only after one of its approvers approved it, with a "
        "signed `releasekit approve`",
        detail=detail,
    )


def approval_gate_for(ledger: Ledger, release_id: str, env: str) -> GateResult:
    """The "approved for ENV" gate from the ledger as it is now (shadow start uses it)."""
    found = check_approval(ledger, release_id, env)
    return approval_gate(env, found.record, rejected=found.rejected)
