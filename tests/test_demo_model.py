"""The demo model: a DVC stage, deterministic, cached, and good enough to serve."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

BIN = Path(sys.executable).parent


def _dvc(repo: Path, *args: str) -> str:
    res = subprocess.run([str(BIN / "dvc"), *args], cwd=repo, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout + res.stderr


def test_demo_stages_are_declared_in_dvc_yaml(repo_root: Path) -> None:
    stages = yaml.safe_load((repo_root / "dvc.yaml").read_text())["stages"]
    assert "models/demo-base" in stages["demo-model"]["outs"]
    assert any("train.py" in d for d in stages["demo-model"]["deps"])


@pytest.mark.slow
def test_trained_weights_match_the_committed_lock(repo_root: Path, demo_model: Path) -> None:
    """Training is deterministic: the weights built here hash to what dvc.lock recorded."""
    status = _dvc(repo_root, "status", "demo-model", "--json")
    assert json.loads(status.strip().splitlines()[-1] or "{}") == {}


@pytest.mark.slow
def test_second_repro_does_not_train_again(repo_root: Path, demo_model: Path) -> None:
    before = (demo_model / "model.safetensors").stat().st_mtime_ns
    out = _dvc(repo_root, "repro", "demo-model")
    assert "didn't change, skipping" in out
    assert (demo_model / "model.safetensors").stat().st_mtime_ns == before


def test_linear_layers_are_multiples_of_128(repo_root: Path, demo_model: Path) -> None:
    cfg = json.loads((demo_model / "config.json").read_text())
    assert cfg["model_type"] == "llama"
    for key in ("hidden_size", "intermediate_size", "vocab_size"):
        assert cfg[key] % 128 == 0, key
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    assert (cfg["num_key_value_heads"] * head_dim) % 128 == 0


def test_tokenizer_has_a_chat_template(demo_model: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_model)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "hi" in text
    assert tok.eos_token is not None
