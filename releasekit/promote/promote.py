"""Promote a release to an environment: policy (bad releases, environment order), gates over
evidence against the live release, then a blue/green deploy and the record.

    result = promote(settings, "manifests/demo-w8a8.yaml", env="staging", reason="...")

Outcomes (`PromoteResult.status`):
- `dry_run`: the gate report only; no ledger event, no process, no file;
- `blocked`: a gate failed; a `gate_failed` event names the failed gates and the report;
- `deploy_failed`: the release did not start or failed its smoke suite (it never got
  traffic), or failed after the switch (traffic went back by itself): a `deploy_failed`
  event says why;
- `promoted`: traffic is on the release and the record moved (a `promote` event, or an
  `override` event listing the failed gates when forced);
- `already_live`: the release is live and serving; nothing to do;
- `redeployed`: the release of record was not running (after `down`); it serves again.
"""

from __future__ import annotations

import datetime as dt
from typing import Any, Literal

from pydantic import BaseModel, Field

from releasekit._support.progress import Progress
from releasekit.config import Settings
from releasekit.deploy.state import read_state
from releasekit.errors import ReleasekitError
from releasekit.promote.context import (
    ReleaseContextError,
    ReleaseInfo,
    load_release,
    release_spec,
    smoke_probe,
)
from releasekit.promote.deploy import DeployOutcome, deploy_release, env_config
from releasekit.promote.gates import GateReport, GateResult, evaluate_gates
from releasekit.promote.report import write_report
from releasekit.releases.assign import AssignResult, assign
from releasekit.releases.prompt_alias import PromptAliasResult, move_prompt_alias
from releasekit.releases.resolve import resolve_release
from releasekit.stores.ledger import Event, EventType, Ledger, LedgerRecord, open_ledger

PromoteStatus = Literal[
    "dry_run", "blocked", "deploy_failed", "promoted", "already_live", "redeployed"
]


class PromoteError(ReleasekitError):
    """Raised when a promotion cannot even be attempted: the environment is not one the
    release may go to, or --force came without a reason."""

    remedy = "read the message; `releasekit promote --help` lists the options"


class PromoteResult(BaseModel):
    """What a promotion did, with the gate report and the deploy's steps."""

    status: PromoteStatus
    environment: str
    release_id: str
    release_name: str
    live_release_id: str | None = None
    forced: bool = False
    overridden: list[str] = Field(default_factory=list, description="failed gates overridden")
    report: GateReport | None = None
    report_json: str | None = None
    report_html: str | None = None
    deploy: DeployOutcome | None = None
    record: LedgerRecord | None = None
    prompt_alias: PromptAliasResult | None = None
    warnings: list[str] = Field(default_factory=list)
    gateway_url: str | None = None

    @property
    def ok(self) -> bool:
        """True when the release serves the environment (or a dry run passed its gates)."""
        if self.status == "dry_run":
            return bool(self.report and self.report.passed)
        return self.status in ("promoted", "already_live", "redeployed")


def _open_ledger(settings: Settings, *, read_only: bool = False) -> Ledger:
    # Signed and anchored like every other writer (stores.ledger.open_ledger).
    return open_ledger(settings, read_only=read_only)


def marked_bad(ledger: Ledger, release_id: str) -> LedgerRecord | None:
    """The latest `mark_bad` event of a release (a rollback moved away from it), or None."""
    for rec in ledger.records(
        release=release_id, types=[EventType.MARK_BAD.value], newest_first=True
    ):
        if rec.to_release == release_id:
            return rec
    return None


def was_live_in(ledger: Ledger, release_id: str, env: str) -> bool:
    """True when the ledger shows `release_id` was ever live in `env`."""
    return any(r.to_release == release_id for r in ledger.records(environment=env, live=True))


