"""The live answer comparison's statistics: excess loss over the A/A floor, per stratum,
after the per-client cap; min pairs sized from the margin; judge failures never pass."""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from releasekit.errors import JudgeError
from releasekit.evaluate.answer_compare import ExactComparator, ScorerComparator
from releasekit.evaluate.answers import (
    AnswerPolicy,
    ComparedRequest,
    ComparisonKind,
    Judged,
    client_cap,
    detectable_excess,
    judge_answers,
    per_look_confidence,
    sized_min_pairs,
)

EXACT = ExactComparator()
POLICY = AnswerPolicy(max_excess=0.1, max_client_share=0.1)


def pair(
    seq: int,
    *,
    reference: str | None = "Muburg",
    judged: str | None = "Muburg",
    floor: str | None = "Muburg",
    client: str = "",
    sampled: bool = False,
    prompt: str | None = None,
) -> ComparedRequest:
    return ComparedRequest(
        seq=seq,
        client=client,
        sampled=sampled,
        reference=reference,
        judged=judged,
        floor=floor,
        has_floor=True,
        prompt=prompt,
        prompt_sha256=hashlib.sha256((prompt or f"p{seq}").encode()).hexdigest(),
    )


def clean(n: int, *, start: int = 0, **kw: Any) -> list[ComparedRequest]:
    return [pair(start + i, **kw) for i in range(n)]


def with_worse(n: int, every: int, *, start: int = 0, **kw: Any) -> list[ComparedRequest]:
    """n pairs whose judged answer differs on every `every`-th pair."""
    return [pair(start + i, judged="Paris" if i % every == 0 else "Muburg", **kw) for i in range(n)]


# ---- sizing and power ---------------------------------------------------------------


def test_sized_min_pairs_is_the_fewest_clean_pairs_that_pass() -> None:
    assert sized_min_pairs(0.1) == 27
    assert sized_min_pairs(0.05) > sized_min_pairs(0.1) > sized_min_pairs(0.2) >= 10
    # a schedule of looks judges each at a higher confidence: more pairs
    assert sized_min_pairs(0.1, confidence=per_look_confidence(0.95, 4)) > 27


def test_a_clean_comparison_passes_at_the_sized_minimum_and_not_before() -> None:
    n = sized_min_pairs(0.1)
    before = judge_answers(clean(n - 1), POLICY, EXACT)
    at = judge_answers(clean(n), POLICY, EXACT)
    assert before.verdict == "insufficient"
    assert at.verdict == "pass", at.reason
    assert at.min_pairs == n
    assert at.strata[0].high is not None and at.strata[0].high <= 0.1
    # even with min_pairs set lower, the interval itself needs that many clean pairs
    low_min = POLICY.model_copy(update={"min_pairs": 10})
    assert judge_answers(clean(n - 1), low_min, EXACT).verdict == "insufficient"


def test_detectable_excess_shrinks_as_pairs_grow() -> None:
    values = [detectable_excess(n, 0.1) for n in (10, 27, 50, 100, 400, 2000)]
    assert values == sorted(values, reverse=True)
    assert len(set(values)) == len(values)
    assert all(0.1 < v < 1 for v in values)
    assert detectable_excess(27, 1.0) == 1.0
    assert detectable_excess(27, 0.1, power=0.9) > detectable_excess(27, 0.1, power=0.8)


# ---- verdicts -----------------------------------------------------------------------


def test_a_third_of_answers_differing_breaches() -> None:
    verdict = judge_answers(with_worse(90, 3), POLICY, EXACT)
    assert verdict.verdict == "breach", verdict.reason
    greedy = verdict.strata[0]
    assert (greedy.pairs, greedy.worse, greedy.floor_worse) == (90, 30, 0)
    assert greedy.low is not None and greedy.low > 0.1
    assert verdict.worse_seqs == [0, 3, 6, 9, 12, 15, 18, 21, 24, 27]
    assert len(verdict.worse_prompts) == 10


def test_sampled_answers_that_always_differ_cancel_against_their_floor() -> None:
    pairs = [
        pair(i, reference=f"r{i}", judged=f"j{i}", floor=f"f{i}", sampled=True) for i in range(60)
    ]
    verdict = judge_answers(pairs, POLICY, EXACT)
    assert verdict.verdict == "pass", verdict.reason
    (sampled,) = verdict.strata
    assert sampled.stratum == "sampled"
    assert sampled.floor_rate == 1.0 and sampled.judged_rate == 1.0 and sampled.excess == 0


