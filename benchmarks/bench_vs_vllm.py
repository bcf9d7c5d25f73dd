"""releasekit's load client side by side with `vllm bench serve`, on one vLLM server.

One vLLM CPU server on the demo model; the same workload for both clients (completions,
32 prompt tokens, 48 output tokens, ignore_eos, greedy); at each concurrency the runs go
releasekit, vLLM, vLLM, releasekit (both orders), each client in its own long-lived worker
process so that its CPU time is its own. Around every run the parent scrapes the server's
/metrics, so each client is also compared with the server's own histograms (TTFT and E2E
means from `_sum`/`_count` deltas, completed requests).

    RELEASEKIT_PORT_RANGE=23000-23999 nice -n 5 .venv/bin/python benchmarks/bench_vs_vllm.py

Prints one table per concurrency and writes benchmarks/results/bench_vs_vllm.json.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _results import REPO, RESULTS, write_result

PROMPT_TOKENS = 32
OUTPUT_TOKENS = 48
MAX_NUM_SEQS = 32
MODEL = "demo"


def requests_for(concurrency: int) -> int:
    """Enough requests for a few waves at every concurrency, in a few seconds here."""
    return max(32, 4 * concurrency)


# --- workers: one process per client ---------------------------------------------------------


def _worker_releasekit(url: str) -> None:
    from releasekit.bench import run_bench
    from releasekit.spec.loadprofile import SLO, LengthDist, LoadProfile, Sweep

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        c, n, seed = int(cmd["concurrency"]), int(cmd["requests"]), int(cmd["seed"])
        prof = LoadProfile(
            name="bench-vs-vllm",
            seed=seed,
            prompt_tokens=LengthDist(dist="fixed", value=PROMPT_TOKENS),
            output_tokens=LengthDist(dist="fixed", value=OUTPUT_TOKENS),
            warmup_requests=0,
            request_timeout_s=120,
            sweep=Sweep(points=[c], requests_per_point=n),
            slo=SLO(ttft_s=5.0, attainment=0.9),
        )
        cpu0 = time.process_time()
        result = run_bench(url, MODEL, prof, repetitions=1, max_num_seqs=MAX_NUM_SEQS)
        cpu = time.process_time() - cpu0
        p = result.points[0]
        out = {
            "completed": p.ok,
            "failed": p.n - p.ok,
            "duration_s": p.duration_s,
            "output_tok_s": p.output_token_throughput,
            "ttft_mean_ms": _ms(p.ttft.mean),
            "ttft_p50_ms": _ms(p.ttft.p50),
            "e2e_mean_ms": _ms(p.e2e.mean),
            "tpot_p50_ms": _ms(p.tpot.p50),
            "cpu_s": cpu,
            "flags": [f.code for f in p.flags],
            "flag_messages": [f.message for f in p.flags],
            "deliveries_per_token": p.deliveries_per_token,
        }
        print(json.dumps(out), flush=True)


def _worker_vllm(url: str) -> None:
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    print(json.dumps({"ready": True}), flush=True)
    real_stdout = sys.stdout
    for line in sys.stdin:
        cmd = json.loads(line)
        c, n, seed = int(cmd["concurrency"]), int(cmd["requests"]), int(cmd["seed"])
        parser = FlexibleArgumentParser()
        add_cli_args(parser)
        args = parser.parse_args(
            [
                "--backend", "vllm", "--base-url", url, "--model", MODEL,
                "--tokenizer", str(cmd["tokenizer"]), "--dataset-name", "random",
                "--random-input-len", str(PROMPT_TOKENS),
                "--random-output-len", str(OUTPUT_TOKENS), "--random-range-ratio", "0",
                "--ignore-eos", "--temperature", "0", "--endpoint", "/v1/completions",
                "--max-concurrency", str(c), "--num-prompts", str(n), "--seed", str(seed),
                "--percentile-metrics", "ttft,tpot,itl,e2el", "--disable-tqdm",
                "--ready-check-timeout-sec", "0",
            ]
        )  # fmt: skip
        sink = io.StringIO()
        cpu0 = time.process_time()
        with contextlib.redirect_stdout(sink):
            res = main(args)
        cpu = time.process_time() - cpu0
        out = {
            "completed": res.get("completed"),
            "failed": res.get("failed"),
            "duration_s": res.get("duration"),
            "output_tok_s": res.get("output_throughput"),
            "ttft_mean_ms": res.get("mean_ttft_ms"),
            "ttft_p50_ms": res.get("median_ttft_ms"),
            "e2e_mean_ms": res.get("mean_e2el_ms"),
            "tpot_p50_ms": res.get("median_tpot_ms"),
            "cpu_s": cpu,
        }
        print(json.dumps(out), file=real_stdout, flush=True)


def _ms(v: float | None) -> float | None:
    return None if v is None else v * 1000


# --- the parent --------------------------------------------------------------------------------


class Worker:
    """A client worker process speaking JSON lines."""

    def __init__(self, kind: str, url: str) -> None:
        self.kind = kind
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", kind, "--url", url],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            cwd=REPO,
        )
        self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{self.kind} worker exited")
            line = line.strip()
            if line.startswith("{"):
                data: dict[str, Any] = json.loads(line)
                return data

    def run(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _server_window(url: str, fn: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run `fn()` between two /metrics scrapes; the server's own means over the window."""
    import httpx

    from releasekit.bench.scrape import Scrape, server_delta

    def scrape() -> Scrape:
        return Scrape(t=time.perf_counter(), text=httpx.get(f"{url}/metrics", timeout=10).text)

    before = scrape()
    out = fn()
    time.sleep(0.1)
    d = server_delta(before, scrape())
    ttft, e2e = d.histograms.get("ttft"), d.histograms.get("e2e")
    server = {
        "server_ttft_mean_ms": _ms(ttft.mean_s if ttft else None),
        "server_e2e_mean_ms": _ms(e2e.mean_s if e2e else None),
        "server_completed": d.requests_succeeded,
        "server_generation_tokens": d.generation_tokens,
    }
    return out, server


