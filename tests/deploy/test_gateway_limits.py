"""The gateway under abuse: each test replays an attack against a real gateway (uvicorn on
127.0.0.1, in front of a fake upstream) and checks the gateway refuses it, stays bounded and
keeps serving."""

from __future__ import annotations

import json
import select
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import webclient
from gateway_fakes import FakeUpstream, wait_until
from prometheus_client.parser import text_string_to_metric_families
from rawhttp import raw_exchange, status_of
from starlette.requests import Request

from releasekit._support.http import http_client
from releasekit.deploy.gateway import (
    PromptTemplate,
    RateLimit,
    Route,
    ThreadedGateway,
)
from releasekit.deploy.gateway.limits import client_address, parse_json
from releasekit.deploy.gateway_client import GatewayClient

Up = Callable[[str], FakeUpstream]
Gw = Callable[..., ThreadedGateway]
STREAM = {"model": "demo", "prompt": "hi", "max_tokens": 4, "stream": True}
PLAIN = {"model": "demo", "prompt": "hi", "max_tokens": 4}


def _addr(tg: ThreadedGateway) -> tuple[str, int]:
    return tg.endpoint.host, tg.endpoint.port


def raw_request(tg: ThreadedGateway, data: bytes, *, wait_s: float = 5.0) -> bytes:
    """Send raw bytes to the gateway and read its answer (tests/rawhttp.py)."""
    return raw_exchange(_addr(tg), data, wait_s=wait_s)


def is_closed(s: socket.socket, wait_s: float) -> tuple[bool, bytes]:
    """Whether the peer closed `s` within `wait_s`, and what it sent before."""
    s.settimeout(wait_s)
    got = b""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            return False, got
        except ConnectionResetError:
            return True, got
        if not chunk:
            return True, got
        got += chunk
    return False, got


def in_flight(tg: ThreadedGateway, admin_token: str) -> int:
    return GatewayClient(tg.url, admin_token=admin_token).state().in_flight_total


def series(url: str, name: str) -> list[dict[str, str]]:
    out = []
    for fam in text_string_to_metric_families(webclient.get(url + "/metrics").text):
        out.extend(s.labels for s in fam.samples if s.name == name)
    return out


# ----------------------------------------------------------------------------- bodies


def test_deep_json_is_400_and_frees_the_slot(
    upstream_factory: Up, gateway_factory: Gw, admin_token: str
) -> None:
    """2 KB of JSON nested 1,100 deep, sent more times than there are slots, to the templated
    route and to a plain route: each is a 400, no slot stays taken, the gateway keeps
    serving and the upstream never sees the body."""
    a = upstream_factory("a")
    route = Route(
        release_id="rel-a", base_url=a.url, prompts={"qa": PromptTemplate(user="{{ q }}")}
    )
    tg = gateway_factory([route], max_in_flight=4)
    deep = b'{"variables": {"q": "x"}, "x": ' + b"[" * 1100 + b"]" * 1100 + b"}"
    with http_client(base_url=tg.url, timeout=10) as c:
        for _ in range(10):
            r = c.post("/v1/templates/qa/chat/completions", content=deep)
            assert r.status_code == 400, r.text
            assert "nests deeper" in r.json()["error"]["message"]
            assert c.post("/v1/completions", content=deep).status_code == 400
        assert in_flight(tg, admin_token) == 0
        ok = c.post("/v1/templates/qa/chat/completions", json={"variables": {"q": "hi"}})
        assert ok.status_code == 200
    assert all(b"[[[[" not in (rec.get("body") or b"") for rec in a.received)


def test_json_depth_limit_is_exact() -> None:
    """Nesting up to max_json_depth parses; one level more is refused."""
    ok = b"[" * 64 + b"]" * 64
    assert parse_json(ok, 64) is not None
    with pytest.raises(ValueError, match="nests deeper than 64"):
        parse_json(b"[" * 65 + b"]" * 65, 64)
    with pytest.raises(ValueError, match="not JSON"):
        parse_json(b"{nope", 64)


