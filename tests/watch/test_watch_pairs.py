"""After a promotion, the watch compares the live release's answers with the previous
release's on the same live requests (the gateway mirrors a share of them to the previous
release, kept warm) and rolls back like any other breach when they agree less than the
environment's floor.

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
from releasekit.config import load_settings  # noqa: E402
from releasekit.deploy.gateway import (  # noqa: E402
    Mirror,
    Route,
    RouteTable,
    ThreadedGateway,
)
from releasekit.deploy.gateway_client import GatewayClient  # noqa: E402
from releasekit.deploy.state import EnvState, GatewayRecord, read_state, write_state  # noqa: E402
from releasekit.promote.deploy import deploy_status  # noqa: E402
from releasekit.promote.policy import PolicyError  # noqa: E402
from releasekit.promote.promote import marked_bad, promote  # noqa: E402
from releasekit.stores.ledger import EventType, Ledger, open_ledger  # noqa: E402
from releasekit.watch.pairs import AnswerWatch  # noqa: E402
from releasekit.watch.service import WatchService  # noqa: E402

__all__ = ["admin_token", "answering", "gateway_factory"]

ENV = "staging"
WINDOW_S = 600
COMPARE = [
    f"after_promotion_compare_s = {WINDOW_S}",
    "after_promotion_share = 1.0",
    "shadow_min_pairs = 10",
]
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
    a 600 s window, every request mirrored, 10 pairs judge it (floor 0.9, the default)."""
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


def _watch(k: Kit, led: Ledger) -> tuple[WatchService, FakeClock]:
    """A watch of staging whose clock starts 300 s before the comparison's window ends."""
    mirror = read_state(k.settings.state_dir, ENV).mirror
    assert mirror is not None and mirror.until is not None
    clock = FakeClock(mirror.until - WINDOW_S / 2)
    svc = WatchService(k.settings, ENV, ledger=led, clock=clock, include_slo=False)
    return svc, clock


def test_a_release_wrong_on_one_class_of_questions_is_rolled_back_by_the_watch(
    ckit: Kit,
) -> None:
    """good, then sums (wrong on every "sum" question, right on the rest) are promoted: the
    promotion keeps good warm past the window and mirrors every request to it, clients get
    sums' own answers; 4 disagreeing pairs are "not judged yet" (never a breach); at 20
    pairs (10 disagree) the watch rolls back through the real rollback, with the
    agreement and the disagreeing pairs side by side in the ledger's rollback event."""
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
    svc, clock = _watch(ckit, led)
    try:
        assert _ask(ckit, _sums(4)) == [(sums, WRONG)] * 4
        tick = svc.watcher.tick()
        a = tick.answers
        assert a is not None and a.verdict == "insufficient" and tick.rollback is None
        assert "not judged yet (4 of 10 pairs)" in a.line() and "300 s left" in a.line()

        answered = _ask(ckit, _sums(6, start=4) + _capitals(10))
        assert answered == [(sums, WRONG)] * 6 + [(sums, RIGHT)] * 10  # the live release's
        clock.advance(5)
        tick = svc.watcher.tick()
        a = tick.answers
        assert a is not None and a.verdict == "breach"
        assert (a.agreement.pairs, a.agreement.agreeing) == (20, 10)
        assert tick.rollback is not None and tick.rollback.status == "rolled_back", tick.rollback
        assert tick.rollback.to_release == good
    finally:
        svc.close()
    [ev] = led.records(environment=ENV, types=[EventType.ROLLBACK.value])
    assert (ev.from_release, ev.to_release, ev.actor) == (sums, good, "releasekit-watch")
    assert "after_promotion_agreement" in ev.evidence["rules"]
    ag = ev.evidence["answers"]["agreement"]
    assert (ag["verdict"], ag["pairs"], ag["agreeing"], ag["min_pairs"]) == ("breach", 20, 10, 10)
    assert ag["high"] < 0.9 and len(ag["examples"]) == 10
    assert {(x["stable"], x["candidate"]) for x in ag["examples"]} == {(WRONG, RIGHT)}
    assert all(x["prompt"] is None and len(x["prompt_sha256"]) == 64 for x in ag["examples"])
    assert ev.evidence["answers"]["previous_release_id"] == good
    # The page shows the disagreeing pairs side by side, and the rollback names it.
    page = Path(ev.evidence["answers"]["page"])
    text = page.read_text()
    assert "BREACH: answers of" in text and "10 of 10 disagreeing pairs" in text
    assert text.count(f"<td>{html.escape(WRONG)}</td><td>{html.escape(RIGHT)}</td>") == 10
    assert led.live_at(ENV).to_release == good  # type: ignore[union-attr]
    assert marked_bad(led, sums) is not None
    led.close()
    # The rollback's table ended the mirror; good answers again.
    assert read_state(ckit.settings.state_dir, ENV).mirror is None
    assert _gateway_state(ckit).mirror is None
    assert _ask(ckit, _sums(1)) == [(good, RIGHT)]


