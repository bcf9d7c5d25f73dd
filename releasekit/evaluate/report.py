"""The comparison report: compare.json, and the same evidence as Markdown and HTML that a
reviewer reads in a minute (verdict per suite first, then noise, load test, flipped items)."""

# ruff: noqa: E501  (the templates below hold table rows that must stay on one line)

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
from pydantic import BaseModel, Field

from releasekit._support.files import write_atomic
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


_MD = """\
# Release comparison: {{ c.candidate_name or 'candidate' }} vs {{ c.baseline_name or 'baseline' }}

**Verdict: {{ c.verdict | verdict | upper }}** ({{ 'passes' if c.passed else 'fails' }} a gate) — the worst of the suite verdicts below.

Candidate `{{ c.candidate_release_id | short }}` ({{ c.candidate_name }}) ·
baseline `{{ c.baseline_release_id | short }}` ({{ c.baseline_name }})

Rule: {{ c.rule }}

| suite | verdict | paired | baseline pass/fail/error | candidate pass/fail/error | baseline | candidate | delta, pts [{{ c.confidence | conf }} CI] | margin, pts | McNemar p | errors b → c | noise, pts | pass→fail | fail→pass |
|---|---|---|---|---|---|---|---|---|---|---|---|---|---|
{% for name, s in c.suites.items() -%}
| {{ name }} | **{{ s.verdict | verdict }}** | {{ s.n_paired }} | {{ counts(s.baseline) }} | {{ counts(s.candidate) }} | {{ s.baseline_pass_rate | pct }} | {{ s.candidate_pass_rate | pct }} | {{ delta_ci(s) }} | {{ (s.margin * 100) | round(1) }} | {{ s.mcnemar_p | pval }} | {{ errors(s.baseline) }} → {{ errors(s.candidate) }} | {{ noise(s) }} | {{ s.flipped_to_fail | length }} | {{ s.flipped_to_pass | length }} |
{% endfor %}
Pass/fail/error counts each item once: an error is a failure unless the item expects one
(those count as passes, noted as "expected"). Pass rates and the delta are over the paired items.

## Why
{% for name, s in c.suites.items() %}
- **{{ name }}: {{ s.verdict | verdict }}**{% if s.reasons %}: {{ s.reasons | join('; ') | md(600) }}{% endif %}
{%- endfor %}
{% if c.warnings %}
Warnings:
{% for w in c.warnings %}- {{ w }}
{% endfor %}
{%- endif %}
## Run-to-run noise

The same release evaluated more than once on the same server (temperature 0 is not
bit-deterministic under batching). A delta inside this noise is not a change.

| suite | baseline flip rate | baseline spread, pts | candidate flip rate | candidate spread, pts | outputs changed (candidate) |
|---|---|---|---|---|---|
{% for name, s in c.suites.items() -%}
| {{ name }} | {{ s.baseline_noise.flip_rate | pct if s.baseline_noise else 'not measured' }} | {{ (s.baseline_noise.spread * 100) | round(1) if s.baseline_noise and s.baseline_noise.spread is not none else 'n/a' }} | {{ s.candidate_noise.flip_rate | pct if s.candidate_noise else 'not measured' }} | {{ (s.candidate_noise.spread * 100) | round(1) if s.candidate_noise and s.candidate_noise.spread is not none else 'n/a' }} | {{ s.candidate_noise.output_change_rate | pct if s.candidate_noise else 'n/a' }} |
{% endfor %}
{%- if bench %}
## Load test at the knee

| | baseline | candidate |
|---|---|---|
{% for label, key, fmt in bench_rows -%}
| {{ label }} | {{ fmtb(bench.baseline, key, fmt) }} | {{ fmtb(bench.candidate, key, fmt) }} |
{% endfor %}
{%- endif %}
## Flipped items
{% if not any_flips %}
No item changed verdict in any suite.
{% endif %}
{%- for name, s in c.suites.items() if s.flips %}
### {{ name }}
{% for direction in ['pass->fail', 'fail->pass'] %}
{%- set fl = s.flips | selectattr('direction', 'equalto', direction) | list %}
{%- if fl %}
**{{ direction | replace('->', ' → ') }}** ({{ fl | length }}\
{%- if fl | length > max_flips %}, first {{ max_flips }} shown; all in compare.json{% endif %})

| id | input | expected | baseline | candidate |
|---|---|---|---|---|
{% for f in fl[:max_flips] -%}
| {{ f.id }} | {{ vars(f.vars) | md(160) }} | {{ f.expected | md(80) }} | {{ f.baseline_output | code(120) | md(200) }} | {{ f.candidate_output | code(120) | md(200) }} |
{% endfor %}
{% endif %}
{%- endfor %}
{%- endfor %}
"""

