"""Live answer comparison: is a release's answer quality worse than the release it is
judged against, beyond the noise of that release against itself?

    verdict = judge_answers(pairs, policy, comparator)

Each mirrored request gives a `ComparedRequest`: the reference answer (the release judged
against), the judged release's answer, and a second answer of the reference release (the
A/A copy). A `Comparator` (`exact`, `scorer` or `judge`: `answer_compare`, `pair_judge`)
says, for the judged answer and for the A/A answer, whether it is `worse` than, `same` as,
or `better` than the reference: a loss of +1, 0 or -1. An error, a cut answer or an
unreadable answer on a side counts as a difference: the side's loss is +1 (a reference that
failed makes both sides +1, so it cancels).

The statistic is the candidate's *excess* loss over the A/A floor, per pair
d = loss(judged) - loss(A/A), averaged over the pairs counted, with an adjusted Wald
interval (two pseudo-pairs, +1 and -1, as Agresti and Min add for paired proportions, so a
run of identical answers still has a width). Pairs are counted per stratum (`greedy` and
`sampled` requests, each against its own floor) after the per-client cap: each client's
pairs count at most `max_client_share` of the pairs counted (its earliest pairs by seq), so
no single key or address decides. The cap is the largest c with c <= share * sum_k min(n_k, c)
over the stratum's clients (`client_cap`): a flood from one key never counts for more than
the share, however many other clients there are; with fewer than 1 / share clients nothing
is counted (a one-client environment sets the share to 1). A pair without a client digest
is a client of its own.

Per stratum: fewer pairs than `min_pairs` is `insufficient`; an interval wholly above
`max_excess` is a `breach`; an interval wholly at or below it a `pass`; between, more
pairs are needed (`insufficient`). The verdict is `breach` when any stratum breaches,
`not_judged` when the comparator could not judge (a judge that is down or answers garbage:
never a pass), `pass` when every stratum holding pairs passes, else `insufficient`.

`min_pairs` is sized from the margin: the fewest pairs at which a comparison with no
difference at all can pass (`sized_min_pairs`). `detectable_excess` states the smallest
excess the minimum detects with 80% power. With `looks` > 1 (a fixed analysis schedule),
each look is judged at confidence 1 - (1 - confidence) / looks (Bonferroni).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import NormalDist
from typing import Any, Literal, Protocol

from pydantic import BaseModel, Field

from releasekit.errors import JudgeError

ComparisonKind = Literal["exact", "scorer", "judge"]
Stratum = Literal["greedy", "sampled"]
Judged = Literal["worse", "same", "better"]
AnswerVerdictKind = Literal["pass", "breach", "insufficient", "not_judged"]

CONFIDENCE = 0.95
POWER = 0.8
MAX_EXAMPLES = 10


class ComparedRequest(BaseModel):
    """One mirrored request's answers: the reference's, the judged release's and the
    reference's second answer (the A/A copy). None: that side errored, was cut or was
    unreadable (a difference)."""

    seq: int
    client: str = Field("", description="digest of the client's key or address")
    sampled: bool = False
    reference: str | None
    judged: str | None
    floor: str | None = None
    has_floor: bool = Field(False, description="an A/A copy was made for this request")
    prompt: str | None = Field(None, description="the prompt, only where it may be kept")
    prompt_sha256: str = ""


class Comparator(Protocol):
    """Compares an answer with the reference answer to the same request."""

    kind: ComparisonKind

    def identity(self) -> dict[str, Any]:
        """What judged (kind, scorer names, judge endpoint/model/prompt digest): recorded
        with every verdict."""
        ...

    def compare(self, reference: str, other: str, *, prompt: str | None) -> Judged:
        """`other` against `reference`. Raises `releasekit.errors.JudgeError` when it
        cannot judge (the verdict is then `not_judged`)."""
        ...


class AnswerPolicy(BaseModel):
    """The environment's committed answers policy."""

    comparison: ComparisonKind = "exact"
    max_excess: float = Field(0.1, gt=0, le=1, description="max_excess_disagreement")
    max_client_share: float = Field(0.1, gt=0, le=1)
    min_pairs: int | None = Field(None, ge=1, description="None: sized from max_excess")
    confidence: float = Field(CONFIDENCE, gt=0, lt=1)
    looks: int = Field(1, ge=1, description="looks in the analysis schedule (Bonferroni)")


