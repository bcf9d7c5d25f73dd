"""How diagnose puts figures into words: durations, ages, the knee beside a live figure, and
the one-line summary of a healthy window (the findings' titles and the CLI use them)."""

from __future__ import annotations

from releasekit.capacity.diagnose_inputs import Baseline


def seconds(x: float | None) -> str:
    """A duration as findings print it: s above 0.1 s, ms below; "-" for no data."""
    if x is None:
        return "-"
    if abs(x) >= 10:
        return f"{x:.1f} s"
    if abs(x) >= 0.1:
        return f"{x:.2f} s"
    return f"{x * 1000:.1f} ms"


def knee_note(base: float | None) -> str:
    """ " (knee X)" after a live figure, or nothing when the knee lacks the figure."""
    return "" if base is None else f" (knee {seconds(base)})"


def age_text(s: float) -> str:
    """An age in the unit that reads best: s, min, h or days."""
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    if s < 172800:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} days"


def healthy_line(k: dict[str, float | None], base: Baseline | None, requests: float) -> str:
    """The one-line summary of a healthy window: requests, TTFT p95 against the knee,
    queue, errors, KV usage."""
    parts = [f"{requests:g} requests"]
    if k["request_rate"] is not None:
        parts[0] += f" ({k['request_rate']:.2f} req/s)"
    if k["ttft_p95_s"] is not None:
        knee = f" (knee {seconds(base.ttft_p95_s)})" if base and base.ttft_p95_s is not None else ""
        parts.append(f"TTFT p95 {seconds(k['ttft_p95_s'])}{knee}")
    if k["queue_mean_s"] is not None:
        parts.append(f"queue {seconds(k['queue_mean_s'])}")
    if k["error_rate"] is not None:
        parts.append(f"errors {k['error_rate']:.1%}")
    if k["kv_cache_usage"] is not None:
        parts.append(f"KV {k['kv_cache_usage']:.0%}")
    return "healthy: " + ", ".join(parts)
