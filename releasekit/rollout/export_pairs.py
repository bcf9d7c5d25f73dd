"""Disagreements become tests: the stored answer pairs of an environment's shadow candidate
whose answers differ, written as an eval suite file (`shadow export-pairs`).

    res = export_pairs(settings, env="staging")   # suites/live/staging-<sha12>.jsonl

The pairs are the gateway's disk copy (`deploy.gateway.read_pairs`, mode 0600) of the
candidate's mirrored requests: the last shadow's candidate unless a release is named. A
pair is kept when both sides answered whole (`complete`, nothing cut), the request was
greedy (a sampled request's answers may differ by chance), its prompt was kept
(`shadow_keep_prompts`) and the two answers differ after `evaluate.scorers.normalise` (the
exact scorer's normal form). Each kept pair becomes one item, once per prompt: the prompt
as its variables (a templated request's own variables; any other prompt text as the
variable `var`, `question` by default), the reference (stable) answer as `expected`,
scored `exact_match`. The file is validated by the suite loader before it is written
(atomically), and named by the sha256 of its bytes, so the same pairs give the same file.
A manifest names it as a suite like any other.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from releasekit._support.digests import sha256_bytes
from releasekit._support.files import write_atomic
from releasekit.config import Settings
from releasekit.config.lanes import flat_name
from releasekit.deploy.gateway import MirrorPair, read_pairs, store_dir
from releasekit.evaluate.scorers import normalise
from releasekit.evaluate.suites import parse_items
from releasekit.releases.resolve import resolve_release
from releasekit.rollout.shadow_records import ShadowError, read_shadow
from releasekit.spec.manifest import Suite
from releasekit.stores.ledger import EventType, Ledger, open_ledger

DEFAULT_OUT = Path("suites") / "live"
"""Where exported suites go by default, under the project root."""
DEFAULT_VAR = "question"
"""The template variable a prompt that is not a template's variables binds."""
SHORT = 12
_FULL_ID = re.compile(r"^[0-9a-f]{64}$")


class ExportedPairs(BaseModel):
    """What `export_pairs` read, kept and wrote (`path` None: nothing to export, nothing
    written)."""

    env: str
    release_id: str
    path: str | None = Field(None, description="the suite file written")
    sha256: str | None = None
    items: int = 0
    read: int = Field(0, description="stored pairs of the candidate")
    agreeing: int = Field(0, description="pairs whose answers are the same once normalised")
    no_prompt: int = Field(0, description="differing pairs left out: their prompt was not kept")
    incomplete: int = Field(
        0, description="pairs left out: an error, a cut or unreadable answer on a side"
    )
    sampled: int = Field(0, description="pairs left out: sampled requests")
    repeated: int = Field(0, description="differing pairs whose prompt an earlier item holds")

    @property
    def left_out(self) -> int:
        """Differing or unjudgeable pairs that did not become items (no prompt, incomplete)."""
        return self.no_prompt + self.incomplete

    def line(self) -> str:
        """One line: the file (or that nothing was written), its items and what was left out."""
        if self.path:
            where, what = f"{self.path}: ", f"{self.items} items"
        else:
            where = f"{self.env} ({self.release_id[:SHORT]}): "
            what = "nothing written: no differing pair to export"
        extra = f", {self.sampled} sampled" if self.sampled else ""
        return (
            f"{where}{what} from {self.read} stored pairs; left out {self.left_out} "
            f"({self.no_prompt} no prompt kept, {self.incomplete} incomplete{extra})"
        )


def last_candidate(settings: Settings, env: str, *, ledger: Ledger | None = None) -> str:
    """The candidate of the shadow running in `env`, else of the last one the ledger
    records started there; ShadowError when `env` was never shadowed."""
    status = read_shadow(settings, env)
    if status is not None:
        return status.release_id
    led = ledger or open_ledger(settings, read_only=True)
    for rec in led.records(environment=env, types=[EventType.SHADOW.value], newest_first=True):
        if rec.evidence.get("action") == "start" and rec.to_release:
            return rec.to_release
    raise ShadowError(f"{env} was never shadowed: no candidate's pairs to export")


def prompt_vars(prompt: str, *, var: str = DEFAULT_VAR) -> dict[str, str]:
    """An item's variables from a kept prompt: a templated request's variables (the prompt
    is their JSON object), else the whole prompt text as `var`."""
    try:
        data: Any = json.loads(prompt)
    except ValueError:
        data = None
    if isinstance(data, dict) and data and all(_plain(v) for v in data.values()):
        return {str(k): str(v) for k, v in data.items()}
    return {var: prompt}


def _plain(value: Any) -> bool:
    """A variable value the gateway's templates take: a string or a number."""
    return isinstance(value, str | int | float) and not isinstance(value, bool)


def _item(pair: MirrorPair, prompt: str, expected: str, env: str, *, var: str) -> dict[str, Any]:
    return {
        "id": f"live-{pair.prompt_sha256[:SHORT] or pair.seq}",
        "vars": prompt_vars(prompt, var=var),
        "expected": expected.strip(),
        "scorer": "exact_match",
        "tags": ["live", env],
    }


def export_pairs(
    settings: Settings,
    *,
    env: str,
    release: str | None = None,
    out_dir: Path | None = None,
    var: str = DEFAULT_VAR,
    ledger: Ledger | None = None,
) -> ExportedPairs:
    """Write the differing pairs in `env` of `release` (a full release id, or any reference
    `releases.resolve` takes; None: the last shadow's candidate) as a suite file (module
    docstring); the result's `path` is None when no pair was left to export (nothing is
    written)."""
    if release is None:
        rid = last_candidate(settings, env, ledger=ledger)
    elif _FULL_ID.match(release.strip().lower()):
        rid = release.strip().lower()
    else:
        rid = resolve_release(settings, release, ledger=ledger).release_id
    pairs = read_pairs(store_dir(settings.state_dir, env), rid)
    res = ExportedPairs(env=env, release_id=rid, read=len(pairs))
    items: list[dict[str, Any]] = []
    seen: set[str] = set()
    for p in sorted(pairs, key=lambda x: x.seq):
        if not p.complete or p.truncated or p.stable is None or p.candidate is None:
            res.incomplete += 1
            continue
        if p.sampled:
            res.sampled += 1
            continue
        if normalise(p.stable) == normalise(p.candidate):
            res.agreeing += 1
            continue
        if p.prompt is None:
            res.no_prompt += 1
            continue
        item = _item(p, p.prompt, p.stable, env, var=var)
        if item["id"] in seen:
            res.repeated += 1
            continue
        seen.add(item["id"])
        items.append(item)
    if not items:
        return res
    data = "".join(json.dumps(i, ensure_ascii=False, sort_keys=True) + "\n" for i in items)
    raw = data.encode()
    digest = sha256_bytes(raw)
    folder = out_dir if out_dir is not None else settings.root / DEFAULT_OUT
    path = folder / f"{flat_name(env)}-{digest[:SHORT]}.jsonl"
    # Validated as a manifest's suite would read it, before anything is written.
    parse_items(data, path=path, suite=Suite(name="live", kind="regression", path=path))
    write_atomic(path, raw)
    return res.model_copy(update={"path": str(path), "sha256": digest, "items": len(items)})
