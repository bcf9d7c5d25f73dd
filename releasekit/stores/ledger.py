"""The event ledger: an append-only, hash-chained record of every change to what runs where.

Each record carries the hash of the one before it, so editing, deleting or reordering a row
breaks the chain at that row and `Ledger.verify()` names it. Storage goes through SQLAlchemy:
SQLite by default (Settings.ledger_url), any database URL for a team. Appends from several
processes serialise on the database: SQLite takes its write lock up front (BEGIN IMMEDIATE),
and on every database the primary key on `seq` plus a compare-and-swap on the head row turn
a lost race into a retry, never a fork.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import random
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import (
    Boolean,
    Column,
    Connection,
    Engine,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    create_engine,
    event,
    func,
    inspect,
    or_,
    select,
)
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, IntegrityError, OperationalError, SQLAlchemyError
from sqlalchemy.pool import StaticPool

from releasekit._support.text import redact_url
from releasekit.errors import LedgerError, LedgerIntegrityError

GENESIS = "0" * 64
HASH_VERSION = "releasekit-ledger/1"
_TIME_FMT = "%Y-%m-%dT%H:%M:%S.%fZ"


class EventType(StrEnum):
    """Kinds of ledger event. Open for extension: later stages add members here.

    `assign`, `promote`, `rollback` (and `deploy`/`override` when they move an environment)
    are written through `registry.assign`, which marks them `live`.
    """

    BUILD = "build"
    REGISTER = "register"
    ASSIGN = "assign"
    DEPLOY = "deploy"
    PROMOTE = "promote"
    GATE_FAILED = "gate_failed"
    ROLLBACK = "rollback"
    OVERRIDE = "override"


class Event(BaseModel):
    """An event to append. The ledger assigns `seq`, `time` and the hashes; `actor` defaults
    to the ledger's actor (RELEASEKIT_ACTOR, git identity, OS user)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    type: EventType
    environment: str | None = Field(None, max_length=64)
    from_release: str | None = Field(None, max_length=64)
    to_release: str | None = Field(None, max_length=64)
    reason: str = ""
    evidence: dict[str, Any] = Field(
        default_factory=dict, description="links to evidence: MLflow run id, report digests"
    )
    live: bool = Field(False, description="True when this event changed what runs in `environment`")
    actor: str | None = Field(None, max_length=255)
    event_id: str = Field(default_factory=lambda: uuid.uuid4().hex, max_length=64)


class LedgerRecord(BaseModel):
    """One stored event with its place in the chain. `type` is a plain string so that a
    ledger written by a newer releasekit (with more event types) still reads."""

    model_config = ConfigDict(frozen=True)

    seq: int
    event_id: str
    type: str
    time: dt.datetime
    actor: str
    environment: str | None
    from_release: str | None
    to_release: str | None
    reason: str
    evidence: dict[str, Any]
    live: bool
    prev_hash: str
    hash: str


class VerifyResult(BaseModel):
    """Outcome of walking the chain; `first_bad_seq` names the first broken record."""

    ok: bool
    url: str
    records: int
    head_seq: int | None = None
    head_hash: str | None = None
    first_bad_seq: int | None = None
    event_id: str | None = None
    problem: str | None = None


_meta = MetaData()

events_table = Table(
    "events",
    _meta,
    Column("seq", Integer, primary_key=True, autoincrement=False),
    Column("event_id", String(64), nullable=False, unique=True),
    Column("type", String(32), nullable=False),
    Column("time", String(32), nullable=False),
    Column("actor", String(255), nullable=False),
    Column("environment", String(64)),
    Column("from_release", String(64)),
    Column("to_release", String(64)),
    Column("reason", Text, nullable=False),
    Column("evidence", Text, nullable=False),
    Column("live", Boolean, nullable=False),
    Column("prev_hash", String(64), nullable=False, unique=True),
    Column("hash", String(64), nullable=False),
    Index("ix_events_env_seq", "environment", "seq"),
    Index("ix_events_env_live_time", "environment", "live", "time"),
    Index("ix_events_live_env_seq", "live", "environment", "seq"),
    Index("ix_events_to_release", "to_release"),
    Index("ix_events_from_release", "from_release"),
    Index("ix_events_time", "time"),
)