def policy_gates(
    settings: Settings, info: ReleaseInfo, *, env: str, ledger: Ledger
) -> list[GateResult]:
    """The release may go to `env` at all: not marked bad, and live first in every
    environment the policy requires (releasekit.toml `requires` and the manifest's)."""
    cfg = env_config(settings, env)
    gates: list[GateResult] = []
    bad = marked_bad(ledger, info.release_id)
    gates.append(
        GateResult(
            name="not marked bad",
            kind="policy",
            passed=bad is None,
            rule="a release rolled back from is refused unless forced",
            detail=(
                f"marked bad in {bad.environment} at {bad.time:%Y-%m-%d %H:%M:%SZ}: {bad.reason}"
                if bad
                else "ok"
            ),
        )
    )
    required = {cfg.requires} | {e.requires for e in info.lm.manifest.environments if e.name == env}
    for need in sorted(r for r in required if r):
        ok = was_live_in(ledger, info.release_id, need)
        gates.append(
            GateResult(
                name=f"live in {need} first",
                kind="policy",
                passed=ok,
                rule=f"{env} takes only releases that have been live in {need}",
                detail="ok" if ok else f"{info.short_id} was never live in {need}",
            )
        )
    return gates


def _check_allowed(info: ReleaseInfo, env: str) -> None:
    allowed = [e.name for e in info.lm.manifest.environments]
    if env not in allowed:
        raise PromoteError(
            f"{info.name} may not go to {env!r}: its manifest lists {', '.join(allowed)}",
            remedy="add the environment to the manifest's `environments` (a new release)",
        )


def _live_info(settings: Settings, live_id: str, ledger: Ledger) -> tuple[ReleaseInfo | None, str]:
    try:
        return load_release(settings, live_id, ledger=ledger), ""
    except ReleaseContextError as exc:
        return None, exc.message


def _running(settings: Settings, env: str, release_id: str) -> bool:
    from releasekit.deploy.local import process_alive

    st = read_state(settings.state_dir, env)
    if release_id not in st.routed_release_ids() or st.gateway is None:
        return False
    urls = {r.base_url for r in st.routes if r.release_id == release_id}
    return process_alive(st.gateway.pid, st.gateway.proc_start) and any(
        s.base_url in urls and process_alive(s.pid, s.proc_start) for s in st.servers
    )


def _gate_summary(report: GateReport) -> dict[str, Any]:
    return {
        "passed": report.passed,
        "mode": report.mode,
        "failed": [g.name for g in report.failed],
        "against": report.live_release_id,
    }


class RecordMove(BaseModel):
    """What moving the record did: the ledger event (with the MLflow model alias, via
    `assign`) and the prompt alias."""

    assign: AssignResult
    prompt_alias: PromptAliasResult | None = None
    warnings: list[str] = Field(default_factory=list)


def move_record(
    settings: Settings,
    release_id: str,
    *,
    env: str,
    reason: str,
    event_type: EventType,
    evidence: dict[str, Any],
    actor: str | None,
    previous_release_id: str | None,
    ledger: Ledger,
) -> RecordMove:
    """The one place promote and rollback move an environment's record: a live ledger
    event and the MLflow model alias (`releases.assign.assign`, both or neither), then the
    prompt alias (a failure there is a warning: the record already moved)."""
    res = assign(
        settings,
        release_id,
        env=env,
        reason=reason,
        event_type=event_type.value,
        evidence=evidence,
        actor=actor,
        ledger=ledger,
    )
    move = RecordMove(assign=res)
    try:
        move.prompt_alias = move_prompt_alias(
            settings,
            env=env,
            release_id=release_id,
            previous_release_id=previous_release_id,
            ledger=ledger,
        )
    except ReleasekitError as exc:
        move.warnings.append(f"prompt alias not moved: {exc.message}")
    return move


