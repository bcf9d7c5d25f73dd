"""Adapter operations on a running engine: an unload the engine does not do stays on the warm
list and is tried again with a bounded backoff (one whose engine is gone leaves the list),
`deploy-status` lists the warm adapters per server and says which unloads are overdue, and a
deploy that fails part-way unloads the adapters it loaded that nothing names.

The rules run against an in-process stand-in engine with vLLM's run-time LoRA API whose
answers can be made to fail; the deploys against the stand-in vLLM of promote_fake_vllm.py."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import webclient
from promote_kit import Kit, adapter_release, kit
from typer.testing import CliRunner

from releasekit.cli import app
from releasekit.cli._common import State
from releasekit.deploy.adapter_loads import DeployLoads
from releasekit.deploy.environments import env_config
from releasekit.deploy.gateway import Mirror, Route
from releasekit.deploy.local import expire_warm, load_release_adapters
from releasekit.deploy.state import EnvState, ServerRecord, StateHandle, read_state, write_state
from releasekit.deploy.target import ReleaseSpec, Upstream
from releasekit.deploy.warm_adapters import (
    UNLOAD_RETRY,
    adapter_deadlines,
    next_unload_try,
    overdue_unloads,
    unload_expired,
)
from releasekit.errors import AdapterLoadError, ReleasekitError
from releasekit.promote.context import load_release, release_spec, smoke_probe
from releasekit.promote.deploy import ShiftContext, ShiftResult, deploy_release, deploy_status
from releasekit.promote.deploy_status import warm_adapter_lines
from releasekit.promote.promote import promote
from releasekit.stores.ledger import Ledger

__all__ = ["kit"]


class StandInEngine:
    """vLLM's run-time LoRA API on a thread: `held` adapters, every call in `calls`;
    `fail_unload` (an HTTP status) makes each unload fail, `fail_load` names refused."""

    def __init__(self) -> None:
        self.held: dict[str, str] = {}
        self.calls: list[list[str]] = []
        self.fail_unload: int | None = None
        self.fail_load: set[str] = set()
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/health":
                    return self._send(200, {})
                held = [{"id": n, "parent": "demo", "root": p} for n, p in engine.held.items()]
                self._send(200, {"data": [{"id": "demo"}, *held]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                name = str(body["lora_name"])
                if self.path == "/v1/load_lora_adapter":
                    engine.calls.append(["load", name])
                    if name in engine.fail_load:
                        return self._send(500, {"error": {"message": f"{name}: rank too high"}})
                    engine.held[name] = str(body["lora_path"])
                    return self._send(200, "Success")
                engine.calls.append(["unload", name])
                if engine.fail_unload is not None:
                    return self._send(engine.fail_unload, {"error": {"message": "engine busy"}})
                if engine.held.pop(name, None) is None:
                    return self._send(404, {"error": {"message": f"{name} cannot be found"}})
                self._send(200, "Success")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def engine() -> Iterator[StandInEngine]:
    e = StandInEngine()
    try:
        yield e
    finally:
        e.close()


@pytest.fixture
def engine_process() -> Iterator[subprocess.Popen[bytes]]:
    """A live process group standing for the engine's process (the expirer checks it)."""
    p = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        yield p
    finally:
        p.kill()
        p.wait()


def _server(base_url: str, warm: dict[str, float] | None = None, pid: int = 1) -> ServerRecord:
    return ServerRecord(
        release_id="r" * 64, serving_key="k", base_url=base_url, port=1, pid=pid, model="demo",
        log_path="-", role="live", started_at=0.0, adapters_warm=dict(warm or {}),
    )  # fmt: skip


def _route(base_url: str, engine_name: str) -> Route:
    return Route(release_id="r1", base_url=base_url, model="demo", adapters={"x": engine_name})


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


# -- an unload the engine does not do -----------------------------------------------------


