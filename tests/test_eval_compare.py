"""Paired comparison and the report, on results built with the runner's own models and
known answers: errors count as failures, small or one-sided evidence fails, the interval
matches published and independent computations, evidence is read back strictly."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from scipy.stats import binomtest, norm

from releasekit.errors import EvalError, InputMissingError
from releasekit.evaluate import Comparison, EvalResult, ItemResult, compare, write_report
from releasekit.evaluate.compare import (
    VERDICT_ORDER,
    EvidenceError,
    SuiteComparison,
    Verdict,
    compare_suite,
    interval_verdict,
    load_comparison,
    mcnemar_exact,
    more_errors_p,
    newcombe_paired_interval,
    paired_bootstrap,
    wilson_interval,
)
from releasekit.evaluate.runner import (
    Noise,
    SuiteNoise,
    load_result,
    summarise,
    write_outputs,
)
from releasekit.evaluate.suites import LoadedSuite
from releasekit.spec.manifest import LoadedManifest, Suite, parse_manifest

Z95 = float(norm.ppf(0.975))


def _lm(
    tmp_path: Path,
    *,
    seed: int = 0,
    samples: int = 2000,
    margin: float = 0.05,
    suites: tuple[str, ...] = ("core", "edge"),
) -> LoadedManifest:
    defs = {
        "core": {"name": "core", "kind": "core", "path": "core.jsonl", "margin": margin},
        "edge": {"name": "edge", "kind": "edge", "path": "edge.jsonl", "scorer": "refusal"},
    }
    data = {
        "apiVersion": "releasekit/v1",
        "name": "cand",
        "model": {"source": "models/x"},
        "prompts": {"user": {"file": "u.txt"}},
        "eval": {
            "suites": [defs[s] for s in suites],
            "seed": seed,
            "bootstrap_samples": samples,
            "confidence": 0.95,
        },
        "load": {"profile": "p.yaml"},
    }
    m = parse_manifest(data, path=tmp_path / "m.yaml")
    return LoadedManifest(path=tmp_path / "m.yaml", base=tmp_path, manifest=m)


def _items(
    suite: str, outcomes: list[str], *, prefix: str = "i", expect_error: bool = False
) -> list[ItemResult]:
    return [
        ItemResult(
            id=f"{prefix}{k:04d}",
            suite=suite,
            scorer="exact_match",
            outcome=o,  # type: ignore[arg-type]
            score=None if o == "error" else float(o == "pass"),
            output=None if o == "error" else f"out-{o}-{k}",
            expected=f"exp{k}",
            vars={"question": f"q{k}?"},
            expect_error=expect_error,
            error="request timed out after 120s" if o == "error" else None,
        )
        for k, o in enumerate(outcomes)
    ]


def _result(
    items: list[ItemResult],
    *,
    release_id: str,
    name: str,
    noise: Noise | None = None,
    digests: dict[str, str] | None = None,
) -> EvalResult:
    """An EvalResult as run_eval builds it: summaries from the runner's `summarise`."""
    suites = {}
    for s in dict.fromkeys(i.suite for i in items):
        kind = s if s in ("core", "edge", "regression") else "regression"
        suite = Suite(name=s, kind=kind, path=Path(f"{s}.jsonl"), margin=0.05)
        digest = (digests or {}).get(s, "d" * 64)
        ls = LoadedSuite(suite=suite, path=suite.path, digest=digest, items=[])
        suites[s] = summarise([i for i in items if i.suite == s], ls)
    return EvalResult(release_id=release_id, name=name, suites=suites, items=items, noise=noise)


def _sc(cand: list[ItemResult], base: list[ItemResult], **kw: object) -> SuiteComparison:
    args: dict[str, object] = {"margin": 0.05, "confidence": 0.95, "samples": 500, "seed": 0}
    args.update(kw)
    return compare_suite(cand, base, **args)  # type: ignore[arg-type]


# ---- McNemar and the error test ------------------------------------------------------


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
    """The exact McNemar p is the two-sided binomial tail on the discordant pairs."""
    assert mcnemar_exact(b, c) == pytest.approx(p, rel=1e-12)
    if b + c:
        assert mcnemar_exact(b, c) == pytest.approx(binomtest(b, b + c, 0.5).pvalue)


