"""Promote with canary steps: the manifest's `promotion.canary` run inside promote's deploy,
with the ledger events that record it.

    result = promote_progressive(settings, "manifests/demo-canary-good.yaml", env="staging")

- nothing live yet, no `promotion.canary`, `no_canary=True` or a dry run: promote as
  before (one switch);
- otherwise, between the smoke suite and the switch, each step below 100% runs
  (`rollout.canary`); every passed step is a `canary_step` event; a breach is a
  `canary_aborted` event holding the breaching windows plus a `mark_bad` event, and the
  result's status is `canary_aborted`; too little evidence by a step's `max_duration_s` is a
  `canary_aborted` event without `mark_bad`. A breach aborts once it held over a disjoint
  window too (`rollout.canary`): the event's breaches hold that window (`confirmed_by`) and
  the rule (`breach_rule`); a step whose breach did not hold records it as
  `unconfirmed_breach` in its `canary_step` event (and its row of a `canary_aborted` one).
- with the environment's committed `canary_compare_answers`, the canary's answers are
  paired with the live release's on the requests it answers and judged at every step
  (`rollout.canary`); each `canary_step` event and a `canary_aborted` event hold the
  answers' verdict (counts and pair ids, no text);
- a shadow comparison of the release in the environment (`rollout.shadow`) is the
  "shadow comparison" gate;
- a canary a dead `promote` left behind (`rollout.state`) is resumed at its step with
  `resume=True` (same release), else recorded as aborted before this promotion starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from releasekit._support.progress import Progress, no_progress
from releasekit.config import Settings
from releasekit.deploy.gateway import Route
from releasekit.deploy.local import stop_group
from releasekit.errors import ReleasekitError
from releasekit.promote.answer_policy import answer_comparator, answer_policy
from releasekit.promote.answers_breach import answers_key
from releasekit.promote.ceilings import canary_within
from releasekit.promote.context import load_release
from releasekit.promote.deploy import ShiftContext, ShiftResult, env_config
from releasekit.promote.gates import GateKind, GateResult
from releasekit.promote.policy import environment_policy, read_policy
from releasekit.promote.promote import PromoteRequest, PromoteResult, run_promotion
from releasekit.releases.resolve import resolve_release
from releasekit.rollout.baseline import canary_under_policy
from releasekit.rollout.canary import AnswersPolicy, CanaryController
from releasekit.rollout.canary_records import BREACH_RULE, BreachRecord, CanaryRun, StepReport
from releasekit.rollout.placement import even_out, release
from releasekit.rollout.power import policy_power
from releasekit.rollout.shadow_gates import shadow_gate
from releasekit.rollout.state import (
    HeldServer,
    RolloutState,
    clear_rollout,
    read_rollout,
    write_rollout,
)
from releasekit.rollout.step_verdicts import agreement_words, summarise
from releasekit.spec.manifest import Canary, CanaryStep
from releasekit.stores.ledger import Event, EventType, Ledger, LedgerRecord, open_ledger


class RolloutResumeError(ReleasekitError):
    """Raised when `--resume` finds no interrupted canary of that release to resume."""

    remedy = "run promote without --resume (the canary starts from its first step)"


def interrupted_canary(settings: Settings, env: str) -> RolloutState | None:
    """The canary a dead `promote` left in `env`, or None."""
    st = read_rollout(settings, env)
    return st if st is not None and st.orphaned else None


def record_interrupted(
    settings: Settings, st: RolloutState, *, ledger: Ledger, actor: str | None = None
) -> LedgerRecord:
    """Record an interrupted canary as aborted (traffic is on stable: the gateway's lease
    reverted it), put the servers it held back to the default priority and forget it."""
    release(st.held)
    stop_interrupted_baseline(settings, st)
    rec = ledger.append(
        Event(
            type=EventType.CANARY_ABORTED,
            environment=st.env,
            from_release=st.stable_release_id,
            to_release=st.release_id,
            reason=(
                f"the promote process (pid {st.pid}) ended during canary step "
                f"{st.step + 1}/{st.steps} at {st.weight:g}%; the gateway's lease put all "
                "traffic back on the stable release"
            ),
            evidence={"interrupted": st.model_dump(mode="json"), "outcome": "interrupted"},
            live=False,
            actor=actor,
        )
    )
    clear_rollout(settings, st.env)
    return rec


def _check_record(c: Any) -> dict[str, Any]:
    return {
        "metric": c.metric,
        "verdict": c.verdict,
        "canary": c.canary,
        "stable": c.stable,
        "limit": c.limit,
        "source": c.source,
        "canary_samples": c.canary_count,
        "stable_samples": c.stable_count,
        "above_limit": c.above,
        "allowed_share": c.allowed_share,
        "p_value": c.p_value,
        "reason": c.reason,
    }


def _unconfirmed_record(s: StepReport) -> dict[str, Any]:
    """A step's breach that its disjoint window did not confirm (`StepReport.unconfirmed`):
    its window and the checks that breached there; empty when none."""
    j = s.unconfirmed
    if j is None:
        return {}
    return {
        "unconfirmed_breach": {
            "window": [j.window_start, j.window_end],
            "breached": [c.metric for c in j.checks if c.verdict == "breach"],
            "checks": [_check_record(c) for c in j.checks if c.verdict == "breach"],
        }
    }


def _confirmation_record(b: BreachRecord) -> dict[str, Any]:
    """How a breach was confirmed: the check over its disjoint window, or why it stands."""
    c = b.confirmed_by
    if c is None:
        return {"confirmed_by": None, "stands": b.stands}
    return {
        "confirmed_by": {
            "start": c.window_start,
            "end": c.window_end,
            "verdict": c.verdict,
            "canary": c.canary,
            "stable": c.stable,
            "limit": c.limit,
            "samples": c.canary_count,
            "p_value": c.p_value,
            "reason": c.reason,
        }
    }


def _judge_record(inputs: dict[str, Any] | None, sustain: int) -> dict[str, Any]:
    """The judge's inputs of a step's last judgement (`rollout.inputs`), for replay."""
    return {"judge": {**inputs, "sustain": sustain}} if inputs is not None else {}


def _run_evidence(
    run: CanaryRun, links: dict[str, str], *, sustain: int = 0, policy: dict[str, Any] | None = None
) -> dict[str, Any]:
    ev: dict[str, Any] = {
        "outcome": run.outcome,
        "steps": [
            {
                "step": s.index + 1,
                "weight": s.weight,
                "status": s.status,
                "seconds": round(s.ended_at - s.started_at, 3),
                "canary_requests": s.canary_requests,
                "stable_requests": s.stable_requests,
                "clean_judgements": s.clean_judgements,
                "checks": [_check_record(c) for c in (s.judgement.checks if s.judgement else [])],
                **_unconfirmed_record(s),
            }
            for s in run.steps
        ],
        "canary_served": run.canary_served,
        "total_served": run.total_served,
        "judged_against": run.judged_against,
        **{k: v for k, v in links.items() if v},
    }
    if run.agreement is not None:
        ev["answers_from"] = run.answers_from
        ev["pairs_read"] = run.pairs_read
        ev["answers"] = run.agreement.evidence()
        for row, s in zip(ev["steps"], run.steps, strict=True):
            row["answers"] = _agreement_counts(s)
    if run.breaches:
        ev["breaches"] = [
            {
                "metric": b.metric,
                "windows": [
                    {
                        "start": j.window_start,
                        "end": j.window_end,
                        "canary": j.value,
                        "limit": j.limit,
                        "samples": j.count,
                        "source": j.source,
                        "reason": j.reason,
                    }
                    for j in b.judgements
                ],
                "stable": [c.stable for c in b.checks],
                "above_limit": [c.above for c in b.checks],
                "p_value": [c.p_value for c in b.checks],
                **_confirmation_record(b),
            }
            for b in run.breaches
        ]
        ev["breach_rule"] = BREACH_RULE
        ev["decide_to_zero_s"] = run.decide_to_zero_s
        ev["window_to_zero_s"] = run.window_to_zero_s
    if run.steps:
        ev |= _judge_record(run.steps[-1].inputs, sustain)
    if policy is not None:
        ev["policy"] = policy
    return ev


def _agreement_counts(s: StepReport) -> dict[str, Any] | None:
    """A step's answer verdict in brief (the run's evidence holds the whole of the last)."""
    a = s.agreement
    if a is None:
        return None
    return {"verdict": a.verdict, "pairs": a.pairs, "reason": a.reason}


def answers_policy(settings: Settings, env: str) -> AnswersPolicy | None:
    """How the canary's answers are compared in `env`: the committed policy's
    `canary_compare_answers` with the shadow's floor, minimum and prompt rule (None: off)."""
    cfg = env_config(settings, env)
    pol = environment_policy(settings, env, cfg).policy
    if not pol.get("canary_compare_answers"):
        return None
    return AnswersPolicy(
        policy=answer_policy(pol),
        max_in_flight=cfg.shadow_max_in_flight,
        keep_prompts=bool(pol["shadow_keep_prompts"]),
    )


