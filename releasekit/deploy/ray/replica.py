"""One replica of a release on Ray Serve: a Serve deployment whose replica runs the
release's vLLM OpenAI server as its child process and relays HTTP to it.

vLLM's CPU build is not run inside the replica's own process: its engine starts processes
of its own and wants the host's cores and signals, which a Ray worker does not give it. The
replica starts exactly the command the `local` target starts (serving.vllm's builder: the
release's model, served name and locked engine arguments, nothing added) on a free port of
its node, and Ray owns the rest: placement (the replica's CPU and memory reservation),
health (`check_health` fails once the child stops answering, and Serve replaces the
replica) and restarts. The child dies with the replica (parent-death signal), and
`__del__` stops its process group when Serve retires the replica.

Each replica records where it runs (node, pids, its server's URL, its log) in the cluster's
key-value store under `releasekit/<app>/<replica>`, which `deploy-status` reads.

Sharing a host's cores, as the `local` target does (serving/host.py): vLLM binds its
worker's OpenMP threads to core 0 by default, in every server. A replica that started
beside a busy replica on the same host (two Ray nodes on one machine, or two replicas on
one node) was bound to the core the busy worker spins on and got almost none of it: after
one replica was killed here, its replacement's vLLM worker ran 0 to 6 CPU ticks of 10 ms
per 3-5 s and had not become healthy after 10 minutes. So each replica claims a core for its
worker (`_cores/<replica>` in the same store: the host's least-claimed core among live
replicas, `choose_core`) unless the release or the node's environment binds it itself,
and its server warms up at the settings' `server_start_nice` autogroup priority until it
is healthy.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hashlib
import hmac
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import ray
from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.experimental import internal_kv
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from releasekit._support.http import async_http_client, http_client
from releasekit._support.procs import tail
from releasekit._support.retry import RetryPolicy
from releasekit.deploy.gateway.routing import UPSTREAM_ROUTES
from releasekit.deploy.ray.loopback import LOOPBACK_ENV
from releasekit.deploy.ray.metrics import REPLICAS_GAUGE, merge_expositions
from releasekit.serving.host import (
    BIND_ENV,
    bind_env,
    inherited_env,
    pick_core,
    raise_priority,
    reset_priority,
)
from releasekit.serving.vllm import VLLMServer, pick_port

KV_NAMESPACE = "releasekit"
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade"}
_PR_SET_PDEATHSIG = 1


def keep_grpc_on_loopback() -> None:
    """On a cluster on loopback (deploy/ray/loopback.py), bind this process's Serve replica
    gRPC server to 127.0.0.1. Why: Ray Serve 2.60 starts each replica's inter-deployment
    gRPC server on `[::]:0`, every interface, whatever the node's address; on a node at
    127.0.0.1 the callers reach it at 127.0.0.1 anyway. Runs when this module is imported
    in a replica's worker, before Serve starts that server; a no-op elsewhere."""
    if os.environ.get(LOOPBACK_ENV) != "0":
        return
    try:
        from ray.serve._private import replica as serve_replica
    except ImportError:  # pragma: no cover - Serve moved it: nothing to narrow
        return
    original = serve_replica.add_port_to_grpc_server
    if getattr(original, "releasekit_loopback", False):
        return

    def add_port(server: Any, address: str) -> int:
        if address.startswith("[::]:"):
            address = "127.0.0.1:" + address[len("[::]:") :]
        return int(original(server, address))

    add_port.releasekit_loopback = True  # type: ignore[attr-defined]
    serve_replica.add_port_to_grpc_server = add_port


