"""The watcher against a fault-injecting metrics server and a hand-moved clock: a sustained
breach rolls back exactly once with the breaching windows as evidence; bursty-but-healthy
traffic, restarts and scrape timeouts do not; cool-down and the no-known-good path."""

from __future__ import annotations

import threading
import time

import webclient
from watchkit import AppServer, FakeClock, FaultyMetrics, Sim

from releasekit.watch.rules import Rule
from releasekit.watch.watcher import (
    RollbackGuard,
    RollbackOutcome,
    RollbackRequest,
    RollbackTransientError,
    Watcher,
    WatchTarget,
)

TTFT = Rule(metric="ttft_p95_s", above=1.0, window_s=30, sustain=3, min_requests=20)
ERRORS = Rule(metric="error_rate", above=0.05, window_s=30, sustain=1, min_requests=20)


class FakeRollback:
    """The injected rollback path: records requests, moves the sim to the previous release."""

    def __init__(self, sim: Sim, *, fail_first: int = 0) -> None:
        self.sim = sim
        self.requests: list[RollbackRequest] = []
        self.fail_first = fail_first

    def __call__(self, req: RollbackRequest) -> RollbackOutcome:
        self.requests.append(req)
        if len(self.requests) <= self.fail_first:
            raise RollbackTransientError("ledger is locked")
        prev = "r0" if self.sim.release == "r1" else "r1"
        from_release = self.sim.release
        self.sim.release = prev
        return RollbackOutcome(
            status="rolled_back",
            env=req.env,
            from_release=from_release,
            to_release=prev,
            event_id=str(len(self.requests)),
        )


def watcher(
    url: str,
    clock: FakeClock,
    rollback: FakeRollback,
    rules: list[Rule],
    *,
    known_good: bool = True,
    cooldown_s: float = 600,
    timeout_s: float = 2.0,
) -> Watcher:
    return Watcher(
        WatchTarget(
            env="prod",
            release="r1",
            vllm_metrics_url=f"{url}/vllm/metrics",
            gateway_metrics_url=f"{url}/gateway/metrics",
        ),
        rules,
        rollback=rollback,
        has_known_good=lambda env: known_good,
        cooldown_s=cooldown_s,
        clock=clock,
        scrape_timeout_s=timeout_s,
    )


def step(w: Watcher, sim: Sim, clock: FakeClock, n: int, **kw: float | str) -> None:
    sim.serve(n, **kw)  # type: ignore[arg-type]
    clock.advance(30)
    w.tick()


def test_sustained_breach_rolls_back_once_with_windows_as_evidence(
    faulty: tuple[FaultyMetrics, str], sim: Sim, clock: FakeClock
) -> None:
    """Three breaching 30 s windows: one rollback, whose evidence is those three windows
    (gateway TTFT p95 above 1 s); more breaching windows in the cool-down do nothing."""
    _, url = faulty
    rb = FakeRollback(sim)
    w = watcher(url, clock, rb, [TTFT])
    assert w.tick().windows == []  # the first scrape only starts the windows
    for _ in range(3):
        step(w, sim, clock, 50, ttft=2.0)
    assert len(rb.requests) == 1
    req = rb.requests[0]
    assert (req.env, req.from_release, req.trigger) == ("prod", "r1", "watch")
    assert len(req.evidence) == 3
    for ev in req.evidence:
        assert ev.judgement.verdict == "breach"
        assert ev.window.figures["ttft_p95_s"].value > 1.0  # type: ignore[operator]
        assert ev.window.figures["ttft_p95_s"].source == "gateway"
        assert ev.window.requests == 50
    assert "ttft_p95_s" in req.reason
    assert w.target.release == "r0"
    for _ in range(4):  # the previous release regresses too: cool-down holds
        step(w, sim, clock, 50, ttft=2.0)
    assert len(rb.requests) == 1
    reg = w.registry
    assert (
        reg.get_sample_value(
            "releasekit_watch_rollbacks_total", {"env": "prod", "status": "rolled_back"}
        )
        == 1
    )
    assert (
        reg.get_sample_value(
            "releasekit_watch_rollbacks_total", {"env": "prod", "status": "cooling_down"}
        )
        == 2
    )
    assert (
        reg.get_sample_value(
            "releasekit_watch_windows_judged_total", {"env": "prod", "rule": TTFT.name}
        )
        == 7
    )
    assert (
        reg.get_sample_value("releasekit_watch_breaches_total", {"env": "prod", "rule": TTFT.name})
        == 7
    )


