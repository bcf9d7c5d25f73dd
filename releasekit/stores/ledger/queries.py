"""Reading the ledger: records by environment, release and time; what was live when.

What was live: the live events (`assign`, `promote`, `override`, `rollback`). In an
environment releasekit deploys (the ledger holds a deploying event there: `DEPLOYING_TYPES`)
an `assign` recorded after the first deploying event never counts as live: it only moved a
name, never what serves, so the release of record there is the last release promote or
rollback put in place (`live_at`,
`current`, `records(live=True)`). `served_at` is the last of those everywhere."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from sqlalchemy import ColumnElement, Connection, func, or_, select

from releasekit.config.lanes import LANE_SEP
from releasekit.stores.ledger.schema import (
    LedgerRecord,
    _to_record,
    events_table,
    format_time,
)

SERVED_TYPES: tuple[str, ...] = ("promote", "override", "rollback", "deploy")
"""Live events that put a release in place by deploying it (an `assign` only records)."""
DEPLOYING_TYPES: tuple[str, ...] = (
    *SERVED_TYPES,
    "deploy_failed",
    "canary_step",
    "canary_aborted",
    "down",
)
"""Events that show releasekit deploys an environment."""


def _counts_as_live() -> ColumnElement[bool]:
    """A live record that counts: anything but an `assign` made after releasekit deployed
    its environment (an `assign` from before the first deploy was the record of an
    environment that was then only a registry of aliases, and stays what was live then)."""
    t = events_table
    earlier = events_table.alias("earlier")
    deployed_before = (
        select(earlier.c.seq)
        .where(
            earlier.c.environment == t.c.environment,
            earlier.c.type.in_(DEPLOYING_TYPES),
            earlier.c.seq < t.c.seq,
        )
        .exists()
    )
    return (t.c.live == True) & or_(t.c.type != "assign", ~deployed_before)  # noqa: E712


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
        with_lanes: bool = False,
    ) -> list[LedgerRecord]:
        """Records matching every filter given, in chain order (or newest first).

        `release` matches either side of an event (from or to); `since`/`until` are inclusive;
        `live=True` leaves out `assign` records of deployed environments (module docstring);
        `with_lanes` counts the adapter lanes of `environment` (`<environment>:<adapter>`)
        as it.
        """
        t = events_table
        q = self._select()
        if environment is not None and with_lanes:
            q = q.where(
                or_(
                    t.c.environment == environment,
                    t.c.environment.startswith(f"{environment}{LANE_SEP}", autoescape=True),
                )
            )
        elif environment is not None:
            q = q.where(t.c.environment == environment)
        if release is not None:
            q = q.where(or_(t.c.to_release == release, t.c.from_release == release))
        if types:
            q = q.where(t.c.type.in_(list(types)))
        if since is not None:
            q = q.where(t.c.time >= format_time(since))
        if until is not None:
            q = q.where(t.c.time <= format_time(until))
        if live is True:
            q = q.where(_counts_as_live())
        elif live is False:
            q = q.where(t.c.live == False)  # noqa: E712
        q = q.order_by(t.c.seq.desc() if newest_first else t.c.seq.asc())
        if limit is not None:
            q = q.limit(limit)
        with self._read() as conn:
            return [_to_record(r) for r in conn.execute(q)]

    def live_at(self, environment: str, at: dt.datetime | None = None) -> LedgerRecord | None:
        """The event that put the current release of `environment` in place at time `at`
        (now if None), or None if nothing was live there yet (an `assign` does not count
        where releasekit deploys the environment: module docstring)."""
        t = events_table
        q = self._select().where(t.c.environment == environment, _counts_as_live())
        if at is not None:
            q = q.where(t.c.time <= format_time(at))
        q = q.order_by(t.c.time.desc(), t.c.seq.desc()).limit(1)
        with self._read() as conn:
            row = conn.execute(q).first()
        return _to_record(row) if row is not None else None

    def served_at(self, environment: str) -> LedgerRecord | None:
        """The last event that deployed a release into `environment` and put it in place
        (`SERVED_TYPES`: never an `assign`), or None."""
        t = events_table
        q = (
            self._select()
            .where(
                t.c.environment == environment,
                t.c.live == True,  # noqa: E712
                t.c.type.in_(SERVED_TYPES),
            )
            .order_by(t.c.seq.desc())
            .limit(1)
        )
        with self._read() as conn:
            row = conn.execute(q).first()
        return _to_record(row) if row is not None else None

    def deployed(self, environment: str) -> LedgerRecord | None:
        """The first event showing releasekit deploys `environment` (`DEPLOYING_TYPES`), or
        None when the ledger shows none."""
        t = events_table
        q = (
            self._select()
            .where(t.c.environment == environment, t.c.type.in_(DEPLOYING_TYPES))
            .order_by(t.c.seq.asc())
            .limit(1)
        )
        with self._read() as conn:
            row = conn.execute(q).first()
        return _to_record(row) if row is not None else None

    def current(self) -> list[LedgerRecord]:
        """For each environment, the event that put its current release in place."""
        t = events_table
        latest = (
            select(func.max(t.c.seq).label("seq"))
            .where(_counts_as_live())
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