keep_grpc_on_loopback()


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _clean_env() -> dict[str, str]:
    """The server's base environment: the Ray worker's, less Ray's and gRPC's variables and
    the kernel-choosing ones (`inherited_env`), with vLLM's worker processes spawned rather
    than forked. Why: a replica's vLLM was seen here aborting at start in gRPC ("epoll_wait
    error: Bad file descriptor", SIGABRT); vLLM imports Ray when it is installed, and gRPC
    does not survive a fork. The release's own `serving.env` still wins."""
    env = {k: v for k, v in inherited_env().items() if not k.startswith(("RAY_", "GRPC_"))}
    env["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    return env


def kv_key(app: str, replica: str) -> bytes:
    """The key one replica's record lives under."""
    return f"{app}/{replica}".encode()


CORES_PREFIX = "_cores/"


def host_id() -> str:
    """This machine, the same for every Ray node it runs (loopback nodes share it)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{os.uname().nodename}/{boot}"


HEALTH_GRACE_S = 60.0
"""How long a replica whose server still runs may go without a good /health before Serve's
health check fails it. A running vLLM that answers slowly is busy, not broken. Failing it on
a few missed answers lets Serve retire a replica that is serving: Serve stops its server's
process group mid-stream, which reads as the engine's "EngineCore encountered an issue" 500s
and then "replica's server unreachable" 502s, the pattern seen on an AMX host when a killed
neighbour's replacement warmed up on the same 2 cores at raised priority. A server that
exited still fails the check at once."""


def choose_core(claims: list[dict[str, Any]], *, host: str, alive: set[str], me: str) -> int:
    """The core for this replica's vLLM worker: the least claimed of this host's cores by
    the other live replicas on the same host (`claims`: every replica's claim, `alive`:
    the actor names that run). On a tie with a replica that claimed at the same moment,
    the larger replica id moves on."""
    mine = [
        c
        for c in claims
        if c.get("host") == host and c.get("actor") in alive and c.get("replica") != me
    ]
    return pick_core(c.get("core") for c in mine)


@serve.deployment
class ReleaseReplica:
    """A release's vLLM server as a Serve replica (see the module docstring)."""

    def __init__(
        self,
        *,
        app: str,
        model_dir: str,
        served_name: str,
        engine_args: dict[str, str],
        env: dict[str, str],
        python: str,
        log_dir: str,
        start_timeout_s: float,
        start_nice: int | None = None,
    ) -> None:
        ctx = serve.get_replica_context()
        self.app = app
        self.replica = ctx.replica_id.unique_id
        self.host = ray.util.get_node_ip_address()
        os.environ.update({k: v for k, v in env.items() if k == "RELEASEKIT_PORT_RANGE"})
        self.port = pick_port(self.host)
        self.base_url = f"http://{self.host}:{self.port}"
        self.served_name = served_name
        self.api_key = engine_args.get("api-key")
        self.log = Path(log_dir) / f"{app}-{self.replica}.log"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        argv = VLLMServer(
            Path(model_dir),
            served_name=served_name,
            engine_args=engine_args,
            env=env,
            python=Path(python),
            log_path=Path(os.devnull),
            host=self.host,
            port=self.port,
        ).command()
        child_env = {**_clean_env(), **env}
        self.core: int | None = None
        if BIND_ENV not in child_env:  # neither the release nor the node places the worker
            self.core = self._claim_core()
            child_env.update(bind_env(self.core))
        with self.log.open("ab") as fh:
            self.proc = subprocess.Popen(
                argv,
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=child_env,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        raised = raise_priority(self.proc.pid, start_nice)
        try:
            self._wait_ready(start_timeout_s)
        except BaseException:
            self._stop_child()
            self._drop_claim()
            raise
        finally:
            if raised:
                reset_priority(self.proc.pid)
        self.client = async_http_client(base_url=self.base_url, timeout=None, trust_env=False)
        self.last_healthy = time.monotonic()
        internal_kv._internal_kv_put(
            kv_key(app, self.replica),
            json.dumps(
                {
                    "replica": self.replica,
                    "actor": ray.get_runtime_context().get_actor_name(),
                    "node_id": ray.get_runtime_context().get_node_id(),
                    "node_ip": self.host,
                    "pid": os.getpid(),
                    "server_pid": self.proc.pid,
                    "server_url": self.base_url,
                    "worker_core": self.core,
                    "log": str(self.log),
                    "started_at": time.time(),
                }
            ).encode(),
            namespace=KV_NAMESPACE,
        )

    def _claims(self) -> tuple[list[dict[str, Any]], set[str]]:
        claims = []
        for key in internal_kv._internal_kv_list(CORES_PREFIX.encode(), namespace=KV_NAMESPACE):
            raw = internal_kv._internal_kv_get(key, namespace=KV_NAMESPACE)
            if raw is not None:
                with contextlib.suppress(ValueError):
                    claims.append(json.loads(raw))
        alive = {
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if isinstance(a, dict) and a.get("namespace") == "serve"
        }
        return claims, alive

    def _claim_core(self) -> int:
        """Claim the host's least-claimed core for this replica's worker (module docstring);
        a claim made at the same moment by a replica with a smaller id wins."""
        host, actor = host_id(), ray.get_runtime_context().get_actor_name()
        claims, alive = self._claims()
        core = choose_core(claims, host=host, alive=alive, me=self.replica)
        self._put_claim(host, actor, core)
        claims, alive = self._claims()
        if any(
            c.get("host") == host
            and c.get("core") == core
            and c.get("actor") in alive
            and str(c.get("replica", "")) < self.replica
            for c in claims
        ):
            core = choose_core(claims, host=host, alive=alive, me=self.replica)
            self._put_claim(host, actor, core)
        return core

    def _put_claim(self, host: str, actor: str | None, core: int) -> None:
        internal_kv._internal_kv_put(
            (CORES_PREFIX + self.replica).encode(),
            json.dumps(
                {"replica": self.replica, "actor": actor, "host": host, "core": core}
            ).encode(),
            namespace=KV_NAMESPACE,
        )

    def _drop_claim(self) -> None:
        with contextlib.suppress(Exception):
            internal_kv._internal_kv_del(
                (CORES_PREFIX + self.replica).encode(), namespace=KV_NAMESPACE
            )

    def _wait_ready(self, timeout_s: float) -> None:
        def healthy() -> bool:
            rc = self.proc.poll()
            if rc is not None:
                raise RuntimeError(
                    f"the server of {self.app} exited with code {rc} before becoming healthy "
                    f"(log: {self.log})\n--- last lines of the server log ---\n{tail(self.log)}"
                )
            return self._healthy_sync()

        if RetryPolicy.poll(interval_s=0.5, deadline_s=timeout_s).call(healthy):
            return
        raise RuntimeError(
            f"the server of {self.app} did not become healthy within {timeout_s:.0f} s "
            f"(log: {self.log})\n--- last lines of the server log ---\n{tail(self.log)}"
        )

    def _healthy_sync(self) -> bool:
        headers = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            with http_client(base_url=self.base_url, timeout=3.0, trust_env=False) as c:
                if c.get("/health").status_code != 200:
                    return False
                r = c.get("/v1/models", headers=headers)
                return r.status_code == 200 and any(
                    m.get("id") == self.served_name for m in r.json().get("data", [])
                )
        except (httpx.HTTPError, ValueError, AttributeError):
            return False

    async def check_health(self) -> None:
        """Serve's health check: the child runs, and has answered /health within the last
        `HEALTH_GRACE_S` (else Serve replaces this replica). A server that exited fails at
        once; one that is slow to answer only fails once it has been silent that long (see
        `HEALTH_GRACE_S`)."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {self.proc.returncode}")
        try:
            r = await self.client.get("/health", timeout=5.0)
            problem = "" if r.status_code == 200 else f"answered {r.status_code}"
        except httpx.HTTPError as exc:
            problem = f"did not answer ({exc!r})"
        now = time.monotonic()
        if not problem:
            self.last_healthy = now
            return
        silent = now - getattr(self, "last_healthy", now)
        if silent > HEALTH_GRACE_S:
            raise RuntimeError(f"the server's /health {problem}; no good answer for {silent:.0f} s")

    async def __call__(self, request: Request) -> Response:
        """Relay one HTTP request to the child, streaming the answer back as it comes."""
        path = request.scope.get("path", "/")
        root = request.scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :] or "/"
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP]
        upstream = self.client.build_request(
            request.method,
            path,
            params=request.query_params,
            headers=headers,
            content=await request.body(),
        )
        try:
            resp = await self.client.send(upstream, stream=True)
        except httpx.HTTPError as exc:
            return Response(
                json.dumps({"error": {"message": f"replica's server unreachable: {exc!r}"}}),
                status_code=502,
                media_type="application/json",
            )
        out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP}
        out_headers["x-releasekit-replica"] = self.replica
        return StreamingResponse(
            resp.aiter_raw(),
            status_code=resp.status_code,
            headers=out_headers,
            background=BackgroundTask(resp.aclose),
        )

    async def relay(
        self, method: str, path: str, query: str, headers: list[tuple[str, str]], body: bytes
    ) -> AsyncIterator[Any]:
        """The router's call: yields {"status", "headers"} once, then the body's chunks as
        the server sends them (a closed stream closes the server's request too)."""
        req = self.client.build_request(
            method, path + (f"?{query}" if query else ""), headers=headers, content=body
        )
        try:
            resp = await self.client.send(req, stream=True)
        except httpx.HTTPError as exc:
            yield {"status": 502, "headers": {"content-type": "application/json"}}
            yield _error(f"replica's server unreachable: {exc!r}")
            return
        try:
            out = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP}
            out["x-releasekit-replica"] = self.replica
            yield {"status": resp.status_code, "headers": out}
            async for chunk in resp.aiter_raw():
                yield chunk
        finally:
            await resp.aclose()

    def _stop_child(self, grace_s: float = 10.0) -> None:
        proc = getattr(self, "proc", None)
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            internal_kv._internal_kv_del(kv_key(self.app, self.replica), namespace=KV_NAMESPACE)
        self._drop_claim()
        self._stop_child()


def _error(message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "releasekit_ray"}}).encode()


