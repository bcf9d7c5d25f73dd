"""Shared fixtures: the demo model, one real vLLM server per test session, temp settings."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from demo_builds import demo_builds
from project_copy import DEMO_MODEL, REPO, make_project
from promote_kit import mlflow_template_db

from releasekit.config import Settings, load_settings
from releasekit.serving.adapters import RUNTIME_ENV
from releasekit.serving.vllm import ServerInfo, VLLMServer

# A shell without job control starts a background job (`cmd &`) with Ctrl-C ignored, and
# an ignored signal stays ignored in every process started from it. The tests that press
# Ctrl-C on a command they start (a build, `releasekit serve`) would then see it ignored
# and fail for how the suite was launched. The suite takes Ctrl-C back: a caught signal
# is reset to its default in each command the tests start, so each handles it as in a
# terminal.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

BIN = Path(sys.executable).parent

# The session's real builds of the demo releases; the deploy kit's MLflow template, defined
# here once so that it is migrated once per session (a fixture imported into each test
# module is a fixture of each module, however it is scoped).
__all__ = ["demo_builds", "mlflow_template_db"]


def _ensure_demo_model() -> Path:
    """The demo model shipped in git (the same weights on every host); nothing trains."""
    if not (DEMO_MODEL / "config.json").is_file():
        pytest.fail(f"{DEMO_MODEL} is missing: it is shipped in git (`git checkout -- models`)")
    return DEMO_MODEL


# The session's shared servers and builds: a test that uses one runs in the suite's second
# run (scripts/test.sh), where they are started once, never beside a test that shares the host.
SESSION_SHARED = ("vllm_server", "demo_builds")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Fast tests first, slow ones (vLLM, training, quantising) after, each in collection
    order: failures in the fast ones show within minutes, and the session's vLLM server,
    booted at the start, is ready by the time the first slow test needs it. A test marked
    `parallel_safe` must be slow (it is what lets a slow test run in the first run) and must
    not use the session's server or builds (the first run would start them a second time)."""
    for it in items:
        if it.get_closest_marker("parallel_safe") is None:
            continue
        shared = [f for f in SESSION_SHARED if f in getattr(it, "fixturenames", ())]
        if it.get_closest_marker("slow") is None or shared:
            raise pytest.UsageError(
                f"{it.nodeid}: parallel_safe is for slow tests that use none of "
                f"{', '.join(SESSION_SHARED)} (it uses {', '.join(shared) or 'no slow mark'})"
            )
    items.sort(key=lambda it: it.get_closest_marker("slow") is not None)


_EXIT_STATUS: list[int] = []
NATIVE_EXIT_ENV = "RELEASEKIT_TEST_NATIVE_EXIT"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _EXIT_STATUS[:] = [int(exitstatus)]


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """End the test process with the session's own exit status once pytest has reported
    everything, without the interpreter's teardown: this process has loaded Ray's core
    worker, torch and vLLM's probes, whose native threads have crashed the interpreter's
    final teardown (a segmentation fault after "N passed", exit 139 on a green run). Every
    server and cluster the tests started is stopped by its fixture before this point, and
    the shared PostgreSQL (stopped at exit otherwise) just before it.
    RELEASEKIT_TEST_NATIVE_EXIT=1 keeps the normal teardown (to see such a crash, with every
    thread's stack: scripts/test.sh sets PYTHONFAULTHANDLER)."""
    if not _EXIT_STATUS or os.environ.get(NATIVE_EXIT_ENV) == "1":
        return
    # The PostgreSQL the ledger tests share stops at exit (atexit), which os._exit skips.
    harness = sys.modules.get("_releasekit_pg_harness")
    if harness is not None:
        harness.stop_server()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_EXIT_STATUS[0])


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Name the threads still running when the session ends: a crash while the interpreter
    exits (printed with every thread's stack by PYTHONFAULTHANDLER, set by scripts/test.sh)
    then points at what left them running."""
    extra = [t for t in threading.enumerate() if t is not threading.main_thread()]
    if extra:
        names = ", ".join(f"{t.name}{' (daemon)' if t.daemon else ''}" for t in extra)
        terminalreporter.write_line(f"threads still running at the end of the session: {names}")


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The releasekit repository root."""
    return REPO


@pytest.fixture(scope="session")
def demo_model() -> Path:
    """models/demo-base, the demo model shipped in git."""
    return _ensure_demo_model()


def _session_server(model: Path, log: Path) -> VLLMServer:
    """The session's one vLLM: the demo model as demo-lora serves it (bf16, and ready to
    load LoRA adapters at run time, which the adapter tests do)."""
    return VLLMServer(
        model,
        served_name="demo",
        engine_args={
            "dtype": "bfloat16",
            "max-model-len": "512",
            "max-num-seqs": "32",
            "enforce-eager": "",
            "enable-lora": "",
            "max-loras": "2",
            "max-lora-rank": "8",
        },
        env={"VLLM_CPU_KVCACHE_SPACE": "1", **RUNTIME_ENV},
        python=Path(sys.executable),
        log_path=log,
        start_timeout_s=300,
    )


class _Boot:
    """The session server starting in a thread while the first tests run."""

    def __init__(self, server: VLLMServer) -> None:
        self.server = server
        self.info: ServerInfo | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="vllm-boot", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.info = self.server.start()
        except BaseException as exc:  # handed to the first test that asks for the server
            self.error = exc

    def result(self) -> ServerInfo:
        self.thread.join()
        if self.error is not None:
            raise self.error
        assert self.info is not None
        return self.info


@pytest.fixture(scope="session", autouse=True)
def _vllm_server_boot(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[_Boot | None]:
    """Start the session's vLLM server at the beginning of the session when a selected test
    needs it and the demo model is there, so its minute of start-up overlaps other tests
    (an idle vLLM CPU server costs no CPU)."""
    wanted = any("vllm_server" in getattr(it, "fixturenames", ()) for it in request.session.items)
    if not wanted or not (DEMO_MODEL / "config.json").is_file():
        yield None
        return
    boot = _Boot(_session_server(DEMO_MODEL, tmp_path_factory.mktemp("vllm") / "server.log"))
    try:
        yield boot
    finally:
        boot.thread.join(timeout=330)
        boot.server.stop()


@pytest.fixture(scope="session")
def vllm_server(
    demo_model: Path, _vllm_server_boot: _Boot | None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerInfo]:
    """ONE real vLLM CPU server on the demo model (served as 'demo') for the whole session:
    the one booted at the start, or started now."""
    if _vllm_server_boot is not None:
        yield _vllm_server_boot.result()
        return
    server = _session_server(demo_model, tmp_path_factory.mktemp("vllm") / "server.log")
    info = server.start()
    try:
        yield info
    finally:
        server.stop()


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A throwaway copy of the project (`make_project`) in this test's temp folder."""
    return make_project(tmp_path / "proj")


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
