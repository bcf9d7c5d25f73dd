"""Capacity plans and rooflines from measured evidence; diagnosis of a live service.

plan = plan_release(settings, release_id, Traffic(daily_requests=1e5, peak_hours=2,
                                                  peak_factor=2))
plan = plan_by_hand(traffic, HandUnit(concurrency=16, tokens_per_second=30,
                                      output_tokens=200))
roof = roofline_by_hand(params=70e9, bytes_per_weight=2, bandwidth_gbs=2000)
"""

from __future__ import annotations

from releasekit.capacity.plan import (
    CapacityError,
    CapacityEvidenceError,
    CapacityPlan,
    HandUnit,
    Traffic,
    peak_rate,
    plan_by_hand,
    plan_from_bench,
    plan_release,
    units_needed,
    volume_curve,
)
from releasekit.capacity.roofline import (
    Roofline,
    ceiling_tokens_per_s,
    measure_bandwidth_gbs,
    roofline_by_hand,
    roofline_release,
)

__all__ = [
    "CapacityError",
    "CapacityEvidenceError",
    "CapacityPlan",
    "HandUnit",
    "Roofline",
    "Traffic",
    "ceiling_tokens_per_s",
    "measure_bandwidth_gbs",
    "peak_rate",
    "plan_by_hand",
    "plan_from_bench",
    "plan_release",
    "roofline_by_hand",
    "roofline_release",
    "units_needed",
    "volume_curve",
]
