"""The team setup for real: an `mlflow server` whose backend store is PostgreSQL, the ledger
in PostgreSQL too, register and assign through both, and the ledger verifying."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import webclient
from mlflow import MlflowClient
from portbands import free_port

from releasekit.config import load_settings
from releasekit.releases.assign import assign
from releasekit.releases.reconcile import checked_status
from releasekit.releases.register import register_release
from releasekit.stores.ledger import open_ledger

if TYPE_CHECKING:
    from tests.releases.conftest import Proj

BIN = Path(sys.executable).parent

MLFLOW_PORTS = (22200, 22299)  # the store tests' range (CONTRIBUTING.md)


def _port() -> int:
    return free_port(*MLFLOW_PORTS, what="the MLflow server")


@pytest.fixture
def pg_mlflow(pg_server: Any, tmp_path: Path) -> Iterator[str]:
    """An `mlflow server` on a fresh PostgreSQL database (proxied local artifacts)."""
    store = pg_server.create_database()
    port = _port()
    log = (tmp_path / "mlflow.log").open("wb")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    proc = subprocess.Popen(
        [
            str(BIN / "mlflow"),
            "server",
            "--backend-store-uri",
            store,
            "--artifacts-destination",
            str(tmp_path / "artifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            if proc.poll() is not None:
                pytest.fail(
                    f"mlflow server exited: {(tmp_path / 'mlflow.log').read_text()[-2000:]}"
                )
            try:
                if webclient.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("mlflow server on PostgreSQL did not become healthy")
            time.sleep(0.5)
        yield url
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait(timeout=20)
        log.close()


@pytest.mark.slow  # an MLflow server migrating a PostgreSQL store: about a minute
@pytest.mark.parallel_safe
def test_register_and_assign_on_mlflow_server_with_postgres_and_postgres_ledger(
    proj: Proj, pg_server: Any, pg_mlflow: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Register two releases and move production between them with MLflow served from
    PostgreSQL and the ledger in PostgreSQL: one alias holder, no drift, ledger verifies."""
    ledger_url = pg_server.create_database()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", pg_mlflow)
    monkeypatch.setenv("RELEASEKIT_LEDGER_URL", ledger_url)
    s = load_settings(root=proj.root)
    a = proj.build("demo-bf16")
    b = proj.build("demo-w4a16")
    ra = register_release(s, proj.manifest("demo-bf16"))
    register_release(s, proj.manifest("demo-w4a16"))
    assert ra.created and ra.tracking_uri == pg_mlflow
    assert not register_release(s, proj.manifest("demo-bf16")).created
    assign(s, a.release_id, env="production", reason="first")
    res = assign(s, b.release_id, env="production", reason="second")
    assert res.changed and res.previous_release_id == a.release_id

    client = MlflowClient(tracking_uri=pg_mlflow, registry_uri=pg_mlflow)
    holders = [
        (rm.name, str(rm.aliases["production"]))
        for rm in client.search_registered_models()
        if "production" in (rm.aliases or {})
    ]
    assert holders == [("demo-w4a16", "1")]
    st = checked_status(s)
    assert [(e.environment, e.drift) for e in st.environments] == [("production", "ok")]
    led = open_ledger(s, read_only=True)
    v = led.verify()
    assert v.ok and v.records == 4 and v.anchoring == "anchored" and v.anchored_seq == 4
