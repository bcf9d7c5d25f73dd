"""Answer comparators without a judge: `exact` (equal after normalisation) and `scorer`
(known items scored as their suites score them, else reference-free checks), and
`make_comparator`, which builds the one an environment's policy names.

`scorer`, for one request:

- A *known item*: the request asks one of the questions of the suite files in
  `answer_known_items`. Its prompt (as the gateway keeps it: chat messages as
  "role: content" lines, a completion prompt, or the JSON of template variables) is
  matched, normalised as `scorers.normalise` does, against each item's
  `vars["question"]` (or its one variable): the variables' `question`, the last user
  message (whole, its first line, either without a leading "Question:"), or the whole
  prompt. Both answers are scored with the item's scorer (`scorers.score_output`): the
  other answer is `worse` when the reference passes and it fails, `better` for the
  reverse, else `same`. Items scored by `judge` are not known items here.
- Otherwise (or no prompt kept): the checks of `answer_checks`. `refusal` passes an
  answer that does not refuse (`scorers.is_refusal`), `json` one that parses as JSON
  (optionally in a code fence), `number` one that holds a number, checked only where the
  reference holds one. The other answer is `worse` when it fails a check the reference
  passes; `better` when it passes a check the reference fails and fails none the
  reference passes, except that answering where the reference refused is `same`: without
  a known question nobody can say the refusal was wrong.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from releasekit.errors import ConfigError, EvalError, InputMissingError
from releasekit.evaluate.answers import Comparator, ComparisonKind, Judged
from releasekit.evaluate.scorers import extract_number, is_refusal, normalise, score_output
from releasekit.evaluate.suites import EvalItem, load_suite
from releasekit.spec.manifest import ScorerName, Suite

if TYPE_CHECKING:
    from releasekit.config.environments import AnswerJudgeConfig

CheckName = Literal["refusal", "json", "number"]
CHECKS: tuple[CheckName, ...] = ("refusal", "json", "number")

_ROLE = re.compile(r"^(system|user|assistant|tool|developer|function|\?): ?", re.I)
_LABEL = re.compile(r"^\s*(?:question|q)\s*:\s*", re.I)
_FENCE = re.compile(r"^```[a-zA-Z0-9_-]*\s*\n?(.*?)\n?```$", re.S)


class ExactComparator:
    """`exact`: the same answer after `scorers.normalise`, else worse (never better)."""

    kind: ComparisonKind = "exact"

    def identity(self) -> dict[str, Any]:
        """Kind and normalisation."""
        return {"kind": self.kind, "normalise": "evaluate.scorers.normalise"}

    def compare(self, reference: str, other: str, *, prompt: str | None) -> Judged:
        """`same` when the normalised answers are equal, else `worse`."""
        return "same" if normalise(reference) == normalise(other) else "worse"


class KnownItem:
    """One known question: the item, the scorer that judges it and its suite file."""

    __slots__ = ("item", "scorer", "source")

    def __init__(self, item: EvalItem, scorer: ScorerName, source: str) -> None:
        self.item = item
        self.scorer = scorer
        self.source = source


def item_question(item: EvalItem) -> str | None:
    """The question an item asks: its `question` variable, else its one variable."""
    if "question" in item.vars:
        return item.vars["question"]
    if len(item.vars) == 1:
        return next(iter(item.vars.values()))
    return None


def prompt_questions(prompt: str) -> list[str]:
    """The texts of a kept prompt that may be a known question, most specific first:
    the variables' `question` (or their one value), the last user message (whole, its
    first line, each without a leading "Question:" label), the whole prompt."""
    found: list[str] = []
    try:
        doc = json.loads(prompt)
    except ValueError:
        doc = None
    if isinstance(doc, dict):
        value = doc.get("question", next(iter(doc.values())) if len(doc) == 1 else None)
        if isinstance(value, str | int | float) and not isinstance(value, bool):
            found.append(str(value))
    user = _last_user_message(prompt)
    if user is not None:
        first = user.split("\n", 1)[0]
        for text in (user, first):
            found += [text, _LABEL.sub("", text, count=1)]
    found.append(prompt)
    return found


def _last_user_message(prompt: str) -> str | None:
    """The content of the last `user:` message of a chat prompt kept as "role: content"
    lines (a message runs until the next line that starts with a role)."""
    lines = prompt.split("\n")
    starts = [i for i, line in enumerate(lines) if _ROLE.match(line)]
    users = [i for i in starts if lines[i].lower().startswith("user:")]
    if not users:
        return None
    begin = users[-1]
    end = next((i for i in starts if i > begin), len(lines))
    first = _ROLE.sub("", lines[begin], count=1)
    return "\n".join([first, *lines[begin + 1 : end]]).strip()


def _is_json(text: str) -> bool:
    body = text.strip()
    fenced = _FENCE.match(body)
    if fenced:
        body = fenced.group(1).strip()
    try:
        json.loads(body)
    except ValueError:
        return False
    return True


def _passes(check: CheckName, answer: str) -> bool:
    if check == "refusal":
        return not is_refusal(answer)
    if check == "json":
        return _is_json(answer)
    return extract_number(answer) is not None


class ScorerComparator:
    """`scorer`: known items scored by their suites' scorers, else reference-free checks
    (rules in the module docstring)."""

    kind: ComparisonKind = "scorer"

    def __init__(
        self,
        *,
        checks: Sequence[CheckName] = ("refusal",),
        known: Sequence[KnownItem] = (),
        files: Sequence[tuple[str, str, int]] = (),
    ) -> None:
        unknown = [c for c in checks if c not in CHECKS]
        if unknown:
            raise ConfigError(
                f"answer_checks: unknown check {unknown[0]!r} (known: {', '.join(CHECKS)})"
            )
        self.checks: tuple[CheckName, ...] = tuple(dict.fromkeys(checks))
        self.files = list(files)
        self._index: dict[str, KnownItem] = {}
        for k in known:
            question = item_question(k.item)
            key = normalise(question) if question is not None else ""
            if key and k.scorer != "judge":
                self._index.setdefault(key, k)

    @classmethod
    def from_files(
        cls, paths: Sequence[Path], *, root: Path, checks: Sequence[CheckName] = ("refusal",)
    ) -> ScorerComparator:
        """Known items read from suite-format JSONL files (relative to `root`).

        Raises ConfigError naming the file and `answer_known_items` when one is missing or
        not a valid suite file."""
        known: list[KnownItem] = []
        files: list[tuple[str, str, int]] = []
        for rel in paths:
            path = rel if rel.is_absolute() else root / rel
            suite = Suite(name="known-items", kind="core", path=rel)
            try:
                loaded = load_suite(path, suite)
            except InputMissingError as exc:
                raise ConfigError(f"answer_known_items: {rel} does not exist") from exc
            except EvalError as exc:
                raise ConfigError(f"answer_known_items: {exc.message}") from exc
            files.append((str(rel), loaded.digest, len(loaded.items)))
            known += [KnownItem(i, i.scorer_for(suite), str(rel)) for i in loaded.items]
        return cls(checks=checks, known=known, files=files)

    @property
    def known_questions(self) -> int:
        """Distinct known questions (judge-scored items left out)."""
        return len(self._index)

    def identity(self) -> dict[str, Any]:
        """Kind, checks and each known-items file with its sha256."""
        return {
            "kind": self.kind,
            "checks": list(self.checks),
            "known_items": [
                {"path": path, "sha256": digest, "items": n} for path, digest, n in self.files
            ],
        }

    def known_item(self, prompt: str | None) -> KnownItem | None:
        """The known item a kept prompt asks, or None."""
        if not prompt or not self._index:
            return None
        for text in prompt_questions(prompt):
            hit = self._index.get(normalise(text))
            if hit is not None:
                return hit
        return None

    def compare(self, reference: str, other: str, *, prompt: str | None) -> Judged:
        """`other` against `reference` (rules in the module docstring)."""
        known = self.known_item(prompt)
        if known is not None:
            ref_ok = score_output(known.item, known.scorer, reference).outcome == "pass"
            other_ok = score_output(known.item, known.scorer, other).outcome == "pass"
            return "worse" if ref_ok > other_ok else "better" if other_ok > ref_ok else "same"
        gained = False
        for check in self.checks:
            if check == "number" and extract_number(reference) is None:
                continue
            ref_ok, other_ok = _passes(check, reference), _passes(check, other)
            if ref_ok and not other_ok:
                return "worse"
            if other_ok and not ref_ok and check != "refusal":
                gained = True
        return "better" if gained else "same"


def make_comparator(
    kind: str,
    *,
    root: Path,
    checks: Sequence[str] = ("refusal",),
    known_items: Sequence[Path | str] = (),
    judge: AnswerJudgeConfig | None = None,
) -> Comparator:
    """The comparator of an environment's `answer_comparison` (`exact`, `scorer` with
    `answer_checks` and `answer_known_items`, `judge` with `answer_judge`).

    Raises ConfigError (one line naming the field) for an unknown kind, a missing or bad
    known-items file, an unknown check, or `judge` without a judge."""
    if kind == "exact":
        return ExactComparator()
    if kind == "scorer":
        bad = [c for c in checks if c not in CHECKS]
        if bad:
            raise ConfigError(
                f"answer_checks: unknown check {bad[0]!r} (known: {', '.join(CHECKS)})"
            )
        return ScorerComparator.from_files(
            [Path(p) for p in known_items],
            root=root,
            checks=[c for c in CHECKS if c in checks],
        )
    if kind == "judge":
        if judge is None:
            raise ConfigError('answer_comparison "judge" needs answer_judge (endpoint, model)')
        from releasekit.evaluate.pair_judge import PairJudge

        comparator: Comparator = PairJudge(judge, root=root)
        return comparator
    raise ConfigError(f"answer_comparison: unknown kind {kind!r} (exact, scorer or judge)")
