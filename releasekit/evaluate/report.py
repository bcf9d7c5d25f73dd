"""The comparison report: compare.json, and the same evidence as Markdown and HTML that a
reviewer reads in a minute (verdict per suite first, then noise, load test, flipped items)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from releasekit._support.files import write_atomic
from releasekit._support.html import Templates
from releasekit.errors import EvalError, InputMissingError
from releasekit.evaluate.compare import (
    COMPARE_JSON,
    Comparison,
    SideCounts,
    SuiteComparison,
    dump_comparison,
)

MAX_FLIPS_SHOWN = 25
"""Flipped items listed per suite and direction; compare.json holds them all."""


class BenchSide(BaseModel):
    """The load-test figures shown side by side: the knee of one release's sweep."""

    release_id: str | None = None
    knee_load: float | None = None
    mode: str | None = None
    ttft_p95_s: float | None = None
    e2e_p95_s: float | None = None
    tpot_p95_s: float | None = None
    request_throughput: float | None = None
    output_token_throughput: float | None = None
    goodput: float | None = None
    points: int = 0
    knee_stop: str | None = Field(None, description="why the knee is where it is (or absent)")
    knee_rule: str | None = None


def _num(d: Any, *keys: str) -> float | None:
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return float(d) if isinstance(d, int | float) and not isinstance(d, bool) else None