def test_more_errors_p_is_the_one_sided_binomial_tail() -> None:
    """P(X >= x), X ~ Bin(x + y, 1/2): 5 candidate-only errors, 0 baseline-only -> 1/32."""
    assert more_errors_p(5, 0) == pytest.approx(1 / 32)
    assert more_errors_p(0, 5) == pytest.approx(1.0)
    assert more_errors_p(0, 0) == 1.0
    assert more_errors_p(3, 1) == pytest.approx(5 / 16)  # (C(4,3) + C(4,4)) / 16


# ---- the interval ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("table", "low", "high"),
    [
        # Newcombe (1998), Statistics in Medicine 17:2635, Table II, method 10.
        ((36, 12, 2, 0), 0.0569, 0.3404),
        ((18, 12, 2, 18), 0.0562, 0.3290),
        ((53, 0, 0, 1), -0.0729, 0.0729),
        ((0, 30, 0, 0), 0.8395, 1.0),
        # Cavo et al. (2012) in Fagerland, Lydersen & Laake, "Statistical Analysis of
        # Contingency Tables", ch. 8: Newcombe square-and-add -0.1186 to -0.0046.
        ((59, 6, 16, 80), -0.1186, -0.0046),
    ],
)
def test_newcombe_interval_reproduces_published_values(
    table: tuple[int, int, int, int], low: float, high: float
) -> None:
    """Method 10 (hybrid score, phi-corrected) gives the published limits to 4 places."""
    lo, hi = newcombe_paired_interval(*table, confidence=0.95)
    assert lo == pytest.approx(low, abs=5e-5)
    assert hi == pytest.approx(high, abs=5e-5)


def test_wilson_interval_matches_the_closed_form() -> None:
    """Wilson's limits for 0/n and n/n are [0, z²/(n+z²)] and [n/(n+z²), 1]."""
    n = 20
    assert wilson_interval(0, n, confidence=0.95) == pytest.approx((0.0, Z95**2 / (n + Z95**2)))
    assert wilson_interval(n, n, confidence=0.95) == pytest.approx((n / (n + Z95**2), 1.0))
    with pytest.raises(ValueError):
        wilson_interval(3, 2, confidence=0.95)


def _tango_statistic(delta: float, b: int, c: int, n: int) -> float:
    """Tango's (1998) score statistic for H0: p12 - p21 = delta, with the restricted MLE of
    p21 from the quadratic in Tango's paper; written here from the formula, independently of
    the module."""
    qa = 2 * n
    qb = -b - c + (2 * n - b + c) * delta
    qc = -c * delta * (1 - delta)
    p21 = (math.sqrt(max(qb * qb - 4 * qa * qc, 0.0)) - qb) / (2 * qa)
    num = b - c - n * delta
    var = n * (2 * p21 + delta * (1 - delta))
    if var <= 0:
        return 0.0 if abs(num) < 1e-12 else math.copysign(math.inf, num)
    return num / math.sqrt(var)