# One row (id=1): the last seq and hash. It catches deletion of the newest records (which a
# chain alone cannot) and is the compare-and-swap point for appends on any database.
head_table = Table(
    "ledger_head",
    _meta,
    Column("id", Integer, primary_key=True, autoincrement=False),
    Column("seq", Integer, nullable=False),
    Column("hash", String(64), nullable=False),
    Column("time", String(32), nullable=False),
)


def format_time(t: dt.datetime) -> str:
    """The stored form of a time: UTC, microseconds, `Z` (sorts as text). Naive is UTC."""
    if t.tzinfo is None:
        t = t.replace(tzinfo=dt.UTC)
    return t.astimezone(dt.UTC).strftime(_TIME_FMT)


def parse_stored_time(text: str) -> dt.datetime:
    """Inverse of `format_time`."""
    return dt.datetime.strptime(text, _TIME_FMT).replace(tzinfo=dt.UTC)


def record_hash(row: dict[str, Any]) -> str:
    """sha256 over a record's stored column values (strings as stored), prev_hash included."""
    payload = [
        HASH_VERSION,
        row["seq"],
        row["event_id"],
        row["type"],
        row["time"],
        row["actor"],
        row["environment"],
        row["from_release"],
        row["to_release"],
        row["reason"],
        row["evidence"],
        bool(row["live"]),
        row["prev_hash"],
    ]
    data = json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()
    return hashlib.sha256(data).hexdigest()


def _evidence_text(evidence: dict[str, Any]) -> str:
    return json.dumps(
        evidence, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str
    )


def _to_record(row: Any) -> LedgerRecord:
    m = row._mapping
    try:
        evidence = json.loads(m["evidence"])
    except ValueError:
        evidence = {"_unreadable": m["evidence"]}
    return LedgerRecord(
        seq=m["seq"],
        event_id=m["event_id"],
        type=m["type"],
        time=parse_stored_time(m["time"]),
        actor=m["actor"],
        environment=m["environment"],
        from_release=m["from_release"],
        to_release=m["to_release"],
        reason=m["reason"],
        evidence=evidence if isinstance(evidence, dict) else {"_value": evidence},
        live=bool(m["live"]),
        prev_hash=m["prev_hash"],
        hash=m["hash"],
    )


class _Contention(Exception):
    """Internal: another writer moved the head between our read and our write."""


