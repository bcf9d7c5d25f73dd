"""LoRA adapters on the deploy side, with the stand-in vLLM (promote_fake_vllm.py): a
release's spec carries its adapters as verified copies, a release that differs only in
adapters reuses the running server and has them loaded before the route moves, and an
engine that refuses one leaves the route where it was and is recorded as a failed deploy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import webclient
from promote_kit import Kit, adapter_release, kit

from releasekit.deploy import local
from releasekit.deploy.environments import env_config
from releasekit.deploy.state import read_state
from releasekit.deploy.target import ReleaseSpec
from releasekit.promote.context import load_release, release_spec, smoke_probe
from releasekit.promote.deploy import deploy_release
from releasekit.promote.promote import promote
from releasekit.spec.lock import serving_key
from releasekit.stores.ledger import EventType, Ledger

__all__ = ["kit"]


def _ledger(k: Kit) -> Ledger:
    return Ledger(k.settings.ledger_url or "")


def _spec(k: Kit, rid: str) -> ReleaseSpec:
    led = _ledger(k)
    return release_spec(k.settings, load_release(k.settings, rid, ledger=led), ledger=led)


def test_a_releases_spec_carries_its_adapters_as_verified_copies(kit: Kit) -> None:
    """The spec maps the adapter's model name to `name@digest12` and that name to a copy
    under the state folder; two releases differing only in the adapter's bytes share a
    serving key (one engine) but not the engine name."""
    r1 = adapter_release(kit, "demo-lora", b"\1" * 64, register=False)
    r2 = adapter_release(kit, "demo-lora2", b"\2" * 64, register=False)
    s1, s2 = _spec(kit, r1), _spec(kit, r2)
    [(client, engine)] = s1.adapters.items()
    assert client == "demo-json" and engine.startswith("demo-json@") and len(engine) == 22
    folder = Path(s1.adapter_dirs[engine])
    assert folder.parent == kit.settings.state_dir / "adapters"
    assert (folder / "adapter_model.safetensors").read_bytes() == b"\1" * 64
    assert s1.serving_key == s2.serving_key != _spec(kit, kit.build("demo-bf16")).serving_key
    assert s2.adapters["demo-json"] != engine
    led = _ledger(kit)
    assert serving_key(load_release(kit.settings, r1, ledger=led).lock) == s1.serving_key


def _adapter_spec(k: Kit, base: ReleaseSpec, tmp: Path) -> ReleaseSpec:
    """`base` as a release that differs only in one adapter (same serving key)."""
    tmp.mkdir(parents=True, exist_ok=True)
    return base.model_copy(
        update={
            "release_id": "a" * 64,
            "adapters": {"demo-json": "demo-json@0123456789ab"},
            "adapter_dirs": {"demo-json@0123456789ab": str(tmp)},
        }
    )


def _deploy(k: Kit, spec: ReleaseSpec, live: str) -> Any:
    led = _ledger(k)
    cfg = env_config(k.settings, "staging")
    probe = smoke_probe(cfg, load_release(k.settings, live, ledger=led))
    return deploy_release(
        k.settings,
        env="staging",
        spec=spec,
        probe=probe,
        record=lambda url: None,
        ledger=led,
        expected_live=live,
    )


def test_an_adapter_only_release_reuses_the_server_and_loads_before_the_switch(
    kit: Kit, monkeypatch: Any
) -> None:
    """The running server (same pid) gets the adapter (engine name -> its folder) while
    the route still points at the live release; then the route maps the adapter's name,
    and the smoke asked the adapter through it."""
    rid = kit.build("demo-bf16")
    assert promote(kit.settings, "manifests/demo-bf16.yaml", env="staging").status == "promoted"
    [before] = read_state(kit.settings.state_dir, "staging").servers
    spec = _adapter_spec(kit, _spec(kit, rid), kit.root / "staged")
    calls: list[tuple[str, dict[str, Path], list[str]]] = []

    def ensure(base_url: str, adapters: dict[str, Path], **kw: Any) -> list[str]:
        routed = [r.release_id for r in read_state(kit.settings.state_dir, "staging").routes]
        calls.append((base_url, dict(adapters), routed))
        return list(adapters)

    monkeypatch.setattr(local, "ensure_adapters", ensure)
    out = _deploy(kit, spec, rid)
    assert out.ok, out
    assert out.reused_server
    assert calls == [(before.base_url, {"demo-json@0123456789ab": kit.root / "staged"}, [rid])]
    assert any(s.step == "adapters" and s.ok for s in out.steps)
    smoked = [i for i in out.smoke_preview.items if i.adapter == "demo-json"]
    assert len(smoked) == 1 and smoked[0].ok
    assert any(i.adapter == "demo-json" and i.ok for i in out.smoke_gateway.items)
    [after] = read_state(kit.settings.state_dir, "staging").servers
    assert after.pid == before.pid
    [route] = read_state(kit.settings.state_dir, "staging").routes
    assert route.release_id == spec.release_id and route.adapters == spec.adapters
    gw = kit.gateway("staging")
    r = webclient.post(
        f"{gw}/v1/chat/completions",
        json={"model": "demo-json@0123456789ab", "messages": [{"role": "user", "content": "x"}]},
    )
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    r = webclient.post(
        f"{gw}/v1/chat/completions",
        json={"model": "demo-json", "messages": [{"role": "user", "content": "x"}]},
    )
    assert r.status_code == 200 and r.headers["x-releasekit-release"] == spec.release_id


def test_an_adapter_the_engine_refuses_leaves_the_route_and_is_a_failed_deploy(
    kit: Kit,
) -> None:
    """The stand-in engine has no run-time LoRA endpoint: the load fails, the route and
    the live server stay as they were, and the ledger has a deploy_failed event at stage
    `adapters` naming the engine's answer."""
    rid = kit.build("demo-bf16")
    assert promote(kit.settings, "manifests/demo-bf16.yaml", env="staging").status == "promoted"
    [before] = read_state(kit.settings.state_dir, "staging").servers
    spec = _adapter_spec(kit, _spec(kit, rid), kit.root / "staged")
    out = _deploy(kit, spec, rid)
    assert not out.ok and out.failed_stage == "adapters" and not out.switched
    assert "did not load adapter demo-json@0123456789ab" in (out.failure or "")
    ev = out.failure_event
    assert ev is not None and ev.type == EventType.DEPLOY_FAILED.value
    assert ev.evidence["stage"] == "adapters" and ev.to_release == spec.release_id
    st = read_state(kit.settings.state_dir, "staging")
    assert [r.release_id for r in st.routes] == [rid]
    assert [s.pid for s in st.servers] == [before.pid]
    r = webclient.post(
        f"{kit.gateway('staging')}/v1/templates/chat/chat/completions",
        json={"variables": {"question": "q?"}, "max_tokens": 4},
    )
    assert r.status_code == 200 and r.headers["x-releasekit-release"] == rid


