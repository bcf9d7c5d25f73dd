"""The roofline: the seed's 70B FP16 example, quantisation doubling the ceiling, a release's
ceiling from its real weight files beside its measured rates, and the bandwidth test."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from releasekit.capacity import (
    CapacityError,
    CapacityEvidenceError,
    ceiling_tokens_per_s,
    measure_bandwidth_gbs,
    roofline_by_hand,
    roofline_release,
)
from releasekit.config import Settings


def test_70b_fp16_on_2tbs_is_about_14_tokens_per_s() -> None:
    """70e9 parameters x 2 bytes on 2,000 GB/s: 2000e9 / 140e9 = 14.3 tokens/s per sequence."""
    r = roofline_by_hand(params=70e9, bytes_per_weight=2, bandwidth_gbs=2000)
    assert r.weight_bytes == pytest.approx(140e9)
    assert r.ceiling_tokens_per_s == pytest.approx(14.2857, rel=1e-4)
    assert r.bandwidth_source == "given" and r.nearest == "not measured"
    assert [s.name for s in r.steps] == ["bytes read per step", "bandwidth ceiling"]
    assert r.steps[0].working == "70 billion parameters x 2 bytes"


def test_half_the_bytes_per_weight_doubles_the_ceiling() -> None:
    """INT8 (1 byte) reads half the bytes of FP16, so its ceiling is twice as high: 28.6."""
    fp16 = roofline_by_hand(params=70e9, bytes_per_weight=2, bandwidth_gbs=2000)
    int8 = roofline_by_hand(params=70e9, bytes_per_weight=1, bandwidth_gbs=2000)
    assert int8.ceiling_tokens_per_s == pytest.approx(2 * fp16.ceiling_tokens_per_s)
    assert int8.ceiling_tokens_per_s == pytest.approx(28.571, rel=1e-4)
    assert ceiling_tokens_per_s(140e9, 2000) == pytest.approx(fp16.ceiling_tokens_per_s)


@pytest.mark.parametrize(
    ("kw", "flag"),
    [
        ({"params": 0, "bytes_per_weight": 2, "bandwidth_gbs": 2000}, "--params"),
        ({"params": 7e9, "bytes_per_weight": -1, "bandwidth_gbs": 2000}, "--bytes-per-weight"),
        ({"params": 7e9, "bytes_per_weight": 2, "bandwidth_gbs": 0}, "--bandwidth-gbs"),
    ],
)
def test_bad_roofline_numbers_name_the_option(kw: dict[str, float], flag: str) -> None:
    """A zero or negative roofline figure raises CapacityError naming its option."""
    with pytest.raises(CapacityError, match=flag):
        roofline_by_hand(**kw)


def test_bandwidth_measurement_returns_a_positive_number() -> None:
    """The host's copy test yields a positive GB/s figure (its speed is not asserted)."""
    assert measure_bandwidth_gbs(megabytes=8, repeats=2) > 0


def test_release_roofline_from_weight_files_and_bench(
    write_release: Callable[..., Path], settings_cap: Settings, release_id: str
) -> None:
    """A release serving a 10 MB safetensors file on 100 GB/s has a 10,000 tokens/s ceiling;
    its single stream (1 / mean TPOT at c=1 = 117.5 tok/s) sits far below it, so it is called
    compute/overhead-bound; the knee's batch (c=16, 768 tok/s) is set against 16 x ceiling."""
    write_release(weights_bytes=10_000_000)
    r = roofline_release(settings_cap, release_id, bandwidth_gbs=100)
    assert r.weight_files == ["model.safetensors"] and r.weight_bytes == 10_000_000
    assert r.ceiling_tokens_per_s == pytest.approx(10_000)
    assert r.single_stream_tokens_per_s == pytest.approx(47 / 0.4)
    assert r.single_stream_source == "1 / mean TPOT at concurrency 1"
    assert r.single_stream_share == pytest.approx(47 / 0.4 / 10_000)
    assert (r.single_stream_tokens_per_s or 0) < r.ceiling_tokens_per_s
    assert r.nearest == "compute/overhead"
    assert "compute/overhead-bound, not bandwidth-bound" in r.verdict
    assert r.knee_concurrency == 16
    assert r.batched_tokens_per_s == pytest.approx(64 * 48 / 4.0)
    assert r.batched_ceiling_tokens_per_s == pytest.approx(160_000)
    assert r.batching_gain == pytest.approx(768 / 117.5, rel=1e-4)


def test_release_roofline_near_the_ceiling_is_bandwidth_bound(
    write_release: Callable[..., Path], settings_cap: Settings, release_id: str
) -> None:
    """The same release on a host of 2 GB/s (ceiling 200 tok/s): 117.5 tok/s is 59% of it,
    bandwidth-bound; on 1 GB/s (ceiling 100) it would exceed the ceiling, which is named."""
    write_release(weights_bytes=10_000_000)
    assert roofline_release(settings_cap, release_id, bandwidth_gbs=2).nearest == "bandwidth"
    over = roofline_release(settings_cap, release_id, bandwidth_gbs=1)
    assert over.nearest == "above the ceiling" and "cannot be" in over.verdict


def test_release_roofline_without_weights_is_an_evidence_error(
    write_release: Callable[..., Path], settings_cap: Settings, release_id: str
) -> None:
    """A release whose model folder holds no safetensors file cannot have a roofline."""
    write_release()
    (settings_cap.root / "models" / "demo-base").mkdir(parents=True)
    with pytest.raises(CapacityEvidenceError, match=r"no \.safetensors"):
        roofline_release(settings_cap, release_id, bandwidth_gbs=100)


def test_quantised_release_reads_its_built_model(
    write_release: Callable[..., Path], settings_cap: Settings, release_id: str
) -> None:
    """A quantised release's weights are results/<id>/model's, not the source model's."""
    rdir = write_release(weights_bytes=10_000_000)
    (rdir / "model").mkdir()
    with (rdir / "model" / "model.safetensors").open("wb") as f:
        f.truncate(2_500_000)
    r = roofline_release(settings_cap, release_id, bandwidth_gbs=100)
    assert r.weight_bytes == 2_500_000 and r.model_dir == str(rdir / "model")


def test_float32_weights_served_as_bfloat16_read_half_their_bytes(
    write_release: Callable[..., Path], settings_cap: Settings, release_id: str
) -> None:
    """A real safetensors file of 4 MB float32 plus 1,000 int8 bytes, served as bfloat16 (the
    manifest's dtype): a step reads 2 MB + 1,000 bytes, and the note says why."""
    write_release()
    model = settings_cap.root / "models" / "demo-base"
    model.mkdir(parents=True)
    save_file(
        {"w": np.zeros((1000, 1000), dtype=np.float32), "q": np.zeros(1000, dtype=np.int8)},
        str(model / "model.safetensors"),
    )
    r = roofline_release(settings_cap, release_id, bandwidth_gbs=100)
    assert r.weight_bytes == 2_000_000 + 1000
    assert r.ceiling_tokens_per_s == pytest.approx(100e9 / 2_001_000)
    assert any("F32 tensors are read as bfloat16" in n for n in r.notes)
