"""Run a load profile against a server (warm-up, then the sweep `repetitions` times, each run
of a point bracketed by /metrics scrapes and cross-checked against them), pool each point's
runs with their spread, choose the knee and say whether reruns agree on it, write and read
the outputs. Benching a locked release on its own vLLM server is `bench.release`."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import os
import tempfile
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from itertools import islice
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from pydantic import ValidationError

from releasekit._support.files import write_atomic
from releasekit._support.http import async_http_client
from releasekit._support.progress import (
    Progress,
)
from releasekit.bench.loadgen import (
    LoadClient,
    LoopLag,
    RawResult,
    RequestRecord,
    RequestSpec,
    api_path,
    auth_headers,
    check_server,
    iter_specs,
    run_closed_loop,
    run_open_loop,
    tokens_per_word,
)
from releasekit.bench.result import BenchResult
from releasekit.bench.scrape import Scrape, fetch, server_delta
from releasekit.bench.stats import (
    PointResult,
    combine_runs,
    find_knee,
    knee_is_stable,
    knee_stop,
    knees_by_repetition,
    noisy_keys,
    point_result,
    runs_needed,
)
from releasekit.bench.streams import to_record
from releasekit.errors import BenchError
from releasekit.spec.loadprofile import LoadProfile
from releasekit.spec.measured import measure_host

PointCallback = Callable[[PointResult], None]

BENCH_JSON = "bench.json"
BENCH_PNG = "bench.png"
REQUESTS_JSONL = "requests.jsonl"
_WARMUP_KEY = 1_000_003
_WARMUP_CONCURRENCY = 4
_SETTLE_S = 0.1  # lets the server's stats logger count the last step before the scrape
_GAUGE_MIN_S = 0.05
_GAUGE_MAX_S = 0.5
DEFAULT_REPETITIONS = 3
"""Sweeps run this often unless the profile (`sweep.repetitions`) or the caller says."""


def knee_in_flight(bench: BenchResult) -> float | None:
    """Requests in flight on one server at the sweep's knee (the highest load whose SLOs
    held): the knee's concurrency in a closed-loop sweep, its arrival rate x mean E2E
    (Little's law) in an open-loop one; None without a knee or a completed request there."""
    knee = bench.knee
    if knee is None or knee.ok == 0:
        return None
    if bench.mode == "concurrency":
        return knee.load
    e2e = knee.e2e.mean
    return knee.load * e2e if e2e is not None and e2e > 0 else None


def knee_rule(share: float, repetitions: int) -> str:
    """The knee rule of a sweep, in words."""
    need = runs_needed(repetitions, share)
    return (
        f"the highest load, with every lighter load holding too, whose SLOs held with no "
        f"flag in at least {need} of its {repetitions} runs"
    )


def point_label(mode: str, load: float) -> str:
    """How a load point is named in progress and tables."""
    return f"concurrency {load:g}" if mode == "concurrency" else f"rate {load:g} req/s"


def profile_repetitions(profile: LoadProfile) -> int:
    """How often to run the sweep: the profile's `sweep.repetitions`."""
    return profile.sweep.repetitions


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    # uvloop (a vLLM dependency) makes the client cheaper per chunk; plain asyncio works.
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def _run_async(coro: Coroutine[Any, Any, BenchResult]) -> BenchResult:
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        return runner.run(coro)


def run_bench(
    base_url: str,
    model: str | Sequence[str],
    profile: LoadProfile,
    *,
    release_id: str | None = None,
    profile_digest: str | None = None,
    progress: Progress | None = None,
    on_point: PointCallback | None = None,
    gauge_interval_s: float | None = None,
    api_key: str | None = None,
    repetitions: int | None = None,
    max_num_seqs: int | None = None,
) -> BenchResult:
    """Run `profile` against the OpenAI-compatible server at `base_url` serving `model`.
    Given a list of model names (a base and its LoRA adapters), each point's requests are
    spread over them round-robin (request i asks for model i mod n; the same in every run),
    and the result is recorded under the first.

    Warm-up requests run first and are excluded from statistics. The sweep then runs
    `repetitions` times (default: `profile_repetitions(profile)`); every run of a point is
    bracketed by /metrics scrapes (server deltas), gauges are sampled during it (every
    `gauge_interval_s`; default: a few samples per point), and its client figures are
    cross-checked against the server's (`stats.cross_check`; `max_num_seqs`, when known,
    bounds the running requests expected). Each point's runs are pooled, with their spread;
    the knee needs the SLOs to hold in every run and no flag.

    `progress(label, done, total)` is called as requests finish (total 0 when the point is
    bounded by time only); `on_point` receives each point's pooled result once its last
    repetition is done. `api_key` is sent as a bearer token, for servers started with
    --api-key.

    Raises ServerUnreachableError if the server does not answer, BenchError if it does not
    serve `model` (each of them) or if no request of the whole sweep completed.
    """
    reps = repetitions if repetitions is not None else profile_repetitions(profile)
    if reps < 1:
        raise BenchError(f"repetitions must be at least 1, not {reps}")
    models = [model] if isinstance(model, str) else list(model)
    if not models:
        raise BenchError("no model to load-test: give at least one model name")
    return _run_async(
        _bench(
            base_url.rstrip("/"),
            models,
            profile,
            release_id=release_id,
            profile_digest=profile_digest,
            progress=progress,
            on_point=on_point,
            gauge_interval_s=gauge_interval_s,
            api_key=api_key,
            repetitions=reps,
            max_num_seqs=max_num_seqs,
        )
    )


async def _sample_gauges(client: LoadClient, every_s: float, out: list[Scrape]) -> None:
    while True:
        await asyncio.sleep(every_s)
        text = await client.get_text("/metrics")
        if text is not None:
            out.append(Scrape(t=time.perf_counter(), text=text))


def _gauge_every(profile: LoadProfile, requested: float | None) -> float:
    if requested is not None:
        return requested
    d = profile.sweep.duration_s
    # A few samples per point: enough to see the running peak, cheap for the server.
    return min(_GAUGE_MAX_S, max(_GAUGE_MIN_S, d / 8)) if d else _GAUGE_MAX_S


def pool_size(profile: LoadProfile) -> int:
    """Connections the client may hold: one per request it can have in flight."""
    sweep = profile.sweep
    pool = int(max(sweep.points)) if sweep.mode == "concurrency" else sweep.max_in_flight
    return max(pool, _WARMUP_CONCURRENCY)


async def _bench(
    base_url: str,
    models: list[str],
    profile: LoadProfile,
    *,
    release_id: str | None,
    profile_digest: str | None,
    progress: Progress | None,
    on_point: PointCallback | None,
    gauge_interval_s: float | None,
    api_key: str | None,
    repetitions: int,
    max_num_seqs: int | None,
) -> BenchResult:
    sweep = profile.sweep
    started_at = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    host = measure_host()
    run_start = time.perf_counter()
    cpu_start = time.process_time()
    chat = profile.api == "chat"
    path = api_path(profile)
    every = _gauge_every(profile, gauge_interval_s)
    records: list[RequestRecord] = []
    runs: dict[int, list[PointResult]] = {i: [] for i in range(len(sweep.points))}
    point_records: dict[int, list[RequestRecord]] = {i: [] for i in range(len(sweep.points))}
    points: list[PointResult] = []
    model = models[0]
    async with (
        LoadClient(
            base_url,
            max_connections=pool_size(profile),
            timeout_s=profile.request_timeout_s,
            api_key=api_key,
        ) as client,
        async_http_client(
            base_url=base_url,
            timeout=10.0,
            headers=auth_headers(api_key),
        ) as meta,
    ):
        for name in dict.fromkeys(models):
            await check_server(meta, name)
        tpw = await tokens_per_word(meta, model)

        def ticker(label: str, total: int) -> Callable[[], None] | None:
            if progress is None:
                return None
            done = 0
            progress(label, 0, total)

            def tick() -> None:
                nonlocal done
                done += 1
                progress(label, done, total)

            return tick

        warm_n = profile.warmup_requests
        warm_ok = 0
        if warm_n:
            raws = await run_closed_loop(
                client,
                path,
                iter_specs(profile, models, key=_WARMUP_KEY, tokens_per_word=tpw),
                concurrency=min(warm_n, _WARMUP_CONCURRENCY),
                requests=warm_n,
                duration_s=None,
                on_done=ticker("warm-up", warm_n),
            )
            warm = [to_record(r, point=-1, run_start=run_start, chat=chat) for r in raws]
            warm_ok = sum(1 for r in warm if r.status == "ok")
            records.extend(warm)

        def point_specs(idx: int) -> Iterable[RequestSpec]:
            # Each run of a point sends the same requests: runs differ only by the server.
            specs = iter_specs(profile, models, key=idx, tokens_per_word=tpw)
            if sweep.requests_per_point is None:
                return specs
            return list(islice(specs, sweep.requests_per_point))  # bodies before the clock

        async def run_point(idx: int, load: float, rep: int, label: str) -> None:
            result, recs = await _run_once(
                client,
                meta,
                path,
                point_specs(idx),
                profile,
                idx=idx,
                load=load,
                rep=rep,
                run_start=run_start,
                gauge_every=every,
                tick=ticker(label, sweep.requests_per_point or 0),
                max_num_seqs=max_num_seqs,
            )
            if progress is not None:  # closes time-bound bars, whose total was unknown
                progress(label, len(recs), len(recs))
            records.extend(recs)
            runs[idx].append(result)
            point_records[idx].extend(recs)

        def pool(idx: int) -> PointResult:
            return combine_runs(
                runs[idx],
                point_records[idx],
                slo=profile.slo,
                max_num_seqs=max_num_seqs,
                knee_share=sweep.knee_share,
            )

        # The whole sweep repeats (rather than each point back to back), so slow drift of a
        # shared machine spreads over every point instead of biasing one.
        for rep in range(repetitions):
            for idx, load in enumerate(sweep.points):
                label = point_label(sweep.mode, load)
                if repetitions > 1:
                    label += f" (run {rep + 1}/{repetitions})"
                await run_point(idx, load, rep, label)
                if rep < repetitions - 1:
                    continue
                pooled = pool(idx)
                noisy = noisy_keys(pooled, sweep.settle_spread) if repetitions > 1 else []
                # Runs that disagree beyond the profile's bound get more runs of the same
                # requests, back to back: from five runs one stray run on each side is set
                # aside, so one stall of a shared host does not decide the point.
                for extra in range(sweep.extra_runs if noisy else 0):
                    label = f"{point_label(sweep.mode, load)} (extra run {extra + 1}/"
                    label += f"{sweep.extra_runs}: runs disagree on {', '.join(noisy)})"
                    await run_point(idx, load, repetitions + extra, label)
                if noisy and sweep.extra_runs:
                    pooled = pool(idx)
                points.append(pooled)
                if on_point is not None:
                    on_point(pooled)

    if not any(p.ok for p in points):
        failures = [r.error for r in records if r.error and not r.warmup]
        first = failures[0] if failures else "no requests were sent"
        raise BenchError(f"no request of the sweep completed against {base_url}: {first}")
    knee = find_knee(points)
    return BenchResult(
        release_id=release_id,
        profile_digest=profile_digest,
        profile_name=profile.name,
        model=model,
        models=models if len(models) > 1 else [],
        base_url=base_url,
        api=profile.api,
        mode=sweep.mode,
        slo=profile.slo,
        started_at=started_at,
        tokens_per_word=round(tpw, 4),
        repetitions=repetitions,
        max_num_seqs=max_num_seqs,
        warmup_requests=warm_n,
        warmup_ok=warm_ok,
        points=points,
        knee=knee,
        knee_share=sweep.knee_share,
        knee_rule=knee_rule(sweep.knee_share, repetitions),
        knee_stable=knee_is_stable(points, knee, sweep.knee_share, repetitions),
        knee_by_repetition=knees_by_repetition(points, repetitions),
        knee_stop=knee_stop(points, profile.slo),
        flagged_points=[p.load for p in points if not p.trusted],
        client_cpu_s=round(time.process_time() - cpu_start, 4),
        host=host.ended(),
        requests=records,
    )


async def _run_once(
    client: LoadClient,
    meta: httpx.AsyncClient,
    path: str,
    specs: Iterable[RequestSpec],
    profile: LoadProfile,
    *,
    idx: int,
    load: float,
    rep: int,
    run_start: float,
    gauge_every: float,
    tick: Callable[[], None] | None,
    max_num_seqs: int | None,
) -> tuple[PointResult, list[RequestRecord]]:
    """One run of one load point: scrape, load, scrape, then parse and cross-check."""
    sweep = profile.sweep
    before = await fetch(meta)
    samples: list[Scrape] = []
    sampler = (
        asyncio.create_task(_sample_gauges(client, gauge_every, samples))
        if gauge_every > 0 and before is not None
        else None
    )
    cpu0 = time.process_time()
    async with LoopLag() as lag:
        if sweep.mode == "concurrency":
            raws = await run_closed_loop(
                client,
                path,
                specs,
                concurrency=int(load),
                requests=sweep.requests_per_point,
                duration_s=sweep.duration_s,
                on_done=tick,
            )
        else:
            raws = await run_open_loop(
                client,
                path,
                specs,
                rate=load,
                # The same arrival times in every repetition.
                rng=np.random.default_rng([profile.seed, idx, 7]),
                requests=sweep.requests_per_point,
                duration_s=sweep.duration_s,
                max_in_flight=sweep.max_in_flight,
                on_done=tick,
            )
    if sampler is not None:
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
    await asyncio.sleep(_SETTLE_S)
    after = await fetch(meta)
    chat = profile.api == "chat"
    recs = [to_record(r, point=idx, run_start=run_start, chat=chat, repetition=rep) for r in raws]
    # Parsing the streams is client work too: count it in the point's CPU.
    cpu = time.process_time() - cpu0
    delta = (
        server_delta(before, after, samples) if before is not None and after is not None else None
    )
    result = point_result(
        recs,
        load=load,
        mode=sweep.mode,
        duration_s=_wall(raws),
        slo=profile.slo,
        server=delta,
        client_cpu_s=cpu,
        max_num_seqs=max_num_seqs,
        repetition=rep,
        client_lag_s=lag.samples,
        client_delay_s=lag.mean_delay_s,
    )
    return result, recs


def _wall(raws: list[RawResult]) -> float:
    """First request started (scheduled or sent) to last request finished."""
    if not raws:
        return 0.0
    start = min(r.scheduled if r.scheduled is not None else r.sent for r in raws)
    end = max(r.end if r.end is not None else r.sent for r in raws)
    return end - start


def write_evidence(result: BenchResult, out_dir: Path) -> None:
    """Write what gates, plans and audits read: bench.json and requests.jsonl, each atomically
    and readable by reviewers (temp files are created 0600)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(out_dir / BENCH_JSON, (result.model_dump_json(indent=2) + "\n").encode())
    lines = "".join(r.model_dump_json() + "\n" for r in result.requests)
    write_atomic(out_dir / REQUESTS_JSONL, lines.encode())
    for name in (BENCH_JSON, REQUESTS_JSONL):
        (out_dir / name).chmod(0o644)


def write_outputs(result: BenchResult, out_dir: Path) -> None:
    """Write the evidence (`write_evidence`) and bench.png, the latency curves for people,
    atomically."""
    from releasekit.bench.plot import plot_sweep  # matplotlib: only when plotting

    write_evidence(result, out_dir)
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{BENCH_PNG}.", suffix=".png")
    os.close(fd)
    try:
        plot_sweep(result, Path(tmp))
        os.chmod(tmp, 0o644)
        os.replace(tmp, out_dir / BENCH_PNG)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_bench(path: Path) -> BenchResult:
    """Read a bench result (a bench folder or its bench.json), with its request records when
    requests.jsonl sits beside it. BenchError if missing or unreadable."""
    file = path / BENCH_JSON if path.is_dir() else path
    if not file.is_file():
        raise BenchError(f"no bench result at {file}", remedy="run `releasekit bench` first")
    try:
        result = BenchResult.model_validate_json(file.read_bytes())
        jsonl = file.parent / REQUESTS_JSONL
        if jsonl.is_file():
            result.requests = [
                RequestRecord.model_validate_json(line)
                for line in jsonl.read_text(encoding="utf-8").splitlines()
                if line.strip()
            ]
    except (ValidationError, ValueError, OSError) as exc:
        raise BenchError(f"unreadable bench result {file}: {exc}") from exc
    return result
