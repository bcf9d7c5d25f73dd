"""Runs at the start of every Python process of a vLLM server releasekit starts on a CPU with
AMX (this folder is first on the server's PYTHONPATH): asks Linux for the AMX tile state
(arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) before any kernel runs.

Why: Linux lets a process execute AMX instructions only after it has asked. vLLM's CPU build
picks its AMX attention kernel by CPUID and never asks; a worker process forked from one that
had asked inherits the permission, but a spawned worker (how a Ray replica starts vLLM's
workers) does not, and died with SIGILL at its first request. Asking costs one system call;
where the CPU or kernel has no AMX the call fails and nothing changes.
"""

import contextlib
import ctypes
import platform

_SYS_ARCH_PRCTL = 158  # x86-64
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18

if platform.machine() == "x86_64":
    # No libc symbol: leave the process as it is.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).syscall(
            _SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA
        )
