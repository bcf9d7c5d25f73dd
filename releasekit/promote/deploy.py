"""The blue/green deploy step shared by promote and rollback, and `down`/status of an
environment.

`deploy_release` runs under the environment's deploy lock:

1. reconcile the recorded processes (forget dead ones, stop half-started or expired ones);
2. make sure the environment's gateway runs;
3. reuse a live or warm server with the same serving key (a prompt-only release never
   restarts vLLM) or start the release's server on its own port;
4. smoke it through a private gateway (no client traffic yet);
5. switch the gateway's table to it atomically;
6. smoke it again through the environment's gateway;
7. move the record (the caller's `record`: ledger event via `assign`, then aliases);
8. drain the old upstream at the gateway, then keep its server warm for `warm_s` or stop it;
   after a promotion (`compare_previous`) with the policy's `after_promotion_compare_s` > 0,
   keep it warm at least that window (plus `drain_deadline_s`) and mirror the policy's
   `after_promotion_share` of live requests to it (`Mirror.purpose` `after_promotion`,
   ending at the window's end), so `watch` can compare the two releases' answers.

A failure in 3-4 leaves the old release serving and is a `deploy_failed` ledger event; a
failure in 6-7 switches the table back to what it was by itself, and records why.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, Field

from releasekit.config import EnvironmentConfig, Settings
from releasekit.deploy.gateway import GatewayError, Mirror, Route, RouteTable
from releasekit.deploy.gateway_client import GatewayClient
from releasekit.deploy.local import LocalTarget, check_health
from releasekit.deploy.smoke import run_smoke
from releasekit.deploy.state import (
    EnvState,
    GatewayRecord,
    StateHandle,
    locked_state,
    read_state,
)
from releasekit.deploy.target import (
    DeployError,
    ReleaseSpec,
    ReleaseStartError,
    SmokeProbe,
    SmokeResult,
    Upstream,
)
from releasekit.errors import ConfigError, ReleasekitError
from releasekit.promote.context import load_release, release_knee, release_spec
from releasekit.stores.ledger import Event, EventType, Ledger, LedgerRecord, open_ledger

DeployStage = Literal["start", "smoke", "canary", "switch", "gateway_smoke", "record"]


class EnvironmentNotConfiguredError(ConfigError):
    """Raised when a command names an environment that releasekit.toml does not define."""

    remedy = "add [environments.NAME] (port, target, policy) to releasekit.toml"


class ConcurrentChangeError(DeployError):
    """Raised when what is live in the environment changed while this command waited for
    the environment's deploy lock (another promote or rollback got there first)."""

    remedy = "look at `releasekit status` and run the command again if it still applies"


class DeployStep(BaseModel):
    """One step of a deploy, how long it took, and what it found."""

    step: str
    ok: bool
    seconds: float
    detail: str = ""


class AfterPromotionMirror(BaseModel):
    """The after-promotion comparison a deploy set up: `share` of the live requests copied
    to the previous release's warm server until `until` (unix time)."""

    previous_release_id: str
    base_url: str
    share: float
    window_s: float
    until: float


