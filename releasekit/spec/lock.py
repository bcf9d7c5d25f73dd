"""Locks and digests: resolve every manifest input to a sha256; release id = digest of them."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from releasekit._support.digests import digest_obj, sha256_bytes, sha256_file
from releasekit._support.files import write_atomic
from releasekit.errors import InputMissingError, LockError, LockMismatchError, ManifestError
from releasekit.spec.adapters import adapter_inputs
from releasekit.spec.adapters import check_files as check_adapter_files
from releasekit.spec.loadprofile import load_profile
from releasekit.spec.manifest import (
    WEIGHT_RECIPE_FIELDS,
    LoadedManifest,
    Manifest,
    check_files,
    load_manifest,
)
from releasekit.spec.prompts import placeholders, read_template, render
from releasekit.spec.provenance import Provenance, read_provenance

LOCK_VERSION = 1
SHORT = 12


def model_files(folder: Path) -> list[Path]:
    """Every file of a model folder (weights, tokenizer, config), hidden ones excluded."""
    return sorted(
        p
        for p in folder.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )


def chat_template_of(folder: Path) -> str | None:
    """The model's chat template text: chat_template.jinja, else tokenizer_config.json's."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    cfg = folder / "tokenizer_config.json"
    if cfg.is_file():
        tpl = json.loads(cfg.read_text(encoding="utf-8")).get("chat_template")
        return tpl if isinstance(tpl, str) else None
    return None


def serving_args(m: Manifest) -> dict[str, str]:
    """Canonical engine arguments: dashed names, stringified values, plus the ones releasekit
    owns (dtype, served name, quantised KV cache)."""
    args: dict[str, str] = {}
    for k, v in m.serving.args.items():
        args[k.replace("_", "-")] = "" if v is None or v is True else str(v)
        if v is False:
            args.pop(k.replace("_", "-"))
    args["dtype"] = m.model.dtype
    args["served-model-name"] = m.served_name
    if m.quantisation.kv_cache_dtype != "auto":
        args["kv-cache-dtype"] = m.quantisation.kv_cache_dtype
    return dict(sorted(args.items()))


def quantisation_recipe(m: Manifest) -> dict[str, Any]:
    """The recipe that drives llm-compressor, without file paths (their bytes are inputs).

    The weight recipe fields (strategy, symmetric, group_size) appear only when set: a
    manifest that leaves them to the scheme's preset keeps the recipe, and the release id,
    it had before they existed."""
    q = m.quantisation.model_dump(mode="json")
    for key in WEIGHT_RECIPE_FIELDS:
        if q.get(key) is None:
            q.pop(key, None)
    if q.get("calibration"):
        q["calibration"].pop("dataset", None)
    return q


class Lock(BaseModel):
    """A lock file: every input's digest, the release id and (unhashed) provenance."""

    lock_version: int = LOCK_VERSION
    name: str
    manifest: str = Field(description="manifest path relative to the project root")
    manifest_digest: str = Field(description="sha256 of the manifest file bytes (not in the id)")
    release_id: str
    inputs: dict[str, str]
    provenance: Provenance
    locked_at: str

    @property
    def short_id(self) -> str:
        """The first 12 hex digits, for display."""
        return self.release_id[:SHORT]


