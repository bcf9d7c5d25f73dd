"""CLI: promote a release behind gates, roll an environment back, stop it, and show what runs
where (deploy-status)."""

from __future__ import annotations

import textwrap
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated

import typer

from releasekit.cli._common import (
    JsonOpt,
    State,
    emit_json,
    err,
    esc,
    handle_errors,
    out,
    progress_reporter,
    short_table,
    table,
)
from releasekit.config.lanes import is_lane

if TYPE_CHECKING:
    from releasekit.promote.gates import GateReport


def register(app: typer.Typer) -> None:
    """Attach this module's commands to the root app."""
    app.command("promote")(promote_cmd)
    app.command("rollback")(rollback_cmd)
    app.command("down")(down_cmd)
    app.command("deploy-status")(deploy_status_cmd)


def _short(rid: str | None) -> str:
    return rid[:12] if rid else "-"


RESULT_STYLES = {"pass": "green", "FAIL": "bold red", "fail (advisory)": "yellow"}
"""How a gate's result is drawn on a terminal."""


def _gates_title(report: GateReport) -> str:
    """`gates: CANDIDATE ID -> ENV (against LIVE ID)`, the first line of a gate report."""
    against = (
        f"{report.live_name} {_short(report.live_release_id)}"
        if report.live_release_id
        else "nothing live (absolute checks)"
    )
    return (
        f"gates: {report.candidate_name} {_short(report.candidate_release_id)} -> "
        f"{report.environment} (against {against})"
    )


def _print_gates(report: object, *, explain: bool, brief: bool = False) -> None:
    """The gate report: a title line, then one line a gate (gate, result, the figure that
    decided, its limit), one line of why for each failed gate, and which failures are
    advisory here. `brief` keeps the table's rows of the gates that did not pass, and says
    how many others passed. `explain` adds the long form: each gate's rule and detail, and
    the quality rule in full."""
    from releasekit.promote.gates import PERF_BY_CANARY_NOTE, GateReport
    from releasekit.promote.report import (
        COLUMNS,
        COMPACT_COLUMNS,
        compact_rows,
        failure_reasons,
        gate_rows,
    )

    if not isinstance(report, GateReport):
        return
    out.print(
        _gates_title(report),
        markup=False,
        highlight=False,
    )
    rows = compact_rows(report, fold=not explain)
    passed = 0
    if brief and not explain:
        rows = [r for r in rows if r[1] != "pass"]
        passed = sum(1 for g in report.gates if g.passed)
    short_table(COMPACT_COLUMNS, rows, cell_styles=RESULT_STYLES)
    if passed:
        out.print(f"  and {passed} other gate(s) passed", markup=False, highlight=False)
    for name, why in failure_reasons(report):
        for line in textwrap.wrap(
            f"{name}: {why}",
            width=out.width,
            initial_indent="  why ",
            subsequent_indent="      ",
            break_long_words=False,
            break_on_hyphens=False,
        ):
            out.print(line, markup=False, highlight=False, soft_wrap=True)
    if report.advisory_failed:
        names = ", ".join(g.name for g in report.advisory_failed)
        why = (
            "this environment lets the canary steps judge performance on live traffic "
            "(perf_by_canary)"
            if all(g.detail.endswith(f"({PERF_BY_CANARY_NOTE})") for g in report.advisory_failed)
            else "this environment's gates do not block (gates_required = false)"
        )
        out.print(
            f"[yellow]advisory here:[/yellow] {esc(names)} failed; {why}",
            highlight=False,
            soft_wrap=False,
        )
    if explain:
        table("gate details", COLUMNS, gate_rows(report))
        if report.comparison_rule:
            out.print(
                f"[dim]quality rule: {esc(report.comparison_rule)}[/dim]",
                highlight=False,
                soft_wrap=False,  # a paragraph: wrapped at the width, on a terminal or piped
            )
    elif (not report.passed or report.advisory_failed) and not brief:
        out.print(
            "[dim]each gate's rule and detail: --explain (the gate report holds them too)[/dim]",
            highlight=False,
        )


def _print_gates_passed(report: object, html: str | None) -> None:
    """One line for a gate report whose every gate passed (`promote --brief`)."""
    from releasekit.promote.gates import GateReport

    if not isinstance(report, GateReport):
        return
    out.print(
        f"{_gates_title(report)}: all {len(report.gates)} passed"
        + (f" (report: {html})" if html else ""),
        markup=False,
        highlight=False,
    )


class ForceKind(StrEnum):
    """A kind of gate `--force` may override, named on its own."""

    perf = "perf"
    quality = "quality"
    evidence = "evidence"
    policy = "policy"


