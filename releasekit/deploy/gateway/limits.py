"""Client limits on the gateway: what one client may send and how fast.

- request headers: at most `max_header_bytes`, complete within `header_timeout_s` of the
  connection opening (or of a keep-alive request's first byte); otherwise 431 / 408 and the
  connection is closed. Enforced in the HTTP protocol (`guarded_http_protocol`), before any
  ASGI code runs, because uvicorn's httptools parser buffers header bytes without a limit;
  `header_bytes` checks the parsed headers again in the app.
- request bodies: counted while they stream in (`read_body`), chunked or not; a declared
  oversize body is refused unread.
- JSON bodies: parsed once, nesting at most `max_json_depth` (`parse_json`).
- per-key token buckets (`TokenBuckets`), and a bucket per client address for failed
  authentications, so wrong keys are throttled too (`client_address`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import time
from collections import OrderedDict
from typing import Any

from starlette.requests import Request

from releasekit.deploy.gateway.config import RateLimit


class TokenBuckets:
    """Per-key token buckets, bounded (least recently seen keys are forgotten)."""

    def __init__(self, limit: RateLimit, *, max_keys: int = 10_000) -> None:
        self.rps = limit.rps
        self.burst = float(limit.burst)
        self.max_keys = max_keys
        self._b: OrderedDict[str, list[float]] = OrderedDict()

    def _refill(self, key: str) -> list[float]:
        now = time.monotonic()
        b = self._b.get(key)
        if b is None:
            b = self._b[key] = [self.burst, now]
            if len(self._b) > self.max_keys:
                self._b.popitem(last=False)
        else:
            self._b.move_to_end(key)
            b[0] = min(self.burst, b[0] + (now - b[1]) * self.rps)
            b[1] = now
        return b

    def take(self, key: str) -> float:
        """0.0 if a token was taken, else seconds until one is available."""
        b = self._refill(key)
        if b[0] >= 1.0:
            b[0] -= 1.0
            return 0.0
        return (1.0 - b[0]) / self.rps

    def wait(self, key: str) -> float:
        """Seconds until `key` has a token (0.0: it has one now); takes nothing."""
        b = self._b.get(key)
        if b is None:
            return 0.0
        b = self._refill(key)
        return 0.0 if b[0] >= 1.0 else (1.0 - b[0]) / self.rps


def client_address(request: Request) -> str:
    """The client's address as a rate-limit key: IPv4 as is, IPv6 by its /64 (one host
    controls a whole /64, so a bucket per address would be a bucket per request)."""
    host = request.client.host if request.client else ""
    if ":" in host:
        try:
            net = ipaddress.IPv6Network((host.split("%", 1)[0], 64), strict=False)
        except ValueError:
            return host
        mapped = ipaddress.IPv6Address(host.split("%", 1)[0]).ipv4_mapped
        return str(mapped) if mapped is not None else str(net)
    return host


def header_guard(app: Any, *, max_header_bytes: int, max_header_count: int) -> Any:
    """`app` (ASGI) behind the header limits, checked on the parsed request: a header block
    over `max_header_bytes` or with more than `max_header_count` headers gets 431 and the
    connection closed (the guarded protocol refuses such a block while it arrives; this
    catches one that completed within a single read)."""

    async def guarded(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and (
            header_bytes(scope) > max_header_bytes or len(scope["headers"]) > max_header_count
        ):
            await send(
                {
                    "type": "http.response.start",
                    "status": 431,
                    "headers": [(b"content-type", b"text/plain"), (b"connection", b"close")],
                }
            )
            await send({"type": "http.response.body", "body": b"request headers too large"})
            return
        await app(scope, receive, send)

    return guarded


def header_bytes(scope: Any) -> int:
    """Bytes of a request's header block as parsed (names, values, path and query)."""
    n = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
    for k, v in scope["headers"]:
        n += len(k) + len(v) + 4
    return n


