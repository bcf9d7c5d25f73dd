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
