"""Approvals before an environment takes a release, and webhook notifications of ledger
events (a real local listener), with retries and the dead-letter log."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from promote_kit import Kit, kill_everything, make_kit, mlflow_template_db
from typer.testing import CliRunner

from releasekit.cli import app
from releasekit.config import load_settings
from releasekit.notify import close_all
from releasekit.promote.approvals import ApprovalError, approve
from releasekit.promote.rollback import rollback
from releasekit.releases.queries import history
from releasekit.rollout.progressive import promote_progressive
from releasekit.stores.ledger import Ledger

__all__ = ["mlflow_template_db"]


def _port(low: int = 32500, high: int = 32999) -> int:
    for port in range(low, high + 1):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    pytest.skip("no free port in 32500-32999")


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


@pytest.fixture
def akit(
    project: Path, monkeypatch: pytest.MonkeyPatch, mlflow_template_db: Path, stand_in_model: Any
) -> Iterator[Kit]:
    """Deploy kit whose environments require an approval."""
    stand_in_model(project)
    k = make_kit(project, monkeypatch, mlflow_template_db, toml_lines=["requires_approval = true"])
    try:
        yield k
    finally:
        close_all(timeout_s=0)
        kill_everything(k.settings)


def _with_webhooks(k: Kit, hooks: str) -> None:
    toml = k.root / "releasekit.toml"
    toml.write_text(toml.read_text() + "\n" + hooks)
    k.settings = load_settings(root=k.root)


def test_promote_without_approval_is_refused_and_no_force_carries_it(akit: Kit) -> None:
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
            app, ["approve", rid[:12], "--env", "staging", "--reason", "reviewed the report"]
        )
        assert out.exit_code == 0, out.output
        assert "approved" in out.output and "Pat Promoter" in out.output

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
    assert [(e.type, e.actor, e.to_release) for e in events] == [
        ("approve", "Pat Promoter <pat@example.com>", rid)
    ]
    shown = CliRunner().invoke(app, ["history", "--env", "staging"], env={"COLUMNS": "300"})
    assert shown.exit_code == 0, shown.output
    assert "approved by Pat Promoter" in shown.output


def test_webhooks_receive_events_and_failures_go_to_the_dead_letter_log(akit: Kit) -> None:
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
        approve(akit.settings, rid, env="staging", reason="ok")
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


def test_a_webhook_that_never_answers_does_not_hold_up_a_rollback(akit: Kit) -> None:
    """The rollback switches and returns while the webhook receiver still holds the
    notification's request unanswered."""
    stalled = Listener(stall=True)
    try:
        _with_webhooks(akit, f'[[webhooks]]\nurl = "{stalled.url}"\ntimeout_s = 30\n')
        for name in ("demo-bf16",):
            rid = akit.build(name)
            approve(akit.settings, rid, env="staging", reason="ok")
        assert promote_progressive(akit.settings, rid, env="staging", reason="a").ok
        assert stalled.got.wait(30)  # the first notification is now held by the receiver
        akit.variant("demo-bf16", "demo-v2", {"max-num-seqs: 32": "max-num-seqs: 16"})
        v2 = akit.build("demo-v2")
        approve(akit.settings, v2, env="staging", reason="ok")
        assert promote_progressive(akit.settings, v2, env="staging", reason="b").ok
        rb = rollback(akit.settings, "staging", reason="bad")
        assert rb.status == "rolled_back"
        assert not stalled.release.is_set()  # ... and is still holding it
        live = Ledger(akit.settings.ledger_url or "").live_at("staging")
        assert live is not None and live.to_release == rid
    finally:
        stalled.close()
