"""`releasekit audit replay` of verdicts judged on live traffic: a recorded canary step
replays "same" through the same judge; a recorded judge parameter that is not the one the
manifest copy and the policy's ceilings give, and a figure edited in a signed row, are
differences (exit 1)."""

from __future__ import annotations

import json

from promote_kit import Kit
from sqlalchemy import create_engine, select
from test_canary_flow import _canary_under_two_streams, canary_block, candidate, ckit
from typer.testing import CliRunner

from releasekit.audit.replay import replay
from releasekit.cli import app
from releasekit.rollout.progressive import promote_progressive
from releasekit.stores.ledger import Event, EventType, Ledger, events_table, open_ledger

__all__ = ["ckit"]


def test_a_canary_step_replays_the_same_and_tampering_differs(ckit: Kit) -> None:
    old = ckit.build("demo-bf16")
    assert promote_progressive(ckit.settings, old, env="staging", reason="base").ok
    steps = (
        "      - {weight: 30, min_duration_s: 1, min_requests: 4, max_duration_s: 60}\n"
        "      - {weight: 100}\n"
    )
    checks = (
        "      - {metric: ttft_p95_s, tolerance: 0.5, slack: 0.5, min_samples: 10}\n"
        "      - {metric: error_rate, tolerance: 0, slack: 0.02, min_samples: 4}\n"
    )
    new = candidate(ckit, "demo-canary-ok", seqs=16, promotion=canary_block(steps, checks))
    res, _, _ = _canary_under_two_streams(ckit, new, lambda *_: None)
    assert res.status == "promoted", res.canary
    [step] = Ledger(ckit.settings.ledger_url or "").records(types=["canary_step"])
    out = replay(ckit.settings, str(step.seq))
    d = out.decisions[0]
    assert out.same, [c for c in d.checks if c.status != "same"]
    kinds = {c.kind for c in d.checks if c.status == "same"}
    assert {"record", "policy", "evidence", "parameters", "canary"} <= kinds
    assert any(c.name == "step 1 ttft_p95_s" and c.replayed == "pass" for c in d.checks)
    assert CliRunner().invoke(app, ["audit", "replay", "--all"]).exit_code == 0

    # A judge parameter recorded looser than the manifest copy and the ceilings give.
    ev = json.loads(json.dumps(step.evidence))
    ev["judge"]["checks"][0]["tolerance"] = 5.0
    led = open_ledger(ckit.settings)
    forged = led.append(
        Event(
            type=EventType.CANARY_STEP,
            environment="staging",
            from_release=old,
            to_release=new,
            reason="judged under another tolerance",
            evidence=ev,
            live=False,
        )
    )
    led.close()
    bad = replay(ckit.settings, str(forged.seq)).decisions[0]
    assert [c.kind for c in bad.differences] == ["parameters"]
    assert "tolerance 5.0 recorded, 0.5 derived" in bad.differences[0].detail

    # A recorded figure edited in the signed row: the chain catches it.
    engine = create_engine(ckit.settings.ledger_url or "")
    with engine.begin() as conn:
        row = conn.execute(select(events_table).where(events_table.c.seq == step.seq)).one()
        conn.execute(
            events_table.update()
            .where(events_table.c.seq == step.seq)
            .values(evidence=row.evidence.replace('"verdict":"pass"', '"verdict":"breach"', 1))
        )
    engine.dispose()
    res2 = CliRunner().invoke(app, ["audit", "replay", str(step.seq)])
    assert res2.exit_code == 1 and f"ledger record {step.seq}" in res2.output