def test_chunked_body_is_counted_while_it_streams(
    upstream_factory: Up, gateway_factory: Gw
) -> None:
    """A chunked body with no Content-Length is cut at the limit: 413 arrives while the
    client is still sending, long before 64 MiB went out, and the connection is closed."""
    a = upstream_factory("a")
    tg = gateway_factory([Route(release_id="rel-a", base_url=a.url)], max_request_bytes=1 << 20)
    head = (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"transfer-encoding: chunked\r\n\r\n"
    )
    piece = b"x" * 65536
    chunk = b"%x\r\n" % len(piece) + piece + b"\r\n"
    sent = 0
    answer = b""
    with socket.create_connection(_addr(tg), timeout=10) as s:
        s.sendall(head)
        while sent < 64 << 20:
            readable, writable, _ = select.select([s], [s], [], 5)
            if readable:
                answer = s.recv(65536)
                break
            if writable:
                try:
                    s.sendall(chunk)
                except (BrokenPipeError, ConnectionResetError):
                    break
                sent += len(piece)
        if not answer:
            _, answer = is_closed(s, 5)
    assert status_of(answer) == 413, answer[:200]
    assert sent < 8 << 20, f"sent {sent} bytes before the 413"
    assert a.received == []
    assert webclient.post(tg.url + "/v1/completions", json=PLAIN).status_code == 200


# ----------------------------------------------------------------------------- headers


def test_oversize_unfinished_headers_get_431_and_a_close(
    upstream_factory: Up, gateway_factory: Gw
) -> None:
    """Header bytes that never end are counted as they arrive: past max_header_bytes the
    client gets 431 and the connection closes; nothing reaches the upstream."""
    a = upstream_factory("a")
    tg = gateway_factory([Route(release_id="rel-a", base_url=a.url)], max_header_bytes=8192)
    with socket.create_connection(_addr(tg), timeout=10) as s:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-junk: ")
        sent = 0
        try:
            while sent < 16 << 20:
                s.sendall(b"a" * 65536)
                sent += 65536
        except (BrokenPipeError, ConnectionResetError):
            pass
        closed, got = is_closed(s, 5)
    assert sent < 4 << 20, f"the gateway read {sent} header bytes"
    assert closed
    assert status_of(got) in (431, 0)  # 0: reset before the answer was read
    assert a.received == []


def test_complete_oversize_headers_are_refused(upstream_factory: Up, gateway_factory: Gw) -> None:
    """A header block over the limit that arrives in one piece is refused too, unforwarded."""
    a = upstream_factory("a")
    tg = gateway_factory([Route(release_id="rel-a", base_url=a.url)], max_header_bytes=8192)
    big = b"x-big: " + b"a" * 20_000 + b"\r\n"
    got = raw_request(tg, b"GET /v1/models HTTP/1.1\r\nhost: x\r\n" + big + b"\r\n")
    assert status_of(got) == 431
    assert a.received == []
    r = webclient.get(tg.url + "/v1/models", headers={"x-small": "a" * 1000})
    assert r.status_code == 200


def test_slow_headers_time_out(upstream_factory: Up, gateway_factory: Gw) -> None:
    """A client that dribbles its headers, or sends nothing at all, is cut after
    header_timeout_s with 408."""
    a = upstream_factory("a")
    tg = gateway_factory([Route(release_id="rel-a", base_url=a.url)], header_timeout_s=0.5)
    with (
        socket.create_connection(_addr(tg), timeout=5) as dribble,
        socket.create_connection(_addr(tg), timeout=5) as silent,
    ):
        t = time.monotonic()
        dribble.sendall(b"GET /v1/models HTTP/1.1\r\n")
        closed_at = None
        for _ in range(40):
            try:
                dribble.sendall(b"x")
            except (BrokenPipeError, ConnectionResetError):
                closed_at = time.monotonic() - t
                break
            readable, _, _ = select.select([dribble], [], [], 0.1)
            if readable:
                closed_at = time.monotonic() - t
                break
        assert closed_at is not None and closed_at < 3.0
        closed, got = is_closed(dribble, 2)
        assert status_of(got) in (408, 0)
        closed, got = is_closed(silent, 3)
        assert closed
    assert webclient.get(tg.url + "/v1/models").status_code == 200


