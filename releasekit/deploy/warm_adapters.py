"""LoRA adapter versions a server keeps loaded for the warm window after its route moved on, and
their unloading when the window ends.

A release that differs from the live one only in its adapters reuses the running engine: the
new versions are loaded beside the old ones and the route switches to them. The versions the
new route no longer carries stay loaded for the environment's warm window (a rollback within
it finds them loaded and moves the route back at once), recorded per server in
`ServerRecord.adapters_warm` (engine name -> unix time). When the window ends, the expirer or
the next command's reconcile unloads each one that no route and no running mirror of the
environment names any more (a rollback that brings one back after the window loads it again).

An unload the engine does not do (it is down, or answers 5xx) keeps its entry, with the time
it was due: it is tried again at `next_unload_try` (a backoff from that time, 5 s doubling
up to 5 min between tries), and `deploy-status` says it is overdue. One whose engine is gone
leaves the list (nothing is loaded any more).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

from releasekit._support.retry import RetryPolicy
from releasekit.deploy.gateway import GatewayError, Route
from releasekit.deploy.gateway_client import GatewayClient
from releasekit.deploy.state import EnvState, ServerRecord
from releasekit.errors import ReleasekitError
from releasekit.serving.adapters import unload_adapter


def engine_names(routes: Iterable[Route], base_url: str) -> set[str]:
    """The engine names of the adapters `routes` send to the server at `base_url`."""
    return {e for r in routes if r.base_url == base_url for e in r.adapters.values()}


def named_adapters(state: EnvState, base_url: str, *, now: float) -> tuple[set[str], set[str]]:
    """(names a route names, names only the running mirror names) on `base_url`: the
    environment's table (a canary's fallback is that table) and its mirror until the
    mirror's `until` (past it, the gateway copies nothing more)."""
    routed = engine_names(state.routes, base_url)
    m = state.mirror
    mirrored: set[str] = set()
    if m is not None and (m.until is None or m.until > now):
        mirrored = engine_names([m.route, *([m.baseline] if m.baseline else [])], base_url)
    return routed, mirrored - routed


def mark_warm(
    server: ServerRecord, before: Sequence[Route], after: Sequence[Route], until: float
) -> list[str]:
    """After a switch from the table `before` to `after`: the adapters `before` sent to
    `server` that `after` does not stay loaded until `until` (a later deadline already
    recorded is kept); those `after` carries again leave the warm list. The names marked."""
    now_routed = engine_names(after, server.base_url)
    for name in now_routed:
        server.adapters_warm.pop(name, None)
    gone = sorted(engine_names(before, server.base_url) - now_routed)
    for name in gone:
        server.adapters_warm[name] = max(until, server.adapters_warm.get(name, until))
    return gone


UNLOAD_RETRY = RetryPolicy(base_s=5.0, cap_s=300.0, jitter=False)
"""The waits between tries of an unload the engine did not do (only its backoff is used:
the expirer and each command's reconcile are the loop)."""


def next_unload_try(due: float, now: float) -> float:
    """When an unload due at `due` and still not done at `now` is tried next: the first of
    due + w1, due + w1 + w2, ... after `now` (w the UNLOAD_RETRY backoff, so every try's
    time follows from the due time alone); `due` itself while it is in the future."""
    if due > now:
        return due
    t, attempt = due, 1
    while True:
        wait = UNLOAD_RETRY.backoff(attempt)
        if t + wait > now:
            return t + wait
        if wait >= UNLOAD_RETRY.cap_s:  # from here every cap_s
            return t + (math.floor((now - t) / wait) + 1) * wait
        t, attempt = t + wait, attempt + 1


def overdue_unloads(server: ServerRecord, now: float) -> dict[str, float]:
    """The warm adapters of `server` whose unload is overdue (due more than the first
    retry's wait ago and still listed: the engine did not unload them, or nothing ran to do
    it): engine name -> when it is tried next."""
    grace = UNLOAD_RETRY.backoff(1)
    return {
        name: next_unload_try(due, now)
        for name, due in sorted(server.adapters_warm.items())
        if now >= due + grace
    }


def adapter_deadlines(state: EnvState, *, now: float | None = None) -> list[float]:
    """When each warm adapter of the environment's servers is due to be unloaded, or, for
    one past due (an unload the engine did not do), tried again."""
    t = time.time() if now is None else now
    return [next_unload_try(due, t) for s in state.servers for due in s.adapters_warm.values()]


def _utc(t: float) -> str:
    return f"{dt.datetime.fromtimestamp(t, dt.UTC):%H:%M:%S} UTC"


def drain_unrouted(state: EnvState, deadline_s: float) -> None:
    """Wait (up to `deadline_s` each) until the gateway has nothing in flight to releases
    it no longer routes: a request pinned to an old route may still use an old adapter."""
    gw = state.gateway
    if gw is None:
        return
    with (
        contextlib.suppress(GatewayError),
        GatewayClient(gw.url, admin_token=gw.admin_token) as c,
    ):
        now = c.state()
        routed = {r.release_id for r in now.routes if r.weight > 0}
        for rid, n in now.in_flight.items():
            if n > 0 and rid not in routed:
                c.wait_drained(rid, deadline_s)


class Unloaded(NamedTuple):
    """What `unload_expired` did: the engine names unloaded, and every step in words."""

    names: list[str]
    notes: list[str]


def unload_expired(
    state: EnvState,
    *,
    now: float,
    drain: Callable[[], None] | None = None,
    alive: Callable[[ServerRecord], bool] | None = None,
) -> Unloaded:
    """Unload the warm adapters whose window is over from their engines (after `drain`,
    once, when there is one to unload) and take them off the warm lists. One a route names
    again is live (off the list, still loaded); one only a running mirror names waits for
    the mirror's end. One the engine does not unload stays listed with its due time (tried
    again at `next_unload_try`), unless `alive` says its engine is gone: then it leaves the
    list, as there is nothing left to unload."""
    out = Unloaded([], [])
    due: list[tuple[ServerRecord, str]] = []
    for s in state.servers:
        routed, mirrored = named_adapters(state, s.base_url, now=now)
        for name, until in sorted(s.adapters_warm.items()):
            if name in routed:
                del s.adapters_warm[name]
            elif until > now:
                continue
            elif name in mirrored:
                m_until = state.mirror.until if state.mirror is not None else None
                if m_until is None:
                    del s.adapters_warm[name]  # a mirror without an end uses it
                else:
                    s.adapters_warm[name] = m_until
            else:
                due.append((s, name))
    if due and drain is not None:
        drain()
    for s, name in due:
        try:
            unload_adapter(s.base_url, name, api_key=s.api_key)
        except ReleasekitError as exc:
            if alive is not None and not alive(s):
                del s.adapters_warm[name]
                out.notes.append(
                    f"adapter {name} left the warm list: its engine at {s.base_url} "
                    f"(pid {s.pid}) is gone"
                )
                continue
            again = next_unload_try(s.adapters_warm[name], now)
            out.notes.append(
                f"adapter {name} stays loaded on {s.base_url}: {exc.message}; "
                f"the unload is tried again at {_utc(again)}"
            )
            continue
        del s.adapters_warm[name]
        out.names.append(name)
        out.notes.append(f"unloaded adapter {name} from {s.base_url} (warm period over)")
    return out
