"""Manifest validation across files, reporting every problem at once."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field

from releasekit.config import Settings, load_settings
from releasekit.errors import ManifestError
from releasekit.spec.adapters import check_files as check_adapter_files
from releasekit.spec.engine_args import check_serving_args
from releasekit.spec.hostcaps import check_scheme
from releasekit.spec.loadprofile import load_profile
from releasekit.spec.lock import plain_chat_problems, rendered_prompts
from releasekit.spec.manifest import check_files, check_gates, load_manifest
from releasekit.spec.quantrecipe import calibration_notes, check_manifest_recipe


class ValidationResult(BaseModel):
    """The outcome for one manifest: `problems` are `field.path: problem` lines; `notes` say
    what could not be checked, and why (the manifest is not failed for them)."""

    path: str
    ok: bool
    problems: list[str]
    notes: list[str] = Field(default_factory=list)


def validate_one(
    path: Path, *, check_files_exist: bool = True, settings: Settings | None = None
) -> ValidationResult:
    """Validate one manifest: schema, gate lines that decide nothing (`check_gates`), then
    referenced files, then the load profile and the quantisation recipe against the model
    folder and calibration set (spec.quantrecipe), then `serving.args` against vLLM's own parser
    (`settings.python`; see spec.engine_args), then `quantisation.scheme` against what that
    vLLM can serve on this host (spec.hostcaps)."""
    try:
        lm = load_manifest(path)
    except ManifestError as exc:
        return ValidationResult(path=str(path), ok=False, problems=exc.problems)
    problems: list[str] = check_gates(lm.manifest)
    if check_files_exist:
        missing = check_files(lm)
        problems += missing
        if lm.manifest.adapters and not missing:
            problems += check_adapter_files(
                lm.manifest.adapters,
                [lm.resolve(a.path) for a in lm.manifest.adapters],
                lm.resolve(lm.manifest.model.source),
            )
        prof = lm.resolve(lm.manifest.load.profile)
        if prof.is_file():
            try:
                load_profile(prof)
            except ManifestError as exc:
                problems += [
                    f"load.profile ({lm.manifest.load.profile}): {p}" for p in exc.problems
                ]
        problems += check_manifest_recipe(lm)
        if lm.manifest.prompts.plain_chat != "as_sent" and not missing:
            problems += plain_chat_problems(rendered_prompts(lm))
    engine = check_serving_args(lm, settings=settings)
    problems += engine.problems
    notes = [engine.not_checked] if engine.not_checked else []
    scheme = check_scheme(lm, python=(settings or load_settings()).python)
    problems += scheme.problems
    notes += scheme.notes
    if check_files_exist and not problems:
        notes += calibration_notes(lm)
    return ValidationResult(path=str(path), ok=not problems, problems=problems, notes=notes)


def validate_many(
    paths: list[Path], *, check_files: bool = True, settings: Settings | None = None
) -> list[ValidationResult]:
    """Validate several manifests; never stops at the first bad one."""
    return [validate_one(p, check_files_exist=check_files, settings=settings) for p in paths]
