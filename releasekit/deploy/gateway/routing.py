"""The gateway's routing table: an immutable set of routes and its weighted cursor."""

from __future__ import annotations

from collections.abc import Sequence

from releasekit.deploy.gateway.config import Route


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
