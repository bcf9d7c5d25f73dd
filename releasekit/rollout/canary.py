"""Canary steps: set a weight at the gateway, judge the canary against stable over the same
window, go on, or send all traffic back to stable at once.

Every weight below 100 is a leased table (`RouteTable.lease_s`, the environment's
`canary_lease_s`): a thread renews it while this process runs, and if the process dies the
gateway itself reverts to stable. A weight of 100 is the switch, which the deploy makes
after the last judged step. Before the first step a canary on its own server gets a warm-up
burst (`warmup_requests` at once, straight to its vLLM, answers discarded), and each step's
window starts `settle_s` after its weight was set: a fresh vLLM's first requests, and the
first seconds after a weight change, are not what the release does in steady state.
A step needs as much evidence to pass as to abort: it passes once it has run
`min_duration_s`, the canary answered `min_requests` and the last `sustain` judgements in
a row were clean (every required check passed on at least its `min_samples`, none
breached); it aborts once a check breached `sustain` judgements in a row (each over the
whole step so far, and each a figure above its limit by more than sampling noise:
`rollout.judge`) and the breach held over a disjoint window too. A breach of any check
starts the clean run again; a judgement that is neither (a required check still waiting)
leaves it as it is, as a no-data window leaves a breach run. Without enough clean
judgements by `max_duration_s` the step ends as insufficient evidence (abort, not a
verdict on the release).

A breach must hold, as the shadow comparison's must (`rollout.shadow_compare`): a freshly
started server is slow for its first seconds (measured on the demo's 2-core host: TTFT
p95 0.48 s against stable's 0.04 s for 20-30 s), so `sustain` judgements of the step so
far can all fall inside its start-up. When the live checks have breached `sustain`
judgements in a row, the step is judged again from a fresh snapshot, over a window that
starts after the breaching one ended and lasts at least as long
(`step_verdicts.confirm_span`): the breach and clean runs start anew there. If one of the
breached checks breaches over that window too, the canary aborts (`BreachRecord.
confirmed_by`); if each of them passes there with its figure within its limit (a pass
that is only not significant yet decides nothing), the first breach was the start-up: the step
goes on, judged from the disjoint window's start, and the breach is kept as
`StepReport.unconfirmed` (said once). A step asks a disjoint window once: a later
sustained breach in it stands, as does one with too little of `max_duration_s` left for
the window, or one whose window decided nothing by then (`BreachRecord.stands` says why).
A canary slow throughout breaches both windows and aborts. Answer breaches are not
confirmed so: a wrong answer is not start-up noise, and `sustain` of them in a row abort
at once.

With a fresh baseline (`baseline: fresh`; `progressive.fresh_baseline` starts it) the
canary is judged against a new server of the live release, warmed alike and given the
same weight under its own label (`baseline_label`), instead of against the live servers;
it leaves the table after the last step and is drained before the deploy stops it.

With `answers` (the environment's committed `canary_compare_answers`), each weight's table
also carries a canary mirror (`Mirror.purpose` `canary`): the gateway copies each request
the canary answers to a live server of the stable release (another replica than the one
judged where there is one; never the fresh baseline, whose latency is judged), under the
label `pair_label(<stable>)`, so the copies' figures never land in the series the canary is
judged on. Every judgement reads the new pairs (`GET /admin/mirror/pairs`) and judges the
answered pairs of the whole canary so far (answers do not depend on the weight) with the
environment's answer comparison (`evaluate.answers`: the canary's excess over the live
release's own second answers, `max_excess_disagreement`): too few pairs, or an interval
still across the margin, is "not judged yet", which keeps a step from passing and never
aborts it; an interval wholly above the margin is a breach, and `sustain` of them in a row
abort the canary like a breaching check, with the verdict (counts and pair ids, no text) in the
run (`CanaryRun.agreement`, the `canary_aborted` event's evidence). Where the copies go to
the very server judged as stable (a single live server), its own vLLM figures include the
copies' load; the gateway's figures never do.

Where each part lives (all re-exported here): the warm-up burst, the scrapes and the pair
of windows in `rollout.figures`, a judgement counted and put in words in
`rollout.step_verdicts`, what a run records in `rollout.canary_records`. This module holds
the step runner, `CanaryController`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel, Field

from releasekit._support.http import http_client
from releasekit._support.progress import Progress, no_progress
from releasekit.deploy.gateway import GatewayError, Mirror, Route, RouteTable, pair_label
from releasekit.deploy.gateway_client import GatewayClient
from releasekit.errors import ReleasekitError
from releasekit.evaluate.answer_compare import ExactComparator
from releasekit.evaluate.answers import (
    AnswerPolicy,
    AnswerVerdict,
    Comparator,
    ComparedRequest,
    judge_answers,
)
from releasekit.promote.answer_pairs import compared as compared_request
from releasekit.promote.deploy import ShiftContext
from releasekit.rollout.canary_records import (
    BreachRecord,
    CanaryRun,
    RunOutcome,
    StepReport,
    StepStatus,
)
from releasekit.rollout.figures import (
    SHARED_SERVER,
    Scrape,
    pair_windows,
    scrape_pair,
    warm_up_server,
)
from releasekit.rollout.inputs import judged_inputs
from releasekit.rollout.judge import CheckResult, ReleaseWindows, StepJudgement, judge_step
from releasekit.rollout.step_verdicts import (
    agreement_words,
    as_judgement,
    breach_words,
    confirm_span,
    confirm_words,
    confirmation,
    next_clean,
    run_words,
    summarise,
    unconfirmed_words,
)
from releasekit.spec.manifest import Canary, CanaryStep
from releasekit.watch.rules import Rule, RuleState


class AnswersPolicy(BaseModel):
    """How a canary's answers are compared with stable's (the environment's committed
    `canary_compare_answers` with the shadow's fields)."""

    policy: AnswerPolicy = Field(default_factory=AnswerPolicy)
    max_in_flight: int = Field(4, ge=1, description="copies to stable in flight at most")
    keep_prompts: bool = False


MAX_PAIRS = 20_000
"""Answer pairs one canary keeps at most (the latest): its memory bound."""
MAX_READS = 50
"""Pages of pairs one judgement reads at most (the gateway answers 2,000 a page)."""


BASELINE_DRAIN_S = 30.0


def split_routes(
    stable: list[Route], canary: Route, weight: float, baseline: Route | None = None
) -> list[Route]:
    """Stable's routes scaled to what is left (their ratios kept) plus the canary at
    `weight` percent and, when given, the baseline at `weight` percent too. Adapter lanes'
    routes (`Route.lane` set) go along unchanged: a lane's traffic is its own adapter's,
    never a share of the base's, so they neither take part of nor count in stable's share."""
    rest = 100.0 - weight * (2 if baseline is not None else 1)
    base = [r for r in stable if r.lane is None]
    live = [r for r in base if r.weight > 0]
    total = sum(r.weight for r in live) or 1.0
    out = [r.model_copy(update={"weight": rest * r.weight / total}) for r in live]
    out += [r for r in base if r.weight <= 0]
    out += [r for r in stable if r.lane is not None]
    out.append(canary.model_copy(update={"weight": weight}))
    if baseline is not None:
        out.append(baseline.model_copy(update={"weight": weight}))
    return out


def baseline_label(release_id: str) -> str:
    """The gateway's name for a fresh baseline server of `release_id`: its own label, so
    its edge figures are its own and not the live servers' (route ids are unique)."""
    return f"{release_id}:baseline"


@dataclass
class _Pending:
    """A sustained breach of live checks waiting for its disjoint window: the judgement
    that made it sustained, its records, and how long the disjoint window lasts at least."""

    judgement: StepJudgement
    breaches: list[BreachRecord]
    span_s: float

    @property
    def metrics(self) -> list[str]:
        return [b.metric for b in self.breaches]


class _Renewer(threading.Thread):
    """Renews the leased table of `generation` every `every_s` until stopped; `lost` once
    the gateway says the table is gone."""

    def __init__(self, client: GatewayClient, generation: int, every_s: float) -> None:
        super().__init__(daemon=True, name="canary-lease")
        self.client = client
        self.generation = generation
        self.every_s = every_s
        self.lost = False
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self.every_s):
            try:
                self.client.renew_lease(self.generation)
            except GatewayError as exc:
                if getattr(exc, "status", None) == 409:
                    self.lost = True
                    return
                # Unreachable for a moment: try again; the lease runs out if it stays so.

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)


