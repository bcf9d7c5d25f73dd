"""The steps both deploys share (a release's blue/green deploy, `releasekit.promote.deploy`,
and an adapter lane's, `releasekit.promote.lane_deploy`): the routes still alive, the
`deploy_failed` event, and what an event records of a smoke run."""

from __future__ import annotations

from typing import Any

from releasekit.deploy.gateway import Route
from releasekit.deploy.state import EnvState
from releasekit.deploy.target import SmokeResult
from releasekit.stores.ledger import Event, EventType, Ledger, LedgerRecord


def routes_alive(state: EnvState) -> list[Route]:
    """The routes whose upstream is a recorded server of the environment."""
    urls = {s.base_url for s in state.servers}
    return [r for r in state.routes if r.base_url in urls]


def fail_event(
    ledger: Ledger,
    *,
    env: str,
    release_id: str,
    previous: str | None,
    stage: str,
    failure: str,
    actor: str | None,
    extra: dict[str, Any] | None = None,
) -> LedgerRecord:
    """Record a `deploy_failed` event: the deploy stopped at `stage` because of `failure`."""
    return ledger.append(
        Event(
            type=EventType.DEPLOY_FAILED,
            environment=env,
            from_release=previous,
            to_release=release_id,
            reason=f"{stage}: {failure}"[:2000],
            evidence={"stage": stage, **(extra or {})},
            live=False,
            actor=actor,
        )
    )


def smoke_summary(s: SmokeResult | None) -> dict[str, Any] | None:
    """What a deploy event records of a smoke run."""
    if s is None:
        return None
    return {
        "where": s.where,
        "passed": s.passed,
        "n": s.n,
        "answered": s.answered,
        "pass_rate": s.pass_rate,
        "problem": s.problem,
    }
