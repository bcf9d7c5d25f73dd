"""The watcher: scrape the live vLLM server's and the gateway's /metrics at a fixed interval,
build one window per rule as each rule's window elapses, judge the rules, and on a sustained
breach ask the rollback path (injected) to roll the environment back, with the breaching
windows as evidence.

`RollbackGuard` is the anti-flap shield in front of the rollback path, shared by the watcher
and the Alertmanager receiver: a cool-down after any rollback (at most one automatic rollback
per cool-down), and no rollback when there is no known-good release to go back to (the
outcome says so, and the caller records and alerts instead).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, make_asgi_app
from pydantic import BaseModel, Field

from releasekit._support.http import http_client
from releasekit.errors import ReleasekitError
from releasekit.watch.pairs import AnswersCheck
from releasekit.watch.rules import Baseline, BreachEvidence, Judgement, Rule, RuleState, judge
from releasekit.watch.windows import (
    ScrapeError,
    Snapshot,
    Window,
    build_window,
    parse_exposition,
    scrape,
)

log = logging.getLogger(__name__)

RollbackStatus = Literal["rolled_back", "no_known_good", "cooling_down", "not_live", "failed"]


class RollbackRequest(BaseModel):
    """What the watcher or the receiver asks the rollback path to do."""

    env: str
    from_release: str | None = Field(
        None,
        description="the release to move away from; the rollback path must do nothing "
        "(status not_live) when another release is live by now. None: whatever is live",
    )
    reason: str
    trigger: Literal["watch", "alertmanager"]
    evidence: list[BreachEvidence] = Field(
        default_factory=list, description="the breaching windows (watch)"
    )
    rules: list[Rule] = Field(
        default_factory=list, description="the sustained rules as judged, for replay (watch)"
    )
    alert: dict[str, Any] | None = Field(
        None, description="the Alertmanager alert: labels, annotations, fingerprint, startsAt"
    )
    answers: dict[str, Any] | None = Field(
        None,
        description="the after-promotion answer comparison that breached: agreement, "
        "interval, disagreeing pairs (watch)",
    )
    requested_at: float = Field(description="the requester's clock, seconds")


class RollbackOutcome(BaseModel):
    """What the rollback path did (or, from the guard, why it was not asked)."""

    status: RollbackStatus
    env: str
    from_release: str | None = None
    to_release: str | None = None
    event_id: str | None = Field(None, description="the ledger record of the rollback")
    message: str = ""


RollbackFn = Callable[[RollbackRequest], RollbackOutcome]


class RollbackTransientError(ReleasekitError):
    """Raised by a rollback callback when the rollback failed in a way a retry could fix
    (the ledger was locked, the previous server is still starting). The receiver answers 503
    so Alertmanager retries; the watcher retries on the next breaching window."""

    remedy = "nothing to do: the rollback is retried; if it keeps failing, roll back by hand"


class RollbackGuard:
    """Anti-flap in front of a rollback path: at most one rollback per environment per
    `cooldown_s` (counted from any rollback it let through, or that `last_rollback_at`
    reports, e.g. from the ledger), and none when `has_known_good(env)` is false.
    A rollback older than the environment's latest promotion (`last_promotion_at`) does not
    count: the cool-down stops rollbacks chasing each other, it never keeps a newly promoted
    release live. `check_records` runs first on each request and raises when the records
    those answers come from cannot be trusted (the request then fails, naming why).
    Thread-safe: the watcher and the receiver may share one guard."""

    def __init__(
        self,
        rollback: RollbackFn,
        *,
        has_known_good: Callable[[str], bool],
        cooldown_s: float = 900.0,
        clock: Callable[[], float] = time.time,
        last_rollback_at: Callable[[str], float | None] | None = None,
        last_promotion_at: Callable[[str], float | None] | None = None,
        check_records: Callable[[], None] | None = None,
    ) -> None:
        self._rollback = rollback
        self._check_records = check_records
        self._last_promotion_at = last_promotion_at
        self._has_known_good = has_known_good
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._last_rollback_at = last_rollback_at
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def cooldown_left(self, env: str) -> float:
        """Seconds of cool-down left for `env` (0 when none)."""
        last = self._last.get(env)
        if self._last_rollback_at is not None:
            other = self._last_rollback_at(env)
            if other is not None and (last is None or other > last):
                last = other
        if last is None:
            return 0.0
        if self._last_promotion_at is not None:
            promoted = self._last_promotion_at(env)
            if promoted is not None and promoted > last:
                return 0.0
        return max(0.0, last + self.cooldown_s - self._clock())

    def __call__(self, request: RollbackRequest) -> RollbackOutcome:
        """Roll back unless cooling down or nothing is known good. Exceptions of the
        rollback path propagate (RollbackTransientError: retry later)."""
        with self._lock:
            if self._check_records is not None:
                self._check_records()
            left = self.cooldown_left(request.env)
            if left > 0:
                return RollbackOutcome(
                    status="cooling_down",
                    env=request.env,
                    from_release=request.from_release,
                    message=f"a rollback happened less than {self.cooldown_s:g} s ago; "
                    f"{left:.0f} s of cool-down left",
                )
            if not self._has_known_good(request.env):
                return RollbackOutcome(
                    status="no_known_good",
                    env=request.env,
                    from_release=request.from_release,
                    message="no known-good release to roll back to: not rolled back (counted in "
                    'releasekit_watch_rollbacks_total{status="no_known_good"})',
                )
            outcome = self._rollback(request)
            if outcome.status == "rolled_back":
                self._last[request.env] = self._clock()
            return outcome


class WatchTarget(BaseModel):
    """What to watch: the environment, its live release, and the /metrics URLs."""

    env: str
    release: str | None = Field(None, description="the live release id (gateway label)")
    vllm_metrics_url: str
    gateway_metrics_url: str | None = None


class WatchTick(BaseModel):
    """One scrape and what it led to."""

    t: float
    scraped: bool
    scrape_errors: dict[str, str] = Field(default_factory=dict)
    windows: list[Window] = Field(default_factory=list)
    judgements: list[Judgement] = Field(default_factory=list)
    sustained: list[str] = Field(default_factory=list, description="rules breached long enough")
    rollback: RollbackOutcome | None = None
    answers: AnswersCheck | None = Field(
        None, description="the after-promotion answer comparison, when one runs"
    )


class WatchSummary(BaseModel):
    """What a `run` loop did before it was stopped."""

    ticks: int = 0
    failed_scrapes: int = 0
    windows_judged: int = 0
    windows_no_data: int = 0
    breaches: int = 0
    rollbacks: list[RollbackOutcome] = Field(default_factory=list)


class _Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.last_scrape = Gauge(
            "releasekit_watch_last_scrape_timestamp_seconds",
            "Time of the last successful scrape of every source",
            ["env"],
            registry=registry,
        )
        self.scrape_failures = Counter(
            "releasekit_watch_scrape_failures",
            "Scrapes that failed (timeout, refused, unparseable)",
            ["env", "source"],
            registry=registry,
        )
        self.judged = Counter(
            "releasekit_watch_windows_judged",
            "Windows judged pass or breach",
            ["env", "rule"],
            registry=registry,
        )
        self.no_data = Counter(
            "releasekit_watch_windows_no_data",
            "Windows with no data (low traffic, restart, missing metric)",
            ["env", "rule"],
            registry=registry,
        )
        self.breaches = Counter(
            "releasekit_watch_breaches", "Breaching windows", ["env", "rule"], registry=registry
        )
        self.consecutive = Gauge(
            "releasekit_watch_consecutive_breaches",
            "Current run of consecutive breaching windows",
            ["env", "rule"],
            registry=registry,
        )
        self.rollbacks = Counter(
            "releasekit_watch_rollbacks",
            "Rollback requests on sustained breaches, by outcome",
            ["env", "status"],
            registry=registry,
        )


class Watcher:
    """Watches one environment's live release and rolls it back on a sustained breach.

    Pass `rollback` and `has_known_good` (a guard with `cooldown_s` and `clock` is built), or
    a shared `guard`. `clock` also times the windows (tests advance it by hand). After a
    rollback the watcher follows the new live release (`outcome.to_release`) and, when
    `reload` is given, takes that release's rules and baseline from it.
    """

    def __init__(
        self,
        target: WatchTarget,
        rules: Sequence[Rule],
        *,
        rollback: RollbackFn | None = None,
        has_known_good: Callable[[str], bool] | None = None,
        guard: RollbackGuard | None = None,
        baseline: Baseline | None = None,
        cooldown_s: float = 900.0,
        interval_s: float | None = None,
        scrape_timeout_s: float = 5.0,
        clock: Callable[[], float] = time.time,
        registry: CollectorRegistry | None = None,
        client: httpx.Client | None = None,
        reload: Callable[[str], tuple[Sequence[Rule], Baseline | None]] | None = None,
    ) -> None:
        if guard is None:
            if rollback is None or has_known_good is None:
                raise ValueError("pass rollback and has_known_good, or a guard")
            guard = RollbackGuard(
                rollback, has_known_good=has_known_good, cooldown_s=cooldown_s, clock=clock
            )
        names = [r.name for r in rules]
        if len(set(names)) != len(names):
            raise ValueError(f"rule names must be unique: {names}")
        self.target = target
        self.guard = guard
        self.baseline = baseline
        self.scrape_timeout_s = scrape_timeout_s
        self.clock = clock
        self.registry = registry if registry is not None else CollectorRegistry()
        self._m = _Metrics(self.registry)
        self._client = client or http_client()
        self._own_client = client is None
        self._reload = reload
        self._fixed_interval = interval_s
        self.states: dict[str, RuleState] = {}
        self._starts: dict[str, Snapshot] = {}
        self._set_rules(rules)

    # ------------------------------------------------------------------ setup

    def _set_rules(self, rules: Sequence[Rule]) -> None:
        self.rules = list(rules)
        self.states = {r.name: RuleState(rule=r) for r in self.rules}
        self._starts = {}
        self.interval_s = self._fixed_interval or min(
            (r.window_s for r in self.rules), default=30.0
        )

    def retarget(
        self, target: WatchTarget, rules: Sequence[Rule], baseline: Baseline | None
    ) -> None:
        """Judge another release from now on: its URLs, its rules and its benchmark, with
        fresh rule states and windows (nothing carries over from the release before)."""
        self.target = target
        self.baseline = baseline
        self._set_rules(rules)

    def close(self) -> None:
        """Close the HTTP client the watcher made."""
        if self._own_client:
            self._client.close()

    def metrics_app(self) -> Any:
        """An ASGI app serving the watcher's own /metrics."""
        return make_asgi_app(registry=self.registry)

    # ------------------------------------------------------------------ one tick

    def _snapshot(self) -> Snapshot:
        t = self.clock()
        sources = {"vllm": self.target.vllm_metrics_url}
        if self.target.gateway_metrics_url:
            sources["gateway"] = self.target.gateway_metrics_url
        parsed: dict[str, Any] = {}
        errors: dict[str, str] = {}
        for source, url in sources.items():
            try:
                text = scrape(url, timeout_s=self.scrape_timeout_s, client=self._client)
                parsed[source] = parse_exposition(text, url=url)
            except ScrapeError as exc:
                errors[source] = exc.problem
                self._m.scrape_failures.labels(self.target.env, source).inc()
        return Snapshot(t=t, vllm=parsed.get("vllm"), gateway=parsed.get("gateway"), errors=errors)

    def tick(self) -> WatchTick:
        """Scrape once; judge every rule whose window has elapsed; roll back on a sustained
        breach. A failed scrape (any source) yields no window: the next window spans it."""
        snap = self._snapshot()
        out = WatchTick(t=snap.t, scraped=not snap.errors, scrape_errors=snap.errors)
        if snap.errors:
            return out
        env = self.target.env
        self._m.last_scrape.labels(env).set(time.time())
        windows: dict[float, Window] = {}
        for rule in self.rules:
            start = self._starts.get(rule.name)
            if start is None:
                self._starts[rule.name] = snap
                continue
            # Due when the window has (about) elapsed: half an interval of jitter is fine.
            if snap.t - start.t < rule.window_s - self.interval_s / 2:
                continue
            window = windows.get(start.t)
            if window is None:
                window = build_window(start, snap, env=env, release=self.target.release)
                windows[start.t] = window
            j = judge(rule, window, self.baseline)
            state = self.states[rule.name]
            state.update(j, window)
            self._starts[rule.name] = snap
            out.judgements.append(j)
            if j.verdict == "no_data":
                self._m.no_data.labels(env, rule.name).inc()
            else:
                self._m.judged.labels(env, rule.name).inc()
            if j.verdict == "breach":
                self._m.breaches.labels(env, rule.name).inc()
            self._m.consecutive.labels(env, rule.name).set(state.consecutive)
        out.windows = list(windows.values())
        out.sustained = [name for name, s in self.states.items() if s.sustained]
        if out.sustained:
            out.rollback = self._act(out.sustained, snap)
        return out

    def _act(self, sustained: list[str], snap: Snapshot) -> RollbackOutcome:
        env = self.target.env
        evidence = [e for name in sustained for e in self.states[name].breaches]
        reason = "; ".join(
            f"{self.states[n].rule.describe()}: "
            + ", ".join(e.judgement.reason for e in self.states[n].breaches)
            for n in sustained
        )
        request = RollbackRequest(
            env=env,
            from_release=self.target.release,
            reason=f"sustained breach: {reason}",
            trigger="watch",
            evidence=evidence,
            rules=[self.states[n].rule for n in sustained],
            requested_at=self.clock(),
        )
        outcome = self.request_rollback(request, snap)
        if outcome.status in ("no_known_good", "not_live"):
            # Recorded; a new sustained run is needed before asking again.
            for name in sustained:
                self.states[name].reset()
        # cooling_down and failed keep the run: the next breaching window asks again.
        return outcome

    def request_rollback(
        self, request: RollbackRequest, snap: Snapshot | None = None
    ) -> RollbackOutcome:
        """Ask the guard to roll back (a rule's sustained breach, or the after-promotion
        answer comparison); after a rollback, judge the new release from fresh windows
        (from `snap`, else from the next scrape). Never raises."""
        env = self.target.env
        try:
            outcome = self.guard(request)
        except Exception as exc:  # the loop must survive any rollback failure; retried later
            log.warning("rollback of %s failed: %s", env, exc, exc_info=True)
            outcome = RollbackOutcome(
                status="failed",
                env=env,
                from_release=self.target.release,
                message=f"{type(exc).__name__}: {exc}",
            )
        self._m.rollbacks.labels(env, outcome.status).inc()
        if outcome.status == "rolled_back":
            if outcome.to_release is not None:
                self.target = self.target.model_copy(update={"release": outcome.to_release})
                if self._reload is not None:
                    rules, self.baseline = self._reload(outcome.to_release)
                    self._set_rules(rules)
            for s in self.states.values():
                s.reset()
            # Judge the new release from fresh windows only.
            self._starts = {r.name: snap for r in self.rules} if snap is not None else {}
        return outcome

    # ------------------------------------------------------------------ loops

    def run_once(self, *, sleep: Callable[[float], None] = time.sleep) -> WatchTick:
        """One check (`watch --once`): a first scrape if none was taken, a wait of the longest
        rule window, then a tick that judges every rule once."""
        if not self._starts:
            first = self.tick()
            if not first.scraped:
                return first
            sleep(max((r.window_s for r in self.rules), default=0.0))
        return self.tick()

    def run(
        self,
        stop_event: threading.Event,
        *,
        on_tick: Callable[[WatchTick], None] | None = None,
    ) -> WatchSummary:
        """Tick every `interval_s` until `stop_event` is set; never raises on a bad scrape,
        a restart or a failed rollback. Returns what happened."""
        summary = WatchSummary()
        while not stop_event.is_set():
            began = time.monotonic()
            try:
                t = self.tick()
            except Exception:  # keep watching whatever one tick met
                log.exception("watch tick for %s failed", self.target.env)
                t = WatchTick(t=self.clock(), scraped=False, scrape_errors={"tick": "crashed"})
            summary.ticks += 1
            summary.failed_scrapes += 0 if t.scraped else 1
            for j in t.judgements:
                if j.verdict == "no_data":
                    summary.windows_no_data += 1
                else:
                    summary.windows_judged += 1
                summary.breaches += j.verdict == "breach"
            if t.rollback is not None:
                summary.rollbacks.append(t.rollback)
            if on_tick is not None:
                on_tick(t)
            stop_event.wait(max(0.0, self.interval_s - (time.monotonic() - began)))
        return summary
