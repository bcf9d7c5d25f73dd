"""Watch rules: absolute and relative judgements, low traffic as no data, and how
consecutive breaches are counted (no-data windows neither reset nor advance the count)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from releasekit.errors import ManifestError
from releasekit.spec.loadprofile import SLO
from releasekit.spec.manifest import WatchRule, parse_manifest
from releasekit.watch.rules import (
    Baseline,
    BaselinePoint,
    Rule,
    RuleState,
    WatchRuleError,
    from_manifest,
    judge,
    rules_from_slo,
)
from releasekit.watch.windows import Figure, Window

ROOT = Path(__file__).resolve().parents[2]


def window(t: float, **figs: tuple[float | None, float]) -> Window:
    """A 30 s window ending at t with figures name=(value, count)."""
    return Window(
        start=t - 30,
        end=t,
        duration_s=30,
        figures={
            k: Figure(value=v, count=n, source="gateway", reason=None if v is not None else "x")
            for k, (v, n) in figs.items()
        },
    )


TTFT = Rule(metric="ttft_p95_s", above=1.0, sustain=3, min_requests=20)


def verdicts(rule: Rule, values: list[tuple[float | None, float]]) -> list[bool]:
    state = RuleState(rule=rule)
    out = []
    for i, (v, n) in enumerate(values):
        w = window(30.0 * (i + 1), ttft_p95_s=(v, n))
        out.append(state.update(judge(rule, w), w))
    return out


def test_absolute_rule_pass_breach_and_low_traffic() -> None:
    """Above the limit breaches, at or below passes, under min_requests is no data."""
    assert judge(TTFT, window(30, ttft_p95_s=(1.2, 50))).verdict == "breach"
    assert judge(TTFT, window(30, ttft_p95_s=(1.0, 50))).verdict == "pass"
    low = judge(TTFT, window(30, ttft_p95_s=(9.0, 5)))
    assert low.verdict == "no_data" and "too little traffic" in low.reason
    missing = judge(TTFT, window(30))
    assert missing.verdict == "no_data"


def test_sustain_needs_consecutive_breaches() -> None:
    """Three breaches in a row are sustained; a pass in between starts the count over."""
    assert verdicts(TTFT, [(2, 50), (2, 50), (2, 50)]) == [False, False, True]
    assert verdicts(TTFT, [(2, 50), (2, 50), (0.5, 50), (2, 50), (2, 50)]) == [False] * 5


def test_no_data_windows_neither_reset_nor_advance() -> None:
    """Breach, no data, breach, breach: sustained at the fourth window (the quiet window
    did not count, and did not reset the run)."""
    state = RuleState(rule=TTFT)
    seq = [(2.0, 50), (None, 0), (9.0, 3), (2.0, 50), (2.0, 50)]
    got = []
    for i, (v, n) in enumerate(seq):
        w = window(30.0 * (i + 1), ttft_p95_s=(v, n))
        got.append((state.update(judge(TTFT, w), w), state.consecutive))
    assert got == [(False, 1), (False, 1), (False, 1), (False, 2), (True, 3)]
    assert [e.window.end for e in state.breaches] == [30, 120, 150]


def test_relative_rule_uses_benchmark_at_similar_rate() -> None:
    """E2E p95 over 1.5x the benchmark interpolated at the live rate breaches; a live rate
    far outside the benchmarked range, or no baseline, is no data."""
    rule = Rule(metric="e2e_p95_s", kind="relative", factor=1.5, min_requests=10)
    base = Baseline(
        points=[
            BaselinePoint(request_rate=2, figures={"e2e_p95_s": 1.0}),
            BaselinePoint(request_rate=6, figures={"e2e_p95_s": 2.0}),
        ]
    )
    # live rate 4 req/s: benchmark 1.5 s, limit 2.25 s
    w = window(30, e2e_p95_s=(2.3, 120), request_rate=(4.0, 120))
    j = judge(rule, w, base)
    assert j.verdict == "breach" and j.limit == pytest.approx(2.25)
    assert "interpolated" in j.reason
    ok = judge(rule, window(30, e2e_p95_s=(2.2, 120), request_rate=(4.0, 120)), base)
    assert ok.verdict == "pass"
    far = judge(rule, window(30, e2e_p95_s=(9.0, 900), request_rate=(30.0, 900)), base)
    assert far.verdict == "no_data" and "far above" in far.reason
    near = judge(rule, window(30, e2e_p95_s=(3.1, 240), request_rate=(8.0, 240)), base)
    assert near.verdict == "breach" and near.limit == pytest.approx(3.0)
    assert judge(rule, w, None).verdict == "no_data"


def test_rule_validation() -> None:
    """Unknown metrics and inconsistent kinds are refused; names default from the metric."""
    with pytest.raises(ValueError, match="unknown metric"):
        Rule(metric="ttft_p97_s", above=1)
    with pytest.raises(ValueError, match="needs `factor`"):
        Rule(metric="e2e_p95_s", kind="relative")
    assert Rule(metric="e2e_p95_s", kind="relative", factor=1.5).name == "e2e_p95_s_relative"


def test_from_manifest_converts_the_manifest_watch_rule() -> None:
    """The manifest's WatchRule(metric, max, window_s, sustain) becomes an absolute Rule;
    an unknown metric is a WatchRuleError with a remedy listing the known ones."""
    r = from_manifest(WatchRule(metric="ttft_p95_s", max=1.0, window_s=20, sustain=2))
    assert (r.kind, r.above, r.window_s, r.sustain, r.min_requests) == (
        "absolute",
        1.0,
        20,
        2,
        20,
    )
    with pytest.raises(WatchRuleError) as exc:
        from_manifest(WatchRule(metric="latency", max=1.0))
    assert "ttft_p95_s" in exc.value.remedy


def test_a_manifest_relative_rule_becomes_a_relative_rule() -> None:
    """`kind: relative` with `factor` (and its own `min_requests`) in the manifest becomes a
    relative Rule; a rule with the wrong limit for its kind is refused by the manifest model
    with a line naming the watch rule."""
    r = from_manifest(
        WatchRule.model_validate(
            {"metric": "e2e_p95_s", "kind": "relative", "factor": 1.5, "min_requests": 5}
        )
    )
    assert (r.kind, r.factor, r.above, r.min_requests) == ("relative", 1.5, None, 5)
    assert r.describe() == "e2e_p95_s more than 1.5x its benchmark for 3 x 30 s windows"
    for bad, words in (
        ({"metric": "e2e_p95_s", "kind": "relative", "max": 2.0}, "takes `factor`"),
        ({"metric": "e2e_p95_s"}, "takes `max`"),
        ({"metric": "e2e_p95_s", "max": 2.0, "factor": 1.5}, "takes `max`"),
    ):
        with pytest.raises(ManifestError) as exc:
            parse_manifest(_manifest_with_watch(bad), path=Path("m.yaml"))
        assert "watch" in str(exc.value) and words in str(exc.value)


def _manifest_with_watch(rule: dict[str, object]) -> dict[str, object]:
    """The demo manifest's fields with one watch rule."""
    data = yaml.safe_load((ROOT / "manifests" / "demo-bf16.yaml").read_text())
    data["watch"] = [rule]
    return dict(data)


