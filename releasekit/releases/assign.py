"""Assign a release to an environment: the ledger event and the MLflow alias move together."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from releasekit._support.text import redact_url
from releasekit.config import Settings
from releasekit.errors import LedgerError, RegistryError, ReleasekitError
from releasekit.spec.lock import SHORT
from releasekit.stores.ledger import Event, EventType, Ledger, LedgerRecord
from releasekit.stores.mlflow import (
    _ALIAS,
    _alias,
    _search_versions,
    client_for,
    mlflow_errors,
    tracking_uri,
)

if TYPE_CHECKING:
    pass


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

    `release_ref` is anything `resolve_release` accepts. The alias is removed from the
    previous release's registered model when that is a different model, so exactly one
    `models:/<name>@<env>` exists. Re-assigning the release already live is a no-op
    (changed=False) unless `force`.
    """
    from releasekit.releases.context import release_manifest, report_digests
    from releasekit.releases.resolve import resolve_release

    etype = EventType(event_type)
    led = ledger or Ledger(settings.ledger_url or "", actor=settings.actor)
    ref = resolve_release(settings, release_ref, ledger=led)
    rid = ref.release_id
    manifest = release_manifest(settings, rid, ledger=led)
    _check_env(env, [e.name for e in manifest.environments] if manifest else None)
    client = client_for(settings)
    with mlflow_errors(f"looking up release {rid[:SHORT]}"):
        found = _search_versions(client, rid, None)
    if not found:
        raise RegistryError(
            f"release {rid[:SHORT]} is not registered in MLflow "
            f"({redact_url(tracking_uri(settings))})",
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
        "tracking_uri": redact_url(tracking_uri(settings)),
    }
    if current is not None:
        ev["previous_model_version"] = current.evidence.get("model_version")
    digests = report_digests(settings, rid)
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
