"""Adapter lanes at the gateway: a lane's route (`Route.lane`) serves only its adapters'
names, so the base's requests (by the base's name, or without `model`) never reach it,
whatever its weight; a lane's adapter goes only to its lane's route (mapped to the engine's
name); lanes side by side never move each other's traffic; a lane whose route is gone
answers the 404 naming its adapter; `GET /v1/models` lists the base once and every lane's
adapters; a base mirror never copies a lane's requests; a lapsed lease keeps the lanes its
fallback does not speak for."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import webclient
from gateway_fakes import FakeUpstream, wait_until
from pydantic import ValidationError

from releasekit.deploy.gateway import Mirror, PromptTemplate, Route, RouteTable, ThreadedGateway
from releasekit.deploy.gateway.app import other_lanes_kept
from releasekit.deploy.gateway.errors import GatewayRequestError
from releasekit.deploy.gateway.models import serves, unknown_model
from releasekit.deploy.gateway.routing import Table
from releasekit.deploy.gateway_client import GatewayClient

Up = Callable[[str], FakeUpstream]
Gw = Callable[..., ThreadedGateway]
JSON_ENGINE = "demo-json@0123456789ab"
SQL_ENGINE = "demo-sql@ba9876543210"
PROMPTS = {"chat": PromptTemplate(system=None, user="Q: {{ question }}")}
URL = "http://127.0.0.1:1"


def _base(url: str, rid: str = "rel-base", **kw: Any) -> Route:
    return Route(release_id=rid, base_url=url, model="demo", prompts=PROMPTS, **kw)


def _lane(url: str, adapter: str, engine: str, rid: str, **kw: Any) -> Route:
    return Route(
        release_id=rid,
        base_url=url,
        model="demo",
        adapters={adapter: engine},
        lane=adapter,
        prompts=PROMPTS,
        **kw,
    )


def _ask(url: str, model: str | None, path: str = "/v1/completions") -> Any:
    body: dict[str, Any] = {"prompt": "hi", "max_tokens": 2}
    if model is not None:
        body["model"] = model
    return webclient.post(url + path, json=body)


def _sent(up: FakeUpstream) -> Any:
    return json.loads(up.received[-1]["body"]).get("model")


def test_a_lane_route_serves_only_its_adapters() -> None:
    """The base's name, another name and a body without `model` are not a lane's; its
    adapter is. A lane's route carries its lane's adapter and no other."""
    lane = _lane(URL, "demo-json", JSON_ENGINE, "rel-json")
    assert serves(lane, "demo-json") and not serves(lane, "demo") and not serves(lane, "x")
    assert unknown_model(lane, {"model": "demo-json"}) is None
    assert unknown_model(lane, {"model": "demo"}) == "demo"
    assert unknown_model(lane, {"prompt": "x"}) == ""
    assert unknown_model(lane, None) == ""
    assert unknown_model(_base(URL), {"prompt": "x"}) is None
    for adapters in ({}, {"demo-json": JSON_ENGINE, "demo-xml": "demo-xml@0123456789ab"}):
        with pytest.raises(ValidationError, match="carries that adapter and no other"):
            Route(release_id="r", base_url=URL, model="demo", lane="demo-json", adapters=adapters)


def test_the_pick_never_gives_the_base_a_lane_route() -> None:
    """Weights 1 (base) and 1000 (lane): `pick()`, no model and the base's name always get
    the base, the lane's adapter always its lane; two routes of one lane split its traffic
    by their weights; a name nobody serves falls to the base's route (which refuses it)."""
    base = _base(URL)
    lane = _lane(URL, "demo-json", JSON_ENGINE, "rel-json", weight=1000)
    table = Table(1, [lane, base])
    for _ in range(3000):
        assert table.pick() is base
        assert table.pick_for(None) is base
        assert table.pick_for("demo") is base
        assert table.pick_for("nope") is base
        assert table.pick_for("demo-json") is lane
    assert table.share(base) == 1.0 and table.share(lane) == 1.0
    assert table.routed("rel-json") and table.lanes() == [lane]
    canary = _lane(URL, "demo-json", "demo-json@cccccccccccc", "rel-json-2", weight=1)
    lane3 = lane.model_copy(update={"weight": 3.0})
    t2 = Table(2, [base, lane3, canary])
    picks = Counter(t2.pick_for("demo-json").release_id for _ in range(4000))  # type: ignore[union-attr]
    assert set(picks) == {"rel-json", "rel-json-2"} and 2800 < picks["rel-json"] < 3200
    assert t2.share(lane3) == 0.75 and t2.share(canary) == 0.25 and t2.share(base) == 1.0
    assert {t2.pick_for(None).release_id for _ in range(200)} == {"rel-base"}  # type: ignore[union-attr]