_HTML = """\
<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>{{ c.candidate_name }} vs {{ c.baseline_name }}: {{ c.verdict | verdict }}</title>
<style>
body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.8em 0}th,td{border:1px solid #ccc;padding:.3em .6em;
text-align:left;vertical-align:top}th{background:#f4f4f4}td.n{text-align:right}
.v{font-weight:bold;padding:.1em .5em;border-radius:.3em;color:#fff}
.superior,.non_inferior{background:#2e7d32}.inferior,.error_regression{background:#c62828}
.inconclusive,.insufficient_evidence,.missing_evidence{background:#f9a825;color:#222}.rule{font-size:.9em}
code{background:#f4f4f4;padding:0 .2em;white-space:pre-wrap}.warn{color:#a15c00}
.small{color:#666;font-size:.9em}
</style></head><body>
<h1>{{ c.candidate_name or 'candidate' }} vs {{ c.baseline_name or 'baseline' }}
 <span class="v {{ c.verdict.value }}">{{ c.verdict | verdict }}</span></h1>
<p class="small">The worst of the suite verdicts; it {{ 'passes' if c.passed else 'fails' }} a gate.
Candidate <code>{{ c.candidate_release_id | short }}</code>, baseline
<code>{{ c.baseline_release_id | short }}</code>.</p>
<p class="rule">Rule: {{ c.rule }}</p>
<table><tr><th>suite</th><th>verdict</th><th>paired</th><th>baseline pass/fail/error</th><th>candidate pass/fail/error</th>
<th>baseline</th><th>candidate</th><th>delta, pts [{{ c.confidence | conf }} CI]</th><th>margin, pts</th><th>McNemar p</th>
<th>errors b &rarr; c</th><th>noise, pts</th><th>pass&rarr;fail</th><th>fail&rarr;pass</th></tr>
{% for name, s in c.suites.items() %}<tr><td>{{ name }}</td><td><span class="v {{ s.verdict.value }}">{{ s.verdict | verdict }}</span></td>
<td class="n">{{ s.n_paired }}</td><td class="n">{{ counts(s.baseline) }}</td><td class="n">{{ counts(s.candidate) }}</td>
<td class="n">{{ s.baseline_pass_rate | pct }}</td><td class="n">{{ s.candidate_pass_rate | pct }}</td>
<td class="n">{{ delta_ci(s) }}</td><td class="n">{{ (s.margin * 100) | round(1) }}</td>
<td class="n">{{ s.mcnemar_p | pval }}</td><td class="n">{{ errors(s.baseline) }} &rarr; {{ errors(s.candidate) }}</td>
<td class="n">{{ noise(s) }}</td><td class="n">{{ s.flipped_to_fail | length }}</td><td class="n">{{ s.flipped_to_pass | length }}</td></tr>
{% endfor %}</table>
<p class="small">Pass/fail/error counts each item once: an error is a failure unless the item expects one (those count
as passes, noted as "expected"). Pass rates and the delta are over the paired items.</p>
<h2>Why</h2>
<ul>{% for name, s in c.suites.items() %}<li><b>{{ name }}: {{ s.verdict | verdict }}</b>{% if s.reasons %}: {{ s.reasons | join('; ') }}{% endif %}</li>
{% endfor %}</ul>
{% if c.warnings %}<ul class="warn">{% for w in c.warnings %}<li>{{ w }}</li>{% endfor %}</ul>{% endif %}
<h2>Run-to-run noise</h2>
<p class="small">The same release evaluated more than once on the same server (temperature 0 is not
bit-deterministic under batching). A delta inside this noise is not a change.</p>
<table><tr><th>suite</th><th>baseline flip rate</th><th>baseline spread, pts</th>
<th>candidate flip rate</th><th>candidate spread, pts</th><th>outputs changed (candidate)</th></tr>
{% for name, s in c.suites.items() %}<tr><td>{{ name }}</td>
<td class="n">{{ s.baseline_noise.flip_rate | pct if s.baseline_noise else 'not measured' }}</td>
<td class="n">{{ (s.baseline_noise.spread * 100) | round(1) if s.baseline_noise and s.baseline_noise.spread is not none else 'n/a' }}</td>
<td class="n">{{ s.candidate_noise.flip_rate | pct if s.candidate_noise else 'not measured' }}</td>
<td class="n">{{ (s.candidate_noise.spread * 100) | round(1) if s.candidate_noise and s.candidate_noise.spread is not none else 'n/a' }}</td>
<td class="n">{{ s.candidate_noise.output_change_rate | pct if s.candidate_noise else 'n/a' }}</td></tr>
{% endfor %}</table>
{% if bench %}<h2>Load test at the knee</h2>
<table><tr><th></th><th>baseline</th><th>candidate</th></tr>
{% for label, key, fmt in bench_rows %}<tr><td>{{ label }}</td><td class="n">{{ fmtb(bench.baseline, key, fmt) }}</td>
<td class="n">{{ fmtb(bench.candidate, key, fmt) }}</td></tr>
{% endfor %}</table>{% endif %}
<h2>Flipped items</h2>
{% if not any_flips %}<p>No item changed verdict in any suite.</p>{% endif %}
{% for name, s in c.suites.items() %}{% if s.flips %}<h3>{{ name }}</h3>
{% for direction in ['pass->fail', 'fail->pass'] %}{% set fl = s.flips | selectattr('direction', 'equalto', direction) | list %}
{% if fl %}<details {% if direction == 'pass->fail' %}open{% endif %}><summary><b>{{ direction }}</b> ({{ fl | length }}{% if fl | length > max_flips %}, first {{ max_flips }} shown; all in compare.json{% endif %})</summary>
<table><tr><th>id</th><th>input</th><th>expected</th><th>baseline</th><th>candidate</th></tr>
{% for f in fl[:max_flips] %}<tr><td>{{ f.id }}</td><td>{{ vars(f.vars) | clip(300) }}</td><td>{{ f.expected | clip(120) }}</td>
<td><code>{{ f.baseline_output | clip(300) }}</code><br><span class="small">{{ f.baseline_detail | clip(160) }}</span></td>
<td><code>{{ f.candidate_output | clip(300) }}</code><br><span class="small">{{ f.candidate_detail | clip(160) }}</span></td></tr>
{% endfor %}</table></details>{% endif %}{% endfor %}{% endif %}{% endfor %}
</body></html>
"""

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


def _env(*, html: bool) -> jinja2.Environment:
    env = jinja2.Environment(
        autoescape=html,
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=False,
    )
    env.filters.update(
        conf=_conf,
        pct=_pct,
        pts=_pts,
        pval=_pval,
        short=_short,
        clip=_clip,
        md=_md,
        code=_code,
        verdict=_verdict,
    )
    env.globals.update(
        ci=_ci,
        noise=_noise,
        vars=_vars,
        counts=_counts,
        delta_ci=_delta_ci,
        errors=_errors,
        fmtb=_fmt_bench,
        bench_rows=_BENCH_ROWS,
        max_flips=MAX_FLIPS_SHOWN,
    )
    return env


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
    md = _env(html=False).from_string(_MD).render(**ctx)
    html = _env(html=True).from_string(_HTML).render(**ctx)
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
