"""vLLM server control: failures quote the log, stops leave no process behind (also when the
owner dies), and a release is served with exactly its manifest's engine arguments."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import webclient

from releasekit._support.procs import reap_registered
from releasekit.config import Settings
from releasekit.errors import ReleaseNotBuiltError, ServerError, ServerStartError
from releasekit.serving.amx_startup import STARTUP_DIR
from releasekit.serving.host import KERNEL_ENV, has_amx, inherited_env
from releasekit.serving.vllm import (
    PIDDIR_ENV,
    PORT_RANGE_ENV,
    VLLMServer,
    pick_port,
    release_model_dir,
    serve_release,
)
from releasekit.spec.lock import locked_release

BIN = Path(sys.executable).parent

StandIn = Callable[[Path], Path]


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group `pgid`."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2 :].split()
            if fields[0] != "Z" and int(fields[2]) == pgid:
                out.append(int(d.name))
    return out


def wait_gone(pgid: int, timeout_s: float = 30.0) -> list[int]:
    """Wait until process group `pgid` is empty; return what is left."""
    deadline = time.monotonic() + timeout_s
    while (left := group_members(pgid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _settings(settings_tmp: Settings, project: Path) -> Settings:
    return settings_tmp.model_copy(update={"root": project, "results_dir": project / "results"})


# ---- fast --------------------------------------------------------------------------------


def test_pick_port_honours_the_port_range(monkeypatch: pytest.MonkeyPatch) -> None:
    """RELEASEKIT_PORT_RANGE confines ports (shared machines); a full range is an error."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        port = busy.getsockname()[1]
        monkeypatch.setenv(PORT_RANGE_ENV, f"{port}-{port}")
        with pytest.raises(ServerError, match="no free port"):
            pick_port()
    assert pick_port() == port
    monkeypatch.setenv(PORT_RANGE_ENV, "nonsense")
    with pytest.raises(ServerError, match="LOW-HIGH"):
        pick_port()
    monkeypatch.delenv(PORT_RANGE_ENV)
    assert 0 < pick_port() < 65536


def test_reap_registered_stops_an_orphaned_server_group(tmp_path: Path) -> None:
    """A server whose owner died is stopped from its pid file, children included."""
    proc = subprocess.Popen(
        ["sh", "-c", "sleep 300 & sleep 300"], start_new_session=True, stdin=subprocess.DEVNULL
    )
    (tmp_path / str(proc.pid)).write_text("{}")
    time.sleep(0.2)
    assert len(group_members(proc.pid)) >= 2  # the shell and its background child
    assert reap_registered(tmp_path, grace_s=5) == [proc.pid]
    proc.wait(timeout=5)
    assert wait_gone(proc.pid, 5) == []
    assert not list(tmp_path.iterdir())


def test_release_serves_exactly_its_manifest_engine_args(
    project: Path, settings_tmp: Settings, stand_in_model: StandIn
) -> None:
    """serve_release: the model source for scheme none, the lock's engine args and env."""
    model = stand_in_model(project)
    settings = _settings(settings_tmp, project)
    lm, lk = locked_release(project / "manifests" / "demo-bf16.yaml", root=project)
    server = serve_release(settings, lm, lk, port=8455)
    cmd = server.command()
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--model") + 1] == str(model)
    assert cmd[cmd.index("--served-model-name") + 1] == "demo"
    assert cmd[cmd.index("--max-model-len") + 1] == "512"
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16"
    assert "--enforce-eager" in cmd
    assert cmd.count("--served-model-name") == 1
    # Exactly the release's environment by default; `server_preload = true` adds the host's
    # allocator and OpenMP runtime (vLLM's CPU guide) where it has them, nothing else.
    assert server.env == {"VLLM_CPU_KVCACHE_SPACE": "1"}
    assert server.base_url == "http://127.0.0.1:8455"
    preloaded = serve_release(settings.model_copy(update={"server_preload": True}), lm, lk)
    assert set(preloaded.env) - {"VLLM_CPU_KVCACHE_SPACE"} <= {"LD_PRELOAD"}


