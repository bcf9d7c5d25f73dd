"""Promote a release to an environment: policy (bad releases, environment order), gates over
evidence against the live release, then a blue/green deploy and the record.

    result = promote(settings, "manifests/demo-w8a8.yaml", env="staging", reason="...")

The environment's policy is the committed one (`releasekit.promote.policy`): a policy that
differs for this command is refused (PolicyError) before anything else; the gates are
judged under it, and every event records it with its source.

Outcomes (`PromoteResult.status`):
- `dry_run`: the gate report only; no ledger event, no process, no file;
- `blocked`: a gate failed; a `gate_failed` event names the failed gates and the report;
- `canary_aborted`: a canary step breached (or lacked evidence in time): traffic went back
  to the stable release and a `canary_aborted` event holds the breaching windows;
- `deploy_failed`: the release did not start or failed its smoke suite (it never got
  traffic), or failed after the switch (traffic went back by itself): a `deploy_failed`
  event says why;
- `promoted`: traffic is on the release and the record moved (a `promote` event, or an
  `override` event listing the failed gates when forced);
- `already_live`: the release is live and serving; nothing to do;
- `redeployed`: the release of record was not running (after `down`); it serves again.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field

from releasekit._support.progress import Progress
from releasekit.config import EnvironmentConfig, Settings
from releasekit.deploy.ray.autoscale import AutoscalePlan, plan_for
from releasekit.deploy.state import read_state
from releasekit.errors import ReleasekitError
from releasekit.promote.approvals import approval_for, approval_gate, wait_for_approval
from releasekit.promote.ceilings import CEILING_FIELDS, CanaryWithin, canary_within
from releasekit.promote.context import (
    ReleaseContextError,
    ReleaseInfo,
    load_release,
    release_knee,
    release_spec,
    smoke_probe,
)
from releasekit.promote.deploy import (
    DeployOutcome,
    ShiftContext,
    ShiftFn,
    ShiftResult,
    deploy_release,
    env_config,
)
from releasekit.promote.gates import GateKind, GateReport, GateResult, evaluate_gates
from releasekit.promote.policy import EnvironmentPolicy, environment_policy, read_policy
from releasekit.promote.report import write_report
from releasekit.releases.assign import AssignResult, assign
from releasekit.releases.prompt_alias import PromptAliasResult, move_prompt_alias
from releasekit.releases.resolve import resolve_release
from releasekit.stores.ledger import Event, EventType, Ledger, LedgerRecord, open_ledger
from releasekit.stores.ledger.queries import SERVED_TYPES

PromoteStatus = Literal[
    "dry_run",
    "blocked",
    "deploy_failed",
    "canary_aborted",
    "promoted",
    "already_live",
    "redeployed",
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
    canary: dict[str, Any] | None = Field(
        None, description="the canary steps as they ran (releasekit.rollout.canary.CanaryRun)"
    )
    canary_power: list[dict[str, Any]] | None = Field(
        None, description="each canary check's power at its min_samples (rollout.power)"
    )
    autoscaling: AutoscalePlan | None = Field(
        None, description="how the release's replicas scale there (a ray environment's policy)"
    )

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
    """True when the ledger shows `release_id` was ever put in place in `env` by promote or
    rollback (`SERVED_TYPES`); an `assign` record only moved a name, so it never counts
    (not for `requires`, a redeploy or `rollback --to`)."""
    return any(
        r.to_release == release_id
        for r in ledger.records(environment=env, live=True, types=SERVED_TYPES)
    )


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
            rule="a release rolled back from is refused unless forced (`--force policy`)",
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
    from releasekit.deploy.local import check_health, process_alive

    st = read_state(settings.state_dir, env)
    if release_id not in st.routed_release_ids() or st.gateway is None:
        return False
    urls = {r.base_url for r in st.routes if r.release_id == release_id}
    return process_alive(st.gateway.pid, st.gateway.proc_start) and any(
        s.base_url in urls
        and (s.app is None or s.release_id == release_id)
        and (
            check_health(s.base_url, s.model, api_key=s.api_key, timeout_s=3.0)
            if s.app
            else process_alive(s.pid, s.proc_start)
        )
        for s in st.servers
    )


def _gate_summary(report: GateReport) -> dict[str, Any]:
    """What a decision's event records of its gates: the verdict, the failed ones, and
    each gate's verdict with the figures it judged (what `releasekit audit replay`
    recomputes and compares)."""
    return {
        "passed": report.passed,
        "mode": report.mode,
        "failed": [g.name for g in report.failed],
        "advisory_failed": [g.name for g in report.advisory_failed],
        "against": report.live_release_id,
        "verdicts": [
            {
                "name": g.name,
                "kind": g.kind,
                "passed": g.passed,
                "advisory": g.advisory,
                "candidate": g.candidate,
                "live": g.live,
                "limit": g.limit,
            }
            for g in report.gates
        ],
    }


PERF_BY_CANARY_UNUSED = (
    "perf_by_canary does not apply: the release's canary has no judged step below 100% "
    "with a required latency check (ttft_p95_s or tpot_p95_s), so its perf gates block"
)


PERF_BY_CANARY_CLAMPED = (
    "perf_by_canary does not apply: the release's canary asks for more than {env}'s "
    "ceilings allow (it runs clamped), so its perf gates block"
)


def canary_ceiling_gate(within: CanaryWithin, *, perf_by_canary: bool) -> GateResult:
    """A report row saying what of the manifest's canary the environment's ceilings
    clamped (it passes: the canary runs within them), and that `perf_by_canary` does not
    apply to it."""
    detail = within.note
    if perf_by_canary:
        detail += "; perf_by_canary does not apply: the offline perf gates block"
    return GateResult(
        name=f"canary within {within.environment}'s ceilings",
        kind="policy",
        passed=True,
        rule="a manifest's canary is never looser than the environment's ceilings ("
        + ", ".join(CEILING_FIELDS)
        + ")",
        detail=detail,
    )


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
    prompt alias (a failure there is a warning: the record already moved). The event
    carries the environment's policy and its source (`evidence["policy"]`; read here when
    the caller did not: a rollback records it without refusing, a way back must work)."""
    if "policy" not in evidence:
        cfg = settings.environments.get(env)
        if cfg is not None:
            evidence = {**evidence, "policy": read_policy(settings, env, cfg).evidence()}
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