def test_a_name_a_lane_serves_goes_to_that_lane_only() -> None:
    """A base route without `model` takes any name, and one whose release carries the
    adapter too serves it, except while a lane's route serves it (whatever its weight);
    once that lane is gone the name goes to the base again."""
    wild = Route(release_id="wild", base_url=URL)
    lane = _lane(URL, "demo-json", JSON_ENGINE, "rel-json")
    table = Table(1, [wild, lane])
    assert {table.pick_for("demo-json").release_id for _ in range(300)} == {"rel-json"}  # type: ignore[union-attr]
    assert table.pick_for("anything") is wild and table.pick_for(None) is wild
    assert Table(2, [wild]).pick_for("demo-json") is wild
    carries = _base(URL, "rel-carries", adapters={"demo-json": "demo-json@000000000009"})
    table = Table(3, [carries, lane.model_copy(update={"weight": 0.001})])
    assert {table.pick_for("demo-json").release_id for _ in range(300)} == {"rel-json"}  # type: ignore[union-attr]
    assert Table(4, [carries]).pick_for("demo-json") is carries


def test_base_requests_never_reach_a_lane_route(upstream_factory: Up, gateway_factory: Gw) -> None:
    """Base 1, lane 1000: requests by the base's name, without `model`, templated without
    `model`, all go to the base's server; none to the lane's."""
    a, b = upstream_factory("a"), upstream_factory("b")
    tg = gateway_factory(
        [_base(a.url, weight=1), _lane(b.url, "demo-json", JSON_ENGINE, "rel-json", weight=1000)]
    )
    seen: Counter[str] = Counter()
    for i in range(60):
        r = _ask(tg.url, "demo" if i % 2 else None)
        assert r.status_code == 200
        seen[r.headers["x-releasekit-release"]] += 1
        r = webclient.post(
            tg.url + "/v1/templates/chat/chat/completions", json={"variables": {"question": "x"}}
        )
        assert r.status_code == 200
        seen[r.headers["x-releasekit-release"]] += 1
    assert seen == {"rel-base": 120}
    assert b.received == [] and len(a.received) == 120
    assert _sent(a) == "demo"  # the templated default is the base's name


def test_a_lanes_adapter_reaches_only_its_lane_by_the_engine_name(
    upstream_factory: Up, gateway_factory: Gw
) -> None:
    """Plain, streamed and templated requests for the lane's adapter go to the lane's route
    (its release in the answer's header) with the engine's name; the base's server (here
    another one) gets none of them."""
    a, b = upstream_factory("a"), upstream_factory("b")
    tg = gateway_factory([_base(a.url), _lane(b.url, "demo-json", JSON_ENGINE, "rel-json")])
    chat = {"model": "demo-json", "messages": [{"role": "user", "content": "hi"}]}
    for _ in range(10):
        r = webclient.post(tg.url + "/v1/chat/completions", json=chat)
        assert r.status_code == 200 and r.headers["x-releasekit-release"] == "rel-json"
        assert json.loads(b.received[-1]["body"]) == {**chat, "model": JSON_ENGINE}
    r = webclient.post(
        tg.url + "/v1/completions",
        json={"model": "demo-json", "prompt": "hi", "max_tokens": 2, "stream": True},
    )
    assert r.status_code == 200 and "data: [DONE]" in r.text and _sent(b) == JSON_ENGINE
    r = webclient.post(
        tg.url + "/v1/templates/chat/chat/completions",
        json={"model": "demo-json", "variables": {"question": "2+2?"}},
    )
    assert r.status_code == 200 and r.headers["x-releasekit-release"] == "rel-json"
    sent = json.loads(b.received[-1]["body"])
    assert sent["model"] == JSON_ENGINE
    assert sent["messages"] == [{"role": "user", "content": "Q: 2+2?"}]
    assert a.received == [] and len(b.received) == 12


