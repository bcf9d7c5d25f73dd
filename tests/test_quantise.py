"""Quantisation: llm-compressor GPTQ/RTN gives compressed-tensors models, byte-identical from
the same lock; scheme none passes the model through; failures are QuantiseErrors."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from releasekit.build import quantise as quantise_mod
from releasekit.build.quantise import (
    QuantiseResult,
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


def write_calibration(path: Path) -> Path:
    """A JSONL calibration set of 40 `text` lines at `path`."""
    lines = [
        json.dumps({"text": " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(48))})
        for i in range(40)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def calibration(tmp_path: Path) -> Path:
    """A JSONL calibration set of 40 `text` lines."""
    return write_calibration(tmp_path / "calibration.jsonl")


def _gptq(scheme: str, calibration: Path, **fields: object) -> Quantisation:
    return Quantisation.model_validate(
        {
            "scheme": scheme,
            "method": "gptq",
            "calibration": {"dataset": str(calibration), "samples": 32, "max_seq_length": 64},
            **fields,
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


# ---- pinned float code paths and the weight recipe --------------------------------------

PARENT_ENV_VARIED = {
    "OMP_NUM_THREADS": "2",
    "MKL_NUM_THREADS": "2",
    "ATEN_CPU_CAPABILITY": "default",
    "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
    "MKL_CBWR": "AUTO",
    "ONEDNN_MAX_CPU_ISA": "SSE41",
}


@pytest.fixture(scope="module")
def pinned_w4a16(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[QuantiseResult, Path]:
    """GPTQ W4A16 of the tiny model with the scheme's preset, pinned (quantised once per
    module) and its calibration set."""
    folder = tmp_path_factory.mktemp("pinned")
    cal = write_calibration(folder / "calibration.jsonl")
    with pytest.MonkeyPatch.context() as mp:
        for key in (*PARENT_ENV_VARIED, "RELEASEKIT_QUANTISE_THREADS"):
            mp.delenv(key, raising=False)
        res = quantise_model(
            tiny_model,
            folder / "out",
            _gptq("W4A16", cal),
            calibration=cal,
            log_path=folder / "q.log",
        )
    return res, cal


@pytest.mark.slow
@pytest.mark.parallel_safe
def test_cpu_quantisation_records_its_pinned_float_paths(
    pinned_w4a16: tuple[QuantiseResult, Path],
) -> None:
    """On the CPU the record names the pins that ran (one thread, ATen and oneDNN on AVX2,
    MKL's branch as MKL reports it) and the host kind; the preset recipe is recorded empty."""
    res, _ = pinned_w4a16
    if res.device != "cpu":
        pytest.skip(f"quantised on {res.device}: no CPU pins")
    fp = res.float_paths
    assert fp is not None
    assert (fp.threads, fp.threads_from, fp.aten, fp.onednn) == (1, "pinned", "avx2", "AVX2")
    assert fp.pinned == (fp.mkl == "AVX2,STRICT")
    assert res.made_on is not None and res.made_on.isa != "unknown"
    assert res.weight_recipe == {}
    assert json.loads(res.model_dump_json())["float_paths"]["mkl"] == fp.mkl


@pytest.mark.slow
@pytest.mark.parallel_safe
def test_the_pins_win_over_the_callers_environment(
    pinned_w4a16: tuple[QuantiseResult, Path],
    tiny_model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another thread count and other ATen, oneDNN and MKL paths in the caller's environment
    give the same weights: the quantisation process sets its own. An explicit
    RELEASEKIT_QUANTISE_THREADS is honoured and the record says the paths were not pinned."""
    pinned, cal = pinned_w4a16
    for key, value in PARENT_ENV_VARIED.items():
        monkeypatch.setenv(key, value)
    res = quantise_model(
        tiny_model,
        tmp_path / "varied",
        _gptq("W4A16", cal),
        calibration=cal,
        log_path=tmp_path / "q.log",
    )
    assert res.weights_digest == pinned.weights_digest
    assert res.float_paths == pinned.float_paths
    monkeypatch.setenv("RELEASEKIT_QUANTISE_THREADS", "2")
    res = quantise_model(
        tiny_model,
        tmp_path / "two",
        _gptq("W4A16", cal),
        calibration=cal,
        log_path=tmp_path / "q.log",
    )
    if res.float_paths is None:
        pytest.skip(f"quantised on {res.device}: no CPU pins")
    assert res.float_paths.pinned is False
    assert (res.float_paths.threads, res.float_paths.threads_from) == (
        2,
        "RELEASEKIT_QUANTISE_THREADS",
    )


@pytest.mark.slow
@pytest.mark.parallel_safe
def test_a_recipe_field_changes_the_weights(
    pinned_w4a16: tuple[QuantiseResult, Path], tiny_model: Path, tmp_path: Path
) -> None:
    """group_size 64 builds llm-compressor's config groups instead of the preset's name:
    groups of 64 in the written config, other weights than the preset's groups of 128."""
    pinned, cal = pinned_w4a16
    q = _gptq("W4A16", cal, group_size=64)
    res = quantise_model(
        tiny_model, tmp_path / "g64", q, calibration=cal, log_path=tmp_path / "q.log"
    )
    assert res.weights_digest != pinned.weights_digest
    assert res.weight_recipe == {"group_size": 64}
    qc = json.loads((tmp_path / "g64" / "config.json").read_text())["quantization_config"]
    weights = qc["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["group_size"], weights["strategy"]) == (4, 64, "group")
    assert qc["ignore"] == ["lm_head"]


def test_bad_recipe_fields_fail_before_any_child_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group size that does not divide the model's in-features and an empty calibration
    set are one-line QuantiseErrors raised before the quantisation process starts."""

    def no_child(*args: object, **kwargs: object) -> None:
        raise AssertionError("a quantisation process was started")

    monkeypatch.setattr(quantise_mod.subprocess, "Popen", no_child)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 128, "intermediate_size": 320}')
    cal = write_calibration(tmp_path / "cal.jsonl")
    with pytest.raises(QuantiseError) as info:
        quantise_model(
            model,
            tmp_path / "out",
            _gptq("W4A16", cal, group_size=128),
            calibration=cal,
            log_path=tmp_path / "q.log",
        )
    assert str(info.value).startswith("quantisation.group_size: 128 does not divide")
    assert "intermediate_size 320" in str(info.value) and "\n" not in str(info.value)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(QuantiseError, match=r"^quantisation.calibration.dataset: .* no samples$"):
        quantise_model(
            model,
            tmp_path / "out",
            _gptq("W4A16", empty),
            calibration=empty,
            log_path=tmp_path / "q.log",
        )
    assert not (tmp_path / "out").exists()
