"""No single client decides an answer comparison: a flood from one key through the real
gateway (stand-in model servers) neither passes a bad release nor breaches a good one."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import webclient
from gateway_fakes import (
    Answering,
    admin_token,
    answering,
    bad_at_sums,
    gateway_factory,
    truth,
    wait_until,
)

from releasekit.deploy.gateway import Mirror, Route, RouteTable, ThreadedGateway
from releasekit.deploy.gateway_client import GatewayClient
from releasekit.evaluate.answer_compare import ExactComparator
from releasekit.evaluate.answers import AnswerPolicy, AnswerVerdict, judge_answers
from releasekit.promote.answer_pairs import compared

__all__ = ["admin_token", "answering", "gateway_factory"]

Gw = Callable[..., ThreadedGateway]
USERS = [f"sk-user-{i:02d}-0123456789abcdef" for i in range(12)]
FLOODER = "sk-flooder-0123456789abcdef"
_noise = itertools.count()


def noisy(answer: Callable[[str], str]) -> Callable[[str], str]:
    """`answer`, except that a question asking for a random number gets a new one each
    time (as a sampled or nondeterministic answer would): it differs from itself."""

    def ask(q: str) -> str:
        return f"{next(_noise)}" if "random" in q else answer(q)

    return ask


class Mirrored:
    """A gateway that mirrors every request to a candidate, with its floor copies."""

    def __init__(self, gateway_factory: Gw, token: str, stable: Answering, cand: Answering) -> None:
        route = Route(release_id="s", base_url=stable.url)
        self.gw = gateway_factory(routes=[route], api_keys=[*USERS, FLOODER])
        self.token = token
        self.asked = 0
        with GatewayClient(self.gw.url, admin_token=token) as c:
            c.set_routes(
                RouteTable(
                    routes=[route],
                    mirror=Mirror(
                        route=Route(release_id="c", base_url=cand.url),
                        share=1.0,
                        max_in_flight=256,
                        pairs=5000,
                    ),
                )
            )

    def ask(self, key: str, question: str) -> None:
        body = {
            "messages": [{"role": "user", "content": question}],
            "max_tokens": 4,
            "temperature": 0,
        }
        r = webclient.post(
            self.gw.url + "/v1/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {key}"},
            timeout=10,
        )
        assert r.status_code == 200, r.text
        self.asked += 1

    def users(self, rounds: int) -> None:
        """Each user asks `rounds` questions: sums and capitals in turn."""
        for i in range(rounds):
            for k, key in enumerate(USERS):
                n = i * len(USERS) + k
                self.ask(key, f"sum {n} {n + 1}" if n % 2 else "capital of France?")

    def verdict(self) -> AnswerVerdict:
        with GatewayClient(self.gw.url, admin_token=self.token) as c:
            assert wait_until(lambda: c.state().mirror_pairs == self.asked, 30), c.state()
            pairs = c.mirror_pairs().pairs
        assert len(pairs) == self.asked
        return judge_answers([compared(p) for p in pairs], AnswerPolicy(), ExactComparator())


def test_one_key_flooding_easy_questions_cannot_pass_a_bad_release(
    answering: Any, gateway_factory: Gw, admin_token: str
) -> None:
    """A release wrong on every sum breaches on 12 users' questions; one key then asks 250
    easy questions both releases answer alike: it counts for at most a tenth of the pairs,
    and the verdict stays a breach."""
    gw = Mirrored(gateway_factory, admin_token, answering(truth), answering(bad_at_sums))
    gw.users(rounds=4)
    before = gw.verdict()
    assert before.verdict == "breach" and before.capped == 0, before.reason
    for _ in range(250):
        gw.ask(FLOODER, "capital of France?")
    after = gw.verdict()
    assert after.verdict == "breach", after.reason
    assert (after.clients, after.capped_clients) == (13, 1)
    assert after.capped >= 240  # the flood's pairs past its share are not counted
    assert after.pairs <= 48 + after.pairs // 10 + 1


def test_one_key_flooding_adversarial_questions_cannot_breach_a_good_release(
    answering: Any, gateway_factory: Gw, admin_token: str
) -> None:
    """A release that answers as stable does passes on 12 users' questions; one key then
    asks 250 questions whose answers differ every time they are asked (on stable too): its
    pairs differ from the candidate's as much as from stable's own second answer (the A/A
    floor cancels them), it counts for at most a tenth of the pairs, and the verdict stays
    a pass."""
    gw = Mirrored(gateway_factory, admin_token, answering(noisy(truth)), answering(noisy(truth)))
    gw.users(rounds=4)
    before = gw.verdict()
    assert before.verdict == "pass", before.reason
    for _ in range(250):
        gw.ask(FLOODER, "pick a random number")
    after = gw.verdict()
    assert after.verdict == "pass", after.reason
    [g] = after.strata
    assert g.floor_worse >= 1 and g.worse >= g.floor_worse  # the flood's pairs differ both ways
    assert (after.clients, after.capped_clients) == (13, 1)
