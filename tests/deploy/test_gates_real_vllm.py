"""The gates on real evidence: the demo's bf16 release, its damaged prompt and its W8A8 and
W4A16 releases, built for real (quantised with llm-compressor, vLLM's CPU build serves each,
the load sweep and the eval suites run against it), then promoted through the real gates and
gateway. bf16 passes every gate; the damaged prompt is blocked by the quality gates (`core`,
and `regression`, which the damage also breaks) and by no other kind of gate; W8A8 passes
every quality gate against bf16; W4A16 is compared on every suite, the fact-heavy `facts`
with McNemar (on AVX-512 only: elsewhere vLLM's CPU build cannot serve W4A16, and the test
says so in one line). The demo's closing example is asked through the gateway and
answered right."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import webclient
from demo_builds import USES_DEMO_BUILDS, DemoBuilds
from promote_kit import kill_everything, use_kit

from releasekit.promote.promote import promote

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CLOSING_QUESTION = "What is the capital of Pistaeland?"  # scripts/demo.sh's closing example
CLOSING_ANSWER = "Muburg"


@USES_DEMO_BUILDS
def test_real_builds_pass_or_block_on_their_own_evidence(
    demo_builds: DemoBuilds, monkeypatch: pytest.MonkeyPatch
) -> None:
    build = demo_builds.build
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    if demo_builds.w4a16_skipped:
        print(f"\nW4A16 skipped on this host: {demo_builds.w4a16_skipped}")
    project = demo_builds.project
    k = use_kit(project, monkeypatch, demo_builds.ports, python=Path(sys.executable))
    try:
        base = demo_builds.release_id("demo-bf16")
        damaged = demo_builds.release_id("demo-damaged-prompt")
        bench = json.loads((project / "results" / base / "bench" / "bench.json").read_text())
        assert bench["knee"] is not None, bench["knee_stop"]

        up = promote(k.settings, "manifests/demo-bf16.yaml", env="staging", reason="real")
        assert up.status == "promoted", (
            up.deploy.model_dump_json(indent=1) if up.deploy else up.report
        )
        assert up.report is not None and up.report.passed and not up.overridden
        assert {g.kind for g in up.report.gates} >= {"perf", "quality", "evidence", "policy"}

        blocked = promote(k.settings, "manifests/demo-damaged-prompt.yaml", env="staging")
        assert blocked.status == "blocked" and blocked.report is not None
        failed = blocked.report.failed
        # Quality gates block it (core, and the regression suite the damage also breaks);
        # no evidence or policy gate stands in the way. Its perf verdicts, and a load test
        # too noisy to judge (its runs' spread above the cap), belong to the host's load
        # (another job on the same 2 cores moves them), so they are set aside here.
        judged = [
            g
            for g in failed
            if g.kind != "perf" and not (g.kind == "evidence" and "too noisy" in g.detail)
        ]
        assert {g.kind for g in judged} == {"quality"}, [(g.name, g.detail) for g in failed]
        assert "suite core" in [g.name for g in failed]
        assert blocked.release_id == damaged

        # 8-bit weights: every suite non-inferior to bf16 (the quality gates look at the
        # evidence only; the performance gates are the demo's business). On the shipped
        # weights W8A8 flips at most one item per suite, far from the 3+ any suite needs.
        w8 = promote(k.settings, "manifests/demo-w8a8.yaml", env="staging", dry_run=True)
        assert w8.report is not None
        quality = {g.name: g for g in w8.report.gates if g.kind == "quality"}
        assert "McNemar p=" in quality["suite facts"].detail
        assert all(g.passed for g in quality.values()), [g.detail for g in quality.values()]

        if demo_builds.w4a16_skipped is None:
            # 4-bit weights are compared on every suite, paired with bf16, McNemar on facts;
            # on the shipped weights they flip facts both ways (docs/concepts/releases.md,
            # "The quantisation lesson"), so no verdict is held here beyond the comparison.
            w4a16 = promote(k.settings, "manifests/demo-w4a16.yaml", env="staging", dry_run=True)
            assert w4a16.report is not None
            facts = next(g for g in w4a16.report.gates if g.name == "suite facts")
            print(f"\nW4A16 on facts: {facts.detail}")
            assert re.search(r"McNemar p=([0-9.e-]+)", facts.detail), facts.detail
            assert facts.candidate is not None and facts.live is not None

        answer = webclient.post(
            f"{k.gateway('staging')}/v1/templates/chat/chat/completions",
            json={"variables": {"question": CLOSING_QUESTION}, "max_tokens": 8},
            timeout=60,
        )
        assert answer.status_code == 200, answer.text
        text = answer.json()["choices"][0]["message"]["content"]
        assert text.strip() == CLOSING_ANSWER
    finally:
        kill_everything(k.settings)
