"""`releasekit export kuberay`: a release on a `ray` environment as a KubeRay RayService
whose serveConfigV2 is the Serve config the `ray` target deploys. Ray's own schema accepts
it, its application args are `release_app_args`'s (what `RayTarget.start` builds from),
bad input is one line with nothing written, and Ray's own `serve deploy` of it on a real
loopback cluster (tests/deploy/ray_kit.py) serves the release through the router.

This module's pytest process never joins a Ray cluster: it talks to the cluster through
`serve deploy`, `serve status` and `python -c` children (one process that initialises
several clusters in turn crashes in Ray)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from promote_kit import Kit, kill_everything, make_kit
from ray_kit import LOOPBACK_ENV, RayCluster, env_lines, free_slot
from typer.testing import CliRunner

from releasekit._support.http import http_client

pytest.importorskip("ray")

import releasekit
from releasekit.cli import app
from releasekit.config import load_settings
from releasekit.deploy.ray.replica import APP_BUILDER, ROUTER_APP, routing_token
from releasekit.deploy.ray.target import app_name, release_app_args, router_secret
from releasekit.deploy.target import ReleaseSpec
from releasekit.promote.context import load_release, release_spec
from releasekit.stores.ledger import Ledger

ROOT = Path(releasekit.__file__).resolve().parents[1]
FAKE_RAY = RayCluster(slot=9, root=Path("/nonexistent"))  # an address only: nothing runs


def _kit(project: Path, monkeypatch: pytest.MonkeyPatch, db: Path, c: RayCluster) -> Kit:
    k = make_kit(project, monkeypatch, db, toml_lines=env_lines(c, cpus_per_replica=1))
    # one more environment, on the local target
    with (project / "releasekit.toml").open("a") as fh:
        fh.write(f"[environments.dev]\nport = {k.ports['production'] + 1}\n")
    k.settings = load_settings(root=project)
    return k


@pytest.fixture
def ekit(
    project: Path, monkeypatch: pytest.MonkeyPatch, mlflow_template_db: Path, stand_in_model: Any
) -> Iterator[Kit]:
    """A deploy-test project whose staging and production are `ray` environments (on a
    cluster that does not run: the export never connects) and `dev` is `local`."""
    stand_in_model(project)
    k = _kit(project, monkeypatch, mlflow_template_db, FAKE_RAY)
    try:
        yield k
    finally:
        kill_everything(k.settings)


def _spec(k: Kit, rid: str) -> ReleaseSpec:
    led = Ledger("sqlite://")  # in memory: the project gets no ledger file
    return release_spec(k.settings, load_release(k.settings, rid, ledger=led), ledger=led)


def _files(root: Path) -> dict[str, float]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*")}


def _export(*args: str) -> Any:
    return CliRunner().invoke(app, ["export", "kuberay", *args], env={"COLUMNS": "200"})


def test_the_exported_serve_config_is_what_the_ray_target_deploys(ekit: Kit) -> None:
    """The manifest is a RayService whose serveConfigV2 passes Ray's own Serve schema, and
    the release's application there has the name, options and constructor arguments the
    ray target deploys (`release_app_args`, which `RayTarget.start` builds from); the
    export creates nothing but --out."""
    from ray.serve.schema import ServeDeploySchema

    rid = ekit.build("demo-bf16", register=False)
    before = _files(ekit.root)
    out = ekit.root / "rayservice.yaml"
    r = _export(rid[:12], "--env", "staging", "--out", str(out))
    assert r.exit_code == 0, r.output
    after = _files(ekit.root)
    assert set(after) - set(before) == {"rayservice.yaml"}
    assert {k: v for k, v in after.items() if k != "rayservice.yaml"} == before

    doc = yaml.safe_load(out.read_text())
    assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", "RayService")
    config = yaml.safe_load(doc["spec"]["serveConfigV2"])
    schema = ServeDeploySchema.model_validate(config)
    apps = {a.name: a for a in schema.applications}
    name = app_name("staging", rid)
    assert set(apps) == {name, ROUTER_APP}
    assert apps[name].import_path == APP_BUILDER and apps[name].route_prefix is None
    assert apps[ROUTER_APP].route_prefix == "/"

    spec = _spec(ekit, rid)
    cfg = ekit.settings.environments["staging"]
    shared = release_app_args(ekit.settings, "staging", cfg, spec)
    assert apps[name].args == shared.model_dump(mode="json")
    assert shared.replica.app == name
    assert shared.options["num_replicas"] == 2 and shared.options["name"] == "server"
    assert shared.options["ray_actor_options"] == {"num_cpus": 1.0}
    assert shared.options["health_check_period_s"] == 1.0
    assert shared.replica.model_dir == str(Path(spec.model_dir).resolve())
    assert shared.replica.engine_args == spec.engine_args
    assert config["http_options"] == {"host": "127.0.0.1", "port": FAKE_RAY.serve_port}
    # no secret: neither a router key nor its digest is written anywhere
    assert not (ekit.settings.state_dir / "deploy" / "staging-router.key").exists()
    assert "router.key" not in out.read_text()
    workers = doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    assert workers["replicas"] == 2
    assert "REPLACE-ME" in workers["template"]["spec"]["containers"][0]["image"]

    # without --out it prints the same manifest
    printed = _export(rid, "--env", "staging")
    assert printed.exit_code == 0 and yaml.safe_load(printed.stdout) == doc


def _one_line_error(r: Any, *words: str) -> None:
    assert r.exit_code == 1, r.output
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert lines[0].startswith("error:") and "Traceback" not in r.output, r.output
    assert all(w in lines[0] for w in words), lines[0]
    assert len(lines) <= 2 and (len(lines) == 1 or "hint:" in lines[1]), r.output


def test_bad_input_is_one_line_and_writes_nothing(ekit: Kit) -> None:
    """An unknown release, an unknown environment, an environment on another target and
    a model folder that cannot be read: one error line with a hint, exit 1, no file."""
    rid = ekit.build("demo-bf16", register=False)
    out = ekit.root / "out.yaml"
    before = _files(ekit.root)

    _one_line_error(_export("f" * 12, "--env", "staging", "--out", str(out)), "f" * 12)
    _one_line_error(_export(rid, "--env", "nowhere", "--out", str(out)), "nowhere")
    _one_line_error(_export(rid, "--env", "dev", "--out", str(out)), "dev", "local")

    model = Path(_spec(ekit, rid).model_dir)
    model.chmod(0o000)
    try:
        if os.access(model, os.R_OK):  # root reads anything: make it vanish instead
            model.chmod(0o755)
            model.rename(model.with_name("gone"))
        _one_line_error(_export(rid, "--env", "staging", "--out", str(out)), "model folder")
    finally:
        if model.with_name("gone").exists():
            model.with_name("gone").rename(model)
        model.chmod(0o755)
    assert not out.exists()
    assert _files(ekit.root).keys() == before.keys()


# -- a real cluster --------------------------------------------------------------------------


def _ray_env() -> dict[str, str]:
    """Environment for the cluster and its clients: this checkout first on the path."""
    path = os.environ.get("PYTHONPATH", "")
    return {
        **os.environ,
        **LOOPBACK_ENV,
        "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else ""),
    }


def _serve(args: list[str], dash: str) -> subprocess.CompletedProcess[str]:
    serve_cli = Path(sys.executable).with_name("serve")
    return subprocess.run(
        [str(serve_cli), *args, "--address", dash],
        capture_output=True,
        text=True,
        check=False,
        env=_ray_env(),
        timeout=300,
    )


def _statuses(dash: str) -> dict[str, str]:
    r = _serve(["status"], dash)
    if r.returncode != 0:
        return {}
    doc = yaml.safe_load(r.stdout) or {}
    return {name: a.get("status", "") for name, a in (doc.get("applications") or {}).items()}


def test_serve_deploy_of_the_export_serves_the_release(
    project: Path,
    monkeypatch: pytest.MonkeyPatch,
    mlflow_template_db: Path,
    stand_in_model: Any,
    tmp_path: Path,
) -> None:
    """Ray's own `serve deploy` of the exported serveConfigV2 on a real loopback cluster:
    both applications reach RUNNING, and the release answers through the router with the
    environment's secret (recorded in the cluster as releasekit does when it connects),
    and only with it."""
    c = RayCluster(slot=free_slot(), root=tmp_path)
    for key, value in _ray_env().items():
        monkeypatch.setenv(key, value)
    stand_in_model(project)
    k = _kit(project, monkeypatch, mlflow_template_db, c)
    monkeypatch.setenv("RELEASEKIT_SERVER_START_TIMEOUT_S", "120")
    k.settings = load_settings(root=project)
    try:
        c.add_node(num_cpus=3, dashboard=True)
        rid = k.build("demo-bf16", register=False)
        out = tmp_path / "rayservice.yaml"
        r = _export(rid, "--env", "staging", "--out", str(out))
        assert r.exit_code == 0, r.output
        config = tmp_path / "serve.yaml"
        config.write_text(yaml.safe_load(out.read_text())["spec"]["serveConfigV2"])

        dash = f"http://127.0.0.1:{c.dashboard_port}"
        deployed = _serve(["deploy", str(config)], dash)
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr

        name = app_name("staging", rid)
        end = time.monotonic() + 300
        seen: dict[str, str] = {}
        while time.monotonic() < end:
            seen = _statuses(dash)
            if seen.get(name) == "RUNNING" and seen.get(ROUTER_APP) == "RUNNING":
                break
            assert seen.get(name) not in ("DEPLOY_FAILED", "UNHEALTHY"), _serve(["status"], dash)
            time.sleep(2)
        assert seen.get(name) == "RUNNING" and seen.get(ROUTER_APP) == "RUNNING", seen

        spec = _spec(k, rid)
        proxy = f"http://127.0.0.1:{c.serve_port}"
        secret = router_secret(k.settings.state_dir, "staging")
        token = routing_token(name, secret, spec.api_key)
        with http_client(base_url=proxy, timeout=60.0, trust_env=False) as h:
            # the manifest holds no secret: until releasekit records it, nothing gets in
            early = h.get("/v1/models", headers={"authorization": f"Bearer {token}"})
            assert early.status_code == 401, early.text
            # what releasekit does when it connects: record the environment's secret digest
            publish = (
                "import sys\n"
                "from releasekit.config import RayTargetConfig\n"
                "from releasekit.deploy.ray.cluster import connect\n"
                "from releasekit.deploy.ray.replica import publish_secret\n"
                "connect(RayTargetConfig(address=sys.argv[1]))\n"
                "publish_secret('staging', sys.stdin.read())\n"
            )
            p = subprocess.run(
                [sys.executable, "-c", publish, c.address],
                input=secret,
                capture_output=True,
                text=True,
                check=False,
                env=_ray_env(),
                timeout=120,
            )
            assert p.returncode == 0, p.stderr[-2000:]

            models = h.get("/v1/models", headers={"authorization": f"Bearer {token}"})
            assert models.status_code == 200, models.text
            assert spec.served_name in {m["id"] for m in models.json()["data"]}
            answer = h.post(
                "/v1/chat/completions",
                headers={"authorization": f"Bearer {token}"},
                json={
                    "model": spec.served_name,
                    "messages": [{"role": "user", "content": "q1?"}],
                    "max_tokens": 8,
                },
            )
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"], json.dumps(answer.json())
            # the secret is what lets a request in
            wrong = routing_token(name, secret[:-1] + "x", spec.api_key)
            refused = h.get("/v1/models", headers={"authorization": f"Bearer {wrong}"})
            assert refused.status_code == 401
    finally:
        c.stop()
        kill_everything(k.settings)
