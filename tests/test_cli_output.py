"""What the CLI prints is the text the core wrote: brackets in messages, hints, warnings
and table cells survive rich's markup (a TOML table name, a list, a path in brackets)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from releasekit.cli import app
from releasekit.cli._common import report_error, table
from releasekit.errors import ManifestError, ReleasekitError


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