def _refusal(status: int, message: str) -> Response:
    return Response(_error(message), status_code=status, media_type="application/json")


ROUTER_APP = "rk-router"
ROUTER_VERSION = b"3"  # 2: the environment's router secret and the route allowlist; 3: the
# fleet page's replica gauge

# A request whose replica died before answering: 6 tries, waits jittered up to 0.25 s,
# doubling to at most 1.25 s.
_HEAD_RETRY = RetryPolicy(
    attempts=6, base_s=0.25, cap_s=1.25, retry_on=(ray.exceptions.RayActorError,)
)
TOKEN_SEP = "~"
ROUTER_KEYS = "_router/"
"""KV keys `_router/<env>`: the digest of each environment's router secret."""
_APP_RE = re.compile(r"^rk-([A-Za-z0-9_.-]+)-[0-9a-f]{12}$")


def secret_digest(secret: str) -> str:
    """What the cluster's key-value store keeps of an environment's router secret."""
    return hashlib.sha256(secret.encode()).hexdigest()


def env_of_app(app: str) -> str | None:
    """The environment a release application (`rk-<env>-<12 hex>`) belongs to."""
    m = _APP_RE.match(app)
    return m.group(1) if m else None


def routing_token(app: str, secret: str, api_key: str | None) -> str:
    """The bearer token the environment's gateway sends for a release: its application,
    the environment's router secret (random, kept in the environment's state: never
    derivable from a release id), then the key its server demands, if any."""
    return app + TOKEN_SEP + secret + (TOKEN_SEP + api_key if api_key else "")