def test_the_retry_schedule_follows_from_the_due_time_and_its_waits_are_bounded() -> None:
    """Before its due time an unload is due then; after it, the tries come 5 s, 10 s, 20 s
    ... after each other, never more than UNLOAD_RETRY.cap_s apart, however long overdue."""
    assert next_unload_try(100.0, 50.0) == 100.0
    assert next_unload_try(100.0, 100.0) == 105.0
    assert next_unload_try(100.0, 105.0) == 115.0
    assert next_unload_try(100.0, 116.0) == 135.0
    for late in (1_000.0, 10_000.0, 1e6):
        again = next_unload_try(0.0, late)
        assert late < again <= late + UNLOAD_RETRY.cap_s
    assert next_unload_try(0.0, 10_000.0) == next_unload_try(0.0, 10_000.5)


def test_a_failed_unload_stays_listed_and_is_tried_again_until_the_engine_does_it(
    engine: StandInEngine,
) -> None:
    """The engine answers 503: the version stays on the warm list with its due time (not
    unloaded, not forgotten), the expirer's next deadline is the retry, deploy-status calls
    it overdue once the first retry is due; when the engine answers again it is unloaded."""
    engine.held["e@old"] = "/store/old"
    engine.fail_unload = 503
    st = EnvState(env="t", servers=[_server(engine.url, {"e@old": 100.0})])
    out = unload_expired(st, now=100.0, alive=lambda s: True)
    assert out.names == [] and engine.calls == [["unload", "e@old"]]
    assert "stays loaded" in out.notes[0] and "tried again at" in out.notes[0]
    assert st.servers[0].adapters_warm == {"e@old": 100.0}
    assert adapter_deadlines(st, now=100.0) == [105.0]
    assert overdue_unloads(st.servers[0], 101.0) == {}
    assert overdue_unloads(st.servers[0], 105.0) == {"e@old": 115.0}
    engine.fail_unload = None
    assert unload_expired(st, now=105.0, alive=lambda s: True).names == ["e@old"]
    assert engine.held == {} and st.servers[0].adapters_warm == {}
    assert adapter_deadlines(st) == []


def test_the_expirer_retries_a_failed_unload_and_drops_one_whose_engine_is_gone(
    engine: StandInEngine, engine_process: subprocess.Popen[bytes], tmp_path: Path
) -> None:
    """`expire_warm` (the expirer's step) keeps a version the live engine did not unload;
    one on a server whose process is gone leaves the list without an unload to wait for."""
    engine.held["e@a"] = "/store/a"
    engine.fail_unload = 500
    gone = _server("http://127.0.0.1:9", {"e@gone": 10.0}, pid=_dead_pid())
    live = _server(engine.url, {"e@a": 10.0}, pid=engine_process.pid)
    live.release_id = "l" * 64
    write_state(tmp_path, EnvState(env="t", servers=[live, gone]))
    assert expire_warm(tmp_path, "t", now=20.0) == 0
    st = read_state(tmp_path, "t")
    assert [s.adapters_warm for s in st.servers] == [{"e@a": 10.0}, {}]
    engine.fail_unload = None
    assert expire_warm(tmp_path, "t", now=next_unload_try(10.0, 20.0)) == 1
    assert read_state(tmp_path, "t").servers[0].adapters_warm == {}
    assert engine.held == {}


# -- what a deploy loaded -------------------------------------------------------------------


def _spec(folder: Path, **names: str) -> ReleaseSpec:
    return ReleaseSpec(
        release_id="n" * 64, name="demo", serving_key="k", model_dir="/nonexistent",
        served_name="demo", engine_args={"enable-lora": ""}, adapters=dict(names),
        adapter_dirs={e: str(folder) for e in names.values()},
    )  # fmt: skip


def test_a_load_refused_part_way_unloads_the_versions_it_loaded_and_says_so(
    engine: StandInEngine, tmp_path: Path
) -> None:
    """Two adapters, the engine refuses the second: the first is unloaded again, the error's
    one line says both, and the warm list keeps nothing."""
    engine.fail_load = {"b@2"}
    handle = StateHandle(tmp_path, EnvState(env="t", servers=[_server(engine.url)]))
    loads = DeployLoads(handle, hold_s=300, drain_s=1)
    up = Upstream(release_id="n" * 64, serving_key="k", base_url=engine.url, model="demo")
    with pytest.raises(AdapterLoadError) as info:
        loads.load(up, _spec(tmp_path, a="a@1", b="b@2"), load_release_adapters)
    [line] = info.value.message.splitlines()
    assert "did not load adapter b@2" in line and "unloaded again: a@1" in line
    assert engine.calls == [["load", "a@1"], ["load", "b@2"], ["unload", "a@1"]]
    assert engine.held == {} and handle.state.servers[0].adapters_warm == {}


