"""The steps every ledger append shares: chained rows and their signatures into the tables,
and the records they make."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import Connection, select

from releasekit.stores.ledger.schema import (
    Event,
    LedgerRecord,
    chained_rows,
    events_table,
    parse_stored_time,
    signatures_table,
)
from releasekit.stores.signing import Signer


def recorded_already(conn: Connection, event_ids: Sequence[str]) -> list[str]:
    """Those of `event_ids` the ledger holds already."""
    return list(
        conn.execute(select(events_table.c.event_id).where(events_table.c.event_id.in_(event_ids)))
        .scalars()
        .all()
    )


def insert_chained(
    conn: Connection,
    events: Sequence[Event],
    *,
    after: tuple[int, str],
    time: str,
    default_actor: str,
) -> tuple[list[dict[str, Any]], tuple[int, str]]:
    """Insert `events` as rows chained after the record `after` (its seq and hash), all at
    `time`; returns the rows and the (seq, hash) of the new last record."""
    rows = chained_rows(
        list(events),
        prev_seq=after[0],
        prev_hash=after[1],
        time=time,
        default_actor=default_actor,
    )
    conn.execute(events_table.insert(), rows)
    return rows, ((rows[-1]["seq"], rows[-1]["hash"]) if rows else after)


def insert_signatures(
    conn: Connection, rows: Sequence[Mapping[str, Any]], signer: Signer
) -> dict[int, tuple[str, str]]:
    """Sign each row's hash with `signer` and store the signatures; returns seq -> (key id,
    signature)."""
    sigs = {r["seq"]: (signer.key_id, signer.sign(r["hash"])) for r in rows}
    conn.execute(
        signatures_table.insert(),
        [{"seq": k, "key_id": v[0], "signature": v[1]} for k, v in sigs.items()],
    )
    return sigs


def records_of(
    rows: Sequence[Mapping[str, Any]], sigs: Mapping[int, tuple[str, str]]
) -> list[LedgerRecord]:
    """The records of freshly inserted `rows`, each with its (key id, signature) from `sigs`
    where it was signed."""
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
