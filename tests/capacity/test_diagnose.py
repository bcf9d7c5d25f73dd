"""`releasekit diagnose`: synthetic windows from real prometheus_client exposition (the
simulated vLLM + gateway of tests/watch/watchkit.py) through the real windowing, judged against
a bench knee the real bench code computed from synthetic request records (capacity/conftest.py)
and a real ledger; and the command through CliRunner against a local
server that serves fixed exposition text, a different text for each scrape."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route
from typer.testing import CliRunner

from releasekit._support.http import http_client
from releasekit.bench.runner import BenchResult, write_evidence
from releasekit.capacity.diagnose import (
    Baseline,
    Diagnosis,
    LiveTargets,
    LiveWindow,
    baseline_from_bench,
    diagnose,
    diagnose_window,
)
from releasekit.cli import diagnose_cmds
from releasekit.cli._common import State
from releasekit.cli.diagnose_cmds import _snapshot, live_window
from releasekit.config import Settings
from releasekit.stores.ledger import Event, EventType, Ledger
from releasekit.watch.windows import Snapshot, parse_exposition

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS / "watch"))
sys.path.insert(0, str(TESTS / "deploy"))
from gateway_fakes import admin_token, gateway_factory, upstream_factory  # noqa: E402
from watchkit import AppServer, Sim  # noqa: E402

from releasekit.deploy.gateway import Route as GatewayRoute  # noqa: E402
from releasekit.deploy.gateway import ThreadedGateway  # noqa: E402

__all__ = ["admin_token", "gateway_factory", "upstream_factory"]  # fixtures used below

# The release fixtures (a locked project with build outputs), under a name of their own.
_spec = importlib.util.spec_from_file_location(
    "releases_fixtures", TESTS / "releases" / "conftest.py"
)
assert _spec is not None and _spec.loader is not None
_releases = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _releases
_spec.loader.exec_module(_releases)
proj = _releases.proj

runner = CliRunner()

#: The knee's server-side segment means added to capacity's known sweep (knee c=16,
#: TTFT 0.3 s, E2E 1.0 s, ITL about 14.9 ms from its request records).
KNEE_QUEUE_S = 0.02
KNEE_PREFILL_S = 0.25
KNEE_DECODE_S = 0.7


# --------------------------------------------------------------------------- helpers


@pytest.fixture
def sim() -> Sim:
    """A fresh simulated vLLM + gateway (env prod, release r1)."""
    return Sim()


@pytest.fixture
def knee_bench(bench_factory: Callable[..., BenchResult]) -> BenchResult:
    """capacity's known sweep with the queue/prefill/decode means vLLM's histograms give at
    its knee."""
    bench = bench_factory()
    assert bench.knee is not None and bench.knee.server is not None
    s = bench.knee.server
    s.queue_time_mean_s = KNEE_QUEUE_S
    s.prefill_time_mean_s = KNEE_PREFILL_S
    s.decode_time_mean_s = KNEE_DECODE_S
    s.kv_cache_usage_peak = 0.6
    s.preemptions = 0.0
    return bench


@pytest.fixture
def base(knee_bench: BenchResult) -> Baseline:
    """The knee as diagnose's healthy reference."""
    b = baseline_from_bench(knee_bench)
    assert b is not None
    return b