class PromoteRequest(BaseModel):
    """What a promotion is asked to do: which release, to which environment, why, by whom,
    and whether it is a dry run or forced over failed gates."""

    release_ref: str = Field(description="anything resolve_release accepts")
    env: str
    reason: str = ""
    dry_run: bool = False
    force: list[GateKind] = Field(
        default_factory=list,
        description="the kinds of gate an override may carry past (perf, quality, evidence, "
        "policy); each must be named, so a performance override never carries a quality "
        "failure",
    )
    actor: str | None = None
    approval_wait_s: float | None = Field(
        None, ge=0, description="wait this long for a missing approval (default: the env's)"
    )
    replicas: int | None = Field(
        None,
        ge=1,
        description="`ray` target: replicas of the release instead of the environment's "
        "count (e.g. the capacity plan's units)",
    )
    canary_steps: bool = Field(
        False,
        description="the release goes live through its manifest's canary steps (where the "
        "environment has `perf_by_canary`, its offline perf gates are then advisory)",
    )


@dataclass(frozen=True)
class PromoteTarget:
    """A resolved promotion: the candidate, the environment's settings and the release of
    record there."""

    info: ReleaseInfo
    cfg: EnvironmentConfig
    live_id: str | None
    base: PromoteResult
    policy: EnvironmentPolicy | None = None


def promote(
    settings: Settings,
    release_ref: str,
    *,
    env: str,
    reason: str = "",
    dry_run: bool = False,
    force: Sequence[GateKind] = (),
    actor: str | None = None,
    progress: Progress | None = None,
    ledger: Ledger | None = None,
    approval_wait_s: float | None = None,
    replicas: int | None = None,
) -> PromoteResult:
    """Promote `release_ref` (anything resolve_release accepts) to `env`; see the module
    docstring for the outcomes. `force` names the kinds of gate an override may carry past
    (`perf`, `quality`, `evidence`, `policy`: each named on its own); it needs a reason and
    is recorded as an `override` event that lists the gates it overrode. A failed gate of a
    kind not named still blocks."""
    request = PromoteRequest(
        release_ref=release_ref,
        env=env,
        reason=reason,
        dry_run=dry_run,
        force=list(dict.fromkeys(force)),
        actor=actor,
        approval_wait_s=approval_wait_s,
        replicas=replicas,
    )
    return run_promotion(settings, request, progress=progress, ledger=ledger)


def release_autoscaling(
    settings: Settings, env: str, cfg: EnvironmentConfig, info: ReleaseInfo
) -> AutoscalePlan | None:
    """How `info`'s replicas scale in `env` (None: not an autoscaled ray environment);
    NoKneeEvidenceError when the environment derives the target from a knee the release
    lacks (its verified load test: `release_knee`)."""
    auto = cfg.ray.autoscaling if cfg.target == "ray" and cfg.ray is not None else None
    if auto is None:
        return None
    knee, problem = release_knee(settings, info)
    assert cfg.ray is not None
    return plan_for(
        env, auto, info.release_id, knee, problem or None, replica_cpus=cfg.ray.cpus_per_replica
    )


