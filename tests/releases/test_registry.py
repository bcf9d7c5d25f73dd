"""MLflow registry: one run and one model version per release, prompts in the prompt registry,
idempotent re-registration, environment aliases that always match the ledger."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from mlflow import MlflowClient
from typer.testing import CliRunner

from releasekit.cli import app
from releasekit.errors import LedgerError, LockError, RegistryError
from releasekit.releases import queries as audit
from releasekit.releases.assign import assign
from releasekit.releases.register import register_release
from releasekit.stores.ledger import Ledger

# The shared fixtures, loaded as a plugin so session-scoped ones are made once per session.
if TYPE_CHECKING:
    from tests.releases.conftest import Proj

runner = CliRunner()


def _client(p: Proj) -> MlflowClient:
    uri = p.settings.mlflow_tracking_uri
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def test_register_logs_run_version_prompts_and_ledger_event(mlproj: Proj) -> None:
    lk = mlproj.build("demo-bf16")
    res = register_release(mlproj.settings, mlproj.manifest("demo-bf16"))
    assert res.created and res.version == "1" and res.release_id == lk.release_id
    c = _client(mlproj)

    mv = c.get_model_version("demo-bf16", "1")
    assert mv.tags["release_id"] == lk.release_id
    assert mv.tags["git_commit"] == lk.provenance.commit and len(mv.tags["git_commit"]) == 40
    assert mv.tags["builder"] == mlproj.actor
    assert mv.tags["run_id"] == res.run_id == mv.run_id

    run = c.get_run(res.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["lock.release_id"] == lk.release_id
    assert run.data.params["lock.inputs.prompt/user"] == lk.inputs["prompt/user"]
    assert run.data.params["manifest.serving.args.max-num-seqs"] == "32"
    assert run.data.metrics["eval.core.pass_rate"] == pytest.approx(0.9)
    assert run.data.metrics["bench.knee.ttft_p95_s"] == pytest.approx(0.2)
    assert run.data.metrics["quantise.size_after_bytes"] == 4_000_000
    sweep = c.get_metric_history(res.run_id, "bench.sweep.ttft_p95_s")
    assert [m.step for m in sweep] == [0, 1, 2]
    arts = {
        a.path
        for folder in ("release", "eval", "bench", "report", "prompts", "")
        for a in c.list_artifacts(res.run_id, folder or None)
    }
    for expected in (
        "release/manifest.yaml",
        "release/lock.json",
        "eval/eval.json",
        "bench/bench.json",
        "bench/bench.png",
        "report/compare.json",
        "prompts/user.txt",
        "quantise.json",
    ):
        assert expected in arts

    # Prompts: in MLflow's prompt registry, linked to the run and the version's model.
    assert res.prompt_uri == "prompts:/demo-bf16.chat/1" == mv.tags["prompt_uri"]
    pv = c.get_prompt_version("demo-bf16.chat", 1)
    # The text the release sends: the file without its final newline.
    user = (mlproj.root / "prompts/demo/user.txt").read_text().removesuffix("\n")
    assert pv.template[-1] == {"role": "user", "content": user}
    linked = json.loads(c.get_logged_model(mv.tags["logged_model_id"]).tags["mlflow.linkedPrompts"])
    assert linked == [{"name": "demo-bf16.chat", "version": "1"}]
    assert "demo-bf16.chat" in run.data.tags["mlflow.linkedPrompts"]

    # The ledger records it, with links to the evidence.
    (ev,) = Ledger(mlproj.settings.ledger_url or "").records()
    assert ev.type == "register" and ev.to_release == lk.release_id and ev.actor == mlproj.actor
    assert ev.evidence["mlflow_run_id"] == res.run_id
    assert ev.evidence["reports"]["eval/eval.json"]


def test_registering_the_same_release_twice_creates_nothing(mlproj: Proj) -> None:
    mlproj.build("demo-bf16")
    first = register_release(mlproj.settings, mlproj.manifest("demo-bf16"))
    again = register_release(mlproj.settings, mlproj.manifest("demo-bf16"))
    assert not again.created
    assert (again.version, again.run_id) == (first.version, first.run_id)
    c = _client(mlproj)
    assert len(c.search_model_versions("name = 'demo-bf16'")) == 1
    exp = c.get_experiment_by_name("releasekit/demo-bf16")
    assert len(c.search_runs([exp.experiment_id])) == 1
    assert len(c.search_prompt_versions("demo-bf16.chat")) == 1
    assert Ledger(mlproj.settings.ledger_url or "").count() == 1


def test_interrupted_registration_is_completed_without_duplicates(mlproj: Proj) -> None:
    """A run that finished but got no version is reused; a version the ledger missed is
    recorded on the next register."""
    mlproj.build("demo-bf16")
    s = mlproj.settings
    first = register_release(s, mlproj.manifest("demo-bf16"))
    c = _client(mlproj)
    c.delete_model_version("demo-bf16", first.version)  # as if we died before creating it
    second = register_release(s, mlproj.manifest("demo-bf16"))
    assert second.created and second.run_id == first.run_id
    exp = c.get_experiment_by_name("releasekit/demo-bf16")
    assert len(c.search_runs([exp.experiment_id])) == 1

    db = Path((s.ledger_url or "").removeprefix("sqlite:///"))
    db.unlink()  # as if we died before the ledger append
    for suffix in ("-wal", "-shm"):
        Path(f"{db}{suffix}").unlink(missing_ok=True)
    third = register_release(s, mlproj.manifest("demo-bf16"))
    assert not third.created and third.ledger_seq == 1
    (rec,) = Ledger(s.ledger_url or "").records()
    assert rec.type == "register" and rec.evidence["model_version"] == second.version


def test_release_without_bench_registers_its_eval_only(mlproj: Proj) -> None:
    mlproj.build("demo-bf16", bench=False)
    res = register_release(mlproj.settings, mlproj.manifest("demo-bf16"))
    metrics = _client(mlproj).get_run(res.run_id).data.metrics
    assert "eval.core.pass_rate" in metrics
    assert not any(k.startswith("bench.") for k in metrics)


def test_unreadable_build_output_registers_nothing(mlproj: Proj) -> None:
    lk = mlproj.build("demo-bf16")
    (mlproj.settings.release_dir(lk.release_id) / "eval" / "eval.json").write_text("{oops")
    with pytest.raises(RegistryError, match=r"eval\.json"):
        register_release(mlproj.settings, mlproj.manifest("demo-bf16"))
    assert _client(mlproj).search_model_versions("name = 'demo-bf16'") == []
    assert Ledger(mlproj.settings.ledger_url or "").count() == 0


def test_prompt_edited_after_lock_is_refused(mlproj: Proj) -> None:
    mlproj.build("demo-bf16")
    (mlproj.root / "prompts/demo/user.txt").write_text("Q: {{ question }}\n")
    with pytest.raises(LockError, match="prompt 'user'"):
        register_release(mlproj.settings, mlproj.manifest("demo-bf16"))


def test_assign_back_and_forth_matches_mlflow_aliases_and_status(mlproj: Proj) -> None:
    """The auditor's check: get_model_version_by_alias(name, env) matches `status`, and
    searching versions by the release-id tag finds each release."""
    mlproj.variant("demo-bf16", "demo-prompt2", {"user.txt": "user_v2.txt"})
    a = mlproj.build("demo-bf16")
    b = mlproj.build("demo-w4a16", pass_rate=0.85)
    c2 = mlproj.build("demo-prompt2")
    s = mlproj.settings
    for name in ("demo-bf16", "demo-w4a16", "demo-prompt2"):
        register_release(s, mlproj.manifest(name))

    assign(s, a.release_id[:10], env="staging", reason="first")
    assign(s, "demo-bf16@1", env="production", reason="first prod")
    assign(s, str(mlproj.manifest("demo-w4a16")), env="staging", reason="try 4-bit")
    assign(s, b.release_id, env="production", reason="4-bit passed")
    assign(s, c2.release_id, env="staging", reason="new prompt")
    res = assign(s, a.release_id, env="production", reason="roll back to bf16")
    assert res.changed and res.previous_release_id == b.release_id

    client = _client(mlproj)
    st = {e.environment: e for e in audit.status(s).environments}
    assert set(st) == {"staging", "production"}
    for env, e in st.items():
        mv = client.get_model_version_by_alias(e.model_name, env)
        assert (mv.name, str(mv.version), mv.tags["release_id"]) == (
            e.model_name,
            e.model_version,
            e.release_id,
        )
    assert st["production"].release_id == a.release_id
    assert st["staging"].release_id == c2.release_id
    # Exactly one model carries each environment's alias.
    for name in ("demo-bf16", "demo-w4a16", "demo-prompt2"):
        aliases = client.get_registered_model(name).aliases
        for env in aliases:
            assert st[env].model_name == name
    for lk in (a, b, c2):
        (mv,) = client.search_model_versions(f"tags.release_id = '{lk.release_id}'")
        assert mv.tags["release_id"] == lk.release_id

    # Re-assigning what is already live records nothing.
    n = Ledger(s.ledger_url or "").count()
    again = assign(s, a.release_id, env="production", reason="again")
    assert not again.changed and Ledger(s.ledger_url or "").count() == n


def test_assign_changes_nothing_when_the_ledger_is_busy(mlproj: Proj) -> None:
    """With the ledger's database write-locked by another process, assign cannot take the
    environment's lock: it fails naming the busy ledger, and neither the alias nor the
    ledger changes (the event is always written before the alias moves)."""
    a = mlproj.build("demo-bf16")
    b = mlproj.build("demo-w4a16")
    s = mlproj.settings
    register_release(s, mlproj.manifest("demo-bf16"))
    register_release(s, mlproj.manifest("demo-w4a16"))
    assign(s, a.release_id, env="production", reason="first")
    led = Ledger(s.ledger_url or "", timeout_s=0.3)
    before = led.count()

    # Another process holds the ledger's write lock: the append cannot happen.
    db = Path((s.ledger_url or "").removeprefix("sqlite:///"))
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(LedgerError, match="write lock"):
            assign(
                s, b.release_id, env="production", reason="blocked", ledger=led, lock_timeout_s=2
            )
    finally:
        holder.execute("ROLLBACK")
        holder.close()

    client = _client(mlproj)
    assert (
        client.get_model_version_by_alias("demo-bf16", "production").tags["release_id"]
        == a.release_id
    )
    assert "production" not in client.get_registered_model("demo-w4a16").aliases
    assert led.count() == before and led.verify().ok


def test_assign_refuses_unknown_environment_and_unregistered_release(mlproj: Proj) -> None:
    a = mlproj.build("demo-bf16")
    b = mlproj.build("demo-w4a16")
    register_release(mlproj.settings, mlproj.manifest("demo-bf16"))
    with pytest.raises(RegistryError, match="not one of the release's environments"):
        assign(mlproj.settings, a.release_id, env="prodution", reason="typo")
    with pytest.raises(RegistryError, match="not registered"):
        assign(mlproj.settings, b.release_id, env="staging", reason="x")
    assert Ledger(mlproj.settings.ledger_url or "").count() == 1


def test_cli_register_and_assign(mlproj: Proj) -> None:
    lk = mlproj.build("demo-bf16")
    res = runner.invoke(app, ["register", "--json", "manifests/demo-bf16.yaml"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["release_id"] == lk.release_id
    res = runner.invoke(app, ["register", "manifests/demo-bf16.yaml"])
    assert res.exit_code == 0 and "already registered" in res.stdout
    res = runner.invoke(
        app, ["assign", "demo-bf16@1", "--env", "staging", "--reason", "go", "--json"]
    )
    assert res.exit_code == 0, res.output
    body = json.loads(res.stdout)
    assert body["release_id"] == lk.release_id and body["record"]["seq"] == 2
    res = runner.invoke(app, ["assign", lk.release_id, "--env", "nowhere", "--reason", "x"])
    assert res.exit_code == 1 and "error:" in res.stderr and "Traceback" not in res.output
    res = runner.invoke(app, ["assign", lk.release_id, "--env", "staging", "--reason", " "])
    assert res.exit_code == 2


def test_register_and_assign_against_a_real_mlflow_server(
    proj: Proj, mlflow_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLFLOW_TRACKING_URI is honoured: the same code registers over HTTP."""
    from releasekit.config import load_settings

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    s = load_settings(root=proj.root)
    assert s.mlflow_tracking_uri == mlflow_server
    lk = proj.build("demo-bf16")
    res = register_release(s, proj.manifest("demo-bf16"))
    assert res.created and res.tracking_uri == mlflow_server
    assert not register_release(s, proj.manifest("demo-bf16")).created
    assign(s, lk.release_id, env="staging", reason="over http")

    client = MlflowClient(tracking_uri=mlflow_server, registry_uri=mlflow_server)
    mv = client.get_model_version_by_alias("demo-bf16", "staging")
    assert mv.tags["release_id"] == lk.release_id
    assert len(client.search_model_versions(f"tags.release_id = '{lk.release_id}'")) == 1
    local = client.download_artifacts(res.run_id, "bench/bench.json", str(proj.root / "dl"))
    assert json.loads(Path(local).read_text())["release_id"] == lk.release_id
    assert client.get_prompt_version("demo-bf16.chat", 1).template[0]["role"] == "system"
    assert audit.show(s, "demo-bf16@1").registry.run_url.startswith(mlflow_server)  # type: ignore[union-attr]
