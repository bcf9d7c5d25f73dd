"""The network surface of the Ray target, against a real two-node Ray cluster on loopback
(tests/deploy/ray_kit.py) with Serve and the releasekit router running: every port the
cluster's processes listen on is on 127.0.0.1, and the router relays only what the
environment's gateway sends (its router secret) on the OpenAI routes the gateway forwards;
a release application has no HTTP route of its own."""

from __future__ import annotations

import contextlib
import ipaddress
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import webclient
from ray_kit import RayCluster, free_slot

from releasekit._support.http import http_client

pytest.importorskip("ray")

from releasekit.config import RayTargetConfig
from releasekit.deploy.gateway import GatewayConfig, Route, ThreadedGateway
from releasekit.deploy.ray.cluster import connect, nodes
from releasekit.deploy.ray.replica import publish_secret, routing_token
from releasekit.deploy.ray.target import ensure_router_app, ensure_serve, router_secret

ENV = "netenv"
APP = f"rk-{ENV}-0123456789ab"
RELEASE = "0123456789ab" + "cd" * 26


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RayCluster, str, str]]:
    """A head and a second node, both on 127.0.0.1; Serve, the router and a stand-in
    release application running; yields (cluster, proxy URL, the environment's secret)."""
    c = RayCluster(slot=free_slot(), root=tmp_path_factory.mktemp("raynet"))
    state = tmp_path_factory.mktemp("raynet-state")
    try:
        c.add_node(num_cpus=1)
        c.add_node(num_cpus=1)
        cfg = RayTargetConfig(address=c.address, serve_port=c.serve_port)
        connect(cfg)
        proxy = ensure_serve(cfg)
        secret = router_secret(state, ENV)
        assert router_secret(state, ENV) == secret  # made once, then read back
        mode = stat.S_IMODE((state / "deploy" / f"{ENV}-router.key").stat().st_mode)
        assert mode == 0o600
        publish_secret(ENV, secret)
        ensure_router_app()
        _deploy_stand_in()
        yield c, proxy, secret
    finally:
        with contextlib.suppress(Exception):
            import ray

            ray.shutdown()
        c.stop()


def _deploy_stand_in() -> None:
    """A release application whose replica answers the router's `relay` calls itself (what
    it was asked, as JSON), deployed as the Ray target deploys releases: no HTTP route."""
    import json

    from ray import serve

    @serve.deployment(name="server", ray_actor_options={"num_cpus": 0})
    class StandIn:
        def __init__(self) -> None:
            # As releasekit's own deployments do when their module loads.
            from releasekit.deploy.ray.replica import keep_grpc_on_loopback

            keep_grpc_on_loopback()

        async def relay(
            self, method: str, path: str, query: str, headers: list[Any], body: bytes
        ) -> Any:
            yield {"status": 200, "headers": {"content-type": "application/json"}}
            seen = {"method": method, "path": path, "auth": dict(headers).get("authorization")}
            yield json.dumps(seen).encode()

        async def __call__(self, request: Any) -> Any:
            from starlette.responses import PlainTextResponse

            return PlainTextResponse("reached the release directly")

    serve._run(StandIn.bind(), _blocking=True, name=APP, route_prefix=None)  # type: ignore[attr-defined]


def test_every_port_the_cluster_listens_on_is_on_loopback(
    cluster: tuple[RayCluster, str, str],
) -> None:
    """Two nodes (told apart by node id, both on 127.0.0.1) and Serve's proxy: every
    listening socket of every process of the cluster is bound to 127.0.0.1."""
    c = cluster[0]
    live = nodes()
    assert len(live) == 2 and len({n.node_id for n in live}) == 2
    assert {n.address for n in live} == {"127.0.0.1"}
    socks = c.listening_sockets()
    print("listening:", sorted({(name, ip, port) for _, name, ip, port in socks}))
    ports = {port for _, _, _, port in socks}
    assert c.gcs_port in ports and c.serve_port in ports, socks
    assert len(socks) >= 8, socks
    off_loopback = [s for s in socks if _ipv4(s[2]) != "127.0.0.1"]
    assert off_loopback == [], off_loopback


def _ipv4(addr: str) -> str:
    """An address as IPv4 (a dual-stack socket on ::ffff:127.0.0.1 is on 127.0.0.1)."""
    ip = ipaddress.ip_address(addr)
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return str(mapped or ip)


def test_the_router_relays_only_what_the_gateway_sends(
    cluster: tuple[RayCluster, str, str],
) -> None:
    """Straight to the router: no token, the application's name alone (what a release id
    gives away), a wrong secret: 401. With the secret: only the OpenAI routes the gateway
    forwards (others 404, other methods 405). The release application itself has no HTTP
    route. Through a gateway whose route holds the token: answered."""
    _, proxy, secret = cluster
    token = routing_token(APP, secret, "sk-upstream")
    with http_client(base_url=proxy, timeout=30, trust_env=False) as h:

        def ask(path: str, auth: str | None, method: str = "GET") -> httpx.Response:
            headers = {"authorization": f"Bearer {auth}"} if auth is not None else {}
            return h.request(method, path, headers=headers, json={} if method == "POST" else None)

        assert ask("/v1/models", None).status_code == 401
        assert ask("/v1/completions", APP, "POST").status_code == 401
        assert ask("/v1/completions", routing_token(APP, RELEASE, None), "POST").status_code == 401
        assert ask("/v1/models", routing_token(APP, secret[:-1] + "x", None)).status_code == 401
        other = f"rk-other-{'f' * 12}"  # another environment's app, this one's secret
        assert ask("/v1/models", routing_token(other, secret, None)).status_code == 401

        ok = ask("/v1/completions", token, "POST")
        assert ok.status_code == 200, ok.text
        assert ok.json() == {
            "method": "POST",
            "path": "/v1/completions",
            "auth": "Bearer sk-upstream",  # the server's own key, never the routing token
        }
        for path in ("/v1/load_lora_adapter", "/tokenize", "/v1/../admin", "/v1//models"):
            assert ask(path, token, "POST").status_code == 404, path
        assert ask("/v1/completions", token, "GET").status_code == 405
        assert ask("/health", None).status_code == 200  # the router's own health, nothing more
        direct = h.get(f"/{APP}/v1/models")
        assert direct.status_code == 401 and "reached" not in direct.text

    cfg = GatewayConfig(
        env=ENV,
        port=0,
        admin_token="a" * 32,
        routes=[Route(release_id=RELEASE, base_url=proxy, api_key=token)],
        shutdown_timeout_s=1,
    )
    with ThreadedGateway(cfg) as tg:
        r = webclient.post(f"{tg.url}/v1/completions", json={"prompt": "x"}, timeout=30)
        assert r.status_code == 200 and r.json()["auth"] == "Bearer sk-upstream"


def test_a_rotated_secret_takes_over(cluster: tuple[RayCluster, str, str], tmp_path: Path) -> None:
    """A new secret published for the environment is accepted (the router reads it again)
    and the old one is refused from then on."""
    _, proxy, old = cluster
    new = router_secret(tmp_path, ENV)
    publish_secret(ENV, new)
    try:
        with http_client(base_url=proxy, timeout=30, trust_env=False) as h:
            hdr = {"authorization": f"Bearer {routing_token(APP, new, None)}"}
            assert h.get("/v1/models", headers=hdr).status_code == 200
            hdr = {"authorization": f"Bearer {routing_token(APP, old, None)}"}
            assert h.get("/v1/models", headers=hdr).status_code == 401
    finally:
        publish_secret(ENV, old)