def _tango_brute_force(b: int, c: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The set {delta : |T(delta)| <= z}: scanned on a grid, the ends refined by bisection."""
    grid = np.linspace(-1.0, 1.0, 4001)
    inside = [i for i, d in enumerate(grid) if abs(_tango_statistic(d, b, c, n)) <= z]

    def refine(ok: float, bad: float) -> float:
        for _ in range(60):
            mid = (ok + bad) / 2
            ok, bad = (mid, bad) if abs(_tango_statistic(mid, b, c, n)) <= z else (ok, mid)
        return ok

    i0, i1 = inside[0], inside[-1]
    lo = grid[i0] if i0 == 0 else refine(grid[i0], grid[i0 - 1])
    hi = grid[i1] if i1 == len(grid) - 1 else refine(grid[i1], grid[i1 + 1])
    return float(lo), float(hi)


@pytest.mark.parametrize("n", [1, 2, 5, 10, 30, 77, 240])
def test_with_no_flips_the_interval_is_as_wide_as_the_score_test_says(n: int) -> None:
    """n items all passing on both sides: the interval is ±z²/(n+z²) (wide at small n, never
    [0, 0]) and equals Tango's score interval found by brute force."""
    lo, hi = newcombe_paired_interval(n, 0, 0, 0, confidence=0.95)
    half = Z95**2 / (n + Z95**2)
    assert (lo, hi) == pytest.approx((-half, half), abs=1e-12)
    t_lo, t_hi = _tango_brute_force(0, 0, n)
    assert (lo, hi) == pytest.approx((t_lo, t_hi), abs=1e-6)
    if n == 1:
        assert hi - lo > 1.5


@pytest.mark.parametrize(
    "table",
    [(1, 1, 7, 12), (59, 6, 16, 80), (36, 12, 2, 0), (225, 3, 3, 9), (220, 2, 8, 10),
     (38, 0, 1, 1), (20, 0, 180, 0), (0, 20, 0, 180), (180, 0, 0, 20)],
)  # fmt: skip
def test_the_interval_agrees_with_an_independent_tango_interval(
    table: tuple[int, int, int, int],
) -> None:
    """Newcombe's and Tango's score intervals are different constructions of the same
    idea: away from the boundary they agree within 0.02 on every table tried."""
    a, b, c, d = table
    lo, hi = newcombe_paired_interval(a, b, c, d, confidence=0.95)
    t_lo, t_hi = _tango_brute_force(b, c, a + b + c + d)
    assert lo <= (b - c) / (a + b + c + d) <= hi
    assert abs(lo - t_lo) < 0.02 and abs(hi - t_hi) < 0.02


def test_the_interval_covers_the_true_delta_at_about_its_confidence() -> None:
    """Pairs with P(both pass)=.80, P(both fail)=.08, P(pass->fail)=.09, P(fail->pass)=.03
    (true delta -0.06): the 95% interval covers it in 93-98% of 2000 suites of 60 items."""
    rng = np.random.default_rng(2024)
    covered = 0
    reps = 2000
    for _ in range(reps):
        a, d, c, b = rng.multinomial(60, [0.80, 0.08, 0.09, 0.03])
        lo, hi = newcombe_paired_interval(a, b, c, d, confidence=0.95)
        covered += lo <= -0.06 <= hi
    assert 0.93 <= covered / reps <= 0.98


# ---- verdicts --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lo", "hi", "verdict"),
    [
        (-0.04, 0.02, Verdict.NON_INFERIOR),
        (0.01, 0.05, Verdict.SUPERIOR),
        (-0.20, -0.06, Verdict.INFERIOR),
        (-0.08, 0.01, Verdict.INCONCLUSIVE),
        (-0.05, 0.0, Verdict.INCONCLUSIVE),  # touching -margin is not above it
        (-0.09, -0.05, Verdict.INCONCLUSIVE),  # nor below it
    ],
)
def test_the_interval_verdict_compares_the_ci_with_minus_margin(
    lo: float, hi: float, verdict: Verdict
) -> None:
    """Lower bound above -margin: non-inferior (above 0: superior); upper below: inferior."""
    assert interval_verdict(lo, hi, 0.05) is verdict


def test_only_non_inferior_and_superior_pass_a_gate() -> None:
    """`Verdict.passed` is True for exactly two verdicts; every other one fails a gate."""
    assert {v for v in Verdict if v.passed} == {Verdict.NON_INFERIOR, Verdict.SUPERIOR}
    assert set(VERDICT_ORDER) == set(Verdict)
    assert Verdict("non_inferior") is Verdict.NON_INFERIOR


def test_a_candidate_that_errors_on_most_items_is_not_non_inferior() -> None:
    """180 errors and 20 passes against 200 passes: errors are failures, so the suite is
    inferior, the error regression is flagged, and nothing about it passes."""
    base = _items("core", ["pass"] * 200)
    cand = _items("core", ["pass"] * 20 + ["error"] * 180)
    sc = _sc(cand, base)
    assert sc.verdict is Verdict.INFERIOR and not sc.passed
    assert sc.n_paired == 200
    assert sc.delta == pytest.approx(-0.9)
    assert sc.ci_high is not None and sc.ci_high < -0.05
    assert sc.error_regression and sc.errors_only_candidate == 180
    assert sc.candidate is not None and sc.baseline is not None
    assert (sc.candidate.passed, sc.candidate.failed, sc.candidate.errors) == (20, 0, 180)
    assert sc.candidate.error_rate == pytest.approx(0.9) and sc.baseline.error_rate == 0.0
    assert len(sc.flipped_to_fail) == 180
    assert sc.flips[-1].candidate_output == "request timed out after 120s"
    assert any("errors on 180/200" in r for r in sc.reasons)


