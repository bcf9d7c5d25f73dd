"""A replica's health check fails a server that exited at once, and a running server that
stops answering only after `HEALTH_GRACE_S` of silence: a busy vLLM (a neighbour warming up on
the same cores) must not be retired, and its process group stopped, mid-stream."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time

import pytest

from releasekit._support.http import async_http_client

pytest.importorskip("ray")

from releasekit.deploy.ray import replica as rmod


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _replica(proc: subprocess.Popen[bytes], silent_s: float) -> object:
    cls = rmod.ReleaseReplica.func_or_class
    r = object.__new__(cls)
    r.proc = proc  # type: ignore[attr-defined]
    r.client = async_http_client(base_url=f"http://127.0.0.1:{_closed_port()}")  # type: ignore[attr-defined]
    r.last_healthy = time.monotonic() - silent_s  # type: ignore[attr-defined]
    return r


def test_a_running_server_that_misses_answers_is_failed_only_after_the_grace() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        busy = _replica(proc, silent_s=5.0)
        asyncio.run(busy.check_health())  # type: ignore[attr-defined]  # busy, not broken
        gone = _replica(proc, silent_s=rmod.HEALTH_GRACE_S + 1)
        with pytest.raises(RuntimeError, match="no good answer for"):
            asyncio.run(gone.check_health())  # type: ignore[attr-defined]
    finally:
        proc.kill()
        proc.wait()


def test_a_server_that_exited_fails_at_once() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait()
    r = _replica(proc, silent_s=0.0)
    with pytest.raises(RuntimeError, match="exited with code 3"):
        asyncio.run(r.check_health())  # type: ignore[attr-defined]
