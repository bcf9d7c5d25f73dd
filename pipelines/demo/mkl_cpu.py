"""MKL's code branch for the demo's training: pipelines/demo/train.py pins MKL to its AVX2
branch in strict mode (MKL_CBWR), which MKL honours only on processors it takes for Intel's.
This module loads, before torch, the library that answers MKL's vendor check elsewhere
(`mkl_intel_branch.c` says why), and reads which branch MKL ran. It imports torch only when
asked which branch ran, and nothing else imports it: servers keep MKL's own choice."""

from __future__ import annotations

from pathlib import Path

# MKL takes the AVX2 branch only on processors it takes for Intel's (mkl_intel_branch.c says
# why and how): elsewhere the training loads a library that answers MKL's vendor check first.
MKL_INTEL_BRANCH_C = Path(__file__).resolve().parent / "mkl_intel_branch.c"
#: MKL's branch constants (MKL_CBWR_AUTO = 2, ...), by value, for the training's log.
MKL_BRANCHES = {2: "AUTO", 3: "COMPATIBLE", 10: "AVX2", 12: "AVX512", 13: "AVX512_E1"}


def _cpu_vendor_and_flags() -> tuple[str, set[str]]:
    """The first processor's vendor id and flags, from /proc/cpuinfo ('' and none elsewhere)."""
    vendor, flags = "", set()
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

    vendor, flags = _cpu_vendor_and_flags()
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
