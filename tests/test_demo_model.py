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
    for name, stage in stages.items():
        outs = [next(iter(o)) if isinstance(o, dict) else o for o in stage.get("outs", [])]
        assert not any(o.startswith("models/demo-base") for o in outs), name


def _shipped(repo_root: Path) -> dict[str, Any]:
    return json.loads((repo_root / "pipelines/demo/shipped_weights.json").read_text())


def test_the_shipped_weights_are_the_recorded_ones_and_every_demo_lock_serves_them(
    repo_root: Path,
) -> None:
    """One demo world on every host: models/demo-base is in git, its files hash to the
    record in pipelines/demo/shipped_weights.json, and every demo manifest's lock was made
    on exactly those files (so a release id means the same weights everywhere)."""
    _, train = _demo_modules()
    model = repo_root / "models" / "demo-base"
    tracked = subprocess.run(
        ["git", "ls-files", "models/demo-base"], cwd=repo_root, capture_output=True, text=True
    ).stdout.split()
    assert sorted(Path(t).name for t in tracked) == sorted(_shipped(repo_root)["files"])
    assert train.file_digests(model) == _shipped(repo_root)["files"]
    for lock in sorted((repo_root / "manifests").glob("*.lock.json")):
        inputs = json.loads(lock.read_text())["inputs"]
        model_inputs = {k.removeprefix("model/"): v for k, v in inputs.items() if "/" in k}
        model_inputs = {k: v for k, v in model_inputs.items() if k in _shipped(repo_root)["files"]}
        assert model_inputs == _shipped(repo_root)["files"], lock.name


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
    first request on a CPU with AMX)."""
    pinned = ("MKL_CBWR", "MKL_DYNAMIC", "OMP_DYNAMIC", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
    code = (
        "import os, sys; sys.path.insert(0, sys.argv[1]); import train; "
        f"print(sorted(k for k in {pinned!r} if k in os.environ))"
    )
    env = {k: v for k, v in os.environ.items() if k not in pinned}
    res = subprocess.run(
        [sys.executable, "-c", code, str(DEMO)], capture_output=True, text=True, env=env
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


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
def test_training_is_deterministic_from_run_to_run(repo_root: Path, tmp_path: Path) -> None:
    """Two trainings with the same inputs on this host write byte-identical folders (a few
    steps: the same code path as the full run, which `dvc repro demo-model` takes)."""
    outs = [tmp_path / "a", tmp_path / "b"]
    for out in outs:
        res = subprocess.run(
            [sys.executable, str(DEMO / "train.py"), "--out", str(out), "--steps", "6"],
            cwd=repo_root,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    _, train = _demo_modules()
    assert train.file_digests(outs[0]) == train.file_digests(outs[1])
    assert "byte-identical" in train.compare_weights(outs[0], outs[1])
    assert "differs" in train.compare_weights(outs[0], repo_root / "models" / "demo-base")


@pytest.mark.slow
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
