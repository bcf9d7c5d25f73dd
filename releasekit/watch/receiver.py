"""The Alertmanager webhook receiver: a Starlette app that authenticates Alertmanager (bearer
token or basic auth, as `http_config` sends them), validates its version "4" JSON, maps each
alert to an environment by its `releasekit_env` label, and runs the injected rollback path
once per firing alert, deduplicating on fingerprint + startsAt in a durable SQLite store.

Answers (Alertmanager retries 5xx and connection errors, never 4xx):
    200  processed; the body lists what happened to each alert (repeats: `duplicate`)
    400  malformed body (not JSON, not a version "4" payload), with the reason
    401  missing or wrong credentials; nothing is read or changed
    413  body over `max_body_bytes`
    422  every alert in the payload lacks `releasekit_env` or names an unknown environment
         (a misrouted alert: Alertmanager counts it as a failed notification, which an
         operator sees, but does not retry it); a payload with some known environments is
         processed and the unknown ones are listed as `ignored` in a 200
    503  the rollback path raised RollbackTransientError: retry (its dedupe key is released)
    500  the rollback path failed unexpectedly (key released, so a retry redoes it)

Unknown JSON keys are ignored rather than refused: Alertmanager adds fields over versions
(`notification_reason`, `routeLabels`), and a 400 is never retried, so refusing them would
turn an Alertmanager upgrade into silently dropped rollbacks. Known fields are strictly typed.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import json
import sqlite3
import time
import uuid
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

from prometheus_client import CollectorRegistry, Counter
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from releasekit.errors import ReleasekitError
from releasekit.watch.watcher import (
    RollbackFn,
    RollbackOutcome,
    RollbackRequest,
    RollbackTransientError,
)

ENV_LABEL = "releasekit_env"
MAX_ENV_LABELS = 64
"""Distinct `env` label values the receiver's metrics take without an `envs` list."""
RELEASE_LABEL = "releasekit_release"
_RFC3339 = r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})$"


class ReceiverConfigError(ReleasekitError):
    """Raised when the receiver is configured without any credentials (it never runs open)."""

    remedy = "set a bearer token or basic-auth user and password for the receiver"


# --------------------------------------------------------------------------- payload


