"""The `judge` answer comparator against a stand-in judge on the real HTTP path: both orders,
position bias cancelled into ties, lenient parsing, and every failure a JudgeError."""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from releasekit.config.environments import AnswerJudgeConfig
from releasekit.errors import JudgeError, PromptError
from releasekit.evaluate.answers import AnswerPolicy, ComparedRequest, judge_answers
from releasekit.evaluate.pair_judge import BUILT_IN_PROMPT, NO_QUESTION, PairJudge, parse_preference

Reply = Callable[[str], tuple[int, str]]

_A = re.compile(r"<answer_a>\n(.*?)\n</answer_a>", re.S)
_B = re.compile(r"<answer_b>\n(.*?)\n</answer_b>", re.S)


def _completion(text: str) -> tuple[int, str]:
    return 200, json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]})


def knows_capitals(prompt: str) -> tuple[int, str]:
    """A fair judge: the answer naming Paris is better; both or neither is the same."""
    a, b = _A.search(prompt), _B.search(prompt)
    assert a and b
    right_a, right_b = "Paris" in a.group(1), "Paris" in b.group(1)
    if right_a == right_b:
        return _completion('{"same": true}')
    better = "A" if right_a else "B"
    return _completion(f'Reasoning done.\n```json\n{{"same": false, "better": "{better}"}}\n```')


def prefers_a(prompt: str) -> tuple[int, str]:
    """A judge with a position bias: whatever it reads first is better."""
    return _completion('{"same": false, "better": "A"}')


class StandInJudge:
    """An OpenAI-compatible chat server on 127.0.0.1 answering each prompt with `reply`."""

    def __init__(self, reply: Reply, *, delay_s: float = 0.0) -> None:
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.stop = threading.Event()
        outer = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                n = int(self.headers.get("content-length", 0))
                body = json.loads(self.rfile.read(n))
                outer.requests.append(body)
                outer.headers.append(dict(self.headers))
                if delay_s and outer.stop.wait(delay_s):
                    return  # closing: the client gave up long ago
                status, text = reply(body["messages"][-1]["content"])
                data = text.encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.endpoint = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def close(self) -> None:
        """Stop serving and wait for every request's thread (a sleeping one wakes)."""
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def serve() -> Iterator[Callable[..., StandInJudge]]:
    started: list[StandInJudge] = []

    def start(reply: Reply, **kw: Any) -> StandInJudge:
        started.append(StandInJudge(reply, **kw))
        return started[-1]

    yield start
    for s in started:
        s.close()


def _judge(endpoint: str, tmp_path: Path, **kw: Any) -> PairJudge:
    return PairJudge(AnswerJudgeConfig(endpoint=endpoint, model="judge-1", **kw), root=tmp_path)


Q = "What is the capital of France?"


def test_same_better_and_worse_hold_in_both_orders(serve: Any, tmp_path: Path) -> None:
    srv = serve(knows_capitals)
    with _judge(srv.endpoint, tmp_path) as j:
        assert j.compare("It is Paris.", "Paris, of course.", prompt=Q) == "same"
        assert j.compare("It is Lyon.", "It is Paris.", prompt=Q) == "better"
        assert j.compare("It is Paris.", "It is Lyon.", prompt=Q) == "worse"
        assert j.ties == 0
    # each comparison asked twice, the reference first as A then as B
    assert len(srv.requests) == 6
    first, second = (r["messages"][0]["content"] for r in srv.requests[2:4])
    assert _A.search(first).group(1) == "It is Lyon."  # type: ignore[union-attr]
    assert _A.search(second).group(1) == "It is Paris."  # type: ignore[union-attr]
    assert Q in first
    assert all(r["temperature"] == 0 and r["model"] == "judge-1" for r in srv.requests)
    assert all(0 < r["max_tokens"] <= 1024 for r in srv.requests)