def record(
    sim: Sim,
    n: int,
    *,
    queue: float = 0.005,
    prefill: float = 0.04,
    intake: float = 0.0,
    itl: float = 0.012,
    tokens: int = 48,
    chunks: int | None = None,
    edge_extra: float = 0.003,
    gw_queue: float = 0.0005,
    status: str = "200",
    reason: str = "stop",
) -> None:
    """`n` finished requests in both the engine's and the gateway's metrics: engine TTFT =
    intake (the API server's share) + queue + prefill, decode = ITL x (tokens - 1); the
    edge's first token `edge_extra` after the engine's plus the gateway's own queue;
    `chunks` SSE chunks relayed per request (default: one per token plus the usage and
    [DONE] events)."""
    ttft = intake + queue + prefill
    decode = itl * (tokens - 1)
    e2e = ttft + decode
    relayed = tokens + 2 if chunks is None else chunks
    v = (sim.model, "0")
    rel, env = sim.release, sim.env
    with sim.lock:
        for _ in range(n):
            sim.v_ttft.labels(*v).observe(ttft)
            for _ in range(tokens - 1):
                sim.v_itl.labels(*v).observe(itl)
            sim.v_e2e.labels(*v).observe(e2e)
            sim.v_queue.labels(*v).observe(queue)
            sim.v_prefill.labels(*v).observe(prefill)
            sim.v_decode.labels(*v).observe(decode)
            sim.v_success.labels(*v, reason).inc()
            sim.v_prompt.labels(*v).inc(32)
            sim.v_gen.labels(*v).inc(tokens)
            sim.g_requests.labels(env, rel, "/v1/completions", status).inc()
            sim.g_ttft.labels(env, rel).observe(ttft + edge_extra + gw_queue)
            sim.g_e2e.labels(env, rel).observe(e2e + edge_extra + gw_queue)
            sim.g_upstream.labels(env, rel).observe(0.001 + gw_queue)
            sim.g_queue.labels(env).observe(gw_queue)
            sim.g_chunks.labels(env, rel).inc(relayed)


def gauges(sim: Sim, *, waiting: float = 0, running: float = 4, kv: float = 0.3) -> None:
    """Set the engine's gauges."""
    v = (sim.model, "0")
    sim.v_waiting.labels(*v).set(waiting)
    sim.v_running.labels(*v).set(running)
    sim.v_kv.labels(*v).set(kv)


def snap(sim: Sim, t: float) -> Snapshot:
    """Both expositions, parsed, as a watch Snapshot taken at `t`."""
    return Snapshot(
        t=t, vllm=parse_exposition(sim.text("vllm")), gateway=parse_exposition(sim.text("gateway"))
    )


def observe(
    sim: Sim, during: Callable[[Sim], None], *, window_s: float = 30.0, release: str | None = None
) -> LiveWindow:
    """Snapshot, let `during` happen, snapshot again: the LiveWindow the CLI builds."""
    record(sim, 5)  # traffic before the window must not count
    before = snap(sim, 0.0)
    during(sim)
    after = snap(sim, window_s)
    rid = release if release is not None else sim.release
    return live_window(before, after, LiveTargets(env=sim.env, release_id=rid))


def judge(w: LiveWindow, base: Baseline | None, **kw: Any) -> Diagnosis:
    return diagnose_window(w, env="prod", release_id="r1", baseline=base, **kw)


def kinds(d: Diagnosis) -> list[str]:
    return [f.kind for f in d.findings]


def ev(d: Diagnosis, kind: str, metric: str) -> float | None:
    f = next(f for f in d.findings if f.kind == kind)
    return next(e.value for e in f.evidence if e.metric == metric)


# --------------------------------------------------------------------------- the judgement


def test_healthy_window_reports_nothing_alarming(sim: Sim, base: Baseline) -> None:
    """Traffic well inside the knee's figures: verdict healthy, no finding, one line with
    the key figures."""
    w = observe(sim, lambda s: (record(s, 60), gauges(s, running=4, kv=0.3)))
    d = judge(w, base)
    assert d.verdict == "healthy" and d.findings == [] and d.classification == "none"
    assert d.summary.startswith("healthy: 60 requests (2.00 req/s)")
    assert "TTFT p95" in d.summary and "knee" in d.summary and "errors 0.0%" in d.summary
    assert not any(s.grew for s in d.segments)


def test_overloaded_names_queueing_first_with_the_numbers(sim: Sim, base: Baseline) -> None:
    """Many waiting and queue time dominant: queueing is the first finding, critical, with
    the queue mean, the waiting count and the TTFT against the knee's, and points to
    `releasekit capacity`."""

    def overload(s: Sim) -> None:
        record(s, 60, queue=3.0, prefill=0.1)
        gauges(s, waiting=40, running=16, kv=0.7)

    d = judge(observe(sim, overload, window_s=3.0), base)
    assert d.verdict == "problems" and d.classification == "performance"
    top = d.findings[0]
    assert top.kind == "queueing" and top.severity == "critical"
    assert "traffic 20.00 req/s over the knee's" in top.title
    assert ev(d, "queueing", "queue_mean_s") == pytest.approx(3.0)
    assert ev(d, "queueing", "waiting_requests_max") == 40
    qe = next(e for e in top.evidence if e.metric == "queue_mean_s")
    assert qe.source == "vllm" and qe.baseline == pytest.approx(KNEE_QUEUE_S)
    assert "3.00 s" in top.title and "40 waiting" in top.title
    assert any(c.startswith("releasekit capacity r1") for c in top.commands)
    assert d.summary.startswith("performance problem: queueing")
    (queue,) = [s for s in d.segments if s.name == "queue"]
    assert queue.grew and queue.share is not None and queue.share > 0.7
    assert [s.name for s in d.segments if s.grew] == ["queue"]


