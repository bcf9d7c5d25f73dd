"""Helpers for the watch tests: a simulated vLLM server and gateway whose /metrics are real
prometheus_client exposition, a fault-injecting HTTP server for them (uvicorn on loopback),
and real Prometheus and Alertmanager processes with their own temp storage."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import portbands
import pytest
import uvicorn
import webclient
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

PORT_BAND = (19000, 19999)  # the watch tests' loopback ports (CONTRIBUTING.md)
FINE = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
PHASE = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 20.0)  # vLLM's request-phase buckets


# --------------------------------------------------------------------------- simulation


class Sim:
    """A vLLM server and the gateway in front of it, as their /metrics show them. `serve`
    records finished requests in both; `restart_vllm` / `restart_gateway` start their
    counters over, as a restarted process does."""

    def __init__(self, *, env: str = "prod", release: str = "r1", model: str = "demo") -> None:
        self.env, self.release, self.model = env, release, model
        self.lock = threading.Lock()
        self.gateway_enabled = True
        self.vllm_families: set[str] = set()
        self._new_vllm()
        self._new_gateway()

    def _new_vllm(self) -> None:
        r = self.vllm_registry = CollectorRegistry()
        lab = ["model_name", "engine"]
        self.v_ttft = Histogram(
            "vllm:time_to_first_token_seconds", "ttft", lab, buckets=FINE, registry=r
        )
        self.v_itl = Histogram(
            "vllm:inter_token_latency_seconds", "itl", lab, buckets=FINE, registry=r
        )
        self.v_e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "e2e", lab, buckets=PHASE, registry=r
        )
        self.v_queue = Histogram(
            "vllm:request_queue_time_seconds", "queue", lab, buckets=PHASE, registry=r
        )
        self.v_prefill = Histogram(
            "vllm:request_prefill_time_seconds", "prefill", lab, buckets=PHASE, registry=r
        )
        self.v_decode = Histogram(
            "vllm:request_decode_time_seconds", "decode", lab, buckets=PHASE, registry=r
        )
        self.v_success = Counter(
            "vllm:request_success", "finished", [*lab, "finished_reason"], registry=r
        )
        self.v_preempt = Counter("vllm:num_preemptions", "preemptions", lab, registry=r)
        self.v_prompt = Counter("vllm:prompt_tokens", "prompt tokens", lab, registry=r)
        self.v_gen = Counter("vllm:generation_tokens", "generation tokens", lab, registry=r)
        self.v_waiting = Gauge("vllm:num_requests_waiting", "waiting", lab, registry=r)
        self.v_running = Gauge("vllm:num_requests_running", "running", lab, registry=r)
        self.v_kv = Gauge("vllm:kv_cache_usage_perc", "kv", lab, registry=r)
        for g in (self.v_waiting, self.v_running, self.v_kv):
            g.labels(self.model, "0").set(0)

    def _new_gateway(self) -> None:
        r = self.gateway_registry = CollectorRegistry()
        er = ["env", "release"]
        self.g_requests = Counter(
            "releasekit_gateway_requests", "requests", [*er, "route", "status"], registry=r
        )
        self.g_in_flight = Gauge("releasekit_gateway_in_flight", "in flight", er, registry=r)
        self.g_ttft = Histogram(
            "releasekit_gateway_ttft_seconds", "ttft", er, buckets=FINE, registry=r
        )
        self.g_e2e = Histogram(
            "releasekit_gateway_e2e_seconds", "e2e", er, buckets=FINE, registry=r
        )
        self.g_upstream = Histogram(
            "releasekit_gateway_upstream_wait_seconds", "upstream", er, buckets=FINE, registry=r
        )
        self.g_queue = Histogram(
            "releasekit_gateway_queue_wait_seconds", "queue", ["env"], buckets=FINE, registry=r
        )
        self.g_chunks = Counter("releasekit_gateway_stream_chunks", "chunks", er, registry=r)
        self.g_rejections = Counter(
            "releasekit_gateway_rejections", "rejections", ["env", "reason"], registry=r
        )
        self.g_feedback = Counter(
            "releasekit_gateway_feedback", "feedback", [*er, "score"], registry=r
        )

    def serve(
        self,
        n: int,
        *,
        ttft: float = 0.05,
        e2e: float = 0.5,
        status: str = "200",
        reason: str = "stop",
        queue: float = 0.01,
        release: str | None = None,
        env: str | None = None,
    ) -> None:
        """Record `n` finished requests with these timings in both servers."""
        rel, en = release or self.release, env or self.env
        with self.lock:
            for _ in range(n):
                v = (self.model, "0")
                self.v_ttft.labels(*v).observe(ttft)
                self.v_itl.labels(*v).observe(0.02)
                self.v_e2e.labels(*v).observe(e2e)
                self.v_queue.labels(*v).observe(queue)
                self.v_prefill.labels(*v).observe(ttft)
                self.v_decode.labels(*v).observe(max(e2e - ttft, 0.0))
                self.v_success.labels(*v, reason).inc()
                self.v_prompt.labels(*v).inc(32)
                self.v_gen.labels(*v).inc(48)
                self.g_requests.labels(en, rel, "/v1/completions", status).inc()
                self.g_ttft.labels(en, rel).observe(ttft + 0.002)
                self.g_e2e.labels(en, rel).observe(e2e + 0.002)
                self.g_upstream.labels(en, rel).observe(0.001)
                self.g_queue.labels(en).observe(0.0005)
                self.g_chunks.labels(en, rel).inc(48)

    def feedback(self, score: str, n: int = 1) -> None:
        """Record `n` feedback scores (positive|negative) for the live release."""
        with self.lock:
            self.g_feedback.labels(self.env, self.release, score).inc(n)

    def restart_vllm(self) -> None:
        """A killed and restarted vLLM server: every counter starts at zero again."""
        with self.lock:
            self._new_vllm()

    def restart_gateway(self) -> None:
        """A restarted gateway: its counters start at zero again."""
        with self.lock:
            self._new_gateway()

    def text(self, which: str) -> str:
        """The current exposition of `vllm` or `gateway`."""
        with self.lock:
            reg = self.vllm_registry if which == "vllm" else self.gateway_registry
            return generate_latest(reg).decode()


# --------------------------------------------------------------------------- servers


def free_port() -> int:
    """A free loopback TCP port from (this worker's share of) the watch tests' range."""
    return portbands.free_port(*PORT_BAND, what="a watch test's server", shuffle=True)


class AppServer:
    """Any ASGI app served by uvicorn on a loopback socket in a daemon thread."""

    def __init__(self, app: Any, *, port: int = 0) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(
            uvicorn.Config(
                app,
                log_level="critical",
                lifespan="off",
                access_log=False,
                timeout_graceful_shutdown=1,
            )
        )
        self.thread = threading.Thread(target=self.server.run, args=([self.sock],), daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> AppServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


class FaultyMetrics:
    """Serves a Sim's /vllm/metrics and /gateway/metrics, and misbehaves on request:
    `delay_s` (answer late: a scrape timeout), `status` (answer an error),
    `drop` (a family name to leave out of the text)."""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self.delay_s: dict[str, float] = {}
        self.status: dict[str, int] = {}
        self.drop: set[str] = set()
        self.hits: dict[str, int] = {"vllm": 0, "gateway": 0}
        self.app = Starlette(routes=[Route("/{which:str}/metrics", self._metrics)])

    async def _metrics(self, request: Request) -> Response:
        import asyncio

        which = request.path_params["which"]
        self.hits[which] = self.hits.get(which, 0) + 1
        if self.delay_s.get(which):
            await asyncio.sleep(self.delay_s[which])
        if self.status.get(which):
            return PlainTextResponse("down", status_code=self.status[which])
        if which == "gateway" and not self.sim.gateway_enabled:
            return PlainTextResponse("not found", status_code=404)
        text = self.sim.text(which)
        if self.drop:
            text = (
                "\n".join(
                    line for line in text.splitlines() if not any(d in line for d in self.drop)
                )
                + "\n"
            )
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


class FakeClock:
    """A clock tests move by hand."""

    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


# --------------------------------------------------------------------------- Prometheus


def _binary(*names: str) -> str | None:
    for n in names:
        p = shutil.which(n)
        if p:
            return p
    return None


def need_binaries(*names: str) -> dict[str, str]:
    """Paths of the named programs; skip the test when one is missing (fail in CI)."""
    found: dict[str, str] = {}
    for group in names:
        alts = group.split("|")
        p = _binary(*alts)
        if p is None:
            msg = (
                f"{alts[0]} is not installed; run scripts/system-deps.sh "
                "(Debian packages prometheus and prometheus-alertmanager)"
            )
            if os.environ.get("CI", "").lower() == "true":
                pytest.fail(msg)
            pytest.skip(msg)
        found[alts[0]] = p
    return found


class Proc:
    """A started program in its own process group, logging to a file; killed on stop."""

    def __init__(self, argv: list[str], log: Path) -> None:
        self.log = log
        self._fh = log.open("wb")
        self.p = subprocess.Popen(
            argv, stdout=self._fh, stderr=subprocess.STDOUT, start_new_session=True
        )

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.p.pid, signal.SIGTERM)
            try:
                self.p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait(timeout=10)
        self._fh.close()


def wait_http(url: str, *, proc: Proc, timeout_s: float = 30.0) -> None:
    """Wait until `url` answers 200 (or fail with the program's log)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.p.poll() is not None:
            raise RuntimeError(f"{proc.log.name} exited {proc.p.returncode}:\n{proc.tail()}")
        try:
            if webclient.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready after {timeout_s} s:\n{proc.tail()}")
