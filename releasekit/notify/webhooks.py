"""Webhooks: every ledger event a webhook subscribes to (promote, gate_failed, canary_step,
canary_aborted, rollback, mark_bad, deploy_failed, approve, ...) is POSTed as JSON, or as a
Slack-compatible `{"text": ...}` body, from a background thread.

Delivery never holds up the command that wrote the event (a rollback switches traffic
first; the event is queued after it is recorded). Each delivery is tried `retries + 1`
times on connection errors, timeouts, 5xx, 408 and 429, waiting between tries with
exponential backoff from `backoff_s` and full jitter (at most 30 s), or as long as the
receiver's `Retry-After` asks (also at most 30 s); another 4xx is not retried. What is
not delivered, after its tries or because the process ended first (`flush`), is appended
to the dead-letter log, `STATE_DIR/notify/dead-letter.jsonl` (created mode 0600): one
JSON object a line with the webhook's scheme and host, the body, the attempts and the
last error. A webhook URL is a credential (a Slack URL is its own secret): no log or
dead-letter line holds more of it than `redact_hook_url` shows.

The JSON body (`build_payload`):

    {"event": "canary_aborted", "seq": 12, "time": "...", "environment": "staging",
     "release_id": "<to>", "previous_release_id": "<from>", "actor": "...",
     "reason": "...", "links": {"gate_report": "..."}, "evidence": {...}}

The evidence is the record's, less users' text: an answer comparison's examples keep their
seqs and prompt digests, never a prompt or an answer (`answer_text`); the dead-letter log
holds the body as it was sent.
"""

from __future__ import annotations

import atexit
import datetime as dt
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from releasekit._support.http import http_client
from releasekit._support.retry import RetryPolicy
from releasekit.config import Settings, WebhookConfig
from releasekit.notify.answer_text import without_answer_text

log = logging.getLogger("releasekit.notify")

LINK_KEYS = ("gate_report", "report", "report_html", "compare", "log")


def _link(value: str, *, root: Path, base_url: str | None) -> str:
    if not base_url:
        return value
    p = Path(value)
    try:
        rel = p.resolve().relative_to(root)
    except (ValueError, OSError):
        return value
    return base_url.rstrip("/") + "/" + rel.as_posix()


def build_payload(
    record: Mapping[str, Any], *, root: Path, links_base_url: str | None = None
) -> dict[str, Any]:
    """The JSON body for one ledger record (a LedgerRecord dumped to JSON-able data). Its
    evidence carries no users' text: answer examples keep their seqs and prompt digests,
    not their prompts or answers (`answer_text`)."""
    evidence = without_answer_text(dict(record.get("evidence") or {}))
    links = {
        k: _link(str(evidence[k]), root=root, base_url=links_base_url)
        for k in LINK_KEYS
        if isinstance(evidence.get(k), str) and evidence.get(k)
    }
    return {
        "event": record.get("type"),
        "seq": record.get("seq"),
        "time": record.get("time"),
        "environment": record.get("environment"),
        "release_id": record.get("to_release"),
        "previous_release_id": record.get("from_release"),
        "actor": record.get("actor"),
        "reason": record.get("reason"),
        "links": links,
        "evidence": evidence,
    }


def slack_body(payload: Mapping[str, Any]) -> dict[str, Any]:
    """A Slack-compatible body (incoming webhooks take `text`; mrkdwn)."""
    env = payload.get("environment") or "-"
    rel = str(payload.get("release_id") or "-")[:12]
    prev = str(payload.get("previous_release_id") or "-")[:12]
    lines = [
        f"*releasekit* `{payload.get('event')}` in *{env}*: `{rel}` (was `{prev}`)",
        f"> {payload.get('reason') or ''}",
        f"by {payload.get('actor') or '-'} at {payload.get('time') or '-'}",
    ]
    for k, v in (payload.get("links") or {}).items():
        lines.append(f"{k}: {v}")
    return {"text": "\n".join(lines)}


