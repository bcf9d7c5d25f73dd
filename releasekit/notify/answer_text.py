"""Webhooks carry no users' text: the answer examples of ledger evidence without their
prompts and answers.

An answer comparison recorded before the comparison against the A/A floor (an
`agreement`, at any depth of an event's evidence: a shadow comparison's, a canary step's,
a watch rollback's `answers`) holds up to ten disagreeing pairs with their prompt and both
answers. A webhook's receiver is outside the project's trust: the payload keeps each
example's seq and prompt digest, and the counts, interval and verdict, never the text
(that stays in the ledger and the gateway's 0600 pair store). Newer `answers` evidence
(`AnswerVerdict.evidence()`) holds no text to begin with.
"""

from __future__ import annotations

from typing import Any

TEXT_FIELDS = frozenset({"stable", "candidate", "prompt", "reference", "judged", "floor"})
"""The fields of one answer example that hold a prompt or an answer."""


def _example(row: Any) -> Any:
    if not isinstance(row, dict):
        return row
    return {k: v for k, v in row.items() if k not in TEXT_FIELDS}


def without_answer_text(value: Any) -> Any:
    """`value` (an event's evidence) with the text fields of every answer example under an
    `agreement` (`agreement.examples[*].stable/candidate/prompt`) left out; everything else
    as it is. Returns a new object; `value` is not changed."""
    if isinstance(value, list):
        return [without_answer_text(v) for v in value]
    if not isinstance(value, dict):
        return value
    out: dict[str, Any] = {}
    for key, v in value.items():
        if key == "agreement" and isinstance(v, dict) and isinstance(v.get("examples"), list):
            inner = {k: without_answer_text(x) for k, x in v.items() if k != "examples"}
            inner["examples"] = [_example(x) for x in v["examples"]]
            out[key] = inner
        else:
            out[key] = without_answer_text(v)
    return out
