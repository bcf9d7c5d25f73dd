"""`assign` is closed for deployed environments whatever config the command is given (the
committed revision and the ledger decide), and an `assign` record never counts as "was
live": not for a redeploy, `rollback --to`, or `requires`. A failed deploy names the release
that really keeps serving."""

from __future__ import annotations

import pytest
from promote_kit import Kit, kit
from typer.testing import CliRunner

from releasekit.cli import app
from releasekit.config import load_settings
from releasekit.promote.deploy import DeployOutcome, deploy_status
from releasekit.promote.promote import promote
from releasekit.promote.rollback import RollbackError, rollback
from releasekit.releases.assign import DeployedEnvironmentError, assign
from releasekit.stores.anchor import resolve_commit
from releasekit.stores.ledger import Event, EventType, Ledger, open_ledger

__all__ = ["kit"]


def _ledger(k: Kit) -> Ledger:
    return Ledger(k.settings.ledger_url or "")


def _damaged(k: Kit) -> str:
    """A release that answers wrongly (it fails any smoke suite) with passing evidence."""
    k.variant(
        "demo-bf16",
        "demo-damaged",
        {'VLLM_CPU_KVCACHE_SPACE: "1"': 'VLLM_CPU_KVCACHE_SPACE: "1"\n    FAKE_ANSWER: "no idea"'},
    )
    return k.build("demo-damaged")


def test_assign_to_a_committed_environment_is_refused_even_with_an_empty_config(
    kit: Kit, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`RELEASEKIT_CONFIG=<empty file> releasekit assign ID --env production`: the command's
    settings name no environment, but releasekit.toml as committed deploys production, so
    the assign is refused in one line naming the commit, and nothing is recorded."""
    rid = kit.build("demo-bf16")
    empty = kit.root / "empty.toml"
    empty.write_text("")
    monkeypatch.setenv("RELEASEKIT_CONFIG", str(empty))
    bare = load_settings(root=kit.root)
    assert bare.environments == {}
    before = _ledger(kit).count()
    commit = resolve_commit(kit.root, "HEAD") or ""
    with pytest.raises(DeployedEnvironmentError, match=f"releasekit.toml at {commit[:12]}"):
        assign(bare, rid, env="production", reason="x")
    cli = CliRunner().invoke(
        app, ["assign", rid[:12], "--env", "production", "-r", "x"], env={"COLUMNS": "300"}
    )
    assert cli.exit_code == 1, cli.output
    assert "production is deployed by releasekit" in cli.output
    assert "Traceback" not in cli.output
    assert _ledger(kit).count() == before
    assert _ledger(kit).live_at("production") is None


def test_assign_to_an_environment_the_ledger_shows_deployed_is_refused(kit: Kit) -> None:
    """An environment no config names any more, but where the ledger shows releasekit
    deployed (here: a `down` record), is closed to `assign` too."""
    rid = kit.build("demo-bf16")
    led = open_ledger(kit.settings)
    rec = led.append(Event(type=EventType.DOWN, environment="canary-pool", reason="t"))
    before = led.count()
    with pytest.raises(DeployedEnvironmentError, match=f"a down event there, record {rec.seq}"):
        assign(kit.settings, rid, env="canary-pool", reason="x")
    assert led.count() == before


def test_an_assign_record_in_a_deployed_environment_counts_for_nothing(kit: Kit) -> None:
    """A ledger holding `assign` records of a damaged release in staging and production
    (signed before assign was closed): what is live stays the promoted release, so
    deploy-status agrees; promoting the damaged release to production is not a gateless
    redeploy but is judged (and blocked: never live in staging, the assign does not count);
    `rollback --to` refuses it; promoting it to staging runs its smoke suite, which fails,
    and the message names the release that really keeps serving."""
    good = kit.build("demo-bf16")
    assert promote(kit.settings, good, env="staging").status == "promoted"
    assert promote(kit.settings, good, env="production").status == "promoted"
    bad = _damaged(kit)
    led = open_ledger(kit.settings)
    for env in ("staging", "production"):
        led.append(
            Event(
                type=EventType.ASSIGN,
                environment=env,
                from_release=good,
                to_release=bad,
                reason="record only",
                live=True,
            )
        )
    for env in ("staging", "production"):
        rec = led.live_at(env)
        assert rec is not None and rec.to_release == good and rec.type == "promote"
    [prod] = deploy_status(kit.settings, env="production", ledger=led)
    assert prod.ledger_release_id == good and prod.agrees

    res = promote(kit.settings, bad, env="production", reason="try")
    assert res.status == "blocked", res.status
    assert res.live_release_id == good
    assert res.report is not None
    assert [g.name for g in res.report.failed] == ["live in staging first"]

    with pytest.raises(RollbackError, match="was never live in production"):
        rollback(kit.settings, "production", to=bad, reason="go back to it")

    cli = CliRunner().invoke(
        app, ["promote", bad[:12], "--to", "staging", "-r", "try"], env={"COLUMNS": "300"}
    )
    assert cli.exit_code == 1, cli.output
    assert "deploy failed" in cli.output
    assert f"{good[:12]} keeps serving" in cli.output
    assert f"{bad[:12]} keeps serving" not in cli.output
    [stg] = deploy_status(kit.settings, env="staging", ledger=led)
    assert stg.ledger_release_id == good and stg.agrees and stg.serving


def test_a_failed_deploy_says_what_serves() -> None:
    """The words after a failure come from what the gateway routes, not the record."""
    out = DeployOutcome(environment="staging", release_id="b" * 64, ok=False)
    out.previous_release_id = "a" * 64
    assert out.still_serving == f"{'a' * 12} keeps serving"  # not read: the record
    out.serving = []
    assert out.still_serving == "nothing serves staging"
    out.serving = ["c" * 64]
    assert out.still_serving == f"{'c' * 12} keeps serving"
