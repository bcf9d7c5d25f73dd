"""CLI: approvals (`approve`), shadow traffic (`shadow start|compare|stop|export-pairs`),
and the rendering of canary steps that `promote` prints."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from releasekit.cli._common import JsonOpt, State, emit_json, err, esc, handle_errors, out, table

if TYPE_CHECKING:
    from releasekit.evaluate.agreement import Agreement
    from releasekit.evaluate.answers import AnswerVerdict

shadow_app = typer.Typer(
    help="Mirror a share of an environment's requests to a candidate (its answers reach no "
    "client) and compare its figures and answers with stable's.",
    no_args_is_help=True,
)


def register(app: typer.Typer) -> None:
    """Attach this module's commands to the root app."""
    app.command("approve")(approve_cmd)
    app.add_typer(shadow_app, name="shadow")


def _short(rid: str | None) -> str:
    return rid[:12] if rid else "-"


def _fmt(v: object) -> str:
    return "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)


def print_canary(canary: dict[str, Any]) -> None:
    """The canary steps as they ran: one row a step (every check: its figures and verdict,
    or why it was not judged; where answers were compared, their agreement), then the
    breach, if any, and the answers' agreement with the disagreeing pairs side by side."""
    from releasekit.rollout.canary import agreement_words
    from releasekit.rollout.judge import CheckResult

    rows = []
    steps = canary.get("steps", [])
    judged = [
        [CheckResult.model_validate(c) for c in (s.get("judgement") or {}).get("checks", [])]
        for s in steps
    ]
    # A check no step could measure (no feedback sent, say) is said once, not on every step.
    never = {
        c.metric: c.reason
        for c in (judged[0] if judged else [])
        if c.verdict == "not_measured"
        and all(
            any(o.metric == c.metric and o.verdict == "not_measured" for o in js) for js in judged
        )
    }
    for s, js in zip(steps, judged, strict=True):
        checks = "; ".join(c.brief() for c in js if c.metric not in never)
        if s.get("agreement") is not None:
            words = agreement_words(answers_of(s["agreement"]))
            checks = f"{checks}; {words}" if checks else words
        rows.append(
            [
                str(s["index"] + 1),
                f"{s['weight']:g}%",
                s["status"],
                f"{s['ended_at'] - s['started_at']:.1f}",
                f"{s.get('canary_requests', 0):g}/{s.get('stable_requests', 0):g}",
                checks or "-",
            ]
        )
    table(
        f"canary: {_short(canary.get('release_id'))} -> {canary.get('outcome')}",
        ["step", "weight", "status", "s", "requests canary/stable", "canary vs stable"],
        rows,
        row_line=lambda r: (
            f"step {r[0]} at {r[1]}: {r[2]} after {r[3]} s, {r[4]} requests canary/stable: {r[5]}"
        ),
    )
    for metric, why in never.items():
        out.print(f"  {metric}: not measured in any step ({why})", highlight=False)
    for s in steps:
        first = s.get("unconfirmed")
        if first:  # a start-up transient the disjoint window did not repeat
            gone = ", ".join(
                str(c.get("metric"))
                for c in first.get("checks", [])
                if c.get("verdict") == "breach"
            )
            span = float(first.get("window_end") or 0) - float(first.get("window_start") or 0)
            out.print(
                f"  step {s['index'] + 1}: {gone or 'a check'} breached in its first {span:.0f} s "
                "and not in the next window, judged on its own: a start-up transient, not a "
                "breach",
                highlight=False,
            )
    against = canary.get("judged_against") or ""
    if against.endswith(":baseline"):
        out.print(
            f"  judged against a fresh baseline server of {_short(against)}, started, warmed "
            "and placed with the canary and given the same share of traffic",
            highlight=False,
        )
    if canary.get("agreement") is not None:
        out.print(
            f"  the canary's answers against {_short(canary.get('answers_from'))}'s copies of "
            "the same requests (candidate: what clients got from the canary):",
            highlight=False,
        )
        print_agreement(answers_of(canary["agreement"]))
    share = canary.get("canary_served", 0), canary.get("total_served", 0)
    if share[1]:
        out.print(
            f"  the canary took {share[0]} of {share[1]} requests ({share[0] / share[1]:.1%})"
        )
    if canary.get("decide_to_zero_s") is not None:
        out.print(
            f"  breach -> 0% canary in {canary['decide_to_zero_s'] * 1000:.0f} ms after the "
            f"decision ({canary['window_to_zero_s']:.2f} s after the breaching window closed)"
        )


def print_canary_power(power: list[dict[str, Any]]) -> None:
    """What each canary check detects, one judgement at its min_samples (rollout.power)."""
    from releasekit.rollout.power import POWER_COLUMNS, CheckPower

    checks = [CheckPower.model_validate(p) for p in power]
    table("canary checks: what one judgement detects", POWER_COLUMNS, [c.cells() for c in checks])
    out.print(
        "  [dim]per judgement at min_samples (rates: with stable at 0, the limit is the "
        "slack); a step aborts on `sustain` breaching judgements in a row that a disjoint "
        "window repeats, and passes on `sustain` clean ones, each over the step so far[/dim]",
        highlight=False,
    )


