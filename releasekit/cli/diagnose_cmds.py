"""`releasekit diagnose ENV`: what is wrong with a live environment, ranked, with evidence
and remedies, from two scrapes of its vLLM server's and gateway's /metrics and the ledger."""

from __future__ import annotations

import time
from typing import Annotated

import typer
from rich.markup import escape

from releasekit.capacity.diagnose import (
    DiagnoseError,
    Diagnosis,
    Evidence,
    LiveTargets,
    LiveWindow,
    Observed,
    diagnose,
    live_release,
    live_targets,
)
from releasekit.cli._common import JsonOpt, State, emit_json, err, esc, handle_errors, out, table
from releasekit.config import Settings
from releasekit.watch.windows import (
    Exposition,
    ScrapeError,
    Snapshot,
    Window,
    build_window,
    parse_exposition,
    scrape,
)

DEFAULT_WINDOW_S = 30.0
MAX_WINDOW_S = 3600.0


def register(app: typer.Typer) -> None:
    """Add the `diagnose` command to the root app."""
    app.command("diagnose")(diagnose_cmd)


def _metrics_url(url: str) -> str:
    """A server's base URL or its /metrics URL, as its /metrics URL."""
    u = url.rstrip("/")
    return u if u.endswith("/metrics") else u + "/metrics"


def resolve_targets(
    settings: Settings, env: str, *, vllm_url: str | None, gateway_url: str | None
) -> LiveTargets:
    """Where to scrape: the flags when given, the env's deploy state for what they leave out.
    The one place diagnose decides its URLs."""
    rid = live_release(settings, env)
    if vllm_url is not None and gateway_url is not None:
        targets = LiveTargets(env=env, release_id=rid)
    else:
        targets = live_targets(settings, env, release_id=rid)
    if vllm_url is not None:
        targets.vllm_metrics_url = _metrics_url(vllm_url)
    if gateway_url is not None:
        targets.gateway_metrics_url = _metrics_url(gateway_url)
    if targets.vllm_metrics_url is None and targets.gateway_metrics_url is None:
        raise DiagnoseError(f"no server recorded for environment {env!r}")
    return targets


def _snapshot(targets: LiveTargets, timeout_s: float) -> Snapshot:
    t = time.monotonic()
    parsed: dict[str, Exposition] = {}
    errors: dict[str, str] = {}
    for source, url in (
        ("vllm", targets.vllm_metrics_url),
        ("gateway", targets.gateway_metrics_url),
    ):
        if url is None:
            continue
        try:
            parsed[source] = parse_exposition(scrape(url, timeout_s=timeout_s), url=url)
        except ScrapeError as exc:
            errors[source] = exc.problem
    return Snapshot(t=t, vllm=parsed.get("vllm"), gateway=parsed.get("gateway"), errors=errors)


def _label_values(exp: Exposition | None, label: str) -> set[str]:
    if exp is None:
        return set()
    return {v for (name, labels) in exp.samples for k, v in labels if k == label}


def _figures(w: Window, source: str) -> dict[str, Observed]:
    return {
        name: Observed(**f.model_dump())
        for name, f in w.figures.items()
        if f.source in (None, source)
    }


def live_window(before: Snapshot, after: Snapshot, targets: LiveTargets) -> LiveWindow:
    """Two snapshots as one LiveWindow: vLLM's figures and the gateway's kept apart (the
    gateway's series restricted to the env and the live release when it labels them)."""
    errors = {**before.errors, **after.errors}
    vw = build_window(Snapshot(before.t, vllm=before.vllm), Snapshot(after.t, vllm=after.vllm))
    gw_env = targets.env if targets.env in _label_values(after.gateway, "env") else None
    rid = targets.release_id
    gw_rel = rid if rid is not None and rid in _label_values(after.gateway, "release") else None
    gw = build_window(
        Snapshot(before.t, gateway=before.gateway),
        Snapshot(after.t, gateway=after.gateway),
        env=gw_env,
        release=gw_rel,
    )
    has_vllm = before.vllm is not None and after.vllm is not None
    has_gw = before.gateway is not None and after.gateway is not None
    requests: float | None = None
    req_src: str | None = None
    if gw.requests is not None and has_gw:
        requests, req_src = gw.requests, gw.requests_source
    elif has_vllm:
        requests, req_src = vw.requests, vw.requests_source
    return LiveWindow(
        duration_s=after.t - before.t,
        requests=requests,
        requests_source=req_src,
        reset=sorted(set(vw.reset) | set(gw.reset)),
        scrape_errors=errors,
        vllm_url=targets.vllm_metrics_url,
        gateway_url=targets.gateway_metrics_url,
        vllm=_figures(vw, "vllm") if has_vllm else {},
        gateway=_figures(gw, "gateway") if has_gw else {},
    )


def measure(targets: LiveTargets, window_s: float, *, timeout_s: float) -> LiveWindow:
    """Scrape the targets twice, `window_s` apart, into a LiveWindow (each scrape bounded by
    `timeout_s`: the caller passes the scrape_timeout_s setting or the flag)."""
    before = _snapshot(targets, timeout_s)
    time.sleep(window_s)
    after = _snapshot(targets, timeout_s)
    return live_window(before, after, targets)


# -- rendering -------------------------------------------------------------------------------

