"""The quantisation ladder on the session's real demo builds (`demo_builds`: bf16, W8A8 and,
where vLLM's CPU build serves it, W4A16, each quantised, served, load-tested and evaluated
for real): every rung is reused as built, compared item by item with bf16 from its signed
evidence, priced from its own knee, and the ladder recommends a rung that passes."""

from __future__ import annotations

import json

import pytest
import yaml
from demo_builds import USES_DEMO_BUILDS, DemoBuilds

from releasekit.ladder.models import LadderResult

pytestmark = pytest.mark.slow


@USES_DEMO_BUILDS
def test_the_ladder_reuses_the_builds_and_recommends_from_their_evidence(
    demo_builds: DemoBuilds,
) -> None:
    build = demo_builds.build
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    project = demo_builds.project
    rungs = [{"name": "demo-w8a8", "manifest": "manifests/demo-w8a8.yaml"}]
    if demo_builds.w4a16_skipped is None:
        rungs.append({"name": "demo-w4a16", "manifest": "manifests/demo-w4a16.yaml"})
    ladder = project / "manifests" / "ladder" / "session.yaml"
    ladder.parent.mkdir(parents=True, exist_ok=True)
    ladder.write_text(yaml.safe_dump({"unit_cost_per_hour": 1.0, "rungs": rungs}))
    r = demo_builds.run(
        "quantise", "ladder", "manifests/demo-bf16.yaml", "--recipes", str(ladder), "--json"
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = LadderResult.model_validate(json.loads(r.stdout))
    names = [row.name for row in result.rows]
    assert names == ["demo-bf16", *(x["name"] for x in rungs)]
    assert result.critical_suites == ["facts"]
    for row in result.rows:
        assert row.reused, f"{row.name} was rebuilt for the ladder"
        assert row.release_id == demo_builds.release_id(row.name)
        assert row.weights_bytes and row.weights_digest
        assert row.memory_bytes and row.memory_bytes > row.weights_bytes
        assert row.knee_goodput and row.cost_per_1k_good
        # Priced at the knee's best run too (the ladder's ties count it).
        assert row.cost_best_run_per_1k_good and row.cost_best_run_per_1k_good > 0
        assert row.measured_on == result.host
    w8 = result.row("demo-w8a8")
    assert w8.weights_bytes < result.row("demo-bf16").weights_bytes  # type: ignore[operator]
    facts = next(s for s in w8.suites if s.suite == "facts")
    assert facts.critical and facts.n == 1440
    assert {s.suite for s in w8.suites} == {"core", "edge", "regression", "facts"}
    assert result.recommended in names
    assert result.row(result.recommended).status in ("base", "passes")  # type: ignore[arg-type]
    page = (project / ".releasekit" / "ladder" / "session" / "ladder.html").read_text()
    assert f"Recommended: {result.recommended}" in page
