"""Register a release: one MLflow run and model version per release id, a model version per
LoRA adapter linked to it, prompts in the prompt registry, a ledger event; idempotent."""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from releasekit._support.digests import digest_obj, sha256_bytes
from releasekit._support.text import flatten, redact_url
from releasekit.config import Settings
from releasekit.errors import LockError, RegistryError
from releasekit.spec.adapters import Adapter, adapters_of
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
    ADAPTER_MODEL_TAG,
    LINKED_PROMPTS,
    TAG_ADAPTER_DIGEST,
    TAG_ADAPTER_NAME,
    TAG_ADAPTER_RANK,
    TAG_ADAPTER_RELEASE,
    TAG_ADAPTER_URIS,
    TAG_BASE_MODEL_URI,
    TAG_BASE_WEIGHTS,
    TAG_BUILDER,
    TAG_COMMIT,
    TAG_MANIFEST,
    TAG_PROMPT,
    TAG_RELEASE,
    TAG_RUN,
    _adapter_versions,
    _ensure_registered_model,
    _experiment,
    _link_prompt_to_experiment,
    _prompt_version,
    _search_versions,
    adapter_model_name,
    client_for,
    mlflow_errors,
    tracking_uri,
)

if TYPE_CHECKING:
    from mlflow import MlflowClient


Progress = Callable[[str], None]
REGISTER_LOCK_TIMEOUT_S = 900.0  # a concurrent register of the same release may log for a while


