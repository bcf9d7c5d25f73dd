"""Canary benchmark: a `max-num-seqs: 1` release promoted with canary steps under steady
streaming load, on the demo with real vLLM; and a healthy release the same way (control).

    flock /work/scratch/heavy.lock nice -n 5 .venv/bin/python benchmarks/canary_bench.py \
        [--concurrency 12] [--max-tokens 48] [--first-weight 25] [--out PATH] [--keep]

On a throwaway copy of the project (the demo model linked), environment `staging` on a
gateway port of 32900-32999 and vLLM on 32000-32899:

1. promote the stable release (demo-bf16's serving, `max-num-seqs: 32`);
2. start steady streaming load: `--concurrency` clients back to back, `--max-tokens` each
   (`ignore_eos`), through the gateway;
3. promote the `max-num-seqs: 1` release with canary steps (`--first-weight`% -> 50% ->
   100%, judged every 2 s, checks: TTFT p95 within 1.5x stable + 50 ms, error rate);
   it should breach at its first step and go back to 0%;
4. promote a healthy release (`max-num-seqs: 16`, its own vLLM server) the same way, and
   then a prompt-only change (the stable release's server, edge figures only): controls
   that should reach 100%.

Measured for the aborted canary: the share of requests it served (the controller's count
from the gateway, and independently the clients' `x-releasekit-release` headers); the time
from the breach to 0% canary (the controller's clock, and independently a poller of the
gateway's admin state every 10 ms that notes when the canary's weight left the table);
the failed requests (non-200 or broken streams) and the canary's slow answers. Prints a
table and writes benchmarks/results/canary.json. Needs models/demo-base and vLLM.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
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
    make_project,
    preflight,
    stream_once,
    use_project,
    write_release,
)
from _results import RESULTS, write_result

PORTS_VLLM = "32000-32899"
PORTS_GATEWAY = (32900, 32999)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class Load:
    """`n` clients streaming completions back to back through the gateway."""

    url: str
    n: int
    max_tokens: int
    done: list[Response] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _client(self, k: int) -> None:
        with httpx.Client(base_url=self.url, timeout=120, trust_env=False) as c:
            i = k * 1_000_000
            while not self._stop.is_set():
                r = stream_once(c, i, self.max_tokens)
                i += 1
                with self._lock:
                    self.done.append(r)

    def start(self) -> Load:
        for k in range(self.n):
            t = threading.Thread(target=self._client, args=(k,), daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)

    def between(self, t0: float, t1: float) -> list[Response]:
        with self._lock:
            return [r for r in self.done if t0 <= r.started <= t1]


@dataclass
class WeightWatch:
    """Polls the gateway's admin state every 10 ms: when `release` last had weight > 0."""

    url: str
    token: str
    release: str
    last_routed: float | None = None
    first_gone_after_routed: float | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _t: threading.Thread | None = None

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=5, trust_env=False,
                          headers={"authorization": f"Bearer {self.token}"}) as c:  # fmt: skip
            while not self._stop.is_set():
                try:
                    st = c.get("/admin/state").json()
                except (httpx.HTTPError, ValueError):
                    time.sleep(0.01)
                    continue
                now = time.time()
                routed = any(
                    r["release_id"] == self.release and r["share"] > 0 for r in st["routes"]
                )
                if routed:
                    self.last_routed = now
                    self.first_gone_after_routed = None
                elif self.last_routed is not None and self.first_gone_after_routed is None:
                    self.first_gone_after_routed = now
                time.sleep(0.01)

    def start(self) -> WeightWatch:
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._t is not None:
            self._t.join(timeout=5)


SEGMENTS = (
    ("edge_ttft_p95_s", "edge", "ttft_p95_s"),
    ("edge_upstream_wait_mean_s", "edge", "upstream_wait_mean_s"),
    ("engine_ttft_mean_s", "engine", "ttft_mean_s"),
    ("engine_queue_mean_s", "engine", "queue_mean_s"),
    ("engine_prefill_mean_s", "engine", "prefill_mean_s"),
    ("engine_decode_mean_s", "engine", "decode_mean_s"),
    ("engine_tpot_p95_s", "engine", "tpot_p95_s"),
)


