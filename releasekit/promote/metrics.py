"""The evidence metric names gates compare, and which of a release's figures are key."""

from __future__ import annotations

import re

KEY_METRIC = re.compile(
    r"^(eval\.[^.]+\.(pass_rate|n)"
    r"|bench\.knee\.(load|ttft_p95_s|tpot_p95_s|e2e_p95_s|output_token_throughput|goodput)"
    r"|quantise\.size_after_bytes"
    r"|compare\.[^.]+\.(delta|ci_low|ci_high))$"
)
"""Flattened evidence metrics (`eval.core.pass_rate`, `bench.knee.ttft_p95_s`, ...) that gates
use and that reports show first; every other metric is detail."""


def is_key_metric(name: str) -> bool:
    """True for the figures gates use (see KEY_METRIC)."""
    return KEY_METRIC.match(name) is not None


def key_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """The key figures of a flattened metrics mapping, in its order."""
    return {k: v for k, v in metrics.items() if is_key_metric(k)}
