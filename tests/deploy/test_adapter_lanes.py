"""Adapter lanes (`<env>:<adapter>`), with the stand-in vLLM started LoRA-ready: two adapters
live at once on one engine in one environment, each with its own record, history and
rollback; a lane's change never moves the base's route or another lane's, and no engine
starts. Bad lane requests are refused in one line and change nothing."""

from __future__ import annotations

from typing import Any

import pytest
import webclient
from promote_kit import Kit, Streamer, adapter_release, kit, lora_base_release
from typer.testing import CliRunner

from releasekit.audit.replay import replay
from releasekit.cli import app
from releasekit.cli._common import State
from releasekit.deploy.state import read_state
from releasekit.promote.deploy import deploy_status, down
from releasekit.promote.promote import PromoteError, promote
from releasekit.promote.rollback import rollback
from releasekit.releases.assign import assign
from releasekit.releases.queries import history
from releasekit.releases.reconcile import checked_status
from releasekit.stores.ledger import Ledger

__all__ = ["kit"]


def _ask(k: Kit, model: str) -> Any:
    return webclient.post(
        f"{k.gateway('staging')}/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4},
    )


def _served_by(k: Kit, model: str) -> str:
    r = _ask(k, model)
    assert r.status_code == 200, r.text
    return str(r.headers["x-releasekit-release"])


def _lanes_live(k: Kit) -> tuple[str, str, str]:
    """The LoRA-ready base in staging, then lane staging:demo-json and lane staging:demo-xml;
    (base, json, xml) release ids."""
    base = lora_base_release(k)
    assert promote(k.settings, base, env="staging").status == "promoted"
    rj = adapter_release(k, "json-v1", b"\1" * 64)
    res = promote(k.settings, rj, env="staging:demo-json")
    assert res.status == "promoted", res
    assert res.report is not None and res.report.live_release_id == base  # judged vs the base
    rx = adapter_release(k, "xml-v1", b"\3" * 64, adapter="demo-xml")
    assert promote(k.settings, rx, env="staging:demo-xml").status == "promoted"
    return base, rj, rx


def test_two_lanes_live_at_once_each_with_its_own_record_and_rollback(kit: Kit) -> None:
    """Both adapters answer under their names from their own releases while the base answers
    from its own, on one engine; a second version of demo-json is judged against the first,
    and rolling it back moves only that lane's route (no load: the old version stayed warm)
    while a client streaming from demo-xml loses nothing; each lane's record, history and
    `at` are its own."""
    base, rj, rx = _lanes_live(kit)
    [srv] = read_state(kit.settings.state_dir, "staging").servers
    assert (_served_by(kit, "demo"), _served_by(kit, "demo-json"), _served_by(kit, "demo-xml")) == (
        base,
        rj,
        rx,
    )
    rj2 = adapter_release(kit, "json-v2", b"\2" * 64)
    res = promote(kit.settings, rj2, env="staging:demo-json")
    assert res.status == "promoted" and res.report is not None
    assert res.report.live_release_id == rj  # the lane's live release, not the base
    assert _served_by(kit, "demo-json") == rj2
    with (
        Streamer(kit.gateway("staging"), model="demo-xml") as xml,
        Streamer(kit.gateway("staging")) as base_client,
    ):
        xml.wait_for(3)
        back = rollback(kit.settings, "staging:demo-json", reason="a worse adapter")
        xml.wait_for(3)
        base_client.wait_for(3)
    assert back.status == "rolled_back" and back.to_release == rj and back.warm
    assert xml.failures == [] and base_client.failures == []
    assert set(xml.releases) == {rx} and set(base_client.releases) == {base}
    assert _served_by(kit, "demo-json") == rj
    [after] = read_state(kit.settings.state_dir, "staging").servers
    assert after.pid == srv.pid  # no engine started through any of it
    led = Ledger(kit.settings.ledger_url or "")
    live = [led.live_at(e) for e in ("staging", "staging:demo-json", "staging:demo-xml")]
    assert [r.to_release if r else None for r in live] == [base, rj, rx]
    lane = history(kit.settings, env="staging:demo-json").events
    assert {e.environment for e in lane} == {"staging:demo-json"}
    assert [e.type for e in lane if e.type in ("promote", "rollback")] == [
        "promote",
        "promote",
        "rollback",
    ]
    every = {e.environment for e in history(kit.settings, env="staging").events}
    assert every >= {"staging", "staging:demo-json", "staging:demo-xml"}
    State.reset()
    out = CliRunner().invoke(app, ["history", "--env", "staging", "--adapter", "demo-xml"])
    assert out.exit_code == 0, out.output
    assert "staging:demo-xml" in out.output and "staging:demo-json" not in out.output
    [dep] = deploy_status(kit.settings, env="staging")
    assert dep.agrees and dep.serving, dep
    assert [(x.lane, x.routed, x.agrees) for x in dep.lanes] == [
        ("staging:demo-json", [rj], True),
        ("staging:demo-xml", [rx], True),
    ]
    st = checked_status(kit.settings)
    rows = {e.environment: (e.release_id, e.drift) for e in st.environments}
    assert rows["staging:demo-json"] == (rj, "ok") and rows["staging:demo-xml"] == (rx, "ok")
    replayed = replay(kit.settings, None, all_=True)
    lanes = {d.environment for d in replayed.decisions}
    assert {"staging:demo-json", "staging:demo-xml"} <= lanes and replayed.same, replayed


