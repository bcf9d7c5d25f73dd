"""The MLflow registry adapter: one run and one model version per release (and one version per
LoRA adapter of it, linked to the release's), its prompts in the prompt registry, and
environment aliases (`models:/<name>@<env>`) kept in step with the ledger.

MLflow is imported inside functions only, so the CLI starts fast. Every MlflowException is
re-raised as RegistryError (`from exc`) where it enters; a tracking server that does not
answer is RegistryUnreachableError, reported within about 15 s: every client this module
makes runs with a bounded HTTP timeout and retry budget (MLflow's own
MLFLOW_HTTP_REQUEST_TIMEOUT / _MAX_RETRIES / _BACKOFF_FACTOR, set from the settings unless
the environment already sets them). Commands that only read never create a store.
"""

from __future__ import annotations

import os
import re
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from releasekit._support.text import redact_url
from releasekit.config import Settings
from releasekit.config.lanes import flat_name
from releasekit.errors import RegistryError, RegistryStoreMissingError, RegistryUnreachableError
from releasekit.spec.lock import SHORT

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


DEFAULT_HTTP_TIMEOUT_S = 4
DEFAULT_HTTP_MAX_RETRIES = 1
_HTTP_ENV = {
    "MLFLOW_HTTP_REQUEST_TIMEOUT": ("mlflow_http_timeout_s", DEFAULT_HTTP_TIMEOUT_S),
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": ("mlflow_http_max_retries", DEFAULT_HTTP_MAX_RETRIES),
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": ("mlflow_http_backoff_factor", 1),
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": ("mlflow_http_backoff_jitter", 0.5),
}
_UNREACHABLE = re.compile(
    r"Max retries exceeded|Connection refused|NewConnectionError|ConnectTimeout|"
    r"Read timed out|ConnectionError|RemoteDisconnected|Name or service not known|"
    r"Temporary failure in name resolution",
    re.IGNORECASE,
)


def http_budget(settings: Settings) -> dict[str, str]:
    """The MLflow HTTP knobs in force: the environment's own values win, then settings
    (`mlflow_http_timeout_s`, ...), then releasekit's defaults (4 s and 1 retry: a silent
    server is reported after about 8 s of waiting, a refused connection at once)."""
    out = {}
    for env, (field, default) in _HTTP_ENV.items():
        value = os.environ.get(env)
        if value is None:
            chosen = getattr(settings, field, None)
            value = str(default if chosen is None else chosen)
        out[env] = value
    return out


def _apply_http_budget(settings: Settings) -> None:
    # MLflow reads these per request (there is no per-client setting).
    for env, value in http_budget(settings).items():
        os.environ[env] = value


def client_for(settings: Settings, *, create: bool = True) -> MlflowClient:
    """An MlflowClient on the configured tracking and registry store, with a bounded HTTP
    timeout and retry budget. `create=False` (read-only commands) raises
    RegistryStoreMissingError instead of creating a missing SQLite store."""
    uri = tracking_uri(settings)
    if uri.startswith("sqlite:///"):
        path = Path(uri.removeprefix("sqlite:///"))
        if create:
            path.parent.mkdir(parents=True, exist_ok=True)
        elif not path.is_file():
            raise RegistryStoreMissingError(
                f"no MLflow store at {redact_url(uri)} (the file {path} does not exist)",
                uri=redact_url(uri),
            )
    _apply_http_budget(settings)
    # MLflow logs its store's set-up ("Creating initial MLflow database tables...") at INFO;
    # releasekit says what it does itself. A level the environment sets is kept.
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    with mlflow_errors("connecting to MLflow", uri=uri):
        from mlflow import MlflowClient

        return MlflowClient(tracking_uri=uri, registry_uri=uri)


def translate(exc: Exception, what: str, *, uri: str | None = None) -> RegistryError:
    """Our error for an MLflow failure: RegistryUnreachableError when the server did not
    answer, RegistryError otherwise (the caller raises it `from exc`)."""
    msg = str(getattr(exc, "message", exc))
    if _UNREACHABLE.search(msg) or "failed with exception" in msg:
        where = redact_url(uri) if uri else _uri_in(msg) or "the tracking URI"
        return RegistryUnreachableError(
            f"cannot reach MLflow at {where} ({what}): {_short_cause(msg)}",
            uri=where,
        )
    return RegistryError(f"{what}: {msg}")


def _uri_in(msg: str) -> str | None:
    m = re.search(r"API request to (\S+?)/api/", msg)
    return redact_url(m.group(1)) if m else None


def _short_cause(msg: str) -> str:
    for pat in ("Read timed out", "Connection refused", "Name or service not known"):
        if pat.lower() in msg.lower():
            return pat.lower()
    if "NewConnectionError" in msg:
        return "connection refused"
    return "no answer within the timeout and retries"


@contextmanager
def mlflow_errors(what: str, *, uri: str | None = None) -> Iterator[None]:
    """Re-raise MLflow (and artifact I/O) failures as RegistryError naming what failed
    (RegistryUnreachableError when the server did not answer)."""
    from mlflow.exceptions import MlflowException

    try:
        yield
    except MlflowException as exc:
        raise translate(exc, what, uri=uri) from exc
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
        raise translate(exc, f"looking up {name} version {version}") from exc


def alias_version(settings: Settings, name: str, alias: str) -> RegisteredVersion | None:
    """The version `models:/<name>@<alias>` points at, or None."""
    return _alias(client_for(settings), name, alias)


