"""LoRA adapters at the gateway: a request's `model` routed to the engine's name for the
routed release's adapter, the base's name untouched, and any other name (an engine's own
adapter name included) refused with an OpenAI-style 404 that reaches no upstream; a route
built from a release carries its adapters; the `ray` target refuses adapters at once."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import webclient
from gateway_fakes import FakeUpstream, wait_until
from pydantic import ValidationError

from releasekit.deploy.gateway import Mirror, PromptTemplate, Route, RouteTable, ThreadedGateway
from releasekit.deploy.gateway_client import GatewayClient
from releasekit.deploy.ray.target import (
    NO_ADAPTERS,
    AdaptersNotCarriedError,
    RayTarget,
    refuse_adapters,
    release_app_args,
)
from releasekit.deploy.target import DeployError, ReleaseSpec, Upstream

Up = Callable[[str], FakeUpstream]
Gw = Callable[..., ThreadedGateway]
ENGINE = "demo-json@0123456789ab"
ADAPTERS = {"demo-json": ENGINE}
PROMPTS = {"chat": PromptTemplate(system=None, user="Q: {{ question }}")}


def _route(up: FakeUpstream, release_id: str = "rel-a", **kw: Any) -> Route:
    return Route(
        release_id=release_id,
        base_url=up.url,
        model="demo",
        adapters=dict(ADAPTERS),
        prompts=PROMPTS,
        **kw,
    )


def _sent_model(up: FakeUpstream) -> Any:
    return json.loads(up.received[-1]["body"])["model"]


def test_an_adapter_name_reaches_the_engine_by_its_engine_name(
    upstream_factory: Up, gateway_factory: Gw
) -> None:
    """Plain chat and completions, streamed or not, and the templated route: a request for
    the adapter goes upstream with the engine's name, the rest of its body kept."""
    a = upstream_factory("a")
    tg = gateway_factory([_route(a)])
    chat = {"model": "demo-json", "messages": [{"role": "user", "content": "hi"}], "n": 1}
    r = webclient.post(tg.url + "/v1/chat/completions", json=chat)
    assert r.status_code == 200 and r.headers["x-releasekit-release"] == "rel-a"
    assert json.loads(a.received[-1]["body"]) == {**chat, "model": ENGINE}
    r = webclient.post(
        tg.url + "/v1/completions",
        json={"model": "demo-json", "prompt": "hi", "max_tokens": 2, "stream": True},
    )
    assert r.status_code == 200 and "data: [DONE]" in r.text
    assert _sent_model(a) == ENGINE
    r = webclient.post(
        tg.url + "/v1/templates/chat/chat/completions",
        json={"model": "demo-json", "variables": {"question": "2+2?"}, "max_tokens": 3},
    )
    assert r.status_code == 200
    sent = json.loads(a.received[-1]["body"])
    assert sent["model"] == ENGINE
    assert sent["messages"] == [{"role": "user", "content": "Q: 2+2?"}]


