"""Shadow traffic: the gateway mirrors an exact share of requests to a candidate whose
answers never reach a client and whose copies take no client rate-limit token; on the
local target the candidate's live comparison with stable is a promote gate."""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import webclient
from gateway_fakes import FakeUpstream, admin_token, gateway_factory, upstream_factory, wait_until
from promote_kit import Kit, Streamer, kill_everything, kit, make_kit
from sqlalchemy import create_engine, select

from releasekit.deploy.gateway import (
    Mirror,
    MirrorPair,
    PairStore,
    PromptTemplate,
    Route,
    RouteTable,
    ThreadedGateway,
    store_dir,
)
from releasekit.deploy.gateway.pairstore import segment_paths
from releasekit.deploy.gateway_client import GatewayClient
from releasekit.deploy.state import locked_state, read_state
from releasekit.promote.deploy import target_for
from releasekit.promote.rollback import rollback
from releasekit.rollout.progressive import promote_progressive
from releasekit.rollout.shadow import (
    ShadowError,
    compare_shadow,
    shadow_gate,
    start_shadow,
    stop_shadow,
)
from releasekit.stores.ledger import (
    GENESIS,
    DecisionRecordsError,
    Event,
    EventType,
    Ledger,
    events_table,
    head_table,
    record_hash,
)

__all__ = ["admin_token", "gateway_factory", "kit", "upstream_factory"]

Up = Callable[[str], FakeUpstream]
Gw = Callable[..., ThreadedGateway]


def test_mirror_copies_an_exact_share_and_clients_never_see_it(
    upstream_factory: Up, gateway_factory: Gw, admin_token: str
) -> None:
    """With share 0.25, 1 request in 4 is copied to the candidate; every client answer
    comes from stable, and the copies take no client rate-limit token."""
    stable, cand = upstream_factory("stable"), upstream_factory("cand")
    gw = gateway_factory(
        routes=[Route(release_id="s", base_url=stable.url)],
        rate_limit={"rps": 0.001, "burst": 8},
    )
    with GatewayClient(gw.url, admin_token=admin_token) as c:
        c.set_routes(
            RouteTable(
                routes=[Route(release_id="s", base_url=stable.url)],
                mirror=Mirror(route=Route(release_id="c", base_url=cand.url), share=0.25),
            )
        )
        answers = [
            webclient.post(
                f"{gw.url}/v1/completions", json={"prompt": f"p{i}", "stream": True}, timeout=10
            )
            for i in range(8)
        ]
        assert all(r.status_code == 200 for r in answers)
        assert {r.headers["x-releasekit-release"] for r in answers} == {"s"}
        assert all(b"cand" not in r.content for r in answers)
        # 8 admitted = the whole burst: the 2 copies took none of it, the 9th is refused.
        assert webclient.post(f"{gw.url}/v1/completions", json={}, timeout=10).status_code == 429
        assert wait_until(lambda: len(cand.finished) == 2), cand.finished
        st = c.state()
    assert st.mirror == "c" and st.mirrored == 2 and st.served == {"s": 8}
    # Stable's server: the 8 client requests and the 2 copies' floor (A/A) copies, whose
    # figures go under the pair label, never stable's.
    assert wait_until(lambda: len(stable.finished) == 10), stable.finished
    assert len(stable.received) == 10
    metrics = webclient.get(f"{gw.url}/metrics", timeout=10).text
    assert 'releasekit_gateway_mirrored_total{env="test",outcome="sent",release="c"} 2.0' in metrics
    assert 'release="c",route="completions",status="200"} 2.0' in metrics
    assert 'release="s:pair",route="completions",status="200"} 2.0' in metrics
    assert 'release="s",route="completions",status="200"} 8.0' in metrics