def _alias(client: MlflowClient, name: str, alias: str) -> RegisteredVersion | None:
    from mlflow.exceptions import MlflowException

    alias = flat_name(alias)
    try:
        return _version_of(client.get_model_version_by_alias(name, alias))
    except MlflowException as exc:
        if _not_found(exc) and not _UNREACHABLE.search(str(exc.message)):
            return None
        raise translate(exc, f"reading alias {name}@{alias}") from exc


class AliasHolder(BaseModel):
    """One registered model version that carries an alias."""

    model_name: str
    version: str


def alias_holders(client: MlflowClient, models: set[str]) -> dict[str, list[AliasHolder]]:
    """Every alias on releasekit's registered models (tagged `releasekit=deployment`, plus
    `models`), by alias name: the MLflow side of the ledger cross-check."""
    out: dict[str, list[AliasHolder]] = {}
    token: str | None = None
    seen: set[str] = set()
    with mlflow_errors("listing registered models and their aliases"):
        while True:
            page = client.search_registered_models(max_results=200, page_token=token)
            for rm in page:
                tags = dict(rm.tags or {})
                if tags.get("releasekit") != "deployment" and rm.name not in models:
                    continue
                seen.add(rm.name)
                for alias, version in _aliases_of(rm).items():
                    out.setdefault(alias, []).append(
                        AliasHolder(model_name=rm.name, version=str(version))
                    )
            token = page.token
            if not token:
                break
        for name in sorted(models - seen):  # named by the ledger but not listed (deleted?)
            try:
                rm = client.get_registered_model(name)
            except Exception as exc:
                if _not_found(exc):
                    continue
                raise
            for alias, version in _aliases_of(rm).items():
                out.setdefault(alias, []).append(
                    AliasHolder(model_name=rm.name, version=str(version))
                )
    for holders in out.values():
        holders.sort(key=lambda h: (h.model_name, int(h.version)))
    return out


def _aliases_of(rm: Any) -> dict[str, str]:
    aliases = rm.aliases or {}
    if isinstance(aliases, dict):
        return {str(k): str(v) for k, v in aliases.items()}
    return {str(a.alias): str(a.version) for a in aliases}  # older MLflow: a list


def set_alias(client: MlflowClient, name: str, alias: str, version: str) -> None:
    """Point `models:/<name>@<alias>` at `version` (an adapter lane's name is mapped to its
    alias: `releasekit.config.lanes.flat_name`)."""
    alias = flat_name(alias)
    with mlflow_errors(f"moving alias {name}@{alias}"):
        client.set_registered_model_alias(name, alias, version)


def delete_alias(client: MlflowClient, name: str, alias: str) -> None:
    """Remove `models:/<name>@<alias>` (gone already is fine)."""
    from mlflow.exceptions import MlflowException

    alias = flat_name(alias)
    try:
        client.delete_registered_model_alias(name, alias)
    except MlflowException as exc:
        if _not_found(exc) and not _UNREACHABLE.search(str(exc.message)):
            return
        raise translate(exc, f"removing alias {name}@{alias}") from exc


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


def _ensure_registered_model(
    client: MlflowClient, name: str, description: str, *, tags: dict[str, str] | None = None
) -> None:
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(name)
        return
    except MlflowException as exc:
        if not _not_found(exc):
            raise
    try:
        client.create_registered_model(
            name,
            tags=tags if tags is not None else {"releasekit": "deployment"},
            description=description or None,
        )
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_ALREADY_EXISTS":
            raise


# -- adapters --------------------------------------------------------------------------------

# Each LoRA adapter of a release is a version of a registered model of its own. Its version
# names the release under `adapter_release_id`, never `release_id`: a lookup of a release by
# `tags.release_id` (find_version, assign) must find the release's own model version only.
TAG_ADAPTER_NAME = "adapter_name"
TAG_ADAPTER_RELEASE = "adapter_release_id"
TAG_ADAPTER_DIGEST = "adapter_digest"
TAG_ADAPTER_RANK = "adapter_rank"
TAG_BASE_WEIGHTS = "base_weights_digest"
TAG_BASE_MODEL_URI = "base_model_uri"  # models:/<release model>/<version>: the base's version
TAG_ADAPTER_URIS = "adapter_model_uris"  # on the release's version: its adapters' model URIs
ADAPTER_MODEL_TAG = "adapter"  # the registered model's `releasekit` tag


def adapter_model_name(model_name: str, adapter: str) -> str:
    """The registered model that holds adapter `adapter` of manifest `model_name`'s releases:
    `<manifest name>~lora~<adapter name>` (e.g. `demo~lora~demo-json`).

    Manifest and adapter names are `[a-z0-9._-]` only, so a name with `~` is never a
    manifest's model, nor its prompt (`<name>.chat`), whatever either is called. MLflow
    refuses only `/` and `:` in model names, and `~` is unreserved in URIs, so
    `models:/demo~lora~demo-json/3` needs no escaping. One model per manifest and adapter:
    the same adapter name on two bases is two lineages, not one."""
    return f"{model_name}~lora~{adapter}"


def _adapter_versions(
    client: MlflowClient, name: str, release_id: str, digest: str
) -> list[ModelVersion]:
    """The versions of adapter model `name` registered for this release and adapter digest
    (oldest first; one, unless a registry was edited by hand)."""
    hexes = re.compile(r"[0-9a-f]{1,64}")
    if not (hexes.fullmatch(release_id) and hexes.fullmatch(digest)):
        return []
    found = client.search_model_versions(
        f"name = '{name}' and tags.{TAG_ADAPTER_RELEASE} = '{release_id}' "
        f"and tags.{TAG_ADAPTER_DIGEST} = '{digest}'"
    )
    return sorted(found, key=lambda v: int(v.version))


# -- assign ----------------------------------------------------------------------------------
