"""The watch's rollback path: the adapter from a watcher's or the receiver's rollback request
to `releasekit.promote.rollback.rollback` (breaking glass on a ledger that fails
verification), and the ledger look-ups the `RollbackGuard` asks: whether there is a
known-good release to go back to, and when the last rollback and promotion were."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from releasekit.config import Settings
from releasekit.deploy.state import DeployStateError
from releasekit.errors import LedgerLockTimeoutError, RegistryUnreachableError
from releasekit.promote.rollback import (
    RollbackError,
    RollbackResult,
    break_glass_target,
    previous_good_release,
)
from releasekit.stores.ledger import DecisionRecordsError, EventType, Ledger
from releasekit.stores.ledger.chain import verified_prefix
from releasekit.watch.rules import BreachEvidence
from releasekit.watch.watcher import (
    RollbackFn,
    RollbackOutcome,
    RollbackRequest,
    RollbackTransientError,
)

log = logging.getLogger(__name__)


class RollbackImpl(Protocol):
    """The signature of `releasekit.promote.rollback.rollback` the adapter calls."""

    def __call__(
        self,
        settings: Settings,
        env: str,
        *,
        reason: str,
        actor: str | None = ...,
        evidence: dict[str, Any] | None = ...,
        from_release: str | None = ...,
        ledger: Ledger | None = ...,
        break_glass: bool = ...,
    ) -> RollbackResult: ...


_TRANSIENT = (DeployStateError, LedgerLockTimeoutError, RegistryUnreachableError)


def breach_record(e: BreachEvidence) -> dict[str, Any]:
    """A breaching window as a rollback event holds it: the judgement, and the window cut
    to the figures `watch.rules.judge` reads (the rule's metric, and the request rate that
    picks a benchmark point): counts and quantiles, never a prompt or an answer."""
    keep = {e.judgement.metric, "request_rate"}
    w = e.window.model_copy(
        update={
            "figures": {k: v for k, v in e.window.figures.items() if k in keep},
            "histograms": {},
        }
    )
    return {"judgement": e.judgement.model_dump(mode="json"), "window": w.model_dump(mode="json")}


def rollback_adapter(
    settings: Settings, *, ledger: Ledger, impl: RollbackImpl | None = None
) -> RollbackFn:
    """The watcher's and receiver's rollback path: `releasekit.promote.rollback.rollback`
    (or `impl`, same signature) to the previous good release, with the breaching windows (or
    the alert) as the event's evidence, as `releasekit-watch` / `releasekit-alertmanager`.
    Nothing to go back to -> `no_known_good`; another release live by now -> `not_live`; a
    held deploy lock or ledger lock -> RollbackTransientError (retried).

    A ledger that fails verification does not stop it: a way back must always work, and an
    alert is when it is needed. It breaks glass on its own (`rollback(break_glass=True)`):
    back to the release the verified records show live before the first bad record, which
    no record at or after the failure can choose, recorded with the failure it went past
    and the trigger as its reason."""
    if impl is None:
        from releasekit.promote.rollback import rollback as impl_

        impl = impl_

    def call(req: RollbackRequest) -> RollbackOutcome:
        evidence: dict[str, Any] = {
            "trigger": req.trigger,
            "requested_at": req.requested_at,
            "rules": sorted({e.judgement.rule for e in req.evidence}),
            "breaches": [breach_record(e) for e in req.evidence],
        }
        if req.rules:  # the rules as judged (after the floor), for `audit replay`
            evidence["rule_params"] = [r.model_dump(mode="json") for r in req.rules]
        if req.alert is not None:
            evidence["alert"] = req.alert
        if req.answers is not None:
            evidence["rules"] = [*evidence["rules"], "after_promotion_answers"]
            evidence["answers"] = req.answers
            # What the answers came from, where a breach finder reads it (as a shadow's).
            evidence["answers_key"] = req.answers.get("answers_key")
        glass: dict[str, Any] = {}
        try:  # act only on verified records (what is live, what is marked bad)
            ledger.verified()
        except DecisionRecordsError as exc:
            log.warning("ledger fails verification; %s breaks glass: %s", req.env, exc.message)
            glass = {"break_glass": True}  # decided on the verified records only
        if ledger.live_at(req.env) is None:
            return RollbackOutcome(
                status="not_live",
                env=req.env,
                from_release=req.from_release,
                message=f"nothing is live in {req.env}",
            )
        try:
            res = impl(
                settings,
                req.env,
                reason=req.reason,
                actor=f"releasekit-{req.trigger}",
                evidence=evidence,
                from_release=req.from_release,
                ledger=ledger,
                **glass,
            )
        except RollbackError as exc:
            return RollbackOutcome(
                status="no_known_good",
                env=req.env,
                from_release=req.from_release,
                message=exc.message,
            )
        except _TRANSIENT as exc:
            raise RollbackTransientError(f"rollback of {req.env} must wait: {exc}") from exc
        return RollbackOutcome(
            status=res.status,
            env=res.environment,
            from_release=res.from_release,
            to_release=res.to_release,
            event_id=res.record.event_id if res.record is not None else None,
            message=res.message,
        )

    return call


def check_records(ledger: Ledger) -> None:
    """Verify afresh before a rollback decision; a failure is logged, not raised: the
    rollback then breaks glass on the verified records (`rollback_adapter`)."""
    try:
        ledger.verified(again=True)
    except DecisionRecordsError as exc:
        log.warning("the ledger fails verification: %s", exc.message)


def known_good(ledger: Ledger) -> Callable[[str], bool]:
    """`has_known_good(env)`: whether the ledger has an earlier release of `env` that is not
    marked bad (where a rollback would go)."""

    def has(env: str) -> bool:
        try:
            ledger.verified()  # marked-bad and live records: verified ones only
        except DecisionRecordsError:  # where a break-glass rollback would go
            raw = ledger.live_at(env)
            try:
                break_glass_target(
                    verified_prefix(ledger), env, current=raw.to_release if raw else None
                )
            except RollbackError:
                return False
            return True
        return previous_good_release(ledger, env) is not None

    return has


def _latest_event_time(ledger: Ledger, types: list[str]) -> Callable[[str], float | None]:
    """`latest(env)`: the unix time of the environment's newest event of `types` (None).
    The ledger is verified first (DecisionRecordsError otherwise): a forged rollback record
    would otherwise hold a regression live for a whole cool-down."""

    def latest(env: str) -> float | None:
        try:
            ledger.verified()
        except DecisionRecordsError:  # a break-glass rollback: the verified records only
            mine = [
                r
                for r in verified_prefix(ledger).records
                if r.environment == env and r.type in types
            ]
            return mine[-1].time.timestamp() if mine else None
        recs = ledger.records(environment=env, types=types, newest_first=True, limit=1)
        return recs[0].time.timestamp() if recs else None

    return latest


def last_rollback_time(ledger: Ledger) -> Callable[[str], float | None]:
    """`last_rollback_at(env)`: the unix time of the environment's latest rollback event (by
    any actor), so the cool-down also covers manual rollbacks and a restarted watcher."""
    return _latest_event_time(ledger, [EventType.ROLLBACK.value])


def last_promotion_time(ledger: Ledger) -> Callable[[str], float | None]:
    """`last_promotion_at(env)`: the unix time of the environment's latest promotion (forced
    or not) that put a new release live, so a rollback before it does not hold back the next.
    A redeploy of the release of record is not one."""
    return _latest_event_time(ledger, [EventType.PROMOTE.value, EventType.OVERRIDE.value])
