"""Gateway test helpers: a misbehaving fake upstream (a real ASGI server on loopback) and
gateways served by uvicorn in background threads, all on OS-chosen ports.

The fake upstream is steered per request by headers the gateway forwards untouched:
  x-fake-chunks: N      SSE chunks to send for `"stream": true` (default 3)
  x-fake-delay: S       seconds between chunks (default 0.01)
  x-fake-hold: NAME     after the first chunk, wait until the test calls `release(NAME)`
  x-fake-stall-after: K after K chunks, go silent (never end)
  x-fake-hang: 1        never send response headers (records "hang" in `cancelled` once the
                        gateway closes the connection)
  x-fake-pad: N         pad every SSE chunk with N bytes
  x-fake-status: CODE   non-stream answer with this status
"""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route as SRoute

from releasekit.deploy.gateway import GatewayConfig, Route, ThreadedGateway


@dataclass
class FakeUpstream:
    """A fake vLLM: records what it received, streams, fails or hangs on request."""

    name: str
    url: str = ""
    received: list[dict[str, Any]] = field(default_factory=list)
    holds: dict[str, threading.Event] = field(default_factory=dict)
    finished: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    _seq: int = 0

    def release(self, name: str) -> None:
        """Let every stream held on `name` continue."""
        self.holds.setdefault(name, threading.Event()).set()

    def next_id(self, prefix: str) -> str:
        self._seq += 1
        return f"{prefix}-{self.name}-{self._seq}"

    def app(self) -> Starlette:
        async def completions(request: Request) -> Response:
            body = await request.body()
            h = request.headers
            self.received.append(
                {
                    "path": request.url.path,
                    "headers": dict(h),
                    "body": body,
                    "query": request.url.query,
                }
            )
            if h.get("x-fake-hang"):
                for _ in range(72_000):
                    await asyncio.sleep(0.05)
                    if await request.is_disconnected():
                        self.cancelled.append("hang")
                        return Response(status_code=499)
            payload = json.loads(body) if body else {}
            chat = request.url.path.endswith("chat/completions")
            rid = self.next_id("chatcmpl" if chat else "cmpl")
            if not payload.get("stream"):
                status = int(h.get("x-fake-status", "200"))
                return JSONResponse(
                    {
                        "id": rid,
                        "object": "text_completion",
                        "upstream": self.name,
                        "choices": [{"index": 0, "text": "hello"}],
                    },
                    status_code=status,
                    headers={"x-upstream": self.name, "connection": "keep-alive"},
                )
            n = int(h.get("x-fake-chunks", "3"))
            delay = float(h.get("x-fake-delay", "0.01"))
            hold = h.get("x-fake-hold")
            stall = int(h.get("x-fake-stall-after", "-1"))
            pad = "x" * int(h.get("x-fake-pad", "0"))

            async def events() -> Any:
                try:
                    if chat:  # vLLM's first chat chunk: the role, empty content
                        yield _sse(
                            {
                                "id": rid,
                                "choices": [{"delta": {"role": "assistant", "content": ""}}],
                            }
                        )
                    for i in range(n):
                        if i == stall:
                            await asyncio.sleep(3600)
                        key = "content" if chat else "text"
                        obj: dict[str, Any] = {"id": rid, "upstream": self.name}
                        if pad:
                            obj["pad"] = pad
                        obj["choices"] = [{"delta": {key: f"t{i}"}} if chat else {key: f"t{i}"}]
                        yield _sse(obj)
                        if i == 0 and hold:
                            ev = self.holds.setdefault(hold, threading.Event())
                            while not ev.is_set():
                                await asyncio.sleep(0.005)
                        await asyncio.sleep(delay)
                    yield b"data: [DONE]\n\n"
                    self.finished.append(rid)
                except asyncio.CancelledError:
                    self.cancelled.append(rid)
                    raise

            return StreamingResponse(
                events(), media_type="text/event-stream", headers={"x-upstream": self.name}
            )

        async def models(request: Request) -> Response:
            self.received.append({"path": request.url.path, "headers": dict(request.headers)})
            return JSONResponse({"object": "list", "data": [{"id": self.name}]})

        async def anything(request: Request) -> Response:
            # vLLM serves more than the OpenAI routes (admin and dev endpoints): record any
            # such request, so a test can show none arrives.
            self.received.append({"path": request.url.path, "headers": dict(request.headers)})
            return JSONResponse({"reached": request.url.path})

        every = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
        return Starlette(
            routes=[
                SRoute("/v1/completions", completions, methods=["POST"]),
                SRoute("/v1/chat/completions", completions, methods=["POST"]),
                SRoute("/v1/models", models, methods=["GET"]),
                SRoute("/{path:path}", anything, methods=every),
            ]
        )


