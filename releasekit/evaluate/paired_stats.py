"""Statistics for paired binary outcomes: Wilson's score interval, Newcombe's hybrid score
interval for a paired difference of proportions (method 10), exact McNemar and error-count
tests, and a seeded percentile bootstrap of a mean paired difference. Pure functions of
counts and scores; no releasekit types."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

_MAX_DRAW = 4_000_000  # indices drawn per bootstrap block: bounds memory for big suites


def _z(confidence: float) -> float:
    from scipy.stats import norm  # imported here: scipy adds ~0.4 s to CLI start-up

    return float(norm.ppf(0.5 + confidence / 2))


def wilson_interval(x: int, n: int, *, confidence: float) -> tuple[float, float]:
    """Wilson's score interval for a proportion x/n (Wilson 1927), without continuity
    correction: (2np + z^2 -/+ z sqrt(z^2 + 4np(1-p))) / (2(n + z^2))."""
    if n <= 0 or not 0 <= x <= n:
        raise ValueError(f"wilson_interval needs 0 <= x <= n and n > 0, got x={x}, n={n}")
    z = _z(confidence)
    p = x / n
    centre = 2 * n * p + z * z
    half = z * math.sqrt(z * z + 4 * n * p * (1 - p))
    den = 2 * (n + z * z)
    return max(0.0, (centre - half) / den), min(1.0, (centre + half) / den)


def newcombe_paired_interval(
    a: int, b: int, c: int, d: int, *, confidence: float
) -> tuple[float, float]:
    """Interval for p1 - p2 = (b - c) / n from paired binary data: Newcombe's method 10
    (Newcombe 1998, Statistics in Medicine 17:2635-2650), the hybrid score interval.

    a = both positive, b = first positive only, c = second positive only, d = neither;
    n = a + b + c + d, p1 = (a + b) / n, p2 = (a + c) / n. With (l1, u1) and (l2, u2) the
    Wilson score limits of p1 and p2, and

        phi = C / sqrt((a+b)(c+d)(a+c)(b+d)),  C = max(ad - bc - n/2, 0) if ad > bc else ad - bc
        (phi = 0 when the denominator is 0),

    the limits are

        L = (p1 - p2) - sqrt((p1 - l1)^2 - 2 phi (p1 - l1)(u2 - p2) + (u2 - p2)^2)
        U = (p1 - p2) + sqrt((u1 - p1)^2 - 2 phi (u1 - p1)(p2 - l2) + (p2 - l2)^2).

    Newcombe's Table II examples reproduce: (36, 12, 2, 0) -> [0.0569, 0.3404];
    (53, 0, 0, 1) -> [-0.0729, 0.0729]; (0, 30, 0, 0) -> [0.8395, 1.0].
    """
    if min(a, b, c, d) < 0 or a + b + c + d == 0:
        raise ValueError(f"newcombe_paired_interval needs counts >= 0, n > 0: {(a, b, c, d)}")
    n = a + b + c + d
    p1, p2 = (a + b) / n, (a + c) / n
    l1, u1 = wilson_interval(a + b, n, confidence=confidence)
    l2, u2 = wilson_interval(a + c, n, confidence=confidence)
    den = (a + b) * (c + d) * (a + c) * (b + d)
    phi = 0.0
    if den:
        cross = a * d - b * c
        num = max(cross - n / 2, 0.0) if cross > 0 else float(cross)
        phi = num / math.sqrt(den)
    lo_sq = (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2
    hi_sq = (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2
    theta = p1 - p2
    return max(-1.0, theta - math.sqrt(max(lo_sq, 0.0))), min(
        1.0, theta + math.sqrt(max(hi_sq, 0.0))
    )


def mcnemar_exact(b: int, c: int) -> float:
    """Exact two-sided McNemar p-value from the discordant counts b and c."""
    if b + c == 0:
        return 1.0
    from scipy.stats import binomtest  # imported here: scipy adds ~0.4 s to CLI start-up

    return float(binomtest(b, b + c, 0.5, alternative="two-sided").pvalue)


def more_errors_p(only_candidate: int, only_baseline: int) -> float:
    """One-sided exact p-value that the candidate errs more often than the baseline, from
    the pairs where exactly one side errored: P(X >= only_candidate), X ~ Bin(total, 1/2)."""
    total = only_candidate + only_baseline
    if total == 0:
        return 1.0
    from scipy.stats import binomtest

    return float(binomtest(only_candidate, total, 0.5, alternative="greater").pvalue)


def paired_bootstrap(
    candidate: Sequence[float] | np.ndarray,
    baseline: Sequence[float] | np.ndarray,
    *,
    samples: int,
    confidence: float,
    seed: int,
) -> tuple[float, float, float]:
    """Mean paired difference (candidate - baseline) and its percentile bootstrap CI.

    Used for the graded score delta only (informative, never a verdict): with few items or
    no change it collapses to [0, 0]. Deterministic for a given `seed`.
    """
    cand = np.asarray(candidate, dtype=float)
    base = np.asarray(baseline, dtype=float)
    if cand.shape != base.shape or cand.ndim != 1 or cand.size == 0:
        raise ValueError("paired_bootstrap needs two equal-length, non-empty 1-d sequences")
    diff = cand - base
    n = diff.size
    rng = np.random.default_rng(seed)
    means = np.empty(samples)
    block = max(1, _MAX_DRAW // n)
    for start in range(0, samples, block):
        stop = min(samples, start + block)
        idx = rng.integers(0, n, size=(stop - start, n))
        means[start:stop] = diff[idx].mean(axis=1)
    alpha = 1.0 - confidence
    low, high = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    return float(diff.mean()), float(low), float(high)