def fresh_baseline(
    policy: Canary, ctx: ShiftContext, say: Progress
) -> tuple[Route, HeldServer] | None:
    """With `baseline: fresh`, a new server of the live release started for the canary's
    steps (its route, under the live release's id, and its process), or the one the
    candidate's shadow ran beside when the candidate runs on its shadow's server (the two
    were started together: `ShiftContext.kept_baseline`); None with `live`,
    when the canary shares stable's server (a prompt-only canary: there is nothing to
    start apart) or where the target cannot start one (then it says so)."""
    if policy.baseline != "fresh":
        return None
    if any(r.base_url == ctx.canary.base_url for r in ctx.stable):
        say("prompt-only canary: judged against the live server (no fresh baseline)", 0, 1)
        return None
    if ctx.kept_baseline is not None:
        say("the fresh baseline server its shadow ran beside: judged against it", 1, 1)
        route, up = ctx.kept_baseline
    elif ctx.start_baseline is None:
        say("this target cannot start a fresh baseline: judged against the live server", 0, 1)
        return None
    else:
        starting = (
            "starting a fresh baseline server of the live release to judge the canary against"
        )
        say(starting, 0, 1)
        route, up = ctx.start_baseline()
        say(starting, 1, 1)
    pid, start = up.handle.get("pid"), up.handle.get("proc_start")
    proc = HeldServer(
        pid=pid if isinstance(pid, int) else 0,
        proc_start=start if isinstance(start, int) else None,
        release_id=route.release_id,
    )
    return route, proc