def test_bursty_but_healthy_traffic_is_not_rolled_back(
    faulty: tuple[FaultyMetrics, str], sim: Sim, clock: FakeClock
) -> None:
    """Bursts of fast requests, quiet windows with a few slow ones (too little traffic to
    judge) and a single slow window between healthy ones: no rollback."""
    _, url = faulty
    rb = FakeRollback(sim)
    w = watcher(url, clock, rb, [TTFT])
    w.tick()
    pattern = [(300, 0.1), (3, 4.0), (250, 0.2), (0, 0.0), (2, 6.0), (80, 2.0), (300, 0.1)]
    for n, ttft in pattern * 2:
        step(w, sim, clock, n, ttft=ttft)
    assert rb.requests == []
    nd = w.registry.get_sample_value(
        "releasekit_watch_windows_no_data_total", {"env": "prod", "rule": TTFT.name}
    )
    assert nd == 6


def test_restarts_of_vllm_and_gateway_are_not_regressions(
    faulty: tuple[FaultyMetrics, str], sim: Sim, clock: FakeClock
) -> None:
    """vLLM killed (scrapes fail, the gateway answers 502s), then restarted with its
    counters at zero, then the gateway restarted: no rollback even with sustain 1."""
    fm, url = faulty
    rb = FakeRollback(sim)
    w = watcher(url, clock, rb, [ERRORS, TTFT.model_copy(update={"sustain": 1})])
    w.tick()
    step(w, sim, clock, 100)
    fm.status["vllm"] = 503  # down
    sim.serve(20, status="502")
    clock.advance(30)
    t = w.tick()
    assert not t.scraped and "vllm" in t.scrape_errors
    sim.restart_vllm()
    fm.status.clear()
    sim.serve(40, ttft=3.0)  # cold start: slow first requests
    clock.advance(30)
    t = w.tick()
    assert t.windows and t.windows[0].reset == ["vllm"]
    assert {j.verdict for j in t.judgements} == {"no_data"}
    step(w, sim, clock, 100)
    sim.restart_gateway()
    step(w, sim, clock, 100)
    step(w, sim, clock, 100)
    assert rb.requests == []
    assert (
        w.registry.get_sample_value(
            "releasekit_watch_scrape_failures_total", {"env": "prod", "source": "vllm"}
        )
        == 1
    )


def test_scrape_timeout_is_a_failed_scrape_not_a_crash(
    faulty: tuple[FaultyMetrics, str], sim: Sim, clock: FakeClock
) -> None:
    """A /metrics that answers too late yields no window and counts a failure; the next
    window spans the gap and is judged."""
    fm, url = faulty
    rb = FakeRollback(sim)
    w = watcher(url, clock, rb, [TTFT], timeout_s=2.0)  # generous: the box may be busy
    w.tick()
    fm.delay_s["gateway"] = 6.0
    sim.serve(50)
    clock.advance(30)
    t = w.tick()
    assert not t.scraped and "timed out" in t.scrape_errors["gateway"]
    fm.delay_s.clear()
    sim.serve(50)
    clock.advance(30)
    t = w.tick()
    assert t.scraped and t.windows[0].duration_s == 60 and t.windows[0].requests == 100
    assert t.judgements[0].verdict == "pass"
    assert (
        w.registry.get_sample_value(
            "releasekit_watch_scrape_failures_total", {"env": "prod", "source": "gateway"}
        )
        == 1
    )


def test_cooldown_allows_one_rollback_then_another_after_it_ends(
    faulty: tuple[FaultyMetrics, str], sim: Sim, clock: FakeClock
) -> None:
    """Within the cool-down a new sustained breach is not rolled back; after it, it is."""
    _, url = faulty
    rb = FakeRollback(sim)
    fast = TTFT.model_copy(update={"sustain": 1})
    w = watcher(url, clock, rb, [fast], cooldown_s=120)
    w.tick()
    step(w, sim, clock, 50, ttft=2.0)
    assert len(rb.requests) == 1
    step(w, sim, clock, 50, ttft=2.0)
    step(w, sim, clock, 50, ttft=2.0)
    assert len(rb.requests) == 1
    clock.advance(120)
    step(w, sim, clock, 50, ttft=2.0)
    assert len(rb.requests) == 2
    assert rb.requests[1].from_release == "r0"


def test_no_known_good_release_records_instead_of_rolling_back(
    faulty: tuple[FaultyMetrics, str], sim: Sim, clock: FakeClock
) -> None:
    """With nothing known-good to go back to, the outcome says so and the rollback path
    is never called."""
    _, url = faulty
    rb = FakeRollback(sim)
    w = watcher(url, clock, rb, [TTFT], known_good=False)
    w.tick()
    outcomes = []
    for _ in range(3):
        sim.serve(50, ttft=2.0)
        clock.advance(30)
        t = w.tick()
        outcomes.append(t.rollback)
    assert rb.requests == []
    assert outcomes[2] is not None and outcomes[2].status == "no_known_good"
    assert w.states[TTFT.name].consecutive == 0  # a new sustained run is needed to ask again


