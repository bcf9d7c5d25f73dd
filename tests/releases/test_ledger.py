"""The event ledger: append-only, hash-chained, safe under concurrent writers, and `verify`
names the first record that was edited, deleted or reordered."""

from __future__ import annotations

import datetime as dt
import json
import multiprocessing as mp
import sqlite3
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from typer.testing import CliRunner

from releasekit.cli import app
from releasekit.errors import LedgerError, LedgerIntegrityError
from releasekit.stores.ledger import GENESIS, Event, EventType, Ledger

# The shared fixtures, loaded as a plugin so session-scoped ones are made once per session.
if TYPE_CHECKING:
    from tests.releases.conftest import Proj

runner = CliRunner()
A, B, C = "a" * 64, "b" * 64, "c" * 64


def _url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'ledger.db'}"


def _fill(led: Ledger, n: int) -> None:
    for i in range(n):
        led.append(Event(type=EventType.BUILD, to_release=f"{i:064x}", reason=f"build {i}"))


def test_each_record_carries_the_hash_of_the_one_before(tmp_path: Path) -> None:
    led = Ledger(_url(tmp_path), actor="ci <ci@example.com>")
    r1 = led.append(Event(type=EventType.BUILD, to_release=A, evidence={"digest": "x"}))
    r2 = led.append(
        Event(type="assign", environment="staging", to_release=A, reason="go", live=True)
    )
    assert (r1.seq, r2.seq) == (1, 2)
    assert r1.prev_hash == GENESIS and r2.prev_hash == r1.hash
    assert r1.actor == "ci <ci@example.com>" and r1.time.tzinfo is not None
    assert led.records() == [r1, r2]
    assert led.records()[0].evidence == {"digest": "x"}
    res = led.verify()
    assert res.ok and res.records == 2 and res.head_seq == 2 and res.head_hash == r2.hash


def test_unknown_event_type_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        Event(type="promoted")  # type: ignore[arg-type]


def _tamper(tmp_path: Path, sql: str) -> None:
    con = sqlite3.connect(tmp_path / "ledger.db")
    con.execute(sql)
    con.commit()
    con.close()


def test_editing_a_row_makes_verify_name_it(tmp_path: Path) -> None:
    led = Ledger(_url(tmp_path), actor="x")
    _fill(led, 6)
    _tamper(tmp_path, "UPDATE events SET reason = 'nothing to see' WHERE seq = 4")
    res = led.verify()
    assert not res.ok and res.first_bad_seq == 4 and "edited" in (res.problem or "")
    with pytest.raises(LedgerIntegrityError) as exc:
        led.check()
    assert exc.value.seq == 4


def test_deleting_a_middle_row_makes_verify_name_it(tmp_path: Path) -> None:
    led = Ledger(_url(tmp_path), actor="x")
    _fill(led, 6)
    _tamper(tmp_path, "DELETE FROM events WHERE seq = 3")
    res = led.verify()
    assert res.first_bad_seq == 3 and "missing" in (res.problem or "")


def test_deleting_the_newest_row_is_caught_by_the_head(tmp_path: Path) -> None:
    led = Ledger(_url(tmp_path), actor="x")
    _fill(led, 5)
    _tamper(tmp_path, "DELETE FROM events WHERE seq = 5")
    res = led.verify()
    assert res.first_bad_seq == 5 and "missing" in (res.problem or "")
    with pytest.raises(LedgerIntegrityError):  # and nothing is appended onto it
        led.append(Event(type=EventType.BUILD, to_release=A))


def test_reordering_rows_makes_verify_name_the_first_moved(tmp_path: Path) -> None:
    led = Ledger(_url(tmp_path), actor="x")
    _fill(led, 6)
    _tamper(tmp_path, "UPDATE events SET seq = -1 WHERE seq = 3")
    _tamper(tmp_path, "UPDATE events SET seq = 3 WHERE seq = 4")
    _tamper(tmp_path, "UPDATE events SET seq = 4 WHERE seq = -1")
    res = led.verify()
    assert res.first_bad_seq == 3


def test_a_rewritten_row_with_a_recomputed_hash_breaks_the_next_link(tmp_path: Path) -> None:
    from releasekit.stores.ledger import record_hash

    led = Ledger(_url(tmp_path), actor="x")
    _fill(led, 4)
    con = sqlite3.connect(tmp_path / "ledger.db")
    con.row_factory = sqlite3.Row
    row = dict(con.execute("SELECT * FROM events WHERE seq = 2").fetchone())
    row["reason"] = "forged"
    con.execute(
        "UPDATE events SET reason = ?, hash = ? WHERE seq = 2", (row["reason"], record_hash(row))
    )
    con.commit()
    con.close()
    res = led.verify()
    assert res.first_bad_seq == 3 and "does not follow record 2" in (res.problem or "")


