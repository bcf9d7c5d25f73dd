"""The relay: one pinned request's bookkeeping (`Flight`) and the response that streams an
upstream's answer to the client chunk by chunk."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable

import aiohttp
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from releasekit.deploy.gateway.admission import Admission
from releasekit.deploy.gateway.config import Route
from releasekit.deploy.gateway.responses import json_bytes

log = logging.getLogger("releasekit.gateway")

RELEASE_HEADER = "x-releasekit-release"
"""Response header naming the release that served a proxied request (`release_header`)."""
ADMIN_HEADER = "x-releasekit-admin"
"""Request header with the admin token: the answer names its release even when the
environment does not show it to clients (the deployer's smoke checks); never forwarded."""

HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
    }
)
# Request headers the gateway sets itself (or must not forward).
DROP_REQUEST = HOP_BY_HOP | {
    b"host",
    b"content-length",
    b"accept-encoding",
    b"authorization",
    ADMIN_HEADER.encode(),
}
DROP_RESPONSE = HOP_BY_HOP | {RELEASE_HEADER.encode()}
CONTENT_RE = re.compile(rb'"(?:text|content)":\s?"[^"]')
ID_RE = re.compile(rb'"id":\s?"([^"\\]{1,256})"')


# Outcomes the client caused: counted as stream errors, never as the gateway's rejections.
CLIENT_OUTCOMES = frozenset({"client_disconnect", "client_stalled"})


class DisconnectFlag:
    """Set once the client has disconnected (written by `watch_disconnect`); `armed` while
    a disconnect should cancel the request's task (the wait for the upstream's headers)."""

    __slots__ = ("armed", "set")

    def __init__(self) -> None:
        self.set = False
        self.armed = False


Remember = Callable[[str, str, str], None]
"""Notes that a release served a response id to a client: (response_id, release_id, client)."""


class Flight:
    """One pinned request: its route, clocks and metrics; `finish` runs exactly once (it
    unpins the request from `admission` and counts it)."""

    __slots__ = (
        "admission", "client", "deadline", "done", "m", "metrics", "remember", "reveal",
        "route", "route_label", "stream", "t0",
    )  # fmt: skip

    def __init__(
        self,
        admission: Admission,
        route: Route,
        route_label: str,
        t0: float,
        *,
        timeout_s: float,
        remember: Remember | None = None,
        client: str = "",
        stream: bool = False,
        reveal: bool = True,
    ) -> None:
        self.admission = admission
        self.metrics = admission.metrics
        self.remember = remember
        self.route = route
        self.route_label = route_label
        self.t0 = t0
        self.client = client
        self.stream = stream
        self.deadline = time.monotonic() + timeout_s
        self.m = self.metrics.release(route.release_id)
        self.reveal = reveal
        self.done = False

    def release_header(self) -> dict[str, str]:
        """The x-releasekit-release header for this request's answer ({} when hidden)."""
        return {RELEASE_HEADER: self.route.release_id} if self.reveal else {}

    def finish(
        self,
        status: int,
        *,
        got_response: bool,
        chunks: int = 0,
        outcome: str | None = None,
        label: str | None = None,
    ) -> None:
        """Unpin and count the request: `status` is what the client got; `label` replaces
        it in the requests metric when the outcome was the client's (`client_timeout`)."""
        if self.done:
            return
        self.done = True
        metrics = self.metrics
        rid = self.route.release_id
        self.admission.unpin(rid, self.m)
        self.admission.release_client(self.client)
        metrics.request(rid, self.route_label, label or status)
        if got_response:
            self.m.e2e.observe(time.perf_counter() - self.t0)
        if chunks:
            self.m.chunks.inc(chunks)
        if outcome is not None:
            metrics.stream_errors.labels(metrics.env, rid, outcome).inc()
            if outcome not in CLIENT_OUTCOMES:
                metrics.reject(outcome)


