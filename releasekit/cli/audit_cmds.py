"""CLI: register releases in MLflow, assign them to environments, keep MLflow in line with the
ledger (reconcile), and answer auditors (status, history, at, show, diff, ledger verify,
keygen, anchor)."""

from __future__ import annotations

import datetime as dt
import json
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Annotated, Any

import typer

from releasekit.cli._common import JsonOpt, State, emit_json, err, esc, handle_errors, out
from releasekit.cli._common import table as common_table
from releasekit.config.lanes import lane_name
from releasekit.errors import TimeParseError
from releasekit.promote.metrics import is_key_metric, key_metrics
from releasekit.promote.policy import verify_with_policies
from releasekit.releases.adapter_view import AdapterInfo
from releasekit.releases.queries import at, diff, event_gates, history, show
from releasekit.releases.reconcile import checked_status, reconcile
from releasekit.releases.resolve import parse_time
from releasekit.stores.ledger import Ledger, LedgerRecord, keygen, open_ledger

ledger_app = typer.Typer(help="The hash-chained event ledger.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    """Attach this module's commands to the root app."""
    app.command("register")(register_cmd)
    app.command("assign")(assign_cmd)
    app.command("status")(status_cmd)
    app.command("reconcile")(reconcile_cmd)
    app.command("history")(history_cmd)
    app.command("at")(at_cmd)
    app.command("show")(show_cmd)
    app.command("diff")(diff_cmd)
    app.add_typer(ledger_app, name="ledger")


def _time(value: str) -> dt.datetime:
    try:
        return parse_time(value)
    except TimeParseError as exc:
        raise typer.BadParameter(str(exc)) from None


_KEEP = {"release", "from", "to", "seq", "time", "since", "environment", "env", "metric", "mlflow"}
_MIN = {"type": 8, "by": 8, "reason": 10, "event": 8, "model": 8}


def table(
    title: str | None,
    columns: Sequence[str],
    rows: Iterable[Sequence[Any]],
    *,
    row_line: Callable[[Sequence[str]], str] | None = None,
) -> None:
    """A table whose id, time and name columns never wrap (ids must stay copyable);
    `row_line` as in `_common.table`."""
    common_table(title, columns, rows, no_wrap=_KEEP, min_width=_MIN, row_line=row_line)


def _key_metrics(metrics: dict[str, float]) -> list[tuple[str, str]]:
    """The figures gates use, for tables (--json has every metric)."""
    return [(k, f"{v:.4g}") for k, v in key_metrics(metrics).items()]


def _nonempty(value: str) -> str:
    if not value.strip():
        raise typer.BadParameter("must not be empty")
    return value


def _short(rid: str | None) -> str:
    return rid[:12] if rid else "-"


def _when(t: dt.datetime | None) -> str:
    return t.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%SZ") if t else "-"


def _who(actor: str) -> str:
    """The actor's name for tables (JSON and CSV keep `name <email>`)."""
    return actor.split(" <", 1)[0] if " <" in actor else actor


def _ledger() -> Ledger:
    # Auditing commands only read: never create a ledger where none is.
    return open_ledger(State.settings(), read_only=True)


def _warn(warnings: Sequence[str]) -> None:
    for w in warnings:
        err.print(f"[yellow]warning:[/yellow] {esc(w)}", highlight=False)


@handle_errors
def register_cmd(
    manifest: Annotated[
        Path, typer.Argument(help="manifest of a locked release", show_default=False)
    ],
    json_: JsonOpt = False,
) -> None:
    """Register a locked release in MLflow (run, model version, prompts) and the ledger."""
    from releasekit.releases.register import register_release

    with err.status("registering") as spinner:
        res = register_release(State.settings(), manifest, progress=lambda msg: spinner.update(msg))
    _warn(res.warnings)
    if json_:
        emit_json(res)
        return
    verb = "registered" if res.created else "already registered"
    out.print(
        f"[green]{esc(verb)}[/green] {esc(res.model_name)} version {res.version} "
        f"(release {_short(res.release_id)}) run {esc(res.run_id)}",
        highlight=False,
    )
    if res.prompt_uri:
        out.print(f"  prompt {esc(res.prompt_uri)}  model {esc(res.model_uri)}", highlight=False)


@handle_errors
def assign_cmd(
    release: Annotated[str, typer.Argument(help="release id/prefix, name@version or manifest")],
    env: Annotated[str, typer.Option("--env", "-e", help="environment, e.g. production")],
    reason: Annotated[
        str,
        typer.Option("--reason", "-r", callback=_nonempty, help="why (recorded in the ledger)"),
    ],
    force: Annotated[bool, typer.Option(help="record an event even if already live")] = False,
    json_: JsonOpt = False,
) -> None:
    """Record that ENV now runs RELEASE: move the MLflow alias and append the event. Only for
    environments releasekit does not deploy; one in releasekit.toml moves through
    `promote` (its gates) and `rollback`."""
    from releasekit.releases.assign import assign

    res = assign(State.settings(), release, env=env, reason=reason, force=force)
    _warn(res.warnings)
    if json_:
        emit_json(res)
        return
    if res.repaired is not None:
        out.print(
            f"[yellow]repaired[/yellow] {esc(env)}: {esc(res.repaired.reason)} "
            f"(event #{res.repaired.seq})",
            highlight=False,
        )
    what = f"{res.model_name} v{res.version} (release {_short(res.release_id)})"
    if not res.changed:
        out.print(f"{esc(env)} already runs {esc(what)}; nothing recorded", highlight=False)
        return
    was = f" (was {_short(res.previous_release_id)})" if res.previous_release_id else ""
    seq = f"; event #{res.record.seq}" if res.record else ""
    out.print(f"[green]{esc(env)}[/green] -> {esc(what)}{esc(was)}{esc(seq)}", highlight=False)


@handle_errors
def status_cmd(json_: JsonOpt = False) -> None:
    """What is live in each environment, since when, who put it there, and whether MLflow's
    alias agrees with the ledger (exit 1 on drift or when MLflow cannot be asked)."""
    rep = checked_status(State.settings())
    if json_:
        emit_json(rep)
    elif not rep.environments:
        out.print("no environment has a release yet (see `releasekit assign`)")
    else:
        table(
            "live releases",
            ["environment", "release", "model", "since", "by", "event", "mlflow", "reason"],
            [
                (
                    e.environment,
                    _short(e.release_id),
                    f"{e.model_name} v{e.model_version}" if e.model_name else "-",
                    _when(e.since),
                    _who(e.actor),
                    f"#{e.seq} {e.event_type}",
                    "ok"
                    if e.drift == "ok"
                    else f"{e.drift.upper()}"
                    if e.drift == "drift"
                    else e.drift,
                    e.reason,
                )
                for e in rep.environments
            ],
            row_line=lambda r: (
                f"{r[0]}: {r[1]} ({r[2]}) since {r[3]}, by {r[4]} ({r[5]}; mlflow {r[6]}): {r[7]}"
            ),
        )
        for e in rep.drifted:
            err.print(f"[red]drift:[/red] {esc(e.drift_detail)}", highlight=False)
        for d in rep.unrecorded:
            err.print(f"[yellow]unrecorded:[/yellow] {esc(d.detail)}", highlight=False)
        if rep.drifted:
            err.print(
                "  [dim]hint: `releasekit reconcile` moves the aliases to match the ledger[/dim]"
            )
        if rep.drift_error:
            err.print(
                f"[red]error:[/red] cannot cross-check MLflow: {esc(rep.drift_error)}",
                highlight=False,
            )
    if rep.drifted or rep.drift_error:
        raise typer.Exit(1)


@handle_errors
def reconcile_cmd(
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="say what would change, change nothing")
    ] = False,
    env: Annotated[str | None, typer.Option("--env", "-e", help="only this environment")] = None,
    json_: JsonOpt = False,
) -> None:
    """Move every MLflow alias that disagrees with the ledger back to the ledger's release
    (each repair is recorded as a `repair` event)."""
    res = reconcile(State.settings(), dry_run=dry_run, environment=env)
    if json_:
        emit_json(res)
        return
    verb = "would repair" if dry_run else "repaired"
    for r in res.repairs:
        found = ", ".join(f"{h.model_name} v{h.version}" for h in r.before) or "nothing"
        seq = f" (event #{r.record.seq})" if r.record else ""
        out.print(
            f"[yellow]{esc(verb)}[/yellow] {esc(r.environment)}: {esc(found)} -> "
            f"{esc(r.after.model_name)} v{r.after.version}{esc(seq)}",
            highlight=False,
        )
    for d in res.unrecorded:
        err.print(f"[yellow]unrecorded:[/yellow] {esc(d.detail)} (left alone)", highlight=False)
    if not res.repairs:
        out.print(f"[green]ok[/green] {res.checked} environments agree with the ledger")


