"""Quantisation: llm-compressor GPTQ/RTN gives compressed-tensors models, byte-identical from
the same lock; scheme none passes the model through; failures are QuantiseErrors."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from releasekit.build.quantise import (
    quantise_model,
    quantise_release,
    read_calibration,
    weights_digest,
)
from releasekit.config import Settings
from releasekit.errors import QuantiseError
from releasekit.spec.manifest import Calibration, Quantisation

WORDS = [f"w{i}" for i in range(200)]


def make_tiny_llama(out: Path) -> Path:
    """A randomly initialised Llama whose linear layers are multiples of 128 (W4A16 groups of
    128), with a word-level tokenizer and a chat template: seconds to make and quantise."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    fast.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (made once per module)."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def calibration(tmp_path: Path) -> Path:
    """A JSONL calibration set of 40 `text` lines."""
    path = tmp_path / "calibration.jsonl"
    lines = [
        json.dumps({"text": " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(48))})
        for i in range(40)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def _gptq(scheme: str, calibration: Path) -> Quantisation:
    return Quantisation.model_validate(
        {
            "scheme": scheme,
            "method": "gptq",
            "calibration": {"dataset": str(calibration), "samples": 32, "max_seq_length": 64},
        }
    )


def _files(folder: Path) -> dict[str, str]:
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.mark.slow
@pytest.mark.parallel_safe
def test_gptq_w8a8_twice_gives_byte_identical_weights(
    tiny_model: Path, calibration: Path, tmp_path: Path
) -> None:
    """Two quantisations from the same recipe (separate processes) write identical bytes:
    weights, config and recipe."""
    q = _gptq("W8A8", calibration)
    runs = [
        quantise_model(
            tiny_model,
            tmp_path / f"out{i}",
            q,
            calibration=calibration,
            log_path=tmp_path / "q.log",
        )
        for i in (1, 2)
    ]
    assert runs[0].weights_digest == runs[1].weights_digest
    assert _files(tmp_path / "out1") == _files(tmp_path / "out2")
    assert (
        runs[0].recipe_digest
        == hashlib.sha256((tmp_path / "out1/recipe.yaml").read_bytes()).hexdigest()
    )
    assert runs[0].weights_digest != weights_digest(tiny_model)
    assert runs[0].calibration_samples == 32

    config = json.loads((tmp_path / "out1" / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"
    group = qc["config_groups"]["group_0"]
    assert group["weights"]["num_bits"] == 8
    assert group["input_activations"]["num_bits"] == 8  # W8A8: int8 activations too
    assert qc["ignore"] == ["lm_head"]
    assert runs[0].size_after_bytes < runs[0].size_before_bytes
    # Tokenizer and chat template travel verbatim, so the release formats prompts the same.
    for name in ("tokenizer.json", "chat_template.jinja", "generation_config.json"):
        assert (tmp_path / "out1" / name).read_bytes() == (tiny_model / name).read_bytes()


@pytest.mark.slow
@pytest.mark.parallel_safe
def test_gptq_w4a16_packs_4bit_groups_of_128(
    tiny_model: Path, calibration: Path, tmp_path: Path
) -> None:
    """W4A16 writes pack-quantized int4 weights in groups of 128, about a quarter the size."""
    res = quantise_model(
        tiny_model,
        tmp_path / "w4",
        _gptq("W4A16", calibration),
        calibration=calibration,
        log_path=tmp_path / "q.log",
    )
    qc = json.loads((tmp_path / "w4" / "config.json").read_text())["quantization_config"]
    weights = qc["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["group_size"], qc["format"]) == (4, 128, "pack-quantized")
    assert qc["config_groups"]["group_0"]["input_activations"] is None
    assert res.size_after_bytes < res.size_before_bytes * 0.6
    assert res.seconds > 0


def test_scheme_none_passes_the_model_through(project: Path, settings_tmp: Settings) -> None:
    """scheme none copies nothing: quantise.json points at the model source, sizes equal."""
    from releasekit.spec.lock import locked_release

    model = project / "models" / "demo-base"
    if model.is_symlink():
        model.unlink()
    model.mkdir(parents=True)
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (model / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    (model / "tokenizer.json").write_text('{"model": {}}')
    settings = settings_tmp.model_copy(update={"root": project, "results_dir": project / "results"})
    lm, lk = locked_release(project / "manifests" / "demo-bf16.yaml", root=project)
    res = quantise_release(settings, lm, lk)
    assert res.model_dir == "models/demo-base"
    assert res.size_before_bytes == res.size_after_bytes == 256 * 64
    assert res.weights_digest == weights_digest(model)
    out = settings.release_dir(lk.release_id)
    assert not (out / "model").exists()
    assert json.loads((out / "quantise.json").read_text())["model_dir"] == "models/demo-base"


def test_bad_calibration_line_names_file_and_line(tmp_path: Path) -> None:
    """A calibration line without a `text` string fails before llm-compressor is imported."""
    bad = tmp_path / "cal.jsonl"
    bad.write_text('{"text": "ok"}\n{"txt": "typo"}\n')
    with pytest.raises(QuantiseError, match=r"cal\.jsonl:2: expected an object with a `text`"):
        read_calibration(bad, 10)
    assert read_calibration(bad, 1) == ["ok"]  # only the samples asked for are read


@pytest.mark.slow
@pytest.mark.parallel_safe
def test_llmcompressor_failure_becomes_quantise_error_quoting_the_log(
    tiny_model: Path, calibration: Path, tmp_path: Path
) -> None:
    """Unreadable weights: the child's exception is a QuantiseError with the log's tail, and
    no half-written model folder is left."""
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    q = Quantisation(scheme="W4A16", method="rtn", calibration=Calibration(dataset=calibration))
    with pytest.raises(QuantiseError, match="llm-compressor failed") as info:
        quantise_model(broken, tmp_path / "out", q, calibration=None, log_path=tmp_path / "q.log")
    assert "Traceback" in str(info.value)  # the log's last lines are quoted
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.tmp-*"))