def run_promotion(
    settings: Settings,
    request: PromoteRequest,
    *,
    progress: Progress | None = None,
    ledger: Ledger | None = None,
    shift: ShiftFn | None = None,
    extra_gates: Callable[[str], list[GateResult]] | None = None,
) -> PromoteResult:
    """The steps of a promotion: resolve, (serve the record again,) gates, block or deploy,
    record. `shift` (canary steps, from `releasekit.rollout`) runs before the switch;
    `extra_gates(release_id)` adds gates from above (the shadow comparison)."""
    say = progress or (lambda label, done, total: None)
    cfg = env_config(settings, request.env)
    if request.replicas is not None and cfg.target != "ray":
        raise PromoteError(
            f"--replicas applies to the ray target; {request.env} runs on {cfg.target}",
            remedy="leave out --replicas, or point the environment at a Ray cluster",
        )
    if request.force and not request.reason.strip():
        raise PromoteError("--force needs --reason: an override must say why")
    # The environment's policy is the committed one; a one-command change is refused.
    policy = environment_policy(settings, request.env, cfg)
    led = ledger or _open_ledger(settings, read_only=request.dry_run)
    led.verified()  # what is live, mark_bad, approvals: decided on verified records only
    target = resolve_target(settings, request, cfg=cfg, ledger=led, policy=policy)
    rid = target.info.release_id
    # Autoscaling from the knee: a release without usable knee evidence is refused here,
    # before any gate runs or anything is deployed.
    scaling = release_autoscaling(settings, request.env, cfg, target.info)
    if scaling is not None:
        target = dataclasses.replace(
            target, base=target.base.model_copy(update={"autoscaling": scaling})
        )
    if target.live_id == rid:
        if _running(settings, request.env, rid):
            return target.base.model_copy(update={"status": "already_live"})
        if request.dry_run:
            return target.base
        say("deploying", 0, 0)
        return redeploy_record(settings, request, target, ledger=led)

    say("checking gates", 0, 0)
    report = check_gates(settings, target, ledger=led)
    if extra_gates is not None:
        more = extra_gates(rid)
        if more:
            report = report.with_gates(more)
    cfg = target.cfg
    notes: list[str] = []
    canary = target.info.lm.manifest.promotion.canary if request.canary_steps else None
    within = canary_within(canary, cfg, request.env) if canary is not None else None
    by_canary = bool(
        request.canary_steps and target.live_id and cfg.perf_by_canary and cfg.gates_required
    )
    if within is not None and within.clamped:
        # The manifest asked for a looser canary than the environment allows: it runs
        # clamped, and it does not stand in for the offline perf gates.
        report = report.with_gates([canary_ceiling_gate(within, perf_by_canary=by_canary)])
        if by_canary:
            notes.append(PERF_BY_CANARY_CLAMPED.format(env=request.env))
    elif by_canary:
        # This environment lets the canary judge performance on live traffic (there is a
        # stable release to judge it against; where gates are advisory anyway, nothing to
        # do), when the canary does judge latency at a step below 100%.
        if canary is not None and canary.judges_latency:
            report = report.perf_judged_live()
        else:
            notes.append(PERF_BY_CANARY_UNUSED)
    if target.cfg.requires_approval:
        report = _with_approval(request, target, report, ledger=led, say=say)
    report = decide_here(report, cfg)
    if target.policy is not None:
        pol = target.policy
        source = f"{pol.where}, digest {pol.source.digest[:12]}"
        report = report.model_copy(update={"policy_source": source})
    if scaling is not None:  # the replica range the release would run with, in the report
        report = report.model_copy(update={"scaling": scaling.text})
    result = target.base.model_copy(update={"report": report, "warnings": notes})
    if request.dry_run:
        return result

    stem = f"{request.env}-{target.info.name}-{target.info.short_id}-"
    stem += f"{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%SZ}"
    jpath, hpath = write_report(report, settings.state_dir / "reports", stem=stem)
    result = result.model_copy(update={"report_json": str(jpath), "report_html": str(hpath)})
    failed = blocking_failures(report, target.cfg)
    forced = set(request.force)
    kinds = {g.name: g.kind for g in report.gates}
    # An approval is a person's decision: no override stands in for it.
    unforced = [
        name for name in failed if kinds.get(name) not in forced or kinds.get(name) == "approval"
    ]
    if unforced:
        return record_block(request, target, result, report, failed=unforced, ledger=led)

    say("deploying", 0, 0)
    return deploy_and_record(
        settings, request, target, result, report, failed=failed, ledger=led, shift=shift
    )