class StratumResult(BaseModel):
    """One stratum's excess over its A/A floor."""

    stratum: Stratum
    pairs: int = Field(description="pairs counted (after the per-client cap)")
    worse: int = Field(description="judged answers worse than (or different from) the reference")
    better: int = 0
    floor_worse: int = Field(description="A/A answers worse than (or different from) the reference")
    floor_better: int = 0
    floor_rate: float | None = None
    judged_rate: float | None = None
    excess: float | None = None
    low: float | None = None
    high: float | None = None
    verdict: Literal["pass", "breach", "insufficient"]
    reason: str
    d_counts: dict[str, int] = Field(
        default_factory=dict,
        description="pairs per excess value d = loss(judged) - loss(A/A), -2..2: what the "
        "interval is computed from (a replay recomputes it from these)",
    )


class AnswerVerdict(BaseModel):
    """A live answer comparison's verdict, as recorded (counts, digests and pair ids: no
    user text; the text stays in the pair store)."""

    comparison: ComparisonKind
    comparator: dict[str, Any] = Field(default_factory=dict)
    verdict: AnswerVerdictKind
    reason: str
    max_excess: float
    min_pairs: int
    confidence: float = Field(description="per look (after the schedule's adjustment)")
    looks: int = Field(1, description="looks in the analysis schedule")
    detectable_excess: float = Field(description="excess detected with 80% power at min_pairs")
    strata: list[StratumResult] = Field(default_factory=list)
    seen: int = Field(0, description="pairs read")
    no_floor: int = Field(0, description="pairs without an A/A answer (not counted)")
    capped: int = Field(0, description="pairs left out by the per-client cap")
    clients: int = 0
    capped_clients: int = 0
    worse_seqs: list[int] = Field(
        default_factory=list, description="pair seqs whose judged answer was worse (at most 10)"
    )
    worse_prompts: list[str] = Field(
        default_factory=list, description="their prompts' sha256 digests"
    )

    @property
    def pairs(self) -> int:
        """Pairs counted over every stratum."""
        return sum(s.pairs for s in self.strata)

    def line(self) -> str:
        """One line: verdict, excess and interval per stratum."""
        head = f"answers ({self.comparison}): {self.verdict.replace('_', ' ')}"
        if self.verdict == "not_judged" or not self.strata:
            return f"{head}, {self.reason}"
        parts = []
        for s in self.strata:
            if s.excess is None or s.low is None or s.high is None:
                parts.append(f"{s.stratum} {s.pairs}/{self.min_pairs} pairs")
            else:
                count = f"{s.pairs}/{self.min_pairs}" if s.pairs < self.min_pairs else s.pairs
                parts.append(
                    f"excess {_pct(s.excess, sign=True)} [{_pct(s.low, sign=True)}, "
                    f"{_pct(s.high, sign=True)}] {s.stratum} {count} pairs"
                )
        return f"{head}, {', '.join(parts)}; max {_pct(self.max_excess, sign=True)}"

    def floor_line(self) -> str:
        """One line: the A/A floor per stratum."""
        parts = [
            f"{s.stratum} {_pct(s.floor_rate)} ({s.floor_worse}/{s.pairs})"
            for s in self.strata
            if s.floor_rate is not None
        ]
        return f"A/A floor: {', '.join(parts) if parts else 'no pairs counted'}"

    def power_line(self) -> str:
        """One line: min pairs and the excess they detect with 80% power."""
        tail = f"with {POWER:.0%} power (max {_pct(self.max_excess, sign=True)})"
        if self.detectable_excess >= 1.0:
            return f"power: {self.min_pairs} pairs detect no excess {tail}"
        return (
            f"power: {self.min_pairs} pairs detect an excess of "
            f"{_pct(self.detectable_excess)} {tail}"
        )

    def evidence(self) -> dict[str, Any]:
        """The verdict as a ledger event and a webhook carry it (no user text): counts,
        rates, intervals, the comparator's identity, worse pair seqs and prompt digests."""
        out = self.model_dump(mode="json")
        out["pairs"] = self.pairs
        return out