# ----------------------------------------------------------------------------- paths


@pytest.mark.parametrize(
    "line",
    [
        b"GET /v1/%2e%2e/%2e%2e/admin/secret HTTP/1.1",
        b"GET /v1/../../version HTTP/1.1",
        b"GET /v1/models/..%2F..%2Fversion HTTP/1.1",
        b"POST /v1//completions HTTP/1.1",
        b"POST /v1/completions%2F HTTP/1.1",
        b"POST /v1/./completions HTTP/1.1",
        b"POST /v1/collective_rpc HTTP/1.1",
        b"POST /v1/scale_elastic_ep HTTP/1.1",
        b"DELETE /v1/completions HTTP/1.1",
        b"GET /v1/completions HTTP/1.1",
    ],
)
def test_only_the_openai_routes_reach_the_upstream(
    line: bytes, upstream_factory: Up, gateway_factory: Gw
) -> None:
    """Paths outside the allowlist, paths with escapes or dot segments, and methods a route
    does not take are refused (404/405) and never reach the upstream (or its key)."""
    a = upstream_factory("a")
    tg = gateway_factory([Route(release_id="rel-a", base_url=a.url, api_key="upstream-key")])
    body = b"{}"
    req = line + b"\r\nhost: x\r\ncontent-length: 2\r\ncontent-type: application/json\r\n\r\n"
    got = raw_request(tg, req + body)
    assert status_of(got) in (404, 405), got[:300]
    assert a.received == []


def test_allowed_routes_still_pass(upstream_factory: Up, gateway_factory: Gw) -> None:
    """The routes vLLM serves keep working, query strings included."""
    a = upstream_factory("a")
    tg = gateway_factory([Route(release_id="rel-a", base_url=a.url)])
    assert webclient.get(tg.url + "/v1/models").status_code == 200
    assert webclient.post(tg.url + "/v1/completions?x=1", json=PLAIN).status_code == 200
    assert [r["path"] for r in a.received] == ["/v1/models", "/v1/completions"]


def test_unknown_paths_do_not_grow_metric_series(upstream_factory: Up, gateway_factory: Gw) -> None:
    """200 distinct made-up paths leave the metric series as they were: labels are bounded."""
    a = upstream_factory("a")
    tg = gateway_factory([Route(release_id="rel-a", base_url=a.url)])
    webclient.post(tg.url + "/v1/completions", json=PLAIN)
    names = ("releasekit_gateway_requests_total", "releasekit_gateway_rejections_total")
    before = [series(tg.url, n) for n in names]
    with http_client(base_url=tg.url) as c:
        for i in range(200):
            assert c.post(f"/v1/made-up-{i}", json=PLAIN).status_code == 404
    after = [series(tg.url, n) for n in names]
    assert after[0] == before[0]
    assert after[1] == [*before[1], {"env": "test", "reason": "bad_request"}]


# ----------------------------------------------------------------------------- clients


