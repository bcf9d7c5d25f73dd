"""Promote end to end on the local target with a stand-in vLLM (promote_fake_vllm.py):
policy and gates, blue/green deploy through a real gateway process, the ledger, the MLflow
model and prompt aliases, and the deploy state."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
import webclient
from promote_kit import (
    PORT_HIGH,
    PORT_LOW,
    Kit,
    Streamer,
    free_port_in_band,
    kit,
)

from releasekit.deploy.state import list_envs, read_state
from releasekit.promote.deploy import deploy_status, down
from releasekit.promote.promote import PromoteError, promote
from releasekit.stores.ledger import Ledger
from releasekit.stores.mlflow import alias_version, client_for

__all__ = ["kit"]


def _ledger(k: Kit) -> Ledger:
    return Ledger(k.settings.ledger_url or "")


def _ask(k: Kit, env: str, question: str = "What?") -> httpx.Response:
    return webclient.post(
        f"{k.gateway(env)}/v1/templates/chat/chat/completions",
        json={"variables": {"question": question}, "max_tokens": 5},
        timeout=30,
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return (
        Path(f"/proc/{pid}").is_dir()
        and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
    )


def _v2(k: Kit, **build: object) -> str:
    k.variant("demo-bf16", "demo-v2", {"max-num-seqs: 32": "max-num-seqs: 16"})
    return k.build("demo-v2", **build)  # type: ignore[arg-type]


def test_first_promotion_serves_through_the_gateway_and_records_it(kit: Kit) -> None:
    """With nothing live, a release whose own evidence holds is promoted: its server
    starts, the gateway serves it, a live `promote` event names it, the MLflow model and
    prompt aliases point at it and deploy-status agrees."""
    rid = kit.build("demo-bf16")
    res = promote(kit.settings, "manifests/demo-bf16.yaml", env="staging", reason="first")
    assert res.status == "promoted", res.deploy
    assert res.report is not None and res.report.mode == "absolute"
    r = _ask(kit, "staging")
    assert r.status_code == 200 and r.headers["x-releasekit-release"] == rid
    live = _ledger(kit).live_at("staging")
    assert live is not None and live.to_release == rid and live.type == "promote"
    assert live.evidence["gates"]["passed"] is True
    alias = alias_version(kit.settings, "demo-bf16", "staging")
    assert alias is not None and alias.release_id == rid
    pv = client_for(kit.settings).get_prompt_version_by_alias("demo-bf16.chat", "staging")
    assert pv is not None
    [st] = deploy_status(kit.settings, env="staging")
    assert st.agrees and st.gateway_healthy and st.ledger_release_id == rid
    assert Path(res.report_html or "").is_file()


def test_dry_run_changes_nothing(kit: Kit) -> None:
    """--dry-run prints the report and writes no ledger event, starts no process and
    writes no file (no state, no report)."""
    kit.build("demo-bf16")
    led = _ledger(kit)
    before = led.count()
    res = promote(kit.settings, "demo-bf16@1", env="staging", dry_run=True)
    assert res.status == "dry_run" and res.ok and res.report is not None
    assert led.count() == before
    assert list_envs(kit.settings.state_dir) == []
    assert not (kit.settings.state_dir / "reports").exists()
    assert not (kit.settings.state_dir / "deploy").exists()
    with pytest.raises(httpx.ConnectError):
        webclient.get(f"{kit.gateway('staging')}/health", timeout=2)


def test_blocked_release_never_starts_and_is_recorded(kit: Kit) -> None:
    """A release the quality gate blocks starts no server, leaves the live release
    serving, and is recorded as `gate_failed` naming the failed suite."""
    old = kit.build("demo-bf16")
    assert promote(kit.settings, old, env="staging", reason="base").status == "promoted"
    kit.build("demo-damaged-prompt", fail={"core": 60})
    servers_before = [s.pid for s in read_state(kit.settings.state_dir, "staging").servers]
    res = promote(kit.settings, "manifests/demo-damaged-prompt.yaml", env="staging")
    assert res.status == "blocked" and not res.ok
    assert res.record is not None and res.record.type == "gate_failed"
    assert res.record.evidence["gates"]["failed"] == ["suite core"]
    assert [s.pid for s in read_state(kit.settings.state_dir, "staging").servers] == servers_before
    assert _ask(kit, "staging").headers["x-releasekit-release"] == old
    live = _ledger(kit).live_at("staging")
    assert live is not None and live.to_release == old


def test_force_needs_a_reason_and_is_recorded_as_an_override(kit: Kit) -> None:
    """--force without a reason is refused; with one, the release goes live through an
    `override` event listing the gates it overrode."""
    kit.build("demo-bf16")
    promote(kit.settings, "manifests/demo-bf16.yaml", env="staging", reason="base")
    bad = kit.build("demo-damaged-prompt", fail={"core": 60})
    with pytest.raises(PromoteError, match="--reason"):
        promote(kit.settings, bad, env="staging", force=["quality"])
    # An override names what it overrides: a performance override does not carry a
    # quality failure.
    perf_only = promote(kit.settings, bad, env="staging", force=["perf"], reason="perf only")
    assert perf_only.status == "blocked"
    assert perf_only.report is not None and "suite core" in [
        g.name for g in perf_only.report.failed
    ]
    res = promote(kit.settings, bad, env="staging", force=["quality"], reason="customer demo")
    assert res.status == "promoted" and res.overridden == ["suite core"]
    live = _ledger(kit).live_at("staging")
    assert live is not None and live.type == "override" and live.reason == "customer demo"
    assert live.evidence["overrode"] == ["suite core"]


def test_production_refuses_a_release_never_live_in_staging(kit: Kit) -> None:
    """The production policy requires staging first: refused (recorded) unless forced."""
    rid = kit.build("demo-bf16")
    res = promote(kit.settings, rid, env="production")
    assert res.status == "blocked"
    assert [g.name for g in res.report.failed] == ["live in staging first"] if res.report else False
    assert promote(kit.settings, rid, env="staging").status == "promoted"
    assert promote(kit.settings, rid, env="production").status == "promoted"


def test_prompt_only_release_switches_without_restarting_vllm(kit: Kit) -> None:
    """A release that differs only in its prompts reuses the running server (same pid):
    only the gateway's route changes, and the templated route serves the new prompt."""
    kit.build("demo-bf16")
    promote(kit.settings, "manifests/demo-bf16.yaml", env="staging")
    [before] = read_state(kit.settings.state_dir, "staging").servers
    (kit.root / "prompts" / "demo" / "user_v3.txt").write_text("Q3: {{ question }}\nA:\n")
    kit.variant("demo-bf16", "demo-v3", {"prompts/demo/user.txt": "prompts/demo/user_v3.txt"})
    rid = kit.build("demo-v3")
    res = promote(kit.settings, rid, env="staging")
    assert res.status == "promoted" and res.deploy is not None and res.deploy.reused_server
    [after] = read_state(kit.settings.state_dir, "staging").servers
    assert after.pid == before.pid and after.role == "live"
    r = _ask(kit, "staging", "Where?")
    assert r.headers["x-releasekit-release"] == rid
    assert r.json()["echo_user"] == "Q3: Where?\nA:"


