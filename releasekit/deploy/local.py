"""The `local` deploy target: each release's vLLM server is a detached process group on this
host with its own port, and the environment's gateway is a detached process in front.

Servers and the gateway outlive the releasekit command that started them (own session, no
parent-death signal); their pids and ports live in the deploy state file
(deploy/state.py), recorded as soon as a process exists. `LocalTarget.reconcile()` runs at
the start of every command: it forgets processes that died, stops servers a crashed command
left half-started, stops warm servers whose warm period is over and unloads the adapter
versions kept warm on a live engine (deploy/warm_adapters.py) once theirs is. A small detached
"expirer" (`python -m releasekit.deploy.local expire --state-dir DIR --env ENV`) does the
last two on time when no command runs; it exits once nothing warm is left (what a failed
deploy loaded into a running engine goes again: deploy/adapter_loads.py)."""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from releasekit._support.http import http_client
from releasekit._support.procs import group_alive, last_error_line, tail
from releasekit._support.retry import RetryPolicy
from releasekit.config import EnvironmentConfig
from releasekit.deploy.adapter_loads import DeployLoads
from releasekit.deploy.gateway import (
    GatewayConfig,
    GatewayError,
    GatewayUnreachableError,
    RateLimit,
    Route,
    RouteTable,
    ThreadedGateway,
    mb_bytes,
    store_dir,
)
from releasekit.deploy.gateway_client import GatewayClient, launch_gateway
from releasekit.deploy.smoke import run_smoke
from releasekit.deploy.state import (
    EnvState,
    GatewayRecord,
    ServerRecord,
    StateHandle,
    deploy_dir,
    env_lock,
    proc_start_time,
    read_state,
    same_process,
    write_state,
)
from releasekit.deploy.target import (
    DeployError,
    DeployTarget,
    OnSpawn,
    ReleaseSpec,
    ReleaseStartError,
    SmokeProbe,
    SmokeResult,
    Upstream,
)
from releasekit.deploy.warm_adapters import adapter_deadlines, drain_unrouted, unload_expired
from releasekit.errors import AdapterLoadError, ServerUnreachableError
from releasekit.serving.adapters import RUNTIME_ENV, ensure_adapters
from releasekit.serving.host import (
    bind_env,
    inherited_env,
    pick_core,
    raise_priority,
    reset_priority,
    server_env,
    worker_core,
)
from releasekit.serving.vllm import PIDDIR_ENV, VLLMServer, pick_port

if TYPE_CHECKING:
    from releasekit.config import Settings

_BIND_ERRORS = ("Address already in use", "[Errno 98]")


def _bind_failed(exc: BaseException) -> bool:
    """Whether a server failed to start only because its port was taken meanwhile."""
    return isinstance(exc, ReleaseStartError) and any(m in exc.log_tail for m in _BIND_ERRORS)


# A port taken between picking it and the server binding it: another port, at once (3 tries).
_PORT_RETRY = RetryPolicy(
    attempts=3, base_s=0.0, retry_on=(ReleaseStartError,), retry_if=_bind_failed
)

_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}
"""Processes this process spawned, kept only to reap them (they are not stopped at exit)."""


def _reap() -> None:
    for pid, proc in list(_CHILDREN.items()):
        if proc.poll() is not None:
            _CHILDREN.pop(pid, None)


def process_alive(pid: int, proc_start: int | None) -> bool:
    """True while the recorded process group runs: some member is alive, and the leader, if
    still there, is the process that was recorded (not a reused pid)."""
    _reap()
    if not group_alive(pid):
        return False
    return proc_start_time(pid) is None or same_process(pid, proc_start)


def stop_group(pid: int, proc_start: int | None, *, grace_s: float) -> None:
    """SIGTERM the process group `pid`, SIGKILL what is left after `grace_s`; idempotent."""
    if not process_alive(pid, proc_start):
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGTERM)
    end = time.monotonic() + grace_s
    while time.monotonic() < end:
        _reap()
        if not group_alive(pid):
            break
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    end = time.monotonic() + 5.0
    while group_alive(pid) and time.monotonic() < end:
        _reap()
        time.sleep(0.05)
    _reap()