def read_bench(path: Path) -> BenchSide:
    """Read a bench.json (bench/bench.json of a release) into the figures at its knee.
    InputMissingError if absent, EvalError if unreadable."""
    if not path.is_file():
        raise InputMissingError(path, what="bench result")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise EvalError(f"unreadable bench result {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise EvalError(f"unreadable bench result {path}: not a JSON object")
    knee = data.get("knee")
    points = data.get("points") if isinstance(data.get("points"), list) else []
    stop, rule = data.get("knee_stop"), data.get("knee_rule")
    side = BenchSide(
        release_id=data.get("release_id"),
        points=len(points or []),
        knee_stop=stop if isinstance(stop, str) else None,
        knee_rule=rule if isinstance(rule, str) else None,
    )
    if isinstance(knee, dict):
        side = side.model_copy(
            update={
                "knee_load": _num(knee, "load"),
                "mode": knee.get("mode") if isinstance(knee.get("mode"), str) else None,
                "ttft_p95_s": _num(knee, "ttft", "p95"),
                "e2e_p95_s": _num(knee, "e2e", "p95"),
                "tpot_p95_s": _num(knee, "tpot", "p95"),
                "request_throughput": _num(knee, "request_throughput"),
                "output_token_throughput": _num(knee, "output_token_throughput"),
                "goodput": _num(knee, "goodput"),
            }
        )
    return side


# ---- formatting filters -------------------------------------------------------------


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _pts(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:+.1f}"


def _ci(lo: float | None, hi: float | None) -> str:
    return "n/a" if lo is None or hi is None else f"[{100 * lo:+.1f}, {100 * hi:+.1f}]"


def _pval(p: float | None) -> str:
    if p is None:
        return "n/a"
    return "<0.001" if p < 0.001 else f"{p:.3f}"


def _num_fmt(x: float | None, fmt: str = ".2f", unit: str = "") -> str:
    return "n/a" if x is None else f"{x:{fmt}}{unit}"


def _conf(x: float) -> str:
    return f"{100 * x:g}%"


def _noise(s: SuiteComparison) -> str:
    """The larger pass-rate spread of the two releases' repeated runs, in points."""
    spreads = [
        n.spread for n in (s.baseline_noise, s.candidate_noise) if n and n.spread is not None
    ]
    return f"±{100 * max(spreads):.1f}" if spreads else "n/a"


def _short(x: str | None) -> str:
    return (x or "unknown")[:12]


def _clip(x: Any, n: int = 300) -> str:
    s = "" if x is None else (x if isinstance(x, str) else json.dumps(x, ensure_ascii=False))
    return s if len(s) <= n else s[:n] + f"… ({len(s)} chars)"


def _md(x: Any, n: int = 300) -> str:
    """A Markdown-safe single-line cell: pipes escaped, newlines shown as ⏎."""
    return _clip(x, n).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ⏎ ")


def _code(x: Any, n: int = 300) -> str:
    """Inline Markdown code for a model output (empty shown as (empty))."""
    s = _clip(x, n).replace("\n", " ⏎ ")
    if not s:
        return "*(empty)*"
    return f"`` {s} ``" if "`" in s else f"`{s}`"


def _vars(v: dict[str, str]) -> str:
    return "; ".join(f"{k}={json.dumps(val, ensure_ascii=False)}" for k, val in v.items())


def _verdict(v: Any) -> str:
    """A verdict as people read it: `non_inferior` -> `non-inferior`."""
    return str(getattr(v, "value", v)).replace("_", " ")


def _delta_ci(s: SuiteComparison) -> str:
    """The delta in points with its interval, or n/a when nothing was compared."""
    if s.delta is None:
        return "n/a"
    return f"{_pts(s.delta)} {_ci(s.ci_low, s.ci_high)}"


def _counts(side: SideCounts | None) -> str:
    """passed/failed/errored of one side, with the expected errors that passed noted."""
    if side is None:
        return "not evaluated"
    extra = f" (+{side.expected_errors} expected)" if side.expected_errors else ""
    return f"{side.passed}/{side.failed}/{side.errors}{extra}"


def _errors(side: SideCounts | None) -> str:
    if side is None or side.error_rate is None:
        return "n/a"
    return f"{side.errors} ({100 * side.error_rate:.1f}%)"


_BENCH_ROWS: list[tuple[str, str, str]] = [
    ("knee load", "knee_load", "load"),
    ("TTFT p95 at the knee", "ttft_p95_s", "s"),
    ("E2E p95 at the knee", "e2e_p95_s", "s"),
    ("TPOT p95 at the knee", "tpot_p95_s", "s"),
    ("request throughput", "request_throughput", "rps"),
    ("output tokens/s", "output_token_throughput", "tps"),
    ("goodput (req/s)", "goodput", "rps"),
]


def _fmt_bench(side: BenchSide | None, key: str, fmt: str) -> str:
    if side is None:
        return "not measured"
    value = getattr(side, key)
    if key == "knee_load":
        if value is None:
            if not side.points:
                return "n/a"
            return f"no knee: {side.knee_stop}" if side.knee_stop else "no knee"
        return f"{value:g} ({side.mode or 'load'})"
    if fmt == "s":
        return _num_fmt(value, ".3f", " s")
    if fmt == "rps":
        return _num_fmt(value, ".2f", " /s")
    return _num_fmt(value, ".1f")


TEMPLATES = Templates(
    Path(__file__).resolve().parent / "templates",
    filters={
        "conf": _conf,
        "pct": _pct,
        "pts": _pts,
        "pval": _pval,
        "short": _short,
        "clip": _clip,
        "md": _md,
        "code": _code,
        "verdict": _verdict,
    },
    globals={
        "ci": _ci,
        "noise": _noise,
        "vars": _vars,
        "counts": _counts,
        "delta_ci": _delta_ci,
        "errors": _errors,
        "fmtb": _fmt_bench,
        "bench_rows": _BENCH_ROWS,
        "max_flips": MAX_FLIPS_SHOWN,
    },
)
"""The report's templates (`report.md`, unescaped; `report.html`, autoescaped)."""


class BenchPair(BaseModel):
    """Baseline and candidate load-test figures (either may be missing)."""

    baseline: BenchSide | None = None
    candidate: BenchSide | None = None


def render_report(comparison: Comparison, *, bench: BenchPair | None = None) -> tuple[str, str]:
    """The report as (Markdown, HTML)."""
    ctx = {
        "c": comparison,
        "bench": bench,
        "any_flips": any(s.flips for s in comparison.suites.values()),
    }
    md = TEMPLATES.render("report.md", **ctx)
    html = TEMPLATES.render("report.html", **ctx)
    return md, html


def write_report(
    comparison: Comparison,
    out_dir: Path,
    *,
    candidate_bench: Path | None = None,
    baseline_bench: Path | None = None,
) -> None:
    """Write compare.json, report.md and report.html to `out_dir`. Bench JSONs, when given,
    add the load-test figures at the knee side by side."""
    bench = None
    if candidate_bench is not None or baseline_bench is not None:
        bench = BenchPair(
            candidate=read_bench(candidate_bench) if candidate_bench else None,
            baseline=read_bench(baseline_bench) if baseline_bench else None,
        )
    md, html = render_report(comparison, bench=bench)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(out_dir / COMPARE_JSON, dump_comparison(comparison))
    write_atomic(out_dir / "report.md", md.encode())
    write_atomic(out_dir / "report.html", html.encode())
