"""A manifest only tightens: the candidate's canary checks, `sustain` and `confidence` are
clamped to the environment's committed ceilings and the report says so; a canary that
needed clamping does not stand in for the offline perf gates (`perf_by_canary`)."""

from __future__ import annotations

import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from promote_kit import Kit, kill_everything, make_kit

from releasekit.config import EnvironmentConfig
from releasekit.promote.ceilings import canary_within
from releasekit.promote.promote import promote
from releasekit.rollout.progressive import promote_progressive
from releasekit.spec.manifest import Canary, load_manifest
from releasekit.watch.rules import from_manifest, with_floor

REPO = Path(__file__).resolve().parents[2]


def _committed_envs() -> dict[str, EnvironmentConfig]:
    data = tomllib.loads((REPO / "releasekit.toml").read_text())
    return {k: EnvironmentConfig.model_validate(v) for k, v in data["environments"].items()}


def test_the_demo_manifests_are_within_the_repositorys_ceilings() -> None:
    """Every demo manifest's canary and watch rules run as written in staging and
    production: the committed ceilings and watch floor clamp none of them."""
    envs = _committed_envs()
    assert {"staging", "production"} <= set(envs)
    for path in sorted((REPO / "manifests").glob("*.yaml")):
        m = load_manifest(path, root=REPO).manifest
        for name, cfg in envs.items():
            assert cfg.watch_floor, name
            if m.promotion.canary is not None:
                within = canary_within(m.promotion.canary, cfg, name)
                assert within.clamps == [], (path.name, name, within.note)
                assert within.canary == m.promotion.canary
            floor = [from_manifest(r) for r in cfg.watch_floor]
            rules = [from_manifest(r) for r in m.watch]
            out, notes = with_floor(rules, floor, env=name)
            assert notes == [] and out == rules, (path.name, name, notes)


def test_a_looser_canary_is_clamped_to_the_ceilings_and_reported() -> None:
    """tolerance 1000, slack 9 s, confidence 0.999 and sustain 50 run at staging's
    ceilings, each named in one "clamped by staging's policy" line; a stricter check
    stays as it is."""
    cfg = _committed_envs()["staging"]
    canary = Canary.model_validate(
        {
            "steps": [{"weight": 25}, {"weight": 100}],
            "sustain": 50,
            "checks": [
                {"metric": "ttft_p95_s", "tolerance": 1000, "slack": 9, "confidence": 0.999},
                {"metric": "error_rate", "tolerance": 0, "slack": 0.01, "min_samples": 10},
            ],
        }
    )
    within = canary_within(canary, cfg, "staging")
    ttft, errors = within.canary.checks
    assert (ttft.tolerance, ttft.slack, ttft.confidence) == (
        cfg.canary_tolerance_ceiling("ttft_p95_s"),
        cfg.canary_slack_ceiling("ttft_p95_s"),
        cfg.max_canary_confidence,
    )
    assert errors == canary.checks[1]
    assert within.canary.sustain == cfg.max_canary_sustain
    assert within.note.startswith("clamped by staging's policy: ")
    for words in (
        "ttft_p95_s tolerance 1000 -> 0.5",
        "ttft_p95_s slack 9 -> 0.25",
        "ttft_p95_s confidence 0.999 -> 0.95",
        "sustain 50 -> 4",
    ):
        assert words in within.note, within.note


BY_CANARY = ["perf_by_canary = true", 'max_canary_tolerance = { "*" = 0.5 }']


@pytest.fixture
def pkit(
    project: Path,
    monkeypatch: pytest.MonkeyPatch,
    mlflow_template_db: Path,
    stand_in_model: Any,
) -> Iterator[Kit]:
    """The deploy kit with `perf_by_canary` and a tolerance ceiling of 0.5 committed."""
    stand_in_model(project)
    k = make_kit(project, monkeypatch, mlflow_template_db, toml_lines=BY_CANARY)
    try:
        yield k
    finally:
        kill_everything(k.settings)


def _slow_candidate(k: Kit, name: str, tolerance: float) -> str:
    """A candidate whose TTFT at the knee is three times the live release's (its offline
    perf gate fails), with canary steps judging TTFT with `tolerance`."""
    path = k.variant("demo-bf16", name, {"max-num-seqs: 32": "max-num-seqs: 16"})
    path.write_text(
        path.read_text()
        + "promotion:\n  canary:\n    steps:\n"
        + "      - {weight: 50, min_duration_s: 1, min_requests: 4}\n      - {weight: 100}\n"
        + f"    checks:\n      - {{metric: ttft_p95_s, tolerance: {tolerance}, slack: 0.05}}\n"
    )
    return k.build(name, knee_ttft=0.6)


def test_a_tolerance_1000_canary_is_clamped_and_the_perf_gates_stay_blocking(pkit: Kit) -> None:
    """With staging's committed `perf_by_canary`, a canary within the ceilings makes the
    failed offline TTFT comparison advisory; one asking `tolerance: 1000` is clamped to
    0.5, its report says "clamped by staging's policy", and its perf gate blocks."""
    live = pkit.build("demo-bf16")
    assert promote(pkit.settings, live, env="staging").status == "promoted"

    within = _slow_candidate(pkit, "demo-narrow", 0.5)
    ok = promote_progressive(pkit.settings, within, env="staging", dry_run=True)
    assert ok.report is not None
    assert [g.kind for g in ok.report.advisory_failed] == ["perf"], ok.report.gates
    assert ok.report.failed == [] and ok.ok
    assert not any("ceilings" in g.name for g in ok.report.gates)

    wide = _slow_candidate(pkit, "demo-wide", 1000)
    res = promote_progressive(pkit.settings, wide, env="staging", dry_run=True)
    assert res.report is not None and not res.ok
    assert [g.kind for g in res.report.failed] == ["perf"], res.report.gates
    assert res.report.advisory_failed == []
    [row] = [g for g in res.report.gates if g.name == "canary within staging's ceilings"]
    assert row.passed and "clamped by staging's policy: ttft_p95_s tolerance 1000 -> 0.5" in (
        row.detail
    )
    assert "perf_by_canary does not apply" in row.detail
    assert any("perf_by_canary does not apply" in w for w in res.warnings), res.warnings
    assert any("clamped by staging's policy" in w for w in res.warnings), res.warnings
