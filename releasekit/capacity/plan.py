"""Capacity plans: business numbers (requests a day, the peak window, the peak factor) turned
into serving units, from a release's own load test at its knee or from per-unit figures given
by hand, with every step of the working and a warning wherever the plan leaves what was
measured.

The arithmetic of design.md ("Capacity planning"):

    peak rate      = daily requests / (peak hours x 3600 s) x peak factor
    per-unit rate  = concurrency at the knee / mean E2E there          (Little's law)
    units          = max(min units, ceil(peak rate x headroom / per-unit rate))
    utilisation    = peak rate / (units x per-unit rate)

This module makes the plans (by hand, from a load test, from a release) and their warnings.
The models are in `capacity.plan_models`, the arithmetic in `capacity.plan_arithmetic`, the
volume curve in `capacity.plan_curve`, a release's files in `capacity.evidence` and the
errors (CapacityError, CapacityEvidenceError) in `capacity.errors`; all are re-exported
here.
"""

from __future__ import annotations

from releasekit.bench.runner import BenchResult, point_label
from releasekit.bench.stats import PointResult
from releasekit.capacity.errors import CapacityError, CapacityEvidenceError
from releasekit.capacity.evidence import (
    max_num_seqs_of,
    read_bench,
    read_release_manifest,
    release_files,
    release_model_dir,
)
from releasekit.capacity.plan_adapters import (
    adapter_bench,
    adapter_note,
    adapters_label,
    in_traffic,
)
from releasekit.capacity.plan_arithmetic import (
    check_hand,
    check_traffic,
    num,
    peak_rate,
    units_needed,
)
from releasekit.capacity.plan_curve import default_volumes, volume_curve
from releasekit.capacity.plan_models import (
    CapacityPlan,
    CurvePoint,
    HandUnit,
    Measured,
    PlanWarning,
    Step,
    Traffic,
    UnitRate,
    WarningCode,
)
from releasekit.config import Settings

