"""What a suite can detect at its margin: the smallest one-way loss that blocks or is called
inferior, from the same interval and verdict rule the gates use; `validate` prints it, and a
comparison says when a blocking verdict rests on fewer flips than a suite should need."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from releasekit.cli import app
from releasekit.evaluate.compare import compare_suite
from releasekit.evaluate.paired_stats import newcombe_paired_interval
from releasekit.evaluate.runner import ItemResult
from releasekit.evaluate.sensitivity import (
    MIN_BLOCKING_FLIPS,
    manifest_sensitivity,
    suite_sensitivity,
)
from releasekit.evaluate.verdicts import interval_verdict
from releasekit.spec.manifest import load_manifest

REPO = Path(__file__).resolve().parents[1]
DEMO = ["demo-bf16", "demo-w8a8", "demo-w4a16", "demo-damaged-prompt"]


def test_a_40_item_suite_at_a_10_point_margin_blocks_on_a_single_flip() -> None:
    """The case the demo met: 1 of 40 items flipped one way is 'inconclusive' at 0.10."""
    s = suite_sensitivity("regression", 40, 0.10, pass_rate=0.9)
    assert s.flips_to_block == 1 and s.single_flip_blocks and s.fragile
    assert "fewer than 3 flips can block" in s.line()
    lo, hi = newcombe_paired_interval(35, 0, 1, 4, confidence=0.95)  # 36 passing, 1 lost
    assert not interval_verdict(lo, hi, 0.10).passed


@pytest.mark.parametrize(("n", "margin"), [(156, 0.10), (528, 0.05), (1440, 0.01), (130, 0.10)])
def test_the_flip_counts_are_where_the_verdict_really_changes(n: int, margin: float) -> None:
    """One flip fewer than `flips_to_block` still passes, and `flips_to_inferior` is the first
    count whose interval lies wholly beyond the margin."""
    s = suite_sensitivity("s", n, margin, pass_rate=0.9)
    assert s.flips_to_block is not None and s.flips_to_inferior is not None
    passing = round(n * 0.9)

    def verdict(k: int) -> str:
        lo, hi = newcombe_paired_interval(passing - k, 0, k, n - passing, confidence=0.95)
        return interval_verdict(lo, hi, margin).value

    assert verdict(s.flips_to_block - 1) in ("non_inferior", "superior")
    assert verdict(s.flips_to_block) not in ("non_inferior", "superior")
    assert verdict(s.flips_to_inferior - 1) != "inferior"
    assert verdict(s.flips_to_inferior) == "inferior"
    assert s.detectable_loss == pytest.approx(s.flips_to_inferior / n)


@pytest.mark.parametrize("name", DEMO)
def test_no_demo_suite_can_block_on_one_or_two_flips(name: str) -> None:
    """The demo's suites are sized for their margins: a release with no real loss is not
    blocked by one or two items that flip on another CPU kind's float kernels."""
    lm = load_manifest(REPO / "manifests" / f"{name}.yaml", root=REPO)
    found = manifest_sensitivity(lm)
    assert {s.suite for s in found} == {s.name for s in lm.manifest.eval.suites}
    for s in found:
        assert s.flips_to_block is not None and s.flips_to_block >= MIN_BLOCKING_FLIPS, s.line()


def _items(outcomes: list[str]) -> list[ItemResult]:
    return [
        ItemResult(
            id=f"i{k:04d}",
            suite="regression",
            scorer="exact_match",
            outcome=o,  # type: ignore[arg-type]
            score=float(o == "pass"),
            output=o,
            expected="pass",
            vars={"question": f"q{k}?"},
        )
        for k, o in enumerate(outcomes)
    ]


def test_a_comparison_says_when_its_block_rests_on_fewer_flips_than_it_should() -> None:
    base = _items(["pass"] * 36 + ["fail"] * 4)
    cand = _items(["fail"] + ["pass"] * 35 + ["fail"] * 4)
    sc = compare_suite(cand, base, margin=0.10, confidence=0.95, samples=200, seed=0)
    assert not sc.passed
    assert any("rests on 1 net flipped item" in r for r in sc.reasons), sc.reasons
    # A clear loss says nothing of the kind.
    worse = _items(["fail"] * 20 + ["pass"] * 16 + ["fail"] * 4)
    sc = compare_suite(worse, base, margin=0.10, confidence=0.95, samples=200, seed=0)
    assert sc.verdict.value == "inferior"
    assert not any("rests on" in r for r in sc.reasons)


def test_validate_prints_each_suites_sensitivity_and_json_carries_it() -> None:
    runner = CliRunner()
    manifest = str(REPO / "manifests" / "demo-bf16.yaml")
    res = runner.invoke(app, ["validate", manifest])
    assert res.exit_code == 0, res.output
    assert "suite regression: n=156, margin 10 points" in res.output
    assert "one-way flips block" in res.output
    res = runner.invoke(app, ["validate", manifest, "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    suites = {s["suite"]: s for s in data[0]["suites"]}
    assert suites["facts"]["n"] == 1440 and suites["facts"]["flips_to_block"] >= 3
