"""The local deploy target and its state: detached servers recorded before they are
healthy, stopped as whole process groups, warm servers expired on time, the environment
lock, and the CLI front (promote/rollback/down/deploy-status)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import typer
import webclient
from promote_kit import Kit, kill_everything, kit, make_kit
from typer.testing import CliRunner

from releasekit.cli import deploy_cmds
from releasekit.deploy.local import LocalTarget, expire_warm, process_alive
from releasekit.deploy.state import (
    DeployStateError,
    env_lock,
    locked_state,
    proc_start_time,
    read_state,
    state_path,
)
from releasekit.deploy.target import ReleaseSpec, ReleaseStartError, Upstream
from releasekit.promote.context import load_release, release_spec
from releasekit.promote.promote import promote
from releasekit.stores.ledger import Ledger

__all__ = ["kit"]


def _spec(k: Kit, name: str = "demo-bf16") -> ReleaseSpec:
    rid = k.build(name, register=False)
    led = Ledger(k.settings.ledger_url or "")
    return release_spec(k.settings, load_release(k.settings, rid, ledger=led), ledger=led)


def test_start_records_the_server_before_it_is_healthy_and_it_outlives_us(kit: Kit) -> None:
    """The server is in the state file (role `starting`) as soon as it exists, runs in its
    own session, and `stop` ends its whole process group."""
    spec = _spec(kit)
    seen: list[str] = []
    cfg = kit.settings.environments["staging"]
    with locked_state(kit.settings.state_dir, "staging") as h:
        target = LocalTarget(kit.settings, "staging", cfg, h)

        def on_spawn(up: Upstream) -> None:
            seen.extend(s.role for s in read_state(kit.settings.state_dir, "staging").servers)

        up = target.start(spec, on_spawn=on_spawn)
        pid = int(up.handle["pid"] or 0)
        assert seen == ["starting"]
        assert os.getsid(pid) == pid != os.getsid(0)  # own session: survives this process
        assert target.health(up)
        target.stop(up, grace_s=2)
        assert not process_alive(pid, None)
        assert h.state.servers == []


def test_a_server_that_exits_is_not_left_recorded(kit: Kit) -> None:
    """A server that dies before it is healthy raises ReleaseStartError quoting the
    cause, and nothing of it stays in the state."""
    spec = _spec(kit)
    bad = spec.model_copy(update={"engine_args": {**spec.engine_args, "no-such-flag": "1"}})
    with locked_state(kit.settings.state_dir, "staging") as h:
        target = LocalTarget(kit.settings, "staging", kit.settings.environments["staging"], h)
        with pytest.raises(ReleaseStartError, match="unrecognized arguments"):
            target.start(bad)
        assert h.state.servers == []


def test_warm_servers_are_stopped_when_their_period_ends(kit: Kit) -> None:
    """A warm server past its warm_until is stopped by `expire_warm` (what the detached
    expirer runs); one still within its period stays."""
    spec = _spec(kit)
    cfg = kit.settings.environments["staging"]
    with locked_state(kit.settings.state_dir, "staging") as h:
        target = LocalTarget(kit.settings, "staging", cfg, h)
        up = target.start(spec)
        [rec] = h.state.servers
        rec.role, rec.warm_until = "warm", time.time() + 3600
    assert expire_warm(kit.settings.state_dir, "staging", grace_s=2) == 0
    assert expire_warm(kit.settings.state_dir, "staging", grace_s=2, now=time.time() + 7200) == 1
    assert not process_alive(int(up.handle["pid"] or 0), None)
    assert read_state(kit.settings.state_dir, "staging").servers == []


def test_the_expirer_process_exits_once_no_warm_server_is_left(kit: Kit) -> None:
    """`python -m releasekit.deploy.local expire` stops a warm server on time and exits."""
    spec = _spec(kit)
    with locked_state(kit.settings.state_dir, "staging") as h:
        target = LocalTarget(kit.settings, "staging", kit.settings.environments["staging"], h)
        up = target.start(spec)
        h.state.servers[0].role = "warm"
        h.state.servers[0].warm_until = time.time() + 1.0
    proc = subprocess.Popen(
        [sys.executable, "-m", "releasekit.deploy.local", "expire", "--state-dir",
         str(kit.settings.state_dir), "--env", "staging", "--grace-s", "2"],
    )  # fmt: skip
    try:
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
    assert not process_alive(int(up.handle["pid"] or 0), None)


def test_a_reused_pid_is_not_mistaken_for_the_recorded_process(kit: Kit) -> None:
    """A record whose pid now belongs to another process (other start time) reads as gone;
    the recorded process itself reads as alive."""
    leader = subprocess.Popen(["sleep", "30"], start_new_session=True)  # its own group
    try:
        start = proc_start_time(leader.pid)
        assert start is not None
        assert process_alive(leader.pid, start)
        assert not process_alive(leader.pid, start + 1)
    finally:
        leader.kill()
        leader.wait(timeout=10)
    assert not process_alive(leader.pid, start)


def test_the_environment_lock_serialises_commands_and_dies_with_its_holder(kit: Kit) -> None:
    """A second command waits for the env's lock (DeployStateError after its timeout);
    when the holder is killed the kernel drops the lock."""
    code = (
        "import sys, time; from pathlib import Path; from releasekit.deploy.state import env_lock\n"
        "with env_lock(Path(sys.argv[1]), 'staging'):\n"
        "    print('held', flush=True); time.sleep(60)\n"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(kit.settings.state_dir)], stdout=subprocess.PIPE
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == b"held"
        with (
            pytest.raises(DeployStateError, match="another releasekit command"),
            env_lock(kit.settings.state_dir, "staging", timeout_s=0.5),
        ):
            pass
        holder.kill()
        holder.wait(timeout=10)
        with env_lock(kit.settings.state_dir, "staging", timeout_s=5):
            pass
    finally:
        holder.kill()


def test_cli_promote_dry_run_status_rollback_and_down(kit: Kit) -> None:
    """The CLI translates: --dry-run --json prints the report and exits 0 when it would
    pass; promote, deploy-status, rollback and down print what they did."""
    app = typer.Typer()
    deploy_cmds.register(app)
    runner = CliRunner()
    kit.build("demo-bf16")
    r = runner.invoke(
        app, ["promote", "manifests/demo-bf16.yaml", "--to", "staging", "--dry-run", "--json"]
    )
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["status"] == "dry_run"
    assert not state_path(kit.settings.state_dir, "staging").exists()
    r = runner.invoke(app, ["promote", "manifests/demo-bf16.yaml", "--to", "staging"])
    assert r.exit_code == 0, r.output
    assert "staging -> demo-bf16" in r.stdout
    r = runner.invoke(app, ["deploy-status", "staging", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)[0]["serving"] is True
    r = runner.invoke(app, ["rollback", "staging", "--reason", "x"])
    assert r.exit_code == 1 and "no earlier release" in r.output
    r = runner.invoke(app, ["promote", "manifests/demo-bf16.yaml", "--to", "nowhere"])
    assert r.exit_code == 1 and "not configured" in r.output
    r = runner.invoke(app, ["down", "staging"])
    assert r.exit_code == 0 and "stopped gateway, server" in r.stdout
    assert read_state(kit.settings.state_dir, "staging").servers == []
    assert promote(kit.settings, "manifests/demo-bf16.yaml", env="staging").status == "redeployed"


def test_an_environment_with_api_keys_smokes_with_its_key_and_refuses_others(
    project: Path,
    monkeypatch: pytest.MonkeyPatch,
    mlflow_template_db: Path,
    stand_in_model: Any,
) -> None:
    """With `api_keys` set, the environment's gateway demands a key (401 without), and the
    post-switch smoke run uses the environment's own key."""
    stand_in_model(project)
    k = make_kit(
        project, monkeypatch, mlflow_template_db, toml_lines=['api_keys = ["sk-test-key-1"]']
    )
    try:
        rid = k.build("demo-bf16")
        res = promote(k.settings, rid, env="staging")
        assert res.status == "promoted", res.deploy
        assert res.deploy is not None and res.deploy.smoke_gateway is not None
        assert res.deploy.smoke_gateway.passed
        url = f"{k.gateway('staging')}/v1/completions"
        assert webclient.post(url, json={"prompt": "x", "max_tokens": 2}).status_code == 401
        ok = webclient.post(
            url,
            json={"prompt": "x", "max_tokens": 2},
            headers={"authorization": "Bearer sk-test-key-1"},
        )
        assert ok.status_code == 200 and ok.headers["x-releasekit-release"] == rid
    finally:
        kill_everything(k.settings)