def test_a_lane_taken_down_404s_and_the_rest_keeps_serving(kit: Kit) -> None:
    """`down staging:demo-xml` takes only that route out (recorded for the lane); its name
    then gets the gateway's 404, never the base's answer, and the base and the other lane
    answer as before. Promoting its release again serves it again."""
    base, rj, rx = _lanes_live(kit)
    res = down(kit.settings, "staging:demo-xml", reason="retire")
    assert res.lanes_down == ["staging:demo-xml"] and res.servers_stopped == []
    assert res.record is not None and res.record.environment == "staging:demo-xml"
    r = _ask(kit, "demo-xml")
    assert r.status_code == 404 and "demo-xml" in r.text
    assert (_served_by(kit, "demo"), _served_by(kit, "demo-json")) == (base, rj)
    again = promote(kit.settings, rx, env="staging:demo-xml")
    assert again.status == "redeployed", again
    assert _served_by(kit, "demo-xml") == rx


def test_a_lane_release_carries_exactly_its_adapter(kit: Kit) -> None:
    """A release without the lane's adapter (the base, another adapter) is refused before
    any gate, naming what it carries; nothing is recorded."""
    base = lora_base_release(kit)
    assert promote(kit.settings, base, env="staging").status == "promoted"
    rx = adapter_release(kit, "xml-v1", b"\3" * 64, adapter="demo-xml")
    led = Ledger(kit.settings.ledger_url or "")
    n = led.count()
    for rid, carried in ((base, "no adapter"), (rx, "demo-xml")):
        with pytest.raises(PromoteError, match=f"carries {carried}: a release for lane"):
            promote(kit.settings, rid, env="staging:demo-json")
    assert led.count() == n


def test_a_lane_needs_the_live_engine_running_its_base(kit: Kit) -> None:
    """With a base that runs other serving arguments live (no LoRA), the lane's promotion is
    a failed deploy at stage `adapters` saying what to promote first; the route stays."""
    plain = kit.build("demo-bf16")
    assert promote(kit.settings, plain, env="staging").status == "promoted"
    rj = adapter_release(kit, "json-v1", b"\1" * 64)
    res = promote(kit.settings, rj, env="staging:demo-json")
    assert res.status == "deploy_failed" and res.deploy is not None
    assert res.deploy.failed_stage == "adapters"
    assert "promote to staging a release of the base" in (res.deploy.failure or "")
    assert [r.release_id for r in read_state(kit.settings.state_dir, "staging").routes] == [plain]


def test_a_base_needing_another_engine_is_refused_while_lanes_live(kit: Kit) -> None:
    """Promoting to staging a release that needs a new engine would strand the lanes: it is
    refused at stage `adapters`, naming them; once the lanes are down it goes through."""
    _base, rj, _rx = _lanes_live(kit)
    plain = kit.build("demo-bf16")
    res = promote(kit.settings, plain, env="staging")
    assert res.status == "deploy_failed" and res.deploy is not None
    assert res.deploy.failed_stage == "adapters"
    assert "staging:demo-json, staging:demo-xml" in (res.deploy.failure or "")
    assert _served_by(kit, "demo-json") == rj
    for lane in ("staging:demo-json", "staging:demo-xml"):
        down(kit.settings, lane, reason="new base")
    assert promote(kit.settings, plain, env="staging").status == "promoted"


def test_lanes_beyond_max_loras_are_refused(kit: Kit) -> None:
    """The engine takes max-loras (2) adapters across lanes: a third lane is a failed deploy
    that says so, and the two live lanes keep answering."""
    _base, rj, rx = _lanes_live(kit)
    rz = adapter_release(kit, "zip-v1", b"\4" * 64, adapter="demo-zip")
    res = promote(kit.settings, rz, env="staging:demo-zip")
    assert res.status == "deploy_failed" and res.deploy is not None
    assert "max-loras is 2" in (res.deploy.failure or "")
    assert (_served_by(kit, "demo-json"), _served_by(kit, "demo-xml")) == (rj, rx)


def test_a_record_only_assign_cannot_move_a_lane(kit: Kit) -> None:
    """A lane is deployed where its environment is: `assign` refuses it."""
    rj = adapter_release(kit, "json-v1", b"\1" * 64)
    with pytest.raises(Exception, match="deployed by releasekit"):
        assign(kit.settings, rj, env="staging:demo-json", reason="sneak")


def test_a_base_release_carrying_a_lanes_adapter_is_refused(kit: Kit) -> None:
    """One adapter name has one release of record: a release of staging itself that carries
    demo-json while lane staging:demo-json is live is refused before any gate."""
    _lanes_live(kit)
    both = adapter_release(kit, "json-in-base", b"\5" * 64)
    with pytest.raises(PromoteError, match="serves in its own lane"):
        promote(kit.settings, both, env="staging")
