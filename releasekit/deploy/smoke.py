"""Smoke tests through a gateway: a few templated chat requests that must all answer, from the
expected release, with enough answers holding their expected text, and one request to each of
the release's LoRA adapters (by the model name clients use, which the gateway maps to the
engine's name) that must answer too."""

from __future__ import annotations

import time
from collections.abc import Sequence

import httpx

from releasekit._support.http import http_client
from releasekit.deploy.gateway import ADMIN_HEADER, RELEASE_HEADER
from releasekit.deploy.target import SmokeItem, SmokeItemResult, SmokeProbe, SmokeResult


def _answer(body: object) -> str | None:
    try:
        content = body["choices"][0]["message"]["content"]  # type: ignore[index]
    except (KeyError, IndexError, TypeError):
        return None
    return content if isinstance(content, str) else None


def run_smoke(
    url: str,
    probe: SmokeProbe,
    *,
    release_id: str,
    where: str,
    api_key: str | None = None,
    admin_token: str | None = None,
    transport: httpx.BaseTransport | None = None,
    adapters: Sequence[str] = (),
    suite: bool = True,
) -> SmokeResult:
    """Send `probe`'s items to `url`'s templated route (`/v1/templates/<prompt>/chat/
    completions`) one by one. An item is ok when it gets 200, a non-empty answer and the
    release header names `release_id`; it passes when ok and its `expected` text (if any)
    is in the answer (case-insensitive). The run passes when every item is ok and the pass
    rate is at least `probe.min_pass_rate`. `admin_token` (the gateway's) has the answers
    name their release where the environment does not show it to clients. Each of
    `adapters` (model names) is then asked the first item once with `model` set to it: it
    must be ok (its text is not checked: an adapter answers in its own way), and the pass
    rate counts the suite's items only. `suite` False asks the adapters only (an adapter
    lane's smoke through the environment's gateway, where the base's requests go to the
    base's own release)."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    if admin_token:
        headers[ADMIN_HEADER] = admin_token
    results: list[SmokeItemResult] = []
    with http_client(
        base_url=url.rstrip("/"),
        headers=headers,
        timeout=probe.timeout_s,
        transport=transport,
        trust_env=False,
    ) as client:
        asks: list[tuple[SmokeItem, str | None]] = (
            [(item, None) for item in probe.items] if suite else []
        )
        if probe.items:
            asks += [(probe.items[0], name) for name in adapters]
        for item, adapter in asks:
            t0 = time.monotonic()
            body: dict[str, object] = {
                "variables": item.vars,
                "max_tokens": probe.max_tokens,
                "temperature": 0,
            }
            if adapter is not None:
                body["model"] = adapter
            item_id = item.id if adapter is None else f"{item.id} (adapter {adapter})"
            try:
                r = client.post(f"/v1/templates/{probe.prompt}/chat/completions", json=body)
            except httpx.HTTPError as exc:
                results.append(
                    SmokeItemResult(
                        id=item_id, ok=False, passed=False, error=repr(exc), adapter=adapter
                    )
                )
                continue
            latency = time.monotonic() - t0
            served = r.headers.get(RELEASE_HEADER)
            answer: str | None = None
            error: str | None = None
            if r.status_code != 200:
                error = f"HTTP {r.status_code}: {r.text[:200]}"
            else:
                try:
                    answer = _answer(r.json())
                except ValueError:
                    answer = None
                if not answer or not answer.strip():
                    error = "empty or malformed answer"
                elif served != release_id:
                    error = f"answered by release {served!r}, not {release_id[:12]}"
            ok = error is None
            passed = ok and (
                adapter is not None
                or item.expected is None
                or item.expected.strip().lower() in (answer or "").lower()
            )
            results.append(
                SmokeItemResult(
                    id=item_id,
                    ok=ok,
                    passed=passed,
                    status=r.status_code,
                    release=served,
                    output=answer,
                    error=error,
                    latency_s=latency,
                    adapter=adapter,
                )
            )
    n = len(results)
    answered = sum(1 for x in results if x.ok)
    asked = [x for x in results if x.adapter is None]
    rate = sum(1 for x in asked if x.passed) / len(asked) if asked else None
    problem: str | None = None
    if n == 0:
        problem = "the smoke suite has no items"
    elif answered < n:
        first = next(x for x in results if not x.ok)
        problem = f"{n - answered} of {n} smoke requests failed (first: {first.id}: {first.error})"
    elif rate is not None and rate < probe.min_pass_rate:
        problem = (
            f"smoke pass rate {rate:.0%} is below the environment's minimum "
            f"{probe.min_pass_rate:.0%}"
        )
    return SmokeResult(
        where=where,
        url=url,
        release_id=release_id,
        passed=problem is None,
        n=n,
        answered=answered,
        pass_rate=rate,
        min_pass_rate=probe.min_pass_rate,
        items=results,
        problem=problem,
    )