class DeployOutcome(BaseModel):
    """What a deploy did: where the environment's traffic goes now, and why if it failed."""

    environment: str
    release_id: str
    previous_release_id: str | None = None
    gateway_url: str | None = None
    ok: bool
    failed_stage: DeployStage | None = None
    failure: str | None = None
    reverted: bool = Field(False, description="traffic was switched back after a late failure")
    reused_server: bool = Field(False, description="no new vLLM: a running server serves it")
    switched: bool = False
    switch_s: float | None = Field(None, description="from the start of the step to the switch")
    smoke_preview: SmokeResult | None = None
    smoke_gateway: SmokeResult | None = None
    warm: list[str] = Field(default_factory=list, description="releases kept warm")
    stopped: list[str] = Field(default_factory=list, description="releases whose server stopped")
    drained: bool | None = None
    notes: list[str] = Field(default_factory=list)
    steps: list[DeployStep] = Field(default_factory=list)
    failure_event: LedgerRecord | None = None
    after_promotion: AfterPromotionMirror | None = Field(
        None, description="answers compared with the previous release's for a window"
    )
    serving: list[str] | None = Field(
        None,
        description="after a failure: the releases the environment's gateway still sends "
        "traffic to (empty: nothing serves it), read from the deploy state",
    )

    @property
    def still_serving(self) -> str:
        """After a failure, who keeps serving, in words: '0123abcd4567 keeps serving',
        'nothing serves staging'."""
        if self.serving is None:  # not read: the release of record before the deploy
            prev = self.previous_release_id
            return f"{prev[:12]} keeps serving" if prev else f"nothing serves {self.environment}"
        if not self.serving:
            return f"nothing serves {self.environment}"
        names = ", ".join(r[:12] for r in self.serving)
        return f"{names} {'keeps' if len(self.serving) == 1 else 'keep'} serving"


RecordFn = Callable[[str], Any]
"""Moves the record once traffic is on the new release; gets the gateway URL. Raising
reverts the switch."""


@dataclass(frozen=True)
class ShiftContext:
    """What a traffic shift before the switch (canary steps) works with: the environment's
    gateway, the candidate's route and the routes serving now (stable)."""

    env: str
    gateway: GatewayRecord
    canary: Route
    stable: list[Route]
    previous_release_id: str | None
    links: dict[str, str] = field(default_factory=dict)
    start_baseline: Callable[[], tuple[Route, Upstream]] | None = None
    """Starts a fresh server of the live release (not routed): its route and handle. Only
    where the target can run a second server of a release (local)."""
    stop_baseline: Callable[[], None] | None = None
    """Stops the server `start_baseline` started (call once nothing is routed to it)."""


class ShiftResult(BaseModel):
    """What a shift did. `ok`: the candidate may take all traffic; otherwise traffic is
    back on `stable` and `event` is the ledger record that says why."""

    ok: bool
    problem: str | None = None
    detail: str = ""
    evidence: dict[str, Any] = Field(default_factory=dict)
    event: LedgerRecord | None = None


ShiftFn = Callable[[ShiftContext], ShiftResult]
"""Moves part of the traffic to the candidate before the switch (canary steps), under the
deploy lock; on a False result the deploy stops the candidate and records the failure."""


def env_config(settings: Settings, env: str) -> EnvironmentConfig:
    """The environment's settings; EnvironmentNotConfiguredError if releasekit.toml has none."""
    cfg = settings.environments.get(env)
    if cfg is None:
        known = ", ".join(sorted(settings.environments)) or "none"
        raise EnvironmentNotConfiguredError(
            f"environment {env!r} is not configured in releasekit.toml (configured: {known})"
        )
    return cfg


def target_for(
    settings: Settings,
    env: str,
    cfg: EnvironmentConfig,
    handle: StateHandle,
    *,
    replicas: int | None = None,
) -> LocalTarget:
    """The deploy target an environment names (`target` in releasekit.toml): `local`, or
    `ray` (with `replicas` per release instead of the environment's count, when given)."""
    if cfg.target == "local":
        return LocalTarget(settings, env, cfg, handle)
    if cfg.target == "ray":
        from releasekit.deploy.ray.target import RayTarget

        return RayTarget(settings, env, cfg, handle, replicas=replicas)
    raise EnvironmentNotConfiguredError(f"environment {env!r}: unknown target {cfg.target!r}")


def _routes_alive(state: EnvState) -> list[Route]:
    urls = {s.base_url for s in state.servers}
    return [r for r in state.routes if r.base_url in urls]


