"""What diagnose looks up about an environment: the release live there (the ledger), its
bench knee, its most recent live change with the diff against the release before it, and
where its metrics are (the deploy state)."""

from __future__ import annotations

import datetime as dt

from pydantic import BaseModel

from releasekit.capacity.diagnose_inputs import Baseline, ChangeSummary, baseline_from_bench
from releasekit.capacity.errors import CapacityEvidenceError
from releasekit.capacity.evidence import read_bench, release_files
from releasekit.config import Settings
from releasekit.deploy.state import EnvState, read_state
from releasekit.errors import ReleasekitError
from releasekit.releases.queries import ReleaseDiff, diff
from releasekit.stores.ledger import Ledger, LedgerRecord, open_ledger

#: Ledger event types that change what an environment runs.
LIVE_TYPES = ("assign", "promote", "rollback", "deploy", "override")


def _diff_lines(d: ReleaseDiff) -> tuple[list[str], list[str]]:
    lines: list[str] = []
    kinds: list[str] = []
    changed_prompts = [p.role for p in d.prompts if not p.same]
    if changed_prompts:
        kinds.append("prompts")
        lines.append("prompts changed: " + ", ".join(changed_prompts))
    # `identity` (the manifest's name and description) differs between any two releases.
    inputs = [c for c in d.inputs if c.key != "identity"]
    for kind, changes in (
        ("model", d.model),
        ("quantisation", d.quantisation),
        ("serving", d.serving),
        ("inputs", inputs),
    ):
        if not changes:
            continue
        kinds.append(kind)
        shown = []
        for c in changes[:4]:
            if kind == "serving":
                shown.append(f"{c.key} {c.a} -> {c.b}")
            else:
                shown.append(c.key)
        extra = f" (+{len(changes) - 4} more)" if len(changes) > 4 else ""
        lines.append(f"{kind} changed: {', '.join(shown)}{extra}")
    return lines, kinds


def last_change(
    settings: Settings,
    env: str,
    *,
    ledger: Ledger,
    now: dt.datetime | None = None,
) -> ChangeSummary | None:
    """The environment's most recent live change, with what it changed against the release
    before it (releasekit.releases.queries.diff); None when nothing was ever live there."""
    recs: list[LedgerRecord] = ledger.records(
        environment=env, live=True, newest_first=True, limit=1
    )
    if not recs:
        return None
    rec = recs[0]
    now = now or dt.datetime.now(dt.UTC)
    when = rec.time if rec.time.tzinfo else rec.time.replace(tzinfo=dt.UTC)
    summary = ChangeSummary(
        seq=rec.seq,
        event_type=rec.type,
        time=when,
        age_s=max((now - when).total_seconds(), 0.0),
        actor=rec.actor,
        reason=rec.reason,
        from_release=rec.from_release,
        to_release=rec.to_release,
    )
    if rec.from_release and rec.to_release and rec.from_release != rec.to_release:
        summary.diff_command = f"releasekit diff {rec.from_release[:12]} {rec.to_release[:12]}"
        try:
            d = diff(settings, rec.from_release, rec.to_release, ledger=ledger)
        except ReleasekitError as exc:
            summary.notes.append(f"no diff: {exc.message}")
        else:
            summary.changed, summary.kinds = _diff_lines(d)
    elif not rec.from_release:
        summary.notes.append("first release in this environment: nothing to diff against")
    return summary


def live_baseline(settings: Settings, release_id: str) -> tuple[Baseline | None, str | None]:
    """The live release's bench knee, or None and why not (a bench.json that is not as the
    release's register event signed is no reference: its message says which file). For a
    release never registered, the knee with the "unverified" note as the second item."""
    try:
        files = release_files(settings, release_id)
        bench = read_bench(settings, release_id, files)
    except CapacityEvidenceError as exc:
        return None, exc.message
    base = baseline_from_bench(bench)
    if base is None:
        return None, f"release {release_id[:12]}'s load test has no knee"
    return base, files.note


class LiveTargets(BaseModel):
    """Where an environment's metrics are: the live vLLM server's and the gateway's."""

    env: str
    release_id: str | None = None
    vllm_metrics_url: str | None = None
    gateway_metrics_url: str | None = None


def _metrics_url(base: str) -> str:
    return base.rstrip("/") + "/metrics"


def live_targets(settings: Settings, env: str, *, release_id: str | None = None) -> LiveTargets:
    """The /metrics URLs of `env` from the deploy state: the gateway's, and the server the
    gateway routes `release_id` to (or the first live server). Raises DeployStateError when
    the state is unreadable."""
    st: EnvState = read_state(settings.state_dir, env)
    vllm = None
    if release_id is not None:
        route = next((r for r in st.routes if r.release_id == release_id), None)
        if route is not None:
            vllm = route.base_url
        elif (srv := st.server_for(release_id)) is not None:
            vllm = srv.base_url
    if vllm is None and st.live_servers():
        vllm = st.live_servers()[0].base_url
    rec = st.server_for(release_id) if release_id else next(iter(st.live_servers()), None)
    metrics = rec.metrics_url if rec is not None and rec.app else None  # ray: all replicas
    return LiveTargets(
        env=env,
        release_id=release_id,
        vllm_metrics_url=metrics or (_metrics_url(vllm) if vllm else None),
        gateway_metrics_url=_metrics_url(st.gateway.url) if st.gateway else None,
    )


def live_release(settings: Settings, env: str, *, ledger: Ledger | None = None) -> str | None:
    """The release live in `env` per the ledger (None: nothing live, or no ledger yet)."""
    led = ledger or ledger_or_none(settings)
    if led is None:
        return None
    try:
        rec = led.live_at(env)
    finally:
        if ledger is None:
            led.close()
    return None if rec is None else rec.to_release


def ledger_or_none(settings: Settings) -> Ledger | None:
    """The ledger, read-only; None when there is none yet (or it cannot be opened)."""
    try:
        return open_ledger(settings, read_only=True)
    except ReleasekitError:
        return None
