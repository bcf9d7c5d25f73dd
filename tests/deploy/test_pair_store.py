"""The disk copy of the mirror's answer pairs (bounded: two segments, the oldest dropped; no
key or header; the prompt only where allowed; a write failure never reaches a client; the
numbering survives a restart) and the shadow comparison's HTML page (the disagreeing
pairs side by side, escaped)."""

from __future__ import annotations

import json
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import webclient
from gateway_fakes import FakeUpstream, admin_token, gateway_factory, upstream_factory, wait_until

from releasekit.deploy.gateway import (
    GatewayConfig,
    Mirror,
    MirrorPair,
    PairStore,
    Route,
    ThreadedGateway,
    read_pairs,
)
from releasekit.deploy.gateway.pairstore import segment_paths
from releasekit.deploy.gateway_client import GatewayClient
from releasekit.evaluate.agreement import AnswerPair, answer_agreement
from releasekit.promote.report import pairs_table_html
from releasekit.rollout.judge import CheckResult, StepJudgement
from releasekit.rollout.report import shadow_html
from releasekit.rollout.shadow import ShadowComparison
from releasekit.rollout.shadow_compare import _window_pairs

__all__ = ["admin_token", "gateway_factory", "upstream_factory"]

Gw = Callable[..., ThreadedGateway]
Ups = Callable[[str], FakeUpstream]
KEY = "sk-client-key-0123456789"
AUTH = {"authorization": f"Bearer {KEY}"}
SEGMENT_MIB = 0.002  # 2,097 bytes: a few pairs a segment


def _mirror(cand: FakeUpstream, **kw: Any) -> Mirror:
    return Mirror(route=Route(release_id="c", base_url=cand.url), share=1.0, max_in_flight=64, **kw)


def _gateway(
    gateway_factory: Gw, stable: FakeUpstream, cand: FakeUpstream, pairs_dir: Path, **kw: Any
) -> ThreadedGateway:
    route = Route(release_id="s", base_url=stable.url)
    return gateway_factory(
        routes=[route], api_keys=[KEY], pairs_dir=str(pairs_dir), mirror=_mirror(cand, **kw)
    )


def _ask(gw: ThreadedGateway, stable: FakeUpstream, n: int, start: int = 0) -> None:
    """n requests (streamed and not, chat and completions), each answered byte for byte
    as stable answers it (ids aside: the fake numbers its answers)."""
    for i in range(start, start + n):
        stream = i % 3 == 1
        if i % 2:
            path = "/v1/completions"
            body: dict[str, Any] = {"prompt": f"secret question {i}", "stream": stream}
        else:
            path = "/v1/chat/completions"
            msgs = [{"role": "user", "content": f"secret question {i}"}]
            body = {"messages": msgs, "stream": stream}
        body["temperature"] = 0
        r = webclient.post(gw.url + path, json=body, headers=AUTH, timeout=10)
        assert r.status_code == 200, r.text
        assert ("t0" if stream else "hello") in r.text


def _stored(gw: ThreadedGateway, admin_token: str, n: int) -> Any:
    with GatewayClient(gw.url, admin_token=admin_token) as c:
        assert wait_until(lambda: c.state().mirror_pairs_stored == n), c.state()
        return c.state()


def test_pairs_reach_the_disk_bounded_keyless_and_digested(
    tmp_path: Path, upstream_factory: Ups, gateway_factory: Gw, admin_token: str
) -> None:
    """40 mirrored requests through a store of two 2 KiB segments: two files, each within
    its cap, holding the latest pairs in order (the oldest segments dropped); both answers,
    the body's digest, no prompt, no key or header, files readable by the owner only."""
    stable, cand = upstream_factory("stable"), upstream_factory("cand")
    d = tmp_path / "mirror-pairs" / "test"
    gw = _gateway(gateway_factory, stable, cand, d, pairs_segment_mib=SEGMENT_MIB)
    _ask(gw, stable, 40)
    st = _stored(gw, admin_token, 40)
    assert (st.mirror_pairs, st.mirror_pairs_store_failed) == (40, 0)
    now, older = segment_paths(d, "c")
    assert sorted(p.name for p in d.iterdir()) == sorted([now.name, older.name])
    cap = int(SEGMENT_MIB * 2**20)
    for f in (now, older):
        assert 0 < f.stat().st_size <= cap
        assert stat.S_IMODE(f.stat().st_mode) == 0o600
    kept = read_pairs(d, "c")
    seqs = [p.seq for p in kept]
    assert seqs == list(range(41 - len(seqs), 41)) and 4 <= len(seqs) < 40
    assert all(p.complete and p.prompt is None and len(p.prompt_sha256) == 64 for p in kept)
    assert {(p.stable, p.candidate) for p in kept} <= {("hello", "hello"), ("t0t1t2", "t0t1t2")}
    raw = now.read_text() + older.read_text()
    assert KEY not in raw and "authorization" not in raw.lower()
    assert "secret question" not in raw and admin_token not in raw
    assert [p.seq for p in read_pairs(d, "c", since=37, until=39)] == [38, 39]


