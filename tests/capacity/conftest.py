"""Fixtures for capacity tests: a release folder whose bench.json the real bench writer wrote,
from request records with known timings, so the knee and its figures are known exactly."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from releasekit.bench import BenchResult, RequestRecord, find_knee, write_evidence
from releasekit.bench.scrape import HistogramWindow, ServerDelta
from releasekit.bench.stats import (
    PointResult,
    combine_runs,
    knee_is_stable,
    knee_stop,
    knees_by_repetition,
    point_result,
)
from releasekit.config import Settings, load_settings
from releasekit.spec.loadprofile import SLO

REPO = Path(__file__).resolve().parents[2]
RELEASE_ID = "ab" * 32
SLO_USED = SLO(ttft_s=1.0, attainment=0.9, max_error_rate=0.01)
PROMPT_TOKENS = 32
OUTPUT_TOKENS = 48
N_PER_RUN = 32
REPETITIONS = 2
#: (concurrency, E2E s, TTFT s) of each point; TTFT 2 s at c=32 breaks the 1 s SLO.
SHAPES = [(1, 0.5, 0.1), (4, 0.6, 0.1), (8, 0.8, 0.2), (16, 1.0, 0.3), (32, 3.0, 2.0)]


def _window(n: int, mean: float) -> HistogramWindow:
    return HistogramWindow(
        count=n, mean_s=mean, sum_s=mean * n, buckets=[(mean * 2, n), (math.inf, n)]
    )


def run_records(idx: int, rep: int, c: int, *, e2e: float, ttft: float) -> list[RequestRecord]:
    """N_PER_RUN requests at concurrency c, sent in waves of c, each taking `e2e` s with its
    first token at `ttft` and one token per chunk after it."""
    step = (e2e - ttft) / (OUTPUT_TOKENS - 1)
    return [
        RequestRecord(
            point=idx,
            index=i,
            repetition=rep,
            sent_s=(i // c) * e2e,
            chunk_s=[ttft + k * step for k in range(OUTPUT_TOKENS)],
            end_s=e2e,
            prompt_words=24,
            max_tokens=OUTPUT_TOKENS,
            prompt_tokens=PROMPT_TOKENS,
            output_tokens=OUTPUT_TOKENS,
            status="ok",
        )
        for i in range(N_PER_RUN)
    ]


def make_bench(
    *,
    knee_duration_s: float | None = None,
    release_id: str = RELEASE_ID,
    max_num_seqs: int | None = 32,
) -> BenchResult:
    """The sweep SHAPES, run twice, each run cross-checked against a server delta that agrees
    with the client, pooled with the bench's own combine_runs: its SLOs (TTFT <= 1 s) hold up
    to c=16, so the knee is c=16 with mean E2E 1.0 s and Little's law gives 16 req/s.
    `knee_duration_s` stretches each run of the knee point (its measured rate drops)."""
    points: list[PointResult] = []
    records: list[RequestRecord] = []
    for idx, (c, e2e, ttft) in enumerate(SHAPES):
        runs: list[PointResult] = []
        recs_all: list[RequestRecord] = []
        for rep in range(REPETITIONS):
            recs = run_records(idx, rep, c, e2e=e2e, ttft=ttft)
            waves = -(-N_PER_RUN // c)
            duration = knee_duration_s if (c == 16 and knee_duration_s) else waves * e2e
            server = ServerDelta(
                interval_s=duration + 0.1,
                generation_tokens=float(N_PER_RUN * OUTPUT_TOKENS),
                requests_succeeded=float(N_PER_RUN),
                histograms={"ttft": _window(N_PER_RUN, ttft), "e2e": _window(N_PER_RUN, e2e)},
                running_peak=float(min(c, max_num_seqs or c)),
                gauge_samples=4,
            )
            runs.append(
                point_result(
                    recs,
                    load=c,
                    mode="concurrency",
                    duration_s=duration,
                    slo=SLO_USED,
                    server=server,
                    max_num_seqs=max_num_seqs,
                    repetition=rep,
                )
            )
            recs_all.extend(recs)
        points.append(combine_runs(runs, recs_all, slo=SLO_USED, max_num_seqs=max_num_seqs))
        records.extend(recs_all)
    knee = find_knee(points)
    return BenchResult(
        release_id=release_id,
        profile_name="capacity-test",
        model="demo",
        base_url="http://127.0.0.1:20999",
        api="completions",
        mode="concurrency",
        slo=SLO_USED,
        started_at="2026-12-01T09:00:00+00:00",
        tokens_per_word=1.3,
        repetitions=REPETITIONS,
        max_num_seqs=max_num_seqs,
        points=points,
        knee=knee,
        knee_stable=knee_is_stable(points, knee),
        knee_by_repetition=knees_by_repetition(points),
        knee_stop=knee_stop(points),
        flagged_points=[p.load for p in points if not p.trusted],
        requests=records,
    )


@pytest.fixture
def settings_cap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """Settings rooted at a temp folder (also for the CLI, through RELEASEKIT_ROOT)."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for key in list(os.environ):
        if key.startswith("RELEASEKIT_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("RELEASEKIT_CONFIG", str(tmp_path / "releasekit.toml"))
    monkeypatch.setenv("RELEASEKIT_ROOT", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "manifests").mkdir()  # what makes a folder a releasekit project
    return load_settings(root=tmp_path)


@pytest.fixture
def release_id() -> str:
    """The id of the release `write_release` writes."""
    return RELEASE_ID


@pytest.fixture
def bench_factory() -> Callable[..., BenchResult]:
    """`bench_factory(knee_duration_s=None)`: the known sweep as a BenchResult (make_bench)."""
    return make_bench


@pytest.fixture
def write_release(settings_cap: Settings) -> Callable[..., Path]:
    """`write_release(max_num_seqs=32, knee_duration_s=None, weights_bytes=None)` writes
    results/<RELEASE_ID>/ with bench/ (the real writer) and a manifest copy (the demo bf16
    manifest with that max-num-seqs); with `weights_bytes`, a model folder holding one
    safetensors file of that size. Returns the release folder."""

    def make(
        *,
        max_num_seqs: int | None = 32,
        knee_duration_s: float | None = None,
        weights_bytes: int | None = None,
    ) -> Path:
        rdir = settings_cap.release_dir(RELEASE_ID)
        bench = make_bench(knee_duration_s=knee_duration_s, max_num_seqs=max_num_seqs)
        write_evidence(bench, rdir / "bench")
        data = yaml.safe_load((REPO / "manifests" / "demo-bf16.yaml").read_text())
        args = dict(data.get("serving", {}).get("args", {}))
        args.pop("max-num-seqs", None)
        if max_num_seqs is not None:
            args["max-num-seqs"] = max_num_seqs
        data.setdefault("serving", {})["args"] = args
        data["model"]["source"] = "models/demo-base"
        (rdir / "manifest.yaml").write_text(yaml.safe_dump(data))
        if weights_bytes is not None:
            model = settings_cap.root / "models" / "demo-base"
            model.mkdir(parents=True, exist_ok=True)
            with (model / "model.safetensors").open("wb") as f:
                f.truncate(weights_bytes)
            (model / "config.json").write_text("{}")
        return rdir

    return make
