"""The canary step loop's decision rule on scripted judgements: passing a step needs as many
clean judgements in a row as aborting it needs breaching ones (`sustain`)."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from gateway_fakes import FakeGateway, stubbed_context

import releasekit.rollout.canary as canary_mod
from releasekit.rollout.canary import CanaryController, Scrape
from releasekit.rollout.judge import CheckResult, ReleaseWindows, StepJudgement
from releasekit.spec.manifest import Canary, CanaryCheck, CanaryStep
from releasekit.watch.windows import Exposition, Window

SUSTAIN = 3


def _check(metric: str, verdict: str, *, required: bool = True) -> CheckResult:
    return CheckResult(
        metric=metric,
        verdict=verdict,  # type: ignore[arg-type]
        required=required,
        canary=0.5,
        stable=0.4,
        limit=0.65,
        canary_count=30,
        stable_count=90,
        reason=f"scripted {verdict}",
        window_start=0.0,
        window_end=1.0,
    )


def _judgement(ttft: str, feedback: str = "wait") -> StepJudgement:
    return StepJudgement(
        window_start=0.0,
        window_end=1.0,
        canary_requests=30,
        stable_requests=90,
        checks=[
            _check("ttft_p95_s", ttft),
            _check("negative_feedback_rate", feedback, required=False),
        ],
    )


class Scripted(CanaryController):
    """A controller whose judgements come from a script instead of live windows."""

    def __init__(self, script: list[StepJudgement]) -> None:
        policy = Canary(
            steps=[
                CanaryStep(weight=50, min_duration_s=0, min_requests=0, max_duration_s=3600),
                CanaryStep(weight=100),
            ],
            checks=[
                CanaryCheck(metric="ttft_p95_s"),
                CanaryCheck(metric="negative_feedback_rate", min_samples=10, required=False),
            ],
            sustain=SUSTAIN,
            warmup_requests=0,
            settle_s=0,
        )
        ctx = stubbed_context()
        super().__init__(policy, ctx, lease_s=3600, sleep=lambda s: None)
        self.gateway = FakeGateway()
        self.script: Iterator[StepJudgement] = iter(script)
        self.judged = 0
        self.now = 0.0  # each snapshot one second after the last
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
        w = Window(start=0.0, end=1.0, duration_s=1.0)
        return ReleaseWindows(release_id="can", edge=w), ReleaseWindows(release_id="stb", edge=w)


@pytest.fixture
def scripted(monkeypatch: pytest.MonkeyPatch) -> Any:
    def make(script: list[StepJudgement]) -> Scripted:
        ctrl = Scripted(script)

        def judge_step(*args: Any) -> StepJudgement:
            ctrl.judged += 1
            return next(ctrl.script)

        monkeypatch.setattr(canary_mod, "judge_step", judge_step)
        return ctrl

    return make


def test_a_step_passes_only_after_sustain_clean_judgements_in_a_row(scripted: Any) -> None:
    """With `sustain: 3` one clean judgement does not pass the step: a breach starts the
    run again, a judgement whose required check still waits leaves it, and the step passes
    on the third clean judgement in a row (each a pass of every required check)."""
    script = [
        _judgement("pass"),
        _judgement("pass"),
        _judgement("breach"),
        _judgement("pass"),
        _judgement("wait"),
        _judgement("pass"),
        _judgement("pass", feedback="not_measured"),
        _judgement("pass"),  # never reached
    ]
    ctrl = scripted(script)
    run = ctrl.run()
    assert run.outcome == "passed", run.reason
    assert ctrl.judged == 7
    [step] = run.steps
    assert step.status == "passed" and step.clean_judgements == SUSTAIN
    progress = [ln for ln in ctrl.lines if "canary /" in ln]
    assert [ln.rsplit("clean ", 1)[1][:3] for ln in progress] == [
        "1/3", "2/3", "0/3", "1/3", "1/3", "2/3", "3/3",
    ]  # fmt: skip
    assert "ttft_p95_s breached 1/3" in progress[2]


def test_a_step_aborts_after_sustain_breaching_judgements_in_a_row(scripted: Any) -> None:
    """The same count the other way: three breaches in a row, then the breach held over a
    disjoint window as long as the one that breached (6 s here: 6 judgements of 1 s),
    abort; a pass between them starts the count again."""
    script = [_judgement(v) for v in ("breach", "breach", "pass", "breach", "breach", "breach")]
    ctrl = scripted(script + [_judgement("breach")] * 6)
    run = ctrl.run()
    assert run.outcome == "breached" and ctrl.judged == 12
    [b] = run.breaches
    assert b.metric == "ttft_p95_s" and len(b.judgements) == SUSTAIN
    assert b.confirmed_by is not None and b.confirmed_by.verdict == "breach"


def test_one_clean_judgement_then_nothing_decided_is_not_a_pass(
    scripted: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step that got one clean judgement and then only waiting ones never passes on it:
    it ends as insufficient evidence at max_duration_s, saying how many clean judgements
    in a row it had and how many it needed."""
    ctrl = scripted([_judgement("pass"), *[_judgement("wait")] * 10])
    steps = ctrl.policy.steps
    ctrl.policy = ctrl.policy.model_copy(
        update={"steps": [steps[0].model_copy(update={"max_duration_s": 4.0}), steps[1]]}
    )
    clock = iter(range(1000))  # one second a reading: the step's time without waiting
    monkeypatch.setattr(canary_mod, "time", SimpleNamespace(time=lambda: float(next(clock))))
    run = ctrl.run()
    assert run.outcome == "insufficient" and 1 < ctrl.judged < 10
    assert "1 clean judgement(s) in a row (need 3)" in run.reason


def test_an_interrupted_canarys_fresh_baseline_is_stopped(tmp_path: Any) -> None:
    """A promote that died mid-canary leaves its fresh baseline server running, unrouted
    (the lease put traffic back on the live servers): whoever records the interrupted
    canary stops it."""
    import subprocess
    import sys

    from releasekit.deploy.state import proc_start_time
    from releasekit.rollout.progressive import record_interrupted
    from releasekit.rollout.state import HeldServer, read_rollout, write_rollout

    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True
    )
    try:
        settings: Any = SimpleNamespace(state_dir=tmp_path, server_stop_grace_s=5.0)
        base = HeldServer(
            pid=proc.pid, proc_start=proc_start_time(proc.pid), release_id="stb:baseline"
        )
        write_rollout(settings, env="staging", release_id="can", stable_release_id="stb",
                      step=0, steps=1, weight=20, baseline=base)  # fmt: skip
        st = read_rollout(settings, "staging")
        assert st is not None and st.baseline == base

        class Led:
            def __init__(self) -> None:
                self.events: list[Any] = []

            def append(self, event: Any) -> Any:
                self.events.append(event)
                return SimpleNamespace(seq=len(self.events))

        led = Led()
        record_interrupted(settings, st, ledger=led)  # type: ignore[arg-type]
        assert proc.wait(timeout=30) is not None
        assert led.events[0].type == "canary_aborted"
        assert read_rollout(settings, "staging") is None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
