"""Progress for long work: bars on a terminal, one line per step in logs and CI."""

from __future__ import annotations

import io

from rich.console import Console

from releasekit.cli._common import progress_reporter


def test_logs_get_one_line_per_step_started_and_finished() -> None:
    buf = io.StringIO()
    with progress_reporter(Console(file=buf, force_terminal=False, width=200)) as rep:
        for done in range(0, 11):
            rep("eval: core", done, 10)
        rep("starting vLLM", 0, 0)
    assert buf.getvalue().splitlines() == [
        "...  eval: core",
        "done  eval: core",
        "...  starting vLLM",
    ]


def test_json_mode_stays_silent() -> None:
    buf = io.StringIO()
    with progress_reporter(Console(file=buf, force_terminal=False), enabled=False) as rep:
        rep("bench: c=4", 1, 2)
    assert buf.getvalue() == ""