def server_command(spec: ReleaseSpec, *, python: Path, host: str, port: int) -> list[str]:
    """The exact argv that serves `spec` (serving.vllm's builder: model, served name, host,
    port and the release's engine args, nothing added)."""
    return VLLMServer(
        Path(spec.model_dir),
        served_name=spec.served_name,
        engine_args=spec.engine_args,
        env=spec.env,
        python=python,
        log_path=Path(os.devnull),
        host=host,
        port=port,
    ).command()


def spawn_detached(
    argv: Sequence[str], *, env: dict[str, str], log_path: Path
) -> subprocess.Popen[bytes]:
    """Start `argv` in its own session (it outlives this process), output to `log_path`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            list(argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            close_fds=True,
        )
    _CHILDREN[proc.pid] = proc
    return proc


def _server_env(spec: ReleaseSpec, settings: Settings, core: int | None) -> dict[str, str]:
    """The server's environment: this process's (less the kernel-choosing variables,
    `inherited_env`), the host's additions (preloaded libraries, the worker's core), then the
    release's own, which win."""
    release_env = dict(spec.env)
    env: dict[str, str] = {
        **inherited_env(),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        **server_env(
            python=settings.python, preload=settings.server_preload, release_env=release_env
        ),
        **(bind_env(core, release_env) if core is not None else {}),
        **release_env,
        # An engine that may carry adapters loads them at run time (a later release that
        # differs only in its adapters reuses it).
        **(RUNTIME_ENV if lora_engine(spec) else {}),
    }
    env.pop(PIDDIR_ENV, None)
    return env


def lora_engine(spec: ReleaseSpec) -> bool:
    """Whether `spec`'s server may carry LoRA adapters: it has some, or its engine args
    enable LoRA (a release of the same base and serving key may bring adapters later)."""
    return bool(spec.adapters) or "enable-lora" in spec.engine_args


def load_release_adapters(upstream: Upstream, spec: ReleaseSpec) -> list[str]:
    """Load into the engine behind `upstream` those of `spec`'s adapters it does not hold
    yet (engine names, from their verified folders); the names loaded now. An engine that
    cannot be reached, or refuses one, is an AdapterLoadError."""
    if spec.adapters_problem is not None:
        raise AdapterLoadError(spec.adapters_problem)
    folders = {name: Path(spec.adapter_dirs[name]) for name in spec.adapters.values()}
    try:
        return ensure_adapters(upstream.base_url, folders, api_key=upstream.api_key)
    except ServerUnreachableError as exc:
        raise AdapterLoadError(
            f"release {spec.release_id[:12]}: its adapters could not be loaded: {exc.message}"
        ) from exc


