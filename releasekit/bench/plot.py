"""The sweep plot: output-token throughput against TTFT and E2E percentiles, the knee marked,
points the cross-check did not trust crossed out in red with their flags; below them, for a
release with adapters, what serving N adapters costs."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from releasekit._support import plots
from releasekit.bench.adapter_cost import adapter_cost_text

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from releasekit.bench.result import BenchResult
    from releasekit.bench.stats import LatencySummary, PointResult

_PCTS: tuple[tuple[str, str, str], ...] = (
    ("p50", "p50", "-"),
    ("p95", "p95", "--"),
    ("p99", "p99", ":"),
)


def _load_label(p: PointResult) -> str:
    return f"c={p.load:g}" if p.mode == "concurrency" else f"{p.load:g} req/s"


def _panel(
    ax: Axes,
    points: Sequence[PointResult],
    metric: str,
    title: str,
    slo: float | None,
    knee: PointResult | None,
) -> None:
    plotted = False
    for key, label, style in _PCTS:
        xs: list[float] = []
        ys: list[float] = []
        for p in points:
            summary: LatencySummary = getattr(p, metric)
            v = getattr(summary, key)
            if v is not None:
                xs.append(p.output_token_throughput)
                ys.append(v)
        if xs:
            ax.plot(xs, ys, style, marker="o", markersize=4, label=f"{title} {label}")
            plotted = plotted or min(ys) > 0
    for p in points:
        v = getattr(p, metric).p95
        if v is not None:
            ax.annotate(
                _load_label(p),
                (p.output_token_throughput, v),
                textcoords="offset points",
                xytext=(4, 6),
                fontsize=8,
                color="dimgray",
            )
    flagged = [p for p in points if not p.trusted and getattr(p, metric).p95 is not None]
    if flagged:
        ax.plot(
            [p.output_token_throughput for p in flagged],
            [getattr(p, metric).p95 for p in flagged],
            marker="X",
            markersize=11,
            color="tab:red",
            linestyle="none",
            label="flagged: not trusted",
        )
        for p in flagged:
            codes = ", ".join(sorted({f.code for f in p.flags}))
            ax.annotate(
                codes,
                (p.output_token_throughput, getattr(p, metric).p95),
                textcoords="offset points",
                xytext=(4, -12),
                fontsize=7,
                color="tab:red",
            )
    if slo is not None:
        ax.axhline(slo, color="tab:red", linewidth=1, alpha=0.7, label=f"SLO {slo:g} s")
    if knee is not None:
        v = getattr(knee, metric).p95
        ax.axvline(knee.output_token_throughput, color="tab:green", linewidth=1, alpha=0.6)
        if v is not None:
            ax.plot(
                [knee.output_token_throughput],
                [v],
                marker="*",
                markersize=16,
                color="tab:green",
                linestyle="none",
                label=f"knee ({_load_label(knee)})",
            )
    ax.set_xlabel("output throughput (tokens/s, client)")
    ax.set_ylabel(f"{title} (s, log scale)")
    # Latencies span orders of magnitude across a sweep: a log axis keeps the low-load
    # points apart instead of flattening them against zero.
    if plotted:
        ax.set_yscale("log")
        plots.plain_log(ax.yaxis)
    plots.title(ax, f"{title} vs throughput")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")


def plot_sweep(result: BenchResult, path: Path) -> None:
    """Write a PNG with two panels (TTFT, E2E) across the sweep; the knee is starred."""
    points = sorted(result.points, key=lambda p: p.load)
    # With adapter sweeps, their cost table goes below the panels, in fixed-width text.
    table = adapter_cost_text(result)
    extra = 0.15 * (table.count("\n") + 1) + 0.15 if table else 0.0
    height = 5 + extra
    # Fixed margins (the two panels' labels are short and known): see _support.plots.
    fig, (ax_ttft, ax_e2e) = plots.figure(
        12,
        height,
        dpi=110,
        margins=(0.06, 0.985, (0.55 + extra) / height, 1 - 0.6 / height),
        cols=2,
        wspace=0.22,
    )
    if table:
        fig.text(0.06, 0.1 / height, table, family="monospace", fontsize=8, va="bottom")
    _panel(ax_ttft, points, "ttft", "TTFT", result.slo.ttft_s, result.knee)
    _panel(ax_e2e, points, "e2e", "E2E", result.slo.e2e_s, result.knee)
    who = result.release_id[:12] if result.release_id else result.model
    if result.knee is None:
        why = result.knee_stop or "no point holds"
        knee = "no knee: " + (why if len(why) <= 90 else why[:87] + "...")
    else:
        knee = f"knee at {_load_label(result.knee)}"
        if result.repetitions < 2:
            knee += " (one run)"
        elif result.knee_stable:
            knee += f" (stable over {result.repetitions} runs)"
        else:
            per = ", ".join("-" if k is None else f"{k:g}" for k in result.knee_by_repetition)
            knee += f" (NOT stable: per-run knees {per})"
    flagged = ", ".join(_load_label(p) for p in points if not p.trusted)
    if flagged:
        knee += f"; flagged: {flagged}"
    fig.suptitle(f"{result.profile_name} on {who}: {knee}", fontsize=11)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
