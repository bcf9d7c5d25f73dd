"""The event ledger: an append-only, hash-chained record of every change to what runs where.

Each record carries the hash of the one before it, so editing, deleting or reordering a row
breaks the chain at that row and `Ledger.verify()` names it. Storage goes through SQLAlchemy:
SQLite by default (Settings.ledger_url), any database URL for a team. Appends from several
processes serialise on the database: SQLite takes its write lock up front (BEGIN IMMEDIATE),
and on every database the primary key on `seq` plus a compare-and-swap on the head row turn
a lost race into a retry, never a fork.

Beyond the chain (which anyone who can write the database can recompute):
- each record is signed with an Ed25519 key kept outside the database (`stores.signing`);
  the repository's `keys/*.pub` say whose signatures count;
- each append advances a git ref in the project repository (`stores.anchor`), so a ledger
  rewritten, truncated or replaced behind a pushed anchor fails `verify`;
- named locks (`Ledger.lock`, `stores.locks`) serialise the writers of one environment or
  one release across processes and machines.

`open_ledger(settings)` wires all three from the settings; `Ledger(url)` alone is the bare
chain (no signing, no anchors), as the tests of the chain itself use it.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import random
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
    text,
)
from sqlalchemy.engine import make_url
from sqlalchemy.exc import (
    ArgumentError,
    IntegrityError,
    OperationalError,
    ProgrammingError,
    SQLAlchemyError,
)
from sqlalchemy.pool import StaticPool

from releasekit._support.text import redact_url
from releasekit.errors import (
    LedgerError,
    LedgerIntegrityError,
    LedgerNotFoundError,
    NotAProjectError,
    SignatureError,
    SigningRequiredError,
)
from releasekit.stores import anchor as anchors
from releasekit.stores import locks
from releasekit.stores.signing import (
    KeyPair,
    Signer,
    find_signer,
    generate_keypair,
    trusted_keys,
    verify_signature,
)

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    from releasekit.config import Settings

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
    DEPLOY_FAILED = "deploy_failed"  # failed to start or its smoke suite, or was reverted
    MARK_BAD = "mark_bad"  # a release was rolled back from: refused by promote unless forced
    DOWN = "down"  # an environment's gateway and servers were stopped
    REPAIR = "repair"  # an MLflow alias put back in line with the ledger (not live)


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
    key_id: str | None = Field(None, description="id of the key that signed it; None: unsigned")
    signature: str | None = None


class VerifyResult(BaseModel):
    """Outcome of checking the ledger: the chain, every signature, every git anchor.

    `first_bad_seq` names the first broken record; `signing` is "signed" (every record),
    "unsigned" (none), "partly signed" (records before signing began are not), or
    "not checked" (no trusted keys given); `anchoring` says whether git anchors were checked.
    """

    ok: bool
    url: str
    records: int
    head_seq: int | None = None
    head_hash: str | None = None
    first_bad_seq: int | None = None
    event_id: str | None = None
    problem: str | None = None
    signing: str = "not checked"
    signed: int = 0
    unsigned: int = 0
    key_ids: list[str] = Field(default_factory=list)
    anchoring: str = "not checked"
    anchors: int = 0
    anchored_seq: int | None = None
    notes: list[str] = Field(default_factory=list)


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

# A record's signature, by seq. Not part of the hashed payload (a signature is over the
# hash), so ledgers written before signing existed keep their hashes.
signatures_table = Table(
    "event_signatures",
    _meta,
    Column("seq", Integer, primary_key=True, autoincrement=False),
    Column("key_id", String(16), nullable=False),
    Column("signature", String(128), nullable=False),
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
    has_sig = "key_id" in m
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
        key_id=m["key_id"] if has_sig else None,
        signature=m["signature"] if has_sig else None,
    )


class _Contention(Exception):
    """Internal: another writer moved the head between our read and our write."""


class Ledger:
    """The event ledger at a SQLAlchemy URL (created on first use unless `create=False`).

    Usage: `open_ledger(settings).append(Event(type=EventType.BUILD, to_release=rid))`.
    """

    def __init__(
        self,
        url: str,
        *,
        actor: str | None = None,
        timeout_s: float = 30.0,
        sqlite_immediate: bool = True,
        create: bool = True,
        signer: Signer | None = None,
        anchor_repo: Path | None = None,
        anchor_ref: str = anchors.ANCHOR_REF,
        trusted: Mapping[str, Ed25519PublicKey] | None = None,
        require_signed: bool | None = None,
    ) -> None:
        """`actor` is used for events that name none (default: provenance.actor());
        `timeout_s` bounds how long an append waits for another writer.
        `sqlite_immediate=False` makes SQLite use the portable optimistic path (unique seq,
        compare-and-swap on the head, retry) that other databases use; for tests.
        `create=False` never creates anything: a missing database or missing tables raise
        LedgerNotFoundError. `signer` signs every record appended; `anchor_repo` is the git
        repository whose `anchor_ref` each append advances (failures become `warnings`);
        `trusted` are the public keys `verify` accepts (None: signatures not checked).
        `require_signed` refuses unsigned appends (SigningRequiredError); default: when
        `trusted` holds a key. An unsigned append after a signed record is refused always."""
        self.url = url
        self._immediate = sqlite_immediate
        self._actor = actor
        self._timeout_s = timeout_s
        self.signer = signer
        self.anchor_repo = anchor_repo
        self.anchor_ref = anchor_ref
        self.trusted = trusted
        self.require_signed = bool(trusted) if require_signed is None else require_signed
        self.trusted_from: str | None = None
        """Where `trusted` was read (a git revision), for verify's report."""
        self.warnings: list[str] = []
        """Problems that did not stop an append (an anchor that could not be written)."""
        self._engine = self._make_engine(url, timeout_s, create=create)
        self._has_sigs = True
        self._ensure_schema(create=create)

    # -- plumbing -----------------------------------------------------------------------

    @staticmethod
    def _make_engine(url: str, timeout_s: float, *, create: bool = True) -> Engine:
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
                path = Path(u.database).expanduser()
                if create:
                    path.parent.mkdir(parents=True, exist_ok=True)
                elif not path.is_file():
                    # Checked before connecting: sqlite3 would create an empty file.
                    raise LedgerNotFoundError(
                        f"no ledger at {redact_url(url)} (the file {path} does not exist)",
                        url=redact_url(url),
                    )
        try:
            engine = create_engine(u, **kwargs)
        except (SQLAlchemyError, ImportError) as exc:
            raise LedgerError(f"cannot open ledger {redact_url(url)}: {exc}") from exc
        if sqlite:
            _sqlite_transactions(engine, wal=not kwargs.get("poolclass") and create)
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

    def _ensure_schema(self, *, create: bool = True) -> None:
        try:
            insp = inspect(self._engine)
            have = {t for t in ("events", "ledger_head", "event_signatures") if insp.has_table(t)}
        except SQLAlchemyError as exc:
            raise LedgerError(f"cannot open ledger {redact_url(self.url)}: {exc}") from exc
        if {"events", "ledger_head"} <= have and (not create or "event_signatures" in have):
            # No write lock needed: a read-only auditor can still query a ledger written
            # before signatures existed.
            self._has_sigs = "event_signatures" in have
            return
        if not create:
            raise LedgerNotFoundError(
                f"no ledger at {redact_url(self.url)} (the database has no ledger tables)",
                url=redact_url(self.url),
            )
        for attempt in range(8):
            try:
                with self._write() as conn:
                    if conn.dialect.name == "postgresql":
                        # Serialise first-time creators: concurrent CREATE TABLE on
                        # PostgreSQL fails on its catalog's unique index, not "exists".
                        conn.execute(text("SELECT pg_advisory_xact_lock(7269417751)"))
                    _meta.create_all(conn, checkfirst=True)
                self._has_sigs = True
                return
            except (OperationalError, IntegrityError, ProgrammingError) as exc:
                # Another process created the tables between our check and our CREATE.
                retry = isinstance(exc, IntegrityError) or "already exists" in str(exc).lower()
                if isinstance(exc, OperationalError):
                    retry = retry or _retryable(exc)
                if attempt == 7 or not retry:
                    raise LedgerError(f"cannot open ledger {redact_url(self.url)}: {exc}") from exc
                time.sleep(0.05 * (attempt + 1))
            except SQLAlchemyError as exc:
                raise LedgerError(f"cannot open ledger {redact_url(self.url)}: {exc}") from exc

    def _select(self) -> Any:
        """SELECT of every record column, with its signature when the table exists."""
        t = events_table
        if not self._has_sigs:
            return select(t)
        sig = signatures_table
        return select(t, sig.c.key_id, sig.c.signature).select_from(
            t.outerjoin(sig, sig.c.seq == t.c.seq)
        )

    def lock(self, name: str, *, timeout_s: float | None = None) -> AbstractContextManager[Any]:
        """Hold the named lock (e.g. `env:production`, `release:<id>`) in this ledger's
        database for the block; raises LedgerLockTimeoutError after `timeout_s`
        (default: the ledger's timeout). Not re-entrant."""
        return locks.hold(
            self._engine,
            name,
            write=self._write,
            owner=self._default_actor(),
            timeout_s=self._timeout_s if timeout_s is None else timeout_s,
        )

    def head(self) -> tuple[int, str] | None:
        """(seq, hash) of the newest record as the head row says, or None when empty."""
        with self._read() as conn:
            row = conn.execute(select(head_table).where(head_table.c.id == 1)).first()
        return (int(row.seq), str(row.hash)) if row is not None else None

    def anchor(self) -> anchors.Anchor | None:
        """Advance the git anchor to the current head (`releasekit ledger anchor`); None
        when it already anchors that head. Raises AnchorError when there is no repository."""
        if self.anchor_repo is None:
            raise anchors.AnchorError("no git repository configured for ledger anchors")
        head = self.head()
        if head is None:
            return None
        key = None
        if self._has_sigs:
            with self._read() as conn:
                key = conn.execute(
                    select(signatures_table.c.key_id).where(signatures_table.c.seq == head[0])
                ).scalar()
        return anchors.anchor(
            self.anchor_repo,
            head[0],
            head[1],
            key_id=key,
            ref=self.anchor_ref,
            ledger=redact_url(self.url),
        )

    def _anchor_after_append(self, last: LedgerRecord) -> None:
        if self.anchor_repo is None:
            return
        try:
            anchors.anchor(
                self.anchor_repo,
                last.seq,
                last.hash,
                key_id=last.key_id,
                ref=self.anchor_ref,
                ledger=redact_url(self.url),
            )
        except anchors.AnchorMismatchError as exc:
            self.warnings.append(f"ledger anchor: {exc.message} (run `releasekit ledger verify`)")
        except anchors.AnchorError as exc:
            self.warnings.append(
                f"the ledger head (record {last.seq}) is not anchored in git: {exc.message}"
            )
        except OSError as exc:  # the record is committed: an anchor problem must not hide it
            self.warnings.append(
                f"the ledger head (record {last.seq}) is not anchored in git: {exc}"
            )

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
                    recs = self._append_locked(conn, events)
                # Committed: now (outside the transaction) move the git anchor forward.
                self._anchor_after_append(recs[-1])
                return recs
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

    def _refuse_unsigned(self, conn: Connection, head_seq: int | None) -> None:
        """Raise SigningRequiredError when this ledger must not take an unsigned record: the
        repository trusts a key, or the newest record is signed (an unsigned record after it
        would break verification for good)."""
        if self.require_signed:
            kids = ", ".join(sorted(self.trusted or {})) or "a key"
            raise SigningRequiredError(
                f"refusing to append an unsigned record to ledger {redact_url(self.url)}: the "
                f"repository trusts {kids}, so every record must be signed, and no signing "
                "key is configured"
            )
        if head_seq is None or not self._has_sigs:
            return
        kid = conn.execute(
            select(signatures_table.c.key_id).where(signatures_table.c.seq == head_seq)
        ).scalar()
        if kid is not None:
            raise SigningRequiredError(
                f"refusing to append an unsigned record to ledger {redact_url(self.url)}: its "
                f"newest record ({head_seq}) is signed by key {kid}, and an unsigned record "
                "after it would fail verification for good; no signing key is configured"
            )

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
        if self.signer is None:
            self._refuse_unsigned(conn, head.seq if head is not None else None)
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
        sigs: dict[int, tuple[str, str]] = {}
        if self.signer is not None:
            if not self._has_sigs:  # pragma: no cover - create=True always makes the table
                raise LedgerError("this ledger was opened read-only; it cannot sign records")
            for r in rows:
                sigs[r["seq"]] = (self.signer.key_id, self.signer.sign(r["hash"]))
            conn.execute(
                signatures_table.insert(),
                [{"seq": k, "key_id": v[0], "signature": v[1]} for k, v in sigs.items()],
            )
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
                **{
                    **r,
                    "time": parse_stored_time(r["time"]),
                    "evidence": json.loads(r["evidence"]),
                },
                key_id=sigs[r["seq"]][0] if r["seq"] in sigs else None,
                signature=sigs[r["seq"]][1] if r["seq"] in sigs else None,
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
        q = self._select()
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
        q = self._select().where(t.c.environment == environment, t.c.live == True)  # noqa: E712
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
        q = self._select().where(t.c.seq.in_(select(latest.c.seq))).order_by(t.c.environment)
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

    def verify(
        self,
        *,
        trusted: Mapping[str, Ed25519PublicKey] | None = None,
        anchor_repo: Path | None = None,
        remote: str | None = None,
    ) -> VerifyResult:
        """Check the whole ledger; name the first record that was edited, deleted, reordered,
        re-signed or rewritten behind a git anchor.

        Checks, in one pass: the chain (seq, prev_hash, hash) and the head row; every
        signature against `trusted` (default: the keys the ledger was opened with; None
        and no keys configured: signatures are not checked) and that no record after a signed
        one is unsigned; and that the ledger extends every anchored head in `anchor_repo`
        (default: the ledger's anchor repository). Once keys are trusted, a ledger whose
        records are all unsigned fails too (its signatures were removed).

        `remote` (a git remote of the anchor repository) fetches the anchor that was pushed
        there and the remote's default branch: the ledger must extend that anchor, and the
        keys trusted are the ones committed on that branch, so neither a re-anchored local
        ref nor a locally committed key can vouch for a replaced ledger.

        Returns a result (ok or not) rather than raising, so a caller can report it; use
        `check()` to raise instead.
        """
        url = redact_url(self.url)
        trusted = self.trusted if trusted is None else trusted
        trusted_from = self.trusted_from
        repo = anchor_repo or self.anchor_repo
        remote_ref: str | None = None
        remote_bad: tuple[int, str, str | None] | None = None
        if remote is not None:
            if repo is None:
                remote_bad = (1, f"cannot check remote {remote}: no git repository", None)
            else:
                try:
                    remote_ref, remote_head = anchors.fetch_remote(repo, remote)
                except anchors.AnchorError as exc:
                    remote_bad = (1, exc.message, None)
                else:
                    if remote_head is not None:
                        trusted = trusted_keys(repo, rev=remote_head)
                        trusted_from = f"{remote}'s default branch"
        expected_seq, prev_hash, n = 1, GENESIS, 0
        chain_bad: tuple[int, str, str | None] | None = None
        sig_bad: tuple[int, str, str | None] | None = None
        pairs: list[tuple[int, str]] = []
        signed = unsigned = 0
        first_signed: int | None = None
        key_ids: set[str] = set()

        with self._read() as conn:
            head = conn.execute(select(head_table).where(head_table.c.id == 1)).first()
            sigs: dict[int, tuple[str, str]] = {}
            if self._has_sigs:
                for srow in conn.execute(select(signatures_table)):
                    sigs[int(srow.seq)] = (str(srow.key_id), str(srow.signature))
            result = conn.execution_options(yield_per=2000).execute(
                select(events_table).order_by(events_table.c.seq)
            )
            for row in result:
                m = dict(row._mapping)
                n += 1
                seq = m["seq"]
                pairs.append((seq, m["hash"]))
                if chain_bad is None:
                    chain_bad = _chain_problem(m, expected_seq, prev_hash)
                    prev_hash = m["hash"]
                    expected_seq = seq + 1
                got = sigs.get(seq)
                if got is not None:
                    signed += 1
                    key_ids.add(got[0])
                    first_signed = first_signed or seq
                    if trusted is not None and sig_bad is None:
                        try:
                            verify_signature(
                                trusted,
                                record_hash=m["hash"],
                                key_id=got[0],
                                signature=got[1],
                                seq=seq,
                            )
                        except SignatureError as exc:
                            sig_bad = (seq, exc.message, m["event_id"])
                else:
                    unsigned += 1
                    if first_signed is not None and sig_bad is None:
                        sig_bad = (
                            seq,
                            f"record {seq} is unsigned although record {first_signed} before "
                            "it is signed: its signature was removed, or it was written by a "
                            "process without the signing key",
                            m["event_id"],
                        )
        last_seq = expected_seq - 1
        if chain_bad is None:
            if head is None:
                if n:
                    chain_bad = (last_seq + 1, "the ledger head record is missing (deleted)", None)
            elif (head.seq, head.hash) != (last_seq, prev_hash):
                if head.seq > last_seq:
                    chain_bad = (
                        last_seq + 1,
                        f"records {last_seq + 1}..{head.seq} are missing (deleted from the "
                        f"end): the head says the chain ends at {head.seq}",
                        None,
                    )
                else:
                    chain_bad = (
                        last_seq,
                        f"the ledger head does not match record {last_seq} (edited)",
                        None,
                    )
        if trusted and n and signed == 0 and sig_bad is None:
            sig_bad = (
                last_seq,
                f"no record is signed although the repository trusts key(s) "
                f"{', '.join(sorted(trusted))}: the signatures were removed (and the chain "
                "perhaps rewritten), or the ledger was written without the signing key",
                None,
            )

        notes: list[str] = []
        anchor_bad: tuple[int, str, str | None] | None = None
        anchoring = "not checked"
        n_anchors = 0
        anchored_seq: int | None = None
        if repo is None:
            notes.append("no git repository configured: anchors not checked")
        else:
            try:
                refs = anchors.anchor_refs(repo)
                checked = [(ref, anchors.read_anchors(repo, ref=ref)) for ref in refs]
            except anchors.AnchorError as exc:
                notes.append(f"anchors not checked: {exc.message}")
                checked = []
            else:
                anchoring = "anchored" if any(a for _, a in checked) else "no anchors yet"
            if remote_ref is not None and not any(r == remote_ref and a for r, a in checked):
                remote_bad = (1, f"remote {remote} holds no ledger anchor", None)
            for _ref, found in checked:
                n_anchors += len(found)
                if found:
                    anchored_seq = max(anchored_seq or 0, found[-1].seq)
                res = anchors.check_extends(pairs, found)
                if not res.ok and res.first_bad_seq is not None:
                    cand = (res.first_bad_seq, res.problem or "anchor mismatch", None)
                    if anchor_bad is None or cand[0] < anchor_bad[0]:
                        anchor_bad = cand
                    continue
                for a in found:  # the signer an anchor saw must still be there
                    if a.key_id is None:
                        continue
                    now = sigs.get(a.seq)
                    if now is None or now[0] != a.key_id:
                        what = "unsigned" if now is None else f"signed by key {now[0]}"
                        cand = (
                            a.seq,
                            f"record {a.seq} was signed by key {a.key_id} when {a.ref} "
                            f"anchored it; it is now {what}",
                            None,
                        )
                        if anchor_bad is None or cand[0] < anchor_bad[0]:
                            anchor_bad = cand
                        break
        if trusted is None:
            signing = "not checked"
        elif n == 0:
            signing = "empty"
        elif signed == n:
            signing = "signed"
        elif signed == 0:
            signing = "unsigned"
        else:
            signing = "partly signed"
        if signing == "partly signed" and first_signed:
            notes.append(f"records 1..{first_signed - 1} predate signing (unsigned)")
        if trusted_from:
            notes.append(f"trusted keys: {trusted_from}")
        problems = [p for p in (chain_bad, sig_bad, anchor_bad, remote_bad) if p is not None]
        base = {
            "url": url,
            "records": n,
            "signing": signing,
            "signed": signed,
            "unsigned": unsigned,
            "key_ids": sorted(key_ids),
            "anchoring": anchoring,
            "anchors": n_anchors,
            "anchored_seq": anchored_seq,
        }
        if problems:
            first = min(problems, key=lambda p: p[0])  # stable: chain, then signature, anchor
            others = [p[1] for p in problems if p is not first]
            return VerifyResult(
                ok=False,
                first_bad_seq=first[0],
                event_id=first[2],
                problem=first[1],
                notes=notes + others,
                **base,
            )
        return VerifyResult(
            ok=True,
            head_seq=last_seq or None,
            head_hash=prev_hash if n else None,
            notes=notes,
            **base,
        )

    def check(self) -> VerifyResult:
        """Like `verify()`, but raise LedgerIntegrityError naming the first bad record."""
        res = self.verify()
        if not res.ok:
            raise LedgerIntegrityError(f"ledger {res.url}: {res.problem}", seq=res.first_bad_seq)
        return res


