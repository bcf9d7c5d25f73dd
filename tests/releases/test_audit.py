"""Auditor queries: release references, status, history, what was live at T, show, diff."""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import time
from typing import TYPE_CHECKING

import pytest
from typer.testing import CliRunner

from releasekit.cli import app
from releasekit.errors import ReleaseNotFoundError, TimeParseError
from releasekit.releases.queries import at, diff, history, show, status
from releasekit.releases.resolve import parse_time, resolve_release
from releasekit.spec.lock import Lock
from releasekit.stores.ledger import Event, EventType, Ledger

# The shared fixtures, loaded as a plugin so session-scoped ones are made once per session.
if TYPE_CHECKING:
    from tests.releases.conftest import Proj

runner = CliRunner()


def _ledger(p: Proj) -> Ledger:
    return Ledger(p.settings.ledger_url or "")


def _registered(p: Proj, lk: Lock, version: int) -> None:
    """The register event registry.register_release writes (without MLflow, for speed)."""
    _ledger(p).append(
        Event(
            type=EventType.REGISTER,
            to_release=lk.release_id,
            reason="registered",
            evidence={
                "model_name": lk.name,
                "model_version": str(version),
                "mlflow_run_id": f"run{version}",
                "manifest": lk.manifest,
                "model_uri": f"models:/{lk.name}/{version}",
                "tracking_uri": "http://mlflow.example:5000",
                "mlflow_experiment_id": "7",
            },
        )
    )


def _assign(
    p: Proj,
    lk: Lock,
    env: str,
    version: int,
    reason: str,
    prev: Lock | None = None,
    etype: str = "assign",
) -> None:
    _ledger(p).append(
        Event(
            type=etype,
            environment=env,
            to_release=lk.release_id,
            from_release=prev.release_id if prev else None,
            reason=reason,
            live=True,
            evidence={"model_name": lk.name, "model_version": str(version)},
        )
    )


@pytest.fixture
def three(proj: Proj) -> tuple[Proj, Lock, Lock, Lock]:
    """bf16, w4a16 and a prompt-edited bf16, built and 'registered' in the ledger."""
    proj.variant("demo-bf16", "demo-prompt2", {"user.txt": "user_v2.txt"})
    a = proj.build("demo-bf16", pass_rate=0.9, ttft_p95=0.20)
    b = proj.build("demo-w4a16", pass_rate=0.85, ttft_p95=0.15, size_after=1_500_000)
    c = proj.build("demo-prompt2", pass_rate=0.8, bench=False)
    for lk in (a, b, c):
        _registered(proj, lk, 1)
    return proj, a, b, c


def test_release_references_resolve_every_way(three: tuple[Proj, Lock, Lock, Lock]) -> None:
    p, a, b, _ = three
    s = p.settings
    _assign(p, b, "production", 1, "go")
    assert resolve_release(s, a.release_id).how == "id"
    assert resolve_release(s, a.release_id[:8]).release_id == a.release_id
    assert resolve_release(s, "demo-w4a16@1").release_id == b.release_id
    assert resolve_release(s, "demo-w4a16@production").release_id == b.release_id
    assert resolve_release(s, "manifests/demo-bf16.yaml").release_id == a.release_id
    with pytest.raises(ReleaseNotFoundError, match="no release matches"):
        resolve_release(s, "f" * 12)
    with pytest.raises(ReleaseNotFoundError, match="not a release id"):
        resolve_release(s, "latest-and-greatest")
    with pytest.raises(ReleaseNotFoundError):
        resolve_release(s, "manifests/nope.yaml")
    with pytest.raises(ReleaseNotFoundError, match="no release of demo-bf16 is live"):
        resolve_release(s, "demo-bf16@production")


def test_ambiguous_prefix_is_refused(proj: Proj) -> None:
    for rid in ("abc1" + "0" * 60, "abc2" + "0" * 60):
        proj.settings.release_dir(rid).mkdir(parents=True)
    with pytest.raises(ReleaseNotFoundError, match="ambiguous: 2 releases"):
        resolve_release(proj.settings, "abc")
    assert resolve_release(proj.settings, "abc2").release_id.startswith("abc2")