def test_client_that_stops_reading_loses_its_slot(
    upstream_factory: Up, gateway_factory: Gw, admin_token: str
) -> None:
    """A client that reads the headers of a stream and then nothing more is cut after
    stream_idle_timeout_s; its slot is freed, the upstream stream closed, and the outcome
    is the client's (no rejection counted)."""
    a = upstream_factory("a")
    tg = gateway_factory([Route(release_id="rel-a", base_url=a.url)], stream_idle_timeout_s=0.5)
    body = json.dumps(STREAM).encode()
    req = (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"x-fake-chunks: 100000\r\nx-fake-delay: 0\r\nx-fake-pad: 16384\r\n"
        b"content-length: %d\r\n\r\n" % len(body)
    ) + body
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(_addr(tg))
    try:
        s.sendall(req)
        assert s.recv(1024).startswith(b"HTTP/1.1 200")
        assert wait_until(lambda: in_flight(tg, admin_token) == 0, timeout_s=20)
        assert wait_until(lambda: bool(a.cancelled), timeout_s=5)
    finally:
        s.close()
    fams = series(tg.url, "releasekit_gateway_stream_errors_total")
    assert any(lab.get("reason") == "client_stalled" for lab in fams)
    assert not any(
        lab.get("reason") == "timeout"
        for lab in series(tg.url, "releasekit_gateway_rejections_total")
    )
    assert webclient.post(tg.url + "/v1/completions", json=PLAIN).status_code == 200


def test_client_leaving_a_non_stream_request_cancels_the_upstream(
    upstream_factory: Up, gateway_factory: Gw, admin_token: str
) -> None:
    """A client that gives up on a non-stream request (the upstream still generating) frees
    its slot at once and the upstream request is cancelled (its connection closed)."""
    a = upstream_factory("a")
    tg = gateway_factory([Route(release_id="rel-a", base_url=a.url)])
    with pytest.raises(httpx.TimeoutException):
        webclient.post(tg.url + "/v1/completions", json=PLAIN, headers={"x-fake-hang": "1"},
                   timeout=0.5)  # fmt: skip
    assert wait_until(lambda: "hang" in a.cancelled, timeout_s=5)
    assert wait_until(lambda: in_flight(tg, admin_token) == 0, timeout_s=5)
    statuses = {lab["status"] for lab in series(tg.url, "releasekit_gateway_requests_total")}
    assert "499" in statuses and "504" not in statuses


def test_wrong_keys_are_rate_limited_per_address(upstream_factory: Up, gateway_factory: Gw) -> None:
    """After `burst` wrong keys from one address, further attempts get 429 without the key
    being checked (so a guess cannot be confirmed while throttled)."""
    a = upstream_factory("a")
    tg = gateway_factory(
        [Route(release_id="rel-a", base_url=a.url)],
        api_keys=["right-key"],
        auth_failure_limit=RateLimit(rps=0.01, burst=3),
    )
    with http_client(base_url=tg.url) as c:
        codes = [
            c.post(
                "/v1/completions", json=PLAIN, headers={"authorization": f"Bearer w{i}"}
            ).status_code
            for i in range(5)
        ]
        assert codes == [401, 401, 401, 429, 429]
        r = c.post("/v1/completions", json=PLAIN, headers={"authorization": "Bearer right-key"})
        assert r.status_code == 429


def _request_from(host: str) -> Request:
    return Request({"type": "http", "client": (host, 1234), "headers": []})


def test_ipv6_clients_share_a_bucket_per_64() -> None:
    """Without keys the bucket is per address; IPv6 addresses of one /64 are one client."""
    assert client_address(_request_from("2001:db8:1:2::1")) == client_address(
        _request_from("2001:db8:1:2:ffff::9")
    )
    assert client_address(_request_from("2001:db8:1:3::1")) != client_address(
        _request_from("2001:db8:1:2::1")
    )
    assert client_address(_request_from("10.0.0.1")) == "10.0.0.1"
    assert client_address(_request_from("::ffff:10.0.0.1")) == "10.0.0.1"


def _sample(text: str, name: str, **labels: str) -> float:
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return 0.0


def _flood(tg: ThreadedGateway, key: str, n: int) -> tuple[list[int], list[httpx.Response]]:
    """`n` streams from one key at once, each held by the upstream after its first chunk;
    returns (the statuses of those refused outright, the open held streams)."""
    import concurrent.futures

    client = http_client(base_url=tg.url, timeout=30, limits=httpx.Limits(max_connections=n + 4))
    headers = {"authorization": f"Bearer {key}", "x-fake-hold": "flood"}

    def one(_: int) -> httpx.Response:
        r = client.send(client.build_request("POST", "/v1/completions", json=STREAM,
                                             headers=headers), stream=True)  # fmt: skip
        if r.status_code != 200:
            r.read()
            r.close()
        return r

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        got = list(pool.map(one, range(n)))
    return [r.status_code for r in got if r.status_code != 200], [
        r for r in got if r.status_code == 200
    ]


