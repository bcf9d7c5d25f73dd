"""Auditor queries: what is live where, the history, what was live at a time, one release in
full, and what changed between two releases. Every function returns a pydantic model."""

from __future__ import annotations

import csv
import datetime as dt
import difflib
import io
import json
import re
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field

from releasekit.config import Settings
from releasekit.errors import (
    LockError,
    ManifestError,
    RegistryError,
    ReleasekitError,
    ReleaseNotFoundError,
)
from releasekit.evidence import (
    BenchPoint,
    CompareSummary,
    EvalSummary,
    Evidence,
    QuantiseSummary,
    read_evidence,
)
from releasekit.ledger import EventType, Ledger, LedgerRecord
from releasekit.lock import (
    SHORT,
    Lock,
    digest_obj,
    lock_path_for,
    quantisation_recipe,
    read_lock,
    serving_args,
    sha256_bytes,
    sha256_file,
)
from releasekit.manifest import LoadedManifest, Manifest, parse_manifest
from releasekit.prompts import read_template, render
from releasekit.provenance import Provenance

_HEX = re.compile(r"^[0-9a-f]{1,64}$")
_REL_TIME = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhdw])(?:\s+ago)?$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


# -- release references ----------------------------------------------------------------------


class ReleaseRef(BaseModel):
    """A resolved release reference: the full id and how the reference named it."""

    release_id: str
    how: str = Field(description="id, prefix, name@version, name@env or manifest")
    name: str | None = None


def parse_time(text: str, *, now: dt.datetime | None = None) -> dt.datetime:
    """Parse an auditor's time: ISO 8601 (`2025-05-01`, `2025-05-01T12:00:00Z`, with offset),
    `now`, or a relative `90m`, `2h ago`, `3d`. Times without a zone are UTC."""
    now = now or dt.datetime.now(dt.UTC)
    s = text.strip()
    if s.lower() == "now":
        return now
    m = _REL_TIME.match(s.lower())
    if m:
        return now - dt.timedelta(seconds=float(m.group(1)) * _UNITS[m.group(2)])
    try:
        t = dt.datetime.fromisoformat(s.replace(" ", "T", 1) if len(s) > 10 else s)
    except ValueError:
        raise ValueError(
            f"not a time: {text!r} (use ISO 8601 like 2025-05-01T12:00:00Z, 'now' or '2h ago')"
        ) from None
    return t.replace(tzinfo=dt.UTC) if t.tzinfo is None else t.astimezone(dt.UTC)


def _open_ledger(settings: Settings, ledger: Ledger | None) -> Ledger:
    return ledger or Ledger(settings.ledger_url or "", actor=settings.actor)


def known_release_ids(settings: Settings, ledger: Ledger) -> set[str]:
    """Release ids with build outputs under results/ or named by any ledger event."""
    ids = set(ledger.release_ids())
    if settings.results_dir.is_dir():
        ids.update(
            p.name
            for p in settings.results_dir.iterdir()
            if p.is_dir() and len(p.name) == 64 and _HEX.match(p.name)
        )
    return ids


def _manifest_ref(settings: Settings, ref: str) -> Path | None:
    for base in (Path.cwd(), settings.root):
        p = Path(ref) if Path(ref).is_absolute() else base / ref
        if p.is_file():
            return p
    return None


def resolve_release(settings: Settings, ref: str, *, ledger: Ledger | None = None) -> ReleaseRef:
    """Resolve a release reference: a full id or a unique prefix of one, `name@version`,
    `name@<environment>` (the release live there), or a manifest path (its lock's id).

    Raises ReleaseNotFoundError when it matches nothing or more than one release.
    """
    led = _open_ledger(settings, ledger)
    text = ref.strip()
    if not text:
        raise ReleaseNotFoundError("empty release reference")
    path = _manifest_ref(settings, text)
    if path is not None or text.endswith((".yaml", ".yml")):
        if path is None:
            raise ReleaseNotFoundError(f"no manifest at {text}")
        try:
            lk = read_lock(lock_path_for(path))
        except LockError as exc:
            raise ReleaseNotFoundError(
                f"{text}: {exc.message}", remedy="run `releasekit lock MANIFEST` first"
            ) from exc
        return ReleaseRef(release_id=lk.release_id, how="manifest", name=lk.name)
    if "@" in text:
        return _resolve_at(settings, text, led)
    low = text.lower()
    if not _HEX.match(low):
        raise ReleaseNotFoundError(
            f"{ref!r} is not a release id, prefix, name@version or manifest path"
        )
    ids = known_release_ids(settings, led)
    if low in ids:
        return ReleaseRef(release_id=low, how="id")
    matches = sorted(i for i in ids if i.startswith(low))
    if len(matches) == 1:
        return ReleaseRef(release_id=matches[0], how="prefix")
    if len(matches) > 1:
        shown = ", ".join(m[:SHORT] for m in matches[:5]) + (" ..." if len(matches) > 5 else "")
        raise ReleaseNotFoundError(
            f"release prefix {ref!r} is ambiguous: {len(matches)} releases match ({shown})",
            remedy="give more digits of the release id",
        )
    if len(low) == 64:
        # Known only to MLflow (registered elsewhere): ask it.
        from releasekit import registry

        try:
            if registry.find_version(settings, low) is not None:
                return ReleaseRef(release_id=low, how="id")
        except RegistryError:
            pass
    raise ReleaseNotFoundError(f"no release matches {ref!r}")


