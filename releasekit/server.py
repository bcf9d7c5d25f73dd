"""vLLM server control: start a release's model with its exact engine args, wait until
healthy, keep its log, and stop it cleanly (never an orphan)."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import httpx
from pydantic import BaseModel

from releasekit.errors import ServerStartError, ServerUnreachableError

_LIVE: set[subprocess.Popen[bytes]] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on `host`."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


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


def tail(path: Path, lines: int = 25) -> str:
    """The last lines of a log file (empty if unreadable)."""
    try:
        data = path.read_bytes()[-16_384:].decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-lines:])


class VLLMServer:
    """One vLLM OpenAI-compatible server process.

    Use as a context manager; the process runs in its own process group so that
    stopping it also stops its engine workers.
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
    ) -> None:
        self.model_dir = model_dir
        self.served_name = served_name
        self.engine_args = dict(engine_args)
        self.env = dict(env or {})
        self.python = python
        self.log_path = log_path
        self.host = host
        self.port = port or free_port(host)
        self.start_timeout_s = start_timeout_s
        self.stop_grace_s = stop_grace_s
        self.proc: subprocess.Popen[bytes] | None = None

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
        """Start the server and block until /health and /v1/models answer."""
        if not self.model_dir.is_dir():
            raise ServerStartError(f"model folder not found: {self.model_dir}")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            **self.env,
        }
        log = self.log_path.open("wb")
        try:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                stdin=subprocess.DEVNULL,
            )
        finally:
            log.close()
        _LIVE.add(self.proc)
        try:
            version = self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return ServerInfo(
            base_url=self.base_url,
            model=self.served_name,
            pid=self.proc.pid,
            port=self.port,
            log_path=str(self.log_path),
            version=version,
        )

    def _wait_ready(self) -> str | None:
        assert self.proc is not None
        deadline = time.monotonic() + self.start_timeout_s
        with httpx.Client(base_url=self.base_url, timeout=5.0) as client:
            while time.monotonic() < deadline:
                rc = self.proc.poll()
                if rc is not None:
                    raise ServerStartError(
                        f"vLLM exited with code {rc} before becoming healthy "
                        f"(log: {self.log_path})",
                        log_tail=tail(self.log_path),
                        log_path=self.log_path,
                    )
                try:
                    if client.get("/health").status_code == 200:
                        models = client.get("/v1/models")
                        if models.status_code == 200 and any(
                            m.get("id") == self.served_name for m in models.json().get("data", [])
                        ):
                            v = client.get("/version")
                            return v.json().get("version") if v.status_code == 200 else None
                except (httpx.HTTPError, ValueError):
                    pass
                time.sleep(0.5)
        raise ServerStartError(
            f"vLLM did not become healthy within {self.start_timeout_s:.0f} s "
            f"(log: {self.log_path})",
            log_tail=tail(self.log_path),
            log_path=self.log_path,
        )

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL it after the grace period; idempotent."""
        proc = self.proc
        if proc is None:
            return
        stop_process_group(proc, self.stop_grace_s)
        _LIVE.discard(proc)
        self.proc = None

    def __enter__(self) -> VLLMServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def stop_process_group(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """Terminate a process started with start_new_session=True, and all its children."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    # Workers may outlive the parent: kill whatever is left of the group.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)


@atexit.register
def _stop_all() -> None:
    for proc in list(_LIVE):
        stop_process_group(proc, 5.0)
        _LIVE.discard(proc)


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt so `finally` blocks stop servers (DVC and CI
    send SIGTERM)."""

    def _raise(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def check_reachable(base_url: str, *, timeout_s: float = 5.0) -> str | None:
    """Check that a server answers /health; return its /version or raise."""
    try:
        with httpx.Client(base_url=base_url, timeout=timeout_s) as c:
            r = c.get("/health")
            if r.status_code != 200:
                raise ServerUnreachableError(f"{base_url}/health answered {r.status_code}")
            v = c.get("/version")
            return v.json().get("version") if v.status_code == 200 else None
    except httpx.HTTPError as exc:
        raise ServerUnreachableError(f"cannot reach {base_url}: {exc}") from exc
