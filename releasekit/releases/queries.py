"""Auditor queries: what is live where, the history, what was live at a time, one release in
full, and what changed between two releases. Every function returns a pydantic model."""

from __future__ import annotations

import csv
import datetime as dt
import difflib
import io
import json
import urllib.parse
from typing import Any

from pydantic import BaseModel, Field

from releasekit._support.digests import sha256_bytes
from releasekit._support.text import flatten
from releasekit.config import Settings
from releasekit.config.lanes import is_lane
from releasekit.releases.adapter_view import (
    AdapterChange,
    AdapterInfo,
    adapter_changes,
    registered_adapters,
    release_adapters,
)
from releasekit.releases.context import _Context, _context, _prompt_texts, _recipe, _serving
from releasekit.releases.resolve import _open_ledger, resolve_release
from releasekit.spec.lock import (
    SHORT,
)
from releasekit.spec.provenance import Provenance
from releasekit.stores.evidence import (
    BenchPoint,
    CompareSummary,
    EvalSummary,
    MadeOn,
    QuantiseSummary,
    read_evidence,
)
from releasekit.stores.ledger import Ledger, LedgerRecord

# -- release references ----------------------------------------------------------------------


# -- one release's context -------------------------------------------------------------------


# -- status, history, at ---------------------------------------------------------------------


class EnvStatus(BaseModel):
    """What runs in one environment, since when and by whom."""

    environment: str
    release_id: str | None
    model_name: str | None = None
    model_version: str | None = None
    since: dt.datetime
    actor: str
    event_type: str
    reason: str
    seq: int
    event_id: str


class StatusReport(BaseModel):
    """Every environment the ledger knows, with its live release."""

    environments: list[EnvStatus]


def _env_status(rec: LedgerRecord) -> EnvStatus:
    mv = rec.evidence.get("model_version")
    return EnvStatus(
        environment=rec.environment or "",
        release_id=rec.to_release,
        model_name=rec.evidence.get("model_name"),
        model_version=None if mv is None else str(mv),
        since=rec.time,
        actor=rec.actor,
        event_type=rec.type,
        reason=rec.reason,
        seq=rec.seq,
        event_id=rec.event_id,
    )


def status(settings: Settings, *, ledger: Ledger | None = None) -> StatusReport:
    """What is live in each environment (from the ledger), since when, by whom."""
    led = _open_ledger(settings, ledger)
    return StatusReport(environments=[_env_status(r) for r in led.current()])


_CSV_FIELDS = [
    "seq",
    "time",
    "type",
    "environment",
    "from_release",
    "to_release",
    "actor",
    "reason",
    "evidence",
    "live",
    "event_id",
    "prev_hash",
    "hash",
]


class HistoryReport(BaseModel):
    """Ledger events matching the filters, oldest first."""

    environment: str | None = None
    release_id: str | None = None
    since: dt.datetime | None = None
    until: dt.datetime | None = None
    events: list[LedgerRecord]

    def to_csv(self) -> str:
        """The events as CSV (evidence as JSON in one column)."""
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=_CSV_FIELDS, lineterminator="\n")
        w.writeheader()
        for e in self.events:
            row = e.model_dump(mode="json")
            row["evidence"] = json.dumps(row["evidence"], sort_keys=True, separators=(",", ":"))
            w.writerow({k: row[k] for k in _CSV_FIELDS})
        return buf.getvalue()


class EventGates(BaseModel):
    """What decided a promotion event beyond its passed gates, read from its evidence: the
    failed gates that were advisory there, the failed gates an override carried, and the
    environment policy's source when it was not the committed one."""

    advisory: list[str] = Field(default_factory=list)
    overridden: list[str] = Field(default_factory=list)
    policy: str | None = Field(
        None, description="the policy's source when not committed, or the fields that differed"
    )

    @property
    def empty(self) -> bool:
        """Nothing to show beside the event."""
        return not (self.advisory or self.overridden or self.policy)