@handle_errors
def promote_cmd(
    release: Annotated[str, typer.Argument(help="release id/prefix, name@version or manifest")],
    to: Annotated[
        str,
        typer.Option("--to", help="environment, e.g. staging (ENV:ADAPTER: that adapter's lane)"),
    ],
    explain: Annotated[
        bool,
        typer.Option(
            "--explain",
            help="each gate's kind, rule and detail below the table, the quality rule in full "
            "and what each canary check detects",
        ),
    ] = False,
    reason: Annotated[str, typer.Option("--reason", "-r", help="why (recorded)")] = "",
    brief: Annotated[
        bool,
        typer.Option(
            "--brief",
            help="when every gate passes, one line for them instead of the table; otherwise "
            "the table's rows of the gates that failed (blocking or advisory) and how many "
            "others passed; for logs of many promotions",
        ),
    ] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="print the gate report; change nothing")
    ] = False,
    force: Annotated[
        list[ForceKind] | None,
        typer.Option(
            "--force",
            help="override failed gates of this kind: perf, quality, evidence or policy; "
            "repeat for more than one (needs --reason; recorded as an override)",
        ),
    ] = None,
    no_canary: Annotated[
        bool, typer.Option("--no-canary", help="one switch, skipping the manifest's canary steps")
    ] = False,
    resume: Annotated[
        bool, typer.Option("--resume", help="resume a canary an ended promote left at its step")
    ] = False,
    wait_approval: Annotated[
        float | None,
        typer.Option("--wait-approval", help="seconds to wait for a missing approval"),
    ] = None,
    replicas: Annotated[
        int | None,
        typer.Option(
            "--replicas",
            min=1,
            help="ray target: run this many replicas of the release (e.g. the units "
            "`releasekit capacity --env ENV` prints) instead of the environment's count",
        ),
    ] = None,
    json_: JsonOpt = False,
) -> None:
    """Promote RELEASE to an environment: gates against the live release, then a blue/green
    deploy through the environment's gateway (after the manifest's canary steps, judged live
    against the stable release), then the record (exit 1 if blocked, aborted or failed).
    `--force KIND` carries a failed gate of that kind only: a performance override never
    carries a quality failure, and nothing carries a missing approval."""
    from releasekit.cli.rollout_cmds import print_canary, print_canary_power
    from releasekit.rollout.progressive import promote_progressive

    with progress_reporter(enabled=not json_) as rep:
        res = promote_progressive(
            State.settings(), release, env=to, reason=reason, dry_run=dry_run,
            force=[k.value for k in force or []], progress=rep, no_canary=no_canary,
            resume=resume, approval_wait_s=wait_approval, replicas=replicas,
        )  # fmt: skip
    if json_:
        emit_json(res)
        if not res.ok:
            raise typer.Exit(1)
        return
    if res.report is not None:
        if brief and not explain and res.report.passed and not res.report.advisory_failed:
            _print_gates_passed(res.report, res.report_html)
        else:
            _print_gates(res.report, explain=explain, brief=brief)
    if explain and res.canary_power:
        print_canary_power(res.canary_power)
    if res.canary is not None:
        print_canary(res.canary)
    who = f"{res.release_name} {_short(res.release_id)}"
    if res.status == "dry_run":
        verdict = "would pass" if res.ok else "would be BLOCKED"
        out.print(f"dry run: {esc(who)} -> {esc(res.environment)} {esc(verdict)}; nothing changed")
    elif res.status == "blocked":
        failed_gates = res.report.failed if res.report else []
        failed = ", ".join(g.name for g in failed_gates)
        # Only these kinds can be forced; a missing approval or a failed shadow comparison
        # cannot.
        forceable = ("perf", "quality", "evidence", "policy")
        kinds = " ".join(
            f"--force {k}" for k in dict.fromkeys(g.kind for g in failed_gates) if k in forceable
        )
        html = f" (report: {esc(res.report_html)})" if res.report_html else ""
        err.print(
            f"[red]blocked:[/red] {esc(who)} -> {esc(res.environment)}: {esc(failed)}{html}",
            highlight=False,
        )
        if any(g.kind == "approval" for g in failed_gates):
            err.print(
                f"  [dim]hint: it needs an approval: releasekit approve "
                f"{esc(_short(res.release_id))} --env {esc(res.environment)} --reason TEXT "
                "--key APPROVER.pem, signed by one of its approvers other than the promoter "
                "(no --force carries it)[/dim]"
            )
        fix = "fix the release (--explain: each gate's rule and detail)"
        if kinds:
            err.print(
                f"  [dim]hint: {fix}; to override, name what you override: "
                f"{esc(kinds)} --reason TEXT[/dim]"
            )
        elif not any(g.kind == "approval" for g in failed_gates):
            err.print(f"  [dim]hint: {fix}[/dim]")
    elif res.status == "canary_aborted" and res.deploy is not None:
        err.print(
            f"[red]canary aborted:[/red] {esc(res.deploy.failure)}; all traffic is back on "
            f"{_short(res.deploy.previous_release_id)}"
            + (f" (ledger event {res.record.seq})" if res.record else ""),
            highlight=False,
        )
    elif res.status == "deploy_failed" and res.deploy is not None:
        failed_deploy = res.deploy
        back = "; traffic went back to the previous release" if failed_deploy.reverted else ""
        err.print(
            f"[red]deploy failed[/red] ({esc(failed_deploy.failed_stage)}): "
            f"{esc(failed_deploy.failure)}{esc(back)}; {esc(failed_deploy.still_serving)}",
            highlight=False,
        )
    elif res.status == "already_live":
        out.print(f"{esc(who)} is already live in {esc(res.environment)}; nothing to do")
    else:
        d = res.deploy
        forced = (
            f" [yellow](forced over: {esc(', '.join(res.overridden))})[/yellow]"
            if res.overridden
            else ""
        )
        how = ""
        if d and d.reused_server:
            how = {
                "shadow": " (on the server its shadow ran on)",
                "warm": " (on a warm server of its engine)",
            }.get(d.reused_role or "", " (same vLLM server: only prompts or adapters differ)")
        warm = f"; kept warm: {', '.join(_short(r) for r in d.warm)}" if d and d.warm else ""
        out.print(
            f"[green]{esc(res.environment)}[/green] -> {esc(who)}{how}{forced} "
            f"at {esc(res.gateway_url)}{esc(warm)}",
            highlight=False,
        )
    if res.autoscaling is not None and res.status in ("dry_run", "promoted", "redeployed"):
        out.print(f"  {esc(res.autoscaling.text)}", highlight=False)
    for w in res.warnings:
        err.print(f"[yellow]warning:[/yellow] {esc(w)}", highlight=False)
    if not res.ok:
        raise typer.Exit(1)