def _approved(e: LedgerRecord) -> str:
    approval = e.evidence.get("approval") if isinstance(e.evidence, dict) else None
    if isinstance(approval, dict) and approval.get("by"):
        return f" (approved by {_who(str(approval['by']))})"
    return ""


def _gate_notes(e: LedgerRecord) -> str:
    """The advisory and overridden gates (and a policy that was not the committed one),
    printed beside the event."""
    g = event_gates(e.evidence if isinstance(e.evidence, dict) else {})
    parts = []
    if g.advisory:
        parts.append(f"advisory: {', '.join(g.advisory)}")
    if g.overridden:
        parts.append(f"overridden: {', '.join(g.overridden)}")
    if g.policy:
        parts.append(f"policy {g.policy}")
    return f" [{'; '.join(parts)}]" if parts else ""


def _events_table(title: str, events: list[LedgerRecord]) -> None:
    table(
        title,
        ["seq", "time", "type", "env", "from", "to", "by", "reason"],
        [
            (
                e.seq,
                _when(e.time),
                e.type,
                e.environment or "",
                _short(e.from_release) if e.from_release else "",
                _short(e.to_release) if e.to_release else "",
                _who(e.actor),
                e.reason + _approved(e) + _gate_notes(e),
            )
            for e in events
        ],
        row_line=_event_line,
    )


