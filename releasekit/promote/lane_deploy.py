"""Deploying an adapter lane's release (`<env>:<adapter>`, `releasekit.config.lanes`): its
adapter goes into the environment's live engine and the lane's one gateway route moves to it.
The base's routes and every other lane's stay as they are, so a lane's promotion or rollback
never touches their traffic, and no engine starts.

Under the environment's deploy lock:

1. check nothing else changed the lane meanwhile (`expected_live`);
2. find the environment's live engine running the release's base with its serving
   arguments (the same serving key); none is a failed deploy at stage `adapters` that says
   what to promote first;
3. refuse more adapters than the engine's `max-loras` (the base's and every lane's);
4. load the adapter (a version already loaded, warm, is held), smoke it through a private
   gateway;
5. switch the lane's route, smoke the adapter through the environment's gateway;
6. record (the caller's `record`), or switch back;
7. the adapter version the lane served before stays loaded for the warm window (a rollback
   inside it loads nothing), then the expirer unloads it.

`lane_down` takes a lane's route out (its adapter stays loaded for the warm window).
"""

from __future__ import annotations

import time
from typing import Any

from releasekit.config import Settings
from releasekit.config.lanes import split_lane
from releasekit.deploy.environments import env_config, target_for
from releasekit.deploy.gateway import GatewayError, Route
from releasekit.deploy.state import EnvState, ServerRecord, locked_state
from releasekit.deploy.target import DeployError, ReleaseSpec, ReleaseStartError, SmokeProbe
from releasekit.deploy.warm_adapters import mark_warm
from releasekit.errors import AdapterLoadError, ReleasekitError
from releasekit.promote.deploy_common import DeployRun, routes_alive, smoke_summary
from releasekit.promote.deploy_models import (
    DeployOutcome,
    DeployStage,
    RecordFn,
)
from releasekit.stores.ledger import Event, EventType, Ledger, LedgerRecord


def lane_routes(state: EnvState, lane: str | None = None) -> list[Route]:
    """The routes of adapter lanes (of `lane` only, when given)."""
    return [r for r in state.routes if r.lane is not None and (lane is None or r.lane == lane)]


def _engine_for(state: EnvState, serving_key: str) -> ServerRecord | None:
    """The environment's live server running `serving_key`, or None."""
    return next((s for s in state.live_servers() if s.serving_key == serving_key), None)


def _max_loras(spec: ReleaseSpec) -> int | None:
    raw = spec.engine_args.get("max-loras") or spec.engine_args.get("max_loras")
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None


