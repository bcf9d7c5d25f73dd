"""How vLLM's CPU build shares this host: the allocator and OpenMP runtime it is started
with, which core each server's worker is bound to, and the scheduler priority and
placement of a server while it starts or is judged.

What was measured on a 2-core host (README, "Where the time goes on a 2-core host"):

- Linux's scheduler autogroups divide the CPU between *sessions*, not processes. A light
  process (a load client, the gateway) in another session than a busy vLLM stalled for up to
  1.7 s at a time, which showed as bursty streams and a TTFT far above the engine's. So
  servers started for a measurement share the caller's session (`VLLMServer`), and a server
  that starts beside a busy live release gets a higher autogroup priority until it is
  healthy (`raise_priority`, then `reset_priority`): under 4 streaming clients a candidate
  became healthy in 27-28 s instead of 154-164 s.
- vLLM binds its worker's OpenMP threads to core 0 by default. Servers of one environment
  take turns (`pick_core`), so a candidate's worker is not bound to the core the live
  worker is busy on.
- Two servers compared with each other (a canary and stable) are judged alike: the same
  autogroup priority and every thread of both free on every core (`spread_session`, then
  `restore_affinity`); bound to a core each, the one whose core the gateway, API servers
  and clients crowd decodes slower (benchmarks/canary_placement.py).
- vLLM's CPU guide preloads tcmalloc and Intel's OpenMP runtime (`preload_libs`); Debian's
  libtcmalloc-minimal4 and the intel-openmp wheel vLLM's CPU build depends on ship them.
  Measured side by side on the demo (benchmarks/bench_vs_vllm.py --preload on|off), it did
  not help on 2 cores (the same at 1-4 in flight, 6-16% fewer tokens/s at 16-64), so it is
  a setting (`server_preload`), off by default.
- A server's environment starts from its caller's less the variables that choose torch's,
  oneDNN's and MKL's CPU kernels (`inherited_env`, `KERNEL_ENV`): those come from the
  release's `serving.env` or not at all. Seen on a CPU with AMX: a vLLM server that inherited
  ONEDNN_MAX_CPU_ISA=AVX2 (set by a training script in the process that started it) aborted
  at its first request, because vLLM picks its AMX kernels by CPUID and torch refuses them
  under the cap ("BFloat16 Brgemm VNNI format is only supported ... when `amx` is
  supported"); elsewhere such a cap silently changes the release's kernels and answers.
- On a CPU with AMX every Python process of a server asks Linux for the AMX tile state at
  start (`amx_startup`, first on its PYTHONPATH). vLLM's AMX attention kernel never asks; a
  worker forked from a process that had asked inherits the permission, but a spawned one (a
  Ray replica's) died with SIGILL at its first request.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

TCMALLOC_CANDIDATES: tuple[str, ...] = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4",
)
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
#: Variables that choose the CPU kernels of torch (ATen), oneDNN and MKL. A server never
#: inherits them: a release that needs one sets it in its `serving.env`.
KERNEL_ENV: tuple[str, ...] = (
    "ONEDNN_MAX_CPU_ISA",
    "DNNL_MAX_CPU_ISA",
    "ONEDNN_DEFAULT_FPMATH_MODE",
    "DNNL_DEFAULT_FPMATH_MODE",
    "ATEN_CPU_CAPABILITY",
    "MKL_CBWR",
    "MKL_ENABLE_INSTRUCTIONS",
)


def has_amx(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU has AMX tiles (the `amx_tile` flag Linux lists)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return False
    return any(
        line.startswith("flags") and "amx_tile" in line.split() for line in text.splitlines()
    )


def inherited_env(
    environ: Mapping[str, str] | None = None, *, amx: bool | None = None
) -> dict[str, str]:
    """What a vLLM server starts from: `environ` (this process's by default) less the
    kernel-choosing variables of `KERNEL_ENV`; on a CPU with AMX (`amx`, read from this
    host by default) with `amx_startup` first on PYTHONPATH, so that every Python process of
    the server asks Linux for the AMX tile state before any kernel runs (a spawned vLLM
    worker that did not ask died with SIGILL in vLLM's AMX attention kernel)."""
    src = os.environ if environ is None else environ
    env = {k: v for k, v in src.items() if k not in KERNEL_ENV}
    with_amx = has_amx() if amx is None else amx
    if with_amx:
        from releasekit.serving.amx_startup import STARTUP_DIR

        rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join([str(STARTUP_DIR), *rest])
    return env


def preload_libs(python: Path) -> list[str]:
    """tcmalloc and Intel's OpenMP runtime, where this host has them: Debian's
    libtcmalloc-minimal4, and libiomp5 from the environment of `python` (the intel-openmp
    wheel installs it under <prefix>/lib)."""
    libs = [p for p in TCMALLOC_CANDIDATES if Path(p).is_file()][:1]
    # The venv's prefix: <prefix>/bin/python -> <prefix>/lib/libiomp5.so (not resolved: a
    # venv's python is a link to the base interpreter).
    iomp = python.parent.parent / "lib" / "libiomp5.so"
    if iomp.is_file():
        libs.append(str(iomp))
    return libs


def server_env(
    *, python: Path, preload: bool, release_env: dict[str, str] | None = None
) -> dict[str, str]:
    """What releasekit adds to a vLLM server's environment on this host: LD_PRELOAD (when
    `preload` and the libraries exist, and the release does not set it itself)."""
    release_env = release_env or {}
    out: dict[str, str] = {}
    if preload and "LD_PRELOAD" not in release_env:
        libs = preload_libs(python)
        if libs:
            current = os.environ.get("LD_PRELOAD", "")
            out["LD_PRELOAD"] = ":".join([*libs, *([current] if current else [])])
    return out


def host_cores() -> list[int]:
    """The cores this process may run on."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return list(range(os.cpu_count() or 1))


def pick_core(taken: Iterable[int | None]) -> int:
    """The core for a new server's worker: the least used among this host's cores by the
    servers still running (`taken`: their cores), the lowest on a tie."""
    cores = host_cores()
    use = {c: 0 for c in cores}
    for c in taken:
        if c in use:
            use[c] += 1
    return min(cores, key=lambda c: (use[c], c))


def bind_env(core: int, release_env: dict[str, str] | None = None) -> dict[str, str]:
    """The placement of a server's worker on `core`, unless the release places it itself."""
    if release_env and BIND_ENV in release_env:
        return {}
    return {BIND_ENV: str(core)}


def _autogroup(pid: int) -> Path:
    return Path(f"/proc/{pid}/autogroup")


def raise_priority(pid: int, nice: int | None) -> bool:
    """Give the scheduler autogroup of `pid` (its session: a server started in its own
    session, with its engine processes) the nice value `nice`. Best effort: False where the
    kernel has no autogroups, or refuses (a negative value needs CAP_SYS_NICE)."""
    if nice is None:
        return False
    path = _autogroup(pid)
    try:
        path.write_text(f"{nice}\n")
    except OSError:
        return False
    return True


def reset_priority(pid: int) -> None:
    """Back to the default autogroup priority (nice 0), once a server is healthy."""
    with contextlib.suppress(OSError):
        _autogroup(pid).write_text("0\n")


def session_pids(sid: int) -> list[int]:
    """The processes of session `sid` (a server started in its own session: its API
    server and engine processes)."""
    out: list[int] = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            # pid (comm) state ppid pgrp session ...; comm may hold spaces and parentheses.
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 3 and fields[3] == str(sid):
            out.append(int(d.name))
    return sorted(out)


Affinities = dict[int, list[int]]
"""The CPU affinity of each task (thread id -> cores), as it was before a change."""


def spread_session(sid: int, cores: Iterable[int] | None = None) -> Affinities:
    """Let every thread of session `sid` run on `cores` (default: all of this host's),
    which lifts the binding of its vLLM worker to one core; returns what each thread had,
    for `restore_affinity`. Best effort: threads that end meanwhile are skipped."""
    allowed = set(host_cores() if cores is None else cores)
    before: Affinities = {}
    for pid in session_pids(sid):
        try:
            tids = [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
        except OSError:
            continue
        for tid in tids:
            try:
                had = os.sched_getaffinity(tid)
                if had != allowed:
                    os.sched_setaffinity(tid, allowed)
                    before[tid] = sorted(had)
            except OSError:
                continue
    return before


def restore_affinity(before: Affinities) -> None:
    """Put back the affinities `spread_session` changed (threads gone since: skipped)."""
    for tid, cores in before.items():
        with contextlib.suppress(OSError):
            os.sched_setaffinity(tid, cores)


def autogroup_nice(pid: int) -> int | None:
    """The nice value of the scheduler autogroup of `pid`, or None (no autogroups, gone)."""
    try:
        return int(_autogroup(pid).read_text().split("nice")[1])
    except (OSError, IndexError, ValueError):
        return None


def worker_core(env: dict[str, str]) -> int | None:
    """The single core a server's environment binds its worker to, if it names one."""
    raw = env.get(BIND_ENV, "")
    try:
        return int(raw)
    except ValueError:
        return None
