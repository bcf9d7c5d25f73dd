"""Fixtures for the registry, ledger and audit tests: a locked project with build outputs,
an embedded MLflow store (migrated once per session, copied per test), a real MLflow server.

Session-scoped fixtures here are made once per session however many modules use them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import webclient
import yaml
from portbands import free_port

if TYPE_CHECKING:
    from releasekit.config import Settings
    from releasekit.spec.lock import Lock

# Keep this module's imports light: spawned worker processes import it.

ACTOR = "Ada Auditor <ada@example.com>"
BIN = Path(sys.executable).parent
# A 1x1 PNG: the bench plot's stand-in.
PNG = bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
    "1f15c4890000000d49444154789c6360000002000100e221bc330000000049454e44ae426082"
)


def bench_point(
    load: float, *, ttft_p95: float, e2e_p95: float = 2.0, ok: bool = True
) -> dict[str, Any]:
    """One load point in the bench/bench.json shape."""

    def pct(base: float) -> dict[str, float]:
        return {
            "p50": base * 0.6,
            "p90": base * 0.9,
            "p95": base,
            "p99": base * 1.2,
            "mean": base * 0.7,
        }

    return {
        "load": load,
        "mode": "concurrency",
        "n": 48,
        "ok": 48,
        "errors": 0,
        "timeouts": 0,
        "duration_s": 10.0,
        "request_throughput": load / 2,
        "output_token_throughput": load * 20,
        "server_generation_tokens_per_s": load * 21,
        "goodput": load / 2.2,
        "slo_attainment": 0.95 if ok else 0.5,
        "slo_ok": ok,
        "ttft": pct(ttft_p95),
        "tpot": pct(0.05),
        "itl": pct(0.05),
        "e2e": pct(e2e_p95),
    }


@dataclass
class Proj:
    """A throwaway project: its root, settings, and helpers to lock and 'build' releases."""

    root: Path
    settings: Settings
    actor: str = ACTOR

    def manifest(self, name: str) -> Path:
        return self.root / "manifests" / f"{name}.yaml"

    def variant(self, base: str, new: str, replace: dict[str, str]) -> Path:
        """Copy manifest `base` as `new` (renamed), replacing text old -> new."""
        text = self.manifest(base).read_text().replace(f"name: {base}", f"name: {new}")
        for old, repl in replace.items():
            text = text.replace(old, repl)
        path = self.manifest(new)
        path.write_text(text)
        return path

    def lock(self, name: str) -> Lock:
        from releasekit.spec import lock as lockmod

        return lockmod.lock(self.manifest(name), root=self.root)

    def build(
        self,
        name: str,
        *,
        pass_rate: float = 0.9,
        ttft_p95: float = 0.2,
        bench: bool = True,
        size_after: int = 4_000_000,
    ) -> Lock:
        """Lock `name` and write the build outputs a real build leaves in results/<id>/."""
        lk = self.lock(name)
        d = self.settings.release_dir(lk.release_id)
        (d / "eval").mkdir(parents=True, exist_ok=True)
        (d / "report").mkdir(exist_ok=True)
        (d / "lock.json").write_text(lk.model_dump_json(indent=2))
        shutil.copy(self.manifest(name), d / "manifest.yaml")
        (d / "quantise.json").write_text(
            json.dumps(
                {
                    "scheme": yaml.safe_load(self.manifest(name).read_text())
                    .get("quantisation", {})
                    .get("scheme", "none"),
                    "method": "gptq",
                    "size_before_bytes": 8_000_000,
                    "size_after_bytes": size_after,
                    "seconds": 12.5,
                    "recipe_digest": lk.inputs["quantisation/recipe"],
                    "model_dir": f"models/{name}",
                    "weights_digest": "ab" * 32,
                }
            )
        )
        n = 40
        passed = round(pass_rate * n)
        (d / "eval" / "eval.json").write_text(
            json.dumps(
                {
                    "release_id": lk.release_id,
                    "suites": {
                        "core": {
                            "kind": "core",
                            "scorer": "exact_match",
                            "n": n,
                            "passed": passed,
                            "failed": n - passed,
                            "errors": 0,
                            "pass_rate": passed / n,
                        },
                        "edge": {
                            "kind": "edge",
                            "scorer": "refusal",
                            "n": 10,
                            "passed": 9,
                            "failed": 1,
                            "errors": 0,
                            "pass_rate": 0.9,
                        },
                    },
                    "judge": None,
                    "noise": None,
                }
            )
        )
        (d / "eval" / "items.jsonl").write_text('{"id": "core-0001", "passed": true}\n')
        (d / "report" / "compare.json").write_text(
            json.dumps(
                {
                    "baseline_release_id": None,
                    "candidate_release_id": lk.release_id,
                    "suites": {
                        "core": {
                            "delta": pass_rate - 0.9,
                            "ci_low": -0.1,
                            "ci_high": 0.05,
                            "mcnemar_p": 0.5,
                            "flipped_to_fail": ["core-0003"],
                            "flipped_to_pass": [],
                            "margin": 0.05,
                            "verdict": "non_inferior",
                        }
                    },
                }
            )
        )
        (d / "report" / "report.md").write_text(f"# {name}\n")
        if bench:
            (d / "bench").mkdir(exist_ok=True)
            points = [bench_point(c, ttft_p95=ttft_p95 * c / 4) for c in (1, 4, 16)]
            (d / "bench" / "bench.json").write_text(
                json.dumps(
                    {
                        "release_id": lk.release_id,
                        "profile_digest": lk.inputs["load/profile"],
                        "points": points,
                        "knee": points[1],
                    }
                )
            )
            (d / "bench" / "bench.png").write_bytes(PNG)
        return lk


def _stand_in_model(project: Path) -> None:
    model = project / "models" / "demo-base"
    if model.is_symlink():
        model.unlink()
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (model / "model.safetensors").write_bytes(bytes(range(256)) * 16)
    (model / "tokenizer.json").write_text('{"model": {}}')
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))


@pytest.fixture(scope="session")
def mlflow_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty MLflow SQLite store, migrated once per session (migrations take seconds)."""
    from mlflow import MlflowClient

    db = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments()
    return db


