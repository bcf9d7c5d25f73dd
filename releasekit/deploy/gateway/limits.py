"""Client limits on the gateway: per-key token buckets."""

from __future__ import annotations

import time
from collections import OrderedDict

from releasekit.deploy.gateway.config import RateLimit


class TokenBuckets:
    """Per-key token buckets, bounded (least recently seen keys are forgotten)."""

    def __init__(self, limit: RateLimit, *, max_keys: int = 10_000) -> None:
        self.rps = limit.rps
        self.burst = float(limit.burst)
        self.max_keys = max_keys
        self._b: OrderedDict[str, list[float]] = OrderedDict()

    def take(self, key: str) -> float:
        """0.0 if a token was taken, else seconds until one is available."""
        now = time.monotonic()
        b = self._b.get(key)
        if b is None:
            b = self._b[key] = [self.burst, now]
            if len(self._b) > self.max_keys:
                self._b.popitem(last=False)
        else:
            self._b.move_to_end(key)
            b[0] = min(self.burst, b[0] + (now - b[1]) * self.rps)
            b[1] = now
        if b[0] >= 1.0:
            b[0] -= 1.0
            return 0.0
        return (1.0 - b[0]) / self.rps
