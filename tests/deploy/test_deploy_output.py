"""What `promote` and `deploy-status` print when piped: environments only (a gateway's
config file is not an environment), nothing wider than 80 columns, no word folded, one
line a gate, and the rules and the quality rule only when asked for (`--explain`)."""

from __future__ import annotations

import json

import typer
from promote_kit import Kit, kit
from typer.testing import CliRunner

from releasekit.cli import deploy_cmds
from releasekit.deploy.state import deploy_dir, list_envs

__all__ = ["kit"]


def _app() -> typer.Typer:
    app = typer.Typer()
    deploy_cmds.register(app)
    return app


def test_deploy_status_piped_lists_environments_only_within_80_columns(kit: Kit) -> None:
    """After a promotion the deploy folder holds staging.json and staging-gateway.json (the
    gateway's config): deploy-status names staging and production, never
    staging-gateway, and every line fits 80 columns with the gateway URL whole."""
    runner = CliRunner()
    kit.build("demo-bf16")
    r = runner.invoke(_app(), ["promote", "manifests/demo-bf16.yaml", "--to", "staging"])
    assert r.exit_code == 0, r.output
    assert (deploy_dir(kit.settings.state_dir) / "staging-gateway.json").is_file()
    assert list_envs(kit.settings.state_dir) == ["staging"]

    r = runner.invoke(_app(), ["deploy-status", "--json"])
    assert r.exit_code == 0, r.output
    assert [e["environment"] for e in json.loads(r.stdout)] == ["production", "staging"]

    r = runner.invoke(_app(), ["deploy-status"])
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines and max(len(line) for line in lines) <= 80, r.stdout
    assert "gateway" not in {line.strip() for line in lines}
    assert not any(line.strip().startswith("staging-gateway") for line in lines)
    # Piped and too wide for a table: one line an environment, its name first.
    assert any(line.startswith("staging: up at ") for line in lines), r.stdout
    assert any(line.startswith("production: ") for line in lines), r.stdout
    url = f"http://127.0.0.1:{kit.ports['staging']}"
    assert any(url in line for line in lines), r.stdout


def test_promote_prints_the_quality_rule_only_with_explain(kit: Kit) -> None:
    """Against a live release the gate report has a quality rule: a dry run prints it only
    with --explain, and the piped gate report fits 80 columns either way."""
    runner = CliRunner()
    kit.build("demo-bf16")
    r = runner.invoke(_app(), ["promote", "manifests/demo-bf16.yaml", "--to", "staging"])
    assert r.exit_code == 0, r.output
    kit.variant("demo-bf16", "demo-v2", {"max-num-seqs: 32": "max-num-seqs: 16"})
    kit.build("demo-v2", baseline="demo-bf16")
    args = ["promote", "manifests/demo-v2.yaml", "--to", "staging", "--dry-run"]
    plain = runner.invoke(_app(), args)
    explained = runner.invoke(_app(), [*args, "--explain"])
    for res in (plain, explained):
        assert res.exit_code == 0, res.output
        assert "would pass" in res.stdout
        assert max(len(line) for line in res.stdout.splitlines()) <= 80, res.stdout
    assert "quality rule" not in plain.stdout
    assert "quality rule: A suite is non-inferior" in explained.stdout
    # One line a gate piped; each gate's kind, rule and detail only with --explain.
    lines = plain.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("gate "))
    assert lines[head].split()[:2] == ["gate", "result"]
    end = next(i for i, line in enumerate(lines) if line.startswith("dry run: "))
    rows = lines[head + 1 : end]
    assert rows and not any(line.startswith(" ") for line in rows), plain.stdout
    assert any(line.startswith("suite ") and " pass " in line for line in rows), plain.stdout
    assert "  rule: " not in plain.stdout and "  kind: " not in plain.stdout
    assert "  rule: " in explained.stdout and "  kind: quality" in explained.stdout
    # --brief: every gate passed, so one line says so instead of the table.
    brief = runner.invoke(_app(), [*args, "--brief"])
    assert brief.exit_code == 0, brief.output
    [said] = [line for line in brief.stdout.splitlines() if line.startswith("gates: ")]
    assert " -> staging (against demo-bf16 " in said
    assert said.split("): all ", 1)[1].split(" passed", 1)[0].isdigit(), said
    assert not any(line.startswith("gate ") for line in brief.stdout.splitlines())


def test_promote_brief_keeps_the_rows_of_the_gates_that_failed(kit: Kit) -> None:
    """`--brief` with a failed gate: the table holds that gate's row only, a line counts
    the gates that passed, and the why line still names the figure."""
    runner = CliRunner()
    kit.build("demo-bf16")
    r = runner.invoke(_app(), ["promote", "manifests/demo-bf16.yaml", "--to", "staging"])
    assert r.exit_code == 0, r.output
    kit.variant("demo-bf16", "demo-v2", {"max-num-seqs: 32": "max-num-seqs: 16"})
    kit.build("demo-v2", baseline="demo-bf16", fail={"core": 40})
    args = ["promote", "manifests/demo-v2.yaml", "--to", "staging", "--dry-run"]
    full = runner.invoke(_app(), args)
    brief = runner.invoke(_app(), [*args, "--brief"])
    assert full.exit_code == brief.exit_code == 1, brief.output
    assert "would be BLOCKED" in brief.stdout

    def rows(out: str) -> list[str]:
        lines = out.splitlines()
        head = next(i for i, line in enumerate(lines) if line.startswith("gate "))
        return [ln for ln in lines[head + 1 :] if ln and not ln.startswith((" ", "dry run"))]

    failed = [ln for ln in rows(full.stdout) if " FAIL " in ln]
    assert failed and any(ln.startswith("suite core ") for ln in failed), full.stdout
    kept = [ln for ln in rows(brief.stdout) if not ln.startswith("each gate")]
    assert [ln.split() for ln in kept] == [ln.split() for ln in failed], brief.stdout
    passed = sum(1 for ln in rows(full.stdout) if " pass " in ln)
    [count] = [ln for ln in brief.stdout.splitlines() if ln.startswith("  and ")]
    assert int(count.split()[1]) >= passed, brief.stdout
    assert "  why suite core: " in brief.stdout
