"""A canary's answers paired with the live release's: the gateway copies each request the
canary answers to the live release's server (under a label of its own, so the copies'
figures stay out of the series the canary is judged on), keeps the pair with the canary as
the side under judgement, and never delays or changes the client's answer."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest.mock import patch

import pytest
import webclient
from gateway_fakes import (
    FakeGateway,
    FakeUpstream,
    admin_token,
    answering,
    bad_at_sums,
    gateway_factory,
    stubbed_context,
    stubbed_gateway,
    truth,
    upstream_factory,
    wait_until,
)
from promote_kit import Kit, kill_everything, make_kit
from pydantic import ValidationError
from rich.console import Console
from test_canary_flow import canary_block, candidate

from releasekit._support.http import http_client
from releasekit.cli import rollout_cmds
from releasekit.config import load_settings
from releasekit.deploy.gateway import (
    Mirror,
    Route,
    RouteTable,
    ThreadedGateway,
    pair_label,
)
from releasekit.deploy.gateway_client import GatewayClient
from releasekit.deploy.state import read_state
from releasekit.evaluate.answer_compare import ExactComparator
from releasekit.evaluate.answers import AnswerPolicy, ComparedRequest, judge_answers
from releasekit.promote.policy import PolicyError
from releasekit.rollout.progressive import promote_progressive
from releasekit.stores.ledger import Ledger
from releasekit.watch.windows import parse_exposition

__all__ = ["admin_token", "answering", "gateway_factory", "upstream_factory"]

Gw = Callable[..., ThreadedGateway]
KEY = "sk-client-key-0123456789"
AUTH = {"authorization": f"Bearer {KEY}"}
WRONG_ON_SUMS = '    FAKE_WRONG_ON: "sum"'


def _question(i: int) -> str:
    if i % 2:
        return f"sum {i} {i + 1}"
    return f"capital of France ({i})?" if i % 4 == 0 else f"capital of Italy ({i})?"


def _request(i: int) -> tuple[str, dict[str, Any]]:
    q, stream = _question(i), i % 3 == 1
    if i % 2:
        return "/v1/completions", {"prompt": q, "max_tokens": 4, "stream": stream, "temperature": 0}
    msgs = [{"role": "user", "content": q}]
    return "/v1/chat/completions", {
        "messages": msgs,
        "max_tokens": 4,
        "stream": stream,
        "temperature": 0,
    }


def canary_mirror(stable: Route, canary_id: str, **kw: Any) -> Mirror:
    """The canary's mirror as the canary steps set it: copies to stable's server, labelled."""
    return Mirror(
        route=stable.model_copy(update={"release_id": pair_label(stable.release_id), "weight": 1}),
        share=1.0,
        purpose="canary",
        source=canary_id,
        **kw,
    )


def _split_gateway(
    gateway_factory: Gw, admin_token: str, stable: str, canary: str, *, stable_weight: float = 1
) -> tuple[ThreadedGateway, Route]:
    s = Route(release_id="s", base_url=stable, weight=stable_weight)
    c = Route(release_id="c", base_url=canary, weight=1)
    gw = gateway_factory(routes=[Route(release_id="s", base_url=stable)], api_keys=[KEY])
    with GatewayClient(gw.url, admin_token=admin_token) as cl:
        cl.set_routes(RouteTable(routes=[s, c], mirror=canary_mirror(s, "c", max_in_flight=64)))
    return gw, s


def _series(gw: ThreadedGateway, family: str) -> dict[str, float]:
    """Release -> the sum of `family`'s samples for it in the gateway's exposition."""
    exp = parse_exposition(webclient.get(gw.url + "/metrics", timeout=10).text, url=gw.url)
    out: dict[str, float] = {}
    for key, v in exp.samples.items():
        name, labels = key[0], dict(key[1])
        if name == family and "release" in labels:
            out[labels["release"]] = out.get(labels["release"], 0.0) + v
    return out


def test_the_canarys_answers_are_paired_with_stables_and_clients_get_theirs_unchanged(
    answering: Any, gateway_factory: Gw, admin_token: str
) -> None:
    """Traffic split between stable and a canary: every client answer is byte for byte what
    the server that answered it gives; only the canary's requests are copied (to stable's
    server), and each pair holds the canary's answer as the candidate side (what the client
    got) and stable's copy's as the stable side, with a digest of the body and no key or
    prompt. The copies' figures go under `s:pair`: stable's own request count is exactly
    the requests clients got from stable, and its TTFT/E2E series hold none of the copies."""
    stable, canary = answering(truth), answering(bad_at_sums)
    gw, _ = _split_gateway(gateway_factory, admin_token, stable.url, canary.url)
    by: dict[str, list[int]] = {"s": [], "c": []}
    digests: dict[str, int] = {}
    n = 40
    for i in range(n):
        path, body = _request(i)
        raw = json.dumps(body).encode()
        digests[hashlib.sha256(raw).hexdigest()] = i
        via = webclient.post(gw.url + path, content=raw, headers=AUTH, timeout=10)
        who = via.headers["x-releasekit-release"]
        server = stable if who == "s" else canary
        direct = webclient.post(server.url + path, content=raw, timeout=10)
        assert via.status_code == 200 and via.content == direct.content
        by[who].append(i)
    assert by["s"] and by["c"], by  # both answered some (a 1:1 split over 40 requests)
    n_c = len(by["c"])
    with GatewayClient(gw.url, admin_token=admin_token) as c:
        assert wait_until(lambda: c.state().mirror_pairs == n_c), c.state()
        st = c.state()
        got = c.mirror_pairs()
    assert (st.mirror, st.mirror_purpose, st.mirror_source) == ("s:pair", "canary", "c")
    assert (st.mirrored, st.mirror_dropped) == (n_c, 0)
    assert got.purpose == "canary" and len(got.pairs) == n_c
    for p in got.pairs:
        i = digests[p.prompt_sha256]
        q = _question(i)
        assert i in by["c"]
        assert (p.stable_release_id, p.candidate_release_id) == ("s", "c")
        assert (p.purpose, p.client_side) == ("canary", "candidate")
        assert p.complete and not p.sampled
        assert (p.stable, p.candidate) == (truth(q), bad_at_sums(q))
        assert p.prompt is None
        # The floor copy: a second copy to the live release, the same label, its answer kept.
        assert (p.has_floor, p.floor_complete, p.floor_status) == (True, True, 200)
        assert (p.floor, p.floor_release_id) == (truth(q), "s")
        assert p.client == "key:" + hashlib.blake2b(KEY.encode(), digest_size=12).hexdigest()
    raw_pairs = webclient.get(
        gw.url + "/admin/mirror/pairs",
        headers={"authorization": f"Bearer {admin_token}"},
        timeout=10,
    ).text
    assert KEY not in raw_pairs and "authorization" not in raw_pairs.lower()
    assert "sum 3 4" not in raw_pairs
    # Each server got its own requests twice (through the gateway, then directly); stable's
    # also two copies of each canary request (the copy and the floor copy).
    assert (stable.received, canary.received) == (2 * len(by["s"]) + 2 * n_c, 2 * n_c)
    # The skew: the copies are counted under their own label, never as stable's.
    reqs = _series(gw, "releasekit_gateway_requests_total")
    assert reqs == {"s": len(by["s"]), "c": n_c, "s:pair": 2 * n_c}, reqs
    e2e = _series(gw, "releasekit_gateway_e2e_seconds_count")
    assert (e2e["s"], e2e["c"], e2e["s:pair"]) == (len(by["s"]), n_c, 2 * n_c), e2e


def test_the_copies_are_capped_and_never_hold_the_canarys_answers(
    answering: Any, upstream_factory: Callable[[str], FakeUpstream], gateway_factory: Gw,
    admin_token: str,
) -> None:  # fmt: skip
    """With stable's server holding every copy's stream, a canary mirror capped at 3 copies
    in flight sends the first request's copy and floor copy (2) and drops the other 4
    requests' (counted, never queued: a request's copies go all together or none, so the
    third slot never takes a lone copy), while all 5 clients get the canary's whole
    answers; once stable lets go, the pair is recorded with its floor."""
    canary = answering(truth)
    held = upstream_factory("stable")
    s = Route(release_id="s", base_url=held.url, weight=0)
    c = Route(release_id="c", base_url=canary.url, weight=1)
    gw = gateway_factory(routes=[c], api_keys=[KEY])
    with GatewayClient(gw.url, admin_token=admin_token) as cl:
        cl.set_routes(RouteTable(routes=[s, c], mirror=canary_mirror(s, "c", max_in_flight=3)))
    body = {"prompt": "sum 1 2", "max_tokens": 4, "stream": True, "temperature": 0}
    for _ in range(5):
        r = webclient.post(
            gw.url + "/v1/completions",
            json=body,
            headers={**AUTH, "x-fake-hold": "copies"},
            timeout=10,
        )
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
        assert r.headers["x-releasekit-release"] == "c"
    with GatewayClient(gw.url, admin_token=admin_token) as cl:
        st = cl.state()
        assert (st.mirrored, st.mirror_dropped, st.mirror_pairs) == (1, 4, 0), st
        held.release("copies")
        assert wait_until(lambda: cl.state().mirror_pairs == 1), cl.state()
        pairs = cl.mirror_pairs().pairs
    assert [(p.stable, p.candidate, p.floor) for p in pairs] == [("t0t1t2", "3", "t0t1t2")]
    reqs = _series(gw, "releasekit_gateway_requests_total")
    assert "s" not in reqs and reqs["s:pair"] == 2 and reqs["c"] == 5, reqs


def test_a_canary_mirror_is_refused_without_its_source_or_label() -> None:
    """A canary's mirror names the canary it copies and sends under `<stable>:pair`; one
    whose copies would land under the live release's own id is refused, as is a source on
    any other mirror."""
    s = Route(release_id="s", base_url="http://127.0.0.1:9")
    for bad in (
        {"route": s, "source": "c"},
        {"route": s.model_copy(update={"release_id": "s:pair"})},
        {"route": s.model_copy(update={"release_id": "c:pair"}), "source": "c"},
    ):
        with pytest.raises(ValidationError):
            Mirror(share=1.0, purpose="canary", **bad)
    with pytest.raises(ValidationError, match="only a canary"):
        Mirror(route=s.model_copy(update={"release_id": "x"}), share=1.0, source="c")
    assert canary_mirror(s, "c").source == "c"


# -- a canary's steps judge its answers (local target, stand-in vLLM servers) ------------


@pytest.fixture
def akit(
    project: Path,
    monkeypatch: pytest.MonkeyPatch,
    mlflow_template_db: Path,
    stand_in_model: Any,
) -> Iterator[Kit]:
    """The deploy kit with the canary's answers compared (committed policy, 10 pairs; its
    one test client counts for every pair)."""
    stand_in_model(project)
    lines = [
        "canary_lease_s = 5",
        "canary_compare_answers = true",
        "answer_min_pairs = 10",
        "answer_max_client_share = 1.0",
    ]
    k = make_kit(project, monkeypatch, mlflow_template_db, toml_lines=lines)
    try:
        yield k
    finally:
        kill_everything(k.settings)


STEPS = "      - {weight: 50, min_duration_s: 0, min_requests: 4, max_duration_s: 300}\n" + (
    "      - {weight: 100}\n"
)
CHECKS = "      - {metric: error_rate, tolerance: 0, slack: 0.05, min_samples: 4}\n"


class Asker:
    """A client asking greedy chat questions through the gateway back to back, in a thread:
    sums (a class of questions) and capitals in turn."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.answered = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with http_client(base_url=self.url, timeout=30) as http:
            i = 0
            while not self._stop.is_set():
                q = f"sum {i} {i + 1}" if i % 2 else f"capital of France ({i})?"
                body = {
                    "model": "demo",
                    "messages": [{"role": "user", "content": q}],
                    "max_tokens": 8,
                    "temperature": 0,
                }
                r = http.post("/v1/chat/completions", json=body)
                if r.status_code == 200:
                    self.answered += 1
                elif r.status_code != 429:
                    self.failures.append(f"HTTP {r.status_code}")
                i += 1
                self._stop.wait(0.02)

    def __enter__(self) -> Asker:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def _promote_under_questions(k: Kit, new: str) -> Any:
    with Asker(k.gateway("staging")) as asker:
        assert wait_until(lambda: asker.answered >= 3, 30)
        res = promote_progressive(k.settings, new, env="staging", reason="canary")
    assert asker.failures == []
    return res


