"""The curve behind a plan's plot: units needed at each daily volume with the plan's peak
window, factor, headroom, floor and per-unit rate, and whether a unit's load there was
measured."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from releasekit.capacity.plan_arithmetic import peak_rate, units_needed
from releasekit.capacity.plan_models import CapacityPlan, CurvePoint


def default_volumes(plan: CapacityPlan, n: int = 240) -> list[float]:
    """Daily volumes to plot: two decades below the plan to one above, widened to show the
    volumes where one unit's load falls inside the sweep."""
    d = plan.traffic.daily_requests
    lo, hi = d / 100, d * 10
    if plan.measured is not None:
        t = plan.traffic
        per_day = t.peak_hours * 3600 / t.peak_factor  # daily requests per req/s of peak
        lo = min(lo, plan.measured.min_requests_per_s * per_day * t.min_units / 2)
        hi = max(hi, plan.measured.max_requests_per_s * per_day * 2)
    # The plan's own volume is on the grid, so the curve passes through the plan's units.
    return sorted({float(v) for v in np.geomspace(lo, hi, n)} | {float(d)})


def volume_curve(plan: CapacityPlan, volumes: Sequence[float] | None = None) -> list[CurvePoint]:
    """Units needed at each daily volume with the plan's peak window, factor, headroom, floor
    and per-unit rate; `measured` says whether a unit's load there (peak / units) lies within
    the request rates the sweep measured."""
    t = plan.traffic
    rate = plan.unit.requests_per_s
    out: list[CurvePoint] = []
    for v in volumes if volumes is not None else default_volumes(plan):
        peak = peak_rate(v, t.peak_hours, t.peak_factor)
        units = units_needed(peak, rate, headroom=t.headroom, min_units=t.min_units)
        load = peak / units
        inside: bool | None = None
        if plan.measured is not None:
            m = plan.measured
            inside = m.min_requests_per_s * 0.99 <= load <= m.max_requests_per_s * 1.01
        out.append(
            CurvePoint(
                daily_requests=v, units=units, load_per_unit_requests_per_s=load, measured=inside
            )
        )
    return out
