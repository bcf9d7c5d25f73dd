"""Fixtures for the store tests: a real PostgreSQL server (one per test session, shared
with tests/releases), a fresh database on it per test, and `ledger_db`, which runs a test
on SQLite and on PostgreSQL. See pg_harness.py for how the server is found and started.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest


def _harness() -> ModuleType:
    name = "_releasekit_pg_harness"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, Path(__file__).with_name("pg_harness.py")
        )
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


@pytest.fixture(scope="session")
def pg_server() -> Any:
    """A PostgreSQL server on 127.0.0.1 (trust auth, user `rk`); skips (fails under CI=true)
    when none can be started."""
    return _harness().server()


@pytest.fixture
def pg_url(pg_server: Any) -> str:
    """URL of a new, empty PostgreSQL database (one per test, so tests never share state)."""
    return str(pg_server.create_database())


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger_db(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A ledger URL, once on SQLite (a file under tmp_path) and once on real PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ledger.db'}"
    return str(request.getfixturevalue("pg_server").create_database())
