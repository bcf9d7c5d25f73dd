"""Reconstruct a release's context from its record: the manifest and lock it was built from,
its evidence, its prompts, recipe and serving args, each checked against the locked digests."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from releasekit._support.digests import digest_obj, sha256_bytes, sha256_file
from releasekit.config import Settings
from releasekit.errors import (
    LockError,
    ManifestError,
    RegistryError,
    ReleasekitError,
)
from releasekit.releases.resolve import _open_ledger
from releasekit.spec.lock import (
    Lock,
    lock_path_for,
    quantisation_recipe,
    read_lock,
    serving_args,
)
from releasekit.spec.manifest import LoadedManifest, Manifest, parse_manifest
from releasekit.spec.prompts import read_template, render
from releasekit.stores.evidence import (
    Evidence,
    read_evidence,
)
from releasekit.stores.ledger import EventType, Ledger, LedgerRecord
from releasekit.stores.verified import (
    EvidenceIntegrityError,
    SignedEvidence,
    verify_release_evidence,
)


@dataclass
class _Context:
    """What can be known about one release from its build outputs, lock and the ledger."""

    release_id: str
    evidence: Evidence
    lock: Lock | None = None
    manifest: Manifest | None = None
    manifest_source: str | None = None
    register: LedgerRecord | None = None
    notes: list[str] = field(default_factory=list)
    signed: SignedEvidence | None = None
    """The build outputs checked against the register event's digests."""
    manifest_problem: str | None = None
    """Why the manifest copy was not read (it differs from what was signed)."""

    @property
    def name(self) -> str | None:
        if self.lock:
            return self.lock.name
        if self.manifest:
            return self.manifest.name
        if self.register:
            return str(self.register.evidence.get("model_name") or "") or None
        return None

    def loaded(self, root: Path) -> LoadedManifest | None:
        if self.manifest is None:
            return None
        return LoadedManifest(
            path=root / (self.manifest_source or "manifest.yaml"), base=root, manifest=self.manifest
        )


def _parse_manifest_file(path: Path) -> Manifest | None:
    try:
        return parse_manifest(yaml.safe_load(path.read_text(encoding="utf-8")), path=path)
    except (OSError, UnicodeDecodeError, yaml.YAMLError, ManifestError):
        return None


def _context(settings: Settings, release_id: str, led: Ledger) -> _Context:
    ev = read_evidence(settings, release_id)
    ctx = _Context(release_id=release_id, evidence=ev, lock=ev.lock)
    regs = led.records(
        release=release_id, types=[EventType.REGISTER.value], newest_first=True, limit=1
    )
    ctx.register = regs[0] if regs else None
    manifest_rel = ctx.lock.manifest if ctx.lock else None
    if manifest_rel is None and ctx.register is not None:
        manifest_rel = ctx.register.evidence.get("manifest")
    if ctx.lock is None and manifest_rel:
        try:
            lk = read_lock(lock_path_for(settings.root / str(manifest_rel)))
            if lk.release_id == release_id:
                ctx.lock = lk
        except LockError:
            pass
    copy = ev.path("manifest")
    ctx.signed = verify_release_evidence(settings, release_id, led)
    bad = ctx.signed.file_problem("manifest")
    if copy is not None and bad is not None:
        # Not as its register event signed it (or not as its lock says): never read.
        ctx.manifest_problem = bad
        ctx.notes.append(bad)
    elif copy is not None:
        ctx.manifest = _parse_manifest_file(copy)
        ctx.manifest_source = (
            f"{settings.release_dir(release_id).relative_to(settings.root)}/{copy.name}"
            if copy.is_relative_to(settings.root)
            else str(copy)
        )
    elif manifest_rel:
        path = settings.root / str(manifest_rel)
        if path.is_file():
            ctx.manifest = _parse_manifest_file(path)
            ctx.manifest_source = str(manifest_rel)
            if ctx.lock and sha256_file(path) != ctx.lock.manifest_digest:
                ctx.notes.append(
                    f"{manifest_rel} changed since the lock; only parts whose digests still "
                    "match the lock are shown"
                )
    if ctx.manifest is None:
        ctx.notes.append("manifest not available")
    return ctx


def release_manifest(
    settings: Settings, release_id: str, *, ledger: Ledger | None = None
) -> Manifest | None:
    """The manifest a release was built from, if its copy or its file can still be read.
    EvidenceIntegrityError when its copy is not the one its register event signed: the
    copy's environments, gates and watch sections decide, so an edited one is refused."""
    ctx = _context(settings, release_id, _open_ledger(settings, ledger))
    if ctx.manifest_problem is not None:
        raise EvidenceIntegrityError(ctx.manifest_problem)
    return ctx.manifest


def report_digests(settings: Settings, release_id: str) -> dict[str, str]:
    """sha256 of each build output the release has now (relative path -> digest); what its
    register event signed is `stores.verified.verify_release_evidence`'s."""
    return read_evidence(settings, release_id).digests


def _prompt_texts(settings: Settings, ctx: _Context) -> dict[str, str | None]:
    """Role -> prompt text the release was locked with (None where it cannot be recovered)."""
    roles: dict[str, str | None] = {}
    locked = {
        k.split("/", 1)[1]: v
        for k, v in (ctx.lock.inputs if ctx.lock else {}).items()
        if k.startswith("prompt/")
    }
    lm = ctx.loaded(settings.root)
    if lm is not None:
        for role in ("system", "user"):
            pf = getattr(lm.manifest.prompts, role)
            if pf is None:
                continue
            try:
                text: str | None = render(read_template(lm.resolve(pf.file)), pf.variables)
            except (ReleasekitError, OSError, UnicodeDecodeError):
                text = None
            if text is not None and role in locked and sha256_bytes(text.encode()) != locked[role]:
                text = None  # the file changed since the lock: not this release's text
            roles[role] = text
    for role in locked:
        roles.setdefault(role, None)
    missing = [r for r, t in roles.items() if t is None]
    uri = ctx.register.evidence.get("prompt_uri") if ctx.register else None
    if missing and uri:
        from releasekit.stores import mlflow as registry

        try:
            msgs = registry.prompt_messages(settings, str(uri))
        except RegistryError:
            msgs = []
        for m in msgs:
            if m["role"] in missing and (
                m["role"] not in locked or sha256_bytes(m["content"].encode()) == locked[m["role"]]
            ):
                roles[m["role"]] = m["content"]
    return roles


def _verified(ctx: _Context, key: str, value: Any) -> Any:
    """`value` if it matches the lock's digest for `key` (or there is no lock), else None."""
    if ctx.lock is None or key not in ctx.lock.inputs:
        return value
    return value if digest_obj(value) == ctx.lock.inputs[key] else None


def _recipe(ctx: _Context) -> dict[str, Any] | None:
    if ctx.manifest is None:
        return None
    out: dict[str, Any] | None = _verified(
        ctx, "quantisation/recipe", quantisation_recipe(ctx.manifest)
    )
    return out


def _serving(ctx: _Context) -> dict[str, Any] | None:
    if ctx.manifest is None:
        return None
    value = {
        "args": serving_args(ctx.manifest),
        "env": dict(sorted(ctx.manifest.serving.env.items())),
    }
    out: dict[str, Any] | None = _verified(ctx, "serving", value)
    return out
