"""LoRA adapters in a manifest: digested into the lock and the release id, tied to the base
they were trained on, and held to the engine arguments that must carry them."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from releasekit.cli import app
from releasekit.errors import ManifestError
from releasekit.spec import lock as lockmod
from releasekit.spec.adapters import adapters_of, weights_digest
from releasekit.spec.manifest import load_manifest

runner = CliRunner()
LORA_ARGS = {"enable-lora": True, "max-loras": 2, "max-lora-rank": 8}


def _adapter(folder: Path, *, rank: int = 8, weights: bytes = b"\1" * 64) -> Path:
    """An adapter folder as peft writes one: adapter_config.json (its rank `r`) and weights."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(
        json.dumps({"r": rank, "lora_alpha": 16, "peft_type": "LORA"})
    )
    (folder / "adapter_model.safetensors").write_bytes(weights)
    return folder


@pytest.fixture
def proj(project: Path, stand_in_model: Callable[[Path], Path]) -> Path:
    stand_in_model(project)
    _adapter(project / "models" / "adapters" / "a")
    _adapter(project / "models" / "adapters" / "b", weights=b"\2" * 64)
    return project


def _manifest(
    proj: Path, adapters: list[dict], *, args: dict | None = None, **extra: object
) -> Path:
    data = yaml.safe_load((proj / "manifests" / "demo-bf16.yaml").read_text())
    data["name"] = "demo-lora"
    data["serving"]["args"].update(LORA_ARGS if args is None else args)
    data["adapters"] = adapters
    data.update(extra)
    path = proj / "manifests" / "demo-lora.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _entry(proj: Path, name: str = "tutor", folder: str = "a", **over: object) -> dict:
    base = weights_digest(proj / "models" / "demo-base")
    return {"name": name, "path": f"models/adapters/{folder}", "rank": 8, "base": base, **over}


def test_adapter_files_and_declaration_are_in_the_release_id(proj: Path) -> None:
    path = _manifest(proj, [_entry(proj)])
    first = lockmod.build_lock(load_manifest(path, root=proj))
    assert "adapter/tutor/adapter_model.safetensors" in first.inputs
    assert "adapter/tutor" in first.inputs
    assert list(adapters_of(first.inputs)) == ["tutor"]
    (proj / "models" / "adapters" / "a" / "adapter_model.safetensors").write_bytes(b"\3" * 64)
    second = lockmod.build_lock(load_manifest(path, root=proj))
    assert second.release_id != first.release_id
    assert adapters_of(second.inputs)["tutor"] != adapters_of(first.inputs)["tutor"]


def test_a_manifest_without_adapters_keeps_its_release_id(proj: Path) -> None:
    """Adapters, and a suite's `adapter` field, add nothing to a release that has none: every
    committed id stays what it was."""
    lk = lockmod.build_lock(load_manifest(proj / "manifests" / "demo-bf16.yaml", root=proj))
    assert not any(k.startswith("adapter") for k in lk.inputs)
    data = yaml.safe_load((proj / "manifests" / "demo-bf16.yaml").read_text())
    assert "adapter" not in json.dumps(
        [
            s
            for s in load_manifest(proj / "manifests" / "demo-bf16.yaml", root=proj)
            .manifest.eval.suites[0]
            .locked_fields()
        ]
    )
    assert data.get("adapters") is None


def test_an_adapter_trained_on_another_base_is_refused_naming_both_digests(proj: Path) -> None:
    other = "0" * 64
    path = _manifest(proj, [_entry(proj, base=other)])
    with pytest.raises(ManifestError) as info:
        lockmod.build_lock(load_manifest(path, root=proj))
    served = weights_digest(proj / "models" / "demo-base")
    (problem,) = info.value.problems
    assert other in problem and served in problem and problem.startswith("adapters[0].base")
    assert not (proj / "manifests" / "demo-lora.lock.json").exists()


def test_a_rank_that_is_not_the_files_rank_is_refused(proj: Path) -> None:
    _adapter(proj / "models" / "adapters" / "r4", rank=4)
    path = _manifest(proj, [_entry(proj, folder="r4")])
    with pytest.raises(ManifestError) as info:
        lockmod.build_lock(load_manifest(path, root=proj))
    assert "declared rank 8, its adapter_config.json says 4" in str(info.value)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ({"max-loras": 2, "max-lora-rank": 8}, "needs enable-lora: true"),
        ({"enable-lora": True, "max-lora-rank": 8}, "needs max-loras"),
        (
            {"enable-lora": True, "max-loras": 1, "max-lora-rank": 8},
            "more than serving.args max-loras 1",
        ),
        (
            {"enable-lora": True, "max-loras": 2, "max-lora-rank": 4},
            "above serving.args max-lora-rank 4",
        ),
    ],
)
def test_the_engine_arguments_must_carry_the_adapters(proj: Path, args: dict, needle: str) -> None:
    path = _manifest(proj, [_entry(proj), _entry(proj, name="critic", folder="b")], args=args)
    with pytest.raises(ManifestError) as info:
        load_manifest(path, root=proj)
    assert needle in str(info.value)


