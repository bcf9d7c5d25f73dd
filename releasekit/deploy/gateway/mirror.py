"""Shadow traffic: copies of admitted requests sent to a candidate whose answers are
discarded.

A copy is made after the client's request was admitted (its rate-limit token and in-flight
slot are the original's, never the candidate's) and goes out on its own task: the client's
answer never waits for it. A templated copy renders the candidate's template from its own
deep copy of the parsed request, so the client's request is never changed by it. Copies in
flight are capped; one past the cap is dropped and counted, never queued. The candidate's
figures land in the gateway's per-release families under its own release id (requests by
status, TTFT, E2E), so a window over them reads like any release's;
`releasekit_gateway_mirrored_total{env,release,outcome}` counts `sent` and `dropped`
copies.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from typing import TYPE_CHECKING, Any

import aiohttp

from releasekit.deploy.gateway.config import Mirror
from releasekit.deploy.gateway.errors import PromptTemplateError
from releasekit.deploy.gateway.relay import CONTENT_RE
from releasekit.deploy.gateway.templates import templated_body

if TYPE_CHECKING:
    from releasekit.deploy.gateway.metrics import Metrics

log = logging.getLogger("releasekit.gateway")


class Mirroring:
    """One mirror configuration in force: which requests to copy (an exact share, by a
    deterministic accumulator), and the copies in flight."""

    def __init__(self, mirror: Mirror, metrics: Metrics, timeout_s: float) -> None:
        self.mirror = mirror
        self.route = mirror.route
        self.metrics = metrics
        self.timeout_s = timeout_s
        self._acc = 0.0
        self.in_flight = 0
        self.sent = 0
        self.dropped = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._counter = metrics.mirrored

    def take(self) -> bool:
        """Whether this request is copied: exactly `share` of requests over any long run."""
        self._acc += self.mirror.share
        if self._acc >= 1.0 - 1e-9:
            self._acc -= 1.0
            return True
        return False

    def drop(self) -> None:
        """Count a copy that was not sent."""
        self.dropped += 1
        self._counter.labels(self.metrics.env, self.route.release_id, "dropped").inc()

    def copy(
        self,
        session: aiohttp.ClientSession,
        *,
        method: str,
        path: str,
        query: bytes,
        headers: list[tuple[str, str]],
        body: bytes,
        payload: Any,
        prompt: str | None,
        route_label: str,
    ) -> None:
        """Send a copy on its own task (or drop it when the mirror is at its cap)."""
        rid = self.route.release_id
        if self.in_flight >= self.mirror.max_in_flight:
            self.drop()
            return
        if prompt is not None:
            try:
                # The copy renders from its own deep copy of the parsed body: the client's
                # request is rendered for its own route after this and must be untouched.
                body = templated_body(self.route, prompt, copy.deepcopy(payload))
            except PromptTemplateError:
                self.drop()
                return
        hdrs = [(k, v) for k, v in headers if k.lower() != "authorization"]
        if self.route.api_key is not None:
            hdrs.append(("authorization", "Bearer " + self.route.api_key))
        url = self.route.base_url + path + ("?" + query.decode("latin-1") if query else "")
        stream = isinstance(payload, dict) and payload.get("stream") is True
        self.in_flight += 1
        self.sent += 1
        self._counter.labels(self.metrics.env, rid, "sent").inc()
        task = asyncio.ensure_future(
            self._send(session, method, url, hdrs, body, stream=stream, route_label=route_label)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(
        self,
        session: aiohttp.ClientSession,
        method: str,
        url: str,
        headers: list[tuple[str, str]],
        body: bytes,
        *,
        stream: bool,
        route_label: str,
    ) -> None:
        rid = self.route.release_id
        m = self.metrics.release(rid)
        t0 = time.perf_counter()
        status: int | str = 502
        try:
            async with asyncio.timeout(self.timeout_s):
                async with session.request(
                    method, url, headers=headers, data=body or None, allow_redirects=False
                ) as r:
                    status = r.status
                    need_ttft = stream
                    async for chunk in r.content.iter_any():
                        if need_ttft and CONTENT_RE.search(chunk):
                            m.ttft.observe(time.perf_counter() - t0)
                            need_ttft = False
                    m.e2e.observe(time.perf_counter() - t0)
        except TimeoutError:
            status = 504
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            log.debug("shadow copy to %s failed: %r", url, exc)
            status = 502
        except asyncio.CancelledError:
            status = "aborted"
            raise
        finally:
            self.in_flight -= 1
            self.metrics.request(rid, route_label, status)

    def cancel_all(self) -> None:
        """Cancel every copy in flight (the mirror was removed or the gateway stops)."""
        for t in list(self._tasks):
            t.cancel()
