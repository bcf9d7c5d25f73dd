"""A way back that always works: when the ledger fails verification (a junk row, a record
signed by a key the repository does not trust), an ordinary rollback refuses and names
`--break-glass`; `rollback --break-glass --reason` goes back to the release the verified
records show live before the bad record, deploys it, and records a signed rollback that
says which record failed and how."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from project_copy import commit_and_land
from promote_kit import Kit, kill_everything, make_kit
from sqlalchemy import create_engine, func, select
from typer.testing import CliRunner

from releasekit.cli import app
from releasekit.deploy.state import read_state
from releasekit.promote.promote import promote
from releasekit.promote.rollback import rollback
from releasekit.stores import signing
from releasekit.stores.ledger import (
    DecisionRecordsError,
    Event,
    EventType,
    Ledger,
    events_table,
    record_hash,
)


@pytest.fixture
def signed_kit(
    project: Path,
    monkeypatch: pytest.MonkeyPatch,
    mlflow_template_db: Path,
    stand_in_model: Any,
) -> Iterator[Kit]:
    """A deploy kit whose ledger is signed with a committed (trusted) project key."""
    stand_in_model(project)
    k = make_kit(project, monkeypatch, mlflow_template_db)
    signing.generate_keypair(project)
    commit_and_land(project, "the project's ledger key", "keys")
    try:
        yield k
    finally:
        kill_everything(k.settings)


def _two_releases(k: Kit) -> tuple[str, str]:
    old = k.build("demo-bf16")
    assert promote(k.settings, old, env="staging").status == "promoted"
    k.variant("demo-bf16", "demo-v2", {"max-num-seqs: 32": "max-num-seqs: 16"})
    new = k.build("demo-v2")
    res = promote(k.settings, new, env="staging")
    assert res.status == "promoted", res.report.failed if res.report else res
    return old, new


def _rows(url: str) -> int:
    engine = create_engine(url)
    with engine.begin() as conn:
        n = int(conn.execute(select(func.count()).select_from(events_table)).scalar_one())
    engine.dispose()
    return n


def _junk_row(url: str) -> int:
    """Insert a row that does not chain (a junk write straight into the database), leaving
    the head row as it was; returns its seq."""
    engine = create_engine(url)
    with engine.begin() as conn:
        last = conn.execute(select(events_table).order_by(events_table.c.seq.desc())).first()
        assert last is not None
        seq = int(last.seq) + 1
        conn.execute(
            events_table.insert().values(
                seq=seq,
                event_id="junk",
                type="note",
                time=last.time,
                actor="nobody",
                environment=None,
                from_release=None,
                to_release=None,
                reason="junk",
                evidence="{}",
                live=False,
                prev_hash="e" * 64,
                hash="f" * 64,
            )
        )
    engine.dispose()
    return seq


def test_a_junk_row_refuses_rollback_and_break_glass_goes_back(signed_kit: Kit) -> None:
    """After a junk row, `rollback` refuses with one line naming --break-glass and changes
    nothing; --break-glass without --reason is one line and changes nothing; with a reason
    it rolls back to the release live before the current one (the junk row changed
    nothing there), serves it, and appends a signed, chained rollback after the junk row
    whose evidence names the record it went past."""
    k = signed_kit
    old, new = _two_releases(k)
    url = k.settings.ledger_url or ""
    bad = _junk_row(url)
    n = _rows(url)
    with pytest.raises(DecisionRecordsError) as info:
        rollback(k.settings, "staging", reason="bad answers")
    assert "--break-glass" in info.value.remedy
    runner = CliRunner()
    res = runner.invoke(app, ["rollback", "staging", "-r", "bad answers"])
    assert res.exit_code == 1 and "--break-glass" in res.output and "Traceback" not in res.output
    res = runner.invoke(app, ["rollback", "staging", "--break-glass"])
    assert res.exit_code == 1 and "needs a reason" in res.output
    assert _rows(url) == n
    assert read_state(k.settings.state_dir, "staging").routed_release_ids() == [new]

    res = runner.invoke(app, ["rollback", "staging", "--break-glass", "-r", "bad answers"])
    assert res.exit_code == 0, res.output
    assert "break glass" in res.output and f"past record {bad}" in res.output
    assert read_state(k.settings.state_dir, "staging").routed_release_ids() == [old]
    led = Ledger(url)
    recs = led.records()
    rb = next(r for r in recs if r.type == "rollback")
    assert rb.seq == bad + 1 and rb.to_release == old and rb.from_release == new
    engine = create_engine(url)
    with engine.begin() as conn:
        row = conn.execute(select(events_table).where(events_table.c.seq == rb.seq)).one()
    engine.dispose()
    assert row.prev_hash == "f" * 64 and record_hash(dict(row._mapping)) == row.hash
    assert rb.key_id is not None and rb.reason == "bad answers"
    glass = rb.evidence["break_glass"]
    assert glass["first_bad_seq"] == bad and glass["verified_up_to"] == bad - 1
    assert "record" in glass["problem"]
    assert any(r.type == "mark_bad" and r.to_release == new for r in recs)
    # The ledger still fails at the junk row: breaking glass repaired nothing.
    assert led.verify().first_bad_seq == bad


def test_a_record_signed_by_an_untrusted_key_is_gone_past(signed_kit: Kit) -> None:
    """A record appended with a key the repository does not trust makes rollback refuse;
    break-glass decides on the records before it and goes back, recorded with the failure
    it went past."""
    k = signed_kit
    old, new = _two_releases(k)
    url = k.settings.ledger_url or ""
    rogue = signing.generate_keypair(k.root / "elsewhere")
    forged = Ledger(url, signer=signing.load_private_key(rogue.private_path))
    rec = forged.append(
        Event(
            type=EventType.ROLLBACK,
            environment="staging",
            from_release=new,
            to_release=old,
            reason="forged",
            live=True,
        )
    )
    with pytest.raises(DecisionRecordsError):
        rollback(k.settings, "staging", reason="again")
    res = rollback(k.settings, "staging", reason="the ledger is forged", break_glass=True)
    assert res.status == "rolled_back" and res.to_release == old
    assert res.record is not None
    assert res.record.evidence["break_glass"]["first_bad_seq"] == rec.seq
    assert res.record.seq == rec.seq + 1