def resolve_target(
    settings: Settings,
    request: PromoteRequest,
    *,
    cfg: EnvironmentConfig,
    ledger: Ledger,
    policy: EnvironmentPolicy | None = None,
) -> PromoteTarget:
    """Resolve the release, check its manifest allows the environment, and read what is
    live there (PromoteError when the manifest does not list the environment)."""
    rid = resolve_release(settings, request.release_ref, ledger=ledger).release_id
    info = load_release(settings, rid, ledger=ledger)
    _check_allowed(info, request.env)
    # The release releasekit put in place there: an `assign` record deployed nothing, so
    # its release is neither redeployed without gates nor the one the gates compare with.
    live_rec = ledger.served_at(request.env)
    live_id = live_rec.to_release if live_rec else None
    base = PromoteResult(
        status="dry_run",
        environment=request.env,
        release_id=rid,
        release_name=info.name,
        live_release_id=live_id,
        forced=bool(request.force),
    )
    return PromoteTarget(info=info, cfg=cfg, live_id=live_id, base=base, policy=policy)


def redeploy_record(
    settings: Settings, request: PromoteRequest, target: PromoteTarget, *, ledger: Ledger
) -> PromoteResult:
    """The release of record is not serving (after `down` or a crash): serve it again,
    recording a non-live `deploy` event (no gates: it already holds the record)."""
    env, info, rid = request.env, target.info, target.info.release_id
    spec = release_spec(settings, info, ledger=ledger)

    def record(url: str) -> None:
        ledger.append(
            Event(
                type=EventType.DEPLOY,
                environment=env,
                from_release=rid,
                to_release=rid,
                reason=request.reason or "redeploy the release of record",
                evidence={"gateway": url},
                live=False,
                actor=request.actor,
            )
        )

    outcome = deploy_release(
        settings,
        env=env,
        spec=spec,
        probe=smoke_probe(target.cfg, info),
        record=record,
        ledger=ledger,
        expected_live=target.live_id,
        actor=request.actor,
        replicas=request.replicas,
    )
    return target.base.model_copy(
        update={
            "status": "redeployed" if outcome.ok else "deploy_failed",
            "deploy": outcome,
            "gateway_url": outcome.gateway_url,
        }
    )


def check_gates(settings: Settings, target: PromoteTarget, *, ledger: Ledger) -> GateReport:
    """Policy gates plus the evidence gates against the live release (absolute checks when
    nothing is live; a failed evidence gate when the live release's evidence is unreadable),
    decided as this environment decides (`decide_here`)."""
    info, env, live_id = target.info, target.base.environment, target.live_id
    policy = policy_gates(settings, info, env=env, ledger=ledger)
    if live_id is None:
        report = evaluate_gates(settings, env=env, candidate=info, live=None, policy=target.cfg)
    else:
        live_info, problem = _live_info(settings, live_id, ledger)
        if live_info is None:
            report = _unreadable_live_report(info, env=env, live_id=live_id, problem=problem)
        else:
            report = evaluate_gates(
                settings, env=env, candidate=info, live=live_info, policy=target.cfg
            )
    return decide_here(report.with_gates(policy), target.cfg)