def event_gates(evidence: dict[str, Any]) -> EventGates:
    """The advisory and overridden gates and the policy source of one event's evidence."""
    gates = evidence.get("gates")
    advisory = gates.get("advisory_failed") if isinstance(gates, dict) else None
    overridden = evidence.get("overrode")
    policy = evidence.get("policy")
    where: str | None = None
    if isinstance(policy, dict):
        raw = policy.get("source")
        source: dict[str, Any] = raw if isinstance(raw, dict) else {}
        differs = policy.get("differs_from_committed")
        if differs:
            where = f"differed from the committed policy in {', '.join(map(str, differs))}"
        elif source.get("kind") == "uncommitted":
            note = source.get("note")
            where = "uncommitted" + (f" ({note})" if note else "")
    return EventGates(
        advisory=[str(g) for g in advisory] if isinstance(advisory, list) else [],
        overridden=[str(g) for g in overridden] if isinstance(overridden, list) else [],
        policy=where,
    )


def history(
    settings: Settings,
    *,
    env: str | None = None,
    release: str | None = None,
    since: dt.datetime | None = None,
    until: dt.datetime | None = None,
    types: list[str] | None = None,
    limit: int | None = None,
    ledger: Ledger | None = None,
) -> HistoryReport:
    """Ledger events, filtered by environment (an environment's own and its adapter lanes';
    a lane's name, `<env>:<adapter>`, that lane's only), release (any reference form), time
    range (inclusive) and type."""
    led = _open_ledger(settings, ledger)
    rid = resolve_release(settings, release, ledger=led).release_id if release else None
    events = led.records(
        environment=env,
        release=rid,
        since=since,
        until=until,
        types=types,
        with_lanes=env is not None and not is_lane(env),
    )
    if limit is not None:
        events = events[-limit:] if limit > 0 else []
    return HistoryReport(environment=env, release_id=rid, since=since, until=until, events=events)


class AtResult(BaseModel):
    """The release live in an environment at a time, the event that put it there, and its
    evidence. `release_id` is None when nothing was live there yet."""

    environment: str
    time: dt.datetime
    release_id: str | None = None
    model_name: str | None = None
    model_version: str | None = None
    record: LedgerRecord | None = None
    evidence: dict[str, Any] = Field(default_factory=dict)
    metrics: dict[str, float] = Field(default_factory=dict)


def at(
    settings: Settings, env: str, when: dt.datetime, *, ledger: Ledger | None = None
) -> AtResult:
    """What was live in `env` at `when`: the release, the event that put it there (who,
    why, on what evidence) and the release's build metrics."""
    led = _open_ledger(settings, ledger)
    rec = led.live_at(env, when)
    when = when if when.tzinfo else when.replace(tzinfo=dt.UTC)
    if rec is None:
        return AtResult(environment=env, time=when)
    mv = rec.evidence.get("model_version")
    metrics = read_evidence(settings, rec.to_release).metrics if rec.to_release else {}
    return AtResult(
        environment=env,
        time=when,
        release_id=rec.to_release,
        model_name=rec.evidence.get("model_name"),
        model_version=None if mv is None else str(mv),
        record=rec,
        evidence=rec.evidence,
        metrics=metrics,
    )


# -- show ------------------------------------------------------------------------------------


class RegistryLinks(BaseModel):
    """Where the release lives in MLflow (from its register event)."""

    model_name: str | None = None
    model_version: str | None = None
    model_uri: str | None = None
    run_id: str | None = None
    experiment_id: str | None = None
    prompt_uri: str | None = None
    tracking_uri: str | None = None
    run_url: str | None = None
    model_url: str | None = None