def check_health(base_url: str, model: str, *, api_key: str | None, timeout_s: float = 5.0) -> bool:
    """True when `base_url` answers /health with 200 and lists `model` on /v1/models."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with http_client(base_url=base_url, timeout=timeout_s, trust_env=False) as c:
            if c.get("/health").status_code != 200:
                return False
            r = c.get("/v1/models", headers=headers)
            return r.status_code == 200 and any(
                m.get("id") == model for m in r.json().get("data", [])
            )
    except (httpx.HTTPError, ValueError, AttributeError):
        return False


class LocalTarget(DeployTarget):
    """Release servers and the gateway of one environment on this host; every change is
    written to the environment's state (whose lock the caller holds)."""

    name = "local"

    def __init__(
        self, settings: Settings, env: str, config: EnvironmentConfig, handle: StateHandle
    ) -> None:
        self.settings = settings
        self.env = env
        self.config = config
        self.handle = handle
        self.loads = DeployLoads(  # what this deploy loads into a running engine
            handle, hold_s=config.warm_s, drain_s=config.drain_deadline_s, after=self.spawn_expirer
        )

    # -- state -------------------------------------------------------------------------

    @property
    def _state(self) -> EnvState:
        return self.handle.state

    def record(self, upstream: Upstream) -> ServerRecord | None:
        """The state record of `upstream`'s process."""
        pid = upstream.handle.get("pid")
        for s in self._state.servers:
            if s.pid == pid:
                return s
        return None

    def upstream_of(self, rec: ServerRecord) -> Upstream:
        """An Upstream handle for a recorded server."""
        return Upstream.of_record(
            rec,
            {"pid": rec.pid, "port": rec.port, "log": rec.log_path, "proc_start": rec.proc_start},
        )

    def after_change(self) -> None:
        """Schedule the end of the warm period (the detached expirer)."""
        self.spawn_expirer()

    def reconcile(self, *, now: float | None = None) -> list[str]:
        """Bring the state in line with the processes: forget dead ones, stop servers a
        crashed command left `starting`, stop warm servers past their warm period and unload
        warm adapters past theirs. Returns what it did, in words."""
        now = time.time() if now is None else now
        notes: list[str] = []
        st = self._state
        gw = st.gateway
        if gw is not None and not process_alive(gw.pid, gw.proc_start):
            notes.append(f"gateway pid {gw.pid} is gone")
            st.gateway = None
        keep: list[ServerRecord] = []
        routed = set(st.routed_release_ids())
        for s in st.servers:
            if not process_alive(s.pid, s.proc_start):
                notes.append(f"server of {s.release_id[:12]} (pid {s.pid}) is gone")
                continue
            if s.role == "starting" and s.release_id not in routed:
                notes.append(f"stopped a half-started server of {s.release_id[:12]}")
                stop_group(s.pid, s.proc_start, grace_s=self.settings.server_stop_grace_s)
                continue
            if s.role == "warm" and s.warm_until is not None and s.warm_until <= now:
                notes.append(f"stopped the warm server of {s.release_id[:12]} (period over)")
                stop_group(s.pid, s.proc_start, grace_s=self.settings.server_stop_grace_s)
                continue
            keep.append(s)
        st.servers = keep
        drain_s = self.config.drain_deadline_s
        notes += unload_expired(st, now=now, drain=lambda: drain_unrouted(st, drain_s)).notes
        self.handle.save()
        return notes

    # -- servers -----------------------------------------------------------------------

    def start(self, spec: ReleaseSpec, *, on_spawn: OnSpawn | None = None) -> Upstream:
        """Start `spec`'s vLLM detached on a free port (RELEASEKIT_PORT_RANGE), wait until
        it is healthy and load its adapters. Recorded as `starting` as soon as it exists; on
        failure it is stopped, forgotten, and ReleaseStartError quotes its log (or the
        engine's refusal of an adapter is an AdapterLoadError)."""
        if spec.adapters_problem is not None:
            raise AdapterLoadError(spec.adapters_problem)
        if not Path(spec.model_dir).is_dir():
            raise ReleaseStartError(
                f"release {spec.release_id[:12]}: model folder not found: {spec.model_dir}"
            )
        host = self.settings.server_host
        tried: set[int] = {s.port for s in self._state.servers}

        def on_a_free_port() -> Upstream:
            port = pick_port(host, avoid=tried)
            tried.add(port)
            return self._start_once(spec, host, port, on_spawn)

        try:
            return _PORT_RETRY.call(on_a_free_port)
        except ReleaseStartError as exc:
            if not _bind_failed(exc):
                raise
            raise ReleaseStartError(
                f"release {spec.release_id[:12]}: no port could be bound"
            ) from exc

    def _start_once(
        self, spec: ReleaseSpec, host: str, port: int, on_spawn: OnSpawn | None
    ) -> Upstream:
        log = self.settings.state_dir / "logs" / f"serve-{self.env}-{spec.release_id[:12]}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_bytes(b"")
        argv = server_command(spec, python=self.settings.python, host=host, port=port)
        # Its worker on the core the environment's other servers use least, so a candidate
        # does not share the busy live worker's core.
        core = pick_core(s.cpu_core for s in self._state.servers)
        env = _server_env(spec, self.settings, core)
        proc = spawn_detached(argv, env=env, log_path=log)
        # Warm up with a higher share of the CPU than the busy live release (until healthy).
        raised = raise_priority(proc.pid, self.settings.server_start_nice)
        rec = ServerRecord(
            release_id=spec.release_id,
            serving_key=spec.serving_key,
            base_url=f"http://{host}:{port}",
            port=port,
            pid=proc.pid,
            proc_start=proc_start_time(proc.pid),
            model=spec.served_name,
            api_key=spec.api_key,
            log_path=str(log),
            role="starting",
            started_at=time.time(),
            cpu_core=worker_core(env),
            start_priority=self.settings.server_start_nice if raised else None,
        )
        self._state.servers.append(rec)
        self.handle.save()
        up = self.upstream_of(rec)
        if on_spawn is not None:
            on_spawn(up)
        try:
            self._wait_healthy(proc, rec, log)
            if spec.adapters:
                load_release_adapters(up, spec)
        except BaseException:
            stop_group(rec.pid, rec.proc_start, grace_s=self.settings.server_stop_grace_s)
            self._forget(rec.pid)
            raise
        finally:
            if raised:
                reset_priority(proc.pid)
        rec.ready_s = round(time.time() - rec.started_at, 1)
        self.handle.save()
        return up

    def _wait_healthy(self, proc: subprocess.Popen[bytes], rec: ServerRecord, log: Path) -> None:
        def healthy() -> bool:
            rc = proc.poll()
            if rc is not None:
                text = tail(log, 200)
                cause = last_error_line(text)
                raise ReleaseStartError(
                    f"vLLM for release {rec.release_id[:12]} exited with code {rc} before "
                    f"becoming healthy{': ' + cause if cause else ''} (log: {log})",
                    log_tail=tail(log),
                    log_path=str(log),
                )
            return check_health(rec.base_url, rec.model, api_key=rec.api_key, timeout_s=2.0)

        poll = RetryPolicy.poll(interval_s=0.5, deadline_s=self.settings.server_start_timeout_s)
        if poll.call(healthy):
            return
        raise ReleaseStartError(
            f"vLLM for release {rec.release_id[:12]} did not become healthy within "
            f"{self.settings.server_start_timeout_s:.0f} s (log: {log})",
            log_tail=tail(log),
            log_path=str(log),
        )

    def _forget(self, pid: int) -> None:
        self._state.servers = [s for s in self._state.servers if s.pid != pid]
        self.handle.save()

    def load_adapters(self, upstream: Upstream, spec: ReleaseSpec) -> list[str]:
        """Load `spec`'s adapters the running server lacks (`DeployLoads.load`)."""
        if not spec.adapters and spec.adapters_problem is None:
            return []
        return self.loads.load(upstream, spec, load_release_adapters)

    def health(self, upstream: Upstream) -> bool:
        """True while the server answers /health and lists its model."""
        return check_health(upstream.base_url, upstream.model, api_key=upstream.api_key)

    def smoke(self, upstream: Upstream, spec: ReleaseSpec, probe: SmokeProbe) -> SmokeResult:
        """Run `probe` through a private gateway in this process whose only route is the
        candidate (the same templating, relaying and adapter names as the environment's
        gateway), so the release and each of its adapters are checked before any client
        reaches them. A failed smoke unloads the adapters this deploy loaded and says so."""
        config = GatewayConfig(
            env=f"{self.env}-preview",
            host="127.0.0.1",
            port=0,
            admin_token=secrets.token_urlsafe(24),
            routes=[upstream.route(spec)],
            log_level="error",
        )
        with self.loads.unloaded_on_error(), ThreadedGateway(config) as tg:
            res = run_smoke(
                tg.url,
                probe,
                release_id=spec.release_id,
                where="preview",
                adapters=sorted(spec.adapters),
            )
        if res.problem is not None:
            res.problem += self.loads.unload()
        return res

    def stop(self, upstream: Upstream, *, grace_s: float = 10.0) -> None:
        """Stop the server's process group and forget it."""
        pid = upstream.handle.get("pid")
        if not isinstance(pid, int):
            return
        start = upstream.handle.get("proc_start")
        stop_group(pid, start if isinstance(start, int) else None, grace_s=grace_s)
        self._forget(pid)

    def list(self) -> list[Upstream]:
        """The release servers recorded for the environment that still run."""
        return [
            self.upstream_of(s) for s in self._state.servers if process_alive(s.pid, s.proc_start)
        ]

    # -- gateway -----------------------------------------------------------------------

    def _client(self) -> GatewayClient:
        gw = self._state.gateway
        if gw is None:
            raise DeployError(f"environment {self.env!r} has no gateway running")
        return GatewayClient(gw.url, admin_token=gw.admin_token)

    def gateway_ok(self) -> bool:
        """True when the recorded gateway runs and its admin API answers."""
        gw = self._state.gateway
        if gw is None or not process_alive(gw.pid, gw.proc_start):
            return False
        try:
            with self._client() as c:
                c.state()
        except GatewayError:
            return False
        return True

    def ensure_router(self, routes: Sequence[Route]) -> str:
        """The environment's gateway URL, starting the gateway (with `routes`, else the
        recorded table) if it is not running."""
        if self.gateway_ok():
            assert self._state.gateway is not None
            return self._state.gateway.url
        gw = self._state.gateway
        if gw is not None:  # recorded, but not answering: replace it
            stop_group(gw.pid, gw.proc_start, grace_s=5.0)
            self._state.gateway = None
        table = list(routes) or list(self._state.routes)
        # The recorded mirror goes with the recorded table (another table ends mirroring).
        mirror = self._state.mirror
        if mirror is not None and (
            table != list(self._state.routes)
            or any(r.release_id == mirror.route.release_id for r in table)
        ):
            mirror = None
        d = deploy_dir(self.settings.state_dir)
        token = secrets.token_urlsafe(32)
        config = GatewayConfig(
            env=self.env,
            host=self.config.host,
            port=self.config.port,
            admin_token=token,
            api_keys=list(self.config.api_keys),
            max_in_flight=self.config.max_in_flight,
            max_queue_wait_s=self.config.max_queue_wait_s,
            rate_limit=(
                RateLimit(rps=self.config.rate_limit_rps, burst=self.config.rate_limit_burst)
                if self.config.rate_limit_rps > 0
                else None
            ),
            max_in_flight_per_client=self.config.max_in_flight_per_key or None,
            release_header=self.config.release_header,
            shutdown_timeout_s=max(self.config.drain_deadline_s, 1.0),
            routes=table,
            mirror=mirror,
            pairs_dir=str(store_dir(self.settings.state_dir, self.env)),
            pairs_prune_s=self.config.mirror_pairs_prune_s,
            pairs_keep_s=self.config.mirror_pairs_keep_days * 86400,
            pairs_max_bytes=mb_bytes(self.config.mirror_pairs_max_mb),
        )
        launched = launch_gateway(
            config,
            config_path=d / f"{self.env}-gateway.json",
            log_path=self.settings.state_dir / "logs" / f"gateway-{self.env}.log",
            python=Path(sys.executable),
        )
        if launched.process is not None:
            _CHILDREN[launched.process.pid] = launched.process
            # A light process in its own session: without a higher autogroup priority it
            # waits behind busy servers and relays streams late and in bursts.
            raise_priority(launched.process.pid, self.settings.gateway_nice)
        self._state.gateway = GatewayRecord(
            url=launched.url,
            host=launched.endpoint.host,
            port=launched.endpoint.port,
            pid=launched.pid,
            proc_start=proc_start_time(launched.pid),
            admin_token=token,
            config_path=str(launched.config_path),
            log_path=str(launched.log_path),
            started_at=launched.endpoint.started_at,
        )
        self._state.routes = table
        self._state.mirror = mirror
        self.handle.save()
        return launched.url

    def route(self, routes: Sequence[Route], *, keep_mirror: bool = False) -> str:
        """Swap the gateway's table atomically and record it (ending any mirror unless
        `keep_mirror`: an adapter lane's change); adapters this deploy loaded that the table
        no longer names are unloaded once drained, and what became of them is said."""
        mirror = self._state.mirror if keep_mirror else None
        with self._client() as c:
            c.set_routes(RouteTable(routes=list(routes), mirror=mirror))
        self._state.routes = list(routes)
        self._state.mirror = mirror
        self.handle.save()
        return self.loads.unload(drain=True)

    def wait_drained(self, release_id: str, *, deadline_s: float) -> bool:
        """True once the gateway has nothing in flight to `release_id`."""
        try:
            with self._client() as c:
                return c.wait_drained(release_id, deadline_s)
        except GatewayUnreachableError:
            return True  # no gateway: nothing can be in flight through it

    def stop_router(self) -> None:
        """Stop the gateway (it lets in-flight requests finish for its shutdown timeout)."""
        gw = self._state.gateway
        if gw is not None:
            stop_group(gw.pid, gw.proc_start, grace_s=max(self.config.drain_deadline_s, 5.0) + 5)
        self._state.gateway = None
        self._state.routes = []
        self._state.mirror = None
        self.handle.save()

    # -- warm period -------------------------------------------------------------------

    def spawn_expirer(self) -> None:
        """Start the detached expirer that stops warm servers and unloads warm adapters when
        their period ends."""
        st = self._state
        if not any(s.role == "warm" and s.warm_until for s in st.servers) and not (
            adapter_deadlines(st)
        ):
            return
        spawn_detached(
            [
                sys.executable,
                "-m",
                "releasekit.deploy.local",
                "expire",
                "--state-dir",
                str(self.settings.state_dir),
                "--env",
                self.env,
                "--grace-s",
                str(self.settings.server_stop_grace_s),
                "--drain-s",
                str(self.config.drain_deadline_s),
            ],
            env=dict(os.environ),
            log_path=self.settings.state_dir / "logs" / f"expire-{self.env}.log",
        )


