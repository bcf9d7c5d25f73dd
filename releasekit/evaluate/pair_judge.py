"""The `judge` answer comparator: a pinned judge model says whether two answers to the same
question say the same thing and, if not, which is better.

    judge = PairJudge(policy.answer_judge, root=root)
    judge.compare(reference, other, prompt=question)   # "worse" | "same" | "better"

The judge is any OpenAI-compatible server (`/v1/chat/completions` at `endpoint`), asked at
temperature 0 with a bound on its answer's length. Each comparison asks it twice, once with
the reference as answer A and once with it as answer B, to cancel a preference for a
position: the same verdict in both orders stands; orders that disagree are a tie, judged
`same` and counted in `ties`. Identical texts are `same` without asking.

The prompt is the built-in template (`templates/pair_judge.md`) or the environment's
`answer_judge.prompt` file (relative to the project root), with the placeholders
`{{ question }}`, `{{ a }}` and `{{ b }}`. Where the question is not kept, the judge is told
so in the question's place and compares the two answers on their own.

The judge must answer with a JSON object, `{"same": true}` or
`{"same": false, "better": "A" | "B"}`; a ``` fence, a reasoning block or text around it
is allowed. Anything else, an HTTP error, a timeout (`timeout_s`) or an unreachable
endpoint raises JudgeError: the answer comparison is then not judged (never a pass).

Verdicts are cached in memory per (reference, other, question) digest, since each look
of a comparison reads the same pairs again.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Literal

import httpx

from releasekit._support.http import http_client
from releasekit.config.environments import AnswerJudgeConfig
from releasekit.errors import JudgeError, PromptError
from releasekit.evaluate.answers import ComparisonKind, Judged
from releasekit.evaluate.judge import chat_url
from releasekit.spec.prompts import placeholders, read_template, render

BUILT_IN_PROMPT = Path(__file__).resolve().parent / "templates" / "pair_judge.md"
PLACEHOLDERS = frozenset({"question", "a", "b"})
NO_QUESTION = (
    "(The question was not kept. Compare the two answers on their own: whether they say "
    "the same thing and, if not, which is the better answer.)"
)
MAX_TOKENS = 256
TEMPERATURE = 0.0

Preferred = Literal["same", "A", "B"]

_THINK = re.compile(r"<think>.*?(?:</think>|\Z)", re.S | re.I)
_FENCE = re.compile(r"```[a-zA-Z0-9_-]*\s*(.*?)```", re.S)
_TRUE = {"true", "yes"}
_FALSE = {"false", "no"}
# What a preference means for the answer compared, placed as B (first order) or A (second).
_OTHER_AS_B: dict[Preferred, Judged] = {"same": "same", "B": "better", "A": "worse"}
_OTHER_AS_A: dict[Preferred, Judged] = {"same": "same", "A": "better", "B": "worse"}
_FORMAT = '{"same": true} or {"same": false, "better": "A"|"B"}'


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _one_line(text: str, limit: int = 160) -> str:
    return " ".join(text.split())[:limit]


def _objects(text: str) -> list[dict[str, Any]]:
    """Every JSON object in `text`, in order (nested ones included)."""
    decoder = json.JSONDecoder()
    found: list[dict[str, Any]] = []
    i = text.find("{")
    while i != -1:
        try:
            doc, _ = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            doc = None
        if isinstance(doc, dict):
            found.append(doc)
        i = text.find("{", i + 1)
    return found


def _as_bool(value: Any) -> bool | None:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        v = value.strip().lower()
        if v in _TRUE:
            return True
        if v in _FALSE:
            return False
    return None


def _as_side(value: Any) -> Literal["A", "B"] | None:
    if not isinstance(value, str):
        return None
    v = value.strip().upper().removeprefix("ANSWER").strip()
    if v == "A":
        return "A"
    if v == "B":
        return "B"
    return None


def parse_preference(text: str) -> Preferred:
    """The judge's answer as `same`, `A` or `B` (format in the module docstring); the last
    well-formed verdict object wins, so an answer that quotes the format before giving its
    own verdict reads right. JudgeError if there is none."""
    body = _THINK.sub("", text)
    fenced = [m.group(1) for m in _FENCE.finditer(body)]
    for chunk in [*fenced, body]:
        for doc in reversed(_objects(chunk)):
            same = _as_bool(doc.get("same"))
            if same is True:
                return "same"
            side = _as_side(doc.get("better"))
            if same is False and side is not None:
                return side
    raise JudgeError(
        f"the answer judge's reply is not a verdict: {_one_line(text)!r}",
        remedy=f"make the judge answer {_FORMAT} (check answer_judge.model and its prompt)",
    )


class PairJudge:
    """The `judge` comparator (`releasekit.evaluate.answers.Comparator`): a pinned judge
    asked in both orders whether an answer says the same as the reference, else which is
    better. `ties` counts the comparisons whose two orders disagreed (judged `same`)."""

    kind: ComparisonKind = "judge"

    def __init__(self, config: AnswerJudgeConfig, *, root: Path) -> None:
        """Raises InputMissingError if `config.prompt` does not exist, PromptError if it
        lacks `{{ a }}` or `{{ b }}` or names another placeholder."""
        self.config = config
        self.url = chat_url(config.endpoint)
        if config.prompt is None:
            path, self.prompt_file = BUILT_IN_PROMPT, "built-in"
        else:
            path = config.prompt if config.prompt.is_absolute() else root / config.prompt
            self.prompt_file = config.prompt.as_posix()
        self.template = read_template(path)
        self.prompt_sha256 = hashlib.sha256(path.read_bytes()).hexdigest()
        names = placeholders(self.template)
        if not {"a", "b"} <= names or names - PLACEHOLDERS:
            raise PromptError(
                f"answer judge prompt {self.prompt_file} must use {{{{ a }}}} and {{{{ b }}}} "
                f"(and may use {{{{ question }}}}); it uses {sorted(names) or 'none'}",
                remedy="fix the placeholders in the prompt file answer_judge.prompt names",
            )
        self.ties = 0
        self.asked = 0
        self._cache: dict[tuple[str, str, str], Judged] = {}
        self._client: httpx.Client | None = None

    def identity(self) -> dict[str, Any]:
        """Kind, endpoint, model, temperature and the prompt's file and sha256."""
        return {
            "kind": self.kind,
            "endpoint": self.config.endpoint,
            "model": self.config.model,
            "temperature": TEMPERATURE,
            "max_tokens": MAX_TOKENS,
            "prompt": self.prompt_file,
            "prompt_sha256": self.prompt_sha256,
        }

    def render(self, *, question: str | None, a: str, b: str) -> str:
        """The judge prompt for answers A and B (the question's place says so when the
        question was not kept)."""
        values = {"question": NO_QUESTION if question is None else question, "a": a, "b": b}
        return render(self.template, values, strict=True)

    def compare(self, reference: str, other: str, *, prompt: str | None) -> Judged:
        """`other` against `reference`, asked in both orders (see the module docstring).
        Raises JudgeError when the judge cannot be asked or answers no verdict."""
        if other == reference:
            return "same"
        key = (_sha256(reference), _sha256(other), "" if prompt is None else _sha256(prompt))
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        first = self._ask(self.render(question=prompt, a=reference, b=other))
        second = self._ask(self.render(question=prompt, a=other, b=reference))
        as_b, as_a = _OTHER_AS_B[first], _OTHER_AS_A[second]
        verdict = as_b
        if as_a != as_b:
            self.ties += 1
            verdict = "same"
        self._cache[key] = verdict
        return verdict

    def close(self) -> None:
        """Close the judge's HTTP connection (a later comparison opens another)."""
        if self._client is not None:
            self._client.close()
            self._client = None

    def __enter__(self) -> PairJudge:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _headers(self) -> dict[str, str]:
        name = self.config.api_key_env
        if not name:
            return {}
        key = os.environ.get(name)
        if not key:
            raise JudgeError(
                f"the answer judge's API key variable {name} is not set",
                remedy=f"export {name}=... or remove answer_judge.api_key_env",
            )
        return {"Authorization": f"Bearer {key}"}

    def _ask(self, content: str) -> Preferred:
        """One question to the judge: its preference between answers A and B."""
        body = {
            "model": self.config.model,
            "messages": [{"role": "user", "content": content}],
            "temperature": TEMPERATURE,
            "max_tokens": MAX_TOKENS,
        }
        headers = self._headers()
        remedy = (
            f"check the answer judge at {self.config.endpoint} (answer_judge in the "
            "environment's policy); the answers are not judged until it answers"
        )
        if self._client is None:
            self._client = http_client(timeout=self.config.timeout_s)
        self.asked += 1
        try:
            r = self._client.post(self.url, json=body, headers=headers)
        except httpx.TimeoutException as exc:
            raise JudgeError(
                f"the answer judge timed out after {self.config.timeout_s:g}s ({self.url})",
                remedy=remedy,
            ) from exc
        except httpx.HTTPError as exc:
            raise JudgeError(
                f"the answer judge could not be reached ({self.url}): "
                f"{_one_line(str(exc)) or type(exc).__name__}",
                remedy=remedy,
            ) from exc
        if r.status_code != 200:
            raise JudgeError(
                f"the answer judge answered HTTP {r.status_code}: {_one_line(r.text)!r}",
                remedy=remedy,
            )
        try:
            text = r.json()["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise JudgeError(
                f"the answer judge's reply is not a chat completion: {_one_line(r.text)!r}",
                remedy=remedy,
            ) from exc
        if not isinstance(text, str):
            raise JudgeError("the answer judge's reply has no text", remedy=remedy)
        return parse_preference(text)
