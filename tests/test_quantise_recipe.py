"""The quantisation recipe's weight fields (strategy, symmetric, group_size): in the release id
only when set (committed release ids stay as they are), checked against the model folder, the
calibration set and compressed-tensors' own argument model, each problem one line naming its
field. No quantisation runs here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from releasekit.errors import ManifestError
from releasekit.spec.lock import build_lock, quantisation_recipe
from releasekit.spec.manifest import Quantisation, load_manifest
from releasekit.spec.quantrecipe import (
    check_calibration,
    check_group_size,
    check_manifest_recipe,
    check_weight_args,
    linear_in_features,
    weight_args,
)

REPO = Path(__file__).resolve().parents[1]
MANIFESTS = sorted((REPO / "manifests").glob("*.yaml"))
W4A16_PRESET = {
    "num_bits": 4,
    "type": "int",
    "symmetric": True,
    "strategy": "group",
    "group_size": 128,
    "dynamic": False,
}


def _w4a16(tmp_path: Path, name: str = "m.yaml", **quant: Any) -> Path:
    """demo-w4a16's manifest with `quant` laid over its quantisation, written to tmp_path
    (its relative paths resolve against the repository)."""
    data = yaml.safe_load((REPO / "manifests" / "demo-w4a16.yaml").read_text())
    data["quantisation"].update(quant)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.stem)
def test_manifests_without_recipe_fields_keep_their_committed_release_ids(path: Path) -> None:
    """No committed manifest sets a weight field: its recipe dict has none of them and its
    release id is the one in its committed lock."""
    lm = load_manifest(path, root=REPO)
    assert not {"strategy", "symmetric", "group_size"} & set(quantisation_recipe(lm.manifest))
    committed = json.loads(path.with_name(path.stem + ".lock.json").read_text())
    lk = build_lock(lm)
    assert lk.inputs["quantisation/recipe"] == committed["inputs"]["quantisation/recipe"]
    assert lk.release_id == committed["release_id"]


def test_each_recipe_field_changes_the_release_id(tmp_path: Path) -> None:
    """Every weight field is in the recipe the release id digests; nothing else moves."""
    base = build_lock(load_manifest(_w4a16(tmp_path), root=REPO))
    ids = {base.release_id}
    for i, quant in enumerate(
        ({"group_size": 64}, {"strategy": "channel"}, {"symmetric": False}, {"group_size": 32})
    ):
        lk = build_lock(load_manifest(_w4a16(tmp_path, f"m{i}.yaml", **quant), root=REPO))
        changed = {k for k in lk.inputs if lk.inputs[k] != base.inputs[k]}
        assert changed == {"quantisation/recipe"}, quant
        ids.add(lk.release_id)
    assert len(ids) == 5


def test_weight_args_lay_the_fields_over_the_preset() -> None:
    """channel drops the groups; group_size (or strategy group) keeps group scales."""
    assert weight_args(W4A16_PRESET, {}) == W4A16_PRESET
    assert weight_args(W4A16_PRESET, {"strategy": "group"}) == W4A16_PRESET
    assert weight_args(W4A16_PRESET, {"group_size": 64})["group_size"] == 64
    channel = weight_args(W4A16_PRESET, {"strategy": "channel", "symmetric": False})
    assert (channel["strategy"], channel["group_size"], channel["symmetric"]) == (
        "channel",
        None,
        False,
    )


@pytest.mark.parametrize(
    ("quant", "field", "says"),
    [
        ({"group_size": 64, "strategy": "channel"}, "group_size", "per-channel scales have no"),
        ({"scheme": "W8A8", "group_size": 64}, "group_size", "W8A8 takes per-channel"),
        ({"scheme": "W8A8", "strategy": "group"}, "strategy", "W8A8 takes per-channel"),
        ({"scheme": "W8A8", "symmetric": False}, "symmetric", "W8A8 takes symmetric"),
        (
            {"scheme": "FP8_DYNAMIC", "method": "rtn", "group_size": 64},
            "group_size",
            "applies to the int schemes W4A16 and W8A8 only",
        ),
        ({"group_size": 0}, "group_size", "greater than or equal to 1"),
        ({"strategy": "block"}, "strategy", "'group' or 'channel'"),
    ],
)
def test_bad_recipe_fields_are_one_line_naming_the_field(
    tmp_path: Path, quant: dict[str, Any], field: str, says: str
) -> None:
    with pytest.raises(ManifestError) as info:
        load_manifest(_w4a16(tmp_path, **quant), root=REPO)
    assert len(info.value.problems) == 1
    (line,) = info.value.problems
    assert line.startswith(f"quantisation.{field}: "), line
    assert says in line and "\n" not in line


def test_group_size_must_divide_the_models_in_features(tmp_path: Path) -> None:
    """The demo model's Linear layers take 128 (hidden, attention output) and 256 (MLP
    down) inputs: 64 divides them, 96 does not, and the line names the sizes."""
    model = REPO / "models" / "demo-base"
    if not (model / "config.json").is_file():
        pytest.skip("demo model not present")
    assert linear_in_features(model) == {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_attention_heads x head_dim": 128,
    }
    assert check_group_size(Quantisation(scheme="W4A16", method="rtn", group_size=64), model) == []
    (line,) = check_manifest_recipe(load_manifest(_w4a16(tmp_path, group_size=96), root=REPO))
    assert line.startswith("quantisation.group_size: 96 does not divide the in-features")
    assert "hidden_size 128" in line and "intermediate_size 256" in line


def test_validate_reports_a_group_size_that_does_not_divide(
    project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`releasekit validate` refuses it with the manifest's other problems (the engine and
    host checks, which import vLLM, are not what this test is about)."""
    from releasekit.spec import validate as validate_mod
    from releasekit.spec.engine_args import ServingArgCheck
    from releasekit.spec.hostcaps import SchemeCheck

    if not (REPO / "models" / "demo-base" / "config.json").is_file():
        pytest.skip("demo model not present")
    monkeypatch.setattr(validate_mod, "check_serving_args", lambda lm, settings: ServingArgCheck())
    monkeypatch.setattr(validate_mod, "check_scheme", lambda lm, python: SchemeCheck())
    res = validate_mod.validate_one(_w4a16(project / "manifests", group_size=96))
    assert not res.ok
    assert [p.split(":")[0] for p in res.problems] == ["quantisation.group_size"]


