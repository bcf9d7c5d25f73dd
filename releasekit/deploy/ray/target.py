"""The `ray` deploy target: each release is a Ray Serve application on the environment's
Ray cluster (`rk-<env>-<release short id>`, no HTTP route of its own), with one vLLM server per
replica (deploy/ray/replica.py); the environment's gateway is releasekit's own, on this
host, as on the `local` target, and routes to the application through Serve's HTTP proxy.

What is whose: releasekit decides what runs (gates, smoke, the switch, the warm period,
rollback) and records it (state file, ledger); the cluster decides where replicas run, keeps
them healthy and replaces dead ones, and scales them when the environment asks for
autoscaling. A replica Ray replaces keeps the application's URL, so the gateway's table does
not change.

Application records live in the same state file as the local target's servers (`app` set,
`pid` 0), and `reconcile` brings them in line with the applications Serve runs: a record
whose application is gone is forgotten; an application a crashed command left `starting`,
one the state does not know, and a warm one past its period are deleted.
"""

from __future__ import annotations

import argparse
import builtins
import contextlib
import os
import re
import secrets
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from releasekit._support.http import http_client
from releasekit._support.procs import last_error_line
from releasekit._support.retry import RetryPolicy
from releasekit.config import EnvironmentConfig, RayTargetConfig, Settings, load_settings
from releasekit.deploy.gateway import GatewayError
from releasekit.deploy.gateway_client import GatewayClient
from releasekit.deploy.local import LocalTarget, check_health, process_alive, spawn_detached
from releasekit.deploy.ray.autoscale import (
    AutoscalePlan,
    autoscale_plan,
    serve_autoscaling_config,
)
from releasekit.deploy.ray.cluster import (
    ReplicaInfo,
    app_statuses,
    check_fits,
    connect,
    replicas_of,
)
from releasekit.deploy.state import (
    ServerRecord,
    StateHandle,
    deploy_dir,
    env_lock,
    read_state,
    write_state,
)
from releasekit.deploy.target import (
    DeployError,
    OnSpawn,
    ReleaseSpec,
    ReleaseStartError,
    Upstream,
)
from releasekit.errors import ConfigError
from releasekit.serving.vllm import PORT_RANGE_ENV

if TYPE_CHECKING:
    from releasekit.deploy.ray.replica import AppArgs

_CHILD_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}


NO_ADAPTERS = (
    "the ray target does not carry LoRA adapters yet: deploy releases with adapters with the "
    "local target"
)


class AdaptersNotCarriedError(ReleaseStartError):
    """Raised before anything starts when a release with LoRA adapters is deployed with
    the `ray` target (a failed start: the old release serves)."""

    remedy = "set the environment's target to local for releases with adapters"


def refuse_adapters(spec: ReleaseSpec) -> None:
    """AdaptersNotCarriedError (one line) when `spec` has adapters."""
    if spec.adapters or spec.adapters_problem is not None:
        raise AdaptersNotCarriedError(NO_ADAPTERS)


def app_name(env: str, release_id: str) -> str:
    """The Serve application of a release in an environment."""
    return f"rk-{env}-{release_id[:12]}"


def _child_env(spec: ReleaseSpec) -> dict[str, str]:
    env = {**_CHILD_ENV, **spec.env}
    if os.environ.get(PORT_RANGE_ENV):
        env.setdefault(PORT_RANGE_ENV, os.environ[PORT_RANGE_ENV])
    return env


