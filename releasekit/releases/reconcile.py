"""Drift between the ledger and MLflow: the ledger says what runs where, MLflow aliases
(`models:/<name>@<env>`) are its projection. Find where they disagree, repair from the ledger.

Drift happens when a process dies between recording an assignment and moving the alias, or
when someone moves an alias by hand. `check_drift` compares every environment the ledger
knows with the aliases MLflow holds; `reconcile` (and every `assign`, under the environment's
lock) puts the alias back where the ledger's last live event says, recording a `repair`
event first, so the repair itself is in the record.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, Field

from releasekit._support.text import redact_url
from releasekit.config import Settings
from releasekit.config.lanes import flat_name
from releasekit.errors import RegistryError
from releasekit.releases.queries import EnvStatus, StatusReport, status
from releasekit.stores.ledger import Event, EventType, Ledger, LedgerRecord, open_ledger
from releasekit.stores.mlflow import (
    AliasHolder,
    _alias,
    alias_holders,
    client_for,
    delete_alias,
    set_alias,
    tracking_uri,
)

if TYPE_CHECKING:
    from mlflow import MlflowClient

DriftState = Literal["ok", "drift", "unrecorded", "unchecked"]


class EnvDrift(BaseModel):
    """One environment compared: what the ledger's last live event names, what MLflow's
    alias points at. `state`: ok, drift (they differ), unrecorded (an alias the ledger never
    recorded), unchecked (the event names no model version)."""

    environment: str
    state: DriftState
    ledger_seq: int | None = None
    ledger_release_id: str | None = None
    ledger_model: str | None = None
    ledger_version: str | None = None
    mlflow: list[AliasHolder] = Field(default_factory=list)
    detail: str = ""


class DriftReport(BaseModel):
    """Every environment cross-checked against MLflow at `tracking_uri`."""

    tracking_uri: str
    environments: list[EnvDrift] = Field(default_factory=list)

    @property
    def drifted(self) -> list[EnvDrift]:
        """Environments whose alias disagrees with the ledger (or that the ledger lacks)."""
        return [e for e in self.environments if e.state in ("drift", "unrecorded")]


class EnvStatusDrift(EnvStatus):
    """An environment's status with the MLflow cross-check."""

    drift: DriftState = "unchecked"
    drift_detail: str = ""
    mlflow: list[AliasHolder] = Field(default_factory=list)


class CheckedStatus(StatusReport):
    """`releasekit status`: what the ledger says is live, and whether MLflow agrees.

    `drift_error` is set when MLflow could not be asked (unreachable, store missing); then
    every environment reads `unchecked`.
    """

    environments: list[EnvStatusDrift]  # type: ignore[assignment]
    tracking_uri: str | None = None
    unrecorded: list[EnvDrift] = Field(default_factory=list)
    drift_error: str | None = None

    @property
    def drifted(self) -> list[EnvStatusDrift]:
        """Environments in drift."""
        return [e for e in self.environments if e.drift == "drift"]


class Repair(BaseModel):
    """One environment put back in line (or that would be, in a dry run)."""

    environment: str
    before: list[AliasHolder]
    after: AliasHolder
    removed: list[AliasHolder] = Field(default_factory=list)
    record: LedgerRecord | None = Field(None, description="the repair event (None: dry run)")


class ReconcileResult(BaseModel):
    """What `reconcile` found and did; `unrecorded` aliases are reported, never touched."""

    dry_run: bool
    tracking_uri: str
    checked: int
    repairs: list[Repair] = Field(default_factory=list)
    unrecorded: list[EnvDrift] = Field(default_factory=list)


def expected_of(rec: LedgerRecord) -> AliasHolder | None:
    """The model version a live event put in place, from its evidence (None if unnamed)."""
    name = rec.evidence.get("model_name")
    version = rec.evidence.get("model_version")
    if not name or version is None:
        return None
    return AliasHolder(model_name=str(name), version=str(version))


def diagnose(env: str, rec: LedgerRecord, holders: list[AliasHolder]) -> EnvDrift:
    """Compare an environment's last live event with the versions carrying its alias."""
    want = expected_of(rec)
    base = EnvDrift(
        environment=env,
        state="ok",
        ledger_seq=rec.seq,
        ledger_release_id=rec.to_release,
        ledger_model=want.model_name if want else None,
        ledger_version=want.version if want else None,
        mlflow=holders,
    )
    if want is None:
        return base.model_copy(
            update={"state": "unchecked", "detail": "the ledger event names no model version"}
        )
    if holders == [want]:
        return base
    found = ", ".join(f"{h.model_name} v{h.version}" for h in holders) or "nothing"
    return base.model_copy(
        update={
            "state": "drift",
            "detail": (
                f"alias @{env} points at {found}; the ledger (record {rec.seq}) says "
                f"{want.model_name} v{want.version}"
            ),
        }
    )


def _env_models(led: Ledger, env: str) -> set[str]:
    """Every registered model any event of `env` named (where a stray alias may sit).

    Not only what counts as live: an `assign` recorded after releasekit first deployed the
    environment never counts as live, but it did move the alias, so its model is looked
    at too (and a stray alias there is reported and removed)."""
    return {
        str(r.evidence["model_name"])
        for r in led.records(environment=env)
        if r.evidence.get("model_name")
    }


def holders_for(client: MlflowClient, models: set[str], env: str) -> list[AliasHolder]:
    """The versions of `models` that carry alias `env` (one lookup per model)."""
    out = []
    for name in sorted(models):
        v = _alias(client, name, env)
        if v is not None:
            out.append(AliasHolder(model_name=name, version=v.version))
    return out


