"""Register a release: one MLflow run and model version per release id, prompts in the
prompt registry, a ledger event; idempotent."""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from releasekit._support.digests import sha256_bytes
from releasekit._support.text import flatten, redact_url
from releasekit.config import Settings
from releasekit.errors import LockError, RegistryError
from releasekit.spec.lock import Lock, lock_path_for, read_lock
from releasekit.spec.manifest import LoadedManifest, load_manifest
from releasekit.spec.prompts import read_template, render
from releasekit.spec.provenance import actor as provenance_actor
from releasekit.stores.evidence import (
    FILES,
    Evidence,
    QuantiseSummary,
    read_evidence,
    sweep_series,
)
from releasekit.stores.ledger import Event, EventType, Ledger, open_ledger
from releasekit.stores.mlflow import (
    _MAX_KEY,
    _MAX_PARAM_VALUE,
    _PARAM_KEY,
    LINKED_PROMPTS,
    TAG_BUILDER,
    TAG_COMMIT,
    TAG_MANIFEST,
    TAG_PROMPT,
    TAG_RELEASE,
    TAG_RUN,
    _ensure_registered_model,
    _experiment,
    _link_prompt_to_experiment,
    _prompt_version,
    _search_versions,
    client_for,
    mlflow_errors,
    tracking_uri,
)

if TYPE_CHECKING:
    from mlflow import MlflowClient


Progress = Callable[[str], None]
REGISTER_LOCK_TIMEOUT_S = 900.0  # a concurrent register of the same release may log for a while


class RegisterResult(BaseModel):
    """A release as registered in MLflow; `created` is False when it already was."""

    release_id: str
    model_name: str
    version: str
    run_id: str
    created: bool
    experiment_id: str | None = None
    model_uri: str = Field(description="models:/<name>/<version>")
    logged_model_id: str | None = None
    prompt_uri: str | None = None
    tracking_uri: str
    ledger_seq: int | None = Field(None, description="seq of the register event, if written now")
    warnings: list[str] = Field(
        default_factory=list, description="what did not stop it (e.g. the git anchor)"
    )


def release_prompts(lm: LoadedManifest, lk: Lock) -> list[dict[str, str]]:
    """The release's chat messages (manifest variables bound), checked against the lock's
    digests so MLflow never records prompt text the release was not locked with."""
    messages: list[dict[str, str]] = []
    for role in ("system", "user"):
        pf = getattr(lm.manifest.prompts, role)
        if pf is None:
            continue
        text = render(read_template(lm.resolve(pf.file)), pf.variables)
        locked = lk.inputs.get(f"prompt/{role}")
        if locked != sha256_bytes(text.encode()):
            raise LockError(
                f"{lm.path}: prompt '{role}' ({pf.file}) changed since the lock; the text "
                "does not match the locked release",
                remedy="run `releasekit lock MANIFEST` (a new release) or restore the prompt file",
            )
        messages.append({"role": role, "content": text})
    return messages


def release_params(lm: LoadedManifest, lk: Lock) -> dict[str, str]:
    """MLflow params of a release: the flattened manifest and every lock digest."""
    raw: dict[str, str] = {}
    raw.update(
        flatten(lm.manifest.model_dump(mode="json", by_alias=True), "manifest", as_text=True)
    )
    raw.update(flatten(lk.inputs, "lock.inputs", as_text=True))
    raw["lock.release_id"] = lk.release_id
    raw["lock.manifest_digest"] = lk.manifest_digest
    out: dict[str, str] = {}
    for k, v in raw.items():
        key = _PARAM_KEY.sub("_", k)[:_MAX_KEY]
        out[key] = v if len(v) <= _MAX_PARAM_VALUE else v[: _MAX_PARAM_VALUE - 3] + "..."
    return out


