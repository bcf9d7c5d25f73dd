"""The blue/green deploy step shared by promote and rollback.

What it reports and the traffic-shift hook live in `releasekit.promote.deploy_models`, an
environment's status and `down` in `releasekit.promote.deploy_status`, `env_config` and
`target_for` in `releasekit.deploy.environments`; all are re-exported here.

`deploy_release` runs under the environment's deploy lock:

1. reconcile the recorded processes (forget dead ones, stop half-started or expired ones);
2. make sure the environment's gateway runs;
3. reuse a live or warm server with the same serving key (a prompt-only or adapter-only
   release never restarts vLLM: its adapters are loaded into the running engine) or start
   the release's server on its own port (its adapters loaded once it is healthy);
4. smoke it through a private gateway (no client traffic yet);
5. switch the gateway's table to it atomically;
6. smoke it again through the environment's gateway;
7. move the record (the caller's `record`: ledger event via `assign`, then aliases);
8. drain the old upstream at the gateway, then keep its server warm for `warm_s` or stop it
   (the adapter versions a reused engine served before and the new route drops stay loaded
   as long, `ServerRecord.adapters_warm`, then are unloaded);
   after a promotion (`compare_previous`) with the policy's `after_promotion_compare_s` > 0,
   keep it warm at least that window (plus `drain_deadline_s`) and mirror the policy's
   `after_promotion_share` of live requests to it (`Mirror.purpose` `after_promotion`,
   ending at the window's end), so `watch` can compare the two releases' answers.

A failure in 3-4 leaves the old release serving and is a `deploy_failed` ledger event (an
adapter the engine refuses: stage `adapters`); a failure in 6-7 switches the table back to
what it was by itself, and records why.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec

from releasekit.config import EnvironmentConfig, Settings
from releasekit.config.lanes import is_lane, lane_name
from releasekit.deploy.environments import EnvironmentNotConfiguredError, env_config, target_for
from releasekit.deploy.gateway import GatewayError, Mirror, Route, RouteTable
from releasekit.deploy.gateway_client import GatewayClient
from releasekit.deploy.local import LocalTarget
from releasekit.deploy.state import StateHandle, locked_state
from releasekit.deploy.target import (
    DeployError,
    ReleaseSpec,
    ReleaseStartError,
    SmokeProbe,
    Upstream,
)
from releasekit.deploy.warm_adapters import mark_warm
from releasekit.errors import AdapterLoadError, ReleasekitError
from releasekit.promote.context import load_release, release_spec
from releasekit.promote.deploy_common import DeployRun
from releasekit.promote.deploy_common import routes_alive as _routes_alive
from releasekit.promote.deploy_common import smoke_summary as _smoke_summary
from releasekit.promote.deploy_models import (
    AfterPromotionMirror,
    ConcurrentChangeError,
    DeployOutcome,
    DeployStage,
    DeployStep,
    RecordFn,
    ShiftContext,
    ShiftFn,
    ShiftResult,
)
from releasekit.promote.deploy_status import (
    DownResult,
    EnvDeployStatus,
    MirrorStatus,
    ReplicaStatus,
    ScaleStatus,
    ServerStatus,
    deploy_status,
    down,
    serving_releases,
)
from releasekit.promote.lane_deploy import deploy_lane, lane_routes
from releasekit.stores.ledger import Event, EventType, Ledger

P = ParamSpec("P")


def _naming_what_serves(
    deploy: Callable[Concatenate[Settings, P], DeployOutcome],
) -> Callable[Concatenate[Settings, P], DeployOutcome]:
    """`deploy`, whose failed outcome also says what still serves its environment (read
    once the deploy lock is released)."""

    @functools.wraps(deploy)
    def deploy_naming_what_serves(
        settings: Settings, /, *args: P.args, **kwargs: P.kwargs
    ) -> DeployOutcome:
        out = deploy(settings, *args, **kwargs)
        if not out.ok:
            out.serving = serving_releases(settings, out.environment)
        return out

    return deploy_naming_what_serves


@_naming_what_serves
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
    A failed outcome says what still serves the environment (`serving`).
    An adapter lane's name (`<env>:<adapter>`) deploys into the lane
    (`releasekit.promote.lane_deploy`). A release of the environment itself keeps every
    lane's route on the engine it reuses; one that needs another engine is refused while
    lanes are live on the old one (a promotion), or takes them down with it (a rollback:
    the base's traffic comes first), recording a `down` event for each."""
    if is_lane(env):
        return deploy_lane(
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
        )
    cfg = env_config(settings, env)
    t0 = time.monotonic() if started_at is None else started_at
    run = DeployRun(ledger, env=env, spec=spec, actor=actor)
    out, step, fail = run.out, run.step, run.fail

    with locked_state(settings.state_dir, env, timeout_s=lock_timeout_s) as handle:
        live_now = run.expect_live(expected_live)

        def adapters_failed(since: float, exc: ReleasekitError) -> DeployOutcome:
            """An adapter that did not load (or a target that carries none): a failed deploy
            at stage `adapters`, as a failed start is; the route has not moved."""
            first = exc.message.splitlines()[0]
            step("adapters", False, since, first)
            return fail("adapters", first, {"adapters": dict(spec.adapters)})

        if spec.adapters_problem is not None:  # its adapters' files are not the locked ones
            return adapters_failed(time.monotonic(), AdapterLoadError(spec.adapters_problem))
        target = target_for(settings, env, cfg, handle, replicas=replicas)
        out.notes += target.reconcile()
        handle.state.routes = _routes_alive(handle.state)
        ts = time.monotonic()
        out.gateway_url = target.ensure_router(handle.state.routes)
        step("gateway", True, ts, out.gateway_url)

        # 3. a server for the release
        ts = time.monotonic()
        reusable = handle.state.server_serving(spec.serving_key)
        lanes = lane_routes(handle.state)
        lanes_gone: list[Route] = []
        if lanes and (reusable is None or any(r.base_url != reusable.base_url for r in lanes)):
            names = ", ".join(sorted({f"{env}:{r.lane}" for r in lanes}))
            if compare_previous:
                stranded = (
                    f"adapter lanes {names} run on {env}'s live engine, and {spec.name} needs "
                    "another engine (its base or serving arguments differ): take the lanes "
                    "down first (releasekit down LANE), then promote them again on the new base"
                )
                step("server", False, ts, stranded)
                return fail("adapters", stranded, {"lanes": sorted(str(r.lane) for r in lanes)})
            lanes_gone, lanes = lanes, []
        up: Upstream | None = None
        newly_started = False
        if reusable is not None:
            cand = target.upstream_of(reusable)
            if target.health(cand):
                up, out.reused_server, out.reused_role = cand, True, reusable.role
                step("server", True, ts, f"reused {reusable.base_url} (pid {reusable.pid})")
        if up is not None and spec.adapters:
            # the running engine gets the release's adapters before any route moves
            ta = time.monotonic()
            try:
                loaded = target.load_adapters(up, spec)
            except (AdapterLoadError, ReleaseStartError) as exc:
                return adapters_failed(ta, exc)
            step("adapters", True, ta, f"loaded {', '.join(loaded)}" if loaded else "held")
        if up is None:
            try:
                up = target.start(spec)
                newly_started = True
                step("server", True, ts, f"started {up.base_url} (pid {up.handle.get('pid')})")
            except AdapterLoadError as exc:  # started, then stopped: the engine refused one
                step("server", False, ts, "started, then stopped: an adapter did not load")
                return adapters_failed(ts, exc)
            except ReleaseStartError as exc:
                step("server", False, ts, exc.message.splitlines()[0])
                return fail(
                    "start",
                    exc.message.splitlines()[0],
                    {"log": exc.log_path, "log_tail": exc.log_tail[-2000:]},
                )

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
                return fail("smoke", problem, {"smoke": _smoke_summary(out.smoke_preview)})

        # 5a. canary steps: part of the traffic first, judged live (the shift's own job)
        previous_routes = list(handle.state.routes)
        if shift is not None and previous_routes and handle.state.gateway is not None:
            ts = time.monotonic()
            baselines: list[Upstream] = []

            def live_spec() -> ReleaseSpec:
                info = load_release(settings, str(live_now), ledger=ledger)
                return release_spec(settings, info, ledger=ledger)

            def start_baseline() -> tuple[Route, Upstream]:
                base = live_spec()
                baselines.append(target.start(base))
                return baselines[-1].route(base), baselines[-1]

            def stop_baseline() -> None:
                while baselines:
                    target.stop(baselines.pop(), grace_s=settings.server_stop_grace_s)

            def shadows_baseline() -> tuple[Route, Upstream] | None:
                """The fresh baseline the candidate's shadow ran beside, when the candidate
                runs on its shadow's server too: both were started and loaded together, so
                the canary judges the pair its shadow did (stopped with the canary)."""
                if reusable is None or newly_started or reusable.role != "shadow" or not live_now:
                    return None
                for s in handle.state.servers:
                    if s.role == "shadow" and s.release_id == live_now:
                        kept = target.upstream_of(s)
                        if s.base_url == up.base_url or not target.health(kept):
                            continue
                        baselines.append(kept)
                        return kept.route(live_spec()), kept
                return None

            local = live_now and isinstance(target, LocalTarget)
            ctx = ShiftContext(
                env=env,
                gateway=handle.state.gateway,
                canary=up.route(spec),
                stable=previous_routes,
                previous_release_id=live_now,
                start_baseline=start_baseline if local else None,
                stop_baseline=stop_baseline,
                kept_baseline=shadows_baseline() if local else None,
            )
            try:
                shifted = shift(ctx)
            finally:
                stop_baseline()  # the shift stops it; a shift that raised leaves it here
            step("canary", shifted.ok, ts, shifted.detail or (shifted.problem or "passed"))
            if not shifted.ok:
                said = ""  # what became of the adapters this deploy loaded
                with contextlib.suppress(GatewayError, DeployError):
                    said = target.route(previous_routes)  # the shift put it back; make sure
                out.reverted = True
                if not any(r.base_url == up.base_url for r in previous_routes):
                    target.wait_drained(spec.release_id, deadline_s=cfg.drain_deadline_s)
                drop_new()
                out.failed_stage = "canary"
                out.failure = (shifted.problem or "canary failed") + said
                out.failure_event = shifted.event
                return out
            out.notes.append(shifted.detail or "canary steps passed")

        # 5. switch
        roles_before = {s.ident: (s.role, s.warm_until) for s in handle.state.servers}
        rec = target.record(up)
        ts = time.monotonic()
        try:
            lanes_gone += [r for r in lanes if r.base_url != up.base_url]
            lanes = [r for r in lanes if r.base_url == up.base_url]
            target.route([up.route(spec), *lanes])
        except (GatewayError, DeployError) as exc:
            step("switch", False, ts, str(exc))
            drop_new()
            return fail("switch", str(exc))
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
                problem += target.route(previous_routes)  # with what became of its adapters
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
            return fail(
                stage, problem, {**extra, "reverted": out.reverted, "reverted_to": live_now}
            )

        # 6. smoke through the environment's gateway
        if probe is not None:
            run.gateway_smoke(cfg, handle.state, probe, adapters=sorted(spec.adapters))
            assert out.smoke_gateway is not None
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
        for lane in sorted({str(r.lane) for r in lanes_gone}):
            ledger.append(
                Event(
                    type=EventType.DOWN,
                    environment=lane_name(env, lane),
                    from_release=next(r.release_id for r in lanes_gone if r.lane == lane),
                    reason=f"taken down with {env}'s move to {spec.name}: its engine stopped",
                    evidence={"lane": lane, "with": spec.release_id},
                    live=False,
                    actor=actor,
                )
            )
            out.notes.append(f"lane {lane_name(env, lane)} taken down with the old engine")

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
        if rec is not None:  # adapter versions the new route dropped stay loaded as long
            until = now + cfg.warm_s
            if window > 0 and prev is not None and rec.base_url == prev.base_url:
                until = max(until, now + window + cfg.drain_deadline_s)
            kept = mark_warm(rec, previous_routes, handle.state.routes, until)
            if kept:
                out.notes.append(f"adapters kept loaded for {until - now:g} s: {', '.join(kept)}")
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


__all__ = [
    "AfterPromotionMirror",
    "ConcurrentChangeError",
    "DeployOutcome",
    "DeployStage",
    "DeployStep",
    "DownResult",
    "EnvDeployStatus",
    "EnvironmentNotConfiguredError",
    "MirrorStatus",
    "RecordFn",
    "ReplicaStatus",
    "ScaleStatus",
    "ServerStatus",
    "ShiftContext",
    "ShiftFn",
    "ShiftResult",
    "deploy_release",
    "deploy_status",
    "down",
    "env_config",
    "serving_releases",
    "target_for",
]
