"""Paired comparison and the report, on constructed results with known answers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import binomtest

from releasekit.evaluate import Comparison, EvalResult, ItemResult, compare, write_report
from releasekit.evaluate.compare import (
    compare_suite,
    mcnemar_exact,
    non_inferiority,
    paired_bootstrap,
)
from releasekit.evaluate.runner import Noise, SuiteNoise, SuiteSummary
from releasekit.spec.manifest import LoadedManifest, parse_manifest


def _lm(
    tmp_path: Path, *, seed: int = 0, samples: int = 2000, margin: float = 0.05
) -> LoadedManifest:
    data = {
        "apiVersion": "releasekit/v1",
        "name": "cand",
        "model": {"source": "models/x"},
        "prompts": {"user": {"file": "u.txt"}},
        "eval": {
            "suites": [
                {"name": "core", "kind": "core", "path": "core.jsonl", "margin": margin},
                {"name": "edge", "kind": "edge", "path": "edge.jsonl", "scorer": "refusal"},
            ],
            "seed": seed,
            "bootstrap_samples": samples,
            "confidence": 0.95,
        },
        "load": {"profile": "p.yaml"},
    }
    m = parse_manifest(data, path=tmp_path / "m.yaml")
    return LoadedManifest(path=tmp_path / "m.yaml", base=tmp_path, manifest=m)


def _items(suite: str, outcomes: list[str], *, prefix: str = "i") -> list[ItemResult]:
    return [
        ItemResult(
            id=f"{prefix}{k:04d}",
            suite=suite,
            scorer="exact_match",
            outcome=o,  # type: ignore[arg-type]
            score=None if o == "error" else float(o == "pass"),
            output=f"out-{o}-{k}",
            expected=f"exp{k}",
            vars={"question": f"q{k}?"},
        )
        for k, o in enumerate(outcomes)
    ]


def _result(
    items: list[ItemResult], *, release_id: str, name: str, noise: Noise | None = None
) -> EvalResult:
    suites = {}
    for s in sorted({i.suite for i in items}):
        its = [i for i in items if i.suite == s]
        p = sum(i.outcome == "pass" for i in its)
        f = sum(i.outcome == "fail" for i in its)
        suites[s] = SuiteSummary(
            kind=s,
            scorer="exact_match",
            n=len(its),
            passed=p,
            failed=f,
            errors=len(its) - p - f,
            pass_rate=p / (p + f) if p + f else None,
            margin=0.05,
            digest="d" * 64,
        )
    return EvalResult(release_id=release_id, name=name, suites=suites, items=items, noise=noise)


# ---- McNemar -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("b", "c", "p"),
    [
        (1, 9, 22 / 1024),  # 2 * (C(10,0) + C(10,1)) / 2^10
        (0, 5, 2 / 32),  # 2 * (1/2)^5
        (2, 10, 2 * (1 + 12 + 66) / 4096),  # 2 * P(X <= 2), X ~ Bin(12, 1/2)
        (10, 0, 2 / 1024),
        (3, 3, 1.0),
        (0, 0, 1.0),
    ],
)
def test_mcnemar_exact_matches_hand_computed_binomial_tails(b: int, c: int, p: float) -> None:
    assert mcnemar_exact(b, c) == pytest.approx(p, rel=1e-12)
    if b + c:
        assert mcnemar_exact(b, c) == pytest.approx(binomtest(b, b + c, 0.5).pvalue)


# ---- non-inferiority verdict ----------------------------------------------------------


@pytest.mark.parametrize(
    ("lo", "hi", "verdict"),
    [
        (-0.04, 0.02, "non-inferior"),
        (0.01, 0.05, "non-inferior"),
        (-0.20, -0.06, "inferior"),
        (-0.08, 0.01, "inconclusive"),
        (-0.05, 0.0, "inconclusive"),  # touching -margin is not above it
        (-0.09, -0.05, "inconclusive"),  # nor below it
        (None, None, "inconclusive"),
    ],
)
def test_verdict_compares_the_ci_with_minus_margin(
    lo: float | None, hi: float | None, verdict: str
) -> None:
    assert non_inferiority(lo, hi, 0.05) == verdict


# ---- paired bootstrap ----------------------------------------------------------------


def test_bootstrap_is_deterministic_for_a_seed() -> None:
    rng = np.random.default_rng(1)
    a = rng.integers(0, 2, 150).astype(float)
    b = rng.integers(0, 2, 150).astype(float)
    one = paired_bootstrap(a, b, samples=500, confidence=0.95, seed=3)
    two = paired_bootstrap(a, b, samples=500, confidence=0.95, seed=3)
    other = paired_bootstrap(a, b, samples=500, confidence=0.95, seed=4)
    assert one == two
    assert one[0] == other[0]
    assert one[1:] != other[1:]
    assert one[1] <= one[0] <= one[2]


def test_bootstrap_ci_covers_the_true_delta_at_about_its_confidence() -> None:
    """Pairs drawn with P(both pass)=.80, P(both fail)=.08, P(pass->fail)=.09,
    P(fail->pass)=.03: the true delta is -0.06. A 95% interval must cover it in about
    95% of 300 simulated suites of 300 items."""
    true_delta = 0.03 - 0.09
    rng = np.random.default_rng(2024)
    covered = 0
    reps = 300
    for rep in range(reps):
        cat = rng.choice(4, size=300, p=[0.80, 0.08, 0.09, 0.03])
        base = np.isin(cat, [0, 2]).astype(float)
        cand = np.isin(cat, [0, 3]).astype(float)
        _, lo, hi = paired_bootstrap(cand, base, samples=1000, confidence=0.95, seed=rep)
        covered += lo <= true_delta <= hi
    assert 0.91 <= covered / reps <= 0.99


def test_bootstrap_ci_narrows_with_more_items() -> None:
    rng = np.random.default_rng(5)
    widths = []
    for n in (50, 800):
        cat = rng.choice(4, size=n, p=[0.80, 0.08, 0.09, 0.03])
        base = np.isin(cat, [0, 2]).astype(float)
        cand = np.isin(cat, [0, 3]).astype(float)
        _, lo, hi = paired_bootstrap(cand, base, samples=1000, confidence=0.95, seed=0)
        widths.append(hi - lo)
    assert widths[1] < widths[0] / 2


def test_bootstrap_rejects_unpaired_input() -> None:
    with pytest.raises(ValueError, match="equal-length"):
        paired_bootstrap([1.0, 0.0], [1.0], samples=100, confidence=0.95, seed=0)


# ---- compare_suite: pairing, flips, errors ---------------------------------------------


def test_identical_results_are_non_inferior_with_a_zero_interval() -> None:
    items = _items("core", ["pass"] * 95 + ["fail"] * 5)
    sc = compare_suite(items, items, margin=0.05, confidence=0.95, samples=500, seed=0)
    assert (sc.delta, sc.ci_low, sc.ci_high) == (0.0, 0.0, 0.0)
    assert sc.mcnemar_p == 1.0
    assert sc.verdict == "non-inferior"
    assert sc.flipped_to_fail == sc.flipped_to_pass == []
    assert (sc.both_pass, sc.both_fail, sc.n_paired) == (95, 5, 100)


def test_a_large_drop_is_inferior_with_its_flips_listed() -> None:
    base = _items("core", ["pass"] * 200)
    cand = _items("core", ["fail"] * 40 + ["pass"] * 160)
    sc = compare_suite(cand, base, margin=0.05, confidence=0.95, samples=2000, seed=0)
    assert sc.delta == pytest.approx(-0.2)
    assert sc.ci_high is not None and sc.ci_high < -0.05
    assert sc.verdict == "inferior"
    assert sc.mcnemar_p == pytest.approx(2 * 0.5**40)
    assert sc.flipped_to_fail == [f"i{k:04d}" for k in range(40)]
    flip = sc.flips[0]
    assert flip.direction == "pass->fail"
    assert flip.vars == {"question": "q0?"}
    assert flip.expected == "exp0"
    assert (flip.baseline_output, flip.candidate_output) == ("out-pass-0", "out-fail-0")


def test_a_small_suite_with_a_few_flips_is_inconclusive() -> None:
    base = _items("core", ["pass"] * 20)
    cand = _items("core", ["fail"] * 2 + ["pass"] * 18)
    sc = compare_suite(cand, base, margin=0.05, confidence=0.95, samples=2000, seed=0)
    assert sc.verdict == "inconclusive"
    assert sc.mcnemar_p == pytest.approx(0.5)


def test_flips_both_ways_cancel_in_the_delta_but_not_in_mcnemar() -> None:
    base = _items("core", ["pass"] * 10 + ["fail"] * 10 + ["pass"] * 80)
    cand = _items("core", ["fail"] * 10 + ["pass"] * 10 + ["pass"] * 80)
    sc = compare_suite(cand, base, margin=0.05, confidence=0.95, samples=500, seed=0)
    assert sc.delta == 0.0
    assert len(sc.flipped_to_fail) == len(sc.flipped_to_pass) == 10
    assert sc.mcnemar_p == 1.0
    assert {f.direction for f in sc.flips} == {"pass->fail", "fail->pass"}


def test_error_items_are_left_out_of_pairing_and_counted() -> None:
    base = _items("core", ["pass", "error", "pass", "fail"])
    cand = _items("core", ["error", "pass", "fail", "fail"])
    sc = compare_suite(cand, base, margin=0.05, confidence=0.95, samples=200, seed=0)
    assert sc.n_paired == 2
    assert sc.excluded_errors == 2
    assert (sc.errors_baseline, sc.errors_candidate) == (1, 1)
    assert sc.flipped_to_fail == ["i0002"]
    assert sc.baseline_pass_rate == 0.5
    assert sc.candidate_pass_rate == 0.0


def test_ids_on_one_side_only_are_counted_not_paired() -> None:
    base = _items("core", ["pass"] * 3)
    cand = _items("core", ["pass"] * 3) + _items("core", ["fail"], prefix="new")
    sc = compare_suite(cand, base, margin=0.05, confidence=0.95, samples=200, seed=0)
    assert (sc.n_paired, sc.unpaired) == (3, 1)


def test_nothing_paired_is_inconclusive_without_statistics() -> None:
    sc = compare_suite(
        _items("core", ["error"] * 3),
        _items("core", ["pass"] * 3),
        margin=0.05,
        confidence=0.95,
        samples=200,
        seed=0,
    )
    assert (sc.n_paired, sc.delta, sc.mcnemar_p, sc.verdict) == (0, None, None, "inconclusive")


def test_graded_judge_scores_get_their_own_delta() -> None:
    base = _items("core", ["pass"] * 10)
    cand = [i.model_copy(update={"score": 0.5}) for i in _items("core", ["pass"] * 10)]
    sc = compare_suite(cand, base, margin=0.05, confidence=0.95, samples=200, seed=0)
    assert sc.delta == 0.0
    assert sc.score_delta == pytest.approx(-0.5)


# ---- compare(): suites, manifest settings, noise ---------------------------------------


def test_compare_uses_the_manifests_margin_seed_and_reports_the_worst_verdict(
    tmp_path: Path,
) -> None:
    noise = Noise(
        runs=2,
        suites={
            "core": SuiteNoise(
                runs=2,
                pass_rates=[0.8, 0.79],
                spread=0.01,
                flip_rate=0.01,
                max_flip_rate=0.01,
                flipped_ids=["i0001"],
                compared=200,
            )
        },
    )
    base = _result(
        _items("core", ["pass"] * 200) + _items("edge", ["pass"] * 50, prefix="e"),
        release_id="b" * 64,
        name="base",
    )
    cand = _result(
        _items("core", ["fail"] * 40 + ["pass"] * 160)
        + _items("edge", ["pass"] * 50, prefix="e")
        + _items("extra", ["pass"], prefix="x"),
        release_id="c" * 64,
        name="cand",
        noise=noise,
    )
    c = compare(cand, base, _lm(tmp_path, seed=7, samples=500, margin=0.30))
    assert c.suites["core"].margin == 0.30
    assert c.suites["core"].verdict == "non-inferior"  # -0.2 is within a 0.30 margin
    assert c.suites["edge"].verdict == "non-inferior"
    assert (c.seed, c.bootstrap_samples) == (7, 500)
    assert c.missing_suites == ["extra"]
    assert any("extra" in w for w in c.warnings)
    assert c.suites["core"].candidate_noise == noise.suites["core"]
    assert c.suites["core"].baseline_noise is None
    assert c.suites["core"].same_suite_file is True

    strict = compare(cand, base, _lm(tmp_path, margin=0.05))
    assert strict.suites["core"].verdict == "inferior"
    assert strict.verdict == "inferior"


def test_compare_is_reproducible(tmp_path: Path) -> None:
    base = _result(_items("core", ["pass"] * 60 + ["fail"] * 40), release_id="b", name="b")
    cand = _result(_items("core", ["pass"] * 50 + ["fail"] * 50), release_id="c", name="c")
    one = compare(cand, base, _lm(tmp_path))
    two = compare(cand, base, _lm(tmp_path))
    assert one.model_dump() == two.model_dump()


# ---- the report ------------------------------------------------------------------------


def _bench(path: Path, *, release_id: str, ttft: float, knee: bool = True) -> Path:
    point = {
        "load": 16,
        "mode": "concurrency",
        "request_throughput": 12.5,
        "output_token_throughput": 600.0,
        "goodput": 12.0,
        "ttft": {"p50": ttft / 2, "p95": ttft},
        "e2e": {"p95": 2.5},
        "tpot": {"p95": 0.04},
    }
    data = {"release_id": release_id, "points": [point], "knee": point if knee else None}
    path.write_text(json.dumps(data))
    return path


def _comparison(tmp_path: Path) -> Comparison:
    base = _result(_items("core", ["pass"] * 200), release_id="b" * 64, name="demo-bf16")
    cand_items = _items("core", ["fail"] * 40 + ["pass"] * 160)
    cand_items[0] = cand_items[0].model_copy(update={"output": "<script>alert(1)</script> | x"})
    cand = _result(cand_items, release_id="c" * 64, name="demo-damaged")
    return compare(cand, base, _lm(tmp_path))


def test_report_writes_the_contracted_compare_json(tmp_path: Path) -> None:
    out = tmp_path / "report"
    write_report(_comparison(tmp_path), out)
    data = json.loads((out / "compare.json").read_text())
    assert data["baseline_release_id"] == "b" * 64
    assert data["candidate_release_id"] == "c" * 64
    core = data["suites"]["core"]
    for key in ("delta", "ci_low", "ci_high", "mcnemar_p", "flipped_to_fail", "flipped_to_pass",
                "margin", "verdict"):  # fmt: skip
        assert key in core
    assert core["verdict"] == "inferior"
    assert len(core["flipped_to_fail"]) == 40


def test_markdown_report_leads_with_the_verdict_and_shows_flipped_items(tmp_path: Path) -> None:
    out = tmp_path / "report"
    write_report(_comparison(tmp_path), out)
    md = (out / "report.md").read_text()
    head = md[: md.index("## Run-to-run noise")]
    assert "**Verdict: INFERIOR**" in head
    assert "| core | **inferior** | 100.0% | 80.0% | -20.0 [" in head
    assert "## Flipped items" in md
    assert '| i0001 | question="q1?" | exp1 | `out-pass-1` | `out-fail-1` |' in md
    assert "first 25 shown" in md
    assert "\\| x" in md  # a pipe in an output cannot break the table
    assert "not measured" in md  # no noise runs in these results


def test_html_report_escapes_model_output(tmp_path: Path) -> None:
    out = tmp_path / "report"
    write_report(_comparison(tmp_path), out)
    html = (out / "report.html").read_text()
    assert "<script>alert" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert 'class="v inferior"' in html


def test_report_shows_bench_side_by_side_at_the_knee(tmp_path: Path) -> None:
    out = tmp_path / "report"
    write_report(
        _comparison(tmp_path),
        out,
        candidate_bench=_bench(tmp_path / "c.json", release_id="c", ttft=0.25),
        baseline_bench=_bench(tmp_path / "b.json", release_id="b", ttft=0.125, knee=False),
    )
    md = (out / "report.md").read_text()
    assert "## Load test at the knee" in md
    assert "| knee load | no knee (SLOs fail at every load) | 16 (concurrency) |" in md
    assert "| TTFT p95 at the knee | n/a | 0.250 s |" in md
    assert "| output tokens/s | n/a | 600.0 |" in md
    assert "Load test at the knee" in (out / "report.html").read_text()


def test_a_missing_or_broken_bench_file_is_a_clear_error(tmp_path: Path) -> None:
    from releasekit.errors import EvalError, InputMissingError

    with pytest.raises(InputMissingError, match="bench result"):
        write_report(_comparison(tmp_path), tmp_path / "r", candidate_bench=tmp_path / "no.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(EvalError, match="unreadable bench result"):
        write_report(_comparison(tmp_path), tmp_path / "r", candidate_bench=bad)
