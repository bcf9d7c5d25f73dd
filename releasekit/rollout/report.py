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
from releasekit.promote.report import PAGE_CSS, pairs_table_html

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
    if a is None:
        answers = "<h2>Answers</h2>\n<p>Answers were not compared.</p>"
    else:
        cls = "pass" if a.verdict == "pass" else "fail" if a.verdict == "breach" else "advisory"
        interval = (
            f"{a.rate:.1%}, {a.confidence:.0%} interval [{a.low:.1%}, {a.high:.1%}]"
            if a.rate is not None and a.low is not None and a.high is not None
            else "no pairs judged"
        )
        disagreeing = a.pairs - a.agreeing
        answers = (
            "<h2>Answers</h2>\n<table>"
            "<tr><th>agreement</th><th>pairs judged</th><th>agreeing</th><th>not judged</th>"
            "<th>floor</th><th>at least</th><th>verdict</th></tr>"
            f'<tr class="{cls}"><td>{e(interval)}</td><td>{a.pairs}</td><td>{a.agreeing}</td>'
            f"<td>{a.not_judged}</td><td>{a.min_agreement:.0%}</td><td>{a.min_pairs} pairs</td>"
            f"<td>{e(a.verdict)}: {e(a.reason)}</td></tr></table>\n"
            + pairs_table_html(
                a.examples,
                caption=f"{len(a.examples)} of {disagreeing} disagreeing pairs",
            )
        )
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>shadow: {cid} vs {sid} in {env}</title>
<style>{PAGE_CSS}</style></head><body>
<h1>{e(cmp.verdict.upper())}: shadow {cid} vs stable {sid} in {env}</h1>
<p>Over {cmp.window_s:g} s: {cmp.mirrored} copies mirrored, {cmp.dropped} dropped;
{j.canary_requests:g} candidate / {j.stable_requests:g} stable requests. {e(when)},
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
