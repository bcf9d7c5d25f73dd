"""Move an environment's MLflow prompt-registry alias (`prompts:/NAME@ENV`) with the release,
so applications that load prompts from MLflow see the version the gateway serves."""

from __future__ import annotations

import re

from pydantic import BaseModel

from releasekit.config import Settings
from releasekit.config.lanes import flat_name
from releasekit.stores.ledger import EventType, Ledger
from releasekit.stores.mlflow import client_for, mlflow_errors

_URI = re.compile(r"^prompts:/([^/@]+)/(\d+)$")


class PromptAliasResult(BaseModel):
    """Where the alias points now, and the one removed from the previous release's prompt."""

    environment: str
    prompt: str | None = None
    version: int | None = None
    removed_from: str | None = None


def prompt_uri_of(ledger: Ledger, release_id: str) -> str | None:
    """The prompt version a release registered (`prompts:/NAME/VERSION`), or None."""
    regs = ledger.records(
        release=release_id, types=[EventType.REGISTER.value], newest_first=True, limit=1
    )
    uri = regs[0].evidence.get("prompt_uri") if regs else None
    return str(uri) if uri else None


def move_prompt_alias(
    settings: Settings,
    *,
    env: str,
    release_id: str,
    previous_release_id: str | None,
    ledger: Ledger,
) -> PromptAliasResult:
    """Point `prompts:/<name>@<env>` at `release_id`'s registered prompt version and, when
    the previous release's prompt has another name, delete the alias there (one prompt
    alias per environment, like the model alias). RegistryError if MLflow refuses; a
    release registered without a prompt leaves the alias alone."""
    uri = prompt_uri_of(ledger, release_id)
    m = _URI.match(uri or "")
    if m is None:
        return PromptAliasResult(environment=env)
    name, version = m.group(1), int(m.group(2))
    alias = flat_name(env)  # an adapter lane's: <env>__<adapter>
    client = client_for(settings)
    removed: str | None = None
    with mlflow_errors(f"moving prompt alias {name}@{alias}"):
        client.set_prompt_alias(name, alias, version)
        prev = prompt_uri_of(ledger, previous_release_id) if previous_release_id else None
        pm = _URI.match(prev or "")
        if pm is not None and pm.group(1) != name:
            from mlflow.exceptions import MlflowException

            try:
                client.delete_prompt_alias(pm.group(1), alias)
                removed = pm.group(1)
            except MlflowException:
                removed = None  # already gone
    return PromptAliasResult(environment=env, prompt=name, version=version, removed_from=removed)
