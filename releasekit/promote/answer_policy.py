"""An environment's answer comparison as its committed policy sets it: the statistical
policy (`evaluate.answers.AnswerPolicy`) and the comparator (`exact`, `scorer`, `judge`),
for a shadow, a canary's answers and the after-promotion check alike."""

from __future__ import annotations

from typing import Any

from releasekit.config import Settings
from releasekit.config.environments import AnswerJudgeConfig
from releasekit.evaluate.answers import AnswerPolicy, Comparator


def answer_policy(pol: dict[str, Any], *, looks: int = 1) -> AnswerPolicy:
    """The statistical policy of an environment's policy fields (`pol`: as
    `promote.policy.environment_policy` applies them)."""
    raw_min = pol.get("answer_min_pairs")
    return AnswerPolicy(
        comparison=pol.get("answer_comparison") or "exact",
        max_excess=float(pol.get("max_excess_disagreement", 0.1)),
        max_client_share=float(pol.get("answer_max_client_share", 0.1)),
        min_pairs=int(raw_min) if raw_min is not None else None,
        looks=looks,
    )


def answer_comparator(settings: Settings, pol: dict[str, Any]) -> Comparator:
    """The comparator an environment's policy names (a scorer's known items and a judge's
    prompt are read under the project root)."""
    from releasekit.evaluate.answer_compare import make_comparator

    judge = pol.get("answer_judge")
    return make_comparator(
        pol.get("answer_comparison") or "exact",
        root=settings.root,
        checks=list(pol.get("answer_checks") or ["refusal"]),
        known_items=list(pol.get("answer_known_items") or []),
        judge=AnswerJudgeConfig.model_validate(judge) if judge is not None else None,
    )