def expire_warm(
    state_dir: Path,
    env: str,
    *,
    grace_s: float = 10.0,
    drain_deadline_s: float = 60.0,
    now: float | None = None,
) -> int:
    """Stop `env`'s warm servers whose warm period is over (under the env's lock), after
    the gateway has nothing in flight to them (up to `drain_deadline_s`), and unload the
    warm adapters whose period is over (`unload_expired`); returns how many servers it
    stopped and adapters it unloaded."""
    stopped = 0
    with env_lock(state_dir, env, timeout_s=3600):
        st = read_state(state_dir, env)
        t = time.time() if now is None else now
        keep = []
        routed = {r.base_url for r in st.routes if r.weight > 0}
        for s in st.servers:
            if (
                s.role == "warm"
                and s.warm_until is not None
                and s.warm_until <= t
                and s.base_url not in routed
            ):
                if st.gateway is not None:  # streams still pinned to it finish first
                    with (
                        contextlib.suppress(GatewayError),
                        GatewayClient(st.gateway.url, admin_token=st.gateway.admin_token) as c,
                    ):
                        c.wait_drained(s.release_id, drain_deadline_s)
                stop_group(s.pid, s.proc_start, grace_s=grace_s)
                stopped += 1
                continue
            keep.append(s)
        had_adapters = bool(adapter_deadlines(st))
        st.servers = keep
        unloaded = unload_expired(  # an engine that is gone has nothing left to unload
            st,
            now=t,
            drain=lambda: drain_unrouted(st, drain_deadline_s),
            alive=lambda s: process_alive(s.pid, s.proc_start),
        )
        if stopped or had_adapters:
            write_state(state_dir, st)
    return stopped + len(unloaded.names)


