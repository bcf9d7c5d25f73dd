"""The `ray` deploy target against a real Ray head on loopback (tests/deploy/ray_kit.py),
with the deploy tests' stand-in vLLM (promote_fake_vllm.py) as each replica's server:
promotion and rollback through the environment's gateway with every stream whole, a
replica whose server dies replaced by Ray, and the errors for an unreachable cluster, a
release that does not fit and a replica that never becomes healthy."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import webclient
from promote_kit import Kit, Streamer, kill_everything, make_kit
from ray_kit import RayCluster, env_lines, free_slot

pytest.importorskip("ray")

from releasekit.config import RayTargetConfig, load_settings
from releasekit.deploy.ray.cluster import (
    RayClusterUnreachableError,
    ReleaseDoesNotFitError,
    app_statuses,
    connect,
)
from releasekit.deploy.ray.target import RayTarget
from releasekit.deploy.state import locked_state, read_state
from releasekit.deploy.target import ReleaseSpec, ReleaseStartError
from releasekit.promote.context import load_release, release_spec
from releasekit.promote.deploy import deploy_status
from releasekit.promote.promote import promote
from releasekit.promote.rollback import rollback
from releasekit.stores.ledger import Ledger
from releasekit.watch.service import metrics_urls


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayCluster]:
    """One Ray head (4 logical CPUs: two releases of two replicas side by side) for the
    module, stopped by session at the end."""
    c = RayCluster(slot=free_slot(), root=tmp_path_factory.mktemp("ray"))
    try:
        c.add_node(num_cpus=4)
        yield c
    finally:
        with contextlib.suppress(Exception):
            import ray

            ray.shutdown()
        c.stop()


@pytest.fixture
def rkit(
    project: Path,
    monkeypatch: pytest.MonkeyPatch,
    mlflow_template_db: Path,
    stand_in_model: Any,
    head: RayCluster,
) -> Iterator[Kit]:
    """A deploy-test project whose environments are on the head's cluster (1 CPU per
    replica, 2 replicas); its applications and gateways are removed afterwards."""
    stand_in_model(project)
    k = make_kit(project, monkeypatch, mlflow_template_db, toml_lines=env_lines(head))
    # A replica's server starts inside a Ray worker: give a loaded host more than 30 s.
    monkeypatch.setenv("RELEASEKIT_SERVER_START_TIMEOUT_S", "120")
    k.settings = load_settings(root=project)
    try:
        yield k
    finally:
        from ray import serve

        with contextlib.suppress(Exception):
            for app in app_statuses():
                serve.delete(app, _blocking=True)
        kill_everything(k.settings)


def _spec(k: Kit, name: str = "demo-bf16") -> ReleaseSpec:
    rid = k.build(name, register=False)
    led = Ledger(k.settings.ledger_url or "")
    return release_spec(k.settings, load_release(k.settings, rid, ledger=led), ledger=led)


def _v2(k: Kit) -> str:
    k.variant("demo-bf16", "demo-v2", {"max-num-seqs: 32": "max-num-seqs: 16"})
    return k.build("demo-v2")


def _served(text: str) -> float:
    """Requests a server (or the merged fleet page) counts as served."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total")
    )


