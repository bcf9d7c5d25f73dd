"""Sweeps with LoRA adapters in traffic: for 1 to the engine's max-loras adapters, the
profile's points run once with requests spread round-robin over the base and that many
adapters on the same engine, extra copies of the release's adapters loaded (and unloaded
after) where it carries fewer."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from pathlib import Path

from releasekit._support.progress import Progress
from releasekit.bench.result import AdapterSweep, BenchResult
from releasekit.bench.runner import run_bench
from releasekit.errors import ReleasekitError
from releasekit.serving.adapters import load_adapter, unload_adapter
from releasekit.spec.loadprofile import LoadProfile

DEFAULT_MAX_LORAS = 1
"""vLLM's max-loras when the serving arguments do not set it."""


def max_loras_of(args: Mapping[str, str]) -> int:
    """The engine's max-loras from its serving arguments (vLLM's default, 1, when unset)."""
    raw = args.get("max-loras") or args.get("max_loras")
    try:
        return max(1, int(raw)) if raw else DEFAULT_MAX_LORAS
    except ValueError:
        return DEFAULT_MAX_LORAS


def copy_name(name: str, i: int) -> str:
    """The model name of the `i`-th extra copy of adapter `name` (from 1)."""
    return f"{name}-copy{i}"


def _labelled(progress: Progress | None, k: int) -> Progress | None:
    if progress is None:
        return None
    prefix = f"{k} adapter{'s' if k != 1 else ''} in traffic: "

    def say(label: str, done: int, total: int) -> None:
        progress(prefix + label, done, total)

    return say


def sweep_of(result: BenchResult, k: int, copies: list[str]) -> AdapterSweep:
    """What an adapter sweep keeps of its run: the points, the knee and its figures."""
    knee = result.knee
    models = result.models or [result.model]
    return AdapterSweep(
        adapters=k,
        models=models,
        copies=[m for m in models if m in copies],
        points=result.points,
        knee=knee,
        knee_stop=result.knee_stop,
        knee_rule=result.knee_rule,
        ttft_p95_s_at_knee=knee.ttft.p95 if knee is not None else None,
        goodput_at_knee=knee.goodput if knee is not None else None,
        client_cpu_s=result.client_cpu_s,
    )


def run_adapter_sweeps(
    base_url: str,
    base_model: str,
    adapters: Mapping[str, Path],
    profile: LoadProfile,
    *,
    max_loras: int,
    api_key: str | None = None,
    max_num_seqs: int | None = None,
    progress: Progress | None = None,
    bench: Callable[..., BenchResult] = run_bench,
) -> list[AdapterSweep]:
    """For k = 1 .. `max_loras`: the profile's points, one run, requests round-robin over
    `base_model` and k adapters, on the engine at `base_url`, which already holds
    `adapters` (model name -> the folder it loaded). The release's own adapters go first,
    in order; for k above their count, extra copies (`<name>-copy<i>`, the same folder) are
    loaded into the engine, which treats each name as its own LoRA slot, and unloaded when
    the sweeps end, also on failure. No adapters: no sweeps.

    Raises what `run_bench` raises; AdapterLoadError when the engine refuses a copy."""
    names = list(adapters)
    if not names:
        return []
    copies: dict[str, Path] = {}
    sweeps: list[AdapterSweep] = []
    ok = False
    try:
        for k in range(1, max_loras + 1):
            i = len(copies)
            while len(names) + len(copies) < k:
                i += 1
                src = names[(i - 1) % len(names)]
                name = copy_name(src, i)
                if name in adapters:
                    continue
                load_adapter(base_url, name, adapters[src], api_key=api_key)
                copies[name] = adapters[src]
            models = [base_model, *[*names, *copies][:k]]
            result = bench(
                base_url,
                models,
                profile,
                repetitions=1,
                api_key=api_key,
                max_num_seqs=max_num_seqs,
                progress=_labelled(progress, k),
            )
            sweeps.append(sweep_of(result, k, list(copies)))
        ok = True
    finally:
        for name in copies:
            if ok:
                unload_adapter(base_url, name, api_key=api_key)
            else:  # the sweep's own error is the one to report
                with contextlib.suppress(ReleasekitError):
                    unload_adapter(base_url, name, api_key=api_key)
    return sweeps
