"""The roofline of decoding: one sequence cannot decode faster than memory bandwidth divided
by the bytes of weights read per step (every weight, once), and how close a release's
measured single-stream and batched rates come to it.

    ceiling (tokens/s per sequence) = bandwidth / (parameters x bytes per weight)

70B parameters in FP16 (2 bytes) on 2,000 GB/s: 2000e9 / 140e9 = about 14 tokens/s.
Quantisation raises the ceiling (INT8 halves the bytes, doubling it); batching shares each
read among the sequences of the batch, so c sequences together can reach c x the ceiling
before compute or KV-cache reads bind.

The bandwidth is the accelerator's where there is one (a device-to-device copy on the first
CUDA device torch sees, timed with CUDA events), else the host's RAM (a numpy copy); `memory`
picks either, and `--bandwidth-gbs` gives a figure by hand.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Literal, TypedDict

import numpy as np
from pydantic import BaseModel, Field

from releasekit.capacity.plan import (
    BenchResult,
    CapacityError,
    CapacityEvidenceError,
    PointResult,
    Step,
    num,
    read_bench,
    read_release_manifest,
    release_files,
    release_model_dir,
)
from releasekit.config import Settings
from releasekit.spec.hostcaps import nvidia_gpus

#: At or above this share of the ceiling, a single stream is called bandwidth-bound.
BANDWIDTH_BOUND_SHARE = 0.5
#: Above this share, the figures cannot all be right (weights in cache, bandwidth too low).
ABOVE_CEILING_SHARE = 1.05

Nearest = Literal["bandwidth", "compute/overhead", "above the ceiling", "not measured"]
BandwidthSource = Literal["given", "measured on this host", "measured on the accelerator"]
Memory = Literal["auto", "host", "accelerator"]


class Roofline(BaseModel):
    """The bandwidth ceiling of decoding beside the measured decode rates."""

    release_id: str | None = None
    model_dir: str | None = None
    weight_files: list[str] = Field(default_factory=list)
    weight_bytes: float = Field(description="bytes read per decode step: every weight once")
    params: float | None = None
    bytes_per_weight: float | None = None
    bandwidth_gbs: float = Field(description="memory bandwidth, GB/s (1e9 bytes)")
    bandwidth_source: BandwidthSource
    accelerator: str | None = Field(None, description="the device measured, when one was")
    ceiling_tokens_per_s: float = Field(description="bandwidth / weight bytes, per sequence")
    single_stream_tokens_per_s: float | None = Field(
        None, description="measured decode rate of one sequence (bench at concurrency 1)"
    )
    single_stream_source: str | None = None
    single_stream_share: float | None = Field(None, description="single stream / ceiling")
    knee_concurrency: float | None = None
    batched_tokens_per_s: float | None = Field(
        None, description="output tokens/s of the whole batch at the knee"
    )
    batched_ceiling_tokens_per_s: float | None = Field(
        None, description="knee concurrency x ceiling (each read shared by the batch)"
    )
    batched_share: float | None = None
    batching_gain: float | None = Field(None, description="batched / single-stream rate")
    nearest: Nearest
    verdict: str
    steps: list[Step]
    notes: list[str] = Field(default_factory=list)


def ceiling_tokens_per_s(weight_bytes: float, bandwidth_gbs: float) -> float:
    """Tokens/s one sequence can decode at most: bandwidth / bytes read per step."""
    return bandwidth_gbs * 1e9 / weight_bytes


def measure_bandwidth_gbs(*, megabytes: int = 256, repeats: int = 5) -> float:
    """This host's memory bandwidth in GB/s from a numpy copy of `megabytes` (bytes read plus
    bytes written, the STREAM "copy" convention), best of `repeats` runs; about a second."""
    n = max(1, megabytes * 2**20 // 8)
    src = np.ones(n, dtype=np.float64)
    dst = np.zeros_like(src)  # both touched first, so page faults stay out of the timing
    best = math.inf
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / max(best, 1e-9) / 1e9


def measure_accelerator_bandwidth_gbs(
    *, megabytes: int = 1024, repeats: int = 10
) -> tuple[float, str] | None:
    """The first CUDA device's memory bandwidth in GB/s from a device-to-device copy of
    `megabytes` (bytes read plus written, as measure_bandwidth_gbs), best of `repeats`, with
    the device's name; None where the NVIDIA driver lists no GPU or torch sees none (torch is
    imported only when the driver lists one)."""
    if not nvidia_gpus():
        return None
    return device_copy_bandwidth_gbs(megabytes=megabytes, repeats=repeats)


def device_copy_bandwidth_gbs(
    *, megabytes: int = 1024, repeats: int = 10
) -> tuple[float, str] | None:
    """measure_accelerator_bandwidth_gbs without asking the driver first: None where torch
    has no CUDA device."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    n = max(1, megabytes * 2**20 // 4)
    src = torch.ones(n, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: allocation and first touch stay out of the timing
    best = math.inf
    for _ in range(max(1, repeats)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return 2 * src.numel() * 4 / max(best, 1e-9) / 1e9, torch.cuda.get_device_name(0)


def weight_files_of(model_dir: Path) -> list[Path]:
    """The safetensors files of a model folder (hidden files left out)."""
    return sorted(
        p
        for p in model_dir.rglob("*.safetensors")
        if p.is_file() and not any(s.startswith(".") for s in p.relative_to(model_dir).parts)
    )


#: Bytes per element of the floating-point safetensors dtypes, and of the serving dtypes.
_STORED_FLOAT_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
_SERVED_FLOAT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_MAX_HEADER = 100 * 2**20


def _header(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if not 0 < n <= _MAX_HEADER:
            raise ValueError(f"header length {n}")
        data = json.loads(f.read(n))
    if not isinstance(data, dict):
        raise ValueError("header is not a mapping")
    return data


def served_weight_bytes(files: list[Path], dtype: str | None) -> tuple[float, str | None]:
    """Bytes one decode step reads from these weights when served in `dtype` (the manifest's
    model.dtype): floating-point tensors count at the serving dtype's width (a float32 file
    served as bfloat16 reads half its bytes), every other tensor (packed or integer
    quantised weights, FP8) at its stored size. Falls back to the file sizes, with a note
    saying so, when a header cannot be read or the dtype is 'auto'/unknown."""
    sizes = float(sum(f.stat().st_size for f in files))
    width = _SERVED_FLOAT_BYTES.get(dtype or "")
    if width is None:
        return sizes, f"weight bytes are the file sizes (serving dtype {dtype or 'unknown'})"
    total = 0.0
    converted: set[str] = set()
    try:
        for f in files:
            for name, t in _header(f).items():
                if name == "__metadata__":
                    continue
                start, end = t["data_offsets"]
                stored = _STORED_FLOAT_BYTES.get(t["dtype"])
                if stored is None:
                    total += end - start
                else:
                    total += (end - start) / stored * width
                    if stored != width:
                        converted.add(t["dtype"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return sizes, f"weight bytes are the file sizes (unreadable safetensors header: {exc})"
    if converted:
        return total, (
            f"{', '.join(sorted(converted))} tensors are read as {dtype}: "
            f"{total / sizes:.0%} of the files' {_gb(sizes)}"
        )
    return total, None


def _check(flag: str, v: float | None) -> None:
    if v is not None and (not math.isfinite(v) or v <= 0):
        raise CapacityError(f"--{flag} must be a positive number (got {v:g})")


def _params(v: float) -> str:
    for scale, word in ((1e12, "trillion"), (1e9, "billion"), (1e6, "million")):
        if v >= scale:
            return f"{v / scale:.3g} {word}"
    return num(v)


def _gb(v: float) -> str:
    return f"{v / 1e9:.3g} GB" if v >= 1e8 else f"{v / 1e6:.3g} MB"


def _bandwidth(
    given: float | None, memory: Memory = "auto"
) -> tuple[float, BandwidthSource, str | None]:
    _check("bandwidth-gbs", given)
    if given is not None:
        return given, "given", None
    if memory != "host":
        device = measure_accelerator_bandwidth_gbs()
        if device is not None:
            return device[0], "measured on the accelerator", device[1]
        if memory == "accelerator":
            raise CapacityError(
                "no accelerator to measure: the NVIDIA driver lists no GPU, or torch sees none",
                remedy="leave out --memory accelerator (the host's bandwidth is measured), or "
                "give --bandwidth-gbs",
            )
    return measure_bandwidth_gbs(), "measured on this host", None


class _MemoryRead(TypedDict):
    """What `roofline_of` takes of the memory the weights are read from: its bandwidth,
    where that figure came from, and the step that counts the bytes read."""

    bandwidth_gbs: float
    bandwidth_source: BandwidthSource
    accelerator: str | None
    steps: list[Step]


def _memory_read(
    weight_bytes: float, counted: str, bandwidth_gbs: float | None, memory: Memory
) -> _MemoryRead:
    """`bandwidth_gbs`, or the measured bandwidth of `memory`, and the step "bytes read per
    step": `weight_bytes`, as `counted` says they were counted."""
    bandwidth, source, accelerator = _bandwidth(bandwidth_gbs, memory)
    step = Step(name="bytes read per step", working=counted, value=weight_bytes, unit="bytes")
    return _MemoryRead(
        bandwidth_gbs=bandwidth, bandwidth_source=source, accelerator=accelerator, steps=[step]
    )


def _verdict(share: float | None) -> tuple[Nearest, str]:
    if share is None:
        return "not measured", "no single-stream measurement: only the ceiling is known"
    pct = f"{share:.0%}" if share >= 0.01 else f"{share:.1%}"
    if share > ABOVE_CEILING_SHARE:
        return (
            "above the ceiling",
            f"single stream runs at {pct} of the bandwidth ceiling, which cannot be: the "
            "weights fit in a cache, or the bandwidth is underestimated (give --bandwidth-gbs)",
        )
    if share >= BANDWIDTH_BOUND_SHARE:
        return (
            "bandwidth",
            f"single stream reaches {pct} of the bandwidth ceiling: bandwidth-bound; fewer "
            "bytes per weight (quantisation) or faster memory raise it",
        )
    return (
        "compute/overhead",
        f"single stream reaches {pct} of the bandwidth ceiling: compute/overhead-bound, not "
        "bandwidth-bound",
    )


def _single_stream(bench: BenchResult) -> tuple[PointResult | None, float | None, str | None]:
    one = [p for p in bench.points if bench.mode == "concurrency" and p.load == 1 and p.ok]
    if not one:
        return None, None, None
    p = one[0]
    # A bursty stream has no measurable TPOT (the bench leaves it empty): fall back to the
    # point's output rate, which counts TTFT too and so understates decode.
    if p.tpot_measurable and p.tpot.mean and p.tpot.mean > 0:
        return p, 1.0 / p.tpot.mean, "1 / mean TPOT at concurrency 1"
    if p.output_token_throughput > 0:
        return p, p.output_token_throughput, "output tokens/s at concurrency 1 (TTFT included)"
    return p, None, None


def roofline_of(
    weight_bytes: float,
    *,
    bandwidth_gbs: float,
    bandwidth_source: BandwidthSource = "given",
    accelerator: str | None = None,
    bench: BenchResult | None = None,
    steps: list[Step] | None = None,
    params: float | None = None,
    bytes_per_weight: float | None = None,
    release_id: str | None = None,
    model_dir: Path | None = None,
    weight_files: list[str] | None = None,
    notes: list[str] | None = None,
) -> Roofline:
    """The ceiling for `weight_bytes` at `bandwidth_gbs`, beside a bench's single-stream rate
    (concurrency 1) and batched rate (the knee) when a bench is given."""
    _check("bandwidth-gbs", bandwidth_gbs)
    steps = list(steps or [])
    notes = list(notes or [])
    ceiling = ceiling_tokens_per_s(weight_bytes, bandwidth_gbs)
    steps.append(
        Step(
            name="bandwidth ceiling",
            working=f"{num(bandwidth_gbs)} GB/s ({bandwidth_source}"
            + (f", {accelerator}" if accelerator else "")
            + f") / {_gb(weight_bytes)}",
            value=ceiling,
            unit="tokens/s per sequence",
        )
    )
    single = single_src = share = None
    knee_c = batched = batched_ceiling = batched_share = gain = None
    if bench is not None:
        _, single, single_src = _single_stream(bench)
        if single is not None:
            share = single / ceiling
            steps.append(
                Step(
                    name="single stream (measured)",
                    working=f"{single_src}: {num(single)} tokens/s = {share:.1%} of {num(ceiling)}",
                    value=single,
                    unit="tokens/s",
                )
            )
        else:
            notes.append("the sweep has no completed point at concurrency 1: no single stream")
        knee = bench.knee
        if knee is not None and knee.output_token_throughput > 0:
            knee_c = knee.load if bench.mode == "concurrency" else None
            if knee_c is None and knee.e2e.mean:
                knee_c = knee.load * knee.e2e.mean  # open loop: Little's law
            batched = knee.output_token_throughput
            if knee_c:
                batched_ceiling = knee_c * ceiling
                batched_share = batched / batched_ceiling
            gain = batched / single if single else None
            steps.append(
                Step(
                    name="batched at the knee (measured)",
                    working=f"{num(batched)} tokens/s at concurrency {num(knee_c or 0)}"
                    + (
                        f" = {batched_share:.1%} of {num(knee_c or 0)} x {num(ceiling)}"
                        if batched_share is not None
                        else ""
                    ),
                    value=batched,
                    unit="tokens/s (whole batch)",
                )
            )
        elif knee is None:
            notes.append("the sweep has no knee: no batched rate")
    nearest, verdict = _verdict(share)
    if gain is not None and knee_c:
        verdict += (
            f"; batching {num(knee_c)} sequences at the knee gives {gain:.1f}x the single "
            f"stream, {batched_share:.0%} of the batched ceiling"
        )
    return Roofline(
        release_id=release_id,
        model_dir=str(model_dir) if model_dir is not None else None,
        weight_files=weight_files or [],
        weight_bytes=weight_bytes,
        params=params,
        bytes_per_weight=bytes_per_weight,
        bandwidth_gbs=bandwidth_gbs,
        bandwidth_source=bandwidth_source,
        accelerator=accelerator,
        ceiling_tokens_per_s=ceiling,
        single_stream_tokens_per_s=single,
        single_stream_source=single_src,
        single_stream_share=share,
        knee_concurrency=knee_c,
        batched_tokens_per_s=batched,
        batched_ceiling_tokens_per_s=batched_ceiling,
        batched_share=batched_share,
        batching_gain=gain,
        nearest=nearest,
        verdict=verdict,
        steps=steps,
        notes=notes,
    )


def roofline_by_hand(
    *,
    params: float,
    bytes_per_weight: float,
    bandwidth_gbs: float | None = None,
    memory: Memory = "auto",
) -> Roofline:
    """The ceiling for a model of `params` weights at `bytes_per_weight` (2 for FP16/BF16, 1
    for INT8, 0.5 for 4-bit), on `bandwidth_gbs` or, when None, the measured
    bandwidth of `memory` (auto: the accelerator's when there is one, else the host's).

    Raises CapacityError for a zero, negative or non-finite figure.
    """
    _check("params", params)
    _check("bytes-per-weight", bytes_per_weight)
    weight_bytes = params * bytes_per_weight
    counted = f"{_params(params)} parameters x {num(bytes_per_weight)} bytes"
    return roofline_of(
        weight_bytes,
        **_memory_read(weight_bytes, counted, bandwidth_gbs, memory),
        params=params,
        bytes_per_weight=bytes_per_weight,
    )


def roofline_release(
    settings: Settings,
    release_id: str,
    *,
    bandwidth_gbs: float | None = None,
    memory: Memory = "auto",
) -> Roofline:
    """A release's ceiling from its real weight files (the safetensors in the folder it
    serves: results/<release_id>/model for a quantised release, else the manifest's model
    source; floating-point tensors counted at the manifest's serving dtype, see
    served_weight_bytes) and `bandwidth_gbs` or the measured bandwidth of `memory` (auto: the
    accelerator's when there is one, else the host's), beside its
    bench's single-stream and knee rates (when it has a bench).

    Raises CapacityEvidenceError when the release has no model folder or no weight files.
    """
    _check("bandwidth-gbs", bandwidth_gbs)
    rf = release_files(settings, release_id)
    lm = read_release_manifest(settings, release_id, rf)
    model_dir = release_model_dir(settings, release_id, lm, rf)
    files = weight_files_of(model_dir)
    if not files:
        raise CapacityEvidenceError(
            f"no .safetensors weight files in {model_dir} (release {release_id[:12]})",
            remedy="build the release, or give --params and --bytes-per-weight by hand",
        )
    dtype = lm.manifest.model.dtype if lm is not None else None
    weight_bytes, note = served_weight_bytes(files, dtype)
    notes: list[str] = [
        "every tensor counts, though a step reads only one row of the input embedding per "
        "sequence, so the ceiling is a little low"
    ]
    if note:
        notes.insert(0, note)
    if rf.note:
        notes.insert(0, rf.note)
    try:
        bench: BenchResult | None = read_bench(settings, release_id, rf)
    except CapacityEvidenceError as exc:
        if rf.evidence is not None and rf.evidence.file_problem("bench"):
            raise  # not as signed: refused, not shown as "no bench"
        bench = None
        notes.append(f"{exc.message}: only the ceiling is shown")
    counted = f"{len(files)} safetensors file(s) in {model_dir}" + (
        f", served as {dtype}" if dtype else ""
    )
    return roofline_of(
        weight_bytes,
        **_memory_read(weight_bytes, counted, bandwidth_gbs, memory),
        bench=bench,
        release_id=release_id,
        model_dir=model_dir,
        weight_files=[f.relative_to(model_dir).as_posix() for f in files],
        notes=notes,
    )
