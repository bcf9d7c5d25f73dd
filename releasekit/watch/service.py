"""Watch one environment, composed from settings: what is live there (the ledger), the live
release's watch rules and load-profile SLOs (its manifest), its own load test as the
baseline of relative rules (its bench.json), the /metrics URLs of its vLLM server and the
environment's gateway (the deploy state), and a `RollbackGuard` in front of the same rollback
`releasekit rollback` performs. With `serve`, the Alertmanager receiver and the watcher's own
/metrics answer on one HTTP port and share that guard.

The watcher follows the environment: when the ledger says another release is live (after its
own rollback, an Alertmanager one, or a promote), the next tick re-reads that release's
rules, baseline and server and judges it from fresh windows.

After a promotion with the environment's `after_promotion_compare_s`, each tick also judges
the live release's answers against the previous release's on mirrored live requests
(`releasekit.watch.pairs`): a breach rolls back through the same guard, with the agreement
and the disagreeing pairs in the rollback's evidence; the window's end removes the mirror
and records the result. The comparison's policy fields must be the committed ones.

Errors (all `releasekit.errors.ReleasekitError`):
    WatchSetupError   the environment cannot be watched (nothing live, no manifest, no server)
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import FrameType
from typing import Any, Protocol

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field, SecretStr, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Mount, Route

from releasekit.config import Settings
from releasekit.deploy.state import DeployStateError, read_state
from releasekit.errors import (
    LedgerLockTimeoutError,
    RegistryUnreachableError,
    ReleasekitError,
)
from releasekit.promote.context import ReleaseInfo, load_release
from releasekit.promote.deploy import env_config
from releasekit.promote.policy import environment_policy, read_policy
from releasekit.promote.rollback import (
    RollbackError,
    RollbackResult,
    break_glass_target,
    previous_good_release,
)
from releasekit.releases.queries import status
from releasekit.spec.loadprofile import SLO, load_profile
from releasekit.stores.evidence import BenchPoint, BenchSummary, Percentiles
from releasekit.stores.ledger import DecisionRecordsError, EventType, Ledger, open_ledger
from releasekit.stores.ledger.chain import verified_prefix
from releasekit.stores.results import ReleasePaths
from releasekit.stores.verified import SignedEvidence
from releasekit.watch.alertrules import (
    AlertmanagerSnippet,
    AlertRulesFile,
    alert_rules,
    alertmanager_config,
    scrape_configs,
)
from releasekit.watch.pairs import AnswerWatch, write_answers_page
from releasekit.watch.receiver import BasicCredential, ReceiverAuth, create_receiver
from releasekit.watch.receiver import guard as receiver_guard
from releasekit.watch.receiver import server_options as receiver_server_options
from releasekit.watch.rules import (
    Baseline,
    BaselinePoint,
    BreachEvidence,
    Rule,
    from_manifest,
    rules_from_slo,
    with_floor,
)
from releasekit.watch.watcher import (
    RollbackFn,
    RollbackGuard,
    RollbackOutcome,
    RollbackRequest,
    RollbackTransientError,
    Watcher,
    WatchSummary,
    WatchTarget,
    WatchTick,
)

log = logging.getLogger(__name__)

TOKEN_ENV = "RELEASEKIT_WEBHOOK_TOKEN"
TOKEN_FILE_ENV = "RELEASEKIT_WEBHOOK_TOKEN_FILE"
USER_ENV = "RELEASEKIT_WEBHOOK_USER"
PASSWORD_ENV = "RELEASEKIT_WEBHOOK_PASSWORD"
RECEIVER_PATH = "/alertmanager"
DEFAULT_COOLDOWN_S = 900.0


class WatchSetupError(ReleasekitError):
    """Raised when an environment cannot be watched: nothing is live in it (ledger), the live
    release's manifest or load profile cannot be read, or the deploy state names no running
    server for it (nothing to scrape)."""

    remedy = (
        "promote a release to the environment (`releasekit promote REL --to ENV`) and check "
        "`releasekit deploy-status`"
    )


# --------------------------------------------------------------------------- the plan


class WatchPlan(BaseModel):
    """What a watch of one environment judges: the live release, its rules (manifest watch
    rules, then load-profile SLO rules), the benchmark baseline, and where to scrape."""

    env: str
    release_id: str
    release_name: str | None = None
    rules: list[Rule]
    baseline: Baseline | None = None
    slo: SLO | None = None
    target: WatchTarget
    notes: list[str] = Field(default_factory=list, description="what is missing, in words")


def live_release_id(settings: Settings, env: str, *, ledger: Ledger) -> str:
    """The release live in `env` by the ledger (`releasekit status`); WatchSetupError if
    nothing is."""
    for s in status(settings, ledger=ledger).environments:
        if s.environment == env and s.release_id:
            return s.release_id
    raise WatchSetupError(f"nothing is live in {env}: there is nothing to watch")


def baseline_from_bench(bench: BenchSummary, *, release_id: str | None = None) -> Baseline | None:
    """The relative rules' baseline from a load test: one point per load level, at its
    completed request rate, with the window figure names (ttft_p95_s, e2e_p95_s, itl_p50_s,
    ..., error_rate, timeout_rate). Only points that passed the load test's cross-check
    count (an untrusted point measured the client, not the release). None when no point
    is left."""
    trusted = [b for b in bench.points if _passed_cross_check(b)]
    points = [p for p in (_baseline_point(b) for b in trusted) if p is not None]
    if not points:
        return None
    return Baseline(release=release_id or bench.release_id, points=points)


def _passed_cross_check(p: BenchPoint) -> bool:
    # Results written before `trusted` was recorded: any flag made the point untrusted.
    return p.trusted if p.trusted is not None else not p.flags


def _baseline_point(p: BenchPoint) -> BaselinePoint | None:
    rate = p.request_throughput
    if rate is None or rate <= 0:
        return None
    figures: dict[str, float] = {}
    for short, pct in (("ttft", p.ttft), ("itl", p.itl), ("e2e", p.e2e)):
        figures |= _percentile_figures(short, pct)
    n = p.n or 0
    if n > 0:
        if p.errors is not None:
            figures["error_rate"] = p.errors / n
        if p.timeouts is not None:
            figures["timeout_rate"] = p.timeouts / n
    if p.server_generation_tokens_per_s is not None:
        figures["generation_tokens_per_s"] = p.server_generation_tokens_per_s
    return BaselinePoint(request_rate=rate, figures=figures)


def _percentile_figures(short: str, pct: Percentiles) -> dict[str, float]:
    out: dict[str, float] = {}
    for key in ("p50", "p90", "p95", "p99", "mean"):
        value = getattr(pct, key)
        if value is not None:
            out[f"{short}_{key}_s"] = float(value)
    return out


def read_baseline(
    settings: Settings, release_id: str, evidence: SignedEvidence | None = None
) -> Baseline | None:
    """The release's own benchmark (results/<id>/bench/bench.json, as its register event
    signed it: `evidence` from `load_release`) as a Baseline, or None when it has none, it
    is unreadable, or it is not the one signed."""
    path = ReleasePaths.of(settings, release_id).bench
    if evidence is None or evidence.problems_for("bench") or not path.is_file():
        return None
    try:
        bench = BenchSummary.model_validate_json(evidence.read_bytes("bench"))
    except (ReleasekitError, ValidationError, ValueError):
        return None
    return baseline_from_bench(bench, release_id=release_id)


def metrics_urls(settings: Settings, env: str, release_id: str) -> tuple[str, str | None]:
    """(vLLM /metrics URL, gateway /metrics URL) of `release_id` in `env`, from the deploy
    state: the server the gateway routes the release to (else any recorded for it), and the
    environment's gateway. WatchSetupError when no server is recorded."""
    try:
        state = read_state(settings.state_dir, env)
    except DeployStateError as exc:
        raise WatchSetupError(exc.message) from exc
    base: str | None = None
    for route in state.routes:
        if route.release_id == release_id and route.weight > 0:
            base = route.base_url
            break
    if base is None:
        rec = state.server_for(release_id)
        base = rec.base_url if rec else None
    if base is None:
        raise WatchSetupError(
            f"the deploy state of {env} names no server for {release_id[:12]}",
            remedy="check `releasekit deploy-status`; promote or roll back to start one",
        )
    rec = state.server_for(release_id)
    vllm = rec.metrics_url if rec is not None and rec.app else _join(base, "metrics")
    gateway: str | None = None
    if state.gateway is not None:
        gateway = state.gateway.url
    else:
        cfg = settings.environments.get(env)
        gateway = cfg.url if cfg is not None else None
    return vllm, (_join(gateway, "metrics") if gateway else None)