class ServedWeights(BaseModel):
    """The weights a release serves: their digest (as its register event signed it, else
    as quantise.json records it), the quantisation scheme and the host kind that made them."""

    digest: str | None = Field(None, description="sha256 over the served weight files")
    scheme: str | None = None
    made_on: MadeOn | None = Field(
        None, description="the host kind that quantised them (None: not quantised, or unrecorded)"
    )
    signed_seq: int | None = Field(
        None, description="seq of the verified register event that signed the digest"
    )

    @property
    def short(self) -> str:
        """The digest's first 12 hex digits ('' when unknown)."""
        return (self.digest or "")[:SHORT]


def _served_weights(ctx: _Context) -> tuple[ServedWeights | None, list[str]]:
    """The release's served weights and what a reader must know about them (notes)."""
    notes: list[str] = []
    signed = ctx.signed
    bad_file = signed.file_problem("quantise") if signed is not None else None
    q = ctx.evidence.quantise if bad_file is None else None
    if bad_file is not None:
        notes.append(f"weights not read from quantise.json: {bad_file}")
    scheme = q.scheme if q is not None else None
    if scheme is None and ctx.manifest is not None:
        scheme = ctx.manifest.quantisation.scheme
    if signed is not None and signed.registered and signed.weights_digest is not None:
        w = ServedWeights(
            digest=signed.weights_digest,
            scheme=scheme,
            made_on=signed.weights_made_on,
            signed_seq=signed.register_seq,
        )
        if q is not None and q.weights_digest not in (None, w.digest):
            notes.append(
                f"quantise.json's weights digest {str(q.weights_digest)[:SHORT]} is not the "
                f"{w.short} register event #{w.signed_seq} signed"
            )
        return w, notes
    if q is None:
        return None, notes
    made_on = q.made_on if q.quantised else None
    return ServedWeights(digest=q.weights_digest, scheme=scheme, made_on=made_on), notes


class ReleaseDetail(BaseModel):
    """One release in full: manifest, lock digests, provenance, MLflow links, eval and bench
    summaries, where it is live, and its whole event trail."""

    release_id: str
    short_id: str
    name: str | None = None
    manifest_source: str | None = None
    manifest: dict[str, Any] | None = None
    inputs: dict[str, str] = Field(default_factory=dict)
    adapters: list[AdapterInfo] = Field(
        default_factory=list, description="its LoRA adapters (manifest and lock)"
    )
    provenance: Provenance | None = None
    locked_at: str | None = None
    registry: RegistryLinks | None = None
    eval: EvalSummary | None = None
    bench_knee: BenchPoint | None = None
    bench_points: int = 0
    quantise: QuantiseSummary | None = None
    weights: ServedWeights | None = None
    compare: CompareSummary | None = None
    metrics: dict[str, float] = Field(default_factory=dict)
    files: dict[str, str] = Field(default_factory=dict, description="build output -> sha256")
    missing: list[str] = Field(default_factory=list)
    live_in: list[str] = Field(default_factory=list)
    events: list[LedgerRecord] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)


def _links(reg: LedgerRecord | None) -> RegistryLinks | None:
    if reg is None:
        return None
    e = reg.evidence
    links = RegistryLinks(
        model_name=e.get("model_name"),
        model_version=None if e.get("model_version") is None else str(e.get("model_version")),
        model_uri=e.get("model_uri"),
        run_id=e.get("mlflow_run_id"),
        experiment_id=e.get("mlflow_experiment_id"),
        prompt_uri=e.get("prompt_uri"),
        tracking_uri=e.get("tracking_uri"),
    )
    uri = links.tracking_uri or ""
    if urllib.parse.urlsplit(uri).scheme in {"http", "https"}:
        base = uri.rstrip("/")
        if links.run_id and links.experiment_id:
            links.run_url = f"{base}/#/experiments/{links.experiment_id}/runs/{links.run_id}"
        if links.model_name and links.model_version:
            links.model_url = f"{base}/#/models/{links.model_name}/versions/{links.model_version}"
    return links


