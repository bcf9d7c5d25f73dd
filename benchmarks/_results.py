"""What every benchmark's result file says about the run besides its figures, and the one
way they are written.

`write_result(path, result)` writes `result` as JSON under benchmarks/results/ with a `run`
block: the UTC date, the host (CPU cores, model and flags, its kind -- avx2, avx512 or
avx512_amx, the families whose kernels and so figures differ -- memory, load average,
platform), Python, the releasekit commit and whether the tree had uncommitted changes
(results aside), and the exact command (with the RELEASEKIT_* variables it ran under,
secrets left out) so that running that command again rewrites the same file. Results are
committed: the README's benchmark figures link to them, each with its host kind and date.

Every file under benchmarks/results/ carries the RUN_FIELDS (tests/test_result_files.py);
a field a file was written without says "unknown" (UNKNOWN), never a guess, and such a
file's `run.in_git` gives the commits that added and last changed it.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
"""Where benchmarks write their JSON (each script's --out defaults to a file here)."""

UNKNOWN = "unknown"
"""The value of a run field that was not recorded when the file was written."""
CPU_KINDS = ("avx2", "avx512", "avx512_amx")
RUN_FIELDS = (
    "date",
    "command",
    "host.cpu_model",
    "host.kind",
    "releasekit_commit",
    "uncommitted_changes",
)
"""What every result file's `run` block holds (dotted: inside `run.host`)."""

_SECRET_WORDS = ("TOKEN", "KEY", "PASSWORD", "SECRET")
_ENV_AT_START = dict(os.environ)  # imported before a benchmark sets its own variables


def _cpuinfo() -> dict[str, Any]:
    """Model name and flags of the first CPU in /proc/cpuinfo ({} elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {}
    info: dict[str, Any] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and "model" not in info:
            info["model"] = value.strip()
        elif key in ("flags", "Features") and "flags" not in info:
            info["flags"] = sorted(value.split())
        if "model" in info and "flags" in info:
            break
    return info


def cpu_kind(flags: list[str] | set[str]) -> str:
    """avx512_amx, avx512 or avx2 (UNKNOWN without either): the CPU families whose float
    kernels, and so weights, answers and timings, differ."""
    have = set(flags)
    if "avx512f" in have:
        return "avx512_amx" if "amx_bf16" in have else "avx512"
    return "avx2" if "avx2" in have else UNKNOWN


def host_kind() -> str:
    """This host's CPU kind (avx512_amx, avx512, avx2): the families whose float kernels
    differ."""
    return cpu_kind(_cpuinfo().get("flags", []))


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        return None
    return None


def _git(*args: str) -> str | None:
    try:
        proc = subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def command_line(argv: list[str] | None = None) -> str:
    """The command as run from the repository root: the RELEASEKIT_* variables set when the
    benchmark started (no secrets), then `python`, the script's path relative to the
    repository, and its arguments."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]).resolve() if argv else Path("?")
    try:
        shown = str(script.relative_to(REPO))
    except ValueError:
        shown = str(script)
    env = [
        f"{k}={shlex.quote(v)}"
        for k, v in sorted(_ENV_AT_START.items())
        if k.startswith("RELEASEKIT_") and not any(w in k for w in _SECRET_WORDS)
    ]
    return " ".join([*env, "python", shlex.join([shown, *argv[1:]])])


def run_info(argv: list[str] | None = None) -> dict[str, Any]:
    """The `run` block: when, where and how this benchmark ran."""
    cpu = _cpuinfo()
    status = _git("status", "--porcelain", "--", ".", ":!benchmarks/results")
    commit = _git("rev-parse", "HEAD")
    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": command_line(argv),
        "host": {
            "cores": os.cpu_count(),
            "cpu_model": cpu.get("model") or platform.processor() or UNKNOWN,
            "kind": cpu_kind(cpu.get("flags", [])),
            "cpu_flags": cpu.get("flags", []),
            "memory_gib": _memory_gib(),
            "load_avg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
            "platform": platform.platform(),
        },
        "python": platform.python_version(),
        "releasekit_commit": commit or UNKNOWN,
        "uncommitted_changes": UNKNOWN if status is None else bool(status),
    }


def write_result(path: Path, result: dict[str, Any], *, argv: list[str] | None = None) -> Path:
    """Write `result` with its `run` block first to `path` (folders made); returns `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"run": run_info(argv), **{k: v for k, v in result.items() if k != "run"}}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)
    return path
