"""The gateway's routing: which upstream paths it forwards, and the route table (an immutable
set of routes and its weighted random choice)."""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Sequence

from releasekit.deploy.gateway.config import Route
from releasekit.deploy.gateway.models import served_models, serves

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


def _wild(route: Route) -> bool:
    """Whether `route` serves any model name (a base route without `model`)."""
    return route.lane is None and route.model is None


class _Weighted:
    """Routes (weights > 0) and their cumulative weights: one at random in proportion to
    its weight."""

    __slots__ = ("cum", "routes", "total")

    def __init__(self, routes: Sequence[Route]) -> None:
        self.routes = tuple(routes)
        self.cum = list(itertools.accumulate(r.weight for r in self.routes))
        self.total = self.cum[-1] if self.cum else 0.0

    def pick(self) -> Route | None:
        routes = self.routes
        if len(routes) == 1:
            return routes[0]
        if not routes:
            return None
        i = bisect.bisect_right(self.cum, _RNG.random() * self.total)
        return routes[min(i, len(routes) - 1)]


class Table:
    """An immutable set of routes; `pick` chooses a live one at random in proportion to the
    weights (from the OS's random source: a client cannot predict, and so aim at, which
    release its next request goes to). A request for a model only some routes serve (a
    canary whose release adds an adapter) is picked among those, their weights
    renormalised.

    Adapter lanes (`Route.lane`): a lane's route serves only its adapters' names. A
    request for one goes only to the lane's routes that serve that name (never to a base
    route, even one that serves it too); a request without `model`, or for the base's
    name, never goes to a lane's route. Weights count within a lane (the base's routes
    are one lane): a lane's route never takes a share of the base's traffic, nor the
    base's of a lane's."""

    __slots__ = (
        "_anything",
        "_base",
        "_by_name",
        "_lanes",
        "_live",
        "_totals",
        "generation",
        "routes",
    )

    def __init__(self, generation: int, routes: Sequence[Route]) -> None:
        self.generation = generation
        self.routes = tuple(routes)
        self._live = [r for r in self.routes if r.weight > 0]
        base = [r for r in self._live if r.lane is None]
        self._base = _Weighted(base)
        self._lanes = [r for r in self._live if r.lane is not None]
        # The routes that serve any name (base routes without `model`) and, per name some
        # live route names itself, the routes that serve it (None: all the base's, which
        # `pick` chooses among). A name a lane serves goes to its lane's routes only, never
        # to a base route (one that takes anything, or whose release carries that adapter
        # too): the lane's release decides what answers its adapter.
        self._anything = self._among([r for r in base if _wild(r)])
        lane_names = {n for r in self._lanes for n in r.adapters}
        named = dict.fromkeys(n for r in self._live for n in served_models(r))
        self._by_name = {
            n: self._among(
                [
                    r
                    for r in self._live
                    if serves(r, n) and (r.lane is not None or n not in lane_names)
                ]
            )
            for n in named
        }
        self._totals: dict[str | None, float] = {}
        for r in self._live:
            self._totals[r.lane] = self._totals.get(r.lane, 0.0) + r.weight

    def _among(self, routes: list[Route]) -> _Weighted | None:
        """The choice among `routes` (None: they are the base's live routes)."""
        return None if tuple(routes) == self._base.routes else _Weighted(routes)

    def share(self, route: Route) -> float:
        """The fraction of its lane's new traffic `route` gets (the base's routes are one
        lane, each adapter lane another)."""
        total = self._totals.get(route.lane, 0.0)
        return route.weight / total if total and route.weight > 0 else 0.0

    def routed(self, release_id: str) -> bool:
        """Whether `release_id` takes traffic (a lane's route included)."""
        return any(r.release_id == release_id for r in self._live)

    def live(self) -> list[Route]:
        """The routes that take traffic (weight > 0), a lane's included."""
        return list(self._live)

    def lanes(self) -> list[Route]:
        """The adapter lanes' routes that take traffic."""
        return list(self._lanes)

    def pick(self) -> Route | None:
        """A routed base route at random, in proportion to the weights (never a lane's)."""
        return self._base.pick()

    def pick_for(self, model: str | None) -> Route | None:
        """A route for a request asking for `model`: one of the live routes that serve it
        (a lane's name: its lane's routes only), in proportion to their weights (without
        lanes, the same distribution as `pick()` followed by a pick among the serving
        routes when the first does not serve it). None: `pick()`
        (a lane's route never takes a request without `model`). When no route serves
        `model`, a base route as `pick()` chooses it (else a lane's, where the base has
        none), which then refuses the model."""
        if model is None:
            return self.pick()
        serving = self._by_name.get(model, self._anything)
        route = self.pick() if serving is None else serving.pick()
        if route is not None:
            return route
        return self.pick() or (self._lanes[0] if self._lanes else None)
