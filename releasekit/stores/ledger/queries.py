"""Reading the ledger: records by environment, release and time; what was live when."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, func, or_, select

from releasekit.stores.ledger.schema import (
    LedgerRecord,
    _to_record,
    events_table,
    format_time,
)


class LedgerQueries:
    """The reading half of `Ledger` (a mixin: it reads through the ledger's connection)."""

    if TYPE_CHECKING:

        def _read(self) -> AbstractContextManager[Connection]: ...

        def _select(self) -> Any: ...

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
