"""The MLflow registry adapter: one run and one model version per release, its prompts in the
prompt registry, and environment aliases (`models:/<name>@<env>`) kept in step with the ledger.

MLflow is imported inside functions only, so the CLI starts fast. Every MlflowException is
re-raised as RegistryError (`from exc`) where it enters.
"""

from __future__ import annotations

import json
import re
import tempfile
import time
import urllib.parse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from releasekit.config import Settings
from releasekit.errors import LedgerError, LockError, RegistryError, ReleasekitError
from releasekit.evidence import FILES, Evidence, read_evidence, sweep_series
from releasekit.ledger import Event, EventType, Ledger, LedgerRecord
from releasekit.lock import SHORT, Lock, lock_path_for, read_lock, sha256_bytes
from releasekit.manifest import LoadedManifest, load_manifest
from releasekit.prompts import read_template, render
from releasekit.provenance import actor as provenance_actor

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities.model_registry import ModelVersion

# Tags on model versions (plain keys, so `tags.release_id = '...'` finds a release).
TAG_RELEASE = "release_id"
TAG_COMMIT = "git_commit"
TAG_BUILDER = "builder"
TAG_RUN = "run_id"
TAG_MANIFEST = "manifest"
TAG_PROMPT = "prompt_uri"
LINKED_PROMPTS = "mlflow.linkedPrompts"  # MLflow's own tag: the UI lists these prompts

_ALIAS = re.compile(r"^[A-Za-z0-9_-]{1,63}$")
_PARAM_KEY = re.compile(r"[^\w./\- ]")
_MAX_PARAM_VALUE = 6000
_MAX_KEY = 250

Progress = Callable[[str], None]


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


class RegisteredVersion(BaseModel):
    """A model version that carries a release."""

    release_id: str
    model_name: str
    version: str
    run_id: str | None
    tags: dict[str, str]

    @property
    def model_uri(self) -> str:
        """`models:/<name>/<version>`."""
        return f"models:/{self.model_name}/{self.version}"


class AssignResult(BaseModel):
    """Outcome of moving an environment to a release (alias moved and event recorded)."""

    release_id: str
    model_name: str
    version: str
    environment: str
    event_type: str
    changed: bool = Field(description="False when the environment already ran this release")
    previous_release_id: str | None = None
    previous_model_name: str | None = None
    previous_version: str | None = None
    record: LedgerRecord | None = None


def redact_uri(uri: str) -> str:
    """A URI with any password replaced by ***, safe to store in the ledger or print."""
    parts = urllib.parse.urlsplit(uri)
    if parts.password is None:
        return uri
    host = parts.hostname or ""
    if parts.port:
        host += f":{parts.port}"
    netloc = f"{parts.username}:***@{host}" if parts.username else f"***@{host}"
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def tracking_uri(settings: Settings) -> str:
    """The MLflow tracking URI in force (MLFLOW_TRACKING_URI is folded in by Settings)."""
    uri = settings.mlflow_tracking_uri
    if not uri:  # pragma: no cover - Settings always fills it
        raise RegistryError("no MLflow tracking URI configured")
    return uri


def _is_remote(uri: str) -> bool:
    return urllib.parse.urlsplit(uri).scheme in {"http", "https", "databricks", "uc"}


def _store_missing(settings: Settings) -> bool:
    """True when the embedded SQLite store does not exist yet: nothing is registered, and a
    lookup must not create (and migrate) an empty store as a side effect."""
    uri = tracking_uri(settings)
    return uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file()


def client_for(settings: Settings) -> MlflowClient:
    """An MlflowClient on the configured tracking and registry store."""
    uri = tracking_uri(settings)
    if uri.startswith("sqlite:///"):
        Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    with mlflow_errors("connecting to MLflow"):
        from mlflow import MlflowClient

        return MlflowClient(tracking_uri=uri, registry_uri=uri)


@contextmanager
def mlflow_errors(what: str) -> Iterator[None]:
    """Re-raise MLflow (and artifact I/O) failures as RegistryError naming what failed."""
    from mlflow.exceptions import MlflowException

    try:
        yield
    except MlflowException as exc:
        raise RegistryError(f"{what}: {exc.message}") from exc
    except OSError as exc:
        raise RegistryError(f"{what}: {exc}") from exc


def _not_found(exc: Exception) -> bool:
    code = getattr(exc, "error_code", "")
    msg = str(getattr(exc, "message", exc)).lower()
    return code == "RESOURCE_DOES_NOT_EXIST" or "not found" in msg or "does not exist" in msg


# -- reading ---------------------------------------------------------------------------------


