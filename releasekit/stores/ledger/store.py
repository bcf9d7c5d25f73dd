"""The ledger store: the database, appends (chained, signed, anchored) and opening a project's
ledger from its settings."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    Connection,
    Engine,
    create_engine,
    event,
    inspect,
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

from releasekit._support.retry import RetryPolicy
from releasekit._support.text import redact_url
from releasekit.errors import (
    LedgerError,
    LedgerIntegrityError,
    LedgerNotFoundError,
    NotAProjectError,
    ReleasekitError,
    SigningKeyError,
    SigningRequiredError,
)
from releasekit.notify import notifier_for
from releasekit.stores import anchor as anchors
from releasekit.stores import locks
from releasekit.stores.ledger.chain import LedgerVerification
from releasekit.stores.ledger.queries import LedgerQueries
from releasekit.stores.ledger.rows import (
    insert_chained,
    insert_signatures,
    recorded_already,
    records_of,
)
from releasekit.stores.ledger.schema import (
    GENESIS,
    Event,
    EventType,
    LedgerRecord,
    _meta,
    events_table,
    format_time,
    head_table,
    signatures_table,
)
from releasekit.stores.signing import (
    ApproverSet,
    KeyPair,
    Signer,
    approver_set,
    find_signer,
    generate_keypair,
    revoked_after,
    trusted_keys,
)
from releasekit.stores.trust import committed_config, trust_root

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    from releasekit.config import Settings


class _Contention(Exception):
    """Internal: another writer moved the head between our read and our write."""


class Ledger(LedgerQueries, LedgerVerification):
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
        self.listeners: list[Callable[[dict[str, Any]], None]] = []
        """Called with each committed record (as JSON-able data), e.g. webhooks."""
        self.require_signed = bool(trusted) if require_signed is None else require_signed
        self.trusted_from: str | None = None
        """Where `trusted` was read (a git revision), for verify's report."""
        self.warnings: list[str] = []
        """Problems that did not stop an append (an anchor that could not be written)."""
        self.approvers: dict[str, ApproverSet] = {}
        """Per environment, who may approve a release for it (from the settings, keys from
        the trusted revision); empty: no approval policy known (a bare ledger)."""
        self.acting_key_id: str | None = signer.key_id if signer is not None else None
        """The key this process acts (promotes) with, even when opened read-only: an
        approval signed with it is a self-approval and does not count."""
        self._verified: tuple[int, str] | None = None
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

        def create_tables() -> None:
            with self._write() as conn:
                if conn.dialect.name == "postgresql":
                    # Serialise first-time creators: concurrent CREATE TABLE on
                    # PostgreSQL fails on its catalog's unique index, not "exists".
                    conn.execute(text("SELECT pg_advisory_xact_lock(7269417751)"))
                _meta.create_all(conn, checkfirst=True)

        try:
            _CREATE_RETRY.call(create_tables)
        except SQLAlchemyError as exc:
            raise LedgerError(f"cannot open ledger {redact_url(self.url)}: {exc}") from exc
        self._has_sigs = True

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

        def write() -> list[LedgerRecord]:
            with self._write() as conn:
                return self._append_locked(conn, events)

        # Jittered, capped backoff: losers retry soon, and not in lockstep.
        policy = RetryPolicy(
            attempts=None,
            deadline_s=self._timeout_s,
            base_s=0.004,
            cap_s=0.05,
            retry_on=(IntegrityError, _Contention, OperationalError),
            retry_if=_contended,
        )
        try:
            recs = policy.call(write)
        except (IntegrityError, _Contention, OperationalError) as exc:
            if not _contended(exc):
                raise LedgerError(f"cannot append to ledger {redact_url(self.url)}: {exc}") from exc
            raise LedgerError(
                f"cannot append to ledger {redact_url(self.url)}: another writer kept it busy "
                f"({exc})"
            ) from exc
        except SQLAlchemyError as exc:
            raise LedgerError(f"cannot append to ledger {redact_url(self.url)}: {exc}") from exc
        # Committed: now (outside the transaction) move the git anchor forward.
        self._anchor_after_append(recs[-1])
        self._tell_listeners(recs)
        return recs

    def _tell_listeners(self, recs: Sequence[LedgerRecord]) -> None:
        """Hand each committed record to the listeners (notifications); a listener's
        failure is logged and never undoes or blocks the append."""
        for rec in recs:
            data = rec.model_dump(mode="json")
            for listener in self.listeners:
                try:
                    listener(data)
                except Exception:
                    log.exception("ledger listener failed on record %s", rec.seq)

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

    def _refuse_untrusted(self, first_seq: int) -> None:
        """Raise SigningKeyError when the signing key is one this ledger's trusted keys do not
        hold, or revoke before record `first_seq`: such a record would fail verification, and
        every decision read from the ledger after it with it."""
        if self.signer is None or self.trusted is None:
            return
        kid = self.signer.key_id
        where = self.trusted_from or "the trusted keys"
        if kid not in self.trusted:
            raise SigningKeyError(
                f"refusing to append to ledger {redact_url(self.url)}: the signing key {kid} is "
                f"not trusted (no keys/{kid}.pub in {where})",
                remedy=f"land keys/{kid}.pub on the protected ref through review and fetch, or "
                "sign with a trusted key (RELEASEKIT_SIGNING_KEY); nothing was written",
            )
        cut = revoked_after(self.trusted, kid)
        if cut is not None and first_seq > cut:
            raise SigningKeyError(
                f"refusing to append to ledger {redact_url(self.url)}: the signing key {kid} is "
                f"revoked after record {cut} (keys/revoked in {where})",
                remedy="sign with another trusted key (RELEASEKIT_SIGNING_KEY); nothing was "
                "written",
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
        else:
            self._refuse_untrusted(head.seq + 1 if head is not None else 1)
        ids = [ev.event_id for ev in events]
        dupes = recorded_already(conn, ids)
        if dupes or len(set(ids)) != len(ids):
            raise LedgerError(f"event already recorded: {', '.join(dupes) or 'duplicate in batch'}")
        prev_time = head.time if head is not None else ""
        # Times never go backwards along the chain, so "what was live at T" can trust order.
        now = max(format_time(dt.datetime.now(dt.UTC)), prev_time)
        after = (head.seq, head.hash) if head is not None else (0, GENESIS)
        rows, (prev_seq, prev_hash) = insert_chained(
            conn, events, after=after, time=now, default_actor=self._default_actor()
        )
        sigs: dict[int, tuple[str, str]] = {}
        if self.signer is not None:
            if not self._has_sigs:  # pragma: no cover - create=True always makes the table
                raise LedgerError("this ledger was opened read-only; it cannot sign records")
            sigs = insert_signatures(conn, rows, self.signer)
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
        return records_of(rows, sigs)


def _retryable(exc: OperationalError) -> bool:
    text = str(exc.orig).lower() if exc.orig is not None else str(exc).lower()
    return any(
        s in text for s in ("locked", "busy", "already exists", "deadlock", "could not serialize")
    )


def _contended(exc: BaseException) -> bool:
    """Whether a failed append lost to another writer (and is worth another try)."""
    return not isinstance(exc, OperationalError) or _retryable(exc)


def _lost_create_race(exc: BaseException) -> bool:
    """Whether creating the tables failed because another process created them between our
    check and our CREATE (or held the database a moment)."""
    if isinstance(exc, IntegrityError) or "already exists" in str(exc).lower():
        return True
    return isinstance(exc, OperationalError) and _retryable(exc)


# Creating the tables: up to 8 tries, 0.05 s apart and growing (with jitter).
_CREATE_RETRY = RetryPolicy(
    attempts=8,
    base_s=0.05,
    cap_s=0.4,
    retry_on=(OperationalError, IntegrityError, ProgrammingError),
    retry_if=_lost_create_race,
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
    tr = trust_root(settings.root)
    trusted = trusted_keys(settings.root, trust=tr)
    try:
        led = Ledger(
            url,
            actor=settings.actor,
            create=not read_only,
            signer=signer,
            anchor_repo=settings.root,
            trusted=trusted,
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
    shown = f"{tr.rev} ({tr.commit[:12]})" if tr.commit else "HEAD"
    led.trusted_from = (
        f"committed keys/ at {shown}"
        if tr.in_git
        else "keys/ in the working tree (not a git repository)"
    )
    where = f"{shown}:keys" if tr.in_git else "keys/"
    led.approvers = {
        name: approver_set(name, entries, trusted, required=required, where=where)
        for name, (entries, required) in _approver_policy(settings, tr.commit).items()
    }
    if read_only:
        try:  # who would act: a self-approval is refused in a dry run too
            acting = find_signer(settings.root, path=settings.signing_key)
        except ReleasekitError:
            acting = None
        led.acting_key_id = acting.key_id if acting is not None else None
    if not read_only:
        notifier = notifier_for(settings)
        if notifier is not None:
            led.listeners.append(notifier.on_record)
    return led


def _approver_policy(settings: Settings, commit: str | None) -> dict[str, tuple[list[str], bool]]:
    """Per environment, (approvers, requires_approval) as committed at the trust commit
    (`commit`), never as this command's settings say; outside git (no commit), the
    settings'. An environment the settings name but the commit does not keeps the settings'
    approval requirement with no approvers: nothing can approve for it."""
    if commit is None:
        return {
            name: (list(cfg.approvers), cfg.requires_approval)
            for name, cfg in settings.environments.items()
        }
    try:
        data = committed_config(settings.root, commit) or {}
    except ReleasekitError:
        data = {}
    envs = data.get("environments")
    out: dict[str, tuple[list[str], bool]] = {}
    for name, table in (envs if isinstance(envs, dict) else {}).items():
        if not isinstance(table, dict):
            continue
        raw = table.get("approvers", [])
        entries = [str(e) for e in raw] if isinstance(raw, list) else []
        out[str(name)] = (entries, bool(table.get("requires_approval", False)))
    for name, cfg in settings.environments.items():
        if name not in out:
            out[name] = ([], cfg.requires_approval)
    return out


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
