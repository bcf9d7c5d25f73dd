"""The `ray` target with real vLLM replicas on a two-node Ray cluster on loopback (a head
and a second `ray start --address` node, two logical CPUs each): a two-replica release is
placed on both nodes, a replica whose Ray worker is killed while a client streams is
replaced (three vLLM starts, about 2 minutes on 2 cores: in the slow suite), and a
promotion and a rollback under a streaming client fail and cut no stream (four vLLM
servers, two per release: only with RELEASEKIT_TEST_RAY_VLLM=1)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from promote_kit import Streamer, kill_everything, make_kit
from ray_kit import RayCluster, env_lines, free_slot

pytest.importorskip("ray")

from releasekit.promote.deploy import deploy_status
from releasekit.promote.promote import promote
from releasekit.promote.rollback import rollback

pytestmark = [pytest.mark.slow]

# Read at import: the tests' project fixture clears RELEASEKIT_* variables.
_OPT_IN = os.environ.get("RELEASEKIT_TEST_RAY_VLLM") == "1"
_LOGS_OUT = os.environ.get("RELEASEKIT_RAY_LOGS_OUT")
_REPLACE_OUT = os.environ.get("RELEASEKIT_RAY_REPLACE_OUT")
# Four vLLM servers (two releases) on a 2-core host: more than the slow suite's budget.
opt_in = pytest.mark.skipif(
    not _OPT_IN,
    reason="the promotion and rollback with real vLLM replicas runs with "
    "RELEASEKIT_TEST_RAY_VLLM=1 (four vLLM servers); the killed-replica case and the fast "
    "Ray tests (tests/deploy/test_target_ray.py) always run",
)


def _live_replicas(settings: object, env: str = "staging") -> list[object]:
    [st] = deploy_status(settings, env=env)  # type: ignore[arg-type]
    return [r for s in st.servers if s.role == "live" for r in s.replicas]


@opt_in
@pytest.mark.timeout(1800)
def test_two_node_cluster_placement_promotion_and_rollback_with_real_vllm(
    project: Path,
    demo_model: Path,
    monkeypatch: pytest.MonkeyPatch,
    mlflow_template_db: Path,
    tmp_path: Path,
) -> None:
    """bf16 on two replicas, one per node; promote a second release and roll back while a
    client streams: 0 failed, 0 cut."""
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
        # Two nodes (told apart by node id), both on loopback.
        assert len({r.node_id for r in reps}) == 2  # type: ignore[attr-defined]
        assert {r.node_ip for r in reps} == {"127.0.0.1"}  # type: ignore[attr-defined]

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
                    "streams_ok_during_switches": s.done,
                    "streams_failed_during_switches": len(s.failures),
                    "nodes": sorted({r.node_id[:12] for r in reps}),  # type: ignore[attr-defined]
                    "second_release_start_s": next(
                        (x.seconds for x in up.deploy.steps if x.step == "server"), None
                    )
                    if up.deploy
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


def _keep_logs(k: object, c: RayCluster) -> None:
    """Copy the replicas' server logs and the nodes' Ray logs to RELEASEKIT_RAY_LOGS_OUT
    (a folder), if set, before the cluster's temp dirs go."""
    out = _LOGS_OUT
    if not out:
        return
    dst = Path(out)
    dst.mkdir(parents=True, exist_ok=True)
    if k is not None:
        logs = k.settings.state_dir / "logs"  # type: ignore[attr-defined]
        if logs.is_dir():
            shutil.copytree(logs, dst / "servers", dirs_exist_ok=True)
    for i, node in enumerate(c.nodes):
        for d in node.temp_dir.glob("session_*/logs"):
            if not d.parent.is_symlink():
                shutil.copytree(d, dst / f"ray-node-{i}", dirs_exist_ok=True)