def _version_of(mv: ModelVersion) -> RegisteredVersion:
    tags = dict(mv.tags or {})
    return RegisteredVersion(
        release_id=tags.get(TAG_RELEASE, ""),
        model_name=mv.name,
        version=str(mv.version),
        run_id=mv.run_id or tags.get(TAG_RUN),
        tags=tags,
    )


def _search_versions(
    client: MlflowClient, release_id: str, name: str | None
) -> list[RegisteredVersion]:
    if not re.fullmatch(r"[0-9a-f]{1,64}", release_id):
        return []
    flt = f"tags.{TAG_RELEASE} = '{release_id}'"
    if name is not None:
        flt = f"name = '{name}' and {flt}"
    found = client.search_model_versions(flt)
    return sorted((_version_of(v) for v in found), key=lambda v: (v.model_name, int(v.version)))


def find_version(
    settings: Settings, release_id: str, *, name: str | None = None
) -> RegisteredVersion | None:
    """The model version tagged with `release_id` (in model `name` if given), or None."""
    if _store_missing(settings):
        return None
    client = client_for(settings)
    with mlflow_errors(f"looking up release {release_id[:SHORT]}"):
        found = _search_versions(client, release_id, name)
    return found[0] if found else None


def get_version(settings: Settings, name: str, version: str) -> RegisteredVersion | None:
    """Model version `name`/`version`, or None if there is none."""
    if _store_missing(settings):
        return None
    from mlflow.exceptions import MlflowException

    client = client_for(settings)
    try:
        return _version_of(client.get_model_version(name, version))
    except MlflowException as exc:
        if _not_found(exc) or exc.error_code == "INVALID_PARAMETER_VALUE":
            return None
        raise RegistryError(f"looking up {name} version {version}: {exc.message}") from exc


def alias_version(settings: Settings, name: str, alias: str) -> RegisteredVersion | None:
    """The version `models:/<name>@<alias>` points at, or None."""
    return _alias(client_for(settings), name, alias)


def _alias(client: MlflowClient, name: str, alias: str) -> RegisteredVersion | None:
    from mlflow.exceptions import MlflowException

    try:
        return _version_of(client.get_model_version_by_alias(name, alias))
    except MlflowException as exc:
        if _not_found(exc):
            return None
        raise RegistryError(f"reading alias {name}@{alias}: {exc.message}") from exc


def prompt_messages(settings: Settings, prompt_uri: str) -> list[dict[str, str]]:
    """The chat messages of a prompt version in MLflow's prompt registry."""
    m = re.fullmatch(r"prompts:/([^/]+)/(\d+)", prompt_uri)
    if m is None:
        raise RegistryError(f"not a prompt version URI: {prompt_uri!r}")
    client = client_for(settings)
    with mlflow_errors(f"loading prompt {prompt_uri}"):
        # get_prompt_version, not load_prompt: the latter tags the prompt with the global
        # default experiment in a background thread.
        pv = client.get_prompt_version(m.group(1), m.group(2))
    if pv is None:
        raise RegistryError(f"prompt {prompt_uri} not found in MLflow")
    tpl = pv.template
    if isinstance(tpl, str):
        return [{"role": "user", "content": tpl}]
    return [{"role": str(m.get("role")), "content": str(m.get("content"))} for m in tpl]


# -- register --------------------------------------------------------------------------------


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


def _flatten(prefix: str, obj: Any, out: dict[str, str]) -> None:
    if isinstance(obj, dict):
        if not obj:
            out[prefix] = "{}"
        for k, v in obj.items():
            _flatten(f"{prefix}.{k}", v, out)
    elif isinstance(obj, list):
        if not obj:
            out[prefix] = "[]"
        for i, v in enumerate(obj):
            _flatten(f"{prefix}.{i}", v, out)
    else:
        out[prefix] = "" if obj is None else str(obj)


def release_params(lm: LoadedManifest, lk: Lock) -> dict[str, str]:
    """MLflow params of a release: the flattened manifest and every lock digest."""
    raw: dict[str, str] = {}
    _flatten("manifest", lm.manifest.model_dump(mode="json", by_alias=True), raw)
    _flatten("lock.inputs", lk.inputs, raw)
    raw["lock.release_id"] = lk.release_id
    raw["lock.manifest_digest"] = lk.manifest_digest
    out: dict[str, str] = {}
    for k, v in raw.items():
        key = _PARAM_KEY.sub("_", k)[:_MAX_KEY]
        out[key] = v if len(v) <= _MAX_PARAM_VALUE else v[: _MAX_PARAM_VALUE - 3] + "..."
    return out


