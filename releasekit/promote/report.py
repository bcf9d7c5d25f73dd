"""The gate report as table rows, JSON and a self-contained HTML page: what passed and failed
with the numbers and rules, the candidate's and the live release's latency-throughput
curves on one plot, and a link to the eval comparison. The page layout (`TEMPLATE_DIR`'s
`report_page.html`), `agreement_html` and `pairs_table_html` (two releases' answers to the
same requests, side by side) serve the other pages too."""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from releasekit._support import plots
from releasekit._support.digests import sha256_bytes
from releasekit._support.files import write_atomic
from releasekit._support.html import Markup, Templates
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


COMPACT_COLUMNS = ("gate", "result", "candidate vs live", "limit")
"""The short gate table's columns: one line a gate, the figure that decided and its bound."""


def _figure(g: GateResult) -> str:
    """The figure that decided: `candidate vs live` where both exist, else the one there is."""
    if g.candidate is not None and g.live is not None:
        return f"{_num(g.candidate)} vs {_num(g.live)}"
    if g.candidate is not None:
        return _num(g.candidate)
    return "-" if g.live is None else f"- vs {_num(g.live)}"


# Gates that hold no figure: when they pass, `compact_rows` counts them in one row.
FOLDED_KINDS = ("approval", "policy", "evidence")


def _folds(g: GateResult) -> bool:
    return g.passed and g.kind in FOLDED_KINDS and g.candidate is None and g.live is None


def compact_rows(report: GateReport, *, fold: bool = True) -> list[list[str]]:
    """One short row per gate, in COMPACT_COLUMNS order (rules and details left out). With
    `fold`, the passing gates that hold no figure (approval, policy, evidence) are one row
    where the first of them stands, saying how many passed; a failed one keeps its row."""
    rows: list[list[str]] = []
    folded = [g for g in report.gates if _folds(g)] if fold else []
    for g in report.gates:
        if folded and _folds(g):
            if g is folded[0]:
                kinds = [k for k in FOLDED_KINDS if any(f.kind == k for f in folded)]
                words = ", ".join(kinds[:-1]) + (" and " if len(kinds) > 1 else "") + kinds[-1]
                rows.append([f"{words} checks ({len(folded)})", "pass", "-", "-"])
            continue
        rows.append([g.name, _result(g), _figure(g), _num(g.limit)])
    return rows


def short_reason(g: GateResult) -> str:
    """Why a gate failed, in one clause: its detail up to the first "; " outside brackets
    (the rule when it has no detail, or only the runs' spread)."""
    detail = g.detail.strip()
    # A perf comparison's detail is the runs' spread (context, not the reason): its rule
    # says what the figure had to meet.
    if not detail or detail == "ok" or detail.startswith("run-to-run spread"):
        return g.rule
    depth = 0
    for i, ch in enumerate(detail):
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth = max(depth - 1, 0)
        elif depth == 0 and detail.startswith("; ", i):
            return detail[:i]
    return detail


def failure_reasons(report: GateReport) -> list[tuple[str, str]]:
    """(gate, short reason) for each failed gate, blocking or advisory, in report order."""
    return [(g.name, short_reason(g)) for g in report.gates if not g.passed]


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


TEMPLATE_DIR = Path(__file__).resolve().parent / "templates"
"""The report pages' templates: the layout (`report_page.html`), the gate report, the
gate table, the answers' agreement and the pairs table (other layers' pages extend and
include them)."""

TEMPLATES = Templates(
    TEMPLATE_DIR,
    filters={"gate_result": _result},
    globals={"columns": COLUMNS},
)
"""The gate report's templates (`releasekit._support.html`: autoescaped)."""


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


def pairs_table_html(pairs: Sequence[AnswerRow], *, caption: str | None = None) -> Markup:
    """Answer pairs side by side, one row a pair: its number, the prompt (or, where it was
    not kept, its sha256), the stable release's answer and the candidate's ("-": not
    readable). Every text is HTML-escaped; "<p>No disagreeing pairs.</p>" for none."""
    return TEMPLATES.render_markup("pairs_table.html", pairs=list(pairs), caption=caption)


def render_html(report: GateReport, *, comparison_href: str | None = None) -> str:
    """The HTML page (plot embedded as a data URI, so the file stands alone)."""
    png = curve_png(report)
    href = comparison_href or report.comparison_path
    target = (Path(href).as_uri() if Path(href).is_absolute() else href) if href else None
    summary = f"{len(report.failed)} of {len(report.gates)} gates failed"
    if report.advisory_failed:
        summary += f" ({len(report.advisory_failed)} more failed, advisory here)"
    return TEMPLATES.render(
        "gate_report.html",
        r=report,
        gates=report.gates,
        summary=summary,
        href=href,
        target=target,
        png=base64.b64encode(png).decode() if png else None,
    )


@dataclass(frozen=True)
class WrittenReport:
    """A gate report's two files as written, and the sha256 of the JSON bytes written (what
    a record that links the report vouches for)."""

    json_path: Path
    html_path: Path
    json_sha256: str


def write_gate_report(report: GateReport, out_dir: Path, *, stem: str) -> WrittenReport:
    """Write `<stem>.json` and `<stem>.html` into `out_dir` atomically; returns both paths
    and the digest of the JSON bytes it wrote."""
    j = out_dir / f"{stem}.json"
    h = out_dir / f"{stem}.html"
    data = report_json(report)
    write_atomic(j, data)
    write_atomic(h, render_html(report).encode())
    for p in (j, h):
        p.chmod(0o644)
    return WrittenReport(json_path=j, html_path=h, json_sha256=sha256_bytes(data))


def write_report(report: GateReport, out_dir: Path, *, stem: str) -> tuple[Path, Path]:
    """Write `<stem>.json` and `<stem>.html` into `out_dir` atomically; returns both paths
    (`write_gate_report` also returns the JSON's digest)."""
    written = write_gate_report(report, out_dir, stem=stem)
    return written.json_path, written.html_path


def agreement_html(a: Agreement) -> Markup:
    """The answers' agreement as a page section: the rate with its interval, the counts,
    the floor and the verdict, then the disagreeing pairs side by side."""
    return TEMPLATES.render_markup("agreement.html", a=a)