def test_a_mirror_with_a_baseline_copies_each_request_to_both_at_once(
    upstream_factory: Up, gateway_factory: Gw, admin_token: str
) -> None:
    """With a fresh baseline, every copy taken goes to the candidate and to the baseline
    (under its own label), both or neither; clients still get stable's answers only. The
    baseline's copy is the floor (A/A) copy: its answer is the pair's floor, and stable's
    server gets no extra request."""
    stable, cand, base = (upstream_factory(n) for n in ("stable", "cand", "base"))
    gw = gateway_factory(routes=[Route(release_id="s", base_url=stable.url)])
    with GatewayClient(gw.url, admin_token=admin_token) as c:
        c.set_routes(
            RouteTable(
                routes=[Route(release_id="s", base_url=stable.url)],
                mirror=Mirror(
                    route=Route(release_id="c", base_url=cand.url),
                    share=0.5,
                    baseline=Route(release_id="s:baseline", base_url=base.url),
                ),
            )
        )
        answers = [
            webclient.post(
                f"{gw.url}/v1/completions",
                json={"prompt": f"p{i}", "stream": True, "temperature": 0},
                timeout=10,
            )
            for i in range(8)
        ]
        assert {r.headers["x-releasekit-release"] for r in answers} == {"s"}
        assert all(b"cand" not in r.content and b"base" not in r.content for r in answers)
        assert wait_until(lambda: len(cand.finished) == 4 and len(base.finished) == 4)
        st = c.state()
        pairs = c.mirror_pairs()
    assert st.mirror == "c" and st.mirrored == 4 and st.served == {"s": 8}
    assert sorted(b["body"] for b in cand.received) == sorted(b["body"] for b in base.received)
    assert {p.candidate_release_id for p in pairs.pairs} == {"c"}
    assert len(stable.received) == 8
    assert {(p.has_floor, p.floor_release_id, p.floor_complete) for p in pairs.pairs} == {
        (True, "s:baseline", True)
    }
    assert all(p.floor == "t0t1t2" for p in pairs.pairs)
    metrics = webclient.get(f"{gw.url}/metrics", timeout=10).text
    for rid in ("c", "s:baseline"):
        assert f'outcome="sent",release="{rid}"}} 4.0' in metrics
        assert f'release="{rid}",route="completions",status="200"}} 4.0' in metrics
    # A baseline under the stable release's own label is refused: its figures would mix.
    with pytest.raises(ValueError, match="label of its own"):
        RouteTable(
            routes=[Route(release_id="s", base_url=stable.url)],
            mirror=Mirror(
                route=Route(release_id="c", base_url=cand.url),
                share=0.5,
                baseline=Route(release_id="s", base_url=base.url),
            ),
        )


def _client_answers(gw_url: str) -> list[tuple[int, Any]]:
    """Templated and plain requests, streamed and not: each client answer as (status, the
    answer's choices)."""
    out: list[tuple[int, Any]] = []
    for i in range(6):
        stream = i % 2 == 1
        if i % 3 == 2:
            path, body = "/v1/completions", {"prompt": f"p{i}", "stream": stream}
        else:
            path = "/v1/templates/chat/chat/completions"
            body = {"variables": {"q": f"question {i}"}, "max_tokens": 4, "stream": stream}
        r = webclient.post(gw_url + path, json=body, timeout=10)
        if stream:
            chunks = [
                json.loads(line[6:]).get("choices")
                for line in r.text.splitlines()
                if line.startswith("data: {")
            ]
            out.append((r.status_code, chunks))
        else:
            out.append((r.status_code, r.json().get("choices", r.json())))
    return out


def test_mirroring_never_changes_a_clients_request(
    upstream_factory: Up, gateway_factory: Gw, admin_token: str
) -> None:
    """With every request mirrored (share 1), templated and plain requests get exactly the
    answers they get without a mirror, and stable receives exactly the same bodies: the
    copy is rendered from its own copy of the request, never from the client's."""
    stable, cand = upstream_factory("stable"), upstream_factory("cand")
    prompts = {"chat": PromptTemplate(system="be brief", user="Q: {{ q }}")}
    route = Route(release_id="s", base_url=stable.url, model="m", prompts=prompts)
    shadow = Route(
        release_id="c",
        base_url=cand.url,
        model="m2",
        prompts={"chat": PromptTemplate(user="other: {{ q }}")},
    )
    gw = gateway_factory(routes=[route])
    plain = _client_answers(gw.url)
    plain_bodies = [json.loads(r["body"]) for r in stable.received]
    stable.received.clear()
    with GatewayClient(gw.url, admin_token=admin_token) as c:
        mirror = Mirror(route=shadow, share=1.0, floor=False)  # stable gets no floor copies
        c.set_routes(RouteTable(routes=[route], mirror=mirror))
        mirrored = _client_answers(gw.url)
        assert wait_until(lambda: c.state().mirrored == 6 and len(cand.received) == 6)
    assert [s for s, _ in plain] == [200] * 6
    assert mirrored == plain
    assert [json.loads(r["body"]) for r in stable.received] == plain_bodies
    templated = [json.loads(r["body"]) for r in cand.received if b"messages" in r["body"]]
    assert len(templated) == 4
    assert all(
        b["messages"][0]["content"].startswith("other: question") and b["model"] == "m2"
        for b in templated
    )