def _pct(x: float | None, *, sign: bool = False) -> str:
    """A share as a short percentage: one decimal under 10%, none above."""
    if x is None:
        return "n/a"
    v = x * 100
    digits = 1 if abs(v) < 10 else 0
    return f"{v:+.{digits}f}%" if sign else f"{v:.{digits}f}%"


def _z(confidence: float) -> float:
    """The two-sided normal quantile of `confidence`."""
    return NormalDist().inv_cdf(0.5 + confidence / 2)


def per_look_confidence(confidence: float, looks: int) -> float:
    """The confidence of each look of a schedule of `looks` (Bonferroni)."""
    return 1 - (1 - confidence) / max(1, looks)


def excess_interval(ds: Sequence[int], *, confidence: float) -> tuple[float, float, float]:
    """(mean, low, high) of the per-pair excess losses `ds`: the mean of `ds`, and the
    adjusted Wald interval of the list with two pseudo-pairs (+1 and -1) added: mean and
    sample sd of the augmented list, half-width z sd / sqrt(n + 2)."""
    aug = [*ds, 1, -1]
    n_aug = len(aug)
    centre = sum(aug) / n_aug
    var = sum((d - centre) ** 2 for d in aug) / (n_aug - 1)
    half = _z(confidence) * math.sqrt(var) / math.sqrt(n_aug)
    mean = sum(ds) / len(ds) if ds else 0.0
    return mean, centre - half, centre + half


def sized_min_pairs(max_excess: float, *, confidence: float = CONFIDENCE) -> int:
    """The fewest pairs at which a comparison with no difference at all passes: the
    smallest n >= 10 with z sqrt(2 / (n + 1)) / sqrt(n + 2) <= max_excess (n pairs of
    d = 0 plus the two pseudo-pairs)."""
    if max_excess <= 0:
        raise ValueError(f"max_excess must be > 0, got {max_excess}")
    z = _z(confidence)
    n = 10
    while z * math.sqrt(2 / (n + 1)) / math.sqrt(n + 2) > max_excess + 1e-12:
        n += 1
    return n


def detectable_excess(
    n: int, max_excess: float, *, confidence: float = CONFIDENCE, power: float = POWER
) -> float:
    """The true excess a breach is found for with `power` at `n` pairs.

    Normal approximation, the sd of a pair's excess at its worst case for a binary
    difference, sqrt(D (1 - D)): the smallest D in (max_excess, 1] with
    (D - max_excess) sqrt(n) >= (z + z_power) sqrt(D (1 - D)), z two-sided at
    `confidence`. 1.0 when no D reaches it."""
    if n < 1 or max_excess >= 1:
        return 1.0
    k = _z(confidence) + NormalDist().inv_cdf(power)
    root_n = math.sqrt(n)

    def gap(d: float) -> float:  # convex in d: one crossing from below
        return (d - max_excess) * root_n - k * math.sqrt(max(0.0, d * (1 - d)))

    lo, hi = max_excess, 1.0
    if gap(hi) < 0:
        return 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if gap(mid) >= 0:
            hi = mid
        else:
            lo = mid
    return hi


def client_cap(counts: Sequence[int], share: float) -> int:
    """The most pairs any one client counts for: the largest c >= 0 with
    c <= share * sum_k min(n_k, c). The condition holds from 0 up to that c and fails
    above it (share * sum_k min(n_k, c) - c is concave in c), so no client ever counts for
    more than `share` of the pairs counted. Fewer than 1 / share clients: 0 (nothing is
    counted; an environment served by one client sets `answer_max_client_share = 1`)."""
    if not counts:
        return 0

    def ok(c: int) -> bool:
        return c <= share * sum(min(n, c) for n in counts) + 1e-9

    lo, hi = 0, max(counts)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _capped(
    pairs: Sequence[ComparedRequest], share: float
) -> tuple[list[ComparedRequest], int, int, int]:
    """The pairs counted after the per-client cap (each client's earliest by seq), the
    clients, the pairs left out and the clients capped. A pair with no client digest is a
    client of its own."""
    by_client: dict[str, list[ComparedRequest]] = {}
    for i, p in enumerate(sorted(pairs, key=lambda p: p.seq)):
        by_client.setdefault(p.client or f"\0{i}", []).append(p)
    cap = client_cap([len(v) for v in by_client.values()], share)
    kept = [p for v in by_client.values() for p in v[:cap]]
    kept.sort(key=lambda p: p.seq)
    capped_clients = sum(1 for v in by_client.values() if len(v) > cap)
    return kept, len(by_client), len(pairs) - len(kept), capped_clients


