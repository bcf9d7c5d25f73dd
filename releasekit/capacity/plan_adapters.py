"""The load test a plan reads for a release with LoRA adapters: the sweep with as many adapters
in traffic as the release carries, in place of the base's own sweep."""

from __future__ import annotations

from releasekit.bench.result import AdapterSweep, BenchResult


def in_traffic(k: int) -> str:
    """`with k adapter(s) in traffic`."""
    return f"with {k} adapter{'s' if k != 1 else ''} in traffic"


def adapters_label(k: int) -> str:
    """How a plan names the knee it planned from."""
    return f"knee {in_traffic(k)}"


def adapter_bench(bench: BenchResult) -> tuple[BenchResult, AdapterSweep | None]:
    """`bench` as a plan reads it: for a release with adapters and a sweep with that many in
    traffic (`BenchResult.adapter_sweep`), that sweep's points and knee (one run) over the
    same profile, host and SLOs; otherwise `bench` itself and None."""
    sweep = bench.adapter_sweep
    if sweep is None:
        return bench, None
    knee = sweep.knee
    view = bench.model_copy(
        update={
            "models": sweep.models,
            "points": sweep.points,
            "knee": knee,
            "repetitions": 1,
            "knee_stable": False,
            "knee_by_repetition": [knee.load if knee is not None else None],
            "knee_stop": sweep.knee_stop,
            "knee_rule": sweep.knee_rule,
            "flagged_points": [p.load for p in sweep.points if not p.trusted],
            "client_cpu_s": sweep.client_cpu_s,
            "adapter_sweeps": [],
        }
    )
    return view, sweep


def adapter_note(bench: BenchResult, sweep: AdapterSweep) -> str:
    """What the plan says about the sweep it planned from, with the base alone beside it."""
    names = ", ".join(bench.adapters)
    base = bench.knee
    alone = (
        f"the base alone has its knee at {base.load:g}"
        if base is not None
        else "the base alone has no knee"
    )
    return (
        f"planned from the {adapters_label(sweep.adapters)} (the release carries {names}; "
        f"requests spread round-robin over {', '.join(sweep.models)}, one run); {alone}"
    )
