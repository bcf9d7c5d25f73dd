"""Mirror cost benchmark: what shadow traffic adds to the gateway. A real gateway (its own
process, `python -m releasekit.deploy.gateway`) in front of two stand-in model servers (a
small ASGI app in this process: the stable release and the candidate), the same requests
sent with the mirror off and then on at share 1.0. No vLLM needed.

    nice -n 10 .venv/bin/python benchmarks/mirror_cost.py [--requests 2000]
        [--concurrency 8] [--warmup 200] [--out PATH]

Requests cycle through four kinds: completions, completions streamed, templated chat,
templated chat streamed (all `temperature` 0: every pair is judged). Per phase:
- the gateway process's CPU seconds per 1,000 requests, read three ways: from outside
  (utime + stime of /proc/PID/stat, read by this process), from inside (the gateway's own
  `process_cpu_seconds_total` on its /metrics) and by a second tool, the kernel's CPU
  controller (the gateway is moved into a cgroup of its own: cgroup v1 `cpuacct.usage`, or
  v2 `cpu.stat` `usage_usec`, in nanoseconds or microseconds, where this host lets the
  benchmark make one; else the file says why not). The first two are one per-task counter
  read twice and agree by construction; the cgroup's figure is the controller's own count,
  the comparison that can disagree. Their differences are reported. The mirror's added
  CPU per 1,000 mirrored requests is on minus off.
- with the mirror on, the memory ring's size per 1,000 pairs (the JSON of the pairs the
  admin route answers, and the gateway's RSS growth over the phase next to the off phase's)
  and the disk copy's bytes per 1,000 pairs (its files' sizes: the gateway writes them under
  a scratch `pairs_dir`, as an environment's gateway does under `<state dir>/mirror-pairs`).

The client and the stand-ins run in this process and share the host's cores with the
gateway: the figures are the gateway's own CPU, not its latency. Writes
benchmarks/results/mirror_cost.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import uvicorn
from _results import RESULTS, write_result
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route as SRoute

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from releasekit.deploy.gateway import (  # noqa: E402
    GatewayConfig,
    Mirror,
    PromptTemplate,
    Route,
    RouteTable,
)
from releasekit.deploy.gateway_client import GatewayClient, launch_gateway  # noqa: E402

ANSWER = ["The", " answer", " is", " 42", "."]
PROMPTS = {"qa": PromptTemplate(system="Answer in one word.", user="Question: {{ q }}")}
CLK_TCK = os.sysconf("SC_CLK_TCK")


def stand_in() -> Starlette:
    """A model server's OpenAI answers, fixed text: JSON, or one SSE event a token."""

    async def completions(request: Request) -> Response:
        body = json.loads(await request.body())
        chat = request.url.path.endswith("chat/completions")
        text = "".join(ANSWER)
        if not body.get("stream"):
            choice: dict[str, Any] = (
                {"index": 0, "message": {"role": "assistant", "content": text}}
                if chat
                else {"index": 0, "text": text}
            )
            usage = {"prompt_tokens": 8, "completion_tokens": len(ANSWER)}
            return JSONResponse({"id": "cmpl-x", "choices": [choice], "usage": usage})

        async def events() -> Any:
            for tok in ANSWER:
                c = {"index": 0, "delta": {"content": tok}} if chat else {"index": 0, "text": tok}
                yield b"data: " + json.dumps({"id": "cmpl-x", "choices": [c]}).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(
        routes=[
            SRoute("/v1/completions", completions, methods=["POST"]),
            SRoute("/v1/chat/completions", completions, methods=["POST"]),
        ]
    )


def serve_in_thread(app: Any) -> tuple[uvicorn.Server, str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_level="error",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=1,
            # Longer than the gateway's pool keeps a connection (30 s): otherwise a request
            # may go out on a connection the stand-in is closing (a 502 nobody caused).
            timeout_keep_alive=75,
        )
    )
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    return server, f"http://127.0.0.1:{port}"


