"""The arithmetic of a plan (design.md, "Capacity planning"): figures checked before use,
the peak rate, the units needed, and a figure printed the way the working prints it."""

from __future__ import annotations

import math

from releasekit.capacity.errors import CapacityError
from releasekit.capacity.plan_models import HandUnit, Traffic


def num(v: float) -> str:
    """A figure as the working prints it: thousands separated, about three significant
    digits."""
    a = abs(v)
    if float(v).is_integer() and a < 1e15:
        return f"{int(v):,}"
    if a >= 1000:
        return f"{v:,.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    return f"{v:.3g}"


def _positive(flag: str, v: float | None, *, allow_zero: bool = False) -> None:
    if v is None:
        return
    bad = not math.isfinite(v) or (v < 0 if allow_zero else v <= 0)
    if bad:
        need = "zero or more" if allow_zero else "a positive number"
        raise CapacityError(f"--{flag} must be {need} (got {v:g})")


def check_traffic(t: Traffic) -> None:
    """Raise CapacityError naming the first figure that cannot make a plan."""
    _positive("daily-requests", t.daily_requests)
    _positive("peak-hours", t.peak_hours)
    if t.peak_hours > 24:
        raise CapacityError(f"--peak-hours must be at most 24 (got {t.peak_hours:g})")
    _positive("peak-factor", t.peak_factor)
    _positive("headroom", t.headroom)
    if t.headroom < 1:
        raise CapacityError(
            f"--headroom multiplies the peak rate (1.25 keeps 25% spare): it must be at least 1 "
            f"(got {t.headroom:g})"
        )
    if t.min_units < 1:
        raise CapacityError(f"--min-units must be at least 1 (got {t.min_units})")
    _positive("unit-cost-per-hour", t.unit_cost_per_hour, allow_zero=True)
    _positive("prompt-tokens", t.prompt_tokens)
    _positive("output-tokens", t.output_tokens)


def check_hand(u: HandUnit) -> None:
    """Raise CapacityError naming the first per-unit figure that cannot make a plan."""
    _positive("concurrency", u.concurrency)
    _positive("tokens-per-second", u.tokens_per_second)
    _positive("output-tokens", u.output_tokens)
    _positive("overhead-s", u.overhead_s, allow_zero=True)
    if u.max_num_seqs is not None and u.max_num_seqs < 1:
        raise CapacityError(f"--max-num-seqs must be at least 1 (got {u.max_num_seqs})")


def peak_rate(daily_requests: float, peak_hours: float, peak_factor: float) -> float:
    """Requests per second at the peak: daily / (peak hours x 3600) x peak factor."""
    return daily_requests / (peak_hours * 3600.0) * peak_factor


def _ceil(x: float) -> int:
    # 12.000000000001 from float error is 12 units, not 13.
    return math.ceil(x - 1e-9)


def units_needed(
    peak_requests_per_s: float, per_unit_requests_per_s: float, *, headroom: float, min_units: int
) -> int:
    """max(min_units, ceil(peak x headroom / per-unit rate))."""
    return max(min_units, _ceil(peak_requests_per_s * headroom / per_unit_requests_per_s))