def _event_line(cells: Sequence[str]) -> str:
    """One event as a log line: `#seq time type env from -> to, by: reason`."""
    seq, when, type_, env, from_, to, by, reason = cells
    moved = f"{from_ or '-'} -> {to}" if to else from_
    head = " ".join(x for x in (f"#{seq}", when, type_, env, moved) if x)
    return f"{head}, by {by}" + (f": {reason}" if reason else "")


@handle_errors
def history_cmd(
    env: Annotated[
        str | None,
        typer.Option("--env", "-e", help="only this environment (with its adapter lanes)"),
    ] = None,
    adapter: Annotated[
        str | None,
        typer.Option("--adapter", help="only this adapter's lane of --env (ENV:ADAPTER)"),
    ] = None,
    release: Annotated[
        str | None, typer.Option("--release", help="only events naming this release")
    ] = None,
    since: Annotated[
        dt.datetime | None, typer.Option(parser=_time, help="from this time (inclusive)")
    ] = None,
    until: Annotated[
        dt.datetime | None, typer.Option(parser=_time, help="up to this time (inclusive)")
    ] = None,
    type_: Annotated[
        list[str] | None, typer.Option("--type", help="only these event types (repeatable)")
    ] = None,
    limit: Annotated[int | None, typer.Option(help="only the newest N events", min=0)] = None,
    json_: JsonOpt = False,
    csv_: Annotated[bool, typer.Option("--csv", help="print CSV")] = False,
) -> None:
    """The ledger's events, oldest first, filtered by environment, release and time."""
    if json_ and csv_:
        err.print("[red]error:[/red] choose one of --json and --csv")
        raise typer.Exit(2)
    if adapter is not None:
        if env is None:
            err.print("[red]error:[/red] --adapter needs --env: a lane is an environment's")
            raise typer.Exit(2)
        env = lane_name(env, adapter)
    rep = history(
        State.settings(),
        env=env,
        release=release,
        since=since,
        until=until,
        types=type_,
        limit=limit,
    )
    if json_:
        emit_json(rep)
    elif csv_:
        sys.stdout.write(rep.to_csv())
    elif not rep.events:
        out.print("no events match")
    else:
        _events_table(f"history ({len(rep.events)} events)", rep.events)


