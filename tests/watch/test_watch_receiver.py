"""The Alertmanager receiver on a real uvicorn server: auth, dedupe (also across a restart
and concurrent deliveries), resolved alerts, body limits and retryable failures."""

from __future__ import annotations

import base64
import copy
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import webclient
from prometheus_client import generate_latest
from pydantic import SecretStr
from watchkit import AppServer

from releasekit.errors import ReleaseNotFoundError
from releasekit.watch.receiver import (
    BasicCredential,
    ReceiverAuth,
    ReceiverConfigError,
    create_receiver,
)
from releasekit.watch.watcher import RollbackOutcome, RollbackRequest, RollbackTransientError

TOKEN = "s3cret-token"
AUTH = ReceiverAuth(
    bearer_tokens=[SecretStr(TOKEN)],
    basic=[BasicCredential(username="am", password=SecretStr("pw"))],
)
BEARER = {"Authorization": f"Bearer {TOKEN}"}


def payload(status: str = "firing", *, env: str = "prod", fp: str = "a1b2c3") -> dict[str, Any]:
    """An Alertmanager 0.25 version 4 webhook body (no notification_reason)."""
    alert = {
        "status": status,
        "labels": {
            "alertname": "ReleasekitWatch_ttft_p95_s_absolute",
            "releasekit_env": env,
            "releasekit_release": "r1",
            "severity": "critical",
        },
        "annotations": {"summary": "prod: ttft_p95_s is 1.8s"},
        "startsAt": "2026-12-01T09:00:00.123456789Z",
        "endsAt": "0001-01-01T00:00:00Z" if status == "firing" else "2026-12-01T09:05:00Z",
        "generatorURL": "http://prometheus/graph",
        "fingerprint": fp,
    }
    return {
        "version": "4",
        "groupKey": '{}:{alertname="ReleasekitWatch_ttft_p95_s_absolute"}',
        "truncatedAlerts": 0,
        "status": status,
        "receiver": "releasekit-prod",
        "groupLabels": {"alertname": "ReleasekitWatch_ttft_p95_s_absolute"},
        "commonLabels": alert["labels"],
        "commonAnnotations": alert["annotations"],
        "externalURL": "http://alertmanager:9093",
        "alerts": [alert],
    }


class Recorder:
    """The injected rollback path; `fail` raises once per listed exception."""

    def __init__(self) -> None:
        self.requests: list[RollbackRequest] = []
        self.fail: list[Exception] = []
        self.status = "rolled_back"
        self.lock = threading.Lock()

    def __call__(self, req: RollbackRequest) -> RollbackOutcome:
        with self.lock:
            self.requests.append(req)
            if self.fail:
                raise self.fail.pop(0)
        return RollbackOutcome(
            status=self.status,  # type: ignore[arg-type]
            env=req.env,
            from_release=req.from_release,
            to_release="r0",
        )


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def receiver(tmp_path: Path, recorder: Recorder) -> Iterator[tuple[str, Any]]:
    """A receiver for envs prod/staging on uvicorn; yields (webhook URL, app)."""
    app = create_receiver(
        rollback=recorder,
        auth=AUTH,
        store_path=tmp_path / "alerts.db",
        envs={"prod", "staging"},
        max_body_bytes=64 * 1024,
    )
    with AppServer(app) as srv:
        yield srv.url + "/alertmanager", app


def post(url: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return webclient.post(
        url,
        content=data,
        headers={"Content-Type": "application/json", **(headers or {})},
        timeout=10,
    )


def test_valid_token_rolls_back_once_when_sent_three_times(
    receiver: tuple[str, Any], recorder: Recorder
) -> None:
    """Three deliveries of one firing alert: one rollback, 2xx each time, repeats marked
    duplicate; the rollback request names env, release and the alert."""
    url, app = receiver
    answers = [post(url, payload(), BEARER) for _ in range(3)]
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert [a.json()["results"][0]["action"] for a in answers] == [
        "rolled_back",
        "duplicate",
        "duplicate",
    ]
    assert len(recorder.requests) == 1
    req = recorder.requests[0]
    assert (req.env, req.from_release, req.trigger) == ("prod", "r1", "alertmanager")
    assert req.alert is not None and req.alert["fingerprint"] == "a1b2c3"
    recs = app.state.store.records()
    assert len(recs) == 1 and recs[0].state == "done"
    assert recs[0].outcome.status == "rolled_back"


def test_concurrent_deliveries_roll_back_once(
    receiver: tuple[str, Any], recorder: Recorder
) -> None:
    """Eight simultaneous deliveries of one alert: exactly one rollback."""
    url, _ = receiver
    codes: list[int] = []
    barrier = threading.Barrier(8)

    def send() -> None:
        barrier.wait()
        codes.append(post(url, payload(), BEARER).status_code)

    threads = [threading.Thread(target=send) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert codes == [200] * 8
    assert len(recorder.requests) == 1


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Bearer {TOKEN}x"},
        {"Authorization": "Basic " + base64.b64encode(b"am:nope").decode()},
        {"Authorization": "Basic !!!notbase64"},
        {"Authorization": f"Token {TOKEN}"},
    ],
)
def test_bad_credentials_get_401_and_change_nothing(
    receiver: tuple[str, Any], recorder: Recorder, headers: dict[str, str]
) -> None:
    """Missing, wrong or unsupported credentials: 401 with WWW-Authenticate, no rollback,
    nothing stored."""
    url, app = receiver
    r = post(url, payload(), headers)
    assert r.status_code == 401 and "Bearer" in r.headers["www-authenticate"]
    assert recorder.requests == [] and app.state.store.records() == []


