"""A release's evidence as capacity reads it: the one place in releasekit.capacity that knows a
release's files (bench.json, read with BenchResult, the model the bench writer dumps; the
manifest it was built from; the model folder it serves) and the models that wrote them."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from pydantic import ValidationError

from releasekit.bench.runner import BENCH_JSON, BenchResult
from releasekit.capacity.errors import CapacityEvidenceError
from releasekit.config import Settings
from releasekit.errors import ManifestError
from releasekit.spec.manifest import LoadedManifest, parse_manifest


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