def _artifacts(lm: LoadedManifest, ev: Evidence) -> list[tuple[Path, str | None]]:
    """(local file, artifact folder) pairs: the release's manifest, lock and reports."""
    out: list[tuple[Path, str | None]] = []
    out.append((ev.path("manifest") or lm.path, "release"))
    out.append((ev.path("lock") or lock_path_for(lm.path), "release"))
    for key in (
        "quantise",
        "eval",
        "eval_items",
        "bench",
        "bench_plot",
        "compare",
        "report_md",
        "report_html",
    ):
        p = ev.path(key)
        if p is not None:
            folder = str(Path(FILES[key]).parent)
            out.append((p, None if folder == "." else folder))
    return out


def _log_run(
    client: MlflowClient,
    exp_id: str,
    lm: LoadedManifest,
    lk: Lock,
    ev: Evidence,
    messages: list[dict[str, str]],
    builder: str,
) -> str:
    from mlflow.entities import Metric, Param

    name = lm.manifest.name
    tags = {
        TAG_RELEASE: lk.release_id,
        TAG_MANIFEST: lk.manifest,
        TAG_BUILDER: builder,
        "mlflow.runName": f"{name}-{lk.short_id}",
        "mlflow.user": builder,
        "mlflow.note.content": lm.manifest.description or f"release {lk.release_id}",
    }
    if lk.provenance.commit:
        tags[TAG_COMMIT] = lk.provenance.commit
        tags["mlflow.source.git.commit"] = lk.provenance.commit
    if lk.provenance.branch:
        tags["mlflow.source.git.branch"] = lk.provenance.branch
    run = client.create_run(exp_id, tags=tags)
    run_id: str = run.info.run_id
    try:
        params = [Param(k, v) for k, v in release_params(lm, lk).items()]
        for i in range(0, len(params), 100):
            client.log_batch(run_id, params=params[i : i + 100])
        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, 0) for k, v in ev.metrics.items()]
        metrics += [Metric(k, v, now, step) for k, v, step in sweep_series(ev)]
        for i in range(0, len(metrics), 1000):
            client.log_batch(run_id, metrics=metrics[i : i + 1000])
        for path, folder in _artifacts(lm, ev):
            client.log_artifact(run_id, str(path), folder)
        with tempfile.TemporaryDirectory() as tmp:
            for m in messages:
                p = Path(tmp) / f"{m['role']}.txt"
                p.write_text(m["content"], encoding="utf-8")
                client.log_artifact(run_id, str(p), "prompts")
        client.set_terminated(run_id, "FINISHED")
    except BaseException:
        client.set_terminated(run_id, "FAILED")
        raise
    return run_id


def _register_event_exists(led: Ledger, release_id: str) -> bool:
    return bool(led.records(release=release_id, types=[EventType.REGISTER.value], limit=1))


def register_release(
    settings: Settings,
    manifest_path: Path | str,
    *,
    ledger: Ledger | None = None,
    progress: Progress | None = None,
) -> RegisterResult:
    """Register a locked (and ideally built) release in MLflow and record it in the ledger.

    One run (params: flattened manifest and lock digests; metrics: eval and bench figures;
    artifacts: manifest, lock, reports, bench JSON and plot), the prompts in the prompt
    registry, and a version of the registered model named after the manifest, tagged with
    release_id, git_commit, builder and run_id. Registering the same release id again
    returns the existing version (created=False) and writes nothing; two processes
    registering one release at once serialise on the release's lock in the ledger database
    and yield one model version.
    """
    say = progress or (lambda _msg: None)
    lm = load_manifest(manifest_path, root=settings.root)
    lk = read_lock(lock_path_for(lm.path))
    name = lm.manifest.name
    if lk.name != name:
        raise LockError(f"{lock_path_for(lm.path)} belongs to manifest '{lk.name}', not '{name}'")
    messages = release_prompts(lm, lk)
    rid = lk.release_id
    uri = tracking_uri(settings)
    client = client_for(settings)
    led = ledger or open_ledger(settings)
    builder = provenance_actor(settings.root, settings.actor)
    with led.lock(f"release:{rid}", timeout_s=REGISTER_LOCK_TIMEOUT_S):
        # Check-then-create under the release's lock: a second registerer waits here, then
        # finds the version the first one made.
        res = _register_locked(settings, lm, lk, messages, client, led, builder, uri, say)
    return res.model_copy(update={"warnings": list(led.warnings)})