def test_a_canary_wrong_on_one_class_of_questions_is_aborted_with_its_pairs(akit: Kit) -> None:
    """A canary that answers every sum wrong (and passes its live checks) is aborted at its
    first step on its answers: the canary_aborted event holds the verdict (its excess over
    the live release's own second answers, the worse pairs by seq and prompt digest, no
    text) and the weights' answers key; the release is marked bad and the gateway is back
    on stable with no mirror left."""
    old = akit.build("demo-bf16")
    assert promote_progressive(akit.settings, old, env="staging", reason="base").ok
    block = canary_block(STEPS, CHECKS)
    new = candidate(akit, "demo-canary-sums", seqs=16, env_line=WRONG_ON_SUMS, promotion=block)
    res = _promote_under_questions(akit, new)
    assert res.status == "canary_aborted", (res.deploy, res.canary)
    assert res.canary is not None and res.canary["outcome"] == "breached"
    assert res.canary["answers_from"] == f"{old}:pair"
    led = Ledger(akit.settings.ledger_url or "")
    [ab] = led.records(environment="staging", types=["canary_aborted"])
    assert "answers:" in ab.reason and "wholly above max +10%" in ab.reason
    a = ab.evidence["answers"]
    assert a["verdict"] == "breach" and a["pairs"] >= 10 and a["min_pairs"] == 10
    [g] = a["strata"]
    assert g["low"] > 0.1 and g["floor_worse"] == 0 and 0 < len(a["worse_seqs"]) <= 10
    assert all(len(d) == 64 for d in a["worse_prompts"])
    assert "I cannot count" not in json.dumps(ab.evidence)
    assert set(ab.evidence["answers_key"]) == {"model", "prompts", "serving"}
    assert ab.evidence["steps"][0]["answers"]["verdict"] == "breach"
    assert [r.to_release for r in led.records(environment="staging", types=["mark_bad"])] == [new]
    gw = read_state(akit.settings.state_dir, "staging").gateway
    assert gw is not None
    with GatewayClient(gw.url, admin_token=gw.admin_token) as c:
        st = c.state()
    assert [r.release_id for r in st.routes] == [old] and st.mirror is None