def _slow_candidate(k: Kit, *, slow_while: Path | None = None) -> str:
    name = "demo-shadow-slow" if slow_while is None else "demo-shadow-slow-start"
    path = k.variant("demo-bf16", name, {"max-num-seqs: 32": "max-num-seqs: 1"})
    kv = 'VLLM_CPU_KVCACHE_SPACE: "1"'
    slow = f'{kv}\n    FAKE_CHUNK_DELAY_S: "0.3"'
    if slow_while is not None:
        slow += f'\n    FAKE_SLOW_WHILE: "{slow_while}"'
    text = path.read_text().replace(kv, slow)
    text += (
        "promotion:\n  canary:\n    steps:\n      - {weight: 10}\n    checks:\n"
        "      - {metric: ttft_p95_s, tolerance: 0.5, slack: 0.1, min_samples: 10}\n"
    )
    path.write_text(text)
    return k.build(name)


def test_a_breach_in_the_first_window_must_hold_in_the_next(kit: Kit, tmp_path: Path) -> None:
    """A candidate slow only at start (a fresh server warming up): its first window breaches
    on TTFT, the next window, judged on its own, passes, so the comparison is no breach and
    says so (the first window kept as `unconfirmed`, in the ledger too). A candidate slow
    throughout breaches both windows: a breach."""
    old = kit.build("demo-bf16")
    assert promote_progressive(kit.settings, old, env="staging", reason="base").ok
    flag = tmp_path / "slow-at-start"
    flag.touch()
    cand = _slow_candidate(kit, slow_while=flag)
    start_shadow(kit.settings, cand, env="staging", share=0.5, reason="try it")

    def sleep(s: float) -> None:
        time.sleep(s)
        if s == 5:  # a window (not the 4 s settle): the start-up ends after the first
            flag.unlink(missing_ok=True)

    with (
        Streamer(kit.gateway("staging"), chunks=15) as s1,
        Streamer(kit.gateway("staging"), chunks=15) as s2,
    ):
        s1.wait_for(2)
        cmp = compare_shadow(kit.settings, env="staging", window_s=5, max_window_s=15, sleep=sleep)
    assert s1.failures == [] and s2.failures == []
    assert cmp.unconfirmed is not None, cmp.reason
    assert [c.verdict for c in cmp.unconfirmed.checks] == ["breach"]
    [ttft] = cmp.judgement.checks
    assert ttft.verdict == "pass" and cmp.verdict != "breach", cmp.reason
    assert cmp.judgement.window_start >= cmp.unconfirmed.window_end - 1e-6
    [rec] = [
        r
        for r in Ledger(kit.settings.ledger_url or "").records(types=["shadow"])
        if r.evidence.get("action") == "compare"
    ]
    assert rec.evidence["unconfirmed_breach"]["breached"] == ["ttft_p95_s"]
    stop_shadow(kit.settings, env="staging")
    # Slow throughout: the next window repeats the breach.
    slow = _slow_candidate(kit)
    start_shadow(kit.settings, slow, env="staging", share=0.5, reason="try it")
    with (
        Streamer(kit.gateway("staging"), chunks=15) as s1,
        Streamer(kit.gateway("staging"), chunks=15) as s2,
    ):
        s1.wait_for(2)
        cmp = compare_shadow(kit.settings, env="staging", window_s=5, max_window_s=15)
    assert cmp.verdict == "breach" and cmp.unconfirmed is None, cmp.reason
    assert cmp.window_s >= 10  # then on while the answers lack pairs
    stop_shadow(kit.settings, env="staging")