def _fail_event(
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


def _smoke_summary(s: SmokeResult | None) -> dict[str, Any] | None:
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


def deploy_release(
    settings: Settings,
    *,
    env: str,
    spec: ReleaseSpec,
    probe: SmokeProbe | None,
    record: RecordFn,
    ledger: Ledger,
    expected_live: str | None,
    actor: str | None = None,
    lock_timeout_s: float = 600.0,
    started_at: float | None = None,
    shift: ShiftFn | None = None,
    replicas: int | None = None,
    compare_previous: bool = False,
) -> DeployOutcome:
    """Blue/green deploy of `spec` to `env` (see the module docstring). `probe` None skips
    both smoke runs (rollback to a known-good release). `expected_live` is the release the
    caller saw live; ConcurrentChangeError if another command changed it meanwhile.
    `started_at` (time.monotonic() of the command's start) is what `switch_s` counts from.
    `replicas` (the `ray` target) overrides the environment's replica count.
    `shift` (canary steps) runs between the smoke and the switch when a release serves the
    environment already; when it fails, the candidate is drained and stopped, nothing else
    changes, and the outcome's `failure_event` is the shift's record.
    `compare_previous` (a promotion, not a rollback): mirror to the previous release for
    the policy's `after_promotion_compare_s` (the caller checked the policy is committed).
    A failed outcome says what still serves the environment (`serving`)."""
    out = _deploy_release(
        settings,
        env=env,
        spec=spec,
        probe=probe,
        record=record,
        ledger=ledger,
        expected_live=expected_live,
        actor=actor,
        lock_timeout_s=lock_timeout_s,
        started_at=started_at,
        shift=shift,
        replicas=replicas,
        compare_previous=compare_previous,
    )
    if not out.ok:
        out.serving = serving_releases(settings, env)
    return out


def serving_releases(settings: Settings, env: str) -> list[str]:
    """The releases `env`'s gateway sends traffic to now (by the deploy state: a running
    gateway's routes with weight; empty when no gateway runs)."""
    from releasekit.deploy.local import process_alive

    st = read_state(settings.state_dir, env)
    gw = st.gateway
    if gw is None or not process_alive(gw.pid, gw.proc_start):
        return []
    return list(dict.fromkeys(r.release_id for r in st.routes if r.weight > 0))


def _deploy_release(
    settings: Settings,
    *,
    env: str,
    spec: ReleaseSpec,
    probe: SmokeProbe | None,
    record: RecordFn,
    ledger: Ledger,
    expected_live: str | None,
    actor: str | None = None,
    lock_timeout_s: float = 600.0,
    started_at: float | None = None,
    shift: ShiftFn | None = None,
    replicas: int | None = None,
    compare_previous: bool = False,
) -> DeployOutcome:
    """The steps of `deploy_release`."""
    cfg = env_config(settings, env)
    t0 = time.monotonic() if started_at is None else started_at
    out = DeployOutcome(environment=env, release_id=spec.release_id, ok=False)

    def step(name: str, ok: bool, since: float, detail: str = "") -> None:
        out.steps.append(
            DeployStep(step=name, ok=ok, seconds=round(time.monotonic() - since, 3), detail=detail)
        )

    with locked_state(settings.state_dir, env, timeout_s=lock_timeout_s) as handle:
        # What releasekit put in place there (an `assign` record deployed nothing).
        live_rec = ledger.served_at(env)
        live_now = live_rec.to_release if live_rec else None
        if live_now != expected_live:
            raise ConcurrentChangeError(
                f"{env} changed while waiting: {str(live_now)[:12]} is live now, "
                f"not {str(expected_live)[:12]}"
            )
        out.previous_release_id = live_now
        target = target_for(settings, env, cfg, handle, replicas=replicas)
        out.notes += target.reconcile()
        handle.state.routes = _routes_alive(handle.state)
        ts = time.monotonic()
        out.gateway_url = target.ensure_router(handle.state.routes)
        step("gateway", True, ts, out.gateway_url)

        # 3. a server for the release
        ts = time.monotonic()
        reusable = handle.state.server_serving(spec.serving_key)
        up: Upstream | None = None
        newly_started = False
        if reusable is not None:
            cand = target.upstream_of(reusable)
            if target.health(cand):
                up, out.reused_server = cand, True
                step("server", True, ts, f"reused {reusable.base_url} (pid {reusable.pid})")
        if up is None:
            try:
                up = target.start(spec)
                newly_started = True
                step("server", True, ts, f"started {up.base_url} (pid {up.handle.get('pid')})")
            except ReleaseStartError as exc:
                step("server", False, ts, exc.message.splitlines()[0])
                out.failed_stage, out.failure = "start", exc.message.splitlines()[0]
                out.failure_event = _fail_event(
                    ledger,
                    env=env,
                    release_id=spec.release_id,
                    previous=live_now,
                    stage="start",
                    failure=out.failure,
                    actor=actor,
                    extra={"log": exc.log_path, "log_tail": exc.log_tail[-2000:]},
                )
                return out

        def drop_new() -> None:
            if newly_started and up is not None:
                target.stop(up, grace_s=settings.server_stop_grace_s)
                out.stopped.append(spec.release_id)

        # 4. smoke before any client traffic
        if probe is not None:
            ts = time.monotonic()
            problem: str | None
            try:
                out.smoke_preview = target.smoke(up, spec, probe)
            except (GatewayError, ReleasekitError) as exc:
                out.smoke_preview = None
                problem = f"preview gateway failed: {exc}"
            else:
                problem = out.smoke_preview.problem
            step("smoke (preview)", problem is None, ts, problem or "passed")
            if problem is not None:
                drop_new()
                out.failed_stage, out.failure = "smoke", problem
                out.failure_event = _fail_event(
                    ledger,
                    env=env,
                    release_id=spec.release_id,
                    previous=live_now,
                    stage="smoke",
                    failure=problem,
                    actor=actor,
                    extra={"smoke": _smoke_summary(out.smoke_preview)},
                )
                return out

        # 5a. canary steps: part of the traffic first, judged live (the shift's own job)
        previous_routes = list(handle.state.routes)
        if shift is not None and previous_routes and handle.state.gateway is not None:
            ts = time.monotonic()
            baselines: list[Upstream] = []

            def start_baseline() -> tuple[Route, Upstream]:
                info = load_release(settings, str(live_now), ledger=ledger)
                base = release_spec(settings, info, ledger=ledger)
                baselines.append(target.start(base))
                return baselines[-1].route(base), baselines[-1]

            def stop_baseline() -> None:
                while baselines:
                    target.stop(baselines.pop(), grace_s=settings.server_stop_grace_s)

            ctx = ShiftContext(
                env=env,
                gateway=handle.state.gateway,
                canary=up.route(spec),
                stable=previous_routes,
                previous_release_id=live_now,
                start_baseline=start_baseline
                if live_now and isinstance(target, LocalTarget)
                else None,
                stop_baseline=stop_baseline,
            )
            try:
                shifted = shift(ctx)
            finally:
                stop_baseline()  # the shift stops it; a shift that raised leaves it here
            step("canary", shifted.ok, ts, shifted.detail or (shifted.problem or "passed"))
            if not shifted.ok:
                with contextlib.suppress(GatewayError, DeployError):
                    target.route(previous_routes)  # the shift put it back; make sure
                out.reverted = True
                if not any(r.base_url == up.base_url for r in previous_routes):
                    target.wait_drained(spec.release_id, deadline_s=cfg.drain_deadline_s)
                drop_new()
                out.failed_stage, out.failure = "canary", shifted.problem or "canary failed"
                out.failure_event = shifted.event
                return out
            out.notes.append(shifted.detail or "canary steps passed")

        # 5. switch
        roles_before = {s.ident: (s.role, s.warm_until) for s in handle.state.servers}
        rec = target.record(up)
        ts = time.monotonic()
        try:
            target.route([up.route(spec)])
        except (GatewayError, DeployError) as exc:
            step("switch", False, ts, str(exc))
            drop_new()
            out.failed_stage, out.failure = "switch", str(exc)
            out.failure_event = _fail_event(
                ledger,
                env=env,
                release_id=spec.release_id,
                previous=live_now,
                stage="switch",
                failure=str(exc),
                actor=actor,
            )
            return out
        out.switched = True
        out.switch_s = round(time.monotonic() - t0, 3)
        step("switch", True, ts)
        for s in handle.state.servers:
            if rec is not None and s.ident == rec.ident:
                s.role, s.warm_until = "live", None
        handle.save()

        def revert(stage: DeployStage, problem: str, extra: dict[str, Any]) -> DeployOutcome:
            tr = time.monotonic()
            try:
                target.route(previous_routes)
                out.reverted = True
            except (GatewayError, DeployError) as exc:
                problem += f"; switching back ALSO failed: {exc}"
            for s in handle.state.servers:
                if s.ident in roles_before:
                    s.role, s.warm_until = roles_before[s.ident]
            handle.save()
            step("revert", out.reverted, tr)
            if not (
                rec is not None
                and any(
                    r.base_url == rec.base_url and r.api_key == rec.api_key for r in previous_routes
                )
            ):
                if out.reverted:
                    target.wait_drained(spec.release_id, deadline_s=cfg.drain_deadline_s)
                drop_new()
            out.failed_stage, out.failure = stage, problem
            out.failure_event = _fail_event(
                ledger,
                env=env,
                release_id=spec.release_id,
                previous=live_now,
                stage=stage,
                failure=problem,
                actor=actor,
                extra={**extra, "reverted": out.reverted, "reverted_to": live_now},
            )
            return out

        # 6. smoke through the environment's gateway
        if probe is not None:
            ts = time.monotonic()
            key = cfg.api_keys[0] if cfg.api_keys else None
            gw_rec = handle.state.gateway
            out.smoke_gateway = run_smoke(
                out.gateway_url,
                probe,
                release_id=spec.release_id,
                where="gateway",
                api_key=key,
                admin_token=gw_rec.admin_token if gw_rec is not None else None,
            )
            step(
                "smoke (gateway)",
                out.smoke_gateway.passed,
                ts,
                out.smoke_gateway.problem or "passed",
            )
            if not out.smoke_gateway.passed:
                return revert(
                    "gateway_smoke",
                    out.smoke_gateway.problem or "smoke failed",
                    {"smoke": _smoke_summary(out.smoke_gateway)},
                )

        # 7. the record
        ts = time.monotonic()
        try:
            record(out.gateway_url)
        except ReleasekitError as exc:
            step("record", False, ts, exc.message)
            return revert("record", f"recording the release failed: {exc.message}", {})
        step("record", True, ts)

        # 8. the old upstream: drain, then warm or stop
        ts = time.monotonic()
        window = cfg.after_promotion_compare_s if compare_previous else 0.0
        prev = next(
            (r for r in previous_routes if r.release_id == live_now != spec.release_id), None
        )
        new_ident = rec.ident if rec is not None else None
        olds = [s for s in handle.state.servers if s.ident != new_ident]
        leaving = [s for s in olds if s.role == "live"]
        # the previous release's own server first (the one the comparison copies to)
        leaving.sort(key=lambda s: prev is None or s.base_url != prev.base_url)
        keep = None
        if leaving and (
            cfg.warm_s > 0
            or (window > 0 and prev is not None and leaving[0].base_url == prev.base_url)
        ):
            keep = leaving[0]
        to_stop = [s for s in olds if s is not keep]
        if to_stop:
            drained = True
            for rid in dict.fromkeys(r.release_id for r in previous_routes):
                if rid != spec.release_id:
                    ok = target.wait_drained(rid, deadline_s=cfg.drain_deadline_s)
                    drained = drained and ok
            out.drained = drained
        for s in to_stop:
            target.stop(target.upstream_of(s), grace_s=settings.server_stop_grace_s)
            out.stopped.append(s.release_id)
        now = time.time()
        if keep is not None:
            keep.role, keep.warm_until = "warm", now + cfg.warm_s
            if window > 0 and prev is not None and keep.base_url == prev.base_url:
                keep.warm_until = max(keep.warm_until, now + window + cfg.drain_deadline_s)
            out.warm.append(keep.release_id)
        handle.save()
        if window > 0 and prev is not None:
            _mirror_previous(out, handle, cfg, prev, window=window, until=now + window)
        target.after_change()
        step("retire old", out.drained is not False, ts, f"warm {out.warm}, stopped {out.stopped}")
        out.ok = True
        return out


def _mirror_previous(
    out: DeployOutcome,
    handle: StateHandle,
    cfg: EnvironmentConfig,
    prev: Route,
    *,
    window: float,
    until: float,
) -> None:
    """Copy `cfg.after_promotion_share` of the live requests to the previous release's
    server (still running: kept warm past `until`, or the live one a prompt-only release
    shares) until `until`. A gateway that refuses leaves a note, never a failed deploy."""
    st = handle.state
    if st.gateway is None or prev.base_url not in {s.base_url for s in st.servers}:
        out.notes.append("no answer comparison: the previous release's server is not running")
        return
    mirror = Mirror(
        route=prev,
        share=cfg.after_promotion_share,
        max_in_flight=cfg.shadow_max_in_flight,
        keep_prompts=cfg.shadow_keep_prompts,
        purpose="after_promotion",
        until=until,
    )
    try:
        with GatewayClient(st.gateway.url, admin_token=st.gateway.admin_token) as c:
            c.set_routes(RouteTable(routes=list(st.routes), mirror=mirror))
    except GatewayError as exc:
        out.notes.append(f"no answer comparison: the gateway refused the mirror: {exc}")
        return
    st.mirror = mirror  # a restarted gateway mirrors again; the next table ends it
    handle.save()
    out.after_promotion = AfterPromotionMirror(
        previous_release_id=prev.release_id,
        base_url=prev.base_url,
        share=mirror.share,
        window_s=window,
        until=until,
    )
    out.notes.append(
        f"comparing answers with {prev.release_id[:12]}: {mirror.share:.0%} of requests "
        f"mirrored for {window:g} s (`releasekit watch` judges them)"
    )


class DownResult(BaseModel):
    """What `down` stopped."""

    environment: str
    gateway_stopped: bool
    servers_stopped: list[str]
    notes: list[str] = Field(default_factory=list)
    record: LedgerRecord | None = None


def down(
    settings: Settings,
    env: str,
    *,
    reason: str = "",
    actor: str | None = None,
    ledger: Ledger | None = None,
) -> DownResult:
    """Stop `env`'s gateway (in-flight requests get its drain deadline) and every server,
    clear its state and record a `down` event. The release of record does not change: the
    next promote or rollback compares with it and starts what it needs."""
    cfg = settings.environments.get(env) or EnvironmentConfig(port=1)
    led = ledger or open_ledger(settings)
    with locked_state(settings.state_dir, env) as handle:
        target = target_for(settings, env, cfg, handle)
        notes = target.reconcile()
        had_gateway = handle.state.gateway is not None
        target.stop_router()
        stopped = []
        for s in list(handle.state.servers):
            target.stop(target.upstream_of(s), grace_s=settings.server_stop_grace_s)
            stopped.append(s.release_id)
        handle.state.servers = []
        handle.save()
    rec = None
    if had_gateway or stopped:
        live = led.live_at(env)
        rec = led.append(
            Event(
                type=EventType.DOWN,
                environment=env,
                from_release=live.to_release if live else None,
                reason=reason or "releasekit down",
                evidence={"servers_stopped": stopped, "gateway_stopped": had_gateway},
                live=False,
                actor=actor,
            )
        )
    return DownResult(
        environment=env,
        gateway_stopped=had_gateway,
        servers_stopped=stopped,
        notes=notes,
        record=rec,
    )


class ReplicaStatus(BaseModel):
    """One replica of a release on the `ray` target: where Ray placed it."""

    replica: str
    node_id: str
    node_ip: str
    pid: int
    server_pid: int
    server_url: str
    log: str


class ScaleStatus(BaseModel):
    """A `ray` release's replica count now, from Ray Serve's own state, and the range its
    environment's autoscaling keeps it in."""

    running: int = Field(description="replicas RUNNING now (Ray Serve's controller)")
    starting: int = 0
    stopping: int = 0
    status: str = Field(description="the deployment's status: HEALTHY, UPSCALING, DOWNSCALING")
    trigger: str = ""
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_in_flight: float | None = None
    autoscaling: str | None = Field(None, description="the plan in one line (None: fixed)")


class ServerStatus(BaseModel):
    """One recorded server (a Serve application on the `ray` target), as it is now."""

    release_id: str
    role: str
    base_url: str
    pid: int
    healthy: bool
    warm_until: dt.datetime | None = None
    log_path: str
    target: str = "local"
    app: str | None = Field(None, description="its Ray Serve application")
    replicas: list[ReplicaStatus] = Field(
        default_factory=list, description="the `ray` target's replicas, with their nodes"
    )
    scale: ScaleStatus | None = Field(None, description="`ray`: replica count and range")


class MirrorStatus(BaseModel):
    """The gateway's mirror in an environment, as `deploy-status` shows it."""

    purpose: str = Field(description="shadow, or after_promotion (answers compared)")
    release_id: str = Field(description="the release receiving the copies")
    share: float
    until: dt.datetime | None = None
    left_s: float | None = Field(None, description="seconds of the window left (0: over)")
    mirrored: int | None = Field(None, description="copies sent (None: gateway not read)")
    dropped: int | None = None
    pairs: int | None = Field(None, description="answer pairs recorded so far")


class EnvDeployStatus(BaseModel):
    """What runs for one environment right now, from its state file and a health check."""

    environment: str
    configured: bool
    gateway_url: str | None = None
    gateway_healthy: bool = False
    gateway_pid: int | None = None
    routes: list[dict[str, Any]] = Field(default_factory=list)
    servers: list[ServerStatus] = Field(default_factory=list)
    ledger_release_id: str | None = Field(None, description="the release of record")
    serving: bool = Field(description="the gateway is up and routes to the release of record")
    agrees: bool = Field(
        description="no contradiction: the gateway routes only to the release of record, "
        "or nothing runs (after `down`)"
    )
    mirror: MirrorStatus | None = Field(
        None, description="the gateway's mirror: a shadow, or the after-promotion comparison"
    )


def _mirror_status(state: EnvState, gw_ok: bool, now: float) -> MirrorStatus | None:
    """The recorded mirror, with the gateway's counts when it answers."""
    m = state.mirror
    if m is None:
        return None
    ms = MirrorStatus(
        purpose=m.purpose,
        release_id=m.route.release_id,
        share=m.share,
        until=dt.datetime.fromtimestamp(m.until, dt.UTC) if m.until is not None else None,
        left_s=max(0.0, m.until - now) if m.until is not None else None,
    )
    gw = state.gateway
    if gw_ok and gw is not None:
        with (
            contextlib.suppress(GatewayError),
            GatewayClient(gw.url, admin_token=gw.admin_token, timeout_s=2.0) as c,
        ):
            gs = c.state()
            if gs.mirror == m.route.release_id:
                ms.mirrored, ms.dropped, ms.pairs = gs.mirrored, gs.mirror_dropped, gs.mirror_pairs
    return ms


def _replicas(settings: Settings, env: str, app: str | None) -> list[ReplicaStatus]:
    """The replicas of a `ray` application, read from its cluster ([] when unreachable)."""
    cfg = settings.environments.get(env)
    if app is None or cfg is None or cfg.ray is None:
        return []
    from releasekit.deploy.ray.cluster import connect, replicas_of

    try:
        connect(cfg.ray)
        return [ReplicaStatus.model_validate(r.model_dump()) for r in replicas_of(app)]
    except ReleasekitError:
        return []


def _scale(
    settings: Settings, env: str, app: str | None, release_id: str, ledger: Ledger
) -> ScaleStatus | None:
    """A `ray` application's replica count from Serve's status, with the range its
    environment's autoscaling gives the release (None when unreachable or not ray)."""
    cfg = settings.environments.get(env)
    if app is None or cfg is None or cfg.ray is None:
        return None
    from releasekit.deploy.ray.autoscale import plan_for
    from releasekit.deploy.ray.cluster import connect, scale_state

    try:
        connect(cfg.ray)
        now = scale_state(app)
    except ReleasekitError:
        return None
    if now is None:
        return None
    out = ScaleStatus(**now.model_dump())
    auto = cfg.ray.autoscaling
    if auto is not None:
        out.min_replicas, out.max_replicas = auto.min_replicas, auto.max_replicas
        try:
            info = load_release(settings, release_id, ledger=ledger)
            knee, problem = release_knee(settings, info)
            plan = plan_for(
                env,
                auto,
                release_id,
                knee,
                problem or None,
                replica_cpus=cfg.ray.cpus_per_replica,
            )
        except ReleasekitError as exc:
            out.autoscaling = (
                f"autoscaling {auto.min_replicas}-{auto.max_replicas} replicas ({exc})"
            )
        else:
            out.target_in_flight, out.autoscaling = plan.target_in_flight, plan.text
    return out


def deploy_status(
    settings: Settings, *, env: str | None = None, ledger: Ledger | None = None
) -> list[EnvDeployStatus]:
    """Every configured (or recorded) environment's gateway, routes and servers; reads the
    state without taking the lock and changes nothing."""
    from releasekit.deploy.local import process_alive
    from releasekit.deploy.state import list_envs

    led = ledger or open_ledger(settings, read_only=True)
    names = [env] if env else sorted({*settings.environments, *list_envs(settings.state_dir)})
    out: list[EnvDeployStatus] = []
    for name in names:
        st = read_state(settings.state_dir, name)
        gw = st.gateway
        gw_ok = bool(gw and process_alive(gw.pid, gw.proc_start))
        live = led.live_at(name)
        routed = st.routed_release_ids()
        servers = [
            ServerStatus(
                release_id=s.release_id,
                role=s.role,
                base_url=s.base_url,
                pid=s.pid,
                healthy=(s.app is not None or process_alive(s.pid, s.proc_start))
                and check_health(s.base_url, s.model, api_key=s.api_key, timeout_s=2.0),
                warm_until=dt.datetime.fromtimestamp(s.warm_until, dt.UTC)
                if s.warm_until
                else None,
                log_path=s.log_path,
                target=s.target,
                app=s.app,
                replicas=_replicas(settings, name, s.app),
                scale=_scale(settings, name, s.app, s.release_id, led),
            )
            for s in st.servers
        ]
        out.append(
            EnvDeployStatus(
                environment=name,
                configured=name in settings.environments,
                gateway_url=gw.url if gw else None,
                gateway_healthy=gw_ok,
                gateway_pid=gw.pid if gw else None,
                routes=[
                    {"release_id": r.release_id, "base_url": r.base_url, "weight": r.weight}
                    for r in st.routes
                ],
                servers=servers,
                ledger_release_id=live.to_release if live else None,
                serving=gw_ok and bool(live) and routed == [live.to_release if live else None],
                agrees=(not gw_ok and not routed)
                or (bool(live) and routed == [live.to_release if live else None]),
                mirror=_mirror_status(st, gw_ok, time.time()),
            )
        )
    return out
