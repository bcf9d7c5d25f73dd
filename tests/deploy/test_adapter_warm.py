"""Adapter versions kept loaded for the warm window, with the stand-in vLLM started with
`--enable-lora` (promote_fake_vllm.py holds them and logs each load and unload): an
adapter-only promotion keeps the old version loaded until the window ends, a rollback within
it moves the route back without loading anything, and the expiry unloads only versions no
route or running mirror names. The rules themselves on plain state records, too."""

from __future__ import annotations

import time
from typing import Any

import pytest
import webclient
from promote_kit import Kit, adapter_release, kit
from typer.testing import CliRunner

from releasekit.cli import app
from releasekit.cli._common import State
from releasekit.deploy import warm_adapters
from releasekit.deploy.gateway import Mirror, Route
from releasekit.deploy.local import expire_warm
from releasekit.deploy.state import EnvState, ServerRecord, read_state
from releasekit.deploy.warm_adapters import mark_warm, unload_expired
from releasekit.promote.context import load_release, release_spec
from releasekit.promote.deploy import deploy_release
from releasekit.promote.promote import promote
from releasekit.promote.rollback import rollback
from releasekit.stores.ledger import Ledger

__all__ = ["kit"]

URL = "http://127.0.0.1:25999"


def _lora_calls(base_url: str) -> list[list[str]]:
    r = webclient.get(base_url + "/fake/lora")
    assert r.status_code == 200
    return list(r.json())


def _ask(k: Kit, model: str) -> Any:
    return webclient.post(
        f"{k.gateway('staging')}/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4},
    )


def test_the_old_adapter_stays_warm_a_rollback_needs_no_load_and_the_window_unloads_it(
    kit: Kit,
) -> None:
    """Promoting an adapter-only release reuses the engine, loads the new version and keeps
    the old one loaded until now + warm_s; a rollback inside that window switches back with
    no load call (the version it leaves goes warm instead); when the window ends the
    expiry unloads the unrouted version and leaves the routed one; going back to it after
    that loads it again."""
    r1 = adapter_release(kit, "demo-lora", b"\1" * 64)
    assert promote(kit.settings, r1, env="staging").status == "promoted"
    [srv] = read_state(kit.settings.state_dir, "staging").servers
    [(_, e1)] = read_state(kit.settings.state_dir, "staging").routes[0].adapters.items()
    r2 = adapter_release(kit, "demo-lora2", b"\2" * 64)
    t0 = time.time()
    assert promote(kit.settings, r2, env="staging").status == "promoted"
    st = read_state(kit.settings.state_dir, "staging")
    [again] = st.servers
    [(_, e2)] = st.routes[0].adapters.items()
    assert again.pid == srv.pid and e2 != e1
    assert list(again.adapters_warm) == [e1]
    assert t0 + 300 <= again.adapters_warm[e1] <= time.time() + 300  # warm_s = 300
    assert _lora_calls(srv.base_url) == [["load", e1], ["load", e2]]
    assert _ask(kit, "demo-json").headers["x-releasekit-release"] == r2
    assert _ask(kit, e1).status_code == 404  # loaded, but no client can name it
    State.reset()
    shown = CliRunner().invoke(app, ["deploy-status", "staging"])
    assert shown.exit_code == 0, shown.output
    assert f"staging: adapters kept loaded (warm): {e1}; unloaded from " in shown.output

    res = rollback(kit.settings, "staging", reason="bad answers")
    assert res.status == "rolled_back" and res.to_release == r1
    st = read_state(kit.settings.state_dir, "staging")
    assert st.routes[0].release_id == r1 and st.routes[0].adapters == {"demo-json": e1}
    assert _lora_calls(srv.base_url) == [["load", e1], ["load", e2]]  # nothing loaded
    assert list(st.servers[0].adapters_warm) == [e2]
    r = _ask(kit, "demo-json")
    assert r.status_code == 200 and r.headers["x-releasekit-release"] == r1

    assert expire_warm(kit.settings.state_dir, "staging", grace_s=2) == 0  # not yet
    later = time.time() + 3600
    assert expire_warm(kit.settings.state_dir, "staging", grace_s=2, now=later) == 1
    assert _lora_calls(srv.base_url)[2:] == [["unload", e2]]
    [after] = read_state(kit.settings.state_dir, "staging").servers
    assert after.adapters_warm == {} and after.pid == srv.pid
    assert _ask(kit, "demo-json").status_code == 200  # the routed version stays

    # after the window, going back to the unloaded version loads it again first
    led = Ledger(kit.settings.ledger_url or "")
    spec = release_spec(kit.settings, load_release(kit.settings, r2, ledger=led), ledger=led)
    out = deploy_release(
        kit.settings, env="staging", spec=spec, probe=None, record=lambda url: None,
        ledger=led, expected_live=r1,
    )  # fmt: skip
    assert out.ok and out.reused_server
    assert _lora_calls(srv.base_url)[3:] == [["load", e2]]
    assert list(read_state(kit.settings.state_dir, "staging").servers[0].adapters_warm) == [e1]


