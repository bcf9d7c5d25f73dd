"""Appending past a record that fails verification: the break-glass rollback's writer.

When the ledger does not verify (a junk row, a record signed by an untrusted or revoked key,
an edited row), every decision refuses to act on it. A break-glass rollback still records
what it did, in the same chain, so an auditor sees it where the failure is:

- its records are appended after the table's last row (not the head row's, which a junk row
  leaves behind): each is a well-formed record, hashed over its contents and the previous
  row's stored hash, and signed with the project's key (a trusted one: an untrusted or
  missing key is refused, as for any append to a ledger that trusts keys);
- the head row moves to the new record, and the git anchor follows (a warning when the
  anchored chain is not extended, as after any rewrite);
- the chain still fails verification at the first bad record afterwards: breaking glass
  repairs nothing, it records that it went past (the event's `break_glass` evidence).

    led = PastFailureLedger.of(open_ledger(settings), prefix)
    led.append(Event(...))     # chained after the last row, signed
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence

from sqlalchemy import Connection, select

from releasekit._support.text import redact_url
from releasekit.errors import LedgerError, SigningRequiredError
from releasekit.stores.ledger.chain import VerifiedPrefix
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
    events_table,
    format_time,
    head_table,
)
from releasekit.stores.ledger.store import Ledger


class PastFailureLedger(Ledger):
    """A project ledger that acts on its verified prefix only and appends past its failure.

    `verified()` passes (the caller decided on `prefix.records`, which verify); `append`
    chains after the last row whatever the rows after the prefix hold. Built from an open
    ledger with `of` (it shares that ledger's database, signer, keys and anchors)."""

    prefix: VerifiedPrefix

    @classmethod
    def of(cls, ledger: Ledger, prefix: VerifiedPrefix) -> PastFailureLedger:
        """This view of `ledger` (opened for writing), for a decision read from `prefix`."""
        view = cls.__new__(cls)
        view.__dict__.update(ledger.__dict__)
        view.prefix = prefix
        return view

    def verified(self, *, again: bool = False) -> None:
        """No check: the caller acts on `prefix.records`, which verified."""

    def append_many(self, events: Sequence[Event]) -> list[LedgerRecord]:
        """Append `events` after the table's last row, in one transaction (all or none)."""
        if not events:
            return []
        for ev in events:
            EventType(ev.type)
        if self.signer is None:
            raise SigningRequiredError(
                "refusing to break glass without a signing key: the record of going past a "
                f"failed verification of ledger {redact_url(self.url)} must be signed"
            )
        if self.trusted is not None and self.signer.key_id not in self.trusted:
            raise SigningRequiredError(
                f"refusing to break glass with key {self.signer.key_id}: it is not one of the "
                "keys the repository trusts, so its record would prove nothing"
            )
        with self._write() as conn:
            recs = self._append_past(conn, events)
        self._anchor_after_append(recs[-1])
        self._tell_listeners(recs)
        return recs

    def _append_past(self, conn: Connection, events: Sequence[Event]) -> list[LedgerRecord]:
        assert self.signer is not None  # checked by the caller
        head = conn.execute(select(head_table).where(head_table.c.id == 1)).first()
        last = conn.execute(
            select(events_table.c.seq, events_table.c.hash)
            .order_by(events_table.c.seq.desc())
            .limit(1)
        ).first()
        dupes = recorded_already(conn, [ev.event_id for ev in events])
        if dupes:
            raise LedgerError(f"event already recorded: {', '.join(dupes)}")
        after = (int(last.seq), str(last.hash)) if last is not None else (0, GENESIS)
        # Time follows the verified records, not whatever a bad row claims.
        verified_time = self.prefix.records[-1].time if self.prefix.records else None
        now = format_time(max(dt.datetime.now(dt.UTC), verified_time or dt.datetime.now(dt.UTC)))
        rows, (prev_seq, prev_hash) = insert_chained(
            conn, events, after=after, time=now, default_actor=self._default_actor()
        )
        sigs = insert_signatures(conn, rows, self.signer)
        if head is None:
            conn.execute(head_table.insert().values(id=1, seq=prev_seq, hash=prev_hash, time=now))
        else:
            conn.execute(
                head_table.update()
                .where(head_table.c.id == 1)
                .values(seq=prev_seq, hash=prev_hash, time=now)
            )
        return records_of(rows, sigs)