def test_a_release_whose_server_cannot_start_never_gets_traffic(kit: Kit) -> None:
    """An engine argument vLLM rejects: the server exits, nothing of it is left, the old
    release keeps serving, and a `deploy_failed` event quotes the cause."""
    old = kit.build("demo-bf16")
    promote(kit.settings, old, env="staging")
    kit.variant(
        "demo-bf16",
        "demo-broken",
        {"enforce-eager: true": "enforce-eager: true\n    no-such-flag: 1"},
    )
    kit.build("demo-broken")
    with Streamer(kit.gateway("staging"), chunks=5) as s:
        s.wait_for(3)
        res = promote(kit.settings, "manifests/demo-broken.yaml", env="staging")
        s.wait_for(3)
    assert res.status == "deploy_failed" and res.deploy is not None
    assert res.deploy.failed_stage == "start" and not res.deploy.switched
    assert res.record is not None and res.record.type == "deploy_failed"
    assert "unrecognized arguments" in res.record.reason
    assert s.failures == [] and set(s.releases) == {old}
    assert [x.release_id for x in read_state(kit.settings.state_dir, "staging").servers] == [old]


def test_a_release_failing_its_smoke_suite_never_gets_traffic(kit: Kit) -> None:
    """A server that answers wrongly fails the smoke suite through the preview gateway:
    it is stopped and the live release keeps every request."""
    old = kit.build("demo-bf16")
    promote(kit.settings, old, env="staging")
    kit.variant(
        "demo-bf16",
        "demo-dumb",
        {'VLLM_CPU_KVCACHE_SPACE: "1"': 'VLLM_CPU_KVCACHE_SPACE: "1"\n    FAKE_ANSWER: "no idea"'},
    )
    kit.build("demo-dumb")
    res = promote(kit.settings, "manifests/demo-dumb.yaml", env="staging")
    assert res.status == "deploy_failed" and res.deploy is not None
    assert res.deploy.failed_stage == "smoke" and not res.deploy.switched
    assert res.deploy.smoke_preview is not None and res.deploy.smoke_preview.pass_rate == 0.0
    assert _ask(kit, "staging").headers["x-releasekit-release"] == old
    assert len(read_state(kit.settings.state_dir, "staging").servers) == 1


