"""The loopback port ranges the tests bind (the table in CONTRIBUTING.md), shared out
between pytest-xdist workers.

`scripts/test.sh` runs the fast selection on several workers (`pytest -n`). Each worker
takes its own equal share of every range, so two workers never race for one port; run
without xdist, a share is the whole range.
"""

from __future__ import annotations

import os
import random
import socket
from collections import deque
from collections.abc import Sequence

import pytest

_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
WORKERS = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or "1"))
WORKER_INDEX = int(_WORKER[2:]) if _WORKER.startswith("gw") and _WORKER[2:].isdigit() else 0


def share(low: int, high: int) -> range:
    """This worker's share of `low`-`high` (inclusive): all of it without xdist."""
    size = (high - low + 1) // WORKERS
    if size < 1:
        raise ValueError(f"{low}-{high} cannot be shared between {WORKERS} workers")
    start = low + WORKER_INDEX * size
    return range(start, start + size)


def first_free(ports: Sequence[int], *, what: str) -> int:
    """The first of `ports` free now on loopback; the test is skipped (naming `what` and the
    ports) when every one is taken."""
    for port in ports:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    pytest.skip(f"no free port in {min(ports)}-{max(ports)} for {what}")


_HANDED_OUT: deque[int] = deque(maxlen=64)
"""The ports `free_port` gave out lately in this process: a port is free until its server
binds it, so two picks before either server starts would otherwise both get it (seen once:
a watch test's Prometheus and Alertmanager on one port)."""


def free_port(low: int, high: int, *, what: str, shuffle: bool = False) -> int:
    """A loopback port free now in this worker's share of `low`-`high` (`first_free`), not
    one of the last 64 this process was given while the share has others."""
    ports = [p for p in share(low, high) if p not in _HANDED_OUT] or list(share(low, high))
    if shuffle:  # several in one test: less chance of meeting a port just released
        random.shuffle(ports)
    port = first_free(ports, what=what)
    _HANDED_OUT.append(port)
    return port
