"""Rollback on the local target: no gates, back to the previous good release (warm: only a
gateway switch; cold: its server starts first), a new event, and the release rolled back
from marked bad."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import webclient
from promote_kit import Kit, Streamer, kill_everything, kit, make_kit
from sqlalchemy import create_engine, select
from typer.testing import CliRunner

from releasekit.cli import app
from releasekit.deploy.state import read_state
from releasekit.promote.promote import promote
from releasekit.promote.rollback import RollbackError, previous_good_release, rollback
from releasekit.stores.ledger import DecisionRecordsError, Ledger, events_table, head_table
from releasekit.stores.mlflow import alias_version, client_for

__all__ = ["kit"]


@pytest.fixture
def cold_kit(
    project: Path,
    monkeypatch: pytest.MonkeyPatch,
    mlflow_template_db: Path,
    stand_in_model: Any,
) -> Iterator[Kit]:
    """A kit whose staging keeps no previous release warm (warm_s = 0)."""
    stand_in_model(project)
    k = make_kit(project, monkeypatch, mlflow_template_db, warm_s={"staging": 0})
    try:
        yield k
    finally:
        kill_everything(k.settings)


def _two_releases(k: Kit) -> tuple[str, str]:
    old = k.build("demo-bf16")
    assert promote(k.settings, old, env="staging").status == "promoted"
    k.variant("demo-bf16", "demo-v2", {"max-num-seqs: 32": "max-num-seqs: 16"})
    new = k.build("demo-v2")
    assert promote(k.settings, new, env="staging").status == "promoted"
    return old, new


def test_warm_rollback_switches_back_without_a_failed_request(kit: Kit) -> None:
    """With the previous release warm, rollback is a gateway switch (no server starts);
    a client streaming throughout sees no failed or cut request; the ledger has a live
    `rollback` event and a `mark_bad` event for the release rolled back from; the MLflow
    alias follows."""
    old, new = _two_releases(kit)
    pids = {s.release_id: s.pid for s in read_state(kit.settings.state_dir, "staging").servers}
    with Streamer(kit.gateway("staging"), chunks=30) as s:
        s.wait_for(2)
        res = rollback(kit.settings, "staging", reason="ttft regression", actor="oncall")
        s.wait_for(3)
    assert res.status == "rolled_back" and res.warm and res.to_release == old
    assert s.failures == [] and old in s.releases and new in s.releases
    st = read_state(kit.settings.state_dir, "staging")
    assert {x.release_id: x.pid for x in st.servers} == pids  # nothing restarted
    assert {(x.release_id, x.role) for x in st.servers} == {(old, "live"), (new, "warm")}
    led = Ledger(kit.settings.ledger_url or "")
    live = led.live_at("staging")
    assert live is not None and live.type == "rollback" and live.to_release == old
    assert live.from_release == new and live.actor == "oncall"
    assert res.marked_bad is not None and res.marked_bad.to_release == new
    alias = alias_version(kit.settings, "demo-bf16", "staging")
    assert alias is not None and alias.release_id == old
    assert alias_version(kit.settings, "demo-v2", "staging") is None
    client = client_for(kit.settings)
    assert client.get_prompt_version_by_alias("demo-bf16.chat", "staging") is not None
    assert res.prompt_alias is not None and res.prompt_alias.removed_from == "demo-v2.chat"


def test_a_release_marked_bad_is_refused_unless_forced(kit: Kit) -> None:
    """After a rollback, promoting the release rolled back from is blocked by the policy
    gate; --force with a reason overrides it."""
    _old, new = _two_releases(kit)
    rollback(kit.settings, "staging", reason="bad answers")
    res = promote(kit.settings, new, env="staging")
    assert res.status == "blocked" and res.report is not None
    assert "not marked bad" in [g.name for g in res.report.failed]
    # Policy is overridden only when named: forcing the other kinds leaves it blocking.
    others = promote(
        kit.settings, new, env="staging", force=["perf", "quality", "evidence"], reason="no"
    )
    assert others.status == "blocked"
    forced = promote(kit.settings, new, env="staging", force=["policy"], reason="fixed upstream")
    assert forced.status == "promoted" and "not marked bad" in forced.overridden


def test_cold_rollback_starts_the_previous_release_first(cold_kit: Kit) -> None:
    """With no warm period the old server was drained and stopped after the promotion;
    rollback starts it again before switching, and the current release serves meanwhile."""
    old, new = _two_releases(cold_kit)
    assert [x.release_id for x in read_state(cold_kit.settings.state_dir, "staging").servers] == [
        new
    ]
    with Streamer(cold_kit.gateway("staging"), chunks=10) as s:
        s.wait_for(2)
        res = rollback(cold_kit.settings, "staging", reason="regression")
        s.wait_for(2)
    assert res.status == "rolled_back" and not res.warm
    assert s.failures == []
    r = webclient.post(
        f"{cold_kit.gateway('staging')}/v1/completions", json={"prompt": "x", "max_tokens": 2}
    )
    assert r.headers["x-releasekit-release"] == old


def test_rollback_guards(kit: Kit) -> None:
    """Nothing live: an error. `from_release` that is no longer live: `not_live`, nothing
    done. Without --to, releases marked bad are skipped."""
    with pytest.raises(RollbackError, match="nothing is live"):
        rollback(kit.settings, "staging", reason="x")
    old, new = _two_releases(kit)
    res = rollback(kit.settings, "staging", reason="x", from_release=old)
    assert res.status == "not_live"
    led = Ledger(kit.settings.ledger_url or "")
    assert previous_good_release(led, "staging") == old
    rollback(kit.settings, "staging", reason="x")
    # now old is live, new is marked bad: nothing good to go back to
    assert previous_good_release(led, "staging") is None
    with pytest.raises(RollbackError, match="no earlier release"):
        rollback(kit.settings, "staging", reason="again")
    # --to a release marked bad: a rollback never goes back to it; promote decides that.
    with pytest.raises(RollbackError, match="is marked bad") as info:
        rollback(kit.settings, "staging", to=new, reason="by name")
    assert "releasekit promote" in info.value.remedy
    live = led.live_at("staging")
    assert live is not None and live.to_release == old


def test_rollback_to_only_goes_back_to_what_was_live_there(kit: Kit) -> None:
    """`rollback --to` a registered release that was never live in staging (no gates, no
    smoke, no approval would stand in its way otherwise) is refused with one line telling
    the user to promote it; nothing moves or starts."""
    old, new = _two_releases(kit)
    kit.variant("demo-bf16", "demo-never", {"max-num-seqs: 32": "max-num-seqs: 8"})
    never = kit.build("demo-never")
    servers = read_state(kit.settings.state_dir, "staging").servers
    with pytest.raises(RollbackError, match="was never live in staging") as info:
        rollback(kit.settings, "staging", to=never, reason="sneak it in")
    assert "releasekit promote" in info.value.remedy
    cli = CliRunner().invoke(
        app, ["rollback", "staging", "--to", never[:12], "-r", "x"], env={"COLUMNS": "300"}
    )
    assert cli.exit_code == 1
    assert f"{never[:12]} was never live in staging" in cli.output
    assert "releasekit promote" in cli.output
    live = Ledger(kit.settings.ledger_url or "").live_at("staging")
    assert live is not None and live.to_release == new
    now = read_state(kit.settings.state_dir, "staging").servers
    assert {x.release_id for x in now} == {x.release_id for x in servers} and old in {
        x.release_id for x in now
    }


def test_a_deleted_mark_bad_record_stops_the_next_promote(kit: Kit) -> None:
    """Someone who can write the ledger database deletes the `mark_bad` record a rollback
    wrote (and points the head back, so the chain itself is consistent): the next promote
    of that release refuses to act on the ledger, naming what failed, instead of finding
    the release no longer marked bad; nothing is deployed."""
    _old, new = _two_releases(kit)
    res = rollback(kit.settings, "staging", reason="bad answers")
    assert res.marked_bad is not None
    seq = res.marked_bad.seq
    url = kit.settings.ledger_url or ""
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(events_table.delete().where(events_table.c.seq == seq))
        prev = conn.execute(select(events_table).where(events_table.c.seq == seq - 1)).one()
        conn.execute(head_table.update().values(seq=prev.seq, hash=prev.hash))
    engine.dispose()
    with pytest.raises(DecisionRecordsError, match="refusing to act on ledger") as info:
        promote(kit.settings, new, env="staging", reason="it is fine now")
    assert f"record {seq}" in info.value.message or "anchor" in info.value.message
    with pytest.raises(DecisionRecordsError):
        rollback(kit.settings, "staging", reason="again")
    live = Ledger(url).live_at("staging")
    assert live is not None and live.to_release == res.to_release
