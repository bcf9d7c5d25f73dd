"""Progress for long work: bars on a terminal; in logs and CI one line per step when it
finishes, with its time, and a `still running` line now and then for a long quiet step."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from releasekit.cli._common import Reporter, progress_reporter


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _log_reporter(clock: Clock) -> tuple[Reporter, io.StringIO]:
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=False, width=200)
    return Reporter(console, quiet_s=30, every_s=60, clock=clock), buf


def test_logs_get_one_line_per_finished_step_with_its_time() -> None:
    """A counted step prints once, when its count reaches the total; a step of unknown
    length ends when the next step that is not part of it starts, or when the work ends.
    No start lines, no pairs."""
    clock = Clock()
    rep, buf = _log_reporter(clock)
    for done in range(0, 11):
        rep("core (run 1/2)", done, 10)
        clock.now += 1.2
    rep("starting vLLM", 0, 0)
    clock.now += 4.0
    rep("deploying", 0, 0)
    clock.now += 2.5
    rep.close()
    assert buf.getvalue().splitlines() == [
        "  core (run 1/2)  12.0 s",
        "  starting vLLM  4.0 s",
        "  deploying  2.5 s",
    ]


def test_the_parts_of_a_step_are_timed_into_its_one_line() -> None:
    """`evidence: warm-up` and `evidence: core` are parts of `evidence` (the text before
    ': ', as a bar is): nothing of their own is printed; the step's line names its longest
    part. A part's count reaching its total does not end the step."""
    clock = Clock()
    rep, buf = _log_reporter(clock)
    rep("evidence", 0, 0)
    rep("evidence: warm-up", 0, 0)
    clock.now += 3.0
    rep("evidence: core", 0, 10)
    clock.now += 9.0
    rep("evidence: core", 10, 10)
    rep("evidence: edge", 0, 4)
    clock.now += 2.0
    rep("evidence", 1, 1)
    assert buf.getvalue().splitlines() == ["  evidence  14.0 s (longest: core 9.0 s)"]


def test_status_labels_of_one_step_make_one_line() -> None:
    """A step that reports its status in the label (`canary step 1/2 at 25%: 4 canary /
    5 stable requests; ...`) is one line when the next step starts, however often it
    changed; a step of unknown length gives way to the next; one seen through a single part
    is named by it."""
    clock = Clock()
    rep, buf = _log_reporter(clock)
    rep("canary step 1/2 at 25%", 0, 0)
    for n in range(5):
        rep(f"canary step 1/2 at 25%: {n} canary / {n} stable requests; ttft_p95_s wait", 0, 0)
        clock.now += 2.0
    rep("canary step 2/2 at 50%: settling", 0, 0)
    clock.now += 1.0
    rep.close()
    assert buf.getvalue().splitlines() == [
        "  canary step 1/2 at 25%  10.0 s",
        "  canary step 2/2 at 50%: settling  1.0 s",  # seen through one part: named by it
    ]


def test_a_long_quiet_step_says_still_running_at_most_once_a_minute() -> None:
    """Nothing written for 30 s: one `still running` line; the next no sooner than 60 s on."""
    clock = Clock()
    rep, buf = _log_reporter(clock)
    rep("concurrency 4 (run 1/3)", 0, 10)
    for _ in range(100):  # 100 s of ticks, one a second
        clock.now += 1.0
        rep.tick()
    rep("concurrency 4 (run 1/3)", 10, 10)
    assert buf.getvalue().splitlines() == [
        "  concurrency 4 (run 1/3): still running (30 s)",
        "  concurrency 4 (run 1/3): still running (90 s)",
        "  concurrency 4 (run 1/3)  100.0 s",
    ]


def test_an_unfinished_counted_step_says_where_it_stopped() -> None:
    clock = Clock()
    rep, buf = _log_reporter(clock)
    rep("edge (run 1/2)", 3, 10)
    clock.now += 2.0
    rep.close()
    assert buf.getvalue().splitlines() == ["  edge (run 1/2)  2.0 s (stopped at 3/10)"]


