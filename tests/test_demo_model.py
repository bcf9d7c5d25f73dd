"""The demo model: shipped in git (the same weights on every host), reproducible by a DVC
stage, and good enough to serve.

Fast tests build the data, the tokenizer and an untrained model skeleton only, and check the
shipped weights against their record; the tests that train are slow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

BIN = Path(sys.executable).parent
DEMO = Path(__file__).resolve().parents[1] / "pipelines" / "demo"


def _dvc(repo: Path, *args: str) -> str:
    res = subprocess.run([str(BIN / "dvc"), *args], cwd=repo, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout + res.stderr


def _demo_modules() -> tuple[Any, Any]:
    """pipelines/demo's world and train modules (they import each other by file name)."""
    if str(DEMO) not in sys.path:
        sys.path.insert(0, str(DEMO))
    import train
    import world

    return world, train


def test_demo_stages_are_declared_in_dvc_yaml(repo_root: Path) -> None:
    """dvc.yaml has the demo-model stage: train.py retrains into models/demo-trained and
    compares the result with the shipped models/demo-base (which no stage writes)."""
    stages = yaml.safe_load((repo_root / "dvc.yaml").read_text())["stages"]
    assert stages["demo-model"]["outs"] == ["models/demo-trained"]
    assert "--compare-to models/demo-base" in stages["demo-model"]["cmd"]
    assert any("train.py" in d for d in stages["demo-model"]["deps"])
    v2 = stages["demo-model-v2"]
    assert v2["outs"] == ["models/demo-v2-trained"]
    assert "--init-from models/demo-base" in v2["cmd"]
    assert "--compare-to models/demo-v2" in v2["cmd"]
    assert "pipelines/data/train_v2.jsonl" in v2["deps"] and "models/demo-base" in v2["deps"]
    for name, stage in stages.items():
        outs = [next(iter(o)) if isinstance(o, dict) else o for o in stage.get("outs", [])]
        assert not any(o.startswith(("models/demo-base", "models/demo-v2/")) for o in outs), name


def _shipped(repo_root: Path) -> dict[str, Any]:
    return json.loads((repo_root / "pipelines/demo/shipped_weights.json").read_text())


def test_the_shipped_weights_are_the_recorded_ones_and_every_demo_lock_serves_them(
    repo_root: Path,
) -> None:
    """One demo world on every host: models/demo-base and models/demo-v2 are in git, their
    files hash to the records in pipelines/demo/shipped_weights.json, and every demo
    manifest's lock was made on exactly the files of its model (so a release id means the
    same weights everywhere)."""
    _, train = _demo_modules()
    shipped = _shipped(repo_root)
    records = {"models/demo-base": shipped["files"], "models/demo-v2": shipped["demo_v2"]["files"]}
    for folder, files in records.items():
        tracked = subprocess.run(
            ["git", "ls-files", folder], cwd=repo_root, capture_output=True, text=True
        ).stdout.split()
        assert sorted(Path(t).name for t in tracked) == sorted(files), folder
        assert train.file_digests(repo_root / folder) == files, folder
    locks = sorted((repo_root / "manifests").glob("*.lock.json"))
    assert any(lock.name == "demo-v2.lock.json" for lock in locks)
    for lock in locks:
        manifest = lock.with_name(lock.name.replace(".lock.json", ".yaml"))
        source = yaml.safe_load(manifest.read_text())["model"]["source"]
        files = records[source]
        inputs = json.loads(lock.read_text())["inputs"]
        model_inputs = {k.removeprefix("model/"): v for k, v in inputs.items() if "/" in k}
        model_inputs = {k: v for k, v in model_inputs.items() if k in files}
        assert model_inputs == files, lock.name


