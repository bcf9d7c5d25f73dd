"""Roll an environment back: no gates, to the release live before the current one (or a
named one), recorded as a new `rollback` event; the release rolled back from gets a
`mark_bad` event, so promote refuses it unless forced.

A rollback goes back, never forward: `--to` names a release that was live in that
environment before, is not marked bad, and whose manifest still lists the environment;
anything else is refused (`promote` takes it, through its gates). The ledger records it
decides on (what is live, what was, what is marked bad) are verified first.

With the previous release's server still warm the gateway switches 0.1-0.2 s after the call
(in process; through `releasekit rollback`, whose start alone takes about 1.6 s, the old
release answered 1.8 s after the command started and the command returned after 7.9 s:
benchmarks/results/rollback.json, one 2-core host); otherwise its server starts first (the
current release keeps serving meanwhile).

For the watcher and the Alertmanager receiver (watch/watcher.py's RollbackRequest):

    def rollback_fn(req: RollbackRequest) -> RollbackOutcome:
        r = rollback(settings, req.env, reason=req.reason, actor=f"releasekit-{req.trigger}",
                     from_release=req.from_release,
                     evidence={"trigger": req.trigger, "breaches": [...], "alert": req.alert})
        return RollbackOutcome(status=r.status, env=r.environment, ...)

`status` is `rolled_back`, `not_live` (another release is live by now: nothing done) or
`failed` (the target release did not start; the current one keeps serving).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from releasekit.config import Settings
from releasekit.config.lanes import is_lane, parent_env
from releasekit.deploy.environments import env_config
from releasekit.deploy.state import read_state
from releasekit.errors import ReleasekitError
from releasekit.promote.context import ReleaseInfo, load_release, release_spec
from releasekit.promote.deploy import deploy_release
from releasekit.promote.deploy_models import DeployOutcome
from releasekit.promote.records import RecordMove, marked_bad, move_record, was_live_in
from releasekit.releases.prompt_alias import PromptAliasResult
from releasekit.releases.resolve import resolve_release
from releasekit.stores.ledger import (
    DecisionRecordsError,
    Event,
    EventType,
    Ledger,
    LedgerRecord,
    open_ledger,
)
from releasekit.stores.ledger.breakglass import PastFailureLedger
from releasekit.stores.ledger.chain import VerifiedPrefix, verified_prefix

RollbackStatus = Literal["rolled_back", "not_live", "failed"]


class RollbackError(ReleasekitError):
    """Raised when there is nothing to roll back (nothing live in the environment), no
    earlier release to roll back to that is not itself marked bad, or `--to` names a
    release that was never live there, is marked bad, or may not go there."""

    remedy = "name the release with --to, or promote one"


_USE_PROMOTE = "use `releasekit promote` (its gates, approvals and smoke suite decide)"


class RollbackResult(BaseModel):
    """What a rollback did."""

    status: RollbackStatus
    environment: str
    from_release: str | None = None
    to_release: str | None = None
    reason: str
    warm: bool = Field(False, description="the target's server was already running")
    switch_s: float | None = Field(None, description="seconds from the call to the switch")
    message: str = ""
    deploy: DeployOutcome | None = None
    record: LedgerRecord | None = None
    marked_bad: LedgerRecord | None = None
    prompt_alias: PromptAliasResult | None = None
    warnings: list[str] = Field(default_factory=list)

    @property
    def event_id(self) -> str | None:
        """The ledger record of the rollback (or of its failure)."""
        return self.record.event_id if self.record else None


def _not_live(env: str, from_release: str, current: str | None, reason: str) -> RollbackResult:
    """The answer to a rollback from a release that is no longer live (a watcher's stale
    request): nothing to do."""
    return RollbackResult(
        status="not_live",
        environment=env,
        from_release=from_release,
        reason=reason,
        message=f"{from_release[:12]} is not live in {env} any more ({str(current)[:12]} is)",
    )


def previous_good_release(ledger: Ledger, env: str) -> str | None:
    """The latest release live in `env` before the current one that is not marked bad
    (what a rollback without --to goes back to), or None."""
    cur = ledger.live_at(env)
    current = cur.to_release if cur else None
    for rec in ledger.records(environment=env, live=True, newest_first=True):
        rid = rec.to_release
        if rid and rid != current and marked_bad(ledger, rid) is None:
            return rid
    return None


def _check_going_back(ledger: Ledger, info: ReleaseInfo, *, env: str) -> None:
    """RollbackError unless `info` was live in `env`, is not marked bad, and its manifest
    lists `env`: a rollback only goes back to what this environment already ran."""
    short = info.release_id[:12]
    if not was_live_in(ledger, info.release_id, env):
        raise RollbackError(
            f"{short} was never live in {env}: a rollback only goes back", remedy=_USE_PROMOTE
        )
    bad = marked_bad(ledger, info.release_id)
    if bad is not None:
        raise RollbackError(
            f"{short} is marked bad (record {bad.seq}, {bad.environment}: {bad.reason})",
            remedy=_USE_PROMOTE + "; `--force policy` overrides the mark there",
        )
    allowed = [e.name for e in info.lm.manifest.environments]
    if parent_env(env) not in allowed:
        raise RollbackError(
            f"{short} may not go to {env}: its manifest lists {', '.join(allowed) or 'none'}",
            remedy=_USE_PROMOTE,
        )


def rollback(
    settings: Settings,
    env: str,
    *,
    to: str | None = None,
    reason: str,
    actor: str | None = None,
    evidence: dict[str, Any] | None = None,
    from_release: str | None = None,
    ledger: Ledger | None = None,
    lock_timeout_s: float = 600.0,
    break_glass: bool = False,
) -> RollbackResult:
    """Move `env` back to `to` (a release reference) or to `previous_good_release`; no
    gates, no smoke suite (the release was live before). `from_release`: do nothing
    (`not_live`) unless that release is the one live now (the watcher's guard).
    RollbackError if nothing is live or there is nothing to go back to (the watcher's
    `no_known_good`); DeployStateError if another command holds the environment longer
    than `lock_timeout_s` (a retry can succeed). A ledger that does not verify raises
    DecisionRecordsError, unless `break_glass` (`break_glass_rollback`: back to the release
    live before the first bad record; with a ledger that verifies, an ordinary rollback)."""
    import time

    t0 = time.monotonic()
    env_config(settings, env)  # an unknown environment fails before anything else
    if not reason.strip():
        what = "a break-glass rollback" if break_glass else "a rollback"
        raise RollbackError(f"{what} needs a reason", remedy="pass --reason TEXT")
    led = ledger or open_ledger(settings)
    try:
        led.verified()  # what is live, what was, what is marked bad: verified records only
    except DecisionRecordsError as exc:
        if not break_glass:
            refused = DecisionRecordsError(exc.message, seq=exc.seq)
            refused.remedy = (
                f"nothing was changed; `releasekit rollback {env} --break-glass --reason TEXT` "
                "goes back to the release live before the first bad record and records the "
                "failure it went past; then run `releasekit ledger verify` and restore the "
                "ledger from a backup, or commit the signer's keys/<key id>.pub if legitimate"
            )
            raise refused from exc
        if to is not None:
            raise RollbackError(
                "--to does not go with --break-glass: a break-glass rollback goes to the "
                "release the verified records show live before the first bad record",
                remedy="leave out --to",
            ) from exc
        return break_glass_rollback(
            settings,
            env,
            led,
            reason=reason,
            actor=actor,
            evidence=evidence,
            from_release=from_release,
            started_at=t0,
            lock_timeout_s=lock_timeout_s,
        )
    cur = led.live_at(env)
    current = cur.to_release if cur else None
    if current is None:
        raise RollbackError(f"nothing is live in {env}: nothing to roll back")
    if from_release is not None and from_release != current:
        return _not_live(env, from_release, current, reason)
    target = resolve_release(settings, to, ledger=led).release_id if to else None
    target = target or previous_good_release(led, env)
    if target is None:
        raise RollbackError(
            f"{env} has no earlier release that is not marked bad",
            remedy=f"`releasekit down {env}` takes the lane's route out"
            if is_lane(env)
            else "promote a release to it",
        )
    if target == current:
        raise RollbackError(f"{target[:12]} is already live in {env}")
    info = load_release(settings, target, ledger=led)
    _check_going_back(led, info, env=env)
    return _go_back(
        settings,
        env,
        led,
        info,
        current=current,
        reason=reason,
        actor=actor,
        evidence=evidence,
        started_at=t0,
        lock_timeout_s=lock_timeout_s,
    )


def _go_back(
    settings: Settings,
    env: str,
    led: Ledger,
    info: ReleaseInfo,
    *,
    current: str,
    reason: str,
    actor: str | None,
    evidence: dict[str, Any] | None,
    started_at: float,
    lock_timeout_s: float,
    expected_live: str | None = None,
) -> RollbackResult:
    """Deploy `info` to `env` through its target (no smoke: it was live there), then record
    the live `rollback` event and mark `current` bad. `expected_live`: what the ledger's
    table says is live (default `current`), checked under the environment's lock."""
    target = info.release_id
    spec = release_spec(settings, info, ledger=led)
    moved: list[RecordMove] = []
    bad: list[LedgerRecord] = []

    def record(url: str) -> None:
        ev = {**(evidence or {}), "gateway": url, "rolled_back_from": current}
        move = move_record(
            settings,
            target,
            env=env,
            reason=reason,
            event_type=EventType.ROLLBACK,
            evidence=ev,
            actor=actor,
            previous_release_id=current,
            ledger=led,
        )
        moved.append(move)
        try:  # the rollback is recorded; a lost mark must not send traffic back
            mark = led.append(
                Event(
                    type=EventType.MARK_BAD,
                    environment=env,
                    from_release=target,
                    to_release=current,
                    reason=reason,
                    evidence={**(evidence or {}), "rolled_back_to": target},
                    live=False,
                    actor=actor,
                )
            )
            bad.append(mark)
        except ReleasekitError as exc:
            move.warnings.append(f"{current[:12]} not marked bad: {exc.message}")

    outcome = deploy_release(
        settings,
        env=env,
        spec=spec,
        probe=None,
        record=record,
        ledger=led,
        expected_live=current if expected_live is None else expected_live,
        actor=actor,
        started_at=started_at,
        lock_timeout_s=lock_timeout_s,
    )
    move = moved[0] if moved else None
    return RollbackResult(
        status="rolled_back" if outcome.ok else "failed",
        environment=env,
        from_release=current,
        to_release=target,
        reason=reason,
        warm=outcome.reused_server,
        switch_s=outcome.switch_s,
        message=outcome.failure or "",
        deploy=outcome,
        record=move.assign.record if move else outcome.failure_event,
        marked_bad=bad[0] if bad else None,
        prompt_alias=move.prompt_alias if move else None,
        warnings=[*move.assign.warnings, *move.warnings] if move else [],
    )


def break_glass_target(prefix: VerifiedPrefix, env: str, *, current: str | None) -> str:
    """Where a break-glass rollback of `env` goes, read from the verified records only: the
    release live there before the first bad record (the last live event that is not an
    `assign`); when that is `current` (what serves now: the bad record did not change it),
    the release live before it that the verified records do not mark bad. RollbackError when the
    verified records show none."""
    where = f"before record {prefix.first_bad_seq}" if prefix.first_bad_seq else "in the ledger"
    lives = [
        r
        for r in prefix.records
        if r.environment == env and r.live and r.type != EventType.ASSIGN.value and r.to_release
    ]
    if not lives:
        raise RollbackError(
            f"the verified records show nothing live in {env} {where}: no release to go back to",
            remedy="restore the ledger from a backup, then `releasekit rollback` or `promote`",
        )
    before = str(lives[-1].to_release)
    if before != current:
        return before
    bad = {
        r.to_release for r in prefix.records if r.type == EventType.MARK_BAD.value and r.to_release
    }
    for rec in reversed(lives):
        rid = str(rec.to_release)
        if rid != current and rid not in bad:
            return rid
    raise RollbackError(
        f"{before[:12]} was live in {env} {where} and still is; the verified records show no "
        "earlier release that is not marked bad",
        remedy="restore the ledger from a backup, then `releasekit rollback` or `promote`",
    )


def break_glass_rollback(
    settings: Settings,
    env: str,
    ledger: Ledger,
    *,
    reason: str,
    actor: str | None = None,
    evidence: dict[str, Any] | None = None,
    from_release: str | None = None,
    started_at: float | None = None,
    lock_timeout_s: float = 600.0,
) -> RollbackResult:
    """Roll `env` back although the ledger fails verification: to `break_glass_target`
    (decided on the verified prefix only), deployed through the environment's target as any
    rollback, recorded as a signed `rollback` event chained after the table's last row
    (`stores.ledger.breakglass`) whose evidence says which record failed and how
    (`break_glass`), with the reason; the release rolled back from is marked bad. The ledger
    still fails verification afterwards: restore or repair it."""
    import time

    t0 = time.monotonic() if started_at is None else started_at
    prefix = verified_prefix(ledger)
    if prefix.ok:  # nothing to go past: an ordinary rollback
        return rollback(
            settings,
            env,
            reason=reason,
            actor=actor,
            evidence=evidence,
            from_release=from_release,
            ledger=ledger,
            lock_timeout_s=lock_timeout_s,
        )
    view = PastFailureLedger.of(ledger, prefix)
    raw = ledger.live_at(env)  # what the table says now, bad rows included
    recorded = raw.to_release if raw else None
    routed = read_state(settings.state_dir, env).routed_release_ids()
    # What actually serves (a bad row may name anything); the table's word where unknown.
    current = routed[0] if len(set(routed)) == 1 else recorded
    if from_release is not None and from_release != current:
        return _not_live(env, from_release, current, reason)
    if current is None:
        raise RollbackError(f"nothing is live in {env}: nothing to roll back")
    target = break_glass_target(prefix, env, current=current)
    info = load_release(settings, target, ledger=view)
    allowed = [e.name for e in info.lm.manifest.environments]
    if parent_env(env) not in allowed:
        raise RollbackError(
            f"{info.short_id} may not go to {env}: its manifest lists {', '.join(allowed)}",
            remedy="restore the ledger from a backup, then `releasekit promote`",
        )
    glass = {**prefix.failure(), "went_past": "a ledger that fails verification"}
    res = _go_back(
        settings,
        env,
        view,
        info,
        current=current,
        reason=reason,
        actor=actor,
        evidence={**(evidence or {}), "break_glass": glass},
        started_at=t0,
        lock_timeout_s=lock_timeout_s,
        expected_live=recorded,
    )
    res.warnings.append(
        f"went past a ledger that fails verification at record {prefix.first_bad_seq}: "
        f"{prefix.problem}; the ledger still fails `releasekit ledger verify` until it is "
        "restored or repaired"
    )
    return res
