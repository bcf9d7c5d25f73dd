"""Canary placement probe: how the scheduler priority and the CPU placement of the canary's
and the stable release's vLLM servers bias the canary's figures, on the demo with real vLLM.

    flock /work/scratch/heavy.lock nice -n 5 .venv/bin/python benchmarks/canary_placement.py \
        [--concurrency 12] [--max-tokens 48] [--window 40] [--rounds 2] [--out PATH]

Two releases that serve alike (demo-bf16's serving, `max-num-seqs` 32 and 16: two vLLM
servers, the same speed at the load used) take half the traffic each: the second is
promoted with one canary step at 50% that never breaches and lasts the whole probe, under
`--concurrency` streaming clients through the gateway. During that step the probe sets, in
turn, each arrangement of the two servers:

- `canary_raised`: the canary's autogroup at nice -5, stable's at 0, each worker bound to
  its own core (what `canary_nice` did);
- `equal_0_bound` / `equal_-5_bound`: both at the same nice, each worker on its own core;
- `equal_0_spread` / `equal_-5_spread`: both at the same nice, every thread of both servers
  free to run on every core;

and after `--settle` seconds measures a `--window` of both servers over the same seconds:
vLLM's own per-request segments (queue, prefill, decode), engine TPOT p95 and TTFT, the
gateway's edge TTFT p95, and the clients' TTFT by release. With equal traffic and equal
serving, an unbiased arrangement gives both sides the same figures; the ratio canary /
stable is the bias. Writes benchmarks/results/canary_placement.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _demo_project import (
    ENV,
    FORCE_ALL,
    machine_info,
    make_project,
    preflight,
    use_project,
    write_release,
)
from _results import RESULTS, write_result
from canary_bench import SEGMENTS, Load

PORTS_VLLM = "32000-32899"
PORTS_GATEWAY = (32900, 32999)

ARRANGEMENTS: dict[str, tuple[int, int, bool]] = {
    # name: (canary nice, stable nice, spread)
    "canary_raised": (-5, 0, False),
    "equal_0_bound": (0, 0, False),
    "equal_-5_bound": (-5, -5, False),
    "equal_0_spread": (0, 0, True),
    "equal_-5_spread": (-5, -5, True),
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def policy(hold_s: float) -> str:
    return (
        "promotion:\n  canary:\n    interval_s: 5\n    sustain: 1000\n    settle_s: 0\n"
        "    steps:\n"
        f"      - {{weight: 50, min_duration_s: {hold_s:.0f}, min_requests: 1, "
        f"max_duration_s: {hold_s + 600:.0f}}}\n"
        "      - {weight: 100}\n"
        "    checks:\n"
        "      - {metric: error_rate, tolerance: 0, slack: 1.0, min_samples: 1}\n"
    )


def p(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 4) if xs else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--window", type=float, default=40.0)
    ap.add_argument("--settle", type=float, default=6.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--start-timeout", type=float, default=900)
    ap.add_argument("--out", type=Path, default=RESULTS / "canary_placement.json")
    args = ap.parse_args()
    preflight()
    tmp = Path(tempfile.mkdtemp(prefix="canary-placement-"))
    root = make_project(tmp, gateway_ports=PORTS_GATEWAY, warm_s=0)
    use_project(root, ports_vllm=PORTS_VLLM, actor="canary-placement",
                start_timeout=args.start_timeout)  # fmt: skip
    toml = root / "releasekit.toml"
    toml.write_text(toml.read_text() + "canary_lease_s = 10\n")

    from releasekit.config import load_settings
    from releasekit.deploy.state import read_state
    from releasekit.promote.deploy import down
    from releasekit.rollout.canary import pair_windows, scrape_pair
    from releasekit.rollout.progressive import promote_progressive
    from releasekit.rollout.state import read_rollout
    from releasekit.serving.host import (
        autogroup_nice,
        raise_priority,
        restore_affinity,
        spread_session,
    )
    from releasekit.spec.lock import lock

    names = list(ARRANGEMENTS)
    order = [n for r in range(args.rounds) for n in (names if r % 2 == 0 else names[::-1])]
    hold = len(order) * (args.window + args.settle) + 60
    # The probe sets the priorities itself: promote leaves both servers as they are.
    settings = load_settings(root=root).model_copy(update={"canary_judge_nice": None})
    result: dict[str, Any] = {
        "machine": machine_info(),
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "window_s": args.window,
        "settle_s": args.settle,
        "arrangements": {
            k: {"canary_nice": v[0], "stable_nice": v[1], "spread": v[2]}
            for k, v in ARRANGEMENTS.items()
        },
        "windows": [],
    }
    load: Load | None = None
    promoted: dict[str, Any] = {}
    try:
        stable = write_release(root, "demo-stable", max_num_seqs=32)
        cand = write_release(root, "demo-placement", max_num_seqs=16, extra=policy(hold))
        log("promoting the stable release ...")
        res = promote_progressive(settings, str(stable), env=ENV, reason="stable",
                                  force=FORCE_ALL)  # fmt: skip
        if not res.ok:
            raise SystemExit(f"stable release did not go live: {res.deploy}")
        load = Load(res.gateway_url or "", args.concurrency, args.max_tokens).start()
        srid, crid = lock(stable, root=root).release_id, lock(cand, root=root).release_id

        def promote() -> None:
            r = promote_progressive(settings, str(cand), env=ENV, reason="placement probe",
                                    force=FORCE_ALL)  # fmt: skip
            promoted["status"] = r.status

        th = threading.Thread(target=promote, daemon=True)
        th.start()
        log("waiting for the canary step ...")
        while read_rollout(settings, ENV) is None:
            if not th.is_alive():
                raise SystemExit(f"promote ended before its canary step: {promoted}")
            time.sleep(1)
        st = read_state(settings.state_dir, ENV)
        by = {s.release_id: s for s in st.servers}
        c, s = by[crid], by[srid]
        assert st.gateway is not None
        urls = (st.gateway.url, c.base_url, s.base_url)
        sid_c, sid_s = os.getsid(c.pid), os.getsid(s.pid)
        time.sleep(10)  # past the warm-up burst
        for n in order:
            cn, sn, spread = ARRANGEMENTS[n]
            raise_priority(sid_c, cn)
            raise_priority(sid_s, sn)
            undo = [spread_session(sid_c), spread_session(sid_s)] if spread else []
            time.sleep(args.settle)
            with __import__("httpx").Client(trust_env=False) as http:
                before = scrape_pair(http, *urls, timeout_s=10)
                time.sleep(args.window)
                after = scrape_pair(http, *urls, timeout_s=10)
            for u in undo:
                restore_affinity(u)
            row: dict[str, Any] = {
                "arrangement": n,
                "nice_read": [autogroup_nice(sid_c), autogroup_nice(sid_s)],
            }
            if all(x is not None for x in (*before[1:], *after[1:])):
                cw, sw = pair_windows(ENV, crid, srid, before, after)
                row["requests"] = [cw.requests, sw.requests]
                for name, side, metric in SEGMENTS:
                    vals = []
                    for w in (cw, sw):
                        win = w.edge if side == "edge" else w.engine
                        v = win.figure(metric).value if win is not None else None
                        vals.append(None if v is None else round(v, 4))
                    row[name] = vals
            reqs = load.between(before[0], after[0])
            row["client_ttft_p50_s"] = [
                p([r.first - r.started for r in reqs if r.ok and r.first and r.release == x], 0.5)
                for x in (crid, srid)
            ]
            row["client_ttft_p95_s"] = [
                p([r.first - r.started for r in reqs if r.ok and r.first and r.release == x], 0.95)
                for x in (crid, srid)
            ]
            row["failed"] = sum(1 for r in reqs if not r.ok)
            result["windows"].append(row)
            log(
                f"  {n:16} tpot_p95 {row.get('engine_tpot_p95_s')} decode "
                f"{row.get('engine_decode_mean_s')} client ttft p50 {row['client_ttft_p50_s']}"
            )
        raise_priority(sid_c, 0)
        raise_priority(sid_s, 0)
        load.stop()
        load = None
        th.join(timeout=hold + 600)
        result["promote_status"] = promoted.get("status")
    finally:
        if load is not None:
            load.stop()
        down(load_settings(root=root), ENV, reason="placement probe done")
        shutil.rmtree(tmp, ignore_errors=True)
    summary: dict[str, Any] = {}
    for n in names:
        rows = [w for w in result["windows"] if w["arrangement"] == n and "requests" in w]
        summary[n] = {
            metric: [
                [w[metric][0] for w in rows],
                [w[metric][1] for w in rows],
            ]
            for metric in (
                "engine_tpot_p95_s",
                "engine_decode_mean_s",
                "engine_ttft_mean_s",
                "edge_ttft_p95_s",
                "client_ttft_p50_s",
                "requests",
            )
        }
    result["summary"] = summary
    write_result(args.out, result)
    for n, v in summary.items():
        print(n, {k: v[k] for k in ("engine_tpot_p95_s", "engine_decode_mean_s",
                                    "client_ttft_p50_s")})  # fmt: skip
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