def release_app_args(
    settings: Settings,
    env: str,
    config: EnvironmentConfig,
    spec: ReleaseSpec,
    *,
    replicas: int | None = None,
    fixed_without_knee: bool = False,
) -> AppArgs:
    """The one description of a release's Serve application in `env` (its name is
    `args.replica.app`): the deployment options and the replica's constructor arguments.
    `RayTarget.start` deploys `build_app(args)`; `releasekit export kuberay` writes the
    same args into a Serve config, so the two cannot differ. Reads only. With autoscaling
    the options carry the environment's plan for this release (deploy/ray/autoscale.py);
    NoKneeEvidenceError when it derives from a knee the release lacks;
    AdaptersNotCarriedError for a release with LoRA adapters."""
    refuse_adapters(spec)
    from releasekit.deploy.ray.replica import AppArgs, ReplicaArgs, replica_options

    ray = config.ray
    if ray is None:
        raise ConfigError(f"environment {env!r}: target ray needs [environments.{env}.ray]")
    count = replicas or ray.replicas
    autoscaling: dict[str, Any] | None = None
    if ray.autoscaling is not None:
        plan = autoscale_plan(
            env,
            ray.autoscaling,
            spec,
            fixed_without_knee=fixed_without_knee,
            replica_cpus=ray.cpus_per_replica,
        )
        autoscaling = serve_autoscaling_config(plan, replicas=count)
    opts = replica_options(
        replicas=count,
        cpus=ray.cpus_per_replica,
        memory_gb=ray.memory_gb_per_replica,
        max_per_node=ray.max_replicas_per_node,
        autoscaling=autoscaling,
        health_period_s=ray.health_check_period_s,
        health_timeout_s=ray.health_check_timeout_s,
        graceful_s=max(config.drain_deadline_s, 1.0),
    )
    return AppArgs(
        options=opts,
        replica=ReplicaArgs(
            app=app_name(env, spec.release_id),
            model_dir=str(Path(spec.model_dir).resolve()),
            served_name=spec.served_name,
            engine_args=dict(spec.engine_args),
            env=_child_env(spec),
            python=str(settings.python),
            log_dir=str((settings.state_dir / "logs").resolve()),
            start_timeout_s=settings.server_start_timeout_s,
            start_nice=settings.server_start_nice,
        ),
    )


def ensure_serve(cfg: RayTargetConfig) -> str:
    """Start Serve on the cluster if it does not run (its HTTP proxy on the head only, at
    serve_host:serve_port); returns the proxy's URL. DeployError if a Serve started earlier
    listens elsewhere."""
    import httpx
    from ray import serve

    host = cfg.serve_host or cfg.host
    url = f"http://{host}:{cfg.serve_port}"
    try:
        serve.start(proxy_location="HeadOnly", http_options={"host": host, "port": cfg.serve_port})
    except Exception as exc:
        raise DeployError(f"could not start Ray Serve on {cfg.address}: {exc}") from exc

    def answers() -> bool:
        with http_client(timeout=3.0, trust_env=False) as c:
            # 503 "Route table is not populated yet" until a first application runs
            return c.get(url + "/-/healthz").status_code in (200, 503)

    poll = RetryPolicy.poll(interval_s=0.5, deadline_s=60, retry_on=(httpx.HTTPError,))
    with contextlib.suppress(httpx.HTTPError):
        if poll.call(answers):
            return url
    raise DeployError(
        f"Ray Serve's HTTP proxy does not answer at {url} (a Serve started with other "
        f"options? check serve_host/serve_port in releasekit.toml)"
    )


def router_secret(state_dir: Path, env: str) -> str:
    """The environment's router secret (deploy/ray/replica.py, Router): random, made once,
    kept in the environment's state folder as `deploy/<env>-router.key`, mode 0600. The
    gateway sends it in each route's token; nothing else knows it."""
    path = deploy_dir(state_dir) / f"{env}-router.key"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        if path.stat().st_mode & 0o077:
            path.chmod(0o600)
        secret = path.read_text().strip()
        if secret:
            return secret
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC, 0o600)
    secret = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    return secret


def ensure_router_app() -> None:
    """Deploy the cluster's router application (deploy/ray/replica.py) if it is missing or
    an older version runs."""
    from ray import serve
    from ray.experimental import internal_kv

    from releasekit.deploy.ray.replica import (
        KV_NAMESPACE,
        ROUTER_APP,
        ROUTER_VERSION,
        build_router,
    )

    key = b"_router_version"
    running = app_statuses().get(ROUTER_APP, ("",))[0] == "RUNNING"
    if running and internal_kv._internal_kv_get(key, namespace=KV_NAMESPACE) == ROUTER_VERSION:
        return
    try:  # missing, or an older router (one without the secret check) still runs: replace it
        serve._run(build_router(), _blocking=True, name=ROUTER_APP, route_prefix="/")
        internal_kv._internal_kv_put(key, ROUTER_VERSION, namespace=KV_NAMESPACE)
    except Exception as exc:
        raise DeployError(f"could not deploy Serve application {ROUTER_APP}: {exc}") from exc


