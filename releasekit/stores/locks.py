"""Named locks in the ledger's own database (per environment, per release), for SQLite and
server databases alike, so the lock is wherever the record is.

- PostgreSQL and other server databases: a row per lock name in `ledger_locks`, held with
  `SELECT ... FOR UPDATE` in a transaction on a connection of its own for as long as the
  caller's block runs. The database drops the lock when that connection dies, so a process
  killed with SIGKILL on any host never leaves it held. `lock_timeout` bounds the wait.
- SQLite: a lease row (token, owner, host, pid, expiry) written under SQLite's write lock
  and deleted on release. SQLite's write lock cannot be held open here (the ledger append
  inside the block needs it), so a lease left by a killed process is taken over once its pid
  is gone (same host) or its lease has expired (another host, e.g. a shared disk).

The lock serialises releasekit's own writers; it is not a barrier against someone editing
the database by hand (signatures and git anchors are).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass

from sqlalchemy import Column, Connection, Engine, Integer, MetaData, String, Table, select, text
from sqlalchemy.exc import IntegrityError, OperationalError, SQLAlchemyError

from releasekit._support.procs import pid_alive
from releasekit._support.retry import RetryPolicy
from releasekit._support.text import redact_url
from releasekit.errors import LedgerError, LedgerLockTimeoutError

_meta = MetaData()

locks_table = Table(
    "ledger_locks",
    _meta,
    Column("name", String(128), primary_key=True),
    Column("token", String(32), nullable=False),
    Column("owner", String(255), nullable=False),
    Column("host", String(255), nullable=False),
    Column("pid", Integer, nullable=False),
    Column("acquired", String(32), nullable=False),
    Column("expires", String(32), nullable=False),
)

_TIME_FMT = "%Y-%m-%dT%H:%M:%S.%fZ"
DEFAULT_LEASE_S = 300.0

WriteTxn = Callable[[], AbstractContextManager[Connection]]


@dataclass(frozen=True)
class LockInfo:
    """A held lock: its name, this holder's token, and how it is held."""

    name: str
    token: str
    mode: str  # "row" (SELECT ... FOR UPDATE) or "lease"


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _fmt(t: dt.datetime) -> str:
    return t.strftime(_TIME_FMT)


def _lost_create_race(exc: BaseException) -> bool:
    """Two first-time lockers raced on CREATE TABLE (the loser finds it next time)."""
    return (
        isinstance(exc, OperationalError | IntegrityError) or "already exists" in str(exc).lower()
    )


# Creating the lock table: up to 5 tries, 0.05 s apart and growing (with jitter).
_CREATE_RETRY = RetryPolicy(
    attempts=5, base_s=0.05, cap_s=0.25, retry_on=(SQLAlchemyError,), retry_if=_lost_create_race
)
# Waiting for a held lock: full jitter growing to 0.2 s (the deadline is the caller's).
_ACQUIRE_BACKOFF = RetryPolicy(attempts=None, deadline_s=float("inf"), base_s=0.01, cap_s=0.2)
# Releasing a lease: a database busy with another writer is waited out, up to 50 tries.
_RELEASE_RETRY = RetryPolicy(
    attempts=50, base_s=0.05, cap_s=0.05, growth=1.0, jitter=False, retry_on=(OperationalError,)
)


def ensure_table(engine: Engine) -> None:
    """Create `ledger_locks` if it is missing (a concurrent creator is not an error)."""

    def create() -> None:
        with engine.begin() as conn:
            _meta.create_all(conn, checkfirst=True)

    try:
        _CREATE_RETRY.call(create)
    except SQLAlchemyError as exc:
        raise LedgerError(
            f"cannot create the lock table in {redact_url(str(engine.url))}: {exc}"
        ) from exc


@contextlib.contextmanager
def hold(
    engine: Engine,
    name: str,
    *,
    write: WriteTxn,
    owner: str,
    timeout_s: float = 60.0,
    lease_s: float = DEFAULT_LEASE_S,
) -> Iterator[LockInfo]:
    """Hold lock `name` for the duration of the block.

    `write` opens a write transaction on `engine` the way the ledger does (on SQLite it takes
    the write lock up front). Raises LedgerLockTimeoutError after `timeout_s`.
    """
    if len(name) > 128:
        raise LedgerError(f"lock name too long: {name!r}")
    ensure_table(engine)
    if engine.dialect.name == "sqlite":
        with _lease(name, write=write, owner=owner, timeout_s=timeout_s, lease_s=lease_s) as info:
            yield info
    else:
        with _row_lock(engine, name, owner=owner, timeout_s=timeout_s) as info:
            yield info