@dataclass
class SegmentTrace:
    """Every `every_s` while a canary runs on its own server: the canary's and stable's
    figures over the same window, split into vLLM's own per-request segments (queue,
    prefill, decode) next to the gateway's edge TTFT; where the canary's time goes."""

    settings: Any
    release: str
    stable: str
    every_s: float = 4.0
    windows: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _t: threading.Thread | None = None

    def _urls(self) -> tuple[str, str, str] | None:
        from releasekit.deploy.state import read_state

        st = read_state(self.settings.state_dir, ENV)
        # A canary stays `starting` in the state until the switch: any role; the scrape
        # below tells whether its server answers yet.
        by = {s.release_id: s for s in st.servers}
        c, s = by.get(self.release), by.get(self.stable)
        if st.gateway is None or c is None or s is None or c.base_url == s.base_url:
            return None
        return st.gateway.url, c.base_url, s.base_url

    def _run(self) -> None:
        try:
            self._trace()
        except Exception as exc:  # a benchmark's side measurement: say why it stopped
            self.error = f"{type(exc).__name__}: {exc}"
            log(f"  segment trace stopped: {self.error}")

    def _trace(self) -> None:
        from releasekit.rollout.canary import pair_windows, scrape_pair

        urls = None
        while urls is None and not self._stop.wait(0.5):
            try:
                urls = self._urls()
            except Exception as exc:  # state being rewritten: try again
                self.error = f"{type(exc).__name__}: {exc}"
        if urls is None:
            return
        t_ready = time.time()
        with httpx.Client(trust_env=False) as http:
            before = scrape_pair(http, *urls, timeout_s=5)
            while not self._stop.wait(self.every_s):
                after = scrape_pair(http, *urls, timeout_s=5)
                if all(x is not None for x in (*before[1:], *after[1:])):
                    cw, sw = pair_windows(ENV, self.release, self.stable, before, after)
                    row: dict[str, Any] = {
                        "t_s": round(after[0] - t_ready, 1),
                        "requests": [cw.requests, sw.requests],
                    }
                    for name, side, metric in SEGMENTS:
                        vals = []
                        for w in (cw, sw):
                            win = w.edge if side == "edge" else w.engine
                            v = win.figure(metric).value if win is not None else None
                            vals.append(None if v is None else round(v, 4))
                        row[name] = vals
                    self.windows.append(row)
                before = after

    def start(self) -> SegmentTrace:
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._t is not None:
            self._t.join(timeout=15)


def policy(first_weight: float) -> str:
    return (
        "promotion:\n  canary:\n    interval_s: 2\n    sustain: 4\n    steps:\n"
        f"      - {{weight: {first_weight:g}, min_duration_s: 40, min_requests: 20, "
        "max_duration_s: 240}\n"
        "      - {weight: 50, min_duration_s: 30, min_requests: 20, max_duration_s: 240}\n"
        "      - {weight: 100}\n"
        "    checks:\n"
        "      - {metric: ttft_p95_s, tolerance: 0.5, slack: 0.05, min_samples: 20}\n"
        "      - {metric: tpot_p95_s, tolerance: 0.5, slack: 0.005, min_samples: 10, "
        "required: false}\n"
        "      - {metric: error_rate, tolerance: 0, slack: 0.02, min_samples: 10}\n"
    )


