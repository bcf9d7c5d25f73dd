"""Eval suites: JSONL items, validated line by line against the item schema and the scorer
that will judge them, so a bad item is reported as `file:line: problem` before any request
is sent."""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from releasekit.errors import EvalError, InputMissingError
from releasekit.spec.manifest import ScorerName, Suite

Expected = str | int | float | list[str] | dict[str, Any] | None


class EvalItem(BaseModel):
    """One eval item: the prompt variables, what a good answer looks like, how to score it.

    - `vars` bind the `{{ name }}` placeholders of the release's prompts left open at lock
      time (for the demo: `question`).
    - `expected` by scorer: exact_match a string or a list of acceptable strings; contains a
      substring or a list that must all appear; regex a pattern (`re.search`); numeric a
      number (or a string holding one) with `tolerance` (absolute); judge an optional
      reference answer; refusal and json_schema need none.
    - `schema` (json_schema only) is the JSON Schema the output must satisfy.
    - `expect_error`: the input is meant to be rejected by the server (e.g. longer than the
      context window); a rejection (HTTP 400/413/422) then counts as handled, i.e. a
      pass. If the server accepts it after all, the item's scorer judges the answer.
    - `scorer` overrides the suite's default scorer; `max_tokens` the suite's limit.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    id: str = Field(min_length=1, max_length=200)
    vars: dict[str, str] = Field(default_factory=dict)
    expected: Expected = None
    scorer: ScorerName | None = None
    tolerance: float = Field(0.0, ge=0)
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    expect_error: bool = False
    max_tokens: int | None = Field(None, ge=1, le=32_768)
    tags: list[str] = Field(default_factory=list)

    def scorer_for(self, suite: Suite) -> ScorerName:
        """The scorer that judges this item: its own, else the suite's default."""
        return self.scorer or suite.scorer


class LoadedSuite(BaseModel):
    """A suite definition from the manifest with its validated items and file digest."""

    model_config = ConfigDict(frozen=True)

    suite: Suite
    path: Path
    digest: str
    items: list[EvalItem]


def _scorer_problem(item: EvalItem, scorer: ScorerName) -> str | None:
    """What makes `item` unusable with `scorer`, or None."""
    exp = item.expected
    if scorer == "exact_match":
        if isinstance(exp, str) or (isinstance(exp, list) and exp):
            return None
        return "exact_match needs `expected`: a string or a non-empty list of strings"
    if scorer == "contains":
        if (isinstance(exp, str) and exp) or (isinstance(exp, list) and exp):
            return None
        return "contains needs `expected`: a non-empty string or list of strings"
    if scorer == "regex":
        if not isinstance(exp, str):
            return "regex needs `expected`: a pattern string"
        try:
            re.compile(exp)
        except re.error as exc:
            return f"`expected` is not a valid regular expression: {exc}"
        return None
    if scorer == "numeric":
        value = _as_number(exp)
        if value is None:
            return "numeric needs `expected`: a number (or a string holding one)"
        return None
    if scorer == "json_schema":
        if item.json_schema is None:
            return "json_schema needs `schema`: a JSON Schema object"
        from jsonschema import exceptions, validators

        try:
            validators.validator_for(item.json_schema).check_schema(item.json_schema)
        except exceptions.SchemaError as exc:
            return f"`schema` is not a valid JSON Schema: {exc.message}"
        return None
    return None  # refusal needs nothing; judge takes an optional reference


def _as_number(value: Expected) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        out = float(value)
    elif isinstance(value, str):
        try:
            out = float(value.strip().replace(",", ""))
        except ValueError:
            return None
    else:
        return None
    return out if math.isfinite(out) else None


def expected_number(item: EvalItem) -> float:
    """The numeric `expected` of an item (validated at load time)."""
    value = _as_number(item.expected)
    if value is None:
        raise EvalError(f"item {item.id}: `expected` is not a number")
    return value


def _pydantic_problems(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(item)"
        msg = "unknown key (typo?)" if err["type"] == "extra_forbidden" else err["msg"]
        parts.append(f"{loc}: {msg}")
    return "; ".join(parts)


def parse_items(text: str, *, path: Path, suite: Suite) -> list[EvalItem]:
    """Parse a suite's JSONL text. Blank lines are skipped; every other line must be one
    valid item usable with its scorer, and ids must be unique.

    Raises EvalError naming `file:line` and the problem for the first bad line.
    """
    items: list[EvalItem] = []
    seen: dict[str, int] = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            raise EvalError(f"{where}: not valid JSON ({exc.msg})") from exc
        if not isinstance(data, dict):
            raise EvalError(f"{where}: expected a JSON object per line")
        try:
            item = EvalItem.model_validate(data)
        except ValidationError as exc:
            raise EvalError(f"{where}: {_pydantic_problems(exc)}") from exc
        problem = _scorer_problem(item, item.scorer_for(suite))
        if problem:
            raise EvalError(f"{where}: item {item.id}: {problem}")
        if item.id in seen:
            raise EvalError(f"{where}: duplicate id {item.id!r} (first on line {seen[item.id]})")
        seen[item.id] = lineno
        items.append(item)
    if not items:
        raise EvalError(f"{path}: suite {suite.name!r} has no items")
    return items


def load_suite(path: Path, suite: Suite) -> LoadedSuite:
    """Read and validate one suite file (see `parse_items`)."""
    if not path.is_file():
        raise InputMissingError(path, what=f"eval suite {suite.name!r}")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise EvalError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    items = parse_items(text, path=path, suite=suite)
    return LoadedSuite(suite=suite, path=path, digest=hashlib.sha256(data).hexdigest(), items=items)