def test_one_key_flooding_cannot_take_the_slots_or_the_queue_of_another(
    upstream_factory: Up, gateway_factory: Gw, admin_token: str
) -> None:
    """A key holding as many streams as it can open gets `max_in_flight_per_client` of
    them; the rest are 429 at once, so they neither hold a slot nor wait in the queue, and
    another key's requests are all answered without queueing (the gateway's own queue-wait
    figures: every admitted request found a free slot). Without the cap the same flood
    takes every slot and the other key is turned away."""
    up = upstream_factory("u")
    keys = ["sk-flood", "sk-good"]
    tg = gateway_factory(
        [Route(release_id="r", base_url=up.url)],
        api_keys=keys,
        max_in_flight=4,
        max_in_flight_per_client=2,
        max_queue_wait_s=0.3,
    )
    refused, held = _flood(tg, "sk-flood", 10)
    try:
        assert refused == [429] * 8 and len(held) == 2
        with GatewayClient(tg.url, admin_token=admin_token) as gc:
            assert gc.state().in_flight_total == 2 and gc.state().queued == 0
        good = [
            webclient.post(
                f"{tg.url}/v1/completions",
                json=STREAM,
                headers={"authorization": "Bearer sk-good"},
                timeout=30,
            )
            for _ in range(5)
        ]
        assert [r.status_code for r in good] == [200] * 5
        assert all(r.text.rstrip().endswith("data: [DONE]") for r in good)
        text = webclient.get(f"{tg.url}/metrics", timeout=10).text
        assert _sample(text, "releasekit_gateway_rejections_total", reason="client_in_flight") == 8
        assert _sample(text, "releasekit_gateway_queue_wait_seconds_count") == 7
        assert _sample(text, "releasekit_gateway_queue_wait_seconds_sum") == 0.0
    finally:
        up.release("flood")
        for r in held:
            r.read()
            r.close()

    open_gw = gateway_factory(
        [Route(release_id="r", base_url=up.url)],
        api_keys=keys,
        max_in_flight=4,
        max_queue_wait_s=0.3,
    )
    up.holds.pop("flood", None)
    refused, held = _flood(open_gw, "sk-flood", 6)
    try:
        assert refused == [503] * 2 and len(held) == 4  # every slot is the flooder's
        r = webclient.post(
            f"{open_gw.url}/v1/completions",
            json=STREAM,
            headers={"authorization": "Bearer sk-good"},
            timeout=30,
        )
        assert r.status_code == 503
    finally:
        up.release("flood")
        for r in held:
            r.read()
            r.close()


def test_feedback_is_capped_per_client(upstream_factory: Up, gateway_factory: Gw) -> None:
    """One client cannot vote in bulk: past its feedback bucket it gets 429 and nothing
    more is counted, while another client still votes."""
    up = upstream_factory("u")
    tg = gateway_factory(
        [Route(release_id="r", base_url=up.url)],
        api_keys=["sk-a", "sk-b"],
        feedback_limit=RateLimit(rps=0.001, burst=3),
    )

    def served(key: str) -> str:
        r = webclient.post(f"{tg.url}/v1/completions", json=PLAIN,
                       headers={"authorization": f"Bearer {key}"}, timeout=10)  # fmt: skip
        return str(r.json()["id"])

    def vote(key: str, rid: str) -> int:
        r = webclient.post(f"{tg.url}/v1/feedback", json={"response_id": rid, "score": "down"},
                       headers={"authorization": f"Bearer {key}"}, timeout=10)  # fmt: skip
        return r.status_code

    ids = [served("sk-a") for _ in range(6)]
    assert [vote("sk-a", i) for i in ids] == [200, 200, 200, 429, 429, 429]
    assert vote("sk-b", served("sk-b")) == 200
    text = webclient.get(f"{tg.url}/metrics", timeout=10).text
    assert _sample(text, "releasekit_gateway_feedback_total", score="negative") == 4
    assert _sample(text, "releasekit_gateway_rejections_total", reason="feedback_limit") == 3


