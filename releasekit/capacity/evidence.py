"""A release's evidence as capacity reads it: the one place in releasekit.capacity that knows a
release's files (bench.json, read with BenchResult, the model the bench writer dumps; the
manifest it was built from; the model folder it serves) and the models that wrote them.

A registered release's files are read only as its signed `register` ledger event vouches for
them (`releasekit.stores.verified`): a swapped, edited or missing file is one clear error
naming it and the record. A release that is built but not registered (planning from one's
own fresh build is a read-only use) is read as its files are, and says so: `ReleaseFiles.note`
("unverified: ... not registered") goes into every plan, roofline and diagnosis made from it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import ValidationError

from releasekit._support.digests import sha256_bytes
from releasekit.bench.runner import BenchResult
from releasekit.capacity.errors import CapacityEvidenceError
from releasekit.config import Settings
from releasekit.errors import LedgerIntegrityError, LedgerNotFoundError, ManifestError
from releasekit.spec.manifest import LoadedManifest, parse_manifest
from releasekit.stores.results import FILES
from releasekit.stores.verified import (
    REGISTER_REMEDY,
    EvidenceIntegrityError,
    SignedEvidence,
    register_record,
    verify_release_evidence,
)


def unregistered_note(release_id: str) -> str:
    """What every figure from an unregistered release's files says about them."""
    return (
        f"unverified: release {release_id[:12]} is not registered, so nothing signed its "
        "files; read as they are on disk (register it to plan from signed evidence)"
    )


@dataclass
class ReleaseFiles:
    """A release's build outputs as capacity may read them: through the digests its verified
    register event signed (`evidence`), or, for a release never registered, as they are
    (`evidence` None, `note` says so)."""

    settings: Settings
    release_id: str
    evidence: SignedEvidence | None
    note: str | None = None

    @property
    def verified(self) -> bool:
        """The files are read through the release's verified register event."""
        return self.evidence is not None

    def path(self, key: str) -> Path:
        """The path of evidence file `key` (a stores.results.FILES key)."""
        return self.settings.release_dir(self.release_id) / FILES[key]

    def read(self, key: str) -> bytes | None:
        """The bytes of evidence file `key`; None when it is absent and nothing signed it.

        Raises CapacityEvidenceError naming the file and the record when a registered
        release's file is not as its register event signed it (or is gone)."""
        path = self.path(key)
        if self.evidence is None:
            try:
                return path.read_bytes() if path.is_file() else None
            except OSError as exc:
                raise CapacityEvidenceError(f"{path}: unreadable ({exc})") from exc
        check = self.evidence.files.get(key)
        if check is None:
            return None
        try:
            return self.evidence.read_bytes(key)
        except EvidenceIntegrityError as exc:
            raise CapacityEvidenceError(exc.message, remedy=REGISTER_REMEDY) from exc

    def matches_signed_manifest(self, path: Path) -> bool:
        """Whether `path` (the project's manifest) is byte for byte the manifest copy the
        register event signed (always True for an unregistered release)."""
        if self.evidence is None:
            return True
        want = self.evidence.manifest_digest
        try:
            return want is not None and sha256_bytes(path.read_bytes()) == want
        except OSError:
            return False


def release_files(settings: Settings, release_id: str) -> ReleaseFiles:
    """`release_id`'s files, checked against its register event in the project's ledger.

    A release with a register event: every file is read through its signed digest, and a
    register record or ledger that does not verify is refused (CapacityEvidenceError). A
    release with none (or a project with no ledger yet), where the ledger verifies: its
    files as they are, with the "unverified: not registered" note."""
    from releasekit.stores.ledger import open_ledger

    try:
        led = open_ledger(settings, read_only=True)
    except LedgerNotFoundError:
        return ReleaseFiles(settings, release_id, None, unregistered_note(release_id))
    if register_record(led, release_id) is None:
        try:
            led.verified()
        except LedgerIntegrityError as exc:
            raise CapacityEvidenceError(
                f"the ledger does not verify ({exc.message}): whether release "
                f"{release_id[:12]} was registered, and what its register event signed, "
                "cannot be told",
                remedy="run `releasekit ledger verify` and restore the ledger",
            ) from exc
        return ReleaseFiles(settings, release_id, None, unregistered_note(release_id))
    ve = verify_release_evidence(settings, release_id, led)
    if ve.problem is not None:
        raise CapacityEvidenceError(ve.problem, remedy=REGISTER_REMEDY)
    return ReleaseFiles(settings, release_id, ve)


def read_bench(
    settings: Settings, release_id: str, files: ReleaseFiles | None = None
) -> BenchResult:
    """The release's load test, results/<release_id>/bench/bench.json, as its register
    event signed it (`files`; default: `release_files`).

    Raises CapacityEvidenceError if it is missing, unreadable or not as signed.
    """
    files = files or release_files(settings, release_id)
    path = files.path("bench")
    data = files.read("bench")
    if data is None:
        raise CapacityEvidenceError(
            f"release {release_id[:12]} has no load test: {path} is missing"
        )
    try:
        return BenchResult.model_validate_json(data)
    except (ValidationError, ValueError) as exc:
        raise CapacityEvidenceError(f"unreadable bench result {path}: {exc}") from exc


def read_release_manifest(
    settings: Settings, release_id: str, files: ReleaseFiles | None = None
) -> LoadedManifest | None:
    """The manifest a release was built from: its copy in results/<release_id>/, else the
    file its lock names (for a registered release only when it is the copy the register
    event signed); None when neither can be read.

    Raises CapacityEvidenceError when a registered release's copy or lock is not as signed.
    """
    files = files or release_files(settings, release_id)
    copy = files.path("manifest")
    data = files.read("manifest")
    if data is not None:
        lm = _parse(data, copy, settings)
        if lm is not None:
            return lm
    lock = files.read("lock")
    if lock is None:
        return None
    try:
        rel = json.loads(lock.decode("utf-8")).get("manifest")
    except (UnicodeDecodeError, ValueError, AttributeError):
        rel = None
    if not isinstance(rel, str) or not rel:
        return None
    path = settings.root / rel
    if not path.is_file() or not files.matches_signed_manifest(path):
        return None
    try:
        return _parse(path.read_bytes(), path, settings)
    except OSError:
        return None


def _parse(data: bytes, path: Path, settings: Settings) -> LoadedManifest | None:
    try:
        m = parse_manifest(yaml.safe_load(data.decode("utf-8")), path=path)
    except (UnicodeDecodeError, yaml.YAMLError, ManifestError):
        return None
    return LoadedManifest(path=path, base=settings.root, manifest=m)


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


def release_model_dir(
    settings: Settings,
    release_id: str,
    lm: LoadedManifest | None,
    files: ReleaseFiles | None = None,
) -> Path:
    """The folder a release serves: results/<release_id>/model (or quantise.json's model_dir,
    as the register event signed it) for a quantised release, else the manifest's model
    source.

    Raises CapacityEvidenceError when neither exists.
    """
    rdir = settings.release_dir(release_id)
    files = files or release_files(settings, release_id)
    record = files.read("quantise")
    if record is not None:
        try:
            recorded = json.loads(record.decode("utf-8")).get("model_dir")
        except (UnicodeDecodeError, ValueError, AttributeError):
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
