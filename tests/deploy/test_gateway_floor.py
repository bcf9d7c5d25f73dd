"""A/A (floor) copies: beside each mirrored request's two answers the gateway keeps a
second answer of the reference release, sent at the same moment, so a candidate is judged
against the reference's disagreement with itself; each pair names its client by digest
only; `compared()` maps a pair's answers to reference, judged and floor by its purpose; and
the gateway ages and bounds its pair store on a schedule, off the event loop."""

from __future__ import annotations

import hashlib
import os
import time
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
from test_canary_pairs import _series

from releasekit.deploy.gateway import (
    Mirror,
    MirrorPair,
    Route,
    RouteTable,
    ThreadedGateway,
    client_digest,
    prune_to_size,
    store_problem,
)
from releasekit.deploy.gateway.pairstore import segment_paths
from releasekit.deploy.gateway_client import GatewayClient
from releasekit.promote.answer_pairs import compared

__all__ = ["admin_token", "answering", "gateway_factory", "upstream_factory"]

Gw = Callable[..., ThreadedGateway]
KEY = "sk-client-key-0123456789"
AUTH = {"authorization": f"Bearer {KEY}"}
KEY_DIGEST = "key:" + hashlib.blake2b(KEY.encode(), digest_size=12).hexdigest()
QUESTIONS = ["sum 1 2", "capital of France?", "sum 3 4", "capital of Italy?"]


def _ask(gw: ThreadedGateway, questions: list[str], headers: dict[str, str]) -> None:
    for i, q in enumerate(questions):
        body = {"prompt": q, "max_tokens": 4, "stream": i % 2 == 1, "temperature": 0}
        r = webclient.post(gw.url + "/v1/completions", json=body, headers=headers, timeout=10)
        assert r.status_code == 200, r.text


def _pairs(gw: ThreadedGateway, admin_token: str, n: int) -> list[MirrorPair]:
    with GatewayClient(gw.url, admin_token=admin_token) as c:
        assert wait_until(lambda: c.state().mirror_pairs == n), c.state()
        return c.mirror_pairs().pairs


def test_a_shadow_records_three_answers_and_the_floor_copys_figures_are_its_own(
    answering: Callable[[Callable[[str], str]], Answering], gateway_factory: Gw, admin_token: str
) -> None:
    """A shadow without a baseline: each copy taken also goes to the server the client's
    request was pinned to, under `s:pair`. Each pair holds the client's answer, the
    candidate's and the floor's (three answers); stable's own series count the clients'
    requests only; the pair names its client by the key's digest, never the key."""
    stable, cand = answering(truth), answering(bad_at_sums)
    s = Route(release_id="s", base_url=stable.url)
    gw = gateway_factory(routes=[s], api_keys=[KEY])
    with GatewayClient(gw.url, admin_token=admin_token) as c:
        mirror = Mirror(route=Route(release_id="c", base_url=cand.url), share=1.0)
        c.set_routes(RouteTable(routes=[s], mirror=mirror))
    _ask(gw, QUESTIONS, AUTH)
    pairs = _pairs(gw, admin_token, len(QUESTIONS))
    # A pair is numbered when its copies finish, not when its request came: match by answers.
    assert sorted((p.stable, p.candidate, p.floor) for p in pairs) == sorted(
        (truth(q), bad_at_sums(q), truth(q)) for q in QUESTIONS
    )
    for p in pairs:
        assert (p.has_floor, p.floor_complete, p.floor_status) == (True, True, 200)
        assert (p.floor_release_id, p.stable_release_id, p.purpose) == ("s", "s", "shadow")
        assert p.client == KEY_DIGEST and p.stable_complete and p.candidate_complete
    n = len(QUESTIONS)
    assert (stable.received, cand.received) == (2 * n, n)
    reqs = _series(gw, "releasekit_gateway_requests_total")
    assert reqs == {"s": n, "c": n, "s:pair": n}, reqs
    e2e = _series(gw, "releasekit_gateway_e2e_seconds_count")
    assert (e2e["s"], e2e["s:pair"]) == (n, n), e2e
    sent = _series(gw, "releasekit_gateway_mirrored_total")
    assert sent == {"c": n, "s:pair": n}, sent
    raw = webclient.get(
        gw.url + "/admin/mirror/pairs",
        headers={"authorization": f"Bearer {admin_token}"},
        timeout=10,
    ).text
    assert KEY not in raw


