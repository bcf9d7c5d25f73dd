"""Capacity plans: business numbers (requests a day, the peak window, the peak factor) turned
into serving units, from a release's own load test at its knee or from per-unit figures given
by hand, with every step of the working and a warning wherever the plan leaves what was
measured.

The arithmetic of design.md ("Capacity planning"):

    peak rate      = daily requests / (peak hours x 3600 s) x peak factor
    per-unit rate  = concurrency at the knee / mean E2E there          (Little's law)
    units          = max(min units, ceil(peak rate x headroom / per-unit rate))
    utilisation    = peak rate / (units x per-unit rate)

Errors raised here:

    ReleasekitError
    └── CapacityError               numbers that cannot make a plan (zero, negative, missing)
        └── CapacityEvidenceError   a release's evidence cannot carry a plan or roofline
                                    (no bench result, no knee, no weight files)
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np
import yaml
from pydantic import BaseModel, Field, ValidationError

# The only imports of evidence models and release files in releasekit.capacity:
from releasekit.bench.runner import BENCH_JSON, BenchResult, point_label
from releasekit.bench.stats import PointResult
from releasekit.config import Settings
from releasekit.errors import ManifestError, ReleasekitError
from releasekit.spec.manifest import LoadedManifest, parse_manifest

# -- errors ----------------------------------------------------------------------------------


class CapacityError(ReleasekitError):
    """Raised when the numbers given cannot make a plan: a zero, negative or non-finite
    figure, a missing business number, or a mix of options that contradict each other. The
    message names the option."""

    remedy = "see `releasekit capacity --help` for the options and a worked example"


class CapacityEvidenceError(CapacityError):
    """Raised when a release's evidence cannot carry a plan or a roofline: no bench result,
    an unreadable one, a sweep with no knee (no trusted load point met the SLOs), no model
    folder or no weight files."""

    remedy = (
        "run `releasekit bench MANIFEST` for the release (its sweep needs a point that meets "
        "the SLOs), or plan by hand with --concurrency, --tokens-per-second, --output-tokens"
    )


# -- evidence: the one place that knows a release's files and the models that wrote them ----
# (bench.json is read with BenchResult, the model the bench writer dumps; see imports above.)


def read_bench(settings: Settings, release_id: str) -> BenchResult:
    """The release's load test, results/<release_id>/bench/bench.json.

    Raises CapacityEvidenceError if it is missing or unreadable.
    """
    path = settings.release_dir(release_id) / "bench" / BENCH_JSON
    if not path.is_file():
        raise CapacityEvidenceError(
            f"release {release_id[:12]} has no load test: {path} is missing"
        )
    try:
        return BenchResult.model_validate_json(path.read_bytes())
    except (ValidationError, ValueError, OSError) as exc:
        raise CapacityEvidenceError(f"unreadable bench result {path}: {exc}") from exc


def read_release_manifest(settings: Settings, release_id: str) -> LoadedManifest | None:
    """The manifest a release was built from: its copy in results/<release_id>/, else the
    file its lock names; None when neither can be read."""
    rdir = settings.release_dir(release_id)
    candidates = [rdir / "manifest.yaml"]
    lock = rdir / "lock.json"
    if lock.is_file():
        try:
            rel = json.loads(lock.read_text(encoding="utf-8")).get("manifest")
        except (OSError, UnicodeDecodeError, ValueError, AttributeError):
            rel = None
        if isinstance(rel, str) and rel:
            candidates.append(settings.root / rel)
    for path in candidates:
        if not path.is_file():
            continue
        try:
            m = parse_manifest(yaml.safe_load(path.read_text(encoding="utf-8")), path=path)
        except (OSError, UnicodeDecodeError, yaml.YAMLError, ManifestError):
            continue
        return LoadedManifest(path=path, base=settings.root, manifest=m)
    return None


def max_num_seqs_of(lm: LoadedManifest | None) -> int | None:
    """`max-num-seqs` from the release's serving arguments (None when not set)."""
    if lm is None:
        return None
    args = lm.manifest.serving.args
    for key in ("max-num-seqs", "max_num_seqs"):
        v = args.get(key)
        if v is not None and not isinstance(v, bool):
            try:
                return int(float(v))
            except ValueError:
                return None
    return None