def _join(base: str, path: str) -> str:
    return base.rstrip("/") + "/" + path


def plan_watch(
    settings: Settings,
    env: str,
    *,
    ledger: Ledger,
    release_id: str | None = None,
    include_slo: bool = True,
    extra_rules: list[Rule] | None = None,
    vllm_metrics_url: str | None = None,
    gateway_metrics_url: str | None = None,
) -> WatchPlan:
    """Everything a watch of `env` needs, for its live release (or `release_id`): rules
    from the manifest's `watch` list and (with `include_slo`) the load profile's SLOs, over
    windows as long and as many as the manifest's longest rule; the benchmark baseline; the
    /metrics URLs (given ones win over the deploy state). WatchSetupError if any is missing."""
    rid = release_id or live_release_id(settings, env, ledger=ledger)
    notes: list[str] = []
    try:
        info = load_release(settings, rid, ledger=ledger)
    except ReleasekitError as exc:
        raise WatchSetupError(
            f"cannot read the manifest of {rid[:12]}, live in {env}: {exc.message}",
            remedy=exc.remedy or WatchSetupError.remedy,
        ) from exc
    manifest = info.lm.manifest
    rules, slo, more = release_rules(info, watch_floor(settings, env), env, include_slo=include_slo)
    notes += more
    rules += extra_rules or []
    rules = _unique(rules)
    if not rules:
        raise WatchSetupError(
            f"{manifest.name} ({rid[:12]}) has no watch rules and no SLOs",
            remedy="add a `watch:` list to the manifest",
        )
    baseline = read_baseline(settings, rid, info.evidence)
    if baseline is None:
        signed = info.evidence.problems_for("bench") if info.evidence else []
        why = signed[0] if signed else "no bench.json"
        notes.append(f"{why}: relative rules judge 'no data'")
    if vllm_metrics_url is None:
        vllm_metrics_url, state_gw = metrics_urls(settings, env, rid)
        gateway_metrics_url = gateway_metrics_url or state_gw
    target = WatchTarget(
        env=env,
        release=rid,
        vllm_metrics_url=vllm_metrics_url,
        gateway_metrics_url=gateway_metrics_url,
    )
    return WatchPlan(
        env=env,
        release_id=rid,
        release_name=manifest.name,
        rules=rules,
        baseline=baseline,
        slo=slo,
        target=target,
        notes=notes,
    )


