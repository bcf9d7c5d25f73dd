"""Shared fixtures: the demo model, one real vLLM server per test session, temp settings."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from releasekit.config import Settings, load_settings
from releasekit.serving.vllm import ServerInfo, VLLMServer

REPO = Path(__file__).resolve().parents[1]
DEMO_MODEL = REPO / "models" / "demo-base"
BIN = Path(sys.executable).parent


def _ensure_demo_model() -> Path:
    """Train the demo model through DVC if it is missing (a fresh clone)."""
    if not (DEMO_MODEL / "config.json").is_file():
        subprocess.run([str(BIN / "dvc"), "repro", "demo-model"], cwd=REPO, check=True)
    return DEMO_MODEL


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The releasekit repository root."""
    return REPO


@pytest.fixture(scope="session")
def demo_model() -> Path:
    """models/demo-base, trained if missing (reproducible, about two minutes)."""
    return _ensure_demo_model()


@pytest.fixture(scope="session")
def vllm_server(demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerInfo]:
    """ONE real vLLM CPU server on the demo model (served as 'demo') for the whole session."""
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    server = VLLMServer(
        demo_model,
        served_name="demo",
        engine_args={
            "dtype": "bfloat16",
            "max-model-len": "512",
            "max-num-seqs": "32",
            "enforce-eager": "",
        },
        env={"VLLM_CPU_KVCACHE_SPACE": "1"},
        python=Path(sys.executable),
        log_path=log,
        start_timeout_s=300,
    )
    info = server.start()
    try:
        yield info
    finally:
        server.stop()


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A throwaway copy of the project's manifests, prompts and pipelines in a fresh git
    repository; the demo model folder is linked, not copied."""
    dst = tmp_path / "proj"
    dst.mkdir()
    for name in ("manifests", "prompts", "pipelines"):
        shutil.copytree(REPO / name, dst / name, ignore=shutil.ignore_patterns("*.lock.json"))
    (dst / "models").mkdir()
    if DEMO_MODEL.is_dir():
        (dst / "models" / "demo-base").symlink_to(DEMO_MODEL, target_is_directory=True)
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "Test",
        "GIT_AUTHOR_EMAIL": "t@example.com",
        "GIT_COMMITTER_NAME": "Test",
        "GIT_COMMITTER_EMAIL": "t@example.com",
    }
    subprocess.run(["git", "init", "-q"], cwd=dst, check=True)
    subprocess.run(["git", "add", "-A"], cwd=dst, check=True, env=env)
    subprocess.run(["git", "commit", "-qm", "init"], cwd=dst, check=True, env=env)
    return dst


def make_stand_in_model(project: Path) -> Path:
    """Replace the project's demo model link with a small folder of bytes: enough for
    locking, planning and failing-to-serve tests, which never load weights."""
    model = project / "models" / "demo-base"
    if model.is_symlink():
        model.unlink()
    model.mkdir(parents=True)
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (model / "model.safetensors").write_bytes(b"\0" * 1024)
    return model


@pytest.fixture
def stand_in_model() -> Callable[[Path], Path]:
    """`stand_in_model(project)` -> a stand-in model folder inside `project`."""
    return make_stand_in_model


@pytest.fixture
def settings_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """Settings rooted at a temp folder: SQLite MLflow and ledger stores inside it."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for key in list(os.environ):
        if key.startswith("RELEASEKIT_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("RELEASEKIT_CONFIG", str(tmp_path / "releasekit.toml"))
    return load_settings(root=tmp_path)