def test_queueing_without_a_bench_uses_the_absolute_line(sim: Sim) -> None:
    """No bench: the same overload is still queueing, judged on the stated absolute line."""

    def overload(s: Sim) -> None:
        record(s, 60, queue=3.0, prefill=0.1)
        gauges(s, waiting=40, running=16)

    d = judge(observe(sim, overload), None)
    assert kinds(d)[0] == "queueing"
    assert "absolute" in d.findings[0].threshold
    assert any("absolute thresholds" in n for n in d.notes)


def test_preemptions_and_a_full_kv_cache_are_memory_pressure(sim: Sim, base: Baseline) -> None:
    """Preemptions per second above zero with the KV cache 97% full: memory pressure,
    critical, remedy lower max-num-seqs or quantise the KV cache."""

    def pressure(s: Sim) -> None:
        record(s, 40)
        s.v_preempt.labels(s.model, "0").inc(45)
        gauges(s, running=30, kv=0.97)

    d = judge(observe(sim, pressure), base)
    top = d.findings[0]
    assert top.kind == "memory_pressure" and top.severity == "critical"
    assert ev(d, "memory_pressure", "preemptions_per_s") == pytest.approx(1.5)
    assert ev(d, "memory_pressure", "kv_cache_usage") == pytest.approx(0.97)
    assert "max-num-seqs" in top.remedy and "KV cache" in top.remedy


def test_tokens_in_bursts_are_streaming_stutters(sim: Sim, base: Baseline) -> None:
    """6 SSE chunks for 48 output tokens: streaming stutters, with chunks per token."""
    d = judge(observe(sim, lambda s: record(s, 40, chunks=6)), base)
    assert kinds(d) == ["streaming_stutter"]
    assert ev(d, "streaming_stutter", "chunks_per_token") == pytest.approx(6 / 48)
    assert "batch chunk forwarding" in d.findings[0].remedy


def test_first_token_late_at_the_edge_is_streaming_stutters(sim: Sim, base: Baseline) -> None:
    """The edge's first token 0.9 s after the engine's, the gateway's queue empty: the
    gateway segment grew and the finding says so with both TTFTs."""
    d = judge(observe(sim, lambda s: record(s, 40, edge_extra=0.9)), base)
    assert kinds(d) == ["streaming_stutter"]
    gap = ev(d, "streaming_stutter", "edge_minus_engine_ttft_s")
    assert gap == pytest.approx(0.9 + 0.0005, abs=1e-6)
    assert [s.name for s in d.segments if s.grew] == ["gateway"]


def test_waiting_at_the_gateway_is_not_a_stutter(sim: Sim, base: Baseline) -> None:
    """Time spent in the gateway's admission queue is named as such, not as stutters."""
    d = judge(observe(sim, lambda s: record(s, 40, gw_queue=0.4)), base)
    assert kinds(d) == ["gateway_queue"]
    assert "max_in_flight" in d.findings[0].remedy


def test_a_slow_front_end_is_told_apart_from_queueing(sim: Sim, base: Baseline) -> None:
    """Engine TTFT 1.2 s above queue + prefill (the API server hands requests over late):
    the intake segment grew, not the queue, and the remedy is about the front end."""
    d = judge(observe(sim, lambda s: record(s, 40, intake=1.2)), base)
    assert kinds(d) == ["slow_intake"]
    assert ev(d, "slow_intake", "intake_mean_s") == pytest.approx(1.2, abs=1e-6)
    assert "--api-server-count" in d.findings[0].remedy
    assert [s.name for s in d.segments if s.grew] == ["intake"]