def proc_cpu_s(pid: int) -> float:
    """utime + stime of a process, from outside it (/proc/PID/stat)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


class CgroupCpu:
    """A process's CPU time as the kernel's CPU controller counts it: the process is moved
    into a cgroup of its own (v1 cpuacct, else v2), whose usage this reads. `kind` is None
    (and `why` says why) where the host does not let this process make one."""

    def __init__(self, pid: int) -> None:
        self.kind: str | None = None
        self.why = ""
        self.dir: Path | None = None
        self._file = ""
        self._scale = 1.0
        name = f"rk-mirror-cost-{os.getpid()}"
        tries = (
            (Path("/sys/fs/cgroup/cpuacct"), "cpuacct.usage", 1e-9, "cgroup v1 cpuacct.usage"),
            (Path("/sys/fs/cgroup/unified"), "cpu.stat", 1e-6, "cgroup v2 cpu.stat usage_usec"),
            (Path("/sys/fs/cgroup"), "cpu.stat", 1e-6, "cgroup v2 cpu.stat usage_usec"),
        )
        for base, file, scale, kind in tries:
            if not (base / "cgroup.procs").is_file():
                continue
            d = base / name
            try:
                d.mkdir()
                (d / "cgroup.procs").write_text(str(pid))
                self.dir, self._file, self._scale, self.kind = d, file, scale, kind
                self.read()
                return
            except OSError as exc:
                self.why = f"{base}: {exc}"
                self.kind = None
                with contextlib.suppress(OSError):
                    d.rmdir()
        self.why = self.why or "no cgroup hierarchy found"

    def read(self) -> float:
        """CPU seconds of the group so far."""
        assert self.dir is not None
        text = (self.dir / self._file).read_text()
        if self._file == "cpu.stat":
            usage = next(ln for ln in text.splitlines() if ln.startswith("usage_usec "))
            return int(usage.split()[1]) * self._scale
        return int(text.strip()) * self._scale

    def close(self) -> None:
        """Remove the group (once its process has exited)."""
        if self.dir is not None:
            with contextlib.suppress(OSError):
                self.dir.rmdir()


def proc_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def scrape(url: str) -> dict[str, float]:
    """The gateway's own process figures from its /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name in ("process_cpu_seconds", "process_resident_memory_bytes"):
            for s in fam.samples:
                out[s.name] = s.value
    return out


def request_of(i: int) -> tuple[str, dict[str, Any]]:
    """The i-th request: completions or templated chat, streamed or not (in turn)."""
    stream = i % 2 == 1
    q = f"question number {i}: what is six times seven?"
    if i % 4 < 2:
        body = {"model": "m", "prompt": q, "max_tokens": 8, "temperature": 0, "stream": stream}
        return "/v1/completions", body
    body = {"model": "m", "variables": {"q": q}, "max_tokens": 8, "temperature": 0}
    body["stream"] = stream
    return "/v1/templates/qa/chat/completions", body


async def send(url: str, n: int, concurrency: int, offset: int) -> dict[str, Any]:
    """n requests over `concurrency` connections; counts of statuses and bad answers."""
    statuses: dict[int, int] = {}
    bad = 0
    nxt = 0

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal nxt, bad
        while nxt < n:
            i = offset + nxt
            nxt += 1
            path, body = request_of(i)
            async with session.post(url + path, json=body) as r:
                raw = await r.read()
                statuses[r.status] = statuses.get(r.status, 0) + 1
                text = raw.decode()
                if body["stream"]:
                    ok = text.rstrip().endswith("data: [DONE]") and '" 42"' in text
                else:
                    ok = "The answer is 42." in text
                bad += not ok

    conn = aiohttp.TCPConnector(limit=concurrency)
    t = time.perf_counter()
    async with aiohttp.ClientSession(connector=conn) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return {
        "requests": n,
        "seconds": round(time.perf_counter() - t, 2),
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "answers_not_as_sent": bad,
    }


