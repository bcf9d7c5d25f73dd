"""Abuse benchmark: the attacks of a holdout review, replayed against a started gateway (its
own process, in front of a fake upstream), a started Alertmanager receiver (its own process)
and a signed ledger in a scratch git repository. No vLLM needed.

    nice -n 10 .venv/bin/python benchmarks/abuse_bench.py [--out PATH] [--quick]

Prints one line per attack: what was sent, the outcome, whether it held, and the peak
resident memory of the process attacked during that attack (VmHWM, reset before each attack
through /proc/PID/clear_refs; the ledger attacks run in this process). Writes
benchmarks/results/abuse.json with the date, the host's cores and CPU flags and the command.

The gateway runs with its defaults except: two client keys, `stream_idle_timeout_s` 2 s and
`upstream_first_byte_timeout_s` 2 s (so the client-side attacks finish in seconds),
`max_request_bytes` 1 MiB (the size limit attacked).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route as SRoute

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from releasekit.deploy.gateway import GatewayConfig, PromptTemplate, Route  # noqa: E402
from releasekit.deploy.gateway_client import GatewayClient, launch_gateway  # noqa: E402
from releasekit.watch.windows import Snapshot, build_window, parse_exposition  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
from _results import RESULTS, write_result  # noqa: E402

KEY_A, KEY_B = "abuse-key-a-" + secrets.token_hex(8), "abuse-key-b-" + secrets.token_hex(8)
PLAIN = {"model": "demo", "prompt": "hi", "max_tokens": 4}
STREAM = {**PLAIN, "stream": True}


# ----------------------------------------------------------------------------- helpers


def peak_kib(pid: int) -> int | None:
    """The process's peak resident memory (VmHWM) in KiB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def reset_peak(pid: int) -> None:
    """Reset VmHWM to the current RSS (Linux: write 5 to clear_refs)."""
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/clear_refs").write_text("5")


