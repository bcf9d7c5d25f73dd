"""The demo's healthy release shadowed again and again, with real vLLM: does its comparison
with stable pass every time, or does its verdict move with the host?

    .venv/bin/python benchmarks/shadow_repeat.py [--runs 5] [--window 40] [--share 0.25]
        [--clients 6] [--out PATH]

On a throwaway copy of the project (the demo model linked), environment `staging` on a
gateway port of 34900-34999 and vLLM on 34000-34899, with the repository's policy for
comparisons (`comparison_baseline = "fresh"`, committed):

1. promote demo-bf16's serving (`demo-stable`) and start the demo's live traffic:
   `--clients` clients streaming back to back through the gateway, half completions and
   half templated chat, greedy, 32 tokens each (`ignore_eos`), as scripts/demo_traffic.py
   sends;
2. `--runs` times: `shadow start` of the demo's healthy release (demo-canary-good's
   serving and canary checks: bf16, 2 GiB of KV cache) at `--share`, which also starts a
   fresh server of stable; `shadow compare` over `--window` seconds; `shadow stop` (both
   servers stop, so every run starts both fresh).

Recorded per run: the verdict and its reason, each check's figures (candidate, baseline,
limit, share above it, p-value, and where the figure came from: the servers' own vLLM
counters or the gateway's), the answer agreement with its interval, the copies sent and
dropped. The clients count their own requests and failures (a second count beside the
gateway's). Prints a table and writes benchmarks/results/shadow_repeat.json. Needs
models/demo-base and vLLM.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from _demo_project import (
    ENV,
    FORCE_ALL,
    REPO,
    machine_info,
    make_project,
    preflight,
    use_project,
    write_release,
)
from _results import RESULTS, write_result

PORTS_VLLM = "34000-34899"
PORTS_GATEWAY = (34900, 34999)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Traffic:
    """The demo's live traffic (scripts/demo_traffic.py's requests): `n` clients streaming
    back to back; each counts its requests and failures."""

    def __init__(self, url: str, n: int) -> None:
        self.url, self.n = url, n
        self.sent = 0
        self.failed = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(k,)) for k in range(n)]

    def _run(self, k: int) -> None:
        with httpx.Client(base_url=self.url, timeout=120, trust_env=False) as c:
            i = 0
            while not self._stop.is_set():
                question = f"Question {k}-{i}: what is 2 + {i % 7}?"
                path = "/v1/completions"
                body: dict[str, Any] = {"model": "demo", "prompt": question}
                if i % 2:
                    path = "/v1/templates/chat/chat/completions"
                    body = {"variables": {"question": question}}
                body.update(max_tokens=32, stream=True, ignore_eos=True, temperature=0)
                i += 1
                try:
                    with c.stream("POST", path, json=body) as r:
                        ok = r.status_code == 200 and any(
                            line.startswith("data: [DONE]") for line in r.iter_lines()
                        )
                except httpx.HTTPError:
                    ok = False
                with self._lock:
                    self.sent += 1
                    self.failed += not ok

    def start(self) -> Traffic:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=130)


def healthy_promotion() -> str:
    """demo-canary-good's `promotion:` block (its canary checks judge the shadow too)."""
    text = (REPO / "manifests" / "demo-canary-good.yaml").read_text()
    return text[text.index("promotion:") :]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--window", type=float, default=40.0)
    ap.add_argument("--share", type=float, default=0.25)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--start-timeout", type=float, default=900)
    ap.add_argument("--out", type=Path, default=RESULTS / "shadow_repeat.json")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    preflight()
    tmp = Path(tempfile.mkdtemp(prefix="shadow-repeat-"))
    root = make_project(tmp, gateway_ports=PORTS_GATEWAY, warm_s=0)
    use_project(root, ports_vllm=PORTS_VLLM, actor="shadow-repeat",
                start_timeout=args.start_timeout)  # fmt: skip
    toml = root / "releasekit.toml"
    toml.write_text(toml.read_text() + 'comparison_baseline = "fresh"\n')
    git = ["git", "-c", "user.name=bench", "-c", "user.email=b@example.com"]
    subprocess.run([*git, "commit", "-qam", "policy"], cwd=root, check=True)

    from releasekit.config import load_settings
    from releasekit.promote.deploy import down
    from releasekit.rollout.progressive import promote_progressive
    from releasekit.rollout.shadow import compare_shadow, start_shadow, stop_shadow
    from releasekit.spec.lock import lock

    settings = load_settings(root=root)
    result: dict[str, Any] = {
        "machine": machine_info(),
        "setup": {
            "runs": args.runs,
            "window_s": args.window,
            "share": args.share,
            "clients": args.clients,
            "baseline": "fresh (committed policy)",
        },
        "runs": [],
    }
    traffic: Traffic | None = None
    try:
        stable = write_release(root, "demo-stable", max_num_seqs=32)
        healthy = write_release(
            root, "demo-healthy", max_num_seqs=32, extra=healthy_promotion(),
            replace={'VLLM_CPU_KVCACHE_SPACE: "1"': 'VLLM_CPU_KVCACHE_SPACE: "2"'},
        )  # fmt: skip
        rid = lock(healthy, root=root).release_id
        log("promoting the stable release ...")
        res = promote_progressive(settings, str(stable), env=ENV, reason="stable",
                                  force=FORCE_ALL)  # fmt: skip
        if not res.ok:
            raise SystemExit(f"stable release did not go live: {res.deploy}")
        traffic = Traffic(res.gateway_url or "", args.clients).start()
        time.sleep(10)
        for n in range(1, args.runs + 1):
            log(f"run {n}: shadow start ...")
            t0 = time.time()
            status = start_shadow(settings, rid, env=ENV, share=args.share, reason=f"run {n}")
            started = time.time() - t0
            sent0, failed0 = traffic.sent, traffic.failed
            cmp = compare_shadow(settings, env=ENV, window_s=args.window)
            sent1, failed1 = traffic.sent, traffic.failed
            stop_shadow(settings, env=ENV, reason=f"run {n} done")
            log(f"  {cmp.verdict}: {cmp.reason}")
            ag = cmp.agreement
            result["runs"].append(
                {
                    "run": n,
                    "verdict": cmp.verdict,
                    "reason": cmp.reason,
                    "judged_against": cmp.judged_against,
                    "fresh_baseline": status.baseline_url is not None,
                    "start_s": round(started, 1),
                    "mirrored": cmp.mirrored,
                    "dropped": cmp.dropped,
                    "candidate_requests": cmp.judgement.canary_requests,
                    "baseline_requests": cmp.judgement.stable_requests,
                    "checks": [
                        c.model_dump(mode="json", exclude={"window_start", "window_end"})
                        for c in cmp.judgement.checks
                    ],
                    "agreement": ag.model_dump(mode="json") if ag is not None else None,
                    "clients_in_window": {"requests": sent1 - sent0, "failed": failed1 - failed0},
                }
            )
        result["clients"] = {"requests": traffic.sent, "failed": traffic.failed}
    finally:
        if traffic is not None:
            traffic.stop()
        down(load_settings(root=root), ENV, reason="shadow repeat done")
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    verdicts = [r["verdict"] for r in result["runs"]]
    result["passed"] = sum(v == "pass" for v in verdicts)
    write_result(args.out, result)
    print(f"{'run':>3} {'verdict':8} {'TTFT p95 cand/base (limit)':>30} {'agree':>9} "
          f"{'copies':>7} {'clients failed':>14}")  # fmt: skip
    for r in result["runs"]:
        ttft = next((c for c in r["checks"] if c["metric"] == "ttft_p95_s"), None)
        t = (
            f"{ttft['canary']:.3f}/{ttft['stable']:.3f} ({ttft['limit']:.3f})"
            if ttft
            and ttft["canary"] is not None
            and ttft["stable"] is not None
            and ttft["limit"] is not None
            else "-"
        )
        ag = r["agreement"] or {}
        agree = f"{ag.get('agreeing', '-')}/{ag.get('pairs', '-')}"
        print(f"{r['run']:>3} {r['verdict']:8} {t:>30} {agree:>9} {r['mirrored']:>7} "
              f"{r['clients_in_window']['failed']:>14}")  # fmt: skip
    print(f"{result['passed']} of {len(verdicts)} passed; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
