"""The gate report as table rows, JSON and a self-contained HTML page: what passed and failed
with the numbers and rules, the candidate's and the live release's latency-throughput
curves on one plot, and a link to the eval comparison. `PAGE_CSS` and `pairs_table_html`
(two releases' answers to the same requests, side by side) serve the other pages too."""

from __future__ import annotations

import base64
import html
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from releasekit._support import plots
from releasekit._support.files import write_atomic
from releasekit.promote.gates import CurvePoint, GateReport, GateResult

if TYPE_CHECKING:
    from releasekit.evaluate.agreement import Agreement

COLUMNS = ("gate", "kind", "result", "candidate", "live", "limit", "rule", "detail")
"""The gate table's columns."""


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def gate_rows(report: GateReport) -> list[list[str]]:
    """One row per gate, in COLUMNS order."""
    return [
        [
            g.name,
            g.kind,
            _result(g),
            _num(g.candidate),
            _num(g.live),
            _num(g.limit),
            g.rule,
            g.detail,
        ]
        for g in report.gates
    ]


def _result(g: GateResult) -> str:
    """pass, FAIL, or 'fail (advisory)' for a failed gate that does not block here."""
    if g.passed:
        return "pass"
    return "fail (advisory)" if g.advisory else "FAIL"


def report_json(report: GateReport) -> bytes:
    """The report as JSON bytes (GateReport.model_dump_json)."""
    return (report.model_dump_json(indent=2) + "\n").encode()