def wait_until(pred: Callable[[], bool], timeout_s: float = 10) -> bool:
    """Poll `pred` until it holds or `timeout_s` passes; its last answer."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


class _ServerThread:
    def __init__(self, app: Any) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        cfg = uvicorn.Config(
            app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=1
        )
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake upstream did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


@pytest.fixture
def upstream_factory() -> Iterator[Callable[[str], FakeUpstream]]:
    """`upstream_factory(name)` -> a started fake upstream (stopped after the test)."""
    started: list[tuple[FakeUpstream, _ServerThread]] = []

    def make(name: str) -> FakeUpstream:
        up = FakeUpstream(name)
        st = _ServerThread(up.app())
        st.start()
        up.url = f"http://127.0.0.1:{st.port}"
        started.append((up, st))
        return up

    yield make
    for up, st in started:
        for ev in up.holds.values():
            ev.set()
        st.stop()


@pytest.fixture
def admin_token() -> str:
    """A fresh admin token."""
    return secrets.token_urlsafe(24)


@pytest.fixture
def gateway_factory(admin_token: str) -> Iterator[Callable[..., ThreadedGateway]]:
    """`gateway_factory(routes=[...], **config)` -> a started ThreadedGateway on port 0."""
    started: list[ThreadedGateway] = []

    def make(routes: list[Route] | None = None, **overrides: Any) -> ThreadedGateway:
        cfg = GatewayConfig(
            env="test",
            port=0,
            admin_token=admin_token,
            routes=routes or [],
            shutdown_timeout_s=1,
            **overrides,
        )
        tg = ThreadedGateway(cfg).start()
        started.append(tg)
        return tg

    yield make
    for tg in started:
        tg.stop()


def refused_url() -> str:
    """An address where nothing listens (connection refused)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"


class Answering:
    """A fake model server whose answer depends on the question: `answer(question)`.
    Deterministic bodies (no ids that change), so a client's answer through the gateway
    can be compared byte for byte with the server's own."""

    def __init__(self, answer: Callable[[str], str]) -> None:
        self.answer = answer
        self.received = 0
        self.server = _ServerThread(self.app())
        self.server.start()
        self.url = f"http://127.0.0.1:{self.server.port}"

    def app(self) -> Starlette:
        async def completions(request: Request) -> Response:
            self.received += 1
            body = json.loads(await request.body())
            chat = "messages" in body
            q = body["messages"][-1]["content"] if chat else body["prompt"]
            text = self.answer(q)
            if not body.get("stream"):
                choice: dict[str, Any] = (
                    {"index": 0, "message": {"role": "assistant", "content": text}}
                    if chat
                    else {"index": 0, "text": text}
                )
                return JSONResponse({"id": "cmpl-1", "choices": [choice]})

            async def events() -> Any:
                for i in range(0, len(text), 3):
                    piece = text[i : i + 3]
                    c = {"delta": {"content": piece}} if chat else {"text": piece}
                    yield b"data: " + json.dumps({"id": "cmpl-1", "choices": [c]}).encode()
                    yield b"\n\n"
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        return Starlette(
            routes=[
                SRoute("/v1/completions", completions, methods=["POST"]),
                SRoute("/v1/chat/completions", completions, methods=["POST"]),
            ]
        )

    def stop(self) -> None:
        self.server.stop()


def truth(q: str) -> str:
    """The stable release's answers in the answer-pair tests: sums ("sum A B") and
    capitals (Paris for France, Rome otherwise)."""
    if q.startswith("sum"):
        a, b = q.split()[1:3]
        return str(int(a) + int(b))
    return "Paris" if "France" in q else "Rome"


def bad_at_sums(q: str) -> str:
    """A release wrong on one class of questions (every sum) and right on the rest."""
    return "I cannot count." if q.startswith("sum") else truth(q)


@pytest.fixture
def answering() -> Iterator[Callable[[Callable[[str], str]], Answering]]:
    """Start `Answering` servers (`answering(answer)`); every one is stopped after."""
    made: list[Answering] = []

    def make(answer: Callable[[str], str]) -> Answering:
        made.append(Answering(answer))
        return made[-1]

    yield make
    for server in made:
        server.stop()


def stubbed_gateway() -> Any:
    """The deploy state's record of a gateway nobody listens for (port 9), for canary
    controllers whose gateway client a test replaces."""
    from releasekit.deploy.state import GatewayRecord

    return GatewayRecord(
        url="http://127.0.0.1:9",
        host="127.0.0.1",
        port=9,
        pid=1,
        admin_token="t",
        config_path="-",
        log_path="-",
        started_at=0.0,
    )


def stubbed_context() -> Any:
    """A canary's `ShiftContext` with the stubbed gateway: canary `can` on its own
    server, stable `stb` live."""
    from releasekit.promote.deploy import ShiftContext

    return ShiftContext(
        env="staging",
        gateway=stubbed_gateway(),
        canary=Route(release_id="can", base_url="http://127.0.0.1:10"),
        stable=[Route(release_id="stb", base_url="http://127.0.0.1:11")],
        previous_release_id="stb",
    )


class FakeGateway:
    """A canary controller's gateway client that takes route tables and lease renewals
    and serves nothing."""

    def __init__(self) -> None:
        self.tables: list[Any] = []

    def set_routes(self, table: Any) -> Any:
        self.tables.append(table)
        return SimpleNamespace(generation=len(self.tables))

    def renew_lease(self, generation: int) -> None:
        pass

    def state(self) -> Any:
        return SimpleNamespace(served={}, in_flight={})

    def close(self) -> None:
        pass
