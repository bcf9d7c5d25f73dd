"""The Ray cluster as releasekit sees it: connecting as a driver, what its nodes have free,
whether a release fits, and which Serve applications and replicas run there.

Every Ray error enters releasekit here and leaves as a `DeployError` subclass.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import socket
import sys
from typing import Any

from pydantic import BaseModel, Field

from releasekit.config import RayTargetConfig
from releasekit.deploy.ray.loopback import LOOPBACK_ENV
from releasekit.deploy.target import DeployError, ReleaseStartError


class RayNotInstalledError(DeployError):
    """Raised when an environment names the `ray` target but Ray is not installed."""

    remedy = (
        "run bash scripts/install.sh without RELEASEKIT_WITH_RAY=0 (it installs "
        "requirements/ray.lock.txt), or pip install -r requirements/ray.txt"
    )


class RayClusterUnreachableError(DeployError):
    """Raised when the environment's Ray cluster does not answer at its address."""

    remedy = (
        "start the cluster (README, 'Serving on a Ray cluster') or fix [environments.NAME.ray] "
        "address in releasekit.toml"
    )


class ReleaseDoesNotFitError(ReleaseStartError):
    """Raised before anything is deployed when the cluster lacks what a release's replicas
    reserve; the message says what is missing (a failed start: the old release serves)."""

    remedy = "add nodes or CPUs to the cluster, or lower replicas / cpus_per_replica"


class NodeInfo(BaseModel):
    """One live node of the cluster (nodes on one host share an address: `node_id` tells
    them apart)."""

    node_id: str
    address: str
    cpus: float
    memory_gb: float
    head: bool


class ReplicaInfo(BaseModel):
    """One running replica of a release: where Ray placed it and what it runs."""

    replica: str
    node_id: str
    node_ip: str
    pid: int = Field(description="the replica's Ray worker process")
    server_pid: int = Field(description="its vLLM server process (own process group)")
    server_url: str
    log: str
    worker_core: int | None = Field(
        None, description="the core its vLLM worker is bound to (None: the release places it)"
    )


def _keep_loopback() -> None:
    """Before Ray is imported (and again if it was): a driver of a cluster on 127.0.0.1
    connects to 127.0.0.1 itself (Ray otherwise rewrites it to the host's outward address,
    where a cluster on loopback does not listen; deploy/ray/loopback.py)."""
    os.environ[LOOPBACK_ENV] = "0"

    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:
        constants.ENABLE_RAY_CLUSTER = False  # type: ignore[attr-defined]


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise RayNotInstalledError("the ray target needs Ray: it is not installed") from exc
    return ray


def node_ip_for(cfg: RayTargetConfig) -> str | None:
    """This host's node IP for the driver: configured, else the address's loopback host."""
    if cfg.node_ip:
        return cfg.node_ip
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(cfg.host).is_loopback:
            return cfg.host
    return None


def connect(cfg: RayTargetConfig) -> None:
    """Attach this process to the cluster as a driver (once; again if the address
    changed). RayClusterUnreachableError when nothing answers at the address."""
    host, port = cfg.host, int(cfg.address.rsplit(":", 1)[1])
    if node_ip_for(cfg) == "127.0.0.1" and host == "127.0.0.1":
        _keep_loopback()
    ray = _ray()
    try:
        with socket.create_connection((host, port), timeout=min(cfg.connect_timeout_s, 5.0)):
            pass
    except OSError as exc:
        raise RayClusterUnreachableError(
            f"no Ray cluster answers at {cfg.address}: {exc.strerror or exc}"
        ) from exc
    if ray.is_initialized():
        ctx = ray.get_runtime_context()
        if getattr(ctx, "gcs_address", None) == cfg.address:
            return
        ray.shutdown()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        ray.init(
            address=cfg.address,
            _node_ip_address=node_ip_for(cfg),
            namespace="releasekit",
            log_to_driver=False,
            logging_level=logging.WARNING,
            configure_logging=False,
        )
    except Exception as exc:  # Ray raises ConnectionError, RuntimeError, ValueError
        with contextlib.suppress(Exception):
            ray.shutdown()
        raise RayClusterUnreachableError(
            f"could not join the Ray cluster at {cfg.address}: {str(exc).splitlines()[0]}"
        ) from exc


def nodes() -> list[NodeInfo]:
    """The cluster's live nodes."""
    ray = _ray()
    out = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        res = n.get("Resources", {})
        out.append(
            NodeInfo(
                node_id=n["NodeID"],
                address=n.get("NodeManagerAddress", "?"),
                cpus=float(res.get("CPU", 0.0)),
                memory_gb=round(float(res.get("memory", 0.0)) / 1024**3, 2),
                head="node:__internal_head__" in res,
            )
        )
    return out


