"""Approvals before an environment takes a release, and webhook notifications of ledger
events (a real local listener), with retries and the dead-letter log."""

from __future__ import annotations

import json
import subprocess
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from portbands import free_port
from promote_kit import Kit, commit_config, kill_everything, make_kit
from sqlalchemy import create_engine, select
from typer.testing import CliRunner

from releasekit.cli import app
from releasekit.config import load_settings
from releasekit.notify import close_all
from releasekit.promote.approvals import ApprovalError, approve, check_approval
from releasekit.promote.policy import PolicyError
from releasekit.promote.promote import promote
from releasekit.promote.rollback import rollback
from releasekit.releases.assign import DeployedEnvironmentError, assign
from releasekit.releases.queries import history
from releasekit.rollout.progressive import promote_progressive
from releasekit.stores import signing
from releasekit.stores.ledger import (
    DecisionRecordsError,
    Event,
    EventType,
    Ledger,
    events_table,
    head_table,
    open_ledger,
    record_hash,
)


def _port() -> int:
    return free_port(32500, 32999, what="a webhook listener")


class Listener:
    """A local webhook receiver: records every POST body; `stall` holds requests until
    `release` is set (a receiver that never answers in time)."""

    def __init__(self, *, status: int = 200, stall: bool = False) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.got = threading.Event()
        self.release = threading.Event()
        outer = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                n = int(self.headers.get("content-length", 0))
                outer.bodies.append(json.loads(self.rfile.read(n)))
                outer.got.set()
                if stall:
                    outer.release.wait(30)
                self.send_response(status)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", _port()), H)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"
        self._t = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._t.start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def _git(root: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-c", "user.name=Test", "-c", "user.email=t@example.com", *args],
        cwd=root,
        check=True,
        capture_output=True,
    )


@dataclass
class Keys:
    """The project's signing key (what promote signs with) and an approver's key (outside
    .releasekit/keys/, as a person's own key is), both public halves committed."""

    project: signing.KeyPair
    approver: signing.KeyPair
    other: signing.KeyPair


def _keys(project: Path) -> Keys:
    keys = Keys(
        project=signing.generate_keypair(project),
        approver=signing.generate_keypair(project, private_path=project / "approver.pem"),
        other=signing.generate_keypair(project, private_path=project / "other.pem"),
    )
    _git(project, "add", "keys")
    _git(project, "commit", "-qm", "trust the release, approver and other keys")
    return keys


@pytest.fixture
def keys(project: Path) -> Keys:
    """Keys committed in the project before its settings are read."""
    return _keys(project)


@pytest.fixture
def akit(
    project: Path,
    keys: Keys,
    monkeypatch: pytest.MonkeyPatch,
    mlflow_template_db: Path,
    stand_in_model: Any,
) -> Iterator[Kit]:
    """Deploy kit whose environments require an approval by the approver's key; the
    ledger is signed with the project's key."""
    stand_in_model(project)
    k = make_kit(
        project,
        monkeypatch,
        mlflow_template_db,
        toml_lines=["requires_approval = true", f'approvers = ["{keys.approver.key_id}"]'],
    )
    try:
        yield k
    finally:
        close_all(timeout_s=0)
        kill_everything(k.settings)


def _approve(k: Kit, keys: Keys, rid: str, env: str = "staging") -> None:
    approve(k.settings, rid, env=env, reason="ok", key=keys.approver.private_path)


def _with_webhooks(k: Kit, hooks: str) -> None:
    toml = k.root / "releasekit.toml"
    toml.write_text(toml.read_text() + "\n" + hooks)
    k.settings = load_settings(root=k.root)