def _mean(xs: list[Any]) -> float | None:
    vals = [float(x) for x in xs if x is not None]
    return statistics.fmean(vals) if vals else None


def _pct(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0:
        return "-"
    return f"{(a - b) / b * 100:+.1f}%"


def _f(v: float | None, fmt: str = ".1f") -> str:
    return "-" if v is None else format(v, fmt)


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Means over a client's runs at one point, and CPU seconds per 100 requests."""
    keys = (
        "output_tok_s", "ttft_mean_ms", "ttft_p50_ms", "e2e_mean_ms", "tpot_p50_ms",
        "server_ttft_mean_ms", "server_e2e_mean_ms",
    )  # fmt: skip
    out: dict[str, Any] = {k: _mean([r.get(k) for r in runs]) for k in keys}
    # What the client adds on top of the server's own clock, run by run: this is the
    # client's fidelity, whatever the (shared, noisy) server did in that run.
    for what in ("ttft", "e2e"):
        out[f"{what}_minus_server_ms"] = _mean(
            [
                r[f"{what}_mean_ms"] - r[f"server_{what}_mean_ms"]
                for r in runs
                if r.get(f"{what}_mean_ms") is not None
                and r.get(f"server_{what}_mean_ms") is not None
            ]
        )
    done = sum(int(r.get("completed") or 0) for r in runs)
    cpu = sum(float(r.get("cpu_s") or 0.0) for r in runs)
    out["cpu_s_per_100_requests"] = cpu / done * 100 if done else None
    out["output_tok_s_runs"] = [r.get("output_tok_s") for r in runs]
    return out


def print_point(c: int, rk: dict[str, Any], vl: dict[str, Any], flags: list[str]) -> None:
    rows = [
        ("output tok/s", "output_tok_s", ".0f"),
        ("TTFT mean (ms)", "ttft_mean_ms", ".1f"),
        ("TTFT p50 (ms)", "ttft_p50_ms", ".1f"),
        ("E2E mean (ms)", "e2e_mean_ms", ".0f"),
        ("server TTFT mean (ms)", "server_ttft_mean_ms", ".1f"),
        ("server E2E mean (ms)", "server_e2e_mean_ms", ".0f"),
        ("TTFT client - server (ms)", "ttft_minus_server_ms", ".1f"),
        ("E2E client - server (ms)", "e2e_minus_server_ms", ".1f"),
        ("client CPU s / 100 req", "cpu_s_per_100_requests", ".2f"),
    ]
    print(f"\nconcurrency {c}  (runs: releasekit, vllm, vllm, releasekit)")
    print(f"  {'':26}{'releasekit':>12}{'vllm bench':>12}{'rk vs vllm':>12}")
    for label, key, fmt in rows:
        a, b = rk.get(key), vl.get(key)
        print(f"  {label:26}{_f(a, fmt):>12}{_f(b, fmt):>12}{_pct(a, b):>12}")
    runs = " / ".join(_f(x, ".0f") for x in rk["output_tok_s_runs"])
    vruns = " / ".join(_f(x, ".0f") for x in vl["output_tok_s_runs"])
    print(f"  tok/s per run: releasekit {runs}; vllm {vruns}")
    print(f"  releasekit flags: {', '.join(sorted(set(flags))) or 'none'}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", choices=["releasekit", "vllm"])
    ap.add_argument("--url")
    ap.add_argument("--points", default="1,4,16,64")
    ap.add_argument("--model-dir", default=str(REPO / "models" / "demo-base"))
    ap.add_argument("--out", default=str(RESULTS / "bench_vs_vllm.json"))
    ap.add_argument("--start-timeout", type=float, default=480.0, help="vLLM start, seconds")
    ap.add_argument("--reprint", help="print the tables of an earlier results JSON and exit")
    ap.add_argument(
        "--preload",
        choices=["on", "off"],
        default="off",
        help="start vLLM with tcmalloc and Intel OpenMP preloaded, or not (releasekit's "
        "default: off, `server_preload`)",
    )
    ns = ap.parse_args()
    if ns.reprint:
        old = json.loads(Path(ns.reprint).read_text())
        print(f"host: {old.get('host')}")
        for pt in old["points"]:
            rks, vls = summarise(pt["releasekit_runs"]), summarise(pt["vllm_runs"])
            flags = [f for r in pt["releasekit_runs"] for f in r.get("flags", [])]
            print_point(int(pt["concurrency"]), rks, vls, flags)
        return 0
    if ns.worker == "releasekit":
        _worker_releasekit(ns.url)
        return 0
    if ns.worker == "vllm":
        _worker_vllm(ns.url)
        return 0

    from releasekit.serving.host import server_env
    from releasekit.serving.vllm import VLLMServer

    model_dir = Path(ns.model_dir)
    if not (model_dir / "config.json").is_file():
        print(f"no model at {model_dir}: run `dvc repro demo-model` first", file=sys.stderr)
        return 1
    points = [int(x) for x in ns.points.split(",")]
    RESULTS.mkdir(parents=True, exist_ok=True)
    started = time.time()
    server = VLLMServer(
        model_dir,
        served_name=MODEL,
        engine_args={
            "dtype": "bfloat16",
            "max-model-len": "512",
            "max-num-seqs": str(MAX_NUM_SEQS),
            "enforce-eager": "",
        },
        env={
            "VLLM_CPU_KVCACHE_SPACE": "1",
            **server_env(python=Path(sys.executable), preload=ns.preload == "on"),
        },
        python=Path(sys.executable),
        log_path=RESULTS / f"bench_vs_vllm.server.{ns.preload}.log",
        start_timeout_s=ns.start_timeout,
    )
    report: dict[str, Any] = {
        "workload": {
            "api": "completions",
            "prompt_tokens": PROMPT_TOKENS,
            "output_tokens": OUTPUT_TOKENS,
            "ignore_eos": True,
            "temperature": 0,
            "max_num_seqs": MAX_NUM_SEQS,
            "order": "releasekit, vllm, vllm, releasekit at each concurrency",
            "preload": ns.preload,
        },
        "host": {"cpus": os.cpu_count(), "loadavg_start": os.getloadavg()},
        "points": [],
    }
    workers: list[Worker] = []
    with server:
        url = server.base_url
        print(f"vLLM up at {url} after {time.time() - started:.0f} s", flush=True)
        rk, vl = Worker("releasekit", url), Worker("vllm", url)
        workers = [rk, vl]
        try:
            rk.run(concurrency=4, requests=32, seed=999)  # warm the server; discarded
            seed = 1
            for c in points:
                n = requests_for(c)
                runs: dict[str, list[dict[str, Any]]] = {"releasekit": [], "vllm": []}
                for w in (rk, vl, vl, rk):
                    seed += 1
                    out, srv = _server_window(
                        url,
                        lambda w=w, seed=seed, c=c, n=n: w.run(
                            concurrency=c, requests=n, seed=seed, tokenizer=str(model_dir)
                        ),
                    )
                    runs[w.kind].append({**out, **srv})
                rks, vls = summarise(runs["releasekit"]), summarise(runs["vllm"])
                flags = [f for r in runs["releasekit"] for f in r.get("flags", [])]
                print_point(c, rks, vls, flags)
                report["points"].append(
                    {
                        "concurrency": c,
                        "requests_per_run": n,
                        "releasekit": rks,
                        "vllm": vls,
                        "releasekit_runs": runs["releasekit"],
                        "vllm_runs": runs["vllm"],
                    }
                )
        finally:
            for w in workers:
                w.close()
    report["host"]["loadavg_end"] = os.getloadavg()
    report["wall_s"] = round(time.time() - started, 1)
    write_result(Path(ns.out), report)
    print(f"\nwrote {ns.out} ({report['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