def test_what_a_deploy_loaded_is_held_warm_until_routed_and_only_unnamed_versions_go(
    engine: StandInEngine, tmp_path: Path
) -> None:
    """Loaded versions are on the warm list (for the hold) until a route names them; an
    unload spares one a route or a running mirror names; one the engine will not unload
    stays listed, due at once, and the expirer is started for it."""
    handle = StateHandle(tmp_path, EnvState(env="t", servers=[_server(engine.url)]))
    started: list[bool] = []
    loads = DeployLoads(handle, hold_s=300, drain_s=1, after=lambda: started.append(True))
    up = Upstream(release_id="n" * 64, serving_key="k", base_url=engine.url, model="demo")
    t0 = time.time()
    assert loads.load(up, _spec(tmp_path, a="a@1", b="b@2"), load_release_adapters) == [
        "a@1",
        "b@2",
    ]
    warm = handle.state.servers[0].adapters_warm
    assert sorted(warm) == ["a@1", "b@2"] and all(t0 + 300 <= t <= t0 + 301 for t in warm.values())
    st = handle.state
    st.routes = [_route(engine.url, "a@1")]
    st.mirror = Mirror(route=_route(engine.url, "b@2"), share=0.5, until=time.time() + 60)
    assert loads.unload() == ""
    assert engine.held.keys() == {"a@1", "b@2"}
    st.routes, st.mirror = [], None
    engine.fail_unload = 503
    said = loads.unload(now=500.0)
    assert said.startswith("; still loaded, the unload is tried again by the expiry: a@1 (")
    assert st.servers[0].adapters_warm == {"a@1": 500.0, "b@2": 500.0} and started == [True]
    assert read_state(tmp_path, "t").servers[0].adapters_warm == {"a@1": 500.0, "b@2": 500.0}
    assert loads.unload() == ""  # handed to the warm list: not this deploy's any more


# -- through a deploy -----------------------------------------------------------------------


def _lora_calls(base_url: str) -> list[list[str]]:
    r = webclient.get(base_url + "/fake/lora")
    assert r.status_code == 200
    return list(r.json())


def _ledger(k: Kit) -> Ledger:
    return Ledger(k.settings.ledger_url or "")


def _next_adapter_release(k: Kit) -> tuple[str, str, ServerRecord, ReleaseSpec]:
    """demo-lora live in staging, and the spec of demo-lora2 (only its adapter differs)."""
    r1 = adapter_release(k, "demo-lora", b"\1" * 64)
    assert promote(k.settings, r1, env="staging").status == "promoted"
    st = read_state(k.settings.state_dir, "staging")
    [srv] = st.servers
    [(_, e1)] = st.routes[0].adapters.items()
    r2 = adapter_release(k, "demo-lora2", b"\2" * 64)
    led = _ledger(k)
    return (
        r1,
        e1,
        srv,
        release_spec(k.settings, load_release(k.settings, r2, ledger=led), ledger=led),
    )


def test_a_failed_preview_smoke_unloads_the_adapter_the_deploy_loaded(kit: Kit) -> None:
    """An adapter-only release loaded into the live engine fails its smoke: its version is
    unloaded again (the live one stays), the failure's detail and ledger event say so, the
    route and the warm list are as before."""
    r1, e1, srv, spec = _next_adapter_release(kit)
    e2 = spec.adapters["demo-json"]
    led = _ledger(kit)
    probe = smoke_probe(
        env_config(kit.settings, "staging"), load_release(kit.settings, r1, ledger=led)
    )
    assert probe is not None
    wrong = [i.model_copy(update={"expected": "no engine says this"}) for i in probe.items]
    probe = probe.model_copy(update={"items": wrong, "min_pass_rate": 1.0})
    out = deploy_release(
        kit.settings, env="staging", spec=spec, probe=probe, record=lambda url: None,
        ledger=led, expected_live=r1,
    )  # fmt: skip
    assert not out.ok and out.failed_stage == "smoke" and out.reused_server
    said = f"the adapters this deploy loaded were unloaded again: {e2}"
    assert said in (out.failure or "")
    assert out.failure_event is not None and said in out.failure_event.reason
    assert _lora_calls(srv.base_url) == [["load", e1], ["load", e2], ["unload", e2]]
    st = read_state(kit.settings.state_dir, "staging")
    assert [r.release_id for r in st.routes] == [r1] and st.routes[0].adapters == {"demo-json": e1}
    assert [(s.pid, s.adapters_warm) for s in st.servers] == [(srv.pid, {})]


