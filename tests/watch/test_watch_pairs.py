"""After a promotion, the watch compares the live release's answers with the previous
release's on the same live requests (the gateway mirrors a share of them to the previous
release, kept warm, twice: the copy and its A/A floor copy), judges them at the looks of a
fixed schedule over the window, and rolls back like any other breach when its answers are
worse than the A/A floor by more than the margin at `after_promotion_sustain` looks in a row.

The promotions are the deploy tests' (real gateway processes, the stand-in vLLM of
tests/deploy/promote_fake_vllm.py, whose FAKE_WRONG_ON makes a release wrong on one class
of questions, a real MLflow store and signed ledger); the watch's clock is moved by hand.
The gateway-level checks use stand-in upstreams that answer by content."""

from __future__ import annotations

import html
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import webclient
from typer.testing import CliRunner

from releasekit._support.http import http_client

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "deploy"))  # the deploy tests' fixtures

from gateway_fakes import (  # noqa: E402
    Answering,
    admin_token,
    answering,
    gateway_factory,
    refused_url,
    wait_until,
)
from promote_kit import (  # noqa: E402
    Kit,
    commit_config,
    kill_everything,
    make_kit,
)
from watchkit import FakeClock  # noqa: E402

from releasekit.cli import app  # noqa: E402
from releasekit.cli._common import State  # noqa: E402
from releasekit.cli.watch_cmds import _print_tick  # noqa: E402
from releasekit.config import load_settings  # noqa: E402
from releasekit.config.environments import AnswerJudgeConfig  # noqa: E402
from releasekit.deploy.gateway import (  # noqa: E402
    Mirror,
    Route,
    RouteTable,
    ThreadedGateway,
)
from releasekit.deploy.gateway_client import GatewayClient  # noqa: E402
from releasekit.deploy.state import EnvState, GatewayRecord, read_state, write_state  # noqa: E402
from releasekit.evaluate.agreement import Agreement  # noqa: E402
from releasekit.evaluate.answer_compare import make_comparator  # noqa: E402
from releasekit.evaluate.answers import (  # noqa: E402
    AnswerPolicy,
    ComparisonKind,
    replay_answers,
)
from releasekit.promote.answer_policy import answer_policy  # noqa: E402
from releasekit.promote.deploy import deploy_status  # noqa: E402
from releasekit.promote.policy import PolicyError  # noqa: E402
from releasekit.promote.promote import marked_bad, promote  # noqa: E402
from releasekit.stores.ledger import EventType, Ledger, open_ledger  # noqa: E402
from releasekit.watch.pairs import (  # noqa: E402
    AnswersCheck,
    AnswerWatch,
    answers_html,
    look_times,
)
from releasekit.watch.service import WatchService  # noqa: E402
from releasekit.watch.watcher import WatchTick  # noqa: E402

__all__ = ["admin_token", "answering", "gateway_factory"]

ENV = "staging"
WINDOW_S = 600
LOOKS, SUSTAIN = 4, 2
COMPARE = [
    f"after_promotion_compare_s = {WINDOW_S}",
    "after_promotion_share = 1.0",
    f"after_promotion_looks = {LOOKS}",
    f"after_promotion_sustain = {SUSTAIN}",
    "max_excess_disagreement = 0.3",
    "answer_max_client_share = 1.0",  # every request here comes from one address
]
"""Looks at 150, 300, 450 and 600 s; 11 pairs with no difference pass (at 1 - 0.05/4)."""
RIGHT = "The answer is 42."  # the stand-in vLLM's answer
WRONG = "I cannot count."  # its answer to a question holding FAKE_WRONG_ON


# -- the deployed environment ----------------------------------------------------------------


@pytest.fixture
def ckit(
    project: Path,
    monkeypatch: pytest.MonkeyPatch,
    mlflow_template_db: Path,
    stand_in_model: Any,
) -> Iterator[Kit]:
    """The deploy tests' kit with the after-promotion comparison in the committed policy:
    a 600 s window, every request mirrored, judged exactly at 4 looks (margin 0.3, two
    breaching looks in a row roll back)."""
    stand_in_model(project)
    k = make_kit(project, monkeypatch, mlflow_template_db, toml_lines=COMPARE)
    try:
        yield k
    finally:
        kill_everything(k.settings)


def _release(k: Kit, name: str, **env: str) -> str:
    """A variant of demo-bf16 with more serving `env` (its own server when that differs):
    FAKE_WRONG_ON makes it wrong on the questions holding that text."""
    path = k.variant("demo-bf16", name, {"max-num-seqs: 32": "max-num-seqs: 16"})
    kv = 'VLLM_CPU_KVCACHE_SPACE: "1"'
    more = "".join(f'\n    {key}: "{value}"' for key, value in env.items())
    path.write_text(path.read_text().replace(kv, kv + more))
    return k.build(name)


