"""Gateway overhead benchmark: one real vLLM server of the demo model, measured in one run
with the same streaming client directly, through the releasekit gateway (its own process)
and through vllm-router (the vLLM project's Rust router) as the peer.

    nice -n 10 .venv/bin/python benchmarks/gateway_bench.py [--concurrency 1 16]
        [--requests 12 48] [--max-tokens 32] [--rounds 4] [--no-router] [--out PATH]

Targets are interleaved (round 1: direct, gateway, router; round 2 reversed, ...) so that
drift in the shared machine does not favour one; the throughput ratio uses the median round.
By default every process it starts (vLLM, gateway, router) runs in this process's session,
each in its own process group: with the kernel's autogroup scheduling a process in its own
session is its own scheduling group, and on a loaded 2-core machine any proxy in a separate
session (the gateway, vllm-router, a 40-line aiohttp relay alike) then often receives vLLM's
whole stream in one burst at the end (TTFT close to E2E): `--separate-sessions` shows it.

Per target and concurrency: TTFT p50/p95
(request sent to first non-empty text chunk, client-side) and output tokens/s (usage
tokens over the wall time of the point). Issue 10's target: gateway TTFT p50 within 5 ms
of direct, output tokens/s at the highest concurrency within 5 % of direct.

Needs models/demo-base (trained by `dvc repro demo-model`); ports come from
RELEASEKIT_PORT_RANGE (default 18000-18999). Writes benchmarks/results/gateway.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx
from _results import RESULTS, write_result

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from releasekit.deploy.gateway import GatewayConfig, Route  # noqa: E402
from releasekit.deploy.gateway_client import launch_gateway  # noqa: E402
from releasekit.serving.vllm import ServerInfo, VLLMServer, pick_port  # noqa: E402

_TEXT = re.compile(rb'"text":"[^"]')
_USAGE = re.compile(rb'"completion_tokens":(\d+)')
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "the",
    "lazy",
    "dog",
    "and",
    "runs",
    "far",
    "away",
]


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100); None without data."""
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


async def one_request(
    session: aiohttp.ClientSession, url: str, body: bytes
) -> tuple[float | None, int, str | None, float]:
    """(ttft_s, output tokens, error, e2e_s) of one streaming completion."""
    t0 = time.perf_counter()
    ttft = None
    tail = b""
    try:
        async with session.post(url, data=body) as r:
            if r.status != 200:
                err = f"HTTP {r.status}: {(await r.read())[:200]!r}"
                return None, 0, err, time.perf_counter() - t0
            async for chunk in r.content.iter_any():
                if ttft is None and _TEXT.search(chunk):
                    ttft = time.perf_counter() - t0
                tail = (tail + chunk)[-2048:]
    except (aiohttp.ClientError, TimeoutError) as exc:
        return None, 0, repr(exc), time.perf_counter() - t0
    m = _USAGE.findall(tail)
    return ttft, int(m[-1]) if m else 0, None, time.perf_counter() - t0