def test_shadow_comparison_of_a_slow_candidate_blocks_its_promotion(kit: Kit) -> None:
    """A slow candidate mirrored at 50% answers no client; its live comparison breaches,
    and promote then refuses it on the "shadow comparison" gate; stop removes it."""
    old = kit.build("demo-bf16")
    assert promote_progressive(kit.settings, old, env="staging", reason="base").ok
    slow = _slow_candidate(kit)
    status = start_shadow(kit.settings, slow, env="staging", share=0.5, reason="try it")
    assert status.release_id == slow and status.stable_release_id == old
    roles = {s.release_id: s.role for s in read_state(kit.settings.state_dir, "staging").servers}
    assert roles == {old: "live", slow: "shadow"}
    with (
        Streamer(kit.gateway("staging"), chunks=3) as s1,
        Streamer(kit.gateway("staging"), chunks=3) as s2,
    ):
        s1.wait_for(2)
        cmp = compare_shadow(kit.settings, env="staging", window_s=4)
    assert s1.failures == [] and s2.failures == []
    assert set(s1.releases + s2.releases) == {old}
    assert cmp.verdict == "breach", cmp.reason
    assert cmp.mirrored > 0 and cmp.judgement.canary_requests > 0
    [ttft] = cmp.judgement.checks
    assert ttft.metric == "ttft_p95_s" and ttft.verdict == "breach"
    res = promote_progressive(kit.settings, slow, env="staging", reason="after shadow")
    assert res.status == "blocked" and res.report is not None
    assert [g.name for g in res.report.failed] == ["shadow comparison"]
    stop_shadow(kit.settings, env="staging")
    servers = read_state(kit.settings.state_dir, "staging").servers
    assert [s.release_id for s in servers] == [old]
    gw: Any = read_state(kit.settings.state_dir, "staging").gateway
    with GatewayClient(gw.url, admin_token=gw.admin_token) as c:
        assert c.state().mirror is None
    # The comparison is a ledger event bound to the stable release it was judged against.
    [rec] = [
        r
        for r in Ledger(kit.settings.ledger_url or "").records(types=["shadow"])
        if r.evidence.get("action") == "compare"
    ]
    assert (rec.from_release, rec.to_release, rec.evidence["verdict"]) == (old, slow, "breach")
    assert cmp.seq == rec.seq
    # Deleting the local copy of the comparison removes no gate: promote reads the ledger.
    for f in (kit.settings.state_dir / "shadow").glob("*.comparison.json"):
        f.unlink()
    res = promote_progressive(kit.settings, slow, env="staging", reason="file deleted")
    assert res.status == "blocked" and res.report is not None
    assert [g.name for g in res.report.failed] == ["shadow comparison"]
    # Deleting its ledger record (the chain recomputed after it): promote refuses to act.
    _delete_record(kit.settings.ledger_url or "", rec.seq)
    with pytest.raises(DecisionRecordsError, match="refusing to act on ledger"):
        promote_progressive(kit.settings, slow, env="staging", reason="row deleted")