async def read_body(request: Request, limit: int) -> bytes | None:
    """The request body, or None once it is over `limit` bytes (a declared Content-Length
    over the limit is refused unread; a chunked body is counted as it arrives and never
    held past the limit)."""
    cl = request.headers.get("content-length")
    if cl is not None and cl.isdigit() and int(cl) > limit:
        return None
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > limit:
            return None
    return bytes(buf)


class JsonBodyError(ValueError):
    """A body that is not JSON, or nests deeper than the gateway allows."""


def parse_json(body: bytes, max_depth: int) -> Any:
    """`body` parsed as JSON; JsonBodyError when it is not JSON or nests deeper than
    `max_depth` arrays/objects (the parser's own recursion limit included: a body nested
    thousands deep is a 400, never a 500)."""
    try:
        obj = json.loads(body)
    except RecursionError as exc:
        raise JsonBodyError(f"JSON nests deeper than {max_depth} levels") from exc
    except ValueError as exc:
        raise JsonBodyError(f"body is not JSON: {exc}") from exc
    # Fewer brackets than the limit cannot nest past it: the common case costs two scans.
    if body.count(b"[") + body.count(b"{") > max_depth and _depth(obj) > max_depth:
        raise JsonBodyError(f"JSON nests deeper than {max_depth} levels")
    return obj


def _depth(obj: Any) -> int:
    """The deepest array/object nesting of a parsed JSON value (iterative)."""
    deepest = 0
    todo: list[tuple[Any, int]] = [(obj, 1)]
    while todo:
        o, d = todo.pop()
        if isinstance(o, dict):
            items: Any = o.values()
        elif isinstance(o, list):
            items = o
        else:
            continue
        deepest = max(deepest, d)
        todo.extend((v, d + 1) for v in items if isinstance(v, dict | list))
    return deepest


def guarded_http_protocol(
    *, max_header_bytes: int, header_timeout_s: float, max_header_count: int = 100
) -> type[asyncio.Protocol] | None:
    """uvicorn's httptools protocol with a header-size limit, a header-count limit and a
    header-read timeout, or None when httptools is not installed (uvicorn then runs h11,
    which has its own incomplete-event size limit)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # pragma: no cover - httptools ships with the stack
        return None

    def _refuse(proto: Any, status: bytes) -> None:
        t = proto.transport
        if t is None or t.is_closing():
            return
        t.write(
            b"HTTP/1.1 " + status + b"\r\ncontent-type: text/plain; charset=utf-8\r\n"
            b"content-length: 0\r\nconnection: close\r\n\r\n"
        )
        t.close()

    class GuardedHttpToolsProtocol(HttpToolsProtocol):  # type: ignore[misc]
        """Counts header bytes as they arrive and times the header block."""

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._hdr_bytes = 0
            self._hdr_count = 0
            self._hdr_done = False
            self._hdr_timer: asyncio.TimerHandle | None = None
            super().connection_made(transport)
            self._arm()

        def _arm(self) -> None:
            if self._hdr_timer is None:
                self._hdr_timer = self.loop.call_later(header_timeout_s, self._header_timeout)

        def _disarm(self) -> None:
            if self._hdr_timer is not None:
                self._hdr_timer.cancel()
                self._hdr_timer = None

        def _header_timeout(self) -> None:
            self._hdr_timer = None
            if not self._hdr_done:
                _refuse(self, b"408 Request Timeout")

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            # Counted after parsing: a message that begins in this read resets the count
            # (on_message_begin), and its bytes must still count (a whole oversize block
            # can arrive in one read).
            super().data_received(data)
            if not self._hdr_done:
                self._hdr_bytes += len(data)
            if not self._hdr_done and (
                self._hdr_bytes > max_header_bytes or self._hdr_count > max_header_count
            ):
                self._disarm()
                _refuse(self, b"431 Request Header Fields Too Large")

        def on_header(self, name: bytes, value: bytes) -> None:
            self._hdr_count += 1
            super().on_header(name, value)

        def on_message_begin(self) -> None:
            self._hdr_done = False
            self._hdr_bytes = 0
            self._hdr_count = 0
            self._arm()
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self._hdr_done = True
            self._disarm()
            super().on_headers_complete()

    return GuardedHttpToolsProtocol