def _experiment(client: MlflowClient, settings: Settings, name: str) -> str:
    exp_name = f"releasekit/{name}"
    exp = client.get_experiment_by_name(exp_name)
    if exp is not None:
        if exp.lifecycle_stage == "deleted":
            client.restore_experiment(exp.experiment_id)
        return str(exp.experiment_id)
    location = None
    if not _is_remote(tracking_uri(settings)):
        # Without a server MLflow would write under the current directory; keep artifacts
        # under the state dir instead.
        root = settings.mlflow_artifact_root
        root.mkdir(parents=True, exist_ok=True)
        location = (root / name).as_uri()
    try:
        return str(client.create_experiment(exp_name, artifact_location=location))
    except Exception:
        exp = client.get_experiment_by_name(exp_name)  # created concurrently
        if exp is None:
            raise
        return str(exp.experiment_id)


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


def _prompt_version(
    client: MlflowClient, name: str, messages: list[dict[str, str]], release_id: str
) -> Any:
    """The prompt version holding exactly these messages (reused if one already does).

    create_prompt/create_prompt_version rather than register_prompt: the latter starts a
    thread that links the prompt to the *global* default experiment.
    """
    from mlflow.exceptions import MlflowException

    if client.get_prompt(name) is None:
        try:
            client.create_prompt(name, description="releasekit: the chat prompt of a deployment")
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
    else:
        for pv in client.search_prompt_versions(name, max_results=1000):
            if pv.template == messages:
                return pv
    return client.create_prompt_version(
        name=name,
        template=messages,
        description=f"releasekit: release {release_id[:SHORT]}",
        tags={TAG_RELEASE: release_id},
    )


def _link_prompt_to_experiment(client: MlflowClient, prompt: str, exp_id: str) -> None:
    """List the prompt in the experiment's Prompts tab (MLflow's comma-wrapped id list)."""
    from mlflow.prompt.constants import PROMPT_EXPERIMENT_IDS_TAG_KEY

    info = client.get_prompt(prompt)
    have = (info.tags.get(PROMPT_EXPERIMENT_IDS_TAG_KEY, "") if info else "").strip(",")
    ids = [i for i in have.split(",") if i]
    if exp_id not in ids:
        ids.append(exp_id)
        client.set_prompt_tag(prompt, PROMPT_EXPERIMENT_IDS_TAG_KEY, f",{','.join(ids)},")


def _ensure_registered_model(client: MlflowClient, name: str, description: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(name)
        return
    except MlflowException as exc:
        if not _not_found(exc):
            raise
    try:
        client.create_registered_model(
            name, tags={"releasekit": "deployment"}, description=description or None
        )
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_ALREADY_EXISTS":
            raise


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
    returns the existing version (created=False) and writes nothing.
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
    led = ledger or Ledger(settings.ledger_url or "", actor=settings.actor)
    builder = provenance_actor(settings.root, settings.actor)
    what = f"registering {name} release {lk.short_id} at {redact_uri(uri)}"
    with mlflow_errors(what):
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
            tracking_uri=redact_uri(uri),
        )
        if not _register_event_exists(led, rid):
            # A crash between creating the version and recording it: record it now.
            rec = led.append(_register_event(result, lk, {}, builder))
            result = result.model_copy(update={"ledger_seq": rec.seq})
        return result

    ev = read_evidence(settings, rid)
    if ev.problems:
        raise RegistryError(
            f"cannot register release {lk.short_id}: unreadable build output: "
            + "; ".join(ev.problems),
            remedy="rebuild the release (`dvc repro`) so its results are complete",
        )
    with mlflow_errors(what):
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
        tracking_uri=redact_uri(uri),
    )
    rec = led.append(_register_event(result, lk, ev.digests, builder))
    return result.model_copy(update={"ledger_seq": rec.seq})


def _register_event(
    result: RegisterResult, lk: Lock, digests: dict[str, str], builder: str
) -> Event:
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
    return Event(
        type=EventType.REGISTER,
        to_release=lk.release_id,
        reason=f"registered {result.model_name} version {result.version}",
        evidence=evidence,
        actor=builder,
    )


# -- assign ----------------------------------------------------------------------------------


def _check_env(env: str, allowed: list[str] | None) -> None:
    if not _ALIAS.match(env) or env == "latest" or re.fullmatch(r"v\d+", env):
        raise RegistryError(
            f"environment name {env!r} cannot be an MLflow alias",
            remedy="use letters, digits, '-' or '_' (not 'latest' or 'v<number>')",
        )
    if allowed is not None and env not in allowed:
        raise RegistryError(
            f"environment {env!r} is not one of the release's environments: {', '.join(allowed)}",
            remedy="fix the --env value, or add the environment to the manifest's `environments`",
        )


