"""The shadow comparison as a self-contained HTML page, written beside its JSON copy: the
verdict, the answers' agreement with its interval, the live figures' checks, and the
disagreeing pairs side by side (`promote.report.pairs_table_html`, in the gate report's
style). Every text from a request or an answer is HTML-escaped."""

from __future__ import annotations

import datetime as dt
import html
from pathlib import Path
from typing import TYPE_CHECKING

from releasekit._support.files import write_atomic
from releasekit.promote.report import PAGE_CSS, agreement_html

if TYPE_CHECKING:
    from releasekit.rollout.judge import CheckResult
    from releasekit.rollout.shadow import ShadowComparison

CHECK_COLUMNS = ("metric", "candidate", "stable", "limit", "source", "verdict")


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g}"


def _check_row(c: CheckResult) -> str:
    cls = "pass" if c.verdict == "pass" else "fail" if c.verdict == "breach" else "advisory"
    verdict = (
        c.verdict + c.over_limit()
        if c.verdict in ("pass", "breach")
        else f"{c.verdict.replace('_', ' ')} ({c.reason})"
    )
    cells = [c.metric, _num(c.canary), _num(c.stable), _num(c.limit), c.source or "-", verdict]
    return f'<tr class="{cls}">' + "".join(f"<td>{html.escape(x)}</td>" for x in cells) + "</tr>"


def shadow_html(cmp: ShadowComparison) -> str:
    """The comparison's HTML page."""
    e = html.escape
    cid, sid, env = e(cmp.release_id[:12]), e(cmp.stable_release_id[:12]), e(cmp.env)
    when = dt.datetime.fromtimestamp(cmp.at, dt.UTC).isoformat(timespec="seconds")
    j = cmp.judgement
    record = f"ledger record {cmp.seq}" if cmp.seq is not None else "not in the ledger"
    head = "".join(f"<th>{c}</th>" for c in CHECK_COLUMNS)
    rows = "\n".join(_check_row(c) for c in j.checks)
    a = cmp.agreement
    answers = (
        "<h2>Answers</h2>\n<p>Answers were not compared.</p>" if a is None else agreement_html(a)
    )
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>shadow: {cid} vs {sid} in {env}</title>
<style>{PAGE_CSS}</style></head><body>
<h1>{e(cmp.verdict.upper())}: shadow {cid} vs stable {sid} in {env}</h1>
<p>Over {cmp.window_s:g} s: {cmp.mirrored} copies mirrored, {cmp.dropped} dropped;
{j.canary_requests:g} candidate / {j.stable_requests:g} stable requests; judged against
{e(cmp.judged_against)}. {e(when)},
{e(record)}.</p>
<p>{e(cmp.reason)}</p>
{answers}
<h2>Live figures</h2>
<table><tr>{head}</tr>
{rows}
</table>
</body></html>
"""


def write_shadow_page(cmp: ShadowComparison, path: Path) -> Path:
    """Write the comparison's page to `path` atomically (mode 0644); returns `path`."""
    write_atomic(path, shadow_html(cmp).encode())
    path.chmod(0o644)
    return path
