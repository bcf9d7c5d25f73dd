"""The steps both deploys share (a release's blue/green deploy, `releasekit.promote.deploy`,
and an adapter lane's, `releasekit.promote.lane_deploy`): the routes still alive, the
`deploy_failed` event, what an event records of a smoke run, and one deploy's outcome as it
goes (`DeployRun`)."""

from __future__ import annotations

import time
from typing import Any

from releasekit.config import EnvironmentConfig
from releasekit.deploy.gateway import Route
from releasekit.deploy.smoke import run_smoke
from releasekit.deploy.state import EnvState
from releasekit.deploy.target import ReleaseSpec, SmokeProbe, SmokeResult
from releasekit.promote.deploy_models import (
    ConcurrentChangeError,
    DeployOutcome,
    DeployStage,
    DeployStep,
)
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


class DeployRun:
    """One deploy's outcome as it goes (`out`): each step with its seconds (`step`), and a
    failure said and recorded as a `deploy_failed` event (`fail`, whose `extra` goes into
    the event's evidence beside `base_extra`)."""

    def __init__(
        self,
        ledger: Ledger,
        *,
        env: str,
        spec: ReleaseSpec,
        actor: str | None,
        base_extra: dict[str, Any] | None = None,
    ) -> None:
        self.ledger, self.env, self.spec, self.actor = ledger, env, spec, actor
        self.base_extra = base_extra or {}
        self.out = DeployOutcome(environment=env, release_id=spec.release_id, ok=False)

    def step(self, name: str, ok: bool, since: float, detail: str = "") -> None:
        """Record step `name`, begun at `since` (time.monotonic())."""
        self.out.steps.append(
            DeployStep(step=name, ok=ok, seconds=round(time.monotonic() - since, 3), detail=detail)
        )

    def expect_live(self, expected: str | None) -> str | None:
        """What releasekit put in place in the environment (an `assign` record deployed
        nothing), checked against what the caller saw (ConcurrentChangeError otherwise)."""
        rec = self.ledger.served_at(self.env)
        live = rec.to_release if rec else None
        if live != expected:
            raise ConcurrentChangeError(
                f"{self.env} changed while waiting: {str(live)[:12]} is live now, "
                f"not {str(expected)[:12]}"
            )
        self.out.previous_release_id = live
        return live

    def fail(
        self, stage: DeployStage, failure: str, extra: dict[str, Any] | None = None
    ) -> DeployOutcome:
        """The deploy failed at `stage`: say why, and record a `deploy_failed` event."""
        self.out.failed_stage, self.out.failure = stage, failure
        self.out.failure_event = fail_event(
            self.ledger,
            env=self.env,
            release_id=self.spec.release_id,
            previous=self.out.previous_release_id,
            stage=stage,
            failure=failure,
            actor=self.actor,
            extra={**self.base_extra, **(extra or {})},
        )
        return self.out

    def gateway_smoke(
        self,
        cfg: EnvironmentConfig,
        state: EnvState,
        probe: SmokeProbe,
        *,
        adapters: list[str],
        suite: bool = True,
    ) -> bool:
        """Smoke the release through the environment's gateway (`out.gateway_url`) as its
        clients reach it, record the step and the result (`out.smoke_gateway`); whether it
        passed."""
        ts = time.monotonic()
        gw = state.gateway
        res = self.out.smoke_gateway = run_smoke(
            str(self.out.gateway_url),
            probe,
            release_id=self.spec.release_id,
            where="gateway",
            api_key=cfg.api_keys[0] if cfg.api_keys else None,
            admin_token=gw.admin_token if gw is not None else None,
            adapters=adapters,
            suite=suite,
        )
        self.step("smoke (gateway)", res.passed, ts, res.problem or "passed")
        return res.passed