def test_more_errors_than_the_baseline_fail_even_when_pass_rates_match() -> None:
    """The candidate errors on 20 items the baseline failed anyway: the pass rates are
    equal (non-inferior by the interval) but the error rate rose: error_regression."""
    base = _items("core", ["pass"] * 180 + ["fail"] * 20)
    cand = _items("core", ["pass"] * 180 + ["error"] * 20)
    sc = _sc(cand, base)
    assert sc.delta == 0.0 and sc.interval_verdict is Verdict.NON_INFERIOR
    assert sc.error_regression_p == pytest.approx(0.5**20)
    assert sc.verdict is Verdict.ERROR_REGRESSION and not sc.passed


def test_an_error_or_two_within_noise_is_not_an_error_regression() -> None:
    """Two candidate-only errors among 200 items (one-sided p = 0.25) are failures in the
    pass rate but no error regression."""
    base = _items("core", ["pass"] * 200)
    cand = _items("core", ["error"] * 2 + ["pass"] * 198)
    sc = _sc(cand, base)
    assert not sc.error_regression and sc.error_regression_p == pytest.approx(0.25)
    assert sc.verdict is Verdict.NON_INFERIOR
    assert sc.candidate_pass_rate == pytest.approx(0.99)


def test_items_that_expect_an_error_pass_when_they_error() -> None:
    """An error on an `expect_error` item is a pass on both sides: no flip, no error count,
    counted as an expected error."""
    base = _items("edge", ["pass"] * 40, expect_error=True)
    cand = _items("edge", ["error"] * 40, expect_error=True)
    sc = _sc(cand, base, margin=0.10)
    assert sc.candidate is not None
    assert (sc.candidate.passed, sc.candidate.errors, sc.candidate.expected_errors) == (40, 0, 40)
    assert sc.candidate_pass_rate == 1.0 and sc.flips == []
    assert not sc.error_regression
    assert sc.verdict is Verdict.NON_INFERIOR


def test_a_one_item_suite_is_insufficient_evidence() -> None:
    """One paired item, no flip: the interval is wide and the verdict is
    insufficient_evidence, which fails a gate."""
    sc = _sc(_items("core", ["pass"]), _items("core", ["pass"]))
    assert sc.verdict is Verdict.INSUFFICIENT_EVIDENCE and not sc.passed
    assert sc.ci_low is not None and sc.ci_low < -0.7
    assert sc.ci_high is not None and sc.ci_high > 0.7
    assert any("only 1 paired items" in r for r in sc.reasons)


def test_the_minimum_paired_items_is_configurable_and_inferior_still_wins() -> None:
    """29 identical items fail the default minimum of 30; the same pass at min_paired=10
    only if the interval allows; a clear drop on few items is still inferior."""
    base = _items("core", ["pass"] * 29)
    assert _sc(base, base).verdict is Verdict.INSUFFICIENT_EVIDENCE
    assert _sc(base, base, min_paired=10, margin=0.20).verdict is Verdict.NON_INFERIOR
    drop = _sc(_items("core", ["fail"] * 20 + ["pass"] * 9), base, min_paired=30)
    assert drop.verdict is Verdict.INFERIOR


def test_identical_results_on_enough_items_are_non_inferior_with_an_honest_interval() -> None:
    """100 items, 95 pass on both sides: delta 0, McNemar 1, interval narrower than the
    margin but not [0, 0]."""
    items = _items("core", ["pass"] * 95 + ["fail"] * 5)
    sc = _sc(items, items)
    assert sc.delta == 0.0 and sc.mcnemar_p == 1.0
    assert sc.ci_low is not None and -0.05 < sc.ci_low < 0
    assert sc.ci_high is not None and sc.ci_high > 0
    assert sc.verdict is Verdict.NON_INFERIOR and sc.passed
    assert (sc.both_pass, sc.both_fail, sc.n_paired) == (95, 5, 100)


def test_a_large_drop_is_inferior_with_its_flips_listed() -> None:
    """40 pass->fail flips of 200: inferior, exact McNemar p, flips carry both answers."""
    base = _items("core", ["pass"] * 200)
    cand = _items("core", ["fail"] * 40 + ["pass"] * 160)
    sc = _sc(cand, base)
    assert sc.delta == pytest.approx(-0.2)
    assert sc.verdict is Verdict.INFERIOR
    assert sc.mcnemar_p == pytest.approx(2 * 0.5**40)
    assert sc.flipped_to_fail == [f"i{k:04d}" for k in range(40)]
    flip = sc.flips[0]
    assert flip.direction == "pass->fail"
    assert flip.vars == {"question": "q0?"}
    assert flip.expected == "exp0"
    assert (flip.baseline_output, flip.candidate_output) == ("out-pass-0", "out-fail-0")


