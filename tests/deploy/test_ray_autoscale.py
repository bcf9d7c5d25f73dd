"""Autoscaling from the knee on a real two-node Ray cluster on loopback (tests/deploy/ray_kit.py:
a head and a second `ray start --address` node, one logical CPU each, one replica per CPU),
with the deploy tests' stand-in vLLM as each replica's server (each stream's chunks 0.2 s
apart, so a stream holds its slot for seconds).

The release's knee is concurrency 16 (its bench.json, written by the bench's own writer);
the environment keeps 75% of it spare, so Ray aims at 16 x (1 - 0.75) = 4 requests in flight
per replica. A load step of 12 concurrent streams through the environment's gateway brings a
second replica up (on the second node: the head has no CPU left), seen in Ray Serve's own
status and in deploy-status; every request succeeds; after the step the release goes back
to one replica.

With RELEASEKIT_AUTOSCALE_OUT set (benchmarks/autoscale_step.py sets it) the run's figures are
written there: replicas over time (Ray Serve's status), TTFT p95 at the gateway per phase,
failures.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from promote_kit import Kit, kill_everything, make_kit, mlflow_template_db
from ray_kit import RayCluster, env_lines, free_slot
from typer.testing import CliRunner

pytest.importorskip("ray")

from releasekit.cli import app
from releasekit.cli._common import State
from releasekit.promote.deploy import ScaleStatus, deploy_status
from releasekit.promote.promote import promote

__all__ = ["mlflow_template_db"]

pytestmark = [pytest.mark.slow]

_OUT = os.environ.get("RELEASEKIT_AUTOSCALE_OUT")  # read at import: the kit clears RELEASEKIT_*

HEADROOM = 0.75
POLICY = (
    f'{{ target = "knee", knee_headroom = {HEADROOM}, min_replicas = 1, max_replicas = 2, '
    "upscale_delay_s = 2, downscale_delay_s = 6, look_back_period_s = 3, "
    "metrics_interval_s = 0.5 }"
)
STEP_STREAMS = 12  # 3 x the target of 4 in flight: Ray wants 3 replicas, the range allows 2
CHUNKS = 15
CHUNK_DELAY_S = 0.2


class Load:
    """Clients streaming completions back to back through the gateway, each in a thread;
    every request is recorded: (phase, start, TTFT or None, end, "ok" or the failure,
    the replica that served it)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.records: list[tuple[str, float, float | None, float, str, str | None]] = []
        self.phase = "before"
        self._threads: list[tuple[threading.Thread, threading.Event]] = []

    def _one(self, client: httpx.Client) -> None:
        body = {"model": "demo", "prompt": "hi", "max_tokens": CHUNKS, "stream": True}
        phase, t0 = self.phase, time.monotonic()
        ttft: float | None = None
        got, done, outcome, replica = 0, False, "ok", None
        try:
            with client.stream("POST", "/v1/completions", json=body) as r:
                replica = r.headers.get("x-releasekit-replica")
                if r.status_code != 200:
                    outcome = f"HTTP {r.status_code}: {r.read()[:200]!r}"
                else:
                    for line in r.iter_lines():
                        if line == "data: [DONE]":
                            done = True
                        elif line.startswith("data: "):
                            if "error" in json.loads(line[6:]):
                                outcome = f"stream error: {line[:200]}"
                                break
                            if ttft is None:
                                ttft = time.monotonic() - t0
                            got += 1
            if outcome == "ok" and (not done or got != CHUNKS):
                outcome = f"cut stream: {got}/{CHUNKS} chunks, done={done}"
        except httpx.HTTPError as exc:
            outcome = repr(exc)
        self.records.append((phase, t0, ttft, time.monotonic(), outcome, replica))

    def add(self, n: int) -> None:
        """Start `n` more clients."""
        for _ in range(n):
            stop = threading.Event()

            def run(stop: threading.Event = stop) -> None:
                with httpx.Client(base_url=self.url, timeout=120, trust_env=False) as c:
                    while not stop.is_set():
                        self._one(c)

            t = threading.Thread(target=run, daemon=True)
            t.start()
            self._threads.append((t, stop))

    def drop(self, n: int) -> None:
        """Stop `n` clients after their current stream (waits for it to finish)."""
        gone = self._threads[-n:]
        del self._threads[-n:]
        for _, stop in gone:
            stop.set()
        for t, _ in gone:
            t.join(timeout=120)

    def failures(self) -> list[str]:
        return [r[4] for r in self.records if r[4] != "ok"]