def repair_env(
    client: MlflowClient,
    led: Ledger,
    env: str,
    rec: LedgerRecord,
    *,
    actor: str | None = None,
    dry_run: bool = False,
    also: set[str] | None = None,
) -> Repair | None:
    """Put alias `env` back on the version the ledger's live event `rec` names, if MLflow
    disagrees (looking at every model the environment's events named, plus `also`). The
    caller holds the environment's lock. The repair event is written before the alias
    moves (the ledger stays the truth if this process dies in between)."""
    want = expected_of(rec)
    if want is None:
        return None
    models = _env_models(led, env) | {want.model_name} | (also or set())
    holders = holders_for(client, models, env)
    if holders == [want]:
        return None
    removed = [h for h in holders if h.model_name != want.model_name]
    repair = Repair(environment=env, before=holders, after=want, removed=removed)
    if dry_run:
        return repair
    found = ", ".join(f"{h.model_name} v{h.version}" for h in holders) or "nothing"
    event = led.append(
        Event(
            type=EventType.REPAIR,
            environment=env,
            to_release=rec.to_release,
            reason=(
                f"alias @{env} pointed at {found}; put back on {want.model_name} "
                f"v{want.version} as record {rec.seq} says"
            ),
            evidence={
                "ledger_seq": rec.seq,
                "found": [h.model_dump() for h in holders],
                "model_name": want.model_name,
                "model_version": want.version,
            },
            live=False,
            actor=actor,
        )
    )
    set_alias(client, want.model_name, env, want.version)
    for h in removed:
        delete_alias(client, h.model_name, env)
    return repair.model_copy(update={"record": event})


def check_drift(settings: Settings, *, ledger: Ledger | None = None) -> DriftReport:
    """Cross-check every environment in the ledger against MLflow's aliases (read-only:
    a missing ledger or MLflow store is an error, never created)."""
    led = ledger or open_ledger(settings, read_only=True)
    uri = tracking_uri(settings)
    current = [r for r in led.current() if r.environment]
    report = DriftReport(tracking_uri=redact_url(uri))
    if not current:
        return report
    models = {m for r in current for m in _env_models(led, r.environment or "")}
    client = client_for(settings, create=False)
    holders = alias_holders(client, models)
    envs = set()
    for r in current:
        env = r.environment or ""
        envs.add(flat_name(env))  # an adapter lane's alias: <env>__<adapter>
        report.environments.append(diagnose(env, r, holders.get(flat_name(env), [])))
    for alias in sorted(set(holders) - envs):
        report.environments.append(
            EnvDrift(
                environment=alias,
                state="unrecorded",
                mlflow=holders[alias],
                detail=f"alias @{alias} exists in MLflow but the ledger never recorded it",
            )
        )
    return report


def checked_status(settings: Settings, *, ledger: Ledger | None = None) -> CheckedStatus:
    """What is live in each environment (from the ledger), cross-checked against MLflow.

    MLflow trouble (unreachable, no store) does not hide the ledger's answer: the
    environments read `unchecked` and `drift_error` says why.
    """
    led = ledger or open_ledger(settings, read_only=True)
    base = status(settings, ledger=led)
    envs = [EnvStatusDrift(**e.model_dump()) for e in base.environments]
    out = CheckedStatus(environments=envs, tracking_uri=redact_url(tracking_uri(settings)))
    if not envs:
        return out
    try:
        report = check_drift(settings, ledger=led)
    except RegistryError as exc:
        return out.model_copy(update={"drift_error": exc.message})
    by_env = {d.environment: d for d in report.environments}
    for e in envs:
        d = by_env.get(e.environment)
        if d is not None:
            e.drift, e.drift_detail, e.mlflow = d.state, d.detail, d.mlflow
    out.unrecorded = [d for d in report.environments if d.state == "unrecorded"]
    return out


def reconcile(
    settings: Settings,
    *,
    dry_run: bool = False,
    environment: str | None = None,
    actor: str | None = None,
    ledger: Ledger | None = None,
) -> ReconcileResult:
    """Repair every environment whose MLflow alias disagrees with the ledger (or just
    `environment`), each under its lock; `dry_run` says what would change and writes
    nothing. Aliases the ledger never recorded are reported, not removed."""
    led = ledger or open_ledger(settings, read_only=True)  # a missing ledger: error, not created
    if ledger is None and not dry_run:
        led = open_ledger(settings)  # it exists: reopen to write (and sign) repair events
    report = check_drift(settings, ledger=led)
    client = client_for(settings, create=False)
    result = ReconcileResult(
        dry_run=dry_run, tracking_uri=report.tracking_uri, checked=len(report.environments)
    )
    for d in report.environments:
        if environment is not None and d.environment != environment:
            continue
        if d.state == "unrecorded":
            result.unrecorded.append(d)
            continue
        if d.state != "drift":
            continue
        if dry_run:
            rec = led.live_at(d.environment)
            if rec is not None:
                fix = repair_env(client, led, d.environment, rec, dry_run=True)
                if fix is not None:
                    result.repairs.append(fix)
            continue
        with led.lock(f"env:{d.environment}"):
            rec = led.live_at(d.environment)  # re-read under the lock: it may have moved
            if rec is None:
                continue
            fix = repair_env(client, led, d.environment, rec, actor=actor)
        if fix is not None:
            result.repairs.append(fix)
    return result