def _ask(k: Kit, questions: list[str]) -> list[tuple[str, str]]:
    """Ask through the environment's gateway; (release that answered, answer) each, once
    every copy sent has its pair."""
    gw: Any = read_state(k.settings.state_dir, ENV).gateway
    got = []
    with GatewayClient(gw.url, admin_token=gw.admin_token) as c:
        st = c.state()
        mirroring = st.mirror is not None and st.mirror_share == 1  # every request paired
        before = st.mirror_pairs
    with http_client(base_url=gw.url, timeout=30, trust_env=False) as http:
        for q in questions:
            body = {
                "model": "demo",
                "messages": [{"role": "user", "content": q}],
                "max_tokens": 4,
                "temperature": 0,
            }
            r = http.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            got.append(
                (r.headers["x-releasekit-release"], r.json()["choices"][0]["message"]["content"])
            )
    with GatewayClient(gw.url, admin_token=gw.admin_token) as c:
        if mirroring:
            assert wait_until(lambda: c.state().mirror_pairs >= before + len(questions), 30)
        assert wait_until(lambda: c.state().mirror_pairs == c.state().mirrored, 30)
    return got


def _sums(n: int, start: int = 0) -> list[str]:
    return [f"sum {i} {i + 1}" for i in range(start, start + n)]


def _capitals(n: int) -> list[str]:
    return ["capital of France?"] * n


def _gateway_state(k: Kit) -> Any:
    gw: Any = read_state(k.settings.state_dir, ENV).gateway
    with GatewayClient(gw.url, admin_token=gw.admin_token) as c:
        return c.state()


def _watch(k: Kit, led: Ledger, at: float) -> tuple[WatchService, FakeClock]:
    """A watch of staging whose clock starts `at` s into the comparison's window."""
    mirror = read_state(k.settings.state_dir, ENV).mirror
    assert mirror is not None and mirror.until is not None
    clock = FakeClock(mirror.until - WINDOW_S + at)
    svc = WatchService(k.settings, ENV, ledger=led, clock=clock, include_slo=False)
    return svc, clock


