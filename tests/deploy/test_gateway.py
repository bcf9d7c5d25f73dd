"""The gateway as a client and a deployer see it: a real uvicorn server in front of fake
upstreams that stream, hang, fail or refuse on purpose."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import webclient
from gateway_fakes import FakeUpstream, refused_url
from prometheus_client.parser import text_string_to_metric_families

from releasekit._support.http import http_client
from releasekit.deploy.gateway import (
    GatewayConfig,
    GatewayConfigError,
    PromptTemplate,
    Route,
    ThreadedGateway,
    load_config,
)
from releasekit.deploy.gateway.routing import Table
from releasekit.deploy.gateway_client import GatewayClient
from releasekit.errors import ReleasekitError

Up = Callable[[str], FakeUpstream]
Gw = Callable[..., ThreadedGateway]
STREAM = {"model": "demo", "prompt": "hi", "max_tokens": 4, "stream": True}
PLAIN = {"model": "demo", "prompt": "hi", "max_tokens": 4}


def metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the gateway's /metrics, keyed by (name, sorted labels)."""
    text = webclient.get(url + "/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def sample(m: dict[Any, float], name: str, **labels: str) -> float:
    """The value of one sample (0.0 when absent)."""
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def sse_lines(resp: httpx.Response) -> list[str]:
    return [ln for ln in resp.iter_lines() if ln.startswith("data:")]


def test_stream_is_relayed_chunk_by_chunk(upstream_factory: Up, gateway_factory: Gw) -> None:
    """The client reads the first SSE chunk while the upstream still holds the rest."""
    a = upstream_factory("a")
    tg = gateway_factory([Route(release_id="rel-a", base_url=a.url)])
    with (
        http_client(base_url=tg.url, timeout=5) as c,
        c.stream(
            "POST",
            "/v1/completions",
            json=STREAM,
            headers={"x-fake-hold": "h", "x-fake-chunks": "3"},
        ) as r,
    ):
        assert r.status_code == 200
        assert r.headers["x-releasekit-release"] == "rel-a"
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        first = next(ln for ln in lines if ln.startswith("data:"))
        assert '"t0"' in first
        assert a.finished == []  # the upstream has not finished: nothing was buffered
        a.release("h")
        rest = [ln for ln in lines if ln.startswith("data:")]
    assert rest[-1] == "data: [DONE]"
    assert len(rest) == 3  # t1, t2, [DONE]


def test_non_stream_passes_status_body_and_headers(
    upstream_factory: Up, gateway_factory: Gw
) -> None:
    """A non-stream answer keeps its status, body and end-to-end headers; hop-by-hop
    headers are not forwarded to the upstream; the path and query are kept."""
    a = upstream_factory("a")
    tg = gateway_factory([Route(release_id="rel-a", base_url=a.url)])
    r = webclient.post(
        tg.url + "/v1/completions?x=1",
        json=PLAIN,
        headers={"x-fake-status": "418", "x-custom": "kept", "te": "trailers"},
    )
    assert r.status_code == 418
    assert r.json()["upstream"] == "a"
    assert r.headers["x-upstream"] == "a"
    assert r.headers["x-releasekit-release"] == "rel-a"
    got = a.received[-1]
    assert got["query"] == "x=1"
    assert json.loads(got["body"]) == PLAIN
    assert got["headers"]["x-custom"] == "kept"
    assert "te" not in got["headers"]


def test_switch_is_atomic_and_in_flight_stream_finishes_on_old(
    upstream_factory: Up, gateway_factory: Gw, admin_token: str
) -> None:
    """After a switch new requests go to the new upstream while a stream admitted before it
    finishes on the old one; wait_drained is False until it ends, then True."""
    a, b = upstream_factory("a"), upstream_factory("b")
    tg = gateway_factory([Route(release_id="rel-a", base_url=a.url)])
    gc = GatewayClient(tg.url, admin_token=admin_token)
    got: list[str] = []

    def stream_on_a() -> None:
        with (
            http_client(timeout=10) as c,
            c.stream(
                "POST", tg.url + "/v1/completions", json=STREAM, headers={"x-fake-hold": "old"}
            ) as r,
        ):
            got.extend(sse_lines(r))

    t = threading.Thread(target=stream_on_a)
    t.start()
    deadline = time.monotonic() + 5
    while gc.state().in_flight.get("rel-a", 0) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    state = gc.set_routes([Route(release_id="rel-b", base_url=b.url)])
    assert [r.release_id for r in state.routes] == ["rel-b"]
    assert state.in_flight == {"rel-a": 1}
    assert webclient.get(tg.url + "/v1/models").headers["x-releasekit-release"] == "rel-b"
    assert gc.wait_drained("rel-a", deadline_s=0.2) is False
    a.release("old")
    assert gc.wait_drained("rel-a", deadline_s=5) is True
    t.join(5)
    assert got[-1] == "data: [DONE]"
    assert all('"upstream": "a"' in ln for ln in got[:-1])
    assert gc.state().in_flight["rel-a"] == 0
    with pytest.raises(ReleasekitError, match="still carries traffic"):
        gc.wait_drained("rel-b", deadline_s=0.1)


def test_weighted_split_is_random_in_proportion(upstream_factory: Up, gateway_factory: Gw) -> None:
    """Weights 3:1 send about 3 of 4 requests to the first release, chosen at random: no
    fixed sequence a client could count along to aim at the canary."""
    a, b = upstream_factory("a"), upstream_factory("b")
    routes = [
        Route(release_id="rel-a", base_url=a.url, weight=3),
        Route(release_id="rel-b", base_url=b.url, weight=1),
    ]
    tg = gateway_factory(routes)
    seen = {"rel-a": 0, "rel-b": 0}
    with http_client(base_url=tg.url) as c:
        for _ in range(40):
            seen[c.get("/v1/models").headers["x-releasekit-release"]] += 1
    assert sum(seen.values()) == 40 and seen["rel-a"] > 0 and seen["rel-b"] > 0
    table = Table(1, routes)
    runs = [[table.pick().release_id for _ in range(4000)] for _ in range(2)]  # type: ignore[union-attr]
    for run in runs:
        assert 2800 < run.count("rel-a") < 3200  # 3000 expected, sd 27
    assert runs[0] != runs[1]
    m = metrics(tg.url)
    assert sample(m, "releasekit_gateway_route_weight", env="test", release="rel-a") == 0.75
    assert sample(m, "releasekit_gateway_info", env="test", release="rel-b", weight="0.25") == 1


def test_client_key_401_and_open_endpoints(
    upstream_factory: Up, gateway_factory: Gw, admin_token: str
) -> None:
    """With api_keys set, /v1 answers 401 (OpenAI-style) to a missing or wrong key or to the
    admin token; /health and /metrics stay open; the upstream never sees the client key."""
    a = upstream_factory("a")
    tg = gateway_factory([Route(release_id="rel-a", base_url=a.url)], api_keys=["k-one", "k-two"])
    with http_client(base_url=tg.url) as c:
        for headers in (
            {},
            {"authorization": "Bearer nope"},
            {"authorization": "k-one"},
            {"authorization": f"Bearer {admin_token}"},
        ):
            r = c.get("/v1/models", headers=headers)
            assert r.status_code == 401
            assert r.json()["error"]["code"] == "invalid_api_key"
        assert c.get("/v1/models", headers={"authorization": "Bearer k-two"}).status_code == 200
        assert "authorization" not in a.received[-1]["headers"]
        assert c.get("/health").status_code == 200
        assert c.get("/metrics").status_code == 200
    m = metrics(tg.url)
    assert sample(m, "releasekit_gateway_rejections_total", env="test", reason="auth") == 4


def test_upstream_key_replaces_client_key(upstream_factory: Up, gateway_factory: Gw) -> None:
    """A route's api_key is what the upstream gets."""
    a = upstream_factory("a")
    tg = gateway_factory(
        [Route(release_id="rel-a", base_url=a.url, api_key="up-key")], api_keys=["k"]
    )
    webclient.get(tg.url + "/v1/models", headers={"authorization": "Bearer k"})
    assert a.received[-1]["headers"]["authorization"] == "Bearer up-key"


def test_admin_api_needs_admin_token(
    upstream_factory: Up, gateway_factory: Gw, admin_token: str
) -> None:
    """/admin/* answers 401 without the admin token, even to a valid client key, and the
    client raises GatewayAuthError on a wrong token."""
    tg = gateway_factory([], api_keys=["client-key"])
    with http_client(base_url=tg.url) as c:
        assert c.get("/admin/state").status_code == 401
        assert (
            c.get("/admin/state", headers={"authorization": "Bearer client-key"}).status_code == 401
        )
        body: dict[str, list[Any]] = {"routes": []}
        assert c.put("/admin/routes", json=body).status_code == 401
        assert c.post("/admin/drain", json={"release_id": "x"}).status_code == 401
        ok = c.get("/admin/state", headers={"authorization": f"Bearer {admin_token}"})
        assert ok.status_code == 200
    from releasekit.deploy.gateway import GatewayAuthError

    with pytest.raises(GatewayAuthError):
        GatewayClient(tg.url, admin_token="wrong-token-wrong-token").state()


def test_invalid_route_table_is_422_and_changes_nothing(
    upstream_factory: Up, gateway_factory: Gw, admin_token: str
) -> None:
    """PUT /admin/routes with duplicate ids or a bad URL is refused with every problem
    listed, and the live table stays."""
    from releasekit.deploy.gateway import GatewayRequestError

    a = upstream_factory("a")
    tg = gateway_factory([Route(release_id="rel-a", base_url=a.url)])
    gc = GatewayClient(tg.url, admin_token=admin_token)
    bad = {"routes": [{"release_id": "x", "base_url": "ftp://h/v1"}]}
    r = webclient.put(
        tg.url + "/admin/routes", json=bad, headers={"authorization": f"Bearer {admin_token}"}
    )
    assert r.status_code == 422
    assert "routes.0.base_url" in r.json()["error"]["problems"][0]
    with pytest.raises(GatewayRequestError) as exc:
        gc._call(
            "PUT",
            "/admin/routes",
            json={
                "routes": [
                    {"release_id": "x", "base_url": a.url},
                    {"release_id": "x", "base_url": a.url},
                ]
            },
        )
    assert exc.value.status == 422 and "appears twice" in str(exc.value)
    assert [r.release_id for r in gc.state().routes] == ["rel-a"]
    assert gc.state().generation == 1


def test_rate_limit_429_per_key(upstream_factory: Up, gateway_factory: Gw) -> None:
    """Past its burst a key gets 429 with Retry-After; another key has its own bucket."""
    a = upstream_factory("a")
    tg = gateway_factory(
        [Route(release_id="rel-a", base_url=a.url)],
        api_keys=["k1", "k2"],
        rate_limit={"rps": 0.01, "burst": 2},
    )
    with http_client(base_url=tg.url) as c:
        k1 = {"authorization": "Bearer k1"}
        assert [c.get("/v1/models", headers=k1).status_code for _ in range(3)] == [200, 200, 429]
        r = c.get("/v1/models", headers=k1)
        assert r.status_code == 429
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        assert c.get("/v1/models", headers={"authorization": "Bearer k2"}).status_code == 200


def test_queue_limit_503_with_retry_after(
    upstream_factory: Up, gateway_factory: Gw, admin_token: str
) -> None:
    """With one in-flight slot taken, a second request waits max_queue_wait_s and gets 503
    with Retry-After; once the slot frees, requests pass again."""
    a = upstream_factory("a")
    tg = gateway_factory(
        [Route(release_id="rel-a", base_url=a.url)], max_in_flight=1, max_queue_wait_s=0.2
    )
    gc = GatewayClient(tg.url, admin_token=admin_token)
    done: list[int] = []

    def hold() -> None:
        with (
            http_client(timeout=10) as c,
            c.stream(
                "POST", tg.url + "/v1/completions", json=STREAM, headers={"x-fake-hold": "slot"}
            ) as r,
        ):
            sse_lines(r)
            done.append(r.status_code)

    t = threading.Thread(target=hold)
    t.start()
    while gc.state().in_flight_total == 0:
        time.sleep(0.01)
    r = webclient.get(tg.url + "/v1/models", timeout=5)
    assert r.status_code == 503
    assert r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "queue_full"
    a.release("slot")
    t.join(5)
    assert done == [200]
    assert webclient.get(tg.url + "/v1/models").status_code == 200
    m = metrics(tg.url)
    assert sample(m, "releasekit_gateway_rejections_total", env="test", reason="queue_full") == 1


def test_queued_request_gets_the_freed_slot(
    upstream_factory: Up, gateway_factory: Gw, admin_token: str
) -> None:
    """A request queued behind a full gateway is served once a slot frees within its wait."""
    a = upstream_factory("a")
    tg = gateway_factory(
        [Route(release_id="rel-a", base_url=a.url)], max_in_flight=1, max_queue_wait_s=10
    )
    gc = GatewayClient(tg.url, admin_token=admin_token)
    t = threading.Thread(
        target=lambda: webclient.post(
            tg.url + "/v1/completions", json=STREAM, timeout=10, headers={"x-fake-hold": "q"}
        )
    )
    t.start()
    while gc.state().in_flight_total == 0:
        time.sleep(0.01)
    result: list[int] = []
    t2 = threading.Thread(
        target=lambda: result.append(webclient.get(tg.url + "/v1/models", timeout=10).status_code)
    )
    t2.start()
    while gc.state().queued == 0:
        time.sleep(0.01)
    a.release("q")
    t.join(5)
    t2.join(5)
    assert result == [200]


def test_hung_upstream_gives_504(upstream_factory: Up, gateway_factory: Gw) -> None:
    """An upstream that never answers headers gets 504 after the first-byte timeout. For a
    stream that is the server's timeout; a non-stream request's first byte comes after the
    whole generation the client asked for, so its 504 is counted as `client_timeout`."""
    a = upstream_factory("a")
    tg = gateway_factory(
        [Route(release_id="rel-a", base_url=a.url)], upstream_first_byte_timeout_s=0.3
    )
    hang = {"x-fake-hang": "1"}
    r = webclient.post(tg.url + "/v1/completions", json=STREAM, headers=hang, timeout=10)
    assert r.status_code == 504
    assert r.headers["x-releasekit-release"] == "rel-a"
    r = webclient.post(tg.url + "/v1/completions", json=PLAIN, headers=hang, timeout=10)
    assert r.status_code == 504
    m = metrics(tg.url)
    assert sample(m, "releasekit_gateway_rejections_total", env="test", reason="timeout") == 1
    lab = {"env": "test", "release": "rel-a", "route": "completions"}
    assert sample(m, "releasekit_gateway_requests_total", **lab, status="504") == 1
    assert sample(m, "releasekit_gateway_requests_total", **lab, status="client_timeout") == 1
    assert sample(m, "releasekit_gateway_in_flight", env="test", release="rel-a") == 0


def test_stalled_stream_ends_with_sse_error(upstream_factory: Up, gateway_factory: Gw) -> None:
    """A stream that goes silent mid-way ends with an SSE error event, counted as a timeout."""
    a = upstream_factory("a")
    tg = gateway_factory([Route(release_id="rel-a", base_url=a.url)], stream_idle_timeout_s=0.3)
    with (
        http_client(timeout=10) as c,
        c.stream(
            "POST",
            tg.url + "/v1/completions",
            json=STREAM,
            headers={"x-fake-chunks": "5", "x-fake-stall-after": "2"},
        ) as r,
    ):
        lines = sse_lines(r)
    assert ['"t0"' in lines[0], '"t1"' in lines[1]] == [True, True]
    err = json.loads(lines[-1][len("data: ") :])["error"]
    assert err["code"] == "timeout"
    m = metrics(tg.url)
    assert (
        sample(
            m,
            "releasekit_gateway_stream_errors_total",
            env="test",
            release="rel-a",
            reason="timeout",
        )
        == 1
    )
    assert sample(m, "releasekit_gateway_rejections_total", env="test", reason="timeout") == 1


def test_refused_upstream_gives_502(gateway_factory: Gw) -> None:
    """Connection refused answers 502 with a JSON error, counted as upstream_error."""
    tg = gateway_factory([Route(release_id="rel-x", base_url=refused_url())])
    r = webclient.post(tg.url + "/v1/completions", json=PLAIN)
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "upstream_error"
    m = metrics(tg.url)
    assert (
        sample(m, "releasekit_gateway_rejections_total", env="test", reason="upstream_error") == 1
    )


def test_health_follows_the_route_table(gateway_factory: Gw, admin_token: str) -> None:
    """/health is 503 with no route carrying traffic and 200 once one does; /v1 without a
    route is 503."""
    tg = gateway_factory([])
    assert webclient.get(tg.url + "/health").status_code == 503
    assert webclient.get(tg.url + "/v1/models").status_code == 503
    GatewayClient(tg.url, admin_token=admin_token).set_routes(
        [Route(release_id="r", base_url=refused_url())]
    )
    assert webclient.get(tg.url + "/health").status_code == 200


def test_metrics_after_known_traffic(upstream_factory: Up, gateway_factory: Gw) -> None:
    """Three streams and one upstream 500 show up with exact counts and histogram counts."""
    a = upstream_factory("a")
    tg = gateway_factory([Route(release_id="rel-a", base_url=a.url)])
    with http_client(base_url=tg.url) as c:
        for _ in range(3):
            with c.stream("POST", "/v1/completions", json=STREAM) as r:
                assert len(sse_lines(r)) == 4
        assert (
            c.post("/v1/completions", json=PLAIN, headers={"x-fake-status": "500"}).status_code
            == 500
        )
    m = metrics(tg.url)
    lab = {"env": "test", "release": "rel-a"}
    assert (
        sample(m, "releasekit_gateway_requests_total", **lab, route="completions", status="200")
        == 3
    )
    assert (
        sample(m, "releasekit_gateway_requests_total", **lab, route="completions", status="500")
        == 1
    )
    assert sample(m, "releasekit_gateway_ttft_seconds_count", **lab) == 3
    assert sample(m, "releasekit_gateway_e2e_seconds_count", **lab) == 4
    assert sample(m, "releasekit_gateway_upstream_wait_seconds_count", **lab) == 4
    assert sample(m, "releasekit_gateway_queue_wait_seconds_count", env="test") == 4
    assert 3 <= sample(m, "releasekit_gateway_stream_chunks_total", **lab) <= 12
    assert sample(m, "releasekit_gateway_in_flight", **lab) == 0
    assert sample(m, "releasekit_gateway_ttft_seconds_bucket", **lab, le="30.0") == 3
    assert sample(m, "releasekit_gateway_routes_generation", env="test") == 1


def test_templated_route_renders_the_live_release(
    upstream_factory: Up, gateway_factory: Gw, admin_token: str
) -> None:
    """The templated route renders the pinned release's templates; a prompt-only route
    change (same base_url) swaps what is rendered; plain /v1 bodies pass untouched."""
    a = upstream_factory("a")
    v1 = {"qa": PromptTemplate(system="Be {{ tone }}.", user="Q: {{ question }}")}
    v2 = {"qa": PromptTemplate(system=None, user="Question: {{question}}\nAnswer:")}
    tg = gateway_factory([Route(release_id="p1", base_url=a.url, model="demo", prompts=v1)])
    req = {"variables": {"tone": "brief", "question": "2+2?"}, "max_tokens": 3}
    r = webclient.post(tg.url + "/v1/templates/qa/chat/completions", json=req)
    assert r.status_code == 200 and r.headers["x-releasekit-release"] == "p1"
    sent = a.received[-1]
    assert sent["path"] == "/v1/chat/completions"
    assert json.loads(sent["body"]) == {
        "max_tokens": 3,
        "model": "demo",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Q: 2+2?"},
        ],
    }
    GatewayClient(tg.url, admin_token=admin_token).set_routes(
        [Route(release_id="p2", base_url=a.url, model="demo", prompts=v2)]
    )
    r = webclient.post(tg.url + "/v1/templates/qa/chat/completions", json=req)
    assert r.headers["x-releasekit-release"] == "p2"
    assert json.loads(a.received[-1]["body"])["messages"] == [
        {"role": "user", "content": "Question: 2+2?\nAnswer:"}
    ]
    raw = b'{"model":"demo",  "messages":[{"role":"user","content":"{{ question }}"}]}'
    webclient.post(
        tg.url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert a.received[-1]["body"] == raw


def test_templated_route_errors_name_the_problem(upstream_factory: Up, gateway_factory: Gw) -> None:
    """Unknown prompt, missing variables and a body with messages are 400s naming them."""
    a = upstream_factory("a")
    prompts = {"qa": PromptTemplate(system="{{ tone }}", user="{{ question }}")}
    tg = gateway_factory([Route(release_id="p1", base_url=a.url, prompts=prompts)])
    url = tg.url + "/v1/templates/{}/chat/completions"
    r = webclient.post(url.format("nope"), json={"variables": {}})
    assert r.status_code == 400 and "'nope'" in r.json()["error"]["message"]
    assert "known: qa" in r.json()["error"]["message"]
    r = webclient.post(url.format("qa"), json={"variables": {"tone": "x"}})
    assert r.status_code == 400 and "question" in r.json()["error"]["message"]
    r = webclient.post(url.format("qa"), json={"variables": {}})
    assert "question, tone" in r.json()["error"]["message"]
    r = webclient.post(
        url.format("qa"), json={"variables": {"tone": "x", "question": "y"}, "messages": []}
    )
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    assert a.received == []


def test_feedback_is_counted_per_release(upstream_factory: Up, gateway_factory: Gw) -> None:
    """Feedback on a response id (non-stream or streamed) counts once per release; unknown
    ids are 404, malformed bodies 400."""
    a = upstream_factory("a")
    tg = gateway_factory([Route(release_id="rel-a", base_url=a.url)])
    with http_client(base_url=tg.url) as c:
        rid = c.post("/v1/completions", json=PLAIN).json()["id"]
        with c.stream("POST", "/v1/chat/completions", json={**STREAM, "messages": []}) as r:
            first = sse_lines(r)[0]
        sid = json.loads(first[len("data: ") :])["id"]
        ok = c.post("/v1/feedback", json={"response_id": rid, "score": "up"})
        assert ok.status_code == 200
        assert ok.json() == {
            "response_id": rid,
            "release_id": "rel-a",
            "score": 1.0,
            "label": "positive",
            "counted": True,
        }
        assert (
            c.post("/v1/feedback", json={"response_id": rid, "score": -1}).json()["counted"]
            is False
        )
        assert c.post("/v1/feedback", json={"response_id": sid, "score": -0.5}).status_code == 200
        assert c.post("/v1/feedback", json={"response_id": "nope", "score": 1}).status_code == 404
        for bad in (
            {"response_id": rid},
            {"response_id": rid, "score": 2},
            {"response_id": rid, "score": "meh"},
            {"score": 1},
        ):
            assert c.post("/v1/feedback", json=bad).status_code == 400, bad
        assert c.post("/v1/feedback", content=b"{not json").status_code == 400
    m = metrics(tg.url)
    lab = {"env": "test", "release": "rel-a"}
    assert sample(m, "releasekit_gateway_feedback_total", **lab, score="positive") == 1
    assert sample(m, "releasekit_gateway_feedback_total", **lab, score="negative") == 1


def test_client_disconnect_stops_the_upstream(
    upstream_factory: Up, gateway_factory: Gw, admin_token: str
) -> None:
    """A client that hangs up mid-stream frees its slot and the upstream stream is closed."""
    a = upstream_factory("a")
    tg = gateway_factory([Route(release_id="rel-a", base_url=a.url)])
    with (
        http_client(timeout=10) as c,
        c.stream(
            "POST",
            tg.url + "/v1/completions",
            json=STREAM,
            headers={"x-fake-chunks": "500", "x-fake-delay": "0.01"},
        ) as r,
    ):
        next(r.iter_lines())
    gc = GatewayClient(tg.url, admin_token=admin_token)
    deadline = time.monotonic() + 5
    while (gc.state().in_flight_total or not a.cancelled) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert gc.state().in_flight_total == 0
    assert a.cancelled and not a.finished


def test_config_file_errors_list_every_field(tmp_path: Any) -> None:
    """A bad config file raises GatewayConfigError naming each field."""
    p = tmp_path / "gw.json"
    p.write_text(json.dumps({"env": "", "admin_token": "short", "max_in_flight": 0}))
    with pytest.raises(GatewayConfigError) as exc:
        load_config(p)
    text = str(exc.value)
    for f in ("env", "admin_token", "max_in_flight"):
        assert f in text
    with pytest.raises(GatewayConfigError, match="cannot read"):
        load_config(tmp_path / "missing.json")
    good = GatewayConfig(env="e", admin_token="x" * 16)
    p.write_text(good.model_dump_json())
    assert load_config(p) == good


def test_runs_as_its_own_process(upstream_factory: Up, tmp_path: Any, admin_token: str) -> None:
    """`python -m releasekit.deploy.gateway --config FILE` serves on an OS-chosen port,
    writes its ready file, answers the admin API, and stops cleanly on SIGTERM (ready file
    removed); the config file it was given is private (0600)."""
    import os
    import signal

    from releasekit.deploy.gateway_client import launch_gateway, read_endpoint

    a = upstream_factory("a")
    cfg = GatewayConfig(
        env="proc", admin_token=admin_token, routes=[Route(release_id="rel-a", base_url=a.url)]
    )
    lg = launch_gateway(cfg, config_path=tmp_path / "gw.json", log_path=tmp_path / "gw.log")
    try:
        assert (os.stat(tmp_path / "gw.json").st_mode & 0o777) == 0o600
        assert read_endpoint(tmp_path / "gw.ready") == lg.endpoint
        assert lg.pid != os.getpid() and os.getpgid(lg.pid) == lg.pid
        r = webclient.get(lg.url + "/v1/models")
        assert r.status_code == 200 and r.headers["x-releasekit-release"] == "rel-a"
        state = GatewayClient(lg.url, admin_token=admin_token).state()
        assert state.env == "proc" and state.pid == lg.pid
    finally:
        os.killpg(lg.pid, signal.SIGTERM)
        assert lg.process is not None
        rc = lg.process.wait(timeout=20)
    assert rc == 0
    assert not (tmp_path / "gw.ready").exists()


def test_launch_reports_a_taken_port(tmp_path: Any, admin_token: str) -> None:
    """A gateway whose port is taken fails to launch with GatewayStartError quoting its log."""
    import socket

    from releasekit.deploy.gateway import GatewayStartError
    from releasekit.deploy.gateway_client import launch_gateway

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    try:
        cfg = GatewayConfig(env="proc", admin_token=admin_token, port=s.getsockname()[1])
        with pytest.raises(GatewayStartError, match="exited with code 2") as exc:
            launch_gateway(cfg, config_path=tmp_path / "gw.json", log_path=tmp_path / "gw.log")
        assert "cannot listen" in str(exc.value)
    finally:
        s.close()