async def watch_disconnect(receive: Receive, flag: DisconnectFlag) -> None:
    """Read the client's ASGI messages until it disconnects, then set `flag`."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            flag.set = True
            return


class Relay(Response):
    """Relays an upstream response: headers once, then each upstream read as it comes.

    A gap over `idle_s` ends it, whether the upstream stopped sending (`timeout`) or the
    client stopped reading (`client_stalled`: its socket buffer is full and the write
    waits); a client that disconnects ends it at the next chunk (`client_disconnect`)."""

    def __init__(
        self,
        flight: Flight,
        upstream: aiohttp.ClientResponse,
        *,
        capture_id: bool,
        watcher: asyncio.Future[None] | None = None,
        flag: DisconnectFlag | None = None,
        idle_s: float = 60.0,
    ) -> None:
        self.flight = flight
        self.upstream = upstream
        self.status_code = upstream.status
        self.background = None
        self.capture_id = capture_id and 200 <= upstream.status < 300
        self.sse = upstream.content_type == "text/event-stream"
        self.watcher = watcher
        self.flag = flag
        self.idle_s = idle_s
        raw = [(k.lower(), v) for k, v in upstream.raw_headers]
        raw = [(k, v) for k, v in raw if k not in DROP_RESPONSE]
        if flight.reveal:
            raw.append((RELEASE_HEADER.encode(), flight.route.release_id.encode()))
        self.raw_headers = raw

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        flight = self.flight
        upstream = self.upstream
        sse = self.sse
        need_ttft = sse
        remember = flight.remember
        need_id = self.capture_id and remember is not None
        deadline = flight.deadline
        chunks = 0
        outcome: str | None = None
        completed = False
        flag = self.flag
        watcher = self.watcher
        if flag is None:
            flag = DisconnectFlag()
            watcher = asyncio.ensure_future(watch_disconnect(receive, flag))
        loop = asyncio.get_running_loop()
        idle = self.idle_s
        sending = False
        try:
            try:
                async with asyncio.timeout_at(loop.time() + idle) as writing:
                    start = {"type": "http.response.start", "status": self.status_code}
                    sending = True
                    await send({**start, "headers": self.raw_headers})
                    sending = False
                    writing.reschedule(None)
                    async for chunk in upstream.content.iter_any():
                        if need_ttft and CONTENT_RE.search(chunk):
                            flight.m.ttft.observe(time.perf_counter() - flight.t0)
                            need_ttft = False
                        if need_id:
                            need_id = False
                            found = ID_RE.search(chunk)
                            if found and remember is not None:
                                remember(
                                    found.group(1).decode(), flight.route.release_id, flight.client
                                )
                        chunks += 1
                        # The write waits only while the client's socket is full: a client
                        # that stops reading is cut after idle_s, like a silent upstream.
                        sending = True
                        writing.reschedule(loop.time() + idle)
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                        writing.reschedule(None)
                        sending = False
                        if flag.set:
                            outcome = "client_disconnect"
                            break
                        if time.monotonic() > deadline:
                            outcome = "timeout"
                            break
            except TimeoutError:
                outcome = "client_stalled" if sending else "timeout"
            except (aiohttp.ClientError, OSError) as exc:
                log.warning("upstream %s broke mid-response: %r", flight.route.base_url, exc)
                outcome = "upstream_error"
            if outcome == "client_stalled":
                # Writing more would wait again; returning unfinished closes the connection.
                return
            if outcome in ("timeout", "upstream_error") and sse:
                msg = (
                    "upstream timed out mid-stream"
                    if outcome == "timeout"
                    else "upstream connection broke mid-stream"
                )
                err = {"message": msg, "type": "server_error", "param": None, "code": outcome}
                event = b"data: " + json_bytes({"error": err}) + b"\n\n"
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            completed = True
        finally:
            if watcher is not None:
                watcher.cancel()
            if completed and outcome is None:
                upstream.release()  # fully read: the connection goes back to the pool
            else:
                upstream.close()  # cut: close the connection (vLLM aborts the request)
            flight.finish(
                self.status_code, got_response=True, chunks=chunks if sse else 0, outcome=outcome
            )
