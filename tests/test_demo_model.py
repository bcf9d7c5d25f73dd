"""The demo model: a DVC stage, deterministic, cached, and good enough to serve.

Fast tests build the data, the tokenizer and an untrained model skeleton only;
every test that needs trained weights (and so may train them) is slow.
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
    """dvc.yaml has the demo-model stage, trained by train.py into models/demo-base."""
    stages = yaml.safe_load((repo_root / "dvc.yaml").read_text())["stages"]
    assert "models/demo-base" in stages["demo-model"]["outs"]
    assert any("train.py" in d for d in stages["demo-model"]["deps"])


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


def _cpu_kind() -> str:
    """The float-kernel family torch picks here: AVX-512 machines with AMX (oneDNN's AMX
    kernels), AVX-512 machines without, and AVX2-only machines train the same seeded model
    to different (each deterministic) weights."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:  # pragma: no cover - not Linux
        return "unknown"
    if "avx512f" in flags:
        return "avx512_amx" if "amx_bf16" in flags else "avx512"
    return "avx2" if "avx2" in flags else "unknown"


@pytest.mark.slow
def test_trained_weights_are_reproducible_on_this_cpu_kind(
    repo_root: Path, demo_model: Path
) -> None:
    """Training is deterministic: the weights built here hash to the digest recorded for
    this CPU kind (pipelines/demo/expected_weights.json)."""
    expected = json.loads((repo_root / "pipelines/demo/expected_weights.json").read_text())
    kind = _cpu_kind()
    if kind not in expected:
        pytest.skip(f"no recorded weights digest for CPU kind {kind!r}")
    digest = hashlib.sha256((demo_model / "model.safetensors").read_bytes()).hexdigest()
    assert digest == expected[kind]


@pytest.mark.slow
def test_second_repro_does_not_train_again(repo_root: Path, demo_model: Path) -> None:
    """A second `dvc repro demo-model` with unchanged inputs skips training."""
    before = (demo_model / "model.safetensors").stat().st_mtime_ns
    out = _dvc(repo_root, "repro", "demo-model")
    assert "didn't change, skipping" in out
    assert (demo_model / "model.safetensors").stat().st_mtime_ns == before


@pytest.mark.slow
def test_trained_model_is_quantisable_and_chat_ready(repo_root: Path, demo_model: Path) -> None:
    """The trained model's linear sizes are multiples of 128 and it carries the chat template."""
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
