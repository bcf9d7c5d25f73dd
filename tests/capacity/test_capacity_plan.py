"""Capacity plans: the worked example of design.md, a second example, plans from a bench.json
written by the real bench writer, and the warnings where a plan leaves what was measured."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest

from releasekit.bench import BenchResult
from releasekit.bench.stats import PointFlag
from releasekit.capacity import (
    CapacityError,
    CapacityEvidenceError,
    HandUnit,
    Traffic,
    peak_rate,
    plan_by_hand,
    plan_from_bench,
    plan_release,
    units_needed,
    volume_curve,
)
from releasekit.capacity.plan import CapacityPlan
from releasekit.config import Settings

WORKED = Traffic(daily_requests=100_000, peak_hours=2, peak_factor=2)
WORKED_UNIT = HandUnit(concurrency=16, tokens_per_second=30, output_tokens=200)


def _step(plan: CapacityPlan, name: str) -> float:
    return next(s.value for s in plan.steps if s.name == name)


def _codes(plan: CapacityPlan) -> set[str]:
    return {w.code for w in plan.warnings}


def test_worked_example_reproduces_design_numbers() -> None:
    """100,000 requests/day, 2 h peak, x2 -> 27.8 req/s; 200 tokens at 30 tok/s -> 6.67 s;
    16 concurrent -> 2.40 req/s per unit -> 12 units at 96% with the default headroom 1.0."""
    plan = plan_by_hand(WORKED, WORKED_UNIT)
    assert plan.traffic.headroom == 1.0
    assert plan.peak_requests_per_s == pytest.approx(27.777, abs=1e-3)
    assert _step(plan, "peak rate") == pytest.approx(100_000 / 7200 * 2)
    assert _step(plan, "time per request") == pytest.approx(200 / 30)
    assert _step(plan, "per-unit rate (Little's law)") == pytest.approx(2.4)
    assert plan.unit.requests_per_s == pytest.approx(2.4)
    assert plan.units == 12
    assert _step(plan, "units") == 12
    assert plan.utilisation == pytest.approx(27.7778 / (12 * 2.4), rel=1e-4)
    assert plan.load_per_unit_requests_per_s == pytest.approx(27.7778 / 12, rel=1e-4)
    workings = [s.working for s in plan.steps]
    assert workings[:4] == [
        "100,000 requests / (2 h x 3600 s) x 2",
        "0 s + 200 tokens / 30 tokens/s",
        "16 concurrent / 6.67 s",
        "ceil(27.8 x 1 / 2.40) = ceil(11.57)",
    ]
    assert plan.cost_per_hour is None and "no_measurement" in _codes(plan)


def test_second_example_with_overhead_headroom_floor_and_cost() -> None:
    """1,000,000/day in an 8 h peak x3 = 104.2 req/s; 0.5 s + 500 tokens at 50 tok/s = 10.5 s;
    64 concurrent = 6.095 req/s; headroom 1.2 -> ceil(20.51) = 21 units at 81.4%; at 2.50 an
    hour: 52.50/h, 1.26 per 1,000 requests over the day, 0.14 at the peak."""
    t = Traffic(
        daily_requests=1_000_000,
        peak_hours=8,
        peak_factor=3,
        headroom=1.2,
        min_units=2,
        unit_cost_per_hour=2.5,
    )
    plan = plan_by_hand(
        t, HandUnit(concurrency=64, tokens_per_second=50, output_tokens=500, overhead_s=0.5)
    )
    assert plan.peak_requests_per_s == pytest.approx(104.1667, rel=1e-5)
    assert _step(plan, "time per request") == pytest.approx(10.5)
    assert plan.unit.requests_per_s == pytest.approx(64 / 10.5)
    assert plan.units == 21
    assert plan.utilisation == pytest.approx(0.81380, rel=1e-4)
    assert plan.cost_per_hour == pytest.approx(52.5)
    assert plan.cost_per_day == pytest.approx(1260.0)
    assert plan.cost_per_1k_requests == pytest.approx(1.26)
    assert plan.cost_per_1k_requests_at_peak == pytest.approx(52.5 / (104.1667 * 3.6), rel=1e-4)
    assert next(s.working for s in plan.steps if s.name == "units") == (
        "max(2, ceil(104.2 x 1.20 / 6.10)) = max(2, ceil(20.51))"
    )


def test_min_units_floor_and_ceil_of_exact_quotient() -> None:
    """A tiny traffic still gets min_units; an exact quotient is not rounded up by float error."""
    assert units_needed(0.01, 2.4, headroom=1.0, min_units=3) == 3
    assert units_needed(0.1 * 3, 0.1, headroom=1.0, min_units=1) == 3
    assert peak_rate(86_400, 24, 1) == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("traffic", "hand", "flag"),
    [
        (WORKED.model_copy(update={"daily_requests": -5}), WORKED_UNIT, "--daily-requests"),
        (WORKED.model_copy(update={"peak_hours": 0}), WORKED_UNIT, "--peak-hours"),
        (WORKED.model_copy(update={"peak_hours": 25}), WORKED_UNIT, "--peak-hours"),
        (WORKED.model_copy(update={"peak_factor": math.nan}), WORKED_UNIT, "--peak-factor"),
        (WORKED.model_copy(update={"headroom": 0.8}), WORKED_UNIT, "--headroom"),
        (WORKED.model_copy(update={"min_units": 0}), WORKED_UNIT, "--min-units"),
        (WORKED, WORKED_UNIT.model_copy(update={"concurrency": 0}), "--concurrency"),
        (WORKED, WORKED_UNIT.model_copy(update={"tokens_per_second": -1}), "--tokens-per-second"),
        (WORKED, WORKED_UNIT.model_copy(update={"overhead_s": -0.1}), "--overhead-s"),
    ],
)
def test_bad_numbers_name_the_option(traffic: Traffic, hand: HandUnit, flag: str) -> None:
    """A zero, negative, out-of-range or NaN figure raises CapacityError naming its option."""
    with pytest.raises(CapacityError, match=flag):
        plan_by_hand(traffic, hand)


def test_hand_concurrency_beyond_max_num_seqs_warns() -> None:
    """By hand, --concurrency above --max-num-seqs is flagged."""
    plan = plan_by_hand(WORKED, WORKED_UNIT.model_copy(update={"max_num_seqs": 8}))
    assert "beyond_max_num_seqs" in _codes(plan)
    assert "beyond_max_num_seqs" not in _codes(plan_by_hand(WORKED, WORKED_UNIT))


TRAFFIC = Traffic(daily_requests=1_000_000, peak_hours=4, peak_factor=2)


def test_release_plan_matches_littles_law_and_measured_rate(
    write_release: Callable[..., Path], settings_cap: Settings, release_id: str
) -> None:
    """From a real-writer bench.json with its knee at c=16 and mean E2E 1.0 s: 16 req/s per
    unit by Little's law, equal to the point's measured rate; 138.9 req/s peak -> 9 units."""
    write_release()
    plan = plan_release(settings_cap, release_id, TRAFFIC)
    u = plan.unit
    assert u.source == "load test" and u.knee_load == 16 and u.mode == "concurrency"
    assert u.seconds_per_request == pytest.approx(1.0)
    assert u.little_requests_per_s == pytest.approx(16.0)
    assert u.measured_requests_per_s == pytest.approx(16.0)
    assert u.little_over_measured == pytest.approx(1.0)
    assert plan.peak_requests_per_s == pytest.approx(1e6 / 14400 * 2)
    assert plan.units == 9
    assert plan.utilisation == pytest.approx(138.889 / (9 * 16), rel=1e-4)
    m = plan.measured
    assert m is not None and m.max_num_seqs == 32 and m.loads == [1, 4, 8, 16, 32]
    assert m.prompt_tokens_mean == 32 and m.output_tokens_mean == 48
    assert plan.warnings == []
    assert [s.name for s in plan.steps][:4] == [
        "peak rate",
        "mean E2E at the knee (concurrency 16)",
        "per-unit rate (Little's law)",
        "cross-check against the measured request rate",
    ]
    assert plan.steps[1].working == "measured over 64 requests in 2 runs (held in 2 of 2)"
    assert plan.steps[2].working == "16 concurrent / 1 s"
    assert plan.steps[3].value == pytest.approx(1.0)


def test_release_plan_warns_when_little_and_measured_disagree_and_beyond_sweep(
    write_release: Callable[..., Path], settings_cap: Settings, release_id: str
) -> None:
    """Knee runs that took 3 s for 2 waves of 1 s measured 10.7 req/s against Little's 16:
    warned (>15%), and 9 units at 15.4 req/s each exceed anything the sweep completed."""
    write_release(knee_duration_s=3.0)
    plan = plan_release(settings_cap, release_id, TRAFFIC)
    assert plan.unit.little_over_measured == pytest.approx(1.5)
    assert {"little_vs_measured", "beyond_sweep"} <= _codes(plan)


def test_release_plan_warns_beyond_max_num_seqs(
    write_release: Callable[..., Path], settings_cap: Settings, release_id: str
) -> None:
    """A knee at 16 in flight with max-num-seqs 8 in the release's serving args is flagged."""
    write_release(max_num_seqs=8)
    plan = plan_release(settings_cap, release_id, TRAFFIC)
    assert _codes(plan) == {"beyond_max_num_seqs"}
    assert "max-num-seqs=8" in plan.warnings[0].message


