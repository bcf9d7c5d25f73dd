"""A stray alias left by an `assign` recorded after an environment was deployed: the record
does not count as live (what runs there is the deploy's release), but the alias it moved
is still found, reported as drift and removed by `reconcile`. Real MLflow store, real
SQLite ledger, releases registered by the real register code."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlflow import MlflowClient

from releasekit.releases.reconcile import checked_status, reconcile
from releasekit.releases.register import register_release
from releasekit.stores.ledger import Event, EventType, open_ledger
from releasekit.stores.mlflow import set_alias

if TYPE_CHECKING:
    from tests.releases.conftest import Proj


def _holders(p: Proj, env: str) -> list[tuple[str, str]]:
    uri = p.settings.mlflow_tracking_uri
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    return sorted(
        (rm.name, str(rm.aliases[env]))
        for rm in client.search_registered_models()
        if env in (rm.aliases or {})
    )


def test_an_alias_moved_by_an_assign_after_the_first_deploy_is_found_and_removed(
    mlproj: Proj,
) -> None:
    p = mlproj
    a = p.build("demo-bf16")
    b = p.build("demo-w4a16")
    register_release(p.settings, p.manifest("demo-bf16"))
    register_release(p.settings, p.manifest("demo-w4a16"))
    led = open_ledger(p.settings)
    # releasekit deployed a to staging...
    led.append(
        Event(
            type=EventType.DEPLOY,
            environment="staging",
            to_release=a.release_id,
            evidence={"model_name": "demo-bf16", "model_version": "1"},
            live=True,
        )
    )
    uri = p.settings.mlflow_tracking_uri
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    set_alias(client, "demo-bf16", "staging", "1")
    # ...then a record-only assign (as an older releasekit accepted) moved b's alias there.
    led.append(
        Event(
            type=EventType.ASSIGN,
            environment="staging",
            to_release=b.release_id,
            from_release=a.release_id,
            evidence={"model_name": "demo-w4a16", "model_version": "1"},
            live=True,
        )
    )
    set_alias(client, "demo-w4a16", "staging", "1")
    assert _holders(p, "staging") == [("demo-bf16", "1"), ("demo-w4a16", "1")]

    # What is live is still a: the assign does not count. The stray alias is drift.
    st = checked_status(p.settings)
    (env,) = [e for e in st.environments if e.environment == "staging"]
    assert env.release_id == a.release_id and env.drift == "drift", env
    assert ("demo-w4a16", "1") in [(h.model_name, h.version) for h in env.mlflow]

    rep = reconcile(p.settings, environment="staging")
    assert [r.environment for r in rep.repairs] == ["staging"], rep
    assert _holders(p, "staging") == [("demo-bf16", "1")]
    (repair,) = open_ledger(p.settings, read_only=True).records(types=[EventType.REPAIR.value])
    assert repair.to_release == a.release_id and not repair.live