class RayTarget(LocalTarget):
    """An environment's releases as Serve applications on a Ray cluster, behind the
    environment's gateway on this host (gateway methods are the local target's)."""

    name = "ray"

    def __init__(
        self,
        settings: Settings,
        env: str,
        config: EnvironmentConfig,
        handle: StateHandle,
        *,
        replicas: int | None = None,
    ) -> None:
        super().__init__(settings, env, config, handle)
        if config.ray is None:
            raise ConfigError(f"environment {env!r}: target ray needs [environments.{env}.ray]")
        self.ray: RayTargetConfig = config.ray
        self.replicas = replicas or self.ray.replicas
        self._proxy: str | None = None
        self._secret = router_secret(settings.state_dir, env)

    # -- cluster -----------------------------------------------------------------------

    def connect(self) -> str:
        """Join the cluster and make sure Serve runs, with the router and this
        environment's router secret; the proxy's URL."""
        if self._proxy is None:
            from releasekit.deploy.ray.replica import publish_secret

            connect(self.ray)
            self._proxy = ensure_serve(self.ray)
            try:
                publish_secret(self.env, self._secret)
            except Exception as exc:  # Ray's key-value store raises its own errors
                raise DeployError(
                    f"could not record the router secret of {self.env}: {exc}"
                ) from exc
            ensure_router_app()
        return self._proxy

    def _apps(self) -> dict[str, tuple[str, str]]:
        self.connect()
        return app_statuses()

    def _delete(self, app: str) -> None:
        from ray import serve

        try:
            serve.delete(app, _blocking=True)
        except Exception as exc:
            raise DeployError(f"could not delete Serve application {app}: {exc}") from exc

    # -- state -------------------------------------------------------------------------

    def record(self, upstream: Upstream) -> ServerRecord | None:
        """The state record of `upstream`'s application."""
        app = upstream.handle.get("app")
        for s in self._state.servers:
            if s.app == app:
                return s
        return None

    def upstream_of(self, rec: ServerRecord) -> Upstream:
        """An Upstream handle for a recorded application."""
        return Upstream.of_record(
            rec, {"app": rec.app, "port": rec.port, "log": rec.log_path, "pid": None}
        )

    def reconcile(self, *, now: float | None = None) -> list[str]:
        """Bring the state in line with the gateway process and the cluster's Serve
        applications (see the module docstring); returns what it did, in words."""
        now = time.time() if now is None else now
        notes: list[str] = []
        st = self._state
        gw = st.gateway
        if gw is not None and not process_alive(gw.pid, gw.proc_start):
            notes.append(f"gateway pid {gw.pid} is gone")
            st.gateway = None
        apps = self._apps()
        routed = set(st.routed_release_ids())
        keep: list[ServerRecord] = []
        for s in st.servers:
            if s.app is None or s.app not in apps:
                notes.append(f"application of {s.release_id[:12]} is gone from the cluster")
                continue
            if s.role == "starting" and s.release_id not in routed:
                notes.append(f"deleted a half-started application of {s.release_id[:12]}")
                self._delete(s.app)
                continue
            if s.role == "warm" and s.warm_until is not None and s.warm_until <= now:
                notes.append(f"deleted the warm application of {s.release_id[:12]} (period over)")
                self._delete(s.app)
                continue
            keep.append(s)
        known = {s.app for s in keep}
        for app in apps:
            if re.fullmatch(rf"rk-{re.escape(self.env)}-[0-9a-f]{{12}}", app) and app not in known:
                notes.append(f"deleted application {app}, which no record names")
                self._delete(app)
        st.servers = keep
        self.handle.save()
        return notes

    # -- servers -----------------------------------------------------------------------

    def load_adapters(self, upstream: Upstream, spec: ReleaseSpec) -> builtins.list[str]:
        """A reused application never gets adapters: AdaptersNotCarriedError when `spec`
        has some."""
        refuse_adapters(spec)
        return []

    def start(self, spec: ReleaseSpec, *, on_spawn: OnSpawn | None = None) -> Upstream:
        """Deploy `spec` as a Serve application with this environment's replica count and
        wait until every replica is healthy. ReleaseDoesNotFitError before anything is
        deployed when the cluster lacks the resources, or AdaptersNotCarriedError when the
        release has LoRA adapters; ReleaseStartError (application
        deleted, record forgotten) when a replica never becomes healthy, quoting its log."""
        refuse_adapters(spec)  # before anything starts
        from releasekit.deploy.ray.replica import build_app, routing_token

        auto = self.ray.autoscaling
        plan = (
            autoscale_plan(
                self.env,
                auto,
                spec,
                fixed_without_knee=True,
                replica_cpus=self.ray.cpus_per_replica,
            )
            if auto is not None
            else None
        )
        proxy = self.connect()
        check_fits(self.ray, replicas=plan.min_replicas if plan else self.replicas)
        app = app_name(self.env, spec.release_id)
        if app in app_statuses():
            self._delete(app)
        log_dir = (self.settings.state_dir / "logs").resolve()
        rec = ServerRecord(
            release_id=spec.release_id,
            serving_key=spec.serving_key,
            base_url=proxy,  # the router sends a request to the app its bearer token names
            port=self.ray.serve_port,
            pid=0,
            model=spec.served_name,
            api_key=routing_token(app, self._secret, spec.api_key),
            log_path=str(log_dir / f"{app}-*.log"),
            role="starting",
            started_at=time.time(),
            target="ray",
            app=app,
        )
        self._state.servers.append(rec)
        self.handle.save()
        up = self.upstream_of(rec)
        if on_spawn is not None:
            on_spawn(up)
        # Promote refuses a release without knee evidence before its gates; a start that
        # gets here without one is a rollback (or a baseline): it runs, unscaled at max.
        args = release_app_args(
            self.settings, self.env, self.config, spec, replicas=self.replicas,
            fixed_without_knee=True,
        )  # fmt: skip
        bound = build_app(args.model_dump())
        try:
            from ray import serve

            try:
                # No HTTP route of its own: the router (with the environment's secret) is
                # the only way to a release's servers.
                serve._run(bound, _blocking=False, name=app, route_prefix=None)
            except Exception as exc:
                raise ReleaseStartError(
                    f"Ray Serve refused release {spec.release_id[:12]}: {exc}"
                ) from exc
            self._wait_running(app, rec)
        except BaseException:
            try:
                self._delete(app)
            finally:
                self._forget_app(app)
            raise
        rec.ready_s = round(time.time() - rec.started_at, 1)
        self.handle.save()
        return up

    def autoscaling(self, spec: ReleaseSpec) -> AutoscalePlan | None:
        """How `spec`'s replicas scale here (None: a fixed count); NoKneeEvidenceError
        when the environment derives the target from a knee `spec` lacks."""
        auto = self.ray.autoscaling
        if auto is None:
            return None
        return autoscale_plan(self.env, auto, spec, replica_cpus=self.ray.cpus_per_replica)

    def _wait_running(self, app: str, rec: ServerRecord) -> None:
        def running() -> bool:
            status, message = app_statuses().get(app, ("MISSING", ""))
            if status == "RUNNING" and check_health(
                rec.base_url, rec.model, api_key=rec.api_key, timeout_s=3.0
            ):
                return True
            if status in ("DEPLOY_FAILED", "UNHEALTHY", "MISSING"):
                cause = last_error_line(message) or status
                raise ReleaseStartError(
                    f"release {rec.release_id[:12]} on Ray: no healthy replica ({status}): {cause}",
                    log_tail=_log_tail(message),
                    log_path=rec.log_path,
                )
            return False

        deadline_s = self.settings.server_start_timeout_s + 30
        if RetryPolicy.poll(interval_s=0.5, deadline_s=deadline_s).call(running):
            return
        raise ReleaseStartError(
            f"release {rec.release_id[:12]} on Ray: its replicas were not all healthy within "
            f"{self.settings.server_start_timeout_s:.0f} s (waiting for resources or a slow "
            f"start; logs: {rec.log_path})",
            log_tail=_log_tail(app_statuses().get(app, ("", ""))[1]),
            log_path=rec.log_path,
        )

    def _forget_app(self, app: str) -> None:
        self._state.servers = [s for s in self._state.servers if s.app != app]
        self.handle.save()

    def health(self, upstream: Upstream) -> bool:
        """True while the application answers /health through Serve and lists its model."""
        return check_health(upstream.base_url, upstream.model, api_key=upstream.api_key)

    def stop(self, upstream: Upstream, *, grace_s: float = 10.0) -> None:
        """Delete the application (Serve lets replicas finish in-flight requests for the
        drain deadline) and forget it; idempotent."""
        app = upstream.handle.get("app")
        if not isinstance(app, str):
            return
        if app in self._apps():
            self._delete(app)
        self._forget_app(app)

    def list(self) -> list[Upstream]:
        """The recorded applications that Serve runs."""
        apps = self._apps()
        return [self.upstream_of(s) for s in self._state.servers if s.app in apps]

    def replicas_of(self, upstream: Upstream) -> builtins.list[ReplicaInfo]:
        """Where the application's replicas run now."""
        self.connect()
        app = upstream.handle.get("app")
        return replicas_of(app) if isinstance(app, str) else []

    # -- warm period -------------------------------------------------------------------

    def spawn_expirer(self) -> None:
        """Start the detached expirer that deletes warm applications when their period
        ends (`python -m releasekit.deploy.ray.target expire`)."""
        if not any(s.role == "warm" and s.warm_until for s in self._state.servers):
            return
        spawn_detached(
            [
                sys.executable,
                "-m",
                "releasekit.deploy.ray.target",
                "expire",
                "--root",
                str(self.settings.root),
                "--env",
                self.env,
            ],
            env=dict(os.environ),
            log_path=self.settings.state_dir / "logs" / f"expire-{self.env}.log",
        )


