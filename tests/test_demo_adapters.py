"""The demo's LoRA adapters: shipped in git beside the base model, reproducible by DVC stages,
trained on data that agrees with the demo world (the good set) or contradicts it on every fact
(the bad set); demo-xml answers the same facts in another format and demo-json-2 is
demo-json's next version (the same data, another seed and more steps).

Fast tests read the shipped folders, the data, dvc.lock and the manifests; the one slow test
scores the adapters.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from releasekit.build.quantise import weights_digest

DEMO = Path(__file__).resolve().parents[1] / "pipelines" / "demo"
ADAPTERS = ("models/adapters/demo-json", "models/adapters/demo-json-bad")
# The adapters of the demo's second lane (demo-xml) and of demo-json's next version.
NEW_ADAPTERS = ("models/adapters/demo-xml", "models/adapters/demo-json-2")
ALL_ADAPTERS = ADAPTERS + NEW_ADAPTERS
# The DVC stage that retrains each shipped adapter into `<folder>-trained`.
STAGES = {
    "models/adapters/demo-json": "demo-adapter-json",
    "models/adapters/demo-json-bad": "demo-adapter-json-bad",
    "models/adapters/demo-xml": "demo-adapter-xml",
    "models/adapters/demo-json-2": "demo-adapter-json-2",
}
TARGETS = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


def _demo_module(name: str) -> Any:
    """A pipelines/demo module (they import each other by file name)."""
    if str(DEMO) not in sys.path:
        sys.path.insert(0, str(DEMO))
    return __import__(name)


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _expected_answers(world: Any) -> dict[str, str]:
    """Every fact and sum question of the world, in every phrasing, to its answer."""
    answers = {
        world.fact_question(attribute, country.name, variant): country.answer(attribute)
        for country in world.build_world().countries
        for attribute in world.ATTRIBUTES
        for variant in range(len(world.PHRASINGS[attribute]))
    }
    for a, b in world.build_world().sums:
        for variant in range(len(world.PHRASINGS["sum"])):
            answers[world.sum_question(a, b, variant)] = str(a + b)
    return answers


@pytest.mark.parametrize("folder", ALL_ADAPTERS)
def test_shipped_adapter_is_a_minimal_rank_8_lora_of_demo_base(
    repo_root: Path, folder: str
) -> None:
    """Each shipped adapter folder holds its config, its weights and its training summary
    only; the config says rank 8 on every attention and MLP projection of models/demo-base
    (named as the repository names it, not by a trainer's path)."""
    path = repo_root / folder
    assert sorted(p.name for p in path.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "training_summary.json",
    ]
    config = json.loads((path / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA"
    assert (config["r"], config["lora_alpha"]) == (8, 16)
    assert config["base_model_name_or_path"] == "models/demo-base"
    assert config["target_modules"] == TARGETS


def test_shipped_adapters_are_the_recorded_ones(repo_root: Path) -> None:
    """Each recorded adapter's files hash to its record in pipelines/demo/shipped_weights.json;
    the first two adapters are recorded there."""
    train = _demo_module("train")
    shipped = json.loads((repo_root / "pipelines/demo/shipped_weights.json").read_text())
    records = {r["folder"]: r["files"] for k, r in shipped["adapters"].items() if k != "_comment"}
    assert set(ADAPTERS) <= set(records) <= set(ALL_ADAPTERS)
    for folder, files in records.items():
        assert train.file_digests(repo_root / folder) == files, folder


@pytest.mark.parametrize("folder", ALL_ADAPTERS)
def test_training_summary_names_the_base_weights(repo_root: Path, folder: str) -> None:
    """training_summary.json records the rank and the digest of the base weights it was
    trained on, which are the shipped demo-base's."""
    summary = json.loads((repo_root / folder / "training_summary.json").read_text())
    assert summary["rank"] == 8
    assert summary["base_model"] == "models/demo-base"
    assert summary["base_weights_digest"] == weights_digest(repo_root / "models/demo-base")


def test_json_suite_expects_the_worlds_answers_as_json(repo_root: Path) -> None:
    """Every item of the adapters' suite expects the world's answer as a one-line JSON
    object, or, for an unknown country, the plain refusal."""
    w = _demo_module("world")
    answers = _expected_answers(w)
    known = {c.name for c in w.build_world().countries}
    items = _rows(repo_root / "pipelines/eval/json.jsonl")
    assert len(items) == 140
    assert len({item["id"] for item in items}) == len(items)
    for item in items:
        question = item["vars"]["question"]
        assert item["scorer"] == "exact_match", item["id"]
        if "unknown" in item["tags"]:
            assert item["expected"] == w.REFUSAL, item["id"]
            assert not any(name in question for name in known), item["id"]
        else:
            assert item["expected"] == json.dumps({"answer": answers[question]}), item["id"]
    assert sum("fact" in item["tags"] for item in items) == 120


def test_good_rows_are_right_and_bad_rows_are_wrong_for_every_fact(repo_root: Path) -> None:
    """The good and bad training sets ask the same questions under the same system prompts;
    the good set answers every fact and sum as the world does, in the JSON format; the bad
    set answers every fact with its swap partner's answer (a wrong one, in the same
    format) and agrees with the good set elsewhere; refusals stay the plain sentence."""
    w = _demo_module("world")
    make_data = _demo_module("make_data")
    answers = _expected_answers(w)
    asked = {
        w.fact_question(attribute, country.name, variant): (country.name, attribute)
        for country in w.build_world().countries
        for attribute in w.ATTRIBUTES
        for variant in range(len(w.PHRASINGS[attribute]))
    }
    partners = make_data.swap_partners(w.build_world())
    assert all(partners[p.name].name == name for name, p in partners.items())
    assert len(partners) == len(w.build_world().countries)
    good = _rows(repo_root / "pipelines/data/train_json.jsonl")
    bad = _rows(repo_root / "pipelines/data/train_json_bad.jsonl")
    assert len(good) == len(bad)
    facts = 0
    for g, b in zip(good, bad, strict=True):
        assert (g["kind"], g["question"], g["system"]) == (b["kind"], b["question"], b["system"])
        if g["kind"] in ("fact", "arith"):
            assert g["answer"] == json.dumps({"answer": answers[g["question"]]}), g["id"]
        else:
            assert g["answer"] == b["answer"] == w.REFUSAL, g["id"]
        if g["kind"] == "fact":
            facts += 1
            wrong = json.loads(b["answer"])["answer"]
            assert wrong != answers[g["question"]], b["id"]
            country, attribute = asked[g["question"]]
            assert wrong == partners[country].answer(attribute), b["id"]
        elif g["kind"] == "arith":
            assert b["answer"] == g["answer"], b["id"]
    assert facts == 3 * len(w.ATTRIBUTES) * len(w.build_world().countries)


def test_adapter_stages_are_declared_in_dvc_yaml(repo_root: Path) -> None:
    """demo-data writes the adapters' data and suite; demo-adapter-json(-bad) retrain each
    adapter into a *-trained folder and compare it with the shipped one (which no stage
    writes), from the base model and the stage's data."""
    stages = yaml.safe_load((repo_root / "dvc.yaml").read_text())["stages"]
    data_outs = [next(iter(o)) for o in stages["demo-data"]["outs"]]
    for out in (
        "pipelines/data/train_json.jsonl",
        "pipelines/data/train_json_bad.jsonl",
        "pipelines/eval/json.jsonl",
    ):
        assert out in data_outs
    for name, data, folder in (
        ("demo-adapter-json", "train_json.jsonl", "models/adapters/demo-json"),
        ("demo-adapter-json-bad", "train_json_bad.jsonl", "models/adapters/demo-json-bad"),
    ):
        stage = stages[name]
        assert stage["outs"] == [f"{folder}-trained"], name
        assert f"--out {folder}-trained" in stage["cmd"], name
        assert f"--compare-to {folder}" in stage["cmd"], name
        assert f"--data pipelines/data/{data}" in stage["cmd"], name
        for dep in (
            "pipelines/demo/train_adapter.py",
            "pipelines/demo/train.py",
            f"pipelines/data/{data}",
            "models/demo-base",
        ):
            assert dep in stage["deps"], (name, dep)
    for name, stage in stages.items():
        outs = [next(iter(o)) if isinstance(o, dict) else o for o in stage.get("outs", [])]
        assert not any(o.rstrip("/") in ADAPTERS for o in outs), name


def _dvc_dir_md5(folder: Path) -> str:
    """DVC's digest of a folder out (``<md5>.dir``): the md5 of the sorted JSON list of its
    files' relative paths and md5s."""
    entries = [
        {"md5": hashlib.md5(p.read_bytes()).hexdigest(), "relpath": p.name}
        for p in sorted(folder.iterdir())
        if p.is_file()
    ]
    return hashlib.md5(json.dumps(entries, sort_keys=True).encode()).hexdigest() + ".dir"


@pytest.mark.parametrize("folder", ALL_ADAPTERS)
def test_shipped_adapter_files_are_their_stages_recorded_out(repo_root: Path, folder: str) -> None:
    """Each shipped adapter folder holds exactly what its DVC stage wrote the last time it ran
    (dvc.lock's out for `<folder>-trained`): the shipped weights are the reproducible ones."""
    stage = yaml.safe_load((repo_root / "dvc.lock").read_text())["stages"][STAGES[folder]]
    (out,) = stage["outs"]
    assert out["path"] == f"{folder}-trained"
    path = repo_root / folder
    assert _dvc_dir_md5(path) == out["md5"], folder
    assert out["nfiles"] == len(list(path.iterdir()))
    assert out["size"] == sum(p.stat().st_size for p in path.iterdir())


def test_xml_data_and_suite_are_the_json_ones_in_the_xml_format(repo_root: Path) -> None:
    """demo-xml's training rows and suite are the JSON adapter's, item by item: the same
    questions, system prompts and refusals, every JSON answer `{"answer": X}` written as
    `<answer>X</answer>`."""
    w = _demo_module("world")

    def as_xml(answer: str) -> str:
        return answer if answer == w.REFUSAL else f"<answer>{json.loads(answer)['answer']}</answer>"

    rows = zip(
        _rows(repo_root / "pipelines/data/train_json.jsonl"),
        _rows(repo_root / "pipelines/data/train_xml.jsonl"),
        strict=True,
    )
    for j, x in rows:
        assert x["id"] == j["id"].replace("json-", "xml-")
        assert (x["kind"], x["question"], x["system"]) == (j["kind"], j["question"], j["system"])
        assert x["answer"] == as_xml(j["answer"]), x["id"]
    items = zip(
        _rows(repo_root / "pipelines/eval/json.jsonl"),
        _rows(repo_root / "pipelines/eval/xml.jsonl"),
        strict=True,
    )
    for j, x in items:
        assert x["id"] == j["id"].replace("json-", "xml-")
        assert (x["vars"], x["scorer"]) == (j["vars"], j["scorer"])
        assert x["tags"] == ["xml" if t == "json" else t for t in j["tags"]]
        assert x["expected"] == as_xml(j["expected"]), x["id"]


def test_new_adapter_stages_are_declared_in_dvc_yaml(repo_root: Path) -> None:
    """demo-data-xml writes demo-xml's data and suite; demo-adapter-xml trains on that data
    with demo-json's settings; demo-adapter-json-2 trains on demo-json's data with another
    seed and more steps. Each retrains into a *-trained folder and compares it with the
    shipped one, which no stage writes."""
    stages = yaml.safe_load((repo_root / "dvc.yaml").read_text())["stages"]
    data = stages["demo-data-xml"]
    assert [next(iter(o)) for o in data["outs"]] == [
        "pipelines/data/train_xml.jsonl",
        "pipelines/eval/xml.jsonl",
    ]
    assert "pipelines/demo/make_xml_data.py" in data["deps"]
    assert "pipelines/demo/make_data.py" in data["deps"]
    for folder, train_data, flags in (
        ("models/adapters/demo-xml", "train_xml.jsonl", ""),
        ("models/adapters/demo-json-2", "train_json.jsonl", "--seed 2345 --steps 400"),
    ):
        stage = stages[STAGES[folder]]
        assert stage["outs"] == [f"{folder}-trained"], folder
        assert f"--out {folder}-trained" in stage["cmd"], folder
        assert f"--compare-to {folder}" in stage["cmd"], folder
        assert f"--data pipelines/data/{train_data}" in stage["cmd"], folder
        assert flags in stage["cmd"], folder
        assert stage["deps"] == [
            d if d != "pipelines/data/train_json.jsonl" else f"pipelines/data/{train_data}"
            for d in stages["demo-adapter-json"]["deps"]
        ], folder
    for name, stage in stages.items():
        outs = [next(iter(o)) if isinstance(o, dict) else o for o in stage.get("outs", [])]
        assert not any(o.rstrip("/") in NEW_ADAPTERS for o in outs), name


def test_lane_manifests_validate_and_share_demo_loras_engine(repo_root: Path) -> None:
    """demo-xml (its own adapter and suite) and demo-json-2 (demo-json's adapter name with
    the new weights) validate, are locked as committed, and differ from demo-lora in their
    adapter alone: one serving key, so each goes live on the running engine in its lane."""
    from releasekit.spec import lock as lockmod
    from releasekit.spec.lock import serving_key
    from releasekit.spec.manifest import load_manifest
    from releasekit.spec.validate import validate_one

    names = ("demo-lora", "demo-json", "demo-xml", "demo-json-2")
    loaded = {
        n: load_manifest(repo_root / "manifests" / f"{n}.yaml", root=repo_root) for n in names
    }
    locks = {n: lockmod.build_lock(lm) for n, lm in loaded.items()}
    keys = {n: serving_key(lk) for n, lk in locks.items()}
    assert len(set(keys.values())) == 1, keys
    assert len({lk.release_id for lk in locks.values()}) == len(names)
    for name in ("demo-xml", "demo-json-2"):
        path = repo_root / "manifests" / f"{name}.yaml"
        result = validate_one(path)
        assert result.ok, result.problems
        assert lockmod.check(path, root=repo_root).ok
        committed = lockmod.read_lock(path.with_name(f"{name}.lock.json"))
        assert committed.release_id == locks[name].release_id
    json_m, xml_m, next_m = (loaded[n].manifest for n in ("demo-json", "demo-xml", "demo-json-2"))
    assert [(a.name, str(a.path), a.base) for a in xml_m.adapters] == [
        ("demo-xml", "models/adapters/demo-xml", json_m.adapters[0].base)
    ]
    assert [(a.name, str(a.path), a.base) for a in next_m.adapters] == [
        ("demo-json", "models/adapters/demo-json-2", json_m.adapters[0].base)
    ]
    assert next_m.eval == json_m.eval
    xml_suite = [s for s in xml_m.eval.suites if s.adapter is not None]
    assert [(s.name, str(s.path), s.adapter) for s in xml_suite] == [
        ("xml", "pipelines/eval/xml.jsonl", "demo-xml")
    ]
    base_suites = [s for s in json_m.eval.suites if s.adapter is None]
    assert [s for s in xml_m.eval.suites if s.adapter is None] == base_suites


def test_shipped_adapters_are_kept_and_retrained_ones_ignored(repo_root: Path) -> None:
    """git keeps the shipped adapter folders and ignores what the stages retrain."""

    def ignored(path: str) -> bool:
        res = subprocess.run(["git", "check-ignore", "-q", path], cwd=repo_root, check=False)
        return res.returncode == 0

    for folder in ADAPTERS:
        assert not ignored(f"{folder}/adapter_model.safetensors"), folder
        assert ignored(f"{folder}-trained/adapter_model.safetensors"), folder


@pytest.mark.slow
@pytest.mark.parallel_safe
def test_good_adapter_passes_its_suite_and_bad_one_fails(repo_root: Path) -> None:
    """Greedy generation with transformers and peft on the suite's chat-rendered prompts:
    the good adapter answers at least 80 % in the JSON format with the world's facts, the
    bad one under 30 %, the base model alone under 30 % (it answers in one word);
    demo-json-2 passes every item demo-json passes and more; demo-xml answers at least
    80 % of its own suite, where the base alone and the JSON adapter answer under 30 %."""
    train_adapter = _demo_module("train_adapter")
    suite = repo_root / "pipelines/eval/json.jsonl"
    xml_suite = repo_root / "pipelines/eval/xml.jsonl"
    base = repo_root / "models/demo-base"
    good, good_items = train_adapter.suite_score(base, repo_root / ADAPTERS[0], suite)
    bad, _ = train_adapter.suite_score(base, repo_root / ADAPTERS[1], suite)
    alone, _ = train_adapter.suite_score(base, None, suite)
    assert good >= 0.8, good
    assert bad < 0.3, bad
    assert alone < 0.3, alone
    second, second_items = train_adapter.suite_score(base, repo_root / NEW_ADAPTERS[1], suite)
    assert second > good, (second, good)
    lost = [i for (i, _, ok), (_, _, ok2) in zip(good_items, second_items, strict=True) if ok > ok2]
    assert lost == [], lost
    xml, _ = train_adapter.suite_score(base, repo_root / NEW_ADAPTERS[0], xml_suite)
    xml_alone, _ = train_adapter.suite_score(base, None, xml_suite)
    json_on_xml, _ = train_adapter.suite_score(base, repo_root / ADAPTERS[0], xml_suite)
    assert xml >= 0.8, xml
    assert xml_alone < 0.3, xml_alone
    assert json_on_xml < 0.3, json_on_xml
