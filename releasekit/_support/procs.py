"""Process groups and signals: start children that die with their parent, stop a whole
group, reap groups whose owner was killed, turn SIGTERM into KeyboardInterrupt."""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass


_PR_SET_PDEATHSIG = 1


def tail(path: Path, lines: int = 25) -> str:
    """The last lines of a log file (empty if unreadable)."""
    try:
        data = path.read_bytes()[-16_384:].decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-lines:])


def last_error_line(text: str) -> str | None:
    """The last line of a log that reads like the cause of a failure (argparse's `error:`, a
    Python exception), trimmed; None if there is none."""
    pattern = re.compile(r"(\berror\b|Error\b|Exception\b)", re.IGNORECASE)
    for line in reversed(text.splitlines()):
        if pattern.search(line):
            line = line.strip()
            return line if len(line) <= 300 else line[:297] + "..."
    return None


def die_with_parent_hook() -> Callable[[], None]:
    """A preexec_fn asking the kernel to SIGTERM the child when its parent dies, so a
    SIGKILLed owner cannot leave vLLM behind. Resolved before fork: the child only calls."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return hook


@contextlib.contextmanager
def deferred_signals() -> Iterator[None]:
    """Hold SIGINT/SIGTERM while cleanup runs (a second Ctrl-C must not cut a stop short);
    a signal that came in meanwhile is raised as KeyboardInterrupt afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []

    def _hold(signum: int, frame: object) -> None:
        got.append(signum)

    old = {s: signal.signal(s, _hold) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if got:
        raise KeyboardInterrupt


def stop_process_group(proc: subprocess.Popen[Any], grace_s: float) -> None:
    """Terminate a process that leads its own process group (`start_new_session=True` or
    `process_group=0`), and all its children."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    # Workers may outlive the parent: kill whatever is left of the group.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group `pgid`, read from /proc."""
    proc = Path("/proc")
    if not proc.is_dir():  # pragma: no cover - not Linux: ask the kernel about the group
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        except PermissionError:
            pass
        return [pgid]
    out = []
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()  # after "pid (comm) "
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            out.append(int(d.name))
    return out


def group_memory_bytes(pgid: int) -> int | None:
    """The memory process group `pgid` holds: the sum of its processes' proportional set
    sizes (`Pss` of /proc/PID/smaps_rollup: a page shared by N processes counts 1/N in each,
    so shared weights and libraries are counted once). None where /proc does not say."""
    total, seen = 0, False
    for pid in group_members(pgid):
        try:
            text = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("Pss:"):
                total += int(line.split()[1]) * 1024  # kB
                seen = True
                break
    return total if seen else None


def pid_alive(pid: int) -> bool:
    """True while process `pid` exists (one owned by another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def group_alive(pgid: int) -> bool:
    """True while any live (non-zombie) process of process group `pgid` exists."""
    return bool(group_members(pgid))


def reap_registered(piddir: Path, *, grace_s: float = 10.0) -> list[int]:
    """Stop every server group still registered in `piddir` (its owner died or was killed
    before stopping it): SIGTERM, then SIGKILL after the grace period. Returns the pids."""
    if not piddir.is_dir():
        return []
    pgids = []
    for f in sorted(piddir.iterdir()):
        if f.name.isdigit():
            pgids.append(int(f.name))
    live = stop_groups(pgids, grace_s=grace_s)
    for g in pgids:
        (piddir / str(g)).unlink(missing_ok=True)
    return live


def stop_groups(pgids: list[int], *, grace_s: float = 10.0) -> list[int]:
    """Stop the process groups `pgids` that still run: SIGTERM, then SIGKILL to whatever is
    left after the grace period. Returns those that were running."""
    live = [g for g in pgids if group_alive(g)]
    for g in live:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(g, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(group_alive(g) for g in live) and time.monotonic() < deadline:
        time.sleep(0.2)
    for g in live:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(g, signal.SIGKILL)
    return live


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt so `finally` blocks stop servers (DVC and CI
    send SIGTERM). Off the main thread, where Python allows no signal handlers, a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _raise(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
