"""Capacity plans for a release with LoRA adapters: planned from the knee with as many adapters
in traffic as the release carries, and saying so; without adapter sweeps, as before."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from releasekit.bench import AdapterSweep, BenchResult, write_evidence
from releasekit.capacity import CapacityEvidenceError, Traffic, plan_from_bench, plan_release
from releasekit.cli import capacity_cmds
from releasekit.cli._common import State
from releasekit.config import Settings

TRAFFIC = Traffic(daily_requests=1_000_000, peak_hours=4, peak_factor=2)


def with_adapters(bench: BenchResult, *, knee_at: float | None = 8) -> BenchResult:
    """`bench` (knee c=16 alone) as a release carrying one adapter, whose sweeps with 1 and 2
    adapters in traffic reuse its points with the knee at `knee_at` and c=4."""
    by_load = {p.load: p for p in bench.points}

    def sweep(k: int, load: float | None) -> AdapterSweep:
        knee = by_load[load] if load is not None else None
        return AdapterSweep(
            adapters=k,
            models=["demo", "json", "json-copy1"][: k + 1],
            copies=["json-copy1"] if k == 2 else [],
            points=bench.points,
            knee=knee,
            knee_stop=None if knee else "c=1: TTFT p95 2.1 s over the SLO",
            ttft_p95_s_at_knee=knee.ttft.p95 if knee else None,
            goodput_at_knee=knee.goodput if knee else None,
        )

    out = bench.model_copy(deep=True)
    out.adapters = ["json"]
    out.adapter_sweeps = [sweep(1, knee_at), sweep(2, 4)]
    return out


def test_a_release_with_one_adapter_plans_from_the_knee_with_one_in_traffic(
    bench_factory: Callable[..., BenchResult],
) -> None:
    alone = plan_from_bench(TRAFFIC, bench_factory())
    plan = plan_from_bench(TRAFFIC, with_adapters(bench_factory()))
    assert alone.unit.knee_load == 16 and alone.adapters_in_traffic is None
    assert plan.unit.knee_load == 8 and plan.adapters_in_traffic == 1
    assert plan.unit.requests_per_s == pytest.approx(8 / 0.8)  # Little's law at c=8
    assert plan.units > alone.units
    assert any("knee with 1 adapter in traffic" in s.name for s in plan.steps)
    note = plan.notes[0]
    assert "planned from the knee with 1 adapter in traffic" in note
    assert "demo, json" in note and "the base alone has its knee at 16" in note


def test_two_adapters_carried_plan_from_the_sweep_with_two(
    bench_factory: Callable[..., BenchResult],
) -> None:
    bench = with_adapters(bench_factory())
    bench.adapters = ["json", "sql"]
    plan = plan_from_bench(TRAFFIC, bench)
    assert plan.unit.knee_load == 4 and plan.adapters_in_traffic == 2
    assert "knee with 2 adapters in traffic" in plan.notes[0]


def test_without_adapter_sweeps_a_release_with_adapters_plans_as_before(
    bench_factory: Callable[..., BenchResult],
) -> None:
    bench = bench_factory()
    bench.adapters = ["json"]  # benched before adapter sweeps existed
    plan = plan_from_bench(TRAFFIC, bench)
    assert plan.unit.knee_load == 16 and plan.adapters_in_traffic is None


def test_no_knee_with_the_adapters_in_traffic_is_an_evidence_error(
    bench_factory: Callable[..., BenchResult],
) -> None:
    with pytest.raises(CapacityEvidenceError, match="sweep with 1 adapter in traffic has no knee"):
        plan_from_bench(TRAFFIC, with_adapters(bench_factory(), knee_at=None))


def test_plan_release_and_the_cli_say_which_knee(
    write_release: Callable[..., Path],
    settings_cap: Settings,
    release_id: str,
    bench_factory: Callable[..., BenchResult],
) -> None:
    rdir = write_release()
    write_evidence(with_adapters(bench_factory()), rdir / "bench")
    plan = plan_release(settings_cap, release_id, TRAFFIC)
    assert plan.adapters_in_traffic == 1 and plan.unit.knee_load == 8

    app = typer.Typer(pretty_exceptions_enable=False)

    @app.callback()
    def _root() -> None:
        State.reset()

    capacity_cmds.register(app)
    args = ["--daily-requests", "1000000", "--peak-hours", "4", "--peak-factor", "2"]
    res = CliRunner().invoke(app, ["capacity", release_id, *args, "--no-plot"])
    assert res.exit_code == 0, res.stdout + res.stderr
    assert "knee with 1 adapter in traffic" in res.stdout
    res = CliRunner().invoke(app, ["capacity", release_id, *args, "--json"])
    assert json.loads(res.stdout)["adapters_in_traffic"] == 1
