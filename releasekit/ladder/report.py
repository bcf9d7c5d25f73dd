"""The ladder for people: its table as rows of short cells (the CLI prints them), the per-tag
losses, a picture of quality against cost, and one HTML page with all three."""

from __future__ import annotations

import base64
from pathlib import Path

from releasekit._support.files import write_atomic
from releasekit._support.html import Templates
from releasekit._support.plots import figure, png, title
from releasekit.ladder.models import LadderResult, RungRow, SuiteDelta

TEMPLATES = Templates(Path(__file__).resolve().parent / "templates")

VERDICT_WORD = {
    "superior": "better",
    "non_inferior": "ok",
    "inconclusive": "unsure",
    "insufficient_evidence": "too few",
    "missing_evidence": "missing",
    "error_regression": "errors",
    "inferior": "LOSS",
}


def _mb(n: int | None) -> str:
    """Bytes in MB: two decimals below 10 MB (a small model's weights), none above."""
    if n is None:
        return "-"
    return f"{n / 1e6:.2f} MB" if n < 10e6 else f"{n / 1e6:.0f} MB"


def _num(x: float | None, spec: str = ".3g") -> str:
    return "-" if x is None else format(x, spec)


def suite_cell(s: SuiteDelta) -> str:
    """`-0.8 [-1.4,-0.3] LOSS`: the delta in points, its interval and the verdict's word."""
    word = VERDICT_WORD.get(s.verdict, s.verdict)
    if s.delta is None or s.ci_low is None or s.ci_high is None:
        return word
    return f"{100 * s.delta:+.1f} [{100 * s.ci_low:+.1f},{100 * s.ci_high:+.1f}] {word}"


def status_cell(r: RungRow, result: LadderResult) -> str:
    """The rung's outcome in a word or two (`recommended` marks the pick)."""
    return "recommended" if r.name == result.recommended else r.status


def outcome_line(result: LadderResult) -> str:
    """Where the ladder ended, in one sentence: the stop, or that no rung lost."""
    if result.stop_reason:
        return result.stop_reason
    judged = [r for r in result.rows if r.suites]
    skipped = [r.name for r in result.rows if r.status in ("not servable here", "failed")]
    text = (
        f"no rung is inferior on a critical suite ({', '.join(result.critical_suites)}): "
        f"the ladder went to its last rung ({len(judged)} compared with the base)"
    )
    return text + (f"; not measured here: {', '.join(skipped)}" if skipped else "")


def note_lines(result: LadderResult) -> list[str]:
    """What validation noticed about a rung's recipe, one line each (`rung: note`)."""
    return [f"{r.name}: {n}" for r in result.rows for n in r.recipe_notes]


def suite_names(result: LadderResult) -> list[str]:
    """Every suite a row judged, in first-seen order."""
    names: dict[str, None] = {}
    for r in result.rows:
        for s in r.suites:
            names.setdefault(s.suite, None)
    return list(names)


def cost_table(result: LadderResult) -> tuple[list[str], list[list[str]]]:
    """Columns and rows of the cost side: recipe, weights, memory, knee, tokens/s, cost."""
    cols = ["rung", "status", "weights", "memory", "knee", "tok/s", "per 1k good"]
    rows = [
        [
            r.name,
            status_cell(r, result),
            _mb(r.weights_bytes),
            _mb(r.memory_bytes),
            _num(r.knee_load, "g"),
            _num(r.knee_tokens_per_s, ".0f"),
            _num(r.cost_per_1k_good, ".3g"),
        ]
        for r in result.rows
    ]
    return cols, rows


def quality_table(result: LadderResult) -> tuple[list[str], list[list[str]]]:
    """Columns and rows of the quality side, one row a rung and suite: the delta against the
    base in points with its 95% interval, the verdict, the items lost and gained; a critical
    suite is marked `!`."""
    cols = ["rung", "suite", "delta [95% CI], pts", "verdict", "lost", "gained"]
    rows = []
    for r in result.rows:
        for s in r.suites:
            interval = (
                "-"
                if s.delta is None or s.ci_low is None or s.ci_high is None
                else f"{100 * s.delta:+.1f} [{100 * s.ci_low:+.1f}, {100 * s.ci_high:+.1f}]"
            )
            rows.append(
                [
                    r.name,
                    s.suite + ("!" if s.critical else ""),
                    interval,
                    VERDICT_WORD.get(s.verdict, s.verdict),
                    str(len(s.lost)),
                    str(len(s.gained)),
                ]
            )
    return cols, rows


