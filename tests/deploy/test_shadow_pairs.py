"""Answer pairs on mirrored traffic: the gateway keeps, beside each client's answer, the
shadow candidate's answer to the same request (bounded, no key, the prompt only where the
environment allows), and the shadow comparison gates on how often they agree."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import webclient
from gateway_fakes import (
    Answering,
    admin_token,
    answering,
    bad_at_sums,
    gateway_factory,
    truth,
    upstream_factory,
    wait_until,
)
from promote_kit import Kit, commit_config, kit
from typer.testing import CliRunner

from releasekit._support.http import http_client
from releasekit.cli import app
from releasekit.cli._common import State
from releasekit.config import load_settings
from releasekit.deploy.gateway import (
    Mirror,
    MirrorPair,
    MirrorPairs,
    Route,
    RouteTable,
    ThreadedGateway,
    read_pairs,
    store_dir,
)
from releasekit.deploy.gateway.mirror import TEXT_MAX, AnswerCapture
from releasekit.deploy.gateway_client import GatewayClient
from releasekit.deploy.state import read_state
from releasekit.evaluate.agreement import answers_agree
from releasekit.evaluate.answer_compare import ExactComparator
from releasekit.evaluate.answers import AnswerPolicy, AnswerVerdict, ComparedRequest, judge_answers
from releasekit.promote.answer_pairs import compared
from releasekit.promote.policy import PolicyError
from releasekit.rollout import shadow
from releasekit.rollout.progressive import promote_progressive
from releasekit.rollout.shadow import compare_shadow, start_shadow
from releasekit.stores.ledger import Ledger

__all__ = ["admin_token", "answering", "gateway_factory", "kit", "upstream_factory"]

Gw = Callable[..., ThreadedGateway]
KEY = "sk-client-key-0123456789"


def _questions(n: int) -> list[str]:
    return [
        f"sum {i} {i + 1}" if i % 2 else ("capital of France?" if i % 4 == 0 else "of Italy?")
        for i in range(n)
    ]


def _request(q: str, i: int) -> tuple[str, dict[str, Any]]:
    stream = i % 3 == 1
    if i % 2:
        return "/v1/completions", {"prompt": q, "max_tokens": 4, "stream": stream, "temperature": 0}
    msgs = [{"role": "user", "content": q}]
    body = {"messages": msgs, "max_tokens": 4, "stream": stream, "temperature": 0}
    return "/v1/chat/completions", body


def _mirrored_gateway(
    gateway_factory: Gw, admin_token: str, stable: Answering, cand: Answering, **mirror: Any
) -> ThreadedGateway:
    route = Route(release_id="s", base_url=stable.url)
    gw = gateway_factory(routes=[route], api_keys=[KEY])
    with GatewayClient(gw.url, admin_token=admin_token) as c:
        c.set_routes(
            RouteTable(
                routes=[route],
                mirror=Mirror(
                    route=Route(release_id="c", base_url=cand.url),
                    share=1.0,
                    max_in_flight=64,
                    **mirror,
                ),
            )
        )
    return gw


def test_pairs_sit_beside_byte_identical_client_answers_bounded_and_keyless(
    answering: Any, gateway_factory: Gw, admin_token: str
) -> None:
    """Every request mirrored (streamed and not, chat and completions): each client's answer
    is byte for byte what stable itself answers; the gateway keeps the latest 5 pairs of 8
    (a ring), each with both texts, a digest of the body and no prompt, key or header; the
    pairs need the admin token."""
    stable, cand = answering(truth), answering(bad_at_sums)
    gw = _mirrored_gateway(gateway_factory, admin_token, stable, cand, pairs=5)
    auth = {"authorization": f"Bearer {KEY}"}
    bodies = []
    for i, q in enumerate(_questions(8)):
        path, body = _request(q, i)
        raw = json.dumps(body).encode()
        bodies.append(raw)
        via = webclient.post(gw.url + path, content=raw, headers=auth, timeout=10)
        direct = webclient.post(stable.url + path, content=raw, timeout=10)
        assert via.status_code == 200 and via.content == direct.content
    with GatewayClient(gw.url, admin_token=admin_token) as c:
        assert wait_until(lambda: c.state().mirror_pairs == 8), c.state()
        st = c.state()
        got = c.mirror_pairs()
    assert (st.mirror_pairs, st.mirror_pairs_kept) == (8, 5)
    assert (got.release_id, got.recorded, got.kept, got.capacity) == ("c", 8, 5, 5)
    assert [p.seq for p in got.pairs] == [4, 5, 6, 7, 8]
    qs = _questions(8)
    for p in got.pairs:
        q = qs[p.seq - 1]
        assert p.complete and (p.stable, p.candidate) == (truth(q), bad_at_sums(q))
        assert p.prompt is None
        assert p.prompt_sha256 == hashlib.sha256(bodies[p.seq - 1]).hexdigest()
        assert (p.stable_release_id, p.candidate_release_id) == ("s", "c")
    raw_pairs = webclient.get(
        gw.url + "/admin/mirror/pairs",
        headers={"authorization": f"Bearer {admin_token}"},
        timeout=10,
    ).text
    assert KEY not in raw_pairs and "authorization" not in raw_pairs.lower()
    assert "sum 3 4" not in raw_pairs  # no prompt text
    with GatewayClient(gw.url, admin_token=admin_token) as c:
        assert [p.seq for p in c.mirror_pairs(since=6).pairs] == [7, 8]
    for token in (None, KEY):
        h = {"authorization": f"Bearer {token}"} if token else {}
        r = webclient.get(gw.url + "/admin/mirror/pairs", headers=h, timeout=10)
        assert r.status_code == 401


def test_a_failing_capture_never_fails_the_clients_answer(
    answering: Any, gateway_factory: Gw, admin_token: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the answer capture raising on every chunk, clients still get stable's answers
    byte for byte; the pairs are kept as not complete (not judged)."""

    def broken(self: AnswerCapture, chunk: bytes) -> None:
        raise RuntimeError("capture broke")

    monkeypatch.setattr(AnswerCapture, "feed", broken)
    stable, cand = answering(truth), answering(truth)
    gw = _mirrored_gateway(gateway_factory, admin_token, stable, cand)
    auth = {"authorization": f"Bearer {KEY}"}
    for i, q in enumerate(_questions(4)):
        path, body = _request(q, i)
        raw = json.dumps(body).encode()
        via = webclient.post(gw.url + path, content=raw, headers=auth, timeout=10)
        assert via.status_code == 200
        assert via.content == webclient.post(stable.url + path, content=raw, timeout=10).content
    with GatewayClient(gw.url, admin_token=admin_token) as c:
        assert wait_until(lambda: c.state().mirror_pairs == 4)
        got = c.mirror_pairs()
    assert all(not p.complete and p.stable is None for p in got.pairs)


