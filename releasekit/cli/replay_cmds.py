"""CLI: `releasekit audit replay` recomputes a recorded decision's gate verdicts from its
verified inputs and says, for each, same or different; `releasekit audit page` writes the
auditor's page of one environment."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Annotated

import typer

from releasekit.cli._common import JsonOpt, State, emit_json, err, esc, handle_errors, out

audit_app = typer.Typer(help="Audit recorded decisions.", no_args_is_help=True)

_MARK = {"same": "[green]same[/green]", "different": "[red]DIFFERENT[/red]"}


def register(app: typer.Typer) -> None:
    """Attach the `audit` group to the root app."""
    app.add_typer(audit_app, name="audit")


@audit_app.command("replay")
@handle_errors
def replay_cmd(
    event: Annotated[
        str | None, typer.Argument(help="the decision: a ledger seq or event id")
    ] = None,
    all_: Annotated[bool, typer.Option("--all", help="every recorded decision")] = False,
    explain: Annotated[
        bool,
        typer.Option("--explain", help="one line per verdict, the same ones included"),
    ] = False,
    brief: Annotated[
        bool,
        typer.Option(
            "--brief",
            help="a line only for a decision with a difference, then the total (for logs)",
        ),
    ] = False,
    json_: JsonOpt = False,
) -> None:
    """Recompute every gate, canary, shadow and watch verdict of a recorded decision (a promote,
    gate_failed, canary step or abort, shadow comparison or watch rollback) from its
    verified inputs (the ledger record, the policy at its recorded commit, the evidence
    files by their signed digests) and print same or different for each; exit 1 on any
    difference. "not replayable" (the event does not record enough) is not a difference.
    One line per decision with a tally of its verdicts (with --brief, only a decision with a
    difference); each different one (with --explain, every one, and why it is not
    replayable) on a line below it."""
    from releasekit.audit.replay import ReplayError, replay

    if all_ == (event is not None):
        raise ReplayError("name one decision (a ledger seq or event id), or pass --all")
    res = replay(State.settings(), event, all_=all_)
    if json_:
        emit_json(res)
    else:
        if not res.ledger_ok:
            err.print(
                f"[yellow]the ledger fails verification:[/yellow] {esc(res.ledger_problem)}",
                highlight=False,
            )
        for d in res.decisions:
            if brief and d.same and not explain:
                continue  # counted in the total line
            head = _MARK["same"] if d.same else _MARK["different"]
            rid = (d.release_id or "-")[:12]
            counts = Counter(c.status for c in d.checks)
            tally = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
            out.print(
                f"#{d.seq} {esc(d.type)} {rid} -> {esc(d.environment or '-')}: {head}"
                + (f" [dim]({esc(tally)})[/dim]" if tally else ""),
                highlight=False,
            )
            for c in d.checks:
                if c.status != "different" and not explain:
                    continue  # counted in the tally; --explain lists them
                mark = _MARK.get(c.status, f"[dim]{c.status}[/dim]")
                verdicts = (
                    f" ({esc(c.recorded)} -> {esc(c.replayed)})"
                    if c.recorded and c.replayed and c.recorded != c.replayed
                    else ""
                )
                detail = f": {esc(c.detail)}" if c.detail and c.status != "same" else ""
                out.print(f"  {mark} {esc(c.name)}{verdicts}{detail}", highlight=False)
        n = len(res.decisions)
        if res.same:
            out.print(f"[green]{n} decision(s) replayed: every verdict the same[/green]")
        else:
            err.print(f"[red]{res.differences} difference(s)[/red] in {n} decision(s)")
    if not res.same:
        raise typer.Exit(1)


@audit_app.command("page")
@handle_errors
def page_cmd(
    env: Annotated[str, typer.Option("--env", help="the environment")],
    out_dir: Annotated[
        Path | None,
        typer.Option("--out", help="folder to write into (default .releasekit/reports/audit/)"),
    ] = None,
    json_: JsonOpt = False,
) -> None:
    """Write the auditor's page of ENV: what was live there when, and each decision with
    who made it, its policy revision and digest, its gates and figures, the evidence
    digests its release's register event signed, the approvals and its replay. One
    self-contained HTML file; prints its path. Reads only (the ledger opened read-only)."""
    from releasekit.audit.page import write_page

    page = write_page(State.settings(), env, out_dir=out_dir)
    if json_:
        emit_json(page)
    else:
        out.print(esc(page.path), highlight=False)