def _p95(values: list[float]) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round(s[min(len(s) - 1, int(0.95 * len(s)))], 3)


def _scale(k: Kit) -> tuple[ScaleStatus | None, list[Any]]:
    [st] = deploy_status(k.settings, env="staging")
    live = [s for s in st.servers if s.role == "live"]
    return (live[0].scale, live[0].replicas) if live else (None, [])


@pytest.mark.timeout(600)
def test_a_load_step_above_the_knee_target_adds_a_replica_and_it_goes_away_after(
    project: Path,
    monkeypatch: pytest.MonkeyPatch,
    mlflow_template_db: Path,
    stand_in_model: Any,
    tmp_path: Path,
) -> None:
    """1 client, then 12 concurrent streams (3x the per-replica target), then 1 client:
    Ray Serve's own status goes from 1 replica to 2 (the second on the second node) and
    back to 1; deploy-status shows the count and the derived range; every request through
    the gateway succeeds."""
    c = RayCluster(slot=free_slot(), root=tmp_path / "ray")
    (tmp_path / "ray").mkdir()
    k: Kit | None = None
    load: Load | None = None
    timeline: list[dict[str, Any]] = []
    try:
        c.add_node(num_cpus=1)
        c.add_node(num_cpus=1)
        stand_in_model(project)
        k = make_kit(
            project,
            monkeypatch,
            mlflow_template_db,
            toml_lines=env_lines(c, replicas=1, cpus_per_replica=1, autoscaling=POLICY),
        )
        monkeypatch.setenv("RELEASEKIT_SERVER_START_TIMEOUT_S", "120")
        kv = 'VLLM_CPU_KVCACHE_SPACE: "1"'
        k.variant(
            "demo-bf16", "demo-slow", {kv: f'{kv}\n    FAKE_CHUNK_DELAY_S: "{CHUNK_DELAY_S}"'}
        )
        from releasekit.config import load_settings

        k.settings = load_settings(root=project)
        rid = k.build("demo-slow")
        res = promote(k.settings, rid, env="staging", reason="autoscaled")
        assert res.status == "promoted", res.deploy
        assert res.autoscaling is not None
        assert (
            "autoscaling 1-2 replicas, target 4 in flight per replica = knee 16 x (1 - 0.75)"
            in (res.autoscaling.text)
        )
        t0 = time.monotonic()

        def sample(phase: str) -> ScaleStatus:
            sc, reps = _scale(k)  # type: ignore[arg-type]
            assert sc is not None, "deploy-status shows no replica count for the live release"
            timeline.append(
                {
                    "t_s": round(time.monotonic() - t0, 2),
                    "phase": phase,
                    "running": sc.running,
                    "starting": sc.starting,
                    "stopping": sc.stopping,
                    "status": sc.status,
                    "nodes": len({r.node_id for r in reps}),
                }
            )
            return sc

        first = sample("before")
        assert first.running == 1 and (first.min_replicas, first.max_replicas) == (1, 2)
        assert first.target_in_flight == 4.0

        load = Load(k.gateway("staging"))
        load.add(1)
        end = time.monotonic() + 8
        while time.monotonic() < end:
            sample("before")
            time.sleep(1)

        # The step: 12 streams in flight on one replica, 3x its target.
        load.phase = "step"
        starts = {"step": round(time.monotonic() - t0, 2)}
        load.add(STEP_STREAMS - 1)
        up = None
        end = time.monotonic() + 180
        while time.monotonic() < end:
            sc = sample("step")
            if sc.running == 2:
                up = time.monotonic() - t0
                break
            time.sleep(0.5)
        assert up is not None, f"no second replica within 180 s: {timeline[-5:]}"
        _, reps = _scale(k)
        assert len({r.node_id for r in reps}) == 2  # the second replica on the second node
        # Keep the step on until the new replica has served streams itself.
        end = time.monotonic() + 60
        while time.monotonic() < end:
            sample("step")
            served = {r[5] for r in load.records if r[0] == "step" and r[4] == "ok"}
            if len(served) >= 2:
                break
            time.sleep(0.5)
        [st] = deploy_status(k.settings, env="staging")
        metrics = httpx.get(
            f"{st.servers[0].base_url}/metrics",
            params={"app": st.servers[0].app or ""},
            timeout=10,
        ).text
        assert "releasekit:replicas 2" in metrics  # what watch's windows read

        # After the step: one client again; Ray scales back to the minimum.
        load.phase = "after"
        starts["after"] = round(time.monotonic() - t0, 2)  # the step's streams finish theirs
        load.drop(STEP_STREAMS - 1)
        starts["after_step_streams_done"] = round(time.monotonic() - t0, 2)
        down = None
        end = time.monotonic() + 180
        while time.monotonic() < end:
            sc = sample("after")
            if sc.running == 1 and sc.stopping == 0 and sc.starting == 0:
                down = time.monotonic() - t0
                break
            time.sleep(0.5)
        assert down is not None, f"not back to 1 replica within 180 s: {timeline[-5:]}"
        end = time.monotonic() + 5
        while time.monotonic() < end:
            sample("after")
            time.sleep(1)
        load.drop(1)

        State.reset()
        r = CliRunner().invoke(app, ["deploy-status", "staging"], env={"COLUMNS": "300"})
        assert r.exit_code == 0, r.output
        flat = " ".join(r.output.split())
        assert "runs 1 replica(s)" in flat and "autoscaling 1-2 replicas, target 4" in flat

        records = load.records
        served = {r[5] for r in records if r[0] == "step" and r[4] == "ok"}
        result = {
            "what": "a load step through the environment's gateway on a Ray environment "
            "autoscaling from the release's knee: 1 client streaming back to back, then "
            f"{STEP_STREAMS} concurrent streams, then 1 client; {CHUNKS} chunks a stream, "
            f"{CHUNK_DELAY_S} s apart; two Ray nodes on loopback (1 CPU each, 1 CPU a replica)",
            "engine": "stand-in vLLM (tests/deploy/promote_fake_vllm.py)",
            "autoscaling": res.autoscaling.model_dump(mode="json"),
            "phase_starts_s": starts,
            "scaled_up_at_s": round(up, 1),
            "scaled_down_at_s": round(down, 1),
            "replicas_over_time": timeline,
            "phases": {
                phase: {
                    "requests": sum(1 for r in records if r[0] == phase),
                    "failed": sum(1 for r in records if r[0] == phase and r[4] != "ok"),
                    "ttft_p95_s": _p95([r[2] for r in records if r[0] == phase and r[2]]),
                }
                for phase in ("before", "step", "after")
            },
            "replicas_serving_the_step": len(served),
            "failures": load.failures(),
        }
        print(
            "autoscale-step",
            json.dumps({k_: v for k_, v in result.items() if k_ != "replicas_over_time"}),
        )
        if _OUT:  # the benchmark adds its run block (benchmarks/autoscale_step.py)
            Path(_OUT).write_text(json.dumps(result, indent=2) + "\n")
        assert load.failures() == []
        assert len(served) == 2  # both replicas served streams of the step
        assert max(x["running"] for x in timeline) == 2  # never above the range
    finally:
        if load is not None:
            with contextlib.suppress(Exception):
                load.drop(len(load._threads))
        if k is not None:
            kill_everything(k.settings)
        with contextlib.suppress(Exception):
            import ray

            ray.shutdown()
        c.stop()