def release_rules(
    info: ReleaseInfo, floor: list[Rule], env: str, *, include_slo: bool = True
) -> tuple[list[Rule], SLO | None, list[str]]:
    """A release's watch rules in `env`: the manifest's `watch` list under the environment's
    `floor`, then (with `include_slo`) its load profile's SLO rules; (rules, SLO, notes).
    `plan_watch` and `releasekit audit replay` both derive them here."""
    manifest = info.lm.manifest
    rules = [from_manifest(r) for r in manifest.watch]
    # The environment's floor: the release's own rules only tighten it.
    rules, notes = with_floor(rules, floor, env=env)
    slo: SLO | None = None
    if include_slo:
        try:
            slo = load_profile(info.lm.resolve(manifest.load.profile)).slo
        except ReleasekitError as exc:
            notes.append(f"load profile unreadable, SLO rules left out: {exc.message}")
    if slo is not None:
        window = max((r.window_s for r in rules), default=60.0)
        sustain = max((r.sustain for r in rules), default=3)
        rules += rules_from_slo(slo, window_s=window, sustain=sustain)
    return _unique(rules), slo, notes


def watch_floor(settings: Settings, env: str) -> list[Rule]:
    """`env`'s floor under every release's watch rules (`watch_floor`, committed policy);
    PolicyError when this command's settings change it from the committed policy."""
    cfg = env_config(settings, env)
    if "watch_floor" in read_policy(settings, env, cfg).differs:
        environment_policy(settings, env, cfg)  # raises, naming the fields
    return [from_manifest(r) for r in cfg.watch_floor]


def _unique(rules: list[Rule]) -> list[Rule]:
    # An SLO rule may mirror a manifest rule of the same name: the manifest's wins.
    seen: set[str] = set()
    out = []
    for r in rules:
        if r.name not in seen:
            seen.add(r.name)
            out.append(r)
    return out


# --------------------------------------------------------------------------- rollback