def _expire_loop(
    state_dir: Path, env: str, grace_s: float, drain_s: float, poll_s: float = 2.0
) -> int:
    while True:
        try:
            st = read_state(state_dir, env)
        except DeployError:
            return 1
        except Exception:
            time.sleep(poll_s)
            continue
        due = [s.warm_until for s in st.servers if s.role == "warm" and s.warm_until is not None]
        due += adapter_deadlines(st)
        if not due:
            return 0
        if min(due) <= time.time():
            expire_warm(state_dir, env, grace_s=grace_s, drain_deadline_s=drain_s)
            continue
        time.sleep(min(poll_s, max(0.05, min(due) - time.time())))


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m releasekit.deploy.local expire --state-dir DIR --env ENV`."""
    parser = argparse.ArgumentParser(prog="python -m releasekit.deploy.local")
    sub = parser.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("expire", help="stop warm servers when their warm period ends")
    ex.add_argument("--state-dir", required=True, type=Path)
    ex.add_argument("--env", required=True)
    ex.add_argument("--grace-s", type=float, default=10.0)
    ex.add_argument("--drain-s", type=float, default=60.0)
    args = parser.parse_args(argv)
    return _expire_loop(args.state_dir, args.env, args.grace_s, args.drain_s)


if __name__ == "__main__":
    from releasekit.deploy.local import main as _main

    sys.exit(_main())