@contextlib.contextmanager
def _row_lock(engine: Engine, name: str, *, owner: str, timeout_s: float) -> Iterator[LockInfo]:
    t = locks_table
    token = uuid.uuid4().hex
    try:
        conn = engine.connect()
    except SQLAlchemyError as exc:
        raise LedgerError(f"cannot lock {name} in {redact_url(str(engine.url))}: {exc}") from exc
    try:
        # The row must exist (committed) before anyone can wait on it.
        try:
            with conn.begin():
                exists = conn.execute(select(t.c.name).where(t.c.name == name)).first()
                if exists is None:
                    conn.execute(
                        t.insert().values(
                            name=name,
                            token=token,
                            owner=owner[:255],
                            host=socket.gethostname()[:255],
                            pid=os.getpid(),
                            acquired=_fmt(_now()),
                            expires=_fmt(_now()),
                        )
                    )
        except IntegrityError:
            pass  # created concurrently: fine, it exists now
        trans = conn.begin()
        try:
            if engine.dialect.name == "postgresql":
                ms = max(1, int(timeout_s * 1000))
                conn.execute(text(f"SET LOCAL lock_timeout = '{ms}ms'"))
            conn.execute(select(t.c.name).where(t.c.name == name).with_for_update()).first()
        except OperationalError as exc:
            trans.rollback()
            msg = str(exc.orig).lower() if exc.orig is not None else str(exc).lower()
            if "lock timeout" in msg or "lock_timeout" in msg or "could not obtain lock" in msg:
                raise LedgerLockTimeoutError(
                    f"{name} is locked by another releasekit process; gave up after "
                    f"{timeout_s:g} s",
                    name=name,
                ) from exc
            raise LedgerError(f"cannot lock {name}: {exc}") from exc
        try:
            # Who holds it, for anyone reading the table after a crash (uncommitted meanwhile).
            conn.execute(
                t.update()
                .where(t.c.name == name)
                .values(
                    token=token,
                    owner=owner[:255],
                    host=socket.gethostname()[:255],
                    pid=os.getpid(),
                    acquired=_fmt(_now()),
                )
            )
            yield LockInfo(name=name, token=token, mode="row")
        finally:
            with contextlib.suppress(SQLAlchemyError):
                trans.rollback()
    finally:
        with contextlib.suppress(SQLAlchemyError):
            conn.close()


def _stale(row: object, host: str) -> bool:
    r = row._mapping  # type: ignore[attr-defined]
    if r["host"] == host:
        # Same machine: the pid says it all (a live holder is never robbed, however slow).
        return r["pid"] != os.getpid() and not pid_alive(int(r["pid"]))
    return bool(r["expires"] < _fmt(_now()))


@contextlib.contextmanager
def _lease(
    name: str, *, write: WriteTxn, owner: str, timeout_s: float, lease_s: float
) -> Iterator[LockInfo]:
    t = locks_table
    token = uuid.uuid4().hex
    host = socket.gethostname()[:255]
    deadline = time.monotonic() + timeout_s
    holder: str | None = None
    attempt = 0
    while True:
        attempt += 1
        now = _now()
        values = {
            "token": token,
            "owner": owner[:255],
            "host": host,
            "pid": os.getpid(),
            "acquired": _fmt(now),
            "expires": _fmt(now + dt.timedelta(seconds=lease_s)),
        }
        got = False
        try:
            with write() as conn:
                row = conn.execute(select(t).where(t.c.name == name)).first()
                if row is None:
                    conn.execute(t.insert().values(name=name, **values))
                    got = True
                elif _stale(row, host):
                    res = conn.execute(
                        t.update().where(t.c.name == name, t.c.token == row.token).values(**values)
                    )
                    got = res.rowcount == 1
                else:
                    holder = f"{row.owner} (pid {row.pid} on {row.host}, since {row.acquired})"
        except (IntegrityError, OperationalError) as exc:
            if isinstance(exc, OperationalError):
                if "locked" not in str(exc).lower() and "busy" not in str(exc).lower():
                    raise LedgerError(f"cannot lock {name}: {exc}") from exc
                holder = "another writer holding the ledger database's write lock"
        if got:
            break
        if time.monotonic() > deadline:
            raise LedgerLockTimeoutError(
                f"{name} is locked by {holder or 'another releasekit process'}; gave up after "
                f"{timeout_s:g} s",
                name=name,
                holder=holder,
            )
        time.sleep(max(0.01, _ACQUIRE_BACKOFF.backoff(attempt)))
    try:
        yield LockInfo(name=name, token=token, mode="lease")
    finally:

        def delete() -> None:
            with write() as conn:
                conn.execute(t.delete().where(t.c.name == name, t.c.token == token))

        # A lease not released expires; the next locker then takes it over.
        with contextlib.suppress(SQLAlchemyError):
            _RELEASE_RETRY.call(delete)
