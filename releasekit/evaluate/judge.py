"""LLM-as-judge: a pinned judge model on any OpenAI-compatible endpoint.

The judge is pinned by the manifest (endpoint, model, prompt file, rubric, temperature 0)
and its identity, including the sha256 of the prompt file, is recorded with every score it
gives. The prompt file is a template with `{{ name }}` placeholders: `rubric`, `input` (the
user message the release received), `output` (the release's answer), `expected` (the item's
reference answer, "" if none) and every variable of the item.

The judge must answer with a verdict the parser understands (`parse_verdict`):

- a JSON object (optionally in a ``` fence) with `"verdict": "pass" | "fail"` or
  `"pass": true | false`, an optional `"score"` in [0, 1] and an optional `"reason"`; or
- text containing `VERDICT: PASS` / `VERDICT: FAIL`, or starting with PASS or FAIL.

Anything else, a timeout, an HTTP error or an unreachable endpoint raises JudgeError, which
the scorer turns into an error item.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict

from releasekit.errors import EvalError, JudgeError
from releasekit.spec.manifest import LoadedManifest
from releasekit.spec.prompts import read_template, render


class JudgeIdentity(BaseModel):
    """Who judged: recorded with every judged score so a verdict can be traced and
    reproduced."""

    model_config = ConfigDict(extra="forbid")

    endpoint: str
    model: str
    prompt_file: str
    prompt_digest: str
    rubric: str
    rubric_digest: str
    temperature: float


class JudgeVerdict(BaseModel):
    """One parsed judge answer."""

    passed: bool
    score: float
    reason: str = ""
    raw: str = ""


def chat_url(endpoint: str) -> str:
    """The chat-completions URL of an endpoint given as `host`, `host/v1` or the full URL."""
    e = endpoint.rstrip("/")
    if e.endswith("/chat/completions"):
        return e
    if e.endswith("/v1"):
        return e + "/chat/completions"
    return e + "/v1/chat/completions"


_FENCE = re.compile(r"```[a-zA-Z0-9_-]*\s*(.*?)```", re.S)
_OBJECT = re.compile(r"\{.*\}", re.S)
_TAGGED = re.compile(r"\bverdict\s*[:=]\s*\**\s*(pass|fail)\b", re.I)
_LEADING = re.compile(r"^\W*(pass|fail)(?:ed)?\b", re.I)


def _from_json(text: str) -> JudgeVerdict | None:
    fenced = _FENCE.search(text)
    body = fenced.group(1) if fenced else text
    m = _OBJECT.search(body)
    if m is None:
        return None
    try:
        doc = json.loads(m.group(0))
    except json.JSONDecodeError:
        return None
    if not isinstance(doc, dict):
        return None
    passed: bool | None = None
    v = doc.get("verdict")
    if isinstance(v, str) and v.strip().lower() in ("pass", "fail"):
        passed = v.strip().lower() == "pass"
    for key in ("pass", "passed"):
        if passed is None and isinstance(doc.get(key), bool):
            passed = bool(doc[key])
    if passed is None:
        return None
    score: Any = doc.get("score", 1.0 if passed else 0.0)
    if isinstance(score, bool) or not isinstance(score, int | float) or not 0 <= score <= 1:
        return None
    reason = doc.get("reason", "")
    return JudgeVerdict(
        passed=passed, score=float(score), reason=str(reason)[:500], raw=text[:2000]
    )


def parse_verdict(text: str) -> JudgeVerdict:
    """Parse a judge answer (formats in the module docstring); JudgeError if none fits."""
    verdict = _from_json(text)
    if verdict is not None:
        return verdict
    m = _TAGGED.search(text) or _LEADING.search(text.strip())
    if m is None:
        raise JudgeError(f"unparseable judge answer: {text.strip()[:160]!r}")
    passed = m.group(1).lower() == "pass"
    rest = text[m.end() :].strip(" \t\n:-.")
    return JudgeVerdict(
        passed=passed, score=1.0 if passed else 0.0, reason=rest[:500], raw=text[:2000]
    )


class LLMJudge:
    """A pinned judge: renders the judge prompt for an item and asks the judge model."""

    def __init__(
        self,
        *,
        endpoint: str,
        model: str,
        prompt_template: str,
        rubric: str,
        prompt_file: str = "",
        prompt_digest: str | None = None,
        temperature: float = 0.0,
        timeout_s: float = 30.0,
        api_key: str | None = None,
        max_tokens: int = 256,
    ) -> None:
        self.url = chat_url(endpoint)
        self.template = prompt_template
        self.timeout_s = timeout_s
        self.api_key = api_key
        self.max_tokens = max_tokens
        self.identity = JudgeIdentity(
            endpoint=endpoint,
            model=model,
            prompt_file=prompt_file,
            prompt_digest=prompt_digest or hashlib.sha256(prompt_template.encode()).hexdigest(),
            rubric=rubric,
            rubric_digest=hashlib.sha256(rubric.encode()).hexdigest(),
            temperature=temperature,
        )

    @classmethod
    def from_manifest(cls, lm: LoadedManifest) -> LLMJudge | None:
        """The manifest's pinned judge, or None when it has none. Raises EvalError if its
        API-key variable is named but unset, InputMissingError if its prompt is missing."""
        j = lm.manifest.eval.judge
        if j is None:
            return None
        api_key = None
        if j.api_key_env:
            api_key = os.environ.get(j.api_key_env)
            if not api_key:
                raise EvalError(
                    f"the judge's API key variable {j.api_key_env} is not set",
                    remedy=f"export {j.api_key_env}=... or remove eval.judge.api_key_env",
                )
        path = lm.resolve(j.prompt)
        return cls(
            endpoint=j.endpoint,
            model=j.model,
            prompt_template=read_template(path),
            rubric=j.rubric,
            prompt_file=j.prompt.as_posix(),
            prompt_digest=hashlib.sha256(path.read_bytes()).hexdigest(),
            temperature=j.temperature,
            timeout_s=j.timeout_s,
            api_key=api_key,
        )

    def render(
        self,
        *,
        input_text: str,
        output: str,
        expected: str | None,
        variables: Mapping[str, str],
    ) -> str:
        """The judge prompt for one item; PromptError if a placeholder has no value."""
        values = {
            **variables,
            "rubric": self.identity.rubric,
            "input": input_text,
            "output": output,
            "expected": expected or "",
        }
        return render(self.template, values, strict=True)

    async def judge(
        self,
        client: httpx.AsyncClient,
        *,
        input_text: str,
        output: str,
        expected: str | None,
        variables: Mapping[str, str],
    ) -> JudgeVerdict:
        """Ask the judge about one output; JudgeError on timeout, HTTP or parse failure."""
        prompt = self.render(
            input_text=input_text, output=output, expected=expected, variables=variables
        )
        body = {
            "model": self.identity.model,
            "messages": [{"role": "user", "content": prompt}],
            "temperature": self.identity.temperature,
            "max_tokens": self.max_tokens,
        }
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            r = await client.post(self.url, json=body, headers=headers, timeout=self.timeout_s)
        except httpx.TimeoutException as exc:
            raise JudgeError(f"judge timed out after {self.timeout_s:g}s ({self.url})") from exc
        except httpx.HTTPError as exc:
            raise JudgeError(f"judge request failed ({self.url}): {exc!r}") from exc
        if r.status_code != 200:
            raise JudgeError(f"judge answered HTTP {r.status_code}: {r.text[:200]}")
        try:
            content = r.json()["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise JudgeError(f"judge response is not a chat completion: {r.text[:200]}") from exc
        if not isinstance(content, str):
            raise JudgeError("judge response has no text content")
        return parse_verdict(content)