def stop_interrupted_baseline(settings: Settings, st: RolloutState) -> None:
    """Stop the fresh baseline server an interrupted canary started (it is not routed: the
    lease put all traffic back on the live servers)."""
    b = st.baseline
    if b is not None and b.pid > 0:
        stop_group(b.pid, b.proc_start, grace_s=settings.server_stop_grace_s)


def canary_shift(
    settings: Settings,
    policy: Canary,
    *,
    ledger: Ledger,
    actor: str | None,
    start_step: int = 0,
    progress: Progress | None = None,
    runs: list[CanaryRun] | None = None,
) -> Any:
    """The `ShiftFn` that runs `policy`'s steps and records them (see the module docstring)."""
    say = progress or no_progress

    def shift(ctx: ShiftContext) -> ShiftResult:
        cfg = env_config(settings, ctx.env)
        answers = answers_policy(settings, ctx.env)
        applied = environment_policy(settings, ctx.env, cfg) if answers is not None else None
        comparator = (
            answer_comparator(settings, applied.policy, commit=applied.source.commit)
            if applied is not None
            else None
        )
        # The policy the steps are judged under (its commit and digest), for replay.
        judged_under = {"source": read_policy(settings, ctx.env, cfg).evidence()["source"]}
        rid = ctx.canary.release_id
        judged = [s for s in policy.steps if s.weight < 100]
        held_ref: list[HeldServer] = []
        baseline_ref: list[HeldServer] = []

        def started(i: int, step: CanaryStep) -> None:
            write_rollout(
                settings,
                env=ctx.env,
                release_id=rid,
                stable_release_id=ctx.previous_release_id,
                step=i,
                steps=len(judged),
                weight=step.weight,
                held=held_ref,
                baseline=baseline_ref[0] if baseline_ref else None,
            )

        def passed(rep: StepReport) -> None:
            ledger.append(
                Event(
                    type=EventType.CANARY_STEP,
                    environment=ctx.env,
                    from_release=ctx.previous_release_id,
                    to_release=rid,
                    reason=(
                        f"canary step {rep.index + 1}/{len(judged)} at {rep.weight:g}% passed: "
                        + (summarise(rep.judgement) if rep.judgement else "")
                        + (f"; {agreement_words(rep.agreement)}" if rep.agreement else "")
                    )[:2000],
                    evidence={
                        "step": rep.index + 1,
                        "weight": rep.weight,
                        "seconds": round(rep.ended_at - rep.started_at, 3),
                        "clean_judgements": rep.clean_judgements,
                        "checks": [
                            _check_record(c)
                            for c in (rep.judgement.checks if rep.judgement else [])
                        ],
                        **(
                            {"answers": rep.agreement.evidence()}
                            if rep.agreement is not None
                            else {}
                        ),
                        **_unconfirmed_record(rep),
                        **{k: v for k, v in ctx.links.items() if v},
                        **_judge_record(rep.inputs, policy.sustain),
                        "policy": judged_under,
                    },
                    live=False,
                    actor=actor,
                )
            )

        def _judged_run(baseline: Route | None) -> CanaryRun:
            ctrl = CanaryController(
                policy,
                ctx,
                lease_s=cfg.canary_lease_s,
                scrape_timeout_s=settings.scrape_timeout_s,
                start_step=start_step,
                progress=say,
                on_step_start=started,
                on_step_passed=passed,
                baseline=baseline,
                answers=answers,
                comparator=comparator,
            )
            # The two servers judged against each other get the same priority and placement.
            held = even_out(settings, replace(ctx, stable=[baseline]) if baseline else ctx)
            held_ref[:] = held
            if held:
                how = [
                    *(
                        [f"scheduler nice {settings.canary_judge_nice}"]
                        if any(h.raised for h in held)
                        else []
                    ),
                    *(["free on every core"] if any(h.affinity for h in held) else []),
                ]
                other = "fresh baseline" if baseline else "stable"
                say(f"canary and {other} servers judged alike: {', '.join(how)}", 0, 1)
            try:
                return ctrl.run()
            finally:
                release(held)
                clear_rollout(settings, ctx.env)
                if baseline is not None and ctx.stop_baseline is not None:
                    ctx.stop_baseline()

        try:
            fresh = fresh_baseline(policy, ctx, say)
        except ReleasekitError as exc:
            run = CanaryRun(
                env=ctx.env,
                release_id=rid,
                stable_release_ids=[r.release_id for r in ctx.stable],
                outcome="baseline_failed",
                reason=f"the fresh baseline server did not start: {exc}",
            )
        else:
            baseline_ref[:] = [fresh[1]] if fresh else []
            run = _judged_run(fresh[0] if fresh else None)
        if runs is not None:
            runs.append(run)
        evidence = _run_evidence(run, ctx.links, sustain=policy.sustain, policy=judged_under)
        if run.agreement is not None:  # what the answers came from: a breach follows it
            lock = load_release(settings, rid, ledger=ledger).lock
            evidence["answers_key"] = answers_key(lock.inputs)
        n = len(run.steps)
        if run.outcome == "passed":
            return ShiftResult(
                ok=True,
                detail=f"{n} canary step(s) passed; switching to 100%",
                evidence=evidence,
            )
        last = run.steps[-1] if run.steps else None
        where = f"step {last.index + 1} at {last.weight:g}%" if last else "before the first step"
        problem = f"canary {run.outcome} at {where}: {run.reason}"
        rec = ledger.append(
            Event(
                type=EventType.CANARY_ABORTED,
                environment=ctx.env,
                from_release=ctx.previous_release_id,
                to_release=rid,
                reason=problem[:2000],
                evidence=evidence,
                live=False,
                actor=actor,
            )
        )
        if run.outcome == "breached":
            ledger.append(
                Event(
                    type=EventType.MARK_BAD,
                    environment=ctx.env,
                    from_release=ctx.previous_release_id,
                    to_release=rid,
                    reason=problem[:2000],
                    evidence={"canary_aborted": rec.seq, "rolled_back_to": ctx.previous_release_id},
                    live=False,
                    actor=actor,
                )
            )
        return ShiftResult(ok=False, problem=problem, detail=problem, evidence=evidence, event=rec)

    return shift


