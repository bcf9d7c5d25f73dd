"""Promote with canary steps on the local target, with stand-in vLLM servers behind a real
gateway process: a healthy canary goes to 100%, a slow one is aborted at its first step
with traffic back on stable, and a promote that dies mid-canary never leaves a weight."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import webclient
from gateway_fakes import FakeUpstream, admin_token, gateway_factory, upstream_factory
from promote_kit import (
    Kit,
    Streamer,
    commit_config,
    kill_everything,
    make_kit,
)

from releasekit.config import load_settings
from releasekit.deploy.gateway import GatewayRequestError, Route, RouteTable, ThreadedGateway
from releasekit.deploy.gateway_client import GatewayClient
from releasekit.deploy.state import read_state
from releasekit.rollout.baseline import BaselinePolicyError
from releasekit.rollout.progressive import RolloutResumeError, promote_progressive
from releasekit.rollout.state import read_rollout, write_rollout
from releasekit.serving.host import autogroup_nice, host_cores, session_pids
from releasekit.stores.ledger import Ledger

__all__ = ["admin_token", "gateway_factory", "upstream_factory"]

LEASE_S = 1.5


@pytest.fixture
def ckit(
    request: pytest.FixtureRequest,
    project: Path,
    monkeypatch: pytest.MonkeyPatch,
    mlflow_template_db: Path,
    stand_in_model: Any,
) -> Iterator[Kit]:
    """The deploy kit with a short canary lease (and, parametrized indirectly, more
    environment settings)."""
    stand_in_model(project)
    lines = [f"canary_lease_s = {LEASE_S}", *getattr(request, "param", [])]
    k = make_kit(project, monkeypatch, mlflow_template_db, toml_lines=lines)
    try:
        yield k
    finally:
        kill_everything(k.settings)


def canary_block(
    steps: str,
    checks: str,
    *,
    interval: float = 0.3,
    sustain: int = 2,
    warmup: int = 0,
    settle: float = 0,
    baseline: str = "live",
) -> str:
    return (
        "promotion:\n  canary:\n"
        f"    interval_s: {interval}\n    sustain: {sustain}\n"
        f"    warmup_requests: {warmup}\n    settle_s: {settle}\n    baseline: {baseline}\n"
        f"    steps:\n{steps}    checks:\n{checks}"
    )


def candidate(
    k: Kit, name: str, *, seqs: int, env_line: str = "", promotion: str, **build: Any
) -> str:
    path = k.variant("demo-bf16", name, {"max-num-seqs: 32": f"max-num-seqs: {seqs}"})
    text = path.read_text()
    if env_line:
        text = text.replace(
            'VLLM_CPU_KVCACHE_SPACE: "1"', f'VLLM_CPU_KVCACHE_SPACE: "1"\n{env_line}'
        )
    path.write_text(text + promotion)
    return k.build(name, **build)


# One step at 25% that lasts until the canary breaches, judged on TTFT p95.
SLOW_STEPS = (
    "      - {weight: 25, min_duration_s: 120, min_requests: 4, max_duration_s: 240}\n"
    "      - {weight: 100}\n"
)
SLOW_CHECKS = "      - {metric: ttft_p95_s, tolerance: 0.5, slack: 0.1, min_samples: 10}\n"
SLOW_CHUNKS = '    FAKE_CHUNK_DELAY_S: "0.4"'


def live_base_and_slow_candidate(k: Kit, **build: Any) -> tuple[str, str]:
    """demo-bf16 live in staging, and a candidate whose stand-in streams slowly, with the
    SLOW canary steps (`build`: the candidate's evidence); (base id, candidate id)."""
    old = k.build("demo-bf16")
    assert promote_progressive(k.settings, old, env="staging", reason="base").ok
    slow = candidate(
        k,
        "demo-canary-slow",
        seqs=1,
        env_line=SLOW_CHUNKS,
        promotion=canary_block(SLOW_STEPS, SLOW_CHECKS),
        **build,
    )
    return old, slow


def _ledger(k: Kit) -> Ledger:
    return Ledger(k.settings.ledger_url or "")


def _nices(k: Kit, env: str = "staging") -> dict[str, int | None]:
    """Each server's scheduler autogroup nice, by release."""
    return {
        s.release_id: autogroup_nice(s.pid) for s in read_state(k.settings.state_dir, env).servers
    }


def _cores(k: Kit, env: str = "staging") -> dict[str, set[int]]:
    """The cores each server's threads may run on (all of its processes' threads), by release."""
    out: dict[str, set[int]] = {}
    for s in read_state(k.settings.state_dir, env).servers:
        cores: set[int] = set()
        for pid in session_pids(s.pid):
            for t in Path(f"/proc/{pid}/task").iterdir():
                cores |= os.sched_getaffinity(int(t.name))
        out[s.release_id] = cores
    return out


def _gateway_state(k: Kit, env: str = "staging") -> Any:
    gw = read_state(k.settings.state_dir, env).gateway
    assert gw is not None
    with GatewayClient(gw.url, admin_token=gw.admin_token) as c:
        return c.state()


def _canary_under_two_streams(
    ckit: Kit, new: str, progress: Callable[[str, int, int], None]
) -> tuple[Any, Streamer, Streamer]:
    """Promote `new` into staging progressively while two clients stream through its
    gateway, each answered at least 3 times before and after: (result, the two streams)."""
    with (
        Streamer(ckit.gateway("staging"), chunks=4) as s1,
        Streamer(ckit.gateway("staging"), chunks=4) as s2,
    ):
        s1.wait_for(3)
        res = promote_progressive(
            ckit.settings, new, env="staging", reason="canary", progress=progress
        )
        s1.wait_for(3)
    return res, s1, s2


def test_healthy_canary_goes_step_by_step_to_100(ckit: Kit) -> None:
    """Under streaming load a canary no worse than stable passes every step (each a
    `canary_step` event) and then takes all traffic; no stream fails on the way. Its own
    server got the warm-up burst first, and each step was judged only after settling."""
    old = ckit.build("demo-bf16")
    assert promote_progressive(ckit.settings, old, env="staging", reason="base").ok
    steps = (
        "      - {weight: 20, min_duration_s: 1, min_requests: 4, max_duration_s: 60}\n"
        "      - {weight: 50, min_duration_s: 1, min_requests: 4, max_duration_s: 60}\n"
        "      - {weight: 100}\n"
    )
    checks = (
        "      - {metric: ttft_p95_s, tolerance: 1.0, slack: 0.5, min_samples: 10}\n"
        "      - {metric: error_rate, tolerance: 0, slack: 0.05, min_samples: 4}\n"
    )
    block = canary_block(steps, checks, warmup=3, settle=0.6)
    new = candidate(ckit, "demo-canary-ok", seqs=16, promotion=block)
    judged: list[dict[str, int | None]] = []
    placed: list[dict[str, set[int]]] = []
    before = _cores(ckit)

    def seen(label: str, done: int, total: int) -> None:
        if "waiting for traffic" in label:
            judged.append(_nices(ckit))
            placed.append(_cores(ckit))

    res, s1, s2 = _canary_under_two_streams(ckit, new, seen)
    assert res.status == "promoted", (res.deploy, res.canary)
    assert res.canary is not None and res.canary["outcome"] == "passed"
    assert [s["weight"] for s in res.canary["steps"]] == [20, 50]
    assert res.canary["warmup_answered"] == 3
    # Judged under the same scheduler priority (where the kernel has autogroups), and
    # both back to the default once the canary is over.
    nice = ckit.settings.canary_judge_nice
    assert len(judged) == 2
    if judged[0].get(old) is not None:
        assert all(j[old] == nice and j[new] == nice for j in judged), judged
        assert all(v == 0 for v in _nices(ckit).values()), _nices(ckit)
    # Each worker is bound to a core of its own, except while judged: both free on all.
    if len(host_cores()) > 1:
        assert len(before[old]) == 1
        assert all(p[old] == p[new] == set(host_cores()) for p in placed), placed
        after = _cores(ckit)
        assert len(after[new]) == 1 and after[new] != before[old], (before, after)
    for step in res.canary["steps"]:
        # Every judged window starts after the step's settling time.
        for c in step["judgement"]["checks"]:
            assert c["window_start"] >= step["started_at"] + 0.6
    assert s1.failures == [] and s2.failures == []
    assert new in s1.releases + s2.releases and old in s1.releases + s2.releases
    led = _ledger(ckit)
    steps_rec = led.records(environment="staging", types=["canary_step"])
    assert [r.evidence["weight"] for r in steps_rec] == [20, 50]
    # Each step passed on `sustain` (2) clean judgements in a row, as an abort needs 2.
    assert all(r.evidence["clean_judgements"] >= 2 for r in steps_rec), steps_rec
    live = led.live_at("staging")
    assert live is not None and live.to_release == new
    assert live.evidence["canary"]["outcome"] == "passed"
    st = _gateway_state(ckit)
    assert [r.release_id for r in st.routes] == [new] and st.lease_left_s is None
    assert read_rollout(ckit.settings, "staging") is None


REQUIRE_FRESH = ['comparison_baseline = "fresh"']


@pytest.mark.parametrize(
    ("ckit", "asked"),
    [([], "fresh"), (REQUIRE_FRESH, "live")],
    ids=["manifest-asks", "environment-requires"],
    indirect=["ckit"],
)
def test_a_fresh_baseline_is_judged_against_the_canary_and_stopped(ckit: Kit, asked: str) -> None:
    """With `baseline: fresh` a new server of the live release starts with the canary, is
    warmed like it and takes the same share of traffic (20% each, the live server the
    rest); the canary is judged against it, not against the long-running live server, and
    it is drained and stopped before the switch. No client stream fails. An environment
    whose committed policy requires a fresh baseline (`comparison_baseline`) gets one even
    for a candidate whose manifest asks to be judged against the live server."""
    old = ckit.build("demo-bf16")
    assert promote_progressive(ckit.settings, old, env="staging", reason="base").ok
    live_url = {r.release_id: r.base_url for r in _gateway_state(ckit).routes}[old]
    steps = (
        "      - {weight: 20, min_duration_s: 1, min_requests: 4, max_duration_s: 60}\n"
        "      - {weight: 100}\n"
    )
    checks = "      - {metric: ttft_p95_s, tolerance: 1.0, slack: 0.5, min_samples: 10}\n"
    block = canary_block(steps, checks, warmup=3, settle=0.3, baseline=asked)
    new = candidate(ckit, "demo-canary-fresh", seqs=16, promotion=block)
    tables: list[dict[str, tuple[float, str]]] = []

    def seen(label: str, done: int, total: int) -> None:
        if "waiting for traffic" in label:
            st = _gateway_state(ckit)
            tables.append({r.release_id: (r.weight, r.base_url) for r in st.routes})

    res, s1, s2 = _canary_under_two_streams(ckit, new, seen)
    assert res.status == "promoted", (res.deploy, res.canary)
    assert res.canary is not None and res.canary["outcome"] == "passed"
    base = f"{old}:baseline"
    assert res.canary["judged_against"] == base
    assert res.canary["warmup_answered"] == 3 and res.canary["baseline_warmup_answered"] == 3
    [table] = tables
    assert {k: w for k, (w, _) in table.items()} == {old: 60, new: 20, base: 20}
    baseline_url = table[base][1]
    assert baseline_url not in (live_url, table[new][1])
    [step] = res.canary["steps"]
    # Judged against the baseline: the stable side's requests are the ones the gateway
    # answered under the baseline's own label (the live server took three times as many),
    # so they are at most what the clients got from it. (A ratio of the two sides' counts
    # in one short window is too noisy to tell: 34 to 11 was seen on a 1:1 split.)
    from_baseline = (s1.releases + s2.releases).count(base)
    from_live = (s1.releases + s2.releases).count(old)
    assert 0 < step["stable_requests"] <= from_baseline < from_live
    assert s1.failures == [] and s2.failures == []
    servers = read_state(ckit.settings.state_dir, "staging").servers
    assert baseline_url not in {s.base_url for s in servers}
    assert [r.release_id for r in _gateway_state(ckit).routes] == [new]
    with pytest.raises(httpx.HTTPError):
        webclient.get(baseline_url + "/health", timeout=2)


@pytest.mark.parametrize(
    "ckit", [["answer_max_client_share = 1", "answer_min_pairs = 4"]], indirect=True
)
def test_a_canary_after_its_shadow_takes_the_shadows_two_servers(ckit: Kit) -> None:
    """Promoted while its shadow still runs, the candidate's canary starts no server: it
    runs on the server its shadow ran on and is judged against the fresh baseline its shadow
    ran beside (the two were started together and got the same copies: the pair the shadow
    judged), which it stops once judged. `shadow stop` then only records the end: the
    candidate, now live, keeps serving."""
    from releasekit.rollout.shadow import compare_shadow, start_shadow, stop_shadow

    old = ckit.build("demo-bf16")
    assert promote_progressive(ckit.settings, old, env="staging", reason="base").ok
    steps = (
        "      - {weight: 20, min_duration_s: 1, min_requests: 4, max_duration_s: 60}\n"
        "      - {weight: 100}\n"
    )
    checks = "      - {metric: ttft_p95_s, tolerance: 1.0, slack: 0.5, min_samples: 10}\n"
    block = canary_block(steps, checks, warmup=3, settle=0.3, baseline="fresh")
    new = candidate(ckit, "demo-canary-fresh", seqs=16, promotion=block)
    shadow = start_shadow(ckit.settings, new, env="staging", share=0.5, reason="try it")
    assert shadow.baseline_url is not None
    stop = threading.Event()

    def greedy() -> None:  # answers a shadow can judge: the same question, not sampled
        i = 0
        while not stop.is_set():
            i += 1
            body = {"model": "demo", "prompt": f"q{i % 5}", "max_tokens": 4, "temperature": 0}
            with contextlib.suppress(httpx.HTTPError):
                webclient.post(f"{ckit.gateway('staging')}/v1/completions", json=body, timeout=10)
            stop.wait(0.1)  # within the gateway's client rate limit

    sender = threading.Thread(target=greedy, daemon=True)
    sender.start()
    try:
        with Streamer(ckit.gateway("staging"), chunks=3) as s0:  # streams: TTFT to judge
            s0.wait_for(2)
            cmp = compare_shadow(ckit.settings, env="staging", window_s=4, max_window_s=40)
    finally:
        stop.set()
        sender.join(timeout=15)
    assert cmp.judged_against == "fresh baseline" and cmp.verdict == "pass", cmp.reason
    pids = {s.base_url: s.pid for s in read_state(ckit.settings.state_dir, "staging").servers}
    tables: list[dict[str, tuple[float, str]]] = []
    said: list[str] = []

    def seen(label: str, done: int, total: int) -> None:
        said.append(label)
        if "waiting for traffic" in label:
            st = _gateway_state(ckit)
            tables.append({r.release_id: (r.weight, r.base_url) for r in st.routes})

    res, s1, s2 = _canary_under_two_streams(ckit, new, seen)
    failed = [(g.name, g.detail) for g in res.report.failed] if res.report else []
    assert res.status == "promoted", (failed, res.deploy, res.canary)
    assert res.canary is not None and res.canary["judged_against"] == f"{old}:baseline"
    assert res.deploy is not None and res.deploy.reused_role == "shadow"
    [table] = tables
    assert table[new][1] == shadow.base_url and table[f"{old}:baseline"][1] == shadow.baseline_url
    assert not any(x.startswith("starting a fresh baseline") for x in said), said
    assert any("the fresh baseline server its shadow ran beside" in x for x in said), said
    assert s1.failures == [] and s2.failures == []
    servers = read_state(ckit.settings.state_dir, "staging").servers
    [live] = [s for s in servers if s.role == "live"]
    assert (live.release_id, live.base_url, live.pid) == (new, shadow.base_url, pids[live.base_url])
    assert shadow.baseline_url not in {s.base_url for s in servers}
    with pytest.raises(httpx.HTTPError):
        webclient.get(shadow.baseline_url + "/health", timeout=2)
    stop_shadow(ckit.settings, env="staging")
    after = read_state(ckit.settings.state_dir, "staging")
    assert [r.release_id for r in after.routes] == [new]
    assert webclient.get(shadow.base_url + "/health", timeout=5).status_code == 200


@pytest.mark.parametrize("ckit", [REQUIRE_FRESH], indirect=True)
def test_steps_that_cannot_run_with_the_required_fresh_baseline_are_refused(ckit: Kit) -> None:
    """The environment requires a fresh baseline and the candidate's judged step takes 60%
    (a fresh baseline takes as much as the canary): promote refuses in one line naming the
    policy and the steps, before anything starts or is recorded."""
    old = ckit.build("demo-bf16")
    assert promote_progressive(ckit.settings, old, env="staging", reason="base").ok
    steps = "      - {weight: 60, min_duration_s: 1, min_requests: 4}\n      - {weight: 100}\n"
    checks = "      - {metric: ttft_p95_s, tolerance: 1.0, slack: 0.5, min_samples: 10}\n"
    new = candidate(ckit, "demo-canary-60", seqs=16, promotion=canary_block(steps, checks))
    before = len(Ledger(ckit.settings.ledger_url or "").records())
    with pytest.raises(BaselinePolicyError) as info:
        promote_progressive(ckit.settings, new, env="staging", reason="try")
    msg = str(info.value)
    assert "comparison_baseline" in msg and "at most 50" in msg and "\n" not in msg
    assert len(Ledger(ckit.settings.ledger_url or "").records()) == before
    st = read_state(ckit.settings.state_dir, "staging")
    assert [r.release_id for r in st.routes] == [old]
    assert {s.release_id for s in st.servers} == {old}


def test_slow_canary_is_aborted_at_the_first_step(ckit: Kit) -> None:
    """A canary whose TTFT is far above stable's breaches at its first step: all traffic
    goes back to stable, no client stream fails, the canary server stops, and the ledger
    holds a `canary_aborted` event with the breaching windows and a `mark_bad`."""
    old, slow = live_base_and_slow_candidate(ckit)
    streamers = [Streamer(ckit.gateway("staging"), chunks=3) for _ in range(3)]
    for s in streamers:
        s.__enter__()
    try:
        streamers[0].wait_for(2)
        res = promote_progressive(ckit.settings, slow, env="staging", reason="canary")
        streamers[0].wait_for(3)
    finally:
        for s in streamers:
            s.__exit__(None, None, None)
    assert res.status == "canary_aborted", res.deploy
    assert not res.ok and res.canary is not None
    assert res.canary["outcome"] == "breached" and len(res.canary["steps"]) == 1
    assert res.canary["canary_served"] > 0
    assert res.canary["decide_to_zero_s"] < 1.0
    assert all(s.failures == [] for s in streamers), [s.failures for s in streamers]
    st = _gateway_state(ckit)
    assert [r.release_id for r in st.routes] == [old]
    assert st.in_flight.get(slow, 0) == 0
    assert all(s.release_id != slow for s in read_state(ckit.settings.state_dir, "staging").servers)
    assert _nices(ckit)[old] in (0, None)  # stable's priority is back after the abort
    led = _ledger(ckit)
    live = led.live_at("staging")
    assert live is not None and live.to_release == old
    [ab] = led.records(environment="staging", types=["canary_aborted"])
    assert ab.to_release == slow and ab.from_release == old
    [breach] = ab.evidence["breaches"]
    assert breach["metric"] == "ttft_p95_s" and len(breach["windows"]) == 2
    w = breach["windows"][-1]
    assert w["canary"] > w["limit"] and w["end"] > w["start"]
    [bad] = led.records(environment="staging", types=["mark_bad"])
    assert bad.to_release == slow
    again = promote_progressive(ckit.settings, slow, env="staging", reason="again")
    assert again.status == "blocked"


@pytest.mark.parametrize("ckit", [["perf_by_canary = true"]], indirect=True)
def test_perf_by_canary_lets_the_canary_judge_what_the_offline_perf_gates_fail(
    ckit: Kit,
) -> None:
    """Where the environment lets the canary judge performance, a release whose offline perf
    gates fail is not blocked by them when it goes live through canary steps: they are in
    the report, failed and advisory, and its canary, slower than stable, is aborted at its
    first step. Without canary steps (`--no-canary`) the same gates block; a quality
    failure blocks either way."""
    # Its load sweep fails the perf gates at the live knee.
    old, slow = live_base_and_slow_candidate(ckit, knee_ttft=0.9, knee_goodput=3.0)

    plain = promote_progressive(ckit.settings, slow, env="staging", dry_run=True, no_canary=True)
    assert plain.report is not None and not plain.report.passed
    assert {g.kind for g in plain.report.failed} == {"perf"}, plain.report.failed
    assert plain.report.advisory_failed == []

    dry = promote_progressive(ckit.settings, slow, env="staging", dry_run=True)
    assert dry.report is not None and dry.report.passed and dry.report.failed == []
    advisory = dry.report.advisory_failed
    assert advisory and {g.kind for g in advisory} == {"perf"}
    assert all("canary steps judge performance" in g.detail for g in advisory)

    with (
        Streamer(ckit.gateway("staging"), chunks=3) as s1,
        Streamer(ckit.gateway("staging"), chunks=3) as s2,
    ):
        s1.wait_for(2)
        res = promote_progressive(ckit.settings, slow, env="staging", reason="canary")
    assert res.status == "canary_aborted", res.deploy
    assert res.canary is not None and len(res.canary["steps"]) == 1
    assert s1.failures == [] and s2.failures == []
    led = _ledger(ckit)
    [ab] = led.records(environment="staging", types=["canary_aborted"])
    assert ab.to_release == slow
    live = led.live_at("staging")
    assert live is not None and live.to_release == old

    # A quality failure is never advisory.
    bad = candidate(
        ckit,
        "demo-canary-worse",
        seqs=16,
        promotion=canary_block(SLOW_STEPS, SLOW_CHECKS),
        fail={"core": 60},
        knee_ttft=0.9,
        knee_goodput=3.0,
    )
    blocked = promote_progressive(ckit.settings, bad, env="staging", reason="x")
    assert blocked.status == "blocked" and blocked.report is not None
    assert "suite core" in [g.name for g in blocked.report.failed]
    assert all(g.kind != "perf" for g in blocked.report.failed)

    # Where an environment's gates do not block (`gates_required = false`), the same failure
    # is shown and listed as advisory, by the same rule: no failed gate blocks there.
    # (A policy change is a commit: the environment's policy is read from one.)
    toml = ckit.root / "releasekit.toml"
    toml.write_text(
        toml.read_text().replace(
            "[environments.staging]\n", "[environments.staging]\ngates_required = false\n"
        )
    )
    commit_config(ckit.root, "staging's gates do not block")
    lax = load_settings(root=ckit.root)
    dry = promote_progressive(lax, bad, env="staging", dry_run=True)
    assert dry.report is not None and dry.report.passed and dry.report.failed == []
    assert "suite core" in [g.name for g in dry.report.advisory_failed]
    assert all("gates do not block" in g.detail for g in dry.report.advisory_failed)


def test_no_canary_switches_at_once(ckit: Kit) -> None:
    """`--no-canary` keeps the one switch: no canary step runs, no canary event. A dry run
    of the same release states its canary checks' power."""
    old = ckit.build("demo-bf16")
    assert promote_progressive(ckit.settings, old, env="staging", reason="base").ok
    steps = "      - {weight: 10, min_duration_s: 600, min_requests: 1000}\n"
    checks = "      - {metric: error_rate}\n"
    new = candidate(ckit, "demo-canary-skip", seqs=16, promotion=canary_block(steps, checks))
    # A canary a dead promote left behind (its process is gone) is recorded as aborted.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    write_rollout(
        ckit.settings, env="staging", release_id=new, stable_release_id=old, step=0, steps=1,
        weight=10,
    )  # fmt: skip
    path = ckit.settings.state_dir / "rollouts" / "staging.json"
    path.write_text(path.read_text().replace(f'"pid": {os.getpid()}', f'"pid": {dead.pid}'))
    # A dry run states what each canary check would detect (`promote --dry-run --explain`).
    dry = promote_progressive(ckit.settings, new, env="staging", dry_run=True)
    assert dry.status == "dry_run" and dry.canary_power is not None
    [power] = dry.canary_power
    assert power["metric"] == "error_rate" and power["samples"] == 20
    assert power["breach_at"] == 1 and power["detects"] is not None  # slack 0: one error
    res = promote_progressive(ckit.settings, new, env="staging", reason="x", no_canary=True)
    assert res.status == "promoted" and res.canary is None and res.canary_power is None
    assert any("--no-canary" in w for w in res.warnings)
    led = _ledger(ckit)
    assert led.records(types=["canary_step"]) == []
    [ab] = led.records(environment="staging", types=["canary_aborted"])
    assert ab.evidence["outcome"] == "interrupted" and ab.to_release == new
    assert read_rollout(ckit.settings, "staging") is None


