"""`releasekit eval`: evaluate a release on its suites and compare it with its baseline."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from releasekit.cli._common import (
    JsonOpt,
    State,
    emit_json,
    err,
    esc,
    handle_errors,
    out,
    progress_reporter,
)
from releasekit.evaluate.compare import Comparison, Verdict
from releasekit.evaluate.release import EvalRun, evaluate_release
from releasekit.evaluate.runner import EvalResult


def _style(verdict: Verdict) -> str:
    """Green for a passing verdict, red for a measured regression, yellow for no verdict."""
    if verdict.passed:
        return "green"
    return "red" if verdict in (Verdict.INFERIOR, Verdict.ERROR_REGRESSION) else "yellow"


def register(app: typer.Typer) -> None:
    """Add the `eval` command to the root app."""
    app.command("eval")(eval_)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _pts(x: float | None) -> str:
    return "-" if x is None else f"±{100 * x:.1f} pts"


def results_table(result: EvalResult) -> Table:
    """One row per suite: counts, pass rate and run-to-run noise."""
    t = Table(title=f"eval: {result.name}", title_justify="left")
    for col in ("suite", "kind", "n", "pass", "fail", "error", "pass rate", "noise flips / spread"):
        t.add_column(col)
    for name, s in result.suites.items():
        noise = result.noise.suites.get(name) if result.noise else None
        t.add_row(
            name,
            s.kind,
            str(s.n),
            str(s.passed),
            str(s.failed),
            str(s.errors),
            _pct(s.pass_rate),
            "-" if noise is None else f"{_pct(noise.flip_rate)} / {_pts(noise.spread)}",
        )
    return t


def comparison_table(c: Comparison) -> Table:
    """One row per suite: pass rates, delta with CI, McNemar p, flips and the verdict."""
    t = Table(
        title=f"vs baseline {c.baseline_name} ({(c.baseline_release_id or '?')[:12]})",
        title_justify="left",
    )
    cols = (
        "suite",
        "baseline",
        "candidate",
        "delta [CI], pts",
        "McNemar p",
        "flips -/+",
        "verdict",
    )
    for col in cols:
        t.add_column(col)
    for name, s in c.suites.items():
        ci = "-"
        if s.delta is not None and s.ci_low is not None and s.ci_high is not None:
            ci = f"{100 * s.delta:+.1f} [{100 * s.ci_low:+.1f}, {100 * s.ci_high:+.1f}]"
        style = _style(s.verdict)
        t.add_row(
            name,
            _pct(s.baseline_pass_rate),
            _pct(s.candidate_pass_rate),
            ci,
            "-" if s.mcnemar_p is None else f"{s.mcnemar_p:.3g}",
            f"{len(s.flipped_to_fail)}/{len(s.flipped_to_pass)}",
            f"[{style}]{s.verdict}[/{style}]",
        )
    return t


def _json(run: EvalRun) -> dict[str, object]:
    """The run without per-item records (they are in items.jsonl and compare.json)."""
    data = run.model_dump(mode="json", exclude={"result": {"items"}})
    if data.get("comparison"):
        for s in data["comparison"]["suites"].values():
            s.pop("flips", None)
    return data


@handle_errors
def eval_(
    manifest: Annotated[Path, typer.Argument(help="manifest of the release", show_default=False)],
    url: Annotated[
        str | None,
        typer.Option("--url", help="evaluate the release already served at URL (no /v1) instead"),
    ] = None,
    baseline: Annotated[
        Path | None,
        typer.Option(
            "--baseline",
            help="baseline manifest, or a folder with its eval results "
            "(default: the manifest's eval.baseline)",
        ),
    ] = None,
    out_dir: Annotated[
        Path | None,
        typer.Option(
            "--out",
            help="folder for eval.json and items.jsonl, report in OUT/report "
            "(default: results/<release_id>/eval and .../report)",
        ),
    ] = None,
    noise_runs: Annotated[
        int, typer.Option("--noise-runs", min=1, help="evaluate this many times to measure noise")
    ] = 2,
    concurrency: Annotated[
        int, typer.Option("--concurrency", min=1, help="requests in flight")
    ] = 16,
    json_: JsonOpt = False,
) -> None:
    """Evaluate a release on its suites (serving it unless --url is given); compare it with
    its baseline and write the report."""
    console: Console = err if json_ else out
    with progress_reporter(console) as bars:
        run = evaluate_release(
            manifest,
            settings=State.settings(),
            url=url,
            baseline=baseline,
            out_dir=out_dir,
            noise_runs=noise_runs,
            concurrency=concurrency,
            progress=bars,
        )
    if json_:
        emit_json(_json(run))
        return
    out.print(results_table(run.result))
    out.print(f"wrote {esc(run.eval_dir)}/eval.json, items.jsonl")
    if run.comparison is None:
        out.print(f"[dim]no comparison: {esc(run.baseline_note)}[/dim]")
        return
    c = run.comparison
    out.print(comparison_table(c))
    for w in c.warnings:
        out.print(f"[yellow]warning:[/yellow] {esc(w)}", highlight=False)
    style = _style(c.verdict)
    out.print(f"verdict: [bold {style}]{esc(c.verdict)}[/bold {style}]")
    out.print(f"report: {esc(run.report_dir)}/report.md, report.html, compare.json")