def test_a_canary_that_answers_alike_passes_its_steps_with_its_agreement(akit: Kit) -> None:
    """A canary with the live release's answers passes its step once its answers are within
    the margin over at least the policy's 10 pairs; the step's ledger event holds the
    verdict and the step table prints it."""
    old = akit.build("demo-bf16")
    assert promote_progressive(akit.settings, old, env="staging", reason="base").ok
    new = candidate(akit, "demo-canary-alike", seqs=16, promotion=canary_block(STEPS, CHECKS))
    res = _promote_under_questions(akit, new)
    assert res.status == "promoted", (res.deploy, res.canary)
    assert res.canary is not None and res.canary["outcome"] == "passed"
    led = Ledger(akit.settings.ledger_url or "")
    [step] = led.records(environment="staging", types=["canary_step"])
    a = step.evidence["answers"]
    assert a["verdict"] == "pass" and a["pairs"] >= 10 and a["worse_seqs"] == []
    assert "answers (exact): pass, excess +0.0%" in step.reason
    console = Console(record=True, width=200)
    with patch.object(rollout_cmds, "out", console):
        from releasekit.cli import _common

        with patch.object(_common, "out", console):
            rollout_cmds.print_canary(res.canary)
    text = console.export_text()
    assert "answers (exact): pass" in text and "A/A floor: greedy 0.0%" in text, text


