"""Scorers: turn one model output into pass, fail or error.

Every scorer returns a `Score`. `pass`/`fail` are verdicts on the release; `error` means no
verdict could be reached (the server timed out, the judge answered unparseably). The paired
comparison counts an erroring item as a failure of the release that produced it, unless the
item expects an error (`evaluate.compare`), and reports errors on each side.

Normalisation used by `exact_match` (see `normalise`): Unicode NFKC, typographic quotes
folded to ASCII, case-folded, runs of whitespace collapsed to one space, then any
surrounding quotes, backticks or markdown emphasis (`"`, `'`, `` ` ``, `*`, `_`) and any
trailing sentence punctuation (`. ! ? , ; :`) stripped, repeatedly. Punctuation inside the
answer ("St. Louis", "3.5") is kept and articles are not removed: "The Hague" differs from
"Hague".
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Sequence
from typing import Any, Literal

import httpx
from pydantic import BaseModel

from releasekit.errors import JudgeError
from releasekit.evaluate.judge import LLMJudge
from releasekit.evaluate.suites import EvalItem, expected_number
from releasekit.spec.manifest import ScorerName

Outcome = Literal["pass", "fail", "error"]


class Score(BaseModel):
    """A scorer's verdict on one output: outcome, a score in [0, 1] (None on error), why."""

    outcome: Outcome
    score: float | None
    detail: str = ""

    @classmethod
    def of(cls, ok: bool, detail: str = "") -> Score:
        """A pass (score 1) or fail (score 0)."""
        return cls(outcome="pass" if ok else "fail", score=1.0 if ok else 0.0, detail=detail)

    @classmethod
    def error(cls, detail: str) -> Score:
        """No verdict: neither pass nor fail."""
        return cls(outcome="error", score=None, detail=detail)


_QUOTES = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"'})
_WRAP = "\"'`*_"
_TRAIL = ".!?,;:"


def normalise(text: str) -> str:
    """Canonical form for exact matching (rules in the module docstring)."""
    s = unicodedata.normalize("NFKC", text).translate(_QUOTES).casefold()
    s = " ".join(s.split())
    while True:
        before = s
        s = s.rstrip(_TRAIL).strip()
        if len(s) >= 2 and s[0] == s[-1] and s[0] in _WRAP:
            s = s[1:-1].strip()
        elif s and s[-1] in _WRAP and s.count(s[-1]) == 1:
            s = s[:-1].strip()  # a lone closing quote left after stripping punctuation
        if s == before:
            return s


def _as_list(expected: str | Sequence[str]) -> list[str]:
    return [expected] if isinstance(expected, str) else list(expected)


def exact_match(output: str, expected: str | Sequence[str]) -> Score:
    """Pass if the normalised output equals the (or any listed) normalised expected answer."""
    got = normalise(output)
    wanted = _as_list(expected)
    ok = any(got == normalise(w) for w in wanted)
    return Score.of(ok, "" if ok else f"expected {' | '.join(wanted)!r}, got {output.strip()!r}")


def contains(output: str, expected: str | Sequence[str]) -> Score:
    """Pass if every listed string appears in the output (case-folded, whitespace
    collapsed)."""
    hay = " ".join(output.casefold().split())
    missing = [w for w in _as_list(expected) if " ".join(w.casefold().split()) not in hay]
    return Score.of(not missing, f"missing {missing!r}" if missing else "")


def regex(output: str, pattern: str) -> Score:
    """Pass if `re.search(pattern, output)` finds a match; anchor the pattern (`^...$`) to
    demand a full match, add `(?i)` to ignore case."""
    ok = re.search(pattern, output) is not None
    return Score.of(ok, "" if ok else f"no match for /{pattern}/")


_NUMBER = re.compile(r"(?<![\w.])[-+\u2212]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?")


def extract_number(text: str) -> float | None:
    """The first number written in `text` ("1,234.5", "-3", "2e3"), or None."""
    m = _NUMBER.search(unicodedata.normalize("NFKC", text))
    if m is None:
        return None
    return float(m.group(0).replace(",", "").replace("\u2212", "-"))


def numeric(output: str, expected: float, *, tolerance: float = 0.0) -> Score:
    """Pass if the first number in the output is within `tolerance` (absolute) of
    `expected`."""
    got = extract_number(output)
    if got is None:
        return Score.of(False, f"no number in {output.strip()!r}")
    ok = abs(got - expected) <= tolerance
    return Score.of(ok, "" if ok else f"expected {expected:g} ± {tolerance:g}, got {got:g}")


