"""A canary step's judgements counted and put in words: whether one is clean, the run of
clean judgements, a check's result as a watch judgement, what a disjoint window says of a
sustained breach, and one-line summaries."""

from __future__ import annotations

from typing import Literal

from releasekit.evaluate.agreement import Agreement
from releasekit.evaluate.answers import AnswerVerdict
from releasekit.rollout.canary_records import BreachRecord
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
    """True when every required check passed with its figure within its limit and none
    breached (and, where answers are compared, their agreement passed); False on any
    breach (the agreement's too); None when neither (a required check waits, was not
    measured, or passed only because its excess over the limit is not significant yet: a
    step needs as much evidence to pass as to abort; or too few pairs)."""
    if any(c.verdict == "breach" for c in j.checks):
        return False
    if agreement is not None and agreement.verdict == "breach":
        return False
    if agreement is not None and agreement.verdict != "pass":
        return None
    if all(c.verdict == "pass" and _within(c) for c in j.checks if c.required):
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


def confirm_span(judged_s: float, policy: Canary) -> float:
    """How long the disjoint window that confirms a sustained breach lasts at least: as
    long as the window that breached (the step so far when the breach became sustained),
    and never less than the `sustain` judgements' own span (`sustain` x `interval_s`).
    The same evidence both ways: the confirming window holds as much time as the one it
    confirms, as the shadow's next window is as long as its first."""
    return max(judged_s, policy.sustain * policy.interval_s)


def confirmation(j: StepJudgement, metrics: list[str]) -> Literal["breach", "pass"] | None:
    """What a disjoint window's judgement `j` says of a sustained breach of `metrics`:
    "breach" when one of them breaches in it too; "pass" when each of them passed with its
    figure within its limit; None when it decides nothing yet: a check still waits for
    samples, was not measured, or passed only because its excess over the limit is not
    significant yet (a release slow throughout, judged on fewer samples, must not clear a
    breach that a significant run of judgements showed)."""
    got = [j.by_metric(m) for m in metrics]
    if any(c is not None and c.verdict == "breach" for c in got):
        return "breach"
    if all(c is not None and c.verdict == "pass" and _within(c) for c in got):
        return "pass"
    return None


def _within(c: CheckResult) -> bool:
    """The check's figure is at or under its limit (or it has no figure to compare)."""
    return c.canary is None or c.limit is None or c.canary <= c.limit


def confirm_words(metrics: list[str], judged_s: float, span_s: float) -> str:
    """'confirming ttft_p95_s: 6/24 s of a disjoint window'."""
    return f"confirming {', '.join(metrics)}: {judged_s:.0f}/{span_s:.0f} s of a disjoint window"


def unconfirmed_words(metrics: list[str], first: StepJudgement, j: StepJudgement) -> str:
    """The one line said when a sustained breach of `metrics` (its window: `first`) did not
    hold over its disjoint window (`j`)."""
    return (
        f"{', '.join(metrics)} breached over the first "
        f"{first.window_end - first.window_start:.0f} s and not over the next "
        f"{j.window_end - j.window_start:.0f} s, judged on their own: not confirmed (a fresh "
        "server's start-up, kept as unconfirmed); the step goes on"
    )


def breach_words(b: BreachRecord, j: StepJudgement) -> str:
    """'ttft_p95_s: <the check's reason> (held over a disjoint 24 s window)', or why the
    breach stands without one."""
    c = j.by_metric(b.metric)
    reason = f"{b.metric}: {c.reason if c is not None else 'breached'}"
    if b.confirmed_by is not None:
        w = b.confirmed_by
        return f"{reason} (held over a disjoint {w.window_end - w.window_start:.0f} s window)"
    return f"{reason} ({b.stands})" if b.stands else reason