def compute_inputs(lm: LoadedManifest) -> dict[str, str]:
    """Digest every input of a manifest. Raise InputMissingError / ManifestError if any is
    missing, before anything is written."""
    missing = check_files(lm)
    if missing:
        raise ManifestError(lm.path, missing)
    from releasekit.spec.quantrecipe import check_manifest_recipe

    bad_recipe = check_manifest_recipe(lm)  # group size vs the model, an empty calibration set
    if bad_recipe:
        raise ManifestError(lm.path, bad_recipe)
    m = lm.manifest
    inputs: dict[str, str] = {}
    src = lm.resolve(m.model.source)
    files = model_files(src)
    if not files:
        raise InputMissingError(src, what="model weights (empty folder)")
    for f in files:
        inputs[f"model/{f.relative_to(src).as_posix()}"] = sha256_file(f)
    if m.adapters:
        folders = [lm.resolve(a.path) for a in m.adapters]
        bad_adapters = check_adapter_files(m.adapters, folders, src)
        if bad_adapters:
            raise ManifestError(lm.path, bad_adapters)
        inputs.update(adapter_inputs(m.adapters, folders))
    tpl = chat_template_of(src)
    if tpl is not None:
        inputs["chat_template"] = sha256_bytes(tpl.encode())
    texts = rendered_prompts(lm)
    for role, text in texts.items():
        inputs[f"prompt/{role}"] = sha256_bytes(text.encode())
    if m.prompts.plain_chat != "as_sent":
        bad_chat = plain_chat_problems(texts)
        if bad_chat:
            raise ManifestError(lm.path, bad_chat)
        # Only where it is not the default, so releases locked before the field keep their id.
        inputs["prompt/plain_chat"] = digest_obj({"plain_chat": m.prompts.plain_chat})
    inputs["quantisation/recipe"] = digest_obj(quantisation_recipe(m))
    if m.quantisation.calibration:
        inputs["quantisation/calibration"] = sha256_file(
            lm.resolve(m.quantisation.calibration.dataset)
        )
    inputs["serving"] = digest_obj(
        {"args": serving_args(m), "env": dict(sorted(m.serving.env.items()))}
    )
    for s in m.eval.suites:
        inputs[f"eval/{s.name}"] = digest_obj(
            {
                "file": sha256_file(lm.resolve(s.path)),
                "suite": s.locked_fields(),
            }
        )
    eval_cfg = m.eval.model_dump(mode="json", exclude={"suites", "judge", "baseline"})
    inputs["eval/config"] = digest_obj(eval_cfg)
    if m.eval.judge:
        j = m.eval.judge
        inputs["eval/judge"] = digest_obj(
            {
                "prompt": sha256_file(lm.resolve(j.prompt)),
                "judge": j.model_dump(mode="json", exclude={"prompt"}),
            }
        )
    profile_path = lm.resolve(m.load.profile)
    load_profile(profile_path)  # validate before pinning
    inputs["load/profile"] = sha256_file(profile_path)
    inputs["identity"] = digest_obj({"name": m.name, "dtype": m.model.dtype})
    return dict(sorted(inputs.items()))


def rendered_prompts(lm: LoadedManifest) -> dict[str, str]:
    """The manifest's prompt texts by role (system first), its variables bound."""
    out = {}
    for role in ("system", "user"):
        pf = getattr(lm.manifest.prompts, role)
        if pf is not None:
            out[role] = render(read_template(lm.resolve(pf.file)), pf.variables)
    return out


def plain_chat_problems(prompts: dict[str, str]) -> list[str]:
    """Why the rendered `prompts` (role -> text, manifest variables bound) cannot take a
    plain chat request's message (`prompts.plain_chat: template`): the user template must
    leave exactly one placeholder for it, the system prompt none."""
    problems = []
    free = sorted(placeholders(prompts.get("user", "")))
    if len(free) != 1:
        problems.append(
            "prompts.plain_chat: 'template' fills the user template's one placeholder with "
            f"the client's message; it has {len(free)} ({', '.join(free) or 'none'}): bind "
            "the others in prompts.user.variables"
        )
    left = sorted(placeholders(prompts.get("system", "")))
    if left:
        problems.append(
            "prompts.plain_chat: 'template' puts the system prompt before a plain chat "
            f"request, which has no variables for {', '.join(left)}: bind them in "
            "prompts.system.variables"
        )
    return problems


def release_id_of(inputs: dict[str, str]) -> str:
    """The release id: sha256 of the canonical inputs."""
    return digest_obj(inputs)