def test_unknown_name_at_version_asks_mlflow_then_fails(mlproj: Proj) -> None:
    with pytest.raises(
        ReleaseNotFoundError, match="no release is registered as demo-bf16 version 9"
    ):
        resolve_release(mlproj.settings, "demo-bf16@9")


def test_status_history_and_at_answer_the_auditor(three: tuple[Proj, Lock, Lock, Lock]) -> None:
    p, a, b, c = three
    s = p.settings
    _assign(p, a, "staging", 1, "first")
    _assign(p, a, "production", 1, "first prod")
    time.sleep(0.01)
    t_a_live = dt.datetime.now(dt.UTC)
    time.sleep(0.01)
    _ledger(p).append(
        Event(
            type="gate_failed",
            environment="production",
            to_release=c.release_id,
            reason="core pass rate fell",
        )
    )
    _assign(p, b, "production", 1, "4-bit is no worse", prev=a, etype="promote")

    st = {e.environment: e for e in status(s).environments}
    assert st["production"].release_id == b.release_id and st["production"].event_type == "promote"
    assert st["production"].actor == p.actor and st["staging"].release_id == a.release_id

    then = at(s, "production", t_a_live)
    assert then.release_id == a.release_id and then.record is not None
    assert then.record.reason == "first prod" and then.record.actor == p.actor
    assert then.metrics["eval.core.pass_rate"] == pytest.approx(0.9)
    assert at(s, "production", dt.datetime.now(dt.UTC)).release_id == b.release_id
    assert at(s, "production", t_a_live - dt.timedelta(hours=1)).release_id is None

    prod = history(s, env="production")
    assert [e.type for e in prod.events] == ["assign", "gate_failed", "promote"]
    assert [e.seq for e in history(s, release=a.release_id[:10]).events] == [1, 4, 5, 7]
    assert [e.type for e in history(s, since=t_a_live).events] == ["gate_failed", "promote"]
    assert len(history(s, until=t_a_live).events) == 5
    rows = list(csv.DictReader(io.StringIO(prod.to_csv())))
    assert rows[-1]["to_release"] == b.release_id
    assert json.loads(rows[-1]["evidence"])["model_name"] == "demo-w4a16"


def test_show_gathers_a_release(three: tuple[Proj, Lock, Lock, Lock]) -> None:
    p, _, b, _ = three
    _assign(p, b, "production", 1, "go")
    d = show(p.settings, "demo-w4a16@1")
    assert d.release_id == b.release_id and d.name == "demo-w4a16"
    assert d.inputs == b.inputs and d.provenance and d.provenance.commit == b.provenance.commit
    assert d.manifest and d.manifest["quantisation"]["scheme"] == "W4A16"
    assert d.registry and d.registry.run_id == "run1"
    assert d.registry.run_url == "http://mlflow.example:5000/#/experiments/7/runs/run1"
    assert d.eval and d.eval.suites["core"].pass_rate == pytest.approx(0.85)
    assert d.bench_knee and d.bench_knee.load == 4
    assert d.metrics["bench.knee.ttft_p95_s"] == pytest.approx(0.15)
    assert d.live_in == ["production"]
    assert [e.type for e in d.events] == ["register", "assign"]
    assert "bench/bench.json" in d.files


def test_show_a_release_without_bench_says_so(three: tuple[Proj, Lock, Lock, Lock]) -> None:
    p, _, _, c = three
    d = show(p.settings, c.release_id)
    assert d.bench_knee is None and "bench" in d.missing and "bench_plot" in d.missing
    assert not any(k.startswith("bench.") for k in d.metrics)


def test_diff_shows_prompt_quantisation_serving_and_metric_changes(
    three: tuple[Proj, Lock, Lock, Lock],
) -> None:
    p, a, _, c = three
    d = diff(p.settings, a.release_id, c.release_id)
    assert d.differs
    (user,) = [x for x in d.prompts if x.role == "user"]
    assert not user.same
    assert "-Answer:" in user.diff and "+Answer briefly:" in user.diff
    assert [x.same for x in d.prompts if x.role == "system"] == [True]
    delta = {m.name: m for m in d.metrics}
    assert delta["eval.core.pass_rate"].delta == pytest.approx(0.8 - 0.9)
    assert delta["bench.knee.ttft_p95_s"].b is None

    q = diff(p.settings, "demo-bf16@1", "demo-w4a16@1")
    keys = {ch.key: ch for ch in q.quantisation}
    assert keys["recipe.scheme"].a == "none" and keys["recipe.scheme"].b == "W4A16"
    assert keys["result.size_after_bytes"].b == 1_500_000
    assert all(x.same for x in q.prompts)
    assert {ch.key for ch in q.inputs} >= {"quantisation/calibration"}

    same = diff(p.settings, a.release_id, "manifests/demo-bf16.yaml")
    assert not same.differs and not same.quantisation and not same.serving


