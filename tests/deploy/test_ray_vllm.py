"""The `ray` target with real vLLM replicas on a two-node Ray cluster on loopback (a head
and a second `ray start --address` node, two logical CPUs each): a two-replica release is
placed on both nodes, a promotion and a rollback under a streaming client fail and cut no
stream, and a replica whose process is killed is replaced while the client streams.
Several minutes: four vLLM servers start on the host (two per release)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from promote_kit import Streamer, kill_everything, make_kit, mlflow_template_db
from ray_kit import RayCluster, env_lines, free_slot

pytest.importorskip("ray")

from releasekit.promote.deploy import deploy_status
from releasekit.promote.promote import promote
from releasekit.promote.rollback import rollback

__all__ = ["mlflow_template_db"]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def _live_replicas(settings: object, env: str = "staging") -> list[object]:
    [st] = deploy_status(settings, env=env)  # type: ignore[arg-type]
    return [r for s in st.servers if s.role == "live" for r in s.replicas]


def test_two_node_cluster_promote_rollback_and_a_killed_replica_with_real_vllm(
    project: Path,
    demo_model: Path,
    monkeypatch: pytest.MonkeyPatch,
    mlflow_template_db: Path,
    tmp_path: Path,
) -> None:
    """bf16 on two replicas, one per node; promote a second release and roll back while a
    client streams (0 failed, 0 cut); SIGKILL one replica's Ray worker: Ray starts a new
    replica and the stream of requests goes on (only a stream in flight on the killed
    replica may be cut)."""
    c = RayCluster(slot=free_slot(), root=tmp_path / "ray")
    (tmp_path / "ray").mkdir()
    k = None
    try:
        c.add_node(num_cpus=2)
        c.add_node(num_cpus=2)
        k = make_kit(
            project,
            monkeypatch,
            mlflow_template_db,
            python=Path(sys.executable),
            smoke='{ suite = "core", max_items = 2, min_pass_rate = 0.0 }',
            toml_lines=env_lines(c, max_replicas_per_node=1, health_check_timeout_s=20),
        )
        t0 = time.monotonic()
        v1 = k.build("demo-bf16")
        res = promote(k.settings, v1, env="staging", reason="ray e2e")
        assert res.status == "promoted", res.deploy
        first_s = time.monotonic() - t0
        reps = _live_replicas(k.settings)
        assert {r.node_ip for r in reps} == {"127.0.0.2", "127.0.0.3"}  # type: ignore[attr-defined]

        # A replica's process killed while a client streams: Ray replaces it.
        victim = reps[0]
        with Streamer(k.gateway("staging"), chunks=24, exact=False) as s2:
            s2.wait_for(2, timeout_s=120)
            t_kill = time.monotonic()
            os.kill(victim.pid, signal.SIGKILL)  # type: ignore[attr-defined]
            now: list[object] = []
            while time.monotonic() < t_kill + 600:
                now = _live_replicas(k.settings)
                ids = {r.replica for r in now}  # type: ignore[attr-defined]
                if len(ids) == 2 and victim.replica not in ids:  # type: ignore[attr-defined]
                    break
                time.sleep(2)
            replaced_s = round(time.monotonic() - t_kill, 1)
            after_kill = len(s2.failures)
            s2.wait_for(3, timeout_s=120)
        ids = {r.replica for r in now}  # type: ignore[attr-defined]
        assert len(ids) == 2 and victim.replica not in ids  # type: ignore[attr-defined]
        assert after_kill <= 1, s2.failures  # at most the one stream on the killed replica
        assert len(s2.failures) == after_kill, s2.failures  # none after the replacement

        # A promotion and a rollback while a client streams: nothing failed or cut.
        k.variant("demo-bf16", "demo-v2", {"max-num-seqs: 32": "max-num-seqs: 16"})
        v2 = k.build("demo-v2")
        with Streamer(k.gateway("staging"), chunks=24, exact=False) as s:
            s.wait_for(2, timeout_s=120)
            up = promote(k.settings, v2, env="staging", reason="second release")
            s.wait_for(2, timeout_s=120)
            back = rollback(k.settings, "staging", reason="ray e2e rollback")
            s.wait_for(2, timeout_s=120)
        assert up.status == "promoted", up.deploy
        assert back.status == "rolled_back" and back.to_release == v1
        assert s.failures == [], s.failures
        assert {v1, v2} <= set(s.releases)
        print(
            "ray-e2e",
            json.dumps(
                {
                    "first_promotion_s": round(first_s, 1),
                    "replica_replaced_s": replaced_s,
                    "streams_cut_by_kill": after_kill,
                    "streams_ok_around_kill": s2.done,
                    "streams_ok_during_switches": s.done,
                    "streams_failed_during_switches": len(s.failures),
                    "nodes": sorted({r.node_ip for r in now}),  # type: ignore[attr-defined]
                    "second_release_ready_s": up.deploy.steps[2].seconds
                    if up.deploy and len(up.deploy.steps) > 2
                    else None,
                }
            ),
        )
    finally:
        # No serve.delete: a replica still starting would hold it; stopping the cluster
        # ends the replicas, and their vLLM servers die with them (parent-death signal).
        if k is not None:
            kill_everything(k.settings)
        with contextlib.suppress(Exception):
            import ray

            ray.shutdown()
        c.stop()