def release_model_dir(settings: Settings, release_id: str, lm: LoadedManifest | None) -> Path:
    """The folder a release serves: results/<release_id>/model (or quantise.json's model_dir)
    for a quantised release, else the manifest's model source.

    Raises CapacityEvidenceError when neither exists.
    """
    rdir = settings.release_dir(release_id)
    record = rdir / "quantise.json"
    if record.is_file():
        try:
            recorded = json.loads(record.read_text(encoding="utf-8")).get("model_dir")
        except (OSError, UnicodeDecodeError, ValueError, AttributeError):
            recorded = None
        if isinstance(recorded, str) and recorded:
            p = Path(recorded)
            p = p if p.is_absolute() else settings.root / p
            if p.is_dir():
                return p
    if (rdir / "model").is_dir():
        return rdir / "model"
    if lm is not None:
        if lm.manifest.quantisation.scheme == "none":
            src = lm.resolve(lm.manifest.model.source)
            if src.is_dir():
                return src
            raise CapacityEvidenceError(
                f"model source of release {release_id[:12]} not found: {src}"
            )
        raise CapacityEvidenceError(
            f"release {release_id[:12]} is quantised ({lm.manifest.quantisation.scheme}) but "
            f"not built: {rdir / 'model'} is missing",
            remedy="run `releasekit build MANIFEST` first",
        )
    raise CapacityEvidenceError(
        f"no model folder for release {release_id[:12]}: neither {rdir / 'model'} nor a "
        "readable manifest",
        remedy="build the release, or give --params and --bytes-per-weight by hand",
    )


# -- models ----------------------------------------------------------------------------------

#: Little's law and the measured request rate at the knee may differ by this much.
LITTLE_TOLERANCE = 0.15
#: The traffic's prompt/output lengths may differ from the load profile's by this much.
LENGTH_TOLERANCE = 0.20
#: Fewer requests than this at the knee make its mean E2E a rough figure.
MIN_KNEE_REQUESTS = 30

WarningCode = Literal[
    "beyond_sweep",
    "beyond_max_num_seqs",
    "prompt_length_mismatch",
    "output_length_mismatch",
    "little_vs_measured",
    "knee_at_sweep_top",
    "knee_few_requests",
    "knee_flagged",
    "knee_unstable",
    "no_measurement",
]


class Traffic(BaseModel):
    """The traffic to plan for, in business numbers, and how much spare to keep."""

    daily_requests: float = Field(description="requests a day")
    peak_hours: float = Field(description="length of the daily peak window, hours")
    peak_factor: float = Field(description="how much the peak exceeds an even spread over it")
    headroom: float = Field(1.0, description="multiplies the peak rate; 1.25 keeps 25% spare")
    min_units: int = Field(1, description="never plan fewer units than this")
    unit_cost_per_hour: float | None = Field(None, description="price of one unit-hour")
    prompt_tokens: float | None = Field(None, description="mean prompt tokens of the traffic")
    output_tokens: float | None = Field(None, description="mean output tokens of the traffic")


class HandUnit(BaseModel):
    """Per-unit figures given by hand, for planning before any load test exists."""

    concurrency: float = Field(description="sequences one unit serves at once")
    tokens_per_second: float = Field(description="decode rate of one sequence, tokens/s")
    output_tokens: float = Field(description="output tokens per request")
    overhead_s: float = Field(0.0, description="added to every request, e.g. TTFT")
    max_num_seqs: int | None = Field(None, description="the engine's max-num-seqs, if known")


class Step(BaseModel):
    """One line of the working: what is computed, with the numbers put in, and the result."""

    name: str
    working: str
    value: float
    unit: str


class PlanWarning(BaseModel):
    """Where the plan leaves what was measured, or the measurement is shaky."""

    code: WarningCode
    message: str


class UnitRate(BaseModel):
    """What one serving unit sustains, and where that figure comes from."""

    source: Literal["load test", "by hand"]
    requests_per_s: float = Field(description="the per-unit rate the plan uses")
    concurrency: float = Field(description="requests in flight per unit at that rate")
    seconds_per_request: float = Field(description="mean E2E (load test) or worked out by hand")
    little_requests_per_s: float = Field(description="concurrency / seconds per request")
    measured_requests_per_s: float | None = Field(
        None, description="request_throughput measured at the knee"
    )
    little_over_measured: float | None = None
    knee_load: float | None = None
    mode: Literal["concurrency", "rate"] | None = None