def curve_png(report: GateReport) -> bytes | None:
    """PNG bytes of TTFT p95 against output throughput for both releases (None without
    points). matplotlib is imported here (its object API: see `_support.plots`)."""
    if not report.candidate_curve and not report.live_curve:
        return None
    fig, (ax,) = plots.figure(7, 4.2, dpi=100, margins=(0.1, 0.97, 0.12, 0.91))

    def draw(points: list[CurvePoint], label: str, style: str, knee: float | None) -> None:
        pts = [p for p in points if p.ttft_p95_s is not None]
        if not pts:
            return
        xs = [p.output_token_throughput for p in pts]
        ys = [float(p.ttft_p95_s or 0.0) for p in pts]
        ax.plot(xs, ys, style, label=label)
        for p, x, y in zip(pts, xs, ys, strict=True):
            ax.annotate(
                f"{p.load:g}", (x, y), textcoords="offset points", xytext=(3, 3), fontsize=7
            )
            if knee is not None and p.load == knee:
                ax.plot([x], [y], "o", markersize=11, fillstyle="none", color="black")

    draw(
        report.live_curve,
        f"live {report.live_name or ''} {(report.live_release_id or '')[:12]}",
        "s--",
        report.live_knee,
    )
    draw(
        report.candidate_curve,
        f"candidate {report.candidate_name} {report.candidate_release_id[:12]}",
        "o-",
        report.candidate_knee,
    )
    ax.set_xlabel("output tokens/s (client)")
    ax.set_ylabel("TTFT p95 (s)")
    plots.title(ax, "latency vs throughput (labels: load; ring: knee)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return plots.png(fig)


def _row(g: GateResult) -> str:
    cls = "pass" if g.passed else ("advisory" if g.advisory else "fail")
    cells = [
        g.name,
        g.kind,
        _result(g),
        _num(g.candidate),
        _num(g.live),
        _num(g.limit),
        g.rule,
        g.detail,
    ]
    return f'<tr class="{cls}">' + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>"


PAGE_CSS = """
body { font-family: sans-serif; margin: 2em; }
table { border-collapse: collapse; }
td, th { border: 1px solid #ccc; padding: 4px 8px; font-size: 13px; vertical-align: top; }
tr.fail td { background: #fde2e2; } tr.pass td { background: #e6f4ea; }
tr.advisory td { background: #fff4d6; }
table.pairs td { white-space: pre-wrap; max-width: 40em; font-family: monospace; }
"""
"""The style of every report page (the gate report's)."""


class AnswerRow(Protocol):
    """What a row of `pairs_table_html` reads: `evaluate.agreement.DisagreeingPair`, or a
    gateway `MirrorPair` (an answer that could not be read is None)."""

    @property
    def seq(self) -> int: ...
    @property
    def stable(self) -> str | None: ...
    @property
    def candidate(self) -> str | None: ...
    @property
    def prompt(self) -> str | None: ...
    @property
    def prompt_sha256(self) -> str: ...


def pairs_table_html(pairs: Sequence[AnswerRow], *, caption: str | None = None) -> str:
    """Answer pairs side by side, one row a pair: its number, the prompt (or, where it was
    not kept, its sha256), the stable release's answer and the candidate's ("-": not
    readable). Every text is HTML-escaped; "<p>No disagreeing pairs.</p>" for none."""
    if not pairs:
        return "<p>No disagreeing pairs.</p>"

    def e(text: str | None) -> str:
        return "-" if text is None else html.escape(text)

    cap = f"<caption>{e(caption)}</caption>" if caption else ""
    rows = "\n".join(
        '<tr class="fail">'
        f"<td>{p.seq}</td>"
        + (
            f"<td>{e(p.prompt)}</td>"
            if p.prompt is not None
            else f'<td title="sha256 of the request body">sha256 {e(p.prompt_sha256[:16])}</td>'
        )
        + f"<td>{e(p.stable)}</td><td>{e(p.candidate)}</td></tr>"
        for p in pairs
    )
    return (
        f'<table class="pairs">{cap}<tr><th>#</th><th>prompt (or its digest)</th>'
        f"<th>stable answered</th><th>candidate answered</th></tr>\n{rows}\n</table>"
    )


def render_html(report: GateReport, *, comparison_href: str | None = None) -> str:
    """The HTML page (plot embedded as a data URI, so the file stands alone)."""
    png = curve_png(report)
    verdict = "PASSED" if report.passed else "BLOCKED"
    live = (
        f"{html.escape(report.live_name or '')} {html.escape((report.live_release_id or '')[:12])}"
        if report.live_release_id
        else "nothing (absolute checks)"
    )
    href = comparison_href or report.comparison_path
    link = "<p>No eval comparison report file.</p>"
    if href:
        target = Path(href).as_uri() if Path(href).is_absolute() else href
        source = html.escape(report.comparison_source or "report")
        link = (
            f'<p>Eval comparison: <a href="{html.escape(target)}">{html.escape(href)}</a> '
            f"(gates used the {source} comparison)</p>"
        )
    img = (
        f'<img alt="latency-throughput curves" src="data:image/png;base64,'
        f'{base64.b64encode(png).decode()}">'
        if png
        else "<p>No bench curves.</p>"
    )
    rule = (
        f"<p><b>Quality rule:</b> {html.escape(report.comparison_rule)}</p>"
        if report.comparison_rule
        else ""
    )
    head = "".join(f"<th>{c}</th>" for c in COLUMNS)
    name = html.escape(report.candidate_name)
    cid = html.escape(report.candidate_release_id[:12])
    env = html.escape(report.environment)
    when = html.escape(report.created_at.isoformat(timespec="seconds"))
    summary = f"{len(report.failed)} of {len(report.gates)} gates failed"
    if report.advisory_failed:
        summary += f" ({len(report.advisory_failed)} more failed, advisory here)"
    rows = "\n".join(_row(g) for g in report.gates)
    policy = (
        f"<p><b>Environment policy:</b> {html.escape(report.policy_source)}</p>\n"
        if report.policy_source
        else ""
    )
    if report.scaling:
        policy += f"<p><b>Replicas:</b> {html.escape(report.scaling)}</p>\n"
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>gates: {name} to {env}</title>
<style>{PAGE_CSS}</style></head><body>
<h1>{verdict}: {name} {cid} to {env}</h1>
<p>Against: {live}. Mode: {report.mode}. {summary}. {when}</p>
{policy}<table><tr>{head}</tr>
{rows}
</table>
{rule}
{link}
{img}
</body></html>
"""


def write_report(report: GateReport, out_dir: Path, *, stem: str) -> tuple[Path, Path]:
    """Write `<stem>.json` and `<stem>.html` into `out_dir` atomically; returns both paths."""
    j = out_dir / f"{stem}.json"
    h = out_dir / f"{stem}.html"
    write_atomic(j, report_json(report))
    write_atomic(h, render_html(report).encode())
    for p in (j, h):
        p.chmod(0o644)
    return j, h


def agreement_html(a: Agreement) -> str:
    """The answers' agreement as a page section: the rate with its interval, the counts,
    the floor and the verdict, then the disagreeing pairs side by side."""
    e = html.escape
    cls = "pass" if a.verdict == "pass" else "fail" if a.verdict == "breach" else "advisory"
    interval = (
        f"{a.rate:.1%}, {a.confidence:.0%} interval [{a.low:.1%}, {a.high:.1%}]"
        if a.rate is not None and a.low is not None and a.high is not None
        else "no pairs judged"
    )
    disagreeing = a.pairs - a.agreeing
    return (
        "<h2>Answers</h2>\n<table>"
        "<tr><th>agreement</th><th>pairs judged</th><th>agreeing</th><th>not judged</th>"
        "<th>floor</th><th>at least</th><th>verdict</th></tr>"
        f'<tr class="{cls}"><td>{e(interval)}</td><td>{a.pairs}</td><td>{a.agreeing}</td>'
        f"<td>{a.not_judged}</td><td>{a.min_agreement:.0%}</td><td>{a.min_pairs} pairs</td>"
        f"<td>{e(a.verdict)}: {e(a.reason)}</td></tr></table>\n"
        + pairs_table_html(
            a.examples, caption=f"{len(a.examples)} of {disagreeing} disagreeing pairs"
        )
    )
