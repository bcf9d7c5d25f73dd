"""The adapters an engine loads, as verified copies: each release's adapter files are checked
against the digests its lock pinned and copied once into a content-addressed folder, so two
versions of one adapter (the same name, the same path in the repository) live side by side in
one engine under names of their own, and a file edited after the lock is never served."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from releasekit._support.digests import sha256_file
from releasekit.errors import AdapterLoadError
from releasekit.spec.adapters import Adapter, adapter_files
from releasekit.spec.adapters import adapter_digest as pinned_digest


class StagedAdapter(BaseModel):
    """One adapter of a release, ready for an engine: the name clients ask for, the name the
    engine holds it under (`name@digest12`), its verified folder and its digest."""

    model_config = ConfigDict(frozen=True)

    name: str
    engine_name: str
    path: Path
    digest: str


def adapter_digest(inputs: Mapping[str, str], name: str) -> str:
    """The digest of one adapter in a lock; AdapterLoadError when the lock pins none."""
    digest = pinned_digest(inputs, name)
    if digest is None:
        raise AdapterLoadError(f"the release's lock pins no adapter named {name}")
    return digest


def engine_name(name: str, digest: str) -> str:
    """The model name an engine holds an adapter under: its name and its digest's first 12
    hex digits (two versions of one adapter never collide)."""
    return f"{name}@{digest[:12]}"


def _pinned_files(inputs: Mapping[str, str], name: str) -> dict[str, str]:
    prefix = f"adapter/{name}/"
    return {k[len(prefix) :]: v for k, v in inputs.items() if k.startswith(prefix)}


def _matches(folder: Path, pinned: Mapping[str, str]) -> list[str]:
    """What differs between `folder` and the pinned {relative path: sha256}: in words."""
    found = {p.relative_to(folder).as_posix(): p for p in adapter_files(folder)}
    problems = [f"{rel} is missing" for rel in sorted(set(pinned) - set(found))]
    problems += [f"{rel} is not in the lock" for rel in sorted(set(found) - set(pinned))]
    problems += [
        f"{rel} has sha256 {sha256_file(found[rel])[:12]}, the lock pins {pinned[rel][:12]}"
        for rel in sorted(set(found) & set(pinned))
        if sha256_file(found[rel]) != pinned[rel]
    ]
    return problems


def stage_adapters(
    store: Path,
    adapters: Sequence[Adapter],
    inputs: Mapping[str, str],
    resolve: Callable[[Path], Path],
) -> list[StagedAdapter]:
    """Verified copies of a release's adapters under `store/<digest>/`: the source folder
    (`resolve(adapter.path)`) is checked file by file against the lock's `inputs` and copied
    once; a copy already there is checked again. AdapterLoadError names the first adapter
    whose files differ from what the lock pinned; nothing is copied for it."""
    staged: list[StagedAdapter] = []
    for a in adapters:
        digest = adapter_digest(inputs, a.name)
        pinned = _pinned_files(inputs, a.name)
        dest = store / digest
        if dest.is_dir() and not _matches(dest, pinned):
            staged.append(
                StagedAdapter(
                    name=a.name, engine_name=engine_name(a.name, digest), path=dest, digest=digest
                )
            )
            continue
        src = resolve(a.path)
        if not src.is_dir():
            raise AdapterLoadError(f"adapter {a.name}: folder not found: {a.path}")
        problems = _matches(src, pinned)
        if problems:
            raise AdapterLoadError(
                f"adapter {a.name} ({a.path}) is not the one its release locked: "
                + "; ".join(problems[:3])
            )
        store.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{digest[:12]}-", dir=store))
        try:
            for rel in pinned:
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src / rel, tmp / rel)
            problems = _matches(tmp, pinned)  # changed while it was copied
            if problems:
                raise AdapterLoadError(
                    f"adapter {a.name} ({a.path}) changed while it was copied: {problems[0]}"
                )
            if dest.is_dir():
                shutil.rmtree(dest)
            os.replace(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        staged.append(
            StagedAdapter(
                name=a.name, engine_name=engine_name(a.name, digest), path=dest, digest=digest
            )
        )
    return staged