class Measured(BaseModel):
    """What the release's sweep covered."""

    profile_name: str
    mode: Literal["concurrency", "rate"]
    loads: list[float]
    min_requests_per_s: float
    max_requests_per_s: float
    max_requests_per_s_load: float
    knee_load: float
    prompt_tokens_mean: float | None = None
    output_tokens_mean: float | None = None
    max_num_seqs: int | None = None


class CapacityPlan(BaseModel):
    """A capacity plan: peak rate, per-unit rate, units, utilisation, cost, the working and
    the warnings. `plot` is set once a plot was written."""

    release_id: str | None = None
    traffic: Traffic
    peak_requests_per_s: float
    unit: UnitRate
    units: int
    utilisation: float = Field(description="peak rate / (units x per-unit rate)")
    load_per_unit_requests_per_s: float = Field(description="peak rate / units")
    cost_per_hour: float | None = Field(None, description="units x unit-hour price")
    cost_per_day: float | None = Field(None, description="a fleet sized for the peak, running 24 h")
    cost_per_1k_requests: float | None = Field(
        None, description="cost per day / daily requests x 1000"
    )
    cost_per_1k_requests_at_peak: float | None = Field(
        None, description="cost per hour / requests in a peak hour x 1000"
    )
    steps: list[Step]
    warnings: list[PlanWarning] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)
    measured: Measured | None = None
    plot: str | None = None


class CurvePoint(BaseModel):
    """Units needed at one daily volume, and whether a unit's load there was measured."""

    daily_requests: float
    units: int
    load_per_unit_requests_per_s: float
    measured: bool | None = Field(None, description="None when nothing was measured")


# -- arithmetic ------------------------------------------------------------------------------


def num(v: float) -> str:
    """A figure as the working prints it: thousands separated, about three significant
    digits."""
    a = abs(v)
    if float(v).is_integer() and a < 1e15:
        return f"{int(v):,}"
    if a >= 1000:
        return f"{v:,.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    return f"{v:.3g}"


def _positive(flag: str, v: float | None, *, allow_zero: bool = False) -> None:
    if v is None:
        return
    bad = not math.isfinite(v) or (v < 0 if allow_zero else v <= 0)
    if bad:
        need = "zero or more" if allow_zero else "a positive number"
        raise CapacityError(f"--{flag} must be {need} (got {v:g})")


def check_traffic(t: Traffic) -> None:
    """Raise CapacityError naming the first figure that cannot make a plan."""
    _positive("daily-requests", t.daily_requests)
    _positive("peak-hours", t.peak_hours)
    if t.peak_hours > 24:
        raise CapacityError(f"--peak-hours must be at most 24 (got {t.peak_hours:g})")
    _positive("peak-factor", t.peak_factor)
    _positive("headroom", t.headroom)
    if t.headroom < 1:
        raise CapacityError(
            f"--headroom multiplies the peak rate (1.25 keeps 25% spare): it must be at least 1 "
            f"(got {t.headroom:g})"
        )
    if t.min_units < 1:
        raise CapacityError(f"--min-units must be at least 1 (got {t.min_units})")
    _positive("unit-cost-per-hour", t.unit_cost_per_hour, allow_zero=True)
    _positive("prompt-tokens", t.prompt_tokens)
    _positive("output-tokens", t.output_tokens)


def check_hand(u: HandUnit) -> None:
    """Raise CapacityError naming the first per-unit figure that cannot make a plan."""
    _positive("concurrency", u.concurrency)
    _positive("tokens-per-second", u.tokens_per_second)
    _positive("output-tokens", u.output_tokens)
    _positive("overhead-s", u.overhead_s, allow_zero=True)
    if u.max_num_seqs is not None and u.max_num_seqs < 1:
        raise CapacityError(f"--max-num-seqs must be at least 1 (got {u.max_num_seqs})")