def test_transient_rollback_failure_is_retried_next_window(
    faulty: tuple[FaultyMetrics, str], sim: Sim, clock: FakeClock
) -> None:
    """A rollback that raises is reported as failed and asked again on the next breach."""
    _, url = faulty
    rb = FakeRollback(sim, fail_first=1)
    w = watcher(url, clock, rb, [TTFT.model_copy(update={"sustain": 1})])
    w.tick()
    sim.serve(50, ttft=2.0)
    clock.advance(30)
    t = w.tick()
    assert t.rollback is not None and t.rollback.status == "failed"
    step(w, sim, clock, 50, ttft=2.0)
    assert len(rb.requests) == 2 and w.target.release == "r0"


def test_guard_is_shared_and_counts_rollbacks_done_elsewhere(clock: FakeClock) -> None:
    """A guard told of a recent rollback (e.g. from the ledger) refuses another."""
    calls: list[RollbackRequest] = []

    def rollback(req: RollbackRequest) -> RollbackOutcome:
        calls.append(req)
        return RollbackOutcome(status="rolled_back", env=req.env)

    guard = RollbackGuard(
        rollback,
        has_known_good=lambda env: True,
        cooldown_s=300,
        clock=clock,
        last_rollback_at=lambda env: clock() - 10 if env == "prod" else None,
    )
    req = RollbackRequest(env="prod", reason="x", trigger="alertmanager", requested_at=clock())
    assert guard(req).status == "cooling_down"
    assert guard(req.model_copy(update={"env": "staging"})).status == "rolled_back"
    assert len(calls) == 1


def test_a_promotion_after_the_last_rollback_ends_the_cooldown(clock: FakeClock) -> None:
    """The cool-down stops rollbacks chasing each other; a release promoted after the last
    rollback is rolled back at its first breach, and a second breach after that is held."""
    calls: list[RollbackRequest] = []

    def rollback(req: RollbackRequest) -> RollbackOutcome:
        calls.append(req)
        return RollbackOutcome(status="rolled_back", env=req.env)

    promoted: dict[str, float] = {}
    guard = RollbackGuard(
        rollback,
        has_known_good=lambda env: True,
        cooldown_s=900,
        clock=clock,
        last_rollback_at=lambda env: clock() - 600,  # a manual rollback 10 minutes ago
        last_promotion_at=promoted.get,
    )
    req = RollbackRequest(env="staging", reason="x", trigger="watch", requested_at=clock())
    assert guard(req).status == "cooling_down" and calls == []
    promoted["staging"] = clock() - 60  # a new release went live since
    assert guard(req).status == "rolled_back" and len(calls) == 1
    assert guard(req).status == "cooling_down" and len(calls) == 1  # its own rollback counts


def test_run_loop_and_own_metrics_endpoint(faulty: tuple[FaultyMetrics, str], sim: Sim) -> None:
    """run(stop_event) on the real clock rolls back a sustained breach once and keeps going;
    the watcher's own /metrics serves its counters."""
    _, url = faulty
    rb = FakeRollback(sim)
    rule = Rule(metric="ttft_p95_s", above=1.0, window_s=0.3, sustain=2, min_requests=5)
    w = Watcher(
        WatchTarget(env="prod", release="r1", vllm_metrics_url=f"{url}/vllm/metrics"),
        [rule],
        rollback=rb,
        has_known_good=lambda env: True,
    )
    stop = threading.Event()
    feeding = threading.Event()

    def feed() -> None:
        while not stop.is_set():
            sim.serve(5, ttft=2.0)
            feeding.set()
            time.sleep(0.05)

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    feeding.wait(5)
    seen: list[int] = []

    def on_tick(t: object) -> None:
        seen.append(1)
        if (rb.requests and len(seen) > 12) or len(seen) > 200:
            stop.set()

    summary = w.run(stop, on_tick=on_tick)
    feeder.join(timeout=5)
    assert len(rb.requests) == 1
    assert summary.rollbacks[0].status == "rolled_back"
    assert summary.windows_judged >= 2 and summary.breaches >= 2
    with AppServer(w.metrics_app()) as srv:
        text = webclient.get(srv.url + "/").text
    assert "releasekit_watch_windows_judged_total" in text
    assert "releasekit_watch_last_scrape_timestamp_seconds" in text
    w.close()


def test_run_once_takes_two_scrapes_one_window_apart(
    faulty: tuple[FaultyMetrics, str], sim: Sim, clock: FakeClock
) -> None:
    """`--once`: scrape, wait one window (injected sleep), scrape, judge every rule once."""
    _, url = faulty
    rb = FakeRollback(sim)
    w = watcher(url, clock, rb, [TTFT])

    def sleep(s: float) -> None:
        sim.serve(60, ttft=0.1)
        clock.advance(s)

    t = w.run_once(sleep=sleep)
    assert [j.verdict for j in t.judgements] == ["pass"]
    assert t.windows[0].requests == 60