def promote_progressive(
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
    no_canary: bool = False,
    resume: bool = False,
    approval_wait_s: float | None = None,
    replicas: int | None = None,
) -> PromoteResult:
    """Promote `release_ref` to `env` with its manifest's canary steps (see the module
    docstring); `PromoteResult.canary` holds the steps as they ran."""
    env_config(settings, env)
    led = ledger or open_ledger(settings, read_only=dry_run)
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
    rid = resolve_release(settings, release_ref, ledger=led).release_id
    cfg = env_config(settings, env)
    policy = canary_under_policy(
        cfg.policy(),
        load_release(settings, rid, ledger=led).lm.manifest.promotion.canary,
        env,
    )
    # A dry run reports the gates as the real promotion would apply them.
    request.canary_steps = policy is not None and not no_canary
    start_step = 0
    notes: list[str] = []
    if policy is not None:
        # The steps run within the environment's ceilings (the gate report says so).
        within = canary_within(policy, cfg, env)
        policy = within.canary
        if within.clamped and not no_canary:
            notes.append(f"canary {within.note}")
    left = None if dry_run else interrupted_canary(settings, env)
    if resume and (left is None or left.release_id != rid):
        raise RolloutResumeError(
            f"no interrupted canary of {rid[:12]} in {env} to resume"
            + (f" (the interrupted one is {left.release_id[:12]})" if left else "")
        )
    if left is not None:
        if resume:
            start_step = left.step
            notes.append(f"resuming the interrupted canary at step {left.step + 1}")
            release(left.held)
            stop_interrupted_baseline(settings, left)
            clear_rollout(settings, env)
        else:
            rec = record_interrupted(settings, left, ledger=led, actor=actor)
            notes.append(f"an interrupted canary was recorded as aborted (event {rec.seq})")

    power = (
        [p.model_dump(mode="json") for p in policy_power(list(policy.checks))]
        if policy is not None and not no_canary
        else None
    )

    def gates(release_id: str) -> list[GateResult]:
        g = shadow_gate(settings, env=env, release_id=release_id, ledger=led)
        return [g] if g is not None else []

    if policy is None or no_canary or dry_run:
        if policy is not None and no_canary:
            notes.append("--no-canary: one switch, no canary steps")
        res = run_promotion(settings, request, progress=progress, ledger=led, extra_gates=gates)
        return res.model_copy(update={"warnings": [*res.warnings, *notes], "canary_power": power})
    runs: list[CanaryRun] = []
    shift = canary_shift(
        settings,
        policy,
        ledger=led,
        actor=actor,
        start_step=start_step,
        progress=progress,
        runs=runs,
    )
    res = run_promotion(
        settings, request, progress=progress, ledger=led, shift=shift, extra_gates=gates
    )
    update: dict[str, Any] = {"warnings": [*res.warnings, *notes], "canary_power": power}
    if runs:
        update["canary"] = runs[-1].model_dump(mode="json")
    elif res.deploy is not None and res.deploy.ok and res.live_release_id is None:
        update["warnings"] = [*update["warnings"], "nothing was live: no canary, one switch"]
    return res.model_copy(update=update)
