"""The servers one `releasekit build` keeps across its releases (`releasekit.build.engines`):
whatever is kept is stopped when the build ends, however it ends, and by the next build when
the one that kept it was killed; a stage never takes a server of another engine or one that
no longer answers. Real process groups stand for the servers here (the whole path with vLLM:
tests/test_build.py, the damaged prompt built after bf16)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from releasekit._support.procs import group_alive
from releasekit.build.engines import ENGINES_ENV, EnginePool, KeptEngine, kept_engines
from releasekit.config import load_settings


def _group() -> int:
    """A process group of its own that runs until stopped (a server's stand-in)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], process_group=0)
    return proc.pid


def _engine(pid: int, key: str = "k" * 64, port: int = 9) -> KeptEngine:
    return KeptEngine(
        pid=pid,
        base_url=f"http://127.0.0.1:{port}",
        serving_key=key,
        model_dir="/models/demo",
        served_name="demo",
        log_path="/dev/null",
        loaded_bytes=1,
        started_for="a" * 64,
    )


def _gone(pid: int, within_s: float = 15.0) -> bool:
    """The group stopped (a stopped child is a zombie until reaped: not alive)."""
    deadline = time.monotonic() + within_s
    while group_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not group_alive(pid)


def test_a_build_stops_what_it_kept_when_it_ends_also_on_an_error(tmp_path: Path) -> None:
    settings = load_settings(root=tmp_path, state_dir=tmp_path / ".releasekit")
    pids = []
    with pytest.raises(KeyboardInterrupt), kept_engines(settings) as root:
        pid = _group()
        pids.append(pid)
        EnginePool(root).keep(_engine(pid))
        assert json.loads((root / str(pid)).read_text())["pid"] == pid
        raise KeyboardInterrupt
    assert _gone(pids[0])
    assert not root.exists()


def test_the_next_build_stops_what_a_killed_build_kept(tmp_path: Path) -> None:
    settings = load_settings(root=tmp_path, state_dir=tmp_path / ".releasekit")
    dead_owner = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                                capture_output=True, text=True, check=True)  # fmt: skip
    left = settings.state_dir / "build-engines" / dead_owner.stdout.strip()
    left.mkdir(parents=True)
    (left / "owner").write_text(json.dumps({"pid": int(dead_owner.stdout)}))
    pid = _group()
    EnginePool(left).keep(_engine(pid))
    with kept_engines(settings) as root:
        assert _gone(pid), "a server kept by a build that died still runs"
        assert not left.exists() and root.is_dir()


def test_a_stage_takes_no_server_of_another_engine_or_one_that_does_not_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each is stopped instead: one engine at a time."""
    settings = load_settings(root=tmp_path, state_dir=tmp_path / ".releasekit")
    with kept_engines(settings) as root:
        monkeypatch.setenv(ENGINES_ENV, str(root))
        pool = EnginePool.from_env()
        assert pool is not None
        other, silent = _group(), _group()
        pool.keep(_engine(other, key="o" * 64))
        pool.keep(_engine(silent))  # nothing listens on its port
        assert pool.take("k" * 64, Path("/models/demo"), None) is None
        assert _gone(other) and _gone(silent)
        assert [f.name for f in root.iterdir() if f.name.isdigit()] == []
    monkeypatch.delenv(ENGINES_ENV)
    assert EnginePool.from_env() is None  # outside a build: each stage its own server