def publish_secret(env: str, secret: str) -> None:
    """Record `env`'s router secret (its digest) where the router checks it; a driver
    connected to the cluster calls it."""
    internal_kv._internal_kv_put(
        (ROUTER_KEYS + env).encode(), secret_digest(secret).encode(), namespace=KV_NAMESPACE
    )


@serve.deployment(
    name="router",
    num_replicas=1,
    ray_actor_options={"num_cpus": 0},
    max_ongoing_requests=4096,
    health_check_period_s=2,
)
class Router:
    """The cluster's one HTTP entry for releasekit (application `rk-router`, route "/"):
    sends each request to the release application its bearer token names (the gateway's
    route key for that release), through a Serve handle, so Serve picks a healthy replica.
    Why: the gateway's routes are bare `http://host:port` URLs, so releases that share
    Serve's single HTTP port cannot be told apart by path.

    Only the environment's gateway gets through: the token must carry the environment's
    router secret (401 otherwise: a release id, which responses carry, is not enough), and
    only the OpenAI routes the gateway forwards, with their methods, are relayed (plus
    `GET /health` for the deployer's health check; 404/405 otherwise). Release
    applications have no HTTP route of their own: the router is the only way in."""

    def __init__(self) -> None:
        self.handles: dict[str, Any] = {}
        self.digests: dict[str, str | None] = {}

    def _handle(self, app: str) -> Any:
        h = self.handles.get(app)
        if h is None:
            h = serve.get_app_handle(app).options(stream=True)
            self.handles[app] = h
        return h

    def _digest(self, env: str, *, fresh: bool) -> str | None:
        if fresh or env not in self.digests:
            raw = internal_kv._internal_kv_get((ROUTER_KEYS + env).encode(), namespace=KV_NAMESPACE)
            self.digests[env] = raw.decode() if raw else None
        return self.digests[env]

    def _sent_by_gateway(self, app: str, secret: str) -> bool:
        """Whether `secret` is the router secret of `app`'s environment (read again when
        it does not match: a secret made since)."""
        env = env_of_app(app)
        if env is None or not secret:
            return False
        mine = secret_digest(secret)
        for fresh in (False, True):
            digest = self._digest(env, fresh=fresh)
            if digest is not None and hmac.compare_digest(mine, digest):
                return True
        return False

    async def _fleet_metrics(self, app: str) -> Response:
        """`GET /metrics?app=APP`: every replica's server's /metrics, merged (one series
        per name and labels: counters, histograms and counting gauges summed over the
        replicas, ratio gauges such as KV-cache usage the fullest replica's;
        deploy/ray/metrics.py), then the `releasekit:replicas` gauge: how many replicas
        answered, so a scrape (watch's windows) sees every scale change."""
        urls = []
        for key in internal_kv._internal_kv_list(f"{app}/".encode(), namespace=KV_NAMESPACE):
            raw = internal_kv._internal_kv_get(key, namespace=KV_NAMESPACE)
            if raw is not None:
                urls.append(json.loads(raw)["server_url"] + "/metrics")
        async with async_http_client(timeout=10.0, trust_env=False) as c:
            got = await asyncio.gather(*(c.get(u) for u in urls), return_exceptions=True)
        pages = [r.text for r in got if isinstance(r, httpx.Response) and r.status_code == 200]
        if not pages:
            return Response(
                _error(f"no replica of {app} answered /metrics"),
                status_code=503,
                media_type="application/json",
            )
        gauge = (
            f"# HELP {REPLICAS_GAUGE} replicas of the release whose server answered /metrics\n"
            f"# TYPE {REPLICAS_GAUGE} gauge\n{REPLICAS_GAUGE} {len(pages)}\n"
        )
        return Response(
            merge_expositions(pages) + gauge,
            media_type="text/plain; version=0.0.4",
            headers={"x-releasekit-replicas": str(len(pages))},
        )

    async def __call__(self, request: Request) -> Response:
        """Relay to the application the bearer token names (`/metrics?app=APP`: the
        application's replicas' metrics, merged)."""
        auth = request.headers.get("authorization", "")
        token = auth[7:] if auth.lower().startswith("bearer ") else ""
        app, _, after_app = token.partition(TOKEN_SEP)
        secret, _, key = after_app.partition(TOKEN_SEP)
        path = request.url.path
        fleet = request.query_params.get("app", "")
        if path == "/metrics" and request.method == "GET" and env_of_app(fleet):
            return await self._fleet_metrics(fleet)
        if not token:
            if path == "/health":
                return Response(status_code=200)
            return _refusal(401, "send Authorization: Bearer <the gateway's routing token>")
        if not self._sent_by_gateway(app, secret):
            return _refusal(401, "not sent by the environment's gateway")
        raw = request.scope.get("raw_path")
        methods = UPSTREAM_ROUTES.get(path, ("GET",) if path == "/health" else None)
        if methods is None or (raw is not None and raw != path.encode("latin-1")):
            return _refusal(404, f"unknown route {path[:200]!r}")
        if request.method not in methods:
            return _refusal(405, f"{request.method} is not allowed on {path}")
        headers = [
            (k, v)
            for k, v in request.headers.items()
            if k.lower() not in _HOP and k.lower() != "authorization"
        ]
        if key:
            headers.append(("authorization", f"Bearer {key}"))
        body = await request.body()

        async def first_head() -> tuple[Any, Any]:
            try:
                gen = self._handle(app).relay.remote(
                    request.method, path, request.url.query, headers, body
                )
                return gen, await gen.__anext__()
            except Exception:  # the application is gone or has no replica now
                self.handles.pop(app, None)
                raise

        try:
            # A replica that died (killed, its node gone) before it answered: nothing
            # reached the client yet, so ask again; Serve drops the dead replica and picks
            # a live one.
            gen, head = await _HEAD_RETRY.acall(first_head)
        except Exception as exc:
            return Response(
                _error(f"release application {app} did not answer: {type(exc).__name__}"),
                status_code=503,
                media_type="application/json",
            )

        async def rest() -> AsyncIterator[bytes]:
            async for chunk in gen:
                yield chunk

        return StreamingResponse(rest(), status_code=head["status"], headers=head["headers"])


