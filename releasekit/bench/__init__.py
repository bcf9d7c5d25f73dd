"""Load testing: a streaming load generator, latency/throughput statistics, server-side
metric deltas, the knee of a sweep and its plot.

    result = run_bench("http://127.0.0.1:8000", "demo", load_profile(path))
    write_outputs(result, Path("results/<release_id>/bench"))
"""

from __future__ import annotations

from releasekit.bench.loadgen import RequestRecord
from releasekit.bench.runner import (
    BenchResult,
    bench_release,
    load_bench,
    point_label,
    run_bench,
    write_outputs,
)
from releasekit.bench.scrape import ServerDelta
from releasekit.bench.stats import LatencySummary, PointResult, find_knee

__all__ = [
    "BenchResult",
    "LatencySummary",
    "PointResult",
    "RequestRecord",
    "ServerDelta",
    "bench_release",
    "find_knee",
    "load_bench",
    "point_label",
    "run_bench",
    "write_outputs",
]
