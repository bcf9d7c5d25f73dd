"""The quantisation ladder file: a base (unquantised) manifest's recipes to try, in order,
from the most faithful down, and how a rung's manifest is derived from the base.

    # manifests/ladder/demo.yaml
    apiVersion: releasekit/v1
    kind: QuantisationLadder
    unit_cost_per_hour: 1.0        # price of one serving unit-hour (for cost per good answer)
    rungs:
      - {name: demo-w8a8, manifest: manifests/demo-w8a8.yaml}     # an existing manifest
      - name: demo-w4a16-rtn-head                                  # a recipe: derived manifest
        quantisation: {scheme: W4A16, method: rtn, ignore: []}

A rung that names `quantisation` gets a manifest derived from the base (the base with that
quantisation block, its own name and the base as its eval baseline), written next to the
ladder file under `<ladder stem>/<name>.yaml`: a manifest like any other, to lock, build,
promote and commit. A rung that names `manifest` uses that file, which may differ from the
base only in its recipe (checked against the two locks).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from releasekit.errors import ManifestError
from releasekit.spec.manifest import Quantisation

_NAME = r"^[a-z0-9][a-z0-9._-]{0,62}$"

#: Lock inputs a rung may differ from its base in: the recipe, its calibration data and the
#: name (`identity`). Everything else (weights, prompts, serving, suites, load) must match.
RECIPE_INPUTS = ("quantisation/recipe", "quantisation/calibration", "identity")


class Rung(BaseModel):
    """One recipe on the ladder: an existing manifest, or a quantisation block to derive one."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=_NAME, description="the rung's manifest name")
    description: str | None = None
    manifest: Path | None = Field(None, description="an existing manifest for this rung")
    quantisation: Quantisation | None = Field(
        None, description="the recipe; the rung's manifest is derived from the base"
    )

    @model_validator(mode="after")
    def _one_source(self) -> Rung:
        if (self.manifest is None) == (self.quantisation is None):
            raise ValueError("give either `manifest` or `quantisation`, not both or neither")
        if self.quantisation is not None and self.quantisation.scheme == "none":
            raise ValueError("a rung quantises: scheme none is the base itself")
        return self


class Ladder(BaseModel):
    """The ladder file (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    apiVersion: Literal["releasekit/v1"] = "releasekit/v1"
    kind: Literal["QuantisationLadder"] = "QuantisationLadder"
    description: str | None = None
    unit_cost_per_hour: float | None = Field(
        None,
        ge=0,
        description="price of one serving unit-hour (the host the knees were measured on); "
        "without it rungs are compared by the memory their weights take",
    )
    cost_tolerance: float = Field(
        0.25,
        ge=0,
        lt=1,
        description="costs closer than this share count as equal (a knee's goodput spreads "
        "about this much between runs on shared cores); the smaller weights then win",
    )
    rungs: list[Rung] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> Ladder:
        names = [r.name for r in self.rungs]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"rung names must be unique: {', '.join(dupes)} repeated")
        return self


def load_ladder(path: Path) -> Ladder:
    """Read and validate a ladder file; ManifestError naming the file and field."""
    if not path.is_file():
        raise ManifestError(path, ["file not found"], remedy="check the --recipes path")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ManifestError(path, [f"not valid YAML ({exc})"]) from exc
    if not isinstance(data, dict):
        raise ManifestError(path, ["expected a mapping with `rungs:`"])
    try:
        return Ladder.model_validate(data)
    except ValidationError as exc:
        problems = [
            f"{'.'.join(str(p) for p in e['loc']) or '(top level)'}: "
            + str(e["msg"]).removeprefix("Value error, ")
            for e in exc.errors()
        ]
        raise ManifestError(path, problems) from exc


def rung_manifest_path(ladder_path: Path, rung: Rung) -> Path:
    """Where a rung's manifest is: its `manifest`, or the derived file beside the ladder."""
    if rung.manifest is not None:
        return rung.manifest
    return ladder_path.parent / ladder_path.stem / f"{rung.name}.yaml"


def derive_manifest(
    base_data: dict[str, Any], rung: Rung, *, base_path: str, ladder_path: str
) -> str:
    """The YAML text of a rung's manifest: the base's data with the rung's recipe, name and
    description, and the base as its eval baseline. Deterministic: the same inputs give the
    same bytes (so a rebuilt ladder leaves its files, and their release ids, unchanged)."""
    if rung.quantisation is None:
        raise ValueError(f"rung {rung.name} names a manifest; nothing to derive")
    data = dict(base_data)
    data["name"] = rung.name
    data["description"] = rung.description or (
        f"{base_data.get('name')} quantised: {recipe_label(rung.quantisation)}"
    )
    data["quantisation"] = rung.quantisation.model_dump(
        mode="json", exclude_none=True, exclude_defaults=True
    ) or {"scheme": rung.quantisation.scheme}
    data["quantisation"]["scheme"] = rung.quantisation.scheme
    ev = dict(data.get("eval") or {})
    ev["baseline"] = base_path
    data["eval"] = ev
    header = (
        f"# Derived by `releasekit quantise ladder` from {base_path} and the rung "
        f"{rung.name} of {ladder_path}.\n# Edit the ladder file, not this one.\n"
    )
    return header + yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=100)


def recipe_label(q: Quantisation) -> str:
    """A recipe in a few words: `W4A16 gptq g128 sym, lm_head kept, 256 calibration rows`."""
    if q.scheme == "none":
        return "unquantised"
    parts: list[str] = [q.scheme, q.method]
    group = getattr(q, "group_size", None)
    strategy = getattr(q, "strategy", None)
    symmetric = getattr(q, "symmetric", None)
    if strategy == "channel":
        parts.append("per-channel")
    elif group:
        parts.append(f"g{group}")
    if symmetric is not None:
        parts.append("sym" if symmetric else "asym")
    kept = ", ".join(q.ignore) if q.ignore else "nothing"
    text = " ".join(parts) + f", keeps {kept} unquantised"
    if q.calibration is not None and q.method == "gptq":
        text += f", {q.calibration.samples} rows of {q.calibration.dataset.name}"
    return text