def test_streaming_client_sees_no_failed_or_cut_request_during_promotion(kit: Kit) -> None:
    """A client streams back to back through the gateway while a release with another
    serving config is promoted: the old server is drained before it stops (the stand-in,
    like vLLM, cuts streams on SIGTERM), so no request fails or is cut."""
    old = kit.build("demo-bf16")
    promote(kit.settings, old, env="staging")
    new = _v2(kit)
    with Streamer(kit.gateway("staging"), chunks=30) as s:
        s.wait_for(2)
        res = promote(kit.settings, new, env="staging")
        s.wait_for(3)
    assert res.status == "promoted", res.deploy
    assert s.failures == [], s.failures
    assert old in s.releases and new in s.releases
    st = read_state(kit.settings.state_dir, "staging")
    assert {(x.release_id, x.role) for x in st.servers} == {(old, "warm"), (new, "live")}


def test_down_stops_the_gateway_and_servers_and_promote_serves_again(kit: Kit) -> None:
    """`down` stops everything the environment runs and records it; promoting the release
    of record afterwards starts it again without a new live event."""
    rid = kit.build("demo-bf16")
    promote(kit.settings, rid, env="staging")
    st = read_state(kit.settings.state_dir, "staging")
    pids = [st.gateway.pid if st.gateway else 0, *[x.pid for x in st.servers]]
    res = down(kit.settings, "staging", reason="maintenance")
    assert res.gateway_stopped and res.servers_stopped == [rid]
    assert res.record is not None and res.record.type == "down"
    assert not any(_alive(p) for p in pids)
    after = read_state(kit.settings.state_dir, "staging")
    assert after.gateway is None and after.servers == []
    again = promote(kit.settings, rid, env="staging")
    assert again.status == "redeployed"
    assert _ask(kit, "staging").headers["x-releasekit-release"] == rid


def test_a_crashed_command_leaves_nothing_the_next_one_cannot_find(kit: Kit) -> None:
    """A gateway killed with SIGKILL is replaced by the next command with the recorded
    routes; a server left `starting` by a crashed command is stopped."""
    import signal

    rid = kit.build("demo-bf16")
    promote(kit.settings, rid, env="staging")
    st = read_state(kit.settings.state_dir, "staging")
    assert st.gateway is not None
    os.killpg(st.gateway.pid, signal.SIGKILL)
    # a half-started server a crashed promote left behind: recorded as starting
    from releasekit.deploy.local import spawn_detached
    from releasekit.deploy.state import ServerRecord, proc_start_time, write_state

    port = free_port_in_band(PORT_LOW, PORT_HIGH - 100, what="an orphaned server")
    proc = spawn_detached(
        [str(kit.python), "-m", "vllm.entrypoints.openai.api_server", "--model", "m",
         "--served-model-name", "demo", "--port", str(port)],
        env=dict(os.environ), log_path=kit.root / "orphan.log",
    )  # fmt: skip
    st.servers.append(
        ServerRecord(
            release_id="f" * 64, serving_key="x", base_url=f"http://127.0.0.1:{port}",
            port=port, pid=proc.pid, proc_start=proc_start_time(proc.pid), model="demo",
            log_path="orphan.log", role="starting", started_at=0.0,
        )
    )  # fmt: skip
    write_state(kit.settings.state_dir, st)
    new = _v2(kit)
    res = promote(kit.settings, new, env="staging")
    assert res.status == "promoted", res.deploy
    assert res.deploy is not None
    assert any("gateway pid" in n for n in res.deploy.notes)
    assert any("half-started" in n for n in res.deploy.notes)
    proc.wait(timeout=10)
    assert _ask(kit, "staging").headers["x-releasekit-release"] == new


def test_a_failure_after_the_switch_reverts_traffic_by_itself(kit: Kit) -> None:
    """When moving the record fails after the switch (here: the release was never
    registered in MLflow), the gateway goes back to the previous release on its own, the
    new server is drained and stopped, a streaming client loses nothing, and a
    `deploy_failed` event says why."""
    old = kit.build("demo-bf16")
    promote(kit.settings, old, env="staging")
    new = _v2(kit, register=False)
    with Streamer(kit.gateway("staging"), chunks=20) as s:
        s.wait_for(2)
        # Unregistered, its evidence is signed by nothing (and so not read): an override
        # carries it past the gates to the switch, where moving the record fails.
        res = promote(
            kit.settings,
            new,
            env="staging",
            force=["evidence", "quality", "perf"],
            reason="test the revert",
        )
        s.wait_for(3)
    assert res.status == "deploy_failed" and res.deploy is not None
    assert res.deploy.failed_stage == "record" and res.deploy.switched and res.deploy.reverted
    assert "not registered" in (res.deploy.failure or "")
    assert res.record is not None and res.record.type == "deploy_failed"
    assert res.record.evidence["reverted_to"] == old
    assert s.failures == [], s.failures
    assert _ask(kit, "staging").headers["x-releasekit-release"] == old
    st = read_state(kit.settings.state_dir, "staging")
    assert [(x.release_id, x.role) for x in st.servers] == [(old, "live")]
    live = _ledger(kit).live_at("staging")
    assert live is not None and live.to_release == old