def test_a_release_wrong_on_one_class_of_questions_is_rolled_back_at_the_sustained_look(
    ckit: Kit,
) -> None:
    """good, then sums (wrong on every "sum" question, right on the rest) are promoted: the
    promotion keeps good warm past the window and mirrors every request to it (the copy and
    its A/A copy), clients get sums' own answers. Ticks before the first look judge
    nothing; the first look breaches but rolls nothing back; ticks after it repeat it (not
    a look, not a rollback); the second breaching look in a row rolls back through the real
    rollback. The rollback's ledger event carries the verdict (counts, pair seqs, prompt
    digests), sums' answers key, the looks and the policy's source, and no text."""
    good = _release(ckit, "demo-good")
    assert promote(ckit.settings, good, env=ENV).status == "promoted"
    assert read_state(ckit.settings.state_dir, ENV).mirror is None  # nothing before it
    sums = _release(ckit, "demo-sums", FAKE_WRONG_ON="sum")
    res = promote(ckit.settings, sums, env=ENV)
    assert res.status == "promoted" and res.deploy is not None
    ap = res.deploy.after_promotion
    assert ap is not None and (ap.previous_release_id, ap.share) == (good, 1.0)
    st = read_state(ckit.settings.state_dir, ENV)
    assert st.mirror is not None and st.mirror.purpose == "after_promotion"
    assert st.mirror.route.release_id == good and st.mirror.until == ap.until
    [warm] = [s for s in st.servers if s.release_id == good]
    assert warm.role == "warm" and warm.warm_until is not None
    assert warm.warm_until >= ap.until + 20  # the window plus the drain deadline
    gs = _gateway_state(ckit)
    assert (gs.mirror, gs.mirror_purpose, gs.mirror_until) == (good, "after_promotion", ap.until)

    led = open_ledger(ckit.settings)
    svc, clock = _watch(ckit, led, at=10)
    try:
        assert _ask(ckit, _sums(20)) == [(sums, WRONG)] * 20
        tick = svc.watcher.tick()
        a = tick.answers
        assert a is not None and a.verdict == "pending" and a.looks_done == 0
        assert tick.rollback is None and "no look yet" in a.line()
        assert "next look in 140 s" in a.line() and "590 s left" in a.line()

        clock.advance(141)  # past the first look: a breach, one of the two needed
        tick = svc.watcher.tick()
        a = tick.answers
        assert a is not None and a.verdict == "breach" and a.judged_now
        assert (a.looks_done, a.breaching_looks, a.rollback_due) == (1, 1, False)
        assert tick.rollback is None
        assert a.answers is not None and a.answers.pairs == 20
        assert "look 1 of 4; breaching looks in a row: 1 of 2" in a.line()
        assert "A/A floor" in a.line() and "power" in a.line()

        assert _ask(ckit, _capitals(5)) == [(sums, RIGHT)] * 5
        clock.advance(100)  # between looks: the pairs are read, nothing is judged
        tick = svc.watcher.tick()
        a = tick.answers
        assert a is not None and a.verdict == "breach" and not a.judged_now
        assert a.answers is not None and a.answers.pairs == 20 and a.pairs_read == 25
        assert tick.rollback is None and "repeated" in a.line()
        assert "next look in 49 s" in a.line()

        clock.advance(50)  # the second look breaches: two in a row roll back
        tick = svc.watcher.tick()
        a = tick.answers
        assert a is not None and a.verdict == "breach" and a.judged_now
        assert (a.looks_done, a.breaching_looks, a.rollback_due) == (2, 2, True)
        assert a.answers is not None and a.answers.pairs == 25
        assert tick.rollback is not None and tick.rollback.status == "rolled_back", tick.rollback
        assert tick.rollback.to_release == good
    finally:
        svc.close()
    [ev] = led.records(environment=ENV, types=[EventType.ROLLBACK.value])
    assert (ev.from_release, ev.to_release, ev.actor) == (sums, good, "releasekit-watch")
    got = ev.evidence["answers"]
    assert got["verdict"] == "breach" and got["previous_release_id"] == good
    assert (got["looks"], got["looks_planned"], got["breaching_looks"]) == (2, 4, 2)
    assert set(got["answers_key"]) == {"model", "prompts", "serving"}
    assert got["policy_source"]["digest"] and got["policy_source"]["where"]
    verdict = got["answers"]
    assert (verdict["verdict"], verdict["comparison"]) == ("breach", "exact")
    [greedy] = verdict["strata"]
    assert (greedy["pairs"], greedy["worse"], greedy["floor_worse"]) == (25, 20, 0)
    assert len(verdict["worse_seqs"]) == 10
    assert all(len(d) == 64 for d in verdict["worse_prompts"])
    committed = answer_policy(ckit.settings.environments[ENV].policy())
    assert replay_answers(verdict, committed).verdict == "breach"  # audit replay reads it
    text = json.dumps(ev.evidence)
    for said in (WRONG, RIGHT, "sum 0 1", "capital of France"):  # no answer, no prompt
        assert said not in text
    # The page shows the verdict and the worse pairs by seq and digest, never their text.
    page = Path(got["page"]).read_text()
    assert "BREACH: answers of" in page and "Look 2 of 4" in page
    assert f"#{verdict['worse_seqs'][0]} ({verdict['worse_prompts'][0][:12]})" in page
    assert html.escape(WRONG) not in page and "sum 0 1" not in page
    assert led.live_at(ENV).to_release == good  # type: ignore[union-attr]
    assert marked_bad(led, sums) is not None
    led.close()
    # The rollback's table ended the mirror; good answers again.
    assert read_state(ckit.settings.state_dir, ENV).mirror is None
    assert _gateway_state(ckit).mirror is None
    assert _ask(ckit, _sums(1)) == [(good, RIGHT)]