class FakeUpstream:
    """A fake vLLM on loopback: answers, streams (padded), hangs until the caller leaves,
    and records every request that reaches it (any path)."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.cancelled = 0
        self._seq = 0

    def app(self) -> Starlette:
        async def completions(request: Request) -> Response:
            self.paths.append(request.url.path)
            body = await request.body()
            h = request.headers
            if h.get("x-fake-hang"):
                for _ in range(12_000):
                    await asyncio.sleep(0.05)
                    if await request.is_disconnected():
                        self.cancelled += 1
                        return Response(status_code=499)
            self._seq += 1
            rid = f"cmpl-{self._seq}-{secrets.token_hex(4)}"
            payload = json.loads(body) if body else {}
            if not payload.get("stream"):
                return JSONResponse({"id": rid, "choices": [{"index": 0, "text": "hello"}]})
            pad = "x" * int(h.get("x-fake-pad", "0"))
            n = int(h.get("x-fake-chunks", "3"))

            async def events() -> Any:
                try:
                    for i in range(n):
                        obj = {"id": rid, "choices": [{"text": f"t{i}"}], "pad": pad}
                        yield b"data: " + json.dumps(obj).encode() + b"\n\n"
                        await asyncio.sleep(0)
                    yield b"data: [DONE]\n\n"
                except asyncio.CancelledError:
                    self.cancelled += 1
                    raise

            return StreamingResponse(events(), media_type="text/event-stream")

        async def anything(request: Request) -> Response:
            self.paths.append(request.url.path)
            return JSONResponse({"reached": request.url.path})

        every = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
        return Starlette(
            routes=[
                SRoute("/v1/completions", completions, methods=["POST"]),
                SRoute("/v1/chat/completions", completions, methods=["POST"]),
                SRoute("/{path:path}", anything, methods=every),
            ]
        )


def serve_in_thread(app: Any) -> tuple[uvicorn.Server, str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="error", lifespan="off", timeout_graceful_shutdown=1)
    )
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    return server, f"http://127.0.0.1:{port}"


def wait_until(cond: Callable[[], bool], timeout_s: float) -> float | None:
    """Seconds until cond() held, or None if it did not within timeout_s."""
    t = time.monotonic()
    while time.monotonic() - t < timeout_s:
        if cond():
            return time.monotonic() - t
        time.sleep(0.05)
    return None


# ----------------------------------------------------------------------------- gateway attacks


class GatewayAttacks:
    def __init__(self, url: str, pid: int, admin: str, up: FakeUpstream) -> None:
        self.url, self.pid, self.admin, self.up = url, pid, admin, up
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.addr = (host, int(port))
        self.auth = {"authorization": f"Bearer {KEY_A}"}
        self.gc = GatewayClient(url, admin_token=admin)

    def in_flight(self) -> int:
        return self.gc.state().in_flight_total

    def serving(self) -> bool:
        r = httpx.post(self.url + "/v1/completions", json=PLAIN, headers=self.auth, timeout=10)
        return r.status_code == 200

    def deep_json(self, n: int) -> dict[str, Any]:
        deep = b'{"variables": {"q": "x"}, "x": ' + b"[" * 1100 + b"]" * 1100 + b"}"
        codes: dict[int, int] = {}
        with httpx.Client(base_url=self.url, headers=self.auth, timeout=30) as c:
            for _ in range(n):
                r = c.post("/v1/templates/qa/chat/completions", content=deep)
                codes[r.status_code] = codes.get(r.status_code, 0) + 1
        held = codes == {400: n} and self.in_flight() == 0 and self.serving()
        return {
            "sent": f"{n} x {len(deep)} B of JSON nested 1,100 deep to the templated route",
            "outcome": f"statuses {codes}; in flight after: {self.in_flight()}",
            "held": held,
        }

    def header_flood(self, conns: int, mib: int) -> dict[str, Any]:
        accepted = []
        for _ in range(conns):
            with socket.create_connection(self.addr, timeout=10) as s:
                s.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-junk: ")
                sent = 0
                try:
                    while sent < mib << 20:
                        s.sendall(b"a" * 65536)
                        sent += 65536
                except OSError:
                    pass
                accepted.append(sent)
        up_before = len(self.up.paths)
        held = max(accepted) < 4 << 20 and self.serving() and len(self.up.paths) == up_before + 1
        return {
            "sent": f"{conns} connections x up to {mib} MiB of unfinished headers",
            "outcome": f"431 and closed; at most {max(accepted) // 1024} KiB left the client "
            "(most of it into socket buffers; the gateway reads at most the 60 KiB limit plus "
            "one socket read)",
            "held": held,
        }

    def header_dribble(self, conns: int, timeout_s: float) -> dict[str, Any]:
        socks = []
        for _ in range(conns):
            s = socket.create_connection(self.addr, timeout=5)
            s.sendall(b"GET /v1/models HTTP/1.1\r\n")
            socks.append(s)
        t = time.monotonic()
        while time.monotonic() - t < timeout_s + 3:
            for s in socks:
                with contextlib.suppress(OSError):
                    s.sendall(b"x")
            time.sleep(1.0)
        still_open = 0
        for s in socks:
            s.setblocking(False)
            try:
                s.recv(4096)  # the 408, or EOF: closed
            except BlockingIOError:
                still_open += 1  # nothing to read and not closed: still held open
            except OSError:
                pass  # reset: closed
            s.close()
        return {
            "sent": f"{conns} connections dribbling a header byte a second for "
            f"{timeout_s + 3:.0f} s",
            "outcome": f"{still_open} still open after {timeout_s + 3:.0f} s "
            f"(header timeout {timeout_s:g} s: 408, closed)",
            "held": still_open == 0 and self.serving(),
        }

    def chunked_body(self, mib: int, limit_mib: int) -> dict[str, Any]:
        head = (
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"authorization: Bearer " + KEY_A.encode() + b"\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        piece = b"x" * 65536
        chunk = b"%x\r\n" % len(piece) + piece + b"\r\n"
        sent, answer = 0, b""
        t = time.monotonic()
        with socket.create_connection(self.addr, timeout=10) as s:
            s.sendall(head)
            while sent < mib << 20:
                readable, writable, _ = select.select([s], [s], [], 5)
                if readable:
                    answer = s.recv(4096)
                    break
                if writable:
                    try:
                        s.sendall(chunk)
                    except OSError:
                        break
                    sent += len(piece)
            if not answer:
                s.settimeout(5)
                try:
                    answer = s.recv(4096)
                except OSError:
                    answer = b""
        took = time.monotonic() - t
        status = answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/1.1") else "reset"
        return {
            "sent": f"a {mib} MiB chunked body (no Content-Length) to a {limit_mib} MiB limit",
            "outcome": f"{status} after {sent / (1 << 20):.1f} MiB sent, {took:.2f} s",
            "held": status == "413" and sent < 8 << 20 and self.serving(),
        }

    def paths(self) -> dict[str, Any]:
        lines = [
            b"GET /v1/%2e%2e/%2e%2e/admin/secret",
            b"GET /v1/../../version",
            b"POST /v1/scale_elastic_ep",
            b"POST /v1/collective_rpc",
            b"POST /v1/sleep",
            b"POST /v1/update_weights",
            b"DELETE /v1/completions",
            b"POST /v1//completions",
            b"GET /v1/models%2F..%2F..%2Fversion",
        ]
        before = len(self.up.paths)
        codes = []
        for line in lines:
            with socket.create_connection(self.addr, timeout=5) as s:
                s.sendall(
                    line
                    + b" HTTP/1.1\r\nhost: x\r\nauthorization: Bearer "
                    + KEY_A.encode()
                    + b"\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}"
                )
                got = s.recv(4096)
            codes.append(int(got.split(b" ", 2)[1]) if got.startswith(b"HTTP/1.1") else 0)
        reached = len(self.up.paths) - before
        return {
            "sent": f"{len(lines)} requests: dot segments, encoded slashes, vLLM admin/dev "
            "routes, other methods",
            "outcome": f"statuses {sorted(set(codes))}; {reached} reached the upstream",
            "held": reached == 0 and all(c in (404, 405) for c in codes),
        }

    def stop_reading(self) -> dict[str, Any]:
        body = json.dumps(STREAM).encode()
        req = (
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"authorization: Bearer " + KEY_A.encode() + b"\r\n"
            b"x-fake-chunks: 100000\r\nx-fake-pad: 16384\r\ncontent-length: %d\r\n\r\n" % len(body)
        ) + body
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(self.addr)
        cancelled0 = self.up.cancelled
        s.sendall(req)
        s.recv(1024)
        freed = wait_until(lambda: self.in_flight() == 0, 30)
        s.close()
        return {
            "sent": "a stream whose client reads the headers, then nothing",
            "outcome": f"slot freed after {freed:.1f} s, upstream stream closed"
            if freed is not None
            else "slot still held after 30 s",
            "held": freed is not None and self.up.cancelled > cancelled0,
        }

    def leave_non_stream(self) -> dict[str, Any]:
        before = self.up.cancelled
        with contextlib.suppress(httpx.TimeoutException):
            httpx.post(
                self.url + "/v1/completions",
                json=PLAIN,
                headers={**self.auth, "x-fake-hang": "1"},
                timeout=0.3,
            )
        took = wait_until(lambda: self.up.cancelled > before and self.in_flight() == 0, 10)
        return {
            "sent": "a non-stream request whose client gives up after 0.3 s",
            "outcome": f"upstream request cancelled {took:.2f} s later, slot freed"
            if took is not None
            else "upstream still generating after 10 s",
            "held": took is not None,
        }

    def rollback_trigger(self) -> dict[str, Any]:
        def snap() -> Snapshot:
            text = httpx.get(self.url + "/metrics").text
            return Snapshot(t=time.monotonic(), gateway=parse_exposition(text))

        before = snap()
        with httpx.Client(base_url=self.url, headers=self.auth, timeout=30) as c:
            for _ in range(10):
                c.post("/v1/completions", json=PLAIN)
            for _ in range(10):  # outlast the first-byte timeout without streaming
                c.post("/v1/completions", json=PLAIN, headers={"x-fake-hang": "1"})
            for _ in range(20):
                c.get("/v1/models")
        for _ in range(10):
            with contextlib.suppress(httpx.TimeoutException):
                httpx.post(
                    self.url + "/v1/completions",
                    json=PLAIN,
                    headers={**self.auth, "x-fake-hang": "1"},
                    timeout=0.2,
                )
        wait_until(lambda: self.in_flight() == 0, 10)
        w = build_window(before, snap(), env="abuse", release="rel-a")
        err = w.figures["error_rate"].value
        return {
            "sent": "10 good requests, 10 non-stream past the first-byte timeout, 10 client "
            "hang-ups, 20 model-list calls",
            "outcome": f"window: {w.requests:g} requests, error_rate {err}, timeout_rate "
            f"{w.figures['timeout_rate'].value}",
            "held": err == 0 and w.requests == 30,
        }

    def feedback_hijack(self, n: int) -> dict[str, Any]:
        with httpx.Client(base_url=self.url, timeout=10) as c:
            ids = [
                c.post("/v1/completions", json=PLAIN, headers=self.auth).json()["id"]
                for _ in range(n)
            ]
            b = {"authorization": f"Bearer {KEY_B}"}
            counted = sum(
                c.post(
                    "/v1/feedback", json={"response_id": i, "score": "down"}, headers=b
                ).status_code
                == 200
                for i in ids
            )
            own = c.post(
                "/v1/feedback", json={"response_id": ids[0], "score": "down"}, headers=self.auth
            ).json()["counted"]
            again = c.post(
                "/v1/feedback", json={"response_id": ids[0], "score": "down"}, headers=self.auth
            ).json()["counted"]
        return {
            "sent": f"key B down-votes {n} responses served to key A; key A votes twice",
            "outcome": f"{counted} of key B's votes counted; key A's counted {own}, then {again}",
            "held": counted == 0 and own is True and again is False,
        }

    def wrong_keys(self, n: int) -> dict[str, Any]:
        codes: dict[int, int] = {}
        transport = httpx.HTTPTransport(local_address="127.0.0.2")
        with httpx.Client(base_url=self.url, transport=transport, timeout=10) as c:
            for i in range(n):
                r = c.post(
                    "/v1/completions", json=PLAIN, headers={"authorization": f"Bearer guess-{i}"}
                )
                codes[r.status_code] = codes.get(r.status_code, 0) + 1
        return {
            "sent": f"{n} wrong keys from one address",
            "outcome": f"statuses {codes} (throttled after the burst, key not checked)",
            "held": codes.get(429, 0) >= n - 20 and self.serving(),
        }

    def label_flood(self, n: int) -> dict[str, Any]:
        def count() -> int:
            return sum(
                1
                for ln in httpx.get(self.url + "/metrics").text.splitlines()
                if ln.startswith("releasekit_gateway_") and not ln.startswith("#")
            )

        before = count()
        with httpx.Client(base_url=self.url, headers=self.auth, timeout=10) as c:
            for i in range(n):
                c.post(f"/v1/made-up-{i}-{secrets.token_hex(4)}", json=PLAIN)
        grew = count() - before
        return {
            "sent": f"{n} requests to distinct made-up paths",
            "outcome": f"{grew} new metric samples",
            "held": grew <= 4,
        }


# ----------------------------------------------------------------------------- receiver attacks


RECEIVER = """
import sys, uvicorn
from pydantic import SecretStr
from releasekit.watch.receiver import ReceiverAuth, create_receiver
from releasekit.watch.watcher import RollbackOutcome