def test_promote_without_approval_is_refused_and_no_force_carries_it(akit: Kit, keys: Keys) -> None:
    """An environment that requires approval refuses an unapproved release (even forced
    over policy); a promote that waits goes on once `approve` records one, and the promote
    event and history name the approver."""
    rid = akit.build("demo-bf16")
    res = promote_progressive(akit.settings, rid, env="staging", reason="try")
    assert res.status == "blocked" and res.report is not None
    [gate] = [g for g in res.report.failed if g.kind == "approval"]
    assert gate.name == "approved for staging" and "releasekit approve" in gate.detail
    forced = promote_progressive(
        akit.settings, rid, env="staging", reason="try", force=["policy", "perf"]
    )
    assert forced.status == "blocked"
    # The CLI says how to get past it: an approval, never a --force.
    cli = CliRunner().invoke(
        app, ["promote", rid[:12], "--to", "staging", "-r", "try"], env={"COLUMNS": "300"}
    )
    assert cli.exit_code == 1
    assert f"releasekit approve {rid[:12]} --env staging" in cli.output
    assert "--force approval" not in cli.output
    with pytest.raises(ApprovalError):
        approve(akit.settings, rid, env="staging", reason=" ")

    def approve_by_cli() -> None:
        out = CliRunner().invoke(
            app,
            [
                "approve",
                rid[:12],
                "--env",
                "staging",
                "--reason",
                "reviewed the report",
                "--key",
                str(keys.approver.private_path),
            ],
        )
        assert out.exit_code == 0, out.output
        assert "approved" in out.output and "Pat Promoter" in out.output
        assert keys.approver.key_id in out.output

    # promote waits for the approval (polling the ledger) and goes on once it is recorded
    t = threading.Timer(1.0, approve_by_cli)
    t.start()
    try:
        ok = promote_progressive(
            akit.settings, rid, env="staging", reason="approved", approval_wait_s=60
        )
    finally:
        t.join()
    assert ok.status == "promoted", ok.deploy
    assert ok.record is not None
    assert ok.record.evidence["approval"]["by"] == "Pat Promoter <pat@example.com>"
    events = history(akit.settings, env="staging", types=["approve"]).events
    assert [(e.type, e.actor, e.to_release, e.key_id) for e in events] == [
        ("approve", "Pat Promoter <pat@example.com>", rid, keys.approver.key_id)
    ]
    assert ok.record.key_id == keys.project.key_id
    shown = CliRunner().invoke(app, ["history", "--env", "staging"], env={"COLUMNS": "300"})
    assert shown.exit_code == 0, shown.output
    assert "approved by Pat Promoter" in shown.output


def test_webhooks_receive_events_and_failures_go_to_the_dead_letter_log(
    akit: Kit, keys: Keys
) -> None:
    """Approve and promote events reach a JSON listener (ids, environment, reason, a link
    to the gate report) and a Slack-style one (`text`); a webhook nobody answers is
    retried and dead-lettered."""
    good, slack = Listener(), Listener()
    try:
        _with_webhooks(
            akit,
            f'[[webhooks]]\nurl = "{good.url}"\n\n'
            f'[[webhooks]]\nurl = "{slack.url}"\nformat = "slack"\nevents = ["promote"]\n\n'
            '[[webhooks]]\nurl = "http://127.0.0.1:22990/none"\nretries = 2\nbackoff_s = 0.01\n'
            'events = ["promote"]\n',
        )
        rid = akit.build("demo-bf16")
        _approve(akit, keys, rid)
        res = promote_progressive(akit.settings, rid, env="staging", reason="first")
        assert res.status == "promoted"
        from releasekit.notify import notifier_for

        n = notifier_for(akit.settings)
        assert n is not None and n.flush(30)
    finally:
        good.close()
        slack.close()
    events = [b["event"] for b in good.bodies]
    assert "approve" in events and "promote" in events
    body = next(b for b in good.bodies if b["event"] == "promote")
    assert body["release_id"] == rid and body["environment"] == "staging"
    assert body["reason"] == "first" and Path(body["links"]["gate_report"]).is_file()
    [sl] = slack.bodies
    assert set(sl) == {"text"} and "promote" in sl["text"] and rid[:12] in sl["text"]
    dead = akit.settings.state_dir / "notify" / "dead-letter.jsonl"
    [line] = [json.loads(x) for x in dead.read_text().splitlines()]
    assert line["event"] == "promote" and line["attempts"] == 3
    assert line["url"] == "http://127.0.0.1:22990" and line["body"]["release_id"] == rid


