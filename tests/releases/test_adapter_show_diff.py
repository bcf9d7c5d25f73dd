"""`show` and `diff` of releases with LoRA adapters: name, rank, digest and base of each, and
an adapter added, removed or changed between two releases."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from typer.testing import CliRunner

from releasekit.cli import app
from releasekit.releases.queries import diff, show
from releasekit.spec.adapters import adapters_of, weights_digest
from releasekit.stores.ledger import Ledger

if TYPE_CHECKING:
    from tests.releases.conftest import Proj

runner = CliRunner()


def _adapter(folder: Path, *, rank: int, weights: bytes) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 16}))
    (folder / "adapter_model.safetensors").write_bytes(weights)


def _with_adapter(p: Proj, name: str, *, folder: str, rank: int) -> None:
    """demo-bf16 as `name`, serving adapter `json-ad` (the folder `folder`) on its base."""
    data: dict[str, Any] = yaml.safe_load(p.manifest("demo-bf16").read_text())
    data["name"] = name
    base = weights_digest(p.root / "models" / "demo-base")
    data["adapters"] = [{"name": "json-ad", "path": folder, "rank": rank, "base": base}]
    data["serving"]["args"].update({"enable-lora": True, "max-loras": 2, "max-lora-rank": 16})
    p.manifest(name).write_text(yaml.safe_dump(data, sort_keys=False))


def test_show_and_diff_name_each_adapter_and_what_changed(proj: Proj) -> None:
    Ledger(proj.settings.ledger_url or "").close()  # show and diff read the ledger
    _adapter(proj.root / "adapters" / "v1", rank=8, weights=b"v1")
    _adapter(proj.root / "adapters" / "v2", rank=16, weights=b"v2")
    _with_adapter(proj, "demo-ad1", folder="adapters/v1", rank=8)
    _with_adapter(proj, "demo-ad2", folder="adapters/v2", rank=16)
    plain, one, two = proj.build("demo-bf16"), proj.build("demo-ad1"), proj.build("demo-ad2")

    d = show(proj.settings, one.release_id)
    (a,) = d.adapters
    assert (a.name, a.rank, a.path) == ("json-ad", 8, "adapters/v1")
    assert a.digest == adapters_of(one.inputs)["json-ad"]["digest"]
    assert a.base == weights_digest(proj.root / "models" / "demo-base")
    assert show(proj.settings, plain.release_id).adapters == []

    added = diff(proj.settings, plain.release_id, one.release_id)
    assert [(c.name, c.change) for c in added.adapters] == [("json-ad", "added")]
    assert not any(c.key.startswith("adapter/") for c in added.inputs)  # shown once, above
    removed = diff(proj.settings, one.release_id, plain.release_id)
    assert [(c.name, c.change) for c in removed.adapters] == [("json-ad", "removed")]
    changed = diff(proj.settings, one.release_id, two.release_id)
    (c,) = changed.adapters
    assert c.change == "changed" and c.a and c.b
    assert (c.a.rank, c.b.rank) == (8, 16) and c.a.digest != c.b.digest
    assert diff(proj.settings, one.release_id, one.release_id).adapters == []

    res = runner.invoke(app, ["show", one.release_id])
    assert res.exit_code == 0, res.output
    assert "adapters" in res.stdout and "json-ad" in res.stdout
    assert a.digest is not None and a.digest[:12] in res.stdout and a.base[:12] in res.stdout
    assert "adapter/json-ad/" not in res.stdout  # its files are summed up by its digest
    res = runner.invoke(app, ["diff", one.release_id, two.release_id])
    assert res.exit_code == 0, res.output
    row = next(line for line in res.stdout.splitlines() if "json-ad" in line)
    da, db = c.a.digest or "", c.b.digest or ""
    assert "changed" in row and f"r8 {da[:12]}" in row and f"r16 {db[:12]}" in row
