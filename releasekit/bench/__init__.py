"""Load testing: a streaming load generator, latency/throughput statistics, server-side
metric deltas, the cross-check of the client against the server, the knee of a repeated
sweep (and whether it is stable) and its plot; for a release with LoRA adapters, sweeps with
1 to max-loras adapters in traffic and what each costs against the base alone.

    result = run_bench("http://127.0.0.1:8000", "demo", load_profile(path))
    write_outputs(result, Path("results/<release_id>/bench"))  # evidence and its plot
"""

from __future__ import annotations

from releasekit.bench.adapter_cost import AdapterCostRow, adapter_cost
from releasekit.bench.loadgen import LoadClient, RequestRecord
from releasekit.bench.release import bench_release
from releasekit.bench.result import AdapterSweep
from releasekit.bench.runner import (
    DEFAULT_REPETITIONS,
    BenchResult,
    load_bench,
    point_label,
    profile_repetitions,
    run_bench,
    write_evidence,
    write_outputs,
)
from releasekit.bench.scrape import ServerDelta
from releasekit.bench.stats import (
    CrossCheck,
    LatencySummary,
    PointFlag,
    PointResult,
    RunSummary,
    Spread,
    find_knee,
)

__all__ = [
    "DEFAULT_REPETITIONS",
    "AdapterCostRow",
    "AdapterSweep",
    "BenchResult",
    "CrossCheck",
    "LatencySummary",
    "LoadClient",
    "PointFlag",
    "PointResult",
    "RequestRecord",
    "RunSummary",
    "ServerDelta",
    "Spread",
    "adapter_cost",
    "bench_release",
    "find_knee",
    "load_bench",
    "point_label",
    "profile_repetitions",
    "run_bench",
    "write_evidence",
    "write_outputs",
]