def test_a_webhook_that_never_answers_does_not_hold_up_a_rollback(akit: Kit, keys: Keys) -> None:
    """The rollback switches and returns while the webhook receiver still holds the
    notification's request unanswered."""
    stalled = Listener(stall=True)
    try:
        _with_webhooks(akit, f'[[webhooks]]\nurl = "{stalled.url}"\ntimeout_s = 30\n')
        for name in ("demo-bf16",):
            rid = akit.build(name)
            _approve(akit, keys, rid)
        assert promote_progressive(akit.settings, rid, env="staging", reason="a").ok
        assert stalled.got.wait(30)  # the first notification is now held by the receiver
        akit.variant("demo-bf16", "demo-v2", {"max-num-seqs: 32": "max-num-seqs: 16"})
        v2 = akit.build("demo-v2")
        _approve(akit, keys, v2)
        assert promote_progressive(akit.settings, v2, env="staging", reason="b").ok
        rb = rollback(akit.settings, "staging", reason="bad")
        assert rb.status == "rolled_back"
        assert not stalled.release.is_set()  # ... and is still holding it
        live = Ledger(akit.settings.ledger_url or "").live_at("staging")
        assert live is not None and live.to_release == rid
    finally:
        stalled.close()


def _approvers(k: Kit, *kids: str) -> None:
    """Name these keys as the approvers of every environment (a reviewed config change)."""
    toml = k.root / "releasekit.toml"
    lines = [
        f"approvers = [{', '.join(repr(x) for x in kids)}]" if ln.startswith("approvers") else ln
        for ln in toml.read_text().splitlines()
    ]
    toml.write_text("\n".join(lines) + "\n")
    commit_config(k.root, "name the approvers")
    k.settings = load_settings(root=k.root)


def _insert_unsigned(url: str, **fields: Any) -> int:
    """What someone who can write the ledger database but holds no key can do: append a
    row with a correct chain hash and move the head to it. Returns its seq."""
    engine = create_engine(url)
    with engine.begin() as conn:
        head = conn.execute(select(head_table)).one()
        row: dict[str, Any] = {
            "seq": head.seq + 1,
            "event_id": uuid.uuid4().hex,
            "time": head.time,
            "actor": "Ann Approver <ann@example.com>",
            "from_release": None,
            "evidence": "{}",
            "live": False,
            "prev_hash": head.hash,
            **fields,
        }
        row["hash"] = record_hash(row)
        conn.execute(events_table.insert(), [row])
        conn.execute(head_table.update().values(seq=row["seq"], hash=row["hash"]))
    engine.dispose()
    return int(row["seq"])


def test_an_approval_counts_only_from_a_named_approver_other_than_the_promoter(
    akit: Kit, keys: Keys
) -> None:
    """Three attacks on the approval gate, each refused: approving with a trusted key that
    is not one of staging's approvers (`approve` refuses it, and one written into the
    ledger anyway does not count); the promoter approving their own promotion with their
    own key, even where that key is an approver; and an `approve` row inserted into the
    ledger database without a key, after which promote refuses to act on the ledger."""
    rid = akit.build("demo-bf16")
    with pytest.raises(ApprovalError, match="is not an approver of staging"):
        approve(akit.settings, rid, env="staging", reason="me", key=keys.other.private_path)
    cli = CliRunner().invoke(
        app,
        [
            "approve",
            rid[:12],
            "--env",
            "staging",
            "-r",
            "me",
            "--key",
            str(keys.other.private_path),
        ],
        env={"COLUMNS": "300"},
    )
    assert cli.exit_code == 1 and "is not an approver of staging" in cli.output
    # Written anyway, signed with the other (trusted) key straight through the ledger.
    other = akit.settings.model_copy(update={"signing_key": keys.other.private_path})
    open_ledger(other).append(
        Event(type=EventType.APPROVE, environment="staging", to_release=rid, reason="sneaky")
    )
    res = promote(akit.settings, rid, env="staging", reason="try")
    assert res.status == "blocked" and res.report is not None
    assert [g.kind for g in res.report.failed] == ["approval"]
    led = open_ledger(akit.settings, read_only=True)
    [why] = check_approval(led, rid, "staging").rejected
    assert f"signed by key {keys.other.key_id}, not an approver of staging" in why

    # Self approval: the promoter's key is an approver too, and approves this release.
    _approvers(akit, keys.approver.key_id, keys.project.key_id)
    mine = approve(akit.settings, rid, env="staging", reason="mine", key=keys.project.private_path)
    assert mine.key_id == keys.project.key_id
    assert "the key promote signs with here" in mine.warnings[0]
    res = promote(akit.settings, rid, env="staging", reason="self-approved")
    assert res.status == "blocked" and res.report is not None
    assert [g.kind for g in res.report.failed] == ["approval"]
    led = open_ledger(akit.settings, read_only=True)
    assert "the promoter's own key" in check_approval(led, rid, "staging").rejected[0]

    # An approve row inserted without a key: the chain is consistent, the row unsigned.
    seq = _insert_unsigned(
        akit.settings.ledger_url or "",
        type="approve",
        environment="staging",
        to_release=rid,
        reason="lgtm",
    )
    with pytest.raises(DecisionRecordsError, match=f"record {seq} is unsigned"):
        promote(akit.settings, rid, env="staging", reason="inserted approval")
    cli = CliRunner().invoke(
        app, ["promote", rid[:12], "--to", "staging", "-r", "x"], env={"COLUMNS": "300"}
    )
    assert cli.exit_code == 1
    assert "refusing to act on ledger" in cli.output and f"record {seq} is unsigned" in cli.output
    assert Ledger(akit.settings.ledger_url or "").live_at("staging") is None