def test_promotion_rollback_metrics_and_a_replaced_replica_on_ray(rkit: Kit) -> None:
    """One flow (a promotion costs seconds here), each step a behaviour users rely on:
    1. a release runs as a two-replica Serve application behind the gateway, and promoting
       another and rolling back under a streaming client cuts no stream; the old
       application stays warm and the rollback reuses it;
    2. deploy-status lists the live release's replicas with their node;
    3. the release's metrics URL (what watch and diagnose scrape) sums every replica's
       series: the same total as reading each replica's server directly;
    4. a replica whose server is killed fails Serve's health check and is replaced; the
       release's URL does not change and the gateway keeps serving."""
    v1 = rkit.build("demo-bf16")
    res = promote(rkit.settings, "manifests/demo-bf16.yaml", env="staging", reason="first")
    assert res.status == "promoted", res.deploy
    v2 = _v2(rkit)
    with Streamer(rkit.gateway("staging")) as s:
        s.wait_for(5)
        res2 = promote(rkit.settings, "manifests/demo-v2.yaml", env="staging", reason="v2")
        assert res2.status == "promoted", res2.deploy
        s.wait_for(5)
        back = rollback(rkit.settings, env="staging", reason="back")
        assert back.status == "rolled_back", back
        s.wait_for(5)
    assert s.failures == [] and s.done >= 15
    assert {v1, v2} <= set(s.releases)
    assert res2.deploy is not None and res2.deploy.warm == [v1]
    assert back.deploy is not None and back.deploy.reused_server  # the warm v1 took it back

    [st] = deploy_status(rkit.settings, env="staging")
    assert st.serving and st.agrees
    live = [x for x in st.servers if x.role == "live"]
    assert [x.release_id for x in live] == [v1]
    reps = live[0].replicas
    assert len(reps) == 2 and {r.node_ip for r in reps} == {"127.0.0.1"}
    assert len({r.node_id for r in reps}) == 1  # the head alone

    vllm_url, _ = metrics_urls(rkit.settings, "staging", v1)
    direct = [_served(webclient.get(f"{r.server_url}/metrics", timeout=10).text) for r in reps]
    merged = webclient.get(vllm_url, timeout=10)
    assert merged.status_code == 200 and merged.headers["x-releasekit-replicas"] == "2"
    assert all(n > 0 for n in direct)  # Serve spread the requests over both
    assert _served(merged.text) == sum(direct)

    victim = reps[0]
    os.killpg(victim.server_pid, signal.SIGKILL)
    end = time.monotonic() + 90
    now: set[str] = set()
    while time.monotonic() < end:
        [st] = deploy_status(rkit.settings, env="staging")
        now = {r.replica for x in st.servers if x.role == "live" for r in x.replicas}
        if len(now) == 2 and victim.replica not in now:
            break
        time.sleep(1)
    assert victim.replica not in now and len(now) == 2
    with Streamer(rkit.gateway("staging")) as s2:
        s2.wait_for(6)
    assert s2.failures == [] and s2.done >= 6


def test_a_release_that_does_not_fit_says_what_is_missing_and_leaves_nothing(
    rkit: Kit,
) -> None:
    """Five 1-CPU replicas on a 4-CPU cluster: refused before anything is deployed, with
    the missing CPU named."""
    spec = _spec(rkit)
    cfg = rkit.settings.environments["staging"]
    with locked_state(rkit.settings.state_dir, "staging") as h:
        target = RayTarget(rkit.settings, "staging", cfg, h, replicas=5)
        with pytest.raises(ReleaseDoesNotFitError, match="1 CPU missing"):
            target.start(spec)
        assert h.state.servers == []
    assert not [a for a in app_statuses() if a.startswith("rk-staging-")]


def test_a_replica_that_never_becomes_healthy_quotes_its_log_and_is_deleted(
    rkit: Kit,
) -> None:
    """A release whose server refuses its engine arguments fails to start on Ray with the
    server log's cause; its application is deleted and nothing is recorded."""
    spec = _spec(rkit)
    bad = spec.model_copy(update={"engine_args": {**spec.engine_args, "no-such-flag": "1"}})
    cfg = rkit.settings.environments["staging"]
    with locked_state(rkit.settings.state_dir, "staging") as h:
        target = RayTarget(rkit.settings, "staging", cfg, h)
        with pytest.raises(ReleaseStartError, match="unrecognized arguments") as info:
            target.start(bad)
        assert "no-such-flag" in info.value.log_tail
        assert h.state.servers == []
    assert not [a for a in app_statuses() if a.startswith("rk-staging-")]
    assert read_state(rkit.settings.state_dir, "staging").servers == []


def test_an_unreachable_cluster_is_one_clear_error() -> None:
    """Nothing listens at the address: RayClusterUnreachableError names it at once."""
    cfg = RayTargetConfig(address="127.0.0.1:31999", connect_timeout_s=2)
    with pytest.raises(RayClusterUnreachableError, match=r"127\.0\.0\.1:31999") as info:
        connect(cfg)
    assert "start the cluster" in info.value.remedy
