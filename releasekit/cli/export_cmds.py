"""`releasekit export kuberay`: a release on a `ray` environment as a KubeRay RayService."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from releasekit.cli._common import State, err, esc, handle_errors, out
from releasekit.errors import LedgerNotFoundError, ReleasekitError

export_app = typer.Typer(
    help="Write a release as a deployment manifest for another platform.",
    no_args_is_help=True,
)


class ExportWriteError(ReleasekitError):
    """Raised when the export cannot be written to --out."""

    remedy = "give --out a path in an existing folder you can write to"


def register(app: typer.Typer) -> None:
    """Add the `export` group to the root app."""
    app.add_typer(export_app, name="export")


@export_app.command("kuberay")
@handle_errors
def kuberay(
    release: Annotated[str, typer.Argument(help="release id, prefix, name@version, name@env")],
    env: Annotated[str, typer.Option("--env", help="a `ray` environment of releasekit.toml")],
    out_file: Annotated[
        Path | None, typer.Option("--out", help="write the YAML here (default: stdout)")
    ] = None,
) -> None:
    """Write a KubeRay RayService (apiVersion ray.io/v1) for RELEASE on ENV.

    Its serveConfigV2 is the Ray Serve config the `ray` target deploys for
    the release (same application name, deployment options and replica
    arguments) plus releasekit's router. No secret is written: the router
    reads the environment's secret digest from the cluster, where releasekit
    records it when it connects. rayClusterConfig is a skeleton with
    placeholders (image, model volume) to fill in.

    Tested: the serveConfigV2 passes Ray's Serve schema and, deployed with
    Ray's `serve deploy` on a local Ray cluster, serves the release. Not
    tested: anything on Kubernetes. Reads only; writes only --out.
    """
    from releasekit.deploy.ray.export import kuberay_export
    from releasekit.promote.context import load_release, release_spec
    from releasekit.promote.deploy import env_config
    from releasekit.releases.resolve import resolve_release
    from releasekit.stores.ledger import Ledger, open_ledger

    settings = State.settings()
    cfg = env_config(settings, env)
    try:
        led = open_ledger(settings, read_only=True)
    except LedgerNotFoundError:
        led = Ledger("sqlite://")  # builds under results/ still resolve; nothing is created
    with led:
        rid = resolve_release(settings, release, ledger=led).release_id
        spec = release_spec(settings, load_release(settings, rid, ledger=led), ledger=led)
    export = kuberay_export(settings, env, cfg, spec)
    if out_file is None:
        out.file.write(export.text)
        return
    try:
        out_file.write_text(export.text, encoding="utf-8")
    except OSError as exc:
        raise ExportWriteError(f"cannot write {out_file}: {exc.strerror or exc}") from exc
    err.print(
        f"wrote RayService {esc(export.manifest['metadata']['name'])} "
        f"(application {esc(export.app)}) to {esc(out_file)}",
        markup=True,
        highlight=False,
    )
