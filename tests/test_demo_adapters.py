"""The demo's LoRA adapters: shipped in git beside the base model, reproducible by DVC stages,
trained on data that agrees with the demo world (the good set) or contradicts it on every fact
(the bad set).

Fast tests read the shipped folders and the data; the one slow test scores both adapters.
"""

from __future__ import annotations

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


@pytest.mark.parametrize("folder", ADAPTERS)
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
    """Each shipped adapter's files hash to its record in pipelines/demo/shipped_weights.json."""
    train = _demo_module("train")
    shipped = json.loads((repo_root / "pipelines/demo/shipped_weights.json").read_text())
    records = {r["folder"]: r["files"] for k, r in shipped["adapters"].items() if k != "_comment"}
    assert sorted(records) == sorted(ADAPTERS)
    for folder, files in records.items():
        assert train.file_digests(repo_root / folder) == files, folder


@pytest.mark.parametrize("folder", ADAPTERS)
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
    bad one under 30 %, the base model alone under 30 % (it answers in one word)."""
    train_adapter = _demo_module("train_adapter")
    suite = repo_root / "pipelines/eval/json.jsonl"
    base = repo_root / "models/demo-base"
    good, _ = train_adapter.suite_score(base, repo_root / ADAPTERS[0], suite)
    bad, _ = train_adapter.suite_score(base, repo_root / ADAPTERS[1], suite)
    alone, _ = train_adapter.suite_score(base, None, suite)
    assert good >= 0.8, good
    assert bad < 0.3, bad
    assert alone < 0.3, alone