def assign(
    settings: Settings,
    release_ref: str,
    *,
    env: str,
    reason: str,
    event_type: str = "assign",
    evidence: dict[str, Any] | None = None,
    actor: str | None = None,
    force: bool = False,
    ledger: Ledger | None = None,
) -> AssignResult:
    """Record that `env` now runs a release: move the alias `env` to its model version and
    append a live ledger event; both happen or neither does.

    `release_ref` is anything `audit.resolve_release` accepts. The alias is removed from the
    previous release's registered model when that is a different model, so exactly one
    `models:/<name>@<env>` exists. Re-assigning the release already live is a no-op
    (changed=False) unless `force`.
    """
    from releasekit import audit

    etype = EventType(event_type)
    led = ledger or Ledger(settings.ledger_url or "", actor=settings.actor)
    ref = audit.resolve_release(settings, release_ref, ledger=led)
    rid = ref.release_id
    manifest = audit.release_manifest(settings, rid, ledger=led)
    _check_env(env, [e.name for e in manifest.environments] if manifest else None)
    client = client_for(settings)
    with mlflow_errors(f"looking up release {rid[:SHORT]}"):
        found = _search_versions(client, rid, None)
    if not found:
        raise RegistryError(
            f"release {rid[:SHORT]} is not registered in MLflow "
            f"({redact_uri(tracking_uri(settings))})",
            remedy="run `releasekit register MANIFEST` first",
        )
    target = found[0]
    current = led.live_at(env)
    prev_rid = current.to_release if current else None
    prev_model = (
        str(current.evidence.get("model_name"))
        if current and current.evidence.get("model_name")
        else None
    )
    on_target = _alias(client, target.model_name, env)
    if (
        not force
        and prev_rid == rid
        and on_target is not None
        and on_target.version == target.version
    ):
        return AssignResult(
            release_id=rid,
            model_name=target.model_name,
            version=target.version,
            environment=env,
            event_type=etype.value,
            changed=False,
            previous_release_id=prev_rid,
            previous_model_name=prev_model,
            previous_version=target.version,
            record=current,
        )
    other = None
    if prev_model and prev_model != target.model_name:
        other = _alias(client, prev_model, env)

    undo: list[Callable[[], None]] = []

    def rollback_aliases() -> list[str]:
        failures = []
        for step in reversed(undo):
            try:
                step()
            except Exception as exc:  # keep undoing the rest; report all
                failures.append(str(exc))
        return failures

    try:
        with mlflow_errors(f"moving alias {target.model_name}@{env}"):
            client.set_registered_model_alias(target.model_name, env, target.version)
            if on_target is not None:
                undo.append(
                    lambda: client.set_registered_model_alias(
                        target.model_name, env, on_target.version
                    )
                )
            else:
                undo.append(lambda: client.delete_registered_model_alias(target.model_name, env))
            if other is not None and prev_model is not None:
                client.delete_registered_model_alias(prev_model, env)
                undo.append(
                    lambda: client.set_registered_model_alias(prev_model, env, other.version)
                )
    except RegistryError:
        rollback_aliases()
        raise

    ev: dict[str, Any] = {
        "mlflow_run_id": target.run_id,
        "model_name": target.model_name,
        "model_version": target.version,
        "model_uri": target.model_uri,
        "tracking_uri": redact_uri(tracking_uri(settings)),
    }
    if current is not None:
        ev["previous_model_version"] = current.evidence.get("model_version")
    digests = audit.report_digests(settings, rid)
    if digests:
        ev["reports"] = digests
    ev.update(evidence or {})
    try:
        rec = led.append(
            Event(
                type=etype,
                environment=env,
                from_release=prev_rid,
                to_release=rid,
                reason=reason,
                evidence=ev,
                live=True,
                actor=actor,
            )
        )
    except BaseException as exc:
        failures = rollback_aliases()
        note = (
            f"; restoring the alias ALSO failed ({'; '.join(failures)}): check "
            f"models:/{target.model_name}@{env} by hand"
            if failures
            else "; the alias was restored"
        )
        if isinstance(exc, ReleasekitError):
            raise LedgerError(f"{exc.message}{note}", remedy=exc.remedy or None) from exc
        if isinstance(exc, Exception):
            raise LedgerError(f"cannot record the assignment: {exc}{note}") from exc
        raise
    return AssignResult(
        release_id=rid,
        model_name=target.model_name,
        version=target.version,
        environment=env,
        event_type=etype.value,
        changed=True,
        previous_release_id=prev_rid,
        previous_model_name=prev_model,
        previous_version=str(current.evidence.get("model_version")) if current else None,
        record=rec,
    )