def test_the_release_header_is_opt_in(
    upstream_factory: Up, gateway_factory: Gw, admin_token: str
) -> None:
    """With `release_header` off no answer names its release (success or error), unless
    the request carries the admin token (the deployer's smoke checks), which never reaches
    the upstream."""
    up = upstream_factory("u")
    tg = gateway_factory([Route(release_id="rel-x", base_url=up.url)], release_header=False)
    ok = webclient.post(f"{tg.url}/v1/completions", json=STREAM, timeout=10)
    bad = webclient.post(
        f"{tg.url}/v1/completions", json=PLAIN, headers={"x-fake-status": "500"}, timeout=10
    )
    wrong = webclient.post(
        f"{tg.url}/v1/completions", json=PLAIN, headers={"x-releasekit-admin": "guess"}, timeout=10
    )
    assert ok.status_code == 200 and bad.status_code == 500 and wrong.status_code == 200
    assert all("x-releasekit-release" not in r.headers for r in (ok, bad, wrong))
    shown = webclient.post(
        f"{tg.url}/v1/completions",
        json=PLAIN,
        headers={"x-releasekit-admin": admin_token},
        timeout=10,
    )
    assert shown.headers["x-releasekit-release"] == "rel-x"
    assert all("x-releasekit-admin" not in r["headers"] for r in up.received)


