"""The `releasekit` command line: a thin typer front over the core modules."""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer
from typer import rich_utils

from releasekit import __version__
from releasekit.cli import (
    audit_cmds,
    bench_cmds,
    build_cmds,
    capacity_cmds,
    deploy_cmds,
    diagnose_cmds,
    doctor_cmds,
    eval_cmds,
    export_cmds,
    ladder_cmds,
    manifest_cmds,
    replay_cmds,
    rollout_cmds,
    watch_cmds,
)
from releasekit.cli._common import State

app = typer.Typer(
    name="releasekit",
    help="Lock, build, register, promote, watch and audit self-hosted LLM releases.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"releasekit {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    traceback: Annotated[
        bool, typer.Option("--traceback", help="show tracebacks on errors")
    ] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="print the version")
    ] = False,
) -> None:
    State.reset()
    State.traceback = traceback


for _group in (
    manifest_cmds,
    build_cmds,
    ladder_cmds,
    bench_cmds,
    eval_cmds,
    audit_cmds,
    deploy_cmds,
    capacity_cmds,
    diagnose_cmds,
    watch_cmds,
    doctor_cmds,
    rollout_cmds,
    export_cmds,
    replay_cmds,
):
    _group.register(app)


HELP_WIDTH = 120
"""The width `--help` is laid out at when neither stdout nor stderr is a terminal and no
width is given (COLUMNS, TERMINAL_WIDTH): rich's 80 folds most descriptions mid-sentence."""


def _wide_help_when_piped() -> None:
    """Lay help out at HELP_WIDTH in logs, CI and files; a terminal keeps its own width."""
    if sys.stdout.isatty() or sys.stderr.isatty():
        return
    if os.environ.get("COLUMNS") or os.environ.get("TERMINAL_WIDTH"):
        return
    rich_utils.MAX_WIDTH = HELP_WIDTH


def main() -> None:
    """Console-script entry point."""
    _wide_help_when_piped()
    app()
