"""The gateway's state and its ASGI app: admission, routing, the admin API, feedback."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import math
import os
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import aiohttp
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from prometheus_client import generate_latest as _generate_latest
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route as _StarletteRoute
from starlette.types import ASGIApp, Receive, Scope, Send

from releasekit.deploy.gateway.config import (
    DrainRequest,
    DrainResult,
    Feedback,
    GatewayConfig,
    GatewayState,
    Route,
    RouteState,
    RouteTable,
    validation_problems,
)
from releasekit.deploy.gateway.errors import GatewayRequestError, PromptTemplateError
from releasekit.deploy.gateway.limits import TokenBuckets
from releasekit.deploy.gateway.metrics import Metrics, ReleaseMetrics, endpoint_label
from releasekit.deploy.gateway.relay import DROP_REQUEST, RELEASE_HEADER, Flight, Relay
from releasekit.deploy.gateway.responses import error_response, json_response
from releasekit.deploy.gateway.routing import Table
from releasekit.deploy.gateway.templates import templated_body

log = logging.getLogger("releasekit.gateway")


_Body = TypeVar("_Body", bound=BaseModel)


async def admin_body(
    request: Request, model: type[_Body], *, what: str, code: str
) -> _Body | Response:
    """An admin request's JSON body as `model`, or the 422 answer listing every problem."""
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as exc:
        problems = validation_problems(exc)
        return error_response(
            422,
            f"invalid {what}: " + "; ".join(problems),
            type_="invalid_request_error",
            code=code,
            extra={"problems": problems},
        )


def bearer_token(request: Request) -> bytes | None:
    h = request.headers.get("authorization")
    if h is None or len(h) < 8 or h[:7].lower() != "bearer ":
        return None
    return h[7:].strip().encode()