def test_the_copies_go_to_a_live_server_never_to_the_server_judged() -> None:
    """The canary's copies go to the live release's long-running server under `:pair`:
    with a fresh baseline, never to the baseline (its latency is judged); judged against
    the live servers, to a replica other than the one judged where there is one."""
    from releasekit.promote.deploy import ShiftContext
    from releasekit.rollout.canary import AnswersPolicy, CanaryController
    from releasekit.spec.manifest import Canary, CanaryStep

    gw = stubbed_gateway()
    policy = Canary(steps=[CanaryStep(weight=10), CanaryStep(weight=100)])
    answers = AnswersPolicy(policy=AnswerPolicy(min_pairs=10), max_in_flight=3)
    can = Route(release_id="can", base_url="http://127.0.0.1:10")
    one = Route(release_id="stb", base_url="http://127.0.0.1:11", weight=2)
    two = Route(release_id="stb#2", base_url="http://127.0.0.1:12", weight=1)

    def ctrl(stable: list[Route], baseline: Route | None = None) -> CanaryController:
        ctx = ShiftContext(
            env="staging", gateway=gw, canary=can, stable=stable, previous_release_id="stb"
        )
        return CanaryController(policy, ctx, lease_s=10, baseline=baseline, answers=answers)

    fresh = ctrl([one], baseline=Route(release_id="stb", base_url="http://127.0.0.1:13"))
    m = fresh.mirror
    assert m is not None and fresh.compared.release_id == "stb:baseline"
    assert (m.route.release_id, m.route.base_url) == ("stb:pair", one.base_url)
    assert (m.purpose, m.source, m.max_in_flight, m.share) == ("canary", "can", 3, 1.0)
    live = ctrl([one, two])
    assert live.compared.release_id == "stb" and live.mirror is not None
    assert (live.mirror.route.release_id, live.mirror.route.base_url) == (
        "stb#2:pair",
        two.base_url,
    )
    off = CanaryController(
        policy,
        ShiftContext(
            env="staging", gateway=gw, canary=can, stable=[one], previous_release_id="stb"
        ),
        lease_s=10,
    )
    assert off.mirror is None


