"""A real PostgreSQL server for tests, started at most once per test session.

Debian's PostgreSQL (/usr/lib/postgresql/<v>/bin) or any `pg_ctl` on PATH. As root it runs
as the `postgres` user (PostgreSQL refuses root) from a temp folder that user owns. Without
a server, `server()` skips the calling test with the reason, except under CI=true, where it
fails: the team setup must be tested where it can be.

conftest.py files load this module by path under one module name
(`_releasekit_pg_harness`), so the tests under tests/stores and tests/releases share one
server.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from portbands import free_port

PG_PORTS = (22100, 22199)  # the store tests' range (CONTRIBUTING.md)
PG_USER = "rk"


@dataclass(frozen=True)
class PgServer:
    """A running PostgreSQL server: `url(db)` is a SQLAlchemy URL for database `db`."""

    host: str
    port: int
    user: str
    bindir: Path

    def url(self, database: str = "postgres") -> str:
        """SQLAlchemy URL (psycopg 3 driver) for `database` on this server."""
        return f"postgresql+psycopg://{self.user}@{self.host}:{self.port}/{database}"

    def create_database(self, name: str | None = None) -> str:
        """Create an empty database and return its URL."""
        import psycopg

        name = name or f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(
            f"host={self.host} port={self.port} user={self.user} dbname=postgres",
            autocommit=True,
        ) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)


def _pg_bindir() -> Path | None:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"), reverse=True)
    if found:
        return found[0].parent
    on_path = shutil.which("pg_ctl")
    return Path(on_path).parent if on_path else None


def _unavailable(reason: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"PostgreSQL is required under CI: {reason}")
    pytest.skip(f"no PostgreSQL server to test against: {reason}")


_server: PgServer | None = None
_failed: str | None = None
_stops: list[Callable[[], None]] = []


def stop_server() -> None:
    """Stop the session's server now (tests/conftest.py calls this before it ends the test
    process without the interpreter's teardown, which would skip the atexit hook)."""
    while _stops:
        _stops.pop()()


def server() -> PgServer:
    """The session's PostgreSQL server (127.0.0.1, trust auth, user `rk`), started on first
    use and stopped when the test process exits."""
    global _server, _failed
    if _server is not None:
        return _server
    if _failed is not None:
        _unavailable(_failed)
    try:
        import psycopg  # noqa: F401
    except ImportError:
        _failed = "the psycopg driver is not installed (pip install 'psycopg[binary]')"
        _unavailable(_failed)
    bindir = _pg_bindir()
    if bindir is None:
        _failed = "neither /usr/lib/postgresql/*/bin nor pg_ctl on PATH"
        _unavailable(_failed)
        raise AssertionError  # unreachable: _unavailable raises
    prefix: list[str] = []
    owner: tuple[int, int] | None = None
    if os.geteuid() == 0:
        import pwd

        try:
            pw = pwd.getpwnam("postgres")
        except KeyError:
            _failed = "running as root and there is no `postgres` user to run the server"
            _unavailable(_failed)
            raise AssertionError from None
        prefix = ["runuser", "-u", "postgres", "--"]
        owner = (pw.pw_uid, pw.pw_gid)
    # Not under pytest's 0700 tmp root: the postgres user must reach its own folder.
    base = Path(tempfile.mkdtemp(prefix="rk-pg-"))
    if owner is not None:
        os.chown(base, *owner)
    data, log = base / "data", base / "server.log"
    port = free_port(*PG_PORTS, what="PostgreSQL")

    def run(*cmd: str) -> None:
        proc = subprocess.run([*prefix, *cmd], capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise RuntimeError(f"{cmd[0]} failed: {proc.stderr.strip()}\n{tail}")

    def stop() -> None:
        with contextlib.suppress(Exception):
            run(str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop")
        shutil.rmtree(base, ignore_errors=True)

    try:
        run(str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", PG_USER, "-E", "UTF8")
        opts = (
            f"-p {port} -k {base} -c listen_addresses=127.0.0.1 -c fsync=off "
            "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
        )
        run(str(bindir / "pg_ctl"), "-D", str(data), "-o", opts, "-l", str(log), "-w", "start")
    except Exception:
        stop()
        raise
    atexit.register(stop)
    _stops.append(stop)
    _server = PgServer(host="127.0.0.1", port=port, user=PG_USER, bindir=bindir)
    return _server
