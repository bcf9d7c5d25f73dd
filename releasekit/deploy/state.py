"""Deploy state: which gateway and which servers run for which environment, on which ports and
pids, in `<state_dir>/deploy/<env>.json`, so that the state survives the command that made it.

Every command that changes an environment holds `<state_dir>/deploy/<env>.lock` (an fcntl
lock, released by the kernel when the holder dies, so a crash never leaves it held) for as
long as it works on the environment, and writes the state file atomically. A server is
recorded (role `starting`) right after its process is spawned and before it is healthy, so
a releasekit killed mid-start leaves a record the next command finds and stops.

State file format (`EnvState`, JSON, mode 0600: it holds the gateway's admin token):

    {"env": "staging", "updated_at": 1733050000.0,
     "gateway": {"url": "http://127.0.0.1:25080", "host": ..., "port": 25080, "pid": 4242,
                 "admin_token": "...", "config_path": ..., "log_path": ..., "started_at": ...},
     "routes": [<gateway Route>, ...],               # the table last set on the gateway
     "mirror": <gateway Mirror> | null,              # the shadow mirror set with it
     "servers": [{"release_id": "...", "serving_key": "...", "base_url": ..., "port": 25123,
                  "pid": 4343, "proc_start": 123456, "model": "demo", "log_path": ...,
                  "role": "live" | "warm" | "starting" | "shadow",
                  "warm_until": 1733050300.0 | null,
                  "adapters_warm": {"demo-json@0123456789ab": 1733050300.0},
                  "started_at": ..., "target": "local"}, ...]}
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, ValidationError

from releasekit._support.files import write_atomic
from releasekit._support.procs import pid_alive
from releasekit._support.retry import RetryPolicy
from releasekit.config.lanes import parent_env
from releasekit.deploy.gateway import Mirror, Route
from releasekit.errors import ReleasekitError

_ENV_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")

Role = Literal["live", "warm", "starting", "shadow"]


class DeployStateError(ReleasekitError):
    """Raised when the deploy state file is unreadable, or another releasekit command holds
    the environment's lock longer than the wait allows."""

    remedy = (
        "wait for the other releasekit command to finish; if none runs, the lock is free "
        "(the kernel drops it when its holder dies) and the state file can be inspected"
    )


class ServerRecord(BaseModel):
    """One release server of an environment (a vLLM process group on the local target)."""

    release_id: str
    serving_key: str = Field(description="digest of what the server runs (model + engine args)")
    base_url: str
    port: int
    pid: int = Field(description="process id, also its process-group id")
    proc_start: int | None = Field(None, description="kernel start time (guards pid reuse)")
    model: str = Field(description="served model name")
    api_key: str | None = Field(None, repr=False, description="key the server demands on /v1")
    log_path: str
    role: Role
    warm_until: float | None = Field(None, description="unix time a warm server is stopped")
    adapters_warm: dict[str, float] = Field(
        default_factory=dict,
        description="LoRA adapters (engine names) no route carries any more, kept loaded "
        "for the warm window: engine name -> unix time they are unloaded",
    )
    started_at: float
    target: str = "local"
    cpu_core: int | None = Field(None, description="the core its vLLM worker is bound to")
    start_priority: int | None = Field(
        None, description="autogroup nice it started with (None: not raised)"
    )
    ready_s: float | None = Field(None, description="seconds from spawn to healthy")
    app: str | None = Field(None, description="the Ray Serve application (`ray` target)")

    @property
    def metrics_url(self) -> str:
        """Where the release's vLLM metrics are read: the server's /metrics, or on the
        `ray` target every replica's, merged by the cluster's router."""
        base = self.base_url.rstrip("/") + "/metrics"
        return f"{base}?app={self.app}" if self.app else base

    @property
    def ident(self) -> str:
        """What tells this server from the environment's others: its Serve application on
        the `ray` target, its process group on `local`."""
        return f"app:{self.app}" if self.app else f"pid:{self.pid}"


class GatewayRecord(BaseModel):
    """The environment's gateway process."""

    url: str
    host: str
    port: int
    pid: int
    proc_start: int | None = None
    admin_token: str = Field(repr=False)
    config_path: str
    log_path: str
    started_at: float


class EnvState(BaseModel):
    """Everything running for one environment."""

    env: str
    updated_at: float = 0.0
    gateway: GatewayRecord | None = None
    routes: list[Route] = Field(default_factory=list)
    mirror: Mirror | None = Field(
        None,
        description="the shadow mirror set on the gateway with `routes` (a restarted gateway "
        "gets it back; a new table ends it)",
    )
    servers: list[ServerRecord] = Field(default_factory=list)

    def server_for(self, release_id: str) -> ServerRecord | None:
        """The server recorded for `release_id` (live or warm first), or None."""
        found = [s for s in self.servers if s.release_id == release_id]
        found.sort(key=lambda s: {"live": 0, "warm": 1, "shadow": 2, "starting": 3}[s.role])
        return found[0] if found else None

    def server_serving(self, serving_key: str) -> ServerRecord | None:
        """A live, warm or shadow server already running this serving config, or None."""
        for role in ("live", "warm", "shadow"):
            for s in self.servers:
                if s.serving_key == serving_key and s.role == role:
                    return s
        return None

    def live_servers(self) -> list[ServerRecord]:
        """Servers that carry the environment's traffic."""
        return [s for s in self.servers if s.role == "live"]

    def routed_release_ids(self) -> list[str]:
        """Releases the gateway's table sends traffic to."""
        return [r.release_id for r in self.routes if r.weight > 0]