def replica_options(
    *,
    replicas: int,
    cpus: float,
    memory_gb: float | None,
    max_per_node: int | None,
    autoscaling: dict[str, Any] | None,
    health_period_s: float,
    health_timeout_s: float,
    graceful_s: float,
) -> dict[str, Any]:
    """Serve deployment options for a release's replicas."""
    actor: dict[str, Any] = {"num_cpus": cpus}
    if memory_gb is not None:
        actor["memory"] = int(memory_gb * 1024**3)
    opts: dict[str, Any] = {
        "name": "server",
        "ray_actor_options": actor,
        "health_check_period_s": health_period_s,
        "health_check_timeout_s": health_timeout_s,
        "graceful_shutdown_timeout_s": graceful_s,
        "max_constructor_retry_count": 1,
        "max_ongoing_requests": 1024,
    }
    if autoscaling is not None:
        opts["autoscaling_config"] = autoscaling
        opts["num_replicas"] = "auto"
    else:
        opts["num_replicas"] = replicas
    if max_per_node is not None:
        opts["max_replicas_per_node"] = max_per_node
    return opts


class ReplicaArgs(BaseModel):
    """The constructor arguments of a release's `ReleaseReplica`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    app: str = Field(description="the Serve application, rk-<env>-<12 hex>")
    model_dir: str = Field(description="the model folder, as every node sees it")
    served_name: str
    engine_args: dict[str, str] = Field(description="the release's locked engine arguments")
    env: dict[str, str] = Field(description="the server's environment")
    python: str = Field(description="the interpreter that runs vLLM, on every node")
    log_dir: str = Field(description="where each replica's server log goes, on its node")
    start_timeout_s: float = Field(gt=0)
    start_nice: int | None = None


class AppArgs(BaseModel):
    """What `build_app` builds a release's application from: the deployment's Serve
    options (`replica_options`) and the replica's constructor arguments. The Ray target
    deploys `build_app(args)`; a Serve config names `build_app` with the same args."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    options: dict[str, Any] = Field(description="Serve deployment options (replica_options)")
    replica: ReplicaArgs


APP_BUILDER = "releasekit.deploy.ray.replica:build_app"
"""`import_path` of a release's application in a Serve config."""
ROUTER_BUILDER = "releasekit.deploy.ray.replica:build_router"
"""`import_path` of the router application in a Serve config."""


def build_app(args: dict[str, Any]) -> Any:
    """A release's Serve application (an application builder: Serve calls it with the
    config's `args`; the Ray target calls it with the same). ValueError (pydantic's) on
    arguments that are not `AppArgs`."""
    a = AppArgs.model_validate(args)
    return ReleaseReplica.options(**a.options).bind(**a.replica.model_dump())  # type: ignore[attr-defined]


def build_router(args: dict[str, Any] | None = None) -> Any:
    """The router application (`rk-router`, route "/"); it takes no arguments: each
    environment's secret digest is read from the cluster's key-value store."""
    if args:
        raise ValueError(f"the router application takes no arguments, got {sorted(args)}")
    return Router.bind()  # type: ignore[attr-defined]
