"""One /metrics page for a release's whole fleet: the Prometheus text of every replica's
server merged, each series summed over the replicas (counters and histogram buckets add
up to the fleet's; gauges become totals, e.g. requests running on all replicas; a ratio
gauge such as `vllm:kv_cache_usage_perc` becomes a sum, not a mean). Pure text: no Ray."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)(?:\s+\S+)?\s*$")


def _fmt(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(v)


def merge_expositions(texts: Iterable[str]) -> str:
    """Merge Prometheus text pages: HELP/TYPE once per family, equal series summed, in the
    order first seen. Lines that are not samples or comments are dropped."""
    out: list[str] = []
    seen_meta: set[str] = set()
    index: dict[str, int] = {}
    values: list[float] = []
    keys: list[str] = []
    for text in texts:
        for line in text.splitlines():
            if line.startswith("#"):
                parts = line.split(None, 3)
                meta = " ".join(parts[:3])
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE") and meta not in seen_meta:
                    seen_meta.add(meta)
                    out.append(line)
                continue
            m = _SAMPLE.match(line)
            if m is None:
                continue
            key = m.group(1) + (m.group(2) or "")
            try:
                v = float(m.group(3))
            except ValueError:
                continue
            if key in index:
                values[index[key]] += v
                continue
            index[key] = len(values)
            values.append(v)
            keys.append(key)
            out.append(f"\0{index[key]}")
    lines = [
        f"{keys[int(x[1:])]} {_fmt(values[int(x[1:])])}" if x.startswith("\0") else x for x in out
    ]
    return "\n".join(lines) + ("\n" if lines else "")
