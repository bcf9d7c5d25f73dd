"""Figures for evidence and reports, drawn cheaply: matplotlib's object API (no pyplot
state, no backend switch), fixed margins instead of a layout engine, titles at a fixed
height, and log axes labelled in plain numbers. A layout engine measures every label once
to place it and again to draw it; automatic title placement measures every tick label of
the axes; and mathtext parses each `10^{-1}` label: together most of a plot's CPU.

matplotlib is imported when a figure is made, not with this module."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.axis import Axis
    from matplotlib.figure import Figure


def figure(
    width: float,
    height: float,
    *,
    dpi: int,
    margins: tuple[float, float, float, float],
    cols: int = 1,
    wspace: float = 0.2,
) -> tuple[Figure, list[Axes]]:
    """A figure of `cols` panels side by side, with fixed `margins` (left, right, bottom,
    top as fractions of the figure, as `subplots_adjust` takes them)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=dpi)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, cols, squeeze=False)[0]
    left, right, bottom, top = margins
    fig.subplots_adjust(left=left, right=right, bottom=bottom, top=top, wspace=wspace)
    return fig, list(axes)


def title(ax: Axes, text: str, **kw: Any) -> None:
    """The panel's title just above it (an explicit height: matplotlib's automatic placement
    measures every tick label to avoid them, and nothing sits above these panels)."""
    ax.set_title(text, y=1.0, pad=6, **kw)


def plain_log(axis: Axis) -> None:
    """Label a log-scale axis in plain numbers (0.05, 0.1, 0.2, 1, 2) rather than mathtext
    powers: ticks at 1, 2 and 5 of each decade (not all nine), each labelled."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    label = FuncFormatter(lambda v, _pos: f"{v:g}")
    axis.set_minor_locator(LogLocator(10, subs=(2.0, 5.0)))
    axis.set_major_formatter(label)
    axis.set_minor_formatter(label)


def short_count(value: float) -> str:
    """A count in short form: 500, 2k, 10k, 1.5M."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:g}{suffix}"
    return f"{value:g}"


def counts_log(axis: Axis) -> None:
    """Label a log-scale axis of counts at its decades in short form (1k, 10k, 1M), the
    other ticks unlabelled: counts that span several decades, where 2 and 5 of each decade
    would crowd the axis."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis.set_major_locator(LogLocator(10))
    axis.set_major_formatter(FuncFormatter(lambda v, _pos: short_count(v)))
    axis.set_minor_formatter(NullFormatter())


def png(fig: Figure) -> bytes:
    """The figure as PNG bytes."""
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()