def test_slow_decode_against_the_knees_inter_token_latency(sim: Sim, base: Baseline) -> None:
    """ITL 80 ms against the knee's ~15 ms: slow decode, with the seconds it adds."""
    d = judge(observe(sim, lambda s: record(s, 40, itl=0.08)), base)
    assert kinds(d) == ["slow_decode"]
    f = d.findings[0]
    assert ev(d, "slow_decode", "itl_mean_s") == pytest.approx(0.08)
    assert base.itl_mean_s is not None
    assert f.added_s == pytest.approx((0.08 - base.itl_mean_s) * 48)
    assert any("--roofline" in c for c in f.commands)


def test_longer_answers_than_the_benchmark_are_named_not_blamed_on_a_segment(
    sim: Sim, base: Baseline
) -> None:
    """400-token answers at the knee's per-token speed: E2E far above the knee's, yet no
    segment grew; the finding says the traffic is heavier than the load profile."""
    d = judge(observe(sim, lambda s: record(s, 20, tokens=400)), base)
    assert kinds(d) == ["latency"]
    assert "no single segment grew" in d.findings[0].title
    assert "load profile" in d.findings[0].remedy
    assert not any(s.grew for s in d.segments)


def test_timeouts_are_a_performance_problem_not_quality(sim: Sim, base: Baseline) -> None:
    """Errors that are mostly gateway timeouts (504) classify as performance."""
    d = judge(observe(sim, lambda s: (record(s, 30), record(s, 10, status="504"))), base)
    assert kinds(d) == ["errors"] and d.classification == "performance"
    assert "time out" in d.findings[0].cause


def test_too_little_traffic_is_not_judged_healthy(sim: Sim, base: Baseline) -> None:
    """3 requests in the window: "not enough traffic to judge", neither healthy nor broken."""
    d = judge(observe(sim, lambda s: record(s, 3, queue=3.0)), base)
    assert d.verdict == "not_enough_traffic" and d.findings == []
    assert d.summary.startswith("not enough traffic to judge: 3 requests")


def test_waiting_with_nothing_finished_is_a_stall(sim: Sim, base: Baseline) -> None:
    """Requests waiting while none finishes: the engine is stalled (judged without traffic)."""
    d = judge(observe(sim, lambda s: gauges(s, waiting=5, running=32)), base)
    assert kinds(d) == ["stalled"] and d.findings[0].severity == "critical"


def test_long_answers_still_generating_are_not_a_stall(sim: Sim, base: Baseline) -> None:
    """Waiting requests and nothing finished, but tokens still come out: not a stall (and
    too little finished traffic to judge the rest)."""

    def long_answers(s: Sim) -> None:
        gauges(s, waiting=5, running=32)
        s.v_gen.labels(s.model, "0").inc(3000)

    d = judge(observe(sim, long_answers), base)
    assert d.findings == [] and d.verdict == "not_enough_traffic"


def test_a_restart_in_the_window_is_not_judged(sim: Sim, base: Baseline) -> None:
    """A server whose counters started over: no verdict on a window that straddles it."""

    def restart(s: Sim) -> None:
        s.restart_vllm()
        record(s, 40)

    d = judge(observe(sim, restart), base)
    assert d.verdict == "not_judged" and "vllm restarted" in d.summary


def test_bench_knee_becomes_the_baseline(knee_bench: BenchResult) -> None:
    """The knee's client and server figures and the profile's SLOs fill the baseline."""
    b = baseline_from_bench(knee_bench)
    assert b is not None
    assert (b.load, b.queue_mean_s, b.server_ttft_mean_s) == (16, KNEE_QUEUE_S, 0.3)
    assert b.slo_ttft_s == 1.0 and b.max_num_seqs == 32
    assert b.ttft_p95_s == pytest.approx(0.3) and b.e2e_mean_s == pytest.approx(1.0)


# --------------------------------------------------------------------------- with a ledger


def _assign(led: Ledger, env: str, to: str, prev: str | None, reason: str) -> None:
    led.append(
        Event(
            type=EventType.ASSIGN,
            environment=env,
            to_release=to,
            from_release=prev,
            reason=reason,
            live=True,
        )
    )