_LOSS: dict[str, int] = {"worse": 1, "same": 0, "better": -1}


def _losses(p: ComparedRequest, comparator: Comparator) -> tuple[int, int]:
    """(loss of the judged answer, loss of the A/A answer) against the reference."""
    if p.reference is None:
        return 1, 1
    sides = []
    for other in (p.judged, p.floor):
        if other is None:
            sides.append(1)
            continue
        judged = comparator.compare(p.reference, other, prompt=p.prompt)
        if judged not in _LOSS:
            raise JudgeError(f"the {comparator.kind} comparator answered {judged!r}")
        sides.append(_LOSS[judged])
    return sides[0], sides[1]


def _stratum(
    stratum: Stratum,
    losses: Sequence[tuple[int, int]],
    *,
    max_excess: float,
    min_pairs: int,
    confidence: float,
    share: float,
) -> StratumResult:
    """One stratum's excess, interval and verdict."""
    counts = {
        "worse": sum(1 for j, _ in losses if j > 0),
        "better": sum(1 for j, _ in losses if j < 0),
        "floor_worse": sum(1 for _, f in losses if f > 0),
        "floor_better": sum(1 for _, f in losses if f < 0),
    }
    ds = sorted(j - f for j, f in losses)
    d_counts = {str(d): ds.count(d) for d in sorted(set(ds))}
    return _stratum_of(
        stratum,
        counts,
        d_counts,
        max_excess=max_excess,
        min_pairs=min_pairs,
        confidence=confidence,
        share=share,
    )


def _stratum_of(
    stratum: Stratum,
    counts: dict[str, int],
    d_counts: dict[str, int],
    *,
    max_excess: float,
    min_pairs: int,
    confidence: float,
    share: float,
) -> StratumResult:
    """A stratum's verdict from its counts and its excess histogram."""
    ds = [int(d) for d, k in d_counts.items() for _ in range(int(k))]
    n = len(ds)
    if n == 0:
        return StratumResult(
            stratum=stratum,
            pairs=0,
            verdict="insufficient",
            reason=f"{stratum}: no pairs counted: too few clients for one to count at most "
            f"{_pct(share)} of the pairs (answer_max_client_share)",
            **counts,
        )
    excess, low, high = excess_interval(ds, confidence=confidence)
    shown = (
        f"{stratum}: excess {_pct(excess, sign=True)} [{_pct(low, sign=True)}, "
        f"{_pct(high, sign=True)}] over {n} pairs"
    )
    verdict: Literal["pass", "breach", "insufficient"]
    if n < min_pairs:
        verdict, reason = "insufficient", f"{stratum}: {n} of {min_pairs} pairs"
    elif low > max_excess:
        verdict, reason = "breach", f"{shown}, wholly above max {_pct(max_excess, sign=True)}"
    elif high <= max_excess:
        verdict, reason = "pass", f"{shown}, within max {_pct(max_excess, sign=True)}"
    else:
        verdict = "insufficient"
        reason = f"{shown} spans max {_pct(max_excess, sign=True)}: more pairs needed"
    return StratumResult(
        stratum=stratum,
        pairs=n,
        floor_rate=counts["floor_worse"] / n,
        judged_rate=counts["worse"] / n,
        excess=excess,
        low=low,
        high=high,
        verdict=verdict,
        reason=reason,
        d_counts=d_counts,
        **counts,
    )