_FENCE = re.compile(r"^```[a-zA-Z0-9_-]*\s*\n?(.*?)\n?```$", re.S)


def json_schema(output: str, schema: dict[str, Any]) -> Score:
    """Pass if the output (optionally inside a ``` fence) is JSON valid against `schema`."""
    from jsonschema import validators
    from jsonschema.exceptions import best_match

    text = output.strip()
    fenced = _FENCE.match(text)
    if fenced:
        text = fenced.group(1).strip()
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        return Score.of(False, f"not JSON: {exc.msg} at char {exc.pos}")
    validator = validators.validator_for(schema)(schema)
    error = best_match(validator.iter_errors(doc))
    if error is None:
        return Score.of(True)
    where = "/".join(str(p) for p in error.absolute_path) or "(root)"
    return Score.of(False, f"schema violation at {where}: {error.message}")


REFUSAL_PATTERNS: tuple[str, ...] = (
    r"\b(?:i|we)\s+(?:cannot|can\s?not|can't|won't|will\s+not|must\s+decline|"
    r"(?:am|'m|are|'re)\s+(?:unable|not\s+able)|do\s+not\s+know|don't\s+know)\b",
    r"\b(?:i'm|i\s+am)\s+sorry\b",
    r"\bunable\s+to\s+(?:answer|help|assist|comply)\b",
    r"\b(?:not|never)\s+(?:able|allowed)\s+to\s+(?:answer|help|assist|share|comply)\b",
    r"\bas\s+an\s+ai\b",
)
"""Phrases that mark a refusal, searched in the case-folded output."""

_REFUSAL = re.compile("|".join(f"(?:{p})" for p in REFUSAL_PATTERNS))


def is_refusal(text: str) -> bool:
    """True if `text` contains a refusal phrase (`REFUSAL_PATTERNS`). An empty output is
    not a refusal: a release that says nothing has not declined clearly."""
    s = " ".join(unicodedata.normalize("NFKC", text).translate(_QUOTES).casefold().split())
    return bool(_REFUSAL.search(s))


def refusal(output: str) -> Score:
    """Pass if the model declined (`is_refusal`)."""
    ok = is_refusal(output)
    return Score.of(ok, "" if ok else f"answered instead of refusing: {output.strip()[:120]!r}")


def rejected(status: int, error_text: str, *, expect_error: bool) -> Score:
    """Score a request the server rejected with a 4xx: handled (pass) when the item expects
    rejection (over-long input), else a fail: this release could not answer it."""
    if expect_error:
        return Score.of(True, f"rejected by the server (HTTP {status}), as expected")
    return Score.of(False, f"rejected by the server (HTTP {status}): {error_text[:200]}")


def score_output(item: EvalItem, scorer: ScorerName, output: str) -> Score:
    """Score a completed output with a deterministic scorer (every scorer except judge)."""
    exp = item.expected
    if scorer == "exact_match":
        return exact_match(output, exp if isinstance(exp, list) else str(exp))
    if scorer == "contains":
        return contains(output, exp if isinstance(exp, list) else str(exp))
    if scorer == "regex":
        return regex(output, str(exp))
    if scorer == "numeric":
        return numeric(output, expected_number(item), tolerance=item.tolerance)
    if scorer == "json_schema":
        return json_schema(output, item.json_schema or {})
    if scorer == "refusal":
        return refusal(output)
    raise ValueError(f"scorer {scorer!r} is not deterministic; use `judge`")


async def judge(
    item: EvalItem,
    output: str,
    *,
    input_text: str,
    llm_judge: LLMJudge,
    client: httpx.AsyncClient,
) -> Score:
    """Score with the pinned LLM judge. A judge that times out, fails or answers
    unparseably gives an `error` score: neither pass nor fail."""
    expected = None if item.expected is None else str(item.expected)
    try:
        verdict = await llm_judge.judge(
            client, input_text=input_text, output=output, expected=expected, variables=item.vars
        )
    except JudgeError as exc:
        return Score.error(f"judge: {exc.message}")
    return Score(
        outcome="pass" if verdict.passed else "fail",
        score=verdict.score,
        detail=f"judge: {verdict.reason}" if verdict.reason else "",
    )
