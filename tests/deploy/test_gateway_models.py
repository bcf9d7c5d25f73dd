"""The gateway's model names across routes: `GET /v1/models` answered from the routed
releases (the bases' served names and the adapters' client names, never an engine's own
name), and a canary whose release adds an adapter the stable one lacks gets the requests
for it (picked among the routes that serve the model, weights renormalised), while a
model no route serves is the 404 as before."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import webclient
from gateway_fakes import FakeUpstream

from releasekit.deploy.gateway import Route, ThreadedGateway
from releasekit.deploy.gateway.routing import Table

Up = Callable[[str], FakeUpstream]
Gw = Callable[..., ThreadedGateway]


def _route(up: FakeUpstream, rid: str, adapters: dict[str, str], **kw: Any) -> Route:
    return Route(release_id=rid, base_url=up.url, model="demo", adapters=adapters, **kw)


def _two(upstream_factory: Up) -> tuple[FakeUpstream, FakeUpstream, list[Route]]:
    a, b = upstream_factory("a"), upstream_factory("b")
    stable = _route(a, "rel-a", {"demo-json": "demo-json@000000000001"}, weight=1)
    canary = _route(
        b,
        "rel-b",
        {"demo-json": "demo-json@000000000002", "demo-sql": "demo-sql@000000000003"},
        weight=1,
    )
    return a, b, [stable, canary]


def test_the_model_list_comes_from_the_routes_not_an_upstream(
    upstream_factory: Up, gateway_factory: Gw
) -> None:
    """Each name once, the base first, adapters with `parent` the base, no engine name;
    no upstream asked; a client key is still demanded; a route at weight 0 is not listed."""
    a, b, routes = _two(upstream_factory)
    c = upstream_factory("c")
    parked = _route(c, "rel-c", {"demo-old": "demo-old@000000000004"}, weight=0)
    tg = gateway_factory([*routes, parked], api_keys=["k1"])
    assert webclient.get(tg.url + "/v1/models").status_code == 401
    r = webclient.get(tg.url + "/v1/models", headers={"authorization": "Bearer k1"})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list"
    assert [(m["id"], m["parent"]) for m in body["data"]] == [
        ("demo", None),
        ("demo-json", "demo"),
        ("demo-sql", "demo"),
    ]
    assert all(m["object"] == "model" and "@" not in json.dumps(m) for m in body["data"])
    assert a.received == [] and b.received == [] and c.received == []


def test_routes_without_a_model_name_still_relay_the_list(
    upstream_factory: Up, gateway_factory: Gw
) -> None:
    """A table whose route does not say its model: the upstream answers, as before."""
    a = upstream_factory("a")
    tg = gateway_factory([Route(release_id="rel-a", base_url=a.url)])
    r = webclient.get(tg.url + "/v1/models")
    assert r.status_code == 200 and r.headers["x-releasekit-release"] == "rel-a"
    assert len(a.received) == 1


def test_a_canarys_new_adapter_is_served_by_the_canary_not_a_404_on_stable(
    upstream_factory: Up, gateway_factory: Gw
) -> None:
    """Requests for the adapter only the canary carries all go to it (mapped to its engine
    name); those for a name both serve go to both; a name neither serves is the 404."""
    a, b, routes = _two(upstream_factory)
    tg = gateway_factory(routes)
    chat = {"model": "demo-sql", "messages": [{"role": "user", "content": "hi"}]}
    for _ in range(12):
        r = webclient.post(tg.url + "/v1/chat/completions", json=chat)
        assert r.status_code == 200 and r.headers["x-releasekit-release"] == "rel-b"
    assert a.received == []
    assert json.loads(b.received[-1]["body"])["model"] == "demo-sql@000000000003"
    seen = set()
    for _ in range(30):
        r = webclient.post(tg.url + "/v1/chat/completions", json={**chat, "model": "demo"})
        seen.add(r.headers["x-releasekit-release"])
    assert seen == {"rel-a", "rel-b"}
    r = webclient.post(tg.url + "/v1/chat/completions", json={**chat, "model": "nope"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    assert len(a.received) + len(b.received) == 42


def test_the_pick_among_the_routes_that_serve_a_model_renormalises_their_weights() -> None:
    """Weights 3, 1 and 6 where only the first two serve `x`: about 3 in 4 of the picks
    for `x` go to the first, none to the third; a model all or none serve picks as usual."""
    up = "http://127.0.0.1:1"
    a = Route(release_id="a", base_url=up, model="m", adapters={"x": "x@1"}, weight=3)
    b = Route(release_id="b", base_url=up, model="m", adapters={"x": "x@2"}, weight=1)
    c = Route(release_id="c", base_url=up, model="m", weight=6)
    table = Table(1, [a, b, c])
    picks = [table.pick_for("x").release_id for _ in range(4000)]  # type: ignore[union-attr]
    assert picks.count("c") == 0 and 2800 < picks.count("a") < 3200
    for model in ("m", "nope", None):
        got = {table.pick_for(model).release_id for _ in range(200)}  # type: ignore[union-attr]
        assert got == {"a", "b", "c"}