class RegisteredAdapter(BaseModel):
    """One LoRA adapter of the release as registered: a version of its own registered model
    (`<manifest name>~lora~<adapter name>`); `created` is False when it already was."""

    name: str
    digest: str = Field(description="over its locked files and declaration")
    model_name: str
    version: str
    model_uri: str = Field(description="models:/<name>/<version>")
    created: bool


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
    adapters: list[RegisteredAdapter] = Field(
        default_factory=list, description="its LoRA adapters' model versions"
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


def locked_adapters(lm: LoadedManifest, lk: Lock) -> list[tuple[Adapter, str]]:
    """The release's adapters with their digests, in name order: the manifest's
    declarations, checked against the lock so MLflow never records a rank or base the
    release was not locked with."""
    declared = {a.name: a for a in lm.manifest.adapters}
    pinned = adapters_of(lk.inputs)
    out: list[tuple[Adapter, str]] = []
    for name in sorted(set(declared) | set(pinned)):
        a = declared.get(name)
        # The declaration's digest as spec.adapters.adapter_inputs pins it.
        if a is None or lk.inputs.get(f"adapter/{name}") != digest_obj(
            {"rank": a.rank, "base": a.base}
        ):
            raise LockError(
                f"{lm.path}: adapter '{name}' changed since the lock; the manifest does not "
                "declare it as the locked release does",
                remedy="run `releasekit lock MANIFEST` (a new release) or restore the manifest",
            )
        out.append((a, pinned[name]["digest"]))
    return out


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
    release_id, git_commit, builder and run_id. Each LoRA adapter of the release is a
    version of its own registered model (`<name>~lora~<adapter>`), tagged with its digest,
    rank, base weights digest and release id, and linked to the release's version
    (`base_model_uri`), which lists the adapters' URIs (`adapter_model_uris`). Registering
    the same release id again returns the existing version (created=False), completes any
    adapter a stopped register left out, and otherwise writes nothing; two processes
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
    adapters = locked_adapters(lm, lk)
    rid = lk.release_id
    uri = tracking_uri(settings)
    client = client_for(settings)
    led = ledger or open_ledger(settings)
    builder = provenance_actor(settings.root, settings.actor)
    with led.lock(f"release:{rid}", timeout_s=REGISTER_LOCK_TIMEOUT_S):
        # Check-then-create under the release's lock: a second registerer waits here, then
        # finds the version the first one made.
        res = _register_locked(settings, lm, lk, messages, adapters, client, led, builder, uri, say)
    return res.model_copy(update={"warnings": list(led.warnings)})


def _register_locked(
    settings: Settings,
    lm: LoadedManifest,
    lk: Lock,
    messages: list[dict[str, str]],
    adapters: list[tuple[Adapter, str]],
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
        if adapters:
            # A register that stopped after the release's version completes its adapters.
            with mlflow_errors(what, uri=uri):
                regs = _register_adapters(
                    client, lk, v.model_name, v.version, v.tags, v.run_id, adapters, builder, say
                )
            result = result.model_copy(update={"adapters": regs})
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
        regs = _register_adapters(
            client, lk, name, str(mv.version), tags, run_id, adapters, builder, say
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
        adapters=regs,
    )
    rec = led.append(_register_event(result, lk, ev, builder))
    return result.model_copy(update={"ledger_seq": rec.seq})


def _register_adapters(
    client: MlflowClient,
    lk: Lock,
    model_name: str,
    version: str,
    version_tags: dict[str, str],
    run_id: str | None,
    adapters: list[tuple[Adapter, str]],
    builder: str,
    say: Progress,
) -> list[RegisteredAdapter]:
    """Each adapter as a version of its own registered model, linked to the release's version
    `model_name`/`version` (the base it is served on), then that version tagged with the
    adapters' model URIs. One adapter version per adapter digest and release: a later
    release that carries the same adapter gets a version of its own, linked to its own base
    version (a version's link is one tag, so it names one base). Whatever already exists is
    kept, so a rerun completes a registration that stopped part way and writes nothing new
    for one that finished."""
    if not adapters:
        return []
    if not run_id:
        raise RegistryError(
            f"{model_name} version {version} (release {lk.short_id}) names no run; its "
            "adapters cannot be linked to it"
        )
    base_uri = f"models:/{model_name}/{version}"
    out: list[RegisteredAdapter] = []
    for a, digest in adapters:
        model = adapter_model_name(model_name, a.name)
        v, created = _adapter_version(client, lk, model, a, digest, base_uri, run_id, builder, say)
        out.append(
            RegisteredAdapter(
                name=a.name,
                digest=digest,
                model_name=model,
                version=v,
                model_uri=f"models:/{model}/{v}",
                created=created,
            )
        )
    uris = ",".join(r.model_uri for r in out)
    if version_tags.get(TAG_ADAPTER_URIS) != uris:
        client.set_model_version_tag(model_name, version, TAG_ADAPTER_URIS, uris)
    return out


def _adapter_version(
    client: MlflowClient,
    lk: Lock,
    model: str,
    a: Adapter,
    digest: str,
    base_uri: str,
    run_id: str,
    builder: str,
    say: Progress,
) -> tuple[str, bool]:
    """(version, created) of adapter `a`'s model version for this release: found, or made."""
    found = _adapter_versions(client, model, lk.release_id, digest)
    if found:
        mv = found[0]
        if (mv.tags or {}).get(TAG_BASE_MODEL_URI) != base_uri:
            # The release's version was made again (it had been deleted): follow it.
            client.set_model_version_tag(model, str(mv.version), TAG_BASE_MODEL_URI, base_uri)
        return str(mv.version), False
    say(f"registering adapter {a.name}")
    _ensure_registered_model(
        client,
        model,
        f"LoRA adapter {a.name} of {lk.name}: each version is the adapter of one release, "
        f"linked to that release's version of {lk.name} (tag {TAG_BASE_MODEL_URI})",
        tags={"releasekit": ADAPTER_MODEL_TAG, TAG_ADAPTER_NAME: a.name, "base_model": lk.name},
    )
    tags = {
        TAG_ADAPTER_NAME: a.name,
        TAG_ADAPTER_DIGEST: digest,
        TAG_ADAPTER_RANK: str(a.rank),
        TAG_BASE_WEIGHTS: a.base,
        TAG_ADAPTER_RELEASE: lk.release_id,
        TAG_BASE_MODEL_URI: base_uri,
        TAG_RUN: run_id,
        TAG_BUILDER: builder,
        TAG_MANIFEST: lk.manifest,
    }
    if lk.provenance.commit:
        tags[TAG_COMMIT] = lk.provenance.commit
    # The source is the release's run (its `release/` artifacts: the manifest and the lock
    # that pins the adapter's files); the files themselves are not copied into MLflow.
    mv = client.create_model_version(
        model,
        source=f"runs:/{run_id}/release",
        run_id=run_id,
        tags=tags,
        description=f"adapter {a.name} of release {lk.release_id} (base {base_uri})",
    )
    return str(mv.version), True


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
    if result.adapters:
        evidence["adapters"] = {a.name: a.model_uri for a in result.adapters}
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
