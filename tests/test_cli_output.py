"""What the CLI prints is the text the core wrote: brackets in messages, hints, warnings
and table cells survive rich's markup (a TOML table name, a list, a path in brackets). Gate
reports are one line a gate (the long form behind --explain), and piped help is wide."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from releasekit.cli import HELP_WIDTH, app
from releasekit.cli._common import report_error, table
from releasekit.cli.deploy_cmds import _print_gates
from releasekit.errors import ManifestError, ReleasekitError
from releasekit.promote.gates import GateReport, GateResult


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty project: a releasekit.toml with one environment, nothing built."""
    for key in list(os.environ):
        if key.startswith("RELEASEKIT_"):
            monkeypatch.delenv(key)
    (tmp_path / "releasekit.toml").write_text(
        '[environments.staging]\ntarget = "local"\nhost = "127.0.0.1"\nport = 25990\n'
    )
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_promote_to_an_unknown_environment_keeps_the_bracketed_hint(project: Path) -> None:
    """`promote --to nowhere` prints the hint with its TOML table name, as the code says."""
    r = CliRunner().invoke(app, ["promote", "manifests/demo-bf16.yaml", "--to", "nowhere"])
    assert r.exit_code == 1
    assert "environment 'nowhere' is not configured" in r.output
    assert "hint: add [environments.NAME] (port, target, policy) to releasekit.toml" in r.output


def test_error_message_remedy_and_manifest_problems_print_as_written(
    capsys: pytest.CaptureFixture[str],
) -> None:
    report_error(
        ReleasekitError("suites [core, edge] differ; [bold]x[/bold] stays", remedy="see [a.b]")
    )
    report_error(ManifestError(Path("[m].yaml"), ["serving.args[max-num-seqs]: not an int"]))
    printed = capsys.readouterr().err
    assert "error: suites [core, edge] differ; [bold]x[/bold] stays" in printed
    assert "hint: see [a.b]" in printed
    assert "error: [m].yaml: serving.args[max-num-seqs]: not an int" in printed


def test_table_cells_and_title_are_plain_text(capsys: pytest.CaptureFixture[str]) -> None:
    table("[environments.staging]", ["field", "value"], [["[red]reason[/red]", "[x, y]"]])
    printed = capsys.readouterr().out
    assert "[environments.staging]" in printed
    assert "[red]reason[/red]" in printed and "[x, y]" in printed


