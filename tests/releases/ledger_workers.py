"""Functions that run in child processes of the ledger tests (spawned children import this
module by name, so it must not be a conftest)."""

from __future__ import annotations

import time
from typing import Any

from releasekit.stores.ledger import Event, EventType, Ledger


def append_worker(url: str, who: int, n: int, immediate: bool, start: Any, spans: Any) -> None:
    """A separate process appending `n` events as `worker-<who>` once every worker is ready;
    records when its appends started and ended in `spans`."""
    led = Ledger(url, actor=f"worker-{who}", sqlite_immediate=immediate, timeout_s=120)
    start.wait()
    spans[2 * who] = time.monotonic()
    for i in range(n):
        led.append(
            Event(type=EventType.BUILD, to_release=f"{who:032x}{i:032x}", reason=f"{who}:{i}")
        )
    spans[2 * who + 1] = time.monotonic()