def _pair(v: list[float | None]) -> str:
    return "/".join("-" if x is None else f"{x:.3g}" for x in v)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--first-weight", type=float, default=25.0)
    ap.add_argument("--start-timeout", type=float, default=900)
    ap.add_argument("--out", type=Path, default=RESULTS / "canary.json")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    preflight()
    tmp = Path(tempfile.mkdtemp(prefix="canary-bench-"))
    root = make_project(tmp, gateway_ports=PORTS_GATEWAY, warm_s=0)
    use_project(root, ports_vllm=PORTS_VLLM, actor="canary-bench", start_timeout=args.start_timeout)
    # The controller's lease: short enough to matter, long enough for a busy 2-CPU host.
    toml = root / "releasekit.toml"
    toml.write_text(toml.read_text() + "canary_lease_s = 10\n")

    from releasekit.config import load_settings
    from releasekit.deploy.state import read_state
    from releasekit.promote.deploy import down
    from releasekit.rollout.progressive import promote_progressive
    from releasekit.stores.ledger import open_ledger

    settings = load_settings(root=root)
    result: dict[str, Any] = {
        "machine": machine_info(),
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "first_weight": args.first_weight,
        "runs": {},
    }
    load: Load | None = None
    try:
        stable = write_release(root, "demo-stable", max_num_seqs=32)
        bad = write_release(root, "demo-canary-seqs1", max_num_seqs=1,
                            extra=policy(args.first_weight))  # fmt: skip
        good = write_release(root, "demo-canary-seqs16", max_num_seqs=16,
                             extra=policy(args.first_weight))  # fmt: skip
        # A prompt-only change: the same serving key, so the same vLLM server as stable.
        sysp = root / "prompts" / "demo" / "system.txt"
        (sysp.parent / "system-canary.txt").write_text(sysp.read_text().rstrip() + " Be brief.\n")
        prompt = write_release(
            root, "demo-canary-prompt", max_num_seqs=32, extra=policy(args.first_weight),
            replace={"prompts/demo/system.txt": "prompts/demo/system-canary.txt"},
        )  # fmt: skip
        log("promoting the stable release (max-num-seqs 32) ...")
        t = time.time()
        res = promote_progressive(settings, str(stable), env=ENV, reason="stable",
                                  force=FORCE_ALL)  # fmt: skip
        if not res.ok:
            raise SystemExit(f"stable release did not go live: {res.deploy}")
        log(f"  live after {time.time() - t:.0f} s")
        url = res.gateway_url or ""
        load = Load(url, args.concurrency, args.max_tokens).start()
        time.sleep(10)
        for label, manifest in (("seqs1", bad), ("seqs16", good), ("prompt", prompt)):
            gw = read_state(settings.state_dir, ENV).gateway
            assert gw is not None
            log(f"promoting {manifest.stem} with canary steps under load ...")
            from releasekit.spec.lock import lock

            rid = lock(manifest, root=root).release_id
            watch = WeightWatch(gw.url, gw.admin_token, rid).start()
            stable_rid = lock(stable, root=root).release_id
            trace = SegmentTrace(settings, rid, stable_rid).start()
            t0 = time.time()
            res = promote_progressive(
                settings, str(manifest), env=ENV, reason=f"canary {label}", force=FORCE_ALL,
                progress=lambda label, done, total: log(f"  {label}"),
            )  # fmt: skip
            t1 = time.time()
            time.sleep(3)
            watch.stop()
            trace.stop()
            can = res.canary or {}
            reqs = load.between(t0, t1)
            by_canary = [r for r in reqs if r.release == rid]
            failed = [r for r in reqs if not r.ok]
            ttft = sorted(
                (r.first - r.started) for r in reqs if r.ok and r.first and r.release != rid
            )
            ttft_c = sorted((r.first - r.started) for r in by_canary if r.ok and r.first)

            def p95(xs: list[float]) -> float | None:
                return xs[min(len(xs) - 1, int(0.95 * len(xs)))] if xs else None

            at_zero = can.get("at_zero_at")
            run = {
                "release_id": rid,
                "status": res.status,
                "outcome": can.get("outcome"),
                "steps": [
                    {
                        k: s.get(k)
                        for k in (
                            "index",
                            "weight",
                            "status",
                            "canary_requests",
                            "stable_requests",
                            "reason",
                        )
                    }
                    | {
                        "seconds": round(s["ended_at"] - s["started_at"], 2),
                        "checks": (s.get("judgement") or {}).get("checks", []),
                    }
                    for s in can.get("steps", [])
                ],
                "controller": {
                    "canary_served": can.get("canary_served"),
                    "total_served": can.get("total_served"),
                    "share": (can["canary_served"] / can["total_served"])
                    if can.get("total_served")
                    else None,
                    "decide_to_zero_s": can.get("decide_to_zero_s"),
                    "window_to_zero_s": can.get("window_to_zero_s"),
                },
                "clients": {
                    "requests": len(reqs),
                    "canary_requests": len(by_canary),
                    "share": len(by_canary) / len(reqs) if reqs else None,
                    "failed": len(failed),
                    "failures": [r.error for r in failed][:10],
                    "ttft_p95_stable_s": p95(ttft),
                    "ttft_p95_canary_s": p95(ttft_c),
                    "canary_requests_after_zero": sum(
                        1 for r in by_canary if at_zero and r.started > at_zero + 0.05
                    ),
                },
                "admin_poll": {
                    "canary_weight_gone_at": watch.first_gone_after_routed,
                    "controller_at_zero_at": at_zero,
                    "delta_s": (watch.first_gone_after_routed - at_zero)
                    if watch.first_gone_after_routed and at_zero
                    else None,
                },
                "promote_s": round(t1 - t0, 1),
                "warmup": {"answered": can.get("warmup_answered"), "s": can.get("warmup_s")},
                # [canary, stable] per window from the canary server's health on; none
                # when the canary shares stable's server.
                "segments": trace.windows,
                "segments_error": trace.error,
            }
            result["runs"][label] = run
            log(f"  -> {res.status} ({can.get('outcome')}) in {t1 - t0:.0f} s")
        led = open_ledger(settings, read_only=True)
        ab = led.records(environment=ENV, types=["canary_aborted"])
        result["ledger"] = {
            "canary_aborted": [{"to": r.to_release, "reason": r.reason,
                                "breaches": r.evidence.get("breaches")} for r in ab],
            "canary_steps": len(led.records(environment=ENV, types=["canary_step"])),
        }  # fmt: skip
    finally:
        if load is not None:
            load.stop()
        down(load_settings(root=root), ENV, reason="canary bench done")
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    write_result(args.out, result)
    print(f"{'run':8} {'status':15} {'steps':>5} {'share':>7} {'client share':>12} "
          f"{'->0% s':>7} {'poll->0% s':>10} {'failed':>6}")  # fmt: skip
    for label, r in result["runs"].items():
        c, cl, ap_ = r["controller"], r["clients"], r["admin_poll"]
        share = f"{c['share']:.1%}" if c["share"] is not None else "-"
        cshare = f"{cl['share']:.1%}" if cl["share"] is not None else "-"
        z = f"{c['decide_to_zero_s']:.3f}" if c["decide_to_zero_s"] is not None else "-"
        pz = f"{ap_['delta_s']:+.3f}" if ap_["delta_s"] is not None else "-"
        print(f"{label:8} {r['status']:15} {len(r['steps']):>5} {share:>7} {cshare:>12} "
              f"{z:>7} {pz:>10} {cl['failed']:>6}")  # fmt: skip
    for label, r in result["runs"].items():
        for w in r["segments"]:
            segs = " ".join(
                f"{name.removesuffix('_s')} {_pair(w[name])}" for name, _, _ in SEGMENTS
            )
            print(f"{label:8} t={w['t_s']:>5}s canary/stable req {_pair(w['requests'])} {segs}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
