"""vLLM server control: start a release's model with its exact engine args, wait until
healthy, keep its log, and stop it cleanly (never an orphan)."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import random
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import httpx
from pydantic import BaseModel

from releasekit._support.http import http_client
from releasekit._support.procs import (
    deferred_signals,
    die_with_parent_hook,
    group_alive,
    group_memory_bytes,
    last_error_line,
    sigterm_as_interrupt,
    stop_process_group,
    tail,
)
from releasekit._support.retry import RetryPolicy
from releasekit.errors import (
    AdapterLoadError,
    ReleaseNotBuiltError,
    ServerError,
    ServerStartError,
    ServerUnreachableError,
)
from releasekit.serving.adapter_store import stage_adapters
from releasekit.serving.adapters import RUNTIME_ENV, ensure_adapters, loaded_adapters
from releasekit.serving.host import inherited_env, server_env

if TYPE_CHECKING:
    from releasekit.config import Settings
    from releasekit.spec.lock import Lock
    from releasekit.spec.manifest import LoadedManifest, Manifest

PORT_RANGE_ENV = "RELEASEKIT_PORT_RANGE"
"""`LOW-HIGH`: pick servers' ports from this range (shared machines); default: any free port."""

PIDDIR_ENV = "RELEASEKIT_SERVER_PIDDIR"
"""A folder where every server started in this process tree leaves `<pid>` (its process
group) while it runs, so a parent (a build) can reap servers whose owner was killed."""

_LIVE: set[subprocess.Popen[bytes]] = set()
_BIND_ERRORS = ("Address already in use", "[Errno 98]")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on `host`."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def pick_port(host: str = "127.0.0.1", *, avoid: set[int] | None = None) -> int:
    """A free port: from RELEASEKIT_PORT_RANGE (`LOW-HIGH`) when set, else any free one."""
    spec = os.environ.get(PORT_RANGE_ENV, "").strip()
    if not spec:
        return free_port(host)
    try:
        low, high = (int(x) for x in spec.split("-", 1))
    except ValueError as exc:
        raise ServerError(f"{PORT_RANGE_ENV}={spec!r} is not LOW-HIGH") from exc
    ports = [p for p in range(low, high + 1) if p not in (avoid or set())]
    random.shuffle(ports)  # concurrent starters rarely pick the same port
    for port in ports:
        if _port_free(host, port):
            return port
    raise ServerError(f"no free port in {PORT_RANGE_ENV}={spec}")


def engine_argv(args: Mapping[str, str]) -> list[str]:
    """Turn canonical engine args (dashed name -> value, "" for a flag) into argv."""
    argv: list[str] = []
    for k, v in args.items():
        argv.append(f"--{k}")
        if v != "":
            argv.append(v)
    return argv


class ServerInfo(BaseModel):
    """A running server: where it answers and what it serves."""

    base_url: str
    model: str
    pid: int
    port: int
    log_path: str
    version: str | None = None