def test_diff_reports_serving_argument_changes(proj: Proj) -> None:
    Ledger(proj.settings.ledger_url or "").close()  # diff reads the ledger; it must exist
    proj.variant("demo-bf16", "demo-seqs", {"max-num-seqs: 32": "max-num-seqs: 8"})
    a = proj.build("demo-bf16")
    b = proj.build("demo-seqs")
    d = diff(proj.settings, a.release_id, b.release_id)
    changes = {ch.key: (ch.a, ch.b) for ch in d.serving}
    assert changes["args.max-num-seqs"] == ("32", "8")
    assert "args.served-model-name" not in changes


def test_cli_auditor_commands(three: tuple[Proj, Lock, Lock, Lock]) -> None:
    p, a, b, _ = three
    _assign(p, a, "production", 1, "first")
    _assign(p, b, "production", 1, "second", prev=a)

    # The ledger answers; the MLflow cross-check cannot run (this project has no MLflow
    # store), which status says, and exits 1 for, without creating one.
    res = runner.invoke(app, ["status"])
    assert "production" in res.stdout and b.release_id[:12] in res.stdout
    assert res.exit_code == 1 and "no MLflow store at sqlite:///" in res.stderr
    assert not (p.settings.state_dir / "mlflow.db").exists()
    res = runner.invoke(app, ["status", "--json"])
    env0 = json.loads(res.stdout)["environments"][0]
    assert env0["release_id"] == b.release_id and env0["drift"] == "unchecked"

    res = runner.invoke(app, ["history", "--env", "production", "--csv"])
    assert res.exit_code == 0 and len(list(csv.DictReader(io.StringIO(res.stdout)))) == 2
    res = runner.invoke(app, ["history", "--json", "--release", "demo-w4a16@1"])
    assert [e["type"] for e in json.loads(res.stdout)["events"]] == ["register", "assign"]
    res = runner.invoke(app, ["history", "--since", "yesterday"])
    assert res.exit_code == 2 and "not a time" in res.output

    res = runner.invoke(app, ["at", "production", "now", "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["release_id"] == b.release_id
    res = runner.invoke(app, ["at", "production", "2000-01-01"])
    assert res.exit_code == 0 and "nothing was live" in res.stdout

    res = runner.invoke(app, ["show", b.release_id[:8]])
    assert res.exit_code == 0 and b.release_id in res.stdout
    res = runner.invoke(app, ["show", "--json", "manifests/demo-bf16.yaml"])
    assert json.loads(res.stdout)["release_id"] == a.release_id
    res = runner.invoke(app, ["show", "nope"])
    assert res.exit_code == 1 and "error:" in res.stderr

    res = runner.invoke(app, ["diff", "demo-bf16@1", "demo-w4a16@1", "--exit-code"])
    assert res.exit_code == 1 and "W4A16" in res.stdout
    res = runner.invoke(app, ["diff", a.release_id, "manifests/demo-bf16.yaml", "--exit-code"])
    assert res.exit_code == 0 and "same release" in res.stdout
    res = runner.invoke(app, ["diff", "--json", a.release_id, b.release_id])
    assert json.loads(res.stdout)["b"]["release_id"] == b.release_id


def test_parse_time_accepts_iso_now_and_relative() -> None:
    now = dt.datetime(2025, 5, 1, 12, 0, tzinfo=dt.UTC)
    assert parse_time("2025-05-01", now=now) == dt.datetime(2025, 5, 1, tzinfo=dt.UTC)
    assert parse_time("2025-05-01T14:00:00+02:00", now=now) == now
    assert parse_time("2025-05-01 12:00", now=now) == now
    assert parse_time("2h ago", now=now) == now - dt.timedelta(hours=2)
    assert parse_time("now", now=now) == now
    with pytest.raises(TimeParseError):
        parse_time("last tuesday", now=now)