@pytest.mark.timeout(900)
def test_a_killed_replica_is_replaced_with_real_vllm(
    project: Path,
    demo_model: Path,
    monkeypatch: pytest.MonkeyPatch,
    mlflow_template_db: Path,
    tmp_path: Path,
) -> None:
    """SIGKILL one replica's Ray worker while a client streams through the gateway: its
    vLLM server dies with it (parent-death signal), Ray starts a replacement replica (a
    new vLLM) and the requests go on on the other replica. What may fail: only the stream
    the killed replica was serving at that moment (the client's stream whose answer came
    from that replica, cut when its process died); every other stream, before, during and
    after the replacement, must end with all its chunks and `[DONE]`. Then the replacement
    is healthy and serves streams itself."""
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
        v1 = k.build("demo-bf16")
        res = promote(k.settings, v1, env="staging", reason="ray e2e")
        assert res.status == "promoted", res.deploy
        reps = _live_replicas(k.settings)
        # Two nodes (told apart by node id), both on loopback.
        assert len({r.node_id for r in reps}) == 2  # type: ignore[attr-defined]
        assert {r.node_ip for r in reps} == {"127.0.0.1"}  # type: ignore[attr-defined]

        victim = reps[0]
        old_ids = {r.replica for r in reps}  # type: ignore[attr-defined]
        new: object | None = None
        with Streamer(k.gateway("staging"), chunks=24, exact=False) as s:
            s.wait_for(4, timeout_s=120)
            # Kill it while it serves the client's stream (that stream may be cut).
            end = time.monotonic() + 60
            while s.in_flight_on != victim.replica and time.monotonic() < end:  # type: ignore[attr-defined]
                time.sleep(0.002)
            serving = s.in_flight_on == victim.replica  # type: ignore[attr-defined]
            t_kill = time.monotonic()
            os.kill(victim.pid, signal.SIGKILL)  # type: ignore[attr-defined]
            while time.monotonic() < t_kill + 600:
                now = _live_replicas(k.settings)
                fresh = [r for r in now if r.replica not in old_ids]  # type: ignore[attr-defined]
                if len(now) == 2 and fresh:
                    new = fresh[0]
                    break
                time.sleep(1)
            replaced_s = time.monotonic() - t_kill
            assert new is not None, f"no replacement replica within 600 s: {now}"
            # Streams go on; wait until the replacement has served some itself.
            end = time.monotonic() + 180
            while time.monotonic() < end:
                if sum(1 for _, o, r in s.log if o == "ok" and r == new.replica) >= 3:  # type: ignore[attr-defined]
                    break
                time.sleep(0.5)
        log = list(s.log)
        before = [e for e in log if e[0] < t_kill]
        after = [e for e in log if e[0] >= t_kill]
        failed_after = [e for e in after if e[1] != "ok"]
        on_victim = [e for e in failed_after if e[2] == victim.replica]  # type: ignore[attr-defined]
        others = [e for e in failed_after if e[2] != victim.replica]  # type: ignore[attr-defined]
        by_new = sum(1 for _, o, r in after if o == "ok" and r == new.replica)  # type: ignore[attr-defined]
        result = {
            "what": "one replica's Ray worker SIGKILLed while one client streams "
            "back to back through the gateway (24 tokens a stream), two replicas on two "
            "Ray nodes on loopback, real vLLM (demo bf16)",
            "killed_while_serving_a_stream": serving,
            "streams_ok_before_kill": sum(1 for e in before if e[1] == "ok"),
            "streams_failed_before_kill": sum(1 for e in before if e[1] != "ok"),
            "streams_ok_after_kill": sum(1 for e in after if e[1] == "ok"),
            "streams_cut_on_killed_replica": len(on_victim),
            "streams_failed_otherwise": len(others),
            "failures": [f"{e[1]} (replica {e[2]})" for e in failed_after],
            "replacement_healthy_s": round(replaced_s, 1),
            "streams_ok_on_replacement": by_new,
            "killed_replica_node": victim.node_id[:12],  # type: ignore[attr-defined]
            "replacement_node": new.node_id[:12],  # type: ignore[attr-defined]
        }
        print("ray-kill", json.dumps(result))
        out = _REPLACE_OUT
        if out:
            from benchmarks._results import run_info

            run = run_info()
            run["command"] = (
                "RELEASEKIT_RAY_REPLACE_OUT=benchmarks/results/ray_replace.json "
                "pytest tests/deploy/test_ray_vllm.py -k killed -s"
            )
            Path(out).write_text(json.dumps({"run": run, **result}, indent=2) + "\n")
        assert s.failures == [e[1] for e in log if e[1] != "ok"]
        assert not [e for e in before if e[1] != "ok"], before
        assert len(on_victim) <= 1, failed_after  # at most the one stream it was serving
        assert others == [], (failed_after, _why_others_failed(k, c))
        assert by_new >= 3, "the replacement served no streams"
    finally:
        # No serve.delete: a replica still starting would hold it; stopping the cluster
        # ends the replicas, and their vLLM servers die with them (parent-death signal).
        with contextlib.suppress(Exception):
            _keep_logs(k, c)
        if k is not None:
            kill_everything(k.settings)
        with contextlib.suppress(Exception):
            import ray

            ray.shutdown()
        c.stop()


_CLUES = re.compile(
    r"Traceback|Error|SIGTERM|SIGKILL|signal|[Kk]ill|OOM|[Oo]ut of memory|memory monitor|"
    r"EngineCore|died|exited",
)


def _why_others_failed(k: object, c: RayCluster) -> str:
    """What the servers, the raylets and the kernel said when a replica that was not killed
    failed too: the lines that name a signal, a kill, memory or an engine error, from every
    replica's server log, every node's raylet log and the kernel's ring buffer."""
    lines: list[str] = []
    logs = k.settings.state_dir / "logs" if k is not None else None  # type: ignore[attr-defined]
    sources = sorted(logs.rglob("*.log")) if logs is not None and logs.is_dir() else []
    for node in c.nodes:
        sources += sorted(node.temp_dir.glob("session_*/logs/raylet*.out"))
        sources += sorted(node.temp_dir.glob("session_*/logs/raylet*.err"))
    for path in sources:
        with contextlib.suppress(OSError):
            hits = [x for x in path.read_text(errors="replace").splitlines() if _CLUES.search(x)]
            if hits:
                lines.append(f"--- {path}")
                lines += hits[-15:]
    dmesg = subprocess.run(["dmesg"], capture_output=True, text=True, check=False)
    lines += [x for x in dmesg.stdout.splitlines() if "oom" in x.lower() or "Killed" in x][-10:]
    return "\n".join(lines) or "no server, raylet or kernel line names a cause"