def test_prompts_reach_the_disk_only_where_allowed(
    tmp_path: Path, upstream_factory: Ups, gateway_factory: Gw, admin_token: str
) -> None:
    """With keep_prompts the stored pair holds the prompt text."""
    stable, cand = upstream_factory("stable"), upstream_factory("cand")
    gw = _gateway(gateway_factory, stable, cand, tmp_path, keep_prompts=True)
    _ask(gw, stable, 2)
    _stored(gw, admin_token, 2)
    assert [p.prompt for p in read_pairs(tmp_path, "c")] == [
        "user: secret question 0",
        "secret question 1",
    ]


def test_an_unwritable_store_never_fails_a_clients_request(
    tmp_path: Path, upstream_factory: Ups, gateway_factory: Gw, admin_token: str
) -> None:
    """The store's folder cannot be made (a file is in the way): every client still gets
    its answer, every pair is kept in memory, and each failed write is counted."""
    stable, cand = upstream_factory("stable"), upstream_factory("cand")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    gw = _gateway(gateway_factory, stable, cand, blocker / "pairs")
    _ask(gw, stable, 12)
    with GatewayClient(gw.url, admin_token=admin_token) as c:
        assert wait_until(lambda: c.state().mirror_pairs_store_failed == 12), c.state()
        st = c.state()
        held = c.mirror_pairs()
    assert (st.mirror_pairs, st.mirror_pairs_kept, st.mirror_pairs_stored) == (12, 12, 0)
    assert [p.seq for p in held.pairs] == list(range(1, 13))
    assert read_pairs(blocker / "pairs", "c") == []


def test_a_restarted_gateway_goes_on_numbering_and_a_window_is_read_from_disk(
    tmp_path: Path, upstream_factory: Ups, admin_token: str
) -> None:
    """A gateway stopped after 5 pairs and started again (same config, a 3-pair ring)
    numbers the next pairs from 6; a window of 6 pairs, more than the ring holds, is read
    whole from the disk copy; the store holds every pair once."""
    stable, cand = upstream_factory("stable"), upstream_factory("cand")
    cfg = GatewayConfig(
        env="test",
        port=0,
        admin_token=admin_token,
        api_keys=[KEY],
        shutdown_timeout_s=1,
        routes=[Route(release_id="s", base_url=stable.url)],
        mirror=_mirror(cand, pairs=3),
        pairs_dir=str(tmp_path),
    )
    with ThreadedGateway(cfg) as gw:
        _ask(gw, stable, 5)
        _stored(gw, admin_token, 5)
    with ThreadedGateway(cfg) as gw, GatewayClient(gw.url, admin_token=admin_token) as c:
        s0 = c.state()
        assert s0.mirror_pairs == 5 and s0.mirror_pairs_kept == 0
        _ask(gw, stable, 6, start=5)
        _stored(gw, admin_token, 6)
        s1 = c.state()
        assert (s1.mirror_pairs, s1.mirror_pairs_kept) == (11, 3)
        assert [p.seq for p in c.mirror_pairs(s0.mirror_pairs).pairs] == [9, 10, 11]
        window = _window_pairs(c, "c", s0, s1, stored=tmp_path)
        assert [p.seq for p in window] == list(range(6, 12))
        # Without the disk copy the window is what memory holds.
        assert [p.seq for p in _window_pairs(c, "c", s0, s1)] == [9, 10, 11]
    assert [p.seq for p in read_pairs(tmp_path, "c")] == list(range(1, 12))


def _pair(seq: int, text: str = "x") -> MirrorPair:
    return MirrorPair(
        seq=seq,
        at=0.0,
        path="/v1/completions",
        stable_release_id="s",
        candidate_release_id="c",
        stable_status=200,
        candidate_status=200,
        stable=text,
        candidate=text,
        complete=True,
        prompt_sha256="0" * 64,
    )