def _log_tail(message: str, lines: int = 25) -> str:
    marker = "--- last lines of the server log ---"
    text = message.split(marker, 1)[1] if marker in message else message
    return "\n".join(text.strip().splitlines()[-lines:])


def expire_warm(settings: Settings, env: str, *, now: float | None = None) -> int:
    """Delete `env`'s warm applications whose period is over (under the env's lock), once
    the gateway has nothing in flight to them; returns how many."""
    cfg = settings.environments[env]
    done = 0
    with env_lock(settings.state_dir, env, timeout_s=3600):
        st = read_state(settings.state_dir, env)
        t = time.time() if now is None else now
        routed = {r.release_id for r in st.routes if r.weight > 0}
        due = [
            s
            for s in st.servers
            if s.app
            and s.role == "warm"
            and s.warm_until is not None
            and s.warm_until <= t
            and s.release_id not in routed
        ]
        if not due:
            return 0
        assert cfg.ray is not None
        connect(cfg.ray)
        from ray import serve

        for s in due:
            if st.gateway is not None:
                try:
                    with GatewayClient(st.gateway.url, admin_token=st.gateway.admin_token) as c:
                        c.wait_drained(s.release_id, cfg.drain_deadline_s)
                except GatewayError:
                    pass
            if s.app is not None:
                serve.delete(s.app, _blocking=True)
            done += 1
        gone = {s.app for s in due}
        st.servers = [s for s in st.servers if s.app not in gone]
        write_state(settings.state_dir, st)
    return done


def _expire_loop(root: Path, env: str, poll_s: float = 2.0) -> int:
    settings = load_settings(root=root)
    while True:
        try:
            st = read_state(settings.state_dir, env)
        except DeployError:
            return 1
        due = [s.warm_until for s in st.servers if s.role == "warm" and s.warm_until]
        if not due:
            return 0
        if min(due) <= time.time():
            expire_warm(settings, env)
            continue
        time.sleep(min(poll_s, max(0.05, min(due) - time.time())))


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m releasekit.deploy.ray.target expire --root DIR --env ENV`."""
    parser = argparse.ArgumentParser(prog="python -m releasekit.deploy.ray.target")
    sub = parser.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("expire", help="delete warm applications when their period ends")
    ex.add_argument("--root", required=True, type=Path)
    ex.add_argument("--env", required=True)
    args = parser.parse_args(argv)
    return _expire_loop(args.root, args.env)


if __name__ == "__main__":
    from releasekit.deploy.ray.target import main as _main

    sys.exit(_main())