def test_rules_from_slo() -> None:
    """SLOs give TTFT/E2E rules at the attainment quantile and an error-rate rule."""
    rules = rules_from_slo(SLO(ttft_s=0.5, e2e_s=4.0, attainment=0.95, max_error_rate=0.02))
    assert {(r.metric, r.above) for r in rules} == {
        ("ttft_p95_s", 0.5),
        ("e2e_p95_s", 4.0),
        ("error_rate", 0.02),
    }


def test_the_documented_watch_example_is_a_valid_manifest_section() -> None:
    """The `watch:` example of the live-quality page parses as a manifest's watch rules: one
    absolute rule, one relative rule at 1.5x its benchmark."""
    text = (ROOT / "docs" / "concepts" / "live-quality.md").read_text()
    block = text.split("```yaml\nwatch:\n", 1)[1].split("```", 1)[0]
    section = yaml.safe_load("watch:\n" + block)
    m = parse_manifest(_manifest_with_watch(section["watch"][0]), path=Path("m.yaml"))
    rules = [from_manifest(WatchRule.model_validate(r)) for r in section["watch"]]
    assert m.watch[0].max == 2.0
    assert [(r.metric, r.kind) for r in rules] == [
        ("ttft_p95_s", "absolute"),
        ("e2e_p95_s", "relative"),
    ]
    assert rules[1].factor == 1.5
