"""CLI: validate and lock manifests."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from releasekit.cli._common import (
    JsonOpt,
    State,
    emit_json,
    err,
    esc,
    handle_errors,
    out,
    report_error,
)
from releasekit.errors import LockMismatchError, ManifestError, ReleasekitError
from releasekit.evaluate.sensitivity import SuiteSensitivity, manifest_sensitivity
from releasekit.spec import lock as lockmod
from releasekit.spec.manifest import load_manifest
from releasekit.spec.validate import validate_many


def register(app: typer.Typer) -> None:
    """Attach this module's commands to the root app."""
    app.command("validate")(validate)
    app.command("lock")(lock)


@handle_errors
def validate(
    manifests: Annotated[list[Path], typer.Argument(help="manifest files", show_default=False)],
    json_: JsonOpt = False,
    files: Annotated[bool, typer.Option(help="also check that named files exist")] = True,
) -> None:
    """Validate manifests; report every problem as `file: field.path: problem`."""
    results = validate_many(manifests, check_files=files, settings=State.settings())
    suites = {r.path: _sensitivity(Path(r.path)) if r.ok and files else [] for r in results}
    if json_:
        emit_json(
            [
                {**r.model_dump(mode="json"), "suites": [s.model_dump() for s in suites[r.path]]}
                for r in results
            ]
        )
    else:
        for r in results:
            if r.ok:
                out.print(f"[green]ok[/green] {esc(r.path)}")
            else:
                report_error(ManifestError(r.path, r.problems))
            for n in r.notes:
                err.print(f"  [yellow]note:[/yellow] {esc(n)}", highlight=False)
            for s in suites[r.path]:
                colour = "yellow" if s.fragile else "dim"
                out.print(f"  [{colour}]suite {esc(s.line())}[/{colour}]", highlight=False)
    if not all(r.ok for r in results):
        raise typer.Exit(1)


def _sensitivity(path: Path) -> list[SuiteSensitivity]:
    """What each suite of a valid manifest can detect at its margin (empty if unreadable)."""
    try:
        return manifest_sensitivity(load_manifest(path))
    except ReleasekitError:
        return []


@handle_errors
def lock(
    manifest: Annotated[Path, typer.Argument(help="manifest file", show_default=False)],
    check: Annotated[
        bool, typer.Option("--check", help="fail if inputs changed since the lock")
    ] = False,
    json_: JsonOpt = False,
) -> None:
    """Lock a manifest into a release: pin every input's sha256; print the release id."""
    if check:
        try:
            res = lockmod.check(manifest)
        except LockMismatchError as exc:
            if json_:
                emit_json({"manifest": str(manifest), "ok": False, "changed": exc.changed})
            else:
                err.print(f"[red]changed since lock:[/red] {esc(exc.path)}", markup=True)
                for name in exc.changed:
                    err.print(f"  {esc(name)}", highlight=False)
                err.print(f"  [dim]hint: {esc(exc.remedy)}[/dim]", highlight=False)
            raise typer.Exit(1) from None
        if json_:
            emit_json({"manifest": str(manifest), "ok": True, "release_id": res.release_id})
        else:
            out.print(f"[green]unchanged[/green] {esc(manifest)} release {res.release_id}")
        return
    lk = lockmod.lock(manifest)
    if json_:
        emit_json(
            {
                "release_id": lk.release_id,
                "name": lk.name,
                "lock": str(lockmod.lock_path_for(Path(manifest))),
                "inputs": len(lk.inputs),
                "provenance": lk.provenance.model_dump(),
            }
        )
    else:
        out.print(lk.release_id)
