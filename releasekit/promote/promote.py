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
from collections.abc import Callable, Sequence
from typing import Any

from releasekit._support.progress import Progress
from releasekit.config import EnvironmentConfig, Settings
from releasekit.config.lanes import flat_name, split_lane
from releasekit.deploy.environments import env_config
from releasekit.deploy.state import read_state
from releasekit.promote.approvals import approval_for
from releasekit.promote.ceilings import canary_within
from releasekit.promote.context import ReleaseInfo, load_release, release_spec, smoke_probe
from releasekit.promote.deploy import deploy_release
from releasekit.promote.deploy_models import ShiftContext, ShiftFn, ShiftResult
from releasekit.promote.gate_results import GateKind, GateReport, GateResult
from releasekit.promote.policy import EnvironmentPolicy, environment_policy
from releasekit.promote.promote_checks import (
    PERF_BY_CANARY_CLAMPED,
    PERF_BY_CANARY_UNUSED,
    _check_allowed,
    _with_approval,
    blocking_failures,
    canary_ceiling_gate,
    check_gates,
    decide_here,
    policy_gates,
    release_autoscaling,
)
from releasekit.promote.promote_models import (
    PromoteError,
    PromoteRequest,
    PromoteResult,
    PromoteStatus,
    PromoteTarget,
)
from releasekit.promote.records import (
    RecordMove,
    _gate_summary,
    _open_ledger,
    marked_bad,
    move_record,
    was_live_in,
)
from releasekit.promote.report import write_gate_report
from releasekit.releases.resolve import resolve_release
from releasekit.stores.ledger import Event, EventType, Ledger


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

    stem = f"{flat_name(request.env)}-{target.info.name}-{target.info.short_id}-"
    stem += f"{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%SZ}"
    written = write_gate_report(report, settings.state_dir / "reports", stem=stem)
    result = result.model_copy(
        update={"report_json": str(written.json_path), "report_html": str(written.html_path)}
    )
    sha = written.json_sha256  # what the record vouches for: the bytes written, not re-read
    failed = blocking_failures(report, target.cfg)
    forced = set(request.force)
    kinds = {g.name: g.kind for g in report.gates}
    # An approval is a person's decision: no override stands in for it.
    unforced = [
        name for name in failed if kinds.get(name) not in forced or kinds.get(name) == "approval"
    ]
    if unforced:
        return record_block(
            request, target, result, report, failed=unforced, ledger=led, report_sha256=sha
        )

    say("deploying", 0, 0)
    return deploy_and_record(
        settings,
        request,
        target,
        result,
        report,
        failed=failed,
        ledger=led,
        shift=shift,
        report_sha256=sha,
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
    compare_id = None
    env, lane = split_lane(request.env)
    if lane is not None:
        check_lane_release(info, lane=lane, env=env)
        if request.canary_steps:
            raise PromoteError(
                f"{request.env} is an adapter lane: its releases switch at once on the live "
                "engine (a rollback moves the route back in under a second); canary steps "
                "for a lane are not supported",
                remedy="promote it with --no-canary",
            )
        if live_id is None:  # the lane's first release is judged against the live base
            base_rec = ledger.served_at(env)
            compare_id = base_rec.to_release if base_rec else None
    else:
        lanes = {r.lane for r in read_state(settings.state_dir, env).routes if r.lane}
        clash = sorted(lanes & {a.name for a in info.lm.manifest.adapters})
        if clash:
            raise PromoteError(
                f"{info.name} carries adapter {', '.join(clash)}, which {env} serves in its "
                f"own lane ({', '.join(f'{env}:{n}' for n in clash)}): one adapter name has "
                "one release of record",
                remedy="promote the adapter to its lane, or take the lane down first",
            )
    base = PromoteResult(
        status="dry_run",
        environment=request.env,
        release_id=rid,
        release_name=info.name,
        live_release_id=live_id,
        forced=bool(request.force),
    )
    return PromoteTarget(
        info=info, cfg=cfg, live_id=live_id, base=base, policy=policy, compare_id=compare_id
    )


def check_lane_release(info: ReleaseInfo, *, lane: str, env: str) -> None:
    """A release for adapter lane `<env>:<lane>` carries exactly that adapter (PromoteError
    otherwise, naming what it carries)."""
    names = [a.name for a in info.lm.manifest.adapters]
    if names != [lane]:
        carried = ", ".join(names) if names else "no adapter"
        raise PromoteError(
            f"{info.name} carries {carried}: a release for lane {env}:{lane} carries exactly "
            f"the adapter {lane}",
            remedy=f"promote it to {env} itself, or to the lane of the adapter it carries",
        )


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
    report_sha256: str | None,
) -> PromoteResult:
    """A gate failed and nothing forces it: a `gate_failed` event naming the failed gates
    and the report (`report_sha256`: the digest of its JSON as written)."""
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
                **_report_digest(report_sha256),
                **_policy_evidence(target),
            },
            live=False,
            actor=request.actor,
        )
    )
    return result.model_copy(update={"status": "blocked", "record": rec})


def _report_digest(report_sha256: str | None) -> dict[str, str]:
    """The sha256 of the gate report JSON the event links, as it was written, so the record
    vouches for the file (an auditor's page shows a swapped report as failed)."""
    return {"gate_report_sha256": report_sha256} if report_sha256 else {}


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
    report_sha256: str | None,
) -> PromoteResult:
    """Blue/green deploy of the candidate (after `shift`'s canary steps, when given); once
    traffic is on it, move the record (a `promote` event, or `override` listing `failed`
    when forced over them; `report_sha256`: the digest of the gate report JSON as written)."""
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
            **_report_digest(report_sha256),
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


__all__ = [
    "PERF_BY_CANARY_CLAMPED",
    "PERF_BY_CANARY_UNUSED",
    "PromoteError",
    "PromoteRequest",
    "PromoteResult",
    "PromoteStatus",
    "PromoteTarget",
    "RecordMove",
    "blocking_failures",
    "canary_ceiling_gate",
    "check_gates",
    "decide_here",
    "deploy_and_record",
    "marked_bad",
    "move_record",
    "policy_gates",
    "promote",
    "record_block",
    "redeploy_record",
    "release_autoscaling",
    "resolve_target",
    "run_promotion",
    "was_live_in",
]
