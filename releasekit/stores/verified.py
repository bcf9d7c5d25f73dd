"""A release's evidence as its signed record vouches for it.

The `register` ledger event of a release signs the sha256 of every build output the release
had when it was registered (`evidence["reports"]`, relative path -> digest) and the digest
of its manifest copy (`evidence["manifest_digest"]`), and, from quantise.json as signed, the
served weights' digest and the host kind that quantised them (`weights_digest`,
`weights_made_on`; absent from events written before they were signed). Everything that
decides from a release's files (the gates' eval, bench and comparison, the knee autoscaling
derives its target from, the manifest copy whose gates, environments, promotion, canary,
shadow and watch sections decide) reads them through `verify_release_evidence`: each file is
compared with the digest the verified register event signed, and the manifest copy with the
lock's `manifest_digest`. A file that differs, one the event does not list, a listed one
that is gone, or no register event at all is a problem that names the file; nothing is
rebuilt.

    ve = verify_release_evidence(settings, release_id, ledger)
    ve.problems_for("eval", "eval_items")   # [] when eval.json and items.jsonl are as signed
    data = ve.read_bytes("bench")           # the bytes, re-checked; EvidenceIntegrityError
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field, ValidationError

from releasekit._support.digests import sha256_bytes, sha256_file
from releasekit.config import Settings
from releasekit.errors import LedgerIntegrityError, ReleasekitError, SignatureError
from releasekit.stores.evidence import MadeOn
from releasekit.stores.ledger import EventType, Ledger, LedgerRecord, format_time, record_hash
from releasekit.stores.ledger.schema import _evidence_text
from releasekit.stores.results import FILES, ReleasePaths
from releasekit.stores.signing import verify_signature

REGISTER_REMEDY = (
    "restore the file as it was registered (from a backup or `dvc checkout`), or build the "
    "change as a new release; a release's evidence and manifest copy are fixed when it is "
    "registered, and nothing is rebuilt in their place"
)


class EvidenceIntegrityError(ReleasekitError):
    """Raised when a release's evidence file (eval, bench, comparison, lock or manifest copy)
    is not the one its verified `register` event signed, or the release has no such event.
    The message names the file and the record."""

    remedy = REGISTER_REMEDY


class FileCheck(BaseModel):
    """One evidence file: the digest the register event signed and the one on disk."""

    key: str = Field(description="its key in stores.results.FILES")
    path: str = Field(description="its path, relative to the project root where possible")
    signed: str | None = Field(None, description="sha256 the register event signed (None: none)")
    actual: str | None = Field(None, description="sha256 of the file now (None: absent)")
    problem: str | None = None


class SignedEvidence(BaseModel):
    """A release's build outputs checked against its verified `register` event.

    `problem` applies to every file (no register event, a register record that fails its
    hash or signature, a ledger that does not verify); `files` holds each file's own check.
    `ok` when neither has a problem."""

    release_id: str
    directory: Path
    register_seq: int | None = None
    register_key_id: str | None = None
    registered: bool = Field(False, description="a verified register event was found")
    manifest_digest: str | None = Field(
        None, description="the manifest copy's sha256 the register event signed"
    )
    problem: str | None = Field(None, description="what makes every file unverified")
    files: dict[str, FileCheck] = Field(default_factory=dict)
    weights_digest: str | None = Field(
        None, description="the served weights' digest the register event signed (None: none)"
    )
    weights_made_on: MadeOn | None = Field(
        None,
        description="the host kind that quantised the served weights, as the register event "
        "signed it (None: not quantised, or an event that does not record it)",
    )

    @property
    def ok(self) -> bool:
        """Every file as signed, and a verified register event."""
        return self.problem is None and not any(f.problem for f in self.files.values())

    @property
    def problems(self) -> list[str]:
        """Every problem, the event's first, then each file's."""
        out = [self.problem] if self.problem else []
        return out + [f.problem for f in self.files.values() if f.problem]

    def problems_for(self, *keys: str) -> list[str]:
        """The problems that concern the files `keys` (FILES keys): the event's, and each
        of those files' own. A file neither present nor signed is no problem here (the
        reader reports it missing)."""
        out = [self.problem] if self.problem else []
        return out + [c.problem for k in keys if (c := self.files.get(k)) and c.problem]

    def file_problem(self, key: str) -> str | None:
        """The problem of one file that is proven (it differs from what the event signed,
        the event does not list it, or it is gone), ignoring the event-wide problem."""
        c = self.files.get(key)
        return c.problem if c else None

    def read_bytes(self, key: str) -> bytes:
        """The bytes of evidence file `key`, checked again as read against the signed digest.
        EvidenceIntegrityError naming the file when it is not as signed (or nothing signed
        it, or it is missing)."""
        probs = self.problems_for(key)
        if probs:
            raise EvidenceIntegrityError(probs[0])
        c = self.files.get(key)
        path = self.directory / FILES[key]
        if c is None or c.signed is None:
            shown = c.path if c is not None else str(path)
            raise EvidenceIntegrityError(
                f"{shown} is not among the files {_event_name(self)} signed"
            )
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise EvidenceIntegrityError(f"{c.path}: unreadable ({exc})") from exc
        if sha256_bytes(data) != c.signed:
            raise EvidenceIntegrityError(_differs(c.path, self))
        return data


def _rel(settings: Settings, path: Path) -> str:
    try:
        return path.relative_to(settings.root).as_posix()
    except ValueError:
        return str(path)


def _event_name(ve: SignedEvidence) -> str:
    return f"release {ve.release_id[:12]}'s register event #{ve.register_seq}"


def _differs(path: str, ve: SignedEvidence) -> str:
    return f"{path} differs from the digest {_event_name(ve)} signed"


def stored_hash(rec: LedgerRecord) -> str:
    """The chain hash of a record recomputed from its contents as stored."""
    row = rec.model_dump()
    row["time"] = format_time(rec.time)
    row["evidence"] = _evidence_text(rec.evidence)
    return record_hash(row)


def register_record(ledger: Ledger, release_id: str) -> LedgerRecord | None:
    """The newest `register` event of `release_id` (unchecked), or None."""
    for rec in ledger.records(
        release=release_id, types=[EventType.REGISTER.value], newest_first=True
    ):
        if rec.to_release == release_id:
            return rec
    return None


def _record_problem(ledger: Ledger, rec: LedgerRecord, *, chain_ok: bool) -> str | None:
    """Why the register record itself cannot vouch for anything, or None."""
    if stored_hash(rec) != rec.hash:
        return f"register event #{rec.seq} was edited: its contents do not match its hash"
    trusted = ledger.trusted
    if rec.key_id is not None and rec.signature is not None:
        if trusted is not None:
            try:
                verify_signature(
                    trusted,
                    record_hash=rec.hash,
                    key_id=rec.key_id,
                    signature=rec.signature,
                    seq=rec.seq,
                )
            except SignatureError as exc:
                return f"register event #{rec.seq}: {exc.message}"
    elif trusted and not chain_ok:
        return f"register event #{rec.seq} is unsigned although the repository trusts keys"
    return None


def verify_release_evidence(
    settings: Settings, release_id: str, ledger: Ledger, *, chain: bool = True
) -> SignedEvidence:
    """Check every build output of `release_id` (results/<id>/, stores.results.FILES)
    against the digests its `register` event signed. Never raises for what it finds: the
    result lists each problem, naming the file and the record.

    The register record must verify: its hash recomputed from its contents, its signature
    against the ledger's trusted keys; with `chain` (the default) the whole ledger is
    verified first (`Ledger.verified`, once per head), so the record is also in place in
    the chain. A ledger that does not verify makes every file unverified (`problem`).
    The manifest copy must also match the lock copy's `manifest_digest`."""
    directory = ReleasePaths.of(settings, release_id).root
    short = release_id[:12]
    ve = SignedEvidence(release_id=release_id, directory=directory)
    chain_ok = False
    if chain:
        try:
            ledger.verified()
            chain_ok = True
        except LedgerIntegrityError as exc:
            ve.problem = (
                f"the ledger does not verify ({exc.message}), so release {short}'s register "
                "event cannot vouch for its evidence"
            )
    rec = register_record(ledger, release_id)
    signed: dict[str, str] = {}
    if rec is None:
        ve.problem = ve.problem or (
            f"release {short} has no register event in the ledger: nothing signed its "
            "evidence (register it: `releasekit register MANIFEST`)"
        )
    else:
        ve.register_seq, ve.register_key_id = rec.seq, rec.key_id
        bad = _record_problem(ledger, rec, chain_ok=chain_ok)
        if bad is not None:
            ve.problem = ve.problem or bad
        reports = rec.evidence.get("reports")
        if isinstance(reports, dict):
            signed = {str(k): str(v) for k, v in reports.items()}
        md = rec.evidence.get("manifest_digest") or signed.get(FILES["manifest"])
        _read_weights(ve, rec)
        ve.manifest_digest = str(md) if md else None
        ve.registered = ve.problem is None
        if not signed and ve.problem is None:
            ve.problem = (
                f"{_event_name(ve)} signs no evidence digests (it was recorded without "
                "them): the release's evidence cannot be checked"
            )
    for key, rel in FILES.items():
        path = directory / rel
        shown = _rel(settings, path)
        check = FileCheck(key=key, path=shown, signed=signed.get(rel))
        if path.is_file():
            try:
                check.actual = sha256_file(path)
            except OSError as exc:
                check.problem = f"{shown}: unreadable ({exc})"
        if rec is not None and signed and check.problem is None:
            if check.actual is not None and check.signed is None:
                check.problem = f"{shown} is not among the files {_event_name(ve)} signed"
            elif check.actual is None and check.signed is not None:
                check.problem = f"{shown} is missing ({_event_name(ve)} signed it)"
            elif check.actual is not None and check.actual != check.signed:
                check.problem = _differs(shown, ve)
        if check.actual is not None or check.signed is not None:
            ve.files[key] = check
    _check_manifest_against_lock(ve)
    return ve