@handle_errors
def at_cmd(
    env: Annotated[str, typer.Argument(help="environment (ENV:ADAPTER: an adapter lane)")],
    time: Annotated[
        dt.datetime,
        typer.Argument(parser=_time, help="ISO 8601 time (UTC if no zone), or '2h ago'"),
    ],
    adapter: Annotated[
        str | None, typer.Option("--adapter", help="this adapter's lane of ENV")
    ] = None,
    json_: JsonOpt = False,
) -> None:
    """The release live in ENV (or one adapter's lane of it) at TIME, the event that put it
    there, and its evidence."""
    if adapter is not None:
        env = lane_name(env, adapter)
    res = at(State.settings(), env, time)
    if json_:
        emit_json(res)
        return
    if res.record is None:
        out.print(f"nothing was live in {esc(env)} at {esc(_when(res.time))}")
        return
    r = res.record
    out.print(
        f"[bold]{esc(env)}[/bold] at {esc(_when(res.time))}: release {res.release_id}",
        highlight=False,
    )
    out.print(f"  model     {esc(res.model_name)} v{res.model_version}", highlight=False)
    out.print(
        f"  since     {esc(_when(r.time))} (event #{r.seq} {r.type}, by {esc(r.actor)})",
        highlight=False,
    )
    out.print(f"  reason    {esc(r.reason)}", highlight=False)
    if r.from_release:
        out.print(f"  replaced  {esc(r.from_release)}", highlight=False)
    for k, v in sorted(res.evidence.items()):
        if k == "reports" and isinstance(v, dict):
            shown = f"{len(v)} files with sha256 (see --json)"
        else:
            shown = json.dumps(v, sort_keys=True) if isinstance(v, dict | list) else v
        out.print(f"  evidence  {esc(k)}: {esc(shown)}", highlight=False)
    if res.metrics:
        table(
            "evidence (key figures; --json for all)", ["metric", "value"], _key_metrics(res.metrics)
        )


def _kv(title: str, rows: list[tuple[str, Any]]) -> None:
    rows = [(k, v) for k, v in rows if v not in (None, "", [], {})]
    if rows:
        table(title, ["field", "value"], rows)