class RollbackImpl(Protocol):
    """The signature of `releasekit.promote.rollback.rollback` the adapter calls."""

    def __call__(
        self,
        settings: Settings,
        env: str,
        *,
        reason: str,
        actor: str | None = ...,
        evidence: dict[str, Any] | None = ...,
        from_release: str | None = ...,
        ledger: Ledger | None = ...,
        break_glass: bool = ...,
    ) -> RollbackResult: ...


_TRANSIENT = (DeployStateError, LedgerLockTimeoutError, RegistryUnreachableError)


def breach_record(e: BreachEvidence) -> dict[str, Any]:
    """A breaching window as a rollback event holds it: the judgement, and the window cut
    to the figures `watch.rules.judge` reads (the rule's metric, and the request rate that
    picks a benchmark point): counts and quantiles, never a prompt or an answer."""
    keep = {e.judgement.metric, "request_rate"}
    w = e.window.model_copy(
        update={
            "figures": {k: v for k, v in e.window.figures.items() if k in keep},
            "histograms": {},
        }
    )
    return {"judgement": e.judgement.model_dump(mode="json"), "window": w.model_dump(mode="json")}


def rollback_adapter(
    settings: Settings, *, ledger: Ledger, impl: RollbackImpl | None = None
) -> RollbackFn:
    """The watcher's and receiver's rollback path: `releasekit.promote.rollback.rollback`
    (or `impl`, same signature) to the previous good release, with the breaching windows (or
    the alert) as the event's evidence, as `releasekit-watch` / `releasekit-alertmanager`.
    Nothing to go back to -> `no_known_good`; another release live by now -> `not_live`; a
    held deploy lock or ledger lock -> RollbackTransientError (retried).

    A ledger that fails verification does not stop it: a way back must always work, and an
    alert is when it is needed. It breaks glass on its own (`rollback(break_glass=True)`):
    back to the release the verified records show live before the first bad record, which
    no record at or after the failure can choose, recorded with the failure it went past
    and the trigger as its reason."""
    if impl is None:
        from releasekit.promote.rollback import rollback as impl_

        impl = impl_

    def call(req: RollbackRequest) -> RollbackOutcome:
        evidence: dict[str, Any] = {
            "trigger": req.trigger,
            "requested_at": req.requested_at,
            "rules": sorted({e.judgement.rule for e in req.evidence}),
            "breaches": [breach_record(e) for e in req.evidence],
        }
        if req.rules:  # the rules as judged (after the floor), for `audit replay`
            evidence["rule_params"] = [r.model_dump(mode="json") for r in req.rules]
        if req.alert is not None:
            evidence["alert"] = req.alert
        if req.answers is not None:
            evidence["rules"] = [*evidence["rules"], "after_promotion_agreement"]
            evidence["answers"] = req.answers
        glass: dict[str, Any] = {}
        try:  # act only on verified records (what is live, what is marked bad)
            ledger.verified()
        except DecisionRecordsError as exc:
            log.warning("ledger fails verification; %s breaks glass: %s", req.env, exc.message)
            glass = {"break_glass": True}  # decided on the verified records only
        if ledger.live_at(req.env) is None:
            return RollbackOutcome(
                status="not_live",
                env=req.env,
                from_release=req.from_release,
                message=f"nothing is live in {req.env}",
            )
        try:
            res = impl(
                settings,
                req.env,
                reason=req.reason,
                actor=f"releasekit-{req.trigger}",
                evidence=evidence,
                from_release=req.from_release,
                ledger=ledger,
                **glass,
            )
        except RollbackError as exc:
            return RollbackOutcome(
                status="no_known_good",
                env=req.env,
                from_release=req.from_release,
                message=exc.message,
            )
        except _TRANSIENT as exc:
            raise RollbackTransientError(f"rollback of {req.env} must wait: {exc}") from exc
        return RollbackOutcome(
            status=res.status,
            env=res.environment,
            from_release=res.from_release,
            to_release=res.to_release,
            event_id=res.record.event_id if res.record is not None else None,
            message=res.message,
        )

    return call


def _check_records(ledger: Ledger) -> None:
    """Verify afresh before a rollback decision; a failure is logged, not raised: the
    rollback then breaks glass on the verified records (`rollback_adapter`)."""
    try:
        ledger.verified(again=True)
    except DecisionRecordsError as exc:
        log.warning("the ledger fails verification: %s", exc.message)