def test_names_must_be_unique_and_apart_from_the_base(proj: Path) -> None:
    path = _manifest(proj, [_entry(proj, name="demo"), _entry(proj, name="demo", folder="b")])
    with pytest.raises(ManifestError) as info:
        load_manifest(path, root=proj)
    text = str(info.value)
    assert "name 'demo' is used twice" in text
    assert "is the base's served name" in text


def test_a_suite_may_only_name_an_adapter_the_manifest_has(proj: Path) -> None:
    data = yaml.safe_load((proj / "manifests" / "demo-bf16.yaml").read_text())
    suites = data["eval"]["suites"]
    suites[0]["adapter"] = "nobody"
    path = _manifest(proj, [_entry(proj)], eval={**data["eval"], "suites": suites})
    with pytest.raises(ManifestError) as info:
        load_manifest(path, root=proj)
    assert "eval.suites[0].adapter: 'nobody' is not one of adapters[].name" in str(info.value)


def test_a_suite_that_scores_an_adapter_is_pinned_with_it(proj: Path) -> None:
    data = yaml.safe_load((proj / "manifests" / "demo-bf16.yaml").read_text())
    plain = lockmod.build_lock(load_manifest(_manifest(proj, [_entry(proj)]), root=proj))
    suites = data["eval"]["suites"]
    suites[0]["adapter"] = "tutor"
    path = _manifest(proj, [_entry(proj)], eval={**data["eval"], "suites": suites})
    scored = lockmod.build_lock(load_manifest(path, root=proj))
    name = suites[0]["name"]
    assert scored.inputs[f"eval/{name}"] != plain.inputs[f"eval/{name}"]


def test_validate_reports_a_missing_adapter_folder_and_a_base_mismatch(proj: Path) -> None:
    path = _manifest(
        proj, [_entry(proj, folder="gone"), _entry(proj, name="critic", folder="b", base="1" * 64)]
    )
    res = runner.invoke(app, ["validate", str(path)])
    assert res.exit_code != 0
    assert "adapters[0].path: folder not found: models/adapters/gone" in res.output
    path = _manifest(proj, [_entry(proj, name="critic", folder="b", base="1" * 64)])
    res = runner.invoke(app, ["validate", str(path)])
    assert res.exit_code != 0
    assert "adapters[0].base: critic was trained on base weights 1111" in res.output


def test_the_demos_adapter_releases_share_demo_loras_engine() -> None:
    """demo-json and demo-json-bad differ from demo-lora in their adapter alone: one serving
    key (promote reuses the running engine), three release ids; demo-bf16, without LoRA in
    its engine arguments, is another engine."""
    from releasekit.spec.lock import serving_key

    repo = Path(__file__).resolve().parents[1]
    locks = {
        name: lockmod.build_lock(load_manifest(repo / "manifests" / f"{name}.yaml", root=repo))
        for name in (
            "demo-lora",
            "demo-json",
            "demo-json-bad",
            "demo-bf16",
            "demo-xml",
            "demo-json-2",
        )
    }
    keys = {name: serving_key(lk) for name, lk in locks.items()}
    assert keys["demo-lora"] == keys["demo-json"] == keys["demo-json-bad"] == keys["demo-xml"]
    assert keys["demo-json-2"] == keys["demo-lora"] != keys["demo-bf16"]
    assert len({lk.release_id for lk in locks.values()}) == 6
    good, bad = (adapters_of(locks[n].inputs)["demo-json"] for n in ("demo-json", "demo-json-bad"))
    assert good != bad
    for name in ("demo-json", "demo-json-bad", "demo-xml", "demo-json-2"):
        committed = lockmod.read_lock(repo / "manifests" / f"{name}.lock.json")
        assert committed.release_id == locks[name].release_id


def test_a_builds_evidence_stage_depends_on_its_adapters() -> None:
    """DVC reruns the evidence stage when an adapter's files change: the folder is a dep."""
    from releasekit.build.pipeline import plan, stage_defs
    from releasekit.config import load_settings

    repo = Path(__file__).resolve().parents[1]
    settings = load_settings(root=repo)
    defs = stage_defs(settings, plan(settings, repo / "manifests" / "demo-json.yaml"))
    assert "models/adapters/demo-json" in defs["demo-json-evidence"]["deps"]