@handle_errors
def rollback_cmd(
    env: Annotated[
        str, typer.Argument(help="environment to roll back (ENV:ADAPTER: one adapter's lane)")
    ],
    reason: Annotated[str, typer.Option("--reason", "-r", help="why (recorded)")] = "",
    to: Annotated[
        str | None, typer.Option("--to", help="release to go back to (default: the previous)")
    ] = None,
    break_glass: Annotated[
        bool,
        typer.Option(
            "--break-glass",
            help="go back even when the ledger fails verification: to the release its "
            "verified records show live before the first bad record (needs --reason; "
            "recorded with the failure it went past)",
        ),
    ] = False,
    json_: JsonOpt = False,
) -> None:
    """Move ENV back to the release live before the current one (or --to: one that was
    live in ENV, is not marked bad and may go there; anything else goes through
    `promote`), no gates; the release rolled back from is marked bad. When the ledger
    fails verification, only `--break-glass --reason TEXT` goes back."""
    from releasekit.promote.rollback import rollback

    res = rollback(State.settings(), env, to=to, reason=reason, break_glass=break_glass)
    if json_:
        emit_json(res)
    elif res.status == "rolled_back":
        how = "warm" if res.warm else "cold start"
        moved = next(
            (x for x in (res.deploy.steps if res.deploy else []) if x.step == "switch"), None
        )
        if moved is not None:
            how += f", the route itself in {moved.seconds * 1000:.0f} ms"
        glass = res.record.evidence.get("break_glass") if res.record is not None else None
        out.print(
            f"[green]{esc(env)}[/green] rolled back {_short(res.from_release)} -> "
            f"{_short(res.to_release)} ({esc(how)}, switched after {res.switch_s:.2f} s); "
            f"{_short(res.from_release)} marked bad"
            + (" [yellow](break glass)[/yellow]" if glass else ""),
            highlight=False,
        )
        if glass and res.record is not None:
            out.print(
                f"  recorded as #{res.record.seq}, past record {glass.get('first_bad_seq')}: "
                f"{esc(str(glass.get('problem')))}",
                highlight=False,
            )
    else:
        err.print(f"[red]rollback {res.status}:[/red] {esc(res.message)}", highlight=False)
    if not json_:
        for w in res.warnings:
            err.print(f"[yellow]warning:[/yellow] {esc(w)}", highlight=False)
    if res.status != "rolled_back":
        raise typer.Exit(1)