def test_without_keys_a_pair_names_its_client_by_the_addresss_digest(
    answering: Callable[[Callable[[str], str]], Answering], gateway_factory: Gw, admin_token: str
) -> None:
    """A gateway without API keys names its clients by address: a pair keeps
    `addr:<blake2b>` of it, never the address itself."""
    stable, cand = answering(truth), answering(truth)
    s = Route(release_id="s", base_url=stable.url)
    gw = gateway_factory(routes=[s])
    with GatewayClient(gw.url, admin_token=admin_token) as c:
        mirror = Mirror(route=Route(release_id="c", base_url=cand.url), share=1.0)
        c.set_routes(RouteTable(routes=[s], mirror=mirror))
    _ask(gw, QUESTIONS[:2], {})
    pairs = _pairs(gw, admin_token, 2)
    assert {p.client for p in pairs} == {client_digest("127.0.0.1")}
    assert pairs[0].client.startswith("addr:") and "127.0.0.1" not in pairs[0].client
    assert client_digest(KEY_DIGEST) == KEY_DIGEST and client_digest("") == ""


def test_an_after_promotion_mirrors_floor_copy_is_a_second_copy_to_the_previous_release(
    answering: Callable[[Callable[[str], str]], Answering], gateway_factory: Gw, admin_token: str
) -> None:
    """After a promotion the copy goes to the previous release: its floor copy is a second
    copy there, under the same label; without `floor` only the one copy goes."""
    new, prev = answering(bad_at_sums), answering(truth)
    s = Route(release_id="new", base_url=new.url)
    gw = gateway_factory(routes=[s])
    with GatewayClient(gw.url, admin_token=admin_token) as c:
        mirror = Mirror(
            route=Route(release_id="old", base_url=prev.url), share=1.0, purpose="after_promotion"
        )
        c.set_routes(RouteTable(routes=[s], mirror=mirror))
    _ask(gw, QUESTIONS, {})
    pairs = _pairs(gw, admin_token, len(QUESTIONS))
    # A pair is numbered when its copies finish, not when its request came: match by answers.
    assert sorted((p.stable, p.candidate, p.floor) for p in pairs) == sorted(
        (bad_at_sums(q), truth(q), truth(q)) for q in QUESTIONS
    )
    for p in pairs:
        assert (p.floor_release_id, p.has_floor) == ("old", True)
    assert (new.received, prev.received) == (4, 8)
    assert _series(gw, "releasekit_gateway_requests_total") == {"new": 4, "old": 8}
    with GatewayClient(gw.url, admin_token=admin_token) as c:
        c.set_routes(RouteTable(routes=[s], mirror=mirror.model_copy(update={"floor": False})))
    _ask(gw, QUESTIONS[:2], {})
    assert wait_until(lambda: prev.received == 10), prev.received
    with GatewayClient(gw.url, admin_token=admin_token) as c:
        assert wait_until(lambda: c.state().mirror_pairs == 2)
        assert all(not p.has_floor and p.floor is None for p in c.mirror_pairs().pairs)


def _pair(purpose: str, **kw: Any) -> MirrorPair:
    base: dict[str, Any] = {
        "seq": 7,
        "at": 0.0,
        "path": "/v1/completions",
        "stable_release_id": "s",
        "candidate_release_id": "c",
        "stable_status": 200,
        "candidate_status": 200,
        "stable": "S",
        "candidate": "C",
        "complete": True,
        "stable_complete": True,
        "candidate_complete": True,
        "sampled": True,
        "prompt_sha256": "ab" * 32,
        "prompt": "q?",
        "purpose": purpose,
        "client_side": "candidate" if purpose == "canary" else "stable",
        "client": KEY_DIGEST,
        "has_floor": True,
        "floor": "F",
        "floor_status": 200,
        "floor_release_id": "s",
        "floor_complete": True,
    }
    return MirrorPair.model_validate({**base, **kw})


@pytest.mark.parametrize(
    ("purpose", "reference", "judged"),
    [("shadow", "S", "C"), ("canary", "S", "C"), ("after_promotion", "C", "S")],
)
def test_compared_maps_each_purposes_answers(purpose: str, reference: str, judged: str) -> None:
    """shadow: reference the client's (stable), judged the candidate's copy; canary:
    reference the live release's copy (stable), judged the canary's (the client's); after a
    promotion: reference the previous release's copy (candidate), judged the new live
    release's (the client's). Floor, client, sampling and prompt carried over."""
    r = compared(_pair(purpose))
    assert (r.reference, r.judged, r.floor) == (reference, judged, "F")
    assert (r.seq, r.client, r.sampled, r.has_floor) == (7, KEY_DIGEST, True, True)
    assert (r.prompt, r.prompt_sha256) == ("q?", "ab" * 32)