def known_good(ledger: Ledger) -> Callable[[str], bool]:
    """`has_known_good(env)`: whether the ledger has an earlier release of `env` that is not
    marked bad (where a rollback would go)."""

    def has(env: str) -> bool:
        try:
            ledger.verified()  # marked-bad and live records: verified ones only
        except DecisionRecordsError:  # where a break-glass rollback would go
            raw = ledger.live_at(env)
            try:
                break_glass_target(
                    verified_prefix(ledger), env, current=raw.to_release if raw else None
                )
            except RollbackError:
                return False
            return True
        return previous_good_release(ledger, env) is not None

    return has


def _latest_event_time(ledger: Ledger, types: list[str]) -> Callable[[str], float | None]:
    """`latest(env)`: the unix time of the environment's newest event of `types` (None).
    The ledger is verified first (DecisionRecordsError otherwise): a forged rollback record
    would otherwise hold a regression live for a whole cool-down."""

    def latest(env: str) -> float | None:
        try:
            ledger.verified()
        except DecisionRecordsError:  # a break-glass rollback: the verified records only
            mine = [
                r
                for r in verified_prefix(ledger).records
                if r.environment == env and r.type in types
            ]
            return mine[-1].time.timestamp() if mine else None
        recs = ledger.records(environment=env, types=types, newest_first=True, limit=1)
        return recs[0].time.timestamp() if recs else None

    return latest


def last_rollback_time(ledger: Ledger) -> Callable[[str], float | None]:
    """`last_rollback_at(env)`: the unix time of the environment's latest rollback event (by
    any actor), so the cool-down also covers manual rollbacks and a restarted watcher."""
    return _latest_event_time(ledger, [EventType.ROLLBACK.value])


def last_promotion_time(ledger: Ledger) -> Callable[[str], float | None]:
    """`last_promotion_at(env)`: the unix time of the environment's latest promotion (forced
    or not) that put a new release live, so a rollback before it does not hold back the next.
    A redeploy of the release of record is not one."""
    return _latest_event_time(ledger, [EventType.PROMOTE.value, EventType.OVERRIDE.value])


# --------------------------------------------------------------------------- receiver auth


def receiver_auth(environ: Mapping[str, str] | None = None) -> ReceiverAuth | None:
    """Receiver credentials from the environment: RELEASEKIT_WEBHOOK_TOKEN (or
    RELEASEKIT_WEBHOOK_TOKEN_FILE) for bearer, RELEASEKIT_WEBHOOK_USER and
    RELEASEKIT_WEBHOOK_PASSWORD for basic auth; None when none is set."""
    env = os.environ if environ is None else environ
    tokens: list[SecretStr] = []
    if env.get(TOKEN_ENV):
        tokens.append(SecretStr(env[TOKEN_ENV]))
    if env.get(TOKEN_FILE_ENV):
        try:
            text = Path(env[TOKEN_FILE_ENV]).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise WatchSetupError(
                f"cannot read {TOKEN_FILE_ENV}={env[TOKEN_FILE_ENV]}: {exc}",
                remedy="point it at a readable file holding the token",
            ) from exc
        if text:
            tokens.append(SecretStr(text))
    basic: list[BasicCredential] = []
    if env.get(USER_ENV) and env.get(PASSWORD_ENV):
        basic.append(BasicCredential(username=env[USER_ENV], password=SecretStr(env[PASSWORD_ENV])))
    if not tokens and not basic:
        return None
    return ReceiverAuth(bearer_tokens=tokens, basic=basic)


def receiver_store_path(settings: Settings) -> Path:
    """Where the receiver keeps its deliveries: `<state_dir>/watch/alerts.db`."""
    return settings.state_dir / "watch" / "alerts.db"


# --------------------------------------------------------------------------- the service


class _FollowingWatcher(Watcher):
    """A Watcher that re-plans when the ledger's live release is not the one it judges."""

    def __init__(self, service: WatchService, plan: WatchPlan, **kw: Any) -> None:
        super().__init__(plan.target, plan.rules, baseline=plan.baseline, **kw)
        self._service = service

    def tick(self) -> WatchTick:
        self._service.follow()
        return self._service.judge_answers(super().tick())


