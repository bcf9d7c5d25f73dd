"""On the real demo server (vLLM CPU): a capacity plan agrees with its own load test, and the
demo's roofline sits above its measured single-stream rate."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from releasekit.bench import run_bench, write_evidence
from releasekit.capacity import CapacityEvidenceError, Traffic, plan_release, roofline_release
from releasekit.config import Settings
from releasekit.serving.vllm import ServerInfo
from releasekit.spec.loadprofile import SLO, LengthDist, LoadProfile, Sweep

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_demo_plan_and_roofline_agree_with_the_load_test(
    vllm_server: ServerInfo, demo_model: Path, settings_cap: Settings, release_id: str
) -> None:
    """A short closed-loop sweep of the demo server, written by the real writer: the plan's
    per-unit rate is the knee's concurrency / mean E2E, within 25% of the knee's measured
    request rate; units follow from it; the roofline from the demo's weight file is above
    the single stream the sweep measured at concurrency 1."""
    profile = LoadProfile(
        name="capacity-demo",
        api="completions",
        prompt_tokens=LengthDist(dist="uniform", min=16, max=48),
        output_tokens=LengthDist(dist="fixed", value=32),
        warmup_requests=4,
        sweep=Sweep(mode="concurrency", points=[1, 4, 8], requests_per_point=None, duration_s=4),
        slo=SLO(ttft_s=2.0, attainment=0.9, max_error_rate=0.01),
    )
    result = run_bench(
        vllm_server.base_url,
        "demo",
        profile,
        release_id=release_id,
        repetitions=2,
        max_num_seqs=32,
    )
    rdir = settings_cap.release_dir(release_id)
    write_evidence(result, rdir / "bench")
    data = yaml.safe_load((REPO / "manifests" / "demo-bf16.yaml").read_text())
    data["model"]["source"] = str(demo_model)
    (rdir / "manifest.yaml").write_text(yaml.safe_dump(data))
    roof = roofline_release(settings_cap, release_id)
    assert roof.weight_files == ["model.safetensors"]
    assert roof.bandwidth_source == "measured on this host" and roof.bandwidth_gbs > 0
    assert roof.single_stream_tokens_per_s is not None
    assert roof.ceiling_tokens_per_s > roof.single_stream_tokens_per_s
    print(  # shown with -s: the figures behind the assertions
        f"\nceiling {roof.ceiling_tokens_per_s:.0f} tok/s on {roof.bandwidth_gbs:.1f} GB/s, "
        f"single stream {roof.single_stream_tokens_per_s:.0f} tok/s "
        f"({roof.single_stream_source}); {roof.verdict}"
    )

    knee = result.knee
    traffic = Traffic(daily_requests=1_000_000, peak_hours=4, peak_factor=2)
    if knee is None:
        with pytest.raises(CapacityEvidenceError, match="no knee"):
            plan_release(settings_cap, release_id, traffic)
        pytest.skip(f"no knee on this host right now ({result.knee_stop})")
    assert knee.e2e.mean is not None
    plan = plan_release(settings_cap, release_id, traffic)
    u = plan.unit
    assert u.knee_load == knee.load
    assert u.little_requests_per_s == pytest.approx(knee.load / knee.e2e.mean)
    assert u.measured_requests_per_s == pytest.approx(knee.request_throughput)
    assert u.little_over_measured is not None and 0.75 < u.little_over_measured < 1.33
    assert plan.units == math.ceil(plan.peak_requests_per_s / u.requests_per_s - 1e-9)
    assert plan.measured is not None and plan.measured.max_num_seqs == 32
    print(
        f"knee c={knee.load:g}: Little {u.little_requests_per_s:.2f} req/s, measured "
        f"{u.measured_requests_per_s:.2f} (ratio {u.little_over_measured:.3f}); "
        f"{plan.units} units"
    )
