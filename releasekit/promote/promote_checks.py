"""What a promotion checks before it deploys: the policy gates, the environments the
manifest allows, the gates as the environment decides them, the canary's ceilings, an
approval, and the autoscaling plan a release would run with."""

from __future__ import annotations

import time

from releasekit._support.progress import Progress
from releasekit.config import EnvironmentConfig, Settings
from releasekit.config.lanes import lane_name, parent_env, split_lane
from releasekit.deploy.environments import env_config
from releasekit.deploy.ray.autoscale import AutoscalePlan, plan_for
from releasekit.promote.answers_breach import answers_breach_gate
from releasekit.promote.approvals import approval_for, approval_gate, wait_for_approval
from releasekit.promote.ceilings import CEILING_FIELDS, CanaryWithin
from releasekit.promote.context import (
    ReleaseContextError,
    ReleaseInfo,
    load_release,
    release_knee,
)
from releasekit.promote.gate_results import GateReport, GateResult
from releasekit.promote.gates import evaluate_gates
from releasekit.promote.promote_models import PromoteError, PromoteRequest, PromoteTarget
from releasekit.promote.records import marked_bad, was_live_in
from releasekit.stores.ledger import Ledger


def policy_gates(
    settings: Settings, info: ReleaseInfo, *, env: str, ledger: Ledger
) -> list[GateResult]:
    """The release may go to `env` at all: not marked bad, and live first in every
    environment the policy requires (releasekit.toml `requires` and the manifest's)."""
    cfg = env_config(settings, env)
    base_env, lane = split_lane(env)
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
    required = {cfg.requires} | {
        e.requires for e in info.lm.manifest.environments if e.name == base_env
    }
    # an adapter lane's release must have been live in the same lane there
    required = {lane_name(r, lane) if lane and r else r for r in required}
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
    if parent_env(env) not in allowed:
        raise PromoteError(
            f"{info.name} may not go to {env!r}: its manifest lists {', '.join(allowed)}",
            remedy="add the environment to the manifest's `environments` (a new release)",
        )


def _live_info(settings: Settings, live_id: str, ledger: Ledger) -> tuple[ReleaseInfo | None, str]:
    try:
        return load_release(settings, live_id, ledger=ledger), ""
    except ReleaseContextError as exc:
        return None, exc.message


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


def check_gates(settings: Settings, target: PromoteTarget, *, ledger: Ledger) -> GateReport:
    """Policy gates plus the evidence gates against the live release (absolute checks when
    nothing is live; a failed evidence gate when the live release's evidence is unreadable),
    decided as this environment decides (`decide_here`). Where the release's weights and
    prompts breached their answers on live traffic (`answers_breach`), the quality gate
    "answers breach of these weights" fails."""
    info, env = target.info, target.base.environment
    live_id = target.live_id or target.compare_id
    policy = policy_gates(settings, info, env=env, ledger=ledger)
    policy.append(answers_breach_gate(ledger, info.lock.inputs))
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
