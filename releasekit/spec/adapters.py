"""LoRA adapters in a manifest: the adapter model, the weights digest an adapter names as its
base, and the checks that tie an adapter's files to its declaration and to the base served."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from releasekit._support.digests import digest_obj, sha256_file

_NAME = r"^[a-z0-9][a-z0-9._-]{0,62}$"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
LORA_ARGS = ("enable-lora", "max-loras", "max-lora-rank")
"""The engine arguments a release with adapters must commit (the same on every release of its
base, so an adapter-only change keeps the serving parameters, and the running engine)."""


class Adapter(BaseModel):
    """One LoRA adapter served on the manifest's base model under its own model name."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(
        pattern=_NAME, description="the model name clients ask for (the request's `model`)"
    )
    path: Path = Field(description="folder with the peft adapter (adapter_config.json, weights)")
    rank: int = Field(ge=1, le=512, description="the LoRA rank (adapter_config.json's `r`)")
    base: str = Field(
        pattern=r"^[0-9a-f]{64}$",
        description="sha256 weights digest of the base model folder it was trained on "
        "(`releasekit validate` names the served base's on a mismatch)",
    )


def adapter_files(folder: Path) -> list[Path]:
    """Every file of an adapter folder, hidden ones excluded, in path order."""
    return sorted(
        p
        for p in folder.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )


def weight_files(folder: Path) -> list[Path]:
    """The weight files of a model folder (safetensors/bin shards and their indexes)."""
    return [
        p
        for p in adapter_files(folder)
        if p.name.endswith(WEIGHT_SUFFIXES) or p.name.endswith(".index.json")
    ]


def weights_digest(folder: Path) -> str:
    """sha256 of the canonical {relative path: sha256} map of a folder's weight files: equal
    digests mean byte-identical weights. An adapter names its base by this digest."""
    return digest_obj(
        {p.relative_to(folder).as_posix(): sha256_file(p) for p in weight_files(folder)}
    )


def _int_arg(args: Mapping[str, Any], key: str) -> int | None:
    for k, v in args.items():
        if k.replace("_", "-") == key:
            try:
                return int(v)
            except (TypeError, ValueError):
                return None
    return None


def _truthy_arg(args: Mapping[str, Any], key: str) -> bool:
    return any(k.replace("_", "-") == key and v not in (False, None) for k, v in args.items())


def check_declared(
    adapters: Sequence[Adapter], *, served_name: str, serving_args: Mapping[str, Any]
) -> list[str]:
    """`adapters...: problem` for each declaration the manifest alone contradicts: a name
    used twice or equal to the base's served name, and the engine arguments that must carry
    them (enable-lora, max-loras at least the adapters' count, max-lora-rank at least each
    rank). Reads no file."""
    if not adapters:
        return []
    problems: list[str] = []
    names = [a.name for a in adapters]
    for dup in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"adapters: name {dup!r} is used twice")
    for i, a in enumerate(adapters):
        if a.name == served_name:
            problems.append(
                f"adapters[{i}].name: {a.name!r} is the base's served name; name the adapter "
                "apart from model.served_name"
            )
    if not _truthy_arg(serving_args, "enable-lora"):
        problems.append(
            "serving.args: a release with adapters needs enable-lora: true (commit it, with "
            "max-loras and max-lora-rank, on every release of this base)"
        )
    max_loras = _int_arg(serving_args, "max-loras")
    if max_loras is None:
        problems.append(
            "serving.args: a release with adapters needs max-loras (how many adapters the "
            "engine holds at once)"
        )
    elif len(adapters) > max_loras:
        problems.append(
            f"adapters: {len(adapters)} adapters, more than serving.args max-loras "
            f"{max_loras}: raise max-loras (a new engine) or ship fewer adapters"
        )
    max_rank = _int_arg(serving_args, "max-lora-rank")
    if max_rank is None:
        problems.append(
            "serving.args: a release with adapters needs max-lora-rank (the highest rank "
            "the engine loads)"
        )
    else:
        for i, a in enumerate(adapters):
            if a.rank > max_rank:
                problems.append(
                    f"adapters[{i}].rank: {a.name} has rank {a.rank}, above serving.args "
                    f"max-lora-rank {max_rank}"
                )
    return problems


def read_rank(folder: Path) -> int | None:
    """The rank an adapter folder's adapter_config.json states (`r`), None if unreadable."""
    try:
        cfg = json.loads((folder / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    r = cfg.get("r") if isinstance(cfg, dict) else None
    return r if isinstance(r, int) and not isinstance(r, bool) else None


def check_files(adapters: Sequence[Adapter], folders: Sequence[Path], base: Path) -> list[str]:
    """`adapters[i]...: problem` for each adapter whose files contradict its declaration: no
    adapter_config.json or weights, another rank than declared, or trained on another base
    than `base` (the model folder served), both weights digests named."""
    problems: list[str] = []
    base_digest: str | None = None
    for i, (a, folder) in enumerate(zip(adapters, folders, strict=True)):
        if not (folder / ADAPTER_CONFIG).is_file():
            problems.append(f"adapters[{i}].path: {a.path} has no {ADAPTER_CONFIG}")
            continue
        if not any((folder / w).is_file() for w in ADAPTER_WEIGHTS):
            problems.append(
                f"adapters[{i}].path: {a.path} has no adapter weights "
                f"({' or '.join(ADAPTER_WEIGHTS)})"
            )
            continue
        rank = read_rank(folder)
        if rank is None:
            problems.append(
                f"adapters[{i}].path: {a.path}/{ADAPTER_CONFIG} states no integer rank `r`"
            )
        elif rank != a.rank:
            problems.append(
                f"adapters[{i}].rank: {a.name} is declared rank {a.rank}, its "
                f"{ADAPTER_CONFIG} says {rank}"
            )
        if base_digest is None:
            base_digest = weights_digest(base)
        if a.base != base_digest:
            problems.append(
                f"adapters[{i}].base: {a.name} was trained on base weights {a.base}, but "
                f"model.source has weights {base_digest}: train it on this base, or serve "
                "it on the base it was trained on"
            )
    return problems


def adapter_inputs(adapters: Sequence[Adapter], folders: Sequence[Path]) -> dict[str, str]:
    """The lock's inputs for the adapters: `adapter/<name>/<file>` (each file's sha256) and
    `adapter/<name>` (its declared rank and base)."""
    out: dict[str, str] = {}
    for a, folder in zip(adapters, folders, strict=True):
        for f in adapter_files(folder):
            out[f"adapter/{a.name}/{f.relative_to(folder).as_posix()}"] = sha256_file(f)
        out[f"adapter/{a.name}"] = digest_obj({"rank": a.rank, "base": a.base})
    return out


def adapter_digest(inputs: Mapping[str, str], name: str) -> str | None:
    """The digest of one adapter in a lock's inputs (its files' digests and its
    declaration), None when the lock pins no adapter `name`."""
    parts = {
        k: v
        for k, v in inputs.items()
        if k == f"adapter/{name}" or k.startswith(f"adapter/{name}/")
    }
    if f"adapter/{name}" not in parts:
        return None
    return digest_obj(dict(sorted(parts.items())))


def adapters_of(inputs: Mapping[str, str]) -> dict[str, dict[str, str]]:
    """A lock's adapters, from its inputs: name -> {"digest": the digest of its files and
    declaration}, for `show` and `diff`."""
    names = sorted(
        k.split("/", 1)[1] for k in inputs if k.startswith("adapter/") and k.count("/") == 1
    )
    return {name: {"digest": str(adapter_digest(inputs, name))} for name in names}