def test_each_stratum_is_judged_against_its_own_floor() -> None:
    greedy = with_worse(60, 2)  # 50% worse, floor 0: breach
    sampled = [
        pair(100 + i, reference=f"r{i}", judged=f"j{i}", floor=f"f{i}", sampled=True)
        for i in range(60)
    ]
    verdict = judge_answers(greedy + sampled, POLICY, EXACT)
    by = {s.stratum: s for s in verdict.strata}
    assert by["greedy"].verdict == "breach" and by["sampled"].verdict == "pass"
    assert verdict.verdict == "breach"


def test_a_stratum_short_of_pairs_holds_the_verdict_at_insufficient() -> None:
    pairs = clean(60) + clean(15, start=100, sampled=True)
    verdict = judge_answers(pairs, POLICY, EXACT)
    assert verdict.verdict == "insufficient"
    assert "sampled: 15 of 27 pairs" in verdict.reason
    # five clients cannot each stay within a 10% share: none of theirs counts
    few = judge_answers(clean(60) + clean(5, start=100, sampled=True), POLICY, EXACT)
    assert few.verdict == "insufficient"
    assert "sampled: no pairs counted: too few clients" in few.reason


def test_errors_count_as_differences_and_a_failed_reference_cancels() -> None:
    errored = [pair(i, judged=None) for i in range(40)]
    assert judge_answers(errored, POLICY, EXACT).verdict == "breach"
    no_reference = [pair(i, reference=None, judged=None) for i in range(40)]
    verdict = judge_answers(no_reference, POLICY, EXACT)
    assert verdict.verdict == "pass"
    assert verdict.strata[0].worse == verdict.strata[0].floor_worse == 40


def test_pairs_without_an_a_a_copy_are_not_counted() -> None:
    pairs = [p.model_copy(update={"has_floor": False}) for p in with_worse(50, 1)]
    verdict = judge_answers(pairs + clean(30, start=100), POLICY, EXACT)
    assert (verdict.seen, verdict.no_floor, verdict.pairs) == (80, 50, 30)
    assert verdict.verdict == "pass"
    assert judge_answers(pairs, POLICY, EXACT).verdict == "insufficient"


class _Failing:
    kind: ComparisonKind = "judge"

    def identity(self) -> dict[str, Any]:
        return {"kind": "judge", "endpoint": "http://127.0.0.1:9/v1"}

    def compare(self, reference: str, other: str, *, prompt: str | None) -> Judged:
        raise JudgeError("judge answered 'maybe'")


def test_a_comparator_that_cannot_judge_gives_not_judged_never_a_pass() -> None:
    verdict = judge_answers(
        clean(60), POLICY.model_copy(update={"comparison": "judge"}), _Failing()
    )
    assert verdict.verdict == "not_judged"
    assert "judge answered 'maybe'" in verdict.reason
    assert verdict.line().startswith("answers (judge): not judged")


# ---- the per-client cap -------------------------------------------------------------


def _clients(
    n_clients: int, per: int, every: int | None, *, start: int = 0
) -> Iterable[ComparedRequest]:
    seq = start
    for c in range(n_clients):
        for i in range(per):
            judged = "Paris" if every is not None and i % every == 0 else "Muburg"
            yield pair(seq, judged=judged, client=f"key:{c:04d}")
            seq += 1


def test_a_flood_of_easy_requests_from_one_key_cannot_turn_a_breach_into_a_pass() -> None:
    others = list(_clients(20, 10, 2))  # 50% worse
    assert judge_answers(others, POLICY, EXACT).verdict == "breach"
    flood = clean(5000, start=10_000, client="key:flood")
    verdict = judge_answers(others + flood, POLICY, EXACT)
    assert verdict.verdict == "breach", verdict.reason
    assert verdict.capped_clients == 1 and verdict.clients == 21
    counted_flood = verdict.pairs - len(others)
    assert counted_flood <= 0.1 * verdict.pairs


def test_an_adversarial_flood_from_one_key_cannot_turn_a_pass_into_a_breach() -> None:
    others = list(_clients(20, 10, None))
    assert judge_answers(others, POLICY, EXACT).verdict == "pass"
    flood = with_worse(5000, 1, start=10_000, client="key:flood")
    verdict = judge_answers(others + flood, POLICY, EXACT)
    assert verdict.verdict != "breach", verdict.reason
    assert verdict.capped == 5000 - (verdict.pairs - len(others))