#: Little's law and the measured request rate at the knee may differ by this much.
LITTLE_TOLERANCE = 0.15
#: The traffic's prompt/output lengths may differ from the load profile's by this much.
LENGTH_TOLERANCE = 0.20
#: Fewer requests than this at the knee make its mean E2E a rough figure.
MIN_KNEE_REQUESTS = 30


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
    if not knee.trusted:
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
    unit_cores: float | None = None,
    scale_cores: bool = False,
) -> CapacityPlan:
    """A plan from a load test: the per-unit rate is Little's law at the knee, concurrency /
    mean E2E (closed-loop sweep), or the arrival rate at the knee (open-loop sweep, where the
    concurrency is rate x mean E2E); either is cross-checked against the request rate the
    point measured. `max_num_seqs` defaults to the one the bench recorded.

    `unit_cores`: the cores one unit gets (a ray replica's CPUs). A knee measured on another
    core count (bench.json's `host`) does not carry over: CapacityEvidenceError, unless
    `scale_cores`, when the per-unit rate and concurrency scale in proportion to the cores,
    shown as a step and a warning. A bench that records no host cannot be matched.

    A release with LoRA adapters plans from the sweep with as many adapters in traffic as it
    carries (`plan_adapters.adapter_bench`), and says so; one without adapter sweeps from
    the base's.

    Raises CapacityError for bad numbers, CapacityEvidenceError when the sweep has no knee.
    """
    check_traffic(traffic)
    full = bench
    bench, sweep = adapter_bench(bench)
    knee = bench.knee
    who = f"release {release_id[:12]}" if release_id else f"bench of {bench.model}"
    with_adapters = f", {adapters_label(sweep.adapters)}" if sweep is not None else ""
    sweep_name = f"the sweep {in_traffic(sweep.adapters)}" if sweep is not None else "the sweep"
    factor = _cores_factor(who, bench, unit_cores, scale=scale_cores)
    if knee is None:
        why = bench.knee_stop or "no load point met its SLOs"
        raise CapacityEvidenceError(
            f"{who}: {sweep_name} has no knee to plan from ({why})",
            remedy="add lighter load points to the load profile (or revisit its SLOs), fix "
            "what the bench flagged, and rerun `releasekit bench`; or plan by hand with "
            "--concurrency, --tokens-per-second, --output-tokens",
        )
    e2e = knee.e2e.mean
    if e2e is None or e2e <= 0 or knee.ok == 0:
        raise CapacityEvidenceError(f"{who}: the knee has no completed request with an E2E time")
    peak = peak_rate(traffic.daily_requests, traffic.peak_hours, traffic.peak_factor)
    measured_rate = knee.request_throughput
    where = point_label(bench.mode, knee.load) + with_adapters
    steps = [
        _peak_step(traffic, peak),
        Step(
            name=f"mean E2E at the knee ({where})",
            working=f"measured over {knee.ok} requests"
            + (f" in {knee.repetitions} runs" if knee.repetitions > 1 else "")
            + (f"; knee: {bench.knee_rule}" if bench.knee_rule else "")
            + (f" (held in {knee.runs_holding} of {len(knee.runs)})" if len(knee.runs) > 1 else ""),
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
    host = bench.host
    cores_warning: list[PlanWarning] = []
    if factor != 1.0 and host is not None and unit_cores is not None:
        scaled = little * factor
        steps.append(
            Step(
                name="per-unit rate scaled to the unit's cores",
                working=f"{num(little)} req/s x {num(unit_cores)} / {host.cores} cores "
                "(assumed proportional to cores: --scale-cores)",
                value=scaled,
                unit="req/s per unit",
            )
        )
        cores_warning.append(
            PlanWarning(
                code="cores_scaled",
                message=f"the knee was measured on {host.label} and a unit here gets "
                f"{unit_cores:g} CPU: its rate was scaled by {factor:.3g} on the assumption "
                "that throughput is proportional to cores; bench the release with the unit's "
                "cores to know",
            )
        )
        little, concurrency, measured_rate = scaled, concurrency * factor, measured_rate * factor
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
        measured_on=host,
        cores=unit_cores if unit_cores is not None else (host.cores if host else None),
    )
    if max_num_seqs is None:
        max_num_seqs = bench.max_num_seqs
    measured = _measured(bench, knee, max_num_seqs)
    notes = [adapter_note(full, sweep)] if sweep is not None else []
    if max_num_seqs is None:
        notes.append("max-num-seqs is not set in the release's serving args (vLLM's default)")
    if bench.repetitions < 2:
        notes.append("the sweep ran once: whether its knee reproduces is unknown")
    if host is not None and unit_cores is None:
        notes.append(f"a unit is one engine as benched: {host.label}")
    elif host is None:
        notes.append(
            "bench.json records no host (measured before releasekit recorded where): the "
            "cores a unit needs for this rate are unknown"
        )
    warnings = [
        *cores_warning,
        *_knee_warnings(bench, knee, ratio),
        *_seqs_warning(concurrency, max_num_seqs),
        *_length_warnings(traffic, measured),
    ]
    plan = _finish(
        traffic,
        peak=peak,
        unit=unit,
        steps=steps,
        warnings=warnings,
        notes=notes,
        measured=measured,
        release_id=release_id or bench.release_id,
    )
    plan.adapters_in_traffic = sweep.adapters if sweep is not None else None
    return plan


def _cores_factor(who: str, bench: BenchResult, unit_cores: float | None, *, scale: bool) -> float:
    """How the knee's per-unit rate carries to a unit of `unit_cores` (1.0: as measured).
    CapacityEvidenceError when it does not carry and `scale` was not asked for."""
    if unit_cores is None:
        return 1.0
    host = bench.host
    if host is None:
        raise CapacityEvidenceError(
            f"{who}: bench.json records no host (measured before releasekit recorded where), "
            f"so its knee cannot be matched to a unit of {unit_cores:g} CPU",
            remedy="rerun `releasekit bench MANIFEST` (it records the host), or plan without --env",
        )
    if float(host.cores) == float(unit_cores):
        return 1.0
    if not scale:
        raise CapacityEvidenceError(
            f"{who}: its knee was measured on {host.label}, and a unit here gets "
            f"{unit_cores:g} CPU: a knee does not carry across core counts",
            remedy="bench the release with the unit's cores, set cpus_per_replica to the "
            "knee's, or pass --scale-cores to scale the knee's rate in proportion to cores "
            "(an assumption the plan then shows)",
        )
    return float(unit_cores) / float(host.cores)


def plan_release(
    settings: Settings,
    release_id: str,
    traffic: Traffic,
    *,
    unit_cores: float | None = None,
    scale_cores: bool = False,
) -> CapacityPlan:
    """A plan from a release's own load test (results/<release_id>/bench/bench.json) and
    its serving arguments (max-num-seqs), read as its register event signed them (an
    unregistered release's as they are, with an "unverified" note). `unit_cores` and
    `scale_cores`: see plan_from_bench.

    Raises CapacityError for bad numbers; CapacityEvidenceError without a bench or a knee,
    or when a registered release's file is not as signed.
    """
    check_traffic(traffic)
    files = release_files(settings, release_id)
    bench = read_bench(settings, release_id, files)
    lm = read_release_manifest(settings, release_id, files)
    plan = plan_from_bench(
        traffic,
        bench,
        release_id=release_id,
        max_num_seqs=max_num_seqs_of(lm),
        unit_cores=unit_cores,
        scale_cores=scale_cores,
    )
    plan.verified = files.verified
    if files.note:
        plan.notes.insert(0, files.note)
    if lm is None:
        plan.notes.append("the release's manifest could not be read: max-num-seqs unknown")
    return plan


__all__ = [
    "LENGTH_TOLERANCE",
    "LITTLE_TOLERANCE",
    "MIN_KNEE_REQUESTS",
    "CapacityError",
    "CapacityEvidenceError",
    "CapacityPlan",
    "CurvePoint",
    "HandUnit",
    "Measured",
    "PlanWarning",
    "Step",
    "Traffic",
    "UnitRate",
    "WarningCode",
    "check_hand",
    "check_traffic",
    "default_volumes",
    "max_num_seqs_of",
    "num",
    "peak_rate",
    "plan_by_hand",
    "plan_from_bench",
    "plan_release",
    "read_bench",
    "read_release_manifest",
    "release_files",
    "release_model_dir",
    "units_needed",
    "volume_curve",
]