def peak_rate(daily_requests: float, peak_hours: float, peak_factor: float) -> float:
    """Requests per second at the peak: daily / (peak hours x 3600) x peak factor."""
    return daily_requests / (peak_hours * 3600.0) * peak_factor


def _ceil(x: float) -> int:
    # 12.000000000001 from float error is 12 units, not 13.
    return math.ceil(x - 1e-9)


def units_needed(
    peak_requests_per_s: float, per_unit_requests_per_s: float, *, headroom: float, min_units: int
) -> int:
    """max(min_units, ceil(peak x headroom / per-unit rate))."""
    return max(min_units, _ceil(peak_requests_per_s * headroom / per_unit_requests_per_s))


def _peak_step(t: Traffic, peak: float) -> Step:
    return Step(
        name="peak rate",
        working=f"{num(t.daily_requests)} requests / ({num(t.peak_hours)} h x 3600 s) "
        f"x {num(t.peak_factor)}",
        value=peak,
        unit="req/s",
    )


def _finish(
    t: Traffic,
    *,
    peak: float,
    unit: UnitRate,
    steps: list[Step],
    warnings: list[PlanWarning],
    notes: list[str],
    measured: Measured | None,
    release_id: str | None,
) -> CapacityPlan:
    rate = unit.requests_per_s
    raw = peak * t.headroom / rate
    units = units_needed(peak, rate, headroom=t.headroom, min_units=t.min_units)
    floor = f"max({t.min_units}, " if t.min_units > 1 else ""
    steps.append(
        Step(
            name="units",
            working=f"{floor}ceil({num(peak)} x {num(t.headroom)} / {num(rate)})"
            + (")" if floor else "")
            + f" = {floor}ceil({raw:.2f})"
            + (")" if floor else ""),
            value=units,
            unit="units",
        )
    )
    util = peak / (units * rate)
    steps.append(
        Step(
            name="utilisation",
            working=f"{num(peak)} / ({units} x {num(rate)})",
            value=util,
            unit="of each unit's rate",
        )
    )
    per_unit_load = peak / units
    cost_h = cost_d = per_1k = per_1k_peak = None
    if t.unit_cost_per_hour is not None:
        cost_h = units * t.unit_cost_per_hour
        cost_d = cost_h * 24
        per_1k = cost_d / t.daily_requests * 1000
        per_1k_peak = cost_h / (peak * 3600) * 1000
        steps += [
            Step(
                name="cost per hour",
                working=f"{units} units x {num(t.unit_cost_per_hour)}",
                value=cost_h,
                unit="per hour",
            ),
            Step(
                name="cost per 1,000 requests",
                working=f"{num(cost_h)} x 24 h / {num(t.daily_requests)} requests x 1000",
                value=per_1k,
                unit="per 1k requests (peak-sized fleet, all day)",
            ),
            Step(
                name="cost per 1,000 requests at the peak",
                working=f"{num(cost_h)} / ({num(peak)} x 3600) x 1000",
                value=per_1k_peak,
                unit="per 1k requests (peak hour)",
            ),
        ]
    if measured is not None and per_unit_load > measured.max_requests_per_s * 1.01:
        warnings.append(
            PlanWarning(
                code="beyond_sweep",
                message=f"each unit would carry {num(per_unit_load)} req/s, more than any "
                f"point of the sweep completed ({num(measured.max_requests_per_s)} req/s at "
                f"{point_label(measured.mode, measured.max_requests_per_s_load)}): the plan "
                "extrapolates beyond what was measured",
            )
        )
    return CapacityPlan(
        release_id=release_id,
        traffic=t,
        peak_requests_per_s=peak,
        unit=unit,
        units=units,
        utilisation=util,
        load_per_unit_requests_per_s=per_unit_load,
        cost_per_hour=cost_h,
        cost_per_day=cost_d,
        cost_per_1k_requests=per_1k,
        cost_per_1k_requests_at_peak=per_1k_peak,
        steps=steps,
        warnings=warnings,
        notes=notes,
        measured=measured,
    )


