"""A canary's breach must hold past a fresh server's start-up: `sustain` breaching
judgements in a row abort only once the breach holds over a disjoint window judged on its
own; a breach that does not hold is kept as `unconfirmed` and the step goes on. And adapter
lanes' routes ride along a canary's tables untouched."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from gateway_fakes import FakeGateway, stubbed_context
from promote_kit import Kit, Streamer
from test_canary_flow import _canary_under_two_streams, canary_block, candidate, ckit

import releasekit.rollout.canary as canary_mod
from releasekit.audit.replay import replay
from releasekit.deploy.gateway import Route
from releasekit.rollout.canary import CanaryController, Scrape, split_routes
from releasekit.rollout.judge import CheckResult, ReleaseWindows, StepJudgement
from releasekit.rollout.progressive import _run_evidence, promote_progressive
from releasekit.spec.manifest import Canary, CanaryCheck, CanaryStep
from releasekit.stores.ledger import Event, EventType, Ledger, open_ledger
from releasekit.watch.windows import Exposition, Window

__all__ = ["ckit"]

SUSTAIN = 3


def _judgement(ttft: str, at: float = 1.0) -> StepJudgement:
    over = ttft == "over"  # passed only because its excess is not significant yet
    check = CheckResult(
        metric="ttft_p95_s",
        verdict="pass" if over else ttft,  # type: ignore[arg-type]
        required=True,
        canary=0.5 if ttft == "breach" else 0.15 if over else 0.05,
        stable=0.04,
        limit=0.1,
        canary_count=30,
        stable_count=90,
        reason=f"scripted {ttft}",
        window_start=0.0,
        window_end=at,
    )
    return StepJudgement(
        window_start=0.0, window_end=at, canary_requests=30, stable_requests=90, checks=[check]
    )


class Scripted(CanaryController):
    """A controller whose judgements come from a script; each snapshot one second after
    the last, and each window judged is kept as (start, end)."""

    def __init__(self, script: list[str], *, max_duration_s: float = 3600) -> None:
        policy = Canary(
            steps=[
                CanaryStep(
                    weight=50, min_duration_s=0, min_requests=0, max_duration_s=max_duration_s
                ),
                CanaryStep(weight=100),
            ],
            checks=[CanaryCheck(metric="ttft_p95_s")],
            sustain=SUSTAIN,
            interval_s=1.0,
            warmup_requests=0,
            settle_s=0,
        )
        super().__init__(policy, stubbed_context(), lease_s=3600, sleep=lambda s: None)
        self.gateway = FakeGateway()
        self.script: Iterator[str] = iter(script)
        self.judged = 0
        self.now = 0.0
        self.windows_judged: list[tuple[float, float]] = []
        self.lines: list[str] = []
        self.say = lambda label, done, total: self.lines.append(label)

    def _client(self) -> Any:
        return self.gateway

    def snapshot(self) -> Scrape:
        empty = Exposition(samples={}, monotonic=frozenset(), created={}, families=frozenset())
        self.now += 1.0
        return Scrape(self.now, empty, None, None, {})

    def windows(self, before: Scrape, after: Scrape) -> tuple[ReleaseWindows, ReleaseWindows]:
        self.windows_judged.append((before.at, after.at))
        w = Window(start=before.at, end=after.at, duration_s=after.at - before.at)
        return ReleaseWindows(release_id="can", edge=w), ReleaseWindows(release_id="stb", edge=w)


@pytest.fixture
def scripted(monkeypatch: pytest.MonkeyPatch) -> Any:
    def make(script: list[str], **kw: Any) -> Scripted:
        ctrl = Scripted(script, **kw)

        def judge_step(checks: Any, cw: ReleaseWindows, sw: ReleaseWindows) -> StepJudgement:
            ctrl.judged += 1
            j = _judgement(next(ctrl.script), at=cw.edge.end)
            for c in j.checks:
                c.window_start = cw.edge.start
            return j.model_copy(update={"window_start": cw.edge.start})

        monkeypatch.setattr(canary_mod, "judge_step", judge_step)
        return ctrl

    return make


def test_a_breach_only_at_start_is_unconfirmed_and_the_step_goes_on(scripted: Any) -> None:
    """Three breaches in a row over the step so far (a fresh server's start-up), then a
    disjoint window from a fresh snapshot, as long as the breaching one, passes: no abort;
    the step is judged from that window's start on and passes on three clean judgements,
    with the first breach kept as `unconfirmed` and said once."""
    # Judged: 3 breaching (window 1 -> 4: 3 s), then 3 of the disjoint window (5 -> 8).
    ctrl = scripted(["breach"] * 3 + ["pass"] * 5)
    run = ctrl.run()
    assert run.outcome == "passed", run.reason
    assert run.breaches == []
    [step] = run.steps
    assert step.status == "passed" and step.clean_judgements == SUSTAIN
    assert step.unconfirmed is not None
    assert [c.verdict for c in step.unconfirmed.checks] == ["breach"]
    breach_end = step.unconfirmed.window_end
    assert ctrl.windows_judged[:3] == [(1.0, 2.0), (1.0, 3.0), (1.0, 4.0)]
    # The disjoint window starts at a fresh snapshot, after the breaching window ended.
    assert all(start > breach_end for start, _ in ctrl.windows_judged[3:])
    assert step.judgement is not None and step.judgement.window_start > breach_end
    said = [ln for ln in ctrl.lines if "not confirmed" in ln]
    assert len(said) == 1 and "ttft_p95_s breached over the first 3 s" in said[0]
    assert any("confirming over the next 3 s" in ln for ln in ctrl.lines)
    # The step's evidence holds it (the run's rows; a canary_step event the same).
    ev = _run_evidence(run, {}, sustain=SUSTAIN)
    row = ev["steps"][0]["unconfirmed_breach"]
    assert row["breached"] == ["ttft_p95_s"] and row["window"] == [1.0, breach_end]


def test_a_window_over_the_limit_but_not_yet_significant_does_not_clear_a_breach(
    scripted: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A release slow throughout whose disjoint window, on fewer samples, is over the limit
    without significance yet: that clears nothing. The window goes on; its breach then
    confirms the first one and the canary aborts; with no breach by max_duration_s the
    first breach stands."""
    ctrl = scripted(["breach"] * 3 + ["over"] * 4 + ["breach"] + ["pass"] * 5)
    run = ctrl.run()
    assert run.outcome == "breached" and run.steps[0].unconfirmed is None
    [b] = run.breaches
    assert b.confirmed_by is not None and b.confirmed_by.verdict == "breach"
    ctrl = scripted(["breach"] * 3 + ["over"] * 50, max_duration_s=30)
    clock = iter(range(1000))
    monkeypatch.setattr(canary_mod.time, "time", lambda: float(next(clock)))
    run = ctrl.run()
    assert run.outcome == "breached"
    [b] = run.breaches
    assert b.confirmed_by is None and "did not show it within its limit" in b.stands


def test_a_canary_slow_throughout_still_aborts(scripted: Any) -> None:
    """The breach holds over the disjoint window too: abort, the breaching run and the
    confirming window both recorded, under the rule that decided it."""
    ctrl = scripted(["breach"] * 20)
    run = ctrl.run()
    assert run.outcome == "breached" and ctrl.judged == 6
    [b] = run.breaches
    assert len(b.judgements) == SUSTAIN and b.stands == ""
    assert b.confirmed_by is not None and b.confirmed_by.verdict == "breach"
    assert b.confirmed_by.window_start > b.judgements[-1].window_end
    assert "held over a disjoint 3 s window" in run.reason
    ev = _run_evidence(run, {}, sustain=SUSTAIN)
    assert ev["breach_rule"] == "sustain+disjoint"
    [rec] = ev["breaches"]
    assert len(rec["windows"]) == SUSTAIN and rec["confirmed_by"]["verdict"] == "breach"
    assert "unconfirmed_breach" not in ev["steps"][0]


def test_a_breach_with_no_time_left_in_the_step_stands(
    scripted: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A breach that becomes sustained with less of `max_duration_s` left than the
    disjoint window needs aborts at once, saying so."""
    ctrl = scripted(["breach"] * 20, max_duration_s=4.5)
    clock = iter(range(1000))  # one second a reading
    monkeypatch.setattr(canary_mod.time, "time", lambda: float(next(clock)))
    run = ctrl.run()
    assert run.outcome == "breached" and ctrl.judged == SUSTAIN
    [b] = run.breaches
    assert b.confirmed_by is None and "no time left" in b.stands


def test_a_second_sustained_breach_in_a_step_stands(scripted: Any) -> None:
    """A step asks a disjoint window once: after its first breach went unconfirmed, a
    later sustained breach in it aborts at once."""
    ctrl = scripted(["breach"] * 3 + ["pass"] * 3 + ["breach"] * 3 + ["pass"] * 10)
    ctrl.policy = ctrl.policy.model_copy(update={"steps": [
        ctrl.policy.steps[0].model_copy(update={"min_duration_s": 1e6}), ctrl.policy.steps[1]
    ]})  # fmt: skip
    run = ctrl.run()
    assert run.outcome == "breached" and ctrl.judged == 9
    [step] = run.steps
    assert step.unconfirmed is not None
    [b] = run.breaches
    assert b.confirmed_by is None and "first breach already" in b.stands


def test_a_disjoint_window_without_a_verdict_waits_then_the_breach_stands(
    scripted: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disjoint window still waiting for samples at its span goes on; by
    `max_duration_s` without a verdict the breach stands."""
    ctrl = scripted(["breach"] * 3 + ["wait"] * 50, max_duration_s=30)
    clock = iter(range(1000))
    monkeypatch.setattr(canary_mod.time, "time", lambda: float(next(clock)))
    run = ctrl.run()
    assert run.outcome == "breached"
    [b] = run.breaches
    assert b.confirmed_by is None and "did not show it within its limit" in b.stands


# -- lanes


def _lane(name: str, weight: float = 1.0) -> Route:
    return Route(
        release_id=f"{name}-rel",
        base_url="http://127.0.0.1:11",
        weight=weight,
        model="demo",
        lane=name,
        adapters={name: f"{name}@0123456789ab"},
    )


def test_split_routes_carries_lane_routes_unchanged() -> None:
    """Adapter lanes' routes keep their weight and take no part of stable's share: the
    base's routes share what the canary leaves, lanes aside."""
    a, b = Route(release_id="a", base_url="http://127.0.0.1:11", weight=3), _lane("json", 7)
    c = Route(release_id="c", base_url="http://127.0.0.1:12", weight=1)
    can = Route(release_id="can", base_url="http://127.0.0.1:10")
    out = {r.release_id: r for r in split_routes([a, b, c], can, 20)}
    assert out["json-rel"] == b  # untouched, weight 7
    assert out["a"].weight == pytest.approx(60) and out["c"].weight == pytest.approx(20)
    assert out["can"].weight == 20
    base = Route(release_id="base", base_url="http://127.0.0.1:13")
    out = {r.release_id: r for r in split_routes([a, b], can, 10, base)}
    assert out["a"].weight == pytest.approx(80) and out["json-rel"].weight == 7


def test_the_compared_stable_route_is_never_a_lane_route() -> None:
    """stable_primary (the route judged as stable and the mirror's target) is chosen among
    the base's routes, even where a lane's route weighs more; going back to stable keeps
    the lanes' routes."""
    plain = stubbed_context()
    ctx = replace(plain, stable=[_lane("json", 50), *plain.stable])
    ctrl = CanaryController(Canary(steps=[CanaryStep(weight=100)]), ctx, lease_s=60)
    assert ctrl.stable_primary.release_id == "stb" and ctrl.compared.release_id == "stb"
    gw = FakeGateway()
    ctrl._set_weight(gw, 25)  # type: ignore[arg-type]
    ctrl._to_stable(gw)  # type: ignore[arg-type]
    table, back = gw.tables
    assert {r.release_id: r.weight for r in table.routes} == {
        "json-rel": 50, "stb": 75, "can": 25,
    }  # fmt: skip
    assert [r.release_id for r in back.routes] == ["json-rel", "stb"]
    assert back.routes[0].lane == "json"


# -- on the stand-in engine


STEPS = (
    "      - {weight: 25, min_duration_s: 1, min_requests: 4, max_duration_s: 120}\n"
    "      - {weight: 100}\n"
)
CHECKS = "      - {metric: ttft_p95_s, tolerance: 0.5, slack: 0.1, min_samples: 10}\n"


def test_a_canary_slow_only_at_start_is_promoted_with_an_unconfirmed_breach(
    ckit: Kit, tmp_path: Path
) -> None:
    """A canary whose stand-in engine is slow only at first (FAKE_SLOW_WHILE: its start-up)
    breaches TTFT `sustain` judgements in a row; the start-up ends as the disjoint window
    starts, the window passes, and the release is promoted, its `canary_step` event holding
    the first breach as `unconfirmed_breach`, which replays the same."""
    old = ckit.build("demo-bf16")
    assert promote_progressive(ckit.settings, old, env="staging", reason="base").ok
    flag = tmp_path / "slow-at-start"
    flag.touch()
    new = candidate(
        ckit,
        "demo-canary-slow-start",
        seqs=1,
        env_line=f'    FAKE_CHUNK_DELAY_S: "0.4"\n    FAKE_SLOW_WHILE: "{flag}"',
        promotion=canary_block(STEPS, CHECKS),
    )
    lines: list[str] = []

    def seen(label: str, done: int, total: int) -> None:
        lines.append(label)
        if "confirming over the next" in label:
            flag.unlink(missing_ok=True)  # the start-up ends as the disjoint window starts

    res, s1, s2 = _canary_under_two_streams(ckit, new, seen)
    assert not flag.exists(), "the canary never breached at start: " + " | ".join(lines[-5:])
    assert res.status == "promoted", res.deploy and res.deploy.failure
    assert s1.failures == [] and s2.failures == []
    assert res.canary is not None and res.canary["breaches"] == []
    [step] = res.canary["steps"]
    assert step["unconfirmed"] is not None
    assert len([ln for ln in lines if "not confirmed" in ln]) == 1
    [ev] = Ledger(ckit.settings.ledger_url or "").records(types=["canary_step"])
    assert ev.evidence["unconfirmed_breach"]["breached"] == ["ttft_p95_s"]
    first_end = ev.evidence["unconfirmed_breach"]["window"][1]
    assert ev.evidence["judge"]["canary"]["edge"]["start"] > first_end
    out = replay(ckit.settings, str(ev.seq))
    assert out.same, [c for c in out.decisions[0].checks if c.status != "same"]


def test_an_aborts_record_replays_the_same_with_and_without_the_rule(ckit: Kit) -> None:
    """A canary slow throughout aborts on a breach its disjoint window confirmed; the
    `canary_aborted` event replays the same, and so does the same record as it was
    written before the rule (no `breach_rule`, no `confirmed_by`)."""
    old = ckit.build("demo-bf16")
    assert promote_progressive(ckit.settings, old, env="staging", reason="base").ok
    slow = candidate(
        ckit,
        "demo-canary-slow",
        seqs=1,
        env_line='    FAKE_CHUNK_DELAY_S: "0.4"',
        promotion=canary_block(STEPS, CHECKS),
    )
    with (
        Streamer(ckit.gateway("staging"), chunks=3) as s1,
        Streamer(ckit.gateway("staging"), chunks=3),
    ):
        s1.wait_for(2)
        res = promote_progressive(ckit.settings, slow, env="staging", reason="canary")
    assert res.status == "canary_aborted" and res.canary is not None, res.deploy
    [ab] = Ledger(ckit.settings.ledger_url or "").records(types=["canary_aborted"])
    assert ab.evidence["breach_rule"] == "sustain+disjoint"
    [b] = ab.evidence["breaches"]
    assert b["confirmed_by"]["verdict"] == "breach" and len(b["windows"]) == 2
    assert b["confirmed_by"]["start"] > b["windows"][-1]["end"]
    out = replay(ckit.settings, str(ab.seq))
    assert out.same, [c for c in out.decisions[0].checks if c.status != "same"]
    before_rule = {k: v for k, v in ab.evidence.items() if k != "breach_rule"}
    before_rule["breaches"] = [
        {k: v for k, v in x.items() if k not in ("confirmed_by", "stands")}
        for x in ab.evidence["breaches"]
    ]
    led = open_ledger(ckit.settings)
    older = led.append(
        Event(
            type=EventType.CANARY_ABORTED,
            environment="staging",
            from_release=old,
            to_release=slow,
            reason=ab.reason,
            evidence=before_rule,
            live=False,
        )
    )
    led.close()
    again = replay(ckit.settings, str(older.seq))
    assert again.same, [c for c in again.decisions[0].checks if c.status != "same"]
    held = [c for c in out.decisions[0].checks if "held past its window" in c.name]
    assert len(held) == 1 and held[0].status == "same"
    # A record that claims the rule but holds no confirming window (nor why it stood) is
    # not what the rule decides: replay says so.
    unconfirmed = {**ab.evidence, "breaches": before_rule["breaches"]}
    led = open_ledger(ckit.settings)
    claimed = led.append(
        Event(
            type=EventType.CANARY_ABORTED,
            environment="staging",
            from_release=old,
            to_release=slow,
            reason=ab.reason,
            evidence=unconfirmed,
            live=False,
        )
    )
    led.close()
    bad = replay(ckit.settings, str(claimed.seq))
    assert [c.name for c in bad.decisions[0].checks if c.status == "different"] == [
        f"breach of {b['metric']} held past its window"
    ]


def test_a_step_whose_figure_is_over_the_limit_never_passes_on_it(
    scripted: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Judgements that pass only because the excess over the limit is not significant yet
    are not clean: the step needs as much evidence to pass as to abort, so it never passes
    on them and ends at max_duration_s without promoting (seen in a full demo run: the
    max-num-seqs 1 release at TTFT p95 0.63 s against stable's 0.415 s, limit 0.62)."""
    ctrl = scripted(["over"] * 60, max_duration_s=30)
    clock = iter(range(1000))
    monkeypatch.setattr(canary_mod.time, "time", lambda: float(next(clock)))
    run = ctrl.run()
    assert run.outcome != "passed"
    [step] = run.steps
    assert step.status != "passed" and step.clean_judgements == 0