def test_prompts_are_kept_only_where_allowed(
    answering: Any, gateway_factory: Gw, admin_token: str
) -> None:
    """With `keep_prompts` the pair holds the prompt text (for chat: its messages). A
    request that samples (no temperature 0) is marked so, and judged in a stratum of its
    own, against its own A/A floor: two samples may differ by chance."""
    stable, cand = answering(truth), answering(truth)
    gw = _mirrored_gateway(gateway_factory, admin_token, stable, cand, keep_prompts=True)
    auth = {"authorization": f"Bearer {KEY}"}
    for i, q in enumerate(_questions(3)):
        path, body = _request(q, i)
        if i == 2:
            del body["temperature"]
        assert webclient.post(gw.url + path, json=body, headers=auth, timeout=10).status_code == 200
    with GatewayClient(gw.url, admin_token=admin_token) as c:
        assert wait_until(lambda: c.state().mirror_pairs == 3)
        got = c.mirror_pairs()
    assert [p.prompt for p in got.pairs] == [
        "user: capital of France?",
        "sum 1 2",
        "user: of Italy?",
    ]
    assert got.keep_prompts
    assert [p.sampled for p in got.pairs] == [False, False, True]
    a = _judged(got.pairs, min_pairs=1)
    assert {x.stratum: x.pairs for x in a.strata} == {"greedy": 2, "sampled": 1}


def _judged(pairs: list[MirrorPair], *, min_pairs: int) -> AnswerVerdict:
    """The gateway's pairs judged by exact match (one test client: no per-client cap)."""
    return judge_answers(
        [compared(p) for p in pairs],
        AnswerPolicy(max_client_share=1.0, min_pairs=min_pairs),
        ExactComparator(),
    )