def check_fits(cfg: RayTargetConfig, *, replicas: int) -> None:
    """ReleaseDoesNotFitError, naming what is missing, when `replicas` replicas of
    `cfg`'s shape cannot all be placed on the cluster's free resources now."""
    ray = _ray()
    live = nodes()
    free = ray.available_resources()
    need_cpu = replicas * cfg.cpus_per_replica
    problems = []
    if not live:
        problems.append("the cluster has no live node")
    biggest = max((n.cpus for n in live), default=0.0)
    if cfg.cpus_per_replica > biggest:
        problems.append(
            f"one replica reserves {cfg.cpus_per_replica:g} CPU but the largest node has "
            f"{biggest:g}"
        )
    free_cpu = float(free.get("CPU", 0.0))
    if need_cpu > free_cpu + 1e-9:
        problems.append(
            f"{replicas} replica(s) x {cfg.cpus_per_replica:g} CPU = {need_cpu:g} CPU needed, "
            f"{free_cpu:g} CPU free on {len(live)} node(s): {need_cpu - free_cpu:g} CPU missing"
        )
    if cfg.memory_gb_per_replica is not None:
        need_mem = replicas * cfg.memory_gb_per_replica
        free_mem = float(free.get("memory", 0.0)) / 1024**3
        if need_mem > free_mem + 1e-6:
            problems.append(
                f"{need_mem:g} GiB memory needed, {free_mem:.2f} GiB free: "
                f"{need_mem - free_mem:.2f} GiB missing"
            )
    if cfg.max_replicas_per_node is not None and replicas > cfg.max_replicas_per_node * len(live):
        problems.append(
            f"{replicas} replica(s) at most {cfg.max_replicas_per_node} per node need "
            f"{-(-replicas // cfg.max_replicas_per_node)} node(s), the cluster has {len(live)}"
        )
    if problems:
        raise ReleaseDoesNotFitError(
            f"the release does not fit the Ray cluster at {cfg.address}: " + "; ".join(problems)
        )


def app_statuses() -> dict[str, tuple[str, str]]:
    """Every Serve application on the cluster: name -> (status, first deployment message)."""
    _ray()
    from ray import serve

    out: dict[str, tuple[str, str]] = {}
    try:
        st = serve.status()
    except Exception as exc:
        raise DeployError(f"could not read Ray Serve's status: {exc}") from exc
    for name, app in st.applications.items():
        msg = app.message or ""
        for dep in app.deployments.values():
            if dep.message:
                msg = dep.message
                break
        out[name] = (str(app.status.value if hasattr(app.status, "value") else app.status), msg)
    return out


class ScaleState(BaseModel):
    """A release application's replica count as Ray Serve's controller reports it."""

    running: int = Field(description="replicas in state RUNNING")
    starting: int = Field(0, description="replicas starting, updating or recovering")
    stopping: int = Field(0, description="replicas being stopped")
    status: str = Field(description="the deployment's status: HEALTHY, UPSCALING, ...")
    trigger: str = Field("", description="what the status follows: UPSCALE_COMPLETED, ...")


def scale_state(app: str) -> ScaleState | None:
    """How many replicas `app` runs now, from Serve's own status (None: no such app)."""
    _ray()
    from ray import serve

    try:
        st = serve.status()
    except Exception as exc:
        raise DeployError(f"could not read Ray Serve's status: {exc}") from exc
    a = st.applications.get(app)
    if a is None or not a.deployments:
        return None
    dep = next(iter(a.deployments.values()))
    counts = {str(getattr(k, "value", k)): int(v) for k, v in dep.replica_states.items()}
    return ScaleState(
        running=counts.get("RUNNING", 0),
        starting=sum(counts.get(k, 0) for k in ("STARTING", "UPDATING", "RECOVERING")),
        stopping=counts.get("STOPPING", 0),
        status=str(getattr(dep.status, "value", dep.status)),
        trigger=str(getattr(dep.status_trigger, "value", dep.status_trigger)),
    )


def replicas_of(app: str) -> list[ReplicaInfo]:
    """The replicas of `app` that run now (their records, less those whose actor is gone)."""
    ray = _ray()
    from ray.experimental import internal_kv

    from releasekit.deploy.ray.replica import KV_NAMESPACE

    alive = {
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if isinstance(a, dict) and a.get("namespace") == "serve"
    }
    out = []
    for key in internal_kv._internal_kv_list(f"{app}/".encode(), namespace=KV_NAMESPACE):
        raw = internal_kv._internal_kv_get(key, namespace=KV_NAMESPACE)
        if raw is None:
            continue
        data = json.loads(raw)
        if data.get("actor") not in alive:
            internal_kv._internal_kv_del(key, namespace=KV_NAMESPACE)
            continue
        out.append(ReplicaInfo.model_validate(data))
    return sorted(out, key=lambda r: (r.node_id, r.replica))
