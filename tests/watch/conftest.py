"""Fixtures for the watch tests (helpers live in watchkit.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from watchkit import AppServer, FakeClock, FaultyMetrics, Proc, Sim


@pytest.fixture
def sim() -> Sim:
    """A fresh simulated vLLM + gateway (env prod, release r1)."""
    return Sim()


@pytest.fixture
def faulty(sim: Sim) -> Iterator[tuple[FaultyMetrics, str]]:
    """The Sim behind a fault-injecting metrics server; yields (server, base URL)."""
    fm = FaultyMetrics(sim)
    with AppServer(fm.app) as srv:
        yield fm, srv.url


@pytest.fixture
def clock() -> FakeClock:
    """A hand-moved clock."""
    return FakeClock()


@pytest.fixture
def start_proc(tmp_path: Path) -> Iterator[Callable[[list[str], str], Proc]]:
    """Start programs that are all killed (process group) when the test ends."""
    procs: list[Proc] = []

    def start(argv: list[str], name: str) -> Proc:
        p = Proc(argv, tmp_path / f"{name}.log")
        procs.append(p)
        return p

    yield start
    for p in reversed(procs):
        p.stop()