def _register_locked(
    settings: Settings,
    lm: LoadedManifest,
    lk: Lock,
    messages: list[dict[str, str]],
    client: MlflowClient,
    led: Ledger,
    builder: str,
    uri: str,
    say: Progress,
) -> RegisterResult:
    rid = lk.release_id
    name = lm.manifest.name
    what = f"registering {name} release {lk.short_id} at {redact_url(uri)}"
    with mlflow_errors(what, uri=uri):
        existing = _search_versions(client, rid, name)
    if existing:
        v = existing[0]
        result = RegisterResult(
            release_id=rid,
            model_name=name,
            version=v.version,
            run_id=v.run_id or "",
            created=False,
            model_uri=v.model_uri,
            prompt_uri=v.tags.get(TAG_PROMPT),
            logged_model_id=v.tags.get("logged_model_id"),
            tracking_uri=redact_url(uri),
        )
        if not _register_event_exists(led, rid):
            # A crash between creating the version and recording it: record it now, with
            # the digests of its evidence as the first attempt would have signed them.
            ev = _evidence_to_sign(settings, lk)
            rec = led.append(_register_event(result, lk, ev, builder))
            result = result.model_copy(update={"ledger_seq": rec.seq})
        return result

    ev = _evidence_to_sign(settings, lk)
    with mlflow_errors(what, uri=uri):
        exp_id = _experiment(client, settings, name)
        say("logging run")
        prior = client.search_runs(
            [exp_id],
            filter_string=f"tags.{TAG_RELEASE} = '{rid}' and attributes.status = 'FINISHED'",
            max_results=1,
        )
        run_id = (
            prior[0].info.run_id
            if prior
            else _log_run(client, exp_id, lm, lk, ev, messages, builder)
        )
        say("registering prompts")
        pv = _prompt_version(client, f"{name}.chat", messages, rid)
        linked = json.dumps([{"name": pv.name, "version": str(pv.version)}])
        # MlflowClient.link_prompt_version_to_run/_model use the *global* tracking URI, not
        # this client's; set MLflow's own link tag directly instead.
        client.set_tag(run_id, LINKED_PROMPTS, linked)
        _link_prompt_to_experiment(client, pv.name, exp_id)
        lm_model = client.create_logged_model(
            exp_id,
            name=name,
            source_run_id=run_id,
            tags={TAG_RELEASE: rid, LINKED_PROMPTS: linked},
        )
        for path, folder in _artifacts(lm, ev)[:2]:
            client.log_model_artifact(lm_model.model_id, str(path), folder)
        client.finalize_logged_model(lm_model.model_id, "READY")
        say("creating model version")
        _ensure_registered_model(client, name, lm.manifest.description)
        tags = {
            TAG_RELEASE: rid,
            TAG_BUILDER: builder,
            TAG_RUN: run_id,
            TAG_MANIFEST: lk.manifest,
            TAG_PROMPT: f"prompts:/{pv.name}/{pv.version}",
            "logged_model_id": lm_model.model_id,
        }
        if lk.provenance.commit:
            tags[TAG_COMMIT] = lk.provenance.commit
        if lk.provenance.dirty is not None:
            tags["git_dirty"] = str(lk.provenance.dirty).lower()
        # The logged model's artifact location, not `models:/m-...`: MLflow's local registry
        # store resolves that URI through the global tracking URI, not this client's.
        mv = client.create_model_version(
            name,
            source=lm_model.artifact_location,
            run_id=run_id,
            tags=tags,
            description=f"release {rid}",
            model_id=lm_model.model_id,
        )
    result = RegisterResult(
        release_id=rid,
        model_name=name,
        version=str(mv.version),
        run_id=run_id,
        created=True,
        experiment_id=exp_id,
        model_uri=f"models:/{name}/{mv.version}",
        logged_model_id=lm_model.model_id,
        prompt_uri=tags[TAG_PROMPT],
        tracking_uri=redact_url(uri),
    )
    rec = led.append(_register_event(result, lk, ev, builder))
    return result.model_copy(update={"ledger_seq": rec.seq})