def _resolve_at(settings: Settings, text: str, led: Ledger) -> ReleaseRef:
    name, _, tail = text.rpartition("@")
    if not name or not tail:
        raise ReleaseNotFoundError(f"{text!r}: expected name@version or name@environment")
    if tail.isdigit():
        for rec in led.records(types=[EventType.REGISTER.value], newest_first=True):
            if (
                rec.to_release
                and rec.evidence.get("model_name") == name
                and str(rec.evidence.get("model_version")) == tail
            ):
                return ReleaseRef(release_id=rec.to_release, how="name@version", name=name)
        from releasekit import registry

        try:
            v = registry.get_version(settings, name, tail)
        except RegistryError as exc:
            raise ReleaseNotFoundError(f"cannot look up {text}: {exc.message}") from exc
        if v is not None and v.release_id:
            return ReleaseRef(release_id=v.release_id, how="name@version", name=name)
        raise ReleaseNotFoundError(f"no release is registered as {name} version {tail}")
    live = led.live_at(tail)
    if live is not None and live.to_release and live.evidence.get("model_name") == name:
        return ReleaseRef(release_id=live.to_release, how="name@env", name=name)
    raise ReleaseNotFoundError(f"no release of {name} is live in {tail!r}")


# -- one release's context -------------------------------------------------------------------


@dataclass
class _Context:
    """What can be known about one release from its build outputs, lock and the ledger."""

    release_id: str
    evidence: Evidence
    lock: Lock | None = None
    manifest: Manifest | None = None
    manifest_source: str | None = None
    register: LedgerRecord | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def name(self) -> str | None:
        if self.lock:
            return self.lock.name
        if self.manifest:
            return self.manifest.name
        if self.register:
            return str(self.register.evidence.get("model_name") or "") or None
        return None

    def loaded(self, root: Path) -> LoadedManifest | None:
        if self.manifest is None:
            return None
        return LoadedManifest(
            path=root / (self.manifest_source or "manifest.yaml"), base=root, manifest=self.manifest
        )


def _parse_manifest_file(path: Path) -> Manifest | None:
    try:
        return parse_manifest(yaml.safe_load(path.read_text(encoding="utf-8")), path=path)
    except (OSError, UnicodeDecodeError, yaml.YAMLError, ManifestError):
        return None


def _context(settings: Settings, release_id: str, led: Ledger) -> _Context:
    ev = read_evidence(settings, release_id)
    ctx = _Context(release_id=release_id, evidence=ev, lock=ev.lock)
    regs = led.records(
        release=release_id, types=[EventType.REGISTER.value], newest_first=True, limit=1
    )
    ctx.register = regs[0] if regs else None
    manifest_rel = ctx.lock.manifest if ctx.lock else None
    if manifest_rel is None and ctx.register is not None:
        manifest_rel = ctx.register.evidence.get("manifest")
    if ctx.lock is None and manifest_rel:
        try:
            lk = read_lock(lock_path_for(settings.root / str(manifest_rel)))
            if lk.release_id == release_id:
                ctx.lock = lk
        except LockError:
            pass
    copy = ev.path("manifest")
    if copy is not None:
        ctx.manifest = _parse_manifest_file(copy)
        ctx.manifest_source = (
            f"{settings.release_dir(release_id).relative_to(settings.root)}/{copy.name}"
            if copy.is_relative_to(settings.root)
            else str(copy)
        )
    elif manifest_rel:
        path = settings.root / str(manifest_rel)
        if path.is_file():
            ctx.manifest = _parse_manifest_file(path)
            ctx.manifest_source = str(manifest_rel)
            if ctx.lock and sha256_file(path) != ctx.lock.manifest_digest:
                ctx.notes.append(
                    f"{manifest_rel} changed since the lock; only parts whose digests still "
                    "match the lock are shown"
                )
    if ctx.manifest is None:
        ctx.notes.append("manifest not available")
    return ctx


def release_manifest(
    settings: Settings, release_id: str, *, ledger: Ledger | None = None
) -> Manifest | None:
    """The manifest a release was built from, if its copy or its file can still be read."""
    return _context(settings, release_id, _open_ledger(settings, ledger)).manifest


def report_digests(settings: Settings, release_id: str) -> dict[str, str]:
    """sha256 of each build output the release has (relative path -> digest)."""
    return read_evidence(settings, release_id).digests