@pytest.mark.parametrize("stage", ["record", "canary"])
def test_a_switch_back_unloads_the_adapter_the_deploy_loaded(kit: Kit, stage: str) -> None:
    """The record fails after the switch, or the canary aborts: the route goes back and
    the new version, which no route names any more, is unloaded, and the failure says so;
    the old one keeps serving."""
    r1, e1, srv, spec = _next_adapter_release(kit)
    e2 = spec.adapters["demo-json"]

    def record(url: str) -> None:
        if stage == "record":
            raise ReleasekitError("the ledger is not writable")

    def shift(ctx: ShiftContext) -> ShiftResult:
        return ShiftResult(ok=stage != "canary", problem="the canary answered worse")

    out = deploy_release(
        kit.settings, env="staging", spec=spec, probe=None, record=record,
        ledger=_ledger(kit), expected_live=r1, shift=shift,
    )  # fmt: skip
    assert not out.ok and out.failed_stage == stage and out.reverted
    assert _lora_calls(srv.base_url) == [["load", e1], ["load", e2], ["unload", e2]]
    said = f"the adapters this deploy loaded were unloaded again: {e2}"
    assert said in (out.failure or ""), out.failure
    if stage == "record":  # its own deploy_failed event (a canary's abort is the shift's)
        assert out.failure_event is not None and said in out.failure_event.reason
    st = read_state(kit.settings.state_dir, "staging")
    assert [r.release_id for r in st.routes] == [r1] and st.servers[0].adapters_warm == {}
    r = webclient.post(
        f"{kit.gateway('staging')}/v1/chat/completions",
        json={"model": "demo-json", "messages": [{"role": "user", "content": "x"}]},
    )
    assert r.status_code == 200 and r.headers["x-releasekit-release"] == r1


# -- deploy-status ------------------------------------------------------------------------------


def test_deploy_status_lists_warm_adapters_per_server_and_says_which_unloads_are_overdue(
    kit: Kit,
) -> None:
    """`deploy-status --json` carries each server's warm adapters under the engine names
    the text shows, with when they are unloaded, and the overdue ones with their next try;
    the text lines name the warm ones and say which unload is overdue."""
    r1 = adapter_release(kit, "demo-lora", b"\1" * 64)
    assert promote(kit.settings, r1, env="staging").status == "promoted"
    st = read_state(kit.settings.state_dir, "staging")
    now = time.time()
    soon, late = "demo-json@aaaaaaaaaaaa", "demo-json@bbbbbbbbbbbb"
    st.servers[0].adapters_warm = {soon: now + 300, late: now - 60}
    write_state(kit.settings.state_dir, st)
    State.reset()
    shown = CliRunner().invoke(app, ["deploy-status", "staging", "--json"])
    assert shown.exit_code == 0, shown.output
    [server] = json.loads(shown.stdout)[0]["servers"]
    assert sorted(server["adapters_warm"]) == [soon, late]
    assert list(server["adapters_overdue"]) == [late]
    [env] = deploy_status(kit.settings, env="staging")
    assert env.servers[0].adapters_warm[soon].timestamp() == pytest.approx(now + 300)
    # tries at due + 5, 15, 35, 75 s: the first still ahead is 15 s from now
    assert env.servers[0].adapters_overdue[late].timestamp() == pytest.approx(now + 15)
    lines = warm_adapter_lines([env])
    assert lines[0].startswith(f"staging: adapters kept loaded (warm): {soon}; unloaded from ")
    assert lines[1].startswith(f"staging: adapter {late} is still loaded on ")
    assert "its unload is overdue" in lines[1] and len(lines) == 2