def test_the_base_name_and_no_name_pass_unchanged(
    upstream_factory: Up, gateway_factory: Gw
) -> None:
    """The base's model name is forwarded byte for byte; a templated request without a
    model gets the base's; a body without `model` on a plain route is not refused."""
    a = upstream_factory("a")
    tg = gateway_factory([_route(a)])
    raw = b'{"model":"demo",  "prompt":"hi", "max_tokens": 2}'
    r = webclient.post(
        tg.url + "/v1/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert r.status_code == 200 and a.received[-1]["body"] == raw
    r = webclient.post(
        tg.url + "/v1/templates/chat/chat/completions", json={"variables": {"question": "x"}}
    )
    assert r.status_code == 200 and _sent_model(a) == "demo"
    r = webclient.post(tg.url + "/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 200 and "model" not in json.loads(a.received[-1]["body"])
    assert webclient.get(tg.url + "/v1/models").status_code == 200


@pytest.mark.parametrize("asked", ["nope", ENGINE, "demo-json@", 7])
def test_an_unknown_or_engine_internal_name_is_a_404_that_reaches_no_upstream(
    upstream_factory: Up, gateway_factory: Gw, asked: Any
) -> None:
    """A model the route does not serve, the engine's own name for an adapter among them,
    gets the OpenAI-shaped 404 from the gateway, on plain and templated routes alike."""
    a = upstream_factory("a")
    tg = gateway_factory([_route(a)])
    for path, body in (
        ("/v1/chat/completions", {"model": asked, "messages": []}),
        ("/v1/templates/chat/chat/completions", {"model": asked, "variables": {"question": "x"}}),
    ):
        r = webclient.post(tg.url + path, json=body)
        assert r.status_code == 404, r.text
        err = r.json()["error"]
        assert err["type"] == "NotFoundError" and err["code"] == 404
        assert err["message"].startswith(f"The model `{asked if isinstance(asked, str) else 7}`")
        assert "does not exist" in err["message"] and "demo, demo-json" in err["message"]
        assert ENGINE not in err["message"] or asked == ENGINE
    assert a.received == []
    text = webclient.get(tg.url + "/metrics").text
    assert 'reason="unknown_model"' in text


def test_a_route_without_a_model_is_never_refused(
    upstream_factory: Up, gateway_factory: Gw
) -> None:
    """Without `model` on the route the gateway cannot tell names apart: it forwards."""
    a = upstream_factory("a")
    tg = gateway_factory([Route(release_id="r", base_url=a.url, adapters=dict(ADAPTERS))])
    r = webclient.post(tg.url + "/v1/completions", json={"model": "other", "prompt": "x"})
    assert r.status_code == 200 and _sent_model(a) == "other"
    webclient.post(tg.url + "/v1/completions", json={"model": "demo-json", "prompt": "x"})
    assert _sent_model(a) == ENGINE


def test_each_route_maps_to_its_own_engine_name(
    upstream_factory: Up, gateway_factory: Gw, admin_token: str
) -> None:
    """A switch to a release with another version of the adapter maps the same client name
    to the new engine name; a rollback's table maps it back to the old one."""
    a = upstream_factory("a")
    old = _route(a, "rel-old")
    new = Route(
        release_id="rel-new",
        base_url=a.url,
        model="demo",
        adapters={"demo-json": "demo-json@ba9876543210"},
    )
    tg = gateway_factory([old])
    body = {"model": "demo-json", "prompt": "x"}
    gw = GatewayClient(tg.url, admin_token=admin_token)
    st = gw.set_routes([new])
    assert st.routes[0].adapters == {"demo-json": "demo-json@ba9876543210"}
    webclient.post(tg.url + "/v1/completions", json=body)
    assert _sent_model(a) == "demo-json@ba9876543210"
    gw.set_routes([old])
    r = webclient.post(tg.url + "/v1/completions", json=body)
    assert r.headers["x-releasekit-release"] == "rel-old" and _sent_model(a) == ENGINE
    r = webclient.post(tg.url + "/v1/completions", json={**body, "model": "demo-json@ba9876543210"})
    assert r.status_code == 404


def test_a_mirror_copy_gets_its_own_routes_engine_name(
    upstream_factory: Up, gateway_factory: Gw, admin_token: str
) -> None:
    """A shadow's copy of an adapter request goes to the candidate with the candidate's
    engine name; a request for a model the candidate lacks is not copied."""
    a, b = upstream_factory("a"), upstream_factory("b")
    stable = _route(a, "rel-a")
    cand = Route(
        release_id="rel-b", base_url=b.url, model="demo", adapters={"demo-json": "demo-json@bbbb"}
    )
    tg = gateway_factory([stable])
    GatewayClient(tg.url, admin_token=admin_token).set_routes(
        RouteTable(routes=[stable], mirror=Mirror(route=cand, share=1.0, floor=False))
    )
    r = webclient.post(tg.url + "/v1/completions", json={"model": "demo-json", "prompt": "x"})
    assert r.status_code == 200 and _sent_model(a) == ENGINE
    assert wait_until(lambda: len(b.received) == 1)
    assert _sent_model(b) == "demo-json@bbbb"
    lone = Route(release_id="rel-c", base_url=b.url, model="demo")
    GatewayClient(tg.url, admin_token=admin_token).set_routes(
        RouteTable(routes=[stable], mirror=Mirror(route=lone, share=1.0, floor=False))
    )
    r = webclient.post(tg.url + "/v1/completions", json={"model": "demo-json", "prompt": "y"})
    assert r.status_code == 200 and _sent_model(a) == ENGINE
    webclient.post(tg.url + "/v1/completions", json={"model": "demo", "prompt": "z"})
    assert wait_until(lambda: len(b.received) == 2)
    assert _sent_model(b) == "demo"  # the base request was copied, the adapter one not


def test_an_adapter_cannot_take_the_base_name() -> None:
    with pytest.raises(ValidationError, match="base's model name"):
        Route(release_id="r", base_url="http://127.0.0.1:1", model="demo", adapters={"demo": "x"})


def _spec(**kw: Any) -> ReleaseSpec:
    return ReleaseSpec(
        release_id="f" * 64,
        name="demo",
        serving_key="k" * 64,
        model_dir="/nonexistent",
        served_name="demo",
        engine_args={"enable-lora": ""},
        **kw,
    )


def test_a_releases_route_carries_its_adapters() -> None:
    """The route a target builds for a release maps its adapters' names."""
    spec = _spec(adapters=dict(ADAPTERS), adapter_dirs={ENGINE: "/store/abc"})
    up = Upstream(release_id="e" * 64, serving_key="k", base_url="http://127.0.0.1:1", model="demo")
    route = up.route(spec)
    assert route.adapters == ADAPTERS and route.release_id == spec.release_id
    assert up.route().adapters == {}


def test_the_ray_target_refuses_adapters_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A release with adapters: one line, a failed start, and the cluster never joined;
    a reused application and its Serve config export are refused the same way; a release
    without adapters passes."""
    target = RayTarget.__new__(RayTarget)

    def joined() -> str:
        raise AssertionError("the cluster was joined")

    monkeypatch.setattr(target, "connect", joined)
    spec = _spec(adapters=dict(ADAPTERS), adapter_dirs={ENGINE: "/store/abc"})
    with pytest.raises(AdaptersNotCarriedError) as info:
        target.start(spec)
    assert str(info.value).splitlines() == [NO_ADAPTERS]
    assert isinstance(info.value, DeployError)
    up = Upstream(release_id="e" * 64, serving_key="k", base_url="http://127.0.0.1:1", model="demo")
    with pytest.raises(AdaptersNotCarriedError):
        target.load_adapters(up, spec)
    assert target.load_adapters(up, _spec()) == []
    refuse_adapters(_spec())
    with pytest.raises(AdaptersNotCarriedError):  # `export kuberay` builds the same args
        release_app_args(None, "staging", None, spec)  # type: ignore[arg-type]
    with pytest.raises(AdaptersNotCarriedError):
        refuse_adapters(_spec(adapters_problem="adapter demo-json ... is not the one locked"))