async def run_point(
    base_url: str, *, concurrency: int, n: int, max_tokens: int, model: str, seed: int
) -> dict[str, Any]:
    """A closed loop of `n` requests at `concurrency`; TTFT percentiles and tokens/s."""
    url = base_url + "/v1/completions"

    def body(i: int) -> bytes:
        words = [WORDS[(seed + i * 7 + j) % len(WORDS)] for j in range(12)]
        return json.dumps(
            {
                "model": model,
                "prompt": " ".join(words),
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        ).encode()

    conn = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    headers = {"content-type": "application/json"}
    async with aiohttp.ClientSession(connector=conn, headers=headers) as session:
        # warm the connections (not measured)
        await asyncio.gather(*(one_request(session, url, body(-1)) for _ in range(concurrency)))
        queue = list(range(n))
        results: list[tuple[float | None, int, str | None, float]] = []

        async def worker() -> None:
            while queue:
                i = queue.pop()
                results.append(await one_request(session, url, body(i)))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    ttfts = [r[0] for r in results if r[0] is not None]
    tokens = sum(r[1] for r in results)
    errors = [r[2] for r in results if r[2]]
    return {
        "requests": n,
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "ttft_ms": [t * 1000 for t in ttfts],
        "e2e_ms": [r[3] * 1000 for r in results if r[2] is None],
        "output_tokens": tokens,
        "wall_s": wall,
    }


def gateway_edge(url: str) -> dict[str, float | None]:
    """Means of the gateway's own histograms over the whole run (ms): its overhead (arrival
    to upstream request sent) and its edge TTFT."""
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for smp in fam.samples:
            if smp.name.endswith(("_sum", "_count")):
                sums[smp.name] = sums.get(smp.name, 0.0) + smp.value

    def mean(family: str) -> float | None:
        n = sums.get(f"releasekit_gateway_{family}_seconds_count", 0.0)
        return 1000 * sums[f"releasekit_gateway_{family}_seconds_sum"] / n if n else None

    return {
        "overhead_mean_ms": mean("overhead"),
        "ttft_mean_ms": mean("ttft"),
        "upstream_wait_mean_ms": mean("upstream_wait"),
    }


def cpu_s(pid: int | None) -> float | None:
    """CPU seconds (user + system) a process has used, from /proc; None if unknown."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def summarise(points: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge the rounds of one (target, concurrency)."""
    ttft = [t for p in points for t in p["ttft_ms"]]
    tokens = sum(p["output_tokens"] for p in points)
    wall = sum(p["wall_s"] for p in points)
    rounds = [p["output_tokens"] / p["wall_s"] for p in points if p["wall_s"] > 0]
    return {
        "requests": sum(p["requests"] for p in points),
        "errors": sum(p["errors"] for p in points),
        "first_error": next((p["first_error"] for p in points if p["first_error"]), None),
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p95_ms": percentile(ttft, 95),
        "e2e_p50_ms": percentile([t for p in points for t in p["e2e_ms"]], 50),
        "rounds_ttft_p50_ms": [percentile(p["ttft_ms"], 50) for p in points],
        "output_tok_s": tokens / wall if wall > 0 else None,
        "rounds_tok_s": rounds,
        "median_round_tok_s": statistics.median(rounds) if rounds else None,
        "proxy_cpu_ms_per_request": (
            1000 * sum(p["proxy_cpu_s"] for p in points) / sum(p["requests"] for p in points)
            if all(p.get("proxy_cpu_s") is not None for p in points)
            else None
        ),
    }


def _detach(separate: bool) -> dict[str, Any]:
    """Popen arguments: its own session (`separate`, as deployed) or its own process group
    in this session (the default: one scheduling group for every process compared)."""
    return {"start_new_session": True} if separate else {"process_group": 0}


def start_vllm(server: VLLMServer, *, separate: bool) -> tuple[ServerInfo, Any]:
    """Start the demo model's server; returns its info and what `stop_vllm` needs."""
    if separate:
        return server.start(), server
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        **server.env,
    }
    with server.log_path.open("wb") as log:
        proc = subprocess.Popen(
            server.command(),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            stdin=subprocess.DEVNULL,
            **_detach(False),
        )
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"vLLM exited {proc.returncode}: {server.log_path.read_text()[-1500:]}"
            )
        try:
            if httpx.get(server.base_url + "/health", timeout=2).status_code == 200:
                models = httpx.get(server.base_url + "/v1/models", timeout=2)
                if models.status_code == 200:
                    v = httpx.get(server.base_url + "/version", timeout=2).json().get("version")
                    info = ServerInfo(
                        base_url=server.base_url,
                        model="demo",
                        pid=proc.pid,
                        port=server.port,
                        log_path=str(server.log_path),
                        version=v,
                    )
                    return info, proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop(proc)
    raise RuntimeError("vLLM not healthy within 600 s")


def stop_vllm(handle: Any) -> None:
    """Stop what start_vllm started."""
    if isinstance(handle, VLLMServer):
        handle.stop()
    else:
        stop(handle)