def _chain_problem(
    m: dict[str, Any], expected_seq: int, prev_hash: str
) -> tuple[int, str, str | None] | None:
    """The first chain problem at this row, or None: a gap, a broken link, an edited row."""
    seq = m["seq"]
    if seq != expected_seq:
        what = (
            f"record {expected_seq} is missing (deleted)"
            if expected_seq == seq - 1
            else f"records {expected_seq}..{seq - 1} are missing (deleted)"
        )
        return (expected_seq, f"{what}: the chain jumps from {expected_seq - 1} to {seq}", None)
    if m["prev_hash"] != prev_hash:
        return (
            seq,
            f"record {seq} does not follow record {seq - 1}: its prev_hash does not match "
            f"(records were reordered, or record {seq - 1} was rewritten)",
            m["event_id"],
        )
    if record_hash(m) != m["hash"]:
        return (
            seq,
            f"record {seq} (event {m['event_id']}) was edited: its contents do not match its hash",
            m["event_id"],
        )
    return None


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


def is_project(root: Path) -> bool:
    """True when `root` looks like a releasekit project: releasekit.toml, .git or manifests/."""
    return (
        (root / "releasekit.toml").is_file()
        or (root / ".git").exists()
        or (root / "manifests").is_dir()
    )


def require_project(settings: Settings) -> None:
    """Raise NotAProjectError when the settings' root is not a releasekit project."""
    if not is_project(settings.root):
        raise NotAProjectError(
            f"{settings.root} is not inside a releasekit project (no releasekit.toml, .git or "
            "manifests/ here or above)",
            root=settings.root,
        )


