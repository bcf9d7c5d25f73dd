"""CLI: build releases through DVC, serve a release in the foreground, and the internal
`stage` commands that dvc.yaml runs."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from releasekit._support.procs import sigterm_as_interrupt
from releasekit._support.progress import (
    PROGRESS_ENV,
    Progress,
    emit_marker,
)
from releasekit.build import pipeline
from releasekit.build.engines import kept_engines
from releasekit.build.stages import StageKind, run_stage
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
from releasekit.serving.vllm import ServerInfo, serve_manifest
from releasekit.spec.lock import Lock

stage_app = typer.Typer(
    help="Internal: one build stage of a locked release (the commands dvc.yaml runs).",
    no_args_is_help=True,
)


def register(app: typer.Typer) -> None:
    """Attach `build`, `serve` and the hidden `stage` group to the root app."""
    app.command("build")(build)
    app.command("serve")(serve)
    app.add_typer(stage_app, name="stage", hidden=True)


@handle_errors
def build(
    manifests: Annotated[list[Path], typer.Argument(help="manifest files", show_default=False)],
    push: Annotated[bool, typer.Option("--push", help="dvc push the outputs afterwards")] = False,
    register_: Annotated[
        bool,
        typer.Option("--register/--no-register", help="register the release in MLflow"),
    ] = True,
    json_: JsonOpt = False,
) -> None:
    """Build releases: lock, quantise, load-test, evaluate and report, as cached DVC stages.

    A manifest whose inputs did not change is not rebuilt ("up to date, nothing rebuilt").
    A release whose engine and load profile were measured before cites that load test; given
    right after the release that ran its engine, it also runs its suites on that server.
    """
    settings = State.settings()
    results = []
    with sigterm_as_interrupt(), kept_engines(settings) as engines:
        for manifest in manifests:
            # In a log the release line below gives each stage's time and longest part.
            with progress_reporter(enabled=not json_, step_lines=False) as progress:
                res = pipeline.build(
                    settings,
                    manifest,
                    progress=progress,
                    push=push,
                    register=register_,
                    engines=engines,
                )
            results.append(res)
            if not json_:
                pushed = ", pushed to the DVC remote" if res.pushed else ""
                registered = (
                    f", registered as {res.registered.get('model_uri')}" if res.registered else ""
                )
                out.print(
                    f"[bold]{esc(res.name)}[/bold] release {res.release_id[:12]}: "
                    f"{'[green]' if res.up_to_date else ''}{esc(res.summary)}"
                    f"{'[/green]' if res.up_to_date else ''}{esc(pushed)}{esc(registered)} "
                    f"({res.seconds:.0f} s) -> {esc(res.release_dir)}/",
                    highlight=False,
                )
    if json_:
        emit_json(results)


@handle_errors
def serve(
    manifest: Annotated[Path, typer.Argument(help="manifest file", show_default=False)],
    port: Annotated[int | None, typer.Option("--port", help="port (default: a free one)")] = None,
    json_: JsonOpt = False,
) -> None:
    """Serve a release with vLLM in the foreground (its exact engine arguments); Ctrl-C stops it."""

    def ready(info: ServerInfo, lock: Lock) -> None:
        if json_:
            data = {**info.model_dump(), "release_id": lock.release_id}
            sys.stdout.write(json.dumps(data) + "\n")
            sys.stdout.flush()
        else:
            out.print(
                f"serving [bold]{esc(lock.name)}[/bold] release {lock.short_id} as "
                f"'{esc(info.model)}' at {esc(info.base_url)}/v1 (log: {esc(info.log_path)}); "
                "Ctrl-C stops",
                highlight=False,
            )

    if not json_:
        err.print("starting vLLM ...")
    try:
        serve_manifest(State.settings(), manifest, port=port, on_ready=ready)
    except KeyboardInterrupt:
        if not json_:
            out.print("stopped")


def _stage_progress() -> tuple[Progress, Callable[[], None]]:
    if os.environ.get(PROGRESS_ENV) == "lines":
        return emit_marker, lambda: None
    cm = progress_reporter()

    def close() -> None:
        cm.__exit__(None, None, None)

    return cm.__enter__(), close


def _run_stage(kind: StageKind, manifest: Path, release: str, baseline: str | None) -> None:
    progress, close = _stage_progress()
    try:
        where = run_stage(
            State.settings(),
            kind,
            manifest,
            release_id=release,
            baseline_release_id=baseline,
            progress=progress,
        )
    finally:
        close()
    err.print(f"{esc(kind)}: wrote {esc(where)}", highlight=False)


ManifestArg = Annotated[Path, typer.Argument(help="manifest file", show_default=False)]
ReleaseOpt = Annotated[str, typer.Option("--release", help="release id dvc.yaml expects")]


@stage_app.command("quantise")
@handle_errors
def stage_quantise(manifest: ManifestArg, release: ReleaseOpt) -> None:
    """Quantise the release's model (results/<release>/model, quantise.json)."""
    _run_stage("quantise", manifest, release, None)


@stage_app.command("bench")
@handle_errors
def stage_bench(manifest: ManifestArg, release: ReleaseOpt) -> None:
    """Serve the release and run its load profile (results/<release>/bench)."""
    _run_stage("bench", manifest, release, None)


@stage_app.command("eval")
@handle_errors
def stage_eval(manifest: ManifestArg, release: ReleaseOpt) -> None:
    """Serve the release and run its eval suites (results/<release>/eval)."""
    _run_stage("eval", manifest, release, None)


@stage_app.command("evidence")
@handle_errors
def stage_evidence(manifest: ManifestArg, release: ReleaseOpt) -> None:
    """Serve the release once: load test, then eval suites (results/<release>/bench, eval)."""
    _run_stage("evidence", manifest, release, None)


@stage_app.command("report")
@handle_errors
def stage_report(
    manifest: ManifestArg,
    release: ReleaseOpt,
    baseline: Annotated[str, typer.Option("--baseline", help="baseline release id")],
) -> None:
    """Compare the release's eval with its baseline's (results/<release>/report)."""
    _run_stage("report", manifest, release, baseline)