def test_an_adapter_edited_after_its_lock_is_a_failed_deploy_before_anything_starts(
    kit: Kit,
) -> None:
    """Adapter files that differ from what the release locked: the spec says why, and its
    deploy is a deploy_failed event at stage `adapters`; no server starts, the route stays."""
    rid = kit.build("demo-bf16")
    assert promote(kit.settings, "manifests/demo-bf16.yaml", env="staging").status == "promoted"
    [before] = read_state(kit.settings.state_dir, "staging").servers
    lora = adapter_release(kit, "demo-lora", b"\1" * 64, register=False)
    (kit.root / "models" / "adapters" / "demo-lora" / "adapter_model.safetensors").write_bytes(
        b"\3" * 64
    )
    spec = _spec(kit, lora)
    assert spec.adapters == {} and "not the one its release locked" in (spec.adapters_problem or "")
    out = _deploy(kit, spec, rid)
    assert not out.ok and out.failed_stage == "adapters" and not out.switched
    assert out.failure_event is not None
    assert out.failure_event.evidence["stage"] == "adapters"
    assert "adapter_model.safetensors" in (out.failure or "")
    st = read_state(kit.settings.state_dir, "staging")
    assert [r.release_id for r in st.routes] == [rid]
    assert [s.pid for s in st.servers] == [before.pid]
