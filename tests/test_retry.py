"""The one retry policy: full-jitter backoff within its bounds, Retry-After (seconds or an
HTTP-date) honoured and capped, the last error when it gives up, and no retry of an error the
caller did not name; and a webhook answered 429/503 with Retry-After tried again after that."""

from __future__ import annotations

import datetime as dt
import email.utils
import json
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from releasekit._support.retry import RetryPolicy, retry_after_s
from releasekit.config import WebhookConfig
from releasekit.notify import Notifier


class Busy(Exception):
    """A failure that may carry a Retry-After value."""

    def __init__(self, n: int = 0, retry_after: object = None) -> None:
        super().__init__(f"busy #{n}")
        self.retry_after = retry_after


def _failing(errors: list[BaseException], then: object = "ok") -> tuple[list[int], object]:
    calls: list[int] = []

    def fn() -> object:
        calls.append(1)
        if len(calls) <= len(errors):
            raise errors[len(calls) - 1]
        return then

    return calls, fn


def test_jittered_waits_stay_within_the_growing_window_and_the_cap() -> None:
    """Each wait is in [0, min(cap, base * 2**(n-1))], and a seed makes them repeatable."""
    policy = RetryPolicy(attempts=10, base_s=0.1, cap_s=1.0, rng=random.Random(42))
    for n in range(1, 12):
        for _ in range(50):
            assert 0.0 <= policy.backoff(n) <= min(1.0, 0.1 * 2 ** (n - 1))
    again = RetryPolicy(attempts=10, base_s=0.1, cap_s=1.0, rng=random.Random(42))
    other = RetryPolicy(attempts=10, base_s=0.1, cap_s=1.0, rng=random.Random(42))
    assert [again.backoff(n) for n in range(1, 8)] == [other.backoff(n) for n in range(1, 8)]


def test_without_jitter_the_waits_double_up_to_the_cap() -> None:
    policy = RetryPolicy(attempts=5, base_s=0.5, cap_s=3.0, jitter=False)
    assert [policy.backoff(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_a_retry_after_in_seconds_is_waited_and_capped() -> None:
    waits: list[float] = []
    _, fn = _failing([Busy(1, "2"), Busy(2, "600"), Busy(3, 1.5)])
    policy = RetryPolicy(attempts=4, base_s=0.01, cap_s=10.0)
    assert policy.call(fn, sleep=waits.append) == "ok"
    assert waits == [2.0, 10.0, 1.5]


def test_a_retry_after_http_date_is_waited_and_capped() -> None:
    now = dt.datetime.now(dt.UTC)
    soon = email.utils.format_datetime(now + dt.timedelta(seconds=30), usegmt=True)
    later = email.utils.format_datetime(now + dt.timedelta(hours=2), usegmt=True)
    assert 25 <= (retry_after_s(soon) or 0) <= 30
    assert retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # already past
    assert retry_after_s("soon") is None and retry_after_s(None) is None
    waits: list[float] = []
    _, fn = _failing([Busy(1, soon), Busy(2, later)])
    assert RetryPolicy(attempts=3, cap_s=60.0).call(fn, sleep=waits.append) == "ok"
    assert 25 <= waits[0] <= 30 and waits[1] == 60.0


def test_it_gives_up_after_the_attempts_with_the_last_error() -> None:
    waits: list[float] = []
    calls, fn = _failing([Busy(n) for n in range(1, 10)])
    with pytest.raises(Busy, match="busy #3"):
        RetryPolicy(attempts=3, base_s=0.01).call(fn, sleep=waits.append)
    assert len(calls) == 3 and len(waits) == 2


def test_an_error_the_caller_did_not_name_is_not_retried() -> None:
    calls, fn = _failing([KeyError("x")])
    with pytest.raises(KeyError):
        RetryPolicy(attempts=5, retry_on=(Busy,)).call(fn, sleep=lambda s: None)
    assert len(calls) == 1
    calls, fn = _failing([Busy(1, "1")])
    refuse = RetryPolicy(attempts=5, retry_on=(Busy,), retry_if=lambda e: e.retry_after is None)
    with pytest.raises(Busy):
        refuse.call(fn, sleep=lambda s: None)
    assert len(calls) == 1


def test_a_deadline_ends_the_retries_and_no_wait_runs_past_it() -> None:
    """A wait longer than the time left is cut to it, the last try is made at the deadline,
    and the last error is raised (a poll returns its last result instead)."""
    waits: list[float] = []

    def sleep(s: float) -> None:
        waits.append(s)
        time.sleep(s)

    long = RetryPolicy(attempts=None, deadline_s=0.1, base_s=5.0, jitter=False)
    calls, fn = _failing([Busy(n) for n in range(1, 100)])
    with pytest.raises(Busy, match="busy #2"):
        long.call(fn, sleep=sleep)
    assert len(calls) == 2 and len(waits) == 1 and 0 < waits[0] <= 0.1
    waits.clear()
    poll = RetryPolicy.poll(interval_s=0.02, deadline_s=0.1)
    assert poll.call(lambda: False, sleep=sleep) is False
    assert 2 <= len(waits) <= 6 and all(0 <= w <= 0.02 for w in waits)


def test_a_policy_needs_a_limit() -> None:
    with pytest.raises(ValueError, match="attempts or a deadline"):
        RetryPolicy(attempts=None)


class _Answering:
    """A webhook receiver answering each POST from a script of (status, Retry-After)."""

    def __init__(self, script: list[tuple[int, str | None]]) -> None:
        self.bodies: list[dict[str, object]] = []
        outer = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                n = int(self.headers.get("content-length", 0))
                outer.bodies.append(json.loads(self.rfile.read(n)))
                status, after = script[min(len(outer.bodies), len(script)) - 1]
                self.send_response(status)
                if after is not None:
                    self.send_header("retry-after", after)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_webhook_answered_429_or_503_with_retry_after_is_tried_again_after_that_wait(
    tmp_path: Path,
) -> None:
    """The notifier waits what the receiver's Retry-After asks (seconds, then an HTTP-date
    in the past: no wait), not its own backoff, and delivers on the third try."""
    past = "Wed, 21 Oct 2015 07:28:00 GMT"
    srv = _Answering([(429, "7"), (503, past), (200, None)])
    waits: list[float] = []
    hook = WebhookConfig(url=srv.url, retries=3, backoff_s=0.01)
    n = Notifier([hook], dead_letter=tmp_path / "dead.jsonl", root=tmp_path, sleep=waits.append)
    try:
        n.on_record({"type": "promote", "seq": 1, "environment": "prod"})
        assert n.flush(30)
    finally:
        n.close(timeout_s=1)
        srv.close()
    assert len(srv.bodies) == 3 and n.delivered == 1 and n.dead == 0
    assert waits == [7.0, 0.0]


def test_a_webhook_refusal_other_than_408_or_429_is_not_retried(tmp_path: Path) -> None:
    srv = _Answering([(403, "1")])
    waits: list[float] = []
    hook = WebhookConfig(url=srv.url, retries=3, backoff_s=0.01)
    dead = tmp_path / "dead.jsonl"
    n = Notifier([hook], dead_letter=dead, root=tmp_path, sleep=waits.append)
    try:
        n.on_record({"type": "promote", "seq": 1})
        assert n.flush(30)
    finally:
        n.close(timeout_s=1)
        srv.close()
    assert len(srv.bodies) == 1 and waits == [] and n.dead == 1
    [line] = [json.loads(x) for x in dead.read_text().splitlines()]
    assert line["attempts"] == 1 and line["error"].startswith("HTTP 403")
