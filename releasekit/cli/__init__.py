"""The `releasekit` command line: a thin typer front over the core modules."""

from __future__ import annotations

from typing import Annotated

import typer

from releasekit import __version__
from releasekit.cli import manifest_cmds
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


manifest_cmds.register(app)

for _mod in ("build_cmds", "bench_cmds", "eval_cmds", "audit_cmds"):
    # Command groups that later modules add; each exposes register(app).
    try:
        import importlib

        importlib.import_module(f"releasekit.cli.{_mod}").register(app)
    except ModuleNotFoundError as _exc:
        if _exc.name != f"releasekit.cli.{_mod}":
            raise


def main() -> None:
    """Console-script entry point."""
    app()
