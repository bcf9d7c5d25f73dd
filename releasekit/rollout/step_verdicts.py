"""A canary step's judgements counted and put in words: whether one is clean, the run of
clean judgements, a check's result as a watch judgement, and one-line summaries."""

from __future__ import annotations

from typing import Literal

from releasekit.evaluate.agreement import Agreement
from releasekit.evaluate.answers import AnswerVerdict
from releasekit.rollout.judge import CheckResult, StepJudgement
from releasekit.spec.manifest import Canary
from releasekit.watch.rules import Judgement, RuleState


def agreement_words(a: AnswerVerdict | Agreement) -> str:
    """'answers: not judged yet (12 of 37 pairs)' or 'answers (exact): pass, excess ...'."""
    if isinstance(a, AnswerVerdict):
        if a.verdict == "insufficient" and a.pairs < a.min_pairs:
            return f"answers: not judged yet ({a.pairs} of {a.min_pairs} pairs)"
        return a.line()
    if a.verdict == "insufficient":
        words = f"answers: not judged yet ({a.pairs} of {a.min_pairs} pairs"
        return words + (f"; {a.not_judged} not judged)" if a.not_judged else ")")
    return f"answers: {a.line()}: {a.verdict}"


def is_clean(j: StepJudgement, agreement: AnswerVerdict | Agreement | None = None) -> bool | None:
    """True when every required check passed and none breached (and, where answers are
    compared, their agreement passed); False on any breach (the agreement's too); None
    when neither (a required check waits or was not measured, or too few pairs)."""
    if any(c.verdict == "breach" for c in j.checks):
        return False
    if agreement is not None and agreement.verdict == "breach":
        return False
    if agreement is not None and agreement.verdict != "pass":
        return None
    if all(c.verdict == "pass" for c in j.checks if c.required):
        return True
    return None


def next_clean(
    clean: int, j: StepJudgement, agreement: AnswerVerdict | Agreement | None = None
) -> int:
    """The run of clean judgements after `j`: one more on a clean one, 0 after a breach,
    unchanged when `j` decided nothing (as a no-data window leaves a breach run)."""
    verdict = is_clean(j, agreement)
    return clean + 1 if verdict else 0 if verdict is False else clean


def run_words(clean: int, states: dict[str, RuleState], policy: Canary) -> str:
    """'clean 2/4' and, for a check breaching in a row, 'ttft_p95_s breached 1/4'."""
    parts = [f"clean {clean}/{policy.sustain}"]
    parts += [
        f"{m} breached {st.consecutive}/{policy.sustain}"
        for m, st in states.items()
        if st.consecutive
    ]
    return ", ".join(parts)


def as_judgement(c: CheckResult) -> Judgement:
    """A canary check's result as the watch rule state counts it (wait and not measured:
    no data)."""
    verdict: Literal["pass", "breach", "no_data"] = (
        c.verdict if c.verdict in ("pass", "breach") else "no_data"  # type: ignore[assignment]
    )
    return Judgement(
        rule=f"canary {c.metric}",
        metric=c.metric,
        verdict=verdict,
        value=c.canary,
        limit=c.limit,
        source=c.source if c.source in ("vllm", "gateway") else None,  # type: ignore[arg-type]
        count=c.canary_count,
        reason=c.reason,
        window_start=c.window_start,
        window_end=c.window_end,
    )


def summarise(j: StepJudgement) -> str:
    """One line: traffic, then each check's canary vs stable figure and verdict, or why it
    was not judged."""
    parts = [f"{j.canary_requests:g} canary / {j.stable_requests:g} stable requests"]
    parts += [c.brief() for c in j.checks]
    return "; ".join(parts)