def _unreadable_live_report(
    info: ReleaseInfo, *, env: str, live_id: str, problem: str
) -> GateReport:
    return GateReport(
        environment=env,
        candidate_release_id=info.release_id,
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


def decide_here(report: GateReport, cfg: EnvironmentConfig) -> GateReport:
    """The report as this environment decides it: where its gates are advisory
    (`gates_required = false`) every failed gate but policy and approval is marked advisory
    (shown as "fail (advisory)", listed in `advisory_failed`); `passed` is then "no failed
    gate blocks", the same rule everywhere."""
    if cfg.gates_required:
        return report
    return report.advisory(None, "advisory here: this environment's gates do not block")


def blocking_failures(report: GateReport, cfg: EnvironmentConfig) -> list[str]:
    """The names of the failed gates that block in this environment."""
    return [g.name for g in decide_here(report, cfg).failed]


def _with_approval(
    request: PromoteRequest,
    target: PromoteTarget,
    report: GateReport,
    *,
    ledger: Ledger,
    say: Progress,
) -> GateReport:
    """The report with the "approved for ENV" gate first, after waiting (not in a dry run)
    up to the request's or the environment's approval wait for a missing approval."""
    rid, env = target.info.release_id, request.env
    wait_s = request.approval_wait_s
    if wait_s is None:
        wait_s = target.cfg.approval_wait_s
    rec = approval_for(ledger, rid, env)
    waited = 0.0
    if rec is None and wait_s > 0 and not request.dry_run:
        say(f"waiting up to {wait_s:g} s for an approval of {target.info.short_id} for {env}", 0, 0)
        t = time.monotonic()
        rec = wait_for_approval(ledger, rid, env, wait_s=wait_s)
        waited = time.monotonic() - t
    gate = approval_gate(env, rec, waited_s=waited)
    return report.with_gates([gate])


def _policy_evidence(target: PromoteTarget) -> dict[str, Any]:
    """The policy the promotion was decided by, with its source, for its ledger event."""
    return {"policy": target.policy.evidence()} if target.policy is not None else {}


def record_block(
    request: PromoteRequest,
    target: PromoteTarget,
    result: PromoteResult,
    report: GateReport,
    *,
    failed: list[str],
    ledger: Ledger,
) -> PromoteResult:
    """A gate failed and nothing forces it: a `gate_failed` event naming the failed gates
    and the report."""
    rec = ledger.append(
        Event(
            type=EventType.GATE_FAILED,
            environment=request.env,
            from_release=target.live_id,
            to_release=target.info.release_id,
            reason=request.reason or f"blocked: {', '.join(failed)}",
            evidence={
                "gates": _gate_summary(report),
                "report": result.report_json,
                **_policy_evidence(target),
            },
            live=False,
            actor=request.actor,
        )
    )
    return result.model_copy(update={"status": "blocked", "record": rec})


def deploy_and_record(
    settings: Settings,
    request: PromoteRequest,
    target: PromoteTarget,
    result: PromoteResult,
    report: GateReport,
    *,
    failed: list[str],
    ledger: Ledger,
    shift: ShiftFn | None = None,
) -> PromoteResult:
    """Blue/green deploy of the candidate (after `shift`'s canary steps, when given); once
    traffic is on it, move the record (a `promote` event, or `override` listing `failed`
    when forced over them)."""
    info, env = target.info, request.env
    spec = release_spec(settings, info, ledger=ledger)
    probe = smoke_probe(target.cfg, info)
    event_type = EventType.OVERRIDE if failed else EventType.PROMOTE
    recorded: dict[str, RecordMove] = {}
    shifted: dict[str, ShiftResult] = {}
    keep_shift: ShiftFn | None = None
    if shift is not None:
        inner = shift

        def keep_shift(ctx: ShiftContext) -> ShiftResult:
            links = {"gate_report": result.report_json or "", "report": result.report_html or ""}
            shifted["result"] = inner(dataclasses.replace(ctx, links=links))
            return shifted["result"]

    def record(url: str) -> None:
        evidence: dict[str, Any] = {
            "gates": _gate_summary(report),
            "gate_report": result.report_json,
            "gateway": url,
            "serving_key": spec.serving_key,
            **_policy_evidence(target),
        }
        if failed:
            evidence["overrode"] = failed
            evidence["forced_kinds"] = list(request.force)
        if target.cfg.requires_approval:
            ok = approval_for(ledger, info.release_id, env)
            if ok is not None:
                evidence["approval"] = {"by": ok.actor, "seq": ok.seq, "reason": ok.reason}
        if "result" in shifted:
            evidence["canary"] = shifted["result"].evidence
        if result.autoscaling is not None:
            evidence["autoscaling"] = result.autoscaling.model_dump(mode="json")
        recorded["move"] = move_record(
            settings,
            info.release_id,
            env=env,
            reason=request.reason or f"promote {info.name} to {env}",
            event_type=event_type,
            evidence=evidence,
            actor=request.actor,
            previous_release_id=target.live_id,
            ledger=ledger,
        )

    outcome = deploy_release(
        settings,
        env=env,
        spec=spec,
        probe=probe,
        record=record,
        ledger=ledger,
        expected_live=target.live_id,
        actor=request.actor,
        shift=keep_shift,
        replicas=request.replicas,
        compare_previous=True,
    )
    move: RecordMove | None = recorded.get("move")
    status: PromoteStatus = "promoted"
    if not outcome.ok:
        status = "canary_aborted" if outcome.failed_stage == "canary" else "deploy_failed"
    return result.model_copy(
        update={
            "status": status,
            "overridden": failed,
            "deploy": outcome,
            "record": move.assign.record if move else outcome.failure_event,
            "prompt_alias": move.prompt_alias if move else None,
            "warnings": [
                *result.warnings,
                *(move.assign.warnings if move else []),
                *(move.warnings if move else []),
            ],
            "gateway_url": outcome.gateway_url,
        }
    )
