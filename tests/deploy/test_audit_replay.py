"""`releasekit audit replay`: a recorded decision's gate verdicts recomputed from its verified
inputs come out the same; tampering with any input (an evidence file, the manifest copy,
the policy at the recorded commit, a ledger row) is reported as a difference (exit 1), and
the live gate catches the tampered evidence too."""

from __future__ import annotations

import json
from pathlib import Path

from promote_kit import Kit
from sqlalchemy import create_engine, select
from test_break_glass import _two_releases, signed_kit
from typer.testing import CliRunner

from releasekit.audit.replay import replay
from releasekit.cli import app
from releasekit.promote.promote import promote
from releasekit.stores.ledger import Event, EventType, Ledger, events_table, open_ledger
from releasekit.stores.results import ReleasePaths

__all__ = ["signed_kit"]


def _decision(k: Kit, rid: str) -> int:
    recs = Ledger(k.settings.ledger_url or "").records(release=rid)
    return next(r.seq for r in recs if r.type in ("promote", "override") and r.to_release == rid)


def _tampered(path: Path) -> bytes:
    """Change one byte of meaning in `path` (a JSON or YAML file); return the original."""
    before = path.read_bytes()
    path.write_bytes(before.replace(b"demo", b"dem0", 1) if b"demo" in before else before + b" ")
    return before


def test_replay_same_then_each_tampered_input_differs(signed_kit: Kit) -> None:
    k = signed_kit
    old, new = _two_releases(k)
    runner = CliRunner()
    res = runner.invoke(app, ["audit", "replay", "--all"])
    assert res.exit_code == 0, res.output
    assert "every verdict the same" in res.output
    # One line a decision with its tally; every verdict only with --explain.
    assert "same ledger record" not in res.output and " same)" in res.output
    explained = runner.invoke(app, ["audit", "replay", "--all", "--explain"])
    assert explained.exit_code == 0 and "same ledger record" in explained.output
    # --brief: the total alone while every decision is the same.
    brief = runner.invoke(app, ["audit", "replay", "--all", "--brief"])
    assert brief.exit_code == 0
    assert brief.output.strip().splitlines() == res.output.strip().splitlines()[-1:]
    seq = _decision(k, new)
    d = replay(k.settings, str(seq)).decisions[0]
    assert d.same and d.against == old
    kinds = {c.kind for c in d.checks if c.status == "same"}
    assert {"record", "policy", "evidence", "quality", "perf"} <= kinds

    # An evidence file: replay and the live gate both name it.
    eval_json = ReleasePaths.of(k.settings, new).eval_dir / "eval.json"
    before = _tampered(eval_json)
    res = runner.invoke(app, ["audit", "replay", str(seq)])
    assert res.exit_code == 1 and "DIFFERENT" in res.output and "eval.json" in res.output
    brief = runner.invoke(app, ["audit", "replay", "--all", "--brief"])
    heads = [ln for ln in brief.output.splitlines() if ln.startswith("#")]
    assert brief.exit_code == 1 and heads and all("DIFFERENT" in ln for ln in heads)
    assert any(ln.startswith(f"#{seq} ") for ln in heads)
    gate = promote(k.settings, new, env="production", dry_run=True)
    assert gate.report is not None and not gate.report.passed
    assert any(g.kind == "evidence" and "eval.json" in g.detail for g in gate.report.failed)
    eval_json.write_bytes(before)

    # The manifest copy.
    manifest = ReleasePaths.of(k.settings, new).manifest
    before = _tampered(manifest)
    out = replay(k.settings, str(seq))
    assert not out.same and any(c.kind == "evidence" for c in out.decisions[0].differences)
    manifest.write_bytes(before)
    assert replay(k.settings, str(seq)).same

    # The policy: a decision whose recorded policy is not the one at its recorded commit.
    led = open_ledger(k.settings)
    rec = next(r for r in led.records() if r.seq == seq)
    ev = json.loads(json.dumps(rec.evidence))
    ev["policy"]["source"]["digest"] = "0" * 64
    forged = led.append(
        Event(
            type=EventType.GATE_FAILED,
            environment="staging",
            from_release=rec.from_release,
            to_release=new,
            reason="recorded under another policy",
            evidence=ev,
            live=False,
        )
    )
    out = replay(k.settings, str(forged.seq))
    assert [c.kind for c in out.decisions[0].differences] == ["policy"]

    # A ledger row edited in place.
    engine = create_engine(k.settings.ledger_url or "")
    with engine.begin() as conn:
        row = conn.execute(select(events_table).where(events_table.c.seq == seq)).one()
        conn.execute(
            events_table.update()
            .where(events_table.c.seq == seq)
            .values(evidence=row.evidence.replace('"passed":true', '"passed":false', 1))
        )
    engine.dispose()
    res = runner.invoke(app, ["audit", "replay", "--all"])
    assert res.exit_code == 1 and f"ledger record {seq}" in res.output


def test_replay_names_no_decision_in_one_line(signed_kit: Kit) -> None:
    """An unknown event, a record that is no decision, or neither EVENT nor --all: one
    line, exit 1."""
    signed_kit.build("demo-bf16")  # a register event
    runner = CliRunner()
    res = runner.invoke(app, ["audit", "replay", "9999"])
    assert res.exit_code == 1 and "no ledger record" in res.output
    res = runner.invoke(app, ["audit", "replay", "1"])
    assert res.exit_code == 1 and "not a decision with gates" in res.output
    res = runner.invoke(app, ["audit", "replay"])
    assert res.exit_code == 1 and "--all" in res.output
    assert "Traceback" not in res.output