def open_ledger(settings: Settings, *, read_only: bool = False) -> Ledger:
    """The project's ledger, signing with the configured key and anchoring in its git repo.

    `read_only=True` (status, history, at, show, diff, ledger verify) never creates
    anything: a ledger that does not exist raises LedgerNotFoundError naming the URL (and
    what the git anchors say it held). Outside a project: NotAProjectError.
    """
    require_project(settings)
    url = settings.ledger_url or ""
    signer = None if read_only else find_signer(settings.root, path=settings.signing_key)
    rev = settings.trusted_keys_rev
    try:
        led = Ledger(
            url,
            actor=settings.actor,
            create=not read_only,
            signer=signer,
            anchor_repo=settings.root,
            trusted=trusted_keys(settings.root, rev=rev),
        )
    except LedgerNotFoundError as exc:
        held = _anchored_seq(settings.root)
        if held:
            raise LedgerNotFoundError(
                f"{exc.message}; the git anchor says this ledger held {held} records: it was "
                "deleted or moved",
                url=exc.url,
            ) from exc
        raise
    led.trusted_from = (
        f"committed keys/ at {rev}"
        if anchors.git_dir(settings.root) is not None
        else "keys/ in the working tree (not a git repository)"
    )
    return led


def _anchored_seq(repo: Path) -> int | None:
    try:
        refs = anchors.anchor_refs(repo)
        found = [a for ref in refs for a in anchors.read_anchors(repo, ref=ref)]
    except anchors.AnchorError:
        return None
    return max((a.seq for a in found), default=None)


def keygen(settings: Settings, *, private_path: Path | None = None) -> KeyPair:
    """`releasekit ledger keygen`: a new Ed25519 keypair for the project at `settings.root`
    (which must be a releasekit project): the private PEM under .releasekit/keys/ (or at
    `private_path`), the public one at keys/<key id>.pub for the team to commit."""
    require_project(settings)
    return generate_keypair(settings.root, private_path=private_path)