def _seqs_warning(concurrency: float, max_num_seqs: int | None) -> list[PlanWarning]:
    if max_num_seqs is None or concurrency <= max_num_seqs:
        return []
    return [
        PlanWarning(
            code="beyond_max_num_seqs",
            message=f"the plan puts {num(concurrency)} requests in flight per unit but the "
            f"engine runs at most max-num-seqs={max_num_seqs} at once: the rest wait in the "
            "server's queue (raise max-num-seqs and re-measure, or plan on "
            f"--concurrency {max_num_seqs})",
        )
    ]


# -- plans -----------------------------------------------------------------------------------


def plan_by_hand(traffic: Traffic, hand: HandUnit) -> CapacityPlan:
    """A plan from per-unit figures given by hand: seconds per request = overhead + output
    tokens / tokens per second; per-unit rate = concurrency / that (Little's law).

    Raises CapacityError for a zero, negative or non-finite figure.
    """
    check_traffic(traffic)
    check_hand(hand)
    if traffic.output_tokens is not None and traffic.output_tokens != hand.output_tokens:
        raise CapacityError("by hand, --output-tokens is the traffic's output length: give it once")
    t = traffic.model_copy(update={"output_tokens": hand.output_tokens})
    peak = peak_rate(t.daily_requests, t.peak_hours, t.peak_factor)
    secs = hand.overhead_s + hand.output_tokens / hand.tokens_per_second
    rate = hand.concurrency / secs
    steps = [
        _peak_step(t, peak),
        Step(
            name="time per request",
            working=f"{num(hand.overhead_s)} s + {num(hand.output_tokens)} tokens / "
            f"{num(hand.tokens_per_second)} tokens/s",
            value=secs,
            unit="s",
        ),
        Step(
            name="per-unit rate (Little's law)",
            working=f"{num(hand.concurrency)} concurrent / {num(secs)} s",
            value=rate,
            unit="req/s per unit",
        ),
    ]
    unit = UnitRate(
        source="by hand",
        requests_per_s=rate,
        concurrency=hand.concurrency,
        seconds_per_request=secs,
        little_requests_per_s=rate,
    )
    warnings = [
        PlanWarning(
            code="no_measurement",
            message="per-unit figures given by hand: nothing here was measured; load-test "
            "the release (`releasekit bench`) and plan from its knee",
        ),
        *_seqs_warning(hand.concurrency, hand.max_num_seqs),
    ]
    return _finish(
        t,
        peak=peak,
        unit=unit,
        steps=steps,
        warnings=warnings,
        notes=[],
        measured=None,
        release_id=None,
    )


def _measured(bench: BenchResult, knee: PointResult, max_num_seqs: int | None) -> Measured:
    points = sorted(bench.points, key=lambda p: p.load)
    best = max(points, key=lambda p: p.request_throughput)
    return Measured(
        profile_name=bench.profile_name,
        mode=bench.mode,
        loads=[p.load for p in points],
        min_requests_per_s=min(p.request_throughput for p in points),
        max_requests_per_s=best.request_throughput,
        max_requests_per_s_load=best.load,
        knee_load=knee.load,
        prompt_tokens_mean=knee.prompt_tokens_mean,
        output_tokens_mean=(knee.output_tokens / knee.ok) if knee.ok else None,
        max_num_seqs=max_num_seqs,
    )


def _length_warnings(t: Traffic, m: Measured) -> list[PlanWarning]:
    out: list[PlanWarning] = []
    pairs: tuple[tuple[WarningCode, str, float | None, float | None], ...] = (
        ("prompt_length_mismatch", "prompt", t.prompt_tokens, m.prompt_tokens_mean),
        ("output_length_mismatch", "output", t.output_tokens, m.output_tokens_mean),
    )
    for code, what, planned, profile in pairs:
        if planned is None or profile is None:
            continue
        if abs(planned - profile) > LENGTH_TOLERANCE * profile:
            out.append(
                PlanWarning(
                    code=code,
                    message=f"the traffic has {num(planned)} {what} tokens a request but the "
                    f"load profile measured {num(profile)} ({planned / profile - 1:+.0%}): the "
                    "per-unit rate holds for the profile's lengths; load-test a profile "
                    "with the traffic's lengths",
                )
            )
    return out