def promote(
    settings: Settings,
    release_ref: str,
    *,
    env: str,
    reason: str = "",
    dry_run: bool = False,
    force: bool = False,
    actor: str | None = None,
    progress: Progress | None = None,
    ledger: Ledger | None = None,
) -> PromoteResult:
    """Promote `release_ref` (anything resolve_release accepts) to `env`; see the module
    docstring for the outcomes. --force needs a reason and overrides failed gates (policy
    included), recorded as an `override` event that lists them."""
    say = progress or (lambda label, done, total: None)
    cfg = env_config(settings, env)
    if force and not reason.strip():
        raise PromoteError("--force needs --reason: an override must say why")
    led = ledger or _open_ledger(settings, read_only=dry_run)
    rid = resolve_release(settings, release_ref, ledger=led).release_id
    info = load_release(settings, rid, ledger=led)
    _check_allowed(info, env)
    live_rec = led.live_at(env)
    live_id = live_rec.to_release if live_rec else None
    base = PromoteResult(
        status="dry_run",
        environment=env,
        release_id=rid,
        release_name=info.name,
        live_release_id=live_id,
        forced=force,
    )
    if live_id == rid:
        if _running(settings, env, rid):
            return base.model_copy(update={"status": "already_live"})
        if dry_run:
            return base
        # The release of record is not serving (after `down` or a crash): serve it again.
        say("deploying", 0, 0)
        spec = release_spec(settings, info, ledger=led)

        def redeploy_record(url: str) -> None:
            led.append(
                Event(
                    type=EventType.DEPLOY,
                    environment=env,
                    from_release=rid,
                    to_release=rid,
                    reason=reason or "redeploy the release of record",
                    evidence={"gateway": url},
                    live=False,
                    actor=actor,
                )
            )

        outcome = deploy_release(
            settings,
            env=env,
            spec=spec,
            probe=smoke_probe(cfg, info),
            record=redeploy_record,
            ledger=led,
            expected_live=live_id,
            actor=actor,
        )
        return base.model_copy(
            update={
                "status": "redeployed" if outcome.ok else "deploy_failed",
                "deploy": outcome,
                "gateway_url": outcome.gateway_url,
            }
        )

    say("checking gates", 0, 0)
    policy = policy_gates(settings, info, env=env, ledger=led)
    if live_id is None:
        report = evaluate_gates(settings, env=env, candidate=info, live=None)
    else:
        live_info, problem = _live_info(settings, live_id, led)
        if live_info is None:
            report = GateReport(
                environment=env,
                candidate_release_id=rid,
                candidate_name=info.name,
                live_release_id=live_id,
                mode="relative",
                passed=False,
                gates=[
                    GateResult(
                        name="live release evidence",
                        kind="evidence",
                        passed=False,
                        rule="the live release's manifest, lock and evidence must be readable",
                        detail=f"missing or mismatched evidence: {problem}",
                    )
                ],
            )
        else:
            report = evaluate_gates(settings, env=env, candidate=info, live=live_info)
    report = report.with_gates(policy)
    if not cfg.gates_required:
        # Advisory: shown, not blocking (policy gates still block).
        report = report.model_copy(update={"passed": all(g.passed for g in policy)})
    result = base.model_copy(update={"report": report})
    if dry_run:
        return result

    stem = f"{env}-{info.name}-{info.short_id}-{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%SZ}"
    jpath, hpath = write_report(report, settings.state_dir / "reports", stem=stem)
    result = result.model_copy(update={"report_json": str(jpath), "report_html": str(hpath)})
    failed = [g.name for g in report.failed if cfg.gates_required or g.kind == "policy"]
    if failed and not force:
        rec = led.append(
            Event(
                type=EventType.GATE_FAILED,
                environment=env,
                from_release=live_id,
                to_release=rid,
                reason=reason or f"blocked: {', '.join(failed)}",
                evidence={"gates": _gate_summary(report), "report": str(jpath)},
                live=False,
                actor=actor,
            )
        )
        return result.model_copy(update={"status": "blocked", "record": rec})

    say("deploying", 0, 0)
    spec = release_spec(settings, info, ledger=led)
    probe = smoke_probe(cfg, info)
    event_type = EventType.OVERRIDE if failed else EventType.PROMOTE
    recorded: dict[str, RecordMove] = {}

    def record(url: str) -> None:
        evidence: dict[str, Any] = {
            "gates": _gate_summary(report),
            "gate_report": str(jpath),
            "gateway": url,
            "serving_key": spec.serving_key,
        }
        if failed:
            evidence["overrode"] = failed
        recorded["move"] = move_record(
            settings,
            rid,
            env=env,
            reason=reason or f"promote {info.name} to {env}",
            event_type=event_type,
            evidence=evidence,
            actor=actor,
            previous_release_id=live_id,
            ledger=led,
        )

    outcome = deploy_release(
        settings,
        env=env,
        spec=spec,
        probe=probe,
        record=record,
        ledger=led,
        expected_live=live_id,
        actor=actor,
    )
    move: RecordMove | None = recorded.get("move")
    return result.model_copy(
        update={
            "status": "promoted" if outcome.ok else "deploy_failed",
            "overridden": failed,
            "deploy": outcome,
            "record": move.assign.record if move else outcome.failure_event,
            "prompt_alias": move.prompt_alias if move else None,
            "warnings": [*(move.assign.warnings if move else []), *(move.warnings if move else [])],
            "gateway_url": outcome.gateway_url,
        }
    )