@pytest.mark.slow  # two CLI processes and a lease expiry: about a minute on 2 busy cores
def test_a_promote_killed_mid_canary_leaves_no_weight_and_resumes(ckit: Kit) -> None:
    """SIGKILL of `promote` during a step: the gateway's lease puts all traffic back on
    stable by itself; the next `promote --resume` continues at that step and finishes."""
    old = ckit.build("demo-bf16")
    assert promote_progressive(ckit.settings, old, env="staging", reason="base").ok
    steps = (
        "      - {weight: 10, min_duration_s: 1, min_requests: 2, max_duration_s: 60}\n"
        "      - {weight: 40, min_duration_s: 2, min_requests: 2, max_duration_s: 60}\n"
    )
    checks = "      - {metric: error_rate, tolerance: 0, slack: 0.05, min_samples: 2}\n"
    new = candidate(ckit, "demo-canary-kill", seqs=16, promotion=canary_block(steps, checks))
    cli = [sys.executable, "-c", "from releasekit.cli import app; app()"]
    with Streamer(ckit.gateway("staging"), chunks=3) as s:
        s.wait_for(2)
        proc = subprocess.Popen(
            [*cli, "promote", new, "--to", "staging", "-r", "canary", "--json"],
            cwd=ckit.root,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            end = time.monotonic() + 120
            while time.monotonic() < end:
                st = read_rollout(ckit.settings, "staging")
                if st is not None and st.step == 1:
                    break
                time.sleep(0.1)
            assert st is not None and st.step == 1, "the canary never reached step 2"
            split = _gateway_state(ckit)
            assert {r.release_id for r in split.routes} == {old, new}
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
        # The lease runs out and the gateway reverts by itself: no stuck weight.
        end = time.monotonic() + 30
        while time.monotonic() < end:
            st_now = _gateway_state(ckit)
            if [r.release_id for r in st_now.routes] == [old]:
                break
            time.sleep(0.1)
        assert [r.release_id for r in st_now.routes] == [old] and st_now.lease_expiries >= 1
        n = s.done
        s.wait_for(3)
        assert s.done > n and s.releases[-1] == old
    left = read_rollout(ckit.settings, "staging")
    assert left is not None and left.orphaned and left.step == 1
    # It names the servers it left at the judged priority; resuming resets them first.
    if _nices(ckit).get(old) is not None:
        assert {h.release_id for h in left.held} == {old, new}
        assert _nices(ckit)[old] == ckit.settings.canary_judge_nice
    with pytest.raises(RolloutResumeError, match="no interrupted canary"):
        promote_progressive(ckit.settings, old, env="staging", resume=True)
    with Streamer(ckit.gateway("staging"), chunks=3) as s:
        s.wait_for(2)
        res = promote_progressive(ckit.settings, new, env="staging", reason="go on", resume=True)
    assert res.status == "promoted", (res.deploy, res.canary)
    assert res.canary is not None and [x["weight"] for x in res.canary["steps"]] == [40]
    assert any("resuming" in w for w in res.warnings) and s.failures == []
    assert read_rollout(ckit.settings, "staging") is None
    assert all(v in (0, None) for v in _nices(ckit).values()), _nices(ckit)


def test_gateway_lease_reverts_and_renewal_keeps_the_split(
    upstream_factory: Callable[[str], FakeUpstream],
    gateway_factory: Callable[..., ThreadedGateway],
    admin_token: str,
) -> None:
    """A leased table stays while renewed and reverts to its fallback once not renewed;
    a renewal of a table that is gone answers 409."""
    stable_up, canary_up = upstream_factory("stable"), upstream_factory("canary")
    stable = Route(release_id="s", base_url=stable_up.url)
    canary = Route(release_id="c", base_url=canary_up.url)
    gw = gateway_factory(routes=[stable])
    with GatewayClient(gw.url, admin_token=admin_token) as c:
        table = RouteTable(routes=[stable, canary], lease_s=0.6, fallback=[stable])
        gen = c.set_routes(table).generation
        for _ in range(4):
            time.sleep(0.2)
            c.renew_lease(gen)
        assert len(c.state().routes) == 2
        end = time.monotonic() + 10
        while len(c.state().routes) == 2 and time.monotonic() < end:
            time.sleep(0.05)
        st = c.state()
        assert [r.release_id for r in st.routes] == ["s"] and st.lease_left_s is None
        assert st.lease_expiries == 1
        with pytest.raises(GatewayRequestError) as e:
            c.renew_lease(gen)
        assert e.value.status == 409
    r = webclient.get(f"{gw.url}/metrics", timeout=10)
    assert 'releasekit_gateway_lease_expiries_total{env="test"} 1.0' in r.text
