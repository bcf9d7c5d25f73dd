"""Resolve a release reference (id or prefix, name@version, name@env, a manifest path, env@time)
to one release id, and parse the times auditors type."""

from __future__ import annotations

import datetime as dt
import re
from pathlib import Path

from pydantic import BaseModel, Field

from releasekit.config import Settings
from releasekit.errors import (
    LedgerNotFoundError,
    LockError,
    RegistryError,
    RegistryUnreachableError,
    ReleaseNotFoundError,
    TimeParseError,
)
from releasekit.spec.lock import (
    SHORT,
    lock_path_for,
    read_lock,
)
from releasekit.stores.ledger import EventType, Ledger, open_ledger

_HEX = re.compile(r"^[0-9a-f]{1,64}$")


_REL_TIME = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhdw])(?:\s+ago)?$")


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


class ReleaseRef(BaseModel):
    """A resolved release reference: the full id and how the reference named it."""

    release_id: str
    how: str = Field(description="id, prefix, name@version, name@env or manifest")
    name: str | None = None


def parse_time(text: str, *, now: dt.datetime | None = None) -> dt.datetime:
    """Parse an auditor's time: ISO 8601 (`2025-05-01`, `2025-05-01T12:00:00Z`, with offset),
    `now`, or a relative `90m`, `2h ago`, `3d`. Times without a zone are UTC."""
    now = now or dt.datetime.now(dt.UTC)
    s = text.strip()
    if s.lower() == "now":
        return now
    m = _REL_TIME.match(s.lower())
    if m:
        return now - dt.timedelta(seconds=float(m.group(1)) * _UNITS[m.group(2)])
    try:
        t = dt.datetime.fromisoformat(s.replace(" ", "T", 1) if len(s) > 10 else s)
    except ValueError:
        raise TimeParseError(
            f"not a time: {text!r} (use ISO 8601 like 2025-05-01T12:00:00Z, 'now' or '2h ago')"
        ) from None
    return t.replace(tzinfo=dt.UTC) if t.tzinfo is None else t.astimezone(dt.UTC)


def _open_ledger(settings: Settings, ledger: Ledger | None) -> Ledger:
    # Lookups only read: a missing ledger is an error naming its URL, never created.
    return ledger or open_ledger(settings, read_only=True)


def _lookup_ledger(settings: Settings) -> Ledger:
    """The ledger for a lookup on its own: the project's, or an empty in-memory one when it
    has none yet (builds under results/ and MLflow still resolve; nothing is created)."""
    try:
        return open_ledger(settings, read_only=True)
    except LedgerNotFoundError:
        return Ledger("sqlite://")


def known_release_ids(settings: Settings, ledger: Ledger) -> set[str]:
    """Release ids with build outputs under results/ or named by any ledger event."""
    ids = set(ledger.release_ids())
    if settings.results_dir.is_dir():
        ids.update(
            p.name
            for p in settings.results_dir.iterdir()
            if p.is_dir() and len(p.name) == 64 and _HEX.match(p.name)
        )
    return ids


def _manifest_ref(settings: Settings, ref: str) -> Path | None:
    for base in (Path.cwd(), settings.root):
        p = Path(ref) if Path(ref).is_absolute() else base / ref
        if p.is_file():
            return p
    return None


def resolve_release(settings: Settings, ref: str, *, ledger: Ledger | None = None) -> ReleaseRef:
    """Resolve a release reference: a full id or a unique prefix of one, `name@version`,
    `name@<environment>` (the release live there), or a manifest path (its lock's id).

    Raises ReleaseNotFoundError when it matches nothing or more than one release.
    """
    led = ledger or _lookup_ledger(settings)
    text = ref.strip()
    if not text:
        raise ReleaseNotFoundError("empty release reference")
    path = _manifest_ref(settings, text)
    if path is not None or text.endswith((".yaml", ".yml")):
        if path is None:
            raise ReleaseNotFoundError(f"no manifest at {text}")
        try:
            lk = read_lock(lock_path_for(path))
        except LockError as exc:
            raise ReleaseNotFoundError(
                f"{text}: {exc.message}", remedy="run `releasekit lock MANIFEST` first"
            ) from exc
        return ReleaseRef(release_id=lk.release_id, how="manifest", name=lk.name)
    if "@" in text:
        return _resolve_at(settings, text, led)
    low = text.lower()
    if not _HEX.match(low):
        raise ReleaseNotFoundError(
            f"{ref!r} is not a release id, prefix, name@version or manifest path"
        )
    ids = known_release_ids(settings, led)
    if low in ids:
        return ReleaseRef(release_id=low, how="id")
    matches = sorted(i for i in ids if i.startswith(low))
    if len(matches) == 1:
        return ReleaseRef(release_id=matches[0], how="prefix")
    if len(matches) > 1:
        shown = ", ".join(m[:SHORT] for m in matches[:5]) + (" ..." if len(matches) > 5 else "")
        raise ReleaseNotFoundError(
            f"release prefix {ref!r} is ambiguous: {len(matches)} releases match ({shown})",
            remedy="give more digits of the release id",
        )
    if len(low) == 64:
        # Known only to MLflow (registered elsewhere): ask it.
        from releasekit.stores import mlflow as registry

        try:
            if registry.find_version(settings, low) is not None:
                return ReleaseRef(release_id=low, how="id")
        except RegistryUnreachableError:
            raise  # "cannot reach MLflow", never "no release matches"
        except RegistryError:
            pass
    raise ReleaseNotFoundError(f"no release matches {ref!r}")


def _resolve_at(settings: Settings, text: str, led: Ledger) -> ReleaseRef:
    name, _, tail = text.rpartition("@")
    if not name or not tail:
        raise ReleaseNotFoundError(f"{text!r}: expected name@version or name@environment")
    if tail.isdigit():
        for rec in led.records(types=[EventType.REGISTER.value], newest_first=True):
            if (
                rec.to_release
                and rec.evidence.get("model_name") == name
                and str(rec.evidence.get("model_version")) == tail
            ):
                return ReleaseRef(release_id=rec.to_release, how="name@version", name=name)
        from releasekit.stores import mlflow as registry

        try:
            v = registry.get_version(settings, name, tail)
        except RegistryError as exc:
            raise ReleaseNotFoundError(f"cannot look up {text}: {exc.message}") from exc
        if v is not None and v.release_id:
            return ReleaseRef(release_id=v.release_id, how="name@version", name=name)
        raise ReleaseNotFoundError(f"no release is registered as {name} version {tail}")
    live = led.live_at(tail)
    if live is not None and live.to_release and live.evidence.get("model_name") == name:
        return ReleaseRef(release_id=live.to_release, how="name@env", name=name)
    raise ReleaseNotFoundError(f"no release of {name} is live in {tail!r}")