def test_rotation_keeps_two_segments_within_the_cap_and_a_cut_line_is_skipped(
    tmp_path: Path,
) -> None:
    """200 pairs through 1 KiB segments: two files within the cap, the latest pairs in
    order; a last line cut by a crash is skipped, ended, and the numbering goes on from the
    last whole pair."""
    store = PairStore(tmp_path, "c", segment_bytes=1024)
    for i in range(1, 201):
        store.append(_pair(i, "answer " * 5))
    store.close(timeout_s=30)
    assert (store.written, store.failed) == (200, 0)
    now, older = segment_paths(tmp_path, "c")
    assert all(0 < f.stat().st_size <= 1024 for f in (now, older))
    assert len(list(tmp_path.iterdir())) == 2
    seqs = [p.seq for p in read_pairs(tmp_path, "c")]
    assert seqs == list(range(201 - len(seqs), 201)) and len(seqs) < 20

    with now.open("ab") as f:
        f.write(b'{"seq": 201, "at": 0.0, "pa')  # the process died mid-line
    again = PairStore(tmp_path, "c", segment_bytes=1 << 20)
    assert again.seq == 200
    again.append(_pair(201))
    again.close(timeout_s=30)
    assert [p.seq for p in read_pairs(tmp_path, "c")][-2:] == [200, 201]
    # A release id that is not a plain name gets a digest for a file name.
    assert segment_paths(tmp_path, "../x y")[0].parent == tmp_path


def test_the_shadow_page_shows_disagreeing_pairs_side_by_side_escaped(tmp_path: Path) -> None:
    """The page names the verdict, the agreement and its interval, the checks, and the
    disagreeing pairs: prompt | stable's answer | candidate's answer, every text escaped
    (a prompt with a script tag comes out as text); a pair without its prompt shows the
    digest."""
    pairs = [
        AnswerPair(
            seq=1,
            stable="<b>Paris</b>",
            candidate="Rome & <i>Milan</i>",
            prompt="<script>alert('x')</script>",
            prompt_sha256="a" * 64,
        ),
        AnswerPair(seq=2, stable="4", candidate="5", prompt=None, prompt_sha256="b" * 64),
        AnswerPair(seq=3, stable="same", candidate="same", prompt_sha256="c" * 64),
    ]
    a = answer_agreement(pairs, min_agreement=0.9, min_pairs=3)
    check = CheckResult(
        metric="ttft_p95_s",
        verdict="pass",
        required=True,
        canary=0.5,
        stable=0.4,
        limit=0.8,
        source="edge",
        reason="ok",
        window_start=0.0,
        window_end=30.0,
    )
    cmp = ShadowComparison(
        env="staging",
        release_id="cand" * 8,
        stable_release_id="stab" * 8,
        verdict="breach",
        window_s=30,
        at=0.0,
        judgement=StepJudgement(
            window_start=0, window_end=30, canary_requests=3, stable_requests=9, checks=[check]
        ),
        mirrored=3,
        reason=f"answers: {a.reason}",
        seq=7,
        agreement=a,
    )
    page = shadow_html(cmp)
    assert "<script>" not in page and "<b>Paris" not in page and "<i>" not in page
    assert "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;" in page
    assert "&lt;b&gt;Paris&lt;/b&gt;" in page and "Rome &amp; &lt;i&gt;Milan&lt;/i&gt;" in page
    assert "sha256 " + "b" * 16 in page
    assert "BREACH: shadow candcandcand vs stable stabstabstab in staging" in page
    assert "33.3%, 95% interval [" in page and "2 of 2 disagreeing pairs" in page
    assert "ttft_p95_s" in page and "ledger record 7" in page
    # The stable answer and the candidate's share a row, in that order.
    row = next(r for r in page.split("<tr") if "Paris" in r)
    assert row.index("Paris") < row.index("Milan")
    assert pairs_table_html([]) == "<p>No disagreeing pairs.</p>"
    # The same table takes the gateway's pairs (an unreadable answer shows as "-").
    unread = _pair(5).model_copy(update={"candidate": None})
    assert "<td>x</td><td>-</td>" in pairs_table_html([unread])
    json.loads(cmp.model_dump_json())  # the comparison still round-trips