def _read_weights(ve: SignedEvidence, rec: LedgerRecord) -> None:
    """The served weights' digest and maker as the register event signed them (events
    written before they were signed carry neither: both stay None)."""
    wd = rec.evidence.get("weights_digest")
    ve.weights_digest = wd if isinstance(wd, str) else None
    made = rec.evidence.get("weights_made_on")
    if isinstance(made, dict):
        try:
            ve.weights_made_on = MadeOn.model_validate(made)
        except ValidationError:
            ve.weights_made_on = None


def _check_manifest_against_lock(ve: SignedEvidence) -> None:
    """The manifest copy against the lock copy's `manifest_digest` (and the digest the
    register event signed for it)."""
    from releasekit.errors import LockError
    from releasekit.spec.lock import read_lock

    man = ve.files.get("manifest")
    if man is None or man.actual is None or man.problem:
        return
    if ve.manifest_digest is not None and man.actual != ve.manifest_digest:
        man.problem = _differs(man.path, ve)
        return
    lock_path = ve.directory / FILES["lock"]
    if not lock_path.is_file():
        return
    try:
        lk = read_lock(lock_path)
    except LockError:
        return
    if lk.manifest_digest != man.actual:
        man.problem = (
            f"{man.path} does not match its lock's manifest_digest ({lk.manifest_digest[:12]}): "
            "the manifest copy was edited after the release was locked"
        )


def require_verified(
    settings: Settings, release_id: str, ledger: Ledger, *keys: str
) -> SignedEvidence:
    """`verify_release_evidence`, raising EvidenceIntegrityError with the first problem of
    the files `keys` (every file when none are named)."""
    ve = verify_release_evidence(settings, release_id, ledger)
    probs = ve.problems_for(*keys) if keys else ve.problems
    if probs:
        raise EvidenceIntegrityError(probs[0])
    return ve