def test_quality_drop_after_a_prompt_change_points_to_it(proj: Any) -> None:
    """A damaged user prompt went live; errors and negative feedback follow: the findings
    are quality, ranked first, and name that change, what it changed (the user prompt) and
    `releasekit diff A B`."""
    a = proj.build("demo-bf16")
    b = proj.build("demo-damaged-prompt")
    with Ledger(proj.settings.ledger_url or "") as led:
        _assign(led, "production", a.release_id, None, "first")
        _assign(led, "production", b.release_id, a.release_id, "tighter prompt")
    sim = Sim(env="production", release=b.release_id)

    def bad(s: Sim) -> None:
        record(s, 40)
        record(s, 10, status="500", reason="error")
        s.feedback("negative", 9)
        s.feedback("positive", 3)

    d = diagnose(proj.settings, "production", observe(sim, bad))
    assert d.release_id == b.release_id
    assert d.classification == "quality"
    assert kinds(d) == ["errors", "negative_feedback"]
    cmd = f"releasekit diff {a.release_id[:12]} {b.release_id[:12]}"
    c = d.last_change
    assert c is not None and c.to_release == b.release_id and c.from_release == a.release_id
    assert c.diff_command == cmd and c.kinds == ["prompts"], c.changed
    assert c.changed == ["prompts changed: user"]
    for f in d.findings:
        assert cmd in f.commands
        assert "prompts changed: user" in f.cause and "assign #" in f.cause
    assert ev(d, "errors", "error_rate") == pytest.approx(10 / 50)
    assert ev(d, "negative_feedback", "negative_feedback_rate") == pytest.approx(0.75)
    # Proj's bench.json is not a strict BenchResult: absolute lines, and a note saying why.
    assert d.baseline is None and any("unreadable bench result" in n for n in d.notes)


def test_live_release_bench_sets_the_lines(
    settings_cap: Settings, knee_bench: BenchResult, release_id: str, sim: Sim
) -> None:
    """With the live release's bench.json on disk (the real writer), diagnose reads its knee:
    the queue line is relative to the knee's queue mean."""
    write_evidence(knee_bench, settings_cap.release_dir(release_id) / "bench")
    with Ledger(settings_cap.ledger_url or "") as led:
        _assign(led, "prod", release_id, None, "first")

    def busy(s: Sim) -> None:
        record(s, 40, queue=0.3, prefill=0.1)
        gauges(s, waiting=3, running=16)

    sim.release = release_id
    d = diagnose(settings_cap, "prod", observe(sim, busy))
    assert d.baseline is not None and d.baseline.queue_mean_s == KNEE_QUEUE_S
    assert kinds(d)[0] == "queueing"
    assert "knee" in d.findings[0].threshold  # relative, not the absolute 0.5 s line
    assert d.last_change is not None and d.last_change.diff_command is None


# --------------------------------------------------------------------------- the command


class FixedMetrics:
    """Serves /vllm/metrics and /gateway/metrics from fixed texts: the n-th scrape of a
    source gets its n-th text (the last one after that); `status` answers an error."""

    def __init__(self, texts: dict[str, list[str]]) -> None:
        self.texts = texts
        self.hits: dict[str, int] = {}
        self.status: dict[str, int] = {}
        self.delay_s = 0.0
        self.app = Starlette(routes=[Route("/{which:str}/metrics", self._metrics)])

    async def _metrics(self, request: Request) -> Response:
        which = request.path_params["which"]
        i = self.hits.get(which, 0)
        self.hits[which] = i + 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.status.get(which):
            return PlainTextResponse("down", status_code=self.status[which])
        texts = self.texts[which]
        return PlainTextResponse(texts[min(i, len(texts) - 1)], media_type="text/plain")


def _texts(sim: Sim, during: Callable[[Sim], None]) -> dict[str, list[str]]:
    record(sim, 5)
    before = {w: sim.text(w) for w in ("vllm", "gateway")}
    during(sim)
    return {w: [before[w], sim.text(w)] for w in ("vllm", "gateway")}


@pytest.fixture
def fixed(sim: Sim) -> Iterator[Callable[[Callable[[Sim], None]], tuple[FixedMetrics, str]]]:
    """`fixed(during)`: a server whose first scrape sees the Sim before `during`, the second
    after; returns (server, base URL)."""
    servers: list[AppServer] = []

    def make(during: Callable[[Sim], None]) -> tuple[FixedMetrics, str]:
        fm = FixedMetrics(_texts(sim, during))
        srv = AppServer(fm.app).__enter__()
        servers.append(srv)
        return fm, srv.url

    yield make
    for s in servers:
        s.__exit__(None, None, None)