def test_quantised_release_needs_a_build_before_serving(
    project: Path, settings_tmp: Settings, stand_in_model: StandIn
) -> None:
    """A quantised release serves results/<id>/model; before the build that is an error."""
    stand_in_model(project)
    settings = _settings(settings_tmp, project)
    lm, lk = locked_release(project / "manifests" / "demo-w4a16.yaml", root=project)
    with pytest.raises(ReleaseNotBuiltError, match="not built"):
        release_model_dir(settings, lm, lk)
    built = settings.release_dir(lk.release_id) / "model"
    built.mkdir(parents=True)
    (built.parent / "quantise.json").write_text(
        json.dumps({"model_dir": f"results/{lk.release_id}/model"})
    )
    assert release_model_dir(settings, lm, lk) == built


# ---- real vLLM ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parallel_safe
def test_a_server_never_inherits_the_kernel_choosing_variables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ONEDNN_MAX_CPU_ISA and the other variables that choose torch's, oneDNN's and MKL's CPU
    kernels do not pass from the starting process to a vLLM server (on a CPU with AMX a
    server that inherited ONEDNN_MAX_CPU_ISA=AVX2 aborted at its first request); everything
    else does, and the release's own serving.env still sets them. The server here is a
    stand-in interpreter that writes the environment it got and exits."""
    dump = tmp_path / "env.bin"
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\nenv -0 > {dump}\nexit 3\n")
    fake.chmod(0o755)
    for key in KERNEL_ENV:
        monkeypatch.setenv(key, "AVX2")
    monkeypatch.setenv("RK_TEST_KEPT", "yes")
    server = VLLMServer(
        tmp_path,
        served_name="demo",
        engine_args={},
        env={"MKL_CBWR": "COMPATIBLE"},  # the release's own
        python=fake,
        log_path=tmp_path / "server.log",
        start_timeout_s=30,
    )
    with pytest.raises(ServerStartError):
        server.start()
    got = dict(e.split("=", 1) for e in dump.read_text().split("\0") if "=" in e)
    assert got["RK_TEST_KEPT"] == "yes"
    assert got["MKL_CBWR"] == "COMPATIBLE"
    assert sorted(set(got) & set(KERNEL_ENV)) == ["MKL_CBWR"]
    assert inherited_env({"ONEDNN_MAX_CPU_ISA": "AVX2", "A": "1"}, amx=False) == {"A": "1"}
    # On a CPU with AMX every process of the server asks for the AMX tile state first.
    assert (str(STARTUP_DIR) in got.get("PYTHONPATH", "").split(os.pathsep)) == has_amx()


_PERM_PROBE = """
import ctypes, sys
mask = ctypes.c_uint64(0)
rc = ctypes.CDLL(None, use_errno=True).syscall(158, 0x1022, ctypes.byref(mask))
print(int(rc == 0 and bool(mask.value & (1 << 18))))
"""


def test_on_a_cpu_with_amx_every_server_process_asks_for_the_amx_tile_state() -> None:
    """A spawned vLLM worker runs AMX kernels only if its own process asked Linux for the
    tile state (without it, SIGILL at the first request, seen with a Ray replica's spawned
    workers). A server's environment puts `amx_startup` first on PYTHONPATH on such a CPU:
    a fresh interpreter with that environment holds the permission, one without it does
    not. Elsewhere nothing is added and the startup module is harmless."""
    base = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env = inherited_env(base, amx=True)
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(STARTUP_DIR)
    assert "PYTHONPATH" not in inherited_env(base, amx=False)
    with_hook = subprocess.run(
        [sys.executable, "-c", _PERM_PROBE], env=env, capture_output=True, text=True
    )
    without = subprocess.run(
        [sys.executable, "-c", _PERM_PROBE], env=base, capture_output=True, text=True
    )
    assert with_hook.returncode == 0 and without.returncode == 0, with_hook.stderr
    if not has_amx():
        assert with_hook.stdout.strip() == "0"  # nothing to ask for here
        pytest.skip("this CPU has no AMX: the permission itself is checked on AMX hosts")
    assert (with_hook.stdout.strip(), without.stdout.strip()) == ("1", "0")


def test_a_ray_replica_server_never_inherits_the_kernel_choosing_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The Ray target's replica builds its server's environment from the Ray worker's: the
    kernel-choosing variables are left out there too (the killed-replica case on AMX failed
    on the other replica's engine, which had inherited ONEDNN_MAX_CPU_ISA=AVX2)."""
    pytest.importorskip("ray")
    from releasekit.deploy.ray.replica import _clean_env

    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("RK_TEST_KEPT", "yes")
    env = _clean_env()
    assert env["RK_TEST_KEPT"] == "yes"
    assert not set(env) & set(KERNEL_ENV)