@handle_errors
def approve_cmd(
    release: Annotated[str, typer.Argument(help="release id/prefix, name@version or manifest")],
    env: Annotated[str, typer.Option("--env", help="environment the approval is for")],
    reason: Annotated[str, typer.Option("--reason", "-r", help="why it may go (recorded)")],
    key: Annotated[
        Path | None,
        typer.Option(
            "--key",
            help="your approver private key (PEM) to sign the approval with; default: the "
            "configured signing key",
        ),
    ] = None,
    json_: JsonOpt = False,
) -> None:
    """Approve RELEASE for an environment: an `approve` ledger event signed with your key.
    An environment with `requires_approval` takes no release without one signed by one of
    its `approvers` (and not with the promoter's own key)."""
    from releasekit.promote.approvals import approve

    res = approve(State.settings(), release, env=env, reason=reason, key=key)
    if json_:
        emit_json(res)
        return
    note = "" if res.required else f" ({env} does not require approvals)"
    signed = f", key {res.key_id}" if res.key_id else ", unsigned"
    out.print(
        f"approved {_short(res.release_id)} for {esc(env)} by {esc(res.approver)}"
        f"{esc(signed)} (ledger event {res.record.seq}){esc(note)}",
        highlight=False,
    )
    for w in res.warnings:
        err.print(f"[yellow]warning:[/yellow] {esc(w)}", highlight=False)


@shadow_app.command("start")
@handle_errors
def shadow_start_cmd(
    release: Annotated[str, typer.Argument(help="the candidate: release id, name@version, ...")],
    env: Annotated[str, typer.Option("--env", help="environment whose traffic is mirrored")],
    share: Annotated[float, typer.Option("--share", help="fraction of requests copied")] = 0.1,
    reason: Annotated[str, typer.Option("--reason", "-r", help="why (recorded)")] = "",
    json_: JsonOpt = False,
) -> None:
    """Start RELEASE's server beside ENV's and mirror a share of ENV's requests to it: its
    answers reach no client (the gateway keeps them beside stable's, for `shadow compare`)
    and the copies never count against clients' rate limits."""
    from releasekit.rollout.shadow import start_shadow

    res = start_shadow(State.settings(), release, env=env, share=share, reason=reason)
    if json_:
        emit_json(res)
        return
    how = "reused a running server" if res.reused_server else f"server at {res.base_url}"
    if res.baseline_url:
        how += f"; judged against a fresh baseline of stable at {res.baseline_url}"
    out.print(
        f"mirroring {res.share:.0%} of {esc(env)}'s requests to {_short(res.release_id)} "
        f"({esc(how)}); compare with `releasekit shadow compare --env {esc(env)}`",
        highlight=False,
    )


def _cell(text: str | None, width: int = 60) -> str:
    if text is None:
        return "-"
    one = " ".join(text.split())
    return one if len(one) <= width else one[: width - 1] + "…"


def answers_of(raw: dict[str, Any]) -> AnswerVerdict | Agreement:
    """A recorded answers verdict: an answer comparison's, or an older exact agreement's."""
    from releasekit.evaluate.agreement import Agreement
    from releasekit.evaluate.answers import AnswerVerdict

    return (
        AnswerVerdict.model_validate(raw) if "comparison" in raw else Agreement.model_validate(raw)
    )


def print_agreement(a: AnswerVerdict | Agreement) -> None:
    """An answer comparison (a shadow's, a canary's): its verdict, the A/A floor and the
    power, one line each (an older exact agreement: its line, then the disagreeing pairs
    side by side)."""
    from releasekit.evaluate.agreement import Agreement

    if not isinstance(a, Agreement):
        for line in (a.line(), a.floor_line(), a.power_line()):
            out.print(esc(line), highlight=False)
        if a.verdict != "pass":
            out.print(f"  {esc(a.reason)}", highlight=False)
        return
    out.print(f"{esc(a.line())}: {esc(a.verdict)} ({esc(a.reason)})", highlight=False)
    if a.examples:
        table(
            f"{len(a.examples)} disagreeing pairs",
            ["#", "stable answered", "candidate answered", "prompt (or its sha256)"],
            [
                [
                    str(x.seq),
                    _cell(x.stable),
                    _cell(x.candidate),
                    _cell(x.prompt) if x.prompt is not None else x.prompt_sha256[:16],
                ]
                for x in a.examples
            ],
            row_line=lambda r: f"  #{r[0]} stable: {r[1]!r} / candidate: {r[2]!r} ({r[3]})",
        )