def test_a_release_answering_as_the_previous_one_stays_and_the_window_end_records_it(
    ckit: Kit, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A release that answers as the previous one did passes its looks and is not rolled
    back; deploy-status and the tick show the comparison running (share, window left,
    pairs); at the window's end (the last look) the watch removes the mirror and records
    the result as a signed ledger event with the verdict, the key and the looks."""
    good = _release(ckit, "demo-good")
    assert promote(ckit.settings, good, env=ENV).status == "promoted"
    same = _release(ckit, "demo-same", FAKE_CHUNK_DELAY_S="0.01")  # its own server
    assert promote(ckit.settings, same, env=ENV).status == "promoted"
    led = open_ledger(ckit.settings)
    svc, clock = _watch(ckit, led, at=WINDOW_S / 2 + 1)  # two looks are due: one look
    try:
        assert _ask(ckit, _sums(6) + _capitals(6)) == [(same, RIGHT)] * 12
        # The copies finish after the clients' answers: read the gateway's counts once it
        # says every copy is paired (or its deadline passes and the assert below says what).
        deadline = time.monotonic() + 30
        while True:
            [ds] = deploy_status(ckit.settings, env=ENV)
            got = ds.mirror and (ds.mirror.mirrored, ds.mirror.pairs)
            if got == (12, 12) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        m = ds.mirror
        assert m is not None and (m.purpose, m.release_id, m.share) == ("after_promotion", good, 1)
        assert (m.mirrored, m.pairs) == (12, 12) and m.left_s is not None and m.left_s > 0
        State.reset()
        r = CliRunner().invoke(app, ["deploy-status", ENV])
        assert r.exit_code == 0, r.output
        assert f"answers compared with {good[:12]}: 100% of requests mirrored" in r.output
        assert "12 pairs so far" in r.output

        tick = svc.watcher.tick()
        a = tick.answers
        assert a is not None and a.verdict == "pass" and tick.rollback is None
        assert (a.looks_done, a.breaching_looks, a.rollback_due) == (2, 0, False)
        assert "answers (exact): pass" in a.line() and "299 s left" in a.line()
        assert _gateway_state(ckit).mirror == good  # still running

        clock.advance(WINDOW_S / 2)
        tick = svc.watcher.tick()
        a = tick.answers
        assert a is not None and a.status == "ended" and a.record_seq is not None
        assert a.looks_done == LOOKS and a.verdict == "pass"
        assert tick.rollback is None
        assert svc.watcher.tick().answers is None  # over
    finally:
        svc.close()
    assert read_state(ckit.settings.state_dir, ENV).mirror is None
    assert _gateway_state(ckit).mirror is None
    assert led.records(environment=ENV, types=[EventType.ROLLBACK.value]) == []
    assert led.live_at(ENV).to_release == same  # type: ignore[union-attr]
    [ev] = [r for r in led.records(types=[EventType.SHADOW.value]) if r.seq == a.record_seq]
    assert (ev.from_release, ev.to_release, ev.actor) == (good, same, "releasekit-watch")
    assert ev.evidence["action"] == "after_promotion" and ev.evidence["verdict"] == "pass"
    assert ev.evidence["answers"]["verdict"] == "pass"
    assert sum(s["pairs"] for s in ev.evidence["answers"]["strata"]) == 12
    assert (ev.evidence["looks"], ev.evidence["looks_planned"]) == (LOOKS, LOOKS)
    assert set(ev.evidence["answers_key"]) == {"model", "prompts", "serving"}
    assert ev.evidence["policy_source"]["kind"] == "committed"
    assert RIGHT not in json.dumps(ev.evidence)
    page = Path(ev.evidence["page"]).read_text()
    assert "PASS: answers of" in page and "Look 4 of 4" in page
    led.close()


def test_window_0_mirrors_nothing_and_a_policy_changed_for_one_watch_is_refused(
    ckit: Kit, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the comparison off (committed: window 0) a promotion sets no mirror and the
    previous release only gets its warm_s; turning it back on for one command is refused,
    by the watch as by promote, naming the field."""
    toml = ckit.root / "releasekit.toml"
    toml.write_text(toml.read_text().replace(f"after_promotion_compare_s = {WINDOW_S}", ""))
    commit_config(ckit.root, "staging: no comparison after a promotion")
    ckit.settings = load_settings(root=ckit.root)
    good = _release(ckit, "demo-good")
    assert promote(ckit.settings, good, env=ENV).status == "promoted"
    sums = _release(ckit, "demo-sums", FAKE_WRONG_ON="sum")
    res = promote(ckit.settings, sums, env=ENV)
    assert res.status == "promoted" and res.deploy is not None
    assert res.deploy.after_promotion is None
    st = read_state(ckit.settings.state_dir, ENV)
    assert st.mirror is None and _gateway_state(ckit).mirror is None
    [warm] = [s for s in st.servers if s.release_id == good]
    assert warm.warm_until is not None and warm.warm_until <= time.time() + 300

    monkeypatch.setenv(
        "RELEASEKIT_ENVIRONMENTS", json.dumps({ENV: {"after_promotion_compare_s": 60}})
    )
    lax = load_settings(root=ckit.root)
    assert lax.environments[ENV].after_promotion_compare_s == 60  # the variable took effect
    led = open_ledger(lax)
    try:
        with pytest.raises(PolicyError, match="after_promotion_compare_s"):
            WatchService(lax, ENV, ledger=led, include_slo=False)
        with pytest.raises(PolicyError, match="after_promotion_compare_s"):
            promote(lax, good, env=ENV, dry_run=True)
    finally:
        led.close()
    for field, value in (("after_promotion_sustain", 1), ("max_excess_disagreement", 0.5)):
        monkeypatch.setenv("RELEASEKIT_ENVIRONMENTS", json.dumps({ENV: {field: value}}))
        lax = load_settings(root=ckit.root)
        led = open_ledger(lax)
        try:
            with pytest.raises(PolicyError, match=field):
                WatchService(lax, ENV, ledger=led, include_slo=False)
        finally:
            led.close()


# -- the gateway and the check on their own -------------------------------------------------


def truth(q: str) -> str:
    if q.startswith("sum"):
        a, b = q.split()[1:3]
        return str(int(a) + int(b))
    return "Paris"


def bad_at_sums(q: str) -> str:
    return WRONG if q.startswith("sum") else truth(q)


def _body(q: str, *, stream: bool = False) -> bytes:
    msgs = [{"role": "user", "content": q}]
    return json.dumps(
        {"messages": msgs, "max_tokens": 4, "temperature": 0, "stream": stream}
    ).encode()


def _comparing(
    gw: ThreadedGateway, token: str, live: Answering, prev: Answering, until: float
) -> Mirror:
    mirror = Mirror(
        route=Route(release_id="prev", base_url=prev.url),
        share=1.0,
        max_in_flight=64,
        purpose="after_promotion",
        until=until,
    )
    with GatewayClient(gw.url, admin_token=token) as c:
        c.set_routes(
            RouteTable(routes=[Route(release_id="live", base_url=live.url)], mirror=mirror)
        )
    return mirror


def test_clients_get_the_live_releases_bytes_and_nothing_is_copied_past_the_window(
    answering: Any, gateway_factory: Any, admin_token: str
) -> None:
    """With the after-promotion mirror on, every client's answer (streamed or not) is byte
    for byte what the live server answers itself, and each pair's stable side is the live
    release's; a mirror past its `until` copies nothing (the previous release's server may
    be gone), and clients are served as before."""
    live, prev = answering(bad_at_sums), answering(truth)
    gw = gateway_factory(routes=[Route(release_id="live", base_url=live.url)])
    _comparing(gw, admin_token, live, prev, until=time.time() + 3600)
    for i, q in enumerate(_sums(3) + _capitals(3)):
        raw = _body(q, stream=i % 2 == 1)
        via = webclient.post(gw.url + "/v1/chat/completions", content=raw, timeout=10)
        direct = webclient.post(live.url + "/v1/chat/completions", content=raw, timeout=10)
        assert via.status_code == 200 and via.content == direct.content
    with GatewayClient(gw.url, admin_token=admin_token) as c:
        assert wait_until(lambda: c.state().mirror_pairs == 6)
        st, got = c.state(), c.mirror_pairs()
    assert (st.mirror_purpose, st.mirrored) == ("after_promotion", 6)
    want = [(WRONG, truth(q)) for q in _sums(3)] + [("Paris", "Paris")] * 3
    assert sorted((p.stable or "", p.candidate or "") for p in got.pairs) == sorted(want)
    assert all(p.complete and p.stable_release_id == "live" for p in got.pairs)

    _comparing(gw, admin_token, live, prev, until=time.time() - 1)
    seen = prev.received
    for q in _sums(3):
        r = webclient.post(gw.url + "/v1/chat/completions", content=_body(q), timeout=10)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == WRONG
    with GatewayClient(gw.url, admin_token=admin_token) as c:
        st = c.state()
    assert (st.mirror, st.mirrored, st.mirror_dropped, st.mirror_pairs) == ("prev", 0, 0, 0)
    assert prev.received == seen


def _compared_env(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    gw: ThreadedGateway,
    token: str,
    live: Answering,
    prev: Answering,
    until: float,
) -> Any:
    """Settings of a project whose deploy state runs `gw` with an after-promotion mirror
    from `live` to `prev` ending at `until` by the watch's clock (the gateway's own runs an
    hour, so the watch's clock decides the end)."""
    for key in list(os.environ):
        if key.startswith("RELEASEKIT_"):
            monkeypatch.delenv(key)
    (tmp_path / "releasekit.toml").write_text(f"[environments.{ENV}]\nport = 25999\n")
    monkeypatch.setenv("RELEASEKIT_CONFIG", str(tmp_path / "releasekit.toml"))
    settings = load_settings(root=tmp_path)
    route = Route(release_id="live", base_url=live.url)
    mirror = _comparing(gw, token, live, prev, until=time.time() + 3600)
    mirror = mirror.model_copy(update={"until": until})
    port = int(gw.url.rsplit(":", 1)[1])
    record = GatewayRecord(
        url=gw.url, host="127.0.0.1", port=port, pid=os.getpid(), admin_token=token,
        config_path="-", log_path="-", started_at=0.0,
    )  # fmt: skip
    write_state(
        settings.state_dir, EnvState(env=ENV, gateway=record, routes=[route], mirror=mirror)
    )
    return settings


def _send(gw: ThreadedGateway, token: str, questions: list[str]) -> None:
    for q in questions:
        assert webclient.post(
            gw.url + "/v1/chat/completions", content=_body(q), timeout=10
        ).is_success
    with GatewayClient(gw.url, admin_token=token) as c:
        assert wait_until(lambda: c.state().mirror_pairs >= len(questions))


def test_looks_are_evenly_spaced_and_the_last_is_at_the_windows_end() -> None:
    assert look_times(1000.0, 600, 4) == [550.0, 700.0, 850.0, 1000.0]
    assert look_times(1000.0, 600, 1) == [1000.0]


def test_too_few_pairs_are_never_a_breach_nor_a_pass_and_the_end_records_so(
    answering: Any,
    gateway_factory: Any,
    admin_token: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """5 pairs that all differ, 10 needed: every look says "insufficient", never a breach
    (nor a rollback due); a tick between looks reads no pair twice and judges nothing; at
    the window's end the mirror is removed (gateway and deploy state) and the ledger records
    the result as insufficient, not a pass."""
    live, prev = answering(bad_at_sums), answering(truth)
    gw = gateway_factory(routes=[Route(release_id="live", base_url=live.url)])
    until = 1_000_000.0 + 60
    settings = _compared_env(tmp_path, monkeypatch, gw, admin_token, live, prev, until)
    _send(gw, admin_token, _sums(5))
    led = Ledger(settings.ledger_url or "", actor="Wanda Watcher <wanda@example.com>")
    clock = FakeClock()
    policy = AnswerPolicy(max_excess=0.3, max_client_share=1.0, looks=2)
    watch = AnswerWatch(
        settings,
        ENV,
        ledger=led,
        policy=policy,
        comparator=make_comparator("exact", root=tmp_path),
        window_s=60,
        sustain=1,
        clock=clock,
    )
    a = watch.check("live")
    assert a is not None and a.verdict == "pending" and a.pairs_read == 5
    clock.advance(30)  # the first look
    for judged_now in (True, False):  # pairs are read once: the tick after repeats the look
        a = watch.check("live")
        assert a is not None and a.verdict == "insufficient" and a.status == "running"
        assert a.judged_now is judged_now and not a.rollback_due and a.pairs_read == 5
        assert a.answers is not None and a.answers.pairs == 5 and a.answers.min_pairs == 10
        assert "30 s left" in a.line() and "next look in 30 s" in a.line()
    clock.advance(30)
    a = watch.check("live")
    assert a is not None and a.status == "ended" and a.verdict == "insufficient"
    assert a.looks_done == 2 and not a.rollback_due
    done = watch.finish(a)
    assert done.record_seq is not None
    assert read_state(settings.state_dir, ENV).mirror is None
    with GatewayClient(gw.url, admin_token=admin_token) as c:
        assert c.state().mirror is None
    [ev] = led.records(types=[EventType.SHADOW.value])
    assert ev.evidence["action"] == "after_promotion" and ev.evidence["verdict"] == "insufficient"
    assert ev.evidence["answers"]["verdict"] == "insufficient" and ev.evidence["looks"] == 2
    assert watch.check("live") is None
    led.close()


def test_a_judge_that_is_down_is_never_a_pass_nor_a_rollback(
    answering: Any,
    gateway_factory: Any,
    admin_token: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A `judge` comparison whose judge does not answer: every look is not judged, with
    the judge's error as its reason, and no rollback is due; at the window's end the ledger
    records "not_judged", never a pass."""
    live, prev = answering(bad_at_sums), answering(truth)
    gw = gateway_factory(routes=[Route(release_id="live", base_url=live.url)])
    until = 1_000_000.0 + 90
    settings = _compared_env(tmp_path, monkeypatch, gw, admin_token, live, prev, until)
    _send(gw, admin_token, _sums(20))
    led = Ledger(settings.ledger_url or "", actor="Wanda Watcher <wanda@example.com>")
    clock = FakeClock()
    judge = AnswerJudgeConfig(endpoint=refused_url(), model="judge", timeout_s=2)
    watch = AnswerWatch(
        settings,
        ENV,
        ledger=led,
        policy=AnswerPolicy(comparison="judge", max_excess=0.3, max_client_share=1.0, looks=3),
        comparator=make_comparator("judge", root=tmp_path, judge=judge),
        window_s=90,
        sustain=2,
        clock=clock,
    )
    for _ in range(2):
        clock.advance(30)
        a = watch.check("live")
        assert a is not None and a.verdict == "not_judged" and a.judged_now
        assert not a.rollback_due and a.breaching_looks == 0
        assert a.answers is not None and "judge" in a.answers.reason
    clock.advance(30)
    a = watch.check("live")
    assert a is not None and a.status == "ended" and a.verdict == "not_judged"
    assert not a.rollback_due
    done = watch.finish(a)
    [ev] = led.records(types=[EventType.SHADOW.value])
    assert ev.seq == done.record_seq and ev.evidence["verdict"] == "not_judged"
    assert ev.evidence["answers"]["comparison"] == "judge"
    led.close()


def test_an_older_check_still_reads() -> None:
    """A check as the exact agreement wrote it (every tick, with disagreeing pairs) still
    reads and prints."""
    old = {
        "env": ENV,
        "release_id": "a" * 64,
        "previous_release_id": "b" * 64,
        "share": 0.2,
        "until": 1_000_060.0,
        "window_left_s": 60.0,
        "mirrored": 5,
        "dropped": 0,
        "pairs_read": 5,
        "agreement": Agreement(
            pairs=5, agreeing=0, min_agreement=0.9, min_pairs=10, verdict="insufficient",
            reason="not enough pairs",
        ).model_dump(mode="json"),
        "status": "running",
    }  # fmt: skip
    check = AnswersCheck.model_validate_json(json.dumps(old))
    assert check.verdict == "insufficient" and check.answers is None
    assert "answers vs bbbbbbbbbbbb" in check.line() and "60 s left" in check.line()


# -- what exact match would have said --------------------------------------------------------

LANDS = {f"Land{i}": f"City{i}" for i in range(20)}


def _capital_of(land: str) -> str:
    return f"What is the capital of {land}?"


def _city(q: str) -> str:
    return LANDS[q.removeprefix("What is the capital of ").rstrip("?")]


def _known_capitals(root: Path) -> Path:
    """A suite-format file of the capital questions, scored by `contains` (as a prompt fix
    that rewords right answers needs)."""
    path = root / "known.jsonl"
    path.write_text(
        "".join(
            json.dumps(
                {"id": land, "vars": {"question": _capital_of(land)}, "expected": city,
                 "scorer": "contains"}
            ) + "\n"
            for land, city in LANDS.items()
        )
    )  # fmt: skip
    return path


def _reworded_watch(
    answering: Any,
    gateway_factory: Any,
    admin_token: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    comparison: ComparisonKind,
) -> tuple[AnswerWatch, FakeClock, Ledger, ThreadedGateway]:
    """The previous release answers "CityN", the live one (a prompt fix) "The capital of
    LandN is CityN.": right, reworded; 20 known questions asked, judged at 3 looks over
    90 s, two breaching looks in a row to roll back."""
    live = answering(lambda q: f"The capital of {q.split()[-1].rstrip('?')} is {_city(q)}.")
    prev = answering(_city)
    gw = gateway_factory(routes=[Route(release_id="live", base_url=live.url)])
    until = 1_000_000.0 + 90
    settings = _compared_env(tmp_path, monkeypatch, gw, admin_token, live, prev, until)
    _send(gw, admin_token, [_capital_of(land) for land in LANDS])
    known = _known_capitals(tmp_path)
    led = Ledger(settings.ledger_url or "", actor="Wanda Watcher <wanda@example.com>")
    clock = FakeClock()
    policy = AnswerPolicy(comparison=comparison, max_excess=0.3, max_client_share=1.0, looks=3)
    watch = AnswerWatch(
        settings,
        ENV,
        ledger=led,
        policy=policy,
        comparator=make_comparator(comparison, root=tmp_path, known_items=[known.name]),
        window_s=90,
        sustain=2,
        clock=clock,
    )
    return watch, clock, led, gw


def test_a_reworded_right_answer_passes_under_scorer_and_exact_match_is_shown_not_deciding(
    answering: Any,
    gateway_factory: Any,
    admin_token: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Under `scorer` with known items, answers reworded but right pass every look and
    nothing is rolled back; beside each look the check shows what exact match would have
    said of the same pairs (a breach), its own run of breaching looks, and from the look
    where that run reaches `sustain` that exact match would have rolled it back. The watch's
    line, the page and the ledger event at the window's end carry it."""
    watch, clock, led, _ = _reworded_watch(
        answering, gateway_factory, admin_token, tmp_path, monkeypatch, "scorer"
    )
    clock.advance(30)  # the first look: exact's run 1 of 2
    a = watch.check("live")
    assert a is not None and a.judged_now and a.verdict == "pass" and not a.rollback_due
    assert a.answers is not None and a.answers.comparison == "scorer" and a.answers.pairs == 20
    e = a.exact_answers
    assert e is not None and e.comparison == "exact" and e.verdict == "breach"
    assert (a.breaching_looks, a.exact_breaching_looks, a.exact_rollback_look) == (0, 1, None)
    line = a.exact_line()
    assert line is not None and line.startswith("under exact match (shown, not deciding): ")
    assert "answers (exact): breach" in line
    assert "exact match: breach at this look (1 of 2 in a row), pass as judged" in line
    assert "rolled it back" not in line

    _print_tick(WatchTick(t=clock(), scraped=True, answers=a), env=ENV, as_json=False)
    printed = capsys.readouterr().out
    assert "answers (scorer): pass" in printed
    assert "\n  under exact match (shown, not deciding): answers (exact): breach" in printed
    # Where exact match says what was judged, the watch's output adds nothing.
    _print_tick(
        WatchTick(
            t=clock(), scraped=True, answers=a.model_copy(update={"exact_answers": a.answers})
        ),
        env=ENV,
        as_json=False,
    )
    assert "under exact match" not in capsys.readouterr().out
    # Between looks the line repeats only as a heartbeat (never with --brief), without the
    # exact view: that is shown at a look.
    later = WatchTick(
        t=clock() + 31, scraped=True, answers=a.model_copy(update={"judged_now": False})
    )
    _print_tick(later, env=ENV, as_json=False, brief=True)
    assert capsys.readouterr().out == ""
    _print_tick(later, env=ENV, as_json=False)
    printed = capsys.readouterr().out
    assert "answers (scorer): pass" in printed and "under exact match" not in printed

    clock.advance(30)  # the second look: exact's run reaches sustain, the verdict passes
    a = watch.check("live")
    assert a is not None and a.verdict == "pass" and not a.rollback_due
    assert (a.exact_breaching_looks, a.exact_rollback_look) == (2, 2)
    assert "exact match would have rolled it back at look 2" in (a.exact_line() or "")
    page = answers_html(a)
    assert "PASS: answers of" in page
    assert "under exact match (shown, not deciding): answers (exact): breach" in page
    assert "exact match would have rolled it back at look 2" in page

    clock.advance(30)  # the window's end: recorded, nothing rolled back
    a = watch.check("live")
    assert a is not None and a.status == "ended" and a.verdict == "pass" and not a.rollback_due
    done = watch.finish(a)
    [ev] = led.records(types=[EventType.SHADOW.value])
    assert ev.seq == done.record_seq and ev.evidence["verdict"] == "pass"
    assert ev.evidence["answers"]["comparison"] == "scorer"
    exact = ev.evidence["answers_exact"]
    assert (exact["verdict"], exact["comparison"], exact["pairs"]) == ("breach", "exact", 20)
    assert (ev.evidence["exact_breaching_looks"], ev.evidence["exact_rollback_look"]) == (3, 2)
    assert "City1" not in json.dumps(ev.evidence)  # counts and digests, no answer
    assert led.records(types=[EventType.ROLLBACK.value]) == []
    led.close()


def test_under_exact_match_there_is_no_second_view(
    answering: Any,
    gateway_factory: Any,
    admin_token: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the environment compares by exact match, the reworded answers breach as
    judged, and no exact view is shown beside it (nor recorded)."""
    watch, clock, led, _ = _reworded_watch(
        answering, gateway_factory, admin_token, tmp_path, monkeypatch, "exact"
    )
    clock.advance(30)
    a = watch.check("live")
    assert a is not None and a.verdict == "breach" and a.breaching_looks == 1
    assert a.exact_answers is None and a.exact_line() is None
    assert "answers_exact" not in a.evidence()
    assert "under exact match" not in answers_html(a)
    led.close()


def test_watch_brief_prints_only_the_windows_a_rule_did_not_pass(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`watch --brief` (for logs): a window whose every rule passed is not printed, one with
    a breach is; without --brief both are."""
    from releasekit.watch.rules import Judgement
    from releasekit.watch.windows import Window

    def tick(t: float, verdict: str) -> WatchTick:
        w = Window(release="r" * 12, start=t - 15, end=t, duration_s=15, requests=40)
        j = Judgement(rule="ttft", metric="ttft_p95_s", verdict=verdict, value=1.0, limit=2.0,  # type: ignore[arg-type]
                      reason="x", window_start=w.start, window_end=w.end)  # fmt: skip
        return WatchTick(t=t, scraped=True, windows=[w], judgements=[j])

    _print_tick(tick(100, "pass"), env=ENV, as_json=False, brief=True)
    assert capsys.readouterr().out == ""
    _print_tick(tick(115, "breach"), env=ENV, as_json=False, brief=True)
    assert "15s window 40 req | ttft 1 / 2 breach" in capsys.readouterr().out
    _print_tick(tick(130, "pass"), env=ENV, as_json=False)
    assert "ttft 1 / 2 pass" in capsys.readouterr().out