class Gateway:
    """The gateway's state and ASGI app; `app()` builds the ASGI application.

    One instance serves one environment. Methods run on the event loop thread; `set_routes`
    may also be called before the server starts.
    """

    def __init__(
        self,
        config: GatewayConfig,
        *,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.config = config
        self.registry = registry if registry is not None else CollectorRegistry()
        self._metrics = Metrics(self.registry, config.env)
        self._table = Table(0, ())
        self._in_flight: dict[str, int] = {}
        self._served: dict[str, int] = {}
        self._idle: dict[str, asyncio.Event] = {}
        self._queued = 0
        self._in_flight_total = 0
        self._sem = asyncio.Semaphore(config.max_in_flight)
        self._session: aiohttp.ClientSession | None = None
        self._buckets = TokenBuckets(config.rate_limit) if config.rate_limit else None
        self._responses: OrderedDict[str, list[Any]] = OrderedDict()
        self._api_keys = [k.encode() for k in config.api_keys]
        self._admin_token = config.admin_token.encode()
        c = config.upstream_connect_timeout_s
        first = min(config.upstream_first_byte_timeout_s, config.request_timeout_s)
        # sock_read bounds every wait for upstream bytes: the response headers first, then
        # (switched after the headers, see _forward) each gap between body chunks.
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=c, sock_connect=c, sock_read=first
        )
        self._idle_s = config.stream_idle_timeout_s
        self._retry_queue = str(max(1, math.ceil(config.max_queue_wait_s)))
        self.started_at = time.time()
        self.set_routes(RouteTable(routes=config.routes))

    # -- routing table

    def set_routes(self, table: RouteTable) -> GatewayState:
        """Swap the routing table (one reference assignment); answers the new state."""
        new = Table(self._table.generation + 1, table.routes)
        self._table = new
        self._metrics.set_routes(new)
        self._metrics.switches.inc()
        return self.state()

    def state(self) -> GatewayState:
        """Routes, in-flight and served counts now."""
        t = self._table
        return GatewayState(
            env=self.config.env,
            generation=t.generation,
            routes=[
                RouteState(
                    release_id=r.release_id,
                    base_url=r.base_url,
                    weight=r.weight,
                    share=t.share(r),
                    model=r.model,
                    prompts=sorted(r.prompts),
                    has_api_key=r.api_key is not None,
                )
                for r in t.routes
            ],
            in_flight=dict(self._in_flight),
            served=dict(self._served),
            in_flight_total=self._in_flight_total,
            queued=self._queued,
            max_in_flight=self.config.max_in_flight,
            pid=os.getpid(),
            started_at=self.started_at,
        )

    async def drain(self, release_id: str, timeout_s: float) -> DrainResult:
        """Wait up to `timeout_s` until no request pinned to `release_id` is in flight.

        Raises GatewayRequestError (409) if the release still gets new traffic.
        """
        if self._table.routed(release_id):
            raise GatewayRequestError(
                f"release {release_id} still carries traffic; switch the routes first",
                status=409,
            )
        t = time.monotonic()
        if self._in_flight.get(release_id, 0) > 0:
            ev = self._idle.get(release_id)
            if ev is None:
                ev = self._idle[release_id] = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await ev.wait()
        n = self._in_flight.get(release_id, 0)
        return DrainResult(
            release_id=release_id, drained=n == 0, in_flight=n, waited_s=time.monotonic() - t
        )

    def _pin(self, rid: str, m: ReleaseMetrics) -> None:
        self._in_flight[rid] = self._in_flight.get(rid, 0) + 1
        self._in_flight_total += 1
        m.in_flight.inc()

    def _unpin(self, rid: str, m: ReleaseMetrics) -> None:
        n = self._in_flight[rid] - 1
        self._in_flight[rid] = n
        self._in_flight_total -= 1
        self._served[rid] = self._served.get(rid, 0) + 1
        m.in_flight.dec()
        self._sem.release()
        if n == 0:
            ev = self._idle.pop(rid, None)
            if ev is not None:
                ev.set()

    def _remember(self, response_id: str, release_id: str) -> None:
        r = self._responses
        r[response_id] = [release_id, False]
        if len(r) > self.config.feedback_capacity:
            r.popitem(last=False)

    # -- lifecycle

    async def startup(self) -> None:
        """Open the shared upstream connection pool (more connections than in-flight
        slots, so an admitted request never waits for one)."""
        connector = aiohttp.TCPConnector(
            limit=self.config.max_in_flight + 16,
            limit_per_host=0,
            keepalive_timeout=30.0,
            enable_cleanup_closed=False,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=self._timeout,
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            trust_env=False,
        )

    async def shutdown(self) -> None:
        """Close the upstream connection pool."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    def app(self) -> ASGIApp:
        """The ASGI application: plain `/v1/*` proxying on a direct path (it is the hot
        path: no router or middleware per chunk), everything else through Starlette's router
        (whose lifespan opens and closes the upstream pool)."""
        starlette = self._starlette()
        proxy = self._proxy

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == "http":
                path = scope["path"]
                if (
                    path.startswith("/v1/")
                    and path != "/v1/feedback"
                    and not path.startswith("/v1/templates/")
                ):
                    response = await proxy(Request(scope, receive))
                    await response(scope, receive, send)
                    return
            await starlette(scope, receive, send)

        return app

    def _starlette(self) -> Starlette:

        @contextlib.asynccontextmanager
        async def lifespan(app: Starlette) -> AsyncIterator[None]:
            await self.startup()
            try:
                yield
            finally:
                await self.shutdown()

        every = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
        routes = [
            _StarletteRoute("/health", self._health, methods=["GET", "HEAD"]),
            _StarletteRoute("/metrics", self._metrics_text, methods=["GET"]),
            _StarletteRoute("/admin/state", self._admin_state, methods=["GET"]),
            _StarletteRoute("/admin/routes", self._admin_routes, methods=["PUT"]),
            _StarletteRoute("/admin/drain", self._admin_drain, methods=["POST"]),
            _StarletteRoute("/v1/feedback", self._feedback, methods=["POST"]),
            _StarletteRoute(
                "/v1/templates/{prompt}/chat/completions", self._templated, methods=["POST"]
            ),
            _StarletteRoute("/v1/{path:path}", self._proxy, methods=every),
        ]
        return Starlette(routes=routes, lifespan=lifespan)

    # -- open endpoints

    async def _health(self, request: Request) -> Response:
        live = sum(1 for r in self._table.routes if r.weight > 0)
        body = {"status": "ok" if live else "no_routes", "env": self.config.env, "routes": live}
        return json_response(body, 200 if live else 503)

    async def _metrics_text(self, request: Request) -> Response:
        return Response(_generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    # -- admin

    def _admin_denied(self, request: Request) -> Response | None:
        token = bearer_token(request)
        if token is not None and hmac.compare_digest(token, self._admin_token):
            return None
        return error_response(
            401,
            "admin token missing or wrong",
            type_="invalid_request_error",
            code="invalid_admin_token",
            headers={"www-authenticate": "Bearer"},
        )

    async def _admin_state(self, request: Request) -> Response:
        return self._admin_denied(request) or json_response(self.state())

    async def _admin_routes(self, request: Request) -> Response:
        denied = self._admin_denied(request)
        if denied:
            return denied
        table = await admin_body(request, RouteTable, what="route table", code="invalid_routes")
        if isinstance(table, Response):
            return table
        return json_response(self.set_routes(table))

    async def _admin_drain(self, request: Request) -> Response:
        denied = self._admin_denied(request)
        if denied:
            return denied
        req = await admin_body(request, DrainRequest, what="drain request", code="invalid_drain")
        if isinstance(req, Response):
            return req
        try:
            return json_response(await self.drain(req.release_id, req.timeout_s))
        except GatewayRequestError as exc:
            return error_response(
                exc.status, exc.message, type_="invalid_request_error", code="routed"
            )

    # -- client endpoints

    def _client_denied(self, request: Request) -> Response | None:
        """Auth, then the per-key token bucket; None when the request may proceed."""
        key: str
        if self._api_keys:
            token = bearer_token(request)
            ok = False
            if token is not None:
                for k in self._api_keys:  # no early exit: time does not tell which key
                    ok |= hmac.compare_digest(token, k)
            if not ok:
                self._metrics.reject("auth")
                return error_response(
                    401,
                    "missing API key" if token is None else "incorrect API key provided",
                    type_="invalid_request_error",
                    code="invalid_api_key",
                    headers={"www-authenticate": "Bearer"},
                )
            key = token.decode(errors="replace") if token is not None else ""
        else:
            key = request.client.host if request.client else ""
        if self._buckets is not None:
            wait = self._buckets.take(key)
            if wait > 0:
                self._metrics.reject("rate_limit")
                return error_response(
                    429,
                    "rate limit exceeded",
                    type_="rate_limit_error",
                    code="rate_limit_exceeded",
                    headers={"retry-after": str(max(1, math.ceil(wait)))},
                )
        return None

    async def _body(self, request: Request) -> bytes | Response:
        limit = self.config.max_request_bytes
        cl = request.headers.get("content-length")
        if cl is not None and cl.isdigit() and int(cl) > limit:
            body = None
        else:
            body = await request.body()
            if len(body) <= limit:
                return body
        self._metrics.reject("bad_request")
        return error_response(
            413, f"request body over {limit} bytes", type_="invalid_request_error", code="too_large"
        )

    async def _admit(self) -> Response | None:
        """Take an in-flight slot, waiting up to max_queue_wait_s; 503 past that."""
        sem = self._sem
        m = self._metrics
        if not sem.locked():
            await sem.acquire()
            m.queue_wait.observe(0.0)
            return None
        t = time.perf_counter()
        self._queued += 1
        m.queue_depth.inc()
        try:
            async with asyncio.timeout(self.config.max_queue_wait_s):
                await sem.acquire()
        except TimeoutError:
            m.queue_wait.observe(time.perf_counter() - t)
            m.reject("queue_full")
            return error_response(
                503,
                f"gateway busy: no slot within {self.config.max_queue_wait_s:g} s",
                type_="server_error",
                code="queue_full",
                headers={"retry-after": self._retry_queue},
            )
        finally:
            self._queued -= 1
            m.queue_depth.dec()
        m.queue_wait.observe(time.perf_counter() - t)
        return None

    async def _proxy(self, request: Request) -> Response:
        t0 = time.perf_counter()
        denied = self._client_denied(request)
        if denied:
            return denied
        body = await self._body(request)
        if isinstance(body, Response):
            return body
        path = request.scope["path"]
        return await self._forward(
            request, t0, path=path, body=body, route_label=endpoint_label(path), prompt=None
        )

    async def _templated(self, request: Request) -> Response:
        t0 = time.perf_counter()
        denied = self._client_denied(request)
        if denied:
            return denied
        body = await self._body(request)
        if isinstance(body, Response):
            return body
        return await self._forward(
            request,
            t0,
            path="/v1/chat/completions",
            body=body,
            route_label="templates",
            prompt=request.path_params["prompt"],
        )

    def _upstream_headers(self, request: Request, route: Route) -> list[tuple[str, str]]:
        out = [
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in request.scope["headers"]
            if k not in DROP_REQUEST
        ]
        out.append(("accept-encoding", "identity"))
        if route.api_key is not None:
            out.append(("authorization", "Bearer " + route.api_key))
        elif not self._api_keys:
            auth = request.headers.get("authorization")
            if auth is not None:
                out.append(("authorization", auth))
        return out

    async def _forward(
        self,
        request: Request,
        t0: float,
        *,
        path: str,
        body: bytes,
        route_label: str,
        prompt: str | None,
    ) -> Response:
        busy = await self._admit()
        if busy is not None:
            return busy
        # Pin and count in the same step (no await in between): a drain that sees 0 in
        # flight for a release no longer routed can trust it stays 0.
        route = self._table.pick()
        if route is None:
            self._sem.release()
            self._metrics.reject("no_route")
            return error_response(
                503,
                "no release is routed",
                type_="server_error",
                code="no_route",
                headers={"retry-after": "1"},
            )
        flight = Flight(self, route, route_label, t0)
        self._pin(route.release_id, flight.m)
        rel_header = {RELEASE_HEADER: route.release_id}
        try:
            if prompt is not None:
                body = templated_body(route, prompt, body)
        except PromptTemplateError as exc:
            flight.finish(400, got_response=False)
            self._metrics.reject("bad_request")
            return error_response(
                400,
                exc.message,
                type_="invalid_request_error",
                code="bad_template",
                headers=rel_header,
            )
        session = self._session
        if session is None:  # pragma: no cover - lifespan not run
            flight.finish(503, got_response=False)
            return error_response(503, "gateway starting", type_="server_error", code="starting")
        qs = request.scope["query_string"]
        url = route.base_url + path + ("?" + qs.decode("latin-1") if qs else "")
        try:
            headers = self._upstream_headers(request, route)
            flight.m.overhead.observe(time.perf_counter() - t0)
            upstream = await session.request(
                request.method, url, headers=headers, data=body or None, allow_redirects=False
            )
        except TimeoutError as exc:
            flight.finish(504, got_response=False)
            self._metrics.reject("timeout")
            return error_response(
                504,
                f"upstream {route.release_id} timed out ({type(exc).__name__})",
                type_="server_error",
                code="upstream_timeout",
                headers=rel_header,
            )
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            flight.finish(502, got_response=False)
            self._metrics.reject("upstream_error")
            log.warning("upstream %s failed: %r", route.base_url, exc)
            return error_response(
                502,
                f"upstream {route.release_id} failed: {type(exc).__name__}",
                type_="server_error",
                code="upstream_error",
                headers=rel_header,
            )
        except BaseException:
            flight.finish(499, got_response=False)
            raise
        flight.m.upstream_wait.observe(time.perf_counter() - t0)
        conn = upstream.connection
        if conn is not None and conn.protocol is not None:
            # From the next body chunk on, a gap over stream_idle_timeout_s is a stall.
            conn.protocol.read_timeout = self._idle_s
        return Relay(flight, upstream, capture_id=request.method == "POST")

    async def _feedback(self, request: Request) -> Response:
        denied = self._client_denied(request)
        if denied:
            return denied
        body = await self._body(request)
        if isinstance(body, Response):
            return body
        try:
            fb = Feedback.model_validate_json(body)
        except ValidationError as exc:
            return error_response(
                400,
                "invalid feedback: " + "; ".join(validation_problems(exc)),
                type_="invalid_request_error",
                code="bad_feedback",
            )
        if isinstance(fb.score, str):
            score = 1.0 if fb.score == "up" else -1.0
        else:
            score = float(fb.score)
        if not -1.0 <= score <= 1.0:
            return error_response(
                400,
                f"invalid feedback: score {score:g} is outside [-1, 1]",
                type_="invalid_request_error",
                code="bad_feedback",
            )
        seen = self._responses.get(fb.response_id)
        if seen is None:
            return error_response(
                404,
                f"unknown response id {fb.response_id!r} (or too old)",
                type_="invalid_request_error",
                code="unknown_response",
            )
        release_id, already = seen
        label = "positive" if score > 0 else "negative" if score < 0 else "neutral"
        if not already:
            seen[1] = True
            self._metrics.feedback.labels(self.config.env, release_id, label).inc()
        return json_response(
            {
                "response_id": fb.response_id,
                "release_id": release_id,
                "score": score,
                "label": label,
                "counted": not already,
            }
        )
