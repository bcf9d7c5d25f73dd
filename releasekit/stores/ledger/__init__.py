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

Modules: `schema` (event types, the stored record, the tables, the record hash), `store`
(the database, appends, `open_ledger`), `chain` (`verify`: chain, signatures, anchors),
`queries` (records, what was live when).
"""

from __future__ import annotations

from releasekit.errors import LedgerNotFoundError
from releasekit.stores.ledger.chain import DecisionRecordsError, VerifyResult
from releasekit.stores.ledger.schema import (
    GENESIS,
    HASH_VERSION,
    Event,
    EventType,
    LedgerRecord,
    events_table,
    format_time,
    head_table,
    parse_stored_time,
    record_hash,
    signatures_table,
)
from releasekit.stores.ledger.store import (
    Ledger,
    is_project,
    keygen,
    open_ledger,
    require_project,
)

__all__ = [
    "GENESIS",
    "HASH_VERSION",
    "DecisionRecordsError",
    "Event",
    "EventType",
    "Ledger",
    "LedgerNotFoundError",
    "LedgerRecord",
    "VerifyResult",
    "events_table",
    "format_time",
    "head_table",
    "is_project",
    "keygen",
    "open_ledger",
    "parse_stored_time",
    "record_hash",
    "require_project",
    "signatures_table",
]