def test_a_shadow_with_a_fresh_baseline_is_judged_against_it_and_stops_it(kit: Kit) -> None:
    """`baseline: fresh` in the candidate's canary policy: the shadow starts a fresh server
    of stable beside the candidate, both get the same copies, the comparison is judged
    against that server (the live one keeps serving every client), and stop ends both."""
    old = kit.build("demo-bf16")
    assert promote_progressive(kit.settings, old, env="staging", reason="base").ok
    path = kit.variant("demo-bf16", "demo-shadow-fresh", {"max-num-seqs: 32": "max-num-seqs: 16"})
    path.write_text(
        path.read_text()
        + "promotion:\n  canary:\n    baseline: fresh\n    steps:\n      - {weight: 10}\n"
        "    checks:\n      - {metric: ttft_p95_s, tolerance: 0.5, slack: 0.1, "
        "min_samples: 10}\n"
    )
    cand = kit.build("demo-shadow-fresh")
    status = start_shadow(kit.settings, cand, env="staging", share=0.5, reason="try it")
    assert status.baseline_url is not None
    servers = read_state(kit.settings.state_dir, "staging").servers
    assert sorted((s.release_id, s.role) for s in servers) == sorted(
        [(old, "live"), (old, "shadow"), (cand, "shadow")]
    )
    [base] = [s for s in servers if s.release_id == old and s.role == "shadow"]
    assert base.base_url == status.baseline_url
    st = read_state(kit.settings.state_dir, "staging")
    assert st.mirror is not None and st.mirror.baseline is not None
    assert st.mirror.baseline.release_id == f"{old}:baseline"
    with Streamer(kit.gateway("staging"), chunks=3) as s1:
        s1.wait_for(2)
        cmp = compare_shadow(kit.settings, env="staging", window_s=4)
    assert s1.failures == [] and set(s1.releases) == {old}
    assert cmp.judged_against == "fresh baseline" and cmp.stable_release_id == old
    # The figures pass (the streamer samples, so its answers are not judged: insufficient).
    [ttft] = cmp.judgement.checks
    assert ttft.verdict == "pass" and cmp.verdict != "breach", cmp.reason
    # Both sides of the judgement are copies: as many baseline requests as candidate ones,
    # but for a pair of copies that straddles either edge of the window (one copy counted
    # inside it, its twin just outside: seen once on a busy host, 54 against 53). Judged
    # against the live server, the stable side would count every client request instead.
    assert cmp.judgement.canary_requests > 0
    assert abs(cmp.judgement.stable_requests - cmp.judgement.canary_requests) <= 2
    [rec] = [
        r
        for r in Ledger(kit.settings.ledger_url or "").records(types=["shadow"])
        if r.evidence.get("action") == "compare"
    ]
    assert rec.evidence["judged_against"] == "fresh baseline"
    stop_shadow(kit.settings, env="staging")
    servers = read_state(kit.settings.state_dir, "staging").servers
    assert [(s.release_id, s.role) for s in servers] == [(old, "live")]
    assert not _answers(status.baseline_url)


@pytest.fixture
def fresh_kit(
    project: Path, monkeypatch: pytest.MonkeyPatch, mlflow_template_db: Path, stand_in_model: Any
) -> Iterator[Kit]:
    """A deploy kit whose environments require a fresh baseline (committed policy)."""
    stand_in_model(project)
    k = make_kit(
        project,
        monkeypatch,
        mlflow_template_db,
        toml_lines=['comparison_baseline = "fresh"', "mirror_pairs_keep_days = 1"],
    )
    try:
        yield k
    finally:
        kill_everything(k.settings)


def test_an_environment_that_requires_a_fresh_baseline_gets_one_and_old_pairs_go(
    fresh_kit: Kit,
) -> None:
    """The environment's committed `comparison_baseline = "fresh"` decides, not the
    candidate: a candidate with no canary policy at all is shadowed beside a fresh server
    of stable and judged against it. Stopping the shadow deletes the stored pairs of
    releases last mirrored longer ago than `mirror_pairs_keep_days`, and keeps the rest."""
    kit = fresh_kit
    old = kit.build("demo-bf16")
    assert promote_progressive(kit.settings, old, env="staging", reason="base").ok
    kit.variant("demo-bf16", "demo-shadow-plain", {"max-num-seqs: 32": "max-num-seqs: 16"})
    cand = kit.build("demo-shadow-plain")
    stored = store_dir(kit.settings.state_dir, "staging")
    for rid in ("a" * 64, "b" * 64):
        store = PairStore(stored, rid, segment_bytes=1 << 20)
        store.append(
            MirrorPair(
                seq=1,
                at=0.0,
                path="/v1/completions",
                stable_release_id=old,
                candidate_release_id=rid,
                stable_status=200,
                candidate_status=200,
                stable="x",
                candidate="x",
                complete=True,
                prompt_sha256="0" * 64,
            )
        )
        store.close(timeout_s=10)
    stale_file = segment_paths(stored, "a" * 64)[0]
    recent_file = segment_paths(stored, "b" * 64)[0]
    assert stale_file.is_file() and recent_file.is_file()
    two_days = 2 * 86400
    os.utime(stale_file, (stale_file.stat().st_atime - two_days,) * 2)
    status = start_shadow(kit.settings, cand, env="staging", share=0.5, reason="try it")
    assert status.baseline_url is not None
    assert not stale_file.exists() and recent_file.is_file()
    with Streamer(kit.gateway("staging"), chunks=3) as s1:
        s1.wait_for(2)
        cmp = compare_shadow(kit.settings, env="staging", window_s=4)
    assert s1.failures == [] and set(s1.releases) == {old}
    assert cmp.judged_against == "fresh baseline"
    assert cmp.judgement.stable_requests == cmp.judgement.canary_requests
    os.utime(recent_file, (recent_file.stat().st_atime - two_days,) * 2)
    stop_shadow(kit.settings, env="staging")
    assert not recent_file.exists()
    assert segment_paths(stored, cand)[0].is_file()  # the candidate's own, written just now