def _app() -> typer.Typer:
    app = typer.Typer(pretty_exceptions_enable=False)

    @app.callback()
    def _root() -> None:
        State.reset()

    diagnose_cmds.register(app)
    return app


def _run(*args: str) -> tuple[int, str, str]:
    res = runner.invoke(_app(), list(args))
    return res.exit_code, res.stdout, res.stderr


def test_cli_json_names_queueing_on_an_overloaded_server(
    settings_cap: Settings, fixed: Callable[..., tuple[FixedMetrics, str]]
) -> None:
    """--vllm-url/--gateway-url and a 0.2 s window: two scrapes each, JSON out, queueing
    first with its numbers."""

    def overload(s: Sim) -> None:
        record(s, 60, queue=3.0, prefill=0.1)
        gauges(s, waiting=40, running=16)

    fm, url = fixed(overload)
    code, stdout, stderr = _run(
        "diagnose", "prod", "--window", "0.2", "--json",
        "--vllm-url", f"{url}/vllm", "--gateway-url", f"{url}/gateway/metrics",
    )  # fmt: skip
    assert code == 0, stderr
    d = Diagnosis.model_validate(json.loads(stdout))
    assert fm.hits == {"vllm": 2, "gateway": 2}
    assert d.verdict == "problems" and d.findings[0].kind == "queueing"
    assert d.requests == 60 and d.window_s > 0
    assert any(n.startswith("no ledger") for n in d.notes)


def test_cli_report_says_healthy_in_one_line(
    settings_cap: Settings, fixed: Callable[..., tuple[FixedMetrics, str]]
) -> None:
    """The human report of a healthy window: the verdict line with the key figures."""
    _, url = fixed(lambda s: record(s, 60))
    code, stdout, stderr = _run(
        "diagnose", "prod", "--window", "0.2",
        "--vllm-url", f"{url}/vllm", "--gateway-url", f"{url}/gateway",
    )  # fmt: skip
    assert code == 0, stderr
    assert "prod" in stdout and "healthy: 60 requests" in stdout
    assert "likely cause" not in stdout


def test_cli_report_prints_findings_with_evidence_and_remedy(
    settings_cap: Settings, fixed: Callable[..., tuple[FixedMetrics, str]]
) -> None:
    """A finding in the human report: severity, title, evidence with its source, the line
    crossed, cause, where to look, remedy, the command to run, and the segments table."""

    def overload(s: Sim) -> None:
        record(s, 60, queue=3.0, prefill=0.1)
        gauges(s, waiting=40, running=16)

    _, url = fixed(overload)
    code, stdout, _ = _run(
        "diagnose", "prod", "--window", "0.2",
        "--vllm-url", f"{url}/vllm", "--gateway-url", f"{url}/gateway",
    )  # fmt: skip
    assert code == 0
    assert "1. critical (performance) queueing" in stdout
    assert "queue_mean_s 3 s (vllm)" in stdout
    for word in ("line:", "likely cause:", "look at:", "remedy:", "$ releasekit capacity"):
        assert word in stdout
    assert "latency segments" in stdout


def test_cli_with_only_vllm_still_judges(
    settings_cap: Settings, fixed: Callable[..., tuple[FixedMetrics, str]]
) -> None:
    """A gateway that answers 503: a note, and the engine's figures still judge the window."""

    def overload(s: Sim) -> None:
        record(s, 60, queue=3.0, prefill=0.1)
        gauges(s, waiting=40, running=16)

    fm, url = fixed(overload)
    fm.status["gateway"] = 503
    code, stdout, stderr = _run(
        "diagnose", "prod", "--window", "0.2", "--json",
        "--vllm-url", f"{url}/vllm", "--gateway-url", f"{url}/gateway",
    )  # fmt: skip
    assert code == 0, stderr
    d = Diagnosis.model_validate(json.loads(stdout))
    assert d.findings[0].kind == "queueing" and d.requests == 60
    assert any("gateway scrape failed: HTTP 503" in n for n in d.notes)