def test_flips_both_ways_cancel_in_the_delta_but_not_in_mcnemar() -> None:
    """10 flips each way: delta 0, McNemar 1, both directions listed."""
    base = _items("core", ["pass"] * 10 + ["fail"] * 10 + ["pass"] * 80)
    cand = _items("core", ["fail"] * 10 + ["pass"] * 10 + ["pass"] * 80)
    sc = _sc(cand, base)
    assert sc.delta == 0.0
    assert len(sc.flipped_to_fail) == len(sc.flipped_to_pass) == 10
    assert sc.mcnemar_p == 1.0
    assert {f.direction for f in sc.flips} == {"pass->fail", "fail->pass"}


def test_ids_on_one_side_only_are_missing_evidence() -> None:
    """An item the baseline lacks means the two evals did not cover the same items."""
    base = _items("core", ["pass"] * 40)
    cand = base + _items("core", ["fail"], prefix="new")
    sc = _sc(cand, base)
    assert sc.verdict is Verdict.MISSING_EVIDENCE and sc.unpaired == 1
    assert sc.delta is None and sc.ci_low is None


def test_graded_judge_scores_get_their_own_delta() -> None:
    """Judge scores of 0.5 on passing items move the score delta, not the pass delta."""
    base = _items("core", ["pass"] * 40)
    cand = [i.model_copy(update={"score": 0.5}) for i in _items("core", ["pass"] * 40)]
    sc = _sc(cand, base)
    assert sc.delta == 0.0
    assert sc.score_delta == pytest.approx(-0.5)


def test_the_score_bootstrap_is_deterministic_for_a_seed() -> None:
    """Same seed, same interval; another seed, another interval around the same mean."""
    rng = np.random.default_rng(1)
    a = rng.integers(0, 2, 150).astype(float)
    b = rng.integers(0, 2, 150).astype(float)
    one = paired_bootstrap(a, b, samples=500, confidence=0.95, seed=3)
    assert one == paired_bootstrap(a, b, samples=500, confidence=0.95, seed=3)
    other = paired_bootstrap(a, b, samples=500, confidence=0.95, seed=4)
    assert one[0] == other[0] and one[1:] != other[1:]
    with pytest.raises(ValueError, match="equal-length"):
        paired_bootstrap([1.0, 0.0], [1.0], samples=100, confidence=0.95, seed=0)


# ---- compare(): suites, files, manifest settings ---------------------------------------


def test_compare_uses_the_manifests_margin_and_reports_the_worst_verdict(
    tmp_path: Path,
) -> None:
    """Margins come from the candidate's manifest; the comparison takes the worst suite."""
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
        _items("core", ["pass"] * 200) + _items("edge", ["pass"] * 100, prefix="e"),
        release_id="b" * 64,
        name="base",
    )
    cand = _result(
        _items("core", ["fail"] * 40 + ["pass"] * 160) + _items("edge", ["pass"] * 100, prefix="e"),
        release_id="c" * 64,
        name="cand",
        noise=noise,
    )
    c = compare(cand, base, _lm(tmp_path, seed=7, samples=500, margin=0.30))
    assert c.suites["core"].margin == 0.30
    assert c.suites["core"].verdict is Verdict.NON_INFERIOR  # -0.2 is within 0.30
    assert c.suites["edge"].verdict is Verdict.NON_INFERIOR
    assert c.verdict is Verdict.NON_INFERIOR and c.passed
    assert (c.seed, c.bootstrap_samples, c.min_paired) == (7, 500, 30)
    assert c.suites["core"].candidate_noise == noise.suites["core"]
    assert c.suites["core"].baseline_noise is None
    assert c.suites["core"].same_suite_file is True

    strict = compare(cand, base, _lm(tmp_path, margin=0.05))
    assert strict.suites["core"].verdict is Verdict.INFERIOR
    assert strict.verdict is Verdict.INFERIOR and not strict.passed
    assert strict.failing_suites() == ["core"]