def test_a_candidate_wrong_on_a_class_of_questions_disagrees_with_examples(
    answering: Any, gateway_factory: Gw, admin_token: str
) -> None:
    """The pairs of a candidate that answers every sum wrong breach: half its answers
    differ from stable's while stable's own second answers (the A/A floor) never do; the
    verdict names the worse pairs by seq and prompt digest, never by text. An agreeing
    candidate's pass; fewer pairs than the minimum never pass."""
    auth = {"authorization": f"Bearer {KEY}"}

    def pairs_of(answer: Callable[[str], str], n: int) -> MirrorPairs:
        stable, cand = answering(truth), answering(answer)
        gw = _mirrored_gateway(gateway_factory, admin_token, stable, cand)
        for i, q in enumerate(_questions(n)):
            path, body = _request(q, i)
            r = webclient.post(gw.url + path, json=body, headers=auth, timeout=10)
            assert r.status_code == 200
        with GatewayClient(gw.url, admin_token=admin_token) as c:
            assert wait_until(lambda: c.state().mirror_pairs == n)
            return c.mirror_pairs()

    bad = pairs_of(bad_at_sums, 40)
    assert all(p.has_floor and p.floor == p.stable for p in bad.pairs)
    a = _judged(bad.pairs, min_pairs=30)
    [g] = a.strata
    assert (a.verdict, g.pairs, g.worse, g.floor_worse) == ("breach", 40, 20, 0), a.reason
    assert g.low is not None and g.low > 0.1 and "wholly above max +10%" in a.reason
    sums = {p.seq for p in bad.pairs if p.candidate == "I cannot count."}
    assert len(a.worse_seqs) == 10 and set(a.worse_seqs) <= sums
    assert all(len(d) == 64 for d in a.worse_prompts)
    assert "I cannot count" not in json.dumps(a.evidence())

    good = pairs_of(truth, 40)
    a = _judged(good.pairs, min_pairs=30)
    assert (a.verdict, a.pairs, a.worse_seqs) == ("pass", 40, [])
    a = _judged(good.pairs[:10], min_pairs=30)
    assert a.verdict == "insufficient" and "10 of 30 pairs" in a.reason


def test_exact_comparison_uses_the_suites_normalisation_and_counts_errors_as_differences() -> None:
    """'Paris.' agrees with ' paris'; a side that failed or was cut counts as a difference
    (a release is charged for the requests it errors on); one difference and one error in
    101 stay within a 10% excess (the interval's upper bound decides)."""
    assert answers_agree(" Paris.", "paris") and not answers_agree("Paris", "Rome")

    def req(seq: int, judged: str | None) -> ComparedRequest:
        return ComparedRequest(seq=seq, reference="4", judged=judged, floor="4.", has_floor=True)

    pairs = [req(i, "4") for i in range(99)] + [req(99, "5"), req(100, None)]
    a = judge_answers(pairs, AnswerPolicy(max_client_share=1.0, min_pairs=30), ExactComparator())
    [g] = a.strata
    assert (g.pairs, g.worse, g.floor_worse, a.verdict) == (101, 2, 0, "pass"), a.reason


def test_capture_reads_streams_across_chunk_boundaries_and_caps_text() -> None:
    """An SSE line split over two chunks is read whole; a stream without [DONE] is not
    whole; an answer is cut at TEXT_MAX characters."""
    cap = AnswerCapture(sse=True)
    event = (
        b'data: {"choices":[{"delta":{"content":"Par"}}]}\n\ndata: {"choices":[{"text":"is"}]}\n\n'
    )
    cap.feed(event[:20])
    cap.feed(event[20:] + b"data: [DONE]\n\n")
    assert cap.finish() == ("Paris", True, False)
    cap = AnswerCapture(sse=True)
    cap.feed(event)
    assert cap.finish() == ("Paris", False, False)
    cap = AnswerCapture(sse=False)
    cap.feed(json.dumps({"choices": [{"text": "x" * (TEXT_MAX + 10)}]}).encode())
    text, whole, cut = cap.finish()
    assert text == "x" * TEXT_MAX and whole and cut
    cap = AnswerCapture(sse=False)
    cap.feed(b'{"choices": [')
    assert cap.finish() == (None, False, False)
    cap = AnswerCapture(sse=False)
    cap.feed(b"[" * 100_000 + b"]" * 100_000)  # nested past what the parser reads
    assert cap.finish() == (None, False, False)
    cap = AnswerCapture(sse=True)
    cap.feed(b'data: {"choices": 5}\n\ndata: ' + b"[" * 100_000 + b"\n\ndata: [DONE]\n\n")
    assert cap.finish() == ("", True, False)