def test_too_few_pairs_never_pass_a_judgement_and_a_disagreement_is_a_breach() -> None:
    """With answers compared, a judgement whose checks all pass is clean only once the
    answers pass: too few pairs leaves the run as it is (never a pass, never a breach); an
    excess above the margin ends it like a breaching check."""
    from releasekit.rollout.canary import next_clean
    from releasekit.rollout.judge import CheckResult, StepJudgement

    ok = CheckResult(
        metric="error_rate",
        verdict="pass",
        required=True,
        reason="ok",
        window_start=0,
        window_end=1,
    )
    j = StepJudgement(
        window_start=0, window_end=1, canary_requests=9, stable_requests=9, checks=[ok]
    )

    def agreement(same: int, differ: int) -> Any:
        def req(seq: int, judged: str) -> ComparedRequest:
            return ComparedRequest(seq=seq, reference="a", judged=judged, floor="a", has_floor=True)

        pairs = [req(i, "a") for i in range(same)] + [req(100 + i, "b") for i in range(differ)]
        policy = AnswerPolicy(min_pairs=10, max_client_share=1.0)
        return judge_answers(pairs, policy, ExactComparator())

    assert next_clean(1, j) == 2
    assert next_clean(1, j, agreement(5, 0)) == 1  # not judged yet: unchanged
    assert next_clean(1, j, agreement(40, 0)) == 2
    assert next_clean(1, j, agreement(5, 15)) == 0


def test_answers_compared_or_not_is_the_committed_policy(akit: Kit) -> None:
    """Turning the comparison off for one command (an uncommitted edit) is refused, naming
    the field: a canary cannot skip its answers' judgement by a local setting."""
    old = akit.build("demo-bf16")
    toml = akit.root / "releasekit.toml"
    toml.write_text(
        toml.read_text().replace("canary_compare_answers = true", "canary_compare_answers = false")
    )
    with pytest.raises(PolicyError, match="canary_compare_answers"):
        promote_progressive(load_settings(root=akit.root), old, env="staging", reason="base")


def test_a_lease_that_reverts_to_stable_drops_the_canarys_mirror(
    answering: Any, gateway_factory: Gw, admin_token: str
) -> None:
    """A canary's leased table that is not renewed reverts to stable, and its mirror goes
    with it (there is no canary left to pair); a shadow's mirror would stay."""
    stable, canary = answering(truth), answering(truth)
    s = Route(release_id="s", base_url=stable.url)
    c = Route(release_id="c", base_url=canary.url)
    gw = gateway_factory(routes=[s], api_keys=[KEY])
    with GatewayClient(gw.url, admin_token=admin_token) as cl:
        cl.set_routes(
            RouteTable(routes=[s, c], lease_s=0.2, fallback=[s], mirror=canary_mirror(s, "c"))
        )
        assert cl.state().mirror == "s:pair"
        assert wait_until(lambda: cl.state().lease_expiries == 1), cl.state()
        st = cl.state()
    assert [r.release_id for r in st.routes] == ["s"]
    assert (st.mirror, st.mirror_purpose, st.mirror_source) == (None, None, None)