class VLLMServer:
    """One vLLM OpenAI-compatible server process.

    Use as a context manager; the process runs in its own process group so that
    stopping it also stops its engine workers. With `die_with_parent` (the default) the
    kernel also stops it if the process that started it dies without cleaning up.

    `adapters` (engine model name -> adapter folder) are LoRA adapters loaded at run time once
    the base is healthy; the server then runs with RUNTIME_ENV, and its engine arguments must
    enable LoRA (enable-lora, max-loras, max-lora-rank).
    """

    def __init__(
        self,
        model_dir: Path,
        *,
        served_name: str,
        engine_args: Mapping[str, str],
        env: Mapping[str, str] | None = None,
        python: Path,
        log_path: Path,
        host: str = "127.0.0.1",
        port: int | None = None,
        start_timeout_s: float = 300.0,
        stop_grace_s: float = 10.0,
        die_with_parent: bool = True,
        adapters: Mapping[str, Path] | None = None,
    ) -> None:
        self.model_dir = model_dir
        self.served_name = served_name
        self.engine_args = dict(engine_args)
        self.adapters = dict(adapters or {})
        # An engine that takes adapters loads them at run time, as a deployed one does.
        lora = bool(self.adapters) or "enable-lora" in self.engine_args
        self.env = {**(env or {}), **(RUNTIME_ENV if lora else {})}
        self.python = python
        self.log_path = log_path
        self.host = host
        self._auto_port = port is None
        self.port = port or pick_port(host)
        self.start_timeout_s = start_timeout_s
        self.stop_grace_s = stop_grace_s
        self.die_with_parent = die_with_parent
        self.proc: subprocess.Popen[bytes] | None = None
        self._pidfile: Path | None = None

    @property
    def base_url(self) -> str:
        """http://host:port (without /v1)."""
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        """The exact argv used to start vLLM."""
        args = {k: v for k, v in self.engine_args.items() if k != "served-model-name"}
        return [
            str(self.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            self.served_name,
            "--host",
            self.host,
            "--port",
            str(self.port),
            *engine_argv(args),
        ]

    def start(self) -> ServerInfo:
        """Start the server and block until /health and /v1/models answer, with the base and
        each of `adapters` (loaded once the base is healthy) listed.

        Raises ServerStartError (quoting the log's last lines) if vLLM exits or is not
        healthy within `start_timeout_s`, AdapterLoadError (the engine's reason, one line)
        if it refuses an adapter; the process group is stopped either way. A port lost to a
        concurrent starter is retried on another port when the port was not given.
        """
        if not self.model_dir.is_dir():
            raise ServerStartError(f"model folder not found: {self.model_dir}")
        self._check_adapter_args()
        tried: set[int] = set()
        while True:
            try:
                return self._start_once()
            except ServerStartError as exc:
                tried.add(self.port)
                lost_port = any(m in exc.log_tail for m in _BIND_ERRORS)
                if not (self._auto_port and lost_port and len(tried) < 3):
                    raise
                self.port = pick_port(self.host, avoid=tried)

    def _start_once(self) -> ServerInfo:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {
            **inherited_env(),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            **self.env,
        }
        env.pop(PIDDIR_ENV, None)
        hook = (
            die_with_parent_hook()
            if self.die_with_parent and threading.current_thread() is threading.main_thread()
            else None
        )
        try:
            with deferred_signals():  # no window where the process runs unregistered
                log = self.log_path.open("wb")
                try:
                    proc = self.proc = subprocess.Popen(
                        self.command(),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=env,
                        # Its own process group (stopped as one), but the caller's session:
                        # Linux's scheduler autogroups share the CPU per session, and a load
                        # client or gateway in another session than a busy vLLM stalls for
                        # up to seconds at a time (measured: README, "Where the time goes").
                        process_group=0,
                        stdin=subprocess.DEVNULL,
                        preexec_fn=hook,
                    )
                finally:
                    log.close()
                _LIVE.add(proc)
                self._register(proc.pid)
            version = self._wait_ready()
            self._load_adapters()
        except BaseException:
            self.stop()
            raise
        return ServerInfo(
            base_url=self.base_url,
            model=self.served_name,
            pid=proc.pid,
            port=self.port,
            log_path=str(self.log_path),
            version=version,
        )

    def _register(self, pid: int) -> None:
        piddir = os.environ.get(PIDDIR_ENV)
        if not piddir:
            return
        with contextlib.suppress(OSError):
            Path(piddir).mkdir(parents=True, exist_ok=True)
            self._pidfile = Path(piddir) / str(pid)
            self._pidfile.write_text(json.dumps({"pid": pid, "log": str(self.log_path)}))

    def _died(self, rc: int, when: str) -> ServerStartError:
        return server_gone(self.log_path, f"vLLM exited with code {rc} {when}")

    def _wait_ready(self) -> str | None:
        if self.proc is None:
            raise ServerStartError("server was not started")
        proc = self.proc

        def ready(client: httpx.Client) -> tuple[bool, str | None]:
            """(True, its version) once it serves its model; (False, None) before."""
            rc = proc.poll()
            if rc is not None:
                raise self._died(rc, "before becoming healthy")
            if client.get("/health").status_code == 200:
                models = client.get("/v1/models")
                if models.status_code == 200 and any(
                    m.get("id") == self.served_name for m in models.json().get("data", [])
                ):
                    v = client.get("/version")
                    return True, v.json().get("version") if v.status_code == 200 else None
            return False, None

        not_yet = (httpx.HTTPError, ValueError)
        poll = RetryPolicy.every(
            0.5, deadline_s=self.start_timeout_s, retry_on=not_yet, retry_result=lambda r: not r[0]
        )
        with (
            http_client(base_url=self.base_url, timeout=5.0) as client,
            contextlib.suppress(*not_yet),
        ):
            ok, version = poll.call(lambda: ready(client))
            if ok:
                return version
        raise ServerStartError(
            f"vLLM did not become healthy within {self.start_timeout_s:.0f} s "
            f"(log: {self.log_path})",
            log_tail=tail(self.log_path),
            log_path=self.log_path,
        )

    def _check_adapter_args(self) -> None:
        """Refuse, before starting anything, adapters the engine arguments cannot hold: no
        enable-lora, or more than max-loras (vLLM would evict one on its own)."""
        if not self.adapters:
            return
        if "enable-lora" not in self.engine_args:
            raise AdapterLoadError(
                f"{len(self.adapters)} adapter(s) to serve but the engine arguments lack "
                "enable-lora (with max-loras and max-lora-rank)"
            )
        cap = self.engine_args.get("max-loras", "")
        if cap.isdigit() and len(self.adapters) > int(cap):
            raise AdapterLoadError(
                f"{len(self.adapters)} adapters to serve, more than max-loras {cap}: "
                f"{', '.join(sorted(self.adapters))}"
            )

    def _api_key(self) -> str | None:
        return self.engine_args.get("api-key") or self.env.get("VLLM_API_KEY") or None

    def _load_adapters(self) -> None:
        """Load `adapters` into the healthy engine and check /v1/models lists each; an
        engine that refuses one (or dies meanwhile) is an AdapterLoadError in one line."""
        if not self.adapters:
            return
        key = self._api_key()
        try:
            ensure_adapters(self.base_url, self.adapters, api_key=key)
            held = loaded_adapters(self.base_url, api_key=key)
        except AdapterLoadError as exc:
            raise AdapterLoadError(
                f"{' '.join(exc.message.split())} (log: {self.log_path})"
            ) from exc
        missing = sorted(set(self.adapters) - set(held))
        if missing:
            raise AdapterLoadError(
                f"the engine at {self.base_url} loaded but does not list adapter(s) "
                f"{', '.join(missing)} in /v1/models (log: {self.log_path})"
            )

    def check_alive(self) -> None:
        """Raise ServerStartError (quoting the log) if the server has died since start."""
        if self.proc is None:
            raise ServerStartError("server is not running")
        rc = self.proc.poll()
        if rc is not None:
            raise self._died(rc, "while serving")

    def memory_bytes(self) -> int | None:
        """The memory the server's processes hold now (API server, engine and workers, shared
        pages counted once: `group_memory_bytes`); None when not running or not measurable."""
        if self.proc is None or self.proc.poll() is not None:
            return None
        return group_memory_bytes(self.proc.pid)

    def wait(self, *, poll_s: float = 0.5) -> None:
        """Block while the server runs (foreground serving); raise ServerStartError quoting
        its log if it exits on its own. Ctrl-C surfaces as KeyboardInterrupt."""
        while True:
            self.check_alive()
            time.sleep(poll_s)

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL it after the grace period; idempotent and not
        interruptible by a second Ctrl-C."""
        proc = self.proc
        if proc is None:
            return
        with deferred_signals():
            stop_process_group(proc, self.stop_grace_s)
            _LIVE.discard(proc)
            self.proc = None
            if self._pidfile is not None:
                self._pidfile.unlink(missing_ok=True)
                self._pidfile = None

    def detach(self) -> int:
        """Hand the running server on: this object and this process stop owning it (no stop
        at exit, no pid file for a parent to reap) and its pid (its process group) is
        returned; whoever takes it stops it (`releasekit.build.engines`). Start it with
        `die_with_parent=False` when its owner will exit before it should."""
        proc = self.proc
        if proc is None:
            raise ServerStartError("server is not running")
        with deferred_signals():
            _LIVE.discard(proc)
            self.proc = None
            if self._pidfile is not None:
                self._pidfile.unlink(missing_ok=True)
                self._pidfile = None
        return proc.pid

    def __enter__(self) -> VLLMServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def server_gone(log_path: Path, what: str) -> ServerStartError:
    """`what` happened to a server: the error, with its log's last error line and tail."""
    cause = last_error_line(tail(log_path, 200))
    return ServerStartError(
        f"{what}{': ' + cause if cause else ''} (log: {log_path})",
        log_tail=tail(log_path),
        log_path=log_path,
    )


class Served(Protocol):
    """A running server as bench and eval use it: where it answers, the adapters it holds
    (model name -> folder), whether it still runs and the memory it holds."""

    @property
    def base_url(self) -> str: ...

    @property
    def adapters(self) -> dict[str, Path]: ...

    def check_alive(self) -> None: ...

    def memory_bytes(self) -> int | None: ...


class AttachedServer:
    """A vLLM server this process did not start (it was handed on: `VLLMServer.detach`):
    where it answers, the adapters it holds for the caller, and whether it still runs. Its
    owner stops it; `stop` here does nothing."""

    def __init__(self, base_url: str, pid: int, *, adapters: Mapping[str, Path], log_path: Path):
        self.base_url = base_url
        self.pid = pid
        self.adapters = dict(adapters)
        self.log_path = log_path

    def check_alive(self) -> None:
        """Raise ServerStartError (quoting its log) if the server has died."""
        if not group_alive(self.pid):
            raise server_gone(self.log_path, f"vLLM (pid {self.pid}) is no longer running")

    def memory_bytes(self) -> int | None:
        """The memory the server's process group holds now (`group_memory_bytes`)."""
        return group_memory_bytes(self.pid) if group_alive(self.pid) else None

    def stop(self) -> None:
        """Not this object's to stop: its owner does."""


@atexit.register
def _stop_all() -> None:
    for proc in list(_LIVE):
        stop_process_group(proc, 5.0)
        _LIVE.discard(proc)


def check_reachable(base_url: str, *, timeout_s: float = 5.0) -> str | None:
    """Check that a server answers /health; return its /version or raise."""
    try:
        with http_client(base_url=base_url, timeout=timeout_s) as c:
            r = c.get("/health")
            if r.status_code != 200:
                raise ServerUnreachableError(f"{base_url}/health answered {r.status_code}")
            v = c.get("/version")
            return v.json().get("version") if v.status_code == 200 else None
    except httpx.HTTPError as exc:
        raise ServerUnreachableError(f"cannot reach {base_url}: {exc}") from exc


def release_model_dir(settings: Settings, lm: LoadedManifest, lock: Lock) -> Path:
    """The folder a release serves: its quantised model (results/<release_id>/model, as
    recorded in quantise.json) or, for `scheme: none`, the manifest's model source.

    Raises ReleaseNotBuiltError if the release is quantised but not built yet.
    """
    release_dir = settings.release_dir(lock.release_id)
    record = release_dir / "quantise.json"
    if record.is_file():
        try:
            recorded = json.loads(record.read_text(encoding="utf-8")).get("model_dir")
        except ValueError:
            recorded = None
        if isinstance(recorded, str) and recorded:
            p = Path(recorded)
            p = p if p.is_absolute() else settings.root / p
            if p.is_dir():
                return p
    if lm.manifest.quantisation.scheme == "none":
        return lm.resolve(lm.manifest.model.source)
    built = release_dir / "model"
    if built.is_dir():
        return built
    raise ReleaseNotBuiltError(
        f"release {lock.short_id} ({lm.manifest.name}) is quantised "
        f"({lm.manifest.quantisation.scheme}) but not built: {built} is missing"
    )


def api_key_of(manifest: Manifest) -> str | None:
    """The key a release's server demands on /v1 (`--api-key` in its serving args, or
    vLLM's VLLM_API_KEY in its environment); bench and eval send it."""
    from releasekit.spec.lock import serving_args

    return serving_args(manifest).get("api-key") or manifest.serving.env.get("VLLM_API_KEY") or None


def serve_release(
    settings: Settings,
    lm: LoadedManifest,
    lock: Lock,
    *,
    port: int | None = None,
    log_path: Path | None = None,
    die_with_parent: bool = True,
) -> VLLMServer:
    """A (not yet started) server for a release: its model folder, the lock's exact engine
    arguments (`serving_args`) and the manifest's environment. Use it as a context manager.

    The release's adapters are staged now (`stage_adapters`: checked against the lock and
    copied under <state_dir>/adapters; AdapterLoadError on a mismatch) and loaded at start
    under their own names, the names its suites and clients ask for.

    The log defaults to <state_dir>/logs/serve-<name>-<release>.log.
    """
    from releasekit.spec.lock import serving_args

    m = lm.manifest
    model_dir = release_model_dir(settings, lm, lock)
    log = log_path or settings.state_dir / "logs" / f"serve-{m.name}-{lock.short_id}.log"
    host_env = server_env(
        python=settings.python, preload=settings.server_preload, release_env=m.serving.env
    )
    return VLLMServer(
        model_dir,
        served_name=m.served_name,
        engine_args=serving_args(m),
        env={**host_env, **m.serving.env},
        python=settings.python,
        log_path=log,
        host=settings.server_host,
        port=port,
        start_timeout_s=settings.server_start_timeout_s,
        stop_grace_s=settings.server_stop_grace_s,
        die_with_parent=die_with_parent,
        adapters=release_adapters(settings, lm, lock),
    )


def release_adapters(settings: Settings, lm: LoadedManifest, lock: Lock) -> dict[str, Path]:
    """The release's adapters as its server loads them: name -> the verified copy under
    <state_dir>/adapters (`stage_adapters`: AdapterLoadError on a mismatch with the lock)."""
    staged = stage_adapters(
        settings.state_dir / "adapters", lm.manifest.adapters, lock.inputs, lm.resolve
    )
    return {a.name: a.path for a in staged}


def serve_manifest(
    settings: Settings,
    manifest_path: Path | str,
    *,
    port: int | None = None,
    on_ready: Callable[[ServerInfo, Lock], None] | None = None,
) -> None:
    """Lock a manifest and serve its release in the foreground until the server exits
    (ServerStartError quoting its log) or the caller is interrupted (Ctrl-C or SIGTERM,
    re-raised as KeyboardInterrupt after the server stopped). The log goes to
    <state_dir>/logs/serve-<name>-<release>.log."""
    from releasekit.spec.lock import locked_release

    lm, lk = locked_release(manifest_path, root=settings.root)
    server = serve_release(settings, lm, lk, port=port)
    with sigterm_as_interrupt():
        try:
            info = server.start()
            if on_ready is not None:
                on_ready(info, lk)
            server.wait()
        finally:
            server.stop()