class WatchService:
    """A watch of one environment: its plan, the shared `guard`, the `watcher`, and (with
    `serve`) the receiver. `rollback` replaces the real rollback path (tests, dry runs);
    `clock` times windows and the cool-down (ledger rollback times count only with the
    real clock, `cooldown_from_ledger`)."""

    def __init__(
        self,
        settings: Settings,
        env: str,
        *,
        ledger: Ledger,
        rollback: RollbackFn | None = None,
        cooldown_s: float = DEFAULT_COOLDOWN_S,
        interval_s: float | None = None,
        scrape_timeout_s: float | None = None,
        include_slo: bool = True,
        extra_rules: list[Rule] | None = None,
        vllm_metrics_url: str | None = None,
        gateway_metrics_url: str | None = None,
        clock: Callable[[], float] = time.time,
        cooldown_from_ledger: bool | None = None,
        client: httpx.Client | None = None,
    ) -> None:
        cfg = env_config(settings, env)  # an unknown environment fails first
        policy = comparison_policy(settings, env)
        self.settings = settings
        self.env = env
        self.ledger = ledger
        self._plan_kw: dict[str, Any] = {
            "include_slo": include_slo,
            "extra_rules": extra_rules,
            "vllm_metrics_url": vllm_metrics_url,
            "gateway_metrics_url": gateway_metrics_url,
        }
        self.plan = plan_watch(settings, env, ledger=ledger, **self._plan_kw)
        if cooldown_from_ledger is None:
            cooldown_from_ledger = clock is time.time
        self.guard = RollbackGuard(
            rollback or rollback_adapter(settings, ledger=ledger),
            has_known_good=known_good(ledger),
            cooldown_s=cooldown_s,
            clock=clock,
            last_rollback_at=last_rollback_time(ledger) if cooldown_from_ledger else None,
            last_promotion_at=last_promotion_time(ledger) if cooldown_from_ledger else None,
            check_records=lambda: _check_records(ledger),
        )
        self.followed: list[str] = [self.plan.release_id]
        self.owns_ledger = False
        self.clock = clock
        self.answers = AnswerWatch(
            settings,
            env,
            ledger=ledger,
            min_agreement=float(policy.get("shadow_min_agreement", cfg.shadow_min_agreement)),
            min_pairs=int(policy.get("shadow_min_pairs", cfg.shadow_min_pairs)),
            clock=clock,
            timeout_s=scrape_timeout_s or settings.scrape_timeout_s,
        )
        self.watcher = _FollowingWatcher(
            self,
            self.plan,
            guard=self.guard,
            interval_s=interval_s,
            scrape_timeout_s=scrape_timeout_s or settings.scrape_timeout_s,
            clock=clock,
            client=client,
        )

    def follow(self) -> bool:
        """Re-plan when the ledger's live release changed (a rollback, a promote); True when
        it did. A release that cannot be planned (no manifest, no server yet) keeps the old
        plan and is tried again on the next tick."""
        rec = self.ledger.live_at(self.env)
        live = rec.to_release if rec else None
        if live is None or live == self.plan.release_id:
            return False
        try:
            plan = plan_watch(
                self.settings, self.env, ledger=self.ledger, release_id=live, **self._plan_kw
            )
        except ReleasekitError as exc:
            log.warning("cannot watch %s yet (live in %s): %s", live[:12], self.env, exc)
            return False
        self.plan = plan
        self.watcher.retarget(plan.target, plan.rules, plan.baseline)
        self.followed.append(live)
        return True

    def judge_answers(self, tick: WatchTick) -> WatchTick:
        """Judge the after-promotion comparison (when one runs) into `tick`: roll back on a
        breach (unless the tick's rules just did), end it at the window's end."""
        if tick.rollback is not None and tick.rollback.status == "rolled_back":
            return tick  # the rollback replaced the gateway's table, and its mirror
        check = self.answers.check(self.plan.release_id)
        if check is None:
            return tick
        tick.answers = check
        if check.verdict == "breach" and tick.rollback is None:
            check = write_answers_page(self.settings, check)
            tick.answers = check
            request = RollbackRequest(
                env=self.env,
                from_release=check.release_id,
                reason=f"answers after the promotion: {check.agreement.reason}",
                trigger="watch",
                answers=check.evidence(),
                requested_at=self.clock(),
            )
            tick.rollback = self.watcher.request_rollback(request)
            if tick.rollback.status == "rolled_back":
                self.answers.settled()
                tick.answers = check.model_copy(update={"status": "ended"})
                return tick
        if check.status == "ended":
            tick.answers = self.answers.finish(write_answers_page(self.settings, check))
        return tick

    def once(self, *, sleep: Callable[[float], None] = time.sleep) -> WatchTick:
        """One check (`watch --once`): two scrapes a longest window apart, every rule judged
        once (and a rollback if a one-window rule is breached)."""
        return self.watcher.run_once(sleep=sleep)

    def run(
        self, stop: threading.Event, *, on_tick: Callable[[WatchTick], None] | None = None
    ) -> WatchSummary:
        """Watch until `stop` is set (see Watcher.run); never raises on a bad tick."""
        return self.watcher.run(stop, on_tick=on_tick)

    def app(self, auth: ReceiverAuth, *, store_path: Path | None = None) -> Starlette:
        """One ASGI app: POST /alertmanager (the receiver, sharing the guard), GET /healthz,
        and GET /metrics (the watcher's and the receiver's own metrics)."""
        receiver = create_receiver(
            rollback=self.guard,
            auth=auth,
            store_path=store_path or receiver_store_path(self.settings),
            envs={self.env},
            path=RECEIVER_PATH,
            registry=self.watcher.registry,
        )
        registry = self.watcher.registry

        async def metrics(request: Request) -> Response:
            return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

        return Starlette(routes=[Route("/metrics", metrics, methods=["GET"]), Mount("/", receiver)])

    @contextlib.contextmanager
    def serve(
        self, host: str, port: int, *, auth: ReceiverAuth, store_path: Path | None = None
    ) -> Iterator[str]:
        """Serve `app` on host:port in a thread for the block; yields its base URL."""
        import socket

        import uvicorn

        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            sock.close()
            raise WatchSetupError(
                f"cannot listen on {host}:{port}: {exc}", remedy="pick another --listen address"
            ) from exc
        server = uvicorn.Server(
            uvicorn.Config(
                receiver_guard(self.app(auth, store_path=store_path)),
                log_level="warning",
                lifespan="off",
                access_log=False,
                timeout_graceful_shutdown=2,
                **receiver_server_options(),  # the gateway's header limits
            )
        )
        thread = threading.Thread(target=server.run, args=([sock],), daemon=True)
        thread.start()
        deadline = time.monotonic() + 10
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                sock.close()
                raise WatchSetupError(f"the receiver did not start on {host}:{port}")
            time.sleep(0.02)
        bound = sock.getsockname()
        try:
            yield f"http://{host if ':' not in host else f'[{host}]'}:{bound[1]}"
        finally:
            server.should_exit = True
            thread.join(timeout=10)
            sock.close()

    def close(self) -> None:
        """Close the watcher's HTTP client (and the ledger when `open_service` opened it)."""
        self.watcher.close()
        if self.owns_ledger:
            self.ledger.close()