def replay_answers(recorded: dict[str, Any], policy: AnswerPolicy) -> AnswerVerdict:
    """A recorded verdict judged again from its recorded counts (each stratum's excess
    histogram) under `policy` with the recorded schedule's looks: the same statistics as
    `judge_answers`, without the pairs (a comparator's verdict on a pair is not recomputed:
    its identity is recorded)."""
    got = AnswerVerdict.model_validate(recorded)
    policy = policy.model_copy(update={"looks": got.looks})
    if got.verdict == "not_judged":
        return got
    confidence = per_look_confidence(policy.confidence, policy.looks)
    min_pairs = policy.min_pairs or sized_min_pairs(policy.max_excess, confidence=confidence)
    strata = [
        _stratum_of(
            s.stratum,
            {
                "worse": s.worse,
                "better": s.better,
                "floor_worse": s.floor_worse,
                "floor_better": s.floor_better,
            },
            s.d_counts,
            max_excess=policy.max_excess,
            min_pairs=min_pairs,
            confidence=confidence,
            share=policy.max_client_share,
        )
        for s in got.strata
    ]
    verdict, reason = _overall(strata, min_pairs)
    return got.model_copy(
        update={
            "strata": strata,
            "verdict": verdict,
            "reason": reason,
            "min_pairs": min_pairs,
            "max_excess": policy.max_excess,
            "confidence": confidence,
            "detectable_excess": detectable_excess(
                min_pairs, policy.max_excess, confidence=confidence
            ),
        }
    )


def judge_answers(
    pairs: Sequence[ComparedRequest], policy: AnswerPolicy, comparator: Comparator
) -> AnswerVerdict:
    """The verdict of `pairs` under `policy` (see the module docstring)."""
    confidence = per_look_confidence(policy.confidence, policy.looks)
    min_pairs = policy.min_pairs or sized_min_pairs(policy.max_excess, confidence=confidence)
    with_floor = [p for p in pairs if p.has_floor]
    base: dict[str, Any] = {
        "comparison": comparator.kind,
        "comparator": comparator.identity(),
        "max_excess": policy.max_excess,
        "min_pairs": min_pairs,
        "confidence": confidence,
        "looks": policy.looks,
        "detectable_excess": detectable_excess(min_pairs, policy.max_excess, confidence=confidence),
        "seen": len(pairs),
        "no_floor": len(pairs) - len(with_floor),
    }
    strata: list[StratumResult] = []
    worse: list[ComparedRequest] = []
    clients = capped = capped_clients = 0
    for stratum in ("greedy", "sampled"):
        group = [p for p in with_floor if p.sampled == (stratum == "sampled")]
        if not group:
            continue
        kept, n_clients, n_capped, n_capped_clients = _capped(group, policy.max_client_share)
        clients += n_clients
        capped += n_capped
        capped_clients += n_capped_clients
        losses = []
        for p in kept:
            try:
                loss = _losses(p, comparator)
            except JudgeError as exc:
                return AnswerVerdict(
                    **base,
                    verdict="not_judged",
                    reason=f"the {comparator.kind} comparator could not judge: {exc.message}",
                )
            losses.append(loss)
            if loss[0] > 0:
                worse.append(p)
        strata.append(
            _stratum(
                stratum,  # type: ignore[arg-type]
                losses,
                max_excess=policy.max_excess,
                min_pairs=min_pairs,
                confidence=confidence,
                share=policy.max_client_share,
            )
        )
    verdict, reason = _overall(strata, min_pairs)
    worse = sorted(worse, key=lambda p: p.seq)[:MAX_EXAMPLES]
    return AnswerVerdict(
        **base,
        verdict=verdict,
        reason=reason,
        strata=strata,
        clients=clients,
        capped=capped,
        capped_clients=capped_clients,
        worse_seqs=[p.seq for p in worse],
        worse_prompts=[p.prompt_sha256 for p in worse],
    )


def _overall(strata: Sequence[StratumResult], min_pairs: int) -> tuple[AnswerVerdictKind, str]:
    """The verdict over the strata and why."""
    if not strata:
        return "insufficient", f"no pairs with an A/A answer yet (0 of {min_pairs})"
    breaches = [s for s in strata if s.verdict == "breach"]
    if breaches:
        return "breach", "; ".join(s.reason for s in breaches)
    if all(s.verdict == "pass" for s in strata):
        return "pass", "; ".join(s.reason for s in strata)
    return "insufficient", "; ".join(s.reason for s in strata if s.verdict != "pass")