def _server(warm: dict[str, float] | None = None, base_url: str = URL) -> ServerRecord:
    return ServerRecord(
        release_id="r-live", serving_key="k", base_url=base_url, port=25999, pid=1,
        model="demo", log_path="-", role="live", started_at=0.0, adapters_warm=dict(warm or {}),
    )  # fmt: skip


def _route(rid: str, engine: str, base_url: str = URL) -> Route:
    return Route(release_id=rid, base_url=base_url, model="demo", adapters={"demo-json": engine})


def test_mark_warm_keeps_dropped_versions_until_the_later_deadline() -> None:
    """The versions the old table sent to the server and the new one does not are marked
    (an earlier, later deadline kept); one the new table carries again leaves the list;
    another server's names are not this one's."""
    s = _server({"demo-json@old": 5000.0, "demo-json@new": 100.0})
    before = [_route("r1", "demo-json@old"), _route("rx", "other@1", "http://127.0.0.1:1")]
    after = [_route("r2", "demo-json@new")]
    assert mark_warm(s, before, after, 1000.0) == ["demo-json@old"]
    assert s.adapters_warm == {"demo-json@old": 5000.0}
    s2 = _server()
    assert mark_warm(s2, [_route("r1", "demo-json@a")], after, 1000.0) == ["demo-json@a"]
    assert s2.adapters_warm == {"demo-json@a": 1000.0}
    assert mark_warm(_server(), after, after, 1000.0) == []


def test_unload_expired_spares_versions_a_route_or_a_running_mirror_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past the deadline: a version no route or mirror names is unloaded (after the
    drain); one a route names is live again (off the list, not unloaded); one only a
    running mirror names waits until the mirror's `until`, then goes; a version not yet due
    stays listed."""
    unloaded: list[tuple[str, str]] = []
    monkeypatch.setattr(
        warm_adapters, "unload_adapter", lambda url, name, **kw: unloaded.append((url, name))
    )
    warm = {"e@gone": 10.0, "e@routed": 10.0, "e@mirrored": 10.0, "e@later": 500.0}
    st = EnvState(env="t", servers=[_server(warm)], routes=[_route("r2", "e@routed")])
    mirror_route = _route("r1", "e@mirrored")
    st.mirror = Mirror(route=mirror_route, share=0.5, purpose="after_promotion", until=200.0)
    drained: list[bool] = []
    out = unload_expired(st, now=100.0, drain=lambda: drained.append(True))
    assert out.names == ["e@gone"] and unloaded == [(URL, "e@gone")] and drained == [True]
    assert st.servers[0].adapters_warm == {"e@mirrored": 200.0, "e@later": 500.0}
    assert unload_expired(st, now=150.0).names == []
    assert unload_expired(st, now=250.0).names == ["e@mirrored"]
    assert st.servers[0].adapters_warm == {"e@later": 500.0}
    assert unloaded[-1] == (URL, "e@mirrored")


def test_an_old_state_file_without_warm_adapters_still_loads() -> None:
    """A server record written before `adapters_warm` existed reads with none."""
    rec = _server().model_dump()
    del rec["adapters_warm"]
    assert ServerRecord.model_validate(rec).adapters_warm == {}