def test_an_empty_calibration_set_is_refused(tmp_path: Path) -> None:
    """A calibration file with no samples is a problem; one with fewer samples than asked is
    not (all of it is used, and quantise.json records how many)."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    q = Quantisation.model_validate(
        {"scheme": "W4A16", "calibration": {"dataset": str(empty), "samples": 8}}
    )
    (line,) = check_calibration(q, empty)
    assert line == f"quantisation.calibration.dataset: {empty} has no samples"
    few = tmp_path / "few.jsonl"
    few.write_text('{"text": "a"}\n')
    assert check_calibration(q, few) == []
    rtn = Quantisation.model_validate(
        {"scheme": "W4A16", "method": "rtn", "calibration": {"dataset": str(empty)}}
    )
    assert check_calibration(rtn, empty) == []  # round-to-nearest reads no data


def test_compressed_tensors_refusal_is_one_line() -> None:
    """The weight arguments go through compressed-tensors' own QuantizationArgs: what it
    refuses comes back as one line (a recipe the manifest's own checks let through is
    built here directly)."""
    pytest.importorskip("compressed_tensors")
    ok = Quantisation(scheme="W4A16", method="rtn", group_size=32, symmetric=False)
    assert check_weight_args(ok) == []
    assert check_weight_args(Quantisation(scheme="W4A16", method="rtn")) == []  # the preset
    bad = Quantisation.model_construct(
        scheme="W8A8", method="rtn", strategy="group", symmetric=None, group_size=None
    )
    (line,) = check_weight_args(bad)
    assert line.startswith("quantisation: compressed-tensors refuses the weight recipe")
    assert "group_size" in line and "\n" not in line


def test_lock_refuses_a_group_size_that_does_not_divide_and_writes_nothing(project: Path) -> None:
    """`releasekit lock` (and so build) refuses the recipe before any lock file is written."""
    from releasekit.errors import ManifestError
    from releasekit.spec.lock import lock, lock_path_for

    path = _w4a16(project / "manifests", group_size=96)
    with pytest.raises(ManifestError) as exc:
        lock(path, root=project)
    assert "quantisation.group_size: 96 does not divide" in str(exc.value)
    assert not lock_path_for(path).exists()