def rollback(req):
    return RollbackOutcome(status="rolled_back", env=req.env, from_release="r1", to_release="r0")

app = create_receiver(rollback=rollback, auth=ReceiverAuth(bearer_tokens=[SecretStr(sys.argv[1])]),
                      store_path=sys.argv[2], envs={"prod"}, max_body_bytes=1024 * 1024)

from starlette.responses import PlainTextResponse
from starlette.routing import Route
from prometheus_client import generate_latest
async def metrics(request):
    return PlainTextResponse(generate_latest(app.state.registry).decode())
app.router.routes.append(Route("/metrics", metrics))
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[3]), log_level="error")
"""


def alert(env: str, fp: str) -> dict[str, Any]:
    a = {
        "status": "firing",
        "labels": {"alertname": "X", "releasekit_env": env},
        "annotations": {},
        "startsAt": "2026-12-01T09:00:00Z",
        "fingerprint": fp,
    }
    return {
        "version": "4",
        "groupKey": "{}",
        "status": "firing",
        "receiver": "r",
        "alerts": [a],
    }


def receiver_attacks(tmp: Path, out: Callable[[str, dict[str, Any], int | None], None]) -> None:
    token = secrets.token_hex(16)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    proc = subprocess.Popen(
        [sys.executable, "-c", RECEIVER, token, str(tmp / "alerts.db"), str(port)],
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _up(url + "/healthz"), 30)
        auth = {"authorization": f"Bearer {token}"}
        reset_peak(proc.pid)
        with httpx.Client(timeout=10) as c:
            for i in range(200):
                c.post(url + "/alertmanager", json=alert(f"made-up-{i}", f"f{i}"), headers=auth)
            series = [
                ln
                for ln in c.get(url + "/metrics").text.splitlines()
                if ln.startswith("releasekit_receiver_alerts_total")
            ]
        out(
            "receiver_label_flood",
            {
                "sent": "200 alerts naming 200 made-up environments",
                "outcome": f"{len(series)} series of releasekit_receiver_alerts_total",
                "held": len(series) <= 1,
            },
            peak_kib(proc.pid),
        )
        reset_peak(proc.pid)

        def body() -> Any:
            for _ in range(300):
                yield b"x" * 65536

        r = httpx.post(url + "/alertmanager", content=body(), headers=auth, timeout=30)
        out(
            "receiver_chunked_body",
            {
                "sent": "an 18.75 MiB chunked webhook to a 1 MiB limit",
                "outcome": f"{r.status_code}",
                "held": r.status_code == 413,
            },
            peak_kib(proc.pid),
        )
    finally:
        proc.terminate()
        proc.wait(10)


def _up(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


# ----------------------------------------------------------------------------- ledger attacks


def ledger_attacks(tmp: Path, out: Callable[[str, dict[str, Any], int | None], None]) -> None:
    from sqlalchemy import create_engine, select

    from releasekit.errors import SigningRequiredError
    from releasekit.stores import anchor as anc
    from releasekit.stores import signing
    from releasekit.stores.ledger import (
        GENESIS,
        Event,
        EventType,
        Ledger,
        events_table,
        head_table,
        record_hash,
        signatures_table,
    )

    def git(repo: Path, *args: str) -> None:
        subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)

    repo = tmp / "proj"
    repo.mkdir()
    remote = tmp / "remote.git"
    git(tmp, "init", "-q", "--bare", str(remote))
    git(repo, "init", "-q")
    git(repo, "config", "user.name", "Ada")
    git(repo, "config", "user.email", "ada@example.com")
    signing.generate_keypair(repo)
    git(repo, "add", "keys")
    git(repo, "commit", "-q", "-m", "trust the release key")
    git(repo, "remote", "add", "origin", str(remote))
    url = f"sqlite:///{tmp / 'ledger.db'}"
    led = Ledger(
        url,
        actor="ci",
        signer=signing.find_signer(repo, environ={}),
        anchor_repo=repo,
        trusted=signing.trusted_keys(repo),
    )
    for i in range(21):
        led.append(Event(type=EventType.BUILD, to_release=f"{i:064x}", reason=f"event {i}"))
    git(repo, "push", "-q", "origin", "HEAD:refs/heads/main", anc.ANCHOR_REF)
    git(remote, "symbolic-ref", "HEAD", "refs/heads/main")
    me = os.getpid()

    # A writer without the key appends after signed records.
    reset_peak(me)
    keyless = Ledger(url, actor="intruder", anchor_repo=repo)
    try:
        keyless.append(Event(type=EventType.ROLLBACK, environment="production", live=True))
        outcome, held = "appended", False
    except SigningRequiredError as exc:
        outcome, held = f"refused: {exc.message[:90]}...", True
    out(
        "ledger_unsigned_append",
        {
            "sent": "an unsigned append after 21 signed records",
            "outcome": outcome,
            "held": held and led.count() == 21,
        },
        peak_kib(me),
    )

    # Swap: recompute the chain, delete the signatures, re-anchor locally.
    reset_peak(me)
    engine = create_engine(url)
    with engine.begin() as conn:
        rows = [dict(r._mapping) for r in conn.execute(select(events_table).order_by("seq"))]
        prev = GENESIS
        for r in rows:
            r["reason"] = "swapped"
            r["prev_hash"] = prev
            r["hash"] = record_hash(r)
            prev = r["hash"]
        conn.execute(events_table.delete())
        conn.execute(events_table.insert(), rows)
        conn.execute(head_table.update().values(hash=prev))
        conn.execute(signatures_table.delete())
    engine.dispose()
    git(repo, "update-ref", "-d", anc.ANCHOR_REF)
    anc.anchor(repo, len(rows), prev)
    res = Ledger(url, anchor_repo=repo, trusted=signing.trusted_keys(repo)).verify()
    out(
        "ledger_swap_local",
        {
            "sent": "chain recomputed, signature rows deleted, re-anchored locally",
            "outcome": "verify ok" if res.ok else f"verify fails: {res.problem}",
            "held": not res.ok,
        },
        peak_kib(me),
    )

    # ... and drop the trusted key with a local commit, plus an uncommitted rogue .pub.
    reset_peak(me)
    git(repo, "rm", "-q", "-r", "keys")
    git(repo, "commit", "-q", "-m", "drop the key")
    signing.generate_keypair(repo, private_path=tmp / "rogue.pem", public_dir=repo / "keys")
    local = Ledger(url, anchor_repo=repo, trusted=signing.trusted_keys(repo))
    fooled = local.verify().ok
    res = local.verify(remote="origin")
    out(
        "ledger_swap_remote",
        {
            "sent": "as above, the key's .pub removed in a local commit, a "
            "rogue .pub left uncommitted",
            "outcome": f"local-only verify ok={fooled}; verify "
            f"--remote origin: {'ok' if res.ok else 'fails: ' + (res.problem or '')[:100]}",
            "held": not res.ok,
        },
        peak_kib(me),
    )


# ----------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "abuse.json")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parser.parse_args()
    results: dict[str, Any] = {}

    def record(name: str, res: dict[str, Any], peak: int | None) -> None:
        res["peak_rss_mib"] = round(peak / 1024, 1) if peak else None
        results[name] = res
        mark = "held" if res["held"] else "FAILED"
        print(f"{name:24} {mark:6} peak {res['peak_rss_mib']} MiB  {res['outcome']}", flush=True)

    up = FakeUpstream()
    server, up_url = serve_in_thread(up.app())
    admin = secrets.token_urlsafe(24)
    with tempfile.TemporaryDirectory(prefix="abuse-") as t:
        tmp = Path(t)
        cfg = GatewayConfig(
            env="abuse",
            port=0,
            admin_token=admin,
            api_keys=[KEY_A, KEY_B],
            stream_idle_timeout_s=2.0,
            upstream_first_byte_timeout_s=2.0,
            max_request_bytes=1 << 20,
            shutdown_timeout_s=1,
            routes=[
                Route(
                    release_id="rel-a",
                    base_url=up_url,
                    prompts={"qa": PromptTemplate(user="{{ q }}")},
                )
            ],
        )
        gw = launch_gateway(
            cfg, config_path=tmp / "gw.json", log_path=tmp / "gw.log", new_session=False
        )
        try:
            a = GatewayAttacks(gw.url, gw.pid, admin, up)
            start_kib = peak_kib(gw.pid)
            n = 60 if args.quick else 300
            attacks: list[tuple[str, Callable[[], dict[str, Any]]]] = [
                ("deep_json", lambda: a.deep_json(n)),
                ("header_flood", lambda: a.header_flood(4, 64)),
                ("header_dribble", lambda: a.header_dribble(30 if args.quick else 300, 10.0)),
                ("chunked_body", lambda: a.chunked_body(300, 1)),
                ("path_allowlist", a.paths),
                ("client_stops_reading", a.stop_reading),
                ("client_leaves_non_stream", a.leave_non_stream),
                ("client_caused_rollback", a.rollback_trigger),
                ("feedback_hijack", lambda: a.feedback_hijack(21)),
                ("gateway_label_flood", lambda: a.label_flood(200)),
                ("wrong_keys", lambda: a.wrong_keys(100)),
            ]
            for name, fn in attacks:
                reset_peak(gw.pid)
                res = fn()
                record(name, res, peak_kib(gw.pid))
            gateway_start = round((start_kib or 0) / 1024, 1)
        finally:
            os.kill(gw.pid, signal.SIGTERM)
            wait_until(lambda: peak_kib(gw.pid) is None, 10)
        receiver_attacks(tmp, record)
        ledger_attacks(tmp, record)
    server.should_exit = True
    held = all(r["held"] for r in results.values())
    doc = {"gateway_rss_at_start_mib": gateway_start, "all_held": held, "attacks": results}
    write_result(args.out, doc)
    print(f"{'all held' if held else 'SOME FAILED'}; wrote {args.out}")
    return 0 if held else 1


if __name__ == "__main__":
    sys.exit(main())
