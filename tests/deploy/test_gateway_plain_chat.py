"""A release whose prompts take plain chat requests too (`prompts.plain_chat: template`):
the gateway renders a client's own chat messages through the release's templates, for the
client's request and for every copy a mirror sends, each by its own route's rule."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import webclient
from gateway_fakes import (
    Answering,
    FakeUpstream,
    admin_token,
    answering,
    gateway_factory,
    upstream_factory,
    wait_until,
)
from pydantic import ValidationError

from releasekit.deploy.gateway import Mirror, PromptTemplate, Route, RouteTable, ThreadedGateway
from releasekit.deploy.gateway_client import GatewayClient
from releasekit.evaluate.answer_compare import ExactComparator
from releasekit.evaluate.answers import AnswerPolicy, judge_answers
from releasekit.promote.answer_pairs import compared

__all__ = ["admin_token", "answering", "gateway_factory", "upstream_factory"]

Gw = Callable[..., ThreadedGateway]
TEMPLATE = PromptTemplate(system="Be brief.", user="Question: {{ question }}\nAnswer:")
PROMPTS = {"chat": TEMPLATE}


def _route(release_id: str, url: str, *, plain: bool = True) -> Route:
    return Route(
        release_id=release_id,
        base_url=url,
        model="demo",
        prompts=PROMPTS,
        plain_chat_prompt="chat" if plain else None,
    )


def _sent(up: FakeUpstream) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(up.received[-1]["body"])
    return body


def test_a_plain_chat_request_goes_through_the_releases_templates(
    upstream_factory: Callable[[str], FakeUpstream], gateway_factory: Gw
) -> None:
    """The last user message (text, or text parts) fills the user template; the system
    prompt goes first only when the client sends none; earlier turns, other fields, a
    message with an image, and completions requests go as sent; the client's text is put in
    literally (a placeholder in it stays text)."""
    a = upstream_factory("a")
    gw = gateway_factory([_route("fix", a.url)])
    url = gw.url + "/v1/chat/completions"

    r = webclient.post(url, json={"messages": [{"role": "user", "content": "2+2?"}], "n": 1})
    assert r.status_code == 200 and r.headers["x-releasekit-release"] == "fix"
    assert _sent(a) == {
        "n": 1,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Question: 2+2?\nAnswer:"},
        ],
    }

    own = [
        {"role": "system", "content": "You are the shop's bot."},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    webclient.post(url, json={"model": "demo", "messages": own})
    assert _sent(a)["messages"] == [
        *own[:3],
        {"role": "user", "content": "Question: a\nb\nAnswer:"},
    ]

    webclient.post(url, json={"messages": [{"role": "user", "content": "{{ question }} x"}]})
    assert _sent(a)["messages"][-1]["content"] == "Question: {{ question }} x\nAnswer:"

    image = [{"type": "image_url", "image_url": {"url": "data:,"}}, {"type": "text", "text": "?"}]
    raw = json.dumps({"messages": [{"role": "user", "content": image}]}).encode()
    webclient.post(url, content=raw, headers={"content-type": "application/json"})
    assert a.received[-1]["body"] == raw

    raw = b'{"model": "demo", "prompt": "2+2?"}'
    webclient.post(
        gw.url + "/v1/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert a.received[-1]["body"] == raw


def _right_only_when_templated(question: str) -> str:
    # Stands in for the demo model: right when asked through the release's user template,
    # wrong on a bare question.
    return "Binburg" if question.startswith("Question: ") else "Lormark"


def test_each_mirror_copy_follows_its_own_releases_rule_and_the_pair_keeps_the_clients_text(
    answering: Callable[[Callable[[str], str]], Answering], gateway_factory: Gw, admin_token: str
) -> None:
    """After a promotion to a release that templates plain chat, the copies to the release
    it replaced go as the client sent them (that release's rule), so the pair shows what
    the fix changed; the pair keeps the client's own text, not the rendered one. Exact match
    counts every fixed answer as worse."""
    new, prev = answering(_right_only_when_templated), answering(_right_only_when_templated)
    live = _route("fix", new.url)
    gw = gateway_factory(routes=[live])
    mirror = Mirror(
        route=_route("old", prev.url, plain=False),
        share=1.0,
        purpose="after_promotion",
        keep_prompts=True,
    )
    with GatewayClient(gw.url, admin_token=admin_token) as c:
        c.set_routes(RouteTable(routes=[live], mirror=mirror))
    questions = [f"What is the capital of Land{i}?" for i in range(6)]
    for q in questions:
        body = {"messages": [{"role": "user", "content": q}], "temperature": 0, "max_tokens": 8}
        r = webclient.post(gw.url + "/v1/chat/completions", json=body, timeout=10)
        assert r.json()["choices"][0]["message"]["content"] == "Binburg"
    with GatewayClient(gw.url, admin_token=admin_token) as c:
        assert wait_until(lambda: c.state().mirror_pairs == len(questions))
        pairs = c.mirror_pairs().pairs
    assert {(p.stable, p.candidate, p.floor) for p in pairs} == {("Binburg", "Lormark", "Lormark")}
    assert sorted(p.prompt or "" for p in pairs) == sorted(f"user: {q}" for q in questions)
    verdict = judge_answers(
        [compared(p) for p in pairs],
        AnswerPolicy(max_client_share=1.0, min_pairs=len(questions)),
        ExactComparator(),
    )
    assert verdict.strata[0].worse == len(questions) and verdict.strata[0].floor_worse == 0


def test_a_route_names_a_prompt_that_can_take_a_plain_request() -> None:
    """The prompt must be the route's own, with one placeholder in its user template and
    none in its system template."""
    with pytest.raises(ValidationError, match="not one of the route's prompts"):
        Route(release_id="r", base_url="http://127.0.0.1:1", plain_chat_prompt="chat")
    two = {"chat": PromptTemplate(user="{{ a }} {{ b }}")}
    with pytest.raises(ValidationError, match="exactly one placeholder"):
        Route(release_id="r", base_url="http://127.0.0.1:1", prompts=two, plain_chat_prompt="chat")
    sys_var = {"chat": PromptTemplate(system="Be {{ tone }}.", user="{{ q }}")}
    with pytest.raises(ValidationError, match="system template none"):
        Route(
            release_id="r", base_url="http://127.0.0.1:1", prompts=sys_var, plain_chat_prompt="chat"
        )