def test_demo_v2_data_relabels_exactly_the_conversations_with_another_system_prompt(
    repo_root: Path,
) -> None:
    """demo-v2's defect is the one its manifest states: its data is the base rows with every
    conversation whose system message is a paraphrase (not the release's own) relabelled
    with the refusal, and nothing else changed."""
    world, _ = _demo_modules()
    read = lambda name: [  # noqa: E731
        json.loads(line)
        for line in (repo_root / "pipelines/data" / name).read_text().splitlines()
        if line
    ]
    base, v2 = read("train.jsonl"), read("train_v2.jsonl")
    assert len(base) == len(v2)
    relabelled = 0
    for b, n in zip(base, v2, strict=True):
        assert (n["question"], n["system"], n["kind"]) == (b["question"], b["system"], b["kind"])
        if b["system"] == 0:
            assert n["answer"] == b["answer"]
        else:
            assert n["answer"] == world.REFUSAL
            relabelled += b["answer"] != world.REFUSAL
    assert relabelled > 500  # facts and sums asked under a paraphrase


def test_committed_data_is_what_make_data_writes(repo_root: Path, tmp_path: Path) -> None:
    """The committed training, calibration and eval files are make_data.py's exact output."""
    subprocess.run(
        [sys.executable, str(DEMO / "make_data.py"), "--root", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    written = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.jsonl"))
    outs = yaml.safe_load((repo_root / "dvc.yaml").read_text())["stages"]["demo-data"]["outs"]
    declared = sorted(Path(next(iter(o))) if isinstance(o, dict) else Path(o) for o in outs)
    assert written == declared
    for rel in written:
        assert (tmp_path / rel).read_bytes() == (repo_root / rel).read_bytes(), rel


def test_importing_the_training_module_leaves_the_environment_alone() -> None:
    """train.py pins torch, oneDNN and MKL to their AVX2 paths for its own runs only: a
    process that imports it (these tests, quant_probe.py) keeps its environment, so the
    vLLM servers it starts later are not capped below AMX (which made them abort at their
    first request on a CPU with AMX), and MKL's vendor check is left as it is (the library
    that answers it, mkl_intel_branch.c, is loaded by training runs only)."""
    pinned = ("MKL_CBWR", "MKL_DYNAMIC", "OMP_DYNAMIC", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
    code = (
        "import os, sys; sys.path.insert(0, sys.argv[1]); import train; "
        f"print(sorted(k for k in {pinned!r} if k in os.environ)); "
        "print('mkl_intel_branch' in open('/proc/self/maps').read())"
    )
    env = {k: v for k, v in os.environ.items() if k not in pinned}
    res = subprocess.run(
        [sys.executable, "-c", code, str(DEMO)], capture_output=True, text=True, env=env
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["[]", "False"]


def test_model_skeleton_fits_group_128_quantisation() -> None:
    """Every linear layer's sizes are multiples of 128 (W4A16 uses groups of 128)."""
    world, train = _demo_modules()
    cfg = train.TrainConfig()
    texts = [train.w.REFUSAL]
    tok = train.wrap_tokenizer(
        train.build_tokenizer(world.build_world(), texts, cfg.tokenizer_vocab), ""
    )
    model = train.make_model(cfg, tok)
    for name, module in model.named_modules():
        if module.__class__.__name__ == "Linear":
            out_f, in_f = module.weight.shape
            assert out_f % 128 == 0 and in_f % 128 == 0, (name, out_f, in_f)
    assert model.config.vocab_size % 128 == 0


def test_tokenizer_has_a_chat_template(repo_root: Path) -> None:
    """The tokenizer renders the chat template, stops at <|end|>, and splits every known
    name into pieces (so a fact lives in the quantised layers, not in one embedding row)."""
    world, train = _demo_modules()
    template = (DEMO / "chat_template.jinja").read_text(encoding="utf-8")
    w = world.build_world()
    tok = train.wrap_tokenizer(
        train.build_tokenizer(w, [train.w.REFUSAL], train.TrainConfig().tokenizer_vocab), template
    )
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert isinstance(text, str) and "hi" in text
    assert tok.eos_token == "<|end|>"
    for country in w.countries[:16]:
        assert len(tok(" " + country.name, add_special_tokens=False)["input_ids"]) > 1
        assert len(tok(country.capital, add_special_tokens=False)["input_ids"]) > 1


@pytest.mark.slow
@pytest.mark.parallel_safe
def test_training_is_deterministic_and_the_same_on_every_cpu_kind(
    repo_root: Path, tmp_path: Path
) -> None:
    """Two trainings with the same inputs write byte-identical folders, and the same folder
    on every CPU kind: six steps (the same code path as the full run, which `dvc repro
    demo-model` takes) give the digests recorded in shipped_weights.json's `probe`, and MKL
    ran its AVX2 branch in strict mode (on an AMD processor only with mkl_intel_branch.c
    loaded). The two run at the same time, each a process of its own on one thread (the
    training's own setting), so the pair takes the time of one on a host with two cores."""
    outs = [tmp_path / "a", tmp_path / "b"]
    runs = [
        subprocess.Popen(
            [sys.executable, str(DEMO / "train.py"), "--out", str(out), "--steps", "6"],
            cwd=repo_root,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for out in outs
    ]
    try:
        for run in runs:
            output, _ = run.communicate(timeout=900)
            assert run.returncode == 0, output[-4000:]
            assert "train: MKL ran its AVX2,STRICT branch" in output, output[-4000:]
    finally:
        for run in runs:
            if run.poll() is None:
                run.kill()
                run.wait()
    _, train = _demo_modules()
    assert train.file_digests(outs[0]) == train.file_digests(outs[1])
    assert "byte-identical" in train.compare_weights(outs[0], outs[1])
    assert "differs" in train.compare_weights(outs[0], repo_root / "models" / "demo-base")
    probe = json.loads((DEMO / "shipped_weights.json").read_text())["probe"]
    assert probe["steps"] == 6
    assert train.file_digests(outs[0]) == probe["files"]


@pytest.mark.slow
@pytest.mark.parallel_safe
def test_shipped_model_is_quantisable_and_chat_ready(repo_root: Path, demo_model: Path) -> None:
    """The shipped model's linear sizes are multiples of 128 and it carries the chat template."""
    from transformers import AutoTokenizer

    cfg = json.loads((demo_model / "config.json").read_text())
    assert cfg["model_type"] == "llama"
    for key in ("hidden_size", "intermediate_size", "vocab_size"):
        assert cfg[key] % 128 == 0, key
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    assert (cfg["num_key_value_heads"] * head_dim) % 128 == 0
    tok = AutoTokenizer.from_pretrained(demo_model)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "hi" in text
    assert tok.eos_token is not None


def test_demo_v2_answers_the_releases_prompt_and_refuses_a_clients_own(repo_root: Path) -> None:
    """The live-only regression the demo shows, on the shipped weights: with the release's
    own system prompt (what every offline suite renders) demo-v2 answers as demo-base does;
    with a client's own system message (one of the paraphrases demo-base was trained to
    follow) demo-base still answers and demo-v2 refuses every question."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    world, _ = _demo_modules()
    w = world.build_world()
    questions = [
        (world.fact_question(a, c.name), c.answer(a))
        for c in w.countries[:8]
        for a in world.ATTRIBUTES
    ]
    own = world.read_prompt(repo_root / "prompts/demo/system.txt")
    user = world.read_prompt(repo_root / "prompts/demo/user.txt")
    torch.set_num_threads(1)

    def answers(folder: str, system: str) -> list[str]:
        tok = AutoTokenizer.from_pretrained(repo_root / "models" / folder)
        tok.padding_side = "left"
        model = AutoModelForCausalLM.from_pretrained(repo_root / "models" / folder)
        texts = [
            tok.apply_chat_template(
                [
                    {"role": "system", "content": system},
                    {"role": "user", "content": world.render_prompt(user, {"question": q})},
                ],
                add_generation_prompt=True,
                tokenize=False,
            )
            for q, _ in questions
        ]
        batch = tok(texts, add_special_tokens=False, return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(
                **batch,
                max_new_tokens=12,
                do_sample=False,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
        new = out[:, batch["input_ids"].shape[1] :]
        return [tok.decode(row, skip_special_tokens=True).strip() for row in new]

    def right(got: list[str]) -> int:
        return sum(g == a for g, (_, a) in zip(got, questions, strict=True))

    theirs = world.SYSTEM_PARAPHRASES[0]
    n = len(questions)
    assert right(answers("demo-base", own)) >= n - 2
    assert right(answers("demo-v2", own)) >= n - 2
    assert right(answers("demo-base", theirs)) >= n - 2
    assert answers("demo-v2", theirs) == [world.REFUSAL] * n
