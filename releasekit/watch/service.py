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
(`releasekit.watch.pairs`), at the looks of a fixed schedule over the window: breaching
looks (`after_promotion_sustain` in a row, or the last one) roll back through the same
guard, with the verdict (counts, digests and pair seqs; no text) in the rollback's
evidence; the window's end removes the mirror and records the result. The comparison's
policy fields must be the committed ones.

Where each part lives (all re-exported here): the plan (live release, rules, baseline,
/metrics URLs) and `WatchSetupError` in `watch.plan`, the rollback path and the guard's
ledger look-ups in `watch.rollbacks`, the webhook's credentials in `watch.webhook`, the
alert-rule files in `watch.alertfiles`. This module runs the service.

Errors (all `releasekit.errors.ReleasekitError`):
    WatchSetupError   the environment cannot be watched (nothing live, no manifest, no server)
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Mount, Route

from releasekit.config import Settings
from releasekit.config.environments import ANSWER_POLICY_FIELDS
from releasekit.config.lanes import is_lane, parent_env
from releasekit.errors import ConfigError, ReleasekitError
from releasekit.promote.answer_policy import answer_comparator, answer_policy
from releasekit.promote.deploy import env_config
from releasekit.promote.policy import EnvironmentPolicy, environment_policy, read_policy
from releasekit.stores.ledger import Ledger, open_ledger
from releasekit.watch.alertfiles import (
    AlertRulesResult,
    WrittenAlertRules,
    build_alert_rules,
    write_alert_rules,
)
from releasekit.watch.pairs import AnswerWatch, write_answers_page
from releasekit.watch.plan import (
    WatchPlan,
    WatchSetupError,
    baseline_from_bench,
    live_release_id,
    metrics_urls,
    plan_watch,
    read_baseline,
    release_rules,
    watch_floor,
)
from releasekit.watch.receiver import ReceiverAuth, create_receiver
from releasekit.watch.receiver import guard as receiver_guard
from releasekit.watch.receiver import server_options as receiver_server_options
from releasekit.watch.rollbacks import (
    RollbackImpl,
    breach_record,
    check_records,
    known_good,
    last_promotion_time,
    last_rollback_time,
    rollback_adapter,
)
from releasekit.watch.rules import Rule
from releasekit.watch.watcher import (
    RollbackFn,
    RollbackGuard,
    RollbackRequest,
    Watcher,
    WatchSummary,
    WatchTick,
)
from releasekit.watch.webhook import (
    RECEIVER_PATH,
    receiver_auth,
    receiver_store_path,
)

log = logging.getLogger(__name__)

DEFAULT_COOLDOWN_S = 900.0


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
        pol = comparison_policy(settings, env)
        policy = pol.policy
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
            check_records=lambda: check_records(ledger),
        )
        self.followed: list[str] = [self.plan.release_id]
        self.owns_ledger = False
        self.clock = clock
        looks = int(policy.get("after_promotion_looks", cfg.after_promotion_looks))
        window_s = float(policy.get("after_promotion_compare_s", cfg.after_promotion_compare_s))
        # The comparator is built (its known items read) only where a comparison can run.
        judged_by = policy if window_s > 0 else {"answer_comparison": "exact"}
        self.answers = AnswerWatch(
            settings,
            env,
            ledger=ledger,
            policy=answer_policy(policy, looks=looks),
            comparator=answer_comparator(
                settings,
                judged_by,
                commit=pol.source.commit if pol.source.kind == "committed" else None,
            ),
            window_s=window_s,
            sustain=int(policy.get("after_promotion_sustain", cfg.after_promotion_sustain)),
            policy_source={**pol.evidence()["source"], "where": pol.where},
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
        """Follow the after-promotion comparison (when one runs) into `tick`: roll back when
        its looks call for it (`AnswersCheck.rollback_due`; unless the tick's rules just
        did), end it at the window's end."""
        if tick.rollback is not None and tick.rollback.status == "rolled_back":
            return tick  # the rollback replaced the gateway's table, and its mirror
        check = self.answers.check(self.plan.release_id)
        if check is None:
            return tick
        tick.answers = check
        verdict = check.answers
        if check.rollback_due and verdict is not None and tick.rollback is None:
            check = write_answers_page(self.settings, check)
            tick.answers = check
            looks = f"{check.breaching_looks} breaching look(s) in a row, look {check.looks_done}"
            request = RollbackRequest(
                env=self.env,
                from_release=check.release_id,
                reason=f"answers after the promotion ({looks} of {check.looks}): {verdict.reason}",
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
    "after_promotion_looks",
    "after_promotion_sustain",
    *ANSWER_POLICY_FIELDS,
)
"""The policy fields the after-promotion comparison is judged by."""


def comparison_policy(settings: Settings, env: str) -> EnvironmentPolicy:
    """The environment's policy the after-promotion comparison is judged by, with its
    source; PolicyError when this command's settings change one of COMPARISON_FIELDS from
    the committed policy (a policy is changed by a commit, not for one watch)."""
    cfg = env_config(settings, env)
    pol = read_policy(settings, env, cfg)
    if set(pol.differs) & set(COMPARISON_FIELDS):
        environment_policy(settings, env, cfg)  # raises, naming the fields
    return pol


def open_service(settings: Settings, env: str, **kw: Any) -> WatchService:
    """A WatchService on the project's ledger (signing and anchoring as every command does).
    An adapter lane is refused in one line: the watch judges its environment's engine and
    gateway figures, which no lane has of its own."""
    if is_lane(env):
        raise ConfigError(
            f"{env} is an adapter lane: watch judges an environment's live release on its "
            "engine's and gateway's figures, which a lane shares with its environment",
            remedy=f"watch {parent_env(env)}; a lane goes back with `releasekit rollback {env}`",
        )
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


__all__ = [
    "COMPARISON_FIELDS",
    "DEFAULT_COOLDOWN_S",
    "RECEIVER_PATH",
    "AlertRulesResult",
    "RollbackImpl",
    "WatchPlan",
    "WatchService",
    "WatchSetupError",
    "WrittenAlertRules",
    "baseline_from_bench",
    "breach_record",
    "build_alert_rules",
    "comparison_policy",
    "known_good",
    "last_promotion_time",
    "last_rollback_time",
    "live_release_id",
    "metrics_urls",
    "open_service",
    "plan_watch",
    "read_baseline",
    "receiver_auth",
    "receiver_store_path",
    "release_rules",
    "rollback_adapter",
    "stop_on_signals",
    "watch_floor",
    "write_alert_rules",
]
