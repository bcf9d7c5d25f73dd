"""`releasekit capacity`: units needed for a traffic (from a release's load test or from
figures given by hand), and with --roofline the bandwidth ceiling of decoding."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from releasekit.capacity import (
    CapacityError,
    CapacityPlan,
    HandUnit,
    Roofline,
    Traffic,
    plan_by_hand,
    plan_release,
    roofline_by_hand,
    roofline_release,
)
from releasekit.capacity.plan import Step, num
from releasekit.capacity.plan_adapters import adapters_label
from releasekit.capacity.plot import default_plot_path, plot_plan
from releasekit.capacity.roofline import Memory
from releasekit.cli._common import JsonOpt, State, emit_json, esc, handle_errors, out, table
from releasekit.config import Settings


def register(app: typer.Typer) -> None:
    """Add the `capacity` command to the root app."""
    app.command("capacity")(capacity)


def _release_id(settings: Settings, ref: str) -> str:
    """Resolve a release reference to its id (the one place the CLI asks the release index)."""
    from releasekit.releases.resolve import resolve_release

    return resolve_release(settings, ref).release_id


def _value(s: Step) -> str:
    if s.name == "utilisation":
        return f"{s.value:.1%}"
    if s.unit == "ratio":
        return f"{s.value:.3f}"
    if s.unit == "units":
        return f"{s.value:.0f} units"
    if s.unit == "bytes":
        return f"{s.value / 1e9:.3g} GB" if s.value >= 1e8 else f"{s.value / 1e6:.3g} MB"
    return f"{num(s.value)} {s.unit}"


def _print_steps(title: str, steps: list[Step]) -> None:
    """The working, one numbered line a step, as design.md writes it."""
    out.print(f"[bold]{esc(title)}[/bold]")
    for i, s in enumerate(steps, 1):
        out.print(f"  {i}. {esc(s.name)}: {esc(s.working)} = {esc(_value(s))}", highlight=False)


def _print_plan(plan: CapacityPlan) -> None:
    who = f"release {plan.release_id[:12]}" if plan.release_id else "by hand"
    if plan.adapters_in_traffic:
        who += f", {adapters_label(plan.adapters_in_traffic)}"
    _print_steps(f"capacity plan ({who})", plan.steps)
    u = plan.unit
    rows: list[tuple[str, str]] = [
        ("peak rate", f"{num(plan.peak_requests_per_s)} req/s"),
        (f"per-unit rate ({u.source})", f"{num(u.requests_per_s)} req/s"),
    ]
    if u.measured_requests_per_s is not None:
        ratio = "-" if u.little_over_measured is None else f"{u.little_over_measured:.3f}"
        rows += [
            ("  Little's law at the knee", f"{num(u.little_requests_per_s)} req/s"),
            ("  measured at the knee", f"{num(u.measured_requests_per_s)} req/s"),
            ("  Little / measured", ratio),
        ]
    rows += [
        ("concurrency per unit", num(u.concurrency)),
        ("units", str(plan.units)),
        ("load per unit at the peak", f"{num(plan.load_per_unit_requests_per_s)} req/s"),
        ("utilisation", f"{plan.utilisation:.1%}"),
    ]
    if plan.cost_per_hour is not None:
        rows.append(("cost per hour", num(plan.cost_per_hour)))
    if plan.cost_per_1k_requests is not None:
        rows.append(("cost per 1,000 requests (over the day)", num(plan.cost_per_1k_requests)))
    table(None, ["figure", "value"], rows)
    for w in plan.warnings:
        out.print(f"[yellow]warning:[/yellow] {esc(w.message)}", highlight=False)
    for n in plan.notes:
        out.print(f"[dim]note: {esc(n)}[/dim]", highlight=False)
    if plan.plot:
        out.print(f"wrote {esc(plan.plot)}", highlight=False)


def _print_roofline(r: Roofline) -> None:
    who = f"release {r.release_id[:12]}" if r.release_id else "by hand"
    _print_steps(f"roofline ({who})", r.steps)
    rows: list[tuple[str, str]] = [
        (
            "bandwidth",
            f"{num(r.bandwidth_gbs)} GB/s ({r.bandwidth_source}"
            + (f", {r.accelerator})" if r.accelerator else ")"),
        ),
        ("ceiling per sequence", f"{num(r.ceiling_tokens_per_s)} tokens/s"),
    ]
    if r.single_stream_tokens_per_s is not None and r.single_stream_share is not None:
        rows.append(
            (
                "single stream (measured)",
                f"{num(r.single_stream_tokens_per_s)} tokens/s ({r.single_stream_share:.1%})",
            )
        )
    if r.batched_tokens_per_s is not None:
        share = "" if r.batched_share is None else f" ({r.batched_share:.1%} of c x ceiling)"
        rows.append(("batched at the knee", f"{num(r.batched_tokens_per_s)} tokens/s{share}"))
    table(None, ["figure", "value"], rows)
    out.print(
        f"ceiling: [bold]{esc(num(r.ceiling_tokens_per_s))} tokens/s per sequence[/bold]",
        highlight=False,
    )
    out.print(r.verdict, highlight=False)
    for n in r.notes:
        out.print(f"[dim]note: {esc(n)}[/dim]", highlight=False)


def _missing(**given: object) -> list[str]:
    return ["--" + k.replace("_", "-") for k, v in given.items() if v is None]


@handle_errors
def capacity(
    release: Annotated[
        str | None,
        typer.Argument(
            help="release (id, prefix, name@version, name@env or manifest) whose load test "
            "to plan from; leave out to plan by hand"
        ),
    ] = None,
    daily_requests: Annotated[
        float | None, typer.Option("--daily-requests", help="requests a day")
    ] = None,
    peak_hours: Annotated[
        float | None, typer.Option("--peak-hours", help="hours of the daily peak window")
    ] = None,
    peak_factor: Annotated[
        float | None,
        typer.Option("--peak-factor", help="peak rate = daily / (peak hours x 3600) x this"),
    ] = None,
    headroom: Annotated[
        float,
        typer.Option(
            "--headroom",
            help="multiplies the peak rate before dividing by a unit's rate (1.25 keeps 25% "
            "spare); default 1.0, no spare, as in design.md's worked example",
        ),
    ] = 1.0,
    min_units: Annotated[int, typer.Option("--min-units", help="plan at least this many")] = 1,
    unit_cost_per_hour: Annotated[
        float | None,
        typer.Option("--unit-cost-per-hour", help="price of one unit-hour: adds cost lines"),
    ] = None,
    concurrency: Annotated[
        float | None,
        typer.Option("--concurrency", help="by hand: sequences one unit serves at once"),
    ] = None,
    tokens_per_second: Annotated[
        float | None,
        typer.Option("--tokens-per-second", help="by hand: decode rate of one sequence"),
    ] = None,
    output_tokens: Annotated[
        float | None,
        typer.Option(
            "--output-tokens",
            help="output tokens per request of the traffic (by hand: required; with RELEASE: "
            "checked against the load profile's)",
        ),
    ] = None,
    overhead_s: Annotated[
        float | None,
        typer.Option(
            "--overhead-s", help="by hand: seconds added to each request, e.g. TTFT (default 0)"
        ),
    ] = None,
    max_num_seqs: Annotated[
        int | None,
        typer.Option(
            "--max-num-seqs", help="by hand: the engine's max-num-seqs, to check --concurrency"
        ),
    ] = None,
    prompt_tokens: Annotated[
        float | None,
        typer.Option(
            "--prompt-tokens",
            help="prompt tokens per request of the traffic (checked against the load profile's)",
        ),
    ] = None,
    roofline: Annotated[
        bool,
        typer.Option(
            "--roofline",
            help="print the bandwidth ceiling of decoding instead: for RELEASE from its weight "
            "files, or by hand from --params and --bytes-per-weight",
        ),
    ] = False,
    params: Annotated[
        float | None, typer.Option("--params", help="roofline by hand: parameters, e.g. 70e9")
    ] = None,
    bytes_per_weight: Annotated[
        float | None,
        typer.Option("--bytes-per-weight", help="roofline by hand: 2 FP16, 1 INT8, 0.5 4-bit"),
    ] = None,
    bandwidth_gbs: Annotated[
        float | None,
        typer.Option(
            "--bandwidth-gbs",
            help="roofline: memory bandwidth in GB/s (default: measured, see --memory)",
        ),
    ] = None,
    memory: Annotated[
        Memory,
        typer.Option(
            "--memory",
            help="roofline: whose bandwidth to measure: auto (the GPU's when the NVIDIA "
            "driver lists one, else the host's), host or accelerator",
        ),
    ] = "auto",
    plot: Annotated[
        Path | None,
        typer.Option(
            "--plot", help="write the plot here (default with RELEASE: results/<id>/capacity.png)"
        ),
    ] = None,
    no_plot: Annotated[bool, typer.Option("--no-plot", help="write no plot")] = False,
    scale_cores: Annotated[
        bool,
        typer.Option(
            "--scale-cores",
            help="with RELEASE and --env: a knee measured on another core count than the "
            "replica's is scaled in proportion to cores (shown as an assumption) instead of "
            "refused",
        ),
    ] = False,
    env: Annotated[
        str | None,
        typer.Option(
            "--env",
            help="a ray-target environment: print the units as its replicas and the promote "
            "command that applies them",
        ),
    ] = None,
    json_out: JsonOpt = False,
) -> None:
    """Serving units for a traffic, from a release's knee (Little's law) or figures by hand.

    E.g. `releasekit capacity --daily-requests 100000 --peak-hours 2 --peak-factor 2
    --concurrency 16 --tokens-per-second 30 --output-tokens 200` (12 units), or
    `releasekit capacity --roofline --params 70e9 --bytes-per-weight 2 --bandwidth-gbs 2000`.
    """
    traffic_given = [daily_requests, peak_hours, peak_factor, unit_cost_per_hour]
    hand_given = [concurrency, tokens_per_second, overhead_s, max_num_seqs]
    if roofline:
        if any(v is not None for v in (*traffic_given, *hand_given)) or plot is not None:
            raise CapacityError(
                "--roofline takes RELEASE, or --params and --bytes-per-weight, and "
                "--bandwidth-gbs; leave out the traffic and per-unit options",
                remedy="run the plan and the roofline as two commands",
            )
        if release is not None:
            if params is not None or bytes_per_weight is not None:
                raise CapacityError(
                    "with RELEASE the roofline reads its weight files: leave out --params "
                    "and --bytes-per-weight"
                )
            roof = roofline_release(
                State.settings(),
                _release_id(State.settings(), release),
                bandwidth_gbs=bandwidth_gbs,
                memory=memory,
            )
        else:
            missing = _missing(params=params, bytes_per_weight=bytes_per_weight)
            if missing or params is None or bytes_per_weight is None:
                raise CapacityError(
                    f"the roofline by hand needs {' and '.join(missing)} (or give RELEASE)",
                    remedy="e.g. --roofline --params 70e9 --bytes-per-weight 2 "
                    "--bandwidth-gbs 2000",
                )
            roof = roofline_by_hand(
                params=params,
                bytes_per_weight=bytes_per_weight,
                bandwidth_gbs=bandwidth_gbs,
                memory=memory,
            )
        if json_out:
            emit_json(roof)
        else:
            _print_roofline(roof)
        return

    if any(v is not None for v in (params, bytes_per_weight, bandwidth_gbs)):
        raise CapacityError("--params, --bytes-per-weight and --bandwidth-gbs need --roofline")
    missing = _missing(
        daily_requests=daily_requests, peak_hours=peak_hours, peak_factor=peak_factor
    )
    if missing or daily_requests is None or peak_hours is None or peak_factor is None:
        raise CapacityError(f"a capacity plan needs {', '.join(missing)}")
    traffic = Traffic(
        daily_requests=daily_requests,
        peak_hours=peak_hours,
        peak_factor=peak_factor,
        headroom=headroom,
        min_units=min_units,
        unit_cost_per_hour=unit_cost_per_hour,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
    )
    by_hand = any(v is not None for v in hand_given)
    if scale_cores and (release is None or env is None):
        raise CapacityError(
            "--scale-cores scales a release's knee to a ray environment's replica: give "
            "RELEASE and --env"
        )
    plot_path = plot
    if release is not None:
        if by_hand:
            raise CapacityError(
                "give RELEASE (plan from its load test) or the per-unit figures by hand "
                "(--concurrency, --tokens-per-second, --overhead-s, --max-num-seqs), not both"
            )
        settings = State.settings()
        rid = _release_id(settings, release)
        cores = None
        if env is not None:
            from releasekit.capacity.replicas import replica_cpus

            cores = replica_cpus(settings, env)
        plan = plan_release(settings, rid, traffic, unit_cores=cores, scale_cores=scale_cores)
        if plot_path is None:
            plot_path = default_plot_path(settings.release_dir(rid))
    else:
        missing = _missing(
            concurrency=concurrency,
            tokens_per_second=tokens_per_second,
            output_tokens=output_tokens,
        )
        if missing or concurrency is None or tokens_per_second is None or output_tokens is None:
            raise CapacityError(
                f"give RELEASE, or plan by hand with {', '.join(missing)} as well",
                remedy="e.g. --concurrency 16 --tokens-per-second 30 --output-tokens 200",
            )
        hand = HandUnit(
            concurrency=concurrency,
            tokens_per_second=tokens_per_second,
            output_tokens=output_tokens,
            overhead_s=overhead_s if overhead_s is not None else 0.0,
            max_num_seqs=max_num_seqs,
        )
        plan = plan_by_hand(traffic, hand)
    if plot_path is not None and not no_plot:
        plan.plot = str(plot_plan(plan, plot_path))
    if env is not None:
        from releasekit.capacity.replicas import PlannedReplicas, replica_plan

        reps = replica_plan(State.settings(), env, plan, release=release)
        if json_out:
            emit_json(PlannedReplicas(plan=plan, replicas=reps))
            return
        _print_plan(plan)
        out.print(
            f"ray target, {esc(env)}: {reps.replicas} replica(s) x "
            f"{reps.cpus_per_replica:g} CPU = {reps.cpus_total:g} Ray CPUs "
            f"(releasekit.toml says {reps.configured_replicas}); apply with: "
            f"{esc(reps.promote_command)}",
            highlight=False,
        )
        out.print(f"  {esc(reps.autoscaling.text)}", highlight=False)
        for w in reps.warnings:
            out.print(f"[yellow]warning:[/yellow] {esc(w)}", highlight=False)
        return
    if json_out:
        emit_json(plan)
    else:
        _print_plan(plan)
