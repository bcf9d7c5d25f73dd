"""The gateway's state and its ASGI app: admission, routing, leases and mirroring; the admin
API is `admin`, feedback `feedback`."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import hmac
import logging
import math
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, ProcessCollector
from prometheus_client import generate_latest as _generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route as _StarletteRoute
from starlette.types import ASGIApp, Receive, Scope, Send

from releasekit.deploy.gateway.admin import AdminAPI, bearer_token
from releasekit.deploy.gateway.config import (
    DrainResult,
    GatewayConfig,
    GatewayState,
    Mirror,
    Route,
    RouteState,
    RouteTable,
)
from releasekit.deploy.gateway.errors import GatewayRequestError, PromptTemplateError
from releasekit.deploy.gateway.feedback import FeedbackBook
from releasekit.deploy.gateway.lease import Lease
from releasekit.deploy.gateway.limits import (
    JsonBodyError,
    TokenBuckets,
    client_address,
    header_bytes,
    parse_json,
    read_body,
)
from releasekit.deploy.gateway.metrics import Metrics, ReleaseMetrics, endpoint_label
from releasekit.deploy.gateway.mirror import Mirroring, MirrorPairs, PairedRelay, PendingPair
from releasekit.deploy.gateway.pairstore import PairStore
from releasekit.deploy.gateway.relay import (
    ADMIN_HEADER,
    DROP_REQUEST,
    DisconnectFlag,
    Flight,
    Relay,
    watch_disconnect,
)
from releasekit.deploy.gateway.responses import error_response, json_response
from releasekit.deploy.gateway.routing import UPSTREAM_ROUTES, Table
from releasekit.deploy.gateway.templates import templated_body

log = logging.getLogger("releasekit.gateway")


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
        if registry is None:
            registry = CollectorRegistry()
            # process_cpu_seconds_total, process_resident_memory_bytes, ... (Linux /proc)
            ProcessCollector(registry=registry)
        self.registry = registry
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
        self._auth_failures = TokenBuckets(config.auth_failure_limit)
        self.feedback = FeedbackBook(self, config.feedback_capacity)
        self.admin = AdminAPI(self, config.admin_token)
        self._lease: Lease | None = None
        self._lease_expiries = 0
        self._lease_task: asyncio.Task[None] | None = None
        self._mirror: Mirroring | None = None
        self._pair_store: PairStore | None = None
        self._api_keys = [k.encode() for k in config.api_keys]
        self._admin_token = config.admin_token.encode()
        self._client_cap = config.max_in_flight_per_client
        self._per_client: dict[str, int] = {}
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
        self.set_routes(RouteTable(routes=config.routes, mirror=config.mirror))

    # -- routing table

    @property
    def metrics(self) -> Metrics:
        """The gateway's metric families."""
        return self._metrics

    def set_routes(self, table: RouteTable) -> GatewayState:
        """Swap the routing table (one reference assignment); answers the new state. A
        leased table (`lease_s`) reverts to its fallback unless renewed; the table's
        `mirror` replaces the one in force (copies in flight finish)."""
        new = Table(self._table.generation + 1, table.routes)
        self._table = new
        self._lease = (
            Lease(new.generation, table.lease_s, table.fallback)
            if table.lease_s is not None
            else None
        )
        if table.mirror is None:
            self._mirror = None
            if self._pair_store is not None:
                self._pair_store.close()  # its writer finishes what is queued
        elif self._mirror is None or self._mirror.mirror != table.mirror:
            self._mirror = Mirroring(
                table.mirror,
                self._metrics,
                self.config.request_timeout_s,
                store=self._store_for(table.mirror),
            )
        self._metrics.set_routes(new)
        self._metrics.switches.inc()
        return self.state()

    def _store_for(self, mirror: Mirror) -> PairStore | None:
        """The disk copy of `mirror`'s pairs (None without `pairs_dir` or when no pairs are
        kept): the store in use when it is the same candidate's (its numbering goes on),
        else a new one, after the previous store's writer."""
        old = self._pair_store
        if self.config.pairs_dir is None or mirror.pairs <= 0:
            return None
        cap = int(mirror.pairs_segment_mib * 2**20)
        rid = mirror.route.release_id
        if old is not None and old.release_id == rid and not old.closing:
            old.segment_bytes = cap
            return old
        if old is not None:
            old.close()
        self._pair_store = PairStore(Path(self.config.pairs_dir), rid, segment_bytes=cap, after=old)
        return self._pair_store

    def renew_lease(self, generation: int) -> bool:
        """Extend the leased table of `generation`; False when it is not in force."""
        self.check_lease()
        lease = self._lease
        return lease is not None and lease.renew(generation)

    def check_lease(self) -> None:
        """Revert an expired leased table to its fallback (keeping the mirror, except a
        canary's)."""
        lease = self._lease
        if lease is None or not lease.expired():
            return
        mirror = self._mirror.mirror if self._mirror is not None else None
        if mirror is not None and mirror.purpose == "canary":
            mirror = None  # back on stable: there is no canary left to pair
        log.warning(
            "leased route table %d not renewed within %g s: back to %s",
            lease.generation,
            lease.lease_s,
            ", ".join(r.release_id[:12] for r in lease.fallback),
        )
        self._lease_expiries += 1
        self._metrics.lease_expiries.inc()
        self.set_routes(RouteTable(routes=list(lease.fallback), mirror=mirror))

    async def _watch_lease(self) -> None:
        while True:
            lease = self._lease
            await asyncio.sleep(min(0.1, lease.left() if lease else 0.1) or 0.01)
            self.check_lease()

    def state(self) -> GatewayState:
        """Routes, in-flight and served counts now."""
        t = self._table
        store = self._mirror.pairs.store if self._mirror else None
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
            lease_left_s=self._lease.left() if self._lease else None,
            fallback=[r.release_id for r in self._lease.fallback] if self._lease else [],
            lease_expiries=self._lease_expiries,
            mirror=self._mirror.route.release_id if self._mirror else None,
            mirror_share=self._mirror.mirror.share if self._mirror else 0.0,
            mirrored=self._mirror.sent if self._mirror else 0,
            mirror_dropped=self._mirror.dropped if self._mirror else 0,
            mirror_pairs=self._mirror.pairs.recorded if self._mirror else 0,
            mirror_pairs_kept=self._mirror.pairs.kept if self._mirror else 0,
            mirror_purpose=self._mirror.mirror.purpose if self._mirror else None,
            mirror_source=self._mirror.mirror.source if self._mirror else None,
            mirror_until=self._mirror.mirror.until if self._mirror else None,
            mirror_pairs_stored=store.written if store else 0,
            mirror_pairs_store_failed=store.failed if store else 0,
        )

    def mirror_pairs(self, since: int, limit: int) -> MirrorPairs:
        """The mirror's answer pairs held with seq > `since` (oldest first, at most `limit`)."""
        m = self._mirror
        if m is None:
            return MirrorPairs(release_id=None)
        book = m.pairs
        return MirrorPairs(
            release_id=m.route.release_id,
            recorded=book.recorded,
            kept=book.kept,
            capacity=book.capacity,
            keep_prompts=book.keep_prompts,
            purpose=m.mirror.purpose,
            pairs=book.since(since, limit),
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
        self._lease_task = asyncio.ensure_future(self._watch_lease())

    async def shutdown(self) -> None:
        """Stop the lease watch and shadow copies; close the upstream connection pool."""
        if self._lease_task is not None:
            self._lease_task.cancel()
            self._lease_task = None
        if self._mirror is not None:
            self._mirror.cancel_all()
        if self._session is not None:
            await self._session.close()
            self._session = None
        store = self._pair_store
        if store is not None:  # what is queued reaches the disk before the process ends
            store.close()
            await asyncio.to_thread(store.join, 5.0)

    def app(self) -> ASGIApp:
        """The ASGI application: plain `/v1/*` proxying on a direct path (it is the hot
        path: no router or middleware per chunk), everything else through Starlette's router
        (whose lifespan opens and closes the upstream pool)."""
        starlette = self._starlette()
        proxy = self._proxy
        max_header = self.config.max_header_bytes
        max_count = self.config.max_header_count
        too_large = error_response(
            431,
            f"request headers over {max_header} bytes or {max_count} headers",
            type_="invalid_request_error",
            code="headers_too_large",
            headers={"connection": "close"},
        )

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == "http":
                # The protocol refuses oversize header blocks as they arrive; this catches
                # one that completed within a single read.
                if header_bytes(scope) > max_header or len(scope["headers"]) > max_count:
                    self._metrics.reject("bad_request")
                    await too_large(scope, receive, send)
                    return
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
            _StarletteRoute("/admin/state", self.admin.state, methods=["GET"]),
            _StarletteRoute("/admin/routes", self.admin.routes, methods=["PUT"]),
            _StarletteRoute("/admin/lease", self.admin.lease, methods=["POST"]),
            _StarletteRoute("/admin/drain", self.admin.drain, methods=["POST"]),
            _StarletteRoute("/admin/mirror/pairs", self.admin.mirror_pairs, methods=["GET"]),
            _StarletteRoute("/v1/feedback", self.feedback.endpoint, methods=["POST"]),
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

    # -- client endpoints

    def client_denied(self, request: Request) -> tuple[Response | None, str]:
        """Auth, then the per-key token bucket: (None, client) when the request may proceed,
        else (the answer, client). `client` names the caller without holding its key: a
        digest of the key, or the client's address when the gateway has no keys."""
        address = client_address(request)
        if self._api_keys:
            if self._auth_failures.wait(address) > 0:
                # Too many wrong keys from this address: refuse without checking this one,
                # so a guess cannot be confirmed while throttled.
                return self._too_many(self._auth_failures.wait(address), "auth"), address
            token = bearer_token(request)
            ok = False
            if token is not None:
                for k in self._api_keys:  # no early exit: time does not tell which key
                    ok |= hmac.compare_digest(token, k)
            if not ok:
                self._auth_failures.take(address)
                answer = self._reject(
                    "auth",
                    401,
                    "missing API key" if token is None else "incorrect API key provided",
                    type_="invalid_request_error",
                    code="invalid_api_key",
                    headers={"www-authenticate": "Bearer"},
                )
                return answer, address
            client = "key:" + hashlib.blake2b(token or b"", digest_size=12).hexdigest()
        else:
            client = address
        if self._buckets is not None:
            wait = self._buckets.take(client)
            if wait > 0:
                return self._too_many(wait, "rate_limit"), client
        return None, client

    def _reject(
        self,
        reason: str,
        status: int,
        message: str,
        *,
        type_: str,
        code: str,
        headers: dict[str, str] | None = None,
    ) -> Response:
        """Count a refused request under `reason` and build its OpenAI-style error answer."""
        self._metrics.reject(reason)
        return error_response(status, message, type_=type_, code=code, headers=headers)

    def _too_many(self, wait: float, why: str) -> Response:
        return self._reject(
            why,
            429,
            "too many failed authentications" if why == "auth" else "rate limit exceeded",
            type_="rate_limit_error",
            code="rate_limit_exceeded",
            headers={"retry-after": str(max(1, math.ceil(wait)))},
        )

    async def read_body(self, request: Request) -> bytes | Response:
        """The request body (counted as it streams), or the 413 answer past the limit."""
        limit = self.config.max_request_bytes
        body = await read_body(request, limit)
        if body is not None:
            return body
        # Close the connection: the rest of an oversize body is not worth reading.
        return self._reject(
            "bad_request",
            413,
            f"request body over {limit} bytes",
            type_="invalid_request_error",
            code="too_large",
            headers={"connection": "close"},
        )

    def _json(self, body: bytes) -> Any:
        """A request body parsed (None when empty), or the 400 answer."""
        if not body:
            return None
        try:
            return parse_json(body, self.config.max_json_depth)
        except JsonBodyError as exc:
            return self._reject(
                "bad_request", 400, str(exc), type_="invalid_request_error", code="invalid_json"
            )

    def _refuse_path(self, request: Request) -> Response | None:
        """404 for a path outside the allowlist (or spelled with escapes or dot segments),
        405 for a method the route does not take; None when it may go upstream."""
        scope = request.scope
        path: str = scope["path"]
        raw = scope.get("raw_path")
        methods = UPSTREAM_ROUTES.get(path)
        if methods is None or (raw is not None and raw != path.encode("latin-1")):
            return self._reject(
                "bad_request",
                404,
                f"unknown route {path[:200]!r}",
                type_="invalid_request_error",
                code="unknown_route",
            )
        if request.method not in methods:
            return self._reject(
                "bad_request",
                405,
                f"{request.method} is not allowed on {path}",
                type_="invalid_request_error",
                code="method_not_allowed",
                headers={"allow": ", ".join(methods)},
            )
        return None

    def _hold_client(self, client: str) -> bool:
        """Count one more request of `client` (admitted or queued); False, counting
        nothing, when it is at `max_in_flight_per_client`."""
        cap = self._client_cap
        if cap is None:
            return True
        n = self._per_client.get(client, 0)
        if n >= cap:
            return False
        self._per_client[client] = n + 1
        return True

    def release_client(self, client: str) -> None:
        """One request of `client` ended (the flight's finish, or before it was pinned)."""
        self._release_client(client)

    def _release_client(self, client: str) -> None:
        if self._client_cap is None:
            return
        n = self._per_client.get(client, 0) - 1
        if n > 0:
            self._per_client[client] = n
        else:
            self._per_client.pop(client, None)

    def reveals_release(self, request: Request) -> bool:
        """Whether the answer names the release that served it: always with
        `release_header`, else only for a request carrying the admin token in
        x-releasekit-admin (the deployer's smoke checks)."""
        if self.config.release_header:
            return True
        given = request.headers.get(ADMIN_HEADER)
        return given is not None and hmac.compare_digest(given.encode(), self._admin_token)

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

    async def _checked_request(
        self, request: Request, *, check_path: bool
    ) -> Response | tuple[str, bytes, Any]:
        """The checks every inference request passes before it is forwarded: the client's
        key and rate, (for plain routes) the path allowlist, the body's size and its JSON.
        A Response when one refuses it, else (client, body, payload)."""
        denied, client = self.client_denied(request)
        if denied:
            return denied
        if check_path:
            refused = self._refuse_path(request)
            if refused:
                return refused
        body = await self.read_body(request)
        if isinstance(body, Response):
            return body
        payload = self._json(body)
        if isinstance(payload, Response):
            return payload
        return client, body, payload

    async def _proxy(self, request: Request) -> Response:
        t0 = time.perf_counter()
        admitted = await self._checked_request(request, check_path=True)
        if isinstance(admitted, Response):
            return admitted
        client, body, payload = admitted
        path = request.scope["path"]
        return await self._forward(
            request,
            t0,
            path=path,
            body=body,
            payload=payload,
            route_label=endpoint_label(path),
            prompt=None,
            client=client,
        )

    async def _templated(self, request: Request) -> Response:
        t0 = time.perf_counter()
        admitted = await self._checked_request(request, check_path=False)
        if isinstance(admitted, Response):
            return admitted
        client, body, payload = admitted
        return await self._forward(
            request,
            t0,
            path="/v1/chat/completions",
            body=body,
            payload=payload,
            route_label="templates",
            prompt=request.path_params["prompt"],
            client=client,
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
        payload: Any,
        route_label: str,
        prompt: str | None,
        client: str,
    ) -> Response:
        if not self._hold_client(client):
            return self._reject(
                "client_in_flight",
                429,
                f"too many requests in flight for this client (at most {self._client_cap})",
                type_="rate_limit_error",
                code="client_in_flight",
                headers={"retry-after": "1"},
            )
        try:
            busy = await self._admit()
        except BaseException:
            self._release_client(client)
            raise
        if busy is not None:
            self._release_client(client)
            return busy
        # The slot (and the client's hold) is taken: from here on every path frees it exactly
        # once, through the flight once the request is pinned, directly before that.
        flight: Flight | None = None
        try:
            self.check_lease()
            # Pin and count in the same step (no await in between): a drain that sees 0 in
            # flight for a release no longer routed can trust it stays 0.
            route = self._table.pick()
            if route is None:
                self._sem.release()
                self._release_client(client)
                return self._reject(
                    "no_route",
                    503,
                    "no release is routed",
                    type_="server_error",
                    code="no_route",
                    headers={"retry-after": "1"},
                )
            stream = isinstance(payload, dict) and payload.get("stream") is True
            pending = Flight(
                self,
                route,
                route_label,
                t0,
                client=client,
                stream=stream,
                reveal=self.reveals_release(request),
            )
            self._pin(route.release_id, pending.m)
            flight = pending
            pair = self._mirror_copy(
                request, path, body, payload, prompt, route_label, route.release_id
            )
            return await self._upstream(request, flight, path=path, body=body,
                                        payload=payload, prompt=prompt, pair=pair)  # fmt: skip
        except Exception as exc:
            if flight is None:
                self._sem.release()
                self._release_client(client)
            else:
                flight.finish(500, got_response=False)
            log.exception("gateway failed on a request to %s", path)
            return error_response(
                500,
                f"gateway error: {type(exc).__name__}",
                type_="server_error",
                code="gateway_error",
                headers=flight.release_header() if flight else None,
            )
        except BaseException:
            if flight is None:
                self._sem.release()
                self._release_client(client)
            else:
                flight.finish(499, got_response=False, outcome="client_disconnect")
            raise

    def _mirror_copy(
        self,
        request: Request,
        path: str,
        body: bytes,
        payload: Any,
        prompt: str | None,
        route_label: str,
        stable_id: str,
    ) -> PendingPair | None:
        """Copy the request to the mirror when it takes this one; a copy that fails to go
        out is dropped, never the client's request. Answers the pair the client's answer
        goes into (None: no copy, or no pairs kept)."""
        mirror = self._mirror
        if (
            mirror is None
            or self._session is None
            or not mirror.copies(stable_id)
            or not mirror.take()
        ):
            return None
        try:
            return mirror.copy(
                self._session,
                method=request.method,
                path=path,
                query=request.scope["query_string"],
                headers=self._upstream_headers(request, mirror.route),
                body=body,
                payload=payload,
                prompt=prompt,
                route_label=route_label,
                stable_id=stable_id,
            )
        except Exception:
            log.exception("shadow copy to %s not sent", mirror.route.release_id)
            mirror.drop()
            return None

    async def _upstream(
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
        route = flight.route
        rel_header = flight.release_header()
        try:
            if prompt is not None:
                body = templated_body(route, prompt, payload)
        except PromptTemplateError as exc:
            flight.finish(400, got_response=False)
            return self._reject(
                "bad_request",
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
            headers = self._upstream_headers(request, route)
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
            return self._reject(
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
            return self._reject(
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