def redact_hook_url(url: str) -> str:
    """What logs may show of a webhook URL: its scheme and host (and port), no path, query
    or user info."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or "?"
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "<webhook>"
    if ":" in host:
        host = f"[{host}]"
    return f"{parts.scheme}://{host}{port}"


def _scrub(text: str, url: str) -> str:
    """`text` (an error message) with the webhook URL, or its path, replaced by the
    redacted URL."""
    shown = redact_hook_url(url)
    out = text.replace(url, shown)
    try:
        path = urlsplit(url).path
    except ValueError:
        path = ""
    if len(path) > 1:
        out = out.replace(path, "/<redacted>")
    return out


def _wants(hook: WebhookConfig, payload: Mapping[str, Any]) -> bool:
    if hook.events and payload.get("event") not in hook.events:
        return False
    return not hook.environments or payload.get("environment") in hook.environments


# The longest wait between two tries of a delivery, Retry-After included.
MAX_WAIT_S = 30.0


def _retryable(status: int) -> bool:
    return status >= 500 or status in (408, 429)


class _Answered(Exception):
    """A receiver's answer other than 2xx; `retry_after` is its Retry-After header, if any."""

    def __init__(self, status: int, error: str, retry_after: str | None) -> None:
        super().__init__(error)
        self.status = status
        self.retry_after = retry_after


