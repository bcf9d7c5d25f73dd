"""Assign a release to an environment: the ledger event first, then the MLflow alias, under
the environment's lock; drift an earlier crash left is repaired from the ledger.

A record-only `assign` (the `releasekit assign` command) is for environments releasekit
does not deploy (a registry of aliases, as GTO keeps); an environment releasekit deploys
moves only through `promote` and `rollback`, which record through here with their own event
types after their gates. Which environments are deployed is not up to the command's config:
one is closed to `assign` when releasekit.toml as committed at the trust revision
(`stores.trust`) deploys it, when the ledger shows releasekit deployed it (a promote,
rollback, deploy or canary event), or when this command's own settings name it (outside
git, the last two decide)."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from releasekit._support.procs import deferred_signals
from releasekit._support.text import redact_url
from releasekit.config import Settings
from releasekit.config.lanes import flat_name, parent_env
from releasekit.errors import AliasDriftError, RegistryError
from releasekit.releases.reconcile import repair_env
from releasekit.spec.lock import SHORT
from releasekit.stores.ledger import Event, EventType, Ledger, LedgerRecord, open_ledger
from releasekit.stores.mlflow import (
    _ALIAS,
    _alias,
    _search_versions,
    client_for,
    delete_alias,
    mlflow_errors,
    set_alias,
    tracking_uri,
)

ASSIGN_LOCK_TIMEOUT_S = 120.0  # how long an assign waits behind others on one environment
PAUSE_ENV = "RELEASEKIT_TEST_PAUSE_AFTER_APPEND"
PAUSE_MARKER_ENV = "RELEASEKIT_TEST_PAUSE_MARKER"


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
    repaired: LedgerRecord | None = Field(
        None, description="the repair event, when the alias had drifted from the ledger first"
    )
    warnings: list[str] = Field(
        default_factory=list, description="what did not stop it (e.g. the git anchor)"
    )


def _check_env(env: str, allowed: list[str] | None) -> None:
    alias = flat_name(env)  # an adapter lane's: <env>__<adapter>
    env = parent_env(env)
    if not _ALIAS.match(alias) or env == "latest" or re.fullmatch(r"v\d+", env):
        raise RegistryError(
            f"environment name {env!r} cannot be an MLflow alias",
            remedy="use letters, digits, '-' or '_' (not 'latest' or 'v<number>')",
        )
    if allowed is not None and env not in allowed:
        raise RegistryError(
            f"environment {env!r} is not one of the release's environments: {', '.join(allowed)}",
            remedy="fix the --env value, or add the environment to the manifest's `environments`",
        )


class DeployedEnvironmentError(RegistryError):
    """Raised when a record-only `assign` names an environment releasekit deploys."""

    remedy = "move a deployed environment with `releasekit promote RELEASE --to ENV` (its gates)"


def _committed_environments(settings: Settings) -> tuple[set[str], str]:
    """The environments releasekit.toml deploys as committed at the trust revision, and
    where that is, in words (empty outside git or where it is not committed)."""
    from releasekit.stores.anchor import resolve_commit
    from releasekit.stores.trust import TrustRootError, committed_config, trust_root

    try:
        commit = trust_root(settings.root).commit
    except TrustRootError:
        # No trusted revision to read: the checked-out commit still names what it deploys
        # (a closed environment is the safe side).
        commit = resolve_commit(settings.root, "HEAD")
    if not commit:
        return set(), ""
    table = committed_config(settings.root, commit) or {}
    envs = table.get("environments")
    names = {str(k) for k in envs} if isinstance(envs, dict) else set()
    return names, f"releasekit.toml at {commit[:12]}"


def _check_record_only(settings: Settings, env: str, event_type: str) -> None:
    """A record-only `assign` moves what the ledger says is live without gates, approval
    or a deploy: refused where releasekit deploys the environment by the committed
    releasekit.toml or this command's settings (module docstring); allowed where the ledger
    is only a registry of aliases."""
    if event_type != EventType.ASSIGN.value:
        return
    committed, where = _committed_environments(settings)
    base = parent_env(env)  # an adapter lane is deployed where its environment is
    if base in committed:
        why = f"[environments.{base}] in {where}"
    elif base in settings.environments:
        why = f"[environments.{base}] in this command's settings"
    else:
        return
    raise DeployedEnvironmentError(
        f"{env} is deployed by releasekit ({why}): `assign` only records, so it cannot move it"
    )


def _check_never_deployed(ledger: Ledger, env: str, event_type: str) -> None:
    """The same refusal where the ledger shows releasekit deployed the environment."""
    if event_type != EventType.ASSIGN.value:
        return
    rec = ledger.deployed(env)
    if rec is not None:
        raise DeployedEnvironmentError(
            f"{env} is deployed by releasekit (the ledger shows a {rec.type} event there, "
            f"record {rec.seq}): `assign` only records, so it cannot move it"
        )


def _pause_for_tests() -> None:
    """Test hook: with RELEASEKIT_TEST_PAUSE_AFTER_APPEND=<seconds>, stop between the ledger
    append and the alias move (touching RELEASEKIT_TEST_PAUSE_MARKER, if set, first) so a
    test can kill the process exactly there."""
    pause = os.environ.get(PAUSE_ENV)
    if not pause:
        return
    marker = os.environ.get(PAUSE_MARKER_ENV)
    if marker:
        Path(marker).write_text(str(os.getpid()))
    time.sleep(float(pause))


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
    lock_timeout_s: float | None = None,
) -> AssignResult:
    """Record that `env` now runs a release, then move the alias `env` to its model version.

    Under the environment's lock (in the ledger's database, so concurrent assigns from any
    process or machine serialise): first repair any drift an earlier crash left (alias !=
    the ledger's last live event: a `repair` event, then the alias), then append the live
    event (the truth), then move the alias (its projection), with SIGINT/SIGTERM held so a
    signal cannot split the two. If the process dies in between anyway, the next assign,
    `status` and `reconcile` see the drift.

    `release_ref` is anything `resolve_release` accepts. The alias is removed from the
    previous release's registered model when that is a different model, so exactly one
    `models:/<name>@<env>` exists. Re-assigning the release already live is a no-op
    (changed=False) unless `force`. Raises AliasDriftError when the event was recorded but
    the alias could not be moved.
    """
    from releasekit.releases.context import release_manifest, report_digests
    from releasekit.releases.resolve import resolve_release

    etype = EventType(event_type)
    _check_record_only(settings, env, etype.value)
    led = ledger or open_ledger(settings)
    _check_never_deployed(led, env, etype.value)
    ref = resolve_release(settings, release_ref, ledger=led)
    rid = ref.release_id
    manifest = release_manifest(settings, rid, ledger=led)
    _check_env(env, [e.name for e in manifest.environments] if manifest else None)
    uri = tracking_uri(settings)
    client = client_for(settings)
    with mlflow_errors(f"looking up release {rid[:SHORT]}", uri=uri):
        found = _search_versions(client, rid, None)
    if not found:
        raise RegistryError(
            f"release {rid[:SHORT]} is not registered in MLflow ({redact_url(uri)})",
            remedy="run `releasekit register MANIFEST` first",
        )
    target = found[0]
    ev: dict[str, Any] = {
        "mlflow_run_id": target.run_id,
        "model_name": target.model_name,
        "model_version": target.version,
        "model_uri": target.model_uri,
        "tracking_uri": redact_url(uri),
    }
    digests = report_digests(settings, rid)
    if digests:
        ev["reports"] = digests
    ev.update(evidence or {})

    with led.lock(f"env:{env}", timeout_s=lock_timeout_s or ASSIGN_LOCK_TIMEOUT_S):
        current = led.live_at(env)
        repaired = None
        if current is not None:
            repaired = repair_env(client, led, env, current, actor=actor, also={target.model_name})
        prev_rid = current.to_release if current else None
        prev_model = (
            str(current.evidence.get("model_name"))
            if current and current.evidence.get("model_name")
            else None
        )
        prev_version = (
            str(current.evidence.get("model_version"))
            if current and current.evidence.get("model_version") is not None
            else None
        )
        on_target = _alias(client, target.model_name, env)

        def result(
            changed: bool, previous_version: str | None, record: LedgerRecord | None
        ) -> AssignResult:
            """What this assign did: `changed`, recorded as `record`."""
            return AssignResult(
                release_id=rid,
                model_name=target.model_name,
                version=target.version,
                environment=env,
                event_type=etype.value,
                changed=changed,
                previous_release_id=prev_rid,
                previous_model_name=prev_model,
                previous_version=previous_version,
                record=record,
                repaired=repaired.record if repaired else None,
                warnings=list(led.warnings),
            )

        if (
            not force
            and prev_rid == rid
            and on_target is not None
            and on_target.version == target.version
        ):
            return result(False, target.version, current)
        if current is not None:
            ev["previous_model_version"] = current.evidence.get("model_version")
        with deferred_signals():
            # The truth first, then its projection; a signal waits until both are done.
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
            _pause_for_tests()
            try:
                set_alias(client, target.model_name, env, target.version)
                if prev_model and prev_model != target.model_name:
                    delete_alias(client, prev_model, env)
            except RegistryError as exc:
                raise AliasDriftError(
                    f"recorded the {etype.value} of {rid[:SHORT]} to {env} (ledger record "
                    f"{rec.seq}) but could not move models:/{target.model_name}@{env}: "
                    f"{exc.message}",
                    environment=env,
                    seq=rec.seq,
                ) from exc
    return result(True, prev_version, rec)