def test_basic_auth_works(receiver: tuple[str, Any], recorder: Recorder) -> None:
    """Alertmanager's basic_auth credentials are accepted too."""
    url, _ = receiver
    basic = {"Authorization": "Basic " + base64.b64encode(b"am:pw").decode()}
    assert post(url, payload(), basic).status_code == 200
    assert len(recorder.requests) == 1


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"{not json", "json"),
        ({**payload(), "version": "3"}, "version"),
        ({k: v for k, v in payload().items() if k != "alerts"}, "alerts"),
        ({**payload(), "alerts": [{"status": "firing"}]}, "fingerprint"),
        ({**payload(), "alerts": "nope"}, "alerts"),
    ],
)
def test_malformed_body_is_400_with_reason(
    receiver: tuple[str, Any], recorder: Recorder, body: Any, reason: str
) -> None:
    """A body that is not a version 4 payload: 400 naming what is wrong, nothing changed."""
    url, app = receiver
    r = post(url, body, BEARER)
    assert r.status_code == 400
    assert reason in r.json()["error"].lower()
    assert recorder.requests == [] and app.state.store.records() == []


def test_oversize_body_is_refused(receiver: tuple[str, Any], recorder: Recorder) -> None:
    """A body over the stated limit gets 413, also when sent chunked without a length."""
    url, _ = receiver
    big = payload()
    big["commonAnnotations"] = {"x": "y" * 100_000}
    assert post(url, big, BEARER).status_code == 413

    def chunks() -> Iterator[bytes]:
        data = json.dumps(big).encode()
        for i in range(0, len(data), 8192):
            yield data[i : i + 8192]

    r = webclient.post(url, content=chunks(), headers=BEARER, timeout=10)
    assert r.status_code == 413
    assert recorder.requests == []


def test_resolved_alert_is_recorded_not_acted_on(
    receiver: tuple[str, Any], recorder: Recorder
) -> None:
    """A resolved alert is stored and answered 200; no rollback."""
    url, app = receiver
    r = post(url, payload("resolved"), BEARER)
    assert r.status_code == 200 and r.json()["results"][0]["action"] == "recorded"
    assert recorder.requests == []
    [rec] = app.state.store.records()
    assert (rec.status, rec.state) == ("resolved", "recorded")


def test_newer_alertmanager_fields_are_tolerated(
    receiver: tuple[str, Any], recorder: Recorder
) -> None:
    """notification_reason and routeLabels (newer Alertmanagers) are accepted."""
    url, _ = receiver
    body = payload()
    body["notification_reason"] = "new_alerts"
    body["routeLabels"] = {"releasekit_env": "prod"}
    assert post(url, body, BEARER).status_code == 200
    assert len(recorder.requests) == 1


def test_unknown_environment_is_422_and_changes_nothing(
    receiver: tuple[str, Any], recorder: Recorder
) -> None:
    """An alert for an environment the receiver does not serve: 422 (not retried)."""
    url, app = receiver
    r = post(url, payload(env="qa"), BEARER)
    assert r.status_code == 422 and r.json()["results"][0]["action"] == "ignored"
    assert recorder.requests == [] and app.state.store.records() == []


def test_transient_failure_is_503_and_the_retry_rolls_back(
    receiver: tuple[str, Any], recorder: Recorder
) -> None:
    """A transient rollback failure answers 503 and releases the key: the retry redoes the
    rollback, and the next repeat is a duplicate."""
    url, _ = receiver
    recorder.fail = [RollbackTransientError("ledger locked")]
    r = post(url, payload(), BEARER)
    assert r.status_code == 503 and r.headers.get("retry-after")
    r = post(url, payload(), BEARER)
    assert r.status_code == 200 and r.json()["results"][0]["action"] == "rolled_back"
    assert post(url, payload(), BEARER).json()["results"][0]["action"] == "duplicate"
    assert len(recorder.requests) == 2


def test_permanent_failure_is_recorded_and_not_retried(
    receiver: tuple[str, Any], recorder: Recorder
) -> None:
    """A rollback that fails for good (a ReleasekitError) is recorded as failed, 200."""
    url, app = receiver
    recorder.fail = [ReleaseNotFoundError("no release r0")]
    r = post(url, payload(), BEARER)
    assert r.status_code == 200 and r.json()["results"][0]["action"] == "failed"
    assert post(url, payload(), BEARER).json()["results"][0]["action"] == "duplicate"
    assert app.state.store.records()[0].outcome.status == "failed"