@handle_errors
def down_cmd(
    env: Annotated[
        str, typer.Argument(help="environment to stop (ENV:ADAPTER: take one lane's route out)")
    ],
    reason: Annotated[str, typer.Option("--reason", "-r", help="why (recorded)")] = "",
    json_: JsonOpt = False,
) -> None:
    """Stop ENV's gateway and servers cleanly, with its adapter lanes (the release of record
    stays recorded). ENV:ADAPTER takes that lane's route out and leaves the rest serving."""
    from releasekit.promote.deploy import down

    res = down(State.settings(), env, reason=reason)
    if json_:
        emit_json(res)
        return
    if is_lane(env):
        said = "route taken out" if res.lanes_down else "nothing (its route was not set)"
        out.print(f"{esc(env)}: {said}")
        return
    what = (
        (["gateway"] if res.gateway_stopped else [])
        + [f"server {_short(r)}" for r in res.servers_stopped]
        + [f"lane {lane}" for lane in res.lanes_down]
    )
    out.print(f"{esc(env)}: stopped {esc(', '.join(what) or 'nothing (nothing ran)')}")


@handle_errors
def deploy_status_cmd(
    env: Annotated[str | None, typer.Argument(help="one environment (default: all)")] = None,
    json_: JsonOpt = False,
) -> None:
    """What runs for each environment: its gateway, routes and servers, and whether the
    gateway serves the ledger's live release."""
    from releasekit.promote.deploy import deploy_status
    from releasekit.promote.deploy_status import warm_adapter_lines

    envs = deploy_status(State.settings(), env=env)
    if json_:
        emit_json(envs)
        return
    rows = []
    for e in envs:
        routes = (
            ", ".join(
                (f"{r['lane']}: " if r.get("lane") else "")
                + f"{_short(r['release_id'])}@{r['base_url']}"
                for r in e.routes
            )
            or "-"
        )
        servers = ", ".join(
            f"{_short(s.release_id)} {s.role} "
            + (f"{len(s.replicas)} replica(s)" if s.app else f"pid {s.pid}")
            + ("" if s.healthy else " (down)")
            for s in e.servers
        )
        rows.append(
            [
                e.environment,
                e.gateway_url or "-",
                "up" if e.gateway_healthy else "down",
                routes,
                servers or "-",
                _short(e.ledger_release_id),
                "yes" if e.agrees else "NO",
            ]
        )
    table(
        "deployments",
        ["environment", "gateway", "state", "routes", "servers", "ledger live", "agrees"],
        rows,
        row_line=lambda r: (
            f"{r[0]}: {r[2]} at {r[1]}; routes {r[3]}; servers {r[4]}; "
            f"ledger live {r[5]} (agrees: {r[6]})"
        ),
    )
    for e in envs:
        for lane in e.lanes:
            out.print(
                f"  lane {esc(lane.lane)}: routes {esc(', '.join(_short(r) for r in lane.routed))}"
                f", ledger live {_short(lane.ledger_release_id)} "
                f"(agrees: {'yes' if lane.agrees else 'NO'})",
                highlight=False,
            )
    for e in envs:
        m = e.mirror
        if m is None:
            continue
        what = "answers compared with" if m.purpose == "after_promotion" else "shadow of"
        left = (
            "no end"
            if m.left_s is None
            else "window over (nothing copied)"
            if m.left_s <= 0
            else f"{m.left_s:.0f} s left"
        )
        counts = (
            f", {m.mirrored} copies ({m.dropped} dropped), {m.pairs} pairs so far"
            if m.mirrored is not None
            else ""
        )
        out.print(
            f"{esc(e.environment)}: {what} {_short(m.release_id)}: {m.share:.0%} of requests "
            f"mirrored, {left}{counts}",
            highlight=False,
        )
    for line in warm_adapter_lines(envs):  # warm adapters, overdue unloads
        out.print(esc(line), highlight=False)
    for e in envs:
        for s in e.servers:
            sc = s.scale
            if sc is None:
                continue
            moving = "" if sc.status == "HEALTHY" else f", {sc.status.lower()}"
            extra = f", {sc.starting} starting" if sc.starting else ""
            extra += f", {sc.stopping} stopping" if sc.stopping else ""
            out.print(
                f"{esc(e.environment)}: {_short(s.release_id)} runs {sc.running} replica(s)"
                f"{extra}{esc(moving)}" + (f"; {esc(sc.autoscaling)}" if sc.autoscaling else ""),
                highlight=False,
            )
    replica_rows = [
        [e.environment, _short(s.release_id), s.role, r.node_id[:12], r.replica, str(r.pid),
         str(r.server_pid), r.server_url]
        for e in envs
        for s in e.servers
        for r in s.replicas
    ]  # fmt: skip
    if replica_rows:
        table(
            "replicas (ray target)",
            ["environment", "release", "role", "node id", "replica", "pid", "server pid", "server"],
            replica_rows,
        )