def _prompt_texts(settings: Settings, ctx: _Context) -> dict[str, str | None]:
    """Role -> prompt text the release was locked with (None where it cannot be recovered)."""
    roles: dict[str, str | None] = {}
    locked = {
        k.split("/", 1)[1]: v
        for k, v in (ctx.lock.inputs if ctx.lock else {}).items()
        if k.startswith("prompt/")
    }
    lm = ctx.loaded(settings.root)
    if lm is not None:
        for role in ("system", "user"):
            pf = getattr(lm.manifest.prompts, role)
            if pf is None:
                continue
            try:
                text: str | None = render(read_template(lm.resolve(pf.file)), pf.variables)
            except (ReleasekitError, OSError, UnicodeDecodeError):
                text = None
            if text is not None and role in locked and sha256_bytes(text.encode()) != locked[role]:
                text = None  # the file changed since the lock: not this release's text
            roles[role] = text
    for role in locked:
        roles.setdefault(role, None)
    missing = [r for r, t in roles.items() if t is None]
    uri = ctx.register.evidence.get("prompt_uri") if ctx.register else None
    if missing and uri:
        from releasekit import registry

        try:
            msgs = registry.prompt_messages(settings, str(uri))
        except RegistryError:
            msgs = []
        for m in msgs:
            if m["role"] in missing and (
                m["role"] not in locked or sha256_bytes(m["content"].encode()) == locked[m["role"]]
            ):
                roles[m["role"]] = m["content"]
    return roles


def _verified(ctx: _Context, key: str, value: Any) -> Any:
    """`value` if it matches the lock's digest for `key` (or there is no lock), else None."""
    if ctx.lock is None or key not in ctx.lock.inputs:
        return value
    return value if digest_obj(value) == ctx.lock.inputs[key] else None


def _recipe(ctx: _Context) -> dict[str, Any] | None:
    if ctx.manifest is None:
        return None
    out: dict[str, Any] | None = _verified(
        ctx, "quantisation/recipe", quantisation_recipe(ctx.manifest)
    )
    return out


def _serving(ctx: _Context) -> dict[str, Any] | None:
    if ctx.manifest is None:
        return None
    value = {
        "args": serving_args(ctx.manifest),
        "env": dict(sorted(ctx.manifest.serving.env.items())),
    }
    out: dict[str, Any] | None = _verified(ctx, "serving", value)
    return out


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
    """Ledger events, filtered by environment, release (any reference form), time range
    (inclusive) and type."""
    led = _open_ledger(settings, ledger)
    rid = resolve_release(settings, release, ledger=led).release_id if release else None
    events = led.records(environment=env, release=rid, since=since, until=until, types=types)
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


class ReleaseDetail(BaseModel):
    """One release in full: manifest, lock digests, provenance, MLflow links, eval and bench
    summaries, where it is live, and its whole event trail."""

    release_id: str
    short_id: str
    name: str | None = None
    manifest_source: str | None = None
    manifest: dict[str, Any] | None = None
    inputs: dict[str, str] = Field(default_factory=dict)
    provenance: Provenance | None = None
    locked_at: str | None = None
    registry: RegistryLinks | None = None
    eval: EvalSummary | None = None
    bench_knee: BenchPoint | None = None
    bench_points: int = 0
    quantise: QuantiseSummary | None = None
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
    notes = list(ctx.notes) + list(ev.problems)
    return ReleaseDetail(
        release_id=rid,
        short_id=rid[:SHORT],
        name=ctx.name,
        manifest_source=ctx.manifest_source,
        manifest=ctx.manifest.model_dump(mode="json", by_alias=True) if ctx.manifest else None,
        inputs=ctx.lock.inputs if ctx.lock else {},
        provenance=ctx.lock.provenance if ctx.lock else None,
        locked_at=ctx.lock.locked_at if ctx.lock else None,
        registry=_links(ctx.register),
        eval=ev.eval,
        bench_knee=ev.bench.knee if ev.bench else None,
        bench_points=len(ev.bench.points) if ev.bench else 0,
        quantise=ev.quantise,
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
    inputs: list[FieldChange] = Field(default_factory=list)
    metrics: list[MetricDelta] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)


def _flat(prefix: str, obj: Any, out: dict[str, Any]) -> dict[str, Any]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            _flat(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = obj
    return out


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
    model digests, other inputs, and eval/bench/quantise metrics side by side."""
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
    qa = _flat("recipe", _recipe(ca) or {}, {})
    qb = _flat("recipe", _recipe(cb) or {}, {})
    for ctx, out in ((ca, qa), (cb, qb)):
        if ctx.evidence.quantise:
            _flat("result", ctx.evidence.quantise.model_dump(exclude={"model_dir", "seconds"}), out)
    quant = _changes(qa, qb)

    sa, sb = _serving(ca), _serving(cb)
    serving = _changes(_flat("", sa or {}, {}), _flat("", sb or {}, {}))
    if (sa is None or sb is None) and ia.get("serving") != ib.get("serving"):
        serving.append(
            FieldChange(key="serving (digest)", a=ia.get("serving"), b=ib.get("serving"))
        )

    def is_model(k: str) -> bool:
        return k.startswith("model/") or k == "chat_template"

    model = _changes(
        {k: v for k, v in ia.items() if is_model(k)}, {k: v for k, v in ib.items() if is_model(k)}
    )
    shown = ("prompt/", "serving", "quantisation/recipe")
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
        inputs=other,
        metrics=metrics,
        notes=notes,
    )