def test_cli_errors_are_one_line_with_a_hint(
    settings_cap: Settings, fixed: Callable[..., tuple[FixedMetrics, str]]
) -> None:
    """No server known for the env, both sources down, a non-positive window: exit 1 with
    one red line and a hint, never a traceback."""
    code, _, stderr = _run("diagnose", "prod", "--window", "0.2")
    assert code == 1 and "no server recorded for environment 'prod'" in stderr
    assert "hint:" in stderr and "--vllm-url" in stderr

    fm, url = fixed(lambda s: record(s, 10))
    fm.status.update({"vllm": 500, "gateway": 500})
    code, _, stderr = _run(
        "diagnose", "prod", "--window", "0.2",
        "--vllm-url", f"{url}/vllm", "--gateway-url", f"{url}/gateway",
    )  # fmt: skip
    assert code == 1 and "no metrics for prod" in stderr and "HTTP 500" in stderr

    code, _, stderr = _run("diagnose", "prod", "--window", "0", "--vllm-url", url)
    assert code == 1 and "--window must be above 0" in stderr


def test_a_slow_metrics_endpoint_gets_the_scrape_timeout_it_is_given(
    settings_cap: Settings,
    fixed: Callable[..., tuple[FixedMetrics, str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A vLLM /metrics that takes 0.5 s (a starved API server): --scrape-timeout 0.2 fails in
    one line naming the timeout; the scrape_timeout_s setting is the default and 2 s reads
    it; a non-positive --scrape-timeout is refused."""
    fm, url = fixed(lambda s: record(s, 60))
    fm.delay_s = 0.5
    args = ("diagnose", "prod", "--window", "0.1", "--json", "--vllm-url", f"{url}/vllm")
    code, _, stderr = _run(*args, "--scrape-timeout", "0.2")
    assert code == 1 and "timed out after 0.2 s" in stderr
    monkeypatch.setenv("RELEASEKIT_SCRAPE_TIMEOUT_S", "0.2")
    code, _, stderr = _run(*args)
    assert code == 1 and "timed out after 0.2 s" in stderr
    fm.hits.clear()  # the next two scrapes see before and after again
    code, stdout, stderr = _run(*args, "--scrape-timeout", "2")
    assert code == 0, stderr
    assert Diagnosis.model_validate(json.loads(stdout)).requests == 60
    code, _, stderr = _run(*args, "--scrape-timeout", "0")
    assert code == 1 and "--scrape-timeout must be above 0" in stderr


def test_real_gateway_edge_figures_feed_the_diagnosis(
    sim: Sim,
    fixed: Callable[..., tuple[FixedMetrics, str]],
    upstream_factory: Callable[[str], Any],
    gateway_factory: Callable[..., ThreadedGateway],
) -> None:
    """The real gateway in front of a fake upstream that streams 3 chunks per answer, while
    the engine's metrics count 48 tokens each: the gateway's own series (env and release
    labels) give the requests and the edge TTFT, and the merged tokens read as stutters."""
    up = upstream_factory("a")
    tg = gateway_factory([GatewayRoute(release_id="rel-a", base_url=up.url)])
    _, url = fixed(lambda s: record(s, 12))
    targets = LiveTargets(
        env="test",
        release_id="rel-a",
        vllm_metrics_url=f"{url}/vllm/metrics",
        gateway_metrics_url=f"{tg.url}/metrics",
    )
    before = _snapshot(targets, 5.0)
    body = {"model": "demo", "prompt": "hi", "max_tokens": 48, "stream": True}
    with http_client(base_url=tg.url, timeout=10) as c:
        for _ in range(12):
            with c.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                for _ in r.iter_lines():
                    pass
    after = _snapshot(targets, 5.0)
    w = live_window(before, after, targets)
    assert not w.scrape_errors and w.requests == 12 and w.requests_source == "gateway"
    assert w.gateway["ttft_mean_s"].count == 12 and w.gateway["ttft_mean_s"].source == "gateway"
    d = diagnose_window(w, env="test", release_id="rel-a", baseline=None)
    assert kinds(d) == ["streaming_stutter"]
    cpt = ev(d, "streaming_stutter", "chunks_per_token")
    assert cpt is not None and 0 < cpt < 0.5
