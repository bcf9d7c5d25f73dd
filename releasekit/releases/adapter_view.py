"""A release's LoRA adapters as `show` and `diff` report them: each adapter's name, rank,
digest and base from its manifest and lock, its MLflow model version from the register
event, and what changed between two releases."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, Field

from releasekit.spec.adapters import adapters_of
from releasekit.spec.manifest import Manifest


class AdapterInfo(BaseModel):
    """One adapter of a release: the model name clients ask for, its rank, the digest of its
    files and declaration (as the lock pins them) and the base weights it was trained on."""

    name: str
    rank: int | None = None
    digest: str | None = Field(None, description="over its locked files and declaration")
    base: str | None = Field(None, description="weights digest of the base it was trained on")
    path: str | None = None
    model_uri: str | None = Field(
        None, description="its MLflow model version (models:/<name>/<version>), if registered"
    )


class AdapterChange(BaseModel):
    """One adapter that differs between releases a and b (None: absent on that side)."""

    name: str
    change: Literal["added", "removed", "changed"]
    a: AdapterInfo | None = None
    b: AdapterInfo | None = None


def registered_adapters(register_evidence: Mapping[str, Any] | None) -> dict[str, str]:
    """Adapter name -> model URI, from a register event's evidence (`adapters`); empty for
    a release not registered, without adapters, or registered before adapters were."""
    raw = (register_evidence or {}).get("adapters")
    if not isinstance(raw, Mapping):
        return {}
    return {str(k): str(v) for k, v in raw.items() if isinstance(v, str)}


def release_adapters(
    manifest: Manifest | None,
    inputs: Mapping[str, str],
    registered: Mapping[str, str] | None = None,
) -> list[AdapterInfo]:
    """A release's adapters, in name order: declared by its manifest (rank, base, path),
    pinned by its lock (digest) and, given `registered` (`registered_adapters`), each one's
    MLflow model version; an adapter known to only one of them is still listed."""
    links = registered or {}
    declared = {a.name: a for a in manifest.adapters} if manifest is not None else {}
    pinned = adapters_of(inputs)
    out: list[AdapterInfo] = []
    for name in sorted(set(declared) | set(pinned)):
        a = declared.get(name)
        out.append(
            AdapterInfo(
                name=name,
                rank=a.rank if a else None,
                digest=pinned.get(name, {}).get("digest"),
                base=a.base if a else None,
                path=a.path.as_posix() if a else None,
                model_uri=links.get(name),
            )
        )
    return out


def adapter_changes(a: list[AdapterInfo], b: list[AdapterInfo]) -> list[AdapterChange]:
    """Adapters added, removed or changed (digest, rank or base) from `a` to `b`."""
    ia, ib = {x.name: x for x in a}, {x.name: x for x in b}
    out: list[AdapterChange] = []
    for name in sorted(set(ia) | set(ib)):
        xa, xb = ia.get(name), ib.get(name)
        if xa is None:
            out.append(AdapterChange(name=name, change="added", b=xb))
        elif xb is None:
            out.append(AdapterChange(name=name, change="removed", a=xa))
        elif (xa.digest, xa.rank, xa.base) != (xb.digest, xb.rank, xb.base):
            out.append(AdapterChange(name=name, change="changed", a=xa, b=xb))
    return out
