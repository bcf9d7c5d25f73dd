"""What a client can and cannot make the watcher see: rollback signals read from a real
gateway's /metrics count only what the server caused, and feedback counts only from the
client that got the response."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import httpx
import pytest
import webclient
from gateway_fakes import FakeUpstream

from releasekit._support.http import http_client, tls
from releasekit.deploy.gateway import Route, ThreadedGateway
from releasekit.watch.windows import Snapshot, build_window, parse_exposition

Up = Callable[[str], FakeUpstream]
Gw = Callable[..., ThreadedGateway]
STREAM = {"model": "demo", "prompt": "hi", "max_tokens": 4, "stream": True}
PLAIN = {"model": "demo", "prompt": "hi", "max_tokens": 4}


def snap(tg: ThreadedGateway) -> Snapshot:
    text = webclient.get(tg.url + "/metrics").text
    return Snapshot(t=time.monotonic(), gateway=parse_exposition(text, url=tg.url))


def settle(tg: ThreadedGateway) -> None:
    """Wait until nothing is in flight (client-side hang-ups finish on the gateway later)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        m = webclient.get(tg.url + "/metrics").text
        if all(
            ln.endswith(" 0.0")
            for ln in m.splitlines()
            if ln.startswith("releasekit_gateway_in_flight{")
        ):
            return
        time.sleep(0.05)


def test_client_caused_outcomes_are_not_errors(upstream_factory: Up, gateway_factory: Gw) -> None:
    """Non-stream requests that outlast the first-byte timeout, clients that hang up (stream
    or not) and model-list calls leave error_rate and timeout_rate at 0; the window counts
    only the inference requests."""
    a = upstream_factory("a")
    tg = gateway_factory(
        [Route(release_id="rel-a", base_url=a.url)], upstream_first_byte_timeout_s=0.3
    )
    before = snap(tg)
    time.sleep(0.01)
    with http_client(base_url=tg.url, timeout=10) as c:
        for _ in range(5):
            assert c.post("/v1/completions", json=PLAIN).status_code == 200
        for _ in range(3):  # "generation" longer than the first-byte timeout
            r = c.post("/v1/completions", json=PLAIN, headers={"x-fake-hang": "1"})
            assert r.status_code == 504
        for _ in range(20):
            assert c.get("/v1/models").status_code == 200
        with c.stream("POST", "/v1/completions", json=STREAM,
                      headers={"x-fake-chunks": "500"}) as s:  # fmt: skip
            next(s.iter_lines())
    for _ in range(2):  # the client's own timeout, shorter than the generation
        with pytest.raises(httpx.TimeoutException):
            webclient.post(tg.url + "/v1/completions", json=PLAIN, headers={"x-fake-hang": "1"},
                       timeout=0.1)  # fmt: skip
    settle(tg)
    w = build_window(before, snap(tg), env="test", release="rel-a")
    assert w.requests == 11
    assert w.figures["error_rate"].value == 0
    assert w.figures["timeout_rate"].value == 0


def test_server_caused_outcomes_are_errors(upstream_factory: Up, gateway_factory: Gw) -> None:
    """5xx from the upstream and a stream whose upstream never answers do count."""
    a = upstream_factory("a")
    tg = gateway_factory(
        [Route(release_id="rel-a", base_url=a.url)], upstream_first_byte_timeout_s=0.3
    )
    before = snap(tg)
    time.sleep(0.01)
    with http_client(base_url=tg.url, timeout=10) as c:
        for _ in range(2):
            assert c.post("/v1/completions", json=PLAIN).status_code == 200
        r = c.post("/v1/completions", json=PLAIN, headers={"x-fake-status": "500"})
        assert r.status_code == 500
        r = c.post("/v1/completions", json=STREAM, headers={"x-fake-hang": "1"})
        assert r.status_code == 504
    w = build_window(before, snap(tg), env="test", release="rel-a")
    assert w.requests == 4
    assert w.figures["error_rate"].value == pytest.approx(0.5)
    assert w.figures["timeout_rate"].value == pytest.approx(0.25)


def test_feedback_counts_only_from_the_client_served(
    upstream_factory: Up, gateway_factory: Gw
) -> None:
    """With keys, another key's feedback on a response is a 404 (as for an unknown id) and
    counts nothing; the key that got the response votes once."""
    a = upstream_factory("a")
    tg = gateway_factory([Route(release_id="rel-a", base_url=a.url)], api_keys=["key-a", "key-b"])
    ka = {"authorization": "Bearer key-a"}
    kb = {"authorization": "Bearer key-b"}
    with http_client(base_url=tg.url) as c:
        rid = c.post("/v1/completions", json=PLAIN, headers=ka).json()["id"]
        with c.stream("POST", "/v1/completions", json=STREAM, headers=ka) as r:
            first = next(ln for ln in r.iter_lines() if ln.startswith("data:"))
        sid = json.loads(first[len("data: ") :])["id"]
        for other in (rid, sid):
            down = c.post("/v1/feedback", json={"response_id": other, "score": "down"}, headers=kb)
            assert down.status_code == 404
        own = c.post("/v1/feedback", json={"response_id": rid, "score": "down"}, headers=ka)
        assert own.status_code == 200 and own.json()["counted"] is True
        again = c.post("/v1/feedback", json={"response_id": rid, "score": "down"}, headers=ka)
        assert again.json()["counted"] is False
    m = webclient.get(tg.url + "/metrics").text
    assert 'releasekit_gateway_feedback_total{env="test",release="rel-a",score="negative"} 1.0' in m


def test_feedback_without_keys_is_tied_to_the_client_address(
    upstream_factory: Up, gateway_factory: Gw
) -> None:
    """Without keys the client is its address: a response served to 127.0.0.1 cannot be
    voted on from 127.0.0.2."""
    a = upstream_factory("a")
    tg = gateway_factory([Route(release_id="rel-a", base_url=a.url)])
    rid = webclient.post(tg.url + "/v1/completions", json=PLAIN).json()["id"]
    other = http_client(transport=httpx.HTTPTransport(local_address="127.0.0.2", verify=tls()))
    with other:
        r = other.post(tg.url + "/v1/feedback", json={"response_id": rid, "score": "down"})
    assert r.status_code == 404
    r = webclient.post(tg.url + "/v1/feedback", json={"response_id": rid, "score": "down"})
    assert r.status_code == 200
