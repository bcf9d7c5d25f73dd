"""The gateway's routing: which upstream paths it forwards, and the route table (an immutable
set of routes and its weighted cursor)."""

from __future__ import annotations

from collections.abc import Sequence

from releasekit.deploy.gateway.config import Route

# The OpenAI routes of vLLM's server the gateway forwards, with their methods. Anything else
# (vLLM's admin and dev routes, other paths, other methods) never reaches an upstream; a path
# matches only as spelled here (no escapes, no dot segments, no doubled slashes).
UPSTREAM_ROUTES: dict[str, tuple[str, ...]] = {
    "/v1/models": ("GET",),
    "/v1/completions": ("POST",),
    "/v1/chat/completions": ("POST",),
    "/v1/embeddings": ("POST",),
    "/v1/responses": ("POST",),
    "/v1/score": ("POST",),
    "/v1/rerank": ("POST",),
}


class Table:
    """An immutable set of routes plus the smooth weighted round-robin cursor."""

    __slots__ = ("_current", "_live", "_total", "generation", "routes")

    def __init__(self, generation: int, routes: Sequence[Route]) -> None:
        self.generation = generation
        self.routes = tuple(routes)
        self._live = [r for r in self.routes if r.weight > 0]
        self._total = sum(r.weight for r in self._live)
        self._current = [0.0] * len(self._live)

    def share(self, route: Route) -> float:
        return route.weight / self._total if self._total and route.weight > 0 else 0.0

    def routed(self, release_id: str) -> bool:
        return any(r.release_id == release_id for r in self._live)

    def pick(self) -> Route | None:
        live = self._live
        if len(live) == 1:
            return live[0]
        if not live:
            return None
        cur = self._current
        best = 0
        for i, r in enumerate(live):
            cur[i] += r.weight
            if cur[i] > cur[best]:
                best = i
        cur[best] -= self._total
        return live[best]