def _three(url: str) -> list[Route]:
    return [
        _base(url),
        _lane(url, "demo-json", JSON_ENGINE, "rel-json"),
        _lane(url, "demo-sql", SQL_ENGINE, "rel-sql"),
    ]


def _answers(tg: ThreadedGateway, a: FakeUpstream) -> dict[str | None, tuple[str, Any]]:
    """Per model asked: (the release that answered, the model name the engine got)."""
    out: dict[str | None, tuple[str, Any]] = {}
    for model in ("demo", None, "demo-json", "demo-sql"):
        got = set()
        for _ in range(8):
            r = _ask(tg.url, model)
            assert r.status_code == 200, r.text
            got.add((r.headers["x-releasekit-release"], _sent(a)))
        assert len(got) == 1, got
        out[model] = got.pop()
    return out


def test_two_lanes_side_by_side_and_one_replaced(
    upstream_factory: Up, gateway_factory: Gw, admin_token: str
) -> None:
    """Two lanes on the base's one engine, each adapter to its own lane; a new table that
    replaces one lane's route (the base's and the other lane's unchanged) changes only that
    lane's answers; the state shows each lane's route with its whole lane's share."""
    a = upstream_factory("a")
    routes = _three(a.url)
    tg = gateway_factory(routes)
    before = _answers(tg, a)
    assert before == {
        "demo": ("rel-base", "demo"),
        None: ("rel-base", None),
        "demo-json": ("rel-json", JSON_ENGINE),
        "demo-sql": ("rel-sql", SQL_ENGINE),
    }
    gw = GatewayClient(tg.url, admin_token=admin_token)
    new_json = _lane(a.url, "demo-json", "demo-json@feedfacecafe", "rel-json-2")
    st = gw.set_routes([routes[0], new_json, routes[2]])
    assert [(r.release_id, r.share) for r in st.routes] == [
        ("rel-base", 1.0),
        ("rel-json-2", 1.0),
        ("rel-sql", 1.0),
    ]
    after = _answers(tg, a)
    assert after == {**before, "demo-json": ("rel-json-2", "demo-json@feedfacecafe")}
    text = webclient.get(tg.url + "/metrics").text  # each lane's release its own series
    for rid in ("rel-base", "rel-json", "rel-json-2", "rel-sql"):
        assert f'release="{rid}",route="completions",status="200"' in text
    assert 'releasekit_gateway_route_weight{env="test",release="rel-sql"} 1.0' in text


def test_a_lanes_adapter_after_its_route_is_gone_is_the_404(
    upstream_factory: Up, gateway_factory: Gw, admin_token: str
) -> None:
    """Its lane's route removed, a request for the adapter gets the OpenAI-shaped 404 naming
    it (and what the environment still serves), never the base's answer; the other lane
    and the base answer as before."""
    a = upstream_factory("a")
    routes = _three(a.url)
    tg = gateway_factory(routes)
    assert _ask(tg.url, "demo-json").headers["x-releasekit-release"] == "rel-json"
    GatewayClient(tg.url, admin_token=admin_token).set_routes([routes[0], routes[2]])
    n = len(a.received)
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = _ask(tg.url, "demo-json", path)
        assert r.status_code == 404, r.text
        err = r.json()["error"]
        assert err["type"] == "NotFoundError" and err["code"] == 404
        assert err["message"].startswith("The model `demo-json` does not exist")
        assert "(this environment serves: demo, demo-sql)" in err["message"]
    r = webclient.post(
        tg.url + "/v1/templates/chat/chat/completions",
        json={"model": "demo-json", "variables": {"question": "x"}},
    )
    assert r.status_code == 404 and "`demo-json`" in r.json()["error"]["message"]
    assert len(a.received) == n
    assert _ask(tg.url, "demo-sql").headers["x-releasekit-release"] == "rel-sql"
    assert _ask(tg.url, "demo").headers["x-releasekit-release"] == "rel-base"


