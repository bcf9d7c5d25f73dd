"""One /metrics page for a release's whole fleet: the Prometheus text of every replica's
server merged into one series per name and labels, each by the rule of its metric kind
(`merge_rule`). Pure text: no Ray.

- Counters, histograms (buckets, `_sum`, `_count`) and summaries' `_sum`/`_count` add up
  to the fleet's: requests served, tokens, latency histograms.
- Gauges that count something add up too: requests running or waiting on all replicas
  (`vllm:num_requests_running`), bytes of memory, open files.
- Gauges that are a level or a fact, not an amount, are not summed: a ratio such as
  `vllm:kv_cache_usage_perc` is the fullest replica's (max: the same "fullest engine" the
  watcher's `kv_cache_usage` figure reads on one server with several engines; a mean would
  hide one replica out of KV cache while another idles), and so are `*_info`, `*_state`,
  limits and start times; a summary's quantiles are the largest replica's too (quantiles
  cannot be merged exactly). `*_created` timestamps are the earliest.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from typing import Literal

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)(?:\s+\S+)?\s*$")
_SUFFIXES = ("_bucket", "_sum", "_count", "_total", "_created", "_gsum", "_gcount")
# Gauges whose value is a level, a limit or a fact rather than an amount: never summed.
_LEVEL = re.compile(
    r"(_perc|_percent|_ratio|_fraction|_usage|_utilization|_info|_state|_enabled"
    r"|_start_time_seconds|_timestamp_seconds|_max_fds|_limit|_max|_min)$"
)

REPLICAS_GAUGE = "releasekit:replicas"
"""The gauge the router adds to a release's fleet page: its replicas whose server answered
(a scale change shows in every scrape)."""

Rule = Literal["sum", "max", "min"]
_APPLY: dict[str, Callable[[float, float], float]] = {
    "sum": lambda a, b: a + b,
    "max": max,
    "min": min,
}


def _fmt(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(v)


def _family(name: str, types: dict[str, str]) -> tuple[str, str]:
    """The family a sample belongs to and its TYPE ("untyped" if none was declared)."""
    if name in types:
        return name, types[name]
    for suffix in _SUFFIXES:
        if name.endswith(suffix) and name[: -len(suffix)] in types:
            return name[: -len(suffix)], types[name[: -len(suffix)]]
    return name, "untyped"


def merge_rule(name: str, kind: str, labels: str = "") -> Rule:
    """How the samples of series `name{labels}` (of TYPE `kind`) from several replicas
    become one (see the module docstring)."""
    if name.endswith("_created"):
        return "min"
    if kind in ("counter", "histogram"):
        return "sum"
    if kind == "summary":
        return "max" if "quantile=" in labels else "sum"
    if kind in ("gauge", "untyped") and _LEVEL.search(name):
        return "max"
    return "sum"


def merge_expositions(texts: Iterable[str]) -> str:
    """Merge Prometheus text pages: HELP/TYPE once per family, equal series merged by
    `merge_rule`, in the order first seen. Lines that are not samples or comments are
    dropped."""
    out: list[str] = []
    seen_meta: set[str] = set()
    types: dict[str, str] = {}
    index: dict[str, int] = {}
    values: list[float] = []
    rules: list[Rule] = []
    keys: list[str] = []
    for text in texts:
        for line in text.splitlines():
            if line.startswith("#"):
                parts = line.split(None, 3)
                meta = " ".join(parts[:3])
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE") and meta not in seen_meta:
                    seen_meta.add(meta)
                    out.append(line)
                if len(parts) == 4 and parts[1] == "TYPE":
                    types.setdefault(parts[2], parts[3].strip())
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
                i = index[key]
                values[i] = _APPLY[rules[i]](values[i], v)
                continue
            index[key] = len(values)
            values.append(v)
            rules.append(merge_rule(m.group(1), _family(m.group(1), types)[1], m.group(2) or ""))
            keys.append(key)
            out.append(f"\0{index[key]}")
    lines = [
        f"{keys[int(x[1:])]} {_fmt(values[int(x[1:])])}" if x.startswith("\0") else x for x in out
    ]
    return "\n".join(lines) + ("\n" if lines else "")