def start_router(worker: str, port: int, log: Path, *, separate: bool) -> subprocess.Popen[bytes]:
    """vllm-router in front of `worker`; raises RuntimeError with its log if it fails."""
    exe = shutil.which("vllm-router", path=str(Path(sys.executable).parent))
    if exe is None:
        raise RuntimeError("vllm-router is not installed (pip install vllm-router==0.1.17)")
    metrics_port = pick_port(avoid={port})
    cmd = [
        exe,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        worker,
        "--policy",
        "round_robin",
        "--log-level",
        "warning",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(metrics_port),
    ]
    with log.open("wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, **_detach(separate))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm-router exited {proc.returncode}: {log.read_text()[-1500:]}")
        try:
            r = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2)
            if r.status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    stop(proc)
    raise RuntimeError(f"vllm-router not ready in 60 s: {log.read_text()[-1500:]}")


def stop(proc: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM the process group, SIGKILL what is left after 10 s."""
    if proc is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", type=Path, default=REPO / "models" / "demo-base")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--requests", type=int, nargs="+", default=[12, 48])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--no-router", action="store_true")
    ap.add_argument(
        "--server-url", help="use this running vLLM (serving 'demo') instead of starting one"
    )
    ap.add_argument(
        "--separate-sessions",
        action="store_true",
        help="start vLLM, the gateway and the router each in its own session, as deployed "
        "(on a shared machine with autogroup scheduling this changes which process waits)",
    )
    ap.add_argument("--out", type=Path, default=RESULTS / "gateway.json")
    args = ap.parse_args()
    if len(args.requests) != len(args.concurrency):
        ap.error("--requests needs one count per --concurrency")
    if not (args.model_dir / "config.json").is_file():
        print(f"skipped: {args.model_dir} does not exist (run `dvc repro demo-model`)")
        return 0
    os.environ.setdefault("RELEASEKIT_PORT_RANGE", "18000-18999")
    work = Path(tempfile.mkdtemp(prefix="gwbench-"))
    server = VLLMServer(
        args.model_dir,
        served_name="demo",
        engine_args={"max-model-len": "512", "enforce-eager": "", "dtype": "bfloat16"},
        env={"VLLM_CPU_KVCACHE_SPACE": "1"},
        python=Path(sys.executable),
        log_path=work / "vllm.log",
    )
    gateway = router = vllm_handle = None
    router_error: str | None = None
    result: dict[str, Any] = {}
    try:
        t = time.perf_counter()
        if args.server_url:
            v = httpx.get(args.server_url + "/version").json().get("version")
            port = httpx.URL(args.server_url).port or 80
            info = ServerInfo(
                base_url=args.server_url, model="demo", pid=0, port=port, log_path="", version=v
            )
        else:
            info, vllm_handle = start_vllm(server, separate=args.separate_sessions)
        print(f"vLLM {info.version} up on {info.base_url} in {time.perf_counter() - t:.0f} s")
        token = secrets.token_urlsafe(24)
        gport = pick_port(avoid={info.port})
        cfg = GatewayConfig(
            env="bench",
            port=gport,
            admin_token=token,
            max_in_flight=256,
            routes=[Route(release_id="demo-bf16", base_url=info.base_url, model="demo")],
        )
        gateway = launch_gateway(
            cfg,
            config_path=work / "gw.json",
            log_path=work / "gw.log",
            new_session=args.separate_sessions,
        )
        targets = {"direct": info.base_url, "gateway": gateway.url}
        if not args.no_router:
            try:
                rport = pick_port(avoid={info.port, gport})
                router = start_router(
                    info.base_url, rport, work / "router.log", separate=args.separate_sessions
                )
                targets["vllm-router"] = f"http://127.0.0.1:{rport}"
            except (RuntimeError, OSError) as exc:
                router_error = str(exc)
                print(f"vllm-router left out: {router_error}")
        names = list(targets)
        pids = {"gateway": gateway.pid, "vllm-router": router.pid if router else None}
        raw: dict[str, dict[int, list[dict[str, Any]]]] = {n: {} for n in names}
        for rnd in range(args.rounds):
            order = names if rnd % 2 == 0 else names[::-1]
            for c, n in zip(args.concurrency, args.requests, strict=True):
                for name in order:
                    pid = pids.get(name)
                    cpu0 = cpu_s(pid)
                    p = asyncio.run(
                        run_point(
                            targets[name],
                            concurrency=c,
                            n=n,
                            max_tokens=args.max_tokens,
                            model="demo",
                            seed=rnd,
                        )
                    )
                    cpu1 = cpu_s(pid)
                    p["proxy_cpu_s"] = (
                        cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None
                    )
                    raw[name].setdefault(c, []).append(p)
        edge = gateway_edge(gateway.url)
        summary = {
            name: {str(c): summarise(pts) for c, pts in by_c.items()} for name, by_c in raw.items()
        }
        result = {
            "vllm_version": info.version,
            "max_tokens": args.max_tokens,
            "rounds": args.rounds,
            "concurrency": args.concurrency,
            "requests_per_round": args.requests,
            "router_error": router_error,
            "separate_sessions": args.separate_sessions,
            "results": summary,
            "gateway_edge": edge,
        }
        top = str(max(args.concurrency))
        d1, g1 = (
            summary["direct"][str(min(args.concurrency))],
            summary["gateway"][str(min(args.concurrency))],
        )
        dk, gk = summary["direct"][top], summary["gateway"][top]
        ttft_delta = (
            g1["ttft_p50_ms"] - d1["ttft_p50_ms"]
            if g1["ttft_p50_ms"] is not None and d1["ttft_p50_ms"] is not None
            else None
        )
        # median over rounds: one round disturbed by another tenant does not decide
        tput_ratio = (
            gk["median_round_tok_s"] / dk["median_round_tok_s"]
            if gk["median_round_tok_s"] and dk["median_round_tok_s"]
            else None
        )
        result["targets"] = {
            "ttft_p50_delta_ms_at_c1": ttft_delta,
            "ttft_p50_within_5ms": ttft_delta is not None and ttft_delta <= 5.0,
            "tok_s_ratio_at_top_concurrency": tput_ratio,
            "tok_s_within_5pct": tput_ratio is not None and tput_ratio >= 0.95,
        }
    finally:
        stop(router)
        if gateway is not None and gateway.process is not None:
            stop(gateway.process)
        if vllm_handle is not None:
            stop_vllm(vllm_handle)
    print()
    print(
        f"{'target':<12} {'conc':>4} {'req':>4} {'err':>3} {'TTFT p50 ms':>12} "
        f"{'TTFT p95 ms':>12} {'E2E p50 ms':>11} {'out tok/s':>10} {'median rnd':>10} "
        f"{'proxy CPU ms/req':>16}"
    )
    for name, by_c in result["results"].items():
        for c, s in by_c.items():

            def f(x: float | None) -> str:
                return f"{x:.1f}" if x is not None else "-"

            def f2(x: float | None) -> str:
                return f"{x:.2f}" if x is not None else "-"

            print(
                f"{name:<12} {c:>4} {s['requests']:>4} {s['errors']:>3} "
                f"{f(s['ttft_p50_ms']):>12} {f(s['ttft_p95_ms']):>12} {f(s['e2e_p50_ms']):>11} "
                f"{f(s['output_tok_s']):>10} {f(s['median_round_tok_s']):>10} "
                f"{f2(s['proxy_cpu_ms_per_request']):>16}"
            )
    tg = result["targets"]
    print()
    print(
        f"gateway vs direct: TTFT p50 delta at c={min(args.concurrency)}: "
        f"{tg['ttft_p50_delta_ms_at_c1']:+.2f} ms (target <= 5 ms); "
        f"tok/s ratio (median round) at c={max(args.concurrency)}: "
        f"{tg['tok_s_ratio_at_top_concurrency']:.3f} (target >= 0.95)"
    )
    e = result["gateway_edge"]
    if e["overhead_mean_ms"] is not None:
        print(
            f"gateway's own overhead (arrival to upstream request sent): "
            f"{e['overhead_mean_ms']:.3f} ms mean"
        )
    if router_error:
        print(f"vllm-router: {router_error}")
    write_result(args.out, result)
    print(f"wrote {args.out}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
