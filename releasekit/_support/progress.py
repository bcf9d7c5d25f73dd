"""The progress protocol, both ends: the callback type long work calls, and the one-line
marker a child process prints so its parent can turn it back into callback calls.

Core code calls `progress(label, done, total)` (`total == 0`: indeterminate). A child
process whose parent set `PROGRESS_ENV=lines` writes `marker_line(...)` on stdout; the
parent feeds every stdout line to `parse_marker`, which gives the call back or None for a
plain log line.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

Progress = Callable[[str, int, int], None]
"""`progress(label, done, total)`: what is being done and how far; total 0 = unknown."""

PROGRESS_ENV = "RELEASEKIT_PROGRESS"
"""Set to `lines` by a parent that reads progress markers from a child's stdout."""

PROGRESS_MARK = "@@releasekit-progress "


def no_progress(label: str, done: int, total: int) -> None:
    """A progress callback that ignores every call."""


def marker_line(label: str, done: int, total: int) -> str:
    """The stdout line (with newline) a child prints for one progress call."""
    return PROGRESS_MARK + json.dumps([label, done, total]) + "\n"


def is_marker(line: str) -> bool:
    """True when a stdout line is a progress marker rather than log output."""
    return line.startswith(PROGRESS_MARK)


def parse_marker(line: str) -> tuple[str, int, int] | None:
    """(label, done, total) of a marker line; None for a log line or a garbled marker."""
    if not is_marker(line):
        return None
    try:
        label, done, total = json.loads(line[len(PROGRESS_MARK) :])
        return str(label), int(done), int(total)
    except (ValueError, TypeError):
        return None


def emit_marker(label: str, done: int, total: int) -> None:
    """Print one progress marker on stdout (the child's end of the protocol)."""
    sys.stdout.write(marker_line(label, done, total))
    sys.stdout.flush()
