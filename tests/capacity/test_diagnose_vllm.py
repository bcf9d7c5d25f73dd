"""`releasekit diagnose` against the real vLLM CPU server on the demo model (slow): light load
reads as nothing alarming; more concurrent clients than max-num-seqs reads as queueing."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
import typer
from typer.testing import CliRunner

from releasekit._support.http import async_http_client
from releasekit.bench.scrape import WAITING
from releasekit.capacity.diagnose import Diagnosis, Thresholds
from releasekit.cli import diagnose_cmds
from releasekit.cli._common import State
from releasekit.config import Settings
from releasekit.watch.windows import ScrapeError, parse_exposition, scrape

pytestmark = pytest.mark.slow
runner = CliRunner()


@contextmanager
def load(
    base_url: str, model: str, *, clients: int, max_tokens: int, stream: bool = True
) -> Iterator[list[int]]:
    """`clients` clients sending completions back to back until the block ends; yields a
    one-item list counting finished requests."""
    done = [0]
    stop = threading.Event()

    async def client(c: httpx.AsyncClient) -> None:
        body = {
            "model": model,
            "prompt": "The quick brown fox jumps over the lazy dog and",
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": stream,
        }
        while not stop.is_set():
            try:
                async with c.stream("POST", "/v1/completions", json=body) as resp:
                    async for _ in resp.aiter_lines():
                        pass
                done[0] += 1
            except httpx.HTTPError:
                await asyncio.sleep(0.1)

    async def main() -> None:
        limits = httpx.Limits(max_connections=clients + 4)
        async with async_http_client(base_url=base_url, timeout=120, limits=limits) as c:
            await asyncio.gather(*(client(c) for _ in range(clients)))

    th = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    th.start()
    try:
        yield done
    finally:
        stop.set()
        th.join(timeout=180)


def _wait_for_a_queue(base_url: str, timeout_s: float = 120.0) -> None:
    """Until vLLM's own gauge shows requests waiting (the clients' ramp-up is slow on a busy
    2-core host), then two seconds more so the queue time builds up."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            exp = parse_exposition(scrape(f"{base_url}/metrics", timeout_s=30), url=base_url)
        except ScrapeError:
            exp = None
        if exp is not None and sum(v for _, v in exp.select(WAITING, {})) > 0:
            time.sleep(2)
            return
        time.sleep(1)
    pytest.fail(f"no request waiting in vLLM after {timeout_s:g} s of 128 clients")


def _diagnose(url: str, window_s: float) -> Diagnosis:
    app = typer.Typer(pretty_exceptions_enable=False)

    @app.callback()
    def _root() -> None:
        State.reset()

    diagnose_cmds.register(app)
    res = runner.invoke(
        app,
        [
            "diagnose",
            "demo",
            "--window",
            str(window_s),
            "--json",
            "--vllm-url",
            url,
            "--scrape-timeout",
            "30",
        ],
    )
    assert res.exit_code == 0, res.stderr
    return Diagnosis.model_validate(json.loads(res.stdout))


def test_light_load_on_the_demo_server_is_nothing_alarming(
    vllm_server: Any, settings_cap: Settings
) -> None:
    """Two clients on a server that holds 32: no finding (healthy, or too little traffic on
    a slow host), never queueing."""
    with load(vllm_server.base_url, vllm_server.model, clients=2, max_tokens=16):
        time.sleep(2)
        d = _diagnose(vllm_server.base_url, 6)
    assert d.findings == [], [f.title for f in d.findings]
    assert d.verdict in ("healthy", "not_enough_traffic")


def test_more_clients_than_max_num_seqs_is_queueing(
    vllm_server: Any, settings_cap: Settings
) -> None:
    """128 clients on a server with max-num-seqs 32: queueing is named (first, or right after
    a slow API-server front end on a starved host), with vLLM's queue time and waiting
    requests as its evidence.

    The test judges a window only once the server itself reports a queue in it (vLLM's
    waiting gauge above 0 and its queue-time histogram over diagnose's line), not on how fast
    the clients ramp up: on a loaded machine the first windows can see a queue still
    building (queue 0.47 s with 179 requests), and such a window is measured again."""
    line = Thresholds().queue_abs_s
    seen: list[str] = []
    # Whole answers (no SSE): the engine, not the API server's relay, is the bottleneck.
    with load(
        vllm_server.base_url, vllm_server.model, clients=128, max_tokens=128, stream=False
    ) as done:
        _wait_for_a_queue(vllm_server.base_url)
        for _ in range(6):
            d = _diagnose(vllm_server.base_url, 10)
            k = d.key_figures
            waiting, queue = k.get("waiting_requests_max") or 0, k.get("queue_mean_s") or 0
            seen.append(f"{d.verdict}: waiting {waiting:g}, queue {queue:.2f} s")
            if waiting > 0 and queue > line:
                break  # the server reports a queue in this window: judge it
        else:
            pytest.fail(
                "vLLM never reported a queue over diagnose's line in 6 windows of 128 clients: "
                + "; ".join(seen)
            )
    assert done[0] > 0
    assert d.verdict == "problems", (d.summary, seen)
    kinds = [f.kind for f in d.findings]
    assert "queueing" in kinds[:2], (d.key_figures, [f.title for f in d.findings])
    top = d.findings[kinds.index("queueing")]
    by = {e.metric: e for e in top.evidence}
    assert by["queue_mean_s"].source == "vllm" and (by["queue_mean_s"].value or 0) > line
    assert (by["waiting_requests_max"].value or 0) > 0