_COLOUR = {"critical": "red", "warning": "yellow", "info": "cyan"}
_VERDICT = {
    "healthy": "green",
    "problems": "red",
    "not_enough_traffic": "yellow",
    "not_judged": "yellow",
}


def _num(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "ratio":
        return f"{value:.1%}"
    if unit == "1/s":
        return f"{value:.3g}/s"
    if unit == "s":
        return f"{value * 1000:.1f} ms" if abs(value) < 0.1 else f"{value:.3g} s"
    return f"{value:.3g} {unit}"


def _evidence_line(e: Evidence) -> str:
    bits = [f"{e.metric} {_num(e.value, e.unit)} ({e.source})"]
    if e.baseline is not None:
        bits.append(f"knee {_num(e.baseline, e.unit)}")
    if e.threshold is not None:
        bits.append(f"line {_num(e.threshold, e.unit)}")
    if e.note:
        bits.append(e.note)
    return ", ".join(bits)


def _print(d: Diagnosis) -> None:
    colour = _VERDICT[d.verdict]
    rel = f" release {d.release_id[:12]}" if d.release_id else ""
    out.print(
        f"[bold]{esc(d.env)}[/bold]{esc(rel)}, {d.window_s:.3g} s window: "
        f"[{colour}]{escape(d.summary)}[/{colour}]",
        highlight=False,
    )
    for i, f in enumerate(d.findings, 1):
        col = _COLOUR[f.severity]
        out.print(
            f"\n{i}. [{col}]{f.severity}[/{col}] ({f.category}) [bold]{escape(f.title)}[/bold]",
            highlight=False,
        )
        for e in f.evidence:
            if e.value is not None:
                out.print(f"   - {escape(_evidence_line(e))}", highlight=False)
        out.print(f"   line: {escape(f.threshold)}", highlight=False)
        out.print(f"   likely cause: {escape(f.cause)}", highlight=False)
        out.print(f"   look at: {escape(f.where)}", highlight=False)
        out.print(f"   remedy: {escape(f.remedy)}", highlight=False)
        for cmd in f.commands:
            out.print(f"   $ {escape(cmd)}", highlight=False)
    if d.findings and any(s.live_s is not None for s in d.segments):
        rows = [
            (
                s.name,
                _num(s.live_s, "s"),
                _num(s.baseline_s, "s"),
                "-" if s.share is None else f"{s.share:.0%}",
                "grew" if s.grew else "",
            )
            for s in d.segments
        ]
        out.print()
        table("latency segments (means)", ["segment", "live", "knee", "share", ""], rows)
    c = d.last_change
    if c is not None and d.findings:
        out.print(
            f"last change: {c.event_type} #{c.seq} by {esc(c.actor)}, "
            f"{(c.from_release or '-')[:12]} -> {(c.to_release or '-')[:12]}",
            highlight=False,
        )
        for line in c.changed:
            out.print(f"  {escape(line)}", highlight=False)
        if c.diff_command:
            out.print(f"  $ {esc(c.diff_command)}", highlight=False)
    for n in d.notes:
        out.print(f"[dim]note: {escape(n)}[/dim]", highlight=False)


@handle_errors
def diagnose_cmd(
    env: Annotated[str, typer.Argument(help="environment to diagnose")],
    window: Annotated[
        float,
        typer.Option("--window", help="seconds between the two scrapes of /metrics"),
    ] = DEFAULT_WINDOW_S,
    vllm_url: Annotated[
        str | None,
        typer.Option(
            "--vllm-url",
            help="the vLLM server (base or /metrics URL); default: "
            "the env's live server from the deploy state",
        ),
    ] = None,
    gateway_url: Annotated[
        str | None,
        typer.Option(
            "--gateway-url",
            help="the gateway (base or /metrics URL); default: "
            "the env's gateway from the deploy state",
        ),
    ] = None,
    scrape_timeout: Annotated[
        float | None,
        typer.Option(
            "--scrape-timeout",
            help="seconds each /metrics scrape may take; default: the scrape_timeout_s "
            "setting (10)",
        ),
    ] = None,
    json_out: JsonOpt = False,
) -> None:
    """Ranked findings for a live environment: performance or quality, the latency segment
    that grew against the release's benchmark, memory pressure, queueing, slow decode,
    streaming stutters, and the last change when quality drops.

    E.g. `releasekit diagnose prod --window 60`.
    """
    if not 0 < window <= MAX_WINDOW_S:
        raise DiagnoseError(
            f"--window must be above 0 and at most {MAX_WINDOW_S:g} s (got {window:g})",
            remedy="e.g. --window 30",
        )
    if scrape_timeout is not None and scrape_timeout <= 0:
        raise DiagnoseError(
            f"--scrape-timeout must be above 0 s (got {scrape_timeout:g})",
            remedy="e.g. --scrape-timeout 15",
        )
    settings = State.settings()
    targets = resolve_targets(settings, env, vllm_url=vllm_url, gateway_url=gateway_url)
    if not json_out:
        err.print(f"[dim]reading {esc(env)}'s metrics for {window:g} s ...[/dim]", highlight=False)
    live = measure(targets, window, timeout_s=scrape_timeout or settings.scrape_timeout_s)
    result = diagnose(settings, env, live, release_id=targets.release_id)
    if json_out:
        emit_json(result)
    else:
        _print(result)