def test_one_client_alone_counts_for_nothing_unless_the_share_allows_it() -> None:
    pairs = clean(100, client="key:only")
    assert judge_answers(pairs, POLICY, EXACT).verdict == "insufficient"
    whole = POLICY.model_copy(update={"max_client_share": 1.0})
    assert judge_answers(pairs, whole, EXACT).verdict == "pass"


def test_the_cap_never_lets_one_client_exceed_its_share() -> None:
    rng = random.Random(7)
    for _ in range(300):
        counts = [rng.randint(1, 50) for _ in range(rng.randint(1, 30))]
        counts.append(rng.randint(1, 5000))
        share = rng.choice([0.05, 0.1, 0.25, 0.5, 1.0])
        cap = client_cap(counts, share)
        total = sum(min(n, cap) for n in counts)
        assert cap <= share * total + 1e-9
        bigger = cap + 1
        if bigger <= max(counts):
            assert bigger > share * sum(min(n, bigger) for n in counts)


# ---- lines and evidence -------------------------------------------------------------


def test_lines_are_short_and_say_the_figures() -> None:
    pairs = with_worse(60, 30) + [
        pair(100 + i, floor="Paris" if i % 4 == 0 else "Muburg", sampled=True) for i in range(40)
    ]
    verdict = judge_answers(pairs, POLICY, EXACT)
    line = verdict.line()
    assert line.startswith(f"answers (exact): {verdict.verdict}, excess ")
    assert "greedy 60 pairs" in line and "sampled 40 pairs" in line and line.endswith("max +10%")
    assert verdict.floor_line() == "A/A floor: greedy 0.0% (0/60), sampled 25% (10/40)"
    assert verdict.power_line() == (
        f"power: 27 pairs detect an excess of {verdict.detectable_excess:.0%} "
        "with 80% power (max +10%)"
    )
    for text in (line, verdict.floor_line(), verdict.power_line()):
        assert len(text) < 160


def test_evidence_carries_counts_and_digests_never_text(tmp_path: Path) -> None:
    items = tmp_path / "known.jsonl"
    items.write_text(
        json.dumps({"id": "k1", "vars": {"question": "Secret question zeta?"}, "expected": "x"})
        + "\n"
    )
    comparator = ScorerComparator.from_files([items], root=tmp_path, checks=["refusal"])
    prompt = json.dumps({"question": "Secret question zeta?"})
    pairs = [
        pair(i, reference="x", judged="SECRET-ANSWER-OMEGA", floor="x", prompt=prompt)
        for i in range(40)
    ]
    verdict = judge_answers(pairs, POLICY.model_copy(update={"comparison": "scorer"}), comparator)
    evidence = verdict.evidence()
    text = json.dumps(evidence)
    assert "SECRET-ANSWER-OMEGA" not in text and "zeta" not in text.lower()
    assert evidence["verdict"] == "breach" and evidence["pairs"] == 40
    assert evidence["worse_prompts"][0] == hashlib.sha256(prompt.encode()).hexdigest()
    assert (
        evidence["comparator"]["known_items"][0]["sha256"]
        == hashlib.sha256(items.read_bytes()).hexdigest()
    )


def test_a_candidate_that_changes_a_fifth_of_its_answers_almost_never_passes() -> None:
    """The old rule (a breach needs the agreement's upper bound below 90%) passed a
    candidate that truly changes 20% of its answers 61% of the time at 30 pairs. Now a pass
    needs the excess's upper bound within the margin: over 400 seeded runs at 30, 60 and 120
    pairs such a candidate passes at most 2% of the time, while one that changes nothing but
    sits on a 5% A/A floor passes most of the time once the pairs allow it."""
    rng = random.Random(20261207)

    def run(n: int, changed: float, floor: float) -> str:
        pairs = [
            pair(
                i,
                client=f"c{i % 20}",
                judged="Paris" if rng.random() < changed + floor else "Muburg",
                floor="Rome" if rng.random() < floor else "Muburg",
            )
            for i in range(n)
        ]
        return judge_answers(pairs, POLICY, EXACT).verdict

    for n in (30, 60, 120):
        verdicts = [run(n, 0.2, 0.0) for _ in range(400)]
        assert verdicts.count("pass") <= 8, (n, verdicts.count("pass"))
    good = [run(120, 0.0, 0.05) for _ in range(400)]
    assert good.count("pass") >= 200 and good.count("breach") <= 8, good.count("pass")