def test_release_plan_warns_on_length_mismatch(
    write_release: Callable[..., Path], settings_cap: Settings, release_id: str
) -> None:
    """Traffic with 500-token prompts or 200-token answers against a profile of 32/48 warns;
    lengths within 20% of the profile's do not."""
    write_release()
    far = TRAFFIC.model_copy(update={"prompt_tokens": 500, "output_tokens": 200})
    assert {"prompt_length_mismatch", "output_length_mismatch"} <= _codes(
        plan_release(settings_cap, release_id, far)
    )
    near = TRAFFIC.model_copy(update={"prompt_tokens": 35, "output_tokens": 48})
    assert _codes(plan_release(settings_cap, release_id, near)) == set()


def test_knee_at_top_of_sweep_and_missing_knee(
    bench_factory: Callable[..., BenchResult],
) -> None:
    """A sweep whose every point holds has its knee at the top (warned); one with no point
    holding has no knee (CapacityEvidenceError)."""
    bench = bench_factory()
    top = bench.model_copy(update={"points": bench.points[:4]})
    assert "knee_at_sweep_top" in _codes(plan_from_bench(TRAFFIC, top))
    broken = bench.model_copy(update={"points": bench.points[4:], "knee": None})
    with pytest.raises(CapacityEvidenceError, match="no knee"):
        plan_from_bench(TRAFFIC, broken)


