"""The demo releases built for real once per test session, for the slow tests that need
real evidence: `releasekit build` of demo-bf16, its damaged prompt and demo-w8a8 (and
demo-w4a16 where vLLM's CPU build serves it), quantised with llm-compressor, each served by
vLLM, load-tested and evaluated, pushed to the project's DVC remote and registered in MLflow.
The gate test promotes them, the build test reads the cold build and runs the warm one, the
eval test reads their suites; none of them builds the same release again."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "deploy"))
from project_copy import make_project
from promote_kit import empty_mlflow_store, kill_everything, kit_environment, prepare_kit

from releasekit.config import load_settings
from releasekit.spec.hostcaps import host_facts, scheme_support
from releasekit.spec.lock import read_lock

BIN = Path(sys.executable).parent
BUILD_TIMEOUT_S = 1800
USES_DEMO_BUILDS = pytest.mark.timeout(BUILD_TIMEOUT_S + 600)
"""For each test that asks for `demo_builds`: whichever runs first pays for the builds in its
set-up (three or four releases, 10 to 15 minutes on 2 cores), which pytest-timeout counts
against that test."""
# The gate test's smoke check: a few core items through the gateway before traffic moves.
SMOKE = '{ suite = "core", max_items = 8, max_tokens = 32, min_pass_rate = 0.5 }'


def command_env(mark: str) -> dict[str, str]:
    """This process's variables for a `releasekit` command a test runs in a project copy:
    none of releasekit's settings or MLflow's tracking URI leak in (the project decides),
    but RELEASEKIT_PORT_RANGE (shared development machines) does, and
    RELEASEKIT_TEST_MARK=`mark`, which every descendant inherits (`marked_processes`)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("RELEASEKIT_") and k != "MLFLOW_TRACKING_URI"
    }
    if "RELEASEKIT_PORT_RANGE" in os.environ:
        env["RELEASEKIT_PORT_RANGE"] = os.environ["RELEASEKIT_PORT_RANGE"]
    env["RELEASEKIT_TEST_MARK"] = mark
    return env


def marked_processes(mark: str) -> list[str]:
    """Live processes (not zombies) whose environment carries RELEASEKIT_TEST_MARK=`mark`:
    a command's whole process tree, vLLM and its engine workers included, wherever they
    were re-parented."""
    needle = f"RELEASEKIT_TEST_MARK={mark}".encode()
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if needle not in (d / "environ").read_bytes().split(b"\0"):
                continue
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if stat[stat.rfind(")") + 2 :].split()[0] != "Z":
            found.append(f"{d.name} {cmd}")
    return found


@dataclass(frozen=True)
class DemoBuilds:
    """The session's build of the demo releases and where it happened."""

    project: Path
    ports: dict[str, int]
    env: dict[str, str]
    """What the build ran with (the kit's variables and a process mark); reuse it for
    further commands in the project."""
    mark: str
    manifests: list[str]
    build: subprocess.CompletedProcess[str]
    left_running: list[str]
    """The build's processes still alive right after it returned (none expected)."""
    w4a16_skipped: str | None
    """Why W4A16 was not built on this host, or None when it was."""

    def release_id(self, manifest: str) -> str:
        return read_lock(self.project / "manifests" / f"{manifest}.lock.json").release_id

    def run(self, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
        """`releasekit ARGS` in the project, with the build's variables and mark."""
        return subprocess.run(
            [str(BIN / "releasekit"), *args],
            cwd=self.project,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )


@pytest.fixture(scope="session")
def demo_builds(tmp_path_factory: pytest.TempPathFactory, demo_model: Path) -> Iterator[DemoBuilds]:
    """The demo releases, built once per session (see the module's docstring). A failed
    build is the tests' to report: each test asserts on `build.returncode` first."""
    root = tmp_path_factory.mktemp("demo-builds")
    project = make_project(root / "proj")
    ports = prepare_kit(project, empty_mlflow_store(root / "mlflow-template.db"), smoke=SMOKE)
    mark = uuid.uuid4().hex
    env = {
        **command_env(mark),
        **kit_environment(project, Path(sys.executable), real_vllm=True),
    }
    w4 = scheme_support("W4A16", host_facts(sys.executable))
    manifests = ["demo-bf16", "demo-damaged-prompt", "demo-w8a8"]
    skipped = None
    if w4.servable:
        manifests.append("demo-w4a16")
    else:
        skipped = w4.how
        warnings.warn(f"W4A16 skipped on this host: {w4.how}", stacklevel=1)
    build = subprocess.run(
        [str(BIN / "releasekit"), "build", *(f"manifests/{m}.yaml" for m in manifests), "--push"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
    )
    builds = DemoBuilds(
        project=project,
        ports=ports,
        env=env,
        mark=mark,
        manifests=manifests,
        build=build,
        left_running=marked_processes(mark),
        w4a16_skipped=skipped,
    )
    try:
        yield builds
    finally:
        kill_everything(load_settings(root=project, state_dir=project / ".releasekit"))
