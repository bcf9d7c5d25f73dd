"""A release's LoRA adapters in the MLflow registry: each a version of its own registered model,
tagged with its digest, rank, base and release, linked to the release's own model version;
idempotent, completed by a rerun after a failure, and absent for a release without adapters."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import pytest
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from mlflow.store.artifact.utils.models import _parse_model_uri

from releasekit.errors import LockError, RegistryError
from releasekit.releases import register as register_mod
from releasekit.releases.adapter_view import registered_adapters, release_adapters
from releasekit.releases.queries import show
from releasekit.releases.register import register_release
from releasekit.spec.adapters import adapter_digest, weights_digest
from releasekit.spec.manifest import load_manifest
from releasekit.stores.ledger import Ledger
from releasekit.stores.mlflow import adapter_model_name, find_version

if TYPE_CHECKING:
    from releasekit.spec.lock import Lock
    from tests.releases.conftest import Proj

# As tests/deploy/promote_kit.py's adapter_release: demo-bf16 with LoRA enabled.
LORA_ARGS = (
    "    enforce-eager: true\n    enable-lora: true\n    max-loras: 2\n    max-lora-rank: 8\n"
)


def _client(p: Proj) -> MlflowClient:
    uri = p.settings.mlflow_tracking_uri
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def _write_adapter(p: Proj, folder: str, weights: bytes) -> str:
    path = p.root / "models" / "adapters" / folder
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": 8, "peft_type": "LORA"}))
    (path / "adapter_model.safetensors").write_bytes(weights)
    return f"models/adapters/{folder}"


def _adapter_release(p: Proj, name: str, adapters: dict[str, bytes]) -> Lock:
    """A variant of demo-bf16 (LoRA enabled) serving rank-8 adapters {name: weights}, each
    in its own folder, locked and built (not registered)."""
    base = weights_digest(p.root / "models" / "demo-base")
    path = p.variant("demo-bf16", name, {"    enforce-eager: true\n": LORA_ARGS})
    lines = ["adapters:\n"]
    for aname, weights in adapters.items():
        folder = _write_adapter(p, f"{name}-{aname}", weights)
        lines.append(f"  - {{name: {aname}, path: {folder}, rank: 8, base: {base}}}\n")
    with path.open("a") as f:
        f.write("".join(lines))
    return p.build(name)


def _versions(c: MlflowClient, model: str) -> list[str]:
    return sorted(str(v.version) for v in c.search_model_versions(f"name = '{model}'"))


def test_each_adapter_is_a_version_linked_to_the_release_version(mlproj: Proj) -> None:
    lk = _adapter_release(mlproj, "lora-rel", {"demo-json": b"J" * 64, "demo-sql": b"S" * 64})
    base = weights_digest(mlproj.root / "models" / "demo-base")
    res = register_release(mlproj.settings, mlproj.manifest("lora-rel"))
    assert res.created and res.model_uri == "models:/lora-rel/1"
    assert [(a.name, a.model_name, a.version, a.created) for a in res.adapters] == [
        ("demo-json", "lora-rel~lora~demo-json", "1", True),
        ("demo-sql", "lora-rel~lora~demo-sql", "1", True),
    ]
    c = _client(mlproj)
    for a in res.adapters:
        assert a.model_name == adapter_model_name("lora-rel", a.name)
        rm = c.get_registered_model(a.model_name)
        assert rm.tags["releasekit"] == "adapter" and rm.tags["base_model"] == "lora-rel"
        mv = c.get_model_version(a.model_name, a.version)
        assert mv.tags["adapter_digest"] == adapter_digest(lk.inputs, a.name) == a.digest
        assert mv.tags["adapter_rank"] == "8"
        assert mv.tags["base_weights_digest"] == base
        assert mv.tags["adapter_release_id"] == lk.release_id
        assert mv.tags["base_model_uri"] == res.model_uri
        # Not `release_id`: a lookup of the release by that tag finds only its own version.
        assert "release_id" not in mv.tags
        # MLflow's own run link and source: the release's run.
        assert mv.run_id == res.run_id
        assert mv.source == f"runs:/{res.run_id}/release"

        # The link resolves (as MLflow parses it) to the version that carries the base.
        parsed = _parse_model_uri(mv.tags["base_model_uri"])
        base_mv = c.get_model_version(parsed.name, parsed.version)
        assert base_mv.tags["release_id"] == lk.release_id
        assert (base_mv.name, str(base_mv.version)) == ("lora-rel", res.version)
        assert _parse_model_uri(a.model_uri).name == a.model_name  # `~` needs no escaping

    release_mv = c.get_model_version("lora-rel", res.version)
    assert release_mv.tags["adapter_model_uris"] == (
        "models:/lora-rel~lora~demo-json/1,models:/lora-rel~lora~demo-sql/1"
    )
    found = find_version(mlproj.settings, lk.release_id)
    assert found is not None and found.model_name == "lora-rel"

    # The register event records the adapters' versions: `show` reads them from there.
    (ev,) = Ledger(mlproj.settings.ledger_url or "").records()
    assert ev.evidence["adapters"] == {a.name: a.model_uri for a in res.adapters}
    lm = load_manifest(mlproj.manifest("lora-rel"), root=mlproj.root)
    shown = release_adapters(lm.manifest, lk.inputs, registered_adapters(ev.evidence))
    assert [(a.name, a.model_uri) for a in shown] == [
        ("demo-json", "models:/lora-rel~lora~demo-json/1"),
        ("demo-sql", "models:/lora-rel~lora~demo-sql/1"),
    ]
    detail = show(mlproj.settings, lk.release_id)
    assert [(a.name, a.model_uri) for a in detail.adapters] == [
        (a.name, a.model_uri) for a in shown
    ]


def test_registering_twice_makes_no_new_adapter_version(mlproj: Proj) -> None:
    _adapter_release(mlproj, "lora-rel", {"demo-json": b"J" * 64})
    first = register_release(mlproj.settings, mlproj.manifest("lora-rel"))
    again = register_release(mlproj.settings, mlproj.manifest("lora-rel"))
    assert not again.created
    assert [(a.model_uri, a.created) for a in again.adapters] == [
        (first.adapters[0].model_uri, False)
    ]
    c = _client(mlproj)
    assert _versions(c, "lora-rel~lora~demo-json") == ["1"]
    assert _versions(c, "lora-rel") == ["1"]
    assert Ledger(mlproj.settings.ledger_url or "").count() == 1


def test_the_same_adapter_in_a_later_release_gets_a_version_linked_to_that_release(
    mlproj: Proj,
) -> None:
    lk1 = _adapter_release(mlproj, "lora-rel", {"demo-json": b"J" * 64})
    r1 = register_release(mlproj.settings, mlproj.manifest("lora-rel"))
    path = mlproj.manifest("lora-rel")
    path.write_text(path.read_text().replace("max-num-seqs: 32", "max-num-seqs: 16"))
    lk2 = mlproj.build("lora-rel")
    assert lk2.release_id != lk1.release_id
    r2 = register_release(mlproj.settings, path)
    assert r2.created and r2.version == "2"
    (a1,), (a2,) = r1.adapters, r2.adapters
    assert a1.digest == a2.digest and (a1.version, a2.version) == ("1", "2")
    c = _client(mlproj)
    assert c.get_model_version(a2.model_name, "1").tags["base_model_uri"] == "models:/lora-rel/1"
    assert c.get_model_version(a2.model_name, "2").tags["base_model_uri"] == "models:/lora-rel/2"
    assert c.get_model_version(a2.model_name, "2").tags["adapter_release_id"] == lk2.release_id


def test_a_failure_mid_adapters_is_a_registry_error_a_rerun_completes(
    mlproj: Proj, monkeypatch: pytest.MonkeyPatch
) -> None:
    _adapter_release(mlproj, "lora-rel", {"demo-json": b"J" * 64, "demo-sql": b"S" * 64})
    real = register_mod._adapter_version

    def flaky(*args: Any, **kwargs: Any) -> tuple[str, bool]:
        if args[3].name == "demo-sql":
            raise MlflowException("the registry said no")
        return real(*args, **kwargs)

    monkeypatch.setattr(register_mod, "_adapter_version", flaky)
    with pytest.raises(RegistryError, match=r"registering lora-rel release .*the registry said no"):
        register_release(mlproj.settings, mlproj.manifest("lora-rel"))
    c = _client(mlproj)
    assert _versions(c, "lora-rel") == ["1"]
    assert _versions(c, "lora-rel~lora~demo-json") == ["1"]
    assert "adapter_model_uris" not in c.get_model_version("lora-rel", "1").tags
    led = Ledger(mlproj.settings.ledger_url or "")
    assert led.count() == 0  # nothing recorded for a registration that did not finish

    monkeypatch.setattr(register_mod, "_adapter_version", real)
    res = register_release(mlproj.settings, mlproj.manifest("lora-rel"))
    assert not res.created
    assert [(a.name, a.version, a.created) for a in res.adapters] == [
        ("demo-json", "1", False),
        ("demo-sql", "1", True),
    ]
    assert _versions(c, "lora-rel~lora~demo-json") == ["1"]
    assert _versions(c, "lora-rel~lora~demo-sql") == ["1"]
    assert c.get_model_version("lora-rel", "1").tags["adapter_model_uris"] == (
        "models:/lora-rel~lora~demo-json/1,models:/lora-rel~lora~demo-sql/1"
    )
    (ev,) = led.records()
    assert set(ev.evidence["adapters"]) == {"demo-json", "demo-sql"}


def test_an_adapter_declared_unlike_its_lock_is_refused_before_mlflow(mlproj: Proj) -> None:
    _adapter_release(mlproj, "lora-rel", {"demo-json": b"J" * 64})
    path = mlproj.manifest("lora-rel")
    path.write_text(path.read_text().replace("rank: 8", "rank: 4"))
    with pytest.raises(LockError, match="adapter 'demo-json' changed since the lock"):
        register_release(mlproj.settings, path)
    assert not _client(mlproj).search_model_versions("name = 'lora-rel'")


def test_a_release_without_adapters_registers_as_before(mlproj: Proj) -> None:
    c = _client(mlproj)
    before = {rm.name for rm in c.search_registered_models()}
    mlproj.build("demo-bf16")
    res = register_release(mlproj.settings, mlproj.manifest("demo-bf16"))
    assert res.adapters == []
    after = {rm.name for rm in c.search_registered_models()}
    assert after - before == {"demo-bf16"}
    assert "adapter_model_uris" not in c.get_model_version("demo-bf16", res.version).tags
    (ev,) = Ledger(mlproj.settings.ledger_url or "").records()
    assert "adapters" not in ev.evidence


def test_adapters_register_over_a_real_mlflow_server(
    proj: Proj, mlflow_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server accepts the adapter models' names and their run-relative source."""
    from releasekit.config import load_settings

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    s = load_settings(root=proj.root)
    lk = _adapter_release(proj, "lora-http", {"demo-json": b"H" * 64})
    res = register_release(s, proj.manifest("lora-http"))
    (a,) = res.adapters
    assert a.created and a.model_name == "lora-http~lora~demo-json"
    assert [x.created for x in register_release(s, proj.manifest("lora-http")).adapters] == [False]
    client = MlflowClient(tracking_uri=mlflow_server, registry_uri=mlflow_server)
    (mv,) = client.search_model_versions(f"name = '{a.model_name}'")
    assert mv.tags["adapter_release_id"] == lk.release_id
    assert mv.tags["base_model_uri"] == res.model_uri and mv.run_id == res.run_id
    assert len(client.search_model_versions(f"tags.release_id = '{lk.release_id}'")) == 1