def test_a_step_without_enough_pairs_by_its_deadline_is_insufficient_evidence() -> None:
    """Every check passes but the canary's answers gathered fewer pairs than the policy's
    minimum by `max_duration_s`: the step ends as insufficient evidence (not a pass, not a
    breach), naming the answers; the pairs read are the canary's only."""
    from types import SimpleNamespace

    import releasekit.rollout.canary as canary_mod
    from releasekit.deploy.gateway import MirrorPair, MirrorPairs
    from releasekit.rollout.canary import AnswersPolicy, CanaryController, Scrape
    from releasekit.rollout.judge import CheckResult, ReleaseWindows, StepJudgement
    from releasekit.spec.manifest import Canary, CanaryCheck, CanaryStep
    from releasekit.watch.windows import Exposition, Window

    def pair(seq: int, candidate: str) -> MirrorPair:
        return MirrorPair(
            floor="42",
            floor_status=200,
            has_floor=True,
            floor_complete=True,
            seq=seq,
            at=0.0,
            path="/v1/chat/completions",
            stable_release_id="stb",
            candidate_release_id=candidate,
            stable_status=200,
            candidate_status=200,
            stable="42",
            candidate="42",
            complete=True,
            prompt_sha256="0" * 64,
            purpose="canary",
            client_side="candidate",
        )

    class Gateway(FakeGateway):
        def mirror_pairs(self, since: int = 0) -> MirrorPairs:
            held = [pair(1, "can"), pair(2, "other"), pair(3, "can")]
            return MirrorPairs(
                release_id="stb:pair",
                recorded=3,
                purpose="canary",
                pairs=[p for p in held if p.seq > since],
            )

    ok = CheckResult(
        metric="error_rate",
        verdict="pass",
        required=True,
        reason="ok",
        window_start=0,
        window_end=1,
    )
    policy = Canary(
        steps=[
            CanaryStep(weight=50, min_duration_s=0, min_requests=0, max_duration_s=1),
            CanaryStep(weight=100),
        ],
        checks=[CanaryCheck(metric="error_rate")],
        sustain=1,
        warmup_requests=0,
        settle_s=0,
    )
    ctx = stubbed_context()
    gateway = Gateway()
    empty = Exposition(samples={}, monotonic=frozenset(), created={}, families=frozenset())
    w = Window(start=0.0, end=1.0, duration_s=1.0)

    class Controller(CanaryController):
        def _client(self) -> Any:
            return gateway

        def snapshot(self) -> Scrape:
            return Scrape(0.0, empty, None, None, {})

        def windows(self, before: Scrape, after: Scrape) -> Any:
            return ReleaseWindows(release_id="can", edge=w), ReleaseWindows(
                release_id="stb", edge=w
            )

    answers = AnswersPolicy(policy=AnswerPolicy(min_pairs=10, max_client_share=1.0))
    ctrl = Controller(policy, ctx, lease_s=3600, sleep=lambda s: None, answers=answers)
    judged = StepJudgement(
        window_start=0, window_end=1, canary_requests=9, stable_requests=9, checks=[ok]
    )
    ticks = iter(range(0, 10**6, 60))  # a clock a minute further on at every reading
    clock = SimpleNamespace(time=lambda: float(next(ticks)))
    with (
        patch.object(canary_mod, "judge_step", lambda *a: judged),
        patch.object(canary_mod, "time", clock),
    ):
        run = ctrl.run()
    assert run.outcome == "insufficient", run
    assert "answers (greedy: 2 of 10 pairs)" in run.reason, run.reason
    assert run.agreement is not None and (run.agreement.pairs, run.pairs_read) == (2, 3)
    assert gateway.tables[0].mirror == ctrl.mirror and gateway.tables[-1].mirror is None