def tag_rows(result: LadderResult, *, critical_only: bool = False) -> list[list[str]]:
    """Per-tag moves of every rung that moved an item: rung, suite, tag, passed on the base
    and on the rung, lost and gained. A tag every item of its suite carries says nothing the
    suite's row does not, and is left out; `critical_only` keeps the critical suites."""
    sizes = {(r.name, s.suite): s.n for r in result.rows for s in r.suites}
    critical = set(result.critical_suites)
    out = []
    for r in result.rows:
        for t in r.tags:
            if not (t.lost or t.gained) or t.n == sizes.get((r.name, t.suite)):
                continue
            if critical_only and t.suite not in critical:
                continue
            out.append(
                [
                    r.name,
                    t.suite,
                    t.tag,
                    f"{t.base_passed}/{t.n}",
                    f"{t.passed}/{t.n}",
                    f"-{t.lost} +{t.gained}",
                ]
            )
    return out


TAG_COLUMNS = ["rung", "suite", "tag", "base", "rung", "lost, gained"]


def plot(result: LadderResult) -> bytes:
    """Quality against cost: each measured rung's delta on the critical suites (points, with
    the interval) against its cost per 1,000 good answers (or its weights' size without a
    price); the margin as a dashed line."""
    priced = all(
        r.cost_per_1k_good is not None for r in result.rows if r.suites or r.status == "base"
    )
    fig, (ax,) = figure(7.0, 4.2, dpi=100, margins=(0.1, 0.97, 0.13, 0.9))
    xlabel = "cost per 1,000 good answers" if priced else "weights (MB)"
    margins: set[float] = set()
    for r in result.rows:
        x = r.cost_per_1k_good if priced else (r.weights_bytes or 0) / 1e6
        if x is None or r.status in ("not servable here", "failed", "not tried"):
            continue
        crit = [s for s in r.suites if s.critical and s.delta is not None]
        if r.status == "base":
            ax.scatter([x], [0.0], color="black", zorder=3)
            ax.annotate(r.name, (x, 0.0), textcoords="offset points", xytext=(5, 5), fontsize=8)
            continue
        for s in crit:
            lo, hi, d = 100 * (s.ci_low or 0), 100 * (s.ci_high or 0), 100 * (s.delta or 0)
            picked = r.name == result.recommended
            colour = "tab:red" if s.verdict == "inferior" else "tab:green" if picked else "tab:blue"
            ax.errorbar([x], [d], yerr=[[d - lo], [hi - d]], fmt="o", color=colour, capsize=3)
            label = r.name + (f" ({s.suite})" if len(crit) > 1 else "")
            ax.annotate(
                label + (", recommended" if picked else ""),
                (x, d),
                textcoords="offset points",
                xytext=(5, 5),
                fontsize=8,
            )
            margins.add(s.margin)
    for m in sorted(margins):
        ax.axhline(-100 * m, linestyle="--", color="grey", linewidth=1)
    ax.axhline(0, color="black", linewidth=0.5)
    ax.margins(x=0.3, y=0.15)  # room for the labels right of the points
    ax.set_xlabel(xlabel)
    ax.set_ylabel("pass rate vs base (points)")
    title(ax, "quality against cost (critical suites; dashed: the margin)", fontsize=10)
    return png(fig)


def write_outputs(result: LadderResult, out_dir: Path) -> dict[str, Path]:
    """ladder.json, ladder.png and ladder.html in `out_dir`; their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {k: out_dir / f"ladder.{k}" for k in ("json", "png", "html")}
    image = plot(result)
    write_atomic(paths["json"], (result.model_dump_json(indent=2) + "\n").encode())
    write_atomic(paths["png"], image)
    cost_cols, cost_rows = cost_table(result)
    q_cols, q_rows = quality_table(result)
    page = TEMPLATES.render(
        "ladder.html",
        result=result,
        outcome=outcome_line(result),
        cost_cols=cost_cols,
        cost_rows=cost_rows,
        q_cols=q_cols,
        q_rows=q_rows,
        tag_cols=TAG_COLUMNS,
        tag_rows=tag_rows(result),
        image=base64.b64encode(image).decode(),
    )
    write_atomic(paths["html"], page.encode())
    return paths