def deploy_lane(
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
) -> DeployOutcome:
    """Put `spec` (a release carrying lane `env`'s adapter) in the lane (module docstring).
    `probe` None skips both smoke runs (a rollback to a release the lane served)."""
    base_env, lane = split_lane(env)
    assert lane is not None, "deploy_lane takes an adapter lane's name"
    cfg = env_config(settings, env)
    t0 = time.monotonic() if started_at is None else started_at
    run = DeployRun(ledger, env=env, spec=spec, actor=actor, base_extra={"lane": lane})
    out, step, fail = run.out, run.step, run.fail

    with locked_state(settings.state_dir, env, timeout_s=lock_timeout_s) as handle:
        live_now = run.expect_live(expected_live)

        ts = time.monotonic()
        if set(spec.adapters) != {lane}:
            step("adapters", False, ts, "not the lane's adapter")
            return fail(
                "adapters",
                f"{spec.name} carries {', '.join(sorted(spec.adapters)) or 'no adapter'}; "
                f"lane {env} takes releases carrying exactly the adapter {lane}",
            )
        if spec.adapters_problem is not None:
            step("adapters", False, ts, spec.adapters_problem.splitlines()[0])
            return fail("adapters", spec.adapters_problem.splitlines()[0])
        if cfg.target != "local":
            step("adapters", False, ts, f"target {cfg.target}")
            return fail(
                "adapters",
                f"the {cfg.target} target does not carry LoRA adapters yet: adapter lanes "
                "run on the local target",
            )
        target = target_for(settings, base_env, cfg, handle)
        out.notes += target.reconcile()
        handle.state.routes = routes_alive(handle.state)
        engine = _engine_for(handle.state, spec.serving_key)
        if engine is None:
            running = sorted({s.serving_key[:12] for s in handle.state.live_servers()})
            problem = (
                f"lane {env} runs on {base_env}'s live engine, and none runs {spec.name}'s "
                f"base with its serving arguments (serving key {spec.serving_key[:12]}; "
                f"{base_env} runs {', '.join(running) or 'nothing'}): promote to {base_env} "
                "a release of the base this adapter was trained on first"
            )
            step("server", False, ts, problem)
            return fail("adapters", problem)
        up = target.upstream_of(engine)
        if not target.health(up):
            step("server", False, ts, f"{up.base_url} does not answer")
            return fail("start", f"{base_env}'s live engine at {up.base_url} does not answer")
        step("server", True, ts, f"reused {up.base_url} (pid {engine.pid})")
        out.reused_server, out.reused_role = True, "live"
        ts = time.monotonic()
        out.gateway_url = target.ensure_router(handle.state.routes)
        step("gateway", True, ts, out.gateway_url)

        # 3. the engine's LoRA slots: the base's adapters and every lane's, this one's new
        others = {
            name
            for r in handle.state.routes
            if r.base_url == up.base_url and r.weight > 0 and r.lane != lane
            for name in r.adapters
        }
        limit = _max_loras(spec)
        if limit is not None and len(others) + 1 > limit:
            problem = (
                f"{base_env}'s engine serves {len(others)} adapter(s) already "
                f"({', '.join(sorted(others))}) and max-loras is {limit}: lane {env} "
                "would be one more"
            )
            step("adapters", False, ts, problem)
            return fail("adapters", problem)

        # 4. load, then smoke before any client traffic
        ts = time.monotonic()
        try:
            loaded = target.load_adapters(up, spec)
        except (AdapterLoadError, ReleaseStartError) as exc:
            first = exc.message.splitlines()[0]
            step("adapters", False, ts, first)
            return fail("adapters", first, {"adapters": dict(spec.adapters)})
        step("adapters", True, ts, f"loaded {', '.join(loaded)}" if loaded else "held")
        if probe is not None:
            ts = time.monotonic()
            problem_s: str | None
            try:
                out.smoke_preview = target.smoke(up, spec, probe)
            except (GatewayError, ReleasekitError) as exc:
                out.smoke_preview, problem_s = None, f"preview gateway failed: {exc}"
            else:
                problem_s = out.smoke_preview.problem
            step("smoke (preview)", problem_s is None, ts, problem_s or "passed")
            if problem_s is not None:
                return fail("smoke", problem_s, {"smoke": smoke_summary(out.smoke_preview)})

        # 5. switch the lane's route only
        previous_routes = list(handle.state.routes)
        new_route = up.route(spec).model_copy(update={"lane": lane})
        table = [r for r in previous_routes if r.lane != lane] + [new_route]
        ts = time.monotonic()
        try:
            target.route(table, keep_mirror=True)
        except (GatewayError, DeployError) as exc:
            step("switch", False, ts, str(exc))
            return fail("switch", str(exc))
        out.switched = True
        out.switch_s = round(time.monotonic() - t0, 3)
        step("switch", True, ts, f"route {lane} -> {spec.adapters[lane]}")
        handle.save()

        def revert(stage: DeployStage, problem: str, extra: dict[str, Any]) -> DeployOutcome:
            tr = time.monotonic()
            try:
                problem += target.route(previous_routes, keep_mirror=True)
                out.reverted = True
            except (GatewayError, DeployError) as exc:
                problem += f"; switching back ALSO failed: {exc}"
            handle.save()
            step("revert", out.reverted, tr)
            return fail(
                stage, problem, {**extra, "reverted": out.reverted, "reverted_to": live_now}
            )

        if probe is not None:
            ok = run.gateway_smoke(cfg, handle.state, probe, adapters=[lane], suite=False)
            assert out.smoke_gateway is not None
            if not ok:
                return revert(
                    "gateway_smoke",
                    out.smoke_gateway.problem or "smoke failed",
                    {"smoke": smoke_summary(out.smoke_gateway)},
                )

        # 6. the record
        ts = time.monotonic()
        try:
            record(out.gateway_url)
        except ReleasekitError as exc:
            step("record", False, ts, exc.message)
            return revert("record", f"recording the release failed: {exc.message}", {})
        step("record", True, ts)

        # 7. the version the lane served before stays loaded for the warm window
        until = time.time() + cfg.warm_s
        kept = mark_warm(engine, previous_routes, handle.state.routes, until)
        if kept:
            out.notes.append(f"adapters kept loaded for {cfg.warm_s:g} s: {', '.join(kept)}")
        handle.save()
        target.after_change()
        out.ok = True
        return out


def lane_down(
    settings: Settings, env: str, *, ledger: Ledger, actor: str | None = None, reason: str = ""
) -> LedgerRecord | None:
    """Take adapter lane `env`'s route out of its environment's gateway (the adapter stays
    loaded for the warm window, then the expirer unloads it) and record a `down` event for
    the lane (None: nothing was routed there, nothing recorded). The lane's release of
    record stays: promoting it again serves it again."""
    base_env, lane = split_lane(env)
    assert lane is not None, "lane_down takes an adapter lane's name"
    cfg = env_config(settings, env)
    with locked_state(settings.state_dir, env) as handle:
        gone = lane_routes(handle.state, lane)
        if not gone:
            return None
        target = target_for(settings, base_env, cfg, handle)
        previous = list(handle.state.routes)
        target.route([r for r in previous if r.lane != lane], keep_mirror=True)
        until = time.time() + cfg.warm_s
        for server in handle.state.servers:
            mark_warm(server, previous, handle.state.routes, until)
        handle.save()
        ids = list(dict.fromkeys(r.release_id for r in gone))
        rec = ledger.append(
            Event(
                type=EventType.DOWN,
                environment=env,
                from_release=ids[0],
                to_release=None,
                reason=reason or f"lane {env} taken down",
                evidence={"lane": lane, "routes_removed": ids},
                live=False,
                actor=actor,
            )
        )
        target.after_change()
        return rec