@pytest.mark.parametrize("side", ["candidate", "baseline"])
def test_a_suite_evaluated_on_one_side_only_is_missing_evidence(tmp_path: Path, side: str) -> None:
    """A suite on one side only gets a verdict (missing_evidence) that fails the whole
    comparison, instead of being left out."""
    both = _items("core", ["pass"] * 100)
    extra = _items("edge", ["pass"] * 50, prefix="e")
    full = _result(both + extra, release_id="f", name="full")
    part = _result(both, release_id="p", name="part")
    cand, base = (full, part) if side == "candidate" else (part, full)
    c = compare(cand, base, _lm(tmp_path))
    assert c.suites["core"].verdict is Verdict.NON_INFERIOR
    assert c.suites["edge"].verdict is Verdict.MISSING_EVIDENCE
    assert c.suites["edge"].reasons == [f"suite evaluated for the {side} only"]
    assert c.missing_suites == ["edge"]
    assert c.verdict is Verdict.MISSING_EVIDENCE and not c.passed


def test_a_suite_the_manifest_names_but_nobody_evaluated_is_missing_evidence(
    tmp_path: Path,
) -> None:
    """The candidate's manifest names `edge`; neither eval ran it: missing_evidence."""
    r = _result(_items("core", ["pass"] * 100), release_id="r", name="r")
    c = compare(r, r, _lm(tmp_path))
    assert c.suites["edge"].verdict is Verdict.MISSING_EVIDENCE
    assert not c.passed


def test_a_suite_built_from_a_different_file_is_missing_evidence(tmp_path: Path) -> None:
    """Same suite name, different sha256: the items are not comparable, no statistics."""
    items = _items("core", ["pass"] * 100)
    base = _result(items, release_id="b", name="b", digests={"core": "a" * 64})
    cand = _result(items, release_id="c", name="c", digests={"core": "b" * 64})
    lm = _lm(tmp_path, suites=("core",))
    sc = compare(cand, base, lm).suites["core"]
    assert sc.verdict is Verdict.MISSING_EVIDENCE and sc.same_suite_file is False
    assert sc.delta is None and sc.ci_low is None
    assert "different suite files" in sc.reasons[0]
    unknown = _result(items, release_id="c", name="c", digests={"core": ""})
    sc = compare(unknown, base, lm).suites["core"]
    assert sc.verdict is Verdict.MISSING_EVIDENCE
    assert "no suite-file digest recorded for the candidate" in sc.reasons


def test_item_records_that_disagree_with_the_summary_are_missing_evidence(
    tmp_path: Path,
) -> None:
    """A candidate whose items.jsonl lost its 180 error records (20 passes left) does not
    pass on what is left: its summary still counts 200 items."""
    base = _result(_items("core", ["pass"] * 200), release_id="b", name="b")
    cand = _result(
        _items("core", ["pass"] * 20 + ["error"] * 180), release_id="c", name="c"
    ).model_copy()
    cand = cand.model_copy(update={"items": [i for i in cand.items if i.outcome == "pass"]})
    sc = compare(cand, base, _lm(tmp_path, suites=("core",))).suites["core"]
    assert sc.verdict is Verdict.MISSING_EVIDENCE
    assert any("summary says n=200" in r for r in sc.reasons)


def test_compare_is_reproducible(tmp_path: Path) -> None:
    """The same inputs give the same comparison, field for field."""
    base = _result(_items("core", ["pass"] * 60 + ["fail"] * 40), release_id="b", name="b")
    cand = _result(_items("core", ["pass"] * 50 + ["fail"] * 50), release_id="c", name="c")
    lm = _lm(tmp_path, suites=("core",))
    assert compare(cand, base, lm).model_dump() == compare(cand, base, lm).model_dump()


def test_compare_works_on_results_read_back_from_disk(tmp_path: Path) -> None:
    """eval.json + items.jsonl written by the runner and read back compare like the
    in-memory results."""
    base = _result(_items("core", ["pass"] * 200), release_id="b", name="b")
    cand = _result(_items("core", ["pass"] * 20 + ["error"] * 180), release_id="c", name="c")
    write_outputs(base, tmp_path / "b")
    write_outputs(cand, tmp_path / "c")
    lm = _lm(tmp_path, suites=("core",))
    disk = compare(load_result(tmp_path / "c"), load_result(tmp_path / "b"), lm)
    assert disk.model_dump() == compare(cand, base, lm).model_dump()
    assert disk.verdict is Verdict.INFERIOR


