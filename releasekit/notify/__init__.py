"""Outbound notifications: ledger events POSTed to webhooks (`[[webhooks]]` in
releasekit.toml), with retries and a dead-letter log. See `webhooks`."""

from releasekit.notify.answer_text import without_answer_text
from releasekit.notify.webhooks import (
    Notifier,
    build_payload,
    close_all,
    notifier_for,
    slack_body,
)

__all__ = [
    "Notifier",
    "build_payload",
    "close_all",
    "notifier_for",
    "slack_body",
    "without_answer_text",
]
