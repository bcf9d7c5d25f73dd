"""The gateway's route table over time, as the switch and rollback benchmarks watch it: a
thread polls the gateway's admin state (its own table, not a guess from the responses) and
keeps every answer, so a benchmark can bound when the table came to route only to one
release, and can run a hook the first time it does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Poll:
    sent: float
    received: float
    routed: tuple[str, ...]
    generation: int


@dataclass
class RouteWatch:
    """Polls the gateway's admin state every `interval` s until stopped."""

    url: str
    admin_token: str
    interval: float
    polls: list[Poll] = field(default_factory=list)
    errors: int = 0
    # called once, the first time the table routes only to `watch_for` after `after`
    on_switch: Callable[[], None] | None = None
    watch_for: str | None = None
    after: float = 0.0
    final: dict[str, Any] = field(default_factory=dict)  # one read after the polls stop
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> RouteWatch:
        self._thread = threading.Thread(target=self._run, daemon=True, name="admin-watch")
        self._thread.start()
        return self

    def _run(self) -> None:
        from releasekit.deploy.gateway import GatewayError
        from releasekit.deploy.gateway_client import GatewayClient

        with GatewayClient(self.url, admin_token=self.admin_token, timeout_s=5.0) as c:
            while not self._stop.is_set():
                t0 = time.time()
                try:
                    st = c.state()
                except GatewayError:
                    self.errors += 1
                else:
                    routed = tuple(r.release_id for r in st.routes if r.share > 0)
                    self.polls.append(Poll(t0, time.time(), routed, st.generation))
                    hook = self.on_switch
                    if hook and routed == (self.watch_for,) and t0 >= self.after:
                        self.on_switch = None
                        hook()
                self._stop.wait(self.interval)

    def stop(self) -> None:
        """Stop polling, then read the state once more: the gateway's own count of the
        requests it finished per release, and what it still has in flight."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        from releasekit.deploy.gateway import GatewayError
        from releasekit.deploy.gateway_client import GatewayClient

        try:
            with GatewayClient(self.url, admin_token=self.admin_token, timeout_s=5.0) as c:
                st = c.state()
        except GatewayError as exc:
            self.final = {"error": str(exc)}
        else:
            self.final = {"served": dict(st.served), "in_flight_total": st.in_flight_total}

    def switched_to(self, release_id: str, after: float) -> tuple[float, float] | None:
        """(lower, upper) bound of when the table came to route only to `release_id` after
        `after`: the send of the last poll that saw otherwise, the answer of the first that
        saw it."""
        prev: Poll | None = None
        want = (release_id,)
        for p in list(self.polls):
            if p.received >= after and p.routed == want and prev and prev.routed != want:
                return prev.sent, p.received
            prev = p
        return None
