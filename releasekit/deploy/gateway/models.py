"""Model names on the gateway: a request's `model` checked against its route (the base's
served name and its LoRA adapters' client names; an adapter lane's route only its adapters')
and mapped to the name the engine holds the adapter under (`name@digest12`), which no client
can name itself; the model list (`GET /v1/models`) the gateway answers from its routes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from starlette.responses import Response

from releasekit.deploy.gateway.config import Route
from releasekit.deploy.gateway.responses import error_response, json_bytes, json_response


def asked_model(payload: Any) -> str | None:
    """The model name a request body asks for (None: no body, no `model`, or not a
    string: any route takes it, or refuses it alike)."""
    if isinstance(payload, dict):
        model = payload.get("model")
        if isinstance(model, str):
            return model
    return None


def serves(route: Route, model: str) -> bool:
    """Whether `route` serves the model name `model`. A lane's route (`Route.lane`) serves
    only its adapters' client names (never the base's name, whatever its `model`); a base
    route serves anything when it has no `model`, else the base's served name and its
    adapters' client names."""
    if route.lane is not None:
        return model in route.adapters
    return route.model is None or model == route.model or model in route.adapters


def unknown_model(route: Route, payload: Any) -> str | None:
    """The `model` a request body asks for when `route` does not serve it (neither its
    `model` nor one of its adapters), else None. A base route without `model`, or a body
    without `model` (the upstream's default, or the route's on the templated route), is
    never refused by a base route; a lane's route refuses a body without `model` too (it
    is never anyone's default), answering "" for the missing name."""
    has_model = isinstance(payload, dict) and "model" in payload
    if route.lane is None and (route.model is None or not has_model):
        return None
    if not has_model:
        return ""
    model = payload["model"]
    if isinstance(model, str) and serves(route, model):
        return None
    return model if isinstance(model, str) else repr(model)


def engine_payload(route: Route, payload: dict[str, Any]) -> dict[str, Any]:
    """`payload` with an adapter's client name in `model` replaced by the engine's name
    (a copy; `payload` itself is never changed), or `payload` when nothing maps."""
    model = payload.get("model")
    if isinstance(model, str) and model in route.adapters:
        return {**payload, "model": route.adapters[model]}
    return payload


def engine_body(route: Route, body: bytes, payload: Any) -> bytes:
    """The body `route`'s upstream gets for a plain request: `body` untouched, unless its
    `model` names one of the route's adapters (then re-encoded with the engine's name)."""
    if not route.adapters or not isinstance(payload, dict):
        return body
    mapped = engine_payload(route, payload)
    return body if mapped is payload else json_bytes(mapped)


def served_models(route: Route) -> list[str]:
    """The model names a client may ask `route` for: the base's, then its adapters' (a
    lane's route: its adapters' only)."""
    base = [route.model] if route.model is not None and route.lane is None else []
    return base + sorted(route.adapters)


def model_list(routes: Sequence[Route], created: int) -> Response | None:
    """The answer to `GET /v1/models` from the routed `routes`, OpenAI's list as vLLM
    shapes it: each base route's served name, then each route's adapters by their client
    names (the base routes' first, then the lanes'; `parent`: the route's base), each name
    once; never an engine's own adapter name. A lane's route adds only its adapters (the
    base's name it carries is listed by the base's routes). None when some base route has
    no `model` (the gateway cannot tell what it serves: its upstream answers) or none is
    routed."""
    base = [r for r in routes if r.lane is None]
    if not routes or any(r.model is None for r in base):
        return None
    seen: dict[str, dict[str, Any]] = {}

    def entry(name: str, parent: str | None) -> None:
        seen.setdefault(
            name,
            {"id": name, "object": "model", "created": created, "owned_by": "releasekit",
             "root": name, "parent": parent},
        )  # fmt: skip

    for r in base:
        entry(str(r.model), None)
    for r in [*base, *(r for r in routes if r.lane is not None)]:
        for name in sorted(r.adapters):
            entry(name, r.model)
    return json_response({"object": "list", "data": list(seen.values())}, 200)


def model_not_found(route: Route, model: str, lanes: Sequence[Route] = ()) -> Response:
    """The 404 a request for a model the route does not serve gets (OpenAI's shape, as
    vLLM answers an unknown model); it names what the environment does serve: the route's
    names, then those of the adapter lanes' routes `lanes`."""
    shown = model if len(model) <= 200 else model[:200] + "..."
    names = list(
        dict.fromkeys([*served_models(route), *(n for r in lanes for n in served_models(r))])
    )
    return error_response(
        404,
        f"The model `{shown}` does not exist (this environment serves: {', '.join(names)}).",
        type_="NotFoundError",
        code=404,
    )