def test_compared_maps_a_side_that_did_not_complete_to_none() -> None:
    """An error status, a cut answer or an unreadable one is None on its side; a pair
    without a floor copy has no floor; an older pair (no floor fields, no per-side flags)
    still reads."""
    r = compared(_pair("shadow", candidate_status=502, complete=False, candidate_complete=False))
    assert (r.reference, r.judged) == ("S", None)
    r = compared(_pair("after_promotion", complete=False, stable_complete=False))
    assert (r.reference, r.judged) == ("C", None)  # the client's stream was cut
    r = compared(_pair("canary", floor_status=504, floor_complete=False, floor=None))
    assert (r.floor, r.has_floor) == (None, True)
    r = compared(_pair("shadow", stable=None, complete=False, stable_complete=False))
    assert (r.reference, r.judged) == (None, "C")
    old = {
        k: v
        for k, v in _pair("shadow").model_dump().items()
        if not k.startswith("floor") and k not in ("has_floor", "client")
        and not k.endswith("_complete")
    }  # fmt: skip
    r = compared(MirrorPair.model_validate({**old, "complete": False, "candidate_status": 500}))
    assert (r.reference, r.judged, r.floor, r.has_floor, r.client) == ("S", None, None, False, "")
    r = compared(MirrorPair.model_validate(old))
    assert (r.reference, r.judged) == ("S", "C")


def _old_file(path: Path, size: int, age_s: float) -> Path:
    path.write_bytes(b"x" * size)
    t = time.time() - age_s
    os.utime(path, (t, t))
    return path


def test_the_gateway_prunes_its_pair_store_by_age_and_size_on_a_schedule(
    tmp_path: Path,
    answering: Callable[[Callable[[str], str]], Answering],
    gateway_factory: Gw,
    admin_token: str,
) -> None:
    """Every `pairs_prune_s`, off the event loop: files of releases no longer mirrored last
    written over `pairs_keep_s` ago go, then the oldest files until the store is under
    `pairs_max_bytes`, never the file being written; requests are answered meanwhile."""
    d = tmp_path / "pairs"
    d.mkdir()
    aged = _old_file(d / "gone.jsonl", 100, 3600)
    mirrored_old = _old_file(d / "c.1.jsonl", 100, 3600)  # the mirrored release: kept by age
    r1 = _old_file(d / "r1.jsonl", 20_000, 60)
    stable, cand = answering(truth), answering(truth)
    s = Route(release_id="s", base_url=stable.url)
    mirror = Mirror(route=Route(release_id="c", base_url=cand.url), share=1.0)
    gw = gateway_factory(
        routes=[s],
        mirror=mirror,
        pairs_dir=str(d),
        pairs_prune_s=0.2,
        pairs_keep_s=600,
        pairs_max_bytes=30_000,
    )
    _ask(gw, QUESTIONS, {})
    writing, _ = segment_paths(d, "c")
    assert wait_until(lambda: not aged.exists() and writing.exists()), os.listdir(d)
    time.sleep(0.5)  # a few more prunes: under the bound, nothing else goes
    assert mirrored_old.exists() and r1.exists()
    # Past the bound: the oldest files go until the store is under it.
    r2 = _old_file(d / "r2.jsonl", 20_000, 30)
    assert wait_until(lambda: not mirrored_old.exists() and not r1.exists()), os.listdir(d)
    time.sleep(0.5)
    assert r2.exists() and writing.exists()
    # The file being written stays, even when it alone is over the bound.
    _old_file(writing, 40_000, 5)
    assert wait_until(lambda: not r2.exists()), os.listdir(d)
    time.sleep(0.5)
    assert writing.exists()
    _ask(gw, QUESTIONS[:1], {})


def test_store_problem_names_an_unwritable_or_full_store(tmp_path: Path) -> None:
    """A folder that cannot be written, or one at its size bound, is a one-line problem;
    prune_to_size never deletes a protected file."""
    d = tmp_path / "pairs"
    assert store_problem(d, max_bytes=1000) is None and d.is_dir()
    (d / "a.jsonl").write_bytes(b"x" * 1000)
    problem = store_problem(d, max_bytes=1000)
    assert problem is not None and "full" in problem and "\n" not in problem
    assert prune_to_size(d, max_bytes=10, protect=[d / "a.jsonl"]) == []
    f = tmp_path / "a-file"
    f.write_bytes(b"")
    problem = store_problem(f, max_bytes=1000)  # not a folder: not writable, even by root
    assert problem is not None and "cannot be written" in problem
    if os.geteuid() == 0:
        return  # root writes through a 0500 folder
    d.chmod(0o500)
    try:
        problem = store_problem(d, max_bytes=10**9)
        assert problem is not None and "cannot be written" in problem
    finally:
        d.chmod(0o700)