class CanaryController:
    """Runs a manifest's canary steps for one deploy (see the module docstring)."""

    def __init__(
        self,
        policy: Canary,
        ctx: ShiftContext,
        *,
        lease_s: float,
        scrape_timeout_s: float = 5.0,
        start_step: int = 0,
        progress: Progress | None = None,
        on_step_start: Callable[[int, CanaryStep], None] | None = None,
        on_step_passed: Callable[[StepReport], None] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        baseline: Route | None = None,
        answers: AnswersPolicy | None = None,
        comparator: Comparator | None = None,
    ) -> None:
        self.policy = policy
        self.ctx = ctx
        self.lease_s = lease_s
        self.scrape_timeout_s = scrape_timeout_s
        self.start_step = start_step
        self.say = progress or no_progress
        self.on_step_start = on_step_start
        self.on_step_passed = on_step_passed
        self.sleep = sleep
        self.canary = ctx.canary
        # Stable is the base lane's routes: adapter lanes' routes ride along untouched
        # (`split_routes`) and are never judged against nor paired with.
        base = [r for r in ctx.stable if r.lane is None]
        if not base:
            raise ReleasekitError(
                f"{ctx.env} has no base route to judge the canary against",
                remedy="promote a base release first",
            )
        live = [r for r in base if r.weight > 0]
        self.stable_primary = max(live, key=lambda r: r.weight) if live else base[0]
        self.shared_server = any(r.base_url == self.canary.base_url for r in base)
        # A fresh baseline (policy.baseline "fresh"): judged against instead of the live
        # servers, under its own label, with the canary's share of traffic.
        self.baseline = (
            baseline.model_copy(update={"release_id": baseline_label(baseline.release_id)})
            if baseline is not None
            else None
        )
        self.compared = self.baseline or self.stable_primary
        self._http = http_client(trust_env=False)
        self.answers = answers
        # The environment's comparator (progressive.answers_policy), else exact match.
        self.comparator: Comparator = comparator or ExactComparator()
        self.mirror = self._canary_mirror(live) if answers is not None else None
        self._pairs: deque[ComparedRequest] = deque(maxlen=MAX_PAIRS)
        self._pairs_since = 0
        self._pairs_read = 0

    def _canary_mirror(self, live: list[Route]) -> Mirror:
        """The mirror that pairs the canary's answers with the live release's: copies of the
        requests the canary answers go to a live server of stable (another one than the
        server judged as stable where there is one), under their own label."""
        assert self.answers is not None
        judged = self.compared.release_id
        to = next((r for r in live if r.release_id != judged), self.stable_primary)
        return Mirror(
            route=to.model_copy(update={"release_id": pair_label(to.release_id), "weight": 1.0}),
            share=1.0,
            max_in_flight=self.answers.max_in_flight,
            keep_prompts=self.answers.keep_prompts,
            purpose="canary",
            source=self.canary.release_id,
        )

    def _agreement(self, client: GatewayClient) -> tuple[AnswerVerdict, str | None]:
        """Read the pairs recorded since the last read and judge all of the canary's so
        far; (the agreement, why the pairs could not be read now or None)."""
        assert self.answers is not None and self.mirror is not None
        label = self.mirror.route.release_id
        problem = None
        try:
            for _ in range(MAX_READS):
                got = client.mirror_pairs(self._pairs_since)
                if got.release_id != label or got.purpose != "canary":
                    break
                if got.recorded < self._pairs_since:  # the gateway restarted: seqs anew
                    self._pairs_since = 0
                    continue
                for p in got.pairs:
                    self._pairs_since = p.seq
                    self._pairs_read += 1
                    if p.purpose == "canary" and p.candidate_release_id == self.canary.release_id:
                        self._pairs.append(compared_request(p))
                if not got.pairs or self._pairs_since >= got.recorded:
                    break
        except GatewayError as exc:
            problem = f"the gateway did not answer its answer pairs: {exc}"
        return judge_answers(list(self._pairs), self.answers.policy, self.comparator), problem

    # -- traffic

    def _client(self) -> GatewayClient:
        return GatewayClient(self.ctx.gateway.url, admin_token=self.ctx.gateway.admin_token)

    def _served(self, client: GatewayClient) -> dict[str, int]:
        """Requests each release took so far: finished plus in flight."""
        try:
            st = client.state()
        except GatewayError:
            return {}
        keys = set(st.served) | set(st.in_flight)
        return {k: st.served.get(k, 0) + st.in_flight.get(k, 0) for k in keys}

    def _set_weight(self, client: GatewayClient, weight: float, *, baseline: bool = True) -> int:
        table = RouteTable(
            routes=split_routes(
                self.ctx.stable, self.canary, weight, self.baseline if baseline else None
            ),
            lease_s=self.lease_s,
            fallback=list(self.ctx.stable),
            mirror=self.mirror,
        )
        return client.set_routes(table).generation

    def _to_stable(self, client: GatewayClient) -> float:
        """All traffic to stable; returns time.time() once the gateway answered."""
        client.set_routes(RouteTable(routes=list(self.ctx.stable)))
        return time.time()

    def warm_up(self, run: CanaryRun) -> None:
        """`warmup_requests` short completions at once straight to the canary's own server
        (not through the gateway, so never in the edge figures; the engine figures of each
        step start after it). Best effort: a failed request is only not counted."""
        n = self.policy.warmup_requests
        if n <= 0 or self.shared_server:
            return
        label = f"warming up the canary ({n} requests to its server)"
        self.say(label, 0, 1)
        run.warmup_answered, run.warmup_s = warm_up_server(self._http, self.canary, n)
        self.say(label, 1, 1)
        if self.baseline is not None:  # warmed alike: both start from the same state
            label = f"warming up the fresh baseline ({n} requests to its server)"
            self.say(label, 0, 1)
            run.baseline_warmup_answered = warm_up_server(self._http, self.baseline, n)[0]
            self.say(label, 1, 1)

    # -- figures

    def snapshot(self) -> Scrape:
        """(time, gateway, canary vLLM, stable vLLM) scraped now; engine ones are None when
        both releases share a server (their engine figures cannot be told apart)."""
        shared = self.shared_server
        return scrape_pair(
            self._http,
            self.ctx.gateway.url,
            None if shared else self.canary.base_url,
            None if shared else self.compared.base_url,
            timeout_s=self.scrape_timeout_s,
            unscraped=SHARED_SERVER,
        )

    def windows(self, before: Scrape, after: Scrape) -> tuple[ReleaseWindows, ReleaseWindows]:
        """(canary, stable) windows between two snapshots."""
        return pair_windows(
            self.ctx.env, self.canary.release_id, self.compared.release_id, before, after
        )

    # -- the steps

    def run(self) -> CanaryRun:
        """Run the steps from `start_step`; on anything but success traffic is on stable."""
        steps = self.policy.steps
        judged = [s for s in steps if s.weight < 100]
        run = CanaryRun(
            env=self.ctx.env,
            release_id=self.canary.release_id,
            stable_release_ids=[r.release_id for r in self.ctx.stable if r.lane is None],
            outcome="passed",
            judged_against=self.compared.release_id,
            answers_from=self.mirror.route.release_id if self.mirror is not None else None,
        )
        self.warm_up(run)
        # The judge's binomial test needs scipy: import it now, not inside a judged window.
        import scipy.stats  # noqa: F401

        client = self._client()
        served0 = self._served(client)
        try:
            for i, step in enumerate(judged):
                if i < self.start_step:
                    continue
                report = self._run_step(client, i, len(judged), step, run)
                run.steps.append(report)
                if report.status != "passed":
                    run.outcome = report.status
                    run.reason = report.reason
                    break
                if self.on_step_passed is not None:
                    self.on_step_passed(report)
            if run.outcome == "passed" and self.baseline is not None and run.steps:
                # The baseline leaves the table (the canary keeps its last weight) so that
                # it can be drained and stopped before the switch.
                self._set_weight(client, run.steps[-1].weight, baseline=False)
            if self.baseline is not None:  # best effort: it is stopped either way
                with contextlib.suppress(GatewayError):
                    client.drain(self.baseline.release_id, timeout_s=BASELINE_DRAIN_S)
        except GatewayError as exc:
            run.outcome, run.reason = "gateway_error", f"gateway failed: {exc}"
            try:
                self._to_stable(client)
            except GatewayError:
                run.reason += "; the lease puts traffic back on stable"
        finally:
            served1 = self._served(client)
            keys = set(served0) | set(served1)
            diff = {k: served1.get(k, 0) - served0.get(k, 0) for k in keys}
            run.canary_served = max(0, diff.get(self.canary.release_id, 0))
            run.total_served = max(0, sum(diff.values()))
            run.pairs_read = self._pairs_read
            client.close()
            self._http.close()
        return run

    def _run_step(
        self, client: GatewayClient, i: int, n: int, step: CanaryStep, run: CanaryRun
    ) -> StepReport:
        policy = self.policy
        if self.on_step_start is not None:
            self.on_step_start(i, step)
        generation = self._set_weight(client, step.weight)
        renewer = _Renewer(self._client(), generation, every_s=max(0.05, self.lease_s / 4))
        renewer.start()
        started = time.time()
        states = self._rule_states()
        recent: dict[str, list[CheckResult]] = {c.metric: [] for c in policy.checks}
        clean = 0
        disagreeing = 0  # agreement breaches in a row
        pending: _Pending | None = None  # a sustained breach waiting for its disjoint window
        asked = False  # this step asked a disjoint window already (once a step)
        label = f"canary step {i + 1}/{n} at {step.weight:g}%"
        report = StepReport(
            index=i, weight=step.weight, status="passed", started_at=started, ended_at=started
        )
        try:
            if policy.settle_s > 0:
                self.say(f"{label}: settling for {policy.settle_s:g} s (not judged)", i, n)
                self.sleep(policy.settle_s)
            self.say(f"{label}: waiting for traffic", i, n)
            before = self.snapshot()
            while True:
                self.sleep(policy.interval_s)
                if renewer.lost:
                    report.status, report.reason = "lease_lost", "the gateway dropped the lease"
                    break
                after = self.snapshot()
                if after.gateway is None or before.gateway is None:
                    problem = after.errors.get("gateway") or before.errors.get("gateway")
                    self.say(f"{label}: gateway {problem}; waiting", i, n)
                    if time.time() - started >= step.max_duration_s:
                        report.status = "insufficient"
                        report.reason = "no gateway figures within max_duration_s"
                        break
                    continue
                cw, sw = self.windows(before, after)
                j = judge_step(policy.checks, cw, sw)
                report.judgement = j
                report.inputs = judged_inputs(policy.checks, cw, sw)
                report.canary_requests, report.stable_requests = (
                    j.canary_requests,
                    j.stable_requests,
                )
                for c in j.checks:
                    st = states[c.metric]
                    st.update(as_judgement(c), cw.edge)
                    if c.verdict == "breach":
                        recent[c.metric] = [*recent[c.metric], c][-policy.sustain :]
                    elif c.verdict == "pass":
                        recent[c.metric] = []
                agreement, answers_line = None, ""
                if self.answers is not None:
                    agreement, problem = self._agreement(client)
                    report.agreement = run.agreement = agreement
                    disagreeing = (
                        disagreeing + 1
                        if agreement.verdict == "breach"
                        else 0
                        if agreement.verdict == "pass"
                        else disagreeing
                    )
                    answers_line = f"; {agreement_words(agreement)}" + (
                        f" ({problem})" if problem else ""
                    )
                clean = next_clean(clean, j, agreement)
                report.clean_judgements = clean
                judged_s = after.at - before.at
                words = run_words(clean, states, policy)
                if disagreeing:
                    words += f", answers breached {disagreeing}/{policy.sustain}"
                if pending is not None:
                    words += f", {confirm_words(pending.metrics, judged_s, pending.span_s)}"
                self.say(f"{label}: {summarise(j)}{answers_line}; {words}", i, n)
                sustained = [m for m, st in states.items() if st.sustained]
                answers_breached = disagreeing >= policy.sustain and agreement is not None
                elapsed = time.time() - started
                aborting: list[BreachRecord] = []
                if pending is not None:
                    said = confirmation(j, pending.metrics) if judged_s >= pending.span_s else None
                    if said == "breach":
                        for b in pending.breaches:
                            b.confirmed_by = j.by_metric(b.metric)
                        aborting = pending.breaches
                    elif said == "pass":
                        report.unconfirmed = pending.judgement
                        self.say(
                            f"{label}: {unconfirmed_words(pending.metrics, pending.judgement, j)}",
                            i,
                            n,
                        )
                        pending = None
                    elif elapsed >= step.max_duration_s:
                        for b in pending.breaches:
                            b.stands = (
                                "the disjoint window did not show it within its limit by "
                                "max_duration_s"
                            )
                        aborting = pending.breaches
                elif sustained:
                    records = [
                        BreachRecord(
                            metric=m,
                            judgements=[b.judgement for b in states[m].breaches],
                            checks=recent[m],
                        )
                        for m in sustained
                    ]
                    span = confirm_span(judged_s, policy)
                    why = (
                        "the answers breached too"
                        if answers_breached
                        else "a disjoint window cleared this step's first breach already"
                        if asked
                        else "no time left in the step for a disjoint window"
                        if step.max_duration_s - elapsed < span
                        else ""
                    )
                    if why:
                        for b in records:
                            b.stands = why
                        aborting = records
                    else:
                        # Judged again over a disjoint window, from a fresh snapshot: the
                        # breach run and the clean run start anew there.
                        asked = True
                        pending = _Pending(judgement=j, breaches=records, span_s=span)
                        fresh = self.snapshot()
                        before = fresh if fresh.gateway is not None else after
                        states = self._rule_states()
                        recent = {c.metric: [] for c in policy.checks}
                        clean = report.clean_judgements = 0
                        self.say(
                            f"{label}: {', '.join(sustained)} breached {policy.sustain} "
                            f"judgements in a row; confirming over the next {span:.0f} s, "
                            "judged on their own",
                            i,
                            n,
                        )
                        continue
                if aborting or answers_breached:
                    decided = time.time()
                    at_zero = self._to_stable(client)
                    run.decide_to_zero_s = at_zero - decided
                    run.window_to_zero_s = at_zero - j.window_end
                    run.at_zero_at = at_zero
                    run.breaches = aborting
                    report.status = "breached"
                    report.reason = "; ".join(
                        [
                            *(
                                [f"answers: {agreement.reason}"]
                                if answers_breached and agreement is not None
                                else []
                            ),
                            *(breach_words(b, j) for b in aborting),
                        ]
                    )
                    break
                if (
                    pending is None
                    and elapsed >= step.min_duration_s
                    and j.canary_requests >= step.min_requests
                    and clean >= policy.sustain
                ):
                    break
                if elapsed >= step.max_duration_s:
                    waiting = [c.metric for c in j.checks if c.required and c.verdict != "pass"]
                    if agreement is not None and agreement.verdict != "pass":
                        waiting.append(f"answers ({agreement.reason})")
                    report.status = "insufficient"
                    report.reason = (
                        f"after {elapsed:.0f} s: {j.canary_requests:g} canary requests "
                        f"(need {step.min_requests}); {clean} clean judgement(s) in a row "
                        f"(need {policy.sustain}); not decided: {', '.join(waiting) or '-'}"
                    )
                    break
        finally:
            renewer.stop()
            renewer.client.close()
            report.ended_at = time.time()
        if report.status not in ("passed", "breached"):
            at_zero = self._to_stable(client)
            run.at_zero_at = at_zero
        return report

    def _rule_states(self) -> dict[str, RuleState]:
        """A fresh breach run for each check (`sustain` breaching judgements in a row)."""
        return {
            c.metric: RuleState(
                rule=Rule(
                    name=f"canary {c.metric}",
                    metric=c.metric,
                    above=0.0,
                    sustain=self.policy.sustain,
                    min_requests=c.min_samples,
                )
            )
            for c in self.policy.checks
        }


__all__ = [
    "BASELINE_DRAIN_S",
    "MAX_PAIRS",
    "MAX_READS",
    "SHARED_SERVER",
    "AnswersPolicy",
    "BreachRecord",
    "CanaryController",
    "CanaryRun",
    "RunOutcome",
    "Scrape",
    "StepReport",
    "StepStatus",
    "agreement_words",
    "baseline_label",
    "next_clean",
    "pair_windows",
    "run_words",
    "scrape_pair",
    "split_routes",
    "summarise",
    "warm_up_server",
]
