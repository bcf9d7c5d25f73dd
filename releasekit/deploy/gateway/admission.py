"""Admission: the in-flight slots and their queue, each client's cap, and the per-release
in-flight and served counts that a drain waits on."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time

from starlette.responses import Response

from releasekit.deploy.gateway.config import DrainResult
from releasekit.deploy.gateway.metrics import Metrics, ReleaseMetrics
from releasekit.deploy.gateway.responses import error_response


class Admission:
    """The gateway's `max_in_flight` slots (a request waits up to `max_queue_wait_s` for
    one), the requests each client holds (at most `client_cap`, admitted or queued), and
    what is pinned to each release. Runs on the event loop thread."""

    def __init__(
        self,
        metrics: Metrics,
        *,
        max_in_flight: int,
        max_queue_wait_s: float,
        client_cap: int | None,
    ) -> None:
        self.metrics = metrics
        self.max_in_flight = max_in_flight
        self.max_queue_wait_s = max_queue_wait_s
        self.client_cap = client_cap
        self.in_flight: dict[str, int] = {}
        self.served: dict[str, int] = {}
        self.in_flight_total = 0
        self.queued = 0
        self._idle: dict[str, asyncio.Event] = {}
        self._sem = asyncio.Semaphore(max_in_flight)
        self._per_client: dict[str, int] = {}
        self._retry_queue = str(max(1, math.ceil(max_queue_wait_s)))

    # -- each client's cap

    def hold_client(self, client: str) -> bool:
        """Count one more request of `client` (admitted or queued); False, counting
        nothing, when it is at `max_in_flight_per_client`."""
        cap = self.client_cap
        if cap is None:
            return True
        n = self._per_client.get(client, 0)
        if n >= cap:
            return False
        self._per_client[client] = n + 1
        return True

    def release_client(self, client: str) -> None:
        """One request of `client` ended (the flight's finish, or before it was pinned)."""
        if self.client_cap is None:
            return
        n = self._per_client.get(client, 0) - 1
        if n > 0:
            self._per_client[client] = n
        else:
            self._per_client.pop(client, None)

    # -- slots

    async def admit(self) -> Response | None:
        """Take an in-flight slot, waiting up to max_queue_wait_s; 503 past that."""
        sem = self._sem
        m = self.metrics
        if not sem.locked():
            await sem.acquire()
            m.queue_wait.observe(0.0)
            return None
        t = time.perf_counter()
        self.queued += 1
        m.queue_depth.inc()
        try:
            async with asyncio.timeout(self.max_queue_wait_s):
                await sem.acquire()
        except TimeoutError:
            m.queue_wait.observe(time.perf_counter() - t)
            m.reject("queue_full")
            return error_response(
                503,
                f"gateway busy: no slot within {self.max_queue_wait_s:g} s",
                type_="server_error",
                code="queue_full",
                headers={"retry-after": self._retry_queue},
            )
        finally:
            self.queued -= 1
            m.queue_depth.dec()
        m.queue_wait.observe(time.perf_counter() - t)
        return None

    def free(self) -> None:
        """Give back a slot taken by `admit` for a request that was never pinned."""
        self._sem.release()

    # -- pinned requests

    def pin(self, rid: str, m: ReleaseMetrics) -> None:
        """Count a request pinned to release `rid` (its slot already taken)."""
        self.in_flight[rid] = self.in_flight.get(rid, 0) + 1
        self.in_flight_total += 1
        m.in_flight.inc()

    def unpin(self, rid: str, m: ReleaseMetrics) -> None:
        """A request pinned to `rid` ended: count it served and free its slot."""
        n = self.in_flight[rid] - 1
        self.in_flight[rid] = n
        self.in_flight_total -= 1
        self.served[rid] = self.served.get(rid, 0) + 1
        m.in_flight.dec()
        self._sem.release()
        if n == 0:
            ev = self._idle.pop(rid, None)
            if ev is not None:
                ev.set()

    async def wait_idle(self, release_id: str, timeout_s: float) -> DrainResult:
        """Wait up to `timeout_s` until no request pinned to `release_id` is in flight."""
        t = time.monotonic()
        if self.in_flight.get(release_id, 0) > 0:
            ev = self._idle.get(release_id)
            if ev is None:
                ev = self._idle[release_id] = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await ev.wait()
        n = self.in_flight.get(release_id, 0)
        return DrainResult(
            release_id=release_id, drained=n == 0, in_flight=n, waited_s=time.monotonic() - t
        )