# -- the shadow comparison on a deployed environment ---------------------------------------


CLIENTS = 12
"""Test clients, each from its own loopback address: the per-client cap (one client counts
for at most 10% of the pairs) needs at least 10 of them for any pair to count."""


def _asker(k: Kit, n: int) -> Callable[[float], None]:
    """A `sleep` for compare_shadow that asks `n` chat questions instead of waiting, in
    turn from CLIENTS clients (each from its own loopback address), then waits until every
    copy sent has its pair (no wall-clock window)."""
    gw: Any = read_state(k.settings.state_dir, "staging").gateway
    asked = [0]

    def ask(_: float) -> None:
        for _ in range(n):
            j = asked[0]
            asked[0] += 1
            body = {
                "model": "demo",
                "messages": [{"role": "user", "content": f"question {j}"}],
                "max_tokens": 4,
                "temperature": 0,
            }
            local = f"127.0.0.{10 + j % CLIENTS}"
            with http_client(base_url=gw.url, timeout=30, local_address=local) as http:
                assert http.post("/v1/chat/completions", json=body).status_code == 200
        with GatewayClient(gw.url, admin_token=gw.admin_token) as c:
            assert wait_until(lambda: c.state().mirror_pairs == c.state().mirrored, 30)

    return ask


def _candidate(k: Kit, name: str, answer: str | None) -> str:
    path = k.variant("demo-bf16", name, {"max-num-seqs: 32": "max-num-seqs: 16"})
    if answer is not None:
        kv = 'VLLM_CPU_KVCACHE_SPACE: "1"'
        path.write_text(path.read_text().replace(kv, f'{kv}\n    FAKE_ANSWER: "{answer}"'))
    return k.build(name)


def test_shadow_compare_blocks_a_candidate_that_answers_differently(
    kit: Kit, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A candidate answering "Paris" where stable answers "The answer is 42." breaches: its
    answers differ on every pair, stable's own second answers (the A/A floor, copies to
    stable under its pair label) on none. The comparison and its signed ledger event hold
    counts, the A/A floor, the power and the worse pairs by seq and prompt digest (no text:
    the policy keeps no prompts here, and answers stay in the pair store). Pairs from fewer
    clients than the per-client cap allows decide nothing; the minimum is the committed
    policy's, and a policy changed for one command is refused."""
    old = kit.build("demo-bf16")
    assert promote_progressive(kit.settings, old, env="staging", reason="base").ok
    cand = _candidate(kit, "demo-shadow-paris", "Paris")
    start_shadow(kit.settings, cand, env="staging", share=1.0, reason="try it")
    few = compare_shadow(kit.settings, env="staging", window_s=1, checks=[], sleep=_asker(kit, 5))
    assert few.verdict == "insufficient" and few.agreement is not None
    assert "too few clients" in few.reason, few.reason

    cmp = compare_shadow(kit.settings, env="staging", window_s=1, checks=[], sleep=_asker(kit, 30))
    a = cmp.agreement
    assert cmp.verdict == "breach" and isinstance(a, AnswerVerdict), cmp.reason
    [g] = a.strata
    assert (g.pairs, g.worse, g.floor_worse, a.min_pairs) == (30, 30, 0, 27), a
    assert (a.clients, a.capped) == (CLIENTS, 0) and len(a.worse_seqs) == 10
    [rec] = [
        r
        for r in Ledger(kit.settings.ledger_url or "").records(types=["shadow"])
        if r.seq == cmp.seq
    ]
    ev = rec.evidence["answers"]
    assert ev["verdict"] == "breach" and ev["pairs"] == 30 and len(ev["worse_prompts"]) == 10
    assert set(rec.evidence["answers_key"]) == {"model", "prompts", "serving"}
    text = json.dumps(rec.evidence)
    assert "question" not in text and "Paris" not in text and "The answer is" not in text
    # Its HTML page, beside the JSON copy: the strata, the floor and the power.
    assert cmp.page is not None and cmp.page.endswith(".comparison.html")
    page = Path(cmp.page).read_text()
    assert "BREACH: shadow" in page and "Answers (exact)" in page and "A/A floor" in page
    # The environment's gateway kept the pairs on disk, with the floor answers (no prompt:
    # none is allowed).
    stored = store_dir(kit.settings.state_dir, "staging")
    gw: Any = read_state(kit.settings.state_dir, "staging").gateway
    with GatewayClient(gw.url, admin_token=gw.admin_token) as c:
        n = c.state().mirror_pairs
    assert n >= 35
    assert wait_until(lambda: len(read_pairs(stored, cmp.release_id)) == n, 30)
    on_disk = read_pairs(stored, cmp.release_id)
    assert [p.seq for p in on_disk] == list(range(1, n + 1))
    assert all(p.floor == p.stable == "The answer is 42." for p in on_disk)
    assert "question" not in "".join(f.read_text() for f in stored.iterdir())

    # The CLI prints the verdict, the A/A floor and the power, one line each; exit 1.
    with monkeypatch.context() as m:
        m.setattr(shadow, "compare_shadow", lambda *a, **kw: cmp)
        State.reset()
        r = CliRunner().invoke(app, ["shadow", "compare", "--env", "staging"])
    assert r.exit_code == 1, r.output
    assert "answers (exact): breach, excess +100%" in r.output
    assert "A/A floor: greedy 0.0% (0/30)" in r.output
    assert "power: 27 pairs detect an excess of" in r.output
    assert "report:" + cmp.page in "".join(r.output.split())

    # A lower minimum for one command is refused; committed, it is the policy.
    toml = kit.root / "releasekit.toml"
    head = "[environments.staging]\n"
    toml.write_text(toml.read_text().replace(head, head + "answer_min_pairs = 5\n"))
    with pytest.raises(PolicyError, match="answer_min_pairs"):
        compare_shadow(
            load_settings(root=kit.root), env="staging", window_s=1, checks=[], sleep=_asker(kit, 5)
        )
    commit_config(kit.root, "staging: 5 answer pairs are enough")
    kit.settings = load_settings(root=kit.root)
    few = compare_shadow(kit.settings, env="staging", window_s=1, checks=[], sleep=_asker(kit, 10))
    assert few.verdict == "breach" and few.agreement is not None
    assert few.agreement.min_pairs == 5