COMPARISON_FIELDS = (
    "after_promotion_compare_s",
    "after_promotion_share",
    "shadow_min_agreement",
    "shadow_min_pairs",
)
"""The policy fields the after-promotion comparison is judged by."""


def comparison_policy(settings: Settings, env: str) -> dict[str, Any]:
    """The environment's policy the after-promotion comparison is judged by; PolicyError
    when this command's settings change one of COMPARISON_FIELDS from the committed
    policy (a policy is changed by a commit, not for one watch)."""
    cfg = env_config(settings, env)
    pol = read_policy(settings, env, cfg)
    if set(pol.differs) & set(COMPARISON_FIELDS):
        environment_policy(settings, env, cfg)  # raises, naming the fields
    return pol.policy


def open_service(settings: Settings, env: str, **kw: Any) -> WatchService:
    """A WatchService on the project's ledger (signing and anchoring as every command does)."""
    ledger = open_ledger(settings)
    try:
        svc = WatchService(settings, env, ledger=ledger, **kw)
    except BaseException:
        ledger.close()
        raise
    svc.owns_ledger = True
    return svc


@contextlib.contextmanager
def stop_on_signals(stop: threading.Event) -> Iterator[None]:
    """Set `stop` on SIGINT or SIGTERM for the block (main thread only), so a running tick
    (and a rollback in it) finishes before the loop ends; a second signal interrupts."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


# --------------------------------------------------------------------------- rules as code


class AlertRulesResult(BaseModel):
    """What `alert-rules ENV` produces: the Prometheus rules file, the Alertmanager snippet,
    and the scrape jobs that give vLLM's series the `releasekit_env` label."""

    env: str
    release_id: str
    rules: AlertRulesFile
    alertmanager: AlertmanagerSnippet
    scrape_configs: list[dict[str, Any]]
    notes: list[str] = Field(default_factory=list)


