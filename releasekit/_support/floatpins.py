"""Pinned float code paths for torch on the CPU: the environment that keeps MKL, ATen and oneDNN
on their AVX2 kernels with fixed thread counts, the library that lets MKL take that branch on
processors that are not Intel's, and what a process actually ran.

Only processes whose float results must be the same from run to run set these (the demo's
training, quantisation on the CPU); a process that imports this module keeps its environment,
and so do the servers it starts. A vLLM server that inherited ONEDNN_MAX_CPU_ISA=AVX2 on a CPU
with AMX aborts at its first request (vLLM picks its AMX kernels by CPUID, and torch refuses
them under the cap). Nothing here imports torch until asked what ran.
"""

from __future__ import annotations

import os
from pathlib import Path

# Before torch loads its kernels: the same float code paths on every x86-64 host this project
# meets (AVX2 is common to AVX2-only, AVX-512 and AVX-512-with-AMX hosts) and from run to run.
# MKL's conditional numerical reproducibility in strict mode on its AVX2 path, with a fixed
# thread count (MKL_DYNAMIC would otherwise use fewer threads on a busy host, which changes the
# order of its sums); ATen's vectorised kernels and oneDNN on AVX2 too (AVX-512 and AMX reduce
# in other orders).
CPU_PINS: dict[str, str] = {
    "MKL_CBWR": "AVX2,STRICT",
    "MKL_DYNAMIC": "FALSE",
    "OMP_DYNAMIC": "FALSE",
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}
#: The thread-count variables a pinned process sets to its own count.
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")

# MKL takes the AVX2 branch only on processors it takes for Intel's (mkl_intel_branch.c says
# why and how): elsewhere a pinned process loads a library that answers MKL's vendor check first.
MKL_INTEL_BRANCH_C = Path(__file__).resolve().parent / "mkl_intel_branch.c"
#: MKL's branch constants (MKL_CBWR_AUTO = 2, ...), by value, for the record.
MKL_BRANCHES = {2: "AUTO", 3: "COMPATIBLE", 10: "AVX2", 12: "AVX512", 13: "AVX512_E1"}


#: Variables that would move a pinned process off its float code paths by other names (MKL's
#: instruction-set cap, oneDNN's old name for its cap): a pinned child does not inherit them.
UNPINNED_VARS = ("MKL_ENABLE_INSTRUCTIONS", "DNNL_MAX_CPU_ISA")


def pinned_env(base: dict[str, str], threads: int = 1) -> dict[str, str]:
    """A child's environment: `base` without UNPINNED_VARS, with CPU_PINS and the OpenMP and
    MKL thread counts set to `threads` laid over it, so the pins win over whatever the
    parent's environment says."""
    env = {k: v for k, v in base.items() if k not in UNPINNED_VARS}
    return {**env, **CPU_PINS, **{var: str(threads) for var in THREAD_VARS}}


def cpu_vendor_and_flags() -> tuple[str, set[str]]:
    """The first processor's vendor id and flags, from /proc/cpuinfo ('' and none elsewhere)."""
    vendor, flags = "", set[str]()
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="ascii", errors="replace")
    except OSError:
        return vendor, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "vendor_id" and not vendor:
            vendor = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return vendor, flags


def load_mkl_intel_branch() -> str:
    """On an x86-64 processor that is not Intel's but has AVX2 and FMA, build and load (before
    torch) the library that lets MKL take the AVX2 branch; return one line saying what was
    done. Needs a C compiler (`cc`); without one MKL runs its own branch and says so later."""
    import ctypes
    import shutil
    import subprocess
    import tempfile

    vendor, flags = cpu_vendor_and_flags()
    if vendor in ("", "GenuineIntel"):
        return f"MKL: {vendor or 'not an x86-64 Linux host'}, its branches as MKL_CBWR asks"
    if not {"avx2", "fma"} <= flags:
        return f"MKL: {vendor} without AVX2 and FMA, MKL's own branch"
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return f"MKL: {vendor}, no C compiler (cc) to build {MKL_INTEL_BRANCH_C.name}"
    with tempfile.TemporaryDirectory(prefix="releasekit-mkl-") as tmp:
        lib = Path(tmp) / "mkl_intel_branch.so"
        cmd = [cc, "-shared", "-fPIC", "-O2", "-o", str(lib), str(MKL_INTEL_BRANCH_C)]
        try:
            subprocess.run(cmd, check=True, capture_output=True, text=True)
            ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)  # stays loaded after the file goes
        except (OSError, subprocess.CalledProcessError) as exc:
            why = getattr(exc, "stderr", "") or str(exc)
            return f"MKL: {vendor}, {MKL_INTEL_BRANCH_C.name} not loaded ({why.strip()[:200]})"
    return f"MKL: {vendor} with AVX2 and FMA, vendor check answered by {MKL_INTEL_BRANCH_C.name}"


def mkl_branch() -> str:
    """The branch MKL runs (after its first call), as MKL_CBWR names it: 'AVX2,STRICT'."""
    import ctypes

    import torch

    lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
    try:
        value = int(lib.mkl_serv_cbwr_get(-1))  # MKL_CBWR_ALL: the branch and the STRICT bit
    except AttributeError:
        return "unknown (this torch does not link MKL)"
    name = MKL_BRANCHES.get(value & 0xFFFF, f"branch {value & 0xFFFF}")
    return name + (",STRICT" if value & 0x10000 else "")


def float_paths_ran() -> dict[str, str | int]:
    """What this process's torch ran on the CPU: threads, MKL's branch (read from MKL after
    its first call), ATen's vector kernels and oneDNN's instruction-set cap."""
    import torch

    return {
        "threads": torch.get_num_threads(),
        "mkl": mkl_branch(),
        "aten": str(torch.backends.cpu.get_cpu_capability()).lower(),
        "onednn": os.environ.get("ONEDNN_MAX_CPU_ISA") or "default",
    }