@pytest.fixture
def proj(project: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Proj]:
    """The project copy (tests/conftest.py `project`) with a stand-in model, run from its
    root, with default settings: SQLite ledger and SQLite MLflow store under .releasekit/."""
    from releasekit.cli._common import State
    from releasekit.config import load_settings

    _stand_in_model(project)
    (project / "prompts" / "demo" / "user_v2.txt").write_text(
        "Question: {{ question }}\nAnswer briefly:\n"
    )
    monkeypatch.chdir(project)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for key in list(os.environ):
        if key.startswith("RELEASEKIT_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("RELEASEKIT_ACTOR", ACTOR)
    State.reset()
    yield Proj(root=project, settings=load_settings(root=project))
    State.reset()


@pytest.fixture
def mlproj(proj: Proj, mlflow_template: Path) -> Proj:
    """`proj` with its embedded MLflow store pre-created from the migrated template."""
    dst = proj.settings.state_dir / "mlflow.db"
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(mlflow_template, dst)
    return proj


@pytest.fixture
def append_worker_fn() -> Any:
    """`append_worker`, for a test to hand to multiprocessing (by reference: it lives in a
    module of its own so a spawned child can import it by a unique name)."""
    from ledger_workers import append_worker

    return append_worker


def _free_port() -> int:
    return free_port(8421, 8429, what="the MLflow server")


class _Server:
    """An `mlflow server` process we started (SQLite backend, local proxied artifacts)."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = (tmp / "server.log").open("wb")
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
        self.proc = subprocess.Popen(
            [
                str(BIN / "mlflow"),
                "server",
                "--backend-store-uri",
                f"sqlite:///{tmp / 'server.db'}",
                "--artifacts-destination",
                str(tmp / "artifacts"),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--workers",
                "1",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )

    def wait_healthy(self, timeout_s: float = 180) -> str:
        import httpx

        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                tail = (self.tmp / "server.log").read_text()[-2000:]
                raise RuntimeError(f"mlflow server exited: {tail}")
            try:
                if webclient.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server did not become healthy in {timeout_s:.0f} s")
            time.sleep(0.25)

    def stop(self) -> None:
        # The server forks uvicorn workers; stop the whole process group we started.
        try:
            os.killpg(self.proc.pid, 15)
            self.proc.wait(timeout=15)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait(timeout=15)
        self.log.close()


@pytest.fixture(scope="session", autouse=True)
def _mlflow_server_boot(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[_Server | None]:
    """Start the MLflow server at the beginning of the session if any selected test needs
    it, so it boots (tens of seconds) while the other tests run."""
    wanted = any("mlflow_server" in getattr(it, "fixturenames", ()) for it in request.session.items)
    if not wanted:
        yield None
        return
    server = _Server(tmp_path_factory.mktemp("mlflow-server"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def mlflow_server(_mlflow_server_boot: _Server | None) -> str:
    """The URL of ONE real `mlflow server` per session, healthy."""
    if _mlflow_server_boot is None:  # pragma: no cover - the boot fixture saw this test
        pytest.fail("mlflow server was not started")
    return _mlflow_server_boot.wait_healthy()


def _pg_harness() -> Any:
    """tests/stores/pg_harness.py, loaded once under one name (one server per session)."""
    import importlib.util

    name = "_releasekit_pg_harness"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "stores" / "pg_harness.py"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


@pytest.fixture(scope="session")
def pg_server() -> Any:
    """The session's real PostgreSQL server (shared with tests/stores); skips without one,
    fails under CI=true."""
    return _pg_harness().server()


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger_backend(request: pytest.FixtureRequest) -> str | None:
    """None (the project's default SQLite ledger) or the URL of a fresh PostgreSQL ledger."""
    if request.param == "sqlite":
        return None
    return str(request.getfixturevalue("pg_server").create_database())