def test_release_without_bench_is_an_evidence_error(
    settings_cap: Settings, release_id: str
) -> None:
    """A release with no bench.json raises CapacityEvidenceError naming the missing file."""
    with pytest.raises(CapacityEvidenceError, match=r"bench\.json is missing"):
        plan_release(settings_cap, release_id, TRAFFIC)


def test_unreadable_bench_is_an_evidence_error(
    write_release: Callable[..., Path], settings_cap: Settings, release_id: str
) -> None:
    """A bench.json the writer would never produce is an error, not a plan."""
    rdir = write_release()
    (rdir / "bench" / "bench.json").write_text('{"points": "many"}')
    with pytest.raises(CapacityEvidenceError, match="unreadable bench result"):
        plan_release(settings_cap, release_id, TRAFFIC)


def test_volume_curve_marks_measured_region(
    write_release: Callable[..., Path], settings_cap: Settings, release_id: str
) -> None:
    """Units grow with volume; volumes whose per-unit load lies within the sweep's measured
    request rates (2-16 req/s here) are marked measured, lighter ones are not."""
    write_release()
    plan = plan_release(settings_cap, release_id, TRAFFIC)
    curve = volume_curve(plan)
    units = [c.units for c in curve]
    assert units == sorted(units) and units[0] == 1
    assert any(c.measured for c in curve) and not all(c.measured for c in curve)
    for c in curve:
        m = plan.measured
        assert m is not None
        inside = m.min_requests_per_s * 0.99 <= c.load_per_unit_requests_per_s
        assert c.measured == (inside and c.load_per_unit_requests_per_s <= 16 * 1.01)
    at_plan = volume_curve(plan, [1_000_000])[0]
    assert at_plan.units == plan.units and at_plan.measured is True


def test_rate_mode_bench_uses_arrival_rate_and_littles_concurrency(
    bench_factory: Callable[..., BenchResult],
) -> None:
    """An open-loop sweep: the knee's arrival rate is the per-unit rate and rate x mean E2E
    its concurrency."""
    bench = bench_factory()
    pts = [p.model_copy(update={"mode": "rate", "load": p.load / 2}) for p in bench.points]
    rate = bench.model_copy(update={"mode": "rate", "points": pts, "knee": pts[3]})
    plan = plan_from_bench(TRAFFIC, rate)
    assert plan.unit.requests_per_s == pytest.approx(8.0)
    assert plan.unit.concurrency == pytest.approx(8.0 * 1.0)
    assert plan.units == 18


def test_unstable_or_flagged_knee_warns(bench_factory: Callable[..., BenchResult]) -> None:
    """Repetitions that disagree on the knee, or a knee carrying a reliability flag (a bench
    written before the knee skipped flagged points), are warned about."""
    bench = bench_factory()
    assert bench.knee_stable and "knee_unstable" not in _codes(plan_from_bench(TRAFFIC, bench))
    unstable = bench.model_copy(update={"knee_stable": False, "knee_by_repetition": [16, 8]})
    plan = plan_from_bench(TRAFFIC, unstable)
    assert "(16, 8)" in next(w.message for w in plan.warnings if w.code == "knee_unstable")
    assert bench.knee is not None and not bench.knee.flags
    flag = PointFlag(code="client_bound", message="client queued")
    # One flagged run of two is below the knee rule's share: the knee is not trusted.
    runs = [bench.knee.runs[0].model_copy(update={"flags": [flag]}), *bench.knee.runs[1:]]
    knee = bench.knee.model_copy(update={"flags": [flag], "runs": runs})
    flagged = bench.model_copy(update={"knee": knee})
    assert "knee_flagged" in _codes(plan_from_bench(TRAFFIC, flagged))
