"""One truth for what runs where, under real failures: processes killed mid-assign,
concurrent assigns and registers from separate processes, a moved alias, wrong ledger URLs,
a run outside the project, a deleted ledger, and an MLflow that does not answer."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from mlflow import MlflowClient
from typer.testing import CliRunner

from releasekit.cli import app
from releasekit.cli._common import State
from releasekit.releases.assign import PAUSE_ENV, PAUSE_MARKER_ENV, assign
from releasekit.releases.reconcile import checked_status
from releasekit.releases.register import register_release
from releasekit.spec.lock import Lock
from releasekit.stores.ledger import EventType, Ledger

if TYPE_CHECKING:
    from tests.releases.conftest import Proj

BIN = Path(sys.executable).parent

runner = CliRunner()
NOTHING_LISTENS = 22990  # in the store tests' range, where nothing is started on it


def _client(p: Proj) -> MlflowClient:
    uri = p.settings.mlflow_tracking_uri
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def _env(p: Proj, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RELEASEKIT_", "MLFLOW_"))}
    env["RELEASEKIT_ACTOR"] = p.actor
    env.update(extra)
    return env


def _cli(
    p: Proj, *args: str, timeout: float = 120, extra: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "releasekit"), *args],
        cwd=p.root,
        env=_env(p, **(extra or {})),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _holders(p: Proj, env: str) -> list[tuple[str, str]]:
    """Every (model, version) that carries alias `env`, across the project's models."""
    client = _client(p)
    return sorted(
        (rm.name, str(rm.aliases[env]))
        for rm in client.search_registered_models()
        if env in (rm.aliases or {})
    )


@pytest.fixture
def two(mlproj: Proj) -> Iterator[tuple[Proj, Lock, Lock]]:
    """Two releases of two different models, registered; production runs the first."""
    a = mlproj.build("demo-bf16")
    b = mlproj.build("demo-w4a16")
    register_release(mlproj.settings, mlproj.manifest("demo-bf16"))
    register_release(mlproj.settings, mlproj.manifest("demo-w4a16"))
    assign(mlproj.settings, a.release_id, env="production", reason="first")
    yield mlproj, a, b


def _assign_paused(p: Proj, rid: str, marker: Path, pause: float) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [str(BIN / "releasekit"), "assign", rid, "--env", "production", "--reason", "paused"],
        cwd=p.root,
        env=_env(p, **{PAUSE_ENV: str(pause), PAUSE_MARKER_ENV: str(marker)}),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not marker.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            out = proc.communicate()[0] if proc.poll() is not None else "(still running)"
            pytest.fail(f"assign never reached the pause: {out}")
        time.sleep(0.05)
    return proc


def test_sigkill_between_event_and_alias_is_drift_that_status_shows_and_reconcile_repairs(
    two: tuple[Proj, Lock, Lock],
) -> None:
    """Killed after the ledger append and before the alias move: the ledger names b, the
    alias still names a; status reports the drift (exit 1), reconcile --dry-run changes
    nothing, reconcile moves the alias and records a repair event; the ledger verifies."""
    p, _a, b = two
    proc = _assign_paused(p, b.release_id, p.root / "paused", 60)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)

    led = Ledger(p.settings.ledger_url or "")
    assert led.live_at("production").to_release == b.release_id  # type: ignore[union-attr]
    assert _holders(p, "production") == [("demo-bf16", "1")]

    State.reset()
    res = runner.invoke(app, ["status", "--json"])
    env0 = json.loads(res.stdout)["environments"][0]
    assert res.exit_code == 1 and env0["drift"] == "drift"
    assert "the ledger (record" in env0["drift_detail"]
    assert "DRIFT" in runner.invoke(app, ["status"]).stdout

    dry = runner.invoke(app, ["reconcile", "--dry-run"])
    assert dry.exit_code == 0 and "would repair production" in dry.stdout
    assert _holders(p, "production") == [("demo-bf16", "1")]

    fix = runner.invoke(app, ["reconcile"])
    assert fix.exit_code == 0 and "repaired production" in fix.stdout, fix.output
    assert _holders(p, "production") == [("demo-w4a16", "1")]
    (rep,) = led.records(types=[EventType.REPAIR.value])
    assert rep.environment == "production" and rep.to_release == b.release_id and not rep.live
    assert runner.invoke(app, ["status"]).exit_code == 0
    assert runner.invoke(app, ["ledger", "verify"]).exit_code == 0