def _knee_warnings(bench: BenchResult, knee: PointResult, ratio: float | None) -> list[PlanWarning]:
    out: list[PlanWarning] = []
    if ratio is not None and abs(ratio - 1) > LITTLE_TOLERANCE:
        out.append(
            PlanWarning(
                code="little_vs_measured",
                message=f"Little's law and the measured request rate at the knee disagree by "
                f"{abs(ratio - 1):.0%} (more than {LITTLE_TOLERANCE:.0%}): the point was "
                "too short to reach a steady state, or requests queued outside the server; "
                "lengthen the sweep's points",
            )
        )
    top = max(p.load for p in bench.points)
    if knee.load >= top:
        out.append(
            PlanWarning(
                code="knee_at_sweep_top",
                message=f"the knee is the sweep's highest load ({point_label(bench.mode, top)}): "
                "its SLOs never broke, so a unit may sustain more; extend the sweep",
            )
        )
    if knee.ok < MIN_KNEE_REQUESTS:
        out.append(
            PlanWarning(
                code="knee_few_requests",
                message=f"only {knee.ok} requests completed at the knee (fewer than "
                f"{MIN_KNEE_REQUESTS}): its mean E2E is a rough figure",
            )
        )
    if knee.flags:
        codes = ", ".join(sorted({f.code for f in knee.flags}))
        out.append(
            PlanWarning(
                code="knee_flagged",
                message=f"the knee carries reliability flags ({codes}): the load test did not "
                "measure the server there; fix the cause and rerun `releasekit bench`",
            )
        )
    if bench.repetitions >= 2 and not bench.knee_stable:
        per = ", ".join("none" if k is None else f"{k:g}" for k in bench.knee_by_repetition)
        out.append(
            PlanWarning(
                code="knee_unstable",
                message=f"the repetitions of the sweep disagree on the knee ({per}): the "
                "per-unit rate is not reproducible; rerun the bench on a quieter host",
            )
        )
    return out


def plan_from_bench(
    traffic: Traffic,
    bench: BenchResult,
    *,
    release_id: str | None = None,
    max_num_seqs: int | None = None,
) -> CapacityPlan:
    """A plan from a load test: the per-unit rate is Little's law at the knee, concurrency /
    mean E2E (closed-loop sweep), or the arrival rate at the knee (open-loop sweep, where the
    concurrency is rate x mean E2E); either is cross-checked against the request rate the
    point measured. `max_num_seqs` defaults to the one the bench recorded.

    Raises CapacityError for bad numbers, CapacityEvidenceError when the sweep has no knee.
    """
    check_traffic(traffic)
    knee = bench.knee
    who = f"release {release_id[:12]}" if release_id else f"bench of {bench.model}"
    if knee is None:
        why = bench.knee_stop or "no load point met its SLOs"
        raise CapacityEvidenceError(
            f"{who}: the sweep has no knee to plan from ({why})",
            remedy="add lighter load points to the load profile (or revisit its SLOs), fix "
            "what the bench flagged, and rerun `releasekit bench`; or plan by hand with "
            "--concurrency, --tokens-per-second, --output-tokens",
        )
    e2e = knee.e2e.mean
    if e2e is None or e2e <= 0 or knee.ok == 0:
        raise CapacityEvidenceError(f"{who}: the knee has no completed request with an E2E time")
    peak = peak_rate(traffic.daily_requests, traffic.peak_hours, traffic.peak_factor)
    measured_rate = knee.request_throughput
    where = point_label(bench.mode, knee.load)
    steps = [
        _peak_step(traffic, peak),
        Step(
            name=f"mean E2E at the knee ({where})",
            working=f"measured over {knee.ok} requests"
            + (f" in {knee.repetitions} runs" if knee.repetitions > 1 else ""),
            value=e2e,
            unit="s",
        ),
    ]
    if bench.mode == "concurrency":
        concurrency = knee.load
        little = concurrency / e2e
        steps.append(
            Step(
                name="per-unit rate (Little's law)",
                working=f"{num(concurrency)} concurrent / {num(e2e)} s",
                value=little,
                unit="req/s per unit",
            )
        )
    else:
        little = knee.load
        concurrency = knee.load * e2e
        steps.append(
            Step(
                name="per-unit rate (the knee's arrival rate)",
                working=f"open loop at {num(knee.load)} req/s with its SLOs holding",
                value=little,
                unit="req/s per unit",
            )
        )
        steps.append(
            Step(
                name="concurrency per unit (Little's law)",
                working=f"{num(knee.load)} req/s x {num(e2e)} s",
                value=concurrency,
                unit="requests in flight",
            )
        )
    ratio = little / measured_rate if measured_rate > 0 else None
    if ratio is not None:
        steps.append(
            Step(
                name="cross-check against the measured request rate",
                working=f"{num(little)} req/s / {num(measured_rate)} req/s measured at the knee",
                value=ratio,
                unit="ratio",
            )
        )
    unit = UnitRate(
        source="load test",
        requests_per_s=little,
        concurrency=concurrency,
        seconds_per_request=e2e,
        little_requests_per_s=little,
        measured_requests_per_s=measured_rate,
        little_over_measured=ratio,
        knee_load=knee.load,
        mode=bench.mode,
    )
    if max_num_seqs is None:
        max_num_seqs = bench.max_num_seqs
    measured = _measured(bench, knee, max_num_seqs)
    notes = []
    if max_num_seqs is None:
        notes.append("max-num-seqs is not set in the release's serving args (vLLM's default)")
    if bench.repetitions < 2:
        notes.append("the sweep ran once: whether its knee reproduces is unknown")
    warnings = [
        *_knee_warnings(bench, knee, ratio),
        *_seqs_warning(concurrency, max_num_seqs),
        *_length_warnings(traffic, measured),
    ]
    return _finish(
        traffic,
        peak=peak,
        unit=unit,
        steps=steps,
        warnings=warnings,
        notes=notes,
        measured=measured,
        release_id=release_id or bench.release_id,
    )


