"""CLI: `releasekit quantise ladder`: walk a base manifest's quantisation recipes, compare each
with the unquantised release, and recommend the cheapest that loses nothing critical."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from releasekit._support.procs import sigterm_as_interrupt
from releasekit.build import pipeline
from releasekit.cli._common import (
    JsonOpt,
    State,
    emit_json,
    handle_errors,
    out,
    progress_reporter,
    short_table,
)
from releasekit.ladder import report
from releasekit.ladder.run import run_ladder

quantise_app = typer.Typer(
    help="Quantisation: walk a ladder of recipes and keep the cheapest that loses nothing.",
    no_args_is_help=True,
)


def register(app: typer.Typer) -> None:
    """Attach the `quantise` group to the root app."""
    app.add_typer(quantise_app, name="quantise")


@quantise_app.command("ladder")
@handle_errors
def ladder(
    manifest: Annotated[
        Path, typer.Argument(help="the base manifest (unquantised)", show_default=False)
    ],
    recipes: Annotated[
        Path,
        typer.Option(
            "--recipes",
            help="the ladder file: the recipes to try, most faithful first",
            show_default=False,
        ),
    ],
    out_dir: Annotated[
        Path | None,
        typer.Option(
            "--out",
            help="folder for ladder.json, .html and .png "
            "(default: .releasekit/ladder/ plus the ladder file's stem)",
        ),
    ] = None,
    brief: Annotated[
        bool,
        typer.Option(
            "--brief",
            help="the cost table, the suites that did not hold and the outcome (the HTML "
            "report keeps every suite and tag)",
        ),
    ] = False,
    json_: JsonOpt = False,
) -> None:
    """Build each recipe as a release (cached like any build), compare it item by item with
    the unquantised base on every suite, and print one table: weights, memory, knee, tokens/s
    and cost per 1,000 good answers beside each suite's delta and verdict. The ladder stops
    at the first recipe inferior on a critical suite (`critical: true` in the manifest's
    suites; every suite when none is marked) and recommends the cheapest rung above it.
    Every row is a registered release, promotable as it stands."""
    settings = State.settings()
    # Short steps (a cached rung's check) are not written: the builds' own stages are.
    with sigterm_as_interrupt(), progress_reporter(enabled=not json_) as progress:
        result = run_ladder(settings, manifest, recipes, builder=pipeline.build, progress=progress)
    folder = out_dir or settings.state_dir / "ladder" / recipes.stem
    paths = report.write_outputs(result, folder)
    if json_:
        emit_json(result)
        return
    cols, rows = report.cost_table(result)
    short_table(cols, rows, cell_styles={"inferior": "red"})
    out.print("")
    cols, rows = report.quality_table(result)
    if brief:
        at = cols.index("verdict")
        rows = [r for r in rows if str(r[at]) != "ok"]
    if rows:
        short_table(cols, rows)
    tags = [] if brief else report.tag_rows(result, critical_only=True)
    if tags:
        out.print("")
        short_table(report.TAG_COLUMNS, tags)
    out.print("")
    for line in report.note_lines(result):
        out.print(line, markup=False, highlight=False)
    out.print(report.outcome_line(result), markup=False, highlight=False)
    pick = result.recommended or "none"
    out.print(f"recommended: {pick}. {result.recommendation}", markup=False, highlight=False)
    out.print(f"report: {paths['html']}", markup=False, highlight=False)