@handle_errors
def show_cmd(
    release: Annotated[str, typer.Argument(help="release id/prefix, name@version or manifest")],
    json_: JsonOpt = False,
) -> None:
    """One release in full: manifest, digests, provenance, MLflow links, evidence, events."""
    d = show(State.settings(), release)
    if json_:
        emit_json(d)
        return
    out.print(f"[bold]release {d.release_id}[/bold]  {esc(d.name or '')}", highlight=False)
    p = d.provenance
    _kv(
        "release",
        [
            ("manifest", d.manifest_source),
            ("locked at", d.locked_at),
            ("git commit", p.commit if p else None),
            ("git branch", p.branch if p else None),
            ("dirty", str(p.dirty).lower() if p and p.dirty is not None else None),
            ("author", p.author if p else None),
            ("live in", ", ".join(d.live_in)),
        ],
    )
    if d.registry:
        r = d.registry
        _kv(
            "MLflow",
            [
                ("model", r.model_uri),
                ("run", r.run_id),
                ("prompt", r.prompt_uri),
                ("tracking", r.tracking_uri),
                ("run url", r.run_url),
                ("model url", r.model_url),
            ],
        )
    if d.weights:
        w = d.weights
        quantised = w.scheme not in (None, "none")
        made = w.made_on.label if w.made_on else ("not recorded" if quantised else None)
        _kv(
            "served weights (--json for the full digest)",
            [
                ("sha256", w.short),
                ("scheme", w.scheme),
                ("made on", made),
                ("signed", f"register event #{w.signed_seq}" if w.signed_seq else "no"),
            ],
        )
    if d.adapters:
        table(
            "adapters (--json for each file's digest)",
            ["name", "rank", "digest", "base", "registry"],
            [
                (a.name, _val(a.rank), _val(a.digest), _val(a.base), _val(a.model_uri))
                for a in d.adapters
            ],
        )
    # An adapter's files are summed up by its digest above.
    inputs = [(k, v) for k, v in sorted(d.inputs.items()) if not k.startswith("adapter/")]
    if inputs:
        table("lock digests", ["input", "sha256"], inputs)
    if d.metrics:
        table(
            "evidence (key figures; --json for all)", ["metric", "value"], _key_metrics(d.metrics)
        )
    if d.missing:
        out.print(f"[dim]not built yet: {esc(', '.join(d.missing))}[/dim]")
    for n in d.notes:
        out.print(f"[yellow]note:[/yellow] {esc(n)}", highlight=False)
    if d.events:
        _events_table("events", d.events)


@handle_errors
def diff_cmd(
    a: Annotated[str, typer.Argument(help="release A (id/prefix, name@version or manifest)")],
    b: Annotated[str, typer.Argument(help="release B")],
    exit_code: Annotated[
        bool, typer.Option("--exit-code", help="exit 1 when the releases differ (for CI)")
    ] = False,
    json_: JsonOpt = False,
) -> None:
    """What differs between two releases: prompts, quantisation, serving, model, metrics."""
    d = diff(State.settings(), a, b)
    if json_:
        emit_json(d)
    else:
        out.print(
            f"a: {d.a.short_id} {esc(d.a.name or '')}  b: {d.b.short_id} {esc(d.b.name or '')}",
            highlight=False,
        )
        if not d.differs:
            out.print("[green]same release[/green]")
        for pd in d.prompts:
            if pd.same:
                continue
            out.print(f"[bold]prompt {esc(pd.role)}[/bold] {esc(pd.note or '')}", highlight=False)
            if pd.diff:
                out.print(pd.diff.rstrip("\n"), markup=False, highlight=False)
        for title, changes in (
            ("quantisation", d.quantisation),
            ("serving", d.serving),
            ("model digests", d.model),
            ("other inputs", d.inputs),
        ):
            if changes:
                rows_ = [(c.key, _val(c.a), _val(c.b)) for c in changes]
                table(title, ["key", "a", "b"], rows_)
        if d.adapters:
            table(
                "adapters (rank, digest)",
                ["adapter", "change", "a", "b"],
                [(c.name, c.change, _adapter(c.a), _adapter(c.b)) for c in d.adapters],
            )
        rows = [
            (m.name, _num(m.a), _num(m.b), _num(m.delta, signed=True))
            for m in d.metrics
            if m.a != m.b and is_key_metric(m.name)
        ]
        if rows:
            table("metrics (key figures; --json for all)", ["metric", "a", "b", "b - a"], rows)
        for n in d.notes:
            out.print(f"[yellow]note:[/yellow] {esc(n)}", highlight=False)
    if exit_code and d.differs:
        raise typer.Exit(1)


def _val(v: Any) -> str:
    """A setting for a table: digests shortened to 12 digits (--json has them whole)."""
    if isinstance(v, str) and len(v) == 64 and all(ch in "0123456789abcdef" for ch in v):
        return v[:12]
    return "" if v is None else str(v)


def _adapter(a: AdapterInfo | None) -> str:
    """An adapter in a diff's cell: `r8 1a2b3c4d5e6f` (rank, digest), `-` when absent."""
    if a is None:
        return "-"
    return f"r{_val(a.rank) or '?'} {_val(a.digest)}".strip()


