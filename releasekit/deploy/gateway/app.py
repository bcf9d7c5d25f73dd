"""The gateway's state and its ASGI app: the route table with its lease and mirror, request
handling from the checks to the upstream, and the Starlette wiring. Admission is
`admission`, the client checks `checks`, the upstream side `upstream`, the admin API
`admin`, feedback `feedback`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, ProcessCollector
from prometheus_client import generate_latest as _generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route as _StarletteRoute
from starlette.types import ASGIApp, Receive, Scope, Send

from releasekit.deploy.gateway.admin import AdminAPI
from releasekit.deploy.gateway.admission import Admission
from releasekit.deploy.gateway.checks import ClientChecks
from releasekit.deploy.gateway.config import (
    DrainResult,
    GatewayConfig,
    GatewayState,
    Mirror,
    Route,
    RouteState,
    RouteTable,
)
from releasekit.deploy.gateway.errors import GatewayRequestError
from releasekit.deploy.gateway.feedback import FeedbackBook
from releasekit.deploy.gateway.lease import Lease
from releasekit.deploy.gateway.limits import header_bytes
from releasekit.deploy.gateway.metrics import Metrics, endpoint_label
from releasekit.deploy.gateway.mirror import Mirroring
from releasekit.deploy.gateway.models import (
    asked_model,
    model_list,
    model_not_found,
    unknown_model,
)
from releasekit.deploy.gateway.pairs import MirrorPairs
from releasekit.deploy.gateway.pairstore import PairStore, prune, prune_to_size
from releasekit.deploy.gateway.relay import Flight
from releasekit.deploy.gateway.responses import error_response, json_response
from releasekit.deploy.gateway.routing import Table
from releasekit.deploy.gateway.upstream import Upstream

log = logging.getLogger("releasekit.gateway")


def other_lanes_kept(fallback: Sequence[Route], current: Sequence[Route]) -> list[Route]:
    """A lapsed lease's table: `fallback`, and the routes of `current` of every lane (the
    base's, an adapter lane's) the fallback has no route of (a release already in the
    fallback is not added twice)."""
    lanes = {r.lane for r in fallback}
    ids = {r.release_id for r in fallback}
    kept = [r for r in current if r.lane not in lanes and r.release_id not in ids]
    return [*fallback, *kept]


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
        self._admission = Admission(
            self._metrics,
            max_in_flight=config.max_in_flight,
            max_queue_wait_s=config.max_queue_wait_s,
            client_cap=config.max_in_flight_per_client,
        )
        self._checks = ClientChecks(config, self._metrics)
        self._upstream = Upstream(config, self._checks)
        self.feedback = FeedbackBook(self._checks, config.feedback_capacity)
        self.admin = AdminAPI(self, config.admin_token)
        self._lease: Lease | None = None
        self._lease_expiries = 0
        self._lease_task: asyncio.Task[None] | None = None
        self._prune_task: asyncio.Task[None] | None = None
        self._mirror: Mirroring | None = None
        self._pair_store: PairStore | None = None
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
        canary's). The fallback speaks for the lanes it has routes of (the base's, an
        adapter lane's): the table's routes of every other lane stay as they are, so a
        lease that lapses on one lane never moves another's traffic."""
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
        routes = other_lanes_kept(lease.fallback, self._table.routes)
        self.set_routes(RouteTable(routes=routes, mirror=mirror))

    async def _watch_lease(self) -> None:
        while True:
            lease = self._lease
            await asyncio.sleep(min(0.1, lease.left() if lease else 0.1) or 0.01)
            self.check_lease()

    def state(self) -> GatewayState:
        """Routes, in-flight and served counts now."""
        t = self._table
        store = self._mirror.pairs.store if self._mirror else None
        adm = self._admission
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
                    adapters=dict(r.adapters),
                    lane=r.lane,
                    has_api_key=r.api_key is not None,
                )
                for r in t.routes
            ],
            in_flight=dict(adm.in_flight),
            served=dict(adm.served),
            in_flight_total=adm.in_flight_total,
            queued=adm.queued,
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
        return await self._admission.wait_idle(release_id, timeout_s)

    # -- the pair store's ageing

    def prune_pairs(self) -> list[Path]:
        """Age (`pairs_keep_s`: never the mirrored release's files) and size
        (`pairs_max_bytes`: oldest first, never the file being written) the stored pairs
        out; the files deleted. Blocking: the schedule runs it in a thread."""
        if self.config.pairs_dir is None:
            return []
        directory = Path(self.config.pairs_dir)
        m, store = self._mirror, self._pair_store
        mirrored = [m.route.release_id] if m is not None else []
        writing = [store.path] if store is not None and not store.closing else []
        gone: list[Path] = []
        if self.config.pairs_keep_s is not None:
            gone += prune(directory, keep_s=self.config.pairs_keep_s, protect=mirrored)
        if self.config.pairs_max_bytes is not None:
            gone += prune_to_size(directory, max_bytes=self.config.pairs_max_bytes, protect=writing)
        return gone

    async def _prune_schedule(self, every_s: float) -> None:
        """Prune the pair store now and every `every_s`, in a thread (the event loop never
        waits on the disk); a prune that fails is logged and tried again next time."""
        while True:
            try:
                gone = await asyncio.to_thread(self.prune_pairs)
                if gone:
                    log.info("stored answer pairs pruned: %d files", len(gone))
            except Exception:
                log.exception("stored answer pairs not pruned")
            await asyncio.sleep(every_s)

    # -- lifecycle

    async def startup(self) -> None:
        """Open the shared upstream connection pool (more connections than in-flight
        slots, so an admitted request never waits for one); start the lease watch and,
        with `pairs_dir` and `pairs_prune_s`, the pair store's pruning."""
        self._upstream.open()
        self._lease_task = asyncio.ensure_future(self._watch_lease())
        every = self.config.pairs_prune_s
        if self.config.pairs_dir is not None and every is not None:
            self._prune_task = asyncio.ensure_future(self._prune_schedule(every))

    async def shutdown(self) -> None:
        """Stop the lease watch, the pruning and shadow copies; close the upstream
        connection pool."""
        if self._lease_task is not None:
            self._lease_task.cancel()
            self._lease_task = None
        if self._prune_task is not None:
            self._prune_task.cancel()
            self._prune_task = None
        if self._mirror is not None:
            self._mirror.cancel_all()
        await self._upstream.close()
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

    async def _proxy(self, request: Request) -> Response:
        t0 = time.perf_counter()
        admitted = await self._checks.checked(request, check_path=True)
        if isinstance(admitted, Response):
            return admitted
        client, body, payload = admitted
        path = request.scope["path"]
        if path == "/v1/models" and request.method == "GET":
            # The routes' names (never an engine's own adapter names), not one upstream's.
            self.check_lease()
            listed = model_list(self._table.live(), int(self.started_at))
            if listed is not None:
                return listed
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
        admitted = await self._checks.checked(request, check_path=False)
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
        """Admit a checked request (the client's cap, then a slot), pin it to a route, copy
        it to the mirror when it takes it, and send it upstream."""
        adm = self._admission
        if not adm.hold_client(client):
            return self._checks.reject(
                "client_in_flight",
                429,
                f"too many requests in flight for this client (at most {adm.client_cap})",
                type_="rate_limit_error",
                code="client_in_flight",
                headers={"retry-after": "1"},
            )
        try:
            busy = await adm.admit()
        except BaseException:
            adm.release_client(client)
            raise
        if busy is not None:
            adm.release_client(client)
            return busy
        # The slot (and the client's hold) is taken: from here on every path frees it exactly
        # once, through the flight once the request is pinned, directly before that.
        flight: Flight | None = None
        try:
            self.check_lease()
            # Pin and count in the same step (no await in between): a drain that sees 0 in
            # flight for a release no longer routed can trust it stays 0.
            route = self._table.pick_for(asked_model(payload))
            if route is None:
                adm.free()
                adm.release_client(client)
                return self._checks.reject(
                    "no_route",
                    503,
                    "no release is routed",
                    type_="server_error",
                    code="no_route",
                    headers={"retry-after": "1"},
                )
            # The pick prefers routes that serve the model asked for; one none serves (an
            # engine's own adapter name included) is refused here: it reaches no upstream
            # and no mirror.
            unknown = unknown_model(route, payload)
            if unknown is not None:
                adm.free()
                adm.release_client(client)
                self._metrics.reject("unknown_model")
                return model_not_found(route, unknown, self._table.lanes())
            stream = isinstance(payload, dict) and payload.get("stream") is True
            pending = Flight(
                adm,
                route,
                route_label,
                t0,
                timeout_s=self.config.request_timeout_s,
                remember=self.feedback.remember,
                client=client,
                stream=stream,
                reveal=self._checks.reveals_release(request),
            )
            adm.pin(route.release_id, pending.m)
            flight = pending
            up = self._upstream
            pair = up.copy(self._mirror, request, path=path, body=body, payload=payload,
                           prompt=prompt, route_label=route_label, pinned=route,
                           client=client)  # fmt: skip
            return await up.send(request, flight, path=path, body=body,
                                 payload=payload, prompt=prompt, pair=pair)  # fmt: skip
        except Exception as exc:
            if flight is None:
                adm.free()
                adm.release_client(client)
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
                adm.free()
                adm.release_client(client)
            else:
                flight.finish(499, got_response=False, outcome="client_disconnect")
            raise
