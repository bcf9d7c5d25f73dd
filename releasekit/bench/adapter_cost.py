"""What serving N LoRA adapters costs: one row per count of adapters in traffic (0, the base
alone, from the main sweep; then each adapter sweep) with the knee, TTFT p95 and goodput
there and their change against the base alone, as rows and as a short text or Markdown
table for the report and the plot."""

from __future__ import annotations

from pydantic import BaseModel, Field

from releasekit.bench.result import BenchResult


class AdapterCostRow(BaseModel):
    """The knee with `adapters` LoRA adapters in traffic (0: the base alone), and each figure's
    change against the base alone as a fraction (None where either side has no figure)."""

    adapters: int
    runs: int = Field(description="runs of the sweep the knee comes from")
    knee_load: float | None = None
    ttft_p95_s: float | None = None
    goodput: float | None = None
    knee_change: float | None = None
    ttft_change: float | None = None
    goodput_change: float | None = None
    knee_stop: str | None = Field(None, description="without a knee: why")


def _change(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or base == 0:
        return None
    return (value - base) / base


def adapter_cost(bench: BenchResult) -> list[AdapterCostRow]:
    """The rows, base alone first; empty for a result without adapter sweeps."""
    if not bench.adapter_sweeps:
        return []
    knee = bench.knee
    base = AdapterCostRow(
        adapters=0,
        runs=bench.repetitions,
        knee_load=knee.load if knee is not None else None,
        ttft_p95_s=knee.ttft.p95 if knee is not None else None,
        goodput=knee.goodput if knee is not None else None,
        knee_stop=bench.knee_stop if knee is None else None,
    )
    rows = [base]
    for s in sorted(bench.adapter_sweeps, key=lambda s: s.adapters):
        load = s.knee.load if s.knee is not None else None
        rows.append(
            AdapterCostRow(
                adapters=s.adapters,
                runs=1,
                knee_load=load,
                ttft_p95_s=s.ttft_p95_s_at_knee,
                goodput=s.goodput_at_knee,
                knee_change=_change(load, base.knee_load),
                ttft_change=_change(s.ttft_p95_s_at_knee, base.ttft_p95_s),
                goodput_change=_change(s.goodput_at_knee, base.goodput),
                knee_stop=s.knee_stop if s.knee is None else None,
            )
        )
    return rows


HEADER = ("adapters", "knee", "TTFT p95 (ms)", "goodput (req/s)", "change vs base")
"""The table's columns."""


def _pct(x: float | None) -> str:
    return "" if x is None else f"{x:+.0%}"


def cells(row: AdapterCostRow, mode: str = "concurrency") -> tuple[str, str, str, str, str]:
    """One row as the table shows it: `change vs base` is knee / TTFT p95 / goodput, in %."""
    who = "0 (base)" if row.adapters == 0 else str(row.adapters)
    if row.knee_load is None:
        return who, "none", "-", "-", ""
    knee = f"c={row.knee_load:g}" if mode == "concurrency" else f"{row.knee_load:g}/s"
    ttft = "-" if row.ttft_p95_s is None else f"{row.ttft_p95_s * 1000:.0f}"
    good = "-" if row.goodput is None else f"{row.goodput:.2f}"
    change = ""
    if row.adapters:
        change = " / ".join(
            _pct(x) or "-" for x in (row.knee_change, row.ttft_change, row.goodput_change)
        )
    return who, knee, ttft, good, change


def adapter_cost_title(bench: BenchResult) -> str:
    """The table's title: what it measures and how many runs each row stands on."""
    return (
        f"adapters in traffic (base: {bench.repetitions} run(s); with adapters: one run each; "
        "change: knee / TTFT p95 / goodput)"
    )


def adapter_cost_text(bench: BenchResult) -> str:
    """The table in fixed-width text (empty without adapter sweeps)."""
    rows = [HEADER, *(cells(r, bench.mode) for r in adapter_cost(bench))]
    if len(rows) == 1:
        return ""
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join([adapter_cost_title(bench), *lines])


def adapter_cost_markdown(bench: BenchResult) -> str:
    """The table in Markdown, for a report (empty without adapter sweeps)."""
    rows = [cells(r, bench.mode) for r in adapter_cost(bench)]
    if not rows:
        return ""
    out = [
        f"**{adapter_cost_title(bench)}**",
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "---|" * len(HEADER),
    ]
    out += ["| " + " | ".join(c or " " for c in r) + " |" for r in rows]
    return "\n".join(out)