def test_progress_reporter_writes_open_steps_when_the_block_ends() -> None:
    buf = io.StringIO()
    with progress_reporter(Console(file=buf, force_terminal=False, width=200), min_s=0) as rep:
        rep("checking gates", 0, 0)
    [line] = buf.getvalue().splitlines()
    assert line.startswith("  checking gates  ") and line.endswith(" s")


def test_json_mode_stays_silent() -> None:
    buf = io.StringIO()
    with progress_reporter(Console(file=buf, force_terminal=False), enabled=False) as rep:
        rep("bench: c=4", 1, 2)
    assert buf.getvalue() == ""


def test_a_step_over_in_a_moment_is_not_written() -> None:
    """Steps shorter than min_s (a lookup, a cached stage) leave no line; longer ones do."""
    clock = Clock()
    buf = io.StringIO()
    rep = Reporter(Console(file=buf, force_terminal=False, width=200), min_s=2.0, clock=clock)
    rep("prepare", 0, 1)
    clock.now += 0.5
    rep("prepare", 1, 1)
    rep("evidence", 0, 1)
    clock.now += 95.0
    rep("evidence", 1, 1)
    assert buf.getvalue().splitlines() == ["  evidence  95.0 s"]


def test_a_build_reports_its_overall_count_once_per_change() -> None:
    """DVC's output ends a stage and then updates the lock file: both end in the watcher's
    count, which is said once (build 1/1, not 1/1 twice)."""
    import io

    from releasekit.build.dvc import _ReproWatcher

    calls: list[tuple[str, int, int]] = []
    watcher = _ReproWatcher(["demo-x"], lambda *c: calls.append(c), io.StringIO())
    watcher.line("Running stage 'demo-x':")
    watcher.line("Updating lock file 'dvc.lock'")
    watcher.line("Use `dvc push` to send your updates to remote storage.")
    builds = [c for c in calls if c[0] == "build"]
    assert builds == [("build", 0, 1), ("build", 1, 1)]


def test_a_build_line_names_each_stage_by_its_kind_with_its_time_and_longest_part(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The release line of a build says what each stage took and where most of its time went
    (a part's runs add up: `core (run 1/2)` and `core (run 2/2)` are one part), so a log needs
    no line per stage."""
    import io

    from releasekit._support.progress import marker_line
    from releasekit.build import dvc
    from releasekit.build.pipeline import BuildResult

    now = [100.0]
    monkeypatch.setattr(dvc.time, "monotonic", lambda: now[0])
    watcher = dvc._ReproWatcher(["demo-x-evidence"], lambda *c: None, io.StringIO())
    watcher.line("Running stage 'demo-x-evidence':")
    for label, took in (("starting vLLM", 30), ("core (run 1/2)", 20), ("core (run 2/2)", 25)):
        watcher.line(marker_line(label, 0, 0))
        now[0] += took
    watcher.line("Updating lock file 'dvc.lock'")
    watcher.close()
    (run,) = watcher.runs.values()
    assert run.seconds == 75 and run.longest == "core 45.0 s"
    res = BuildResult(
        manifest="manifests/demo-x.yaml",
        name="demo-x",
        release_id="a" * 64,
        release_dir="results/a",
        stages=[run],
        up_to_date=False,
        seconds=80,
        log_path="x.log",
    )
    assert res.summary == "ran evidence 75 s (longest: core 45.0 s)"


def test_step_lines_off_leaves_only_still_running() -> None:
    """A caller that writes each step's time itself (the build's release line) turns step
    lines off: a finished step writes nothing, a long quiet one still says it runs."""
    buf = io.StringIO()
    clock = Clock()
    rep = Reporter(
        Console(file=buf, width=200), quiet_s=10, every_s=10, step_lines=False, clock=clock
    )
    rep("evidence: starting vLLM", 0, 0)
    clock.now += 30
    rep.tick()
    rep("evidence: core", 0, 0)
    clock.now += 30
    rep.close()
    assert buf.getvalue().splitlines() == ["  evidence: still running (30 s; now starting vLLM)"]