def test_a_judge_that_always_prefers_answer_a_gives_ties_not_better(
    serve: Any, tmp_path: Path
) -> None:
    srv = serve(prefers_a)
    j = _judge(srv.endpoint, tmp_path)
    assert j.compare("It is Lyon.", "It is Paris.", prompt=Q) == "same"
    assert j.compare("It is Paris.", "It is Lyon.", prompt=Q) == "same"
    assert j.ties == 2


def test_verdicts_are_cached_per_pair_and_identical_answers_are_not_asked(
    serve: Any, tmp_path: Path
) -> None:
    srv = serve(knows_capitals)
    j = _judge(srv.endpoint, tmp_path)
    for _ in range(3):
        assert j.compare("It is Lyon.", "It is Paris.", prompt=Q) == "better"
    assert j.compare("It is Paris.", "It is Paris.", prompt=Q) == "same"
    assert len(srv.requests) == 2
    # another question is another pair
    assert j.compare("It is Lyon.", "It is Paris.", prompt=Q + " ") == "better"
    assert len(srv.requests) == 4


def test_without_the_question_the_prompt_says_it_was_not_kept(serve: Any, tmp_path: Path) -> None:
    srv = serve(knows_capitals)
    j = _judge(srv.endpoint, tmp_path)
    assert j.compare("It is Lyon.", "It is Paris.", prompt=None) == "better"
    sent = srv.requests[0]["messages"][0]["content"]
    assert NO_QUESTION in sent and "{{" not in sent


@pytest.mark.parametrize(
    ("reply", "match"),
    [
        (lambda p: (500, "internal error"), "HTTP 500"),
        (lambda p: _completion("I think they are both fine."), "not a verdict"),
        (lambda p: _completion('{"same": false}'), "not a verdict"),
        (lambda p: _completion('{"same": false, "better": "C"}'), "not a verdict"),
        (lambda p: (200, "<html>nope</html>"), "not a chat completion"),
    ],
    ids=["http-500", "prose", "no-side", "bad-side", "not-json"],
)
def test_a_judge_that_fails_or_answers_garbage_raises_judge_error(
    serve: Any, tmp_path: Path, reply: Reply, match: str
) -> None:
    srv = serve(reply)
    with pytest.raises(JudgeError, match=match) as info:
        _judge(srv.endpoint, tmp_path).compare("It is Lyon.", "It is Paris.", prompt=Q)
    assert "\n" not in str(info.value) and info.value.remedy


def test_a_judge_slower_than_the_timeout_raises_judge_error(serve: Any, tmp_path: Path) -> None:
    srv = serve(knows_capitals, delay_s=1.5)
    j = _judge(srv.endpoint, tmp_path, timeout_s=0.2)
    start = time.monotonic()
    with pytest.raises(JudgeError, match=r"timed out after 0\.2s"):
        j.compare("It is Lyon.", "It is Paris.", prompt=Q)
    assert time.monotonic() - start < 1.5