def plan_release(settings: Settings, release_id: str, traffic: Traffic) -> CapacityPlan:
    """A plan from a release's own load test (results/<release_id>/bench/bench.json) and
    its serving arguments (max-num-seqs).

    Raises CapacityError for bad numbers; CapacityEvidenceError without a bench or a knee.
    """
    check_traffic(traffic)
    bench = read_bench(settings, release_id)
    lm = read_release_manifest(settings, release_id)
    plan = plan_from_bench(traffic, bench, release_id=release_id, max_num_seqs=max_num_seqs_of(lm))
    if lm is None:
        plan.notes.append("the release's manifest could not be read: max-num-seqs unknown")
    return plan


# -- the curve behind the plot ---------------------------------------------------------------


def default_volumes(plan: CapacityPlan, n: int = 240) -> list[float]:
    """Daily volumes to plot: two decades below the plan to one above, widened to show the
    volumes where one unit's load falls inside the sweep."""
    d = plan.traffic.daily_requests
    lo, hi = d / 100, d * 10
    if plan.measured is not None:
        t = plan.traffic
        per_day = t.peak_hours * 3600 / t.peak_factor  # daily requests per req/s of peak
        lo = min(lo, plan.measured.min_requests_per_s * per_day * t.min_units / 2)
        hi = max(hi, plan.measured.max_requests_per_s * per_day * 2)
    # The plan's own volume is on the grid, so the curve passes through the plan's units.
    return sorted({float(v) for v in np.geomspace(lo, hi, n)} | {float(d)})


def volume_curve(plan: CapacityPlan, volumes: Sequence[float] | None = None) -> list[CurvePoint]:
    """Units needed at each daily volume with the plan's peak window, factor, headroom, floor
    and per-unit rate; `measured` says whether a unit's load there (peak / units) lies within
    the request rates the sweep measured."""
    t = plan.traffic
    rate = plan.unit.requests_per_s
    out: list[CurvePoint] = []
    for v in volumes if volumes is not None else default_volumes(plan):
        peak = peak_rate(v, t.peak_hours, t.peak_factor)
        units = units_needed(peak, rate, headroom=t.headroom, min_units=t.min_units)
        load = peak / units
        inside: bool | None = None
        if plan.measured is not None:
            m = plan.measured
            inside = m.min_requests_per_s * 0.99 <= load <= m.max_requests_per_s * 1.01
        out.append(
            CurvePoint(
                daily_requests=v, units=units, load_per_unit_requests_per_s=load, measured=inside
            )
        )
    return out