def _hostport(url: str | None) -> str | None:
    if not url:
        return None
    parsed = httpx.URL(url)
    return f"{parsed.host}:{parsed.port}" if parsed.port else parsed.host


def build_alert_rules(
    settings: Settings,
    env: str,
    *,
    ledger: Ledger,
    webhook_url: str | None = None,
    environ: Mapping[str, str] | None = None,
    evaluation_interval_s: float | None = None,
) -> AlertRulesResult:
    """The rules file and Alertmanager snippet for `env`'s live release: its watch rules and
    SLO rules (one alert per benchmark band for a relative rule), labelled with the
    environment and release. The webhook authenticates as the receiver will check:
    RELEASEKIT_WEBHOOK_TOKEN_FILE (as `credentials_file`), else the token inline, else basic
    auth, else a token file path to fill in."""
    env_config(settings, env)
    plan = plan_watch(settings, env, ledger=ledger)
    notes = [
        *plan.notes,
        f"the rules select release {plan.release_id[:12]}: regenerate them after every "
        "promote or rollback of this environment",
    ]
    rules_file = alert_rules(
        env,
        plan.rules,  # the SLO rules are among them, windowed like the manifest's
        baseline=plan.baseline,
        release=plan.release_id,
        gateway=plan.target.gateway_metrics_url is not None,
        evaluation_interval_s=evaluation_interval_s,
    )
    e = os.environ if environ is None else environ
    url = webhook_url or f"http://127.0.0.1:9095{RECEIVER_PATH}"
    if webhook_url is None:
        notes.append(f"webhook URL defaulted to {url}; pass --webhook-url for `watch --listen`")
    auth: dict[str, Any]
    if e.get(TOKEN_FILE_ENV):
        auth = {"bearer_token_file": e[TOKEN_FILE_ENV]}
    elif e.get(TOKEN_ENV):
        auth = {"bearer_token": e[TOKEN_ENV]}
        notes.append("the webhook token is inline in the Alertmanager snippet: keep it private")
    elif e.get(USER_ENV) and e.get(PASSWORD_ENV):
        auth = {"basic_auth": (e[USER_ENV], e[PASSWORD_ENV])}
        notes.append("the basic-auth password is inline in the Alertmanager snippet")
    else:
        path = "/etc/alertmanager/releasekit-webhook-token"
        auth = {"bearer_token_file": path}
        notes.append(
            f"no {TOKEN_ENV} set: the snippet reads the token from {path}; put the same token "
            f"in {TOKEN_ENV} for `releasekit watch --listen`"
        )
    snippet = alertmanager_config(env, webhook_url=url, **auth)
    vllm = _hostport(plan.target.vllm_metrics_url)
    gw = _hostport(plan.target.gateway_metrics_url)
    jobs = scrape_configs(
        env, vllm_targets=[vllm] if vllm else [], gateway_targets=[gw] if gw else []
    )
    return AlertRulesResult(
        env=env,
        release_id=plan.release_id,
        rules=rules_file,
        alertmanager=snippet,
        scrape_configs=jobs,
        notes=notes,
    )


class WrittenAlertRules(BaseModel):
    """Where `write_alert_rules` put the files, and the scrape jobs as YAML to add."""

    rules_path: Path
    alertmanager_path: Path
    scrape_yaml: str
    result: AlertRulesResult


def write_alert_rules(
    result: AlertRulesResult, *, rules_path: Path, alertmanager_path: Path
) -> WrittenAlertRules:
    """Write the rules file and the Alertmanager config atomically (the config is 0600: it
    may hold the webhook's credentials)."""
    import yaml

    from releasekit._support.files import write_atomic

    for path, text in (
        (rules_path, result.rules.yaml),
        (alertmanager_path, result.alertmanager.yaml),
    ):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, text.encode())
    with contextlib.suppress(OSError):
        rules_path.chmod(0o644)  # Prometheus reads it, often as another user
        alertmanager_path.chmod(0o600)
    scrape = yaml.safe_dump({"scrape_configs": result.scrape_configs}, sort_keys=False)
    return WrittenAlertRules(
        rules_path=rules_path,
        alertmanager_path=alertmanager_path,
        scrape_yaml=scrape,
        result=result,
    )