def test_shadow_compare_passes_a_candidate_that_answers_the_same(kit: Kit) -> None:
    """A candidate with stable's answers passes: no excess over the A/A floor in 30 pairs
    from 12 clients."""
    old = kit.build("demo-bf16")
    assert promote_progressive(kit.settings, old, env="staging", reason="base").ok
    cand = _candidate(kit, "demo-shadow-same", None)
    start_shadow(kit.settings, cand, env="staging", share=1.0, reason="try it")
    cmp = compare_shadow(
        kit.settings,
        env="staging",
        window_s=1,
        checks=[],
        sleep=_asker(kit, 30),
    )
    a = cmp.agreement
    assert cmp.verdict == "pass" and isinstance(a, AnswerVerdict), cmp.reason
    assert (a.pairs, a.worse_seqs, a.clients) == (30, [], CLIENTS)


def test_the_window_grows_until_the_comparison_has_its_pairs(kit: Kit) -> None:
    """With `max_window_s` the comparison measures on, a window at a time, while its answers
    are undecided (a slower host serves fewer requests a second): 12 pairs a window pass in
    the third (36 pairs; 3 looks, each at confidence 1 - 0.05/3); capped before enough pairs,
    it is still insufficient, over the longest window allowed."""
    old = kit.build("demo-bf16")
    assert promote_progressive(kit.settings, old, env="staging", reason="base").ok
    cand = _candidate(kit, "demo-shadow-grow", None)
    start_shadow(kit.settings, cand, env="staging", share=1.0, reason="try it")
    windows: list[float] = []
    ask = _asker(kit, 12)

    def sleep(s: float) -> None:
        windows.append(s)
        ask(s)

    cmp = compare_shadow(
        kit.settings, env="staging", window_s=1, max_window_s=3, checks=[], sleep=sleep
    )
    assert cmp.agreement is not None and cmp.agreement.pairs == 36, cmp.reason
    # The settle before the window first (the canary's settle_s), then three windows.
    assert cmp.verdict == "pass" and windows[1:] == [1, 1, 1] and cmp.window_s == 3
    capped = compare_shadow(
        kit.settings, env="staging", window_s=1, max_window_s=2, checks=[], sleep=_asker(kit, 5)
    )
    assert capped.verdict == "insufficient" and capped.window_s == 2
    assert "10 of " in capped.reason, capped.reason
