"""The ladder's rules, as pure functions of its rows: a rung's status from its suites, where
the ladder stops, what a good answer costs, and which rung it recommends.

- A rung **passes** when every suite is non-inferior or superior to the base (the quality
  gates' own rule: only these pass a gate); it is **inferior** when a suite's interval lies
  wholly below the margin; otherwise **inconclusive**.
- The ladder **stops** at the first rung inferior on a critical suite: the rungs below it
  are not built.
- **Cost** per 1,000 good answers is the unit-hour price over the answers that pass per hour
  at the knee: price / (knee goodput x 3600 x good rate) x 1000.
- It **recommends** the cheapest eligible rung (the base, or one that passes) above the stop.
  Costs within `tolerance` of the lowest count as equal (a knee's goodput spreads about that
  much from run to run on shared cores, so a smaller difference is not a finding), and so
  does a rung whose best run at the knee costs within it (a difference its own runs span is
  not one either); among those, the smallest weights win, then the rung higher on the
  ladder. Without prices, the smallest weights win.
"""

from __future__ import annotations

from collections.abc import Sequence

from releasekit.ladder.models import RungRow, RungStatus, SuiteDelta

PASSING = ("non_inferior", "superior")


def rung_status(suites: Sequence[SuiteDelta]) -> RungStatus:
    """passes / inferior / inconclusive from a rung's suite verdicts (see the module)."""
    if not suites:
        return "inconclusive"
    if any(s.verdict in ("inferior", "error_regression") for s in suites):
        return "inferior"
    if all(s.verdict in PASSING for s in suites):
        return "passes"
    return "inconclusive"


def stops_ladder(row: RungRow) -> bool:
    """The ladder goes no lower than a rung inferior on a critical suite."""
    return bool(row.critical_losses())


def stop_reason(row: RungRow) -> str:
    """Why the ladder stopped at `row`: each critical suite it lost, with the items."""
    parts = []
    for s in row.critical_losses():
        shown = ", ".join(s.lost[:5]) + (" ..." if len(s.lost) > 5 else "")
        parts.append(
            f"{s.suite} (critical) inferior: {len(s.lost)} items lost, {len(s.gained)} "
            f"gained" + (f" ({shown})" if shown else "")
        )
    return f"stopped at {row.name}: " + "; ".join(parts)


def cost_per_1k_good(
    unit_cost_per_hour: float | None, goodput: float | None, good_rate: float | None
) -> float | None:
    """The price of 1,000 answers that pass, at the knee (None when a figure is missing)."""
    if unit_cost_per_hour is None or not goodput or not good_rate:
        return None
    return unit_cost_per_hour / (goodput * 3600 * good_rate) * 1000


def _mb(n: int | None) -> str:
    return "?" if n is None else f"{n / 1e6:.2f} MB"


def _best_cost(r: RungRow) -> float:
    """A rung's cost, or its best run's where that is lower (0 when it has none)."""
    costs = [c for c in (r.cost_per_1k_good, r.cost_best_run_per_1k_good) if c is not None]
    return min(costs) if costs else 0.0


def recommend(rows: Sequence[RungRow], *, tolerance: float) -> tuple[RungRow | None, str]:
    """The recommended rung among the eligible ones, and why, in one sentence."""
    eligible = [r for r in rows if r.eligible]
    if not eligible:
        return None, "no rung passes every suite, and the base was not measured"
    costs = [r.cost_per_1k_good for r in eligible]
    if all(c is not None for c in costs):
        lowest = min(c for c in costs if c is not None)
        tied = [r for r in eligible if _best_cost(r) <= lowest * (1 + tolerance)]
        rule = (
            f"the smallest weights among the rungs within {tolerance:.0%} of the lowest cost "
            f"per 1,000 good answers ({lowest:.3g}), at the knee or at its best run"
        )
    else:
        tied = list(eligible)
        rule = "the smallest weights (no cost per good answer for every rung)"
    order = {r.name: i for i, r in enumerate(rows)}
    pick = min(tied, key=lambda r: (r.weights_bytes or 2**62, order[r.name]))
    what = "the base" if pick.status == "base" else "every suite non-inferior to the base"
    cheaper = [
        r.name
        for r in eligible
        if r is not pick
        and r.cost_per_1k_good is not None
        and pick.cost_per_1k_good is not None
        and r.cost_per_1k_good < pick.cost_per_1k_good
    ]
    tail = f"; {', '.join(cheaper)} measured cheaper, within the tolerance" if cheaper else ""
    return pick, f"{pick.name}: {rule}, {_mb(pick.weights_bytes)}; {what}{tail}"
