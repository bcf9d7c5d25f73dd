"""The watch over a real deployment: the deploy tests' promote and rollback on the local target
(real gateway processes, the stand-in vLLM of tests/deploy/promote_fake_vllm.py, a real
embedded MLflow store and ledger). Everything the watch uses is composed from settings:
the ledger's live release, its manifest's watch rules, the deploy state's URLs (the
gateway's edge histograms carry the latency). Only the windows' clock is moved by hand,
after real requests have gone through the gateway."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "deploy"))  # the deploy tests' fixtures (promote_kit.py)

from promote_kit import Kit, Streamer, kit  # noqa: E402
from watchkit import FakeClock  # noqa: E402

from releasekit.promote.promote import marked_bad, promote  # noqa: E402
from releasekit.stores.ledger import EventType, open_ledger  # noqa: E402
from releasekit.watch.service import WatchService  # noqa: E402

__all__ = ["kit"]

ENV = "staging"
DEMO_WATCH = """watch:
  - {metric: ttft_p95_s, max: 2.0, window_s: 15, sustain: 3}
  - {metric: error_rate, max: 0.05, window_s: 15, sustain: 2}"""
WATCH = """watch:
  - {metric: e2e_p95_s, max: 0.3, window_s: 15, sustain: 3}
  - {metric: error_rate, max: 0.05, window_s: 15, sustain: 2}"""
SLOW = 'VLLM_CPU_KVCACHE_SPACE: "1"\n    FAKE_CHUNK_DELAY_S: "0.1"'


def _window(streamers: list[Streamer], clock: FakeClock, svc: WatchService, n: int) -> None:
    for s in streamers:
        s.wait_for(n, timeout_s=60)
    clock.advance(15)
    svc.watcher.tick()


def test_watch_rolls_back_a_promoted_regression_through_the_real_rollback(kit: Kit) -> None:
    """good then slow (5-chunk streams at 0.1 s a chunk: E2E p95 about 0.5 s > 0.3 s) are
    promoted to staging; under steady load through the gateway, three breaching windows of
    slow make the watch call the real rollback once: the gateway answers from good again,
    the ledger's live event is a `rollback` by releasekit-watch holding the breaching
    windows, slow is marked bad, and the watch follows good on its warm server."""
    kit.variant("demo-bf16", "demo-good", {DEMO_WATCH: WATCH})
    kit.variant("demo-bf16", "demo-slow", {DEMO_WATCH: WATCH, 'VLLM_CPU_KVCACHE_SPACE: "1"': SLOW})
    good = kit.build("demo-good")
    assert promote(kit.settings, good, env=ENV).status == "promoted"
    slow = kit.build("demo-slow")
    assert promote(kit.settings, slow, env=ENV).status == "promoted"
    led = open_ledger(kit.settings)
    clock = FakeClock()
    svc = WatchService(kit.settings, ENV, ledger=led, clock=clock, include_slo=False)
    try:
        assert svc.plan.release_id == slow
        streamers = [Streamer(kit.gateway(ENV), chunks=5) for _ in range(4)]
        for s in streamers:
            s.__enter__()
        try:
            for s in streamers:
                s.wait_for(1, timeout_s=60)
            svc.watcher.tick()  # starts the windows
            for _ in range(3):
                _window(streamers, clock, svc, 6)
            _window(streamers, clock, svc, 6)  # served by good now; the watch follows it
        finally:
            for s in streamers:
                s.__exit__(None, None, None)
        rollbacks = led.records(environment=ENV, types=[EventType.ROLLBACK.value])
        assert len(rollbacks) == 1
        ev = rollbacks[0]
        assert (ev.from_release, ev.to_release, ev.actor) == (slow, good, "releasekit-watch")
        assert led.live_at(ENV).to_release == good  # type: ignore[union-attr]
        breaches = [b for b in ev.evidence["breaches"] if b["judgement"]["rule"].startswith("e2e")]
        assert len(breaches) == 3
        for b in breaches:
            fig = b["window"]["figures"]["e2e_p95_s"]
            assert fig["source"] == "gateway" and fig["value"] > 0.3
            assert b["window"]["release"] == slow
        assert marked_bad(led, slow) is not None
        assert svc.plan.release_id == good and svc.followed == [slow, good]
        assert all(s.failures == [] for s in streamers)
        assert good in {r for s in streamers for r in s.releases[-3:]}  # good answers again
    finally:
        svc.close()
        led.close()
