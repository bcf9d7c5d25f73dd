"""The ledger's schema: event types, the stored record, the tables, and the record hash."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import uuid
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import Boolean, Column, Index, Integer, MetaData, String, Table, Text

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
    CANARY_STEP = "canary_step"  # a canary step passed its judgement (not live)
    CANARY_ABORTED = "canary_aborted"  # a canary went back to 0% (breach, no evidence, crash)
    APPROVE = "approve"  # someone approved a release for an environment (not live)
    SHADOW = "shadow"  # mirroring to a candidate started or stopped (not live)


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


def chained_rows(
    events: list[Event], *, prev_seq: int, prev_hash: str, time: str, default_actor: str
) -> list[dict[str, Any]]:
    """The rows that append `events` after the record (`prev_seq`, `prev_hash`), each hashed
    and chained to the one before it, all at `time` (stored form)."""
    rows: list[dict[str, Any]] = []
    for ev in events:
        row: dict[str, Any] = {
            "seq": prev_seq + 1,
            "event_id": ev.event_id,
            "type": str(EventType(ev.type).value),
            "time": time,
            "actor": ev.actor or default_actor,
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
    return rows