def _delete_record(url: str, seq: int) -> None:
    """What someone who can write the ledger database can do: delete a record, renumber
    and re-hash every later one and move the head, so the chain itself is consistent."""
    engine = create_engine(url)
    with engine.begin() as conn:
        rows = [dict(r._mapping) for r in conn.execute(select(events_table).order_by("seq"))]
        rows = [r for r in rows if r["seq"] != seq]
        prev = GENESIS
        for i, r in enumerate(rows, start=1):
            r["seq"], r["prev_hash"] = i, prev
            r["hash"] = record_hash(r)
            prev = r["hash"]
        conn.execute(events_table.delete())
        conn.execute(events_table.insert(), rows)
        conn.execute(head_table.update().values(seq=len(rows), hash=prev))
    engine.dispose()


def test_shadow_starts_only_for_what_promote_would_consider(kit: Kit) -> None:
    """`shadow start` of a release marked bad, or of one never live in staging into
    production (which requires it), is refused before any request is copied; once a
    candidate was shadowed, its promotion fails the "shadow comparison" gate until a
    passing comparison against the release live now, at most `shadow_max_age_s` old, is
    in the ledger."""
    old = kit.build("demo-bf16")
    assert promote_progressive(kit.settings, old, env="staging", reason="base").ok
    kit.variant("demo-bf16", "demo-v2", {"max-num-seqs: 32": "max-num-seqs: 16"})
    bad = kit.build("demo-v2")
    assert promote_progressive(kit.settings, bad, env="staging", reason="v2").ok
    rollback(kit.settings, "staging", reason="bad answers")
    with pytest.raises(ShadowError, match="not marked bad"):
        start_shadow(kit.settings, bad, env="staging", share=1.0)
    twin = kit.build(
        kit.variant("demo-bf16", "demo-shadow-twin", {"max-num-seqs: 32": "max-num-seqs: 8"}).stem
    )
    with pytest.raises(ShadowError, match="live in staging first"):
        start_shadow(kit.settings, twin, env="production", share=1.0)
    st = read_state(kit.settings.state_dir, "staging")
    assert st.mirror is None and {s.role for s in st.servers} <= {"live", "warm"}

    start_shadow(kit.settings, twin, env="staging", share=1.0, reason="try it")
    stop_shadow(kit.settings, env="staging")
    res = promote_progressive(kit.settings, twin, env="staging", reason="never compared")
    assert res.status == "blocked" and res.report is not None
    [gate] = res.report.failed
    assert gate.name == "shadow comparison" and "no comparison is recorded" in gate.detail

    led = Ledger(kit.settings.ledger_url or "")

    def compared(stable: str, verdict: str = "pass") -> None:
        led.append(
            Event(
                type=EventType.SHADOW,
                environment="staging",
                from_release=stable,
                to_release=twin,
                reason="shadow comparison",
                evidence={"action": "compare", "verdict": verdict, "window_s": 30.0},
            )
        )

    compared(bad)  # against a release that is not live now
    g = shadow_gate(kit.settings, env="staging", release_id=twin, ledger=led)
    assert g is not None and not g.passed and "compare again" in g.detail
    compared(old)
    g = shadow_gate(kit.settings, env="staging", release_id=twin, ledger=led)
    assert g is not None and g.passed, g.detail
    assert "2 comparisons" in g.detail
    later = dt.datetime.now(dt.UTC) + dt.timedelta(hours=2)
    g = shadow_gate(kit.settings, env="staging", release_id=twin, ledger=led, now=later)
    assert g is not None and not g.passed and "s old, over 3600 s" in g.detail


