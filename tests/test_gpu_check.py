"""benchmarks/gpu_check.py falls back to the CPU cleanly where torch sees no CUDA device: the
demo quantised by releasekit's quantisation (recorded as done on the CPU), evaluated against
bf16 with releasekit's scorers and paired comparison, bandwidth and decode rate beside the
roofline, one JSON that says it is a CPU fallback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELEASEKIT_")}
    env |= {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=600,
        check=False,
    )


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.slow  # quantises the demo model
def test_cpu_fallback_quantises_evaluates_and_measures(demo_model: Path, tmp_path: Path) -> None:
    """Static FP8 (calibrated) on a few items per suite: the whole check on the CPU."""
    out = tmp_path / "gpu_check.json"
    res = _run(
        *("--model", str(demo_model), "--schemes", "FP8", "--limit", "6"),
        *("--calibration-samples", "16", "--decode-tokens", "16", "--device", "cpu"),
        *("--out", str(out)),
    )
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["device"]["kind"] == "cpu"
    assert data["device"]["fallback"].startswith("--device cpu: everything ran on the CPU")
    # every suite of the demo manifest, the fact-heavy one included
    assert data["items_per_suite"] == {"core": 6, "edge": 6, "regression": 6, "facts": 6}
    (fp8,) = data["schemes"]
    assert "error" not in fp8, fp8
    assert fp8["quantise"]["device"] == "cpu"  # the quantise record says where it ran
    assert fp8["quantise"]["calibration_samples"] == 16
    assert fp8["format"] == "float-quantized"
    assert fp8["weight_bytes"] < data["model"]["weight_bytes"]
    for suite in ("core", "edge", "regression", "facts"):
        cmp = fp8["vs_bf16"][suite]
        assert cmp["n_paired"] == 6
        assert cmp["verdict"] == "insufficient_evidence"  # 6 pairs are too few for a verdict
        assert cmp["ci_low"] <= cmp["delta"] <= cmp["ci_high"]
    bw, dec = data["bandwidth"], data["decode"]
    assert bw["gbs"] > 0 and bw["independent_gbs"] > 0
    assert dec["ceiling_tokens_per_s"] == pytest.approx(bw["gbs"] * 1e9 / dec["weight_bytes"])
    assert 0 < dec["step_loop_tokens_per_s"] <= dec["ceiling_tokens_per_s"] * 1.05
    assert dec["generate_tokens_per_s"] > 0
    assert f"wrote {out}" in res.stdout


def test_asking_for_cuda_without_a_device_is_one_line_and_writes_nothing(tmp_path: Path) -> None:
    if _cuda():
        pytest.skip("this host has a CUDA device")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    out = tmp_path / "x.json"
    res = _run("--model", str(model), "--device", "cuda", "--out", str(out))
    assert res.returncode == 1
    assert (
        res.stderr.strip()
        .splitlines()[-1]
        .startswith("gpu_check: cannot run: --device cuda but torch")
    )
    assert not out.exists()


def test_an_unknown_scheme_is_refused_by_name() -> None:
    res = _run("--schemes", "W8A8,INT3")
    assert res.returncode == 2
    assert "--schemes: unknown INT3" in res.stderr
