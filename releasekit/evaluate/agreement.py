"""Answer agreement: two releases' answers to the same requests, compared pairwise.

    result = answer_agreement(pairs, min_agreement=0.9, min_pairs=30)

Two answers agree when they are equal after the suites' exact-match normalisation
(`scorers.normalise`: case, whitespace, quotes and trailing punctuation), which is what the
demo's one-word answers need. The agreement rate gets a Wilson score interval
(`paired_stats.wilson_interval`, as the suites' pass rates do), and the verdict is judged on
it: fewer than `min_pairs` judged pairs is `insufficient` (never a pass); an upper bound
below `min_agreement` is a `breach` (the evidence says the candidate agrees less than the
floor); anything else passes. Pairs not judged (a sampled request, an error or a cut
answer on either side: the caller says which are judged) are counted apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, Field

from releasekit.evaluate.paired_stats import wilson_interval
from releasekit.evaluate.scorers import normalise

AgreementVerdict = Literal["pass", "breach", "insufficient"]

CONFIDENCE = 0.95
MAX_EXAMPLES = 10


class AnswerPair(BaseModel):
    """One request's two answers: the stable release's and the candidate's."""

    seq: int
    stable: str | None
    candidate: str | None
    judged: bool = Field(True, description="both answers came whole (else not compared)")
    prompt: str | None = None
    prompt_sha256: str = ""


class DisagreeingPair(BaseModel):
    """An example of a pair whose answers differ."""

    seq: int
    stable: str
    candidate: str
    prompt: str | None = None
    prompt_sha256: str = ""


class Agreement(BaseModel):
    """How often the candidate answered what the stable release answered."""

    pairs: int = Field(description="pairs judged")
    agreeing: int
    not_judged: int = Field(
        0, description="pairs not compared: sampled, or an error or a cut answer on a side"
    )
    rate: float | None = None
    low: float | None = None
    high: float | None = None
    confidence: float = CONFIDENCE
    min_agreement: float
    min_pairs: int
    verdict: AgreementVerdict
    reason: str
    examples: list[DisagreeingPair] = Field(default_factory=list)

    def evidence(self, *, text_max: int = 500) -> dict[str, Any]:
        """The agreement as a ledger event holds it: counts, interval and at most
        MAX_EXAMPLES disagreeing pairs, each text cut at `text_max` characters (a prompt
        only where it was kept, else its digest)."""
        cut = text_max
        return {
            **self.model_dump(mode="json", exclude={"examples"}),
            "examples": [
                {
                    "seq": x.seq,
                    "stable": x.stable[:cut],
                    "candidate": x.candidate[:cut],
                    "prompt": x.prompt[:cut] if x.prompt is not None else None,
                    "prompt_sha256": x.prompt_sha256,
                }
                for x in self.examples[:MAX_EXAMPLES]
            ],
        }

    def line(self) -> str:
        """One line: the rate, its interval and the counts."""
        if self.rate is None or self.low is None or self.high is None:
            return f"agreement: no pairs judged ({self.not_judged} not judged)"
        return (
            f"agreement {self.rate:.1%} [{self.low:.1%}, {self.high:.1%}] "
            f"({self.agreeing}/{self.pairs} pairs; floor {self.min_agreement:.0%}"
            + (f"; {self.not_judged} not judged" if self.not_judged else "")
            + ")"
        )


def answers_agree(stable: str, candidate: str) -> bool:
    """Whether two answers are the same after the suites' exact-match normalisation."""
    return normalise(stable) == normalise(candidate)


def answer_agreement(
    pairs: Sequence[AnswerPair],
    *,
    min_agreement: float,
    min_pairs: int,
    confidence: float = CONFIDENCE,
    max_examples: int = MAX_EXAMPLES,
) -> Agreement:
    """The agreement of `pairs` with its interval and verdict (see the module docstring)."""
    judged = [p for p in pairs if p.judged and p.stable is not None and p.candidate is not None]
    n = len(judged)
    differ = [p for p in judged if not answers_agree(p.stable or "", p.candidate or "")]
    agreeing = n - len(differ)
    examples = [
        DisagreeingPair(
            seq=p.seq,
            stable=p.stable or "",
            candidate=p.candidate or "",
            prompt=p.prompt,
            prompt_sha256=p.prompt_sha256,
        )
        for p in differ[:max_examples]
    ]
    rate = low = high = None
    if n:
        rate = agreeing / n
        low, high = wilson_interval(agreeing, n, confidence=confidence)
    verdict: AgreementVerdict
    if n < min_pairs:
        verdict = "insufficient"
        reason = f"not enough pairs: {n} judged, at least {min_pairs} needed"
        if len(pairs) > n:
            reason += f" ({len(pairs) - n} not judged: sampled, failed or cut)"
    elif high is not None and high < min_agreement:
        verdict = "breach"
        reason = (
            f"answers agree {rate:.1%} of {n} pairs ({confidence:.0%} interval up to "
            f"{high:.1%}), below the floor of {min_agreement:.0%}: {len(differ)} differ"
        )
    else:
        verdict = "pass"
        reason = f"answers agree {rate:.1%} of {n} pairs (floor {min_agreement:.0%})"
    return Agreement(
        pairs=n,
        agreeing=agreeing,
        not_judged=len(pairs) - n,
        rate=rate,
        low=low,
        high=high,
        confidence=confidence,
        min_agreement=min_agreement,
        min_pairs=min_pairs,
        verdict=verdict,
        reason=reason,
        examples=examples,
    )