class _AM(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class AlertmanagerAlert(_AM):
    """One alert of an Alertmanager webhook payload."""

    status: Literal["firing", "resolved"]
    labels: dict[str, str]
    annotations: dict[str, str] = Field(default_factory=dict)
    startsAt: str = Field(pattern=_RFC3339)
    endsAt: str = ""
    generatorURL: str = ""
    fingerprint: str = Field(min_length=1, max_length=128)


class AlertmanagerPayload(_AM):
    """Alertmanager's webhook body, version "4"."""

    version: Literal["4"]
    groupKey: str
    truncatedAlerts: int = 0
    status: Literal["firing", "resolved"]
    receiver: str
    groupLabels: dict[str, str] = Field(default_factory=dict)
    commonLabels: dict[str, str] = Field(default_factory=dict)
    commonAnnotations: dict[str, str] = Field(default_factory=dict)
    externalURL: str = ""
    alerts: list[AlertmanagerAlert]
    # Newer Alertmanager versions; absent in 0.25.
    notification_reason: str | None = None
    routeLabels: dict[str, str] | None = None


# --------------------------------------------------------------------------- auth


class BasicCredential(BaseModel):
    """A basic-auth user Alertmanager may send (`http_config.basic_auth`)."""

    model_config = ConfigDict(frozen=True)

    username: str
    password: SecretStr


class ReceiverAuth(BaseModel):
    """Accepted credentials: any of the bearer tokens, or any basic-auth user."""

    model_config = ConfigDict(frozen=True)

    bearer_tokens: list[SecretStr] = Field(default_factory=list)
    basic: list[BasicCredential] = Field(default_factory=list)

    def check(self, header: str | None) -> bool:
        """Whether an Authorization header carries accepted credentials (constant-time
        comparisons, every candidate compared)."""
        if not header:
            return False
        scheme, _, value = header.strip().partition(" ")
        value = value.strip()
        ok = False
        if scheme.lower() == "bearer":
            given = value.encode()
            for tok in self.bearer_tokens:
                ok |= hmac.compare_digest(given, tok.get_secret_value().encode())
        elif scheme.lower() == "basic":
            try:
                user, sep, password = base64.b64decode(value, validate=True).decode().partition(":")
            except (binascii.Error, UnicodeDecodeError):
                return False
            if not sep:
                return False
            for cred in self.basic:
                u = hmac.compare_digest(user.encode(), cred.username.encode())
                p = hmac.compare_digest(
                    password.encode(), cred.password.get_secret_value().encode()
                )
                ok |= u and p
        return ok


# --------------------------------------------------------------------------- store

AlertAction = Literal[
    "rolled_back",
    "no_known_good",
    "cooling_down",
    "not_live",
    "failed",
    "duplicate",
    "in_progress",
    "recorded",
    "ignored",
    "retry",
]


class AlertRecord(BaseModel):
    """A stored delivery: a firing alert acted on (with its rollback outcome), or a resolved
    alert recorded."""

    fingerprint: str
    starts_at: str
    status: Literal["firing", "resolved"]
    env: str | None
    alertname: str | None
    state: Literal["claimed", "done", "recorded"]
    received_at: float
    finished_at: float | None
    outcome: RollbackOutcome | None
    alert: dict[str, Any]


class AlertStore:
    """Durable deduplication of alert deliveries (SQLite at `path`).

    A firing alert is claimed with one atomic insert-or-ignore on (fingerprint, startsAt):
    of two concurrent deliveries, only one gets the claim. The claim is finished with the
    rollback's outcome, or released when the rollback failed, so a retry redoes it. A claim
    older than `claim_ttl_s` (its process died mid-rollback) can be taken over.
    """

    def __init__(self, path: Path | str, *, claim_ttl_s: float = 900.0) -> None:
        self.path = Path(path)
        self.claim_ttl_s = claim_ttl_s
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._db() as db:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute(
                """CREATE TABLE IF NOT EXISTS alert_deliveries (
                    fingerprint TEXT NOT NULL,
                    starts_at TEXT NOT NULL,
                    status TEXT NOT NULL,
                    env TEXT,
                    alertname TEXT,
                    state TEXT NOT NULL,
                    claim_id TEXT,
                    received_at REAL NOT NULL,
                    finished_at REAL,
                    outcome TEXT,
                    alert TEXT NOT NULL,
                    PRIMARY KEY (fingerprint, starts_at, status)
                )"""
            )

    @contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        try:
            yield db
        finally:
            db.close()

    def claim(
        self, alert: AlertmanagerAlert, *, env: str, now: float
    ) -> tuple[str | None, str | None]:
        """Try to claim a firing alert. Returns (claim id, None) when claimed, else
        (None, existing state: 'claimed' or 'done')."""
        claim_id = uuid.uuid4().hex
        with self._db() as db:
            cur = db.execute(
                """INSERT INTO alert_deliveries
                   (fingerprint, starts_at, status, env, alertname, state, claim_id,
                    received_at, alert)
                   VALUES (?, ?, 'firing', ?, ?, 'claimed', ?, ?, ?)
                   ON CONFLICT (fingerprint, starts_at, status) DO UPDATE
                   SET claim_id = excluded.claim_id, received_at = excluded.received_at
                   WHERE alert_deliveries.state = 'claimed'
                     AND alert_deliveries.received_at < ?""",
                (
                    alert.fingerprint,
                    alert.startsAt,
                    env,
                    alert.labels.get("alertname"),
                    claim_id,
                    now,
                    alert.model_dump_json(),
                    now - self.claim_ttl_s,
                ),
            )
            if cur.rowcount == 1:
                return claim_id, None
            row = db.execute(
                "SELECT state FROM alert_deliveries WHERE fingerprint=? AND starts_at=? "
                "AND status='firing'",
                (alert.fingerprint, alert.startsAt),
            ).fetchone()
        return None, (row[0] if row else "claimed")

    def finish(self, alert: AlertmanagerAlert, claim_id: str, outcome: RollbackOutcome) -> None:
        """Commit a claimed alert with the outcome of its rollback."""
        with self._db() as db:
            db.execute(
                "UPDATE alert_deliveries SET state='done', finished_at=?, outcome=? "
                "WHERE fingerprint=? AND starts_at=? AND status='firing' AND claim_id=?",
                (
                    time.time(),
                    outcome.model_dump_json(),
                    alert.fingerprint,
                    alert.startsAt,
                    claim_id,
                ),
            )

    def release(self, alert: AlertmanagerAlert, claim_id: str) -> None:
        """Drop a claim whose rollback did not complete, so a redelivery redoes it."""
        with self._db() as db:
            db.execute(
                "DELETE FROM alert_deliveries WHERE fingerprint=? AND starts_at=? "
                "AND status='firing' AND claim_id=? AND state='claimed'",
                (alert.fingerprint, alert.startsAt, claim_id),
            )

    def record_resolved(self, alert: AlertmanagerAlert, *, env: str | None, now: float) -> bool:
        """Record a resolved alert (once); True when it was new."""
        with self._db() as db:
            cur = db.execute(
                """INSERT OR IGNORE INTO alert_deliveries
                   (fingerprint, starts_at, status, env, alertname, state, received_at,
                    finished_at, alert)
                   VALUES (?, ?, 'resolved', ?, ?, 'recorded', ?, ?, ?)""",
                (
                    alert.fingerprint,
                    alert.startsAt,
                    env,
                    alert.labels.get("alertname"),
                    now,
                    now,
                    alert.model_dump_json(),
                ),
            )
            return cur.rowcount == 1

    def records(self) -> list[AlertRecord]:
        """Every stored delivery, oldest first."""
        with self._db() as db:
            rows = db.execute(
                "SELECT fingerprint, starts_at, status, env, alertname, state, received_at, "
                "finished_at, outcome, alert FROM alert_deliveries ORDER BY received_at, rowid"
            ).fetchall()
        return [
            AlertRecord(
                fingerprint=r[0],
                starts_at=r[1],
                status=r[2],
                env=r[3],
                alertname=r[4],
                state=r[5],
                received_at=r[6],
                finished_at=r[7],
                outcome=RollbackOutcome.model_validate_json(r[8]) if r[8] else None,
                alert=json.loads(r[9]),
            )
            for r in rows
        ]


# --------------------------------------------------------------------------- the app


class AlertResult(BaseModel):
    """What the receiver did with one alert of a delivery."""

    fingerprint: str
    starts_at: str
    status: Literal["firing", "resolved"]
    env: str | None
    action: AlertAction
    outcome: RollbackOutcome | None = None
    message: str = ""


class ReceiverResponse(BaseModel):
    """The body of every answer to a delivery that got past authentication."""

    results: list[AlertResult] = Field(default_factory=list)
    error: str | None = None


def _env_of(alert: AlertmanagerAlert, payload: AlertmanagerPayload) -> str | None:
    return alert.labels.get(ENV_LABEL) or payload.commonLabels.get(ENV_LABEL)


MAX_HEADER_BYTES = 60 * 1024
"""The receiver's header limits, the gateway's: a request line and headers of at most
60 KiB, at most 100 headers, sent within 10 s of the connection (or of a keep-alive
request's first byte); otherwise 431 / 408 and the connection closed."""
MAX_HEADER_COUNT = 100
HEADER_TIMEOUT_S = 10.0


def server_options() -> dict[str, Any]:
    """uvicorn.Config options that put the receiver behind the gateway's header limits
    (the guarded HTTP protocol: size, count, read timeout); wrap the app in `guard`."""
    from releasekit.deploy.gateway.limits import guarded_http_protocol

    protocol = guarded_http_protocol(
        max_header_bytes=MAX_HEADER_BYTES,
        header_timeout_s=HEADER_TIMEOUT_S,
        max_header_count=MAX_HEADER_COUNT,
    )
    return {
        "http": protocol if protocol is not None else "h11",
        "h11_max_incomplete_event_size": MAX_HEADER_BYTES,
        "server_header": False,
        "proxy_headers": False,
    }


def guard(app: Any) -> Any:
    """`app` behind the header limits checked on the parsed request (431)."""
    from releasekit.deploy.gateway.limits import header_guard

    return header_guard(app, max_header_bytes=MAX_HEADER_BYTES, max_header_count=MAX_HEADER_COUNT)


def create_receiver(
    *,
    rollback: RollbackFn,
    auth: ReceiverAuth,
    store_path: Path | str,
    envs: Collection[str] | None = None,
    max_body_bytes: int = 1024 * 1024,
    path: str = "/alertmanager",
    clock: Callable[[], float] = time.time,
    registry: CollectorRegistry | None = None,
    claim_ttl_s: float = 900.0,
) -> Starlette:
    """The receiver app: POST `path` takes Alertmanager deliveries, GET /healthz answers 200.

    `rollback` is the rollback path (usually a `RollbackGuard`, shared with the watcher, so
    a watch rollback and an alert for the same regression do not both roll back). `envs`
    limits the environments accepted (None: any). Bodies over `max_body_bytes` (1 MiB by
    default; Alertmanager's payloads are a few kB per alert) get 413, also when sent chunked.
    Deliveries are stored under `store_path`
    (`app.state.store`). Raises ReceiverConfigError when `auth` accepts nothing."""
    if not auth.bearer_tokens and not auth.basic:
        raise ReceiverConfigError("the Alertmanager receiver needs a bearer token or basic auth")
    store = AlertStore(store_path, claim_ttl_s=claim_ttl_s)
    known = set(envs) if envs is not None else None
    reg = registry if registry is not None else CollectorRegistry()
    deliveries = Counter(
        "releasekit_receiver_deliveries",
        "Alertmanager deliveries by HTTP status answered",
        ["code"],
        registry=reg,
    )
    alerts_seen = Counter(
        "releasekit_receiver_alerts",
        "Alerts received, by what the receiver did",
        ["env", "action"],
        registry=reg,
    )

    env_labels: set[str] = set()

    def env_label(r: AlertResult) -> str:
        # A label value must not come from what a sender writes: an ignored alert's env
        # is not ours, and without an `envs` list only the first MAX_ENV_LABELS get a series.
        if r.env is None or r.action == "ignored":
            return ""
        if r.env in env_labels or known is not None:
            return r.env
        if len(env_labels) < MAX_ENV_LABELS:
            env_labels.add(r.env)
            return r.env
        return "other"

    def answer(
        code: int, body: ReceiverResponse, headers: dict[str, str] | None = None
    ) -> Response:
        deliveries.labels(str(code)).inc()
        for r in body.results:
            alerts_seen.labels(env_label(r), r.action).inc()
        return JSONResponse(body.model_dump(mode="json"), status_code=code, headers=headers)

    async def read_body(request: Request) -> bytes | None:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
            return None
        buf = bytearray()
        async for chunk in request.stream():
            buf += chunk
            if len(buf) > max_body_bytes:
                return None
        return bytes(buf)

    async def handle_firing(
        alert: AlertmanagerAlert, env: str, payload: AlertmanagerPayload
    ) -> tuple[AlertResult, int]:
        base = {"fingerprint": alert.fingerprint, "starts_at": alert.startsAt, "env": env}
        now = clock()
        claim_id, existing = await run_in_threadpool(store.claim, alert, env=env, now=now)
        if claim_id is None:
            action: AlertAction = "duplicate" if existing == "done" else "in_progress"
            return AlertResult(**base, status="firing", action=action), 200
        name = alert.labels.get("alertname", "alert")
        summary = alert.annotations.get("summary") or alert.annotations.get("description", "")
        req = RollbackRequest(
            env=env,
            from_release=alert.labels.get(RELEASE_LABEL),
            reason=f"Alertmanager alert {name} firing" + (f": {summary}" if summary else ""),
            trigger="alertmanager",
            alert={
                "fingerprint": alert.fingerprint,
                "startsAt": alert.startsAt,
                "labels": alert.labels,
                "annotations": alert.annotations,
                "generatorURL": alert.generatorURL,
                "groupKey": payload.groupKey,
            },
            requested_at=now,
        )
        try:
            outcome = await run_in_threadpool(rollback, req)
        except RollbackTransientError as exc:
            await run_in_threadpool(store.release, alert, claim_id)
            return AlertResult(**base, status="firing", action="retry", message=str(exc)), 503
        except ReleasekitError as exc:
            # A retry would fail the same way: keep the key, record the failure.
            outcome = RollbackOutcome(
                status="failed",
                env=env,
                from_release=req.from_release,
                message=f"{type(exc).__name__}: {exc}",
            )
        except Exception as exc:
            await run_in_threadpool(store.release, alert, claim_id)
            return (
                AlertResult(
                    **base,
                    status="firing",
                    action="retry",
                    message=f"unexpected {type(exc).__name__}: {exc}",
                ),
                500,
            )
        if outcome.status == "cooling_down":
            # Time-bound: let a resend after the cool-down act on it.
            await run_in_threadpool(store.release, alert, claim_id)
        else:
            await run_in_threadpool(store.finish, alert, claim_id, outcome)
        return (
            AlertResult(
                **base,
                status="firing",
                action=outcome.status,
                outcome=outcome,
                message=outcome.message,
            ),
            200,
        )

    async def webhook(request: Request) -> Response:
        if not auth.check(request.headers.get("authorization")):
            deliveries.labels("401").inc()
            return JSONResponse(
                {"error": "unauthorized"},
                status_code=401,
                headers={"WWW-Authenticate": 'Bearer realm="releasekit", Basic realm="releasekit"'},
            )
        body = await read_body(request)
        if body is None:
            return answer(413, ReceiverResponse(error=f"body over {max_body_bytes} bytes"))
        try:
            payload = AlertmanagerPayload.model_validate_json(body)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or '(body)'}: {e['msg']}"
                for e in exc.errors()[:5]
            )
            return answer(
                400, ReceiverResponse(error=f"not an Alertmanager v4 payload: {problems}")
            )
        results: list[AlertResult] = []
        codes: list[int] = []
        for alert in payload.alerts:
            env = _env_of(alert, payload)
            base = {"fingerprint": alert.fingerprint, "starts_at": alert.startsAt, "env": env}
            if env is None or (known is not None and env not in known):
                why = f"no {ENV_LABEL} label" if env is None else f"unknown environment {env!r}"
                results.append(
                    AlertResult(**base, status=alert.status, action="ignored", message=why)
                )
                continue
            if alert.status == "resolved":
                await run_in_threadpool(store.record_resolved, alert, env=env, now=clock())
                results.append(AlertResult(**base, status="resolved", action="recorded"))
                continue
            result, code = await handle_firing(alert, env, payload)
            results.append(result)
            codes.append(code)
        if results and all(r.action == "ignored" for r in results):
            return answer(
                422,
                ReceiverResponse(
                    results=results,
                    error="no alert names a known environment (label releasekit_env)",
                ),
            )
        if 500 in codes:
            return answer(500, ReceiverResponse(results=results, error="rollback failed; retry"))
        if 503 in codes:
            return answer(
                503,
                ReceiverResponse(results=results, error="rollback failed transiently; retry"),
                headers={"Retry-After": "10"},
            )
        return answer(200, ReceiverResponse(results=results))

    async def healthz(request: Request) -> Response:
        return JSONResponse({"ok": True})

    app = Starlette(
        routes=[
            Route(path, webhook, methods=["POST"]),
            Route("/healthz", healthz, methods=["GET"]),
        ]
    )
    app.state.store = store
    app.state.registry = reg
    return app