def test_a_malformed_item_line_is_an_error_not_a_pass(tmp_path: Path) -> None:
    """An item record whose outcome the runner never writes is rejected on load."""
    r = _result(_items("core", ["pass"] * 3), release_id="r", name="r")
    write_outputs(r, tmp_path)
    lines = (tmp_path / "items.jsonl").read_text().splitlines()
    lines[1] = lines[1].replace('"outcome":"pass"', '"outcome":"passed"')
    (tmp_path / "items.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(EvalError, match=r"items.jsonl:2: unreadable item record"):
        load_result(tmp_path)


# ---- compare.json read back ------------------------------------------------------------


def _comparison(tmp_path: Path) -> Comparison:
    base = _result(_items("core", ["pass"] * 200), release_id="b" * 64, name="demo-bf16")
    cand_items = _items("core", ["fail"] * 40 + ["pass"] * 160)
    cand_items[0] = cand_items[0].model_copy(update={"output": "<script>alert(1)</script> | x"})
    cand = _result(cand_items, release_id="c" * 64, name="demo-damaged")
    return compare(cand, base, _lm(tmp_path, suites=("core",)))


def test_compare_json_reads_back_to_the_same_comparison(tmp_path: Path) -> None:
    """load_comparison(write_report(...)) is the comparison that was written."""
    c = _comparison(tmp_path)
    write_report(c, tmp_path / "report")
    assert load_comparison(tmp_path / "report") == c
    assert load_comparison(tmp_path / "report" / "compare.json").verdict is Verdict.INFERIOR


def _edited(tmp_path: Path, edit: object) -> Path:
    write_report(_comparison(tmp_path), tmp_path / "report")
    path = tmp_path / "report" / "compare.json"
    data = json.loads(path.read_text())
    edit(data)  # type: ignore[operator]
    path.write_text(json.dumps(data))
    return path


def _claim_non_inferior(d: dict[str, Any]) -> None:
    """Edit an inferior comparison to say non_inferior throughout."""
    d["verdict"] = "non_inferior"
    d["suites"]["core"]["verdict"] = "non_inferior"


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        (lambda d: d.update(verdict="non-inferior"), "verdict"),
        (lambda d: d["suites"]["core"].update(verdict="pass"), "suites.core.verdict"),
        (lambda d: d["suites"]["core"].update(verdikt="inferior"), "unknown field"),
        (lambda d: d.update(verdict="non_inferior"), "not the worst suite verdict"),
        (_claim_non_inferior, "contradicts"),
        (lambda d: d.pop("suites"), "suites: Field required"),
    ],
)  # fmt: skip
def test_a_compare_json_the_code_never_writes_is_rejected(
    tmp_path: Path, edit: object, problem: str
) -> None:
    """A verdict spelled another way, an unknown field, or a verdict its own numbers
    contradict is an EvidenceError on load, never a pass."""
    path = _edited(tmp_path, edit)
    with pytest.raises(EvidenceError, match=problem):
        load_comparison(path)


def test_a_missing_or_garbled_compare_json_is_a_clear_error(tmp_path: Path) -> None:
    """No file: InputMissingError; not JSON: EvidenceError naming the file."""
    with pytest.raises(InputMissingError, match=r"compare\.json"):
        load_comparison(tmp_path)
    (tmp_path / "compare.json").write_text("{not json")
    with pytest.raises(EvidenceError, match=r"compare\.json"):
        load_comparison(tmp_path / "compare.json")


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
    data = {
        "release_id": release_id,
        "points": [point],
        "knee": point if knee else None,
        "knee_stop": None if knee else "load 16 held in 1 of 3 runs (the rule needs 2)",
    }
    path.write_text(json.dumps(data))
    return path


def test_report_writes_the_contracted_compare_json(tmp_path: Path) -> None:
    """compare.json keeps the contracted per-suite keys, verdicts spelled as the enum."""
    out = tmp_path / "report"
    write_report(_comparison(tmp_path), out)
    data = json.loads((out / "compare.json").read_text())
    assert data["baseline_release_id"] == "b" * 64
    assert data["candidate_release_id"] == "c" * 64
    core = data["suites"]["core"]
    for key in ("delta", "ci_low", "ci_high", "mcnemar_p", "flipped_to_fail", "flipped_to_pass",
                "margin", "verdict", "n_paired", "baseline", "candidate", "reasons"):  # fmt: skip
        assert key in core
    assert core["verdict"] == "inferior" and data["verdict"] == "inferior"
    assert len(core["flipped_to_fail"]) == 40
    assert "passed" not in data  # a property, not a stored field