def test_a_wide_table_piped_becomes_records_within_the_width(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Piped, a table wider than 80 columns prints one record per row: the first cell as
    heading, `column: value` lines wrapped at 80, empty and "-" cells left out, and a
    64-character release id kept whole on its line."""
    rid = "45846ee7c57a2303c741932b293f54e65d762c28c3556cda43d8f69df1b6c41b"
    cols = ["environment", "gateway", "state", "release", "servers", "note"]
    table("deployments", cols, [["production", "http://127.0.0.1:8200", "up", rid, "-", "x " * 60]])
    lines = capsys.readouterr().out.splitlines()
    assert lines[:3] == ["deployments", "production", "  gateway: http://127.0.0.1:8200"]
    assert "  release: " + rid in lines
    assert not any(line.strip().startswith("servers") for line in lines)
    assert max(len(line) for line in lines) <= 80


def test_a_narrow_table_piped_stays_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    table(None, ["field", "value"], [["units", "12"]])
    printed = capsys.readouterr().out
    assert "units" in printed and "│" in printed


def _report() -> GateReport:
    """A blocked report: a policy gate, three suites (one failed, one advisory), a perf gate
    with candidate and live figures, and a rule that two gates share."""
    shared = "eval results must exist, be made for this release, on its locked inputs"
    return GateReport(
        environment="staging",
        candidate_release_id="c" * 64,
        candidate_name="demo-damaged",
        live_release_id="b" * 64,
        live_name="demo-bf16",
        mode="relative",
        passed=False,
        comparison_rule="A suite is non-inferior when the interval's lower bound ...",
        gates=[
            GateResult(
                name="not marked bad",
                kind="policy",
                passed=True,
                rule="a release rolled back from is refused unless forced (`--force policy`)",
                detail="ok",
            ),
            GateResult(name="eval evidence (candidate)", kind="evidence", passed=True, rule=shared),
            GateResult(name="eval evidence (live)", kind="evidence", passed=True, rule=shared),
            GateResult(
                name="suite core",
                kind="quality",
                passed=False,
                rule="non-inferior: lower bound of the 95% interval above -0.05",
                candidate=0.08523,
                live=0.964,
                limit=-0.05,
                detail="inferior: delta -0.879, 95% CI [-0.903, -0.846], 464 pass->fail, "
                "0 fail->pass (McNemar p=4.2e-140); n=528; the upper bound is below -5 pts",
            ),
            GateResult(
                name="SLOs hold at the live knee (load 64)",
                kind="perf",
                passed=False,
                advisory=True,
                rule="at the live release's knee load the candidate holds",
                candidate=0.5,
                live=1.0,
                limit=0.9,
                detail="attainment 50%, held in 1 of 3 runs (advisory here)",
            ),
            GateResult(
                name="SLOs hold at the knee (candidate)",
                kind="perf",
                passed=True,
                rule="some load point meets the profile's SLOs",
                candidate=64,
            ),
        ],
    )


def _gate_lines(explain: bool, capsys: pytest.CaptureFixture[str]) -> list[str]:
    _print_gates(_report(), explain=explain)
    return capsys.readouterr().out.splitlines()


def test_piped_gate_report_is_one_line_per_gate_and_why_for_the_failed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Piped at 80 columns: a title, a header, then one line per gate that holds a figure or
    failed (gate, result, candidate vs live, limit) and one line counting the passing
    approval, policy and evidence checks; one `why` for each failed gate with its first
    clause; no rule at all and a pointer to --explain."""
    lines = _gate_lines(False, capsys)
    folded = [g for g in _report().gates if g.kind in ("policy", "evidence") and g.passed]
    gates = [g for g in _report().gates if g not in folded]
    assert lines[0].startswith("gates: demo-damaged cccccccccccc -> staging (against demo-bf16")
    assert lines[1].split() == ["gate", "result", "candidate", "vs", "live", "limit"]
    summary = ["policy", "and", "evidence", "checks", f"({len(folded)})", "pass"]
    assert lines[2].split()[:6] == summary
    lines = [lines[0], lines[1], *lines[3:]]
    rows = lines[2 : 2 + len(gates)]
    assert [r.startswith(g.name) for r, g in zip(rows, gates, strict=True)] == [True] * len(gates)
    by_name = {g.name: r for g, r in zip(gates, rows, strict=True)}
    assert by_name["suite core"].split()[2:] == ["FAIL", "0.08523", "vs", "0.964", "-0.05"]
    assert "fail (advisory)  0.5 vs 1" in by_name["SLOs hold at the live knee (load 64)"]
    assert by_name["SLOs hold at the knee (candidate)"].split()[-2:] == ["64", "-"]
    rest = "\n".join(lines[2 + len(gates) :])
    assert "why suite core: inferior: delta -0.879, 95% CI [-0.903, -0.846]" in rest
    assert "n=528" not in rest  # the first clause only
    assert "why SLOs hold at the live knee (load 64): attainment 50%" in rest
    assert "advisory here:" in rest and "--explain" in rest
    printed = "\n".join(lines)
    assert "rule" not in printed.replace("rule and detail", "")
    assert "refused unless forced" not in printed
    assert max(len(line) for line in lines) <= 80
    assert all(line == line.rstrip() for line in lines[1 : 2 + len(gates)])  # no padding


def test_explain_adds_the_long_form_with_each_rule_and_the_quality_rule(
    capsys: pytest.CaptureFixture[str],
) -> None:
    lines = _gate_lines(True, capsys)
    printed = "\n".join(lines)
    assert "gate details" in lines
    assert "  rule: a release rolled back from is refused unless forced (`--force policy`)" in lines
    assert "  kind: quality" in lines and "n=528" in printed
    assert "quality rule: A suite is non-inferior" in printed
    assert max(len(line) for line in lines) <= 80


def test_piped_help_is_laid_out_wide_not_folded_mid_sentence() -> None:
    """`releasekit promote --help` into a pipe, with no COLUMNS: a short option description
    stays on one line (at 80 columns it folds after "skipping the")."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "TERMINAL_WIDTH")}
    script = Path(sys.executable).with_name("releasekit")
    done = subprocess.run(
        [str(script), "promote", "--help"], capture_output=True, text=True, env=env, check=True
    )
    assert "one switch, skipping the manifest's canary steps" in done.stdout
    assert "gates against the live release, then a blue/green deploy through" in done.stdout
    assert max(len(line) for line in done.stdout.splitlines()) <= HELP_WIDTH


def test_a_wide_table_with_a_row_line_is_one_wrapped_line_a_row_piped(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`history` piped: one event a line (wrapped under a hanging indent), not a record of
    seven `column: value` lines."""
    from releasekit.cli.audit_cmds import _event_line

    cols = ["seq", "time", "type", "env", "from", "to", "by", "reason"]
    reason = "a bad prompt edit; failed: suite core, suite facts " * 2
    when = "2026-12-06 19:10:42"
    rows = [["13", when, "gate_failed", "staging", "9aabe699998b", "00fbdf5a96a7", "demo", reason]]
    table("history (1 events)", cols, rows, row_line=_event_line)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "history (1 events)"
    assert lines[1].startswith("#13 2026-12-06 19:10:42 gate_failed staging 9aabe699998b ->")
    assert all(line.startswith("    ") for line in lines[2:]) and len(lines) <= 5
    assert max(len(line) for line in lines) <= 80


def test_a_failed_perf_gate_says_its_rule_not_the_runs_spread() -> None:
    """A perf comparison whose detail is only the runs' spread explains its failure by the
    rule the figure had to meet."""
    from releasekit.promote.gates import GateResult
    from releasekit.promote.report import short_reason

    g = GateResult(
        name="ttft_p95_s at the knee",
        kind="perf",
        passed=False,
        candidate=9.05,
        live=0.42,
        limit=0.62,
        rule="ttft_p95_s at the live knee load <= live x (1 + 0.50)",
        detail="run-to-run spread: candidate 0.35, live 0.37; at most 0.45",
    )
    assert short_reason(g) == "ttft_p95_s at the live knee load <= live x (1 + 0.50)"


def test_a_canary_step_with_an_unconfirmed_breach_says_so_once(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A step whose first breach the disjoint window did not repeat names the metric and
    the span it breached in, as a start-up transient, under the steps' table."""
    from releasekit.cli.rollout_cmds import print_canary

    check = {
        "metric": "ttft_p95_s",
        "verdict": "breach",
        "canary": 0.48,
        "stable": 0.04,
        "limit": 0.1,
        "required": True,
    }
    step = {
        "index": 0,
        "weight": 10,
        "status": "passed",
        "started_at": 0.0,
        "ended_at": 60.0,
        "canary_requests": 40,
        "stable_requests": 360,
        "judgement": None,
        "unconfirmed": {"window_start": 100.0, "window_end": 124.0, "checks": [check]},
    }
    print_canary({"release_id": "a" * 64, "outcome": "promoted", "steps": [step]})
    out = capsys.readouterr().out
    assert out.count("start-up transient") == 1
    assert "step 1: ttft_p95_s breached in its first 24 s" in out
