"""Leased route tables: a table that reverts to its fallback unless renewed in time.

A canary's weight is set by a controller (the `promote` process) that may die; a leased
table makes the gateway itself put all traffic back on the fallback (the stable release)
once `lease_s` passes without a renewal, so no weight is ever stuck.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from releasekit.deploy.gateway.config import Route


class Lease:
    """The lease on one table generation: when it ends and what replaces it then."""

    __slots__ = ("deadline", "fallback", "generation", "lease_s")

    def __init__(self, generation: int, lease_s: float, fallback: Sequence[Route]) -> None:
        self.generation = generation
        self.lease_s = lease_s
        self.fallback = tuple(fallback)
        self.deadline = time.monotonic() + lease_s

    def renew(self, generation: int) -> bool:
        """Extend the lease by `lease_s` from now; False when `generation` is not its table."""
        if generation != self.generation:
            return False
        self.deadline = time.monotonic() + self.lease_s
        return True

    def left(self, now: float | None = None) -> float:
        """Seconds until the table reverts (never below 0)."""
        return max(0.0, self.deadline - (time.monotonic() if now is None else now))

    def expired(self, now: float | None = None) -> bool:
        """Whether the lease has run out."""
        return (time.monotonic() if now is None else now) >= self.deadline
