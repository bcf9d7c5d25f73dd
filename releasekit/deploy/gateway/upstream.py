"""The upstream side: the shared connection pool, the headers an upstream gets, a pinned
request sent and its answer relayed, and the copy of it sent to the mirror."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Any

import aiohttp
from starlette.requests import Request
from starlette.responses import Response

from releasekit.deploy.gateway.checks import ClientChecks
from releasekit.deploy.gateway.config import GatewayConfig, Route
from releasekit.deploy.gateway.errors import PromptTemplateError
from releasekit.deploy.gateway.mirror import Mirroring, PairedRelay, PendingPair
from releasekit.deploy.gateway.relay import (
    DROP_REQUEST,
    DisconnectFlag,
    Flight,
    Relay,
    watch_disconnect,
)
from releasekit.deploy.gateway.responses import error_response
from releasekit.deploy.gateway.templates import plain_body, templated_body

log = logging.getLogger("releasekit.gateway")


class Upstream:
    """The gateway's one upstream connection pool (`open` on startup, `close` on shutdown)
    and the requests that go through it; refusals are counted through `checks`."""

    def __init__(self, config: GatewayConfig, checks: ClientChecks) -> None:
        self.config = config
        self.checks = checks
        c = config.upstream_connect_timeout_s
        first = min(config.upstream_first_byte_timeout_s, config.request_timeout_s)
        # sock_read bounds every wait for upstream bytes: the response headers first, then
        # (switched after the headers, see send) each gap between body chunks.
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=c, sock_connect=c, sock_read=first
        )
        self._idle_s = config.stream_idle_timeout_s
        self.session: aiohttp.ClientSession | None = None

    def open(self) -> None:
        """Open the shared upstream connection pool, on the event loop (more connections
        than in-flight slots, so an admitted request never waits for one)."""
        connector = aiohttp.TCPConnector(
            limit=self.config.max_in_flight + 16,
            limit_per_host=0,
            keepalive_timeout=30.0,
            enable_cleanup_closed=False,
        )
        self.session = aiohttp.ClientSession(
            connector=connector,
            timeout=self._timeout,
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            trust_env=False,
        )

    async def close(self) -> None:
        """Close the upstream connection pool."""
        if self.session is not None:
            await self.session.close()
            self.session = None

    def headers(self, request: Request, route: Route) -> list[tuple[str, str]]:
        """The headers `route`'s upstream gets: the client's, less hop-by-hop ones and those
        the gateway sets itself; the route's own key, else the client's when the gateway
        checks none."""
        out = [
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in request.scope["headers"]
            if k not in DROP_REQUEST
        ]
        out.append(("accept-encoding", "identity"))
        if route.api_key is not None:
            out.append(("authorization", "Bearer " + route.api_key))
        elif not self.checks.checks_keys:
            auth = request.headers.get("authorization")
            if auth is not None:
                out.append(("authorization", auth))
        return out

    def copy(
        self,
        mirror: Mirroring | None,
        request: Request,
        *,
        path: str,
        body: bytes,
        payload: Any,
        prompt: str | None,
        route_label: str,
        pinned: Route,
        client: str = "",
    ) -> PendingPair | None:
        """Copy the request to the mirror when it takes this one; a copy that fails to go
        out is dropped, never the client's request. `pinned`: the route the client's request
        went to (only a request of the mirror route's own lane is copied); `client`: the
        client as `checks.client_denied` names it (the pair keeps a digest). Answers the
        pair the client's answer goes into (None: no copy, or no pairs kept)."""
        stable_id = pinned.release_id
        if mirror is None or self.session is None or not mirror.copies(pinned) or not mirror.take():
            return None
        try:
            return mirror.copy(
                self.session,
                method=request.method,
                path=path,
                query=request.scope["query_string"],
                headers=self.headers(request, mirror.route),
                body=body,
                payload=payload,
                prompt=prompt,
                route_label=route_label,
                stable_id=stable_id,
                pinned=pinned,
                client=client,
            )
        except Exception:
            log.exception("shadow copy to %s not sent", mirror.route.release_id)
            mirror.drop()
            return None

    async def send(
        self,
        request: Request,
        flight: Flight,
        *,
        path: str,
        body: bytes,
        payload: Any,
        prompt: str | None,
        pair: PendingPair | None = None,
    ) -> Response:
        """Send the pinned request `flight` upstream (rendering the route's template
        `prompt` first; an adapter's model name mapped to the engine's) and answer the
        relay of its response, or the error answer (400 for a template, 504 for a timeout,
        502 for a broken upstream, 499 when the client left); every path finishes the
        flight once. With `pair`, the client's answer also goes into that answer pair."""
        route = flight.route
        rel_header = flight.release_header()
        try:
            if prompt is not None:
                body = templated_body(route, prompt, payload)
            else:
                body = plain_body(route, body, payload)
        except PromptTemplateError as exc:
            flight.finish(400, got_response=False)
            return self.checks.reject(
                "bad_request",
                400,
                exc.message,
                type_="invalid_request_error",
                code="bad_template",
                headers=rel_header,
            )
        session = self.session
        if session is None:  # pragma: no cover - lifespan not run
            flight.finish(503, got_response=False)
            return error_response(503, "gateway starting", type_="server_error", code="starting")
        qs = request.scope["query_string"]
        url = route.base_url + path + ("?" + qs.decode("latin-1") if qs else "")
        # Watch the client while the upstream works: a client that goes away cancels the
        # upstream request (its connection is closed, so vLLM aborts the generation).
        flag = DisconnectFlag()
        watcher = asyncio.ensure_future(watch_disconnect(request.receive, flag))
        task = asyncio.current_task()

        def gone(_: object) -> None:
            if flag.set and flag.armed and task is not None:
                task.cancel()

        watcher.add_done_callback(gone)
        flag.armed = True
        try:
            headers = self.headers(request, route)
            flight.m.overhead.observe(time.perf_counter() - flight.t0)
            upstream = await session.request(
                request.method, url, headers=headers, data=body or None, allow_redirects=False
            )
        except asyncio.CancelledError:
            flag.armed = False
            watcher.cancel()
            if flag.set and task is not None and task.uncancel() == 0:
                flight.finish(499, got_response=False, outcome="client_disconnect")
                return Response(status_code=499)
            raise
        except TimeoutError as exc:
            flag.armed = False
            watcher.cancel()
            if flight.stream:
                flight.finish(504, got_response=False)
                reason = "timeout"
            else:
                # A non-stream answer's first byte comes after the whole generation, whose
                # length the client chose: the client's outcome, not the server's.
                flight.finish(504, got_response=False, label="client_timeout")
                reason = "client_timeout"
            return self.checks.reject(
                reason,
                504,
                f"upstream {route.release_id} timed out ({type(exc).__name__})",
                type_="server_error",
                code="upstream_timeout",
                headers=rel_header,
            )
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            flag.armed = False
            watcher.cancel()
            flight.finish(502, got_response=False)
            log.warning("upstream %s failed: %r", route.base_url, exc)
            return self.checks.reject(
                "upstream_error",
                502,
                f"upstream {route.release_id} failed: {type(exc).__name__}",
                type_="server_error",
                code="upstream_error",
                headers=rel_header,
            )
        except BaseException:
            flag.armed = False
            watcher.cancel()
            raise
        flag.armed = False
        flight.m.upstream_wait.observe(time.perf_counter() - flight.t0)
        conn = upstream.connection
        if conn is not None and conn.protocol is not None:
            # From the next body chunk on, a gap over stream_idle_timeout_s is a stall.
            conn.protocol.read_timeout = self._idle_s
        relay = Relay if pair is None else functools.partial(PairedRelay, pair=pair)
        return relay(
            flight,
            upstream,
            capture_id=request.method == "POST",
            watcher=watcher,
            flag=flag,
            idle_s=self._idle_s,
        )