def _num(v: float | None, *, signed: bool = False) -> str:
    if v is None:
        return "-"
    return f"{v:+.4g}" if signed else f"{v:.4g}"


@ledger_app.command("verify")
@handle_errors
def verify_cmd(
    remote: Annotated[
        str | None,
        typer.Option(
            help="also check against the anchor pushed to this git remote, trusting the keys "
            "committed on its default branch, and recompute every decision's policy digest "
            "at its recorded commit (which must be on that branch)"
        ),
    ] = None,
    json_: JsonOpt = False,
) -> None:
    """Check the ledger: the hash chain, every signature, and that it extends every git
    anchor; name the first edited, deleted, re-signed or truncated record (exit 1)."""
    if remote is None:
        res = _ledger().verify()
    else:
        res = verify_with_policies(_ledger(), State.settings().root, remote=remote)
    if json_:
        emit_json(res)
    elif res.ok:
        head = f", head #{res.head_seq} {res.head_hash[:12]}" if res.head_hash else ""
        out.print(
            f"[green]ok[/green] {res.records} records, chain intact{esc(head)}",
            highlight=False,
        )
        keys = f" by {', '.join(res.key_ids)}" if res.key_ids else ""
        out.print(f"  signatures: {esc(res.signing)}{esc(keys)}", highlight=False)
        anchored = f" up to #{res.anchored_seq}" if res.anchored_seq else ""
        out.print(f"  git anchors: {esc(res.anchoring)}{esc(anchored)}", highlight=False)
        for n in res.notes:
            out.print(f"  [dim]{esc(n)}[/dim]", highlight=False)
    else:
        err.print(f"[red]ledger broken:[/red] {esc(res.problem)}", highlight=False)
        for n in res.notes:
            err.print(f"  also: {esc(n)}", highlight=False)
        err.print(
            "  [dim]hint: restore the ledger from a backup; the named record was edited, "
            "deleted, re-signed or truncated[/dim]"
        )
    if not res.ok:
        raise typer.Exit(1)


@ledger_app.command("keygen")
@handle_errors
def keygen_cmd(
    private: Annotated[
        Path | None,
        typer.Option(help="where to write the private key (default .releasekit/keys/<id>.pem)"),
    ] = None,
    json_: JsonOpt = False,
) -> None:
    """Make an Ed25519 signing key: the private key stays out of git, the public key goes
    to keys/<key id>.pub for the team to commit."""
    kp = keygen(State.settings(), private_path=private)
    if json_:
        emit_json(
            {"key_id": kp.key_id, "private": str(kp.private_path), "public": str(kp.public_path)}
        )
        return
    out.print(f"[green]key {kp.key_id}[/green]", highlight=False)
    out.print(
        f"  private: {esc(kp.private_path)} (keep it secret; never commit it)", highlight=False
    )
    out.print(
        f"  public:  {esc(kp.public_path)} (commit it, `git add {esc(kp.public_path)}`, and "
        "land it on the protected ref: it signs once it is there)",
        highlight=False,
    )
    out.print(
        "  elsewhere (CI, release machine): RELEASEKIT_SIGNING_KEY=/path/to/that .pem",
        highlight=False,
    )


@ledger_app.command("anchor")
@handle_errors
def anchor_cmd(json_: JsonOpt = False) -> None:
    """Advance the git anchor (refs/releasekit/ledger) to the ledger's head; push it with
    `git push origin refs/releasekit/ledger`."""
    led = _ledger()
    a = led.anchor()
    if json_:
        emit_json(a.model_dump() if a else {"anchored": False})
        return
    if a is None:
        out.print("the git anchor already covers the ledger's head (or the ledger is empty)")
    else:
        out.print(
            f"[green]anchored[/green] record #{a.seq} {a.hash[:12]} on {esc(a.ref)} "
            f"(commit {(a.commit or '')[:12]})",
            highlight=False,
        )
