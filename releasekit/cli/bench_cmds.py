"""`releasekit bench`: load-test a running server, or a manifest's release on its own server."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from releasekit.bench import (
    BenchResult,
    PointResult,
    bench_release,
    point_label,
    run_bench,
    write_outputs,
)
from releasekit.bench.adapter_cost import HEADER, adapter_cost, adapter_cost_title, cells
from releasekit.cli._common import (
    JsonOpt,
    State,
    emit_json,
    err,
    esc,
    handle_errors,
    out,
    progress_reporter,
)
from releasekit.errors import BenchError
from releasekit.spec.loadprofile import load_profile


def register(app: typer.Typer) -> None:
    """Add the `bench` command to the root app."""
    app.command("bench")(bench)


def _ms(v: float | None) -> str:
    if v is None:
        return "-"
    ms = v * 1000
    return f"{ms:.1f}" if ms < 10 else f"{ms:.0f}"


def _num(v: float | None, fmt: str = ".1f") -> str:
    return "-" if v is None else format(v, fmt)


def _spread(p: PointResult, key: str, fmt: str = ".0f", *, ms: bool = False) -> str:
    """`min / median / max` of a figure across repetitions ("-" with one run)."""
    s = p.spread.get(key)
    if s is None or s.n < 2:
        return "-"
    show = _ms if ms else (lambda v: _num(v, fmt))
    return f"{show(s.min)} / {show(s.median)} / {show(s.max)}"


def _flag_codes(p: PointResult) -> str:
    return ", ".join(sorted({f.code for f in p.flags}))


def point_table(p: PointResult) -> Table:
    """One load point: requests, throughput, latencies, SLOs, the server's own figures and
    the cross-check, every flag with its numbers, and the spread across repetitions."""
    t = Table(title=point_label(p.mode, p.load), show_header=True, title_justify="left")
    for col in ("metric", "value"):
        t.add_column(col)
    s, c = p.server, p.check
    tpot = (
        f"{_ms(p.tpot.p50)} / {_ms(p.tpot.p95)} ({p.tpot_source})"
        if p.tpot_measurable
        else "not measurable (bursty, no server figures)"
    )
    rows: list[tuple[str, str]] = [
        ("repetitions", str(p.repetitions)),
        ("requests ok / errors / timeouts", f"{p.ok} / {p.errors} / {p.timeouts}"),
        ("wall time (s)", f"{p.duration_s:.2f}"),
        ("requests/s", f"{p.request_throughput:.2f}"),
        ("output tok/s", f"{p.output_token_throughput:.1f}"),
        ("TTFT p50 / p95 / p99 (ms)", f"{_ms(p.ttft.p50)} / {_ms(p.ttft.p95)} / {_ms(p.ttft.p99)}"),
        ("TPOT p50 / p95 (ms)", tpot),
        (
            "ITL p50 / p95 (ms)",
            f"{_ms(p.itl.p50)} / {_ms(p.itl.p95)} ({p.tpot_source})" if p.tpot_measurable else "-",
        ),
        ("E2E p50 / p95 / p99 (ms)", f"{_ms(p.e2e.p50)} / {_ms(p.e2e.p95)} / {_ms(p.e2e.p99)}"),
        ("goodput (req/s)", f"{p.goodput:.2f}"),
        (
            "SLO attainment",
            f"{p.slo_attainment:.1%} (held in {p.runs_holding} of {len(p.runs)} runs: "
            f"{'holds' if p.holds else 'does not hold'})",
        ),
        ("client CPU share", _num(p.client_cpu_share, ".0%")),
    ]
    if p.repetitions > 1:
        rows += [
            ("spread: output tok/s (min / med / max)", _spread(p, "output_token_throughput")),
            ("spread: TTFT p95 (ms)", _spread(p, "ttft_p95_s", ms=True)),
            ("spread: E2E p95 (ms)", _spread(p, "e2e_p95_s", ms=True)),
            ("spread: SLO attainment", _spread(p, "slo_attainment", ".2f")),
        ]
    if c is not None:
        rows += [
            (
                "client: delay its stalls added / loop lag max (ms)",
                f"{_ms(c.client_delay_mean_s)} / {_ms(c.client_lag_max_s)}",
            ),
            (
                "TTFT mean: client = front end + engine (ms)",
                f"{_ms(c.client_ttft_mean_s)} = {_ms(c.front_end_ttft_s)} + "
                f"{_ms(c.server_ttft_mean_s)}",
            ),
            (
                "engine TTFT: queue / prefill mean (ms)",
                f"{_ms(c.engine_queue_mean_s)} / {_ms(c.engine_prefill_mean_s)}",
            ),
            (
                "E2E mean client / server HTTP / engine (ms)",
                f"{_ms(c.client_e2e_mean_s)} / {_ms(c.server_http_e2e_mean_s)} / "
                f"{_ms(c.server_e2e_mean_s)}",
            ),
            ("completed client / server", f"{c.client_ok} / {_num(c.server_succeeded, '.0f')}"),
            (
                "running peak / expected",
                f"{_num(c.running_peak, '.0f')} / {_num(c.expected_running, '.0f')}",
            ),
            ("content arrivals per token", _num(c.deliveries_per_token, ".2f")),
        ]
    if s is not None:
        rows += [
            ("server generation tok/s", _num(p.server_generation_tokens_per_s)),
            (
                "server queue / prefill / decode mean (ms)",
                f"{_ms(s.queue_time_mean_s)} / {_ms(s.prefill_time_mean_s)} / "
                f"{_ms(s.decode_time_mean_s)}",
            ),
            ("server preemptions", _num(s.preemptions, ".0f")),
            ("server KV-cache peak", _num(s.kv_cache_usage_peak, ".1%")),
            (
                "server running / waiting peak",
                f"{_num(s.running_peak, '.0f')} / {_num(s.waiting_peak, '.0f')}",
            ),
        ]
    for f in p.flags:
        where = (
            f" (run {f.repetition + 1})" if f.repetition is not None and p.repetitions > 1 else ""
        )
        rows.append((f"[red]FLAG {f.code}[/red]{where}", esc(f.message)))
    seen: set[str] = set()
    for f in p.findings:
        if f.code in seen:  # one line per kind of finding is enough
            continue
        seen.add(f.code)
        rows.append((f"[yellow]finding {f.code}[/yellow]", esc(f.message)))
    for name, count in p.top_errors.items():
        rows.append((f"failure x{count}", name))
    for r in rows:
        t.add_row(*r)
    return t


def summary_table(result: BenchResult) -> Table:
    """One row per point, the knee marked, flagged points named; narrow enough for an
    80-column terminal."""
    t = Table(
        title=f"{result.profile_name}: sweep (latencies in ms, {result.repetitions} run(s))",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    for col in (
        "load", "ok/n", "tok/s", "TTFT\np95", "front\nend", "E2E\np95",
        "held", "SLO", "flags",
    ):  # fmt: skip
        t.add_column(col, no_wrap=True)
    knee = result.knee
    for p in result.points:
        is_knee = knee is not None and p.load == knee.load
        fe = p.check.front_end_ttft_s if p.check is not None else None
        t.add_row(
            f"c={p.load:g}" if p.mode == "concurrency" else f"{p.load:g}/s",
            f"{p.ok}/{p.n}",
            f"{p.output_token_throughput:.0f}",
            _ms(p.ttft.p95),
            _ms(fe),
            _ms(p.e2e.p95),
            f"{p.runs_holding}/{len(p.runs)}",
            "[bold green]knee[/bold green]" if is_knee else ("ok" if p.holds else "broken"),
            f"[red]{_flag_codes(p)}[/red]" if p.flags else "",
        )
    return t


def knee_line(result: BenchResult) -> str:
    """The knee with its spread across repetitions and whether reruns agree."""
    knee = result.knee
    per = ", ".join("none" if k is None else f"{k:g}" for k in result.knee_by_repetition)
    stop = f"; {esc(result.knee_stop)}" if result.knee_stop else ""
    rule = f"\n  rule: {esc(result.knee_rule)}" if result.knee_rule else ""
    if knee is None:
        return f"[yellow]no knee{stop}[/yellow]{rule}"
    if result.repetitions < 2:
        stability = "[yellow]one run: stability not shown[/yellow]"
    elif result.knee_stable:
        stability = f"[green]stable[/green] over {result.repetitions} runs"
    else:
        stability = f"[yellow]NOT stable[/yellow]: per-run knees {per}"
    spread = ""
    if knee.repetitions > 1:
        spread = (
            f"\n  spread over runs (min / median / max): output tok/s "
            f"{_spread(knee, 'output_token_throughput')}, TTFT p95 ms "
            f"{_spread(knee, 'ttft_p95_s', ms=True)}, E2E p95 ms "
            f"{_spread(knee, 'e2e_p95_s', ms=True)}"
        )
    return (
        f"knee: [bold]{point_label(knee.mode, knee.load)}[/bold] ({stability}{stop}){spread}{rule}"
    )


def adapter_table(result: BenchResult) -> Table | None:
    """What serving N adapters costs (`bench.adapter_cost`); None without adapter sweeps."""
    rows = adapter_cost(result)
    if not rows:
        return None
    t = Table(
        title=adapter_cost_title(result), title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False
    )
    for col in HEADER:
        t.add_column(col, no_wrap=True)
    for r in rows:
        t.add_row(*cells(r, result.mode))
    return t


@handle_errors
def bench(
    manifest: Annotated[
        Path | None,
        typer.Argument(help="manifest: lock it, serve its release and run its load profile"),
    ] = None,
    url: Annotated[
        str | None, typer.Option("--url", help="base URL of a running server (no /v1)")
    ] = None,
    model: Annotated[str | None, typer.Option("--model", help="served model name")] = None,
    profile: Annotated[Path | None, typer.Option("--profile", help="load profile YAML")] = None,
    out_dir: Annotated[
        Path | None,
        typer.Option(
            "--out",
            help="output folder (default with a manifest: results/<release_id>/bench; "
            "with --url nothing is written unless set)",
        ),
    ] = None,
    port: Annotated[
        int | None,
        typer.Option("--port", help="with a manifest: port to serve on (default: a free one)"),
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option("--api-key", envvar="VLLM_API_KEY", help="bearer token for --url servers"),
    ] = None,
    repetitions: Annotated[
        int | None,
        typer.Option(
            "--repetitions",
            min=1,
            help="run the sweep this many times (default: the profile's, else 3); the knee "
            "needs the SLOs to hold in every run",
        ),
    ] = None,
    json_out: JsonOpt = False,
) -> None:
    """Load-test a server: a repeated sweep of load points, latency percentiles, goodput, each
    point cross-checked against the server's own metrics, and the knee with its spread. A
    manifest with LoRA adapters also sweeps with 1 to max-loras adapters in traffic and shows
    what each costs against the base alone."""
    by_url = url is not None or model is not None or profile is not None
    complete = url is not None and model is not None and profile is not None
    if (manifest is not None and by_url) or (manifest is None and not complete):
        raise BenchError(
            "give either MANIFEST, or --url, --model and --profile",
            remedy="e.g. `releasekit bench manifests/demo-bf16.yaml` or "
            "`releasekit bench --url http://127.0.0.1:8000 --model demo "
            "--profile pipelines/load/demo.yaml`",
        )
    console: Console = err if json_out else out
    written: Path | None = None
    with progress_reporter(console) as bars:

        def on_point(p: PointResult) -> None:
            if not json_out:
                bars.print(point_table(p))

        if manifest is not None:
            result, written = bench_release(
                manifest,
                settings=State.settings(),
                out_dir=out_dir,
                port=port,
                progress=bars,
                on_point=on_point,
                repetitions=repetitions,
            )
        else:
            result = run_bench(
                str(url),
                str(model),
                load_profile(Path(str(profile))),
                progress=bars,
                on_point=on_point,
                api_key=api_key,
                repetitions=repetitions,
            )
            written = out_dir
            if out_dir is not None:
                write_outputs(result, out_dir)
    if json_out:
        emit_json(result)
        return
    out.print(summary_table(result))
    out.print(knee_line(result))
    costs = adapter_table(result)
    if costs is not None:
        out.print(costs)
    if written is not None:
        out.print(f"wrote {esc(written)}/bench.json, bench.png, requests.jsonl")
