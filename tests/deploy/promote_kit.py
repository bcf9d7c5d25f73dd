"""Fixtures for the promote, rollback, gate and target tests: a throwaway project whose
releases have synthetic evidence (eval outcomes and load-sweep points the kit makes up, no
model served or evaluated, written to disk by the real writers from BenchResult, EvalResult
and Comparison models) and are registered in a real embedded MLflow store, environments on
ports 25000-25999 (these tests' range, see CONTRIBUTING.md), and a stand-in vLLM
(promote_fake_vllm.py) behind real gateway processes.

Import `kit` into a test module (`from promote_kit import kit`); `mlflow_template_db` is
tests/conftest.py's, so that the store is migrated once per session.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from portbands import first_free, share
from project_copy import land

from releasekit._support.http import http_client
from releasekit.bench.reuse import bench_key, cite, find_measurement
from releasekit.bench.runner import BenchResult, write_evidence
from releasekit.bench.stats import LatencySummary, PointFlag, PointResult
from releasekit.config import Settings, load_settings
from releasekit.evaluate.compare import compare, dump_comparison
from releasekit.evaluate.runner import EvalResult, ItemResult, summarise
from releasekit.evaluate.runner import write_outputs as write_eval
from releasekit.evaluate.suites import load_suite
from releasekit.spec.loadprofile import load_profile
from releasekit.spec.lock import Lock, lock
from releasekit.spec.manifest import load_manifest
from releasekit.spec.measured import MeasuredOn
from releasekit.stores.ledger import Ledger
from releasekit.stores.results import ReleasePaths

HERE = Path(__file__).resolve().parent
FAKE_VLLM = HERE / "promote_fake_vllm.py"
# RELEASEKIT_TEST_DEPLOY_PORTS=LOW-HIGH moves the range (two suites on one host); each
# xdist worker takes its share of it (portbands).
_DEPLOY_PORTS = share(
    *(int(x) for x in os.environ.get("RELEASEKIT_TEST_DEPLOY_PORTS", "25000-25999").split("-"))
)
PORT_LOW, PORT_HIGH = _DEPLOY_PORTS.start, _DEPLOY_PORTS.stop - 1
ACTOR = "Pat Promoter <pat@example.com>"


def free_port_in_band(
    low: int | None = None, high: int | None = None, *, what: str = "a gateway"
) -> int:
    """A free port from the top of (this worker's share of) the deploy tests' range
    (gateways; servers use the rest), or from `low`-`high`."""
    low = PORT_HIGH - 99 if low is None else low
    high = PORT_HIGH if high is None else high
    return first_free(range(low, high + 1), what=what)


KIT_HOST = MeasuredOn(
    cpu_vendor="AuthenticAMD", cpu_model="AMD EPYC (test)", isa="avx512_bf16", cores=1,
    load_start=0.5, load_end=0.6,
)  # fmt: skip
"""Where the kit's load tests say they were measured: one core, as a replica of the `ray`
target gets by default, so a knee applies to it (`build(host=...)` for another host)."""


def latency(p95: float) -> LatencySummary:
    """A latency summary whose p95 is `p95` seconds."""
    return LatencySummary(
        n=48, p50=p95 * 0.6, p90=p95 * 0.9, p95=p95, p99=p95 * 1.2, mean=p95 * 0.7
    )


def point(
    load: float,
    *,
    ttft_p95: float,
    goodput: float,
    slo_ok: bool = True,
    flagged: bool = False,
) -> PointResult:
    """One load point of a closed-loop sweep."""
    return PointResult(
        load=load,
        mode="concurrency",
        n=48,
        ok=48,
        errors=0,
        timeouts=0,
        error_rate=0.0,
        timeout_rate=0.0,
        duration_s=6.0,
        request_throughput=goodput * 1.05,
        output_token_throughput=goodput * 48,
        goodput=goodput,
        slo_attainment=0.97 if slo_ok else 0.4,
        slo_ok=slo_ok,
        holds=slo_ok and not flagged,
        runs_holding=3 if slo_ok and not flagged else 0,
        ttft=latency(ttft_p95),
        tpot=latency(0.02),
        itl=latency(0.02),
        e2e=latency(ttft_p95 + 1.0),
        flags=[PointFlag(code="client_bound", message="client CPU saturated")] if flagged else [],
    )


@dataclass
class Kit:
    """A project with environments, releases built on demand, and cleanup of processes."""

    root: Path
    settings: Settings
    python: Path
    ports: dict[str, int]
    rids: dict[str, str] = field(default_factory=dict)

    def manifest(self, name: str) -> Path:
        return self.root / "manifests" / f"{name}.yaml"

    def variant(self, base: str, new: str, replace: dict[str, str] | None = None) -> Path:
        """Copy manifest `base` as `new`, replacing text old -> new."""
        text = self.manifest(base).read_text().replace(f"name: {base}", f"name: {new}")
        for old, repl in (replace or {}).items():
            assert old in text, old
            text = text.replace(old, repl)
        path = self.manifest(new)
        path.write_text(text)
        return path

    def build(
        self,
        name: str,
        *,
        fail: dict[str, int] | None = None,
        knee_ttft: float = 0.20,
        knee_goodput: float = 8.0,
        flagged_knee: bool = False,
        stable: bool = True,
        profile_digest: str | None = None,
        baseline: str | None = None,
        register: bool = True,
        host: MeasuredOn | None = None,
        reuse: bool = False,
    ) -> str:
        """Lock `name` and write real build outputs: lock and manifest copies, eval results
        (every suite; the first `fail[suite]` items fail), a bench sweep (knee at load 16;
        its JSON, not the sweep's picture, which no gate reads), optionally a comparison
        against `baseline`'s eval; then register it in MLflow. With `reuse`, the bench is
        the registered load test the build's evidence stage would cite, when there is one."""
        lk: Lock = lock(self.manifest(name), root=self.root)
        rid = lk.release_id
        paths = ReleasePaths.of(self.settings, rid)
        paths.root.mkdir(parents=True, exist_ok=True)
        paths.lock.write_text(lk.model_dump_json(indent=2))
        shutil.copy(self.manifest(name), paths.manifest)
        lm = load_manifest(self.manifest(name), root=self.root)
        result = self._eval(lm, rid, fail or {})
        write_eval(result, paths.eval_dir)
        profile = load_profile(lm.resolve(lm.manifest.load.profile))
        pts = [
            point(1, ttft_p95=0.05, goodput=2.0),
            point(4, ttft_p95=0.08, goodput=5.0),
            point(16, ttft_p95=knee_ttft, goodput=knee_goodput, flagged=flagged_knee),
            point(32, ttft_p95=2.5, goodput=3.0, slo_ok=False),
        ]
        bench = BenchResult(
            release_id=rid,
            profile_digest=profile_digest or lk.inputs["load/profile"],
            profile_name=profile.name,
            model=lm.manifest.served_name,
            base_url="http://127.0.0.1:1",
            api="completions",
            mode="concurrency",
            slo=profile.slo,
            started_at=dt.datetime.now(dt.UTC).isoformat(),
            tokens_per_word=1.3,
            points=pts,
            knee=pts[2],
            repetitions=3,
            knee_stable=stable,
            knee_by_repetition=[16, 16, 16] if stable else [16, 4, 16],
            host=host or KIT_HOST,
        )
        bench.bench_key = bench_key(lk, lm.manifest.served_name)  # as bench_served tags it
        if reuse:
            led = Ledger(self.settings.ledger_url or "")
            found = find_measurement(
                self.settings, lk, lm.manifest.served_name, ledger=led, host=host or KIT_HOST
            )
            if found is not None:
                bench = cite(found, release_id=rid)
        write_evidence(bench, paths.bench_dir)  # gates read bench.json only
        if baseline is not None:
            from releasekit.evaluate.runner import load_result

            base_eval = load_result(ReleasePaths.of(self.settings, self.rids[baseline]).eval_dir)
            paths.report_dir.mkdir(parents=True, exist_ok=True)
            paths.compare.write_bytes(dump_comparison(compare(result, base_eval, lm)))
        if register:
            from releasekit.releases.register import register_release

            register_release(self.settings, self.manifest(name))
        self.rids[name] = rid
        return rid

    def _eval(self, lm: Any, rid: str, fail: dict[str, int]) -> EvalResult:
        suites = {}
        items: list[ItemResult] = []
        for s in lm.manifest.eval.suites:
            ls = load_suite(lm.resolve(s.path), s)
            mine = []
            for i, it in enumerate(ls.items):
                bad = i < fail.get(s.name, 0)
                mine.append(
                    ItemResult(
                        id=it.id,
                        suite=s.name,
                        scorer=it.scorer or s.scorer,
                        outcome="fail" if bad else "pass",
                        score=0.0 if bad else 1.0,
                        output="wrong" if bad else "right",
                        vars=dict(it.vars),
                    )
                )
            suites[s.name] = summarise(mine, ls)
            items += mine
        return EvalResult(
            release_id=rid, name=lm.manifest.name, model=lm.manifest.served_name,
            suites=suites, items=items,
        )  # fmt: skip

    def gateway(self, env: str) -> str:
        return f"http://127.0.0.1:{self.ports[env]}"


def _write_python_wrapper(dst: Path) -> Path:
    script = dst / "fake-python"
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE_VLLM}" "$@"\n')
    script.chmod(0o755)
    return script


def _toml(ports: dict[str, int], smoke: str, extra: dict[str, str], lines: list[str]) -> str:
    out = []
    for env, port in ports.items():
        out.append(f"[environments.{env}]")
        out.append(f"port = {port}")
        out.append(f"warm_s = {extra.get(env + '.warm_s', '300')}")
        out.append("drain_deadline_s = 20")
        out.append("release_header = true")  # the tests check which release answered
        # Copies in flight: every request's copy and floor copy at once, however slowly the
        # stand-in servers answer on a busy host, so a mirrored request always has its pair.
        out.append("shadow_max_in_flight = 64")
        if env == "production":
            out.append('requires = "staging"')
        out.append(f"smoke = {smoke}")
        out.extend(lines)
        out.append("")
    return "\n".join(out)


GOODPUT_LINE = "  - {metric: bench.knee.goodput, kind: non_inferior, margin: 0.25}\n"
"""The demo manifests' goodput tolerance (25%); a variant without it gets the default (10%)."""


def commit_config(project: Path, message: str = "environments and their policy") -> None:
    """Commit the project's releasekit.toml and land it on the protected ref: an
    environment's policy is read from a commit there (releasekit.promote.policy), so a change
    to it is a reviewed commit, as in a real repository."""
    git = ["git", "-C", str(project), "-c", "user.name=Test", "-c", "user.email=t@example.com"]
    subprocess.run([*git, "add", "releasekit.toml"], check=True, capture_output=True)
    # (Nothing to commit when the file is already committed as it is.)
    subprocess.run([*git, "commit", "-qm", message, "--", "releasekit.toml"], capture_output=True)
    same = subprocess.run([*git, "diff", "--quiet", "HEAD", "--", "releasekit.toml"])
    assert same.returncode == 0, "releasekit.toml could not be committed"
    land(project)  # the policy is read from commits on the protected ref


def empty_mlflow_store(db: Path) -> Path:
    """Create and migrate an empty MLflow SQLite store at `db` (a template to copy)."""
    from mlflow import MlflowClient

    MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments()
    return db


@pytest.fixture(scope="session")
def mlflow_template_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty MLflow SQLite store, migrated once per session."""
    return empty_mlflow_store(tmp_path_factory.mktemp("mlflow-template-promote") / "mlflow.db")


def prepare_kit(
    project: Path,
    mlflow_db: Path,
    *,
    warm_s: dict[str, float] | None = None,
    smoke: str | None = None,
    toml_lines: list[str] | None = None,
) -> dict[str, int]:
    """Write the deploy tests' files into `project` (tests/conftest.py): an MLflow store
    copied from `mlflow_db`, a smoke suite, and staging and production on free ports in a
    committed releasekit.toml. Returns the environments' ports."""
    state = project / ".releasekit"
    state.mkdir(exist_ok=True)
    shutil.copy(mlflow_db, state / "mlflow.db")
    smoke_file = project / "pipelines" / "smoke.jsonl"
    smoke_file.write_text(
        "".join(
            json.dumps({"id": f"s{i}", "vars": {"question": f"q{i}?"}, "expected": "42"}) + "\n"
            for i in range(4)
        )
    )
    ports = {"staging": free_port_in_band(), "production": 0}
    ports["production"] = free_port_in_band(ports["staging"] + 1)
    extra = {f"{k}.warm_s": str(v) for k, v in (warm_s or {}).items()}
    smoke_cfg = smoke or f'{{ path = "{smoke_file}", max_items = 4, min_pass_rate = 0.75 }}'
    (project / "releasekit.toml").write_text(_toml(ports, smoke_cfg, extra, toml_lines or []))
    commit_config(project)
    return ports


def kit_environment(project: Path, python: Path, *, real_vllm: bool) -> dict[str, str]:
    """The variables a kit's commands run with: its configuration, actor and port band,
    the Python that starts servers (`python`: a real one, or the stand-in's wrapper), and
    start-up and stop timeouts sized for a real vLLM or the stand-in."""
    return {
        "RELEASEKIT_ACTOR": ACTOR,
        "RELEASEKIT_PORT_RANGE": f"{PORT_LOW}-{PORT_HIGH - 100}",
        "RELEASEKIT_CONFIG": str(project / "releasekit.toml"),
        "RELEASEKIT_PYTHON": str(python),
        "RELEASEKIT_SERVER_START_TIMEOUT_S": "900" if real_vllm else "30",
        "RELEASEKIT_SERVER_STOP_GRACE_S": "3",
    }


def use_kit(
    project: Path,
    monkeypatch: pytest.MonkeyPatch,
    ports: dict[str, int],
    *,
    python: Path | None = None,
) -> Kit:
    """A kit on a project `prepare_kit` has set up: this test's working folder and
    variables point at it (`python` None: the stand-in vLLM)."""
    from releasekit.cli._common import State

    monkeypatch.chdir(project)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for key in list(os.environ):
        if key.startswith("RELEASEKIT_"):
            monkeypatch.delenv(key)
    server_python = python or _write_python_wrapper(project)
    for key, value in kit_environment(project, server_python, real_vllm=python is not None).items():
        monkeypatch.setenv(key, value)
    State.reset()
    settings = load_settings(root=project)
    return Kit(root=project, settings=settings, python=server_python, ports=ports)


def make_kit(
    project: Path,
    monkeypatch: pytest.MonkeyPatch,
    mlflow_db: Path,
    *,
    warm_s: dict[str, float] | None = None,
    python: Path | None = None,
    smoke: str | None = None,
    toml_lines: list[str] | None = None,
) -> Kit:
    """Set up `project` (tests/conftest.py) for deploy tests."""
    ports = prepare_kit(project, mlflow_db, warm_s=warm_s, smoke=smoke, toml_lines=toml_lines)
    return use_kit(project, monkeypatch, ports, python=python)


def kill_everything(settings: Settings) -> None:
    """Stop every gateway, server and expirer the deploy state (or its logs) names."""
    from releasekit._support.procs import group_alive
    from releasekit.deploy.state import list_envs, read_state

    pgids: set[int] = set()
    for env in list_envs(settings.state_dir):
        st = read_state(settings.state_dir, env)
        if st.gateway:
            pgids.add(st.gateway.pid)
        pgids.update(s.pid for s in st.servers if s.app is None)  # not Ray applications
    from releasekit.deploy import local

    pgids.update(local._CHILDREN)
    for g in pgids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(g, signal.SIGKILL)
    end = time.monotonic() + 10
    while any(group_alive(g) for g in pgids) and time.monotonic() < end:
        local._reap()
        time.sleep(0.05)


@pytest.fixture
def kit(
    project: Path,
    monkeypatch: pytest.MonkeyPatch,
    mlflow_template_db: Path,
    stand_in_model: Any,
) -> Iterator[Kit]:
    """A deploy-test project with a stand-in model; every process it started is killed."""
    stand_in_model(project)
    k = make_kit(project, monkeypatch, mlflow_template_db)
    try:
        yield k
    finally:
        kill_everything(k.settings)


class Streamer:
    """A client streaming completions through a gateway back to back, in a thread; every
    request must end with `[DONE]` after all its chunks."""

    def __init__(
        self, url: str, *, chunks: int = 15, model: str = "demo", exact: bool = True
    ) -> None:
        self.url = url
        self.chunks = chunks
        self.exact = exact
        self.model = model
        self.done = 0
        self.failures: list[str] = []
        self.releases: list[str] = []
        # Per stream, in order: (monotonic end time, "ok" or the failure, the replica that
        # served it: its x-releasekit-replica header, None when no answer came).
        self.log: list[tuple[float, str, str | None]] = []
        self._replica: str | None = None
        self.in_flight_on: str | None = None  # the replica of the stream being read now
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _one(self, client: httpx.Client) -> None:
        body = {
            "model": self.model,
            "prompt": "hi",
            "max_tokens": self.chunks,
            "stream": True,
            "ignore_eos": True,
        }
        got, finished = 0, False
        self._replica = None
        with client.stream("POST", "/v1/completions", json=body) as r:
            self._replica = r.headers.get("x-releasekit-replica")
            if r.status_code != 200:
                self._fail(f"HTTP {r.status_code}: {r.read()[:200]!r}")
                return
            self.releases.append(r.headers.get("x-releasekit-release", "?"))
            self.in_flight_on = self._replica
            try:
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        finished = True
                    elif line.startswith("data: "):
                        data = json.loads(line[6:])
                        if "error" in data:
                            self._fail(f"stream error: {data['error']}")
                            return
                        got += 1
            finally:
                self.in_flight_on = None
        if not finished or (got != self.chunks if self.exact else got < 1):
            self._fail(f"cut stream: {got}/{self.chunks} chunks, done={finished}")
        else:
            self.done += 1
            self.log.append((time.monotonic(), "ok", self._replica))

    def _fail(self, what: str) -> None:
        self.failures.append(what)
        self.log.append((time.monotonic(), what, self._replica))

    def _run(self) -> None:
        with http_client(base_url=self.url, timeout=60, trust_env=False) as client:
            while not self._stop.is_set():
                try:
                    self._one(client)
                except httpx.HTTPError as exc:
                    self._fail(repr(exc))

    def __enter__(self) -> Streamer:
        self._thread.start()
        return self

    def wait_for(self, n: int, timeout_s: float = 60) -> None:
        end = time.monotonic() + timeout_s
        start = self.done
        while self.done < start + n and time.monotonic() < end:
            time.sleep(0.02)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


LORA_ARGS = (
    "    enforce-eager: true\n    enable-lora: true\n    max-loras: 2\n    max-lora-rank: 8\n"
)


def adapter_release(
    k: Kit, name: str, weights: bytes, *, register: bool = True, adapter: str = "demo-json"
) -> str:
    """A variant of demo-bf16 (LoRA enabled) serving one rank-8 adapter (`adapter`, the
    model name clients ask for) whose weights are `weights` (its own folder per variant),
    locked and built."""
    import json

    from releasekit.spec.adapters import weights_digest

    folder = k.root / "models" / "adapters" / name
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": 8, "peft_type": "LORA"}))
    (folder / "adapter_model.safetensors").write_bytes(weights)
    base = weights_digest(k.root / "models" / "demo-base")
    path = k.variant("demo-bf16", name, {"    enforce-eager: true\n": LORA_ARGS})
    with path.open("a") as f:
        f.write(
            "adapters:\n"
            f"  - {{name: {adapter}, path: models/adapters/{name}, rank: 8, base: {base}}}\n"
        )
    return k.build(name, register=register)


def lora_base_release(k: Kit, name: str = "demo-lorabase") -> str:
    """demo-bf16 started LoRA-ready and carrying no adapter (the base adapter lanes run on:
    the same serving key as `adapter_release`'s), locked and built."""
    k.variant("demo-bf16", name, {"    enforce-eager: true\n": LORA_ARGS})
    return k.build(name)
