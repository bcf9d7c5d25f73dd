"""CLI: watch an environment's live release and roll it back on a sustained breach (`watch`),
and write its Prometheus alerting rules and Alertmanager snippet (`alert-rules`)."""

from __future__ import annotations

import datetime as dt
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from releasekit.cli._common import JsonOpt, State, emit_json, err, esc, handle_errors, out
from releasekit.errors import ConfigError

if TYPE_CHECKING:
    from releasekit.watch.pairs import AnswersCheck
    from releasekit.watch.rules import Judgement
    from releasekit.watch.watcher import RollbackOutcome, WatchTick


def register(app: typer.Typer) -> None:
    """Attach this module's commands to the root app."""
    app.command("watch")(watch_cmd)
    app.command("alert-rules")(alert_rules_cmd)


def _short(rid: str | None) -> str:
    return rid[:12] if rid else "-"


def _hhmmss(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%H:%M:%S")


def _parse_listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(
            f"--listen {value!r} is not HOST:PORT", remedy="e.g. --listen 127.0.0.1:9095"
        )
    return (host.strip("[]") or "127.0.0.1"), int(port)


def _verdict(j: Judgement) -> str:
    colour = {"pass": "green", "breach": "red", "no_data": "dim"}[j.verdict]
    if j.value is None or j.verdict == "no_data":
        return f"{esc(j.rule)} [{colour}]no data[/{colour}] ({esc(j.reason)})"
    limit = f" / {j.limit:.4g}" if j.limit is not None else ""
    return f"{esc(j.rule)} {j.value:.4g}{limit} [{colour}]{j.verdict}[/{colour}]"


ANSWERS_EVERY_S = 30.0
"""Between the after-promotion check's looks, its unchanged line is printed this seldom."""
_answers_shown: dict[str, tuple[tuple[object, ...], float]] = {}


def _answers_news(env: str, a: AnswersCheck, now: float, *, every_s: float) -> bool:
    """Whether the after-promotion check's line says something new: a look done, another
    verdict, the window's end, a record or a page, or `every_s` since it was shown."""
    key = (a.looks_done, a.verdict, a.status, a.record_seq, a.page, a.problem)
    last = _answers_shown.get(env)
    if last is not None and last[0] == key and now - last[1] < every_s:
        return False
    _answers_shown[env] = (key, now)
    return True


def _print_tick(t: WatchTick, *, env: str, as_json: bool, brief: bool = False) -> None:
    """One tick for people: each judged window (with `brief`, only one with a verdict
    other than pass, or a reset), the after-promotion check at a look, a change or every
    ANSWERS_EVERY_S (with `brief`, never only for the time), and a rollback."""
    if as_json:
        sys.stdout.write(t.model_dump_json() + "\n")
        sys.stdout.flush()
        return
    if t.scrape_errors:
        problems = "; ".join(f"{k}: {v}" for k, v in t.scrape_errors.items())
        err.print(f"{esc(_hhmmss(t.t))} {esc(env)} [yellow]scrape failed[/yellow] {esc(problems)}")
    for w in t.windows:
        judged = [j for j in t.judgements if j.window_start == w.start and j.window_end == w.end]
        if brief and not w.reset and all(j.verdict == "pass" for j in judged):
            continue  # counted in the summary at the end
        head = f"{_hhmmss(w.end)} {esc(env)} {_short(w.release)} {w.duration_s:.0f}s window"
        if w.reset:
            head += f" [dim](reset: {esc(', '.join(w.reset))} restarted)[/dim]"
        else:
            head += f" {w.requests or 0:g} req"
        out.print(head + " | " + " | ".join(_verdict(j) for j in judged), highlight=False)
    every_s = float("inf") if brief else ANSWERS_EVERY_S
    if t.answers is not None and _answers_news(env, t.answers, t.t, every_s=every_s):
        a = t.answers
        colour = {"pass": "green", "breach": "red"}.get(a.verdict, "dim")
        line = f"{_hhmmss(t.t)} {esc(env)} {_short(a.release_id)} [{colour}]{esc(a.line())}"
        if a.record_seq is not None:
            line += f" (result recorded: ledger record {a.record_seq})"
        elif a.status == "ended" and a.verdict != "breach":
            line += " (mirror not removed yet)"
        out.print(line + f"[/{colour}]", highlight=False)
        # What exact match would have said, where it says otherwise (the page shows it always).
        shown = (a.judged_now or a.status == "ended") and a.exact_differs
        exact = a.exact_line() if shown else None
        if exact is not None:  # shown, never deciding
            out.print(f"  [dim]{esc(exact)}[/dim]", highlight=False)
        if a.page:
            out.print(f"  page: {esc(a.page)}", highlight=False)
    if t.rollback is not None:
        _print_rollback(t.rollback, env=env)


def _print_rollback(o: RollbackOutcome, *, env: str) -> None:
    if o.status == "rolled_back":
        out.print(
            f"[red]ROLLED BACK[/red] {esc(env)}: {_short(o.from_release)} -> "
            f"{_short(o.to_release)} "
            f"(ledger event {_short(o.event_id)}); {_short(o.from_release)} marked bad",
            highlight=False,
        )
    else:
        err.print(
            f"[yellow]rollback {o.status}[/yellow] {esc(env)}: {esc(o.message)}",
            highlight=False,
        )


@handle_errors
def watch_cmd(
    env: Annotated[str, typer.Argument(help="environment to watch, e.g. production")],
    once: Annotated[
        bool,
        typer.Option(
            "--once",
            help="judge one window of every rule, then exit (a sustain-1 rule can roll back)",
        ),
    ] = False,
    interval: Annotated[
        float | None,
        typer.Option(
            "--interval", min=0.1, help="seconds between scrapes (default: shortest window)"
        ),
    ] = None,
    listen: Annotated[
        str | None,
        typer.Option(
            "--listen",
            help="HOST:PORT for the Alertmanager receiver (POST /alertmanager) and /metrics; "
            "auth from RELEASEKIT_WEBHOOK_TOKEN or RELEASEKIT_WEBHOOK_USER/_PASSWORD",
        ),
    ] = None,
    cooldown: Annotated[
        float,
        typer.Option("--cooldown", min=0, help="seconds after a rollback before another"),
    ] = 900.0,
    json_: Annotated[
        bool, typer.Option("--json", help="one JSON object per scrape (JSON Lines)")
    ] = False,
    brief: Annotated[
        bool,
        typer.Option(
            "--brief",
            help="print a window only when a rule does not pass (and the answers only at "
            "their looks): for logs; the summary at the end counts every window",
        ),
    ] = False,
) -> None:
    """Watch ENV's live release: scrape its vLLM server and gateway, judge its watch rules
    and SLOs window by window, and roll back (marking it bad) on a sustained breach. After
    a promotion with after_promotion_compare_s, also compare its answers with the previous
    release's on mirrored requests and roll back when they agree less than the policy's
    floor. Runs until Ctrl-C or SIGTERM, which let the current check finish."""
    from releasekit.watch.service import open_service, receiver_auth, stop_on_signals

    settings = State.settings()
    addr = _parse_listen(listen) if listen else None
    auth = receiver_auth() if addr else None
    if addr and auth is None:
        raise ConfigError(
            "--listen needs receiver credentials",
            remedy="set RELEASEKIT_WEBHOOK_TOKEN (bearer) or RELEASEKIT_WEBHOOK_USER and "
            "RELEASEKIT_WEBHOOK_PASSWORD (basic auth), as Alertmanager's http_config sends",
        )
    svc = open_service(settings, env, interval_s=interval, cooldown_s=cooldown)
    try:
        p = svc.plan
        if not json_:
            err.print(
                f"watching {esc(env)}: {esc(p.release_name)} {_short(p.release_id)} at "
                f"{esc(p.target.vllm_metrics_url)}"
                + (
                    f" and {esc(p.target.gateway_metrics_url)}"
                    if p.target.gateway_metrics_url
                    else ""
                )
                + f", every {svc.watcher.interval_s:g} s",
                highlight=False,
            )
            if p.rules:  # one line; a window that does not pass names its rule
                rules = "; ".join(r.describe() for r in p.rules)
                err.print(f"  rules: {esc(rules)}", highlight=False)
            for n in p.notes:
                err.print(f"  [dim]note: {esc(n)}[/dim]", highlight=False)
        if once:
            tick = svc.once()
            if json_:
                emit_json(tick)
            else:
                _print_tick(tick, env=env, as_json=False, brief=brief)
            if not tick.scraped:
                raise typer.Exit(1)
            return
        stop = threading.Event()
        with stop_on_signals(stop):
            if addr and auth:
                with svc.serve(addr[0], addr[1], auth=auth) as url:
                    if not json_:
                        err.print(
                            f"  receiver: POST {esc(url)}/alertmanager, metrics: {esc(url)}/metrics"
                        )
                    summary = svc.run(
                        stop,
                        on_tick=lambda t: _print_tick(t, env=env, as_json=json_, brief=brief),
                    )
            else:
                summary = svc.run(
                    stop, on_tick=lambda t: _print_tick(t, env=env, as_json=json_, brief=brief)
                )
        if not json_:
            err.print(
                f"stopped: {summary.ticks} scrapes ({summary.failed_scrapes} failed), "
                f"{summary.windows_judged} windows judged, {summary.breaches} breaching, "
                f"{len([r for r in summary.rollbacks if r.status == 'rolled_back'])} rollbacks",
                highlight=False,
            )
    finally:
        svc.close()


@handle_errors
def alert_rules_cmd(
    env: Annotated[str, typer.Argument(help="environment whose live release to cover")],
    out_file: Annotated[
        Path | None,
        typer.Option("--out", help="rules file (default: releasekit-ENV.rules.yml)"),
    ] = None,
    am_out: Annotated[
        Path | None,
        typer.Option(
            "--alertmanager-out",
            help="Alertmanager config (default: releasekit-ENV.alertmanager.yml)",
        ),
    ] = None,
    webhook_url: Annotated[
        str | None,
        typer.Option("--webhook-url", help="where `releasekit watch ENV --listen` answers"),
    ] = None,
    json_: JsonOpt = False,
) -> None:
    """Write ENV's Prometheus alerting rules (from the live release's watch rules and SLOs)
    and the matching Alertmanager route and webhook receiver."""
    from releasekit.stores.ledger import open_ledger
    from releasekit.watch.service import build_alert_rules, write_alert_rules

    settings = State.settings()
    with open_ledger(settings, read_only=True) as led:
        res = build_alert_rules(settings, env, ledger=led, webhook_url=webhook_url)
    rules_path = out_file or Path(f"releasekit-{env}.rules.yml")
    am_path = am_out or Path(f"releasekit-{env}.alertmanager.yml")
    written = write_alert_rules(res, rules_path=rules_path, alertmanager_path=am_path)
    if json_:
        emit_json(written)
        return
    out.print(
        f"wrote {esc(rules_path)} ({len(res.rules.alerts)} alerts for {esc(env)}, release "
        f"{_short(res.release_id)}) and {esc(am_path)}",
        highlight=False,
    )
    for s in res.rules.skipped:
        err.print(f"  [yellow]skipped[/yellow] {esc(s)}", highlight=False)
    for n in res.notes:
        err.print(f"  [dim]note: {esc(n)}[/dim]", highlight=False)
    out.print(f"check it: promtool check rules {esc(rules_path)}", highlight=False)
    out.print(
        f"Prometheus needs these scrape jobs (they add the releasekit_env label):\n"
        f"{esc(written.scrape_yaml)}",
        highlight=False,
    )