def test_an_agreeing_release_stays_and_its_mirror_ends_with_the_window(
    ckit: Kit, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A release that answers as the previous one did is not rolled back; deploy-status
    and the tick show the comparison running (share, window left, pairs); at the window's
    end the watch removes the mirror and records the result as a signed ledger event."""
    good = _release(ckit, "demo-good")
    assert promote(ckit.settings, good, env=ENV).status == "promoted"
    same = _release(ckit, "demo-same", FAKE_CHUNK_DELAY_S="0.01")  # its own server
    assert promote(ckit.settings, same, env=ENV).status == "promoted"
    led = open_ledger(ckit.settings)
    svc, clock = _watch(ckit, led)
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
        assert "agreement 100.0%" in a.line() and "300 s left" in a.line()
        assert _gateway_state(ckit).mirror == good  # still running

        clock.advance(WINDOW_S / 2)
        tick = svc.watcher.tick()
        a = tick.answers
        assert a is not None and a.status == "ended" and a.record_seq is not None
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
    assert ev.evidence["agreement"]["pairs"] == 12
    page = Path(ev.evidence["page"]).read_text()
    assert "PASS: answers of" in page and "No disagreeing pairs." in page
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


def test_too_few_pairs_are_never_a_breach_nor_a_pass_and_the_end_records_so(
    answering: Any,
    gateway_factory: Any,
    admin_token: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """5 pairs that all disagree, 10 needed: every tick says "not judged yet (5 of 10
    pairs)", never a breach; at the window's end the mirror is removed (gateway and deploy
    state) and the ledger records the result as insufficient, not a pass."""
    for key in list(os.environ):
        if key.startswith("RELEASEKIT_"):
            monkeypatch.delenv(key)
    (tmp_path / "releasekit.toml").write_text(f"[environments.{ENV}]\nport = 25999\n")
    monkeypatch.setenv("RELEASEKIT_CONFIG", str(tmp_path / "releasekit.toml"))
    settings = load_settings(root=tmp_path)
    live, prev = answering(bad_at_sums), answering(truth)
    route = Route(release_id="live", base_url=live.url)
    gw = gateway_factory(routes=[route])
    until = 1_000_000.0 + 60
    mirror = _comparing(gw, admin_token, live, prev, until=time.time() + 3600)
    mirror = mirror.model_copy(update={"until": until})  # the watch's clock decides the end
    port = int(gw.url.rsplit(":", 1)[1])
    record = GatewayRecord(
        url=gw.url, host="127.0.0.1", port=port, pid=os.getpid(), admin_token=admin_token,
        config_path="-", log_path="-", started_at=0.0,
    )  # fmt: skip
    write_state(
        settings.state_dir, EnvState(env=ENV, gateway=record, routes=[route], mirror=mirror)
    )
    for q in _sums(5):
        assert webclient.post(
            gw.url + "/v1/chat/completions", content=_body(q), timeout=10
        ).is_success
    with GatewayClient(gw.url, admin_token=admin_token) as c:
        assert wait_until(lambda: c.state().mirror_pairs == 5)
    led = Ledger(settings.ledger_url or "", actor="Wanda Watcher <wanda@example.com>")
    clock = FakeClock()
    watch = AnswerWatch(settings, ENV, ledger=led, min_agreement=0.9, min_pairs=10, clock=clock)
    for _ in range(2):  # pairs are read once: the second tick judges the same 5
        a = watch.check("live")
        assert a is not None and a.verdict == "insufficient" and a.status == "running"
        assert (a.agreement.pairs, a.agreement.agreeing, a.pairs_read) == (5, 0, 5)
        assert "not judged yet (5 of 10 pairs)" in a.line() and "60 s left" in a.line()
    clock.advance(60)
    a = watch.check("live")
    assert a is not None and a.status == "ended" and a.verdict == "insufficient"
    done = watch.finish(a)
    assert done.record_seq is not None
    assert read_state(settings.state_dir, ENV).mirror is None
    with GatewayClient(gw.url, admin_token=admin_token) as c:
        assert c.state().mirror is None
    [ev] = led.records(types=[EventType.SHADOW.value])
    assert ev.evidence["action"] == "after_promotion" and ev.evidence["verdict"] == "insufficient"
    assert watch.check("live") is None
    led.close()
