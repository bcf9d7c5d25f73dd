"""The gateway's routing: which upstream paths it forwards, and the route table (an immutable
set of routes and its weighted random choice)."""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Sequence

from releasekit.deploy.gateway.config import Route
from releasekit.deploy.gateway.models import serves

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


_RNG = random.SystemRandom()


class Table:
    """An immutable set of routes; `pick` chooses a live one at random in proportion to the
    weights (from the OS's random source: a client cannot predict, and so aim at, which
    release its next request goes to). A request for a model only some routes serve (a
    canary whose release adds an adapter) is picked among those, their weights
    renormalised."""

    __slots__ = ("_cum", "_live", "_total", "generation", "routes")

    def __init__(self, generation: int, routes: Sequence[Route]) -> None:
        self.generation = generation
        self.routes = tuple(routes)
        self._live = [r for r in self.routes if r.weight > 0]
        self._cum = list(itertools.accumulate(r.weight for r in self._live))
        self._total = self._cum[-1] if self._cum else 0.0

    def share(self, route: Route) -> float:
        return route.weight / self._total if self._total and route.weight > 0 else 0.0

    def routed(self, release_id: str) -> bool:
        return any(r.release_id == release_id for r in self._live)

    def live(self) -> list[Route]:
        """The routes that take traffic (weight > 0)."""
        return list(self._live)

    def pick(self) -> Route | None:
        """A routed route at random, in proportion to the weights."""
        live = self._live
        if len(live) == 1:
            return live[0]
        if not live:
            return None
        i = bisect.bisect_right(self._cum, _RNG.random() * self._total)
        return live[min(i, len(live) - 1)]

    def pick_for(self, model: str | None) -> Route | None:
        """`pick()`, and when the route it picked does not serve `model`, a pick among the
        routes that do (so each of those is chosen in proportion to its weight among them);
        when none does, the first pick (which then refuses the model)."""
        route = self.pick()
        if route is None or model is None or serves(route, model):
            return route
        serving = [r for r in self._live if serves(r, model)]
        return _weighted(serving) if serving else route


def _weighted(routes: Sequence[Route]) -> Route:
    """One of `routes` (weights > 0) at random, in proportion to their weights."""
    cum = list(itertools.accumulate(r.weight for r in routes))
    i = bisect.bisect_right(cum, _RNG.random() * cum[-1])
    return routes[min(i, len(routes) - 1)]