def test_sigterm_during_assign_still_moves_the_alias(two: tuple[Proj, Lock, Lock]) -> None:
    """SIGTERM between the append and the alias move is held until the move is done: the
    command exits as interrupted (130) and the ledger and MLflow agree."""
    p, _a, b = two
    proc = _assign_paused(p, b.release_id, p.root / "paused", 2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    assert _holders(p, "production") == [("demo-w4a16", "1")]
    State.reset()
    st = checked_status(p.settings)
    assert [(e.environment, e.drift) for e in st.environments] == [("production", "ok")]


def test_next_assign_repairs_an_alias_moved_by_hand_first(two: tuple[Proj, Lock, Lock]) -> None:
    """Someone points @production elsewhere by hand; the next assign to production records
    a repair event (from the ledger) before its own event, and leaves one alias holder."""
    p, _a, b = two
    client = _client(p)
    client.set_registered_model_alias("demo-w4a16", "production", "1")  # now two holders
    res = assign(p.settings, b.release_id, env="production", reason="second")
    assert res.repaired is not None and res.repaired.type == "repair"
    assert res.record is not None and res.repaired.seq < res.record.seq
    assert _holders(p, "production") == [("demo-w4a16", "1")]
    assert Ledger(p.settings.ledger_url or "").live_at("production").to_release == b.release_id  # type: ignore[union-attr]


RACERS = 4  # twice the cores here: they overlap in the ledger and in MLflow


@pytest.mark.slow  # four processes importing MLflow on two cores: about 15 s per backend
@pytest.mark.parallel_safe
def test_concurrent_assigns_leave_exactly_the_ledgers_alias(
    two: tuple[Proj, Lock, Lock], ledger_backend: str | None
) -> None:
    """`releasekit assign` processes race on one environment (alternating two
    releases of two models), on SQLite and on PostgreSQL: afterwards exactly one version
    carries the alias, it is the one the ledger's last live event names, and the ledger
    verifies."""
    p, a, b = two
    extra = {"RELEASEKIT_LEDGER_URL": ledger_backend} if ledger_backend else {}
    if ledger_backend:
        # A fresh ledger on PostgreSQL: start it where SQLite's stands.
        assert (
            _cli(p, "assign", a.release_id, "-e", "production", "-r", "pg", extra=extra).returncode
            == 0
        )
    procs = [
        subprocess.Popen(
            [
                str(BIN / "releasekit"),
                "assign",
                (a if i % 2 else b).release_id,
                "--env",
                "production",
                "--reason",
                f"racer {i}",
                "--force",
            ],
            cwd=p.root,
            env=_env(p, **extra),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(RACERS)
    ]
    outs = [pr.communicate(timeout=300)[0] for pr in procs]
    assert [pr.returncode for pr in procs] == [0] * RACERS, outs
    url = ledger_backend or p.settings.ledger_url or ""
    led = Ledger(url)
    last = led.live_at("production")
    assert last is not None
    assert _holders(p, "production") == [
        (str(last.evidence["model_name"]), str(last.evidence["model_version"]))
    ]
    live = led.records(environment="production", live=True)
    assert len(live) >= RACERS and led.verify(trusted=None).ok
    assert not led.records(types=[EventType.REPAIR.value])  # serialised: nothing drifted


@pytest.mark.slow  # two full registers racing: about 45 s on two cores
@pytest.mark.parallel_safe
def test_two_concurrent_registers_yield_one_model_version(mlproj: Proj) -> None:
    """Two `releasekit register` processes of one release at once: one model version, one
    register event, and the second reports it as already registered."""
    lk = mlproj.build("demo-bf16")
    procs = [
        subprocess.Popen(
            [str(BIN / "releasekit"), "register", "--json", "manifests/demo-bf16.yaml"],
            cwd=mlproj.root,
            env=_env(mlproj),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [pr.communicate(timeout=300) for pr in procs]
    assert [pr.returncode for pr in procs] == [0, 0], outs
    created = sorted(json.loads(o)["created"] for o, _ in outs)
    assert created == [False, True]
    versions = _client(mlproj).search_model_versions(f"tags.release_id = '{lk.release_id}'")
    assert len(versions) == 1
    led = Ledger(mlproj.settings.ledger_url or "")
    assert len(led.records(types=[EventType.REGISTER.value])) == 1


READ_ONLY = [
    ["status"],
    ["history"],
    ["at", "production", "now"],
    ["show", "demo-bf16@1"],
    ["diff", "demo-bf16@1", "demo-bf16@2"],
    ["ledger", "verify"],
]


@pytest.mark.parametrize("args", READ_ONLY, ids=lambda a: "-".join(a[:2]))
def test_read_only_commands_with_a_wrong_ledger_url_create_nothing(
    proj: Proj, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str]
) -> None:
    """A mistyped RELEASEKIT_LEDGER_URL: the command exits 1 naming the URL tried and how to
    point at the right one, and no file or folder appears."""
    wrong = tmp_path / "typo" / "ledger.db"
    monkeypatch.setenv("RELEASEKIT_LEDGER_URL", f"sqlite:///{wrong}")
    State.reset()
    res = runner.invoke(app, args)
    assert res.exit_code == 1, res.output
    assert f"no ledger at sqlite:///{wrong}" in res.stderr and "RELEASEKIT_LEDGER_URL" in res.stderr
    assert not wrong.parent.exists()
    assert not (proj.settings.state_dir / "ledger.db").exists()


def test_read_only_commands_on_a_postgres_database_without_a_ledger_create_no_tables(
    proj: Proj, pg_server: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server URL whose database holds no ledger: verify and status fail, tables stay
    absent."""
    from sqlalchemy import create_engine, inspect

    url = pg_server.create_database()  # type: ignore[attr-defined]
    monkeypatch.setenv("RELEASEKIT_LEDGER_URL", url)
    for args in (["ledger", "verify"], ["status"]):
        State.reset()
        res = runner.invoke(app, args)
        assert res.exit_code == 1 and "has no ledger tables" in res.stderr
    engine = create_engine(url)
    assert inspect(engine).get_table_names() == []
    engine.dispose()


def test_outside_a_project_says_so_and_creates_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run from a folder that is no releasekit project (no releasekit.toml, .git or
    manifests/): read-only commands say so, and no .releasekit/ appears."""
    nowhere = tmp_path / "nowhere"
    nowhere.mkdir()
    monkeypatch.chdir(nowhere)
    for key in list(os.environ):
        if key.startswith("RELEASEKIT_"):
            monkeypatch.delenv(key)
    for args in (["status"], ["history"], ["ledger", "verify"]):
        State.reset()
        res = runner.invoke(app, args)
        assert res.exit_code == 1 and "is not inside a releasekit project" in res.stderr
    assert list(nowhere.iterdir()) == []
    State.reset()


def test_deleted_ledger_fails_against_the_git_anchor(two: tuple[Proj, Lock, Lock]) -> None:
    """Every append advanced refs/releasekit/ledger; after the database is deleted, verify
    fails naming the URL and how many records the anchor says it held."""
    p, _a, _b = two
    n = Ledger(p.settings.ledger_url or "").count()
    Path((p.settings.ledger_url or "").removeprefix("sqlite:///")).unlink()
    res = _cli(p, "ledger", "verify")
    assert res.returncode == 1
    assert f"the git anchor says this ledger held {n} records" in res.stderr


def test_signed_ledger_cli_keygen_verify_and_forgery(mlproj: Proj) -> None:
    """`ledger keygen` writes keys/<id>.pub and a private key under .releasekit/keys; later
    events are signed; a row edited with recomputed hashes fails verify naming it."""
    import sqlite3

    from releasekit.stores.ledger import record_hash

    State.reset()
    res = runner.invoke(app, ["ledger", "keygen", "--json"])
    key = json.loads(res.stdout)
    assert Path(key["public"]) == mlproj.root / "keys" / f"{key['key_id']}.pub"
    assert ".releasekit/keys" in key["private"]
    # Keys count once committed (the working tree is never trusted).
    ident = {
        **os.environ,
        "GIT_AUTHOR_NAME": "Test",
        "GIT_AUTHOR_EMAIL": "t@example.com",
        "GIT_COMMITTER_NAME": "Test",
        "GIT_COMMITTER_EMAIL": "t@example.com",
    }
    for cmd in (
        ["git", "add", "keys"],
        ["git", "commit", "-qm", "trust the release key"],
        ["git", "push", "-q"],  # landed on the protected ref (the key counts from there)
    ):
        subprocess.run(cmd, cwd=mlproj.root, check=True, env=ident)
    lk = mlproj.build("demo-bf16")
    assert runner.invoke(app, ["register", "manifests/demo-bf16.yaml"]).exit_code == 0
    res = runner.invoke(app, ["assign", lk.release_id, "-e", "production", "-r", "go"])
    assert res.exit_code == 0, res.output
    ok = runner.invoke(app, ["ledger", "verify"])
    assert ok.exit_code == 0 and f"signatures: signed by {key['key_id']}" in ok.stdout
    assert "git anchors: anchored up to #2" in ok.stdout

    db = sqlite3.connect((mlproj.settings.ledger_url or "").removeprefix("sqlite:///"))
    db.row_factory = sqlite3.Row
    rows = [dict(r) for r in db.execute("SELECT * FROM events ORDER BY seq")]
    rows[0]["reason"] = "registered something else"
    prev = "0" * 64
    for r in rows:
        r["prev_hash"], r["hash"] = prev, None
        r["hash"] = record_hash(r)
        prev = r["hash"]
        db.execute(
            "UPDATE events SET reason=?, prev_hash=?, hash=? WHERE seq=?",
            (r["reason"], r["prev_hash"], r["hash"], r["seq"]),
        )
    db.execute("UPDATE ledger_head SET hash=?", (prev,))
    db.commit()
    db.close()
    bad = runner.invoke(app, ["ledger", "verify", "--json"])
    res_json = json.loads(bad.stdout)
    assert bad.exit_code == 1 and res_json["first_bad_seq"] == 1
    assert "changed after it was signed" in res_json["problem"]


def test_unreachable_mlflow_is_reported_as_such(mlproj: Proj) -> None:
    """With MLFLOW_TRACKING_URI at a port where nothing listens, assign fails with
    "cannot reach MLflow at URI" (not "no release matches"), well inside the bound."""
    lk = mlproj.build("demo-bf16")
    uri = f"http://127.0.0.1:{NOTHING_LISTENS}"
    res = _cli(
        mlproj,
        "assign",
        lk.release_id,
        "-e",
        "production",
        "-r",
        "x",
        timeout=60,
        extra={"MLFLOW_TRACKING_URI": uri},
    )
    assert res.returncode == 1
    assert f"cannot reach MLflow at {uri}" in res.stderr and "no release matches" not in res.stderr
    res = _cli(mlproj, "show", "ab" * 32, timeout=60, extra={"MLFLOW_TRACKING_URI": uri})
    assert res.returncode == 1 and "cannot reach MLflow" in res.stderr


def test_silent_mlflow_is_reported_within_the_timeout_budget(mlproj: Proj) -> None:
    """A tracking server that accepts connections and never answers: assign gives up with
    "cannot reach MLflow" after its HTTP timeout and one retry (the subprocess bound of 45 s
    would catch MLflow's default 120 s x 7 retries)."""
    lk = mlproj.build("demo-bf16")
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    uri = f"http://127.0.0.1:{srv.getsockname()[1]}"
    try:
        res = _cli(
            mlproj,
            "assign",
            lk.release_id,
            "-e",
            "production",
            "-r",
            "x",
            timeout=45,
            extra={"MLFLOW_TRACKING_URI": uri},
        )
    finally:
        stop.set()
        t.join()
        for c in held:
            c.close()
        srv.close()
    assert res.returncode == 1 and f"cannot reach MLflow at {uri}" in res.stderr
    assert "read timed out" in res.stderr


def test_cli_ledger_anchor_catches_up_an_unanchored_head(proj: Proj) -> None:
    """Events written without anchoring (a bare Ledger) are anchored by `ledger anchor`,
    after which verify checks them against git; a second run has nothing to do."""
    from releasekit.stores import anchor as anc
    from releasekit.stores.ledger import Event

    led = Ledger(proj.settings.ledger_url or "", actor="x")
    for _ in range(3):
        led.append(Event(type=EventType.BUILD, to_release="ef" * 32))
    State.reset()
    res = runner.invoke(app, ["ledger", "anchor"])
    assert res.exit_code == 0 and "anchored record #3" in res.stdout
    assert [a.seq for a in anc.read_anchors(proj.root)] == [3]
    assert "already covers" in runner.invoke(app, ["ledger", "anchor"]).stdout
    ok = runner.invoke(app, ["ledger", "verify"])
    assert ok.exit_code == 0 and "signatures: unsigned" in ok.stdout
    assert "git anchors: anchored up to #3" in ok.stdout