def show(settings: Settings, ref: str, *, ledger: Ledger | None = None) -> ReleaseDetail:
    """Everything known about one release (no MLflow call: links come from the ledger)."""
    led = _open_ledger(settings, ledger)
    rid = resolve_release(settings, ref, ledger=led).release_id
    ctx = _context(settings, rid, led)
    ev = ctx.evidence
    live_in = sorted(r.environment or "" for r in led.current() if r.to_release == rid)
    weights, weight_notes = _served_weights(ctx)
    notes = list(ctx.notes) + list(ev.problems) + weight_notes
    return ReleaseDetail(
        release_id=rid,
        short_id=rid[:SHORT],
        name=ctx.name,
        manifest_source=ctx.manifest_source,
        manifest=ctx.manifest.model_dump(mode="json", by_alias=True) if ctx.manifest else None,
        inputs=ctx.lock.inputs if ctx.lock else {},
        adapters=release_adapters(
            ctx.manifest,
            ctx.lock.inputs if ctx.lock else {},
            registered_adapters(ctx.register.evidence if ctx.register else None),
        ),
        provenance=ctx.lock.provenance if ctx.lock else None,
        locked_at=ctx.lock.locked_at if ctx.lock else None,
        registry=_links(ctx.register),
        eval=ev.eval,
        bench_knee=ev.bench.knee if ev.bench else None,
        bench_points=len(ev.bench.points) if ev.bench else 0,
        quantise=ev.quantise,
        weights=weights,
        compare=ev.compare,
        metrics=ev.metrics,
        files=ev.digests,
        missing=ev.missing,
        live_in=live_in,
        events=led.records(release=rid),
        notes=notes,
    )


# -- diff ------------------------------------------------------------------------------------


class FieldChange(BaseModel):
    """One setting that differs (None: absent on that side)."""

    key: str
    a: Any = None
    b: Any = None


class PromptDiff(BaseModel):
    """One prompt role compared; `diff` is a unified diff when both texts are known."""

    role: str
    same: bool
    a_digest: str | None = None
    b_digest: str | None = None
    diff: str = ""
    note: str | None = None


class MetricDelta(BaseModel):
    """One build metric side by side; `delta` = b - a when both exist."""

    name: str
    a: float | None = None
    b: float | None = None
    delta: float | None = None


class ReleaseSide(BaseModel):
    """One side of a diff."""

    release_id: str
    short_id: str
    name: str | None = None
    model_version: str | None = None


class ReleaseDiff(BaseModel):
    """What differs between releases a and b. `differs` is about inputs (what defines a
    release); metric deltas are reported alongside and do not set it."""

    a: ReleaseSide
    b: ReleaseSide
    differs: bool
    prompts: list[PromptDiff] = Field(default_factory=list)
    quantisation: list[FieldChange] = Field(default_factory=list)
    serving: list[FieldChange] = Field(default_factory=list)
    model: list[FieldChange] = Field(default_factory=list)
    adapters: list[AdapterChange] = Field(
        default_factory=list, description="adapters added, removed or changed"
    )
    inputs: list[FieldChange] = Field(default_factory=list)
    metrics: list[MetricDelta] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)


def _changes(a: dict[str, Any], b: dict[str, Any]) -> list[FieldChange]:
    return [
        FieldChange(key=k, a=a.get(k), b=b.get(k))
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k)
    ]


def _side(ctx: _Context) -> ReleaseSide:
    mv = ctx.register.evidence.get("model_version") if ctx.register else None
    return ReleaseSide(
        release_id=ctx.release_id,
        short_id=ctx.release_id[:SHORT],
        name=ctx.name,
        model_version=None if mv is None else str(mv),
    )