def _evidence_to_sign(settings: Settings, lk: Lock) -> Evidence:
    """The release's build outputs whose digests the register event signs: readable, and
    the manifest copy (whose gates, environments, promotion and watch sections decide) the
    one the lock was made from. RegistryError otherwise: nothing is signed."""
    ev = read_evidence(settings, lk.release_id)
    if ev.problems:
        raise RegistryError(
            f"cannot register release {lk.short_id}: unreadable build output: "
            + "; ".join(ev.problems),
            remedy="rebuild the release (`dvc repro`) so its results are complete",
        )
    copy = ev.digests.get(FILES["manifest"])
    if copy is not None and copy != lk.manifest_digest:
        raise RegistryError(
            f"cannot register release {lk.short_id}: its manifest copy "
            f"{ev.directory / FILES['manifest']} is not the manifest its lock was made from "
            f"(sha256 {copy[:12]}, the lock says {lk.manifest_digest[:12]})",
            remedy="rebuild the release (`releasekit build MANIFEST` locks and copies the "
            "manifest again) before registering it",
        )
    return ev


def signed_weights(ev: Evidence) -> dict[str, Any]:
    """The served weights as a register event signs them: `weights_digest` (sha256 over the
    served weight files, from quantise.json) and `weights_made_on` (the host kind that
    quantised them; None for `scheme: none` or where quantise.json does not record it).

    Read from the very bytes whose digest the event signs (`ev.digests`): quantise.json is
    read once, checked against that digest, and parsed. Empty when the release has no
    quantise.json; RegistryError when the file changed since its digest was taken."""
    path = ev.path("quantise")
    signed = ev.digests.get(FILES["quantise"])
    if path is None or signed is None:
        return {}
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise RegistryError(f"cannot register release {ev.release_id[:12]}: {path}: {exc}") from exc
    if sha256_bytes(data) != signed:
        raise RegistryError(
            f"cannot register release {ev.release_id[:12]}: {path} changed while it was "
            f"being registered (sha256 {sha256_bytes(data)[:12]} now, {signed[:12]} before)",
            remedy="register again once nothing writes the release's results",
        )
    try:
        q = QuantiseSummary.model_validate_json(data)
    except ValueError as exc:
        first = str(exc).strip().splitlines()[0]
        raise RegistryError(
            f"cannot register release {ev.release_id[:12]}: {path}: {first}",
            remedy="rebuild the release (`dvc repro`) so its results are complete",
        ) from exc
    made_on = q.made_on.record() if q.quantised and q.made_on is not None else None
    return {"weights_digest": q.weights_digest, "weights_made_on": made_on or None}


def _register_event(result: RegisterResult, lk: Lock, ev: Evidence, builder: str) -> Event:
    digests = ev.digests
    evidence: dict[str, Any] = {
        "mlflow_run_id": result.run_id,
        "model_name": result.model_name,
        "model_version": result.version,
        "model_uri": result.model_uri,
        "tracking_uri": result.tracking_uri,
        "manifest": lk.manifest,
    }
    if result.experiment_id:
        evidence["mlflow_experiment_id"] = result.experiment_id
    if result.prompt_uri:
        evidence["prompt_uri"] = result.prompt_uri
    if result.logged_model_id:
        evidence["logged_model_id"] = result.logged_model_id
    if lk.provenance.commit:
        evidence["git_commit"] = lk.provenance.commit
    if digests:
        evidence["reports"] = digests
    # The manifest's deciding sections (gates, environments, promotion, watch) are not in
    # the release id: the digest of the copy they are read from is signed here.
    evidence["manifest_digest"] = digests.get(FILES["manifest"], lk.manifest_digest)
    # The served weights: the digest a server of this release must load, and the host kind
    # that quantised them (taken from quantise.json as signed above, in `reports`).
    evidence.update(signed_weights(ev))
    return Event(
        type=EventType.REGISTER,
        to_release=lk.release_id,
        reason=f"registered {result.model_name} version {result.version}",
        evidence=evidence,
        actor=builder,
    )