def test_bad_engine_arg_raises_start_error_quoting_the_log(tmp_path: Path) -> None:
    """vLLM rejecting an argument: ServerStartError names the cause and quotes the log; the
    process group is gone."""
    server = VLLMServer(
        tmp_path,
        served_name="demo",
        engine_args={"max-model-len": "lots"},
        python=Path(sys.executable),
        log_path=tmp_path / "server.log",
        start_timeout_s=120,
    )
    with pytest.raises(ServerStartError) as info:
        server.start()
    msg = str(info.value)
    assert "exited with code" in msg
    assert "--max-model-len" in msg.splitlines()[0]  # the cause, on the first line
    assert "last lines of the server log" in msg
    assert "invalid" in info.value.log_tail
    assert server.proc is None


@pytest.mark.slow
@pytest.mark.parallel_safe
def test_never_healthy_server_times_out_and_is_stopped(tmp_path: Path) -> None:
    """A server not healthy within the timeout raises ServerStartError and is killed."""
    server = VLLMServer(
        tmp_path,
        served_name="demo",
        engine_args={},
        python=Path(sys.executable),
        log_path=tmp_path / "server.log",
        start_timeout_s=2,
        stop_grace_s=5,
    )
    pgid: list[int] = []
    original = server._wait_ready

    def spy() -> str | None:
        assert server.proc is not None
        pgid.append(server.proc.pid)
        return original()

    server._wait_ready = spy  # type: ignore[method-assign]
    with pytest.raises(ServerStartError, match="did not become healthy within 2 s"):
        server.start()
    assert wait_gone(pgid[0], 10) == []


def test_server_dies_with_its_owner(tmp_path: Path) -> None:
    """SIGKILL the process that started a server (no cleanup can run): the kernel stops the
    server too. The "server" is a stand-in that would otherwise run for minutes."""
    fake_python = tmp_path / "python"
    fake_python.write_text("#!/bin/sh\nexec sleep 300\n")
    fake_python.chmod(0o755)
    owner_code = textwrap.dedent(
        f"""
        from pathlib import Path
        from releasekit.serving.vllm import VLLMServer
        VLLMServer(Path({str(tmp_path)!r}), served_name="demo", engine_args={{}},
                   python=Path({str(fake_python)!r}), log_path=Path({str(tmp_path / "s.log")!r}),
                   start_timeout_s=600).start()
        """
    )
    piddir = tmp_path / "pids"
    owner = subprocess.Popen(
        [sys.executable, "-c", owner_code],
        env={**os.environ, PIDDIR_ENV: str(piddir)},
        stdin=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while not (piddir.is_dir() and list(piddir.iterdir())) and time.monotonic() < deadline:
        time.sleep(0.1)
    pids = [int(p.name) for p in piddir.iterdir()]
    assert len(pids) == 1, "the owner never started the server"
    time.sleep(0.5)
    assert group_members(pids[0]), "the server should run while its owner does"
    owner.send_signal(signal.SIGKILL)
    owner.wait(timeout=10)
    left = wait_gone(pids[0], 10)
    if left:
        os.killpg(pids[0], signal.SIGKILL)
    assert left == []


@pytest.mark.slow
@pytest.mark.parallel_safe
def test_serve_runs_in_the_foreground_until_ctrl_c(project: Path, demo_model: Path) -> None:
    """`releasekit serve`: healthy, answers /v1/models under the served name; Ctrl-C stops
    it cleanly (exit 0) and its process group is gone."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELEASEKIT_")}
    if PORT_RANGE_ENV in os.environ:
        env[PORT_RANGE_ENV] = os.environ[PORT_RANGE_ENV]
    proc = subprocess.Popen(
        [str(BIN / "releasekit"), "serve", "manifests/demo-bf16.yaml", "--json"],
        cwd=project,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, proc.stderr.read() if proc.stderr else ""
        info = json.loads(line)
        models = webclient.get(info["base_url"] + "/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["demo"]
        assert group_members(info["pid"])
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        assert wait_gone(info["pid"], 10) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