def test_the_slot_is_freed_when_the_gateway_fails_before_relaying(
    upstream_factory: Up, gateway_factory: Gw, admin_token: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure between taking the slot and relaying (choosing the route, a shadow copy
    that cannot be sent) never keeps the slot: with one slot, the next request still goes."""
    from releasekit.deploy.gateway import Mirror, RouteTable
    from releasekit.deploy.gateway.mirror import Mirroring
    from releasekit.deploy.gateway.routing import Table

    up, cand = upstream_factory("u"), upstream_factory("c")
    route = Route(release_id="r", base_url=up.url)
    tg = gateway_factory([route], max_in_flight=1, max_queue_wait_s=0.2,
                         max_in_flight_per_client=1)  # fmt: skip
    calls = {"n": 0}
    real_pick = Table.pick

    def failing_pick(self: Table) -> Route | None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("route choice failed")
        return real_pick(self)

    monkeypatch.setattr(Table, "pick", failing_pick)
    first = webclient.post(f"{tg.url}/v1/completions", json=PLAIN, timeout=10)
    assert first.status_code == 500
    assert webclient.post(f"{tg.url}/v1/completions", json=PLAIN, timeout=10).status_code == 200

    def failing_copy(self: Mirroring, *args: object, **kwargs: object) -> None:
        raise RuntimeError("copy failed")

    monkeypatch.setattr(Mirroring, "copy", failing_copy)
    with GatewayClient(tg.url, admin_token=admin_token) as gc:
        gc.set_routes(RouteTable(routes=[route], mirror=Mirror(
            route=Route(release_id="c", base_url=cand.url), share=1.0)))  # fmt: skip
        for _ in range(3):
            r = webclient.post(f"{tg.url}/v1/completions", json=PLAIN, timeout=10)
            assert r.status_code == 200  # the client's request never pays for the copy
        st = gc.state()
    assert st.in_flight_total == 0 and st.mirror_dropped == 3 and st.served == {"r": 4}


def test_a_deployed_environment_gives_its_gateway_limits_and_hides_the_release(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, upstream_factory: Up
) -> None:
    """`[environments.NAME]` with nothing set: the deployed gateway limits each client
    (rate and in-flight) and names no release to clients; the limits are the environment's
    when it sets them."""
    from releasekit.config import load_settings
    from releasekit.deploy.gateway import load_config
    from releasekit.deploy.local import LocalTarget
    from releasekit.deploy.state import deploy_dir, locked_state

    up = upstream_factory("u")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("RELEASEKIT_ROOT", str(tmp_path))
    (tmp_path / "releasekit.toml").write_text(
        f"[environments.staging]\nport = {port}\n\n"
        "[environments.production]\nport = 1\nrate_limit_rps = 0\nmax_in_flight_per_key = 0\n"
        "release_header = true\nrate_limit_burst = 5\n"
    )
    settings = load_settings(root=tmp_path)
    prod = settings.environments["production"]
    assert prod.rate_limit_rps == 0 and prod.max_in_flight_per_key == 0 and prod.release_header
    cfg = settings.environments["staging"]
    with locked_state(settings.state_dir, "staging") as h:
        target = LocalTarget(settings, "staging", cfg, h)
        url = target.ensure_router([Route(release_id="rel-s", base_url=up.url)])
        try:
            gw = load_config(deploy_dir(settings.state_dir) / "staging-gateway.json")
            assert gw.rate_limit == RateLimit(rps=50, burst=100)
            assert gw.max_in_flight_per_client == 32 and gw.release_header is False
            r = webclient.post(f"{url}/v1/completions", json=PLAIN, timeout=10)
            assert r.status_code == 200 and "x-releasekit-release" not in r.headers
            # What the deployer's smoke check sends: the gateway's admin token.
            assert h.state.gateway is not None
            admin = {"x-releasekit-admin": h.state.gateway.admin_token}
            r = webclient.post(f"{url}/v1/completions", json=PLAIN, headers=admin, timeout=10)
            assert r.headers["x-releasekit-release"] == "rel-s"
        finally:
            target.stop_router()


def test_too_many_headers_and_an_oversize_block_in_one_read_get_431(
    upstream_factory: Up, gateway_factory: Gw
) -> None:
    """150 headers (past `max_header_count`) get 431, and so does an unfinished header
    block over `max_header_bytes` that arrives in a single read; nothing reaches the
    upstream."""
    a = upstream_factory("a")
    tg = gateway_factory([Route(release_id="rel-a", base_url=a.url)], header_timeout_s=30)
    many = b"GET /v1/models HTTP/1.1\r\nhost: x\r\n"
    many += b"".join(b"x-h%d: v\r\n" % i for i in range(150)) + b"\r\n"
    assert status_of(raw_request(tg, many)) == 431
    block = b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-pad: " + b"a" * (62 * 1024)
    assert status_of(raw_request(tg, block, wait_s=20)) == 431
    assert a.received == []


def test_the_smoke_check_asks_for_the_release_header_with_the_admin_token() -> None:
    """`run_smoke(admin_token=...)` sends the gateway's admin token, so it can tell which
    release answered where clients are not told."""
    from releasekit.deploy.smoke import run_smoke
    from releasekit.deploy.target import SmokeItem, SmokeProbe

    def answer(request: httpx.Request) -> httpx.Response:
        shown = request.headers.get("x-releasekit-admin") == "tok-" + "x" * 20
        return httpx.Response(
            200,
            json={"choices": [{"message": {"content": "an answer"}}]},
            headers={"x-releasekit-release": "rel-1"} if shown else {},
        )

    probe = SmokeProbe(items=[SmokeItem(id="a", vars={"question": "q"})])
    kw: dict[str, Any] = {"release_id": "rel-1", "where": "gateway"}
    transport = httpx.MockTransport(answer)
    blind = run_smoke("http://gw", probe, transport=transport, **kw)
    assert not blind.passed and blind.items[0].release is None
    seen = run_smoke("http://gw", probe, admin_token="tok-" + "x" * 20, transport=transport, **kw)
    assert seen.passed and seen.items[0].release == "rel-1"