def lock_path_for(manifest_path: Path) -> Path:
    """`manifests/x.yaml` -> `manifests/x.lock.json`."""
    return manifest_path.with_name(manifest_path.stem + ".lock.json")


def _rel(p: Path, base: Path) -> str:
    try:
        return p.resolve().relative_to(base).as_posix()
    except ValueError:
        return p.resolve().as_posix()


def build_lock(lm: LoadedManifest) -> Lock:
    """Compute (without writing) the lock of a loaded manifest."""
    inputs = compute_inputs(lm)
    return Lock(
        name=lm.manifest.name,
        manifest=_rel(lm.path, lm.base),
        manifest_digest=sha256_file(lm.path),
        release_id=release_id_of(inputs),
        inputs=inputs,
        provenance=read_provenance(lm.base),
        locked_at=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    )


def read_lock(path: Path) -> Lock:
    """Read a lock file; LockError if missing or unreadable."""
    if not path.is_file():
        raise LockError(f"no lock file at {path}")
    try:
        return Lock.model_validate_json(path.read_bytes())
    except ValueError as exc:
        raise LockError(f"unreadable lock file {path}: {exc}") from exc


def lock(manifest_path: Path | str, *, root: Path | None = None) -> Lock:
    """Lock a manifest: compute every digest and write the lock file next to it.

    If the inputs match the existing lock, the existing file (and its provenance and
    time) is kept, so locking twice is a no-op.
    """
    lm = load_manifest(manifest_path, root=root)
    new = build_lock(lm)
    path = lock_path_for(lm.path)
    if path.is_file():
        try:
            old = read_lock(path)
        except LockError:
            old = None
        if (
            old is not None
            and old.release_id == new.release_id
            and old.manifest_digest == new.manifest_digest
        ):
            return old
    write_atomic(path, (new.model_dump_json(indent=2) + "\n").encode())
    return new


class LockCheck(BaseModel):
    """Result of comparing a lock with the current inputs."""

    manifest: str
    release_id: str
    current_release_id: str
    changed: list[str]
    added: list[str]
    removed: list[str]

    @property
    def ok(self) -> bool:
        """True when nothing changed since the lock."""
        return not (self.changed or self.added or self.removed)


def check(manifest_path: Path | str, *, root: Path | None = None) -> LockCheck:
    """Compare the lock with the current inputs; raise LockMismatchError naming each change."""
    lm = load_manifest(manifest_path, root=root)
    old = read_lock(lock_path_for(lm.path))
    cur = compute_inputs(lm)
    result = LockCheck(
        manifest=str(manifest_path),
        release_id=old.release_id,
        current_release_id=release_id_of(cur),
        changed=sorted(k for k in cur if k in old.inputs and cur[k] != old.inputs[k]),
        added=sorted(k for k in cur if k not in old.inputs),
        removed=sorted(k for k in old.inputs if k not in cur),
    )
    if not result.ok:
        names = (
            result.changed
            + [f"{k} (added)" for k in result.added]
            + [f"{k} (removed)" for k in result.removed]
        )
        raise LockMismatchError(lm.path, names)
    return result


def locked_release(
    manifest_path: Path | str, *, root: Path | None = None
) -> tuple[LoadedManifest, Lock]:
    """Load a manifest and its lock, locking first if needed or if inputs changed."""
    lm = load_manifest(manifest_path, root=root)
    return lm, lock(lm.path, root=root)


_SERVING_INPUTS = ("model/", "quantisation/")


def serving_key(lock: Lock) -> str:
    """Digest of what a server of this release runs: model bytes, chat template,
    quantisation recipe and calibration, engine args and environment. Two releases with the
    same key (e.g. differing only in prompts) can share one vLLM server."""
    picked = {
        k: v
        for k, v in lock.inputs.items()
        if k.startswith(_SERVING_INPUTS) or k in ("chat_template", "serving")
    }
    return digest_obj(picked)
