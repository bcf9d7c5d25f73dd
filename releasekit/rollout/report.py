"""The shadow comparison as a self-contained HTML page, written beside its JSON copy: the
verdict, the answers' agreement with its interval, the live figures' checks, and the
disagreeing pairs side by side (`promote.report`'s templates, in the gate report's
style). Every text from a request or an answer is HTML-escaped."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import TYPE_CHECKING

from releasekit._support.files import write_atomic
from releasekit._support.html import Templates
from releasekit.promote.report import TEMPLATE_DIR

if TYPE_CHECKING:
    from releasekit.rollout.judge import CheckResult
    from releasekit.rollout.shadow_records import ShadowComparison

CHECK_COLUMNS = ("metric", "candidate", "stable", "limit", "source", "verdict")


def _check_verdict(c: CheckResult) -> str:
    """A check's verdict cell: pass or breach with how far over its limit, else why not
    judged."""
    if c.verdict in ("pass", "breach"):
        return c.verdict + c.over_limit()
    return f"{c.verdict.replace('_', ' ')} ({c.reason})"


TEMPLATES = Templates(
    Path(__file__).resolve().parent / "templates",
    below=[TEMPLATE_DIR],
    filters={"check_verdict": _check_verdict},
    globals={"check_columns": CHECK_COLUMNS},
)
"""The shadow comparison's page, in the gate report's layout (`releasekit._support.html`)."""


def shadow_html(cmp: ShadowComparison) -> str:
    """The comparison's HTML page."""
    when = dt.datetime.fromtimestamp(cmp.at, dt.UTC).isoformat(timespec="seconds")
    return TEMPLATES.render("shadow.html", cmp=cmp, when=when)


def write_shadow_page(cmp: ShadowComparison, path: Path) -> Path:
    """Write the comparison's page to `path` atomically (mode 0644); returns `path`."""
    write_atomic(path, shadow_html(cmp).encode())
    path.chmod(0o644)
    return path