class Ledger:
    """The event ledger at a SQLAlchemy URL (created on first use).

    Usage: `Ledger(settings.ledger_url).append(Event(type=EventType.BUILD, to_release=rid))`.
    """

    def __init__(
        self,
        url: str,
        *,
        actor: str | None = None,
        timeout_s: float = 30.0,
        sqlite_immediate: bool = True,
    ) -> None:
        """`actor` is used for events that name none (default: provenance.actor());
        `timeout_s` bounds how long an append waits for another writer.
        `sqlite_immediate=False` makes SQLite use the portable optimistic path (unique seq,
        compare-and-swap on the head, retry) that other databases use; for tests."""
        self.url = url
        self._immediate = sqlite_immediate
        self._actor = actor
        self._timeout_s = timeout_s
        self._engine = self._make_engine(url, timeout_s)
        self._ensure_schema()

    # -- plumbing -----------------------------------------------------------------------

    @staticmethod
    def _make_engine(url: str, timeout_s: float) -> Engine:
        try:
            u = make_url(url)
        except ArgumentError as exc:
            raise LedgerError(f"invalid ledger URL {url!r}: {exc}") from exc
        sqlite = u.get_backend_name() == "sqlite"
        kwargs: dict[str, Any] = {}
        if sqlite:
            memory = u.database in (None, "", ":memory:")
            kwargs["connect_args"] = {"timeout": timeout_s, "check_same_thread": False}
            if memory:
                kwargs["poolclass"] = StaticPool
            elif u.database and not u.database.startswith("file:"):  # not a sqlite URI name
                Path(u.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        try:
            engine = create_engine(u, **kwargs)
        except (SQLAlchemyError, ImportError) as exc:
            raise LedgerError(f"cannot open ledger {redact_url(url)}: {exc}") from exc
        if sqlite:
            _sqlite_transactions(engine, wal=not kwargs.get("poolclass"))
        return engine

    @contextmanager
    def _write(self) -> Iterator[Connection]:
        """A write transaction; on SQLite it holds the write lock from its first statement."""
        with self._engine.connect() as conn:
            conn = conn.execution_options(releasekit_immediate=self._immediate)
            with conn.begin():
                yield conn

    @contextmanager
    def _read(self) -> Iterator[Connection]:
        try:
            with self._engine.connect() as conn, conn.begin():
                yield conn
        except SQLAlchemyError as exc:
            raise LedgerError(f"cannot read ledger {redact_url(self.url)}: {exc}") from exc

    def _ensure_schema(self) -> None:
        try:
            insp = inspect(self._engine)
            if insp.has_table("events") and insp.has_table("ledger_head"):
                return  # no write lock needed: a read-only auditor can still query
        except SQLAlchemyError as exc:
            raise LedgerError(f"cannot open ledger {redact_url(self.url)}: {exc}") from exc
        for attempt in range(5):
            try:
                with self._write() as conn:
                    _meta.create_all(conn, checkfirst=True)
                return
            except OperationalError as exc:
                # Another process created the tables between our check and our CREATE.
                if attempt == 4 or not _retryable(exc):
                    raise LedgerError(f"cannot open ledger {redact_url(self.url)}: {exc}") from exc
                time.sleep(0.05 * (attempt + 1))
            except SQLAlchemyError as exc:
                raise LedgerError(f"cannot open ledger {redact_url(self.url)}: {exc}") from exc

    def close(self) -> None:
        """Release pooled connections."""
        self._engine.dispose()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _default_actor(self) -> str:
        if self._actor is None:
            from releasekit.config import find_root
            from releasekit.spec.provenance import actor

            self._actor = actor(find_root())
        return self._actor

    # -- writing ------------------------------------------------------------------------

    def append(self, event: Event) -> LedgerRecord:
        """Append one event at the end of the chain and return the stored record."""
        return self.append_many([event])[0]

    def append_many(self, events: Sequence[Event]) -> list[LedgerRecord]:
        """Append events in one transaction (all or none), in order."""
        if not events:
            return []
        for ev in events:
            EventType(ev.type)  # a typo'd type must not reach the chain
        last_exc: Exception | None = None
        deadline = time.monotonic() + self._timeout_s
        attempt = 0
        while True:
            attempt += 1
            try:
                with self._write() as conn:
                    return self._append_locked(conn, events)
            except (IntegrityError, _Contention) as exc:
                last_exc = exc
            except OperationalError as exc:
                if not _retryable(exc):
                    raise LedgerError(
                        f"cannot append to ledger {redact_url(self.url)}: {exc}"
                    ) from exc
                last_exc = exc
            except SQLAlchemyError as exc:
                raise LedgerError(f"cannot append to ledger {redact_url(self.url)}: {exc}") from exc
            if time.monotonic() > deadline:
                break
            # Jittered, capped backoff: losers retry soon, and not in lockstep.
            time.sleep(random.uniform(0, min(0.05, 0.002 * 2 ** min(attempt, 10))))
        raise LedgerError(
            f"cannot append to ledger {redact_url(self.url)}: another writer kept it busy "
            f"({last_exc})"
        ) from last_exc

    def _append_locked(self, conn: Connection, events: Sequence[Event]) -> list[LedgerRecord]:
        head = conn.execute(select(head_table).where(head_table.c.id == 1)).first()
        last = conn.execute(
            select(events_table.c.seq, events_table.c.hash, events_table.c.time)
            .order_by(events_table.c.seq.desc())
            .limit(1)
        ).first()
        if head is None and last is not None:
            raise LedgerIntegrityError(
                "the ledger head record is missing; refusing to append to a chain that cannot "
                "be checked (run `releasekit ledger verify`)"
            )
        if head is not None and (last is None or (last.seq, last.hash) != (head.seq, head.hash)):
            raise LedgerIntegrityError(
                f"the ledger head says record {head.seq} is the newest but the table ends at "
                f"{last.seq if last else 'nothing'}; refusing to append (run `releasekit ledger "
                "verify`)",
                seq=(last.seq + 1) if last else 1,
            )
        ids = [ev.event_id for ev in events]
        dupes = (
            conn.execute(select(events_table.c.event_id).where(events_table.c.event_id.in_(ids)))
            .scalars()
            .all()
        )
        if dupes or len(set(ids)) != len(ids):
            raise LedgerError(f"event already recorded: {', '.join(dupes) or 'duplicate in batch'}")
        prev_seq = head.seq if head is not None else 0
        prev_hash = head.hash if head is not None else GENESIS
        prev_time = head.time if head is not None else ""
        # Times never go backwards along the chain, so "what was live at T" can trust order.
        now = max(format_time(dt.datetime.now(dt.UTC)), prev_time)
        rows: list[dict[str, Any]] = []
        for ev in events:
            row: dict[str, Any] = {
                "seq": prev_seq + 1,
                "event_id": ev.event_id,
                "type": str(EventType(ev.type).value),
                "time": now,
                "actor": ev.actor or self._default_actor(),
                "environment": ev.environment,
                "from_release": ev.from_release,
                "to_release": ev.to_release,
                "reason": ev.reason,
                "evidence": _evidence_text(ev.evidence),
                "live": ev.live,
                "prev_hash": prev_hash,
            }
            row["hash"] = record_hash(row)
            rows.append(row)
            prev_seq, prev_hash = row["seq"], row["hash"]
        conn.execute(events_table.insert(), rows)
        if head is None:
            conn.execute(head_table.insert().values(id=1, seq=prev_seq, hash=prev_hash, time=now))
        else:
            res = conn.execute(
                head_table.update()
                .where(head_table.c.id == 1, head_table.c.seq == head.seq)
                .values(seq=prev_seq, hash=prev_hash, time=now)
            )
            if res.rowcount != 1:
                raise _Contention("head moved")
        return [
            LedgerRecord(
                **{**r, "time": parse_stored_time(r["time"]), "evidence": json.loads(r["evidence"])}
            )
            for r in rows
        ]

    # -- reading ------------------------------------------------------------------------

    def records(
        self,
        *,
        environment: str | None = None,
        release: str | None = None,
        types: Sequence[str] | None = None,
        since: dt.datetime | None = None,
        until: dt.datetime | None = None,
        live: bool | None = None,
        limit: int | None = None,
        newest_first: bool = False,
    ) -> list[LedgerRecord]:
        """Records matching every filter given, in chain order (or newest first).

        `release` matches either side of an event (from or to); `since`/`until` are inclusive.
        """
        t = events_table
        q = select(t)
        if environment is not None:
            q = q.where(t.c.environment == environment)
        if release is not None:
            q = q.where(or_(t.c.to_release == release, t.c.from_release == release))
        if types:
            q = q.where(t.c.type.in_(list(types)))
        if since is not None:
            q = q.where(t.c.time >= format_time(since))
        if until is not None:
            q = q.where(t.c.time <= format_time(until))
        if live is not None:
            q = q.where(t.c.live == live)
        q = q.order_by(t.c.seq.desc() if newest_first else t.c.seq.asc())
        if limit is not None:
            q = q.limit(limit)
        with self._read() as conn:
            return [_to_record(r) for r in conn.execute(q)]

    def live_at(self, environment: str, at: dt.datetime | None = None) -> LedgerRecord | None:
        """The event that put the current release of `environment` in place at time `at`
        (now if None), or None if nothing was live there yet."""
        t = events_table
        q = select(t).where(t.c.environment == environment, t.c.live == True)  # noqa: E712
        if at is not None:
            q = q.where(t.c.time <= format_time(at))
        q = q.order_by(t.c.time.desc(), t.c.seq.desc()).limit(1)
        with self._read() as conn:
            row = conn.execute(q).first()
        return _to_record(row) if row is not None else None

    def current(self) -> list[LedgerRecord]:
        """For each environment, the event that put its current release in place."""
        t = events_table
        latest = (
            select(func.max(t.c.seq).label("seq"))
            .where(t.c.live == True)  # noqa: E712
            .group_by(t.c.environment)
            .subquery()
        )
        q = select(t).where(t.c.seq.in_(select(latest.c.seq))).order_by(t.c.environment)
        with self._read() as conn:
            return [_to_record(r) for r in conn.execute(q)]

    def release_ids(self) -> set[str]:
        """Every release id any event names (either side)."""
        t = events_table
        with self._read() as conn:
            to = conn.execute(select(t.c.to_release).distinct()).scalars().all()
            fr = conn.execute(select(t.c.from_release).distinct()).scalars().all()
        return {r for r in (*to, *fr) if r}

    def count(self) -> int:
        """Number of records."""
        with self._read() as conn:
            return int(conn.execute(select(func.count()).select_from(events_table)).scalar_one())

    # -- checking -----------------------------------------------------------------------

    def verify(self) -> VerifyResult:
        """Walk the whole chain; name the first record that was edited, deleted or reordered.

        Returns a result (ok or not) rather than raising, so a caller can report it; use
        `check()` to raise LedgerIntegrityError instead.
        """
        url = redact_url(self.url)
        expected_seq, prev_hash, n = 1, GENESIS, 0

        def bad(seq: int, problem: str, event_id: str | None = None) -> VerifyResult:
            return VerifyResult(
                ok=False,
                url=url,
                records=n,
                first_bad_seq=seq,
                event_id=event_id,
                problem=problem,
            )

        with self._read() as conn:
            head = conn.execute(select(head_table).where(head_table.c.id == 1)).first()
            result = conn.execution_options(yield_per=2000).execute(
                select(events_table).order_by(events_table.c.seq)
            )
            for row in result:
                m = dict(row._mapping)
                n += 1
                seq = m["seq"]
                if seq != expected_seq:
                    what = (
                        f"record {expected_seq} is missing (deleted)"
                        if expected_seq == seq - 1
                        else f"records {expected_seq}..{seq - 1} are missing (deleted)"
                    )
                    return bad(
                        expected_seq, f"{what}: the chain jumps from {expected_seq - 1} to {seq}"
                    )
                if m["prev_hash"] != prev_hash:
                    return bad(
                        seq,
                        f"record {seq} does not follow record {seq - 1}: its prev_hash does not "
                        f"match (records were reordered, or record {seq - 1} was rewritten)",
                        m["event_id"],
                    )
                if record_hash(m) != m["hash"]:
                    return bad(
                        seq,
                        f"record {seq} (event {m['event_id']}) was edited: its contents do not "
                        "match its hash",
                        m["event_id"],
                    )
                prev_hash = m["hash"]
                expected_seq += 1
        last_seq = expected_seq - 1
        if head is None:
            if n:
                return bad(last_seq + 1, "the ledger head record is missing (deleted)")
        elif (head.seq, head.hash) != (last_seq, prev_hash):
            if head.seq > last_seq:
                return bad(
                    last_seq + 1,
                    f"records {last_seq + 1}..{head.seq} are missing (deleted from the end): "
                    f"the head says the chain ends at {head.seq}",
                )
            return bad(last_seq, f"the ledger head does not match record {last_seq} (edited)")
        return VerifyResult(
            ok=True,
            url=url,
            records=n,
            head_seq=last_seq or None,
            head_hash=prev_hash if n else None,
        )

    def check(self) -> VerifyResult:
        """Like `verify()`, but raise LedgerIntegrityError naming the first bad record."""
        res = self.verify()
        if not res.ok:
            raise LedgerIntegrityError(f"ledger {res.url}: {res.problem}", seq=res.first_bad_seq)
        return res


def _retryable(exc: OperationalError) -> bool:
    text = str(exc.orig).lower() if exc.orig is not None else str(exc).lower()
    return any(
        s in text for s in ("locked", "busy", "already exists", "deadlock", "could not serialize")
    )


def _sqlite_transactions(engine: Engine, *, wal: bool) -> None:
    """Let SQLAlchemy, not the sqlite3 module, emit BEGIN, so a write transaction can take
    the write lock first (BEGIN IMMEDIATE) instead of failing on upgrade under contention."""

    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn: Any, _rec: Any) -> None:
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        if wal:
            # Readers do not block the writer (and vice versa); safe on local disks.
            cur.execute("PRAGMA journal_mode=WAL")
        cur.close()

    @event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        immediate = conn.get_execution_options().get("releasekit_immediate", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")