def phase(
    gw_url: str, pid: int, n: int, concurrency: int, offset: int, cg: CgroupCpu
) -> dict[str, Any]:
    """Send n requests; the gateway's CPU (every way) and RSS before and after."""
    g0 = cg.read() if cg.kind else None
    p0, m0, r0 = proc_cpu_s(pid), scrape(gw_url), proc_rss_bytes(pid)
    sent = asyncio.run(send(gw_url, n, concurrency, offset))
    m1, p1, r1 = scrape(gw_url), proc_cpu_s(pid), proc_rss_bytes(pid)
    g1 = cg.read() if cg.kind else None
    via_proc = p1 - p0
    via_metrics = m1["process_cpu_seconds_total"] - m0["process_cpu_seconds_total"]
    via_cgroup = g1 - g0 if g0 is not None and g1 is not None else None
    return {
        **sent,
        "cpu_s_cgroup": round(via_cgroup, 3) if via_cgroup is not None else None,
        "cpu_s_per_1000_cgroup": round(via_cgroup / n * 1000, 3)
        if via_cgroup is not None
        else None,
        "cpu_s_proc_stat": round(via_proc, 3),
        "cpu_s_metrics": round(via_metrics, 3),
        "cpu_s_per_1000_proc_stat": round(via_proc / n * 1000, 3),
        "cpu_s_per_1000_metrics": round(via_metrics / n * 1000, 3),
        "rss_start_mib": round(r0 / 2**20, 2),
        "rss_end_mib": round(r1 / 2**20, 2),
        "rss_delta_mib": round((r1 - r0) / 2**20, 2),
        "rss_metrics_delta_mib": round(
            (m1["process_resident_memory_bytes"] - m0["process_resident_memory_bytes"]) / 2**20, 2
        ),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="per phase")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=200, help="requests before measuring")
    parser.add_argument("--out", type=Path, default=RESULTS / "mirror_cost.json")
    args = parser.parse_args()
    n = args.requests
    if not 0 < n <= 100_000:
        parser.error("--requests must be in 1..100000 (the ring holds at most 100,000)")

    stable_srv, stable_url = serve_in_thread(stand_in())
    cand_srv, cand_url = serve_in_thread(stand_in())
    stable = Route(release_id="stable", base_url=stable_url, prompts=PROMPTS)
    cand = Route(release_id="candidate", base_url=cand_url, prompts=PROMPTS)
    admin = secrets.token_urlsafe(24)
    with tempfile.TemporaryDirectory(prefix="mirror-cost-") as t:
        tmp = Path(t)
        pairs_dir = tmp / "mirror-pairs" / "bench"
        cfg = GatewayConfig(
            env="bench",
            port=0,
            admin_token=admin,
            shutdown_timeout_s=2,
            routes=[stable],
            pairs_dir=str(pairs_dir),
        )
        gw = launch_gateway(
            cfg, config_path=tmp / "gw.json", log_path=tmp / "gw.log", new_session=False
        )
        mirror = Mirror(route=cand, share=1.0, max_in_flight=4 * args.concurrency, pairs=n)
        cg = CgroupCpu(gw.pid)
        try:
            with GatewayClient(gw.url, admin_token=admin) as c:
                asyncio.run(send(gw.url, args.warmup, args.concurrency, 0))
                off = phase(gw.url, gw.pid, n, args.concurrency, args.warmup, cg)
                c.set_routes(RouteTable(routes=[stable], mirror=mirror))
                on = phase(gw.url, gw.pid, n, args.concurrency, args.warmup + n, cg)
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    st = c.state()
                    written = st.mirror_pairs_stored + st.mirror_pairs_store_failed
                    if written >= st.mirror_pairs >= st.mirrored:
                        break
                    time.sleep(0.1)
                st = c.state()
                pairs = c.mirror_pairs(0).pairs
        finally:
            os.kill(gw.pid, signal.SIGTERM)
            if gw.process is not None:
                gw.process.wait(timeout=30)
            cg.close()
        disk = sum(f.stat().st_size for f in pairs_dir.iterdir()) if pairs_dir.exists() else 0
        files = sorted(f.name for f in pairs_dir.iterdir()) if pairs_dir.exists() else []
    stable_srv.should_exit = True
    cand_srv.should_exit = True

    ring_json = len(json.dumps([p.model_dump(mode="json") for p in pairs]).encode())
    k = 1000 / max(1, len(pairs))
    # The on phase's CPU less what its requests cost with the mirror off, per copy sent (a
    # copy past the mirror's in-flight cap is dropped, not sent).
    mirrored = max(1, st.mirrored)
    added_proc = (on["cpu_s_proc_stat"] - off["cpu_s_proc_stat"] * on["requests"] / n) / mirrored
    added_metrics = (on["cpu_s_metrics"] - off["cpu_s_metrics"] * on["requests"] / n) / mirrored
    added_proc, added_metrics = added_proc * 1000, added_metrics * 1000
    added_cgroup = None
    if on["cpu_s_cgroup"] is not None and off["cpu_s_cgroup"] is not None:
        added_cgroup = (on["cpu_s_cgroup"] - off["cpu_s_cgroup"] * on["requests"] / n) / mirrored
        added_cgroup *= 1000
    doc: dict[str, Any] = {
        "setup": {
            "requests_per_phase": n,
            "warmup_requests": args.warmup,
            "concurrency": args.concurrency,
            "kinds": "completions, completions streamed, templated chat, templated chat "
            "streamed, in turn; temperature 0",
            "answer": "".join(ANSWER),
            "mirror": {
                "share": 1.0,
                "max_in_flight": mirror.max_in_flight,
                "pairs": mirror.pairs,
                "pairs_segment_mib": mirror.pairs_segment_mib,
            },
        },
        "off": off,
        "on": on,
        "mirror": {
            "mirrored": st.mirrored,
            "dropped": st.mirror_dropped,
            "pairs_recorded": st.mirror_pairs,
            "pairs_kept": st.mirror_pairs_kept,
            "pairs_stored": st.mirror_pairs_stored,
            "pairs_store_failed": st.mirror_pairs_store_failed,
            "pairs_complete": sum(p.complete for p in pairs),
            "pairs_agreeing": sum(p.stable == p.candidate for p in pairs),
        },
        "added_cpu_s_per_1000_mirrored": {
            "proc_stat": round(added_proc, 3),
            "metrics": round(added_metrics, 3),
            "difference": round(abs(added_proc - added_metrics), 3),
            "cgroup": round(added_cgroup, 3) if added_cgroup is not None else None,
            "cgroup_vs_proc_stat": round(abs(added_cgroup - added_proc), 3)
            if added_cgroup is not None
            else None,
        },
        "cgroup": {"kind": cg.kind, "why_not": cg.why if cg.kind is None else None},
        "two_ways_apart": {
            "off_s": round(abs(off["cpu_s_proc_stat"] - off["cpu_s_metrics"]), 3),
            "on_s": round(abs(on["cpu_s_proc_stat"] - on["cpu_s_metrics"]), 3),
        },
        "cgroup_vs_proc_stat_s": {
            "off": round(abs(off["cpu_s_cgroup"] - off["cpu_s_proc_stat"]), 3)
            if off["cpu_s_cgroup"] is not None
            else None,
            "on": round(abs(on["cpu_s_cgroup"] - on["cpu_s_proc_stat"]), 3)
            if on["cpu_s_cgroup"] is not None
            else None,
        },
        "ring_json_bytes_per_1000_pairs": round(ring_json * k),
        "rss_delta_mib_per_1000_pairs": round(on["rss_delta_mib"] * k, 2),
        "disk_bytes_per_1000_pairs": round(disk * k),
        "disk_files": files,
        "disk_bytes": disk,
    }
    write_result(args.out, doc)
    print(f"{'':28}{'off':>10}{'on (share 1.0)':>16}")
    for label, key in (
        ("CPU s / 1,000 (proc/stat)", "cpu_s_per_1000_proc_stat"),
        ("CPU s / 1,000 (/metrics)", "cpu_s_per_1000_metrics"),
        ("CPU s / 1,000 (cgroup)", "cpu_s_per_1000_cgroup"),
        ("RSS delta MiB", "rss_delta_mib"),
        ("seconds", "seconds"),
    ):
        print(f"{label:28}{off[key]!s:>10}{on[key]!s:>16}")
    a = doc["added_cpu_s_per_1000_mirrored"]
    print(
        f"added CPU per 1,000 mirrored: {a['proc_stat']} s (proc/stat), {a['metrics']} s "
        f"(/metrics), {a['difference']} s apart; {a['cgroup']} s by the CPU controller "
        f"({cg.kind or 'not measured: ' + cg.why})"
    )
    print(
        f"ring {doc['ring_json_bytes_per_1000_pairs']:,} B JSON / 1,000 pairs, RSS +"
        f"{doc['rss_delta_mib_per_1000_pairs']} MiB / 1,000 pairs; disk "
        f"{doc['disk_bytes_per_1000_pairs']:,} B / 1,000 pairs; "
        f"{st.mirrored} mirrored, {st.mirror_dropped} dropped, {st.mirror_pairs_stored} stored"
    )
    print(
        f"client answers not as sent: {off['answers_not_as_sent']} off, "
        f"{on['answers_not_as_sent']} on; wrote {args.out}"
    )
    bad = off["answers_not_as_sent"] + on["answers_not_as_sent"]
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