def diff(settings: Settings, a: str, b: str, *, ledger: Ledger | None = None) -> ReleaseDiff:
    """Compare two releases: prompt text (unified diff), quantisation, serving arguments,
    model digests, adapters, other inputs, and eval/bench/quantise metrics side by side."""
    led = _open_ledger(settings, ledger)
    ca = _context(settings, resolve_release(settings, a, ledger=led).release_id, led)
    cb = _context(settings, resolve_release(settings, b, ledger=led).release_id, led)
    notes = [f"a: {n}" for n in ca.notes] + [f"b: {n}" for n in cb.notes]
    ia = ca.lock.inputs if ca.lock else {}
    ib = cb.lock.inputs if cb.lock else {}
    if not ca.lock or not cb.lock:
        notes.append("a lock is missing: input digests are compared only where known")

    # prompts
    ta, tb = _prompt_texts(settings, ca), _prompt_texts(settings, cb)
    prompts: list[PromptDiff] = []
    for role in sorted(set(ta) | set(tb) | {k[7:] for k in (*ia, *ib) if k.startswith("prompt/")}):
        da, db = ia.get(f"prompt/{role}"), ib.get(f"prompt/{role}")
        xa, xb = ta.get(role), tb.get(role)
        da = da or (sha256_bytes(xa.encode()) if xa is not None else None)
        db = db or (sha256_bytes(xb.encode()) if xb is not None else None)
        same = da == db and da is not None
        pd = PromptDiff(role=role, same=same, a_digest=da, b_digest=db)
        if not same:
            if xa is not None or xb is not None:
                if (xa is None) != (xb is None) and da and db:
                    pd.note = "prompt text unavailable on one side; digests differ"
                pd.diff = "".join(
                    difflib.unified_diff(
                        (xa or "").splitlines(keepends=True),
                        (xb or "").splitlines(keepends=True),
                        fromfile=f"{ca.release_id[:SHORT]}/{role}",
                        tofile=f"{cb.release_id[:SHORT]}/{role}",
                    )
                )
            else:
                pd.note = "prompt text unavailable; digests differ"
        prompts.append(pd)

    # quantisation: the recipe plus what quantise.json reports
    qa = flatten(_recipe(ca) or {}, "recipe")
    qb = flatten(_recipe(cb) or {}, "recipe")
    for ctx, out in ((ca, qa), (cb, qb)):
        if ctx.evidence.quantise:
            out.update(
                flatten(
                    ctx.evidence.quantise.model_dump(exclude={"model_dir", "seconds"}), "result"
                )
            )
    quant = _changes(qa, qb)

    sa, sb = _serving(ca), _serving(cb)
    serving = _changes(flatten(sa or {}), flatten(sb or {}))
    if (sa is None or sb is None) and ia.get("serving") != ib.get("serving"):
        serving.append(
            FieldChange(key="serving (digest)", a=ia.get("serving"), b=ib.get("serving"))
        )

    def is_model(k: str) -> bool:
        return k.startswith("model/") or k == "chat_template"

    model = _changes(
        {k: v for k, v in ia.items() if is_model(k)}, {k: v for k, v in ib.items() if is_model(k)}
    )
    adapters = adapter_changes(release_adapters(ca.manifest, ia), release_adapters(cb.manifest, ib))
    shown = ("prompt/", "serving", "quantisation/recipe", "adapter/")
    other = _changes(
        {k: v for k, v in ia.items() if not is_model(k) and not k.startswith(shown)},
        {k: v for k, v in ib.items() if not is_model(k) and not k.startswith(shown)},
    )

    ma, mb = ca.evidence.metrics, cb.evidence.metrics
    metrics = []
    for name in sorted(set(ma) | set(mb)):
        va, vb = ma.get(name), mb.get(name)
        metrics.append(
            MetricDelta(
                name=name,
                a=va,
                b=vb,
                delta=(vb - va) if va is not None and vb is not None else None,
            )
        )

    differs = ca.release_id != cb.release_id
    return ReleaseDiff(
        a=_side(ca),
        b=_side(cb),
        differs=differs,
        prompts=prompts,
        quantisation=quant,
        serving=serving,
        model=model,
        adapters=adapters,
        inputs=other,
        metrics=metrics,
        notes=notes,
    )