def test_the_model_list_has_the_base_once_and_every_lanes_adapters(
    upstream_factory: Up, gateway_factory: Gw
) -> None:
    """The base's name once (its own adapters next), then each lane's adapters with the
    base as parent; no engine name, no upstream asked. A lane's route alone does not make
    the list fall to the upstream."""
    a = upstream_factory("a")
    base = _base(a.url, adapters={"demo-summ": "demo-summ@111111111111"})
    tg = gateway_factory(
        [_lane(a.url, "demo-sql", SQL_ENGINE, "rel-sql"), base, *_three(a.url)[1:2]]
    )
    r = webclient.get(tg.url + "/v1/models")
    assert r.status_code == 200
    assert [(m["id"], m["parent"]) for m in r.json()["data"]] == [
        ("demo", None),
        ("demo-summ", "demo"),
        ("demo-sql", "demo"),
        ("demo-json", "demo"),
    ]
    assert "@" not in r.text and a.received == []


def test_a_base_mirror_never_copies_a_lanes_requests(
    upstream_factory: Up, gateway_factory: Gw, admin_token: str
) -> None:
    """A base shadow at share 1: each base request is copied; a lane's request is not
    (and counts as no drop); a lane's own mirror copies only its lane's requests."""
    a, s = upstream_factory("a"), upstream_factory("s")
    routes = _three(a.url)
    tg = gateway_factory(routes)
    gw = GatewayClient(tg.url, admin_token=admin_token)
    shadow = _base(s.url, "rel-shadow")
    gw.set_routes(RouteTable(routes=routes, mirror=Mirror(route=shadow, share=1.0, floor=False)))
    for asked in ("demo-json", "demo-sql", "demo-json"):
        assert _ask(tg.url, asked).status_code == 200
    assert _ask(tg.url, "demo").status_code == 200
    assert wait_until(lambda: len(s.received) == 1)
    time.sleep(0.2)
    assert len(s.received) == 1 and _sent(s) == "demo"
    st = gw.state()
    assert (st.mirrored, st.mirror_dropped) == (1, 0)
    cand = _lane(s.url, "demo-json", "demo-json@dddddddddddd", "rel-json-cand")
    gw.set_routes(RouteTable(routes=routes, mirror=Mirror(route=cand, share=1.0, floor=False)))
    for maybe in ("demo", None, "demo-sql", "demo-json"):
        assert _ask(tg.url, maybe).status_code == 200
    assert wait_until(lambda: len(s.received) == 2)
    time.sleep(0.2)
    assert len(s.received) == 2 and _sent(s) == "demo-json@dddddddddddd"
    st = gw.state()
    assert (st.mirrored, st.mirror_dropped) == (1, 0)


def test_a_lapsed_lease_keeps_the_lanes_its_fallback_does_not_name(
    upstream_factory: Up, gateway_factory: Gw, admin_token: str
) -> None:
    """A base canary's leased table whose fallback is the base's stable route only: when
    the lease lapses, the base goes back to stable and the lanes keep their routes."""
    a, c = upstream_factory("a"), upstream_factory("c")
    routes = _three(a.url)
    tg = gateway_factory(routes)
    gw = GatewayClient(tg.url, admin_token=admin_token)
    canary = _base(c.url, "rel-canary")
    gw.set_routes(RouteTable(routes=[*routes, canary], lease_s=0.3, fallback=[routes[0]]))
    assert wait_until(lambda: gw.state().lease_expiries == 1, timeout_s=10)
    st = gw.state()
    assert [r.release_id for r in st.routes] == ["rel-base", "rel-json", "rel-sql"]
    assert _ask(tg.url, "demo-json").headers["x-releasekit-release"] == "rel-json"
    assert _ask(tg.url, "demo").headers["x-releasekit-release"] == "rel-base"
    lane2 = _lane(a.url, "demo-json", "demo-json@eeeeeeeeeeee", "rel-json-2")
    assert other_lanes_kept([routes[1]], [routes[0], lane2, routes[2]]) == [
        routes[1],
        routes[0],
        routes[2],
    ]
    assert other_lanes_kept(routes, [canary]) == routes


def test_a_routed_lane_release_is_not_drained(
    upstream_factory: Up, gateway_factory: Gw, admin_token: str
) -> None:
    """A lane's release is routed: a drain of it is refused until its route is gone."""
    a = upstream_factory("a")
    routes = _three(a.url)
    tg = gateway_factory(routes)
    gw = GatewayClient(tg.url, admin_token=admin_token)
    with pytest.raises(GatewayRequestError) as info:
        gw.drain("rel-json", timeout_s=0.1)
    assert info.value.status == 409
    gw.set_routes([routes[0], routes[2]])
    assert gw.drain("rel-json", timeout_s=1).drained
