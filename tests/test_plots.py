"""The shared plot helpers label axes as readers expect: counts in short form at each decade,
log latencies in plain numbers."""

from __future__ import annotations

from typing import Any

import pytest

from releasekit._support.plots import counts_log, figure, plain_log, png, short_count


@pytest.mark.parametrize(
    ("value", "text"),
    [(0.5, "0.5"), (500, "500"), (1000, "1k"), (2000, "2k"), (15000, "15k"), (1e6, "1M"),
     (1.5e6, "1.5M"), (3e9, "3G")],
)  # fmt: skip
def test_short_count(value: float, text: str) -> None:
    assert short_count(value) == text


def _labels(ticks: list[Any], lo: float, hi: float, at: int) -> list[str]:
    """The labels drawn for ticks inside the axis's limits."""
    return [t.get_text() for t in ticks if t.get_text() and lo <= t.get_position()[at] <= hi]


def test_log_axes_are_labelled_in_plain_numbers() -> None:
    """A volume axis over three decades reads 1k, 10k, 100k, 1M (no 10^3, no crowded
    minor labels); a latency axis reads 0.05, 0.1, 0.2 ..."""
    fig, (ax,) = figure(6, 4, dpi=50, margins=(0.1, 0.95, 0.1, 0.9))
    ax.plot([1e3, 1e6], [0.05, 2.0])
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(1e3, 1e6)
    ax.set_ylim(0.05, 2.0)
    counts_log(ax.xaxis)
    plain_log(ax.yaxis)
    assert png(fig)[:4] == b"\x89PNG"  # drawing fixes the tick labels
    xs = [*_labels(ax.get_xticklabels(), 1e3, 1e6, 0),
          *_labels(ax.get_xticklabels(minor=True), 1e3, 1e6, 0)]  # fmt: skip
    assert xs == ["1k", "10k", "100k", "1M"]
    ys = [*_labels(ax.get_yticklabels(), 0.05, 2.0, 1),
          *_labels(ax.get_yticklabels(minor=True), 0.05, 2.0, 1)]  # fmt: skip
    assert {"0.1", "1", "0.05", "0.2", "0.5", "2"} <= set(ys)
    assert not any("$" in y or "10^" in y for y in xs + ys)