def test_a_restarted_gateway_mirrors_again(kit: Kit) -> None:
    """The mirror is recorded with the route table: a gateway that died and is started
    again (as the next deploy does) copies to the shadow candidate again, and a new table
    (a promote's switch) ends the mirroring for good."""
    old = kit.build("demo-bf16")
    assert promote_progressive(kit.settings, old, env="staging", reason="base").ok
    cand = kit.build(
        kit.variant("demo-bf16", "demo-shadow-twin", {"max-num-seqs: 32": "max-num-seqs: 8"}).stem
    )
    start_shadow(kit.settings, cand, env="staging", share=1.0, reason="try it")
    st = read_state(kit.settings.state_dir, "staging")
    assert st.mirror is not None and st.mirror.route.release_id == cand
    gw: Any = st.gateway
    os.killpg(gw.pid, signal.SIGKILL)
    assert wait_until(lambda: not _answers(gw.url))
    with locked_state(kit.settings.state_dir, "staging") as handle:
        cfg = kit.settings.environments["staging"]
        url = target_for(kit.settings, "staging", cfg, handle).ensure_router(handle.state.routes)
    new: Any = read_state(kit.settings.state_dir, "staging").gateway
    assert new.pid != gw.pid
    with GatewayClient(url, admin_token=new.admin_token) as c:
        assert c.state().mirror == cand
        r = webclient.post(
            f"{url}/v1/completions", json={"prompt": "p", "max_tokens": 2}, timeout=30
        )
        assert r.status_code == 200 and r.headers["x-releasekit-release"] == old
        assert wait_until(lambda: c.state().mirrored >= 1)
    with locked_state(kit.settings.state_dir, "staging") as handle:
        target_for(kit.settings, "staging", cfg, handle).route(handle.state.routes)
    assert read_state(kit.settings.state_dir, "staging").mirror is None


def _answers(url: str) -> bool:
    try:
        webclient.get(f"{url}/metrics", timeout=1)
    except httpx.HTTPError:
        return False
    return True


@pytest.fixture
def small_store_kit(
    project: Path, monkeypatch: pytest.MonkeyPatch, mlflow_template_db: Path, stand_in_model: Any
) -> Iterator[Kit]:
    """A deploy kit whose environments keep at most 10 kB of answer pairs."""
    stand_in_model(project)
    k = make_kit(
        project, monkeypatch, mlflow_template_db, toml_lines=["mirror_pairs_max_mb = 0.01"]
    )
    try:
        yield k
    finally:
        kill_everything(k.settings)


def test_a_shadow_is_refused_when_its_pairs_could_not_be_kept(small_store_kit: Kit) -> None:
    """`shadow start` refuses, in one line and with nothing changed (no mirror, no server
    started), when the environment's pairs folder cannot be written or holds
    `mirror_pairs_max_mb` already (what is recent enough to stay after ageing); the
    gateway is told to age and bound the store on the environment's schedule."""
    kit = small_store_kit
    old = kit.build("demo-bf16")
    assert promote_progressive(kit.settings, old, env="staging", reason="base").ok
    cand = kit.build(
        kit.variant("demo-bf16", "demo-shadow-full", {"max-num-seqs: 32": "max-num-seqs: 8"}).stem
    )
    d = store_dir(kit.settings.state_dir, "staging")
    cfg = json.loads((kit.settings.state_dir / "deploy" / "staging-gateway.json").read_text())
    assert (cfg["pairs_dir"], cfg["pairs_max_bytes"]) == (str(d), 10_000)
    assert cfg["pairs_prune_s"] > 0 and cfg["pairs_keep_s"] > 0
    before = read_state(kit.settings.state_dir, "staging")
    d.mkdir(parents=True, exist_ok=True)
    (d / "other.jsonl").write_bytes(b"x" * 10_000)
    with pytest.raises(ShadowError, match="is full") as full:
        start_shadow(kit.settings, cand, env="staging", share=1.0)
    assert "\n" not in full.value.message
    (d / "other.jsonl").unlink()
    d.rmdir()
    d.write_bytes(b"")  # a file where the folder should be: not writable, even by root
    with pytest.raises(ShadowError, match="cannot be written"):
        start_shadow(kit.settings, cand, env="staging", share=1.0)
    d.unlink()
    d.mkdir()
    if os.geteuid() != 0:  # root writes through a 0500 folder
        d.chmod(0o500)
        try:
            with pytest.raises(ShadowError, match="cannot be written"):
                start_shadow(kit.settings, cand, env="staging", share=1.0)
        finally:
            d.chmod(0o700)
    after = read_state(kit.settings.state_dir, "staging")
    assert after.mirror is None and after.servers == before.servers
