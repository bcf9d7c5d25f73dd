"""A webhook URL is a credential (a Slack URL is its own secret): a failing delivery never
writes it to a log or the dead-letter file, the dead-letter file is readable by its owner
only, and a URL that would send it in clear text off this host (or with user:password) is
refused when the settings load. A webhook carries no users' text either: an answer
comparison's examples reach it (and its dead-letter line) with their seqs and prompt digests,
never a prompt or an answer."""

from __future__ import annotations

import json
import logging
import stat
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from releasekit.config import WebhookConfig, load_settings
from releasekit.errors import ConfigError
from releasekit.notify import Notifier

SECRET = "T000/B000/XXXXsecretXXXX"


class _Failing:
    """A Slack-style listener that answers every POST with `status` (500) and echoes its
    path; it keeps the JSON bodies it got."""

    def __init__(self, status: int = 500) -> None:
        self.hits = 0
        self.bodies: list[Any] = []
        outer = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                outer.hits += 1
                outer.bodies.append(
                    json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
                )
                body = f"no such hook {self.path}".encode()
                self.send_response(status)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_port}/services/{SECRET}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_failing_webhook_leaves_its_url_in_no_log_and_an_owner_only_dead_letter_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    hook_srv = _Failing()
    dead = tmp_path / "notify" / "dead-letter.jsonl"
    hook = WebhookConfig(url=hook_srv.url, format="slack", retries=1, backoff_s=0.0)
    refused = WebhookConfig(url=f"http://127.0.0.1:1/services/{SECRET}", retries=0)
    n = Notifier([hook, refused], dead_letter=dead, root=tmp_path)
    try:
        with caplog.at_level(logging.DEBUG, logger="releasekit.notify"):
            n.on_record({"type": "rollback", "seq": 1, "environment": "prod", "reason": "r"})
            assert n.flush(30)
    finally:
        n.close(timeout_s=1)
        hook_srv.close()
    assert hook_srv.hits == 2 and n.dead == 2
    assert stat.S_IMODE(dead.stat().st_mode) == 0o600
    text = dead.read_text()
    assert SECRET not in text and "/services" not in text
    lines: list[dict[str, Any]] = [json.loads(x) for x in text.splitlines()]
    port = hook_srv.server.server_port
    assert sorted(x["url"] for x in lines) == sorted(
        [f"http://127.0.0.1:{port}", "http://127.0.0.1:1"]
    )
    assert any(x["error"].startswith("HTTP 500") for x in lines)
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "not delivered" in logged and SECRET not in logged and "/services" not in logged


def test_a_dead_letter_file_left_readable_is_made_owner_only(tmp_path: Path) -> None:
    dead = tmp_path / "dead-letter.jsonl"
    dead.write_text("")
    dead.chmod(0o644)
    hook = WebhookConfig(url=f"http://127.0.0.1:1/{SECRET}", retries=0)
    n = Notifier([hook], dead_letter=dead, root=tmp_path)
    try:
        n.on_record({"type": "promote", "seq": 2})
        assert n.flush(30)
    finally:
        n.close(timeout_s=1)
    assert stat.S_IMODE(dead.stat().st_mode) == 0o600 and SECRET not in dead.read_text()


@pytest.mark.parametrize(
    ("url", "why"),
    [
        (f"http://hooks.example.com/services/{SECRET}", "must be https"),
        (f"https://user:pw@hooks.example.com/services/{SECRET}", "user:password"),
        (f"http://user:pw@127.0.0.1:9/{SECRET}", "user:password"),
    ],
)
def test_a_webhook_url_that_would_leak_is_refused_when_the_settings_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str, why: str
) -> None:
    monkeypatch.setenv("RELEASEKIT_ROOT", str(tmp_path))
    (tmp_path / "releasekit.toml").write_text(f'[[webhooks]]\nurl = "{url}"\n')
    with pytest.raises(ConfigError) as err:
        load_settings(root=tmp_path)
    msg = err.value.message
    assert why in msg and "\n" not in msg and SECRET not in msg and "pw" not in msg


@pytest.mark.parametrize(
    "url",
    ["https://hooks.example.com/services/x", "http://127.0.0.1:9099/hook", "http://localhost/h"],
)
def test_https_and_loopback_webhooks_are_accepted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str
) -> None:
    monkeypatch.setenv("RELEASEKIT_ROOT", str(tmp_path))
    (tmp_path / "releasekit.toml").write_text(f'[[webhooks]]\nurl = "{url}"\n')
    assert [h.url for h in load_settings(root=tmp_path).webhooks] == [url]


PROMPT, STABLE, CANDIDATE = "user: my card 4111 expires", "Muburg", "I cannot answer that."


def _agreement_with_text() -> dict[str, Any]:
    return {
        "pairs": 40,
        "agreeing": 30,
        "verdict": "breach",
        "examples": [
            {
                "seq": 7,
                "stable": STABLE,
                "candidate": CANDIDATE,
                "prompt": PROMPT,
                "prompt_sha256": "ab" * 32,
            }
        ],
    }


def test_answer_examples_reach_a_webhook_without_their_prompts_and_answers(
    tmp_path: Path,
) -> None:
    """A shadow comparison's and a watch rollback's agreement examples are posted with
    their seqs, prompt digests and counts, and no prompt or answer text, to the webhook
    and to its dead-letter line alike."""
    ok, failing = _Failing(status=200), _Failing()
    dead = tmp_path / "dead-letter.jsonl"
    n = Notifier(
        [WebhookConfig(url=ok.url, retries=0), WebhookConfig(url=failing.url, retries=0)],
        dead_letter=dead,
        root=tmp_path,
    )
    shadow = {"action": "compare", "verdict": "breach", "agreement": _agreement_with_text()}
    rollback = {"trigger": "watch", "answers": {"agreement": _agreement_with_text()}}
    try:
        n.on_record({"type": "shadow", "seq": 3, "evidence": shadow})
        n.on_record({"type": "rollback", "seq": 4, "evidence": rollback})
        assert n.flush(30)
    finally:
        n.close(timeout_s=1)
        ok.close()
        failing.close()
    assert [b["seq"] for b in ok.bodies] == [3, 4]
    sent = json.dumps(ok.bodies) + dead.read_text()
    for text in (PROMPT, STABLE, CANDIDATE):
        assert text not in sent
    a, b = ok.bodies[0]["evidence"]["agreement"], ok.bodies[1]["evidence"]["answers"]["agreement"]
    for got in (a, b):
        assert got["pairs"] == 40 and got["agreeing"] == 30 and got["verdict"] == "breach"
        assert got["examples"] == [{"seq": 7, "prompt_sha256": "ab" * 32}]
    assert shadow["agreement"]["examples"][0]["prompt"] == PROMPT  # the record is not changed


def test_a_slack_webhook_body_names_no_answer_text(tmp_path: Path) -> None:
    """The Slack body is built from the same payload: no example text in it."""
    from releasekit.notify import build_payload, slack_body

    rec = {"type": "shadow", "seq": 3, "evidence": {"agreement": _agreement_with_text()}}
    payload = build_payload(rec, root=tmp_path)
    body = json.dumps(slack_body(payload)) + json.dumps(payload)
    assert all(t not in body for t in (PROMPT, STABLE, CANDIDATE))