def test_cli_ledger_verify_exits_1_and_names_the_record(proj: Proj) -> None:
    led = Ledger(proj.settings.ledger_url or "", actor="x")
    _fill(led, 3)
    res = runner.invoke(app, ["ledger", "verify"])
    assert res.exit_code == 0 and "3 records" in res.stdout
    db = Path((proj.settings.ledger_url or "").removeprefix("sqlite:///"))
    con = sqlite3.connect(db)
    con.execute("UPDATE events SET actor = 'mallory' WHERE seq = 2")
    con.commit()
    con.close()
    res = runner.invoke(app, ["ledger", "verify"])
    assert res.exit_code == 1 and "record 2" in res.stderr
    res = runner.invoke(app, ["ledger", "verify", "--json"])
    assert res.exit_code == 1 and json.loads(res.stdout)["first_bad_seq"] == 2


@pytest.mark.parametrize("immediate", [True, False], ids=["begin-immediate", "optimistic-retry"])
def test_concurrent_appends_from_processes_keep_one_valid_chain(
    tmp_path: Path, immediate: bool, append_worker_fn: Any
) -> None:
    """Real processes append at the same moment; the chain neither forks nor breaks. The
    optimistic path (unique seq + compare-and-swap + retry) is what non-SQLite databases use."""
    url = _url(tmp_path)
    Ledger(url)  # create the schema first, as any real deployment has
    ctx = mp.get_context("spawn")
    workers, per = 4, 25
    start = ctx.Barrier(workers)
    spans = ctx.Array("d", 2 * workers)
    procs = [
        ctx.Process(target=append_worker_fn, args=(url, w, per, immediate, start, spans))
        for w in range(workers)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    led = Ledger(url)
    recs = led.records()
    assert [r.seq for r in recs] == list(range(1, workers * per + 1))
    assert led.verify().ok
    for w in range(workers):  # each writer's events, in its own order
        mine = [int(r.reason.split(":")[1]) for r in recs if r.actor == f"worker-{w}"]
        assert mine == list(range(per))
    # The writers really overlapped in time (the test would prove nothing otherwise).
    starts, ends = spans[0::2], spans[1::2]
    assert max(starts) < min(ends)


def test_live_at_and_current_follow_assignments(tmp_path: Path) -> None:
    led = Ledger(_url(tmp_path), actor="x")
    led.append(Event(type="assign", environment="production", to_release=A, live=True))
    time.sleep(0.01)
    t1 = dt.datetime.now(dt.UTC)
    time.sleep(0.01)
    led.append(Event(type="gate_failed", environment="production", to_release=C))  # not live
    led.append(
        Event(type="promote", environment="production", from_release=A, to_release=B, live=True)
    )
    led.append(Event(type="assign", environment="staging", to_release=C, live=True))
    assert led.live_at("production", t1).to_release == A  # type: ignore[union-attr]
    assert led.live_at("production").to_release == B  # type: ignore[union-attr]
    assert led.live_at("production", t1 - dt.timedelta(days=1)) is None
    assert {r.environment: r.to_release for r in led.current()} == {"production": B, "staging": C}
    assert [r.seq for r in led.records(release=A)] == [1, 3]
    assert [r.seq for r in led.records(environment="production", since=t1)] == [2, 3]
    assert [r.seq for r in led.records(types=["gate_failed"])] == [2]
    assert led.release_ids() == {A, B, C}


def test_times_never_go_backwards_along_the_chain(tmp_path: Path) -> None:
    led = Ledger(_url(tmp_path), actor="x")
    _fill(led, 20)
    times = [r.time for r in led.records()]
    assert times == sorted(times)


def test_append_many_is_all_or_nothing(tmp_path: Path) -> None:
    led = Ledger(_url(tmp_path), actor="x")
    evs = [Event(type=EventType.BUILD, to_release=A), Event(type=EventType.BUILD, to_release=B)]
    led.append_many(evs)
    with pytest.raises(LedgerError):  # same event ids again: the unique constraint refuses
        led.append_many([Event(type=EventType.BUILD, to_release=C), evs[0]])
    assert led.count() == 2 and led.verify().ok


def test_unusable_ledger_url_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(LedgerError, match="invalid ledger URL"):
        Ledger("not a url")
    (tmp_path / "dir.db").mkdir()
    with pytest.raises(LedgerError, match="cannot open ledger"):
        Ledger(f"sqlite:///{tmp_path / 'dir.db'}")


def test_a_read_only_auditor_can_query_and_verify(tmp_path: Path) -> None:
    led = Ledger(_url(tmp_path), actor="x")
    _fill(led, 3)
    led.close()
    ro = Ledger(f"sqlite:///file:{tmp_path / 'ledger.db'}?mode=ro&uri=true")
    assert ro.count() == 3 and ro.verify().ok and len(ro.records(limit=2)) == 2
    with pytest.raises(LedgerError, match="readonly"):
        ro.append(Event(type=EventType.BUILD, to_release=A))