def deploy_dir(state_dir: Path) -> Path:
    """`<state_dir>/deploy`: state files, locks, gateway configs."""
    return state_dir / "deploy"


def _check_env(env: str) -> str:
    """The environment whose state and lock `env` uses (an adapter lane shares its
    environment's: `releasekit.config.lanes`), checked."""
    env = parent_env(env)
    if not _ENV_NAME.match(env):
        raise DeployStateError(f"environment name {env!r} must match [A-Za-z0-9_.-]{{1,64}}")
    return env


def state_path(state_dir: Path, env: str) -> Path:
    """The state file of `env`."""
    return deploy_dir(state_dir) / f"{_check_env(env)}.json"


def read_state(state_dir: Path, env: str) -> EnvState:
    """The recorded state of `env` (empty if none; an adapter lane's is its environment's);
    DeployStateError if unreadable."""
    path = state_path(state_dir, env)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return EnvState(env=parent_env(env))
    except OSError as exc:
        raise DeployStateError(f"cannot read deploy state {path}: {exc}") from exc
    try:
        return EnvState.model_validate_json(data)
    except ValidationError as exc:
        raise DeployStateError(f"deploy state {path} is not valid: {exc}") from exc


def write_state(state_dir: Path, state: EnvState) -> None:
    """Write `state` atomically (mode 0600)."""
    path = state_path(state_dir, state.env)
    state.updated_at = time.time()
    write_atomic(path, (state.model_dump_json(indent=2) + "\n").encode())
    with contextlib.suppress(OSError):
        path.chmod(0o600)


def list_envs(state_dir: Path) -> list[str]:
    """Environments that have a state file. The folder also holds each gateway's config
    (`<env>-gateway.json`): only a file that reads as the state of the environment its name
    says counts."""
    d = deploy_dir(state_dir)
    if not d.is_dir():
        return []
    found = []
    for p in d.glob("*.json"):
        if not _ENV_NAME.match(p.stem):
            continue
        try:
            state = EnvState.model_validate_json(p.read_bytes())
        except (OSError, ValidationError):
            continue
        if state.env == p.stem:
            found.append(p.stem)
    return sorted(found)


def _lock_held(exc: BaseException) -> bool:
    """Whether a non-blocking flock failed because another process holds the lock."""
    return isinstance(exc, OSError) and exc.errno in (errno.EAGAIN, errno.EACCES)


@contextlib.contextmanager
def env_lock(state_dir: Path, env: str, *, timeout_s: float = 600.0) -> Iterator[None]:
    """Hold `env`'s deploy lock (fcntl; the kernel drops it if this process dies).
    DeployStateError if another holder keeps it past `timeout_s`."""
    path = deploy_dir(state_dir) / f"{_check_env(env)}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        policy = RetryPolicy.every(
            0.1, deadline_s=timeout_s, retry_on=(OSError,), retry_if=_lock_held
        )
        try:
            policy.call(lambda: fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB))
        except OSError as exc:
            if not _lock_held(exc):
                raise
            raise DeployStateError(
                f"another releasekit command is changing environment {env!r} "
                f"(waited {timeout_s:g} s for {path})"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


class StateHandle:
    """The state of one environment while its lock is held: `state` to read and change,
    `save()` to write it (call after each step, so a crash loses no process)."""

    def __init__(self, state_dir: Path, state: EnvState) -> None:
        self.state_dir = state_dir
        self.state = state

    def save(self) -> None:
        """Write the state file atomically."""
        write_state(self.state_dir, self.state)


@contextlib.contextmanager
def locked_state(state_dir: Path, env: str, *, timeout_s: float = 600.0) -> Iterator[StateHandle]:
    """`with locked_state(dir, env) as h:` the env's lock held, its state read; the state
    is written again when the block ends (also on error)."""
    with env_lock(state_dir, env, timeout_s=timeout_s):
        handle = StateHandle(state_dir, read_state(state_dir, env))
        try:
            yield handle
        finally:
            handle.save()


def proc_start_time(pid: int) -> int | None:
    """The kernel's start time of `pid` (clock ticks since boot), or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def same_process(pid: int, proc_start: int | None) -> bool:
    """True when `pid` runs and is the process that was recorded (not a reused pid)."""
    now = proc_start_time(pid)
    if now is None:
        return pid_alive(pid) and proc_start is None
    return proc_start is None or now == proc_start