def test_a_judge_that_is_down_raises_judge_error(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    j = _judge(f"http://127.0.0.1:{port}/v1", tmp_path, timeout_s=5)
    with pytest.raises(JudgeError, match="could not be reached"):
        j.compare("It is Lyon.", "It is Paris.", prompt=Q)


def test_an_unset_api_key_variable_raises_judge_error_and_a_set_one_is_sent(
    serve: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    srv = serve(knows_capitals)
    monkeypatch.delenv("RK_TEST_JUDGE_KEY", raising=False)
    j = _judge(srv.endpoint, tmp_path, api_key_env="RK_TEST_JUDGE_KEY")
    with pytest.raises(JudgeError, match="RK_TEST_JUDGE_KEY is not set"):
        j.compare("It is Lyon.", "It is Paris.", prompt=Q)
    monkeypatch.setenv("RK_TEST_JUDGE_KEY", "sekret")
    assert j.compare("It is Lyon.", "It is Paris.", prompt=Q) == "better"
    assert srv.headers[-1]["Authorization"] == "Bearer sekret"


def test_identity_names_the_judge_and_the_prompt_digest(serve: Any, tmp_path: Path) -> None:
    built_in = _judge("http://judge.internal:8000", tmp_path).identity()
    assert built_in["kind"] == "judge"
    assert built_in["endpoint"] == "http://judge.internal:8000"
    assert built_in["model"] == "judge-1"
    assert built_in["temperature"] == 0
    assert built_in["prompt_sha256"] == hashlib.sha256(BUILT_IN_PROMPT.read_bytes()).hexdigest()

    (tmp_path / "prompts").mkdir()
    own = tmp_path / "prompts" / "pair.txt"
    own.write_text(
        "Q: {{ question }}\n<answer_a>\n{{ a }}\n</answer_a>\n<answer_b>\n{{ b }}\n</answer_b>\n"
    )
    srv = serve(knows_capitals)
    j = _judge(srv.endpoint, tmp_path, prompt=Path("prompts/pair.txt"))
    ident = j.identity()
    assert ident["prompt"] == "prompts/pair.txt"
    assert ident["prompt_sha256"] == hashlib.sha256(own.read_bytes()).hexdigest()
    assert ident["prompt_sha256"] != built_in["prompt_sha256"]
    assert j.compare("Lyon", "Paris", prompt=Q) == "better"
    assert srv.requests[0]["messages"][0]["content"].startswith(f"Q: {Q}\n")


def test_a_prompt_without_both_answers_is_refused(tmp_path: Path) -> None:
    (tmp_path / "p.txt").write_text("Is {{ a }} good? {{ rubric }}")
    with pytest.raises(PromptError, match="must use"):
        _judge("http://judge.internal", tmp_path, prompt=Path("p.txt"))


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ('{"same": true}', "same"),
        ('{"same": false, "better": "b"}', "B"),
        ('```json\n{"same": false, "better": "A"}\n```', "A"),
        ('Answer B misses it.\n{"same": false, "better": "Answer A"} done', "A"),
        ('<think>maybe {"same": true}</think>{"same": false, "better": "B"}', "B"),
        ('Format: {"same": true} or ... My verdict: {"same": false, "better": "B"}', "B"),
        ('{"same": "yes"}', "same"),
    ],
)
def test_the_parser_is_lenient_about_fences_and_surrounding_text(text: str, want: str) -> None:
    assert parse_preference(text) == want


def _pairs(reference: Callable[[int], str], judged: Callable[[int], str]) -> list[ComparedRequest]:
    """400 pairs from 20 clients; the A/A copy always matches the reference."""
    return [
        ComparedRequest(
            seq=i,
            client=f"c{i % 20}",
            reference=reference(i),
            judged=judged(i),
            floor=reference(i),
            has_floor=True,
            prompt=Q,
            prompt_sha256=hashlib.sha256(Q.encode()).hexdigest(),
        )
        for i in range(400)
    ]


def test_a_candidate_better_on_the_differing_pairs_is_no_breach(serve: Any, tmp_path: Path) -> None:
    """End to end through the engine: where the candidate's answer differs from the
    reference (one pair in four) it names the right capital, so it passes; the same
    difference the other way round is a breach."""
    srv = serve(knows_capitals)
    j = _judge(srv.endpoint, tmp_path)
    policy = AnswerPolicy(comparison="judge", max_excess=0.1)

    def wrong(i: int) -> str:
        return f"It is {['Lyon', 'Marseille', 'Nice'][i % 3]}. ({i})"

    def right_on_some(i: int) -> str:
        return f"It is Paris. ({i})" if i % 4 == 0 else wrong(i)

    verdict = judge_answers(_pairs(wrong, right_on_some), policy, j)
    assert verdict.verdict == "pass", verdict.reason
    assert verdict.comparator["prompt_sha256"] == j.prompt_sha256
    assert j.ties == 0

    worse = judge_answers(_pairs(right_on_some, wrong), policy, j)
    assert worse.verdict == "breach", worse.reason