def test_ledger_verify_reports_a_promotion_without_a_distinct_approver(
    akit: Kit, keys: Keys
) -> None:
    """A release put live in staging (which requires an approval) without one, through the
    signed record written past promote (promote refuses a policy switched off for one
    command, and the record-only `assign` refuses a deployed environment), makes `ledger
    verify` fail naming its record; one approved by the approver verifies."""
    rid = akit.build("demo-bf16")
    _approve(akit, keys, rid)
    assert promote(akit.settings, rid, env="staging", reason="approved").status == "promoted"
    res = open_ledger(akit.settings, read_only=True).verify()
    assert res.ok and res.approvals == "checked" and res.unapproved == [], res.problem
    akit.variant("demo-bf16", "demo-v2", {"max-num-seqs: 32": "max-num-seqs: 16"})
    v2 = akit.build("demo-v2")
    envs = dict(akit.settings.environments)
    envs["staging"] = envs["staging"].model_copy(update={"requires_approval": False})
    loose = akit.settings.model_copy(update={"environments": envs})
    with pytest.raises(PolicyError, match=r"differs from releasekit\.toml"):
        promote(loose, v2, env="staging", reason="no approval this once")
    # The record-only `assign` is no side door either: staging is deployed, so it is
    # refused and records nothing.
    before = len(open_ledger(akit.settings, read_only=True).records())
    with pytest.raises(DeployedEnvironmentError, match="staging is deployed by releasekit"):
        assign(akit.settings, v2, env="staging", reason="no approval this once")
    assert len(open_ledger(akit.settings, read_only=True).records()) == before
    cli = CliRunner().invoke(
        app, ["assign", v2[:12], "--env", "staging", "-r", "x"], env={"COLUMNS": "300"}
    )
    assert cli.exit_code == 1 and "`assign` only records" in cli.output
    # Someone holding the signing key appends a promotion straight to the ledger: signed
    # and chained, but with no approval behind it.
    seq = (
        open_ledger(akit.settings)
        .append(
            Event(
                type=EventType.PROMOTE,
                environment="staging",
                from_release=rid,
                to_release=v2,
                reason="no approval this once",
                live=True,
            )
        )
        .seq
    )
    res = open_ledger(akit.settings, read_only=True).verify()
    assert not res.ok and res.unapproved == [seq]
    assert res.first_bad_seq == seq and "requires an approval" in (res.problem or "")
    cli = CliRunner().invoke(app, ["ledger", "verify"], env={"COLUMNS": "300"})
    assert cli.exit_code != 0 and f"record {seq} (promote)" in cli.output
