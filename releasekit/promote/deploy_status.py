"""An environment as it runs now: `deploy_status` (gateway, routes, servers, a `ray`
release's replicas and scale, the adapter versions a server keeps loaded after its route moved
on, the mirror), the releases it serves, and `down`."""

from __future__ import annotations

import contextlib
import datetime as dt
import time
from typing import Any

from pydantic import BaseModel, Field

from releasekit.config import EnvironmentConfig, Settings
from releasekit.config.lanes import is_lane, lane_name
from releasekit.deploy.environments import env_config, target_for
from releasekit.deploy.gateway import GatewayError
from releasekit.deploy.gateway_client import GatewayClient
from releasekit.deploy.local import check_health
from releasekit.deploy.state import EnvState, locked_state, read_state
from releasekit.deploy.warm_adapters import overdue_unloads
from releasekit.errors import ReleasekitError
from releasekit.promote.context import load_release, release_knee
from releasekit.promote.lane_deploy import lane_down
from releasekit.stores.ledger import Event, EventType, Ledger, LedgerRecord, open_ledger


def serving_releases(settings: Settings, env: str) -> list[str]:
    """The releases `env`'s gateway sends traffic to now (by the deploy state: a running
    gateway's routes with weight; empty when no gateway runs)."""
    from releasekit.deploy.local import process_alive

    st = read_state(settings.state_dir, env)
    gw = st.gateway
    if gw is None or not process_alive(gw.pid, gw.proc_start):
        return []
    return list(dict.fromkeys(r.release_id for r in st.routes if r.weight > 0))


class DownResult(BaseModel):
    """What `down` stopped."""

    environment: str
    gateway_stopped: bool
    servers_stopped: list[str]
    notes: list[str] = Field(default_factory=list)
    record: LedgerRecord | None = None
    lanes_down: list[str] = Field(
        default_factory=list, description="adapter lanes whose route was taken out"
    )


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
    next promote or rollback compares with it and starts what it needs.
    An adapter lane's name (`<env>:<adapter>`) takes only that lane's route out, and each
    lane an environment's `down` takes with it gets a `down` event of its own."""
    led = ledger or open_ledger(settings)
    if is_lane(env):
        env_config(settings, env)  # a lane of an environment releasekit.toml lacks: refused
        rec = lane_down(settings, env, ledger=led, actor=actor, reason=reason)
        return DownResult(
            environment=env,
            gateway_stopped=False,
            servers_stopped=[],
            record=rec,
            lanes_down=[env] if rec is not None else [],
            notes=[] if rec is not None else [f"lane {env} serves nothing: nothing to take down"],
        )
    cfg = settings.environments.get(env) or EnvironmentConfig(port=1)
    with locked_state(settings.state_dir, env) as handle:
        target = target_for(settings, env, cfg, handle)
        notes = target.reconcile()
        lanes = {str(r.lane): r.release_id for r in handle.state.routes if r.lane is not None}
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
        for lane, rid in sorted(lanes.items()):
            led.append(
                Event(
                    type=EventType.DOWN,
                    environment=lane_name(env, lane),
                    from_release=rid,
                    reason=reason or f"releasekit down {env}",
                    evidence={"lane": lane, "with": env},
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
        lanes_down=[lane_name(env, lane) for lane in sorted(lanes)] if rec is not None else [],
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
    adapters_warm: dict[str, dt.datetime] = Field(
        default_factory=dict,
        description="LoRA adapter versions (engine names) it keeps loaded though no route "
        "names them any more: engine name -> when they are unloaded",
    )
    adapters_overdue: dict[str, dt.datetime] = Field(
        default_factory=dict,
        description="those of `adapters_warm` whose unload is overdue (the engine did not "
        "unload them when due): engine name -> when the unload is tried next",
    )


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


class LaneStatus(BaseModel):
    """One adapter lane of an environment: what its route serves and what its record says."""

    lane: str = Field(description="the lane's name, <env>:<adapter>")
    routed: list[str] = Field(description="releases its route sends the adapter's traffic to")
    ledger_release_id: str | None = Field(None, description="the lane's release of record")
    agrees: bool = Field(description="its route serves exactly its release of record")


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
    lanes: list[LaneStatus] = Field(default_factory=list, description="its adapter lanes")


def _lanes(led: Ledger, env: str, state: EnvState) -> list[LaneStatus]:
    """Each adapter lane the state routes, against its own record."""
    out = []
    for lane in sorted({r.lane for r in state.routes if r.lane}):
        name = lane_name(env, lane)
        rec = led.live_at(name)
        routed = [r.release_id for r in state.routes if r.lane == lane and r.weight > 0]
        want = rec.to_release if rec else None
        out.append(
            LaneStatus(lane=name, routed=routed, ledger_release_id=want, agrees=routed == [want])
        )
    return out


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


def _utc(t: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(t, dt.UTC)


def warm_adapter_lines(envs: list[EnvDeployStatus]) -> list[str]:
    """`deploy-status`'s lines on warm adapters: per environment, the versions its engines
    keep loaded for the warm window and when the first is unloaded, then one line per
    unload that is overdue (the engine did not do it), with when it is tried next."""
    lines: list[str] = []
    for e in envs:
        warm: dict[str, dt.datetime] = {}
        late: list[str] = []
        for s in e.servers:
            for name, until in s.adapters_warm.items():
                if name in s.adapters_overdue:
                    again = s.adapters_overdue[name]
                    late.append(
                        f"{e.environment}: adapter {name} is still loaded on {s.base_url}: "
                        f"its unload is overdue (due {until:%Y-%m-%d %H:%M:%S} UTC; "
                        f"tried again at {again:%H:%M:%S} UTC)"
                    )
                else:
                    warm[name] = until
        if warm:
            lines.append(
                f"{e.environment}: adapters kept loaded (warm): {', '.join(sorted(warm))}; "
                f"unloaded from {min(warm.values()):%Y-%m-%d %H:%M:%S} UTC"
            )
        lines += late
    return lines


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
    now = time.time()
    for name in names:
        st = read_state(settings.state_dir, name)
        gw = st.gateway
        gw_ok = bool(gw and process_alive(gw.pid, gw.proc_start))
        live = led.live_at(name)
        # the base's routes; each adapter lane is checked against its own record
        routed = list(dict.fromkeys(r.release_id for r in st.routes if r.weight > 0 and not r.lane))
        lanes = _lanes(led, name, st)
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
                adapters_warm={n: _utc(t) for n, t in sorted(s.adapters_warm.items())},
                adapters_overdue={n: _utc(t) for n, t in overdue_unloads(s, now).items()},
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
                    {
                        "release_id": r.release_id,
                        "base_url": r.base_url,
                        "weight": r.weight,
                        **({"lane": r.lane} if r.lane else {}),
                    }
                    for r in st.routes
                ],
                servers=servers,
                ledger_release_id=live.to_release if live else None,
                serving=gw_ok and bool(live) and routed == [live.to_release if live else None],
                agrees=(
                    (not gw_ok and not routed)
                    or (bool(live) and routed == [live.to_release if live else None])
                )
                and all(x.agrees for x in lanes),
                mirror=_mirror_status(st, gw_ok, now),
                lanes=lanes,
            )
        )
    return out