def test_unexpected_failure_is_500_and_releases_the_key(
    receiver: tuple[str, Any], recorder: Recorder
) -> None:
    """An unexpected exception answers 500 (retryable) and leaves no record behind."""
    url, app = receiver
    recorder.fail = [RuntimeError("bug")]
    assert post(url, payload(), BEARER).status_code == 500
    assert app.state.store.records() == []


def test_cooling_down_is_not_committed(receiver: tuple[str, Any], recorder: Recorder) -> None:
    """An alert refused for cool-down is answered 200 but not deduplicated, so a resend
    after the cool-down can act."""
    url, _ = receiver
    recorder.status = "cooling_down"
    assert post(url, payload(), BEARER).json()["results"][0]["action"] == "cooling_down"
    recorder.status = "rolled_back"
    assert post(url, payload(), BEARER).json()["results"][0]["action"] == "rolled_back"
    assert len(recorder.requests) == 2


def test_restarted_receiver_still_deduplicates(tmp_path: Path, recorder: Recorder) -> None:
    """A new receiver on the same store answers a repeat as duplicate without rolling back;
    a new startsAt (the alert fired again) is a new alert."""
    for _ in range(2):
        app = create_receiver(rollback=recorder, auth=AUTH, store_path=tmp_path / "a.db")
        with AppServer(app) as srv:
            post(srv.url + "/alertmanager", payload(), BEARER)
    assert len(recorder.requests) == 1
    again = copy.deepcopy(payload())
    again["alerts"][0]["startsAt"] = "2026-12-01T10:00:00Z"
    app = create_receiver(rollback=recorder, auth=AUTH, store_path=tmp_path / "a.db")
    with AppServer(app) as srv:
        post(srv.url + "/alertmanager", again, BEARER)
    assert len(recorder.requests) == 2


def test_receiver_refuses_to_run_without_credentials(tmp_path: Path) -> None:
    """No token and no basic user: a ReceiverConfigError, never an open endpoint."""
    with pytest.raises(ReceiverConfigError):
        create_receiver(rollback=Recorder(), auth=ReceiverAuth(), store_path=tmp_path / "x.db")


def test_claim_of_a_crashed_delivery_is_taken_over_after_its_ttl(
    tmp_path: Path, recorder: Recorder
) -> None:
    """A claim left by a receiver that died mid-rollback blocks repeats (in progress) until
    its TTL passes; then a redelivery rolls back."""
    from releasekit.watch.receiver import AlertmanagerPayload, AlertStore

    alert = AlertmanagerPayload.model_validate(payload()).alerts[0]
    store = AlertStore(tmp_path / "a.db")
    claim_id, _ = store.claim(alert, env="prod", now=time.time())
    assert claim_id is not None
    app = create_receiver(rollback=recorder, auth=AUTH, store_path=tmp_path / "a.db")
    with AppServer(app) as srv:
        r = post(srv.url + "/alertmanager", payload(), BEARER)
    assert r.json()["results"][0]["action"] == "in_progress" and recorder.requests == []
    app = create_receiver(rollback=recorder, auth=AUTH, store_path=tmp_path / "a.db", claim_ttl_s=0)
    with AppServer(app) as srv:
        r = post(srv.url + "/alertmanager", payload(), BEARER)
    assert r.json()["results"][0]["action"] == "rolled_back" and len(recorder.requests) == 1


def test_unknown_keys_are_ignored_but_known_ones_strictly_typed(
    receiver: tuple[str, Any], recorder: Recorder
) -> None:
    """A future Alertmanager field does not block a rollback (4xx is never retried), while
    a known field of the wrong type is a 400."""
    url, _ = receiver
    body = payload()
    body["someFutureField"] = {"x": 1}
    body["alerts"][0]["anotherNewField"] = "y"
    assert post(url, body, BEARER).status_code == 200
    bad = payload(fp="other")
    bad["truncatedAlerts"] = "0"
    assert post(url, bad, BEARER).status_code == 400
    assert len(recorder.requests) == 1


def test_alert_contents_do_not_become_metric_labels(
    receiver: tuple[str, Any], recorder: Recorder
) -> None:
    """200 alerts naming 200 made-up environments add one series, not 200: label values
    come from the receiver's own environments, never from what a sender writes."""
    url, app = receiver
    for i in range(200):
        assert post(url, payload(env=f"made-up-{i}", fp=f"f{i}"), BEARER).status_code == 422
    lines = [
        ln
        for ln in generate_latest(app.state.registry).decode().splitlines()
        if ln.startswith("releasekit_receiver_alerts_total")
    ]
    assert lines == ['releasekit_receiver_alerts_total{action="ignored",env=""} 200.0']
