"""Score a served demo model on an eval suite through /v1/chat/completions.

Starts nothing: point it at a running vLLM server. Each item's question is
put through the user template (``{{ question }}`` plus any ``--var``
bindings), the system template is the system message, and the request runs
at temperature 0 with ``max_tokens`` 32. Scoring mirrors the suite schema:

- ``exact_match``: answer equals ``expected`` after trimming whitespace and
  a trailing full stop, case-insensitively;
- ``numeric``: the first number in the answer is within ``tolerance``;
- ``refusal``: the answer contains the refusal phrase; an item with
  ``expect_error`` passes when the server rejects the request (HTTP 4xx).

Usage::

    python pipelines/demo/check_served.py --base-url http://127.0.0.1:8411 \\
        --model demo --suite pipelines/eval/core.jsonl \\
        --user-template prompts/demo/user.txt
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import world as w

ROOT = Path(__file__).resolve().parents[2]
REFUSAL_MARKER = "cannot answer"
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@dataclass(frozen=True)
class Outcome:
    """The result of one item."""

    item_id: str
    passed: bool
    answer: str
    tags: tuple[str, ...]


def normalise(text: str) -> str:
    """Trim, drop one trailing full stop, lower-case."""
    text = text.strip()
    return text[:-1].strip().casefold() if text.endswith(".") else text.casefold()


def score(item: Mapping[str, Any], answer: str | None, status: int) -> bool:
    """Whether ``answer`` (``None`` when the server refused the request) passes."""
    if item.get("expect_error"):
        return answer is None and 400 <= status < 500
    if answer is None:
        return False
    scorer = item["scorer"]
    if scorer == "exact_match":
        return normalise(answer) == normalise(str(item["expected"]))
    if scorer == "numeric":
        match = _NUMBER.search(answer)
        return match is not None and abs(float(match.group()) - float(item["expected"])) <= float(
            item.get("tolerance", 0)
        )
    if scorer == "refusal":
        return REFUSAL_MARKER in answer.casefold()
    raise ValueError(f"{item['id']}: unknown scorer {scorer!r}")


async def ask(
    client: httpx.AsyncClient, model: str, system: str, user: str, max_tokens: int
) -> tuple[str | None, int]:
    """One chat completion; returns (answer or None on an HTTP error, status)."""
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": user})
    body = {"model": model, "messages": messages, "temperature": 0, "max_tokens": max_tokens}
    response = await client.post("/v1/chat/completions", json=body)
    if response.status_code != 200:
        return None, response.status_code
    content = response.json()["choices"][0]["message"]["content"]
    return content or "", response.status_code


async def run_suite(
    base_url: str,
    model: str,
    items: Sequence[Mapping[str, Any]],
    system: str,
    user_template: str,
    bindings: Mapping[str, str],
    concurrency: int,
    max_tokens: int,
) -> list[Outcome]:
    """Query every item (``concurrency`` at a time) and score it."""
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=120.0) as client:

        async def one(item: Mapping[str, Any]) -> Outcome:
            user = w.render_prompt(user_template, {**bindings, **item["vars"]})
            async with gate:
                answer, status = await ask(client, model, system, user, max_tokens)
            shown = answer if answer is not None else f"<HTTP {status}>"
            return Outcome(
                item["id"], score(item, answer, status), shown, tuple(item.get("tags", ()))
            )

        return list(await asyncio.gather(*(one(item) for item in items)))


def main(argv: Sequence[str] | None = None) -> int:
    """Run one suite and print accuracy overall and per tag."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8411")
    parser.add_argument("--model", default="demo", help="served model name")
    parser.add_argument("--suite", type=Path, required=True, help="eval JSONL file")
    parser.add_argument("--user-template", type=Path, default=ROOT / "prompts/demo/user.txt")
    parser.add_argument("--system-template", type=Path, default=ROOT / "prompts/demo/system.txt")
    parser.add_argument(
        "--var", action="append", default=[], metavar="NAME=VALUE", help="extra prompt binding"
    )
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--show-failures", type=int, default=10, help="print up to N failed items")
    args = parser.parse_args(argv)

    items = [
        json.loads(line)
        for line in args.suite.read_text(encoding="utf-8").splitlines()
        if line.strip()
    ]
    bindings = dict(v.split("=", 1) for v in args.var)
    system = w.read_prompt(args.system_template)
    user_template = w.read_prompt(args.user_template)
    outcomes = asyncio.run(
        run_suite(
            args.base_url,
            args.model,
            items,
            system,
            user_template,
            bindings,
            args.concurrency,
            args.max_tokens,
        )
    )

    passed = sum(o.passed for o in outcomes)
    share = passed / len(outcomes) if outcomes else 0.0
    print(f"{args.suite.name} ({args.user_template.name}): {passed}/{len(outcomes)} = {share:.3f}")
    totals: Counter[str] = Counter()
    hits: Counter[str] = Counter()
    for outcome in outcomes:
        for tag in outcome.tags:
            totals[tag] += 1
            hits[tag] += outcome.passed
    for tag in sorted(totals):
        print(f"  {tag:12s} {hits[tag]}/{totals[tag]} = {hits[tag] / totals[tag]:.3f}")
    failures = [o for o in outcomes if not o.passed]
    for outcome in failures[: args.show_failures]:
        print(f"  FAIL {outcome.item_id}: {outcome.answer[:80]!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