def test_markdown_report_shows_counts_interval_rule_and_flipped_items(tmp_path: Path) -> None:
    """The head shows the verdict, the rule in words, n paired, pass/fail/error per side,
    the delta with its interval, McNemar p and the verdict per suite."""
    out = tmp_path / "report"
    write_report(_comparison(tmp_path), out)
    md = (out / "report.md").read_text()
    head = md[: md.index("## Run-to-run noise")]
    assert "**Verdict: INFERIOR** (fails a gate)" in head
    assert (
        "non-inferior if the lower bound of the 95% interval of (candidate - baseline) "
        "pass rate is above -margin, with at least 30 paired items"
    ) in head
    assert "| core | **inferior** | 200 | 200/0/0 | 160/40/0 | 100.0% | 80.0% | -20.0 [" in head
    assert "| <0.001 | 0 (0.0%) → 0 (0.0%) |" in head
    assert "- **core: inferior**: the 95% interval's upper bound" in head
    assert "## Flipped items" in md
    assert '| i0001 | question="q1?" | exp1 | `out-pass-1` | `out-fail-1` |' in md
    assert "first 25 shown" in md
    assert "\\| x" in md  # a pipe in an output cannot break the table
    assert "not measured" in md  # no noise runs in these results


def test_report_names_missing_and_insufficient_evidence(tmp_path: Path) -> None:
    """A suite on one side only and a one-item suite appear with their verdicts and why."""
    base = _result(_items("core", ["pass"]), release_id="b", name="b")
    cand = _result(
        _items("core", ["pass"]) + _items("edge", ["pass"] * 40, prefix="e"),
        release_id="c",
        name="c",
    )
    write_report(compare(cand, base, _lm(tmp_path)), tmp_path / "r")
    md = (tmp_path / "r" / "report.md").read_text()
    assert "| core | **insufficient evidence** | 1 | 1/0/0 | 1/0/0 |" in md
    assert "| edge | **missing evidence** | 0 | not evaluated | 40/0/0 |" in md
    assert "- **edge: missing evidence**: suite evaluated for the candidate only" in md
    assert "only 1 paired items; a verdict needs at least 30" in md
    html = (tmp_path / "r" / "report.html").read_text()
    assert 'class="v missing_evidence"' in html


def test_html_report_escapes_model_output(tmp_path: Path) -> None:
    """Model output is escaped in HTML; the verdict is styled by its enum value."""
    out = tmp_path / "report"
    write_report(_comparison(tmp_path), out)
    html = (out / "report.html").read_text()
    assert "<script>alert" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert 'class="v inferior"' in html
    assert "Rule: A suite is non-inferior" in html


def test_report_shows_bench_side_by_side_at_the_knee(tmp_path: Path) -> None:
    """Bench JSONs, when given, add the knee figures side by side."""
    out = tmp_path / "report"
    write_report(
        _comparison(tmp_path),
        out,
        candidate_bench=_bench(tmp_path / "c.json", release_id="c", ttft=0.25),
        baseline_bench=_bench(tmp_path / "b.json", release_id="b", ttft=0.125, knee=False),
    )
    md = (out / "report.md").read_text()
    assert "## Load test at the knee" in md
    # Why there is no knee, with the numbers, not a guess.
    assert (
        "| knee load | no knee: load 16 held in 1 of 3 runs (the rule needs 2) "
        "| 16 (concurrency) |" in md
    )
    assert "| TTFT p95 at the knee | n/a | 0.250 s |" in md
    assert "| output tokens/s | n/a | 600.0 |" in md
    assert "Load test at the knee" in (out / "report.html").read_text()


def test_a_missing_or_broken_bench_file_is_a_clear_error(tmp_path: Path) -> None:
    """A bench file that is absent or not JSON is named in the error."""
    with pytest.raises(InputMissingError, match="bench result"):
        write_report(_comparison(tmp_path), tmp_path / "r", candidate_bench=tmp_path / "no.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(EvalError, match="unreadable bench result"):
        write_report(_comparison(tmp_path), tmp_path / "r", candidate_bench=bad)
