"""The gates on real evidence: the demo's bf16 release and its damaged prompt, built for real
(vLLM's CPU build serves each, the load sweep and the eval suites run against it), then
promoted through the real gates and gateway. bf16 passes every gate; the damaged prompt is
blocked by the quality gates (`core`, and `regression`, which the damage also breaks) and by
no other kind of gate. The demo's closing example is
asked through the gateway and answered right."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from promote_kit import kill_everything, make_kit, mlflow_template_db

from releasekit.promote.promote import promote
from releasekit.spec.lock import read_lock

__all__ = ["mlflow_template_db"]

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
CLOSING_QUESTION = "What is the capital of Pistaeland?"  # scripts/demo.sh's closing example
CLOSING_ANSWER = "Birthasdale"


def test_real_builds_pass_or_block_on_their_own_evidence(
    project: Path,
    demo_model: Path,
    monkeypatch: pytest.MonkeyPatch,
    mlflow_template_db: Path,
) -> None:
    k = make_kit(
        project,
        monkeypatch,
        mlflow_template_db,
        python=Path(sys.executable),
        smoke='{ suite = "core", max_items = 8, max_tokens = 32, min_pass_rate = 0.5 }',
    )
    try:
        build = subprocess.run(
            [
                str(BIN / "releasekit"),
                "build",
                "manifests/demo-bf16.yaml",
                "manifests/demo-damaged-prompt.yaml",
            ],
            cwd=project,
            env=dict(os.environ),
            capture_output=True,
            text=True,
            timeout=1500,
        )
        assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
        base = read_lock(project / "manifests" / "demo-bf16.lock.json").release_id
        damaged = read_lock(project / "manifests" / "demo-damaged-prompt.lock.json").release_id
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
        # Only quality gates fail (core, and the regression suite the damage also breaks):
        # no performance, evidence or policy gate stands in the way.
        assert {g.kind for g in failed} == {"quality"}, [(g.name, g.detail) for g in failed]
        assert "suite core" in [g.name for g in failed]
        assert blocked.release_id == damaged

        answer = httpx.post(
            f"{k.gateway('staging')}/v1/templates/chat/chat/completions",
            json={"variables": {"question": CLOSING_QUESTION}, "max_tokens": 8},
            timeout=60,
        )
        assert answer.status_code == 200, answer.text
        text = answer.json()["choices"][0]["message"]["content"]
        assert text.strip() == CLOSING_ANSWER
    finally:
        kill_everything(k.settings)
