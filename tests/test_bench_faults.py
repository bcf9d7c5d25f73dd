"""The load generator against a small local OpenAI-compatible server that misbehaves on
purpose: HTTP 500s, streams that stall or break, error events, a missing /metrics, a wrong
model, a closed port. The fake also exposes real Prometheus metrics (prometheus_client), so
server deltas and the client/server token agreement are checked end to end."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import ClassVar

import pytest
import uvicorn
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send
from typer.testing import CliRunner

from releasekit.bench import BenchResult, load_bench, run_bench, write_outputs
from releasekit.cli import app
from releasekit.errors import BenchError, ServerUnreachableError
from releasekit.spec.loadprofile import SLO, LengthDist, LoadProfile, Sweep

Behaviour = Callable[[int], str]


def always_ok(n: int) -> str:
    return "ok"


class FakeVLLM:
    """A tiny vLLM look-alike. `behaviour(n)` picks what the n-th generation request (from 0)
    gets: ok, 500, stall, close (drop the connection mid-stream), error_event, no_done."""

    def __init__(
        self,
        behaviour: Behaviour = always_ok,
        *,
        model: str = "fake",
        token_delay_s: float = 0.002,
        metrics: bool = True,
        api_key: str | None = None,
    ) -> None:
        self.behaviour = behaviour
        self.model = model
        self.token_delay_s = token_delay_s
        self.metrics = metrics
        self.api_key = api_key
        self.requests = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.arrivals: list[float] = []
        self.bodies: list[dict[str, object]] = []
        reg = self.registry = CollectorRegistry()
        self.gen_tokens = Counter("vllm:generation_tokens", "gen", ["model_name"], registry=reg)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "prompt", ["model_name"], registry=reg)
        Counter("vllm:num_preemptions", "pre", ["model_name"], registry=reg).labels(model).inc(0)
        self.success = Counter(
            "vllm:request_success", "ok", ["model_name", "finished_reason"], registry=reg
        )
        self.running = Gauge("vllm:num_requests_running", "r", ["model_name"], registry=reg)
        Gauge("vllm:num_requests_waiting", "w", ["model_name"], registry=reg).labels(model).set(0)
        self.kv = Gauge("vllm:kv_cache_usage_perc", "kv", ["model_name"], registry=reg)
        buckets = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)
        self.hist = {
            name: Histogram(name, name, ["model_name"], buckets=buckets, registry=reg)
            for name in (
                "vllm:time_to_first_token_seconds",
                "vllm:inter_token_latency_seconds",
                "vllm:e2e_request_latency_seconds",
                "vllm:request_queue_time_seconds",
                "vllm:request_prefill_time_seconds",
                "vllm:request_decode_time_seconds",
            )
        }
        self.app = Starlette(
            middleware=[Middleware(_KeyCheck, fake=self)],
            routes=[
                Route("/health", self._health),
                Route("/v1/models", self._models),
                Route("/metrics", self._metrics),
                Route("/tokenize", self._tokenize, methods=["POST"]),
                Route("/v1/completions", self._generate, methods=["POST"]),
                Route("/v1/chat/completions", self._generate, methods=["POST"]),
            ],
        )
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(
            uvicorn.Config(
                self.app,
                log_level="critical",
                lifespan="off",
                timeout_graceful_shutdown=1,
                access_log=False,
            )
        )
        self.thread = threading.Thread(target=self.server.run, args=([self.sock],), daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FakeVLLM:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()

    async def _health(self, request: Request) -> Response:
        return PlainTextResponse("")

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"data": [{"id": self.model, "object": "model"}]})

    async def _metrics(self, request: Request) -> Response:
        if not self.metrics:
            return PlainTextResponse("not found", status_code=404)
        return PlainTextResponse(generate_latest(self.registry).decode())

    async def _tokenize(self, request: Request) -> Response:
        body = await request.json()
        # Two tokens a word, so calibration has something to do.
        return JSONResponse({"count": 2 * len(str(body["prompt"]).split())})

    async def _fail_all(self, request: Request) -> Response:
        return JSONResponse({"error": {"message": "broken release"}}, status_code=500)

    async def _generate(self, request: Request) -> Response:
        body = await request.json()
        n = self.requests
        self.requests += 1
        self.arrivals.append(time.perf_counter())
        self.bodies.append(body)
        what = self.behaviour(n)
        if what == "500":
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        chat = "messages" in body
        max_tokens = int(body["max_tokens"])
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        p_tokens = 2 * len(str(prompt).split())
        return StreamingResponse(
            self._stream(what, chat, max_tokens, p_tokens), media_type="text/event-stream"
        )

    async def _stream(
        self, what: str, chat: bool, max_tokens: int, p_tokens: int
    ) -> AsyncIterator[bytes]:
        m = self.model
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.running.labels(m).set(self.in_flight)
        self.kv.labels(m).set(min(1.0, self.in_flight / 10))
        start = time.perf_counter()
        try:
            self.prompt_tokens.labels(m).inc(p_tokens)
            self.hist["vllm:request_queue_time_seconds"].labels(m).observe(0.002)
            self.hist["vllm:request_prefill_time_seconds"].labels(m).observe(0.004)
            if chat:
                yield _sse(
                    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
                )
            for i in range(max_tokens):
                await asyncio.sleep(self.token_delay_s)
                if what == "stall" and i == 2:
                    await asyncio.sleep(3600)
                if what == "close" and i == 2:
                    raise RuntimeError("connection dropped on purpose")
                if what == "error_event" and i == 2:
                    yield _sse({"error": {"message": "engine died", "code": 500}})
                    yield b"data: [DONE]\n\n"
                    return
                self.gen_tokens.labels(m).inc()
                if i == 0:
                    self.hist["vllm:time_to_first_token_seconds"].labels(m).observe(
                        time.perf_counter() - start
                    )
                else:
                    self.hist["vllm:inter_token_latency_seconds"].labels(m).observe(
                        self.token_delay_s
                    )
                choice: dict[str, object] = (
                    {"index": 0, "delta": {"content": f" t{i}"}}
                    if chat
                    else {"index": 0, "text": f" t{i}"}
                )
                if i == max_tokens - 1:
                    choice["finish_reason"] = "length"
                yield _sse({"choices": [choice], "usage": None})
            self.success.labels(m, "length").inc()
            e2e = time.perf_counter() - start
            self.hist["vllm:e2e_request_latency_seconds"].labels(m).observe(e2e)
            self.hist["vllm:request_decode_time_seconds"].labels(m).observe(e2e)
            usage = {"prompt_tokens": p_tokens, "completion_tokens": max_tokens}
            if what == "no_usage":
                yield b"data: [DONE]\n\n"
                return
            yield _sse({"choices": [], "usage": usage})
            if what != "no_done":
                yield b"data: [DONE]\n\n"
        finally:
            self.in_flight -= 1
            self.running.labels(m).set(self.in_flight)


class _KeyCheck:
    """ASGI middleware: like vLLM's --api-key, /v1 needs the bearer token."""

    def __init__(self, app: ASGIApp, fake: FakeVLLM) -> None:
        self.app = app
        self.fake = fake

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = self.fake.api_key
        if key and scope["type"] == "http" and scope["path"].startswith("/v1"):
            headers = dict(scope["headers"])
            if headers.get(b"authorization") != f"Bearer {key}".encode():
                await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _sse(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def profile(
    *,
    points: list[float] | None = None,
    mode: str = "concurrency",
    requests: int | None = 8,
    duration_s: float | None = None,
    warmup: int = 0,
    timeout_s: float = 5.0,
    output_tokens: int = 6,
    api: str = "completions",
    slo: SLO | None = None,
) -> LoadProfile:
    return LoadProfile(
        name="test-load",
        seed=3,
        api=api,  # type: ignore[arg-type]
        prompt_tokens=LengthDist(dist="uniform", min=8, max=16),
        output_tokens=LengthDist(dist="fixed", value=output_tokens),
        warmup_requests=warmup,
        request_timeout_s=timeout_s,
        sweep=Sweep(
            mode=mode,  # type: ignore[arg-type]
            points=points or [1, 4],
            requests_per_point=requests,
            duration_s=duration_s,
        ),
        slo=slo or SLO(ttft_s=1.0, attainment=0.9, max_error_rate=0.01),
    )


@pytest.fixture
def fake() -> Iterator[FakeVLLM]:
    with FakeVLLM() as f:
        yield f


# --- a well-behaved fake: the mechanics -------------------------------------------------


def test_client_and_server_token_counts_agree_and_warmup_is_excluded(fake: FakeVLLM) -> None:
    """Server deltas cover exactly the point's requests: warm-up happens before the first
    scrape, so the client/server ratio is 1 and the per-point counters match."""
    result = run_bench(fake.base_url, "fake", profile(warmup=3), gauge_interval_s=0.01)
    assert fake.requests == 3 + 8 + 8
    assert result.warmup_requests == 3 and result.warmup_ok == 3
    assert [r.warmup for r in result.requests].count(True) == 3
    for p in result.points:
        assert p.n == 8 and p.ok == 8
        assert p.output_tokens == 8 * 6
        assert p.server is not None
        assert p.server.generation_tokens == 8 * 6
        assert p.server.requests_succeeded == 8
        assert p.server.requests_by_reason == {"length": 8}
        assert p.token_rate_ratio == pytest.approx(1.0)
        assert p.server.histograms["e2e"].count == 8
        assert p.server.queue_time_mean_s == pytest.approx(0.002)
        assert p.server.prefill_time_mean_s == pytest.approx(0.004)
        assert p.server.missing == []
    # Gauges sampled during the 4-way point saw 4 requests running.
    four = result.points[1].server
    assert four is not None and four.running_peak == 4


def test_closed_loop_keeps_exactly_the_requested_concurrency(fake: FakeVLLM) -> None:
    fake.token_delay_s = 0.01
    run_bench(fake.base_url, "fake", profile(points=[3], requests=12))
    assert fake.max_in_flight == 3


def test_duration_bound_point_stops_issuing_after_the_duration(fake: FakeVLLM) -> None:
    fake.token_delay_s = 0.01
    result = run_bench(fake.base_url, "fake", profile(points=[2], requests=None, duration_s=0.6))
    p = result.points[0]
    # Each request takes about 60 ms: about 10 per worker in 0.6 s, none after the end.
    assert 6 <= p.n <= 30
    assert p.duration_s < 0.6 + 0.5


def test_open_loop_poisson_arrivals_follow_the_rate(fake: FakeVLLM) -> None:
    result = run_bench(fake.base_url, "fake", profile(mode="rate", points=[40.0], requests=60))
    p = result.points[0]
    assert p.n == 60 and p.ok == 60
    gaps = [b - a for a, b in zip(fake.arrivals, fake.arrivals[1:], strict=False)]
    mean_gap = sum(gaps) / len(gaps)
    assert 1 / 40 * 0.6 < mean_gap < 1 / 40 * 1.6
    # Open loop: arrivals are scheduled, not paced by answers.
    assert all(r.scheduled_s is not None for r in result.requests)


def test_requests_carry_the_streaming_contract(fake: FakeVLLM) -> None:
    run_bench(fake.base_url, "fake", profile(points=[1], requests=2))
    body = fake.bodies[0]
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["temperature"] == 0.0
    assert body["max_tokens"] == 6 and body["model"] == "fake"
    # Prompt lengths are calibrated: the fake counts 2 tokens a word, the profile asks 8..16.
    words = len(str(body["prompt"]).split())
    assert 4 <= words <= 8


def test_chat_api_counts_content_not_the_role_chunk(fake: FakeVLLM) -> None:
    result = run_bench(fake.base_url, "fake", profile(points=[2], api="chat"))
    assert "messages" in fake.bodies[0]
    rec = result.requests[0]
    assert rec.status == "ok" and len(rec.chunk_s) == 6 and rec.output_tokens == 6


def test_without_usage_tokens_are_counted_from_chunks() -> None:
    with FakeVLLM(lambda n: "no_usage") as f:
        result = run_bench(f.base_url, "fake", profile(points=[1], requests=2))
    rec = result.requests[0]
    assert rec.status == "ok" and rec.tokens_from == "chunks" and rec.output_tokens == 6


def test_outputs_written_and_read_back(fake: FakeVLLM, tmp_path: Path) -> None:
    result = run_bench(fake.base_url, "fake", profile(), release_id="abc" * 20, profile_digest="d")
    write_outputs(result, tmp_path)
    data = json.loads((tmp_path / "bench.json").read_text())
    point = data["points"][0]
    for key in (
        "load", "mode", "n", "ok", "errors", "timeouts", "duration_s", "request_throughput",
        "output_token_throughput", "server_generation_tokens_per_s", "goodput",
        "slo_attainment", "slo_ok", "ttft", "tpot", "itl", "e2e", "server",
    ):  # fmt: skip
        assert key in point, key
    assert set(point["ttft"]) >= {"p50", "p90", "p95", "p99", "mean"}
    assert data["release_id"] == "abc" * 20 and data["profile_digest"] == "d"
    assert "requests" not in data
    assert data["knee"]["load"] == 4
    png = (tmp_path / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    assert width > 800 and height > 400
    lines = (tmp_path / "requests.jsonl").read_text().splitlines()
    assert len(lines) == 16
    back = load_bench(tmp_path)
    assert isinstance(back, BenchResult)
    assert back.knee == result.knee and len(back.requests) == 16


# --- faults -------------------------------------------------------------------------------


def test_http_500_counts_as_error_and_breaks_the_slo() -> None:
    with FakeVLLM(lambda n: "500" if n % 4 == 3 else "ok") as f:
        result = run_bench(f.base_url, "fake", profile(points=[2], requests=16))
    p = result.points[0]
    assert (p.n, p.ok, p.errors, p.timeouts) == (16, 12, 4, 0)
    assert p.error_rate == pytest.approx(0.25)
    assert p.slo_ok is False and result.knee is None
    assert any(k.startswith("HTTP 500") for k in p.top_errors)
    # Throughput counts completed requests only.
    assert p.output_tokens == 12 * 6
    bad = [r for r in result.requests if r.status == "error"]
    assert all(r.http_status == 500 for r in bad)


def test_a_stalled_stream_times_out_without_holding_up_the_point() -> None:
    with FakeVLLM(lambda n: "stall" if n % 2 == 1 else "ok") as f:
        start = time.perf_counter()
        result = run_bench(f.base_url, "fake", profile(points=[4], requests=8, timeout_s=0.5))
        took = time.perf_counter() - start
    p = result.points[0]
    assert (p.ok, p.timeouts, p.errors) == (4, 4, 0)
    assert p.timeout_rate == pytest.approx(0.5)
    assert took < 5
    stalled = [r for r in result.requests if r.status == "timeout"]
    # The chunks that did arrive before the stall are kept in the raw record.
    assert all(len(r.chunk_s) == 2 for r in stalled)


def test_a_dropped_connection_mid_stream_is_an_error() -> None:
    with FakeVLLM(lambda n: "close" if n == 1 else "ok") as f:
        result = run_bench(f.base_url, "fake", profile(points=[1], requests=4))
    p = result.points[0]
    assert (p.ok, p.errors) == (3, 1)
    bad = next(r for r in result.requests if r.status == "error")
    assert bad.error is not None and "Protocol" in bad.error
    assert len(bad.chunk_s) == 2


def test_an_error_event_in_the_stream_is_an_error() -> None:
    with FakeVLLM(lambda n: "error_event" if n == 0 else "ok") as f:
        result = run_bench(f.base_url, "fake", profile(points=[1], requests=3))
    bad = result.requests[0]
    assert bad.status == "error" and "engine died" in (bad.error or "")


def test_a_stream_that_ends_without_done_is_an_error() -> None:
    with FakeVLLM(lambda n: "no_done" if n == 0 else "ok") as f:
        result = run_bench(f.base_url, "fake", profile(points=[1], requests=3))
    assert result.requests[0].status == "error"
    assert result.requests[0].error == "stream ended before [DONE]"


def test_every_request_failing_raises_bench_error() -> None:
    with (
        FakeVLLM(lambda n: "500") as f,
        pytest.raises(BenchError, match=r"no request of the sweep completed.*HTTP 500"),
    ):
        run_bench(f.base_url, "fake", profile(points=[1], requests=3))


def test_a_closed_port_raises_server_unreachable() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(ServerUnreachableError, match="cannot reach"):
        run_bench(f"http://127.0.0.1:{port}", "fake", profile())


def test_a_model_the_server_does_not_serve_is_named(fake: FakeVLLM) -> None:
    with pytest.raises(BenchError, match=r"does not serve model 'other'.*fake"):
        run_bench(fake.base_url, "other", profile())


def test_an_api_key_is_sent_as_a_bearer_token() -> None:
    with FakeVLLM(api_key="s3cret") as f:
        result = run_bench(f.base_url, "fake", profile(points=[1], requests=2), api_key="s3cret")
        assert result.points[0].ok == 2
        with pytest.raises(BenchError, match="wants an API key"):
            run_bench(f.base_url, "fake", profile(points=[1], requests=2))


def test_a_server_without_metrics_still_benches_without_deltas() -> None:
    with FakeVLLM(metrics=False) as f:
        result = run_bench(f.base_url, "fake", profile(points=[1], requests=2))
    p = result.points[0]
    assert p.ok == 2 and p.server is None and p.server_generation_tokens_per_s is None


def test_a_timed_out_warmup_is_excluded_from_the_point_stats() -> None:
    with FakeVLLM(lambda n: "stall" if n == 0 else "ok") as f:
        result = run_bench(f.base_url, "fake", profile(points=[1], warmup=2, timeout_s=0.3))
    assert result.warmup_ok == 1
    assert result.points[0].timeouts == 0 and result.points[0].ok == 8


# --- CLI ----------------------------------------------------------------------------------


def test_cli_bench_url_mode_prints_rates_and_knee(fake: FakeVLLM, tmp_path: Path) -> None:
    prof = tmp_path / "load.yaml"
    prof.write_text(profile().model_dump_json())  # JSON is YAML
    out = tmp_path / "bench"
    res = CliRunner().invoke(
        app,
        [
            "bench",
            "--url",
            fake.base_url,
            "--model",
            "fake",
            "--profile",
            str(prof),
            "--out",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    assert "client output tok/s" in res.output and "server generation tok/s" in res.output
    assert "client / server ratio" in res.output
    assert "knee: concurrency 4" in res.output
    assert (out / "bench.json").is_file() and (out / "bench.png").is_file()


def test_cli_bench_json_prints_the_result(fake: FakeVLLM, tmp_path: Path) -> None:
    prof = tmp_path / "load.yaml"
    prof.write_text(profile(points=[2]).model_dump_json())
    res = CliRunner().invoke(
        app, ["bench", "--url", fake.base_url, "--model", "fake", "--profile", str(prof), "--json"]
    )
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["knee"]["load"] == 2 and data["points"][0]["ok"] == 8


def test_cli_bench_needs_a_manifest_or_a_url() -> None:
    res = CliRunner().invoke(app, ["bench", "--url", "http://127.0.0.1:1"])
    assert res.exit_code == 1
    assert "give either MANIFEST, or --url, --model and --profile" in res.output


def test_cli_bench_unreachable_url_is_one_red_line(tmp_path: Path) -> None:
    prof = tmp_path / "load.yaml"
    prof.write_text(profile().model_dump_json())
    res = CliRunner().invoke(
        app, ["bench", "--url", "http://127.0.0.1:9", "--model", "m", "--profile", str(prof)]
    )
    assert res.exit_code == 1
    assert "error: cannot reach http://127.0.0.1:9" in res.output
    assert "Traceback" not in res.output


# --- manifest mode: lock, serve the release, bench, stop ------------------------------------


class FakeReleaseServer:
    """Stands in for releasekit.server.VLLMServer: records how it was asked to serve and
    answers with a FakeVLLM."""

    instances: ClassVar[list[FakeReleaseServer]] = []

    def __init__(self, model_dir: Path, **kw: object) -> None:
        self.model_dir = model_dir
        self.kw = kw
        self.fake = FakeVLLM(model=str(kw["served_name"]))
        self.running = False
        FakeReleaseServer.instances.append(self)

    @property
    def base_url(self) -> str:
        return self.fake.base_url

    def __enter__(self) -> FakeReleaseServer:
        self.fake.__enter__()
        self.running = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.fake.__exit__()
        self.running = False

    def check_alive(self) -> None:
        assert self.running


@pytest.fixture
def release_project(project: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The project copy with a stand-in model folder, a small load profile, settings rooted
    in it, and VLLMServer replaced by the fake."""
    model = project / "models" / "demo-base"
    if model.is_symlink():
        model.unlink()
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (model / "model.safetensors").write_bytes(b"weights")
    (project / "pipelines" / "load" / "demo.yaml").write_text(
        profile(points=[1, 2], requests=4, warmup=1).model_dump_json()
    )
    for key in [k for k in os.environ if k.startswith("RELEASEKIT_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("RELEASEKIT_ROOT", str(project))
    monkeypatch.setenv("RELEASEKIT_CONFIG", str(project / "releasekit.toml"))
    monkeypatch.chdir(project)
    monkeypatch.setattr("releasekit.serving.vllm.VLLMServer", FakeReleaseServer)
    FakeReleaseServer.instances.clear()
    return project


def test_cli_bench_manifest_serves_the_release_with_its_exact_args(release_project: Path) -> None:
    from releasekit.spec.lock import read_lock

    manifest = release_project / "manifests" / "demo-bf16.yaml"
    res = CliRunner().invoke(app, ["bench", str(manifest), "--port", "8439"])
    assert res.exit_code == 0, res.output
    lk = read_lock(release_project / "manifests" / "demo-bf16.lock.json")
    (srv,) = FakeReleaseServer.instances
    assert srv.running is False  # stopped after the run
    assert srv.model_dir == release_project / "models" / "demo-base"
    assert srv.kw["served_name"] == "demo" and srv.kw["port"] == 8439
    args = srv.kw["engine_args"]
    assert isinstance(args, dict)
    assert args["max-num-seqs"] == "32" and args["dtype"] == "bfloat16"
    assert args["enforce-eager"] == ""
    assert srv.kw["env"] == {"VLLM_CPU_KVCACHE_SPACE": "1"}
    out = release_project / "results" / lk.release_id / "bench"
    data = json.loads((out / "bench.json").read_text())
    assert data["release_id"] == lk.release_id
    assert data["profile_digest"] == lk.inputs["load/profile"]
    assert (out / "bench.png").is_file() and (out / "requests.jsonl").is_file()
    assert "knee: concurrency 2" in res.output


def test_cli_bench_manifest_serves_the_built_quantised_model(release_project: Path) -> None:
    from releasekit.spec.lock import lock

    manifest = release_project / "manifests" / "demo-w8a8.yaml"
    built = release_project / "results" / lock(manifest).release_id / "model"
    built.mkdir(parents=True)
    out = release_project / "elsewhere"
    res = CliRunner().invoke(app, ["bench", str(manifest), "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    assert FakeReleaseServer.instances[0].model_dir == built
    assert json.loads(res.stdout)["knee"]["load"] == 2
    assert (out / "bench.json").is_file()


def test_cli_bench_manifest_refuses_an_unbuilt_quantised_release(release_project: Path) -> None:
    """Benching a W8A8 release before its build must not silently bench the bf16 weights."""
    res = CliRunner().invoke(app, ["bench", str(release_project / "manifests" / "demo-w8a8.yaml")])
    assert res.exit_code == 1
    assert "not built" in res.output and "releasekit build" in res.output
    assert FakeReleaseServer.instances == []


def test_cli_bench_manifest_stops_the_server_when_the_bench_fails(
    release_project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(FakeVLLM, "_generate", FakeVLLM._fail_all, raising=True)
    res = CliRunner().invoke(app, ["bench", str(release_project / "manifests" / "demo-bf16.yaml")])
    assert res.exit_code == 1
    assert "no request of the sweep completed" in res.output
    assert FakeReleaseServer.instances[0].running is False