class Notifier:
    """Queues notifications and delivers them from one background thread (see the module
    docstring). `transport` is for tests (an httpx transport)."""

    def __init__(
        self,
        hooks: list[WebhookConfig],
        *,
        dead_letter: Path,
        root: Path,
        links_base_url: str | None = None,
        transport: httpx.BaseTransport | None = None,
        sleep: Callable[[float], object] | None = None,
    ) -> None:
        self.hooks = list(hooks)
        self.dead_letter = dead_letter
        self.root = root
        self.links_base_url = links_base_url
        self.delivered = 0
        self.dead = 0
        self._q: queue.Queue[tuple[WebhookConfig, dict[str, Any]] | None] = queue.Queue()
        self._pending = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._http = http_client(trust_env=False, transport=transport)
        self._closing = threading.Event()
        # Waits between tries end early when the notifier closes; `sleep` is for tests.
        self._sleep = sleep or self._closing.wait
        self._thread = threading.Thread(target=self._work, daemon=True, name="releasekit-notify")
        self._thread.start()

    # -- producer side

    def on_record(self, record: Mapping[str, Any]) -> None:
        """Ledger listener: queue the record for every webhook that wants it. Never raises."""
        try:
            payload = build_payload(record, root=self.root, links_base_url=self.links_base_url)
            for hook in self.hooks:
                if _wants(hook, payload):
                    self.send(hook, payload)
        except Exception:  # a notification must never break the command that recorded
            log.exception("could not queue a notification")

    def send(self, hook: WebhookConfig, payload: dict[str, Any]) -> None:
        """Queue one delivery."""
        with self._lock:
            self._pending += 1
        self._q.put((hook, payload))

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait up to `timeout_s` for queued deliveries; True when none is left. Deliveries
        still queued then are dead-lettered (the process is ending)."""
        end = time.monotonic() + timeout_s
        with self._idle:
            while self._pending > 0:
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._idle.wait(left)
            done = self._pending == 0
        if not done:
            self._closing.set()
            while True:
                try:
                    item = self._q.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    self._dead(item[0], item[1], attempts=0, error="not delivered before exit")
                    self._done()
        return done

    # -- delivery

    def _done(self) -> None:
        with self._idle:
            self._pending -= 1
            self._idle.notify_all()

    def _work(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            hook, payload = item
            try:
                self._deliver(hook, payload)
            except Exception as exc:  # never let the worker die
                error = _scrub(f"{type(exc).__name__}: {exc}", hook.url)
                self._dead(hook, payload, attempts=0, error=error)
            finally:
                self._done()

    def _policy(self, hook: WebhookConfig) -> RetryPolicy:
        return RetryPolicy(
            attempts=hook.retries + 1,
            base_s=hook.backoff_s,
            cap_s=MAX_WAIT_S,
            retry_on=(httpx.HTTPError, _Answered),
            retry_if=lambda exc: not isinstance(exc, _Answered) or _retryable(exc.status),
        )

    def _deliver(self, hook: WebhookConfig, payload: dict[str, Any]) -> bool:
        body = slack_body(payload) if hook.format == "slack" else payload
        attempts = 0

        def post() -> None:
            nonlocal attempts
            attempts += 1
            r = self._http.post(
                hook.url,
                json=body,
                headers={"user-agent": "releasekit-webhook", **hook.headers},
                timeout=hook.timeout_s,
            )
            if not 200 <= r.status_code < 300:
                error = _scrub(f"HTTP {r.status_code}: {r.text[:200]}", hook.url)
                raise _Answered(r.status_code, error, r.headers.get("retry-after"))

        try:
            self._policy(hook).call(post, sleep=self._sleep, until=self._closing)
        except _Answered as exc:
            error = str(exc)
        except httpx.HTTPError as exc:
            error = _scrub(f"{type(exc).__name__}: {exc}", hook.url)
        else:
            self.delivered += 1
            return True
        self._dead(hook, body, attempts=attempts, error=error)
        return False

    def _dead(
        self, hook: WebhookConfig, body: Mapping[str, Any], *, attempts: int, error: str
    ) -> None:
        self.dead += 1
        shown = redact_hook_url(hook.url)
        line = {
            "time": dt.datetime.now(dt.UTC).isoformat(),
            "url": shown,
            "event": body.get("event"),
            "attempts": attempts,
            "error": error,
            "body": body,
        }
        try:
            self.dead_letter.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.dead_letter, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            with os.fdopen(fd, "a", encoding="utf-8") as f:
                os.fchmod(f.fileno(), 0o600)  # also a file an older version left readable
                f.write(json.dumps(line, default=str) + "\n")
        except OSError as exc:
            log.error("could not write the dead-letter log %s: %s", self.dead_letter, exc)
        log.warning("webhook %s: %s not delivered (%s)", shown, body.get("event"), error)

    def close(self, timeout_s: float = 10.0) -> None:
        """Flush, then stop the worker (a delivery still in its request is abandoned)."""
        self.flush(timeout_s)
        self._closing.set()
        self._q.put(None)
        self._thread.join(timeout=1)
        if not self._thread.is_alive():
            self._http.close()


_NOTIFIERS: dict[tuple[str, str], Notifier] = {}
_LOCK = threading.Lock()


def dead_letter_path(settings: Settings) -> Path:
    """The dead-letter log of a project."""
    return settings.state_dir / "notify" / "dead-letter.jsonl"


def notifier_for(settings: Settings) -> Notifier | None:
    """The process's notifier for these settings' webhooks (one worker per configuration;
    flushed for up to 10 s when the process exits), or None without webhooks."""
    if not settings.webhooks:
        return None
    key = (
        str(dead_letter_path(settings)),
        json.dumps([h.model_dump(mode="json") for h in settings.webhooks], sort_keys=True),
    )
    with _LOCK:
        n = _NOTIFIERS.get(key)
        if n is None:
            n = _NOTIFIERS[key] = Notifier(
                list(settings.webhooks),
                dead_letter=dead_letter_path(settings),
                root=settings.root,
                links_base_url=settings.links_base_url,
            )
        return n


def close_all(timeout_s: float = 10.0) -> None:
    """Flush and stop every notifier of this process (what is left is dead-lettered)."""
    with _LOCK:
        notifiers = list(_NOTIFIERS.values())
        _NOTIFIERS.clear()
    for n in notifiers:
        n.close(timeout_s)


atexit.register(close_all)