@shadow_app.command("compare")
@handle_errors
def shadow_compare_cmd(
    env: Annotated[str, typer.Option("--env", help="environment being mirrored")],
    window: Annotated[float, typer.Option("--window", help="seconds to measure")] = 30.0,
    max_window: Annotated[
        float | None,
        typer.Option(
            "--max-window",
            help="measure on, --window seconds at a time up to this many, while the "
            "answer comparison is undecided (fewer pairs than it needs, or an interval across "
            "the policy's max_excess_disagreement) or a "
            "check still waits for samples",
        ),
    ] = None,
    json_: JsonOpt = False,
) -> None:
    """Judge the shadow candidate's live figures against stable's over the next --window
    seconds (the candidate's canary checks) and its answers against stable's answers to the
    same mirrored requests (their excess over stable's own second answers, by the
    environment's comparison); promote reads the result as a gate. Writes an HTML page and
    prints its path."""
    from releasekit.rollout.shadow import compare_shadow

    res = compare_shadow(State.settings(), env=env, window_s=window, max_window_s=max_window)
    if json_:
        emit_json(res)
    else:
        rows = [
            [
                c.metric,
                _fmt(c.canary),
                _fmt(c.stable),
                _fmt(c.limit),
                c.source or "-",
                c.verdict + c.over_limit()
                if c.verdict in ("pass", "breach")
                else f"{c.verdict.replace('_', ' ')} ({c.reason})",
            ]
            for c in res.judgement.checks
        ]
        fresh = res.judged_against == "fresh baseline"
        table(
            f"shadow {_short(res.release_id)} vs stable {_short(res.stable_release_id)} "
            + ("(a fresh baseline server) " if fresh else "")
            + f"over {res.window_s:g} s ({res.judgement.canary_requests:g} mirrored / "
            f"{res.judgement.stable_requests:g} {'baseline' if fresh else 'live'} requests): "
            f"{res.verdict}",
            [
                "metric",
                "candidate",
                "baseline" if fresh else "stable",
                "limit",
                "source",
                "verdict",
            ],
            rows,
            row_line=lambda r: f"  {r[0]}: {r[1]} vs {r[2]} (limit {r[3]}, {r[4]}): {r[5]}",
        )
        if res.unconfirmed is not None:
            first = res.unconfirmed
            gone = ", ".join(c.metric for c in first.checks if c.verdict == "breach")
            out.print(
                f"  {gone} breached in the first {first.window_end - first.window_start:.0f} s "
                "and not in the next window, judged on its own: a start-up transient, not a "
                "breach (the figures above are that window's)"
            )
        if res.dropped:
            out.print(f"  {res.dropped} copies dropped (the mirror was at its in-flight cap)")
        if res.agreement is not None:
            print_agreement(res.agreement)
        if res.exact_answers is not None:
            out.print(
                f"  under exact match (shown, not deciding): {esc(res.exact_answers.line())}",
                highlight=False,
            )
        if res.page:
            out.print(f"report: {esc(res.page)}", highlight=False)
    if res.verdict == "breach":
        raise typer.Exit(1)


@shadow_app.command("stop")
@handle_errors
def shadow_stop_cmd(
    env: Annotated[str, typer.Option("--env", help="environment being mirrored")],
    reason: Annotated[str, typer.Option("--reason", "-r", help="why (recorded)")] = "",
    json_: JsonOpt = False,
) -> None:
    """Stop mirroring and the candidate's shadow server (its last comparison is kept)."""
    from releasekit.rollout.shadow import stop_shadow

    res = stop_shadow(State.settings(), env=env, reason=reason)
    if json_:
        emit_json(res)
        return
    out.print(f"{esc(env)}: no longer mirrored to {_short(res.release_id)}")


@shadow_app.command("export-pairs")
@handle_errors
def shadow_export_pairs_cmd(
    env: Annotated[str, typer.Option("--env", help="environment whose stored pairs are read")],
    release: Annotated[
        str | None,
        typer.Option("--release", help="the candidate (default: the last shadow's candidate)"),
    ] = None,
    out_dir: Annotated[
        Path | None,
        typer.Option("--out", help="folder of the suite file (default: suites/live/)"),
    ] = None,
    var: Annotated[
        str,
        typer.Option(
            "--var",
            help="the template variable a prompt binds when it is not a templated "
            "request's variables",
        ),
    ] = "question",
    json_: JsonOpt = False,
) -> None:
    """Write the candidate's stored answer pairs whose answers differ (both whole, the
    prompt kept) as an eval suite: one exact_match item a prompt, stable's answer expected,
    in OUT/ENV-SHA12.jsonl. Exits 1, writing nothing, when no pair is left to export."""
    from releasekit.rollout.export_pairs import export_pairs

    res = export_pairs(State.settings(), env=env, release=release, out_dir=out_dir, var=var)
    if json_:
        emit_json(res)
    else:
        out.print(esc(res.line()), highlight=False)
    if res.path is None:
        raise typer.Exit(1)
