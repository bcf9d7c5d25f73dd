"""The gateway: one stable, OpenAI-compatible address per environment in front of vLLM servers.

An ASGI app (Starlette for everything but the hot path) served by uvicorn with uvloop and
httptools when installed, talking to upstreams through one shared aiohttp session whose
pool holds more connections than `max_in_flight` (aiohttp, not httpx: relaying a 33-chunk
stream cost 1.1 ms of CPU with aiohttp and 3.9 ms with httpx in the same minimal proxy).
It runs as its own process so that it outlives the releasekit command that started it:

    python -m releasekit.deploy.gateway --config FILE.json

The deployer writes FILE.json (a `GatewayConfig`; keep it mode 0600, it holds the admin
token). Once the gateway listens it writes `ready_file` (a `GatewayEndpoint`: url, port,
pid) atomically; `GatewayClient.wait_ready` then confirms the admin API answers. The
gateway knows upstreams only: it never reads MLflow, the ledger or any store.

Endpoints (one port)
--------------------
- `GET /health`            200 while at least one route carries traffic, 503 otherwise. Open.
- `GET /metrics`           Prometheus text of the gateway's own registry. Open.
- `/v1/*` (any method)     proxied to the pinned route's upstream, `base_url + path + query`,
                           body and status untouched, hop-by-hop headers dropped; SSE relayed
                           chunk by chunk as the upstream sends it. Every proxied response
                           carries `x-releasekit-release: <release id>`.
- `POST /v1/templates/{prompt}/chat/completions`
                           the templated route (below).
- `POST /v1/feedback`      `{"response_id": "...", "score": -1..1 | "up" | "down"}` (below).
- `/admin/*`               the admin API, guarded by `admin_token` (never by a client key):
  - `GET  /admin/state`    `GatewayState`: routes, in-flight and served counts per release.
  - `PUT  /admin/routes`   body `RouteTable`; swaps the table atomically, answers the new
                           `GatewayState`; 422 lists each `field: problem`.
  - `POST /admin/drain`    body `DrainRequest`; waits (up to `timeout_s`) until the release
                           has no request in flight, answers `DrainResult`; 409 if the release
                           still carries traffic (switch first).

Routing
-------
The table is a list of `Route`s swapped by one reference assignment. A request is pinned to
a route when it is admitted and stays there until its last byte, whatever the table does
meanwhile: after a switch, the old release's in-flight count only falls, and a deployer waits
for 0 (`GatewayClient.wait_drained`) before stopping that server. Weights split traffic
with smooth weighted round-robin: deterministic, and exact over any run of
`sum(weights)` requests for integer weights (a 9:1 canary sends 1 of every 10). Weight 0
keeps a route in the table (its templates listed) without traffic.

Client credentials: with `api_keys` set, `/v1/*` needs `Authorization: Bearer <key>`
(401 otherwise, OpenAI-style JSON). The upstream gets the route's own `api_key` when set;
otherwise the client's Authorization header is dropped when the gateway checks keys (it is
the gateway's key, not the upstream's) and passed through when it does not.

Admission and limits, in order: auth (401), per-key token bucket (`rate_limit`; 429 with
Retry-After; keyed by API key, or by client address without keys), the in-flight limit
`max_in_flight` with a queue: a request waits up to `max_queue_wait_s` for a slot, then
gets 503 with Retry-After. Upstream: connect timeout and first-byte timeout (time to the
upstream's response headers; for a non-stream request that includes generation) give 504;
a refused or broken connection gives 502. Once streaming, a gap longer than
`stream_idle_timeout_s` between upstream chunks, or passing `request_timeout_s` in total,
ends the stream with an SSE error event `data: {"error": {...}}` (a non-SSE body is cut).

Templated route
---------------
`POST /v1/templates/{prompt}/chat/completions` with `{"variables": {"name": "value"},
...any other chat-completions parameter}`: the gateway renders the *pinned route's*
template `prompt` (its `system` and `user` texts, `{{ name }}` placeholders, the project's
renderer) into the system and user messages and forwards the body to
`/v1/chat/completions` of that route's upstream (`model` defaults to the route's `model`).
A release that differs only in its prompts is therefore a route-table change with the same
`base_url`: no vLLM restart, and a rollback restores the old templates with the table.
400 names an unknown prompt (and lists the known ones), every missing variable, or a body
that sets `messages` itself. Plain `/v1/*` requests are never rewritten.

Feedback
--------
The gateway remembers the `id` of recent successful responses (the JSON body's `id`, or the
first SSE chunk's), mapped to the release that served them, in a bounded LRU
(`feedback_capacity`). `POST /v1/feedback` counts a score per release: > 0 positive, < 0
negative, 0 neutral (`up` = 1, `down` = -1); only the first feedback on a response is
counted (a repeat answers `counted: false`). Unknown or evicted id: 404; malformed: 400.

Metrics (own CollectorRegistry; `env` is the gateway's environment)
-------------------------------------------------------------------
- `releasekit_gateway_requests_total{env,release,route,status}` counter: pinned requests by
  endpoint (`completions`, `chat/completions`, `models`, `templates`, `other`, ...) and the
  HTTP status the client got (the upstream's, or 400/502/504 from the gateway).
- `releasekit_gateway_in_flight{env,release}` gauge: pinned requests not finished.
- `releasekit_gateway_ttft_seconds{env,release}` histogram (1 ms .. 30 s): arrival at the
  gateway to the first SSE chunk carrying content (`"text"`/`"content"` not empty); streams only.
- `releasekit_gateway_e2e_seconds{env,release}` histogram: arrival to last byte relayed,
  every request that got upstream headers (streamed or not, cut or not).
- `releasekit_gateway_upstream_wait_seconds{env,release}` histogram: arrival to the
  upstream's response headers (admission wait included).
- `releasekit_gateway_overhead_seconds{env,release}` histogram: arrival to the upstream
  request being sent (auth, rate limit, queue, templating): the gateway's own share.
- `releasekit_gateway_queue_wait_seconds{env}` histogram: admission wait (0 when a slot
  was free), every admitted or queue-rejected request.
- `releasekit_gateway_queue_depth{env}` gauge: requests waiting for a slot.
- `releasekit_gateway_stream_chunks_total{env,release}` counter: SSE chunks relayed.
- `releasekit_gateway_stream_errors_total{env,release,reason}` counter: streams ended early
  (`timeout`, `upstream_error`, `client_disconnect`).
- `releasekit_gateway_rejections_total{env,reason}` counter: `auth`, `rate_limit`,
  `queue_full`, `no_route`, `timeout` (504 and mid-stream), `upstream_error` (502 and
  mid-stream), `bad_request` (413, template errors).
- `releasekit_gateway_feedback_total{env,release,score}` counter: `positive`, `negative`,
  `neutral`.
- `releasekit_gateway_info{env,release,weight}` gauge, 1 per live route (`weight` is the
  route's share of traffic, e.g. "0.9"); `releasekit_gateway_route_weight{env,release}` the
  same share as a value; `releasekit_gateway_routes_generation{env}` the table version;
  `releasekit_gateway_route_switches_total{env}` table swaps.

Errors
------
    ReleasekitError
    └── GatewayError                 root of everything the gateway and its client raise
        ├── GatewayConfigError       the config file is unreadable or invalid
        ├── GatewayStartError        the process could not listen, or never became ready
        ├── GatewayUnreachableError  the admin API does not answer
        ├── GatewayAuthError         the admin API refused the admin token (401)
        ├── GatewayRequestError      the admin API rejected a request (422 routes, 409 drain)
        └── PromptTemplateError      a templated request names an unknown prompt or misses
                                     variables (the gateway answers it with 400)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import logging
import math
import os
import re
import socket
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import aiohttp
import httpx
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import generate_latest as _generate_latest
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictFloat,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route as _StarletteRoute
from starlette.types import ASGIApp, Receive, Scope, Send

from releasekit.errors import ReleasekitError

# The project's prompt renderer, imported in this one place (it moved from releasekit.prompts
# to releasekit.spec.prompts with the package reshape).
from releasekit.spec.prompts import placeholders as _placeholders
from releasekit.spec.prompts import render as _render

if TYPE_CHECKING:
    import uvicorn

log = logging.getLogger("releasekit.gateway")

RELEASE_HEADER = "x-releasekit-release"
"""Response header naming the release that served a proxied request."""

TTFT_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
    0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0,
)  # fmt: skip
E2E_BUCKETS = (*TTFT_BUCKETS, 45.0, 60.0, 120.0, 300.0, 600.0)
QUEUE_BUCKETS = (0.0001, 0.0005, *TTFT_BUCKETS)
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, *TTFT_BUCKETS)

_HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
    }
)
# Request headers the gateway sets itself (or must not forward).
_DROP_REQUEST = _HOP_BY_HOP | {b"host", b"content-length", b"accept-encoding", b"authorization"}
_DROP_RESPONSE = _HOP_BY_HOP | {RELEASE_HEADER.encode()}
_CONTENT_RE = re.compile(rb'"(?:text|content)":\s?"[^"]')
_ID_RE = re.compile(rb'"id":\s?"([^"\\]{1,256})"')
_KNOWN_ROUTES = frozenset(
    {"completions", "chat/completions", "models", "embeddings", "responses", "tokenize"}
)
_PROMPT_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


# ----------------------------------------------------------------------------- errors


class GatewayError(ReleasekitError):
    """Root of every error the gateway and its client raise."""

    remedy = "check the gateway's log and its config file"


class GatewayConfigError(GatewayError):
    """Raised when the gateway's config file is unreadable or fails validation; `problems`
    lists each `field: problem`."""

    remedy = "fix the fields listed in the gateway config file (written by the deployer)"

    def __init__(self, path: Path | str, problems: list[str]) -> None:
        self.path = Path(path)
        self.problems = problems
        super().__init__("\n".join(f"{path}: {p}" for p in problems))


class GatewayStartError(GatewayError):
    """Raised when the gateway cannot listen on its address, or its process exits or does
    not write its ready file in time; `log_tail` quotes its log when known."""

    remedy = "check that the gateway's port is free and read its log"

    def __init__(self, message: str, *, log_tail: str = "") -> None:
        self.log_tail = log_tail
        if log_tail:
            message += "\n--- last lines of the gateway log ---\n" + log_tail
        super().__init__(message)


class GatewayUnreachableError(GatewayError):
    """Raised when the gateway's admin API does not answer (not running, wrong address)."""

    remedy = "check that the gateway process runs (`releasekit status`) and its address"


class GatewayAuthError(GatewayError):
    """Raised when the gateway's admin API answers 401: the admin token is wrong."""

    remedy = "use the admin token from the gateway's config file"


class GatewayRequestError(GatewayError):
    """Raised when the admin API rejects a request: an invalid route table (422, `problems`
    lists each `field: problem`) or a drain of a release that still carries traffic (409)."""

    remedy = "fix the request named above"

    def __init__(self, message: str, *, status: int, problems: list[str] | None = None) -> None:
        self.status = status
        self.problems = problems or []
        super().__init__(message)


class PromptTemplateError(GatewayError):
    """Raised when a templated request names a prompt the pinned release lacks, or misses
    variables its templates need; the gateway answers it with 400 and this message."""

    remedy = "send the variables the release's templates name, or use a prompt it defines"


# ----------------------------------------------------------------------------- models


class PromptTemplate(BaseModel):
    """One prompt of a release: its system and user template texts (`{{ name }}`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    system: str | None = None
    user: str


class Route(BaseModel):
    """One upstream the gateway may send traffic to: a release's vLLM server."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    release_id: str = Field(min_length=1, max_length=200, description="the release served")
    base_url: str = Field(description="the upstream, http://host:port without /v1")
    weight: float = Field(1.0, ge=0, le=1e6, allow_inf_nan=False, description="traffic share")
    api_key: str | None = Field(None, repr=False, description="key the upstream demands")
    model: str | None = Field(None, description="served model name; default on templated calls")
    prompts: dict[str, PromptTemplate] = Field(
        default_factory=dict, description="prompt name -> templates, for the templated route"
    )

    @field_validator("base_url")
    @classmethod
    def _check_url(cls, v: str) -> str:
        try:
            url = httpx.URL(v)
        except httpx.InvalidURL as exc:
            raise ValueError(f"not a URL: {v!r}") from exc
        if url.scheme not in ("http", "https") or not url.host:
            raise ValueError(f"must be http(s)://host:port, got {v!r}")
        if url.path not in ("", "/") or url.query:
            raise ValueError(f"must have no path or query (the gateway adds /v1/...), got {v!r}")
        return v.rstrip("/")

    @field_validator("prompts")
    @classmethod
    def _check_prompt_names(cls, v: dict[str, PromptTemplate]) -> dict[str, PromptTemplate]:
        for name in v:
            if not _PROMPT_NAME.match(name):
                raise ValueError(f"prompt name {name!r} must match [A-Za-z0-9_.-]{{1,128}}")
        return v


class RouteTable(BaseModel):
    """The whole routing table (`PUT /admin/routes`): release ids unique, and at least one
    route with weight > 0 unless the table is empty."""

    model_config = ConfigDict(extra="forbid")

    routes: list[Route] = Field(default_factory=list)

    @model_validator(mode="after")
    def _check(self) -> RouteTable:
        seen: set[str] = set()
        for r in self.routes:
            if r.release_id in seen:
                raise ValueError(f"release {r.release_id!r} appears twice")
            seen.add(r.release_id)
        if self.routes and not any(r.weight > 0 for r in self.routes):
            raise ValueError("at least one route needs weight > 0")
        return self


class RateLimit(BaseModel):
    """A token bucket per client key: `rps` requests per second, bursts of `burst`."""

    model_config = ConfigDict(extra="forbid")

    rps: float = Field(gt=0, allow_inf_nan=False)
    burst: int = Field(ge=1)


class GatewayConfig(BaseModel):
    """Everything a gateway process needs, loaded from the JSON file the deployer writes."""

    model_config = ConfigDict(extra="forbid")

    env: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535, description="0: the OS picks (see ready_file)")
    admin_token: str = Field(min_length=16, repr=False, description="guards /admin/*")
    api_keys: list[str] = Field(default_factory=list, repr=False, description="client keys")
    rate_limit: RateLimit | None = None
    max_in_flight: int = Field(256, ge=1, le=100_000)
    max_queue_wait_s: float = Field(5.0, ge=0, allow_inf_nan=False)
    request_timeout_s: float = Field(600.0, gt=0, allow_inf_nan=False)
    upstream_connect_timeout_s: float = Field(5.0, gt=0, allow_inf_nan=False)
    upstream_first_byte_timeout_s: float = Field(120.0, gt=0, allow_inf_nan=False)
    stream_idle_timeout_s: float = Field(60.0, gt=0, allow_inf_nan=False)
    max_request_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    feedback_capacity: int = Field(100_000, ge=1)
    shutdown_timeout_s: float = Field(30.0, ge=0, description="uvicorn graceful shutdown")
    ready_file: str | None = Field(None, description="where to write GatewayEndpoint when up")
    log_level: Literal["debug", "info", "warning", "error"] = "warning"
    routes: list[Route] = Field(default_factory=list, description="the initial table")

    @field_validator("api_keys")
    @classmethod
    def _check_keys(cls, v: list[str]) -> list[str]:
        if any(not k for k in v):
            raise ValueError("an API key is empty")
        return v

    @model_validator(mode="after")
    def _check_routes(self) -> GatewayConfig:
        RouteTable(routes=self.routes)
        return self


class RouteState(BaseModel):
    """A route as `GET /admin/state` shows it (no upstream key)."""

    release_id: str
    base_url: str
    weight: float
    share: float = Field(description="fraction of new traffic it gets")
    model: str | None = None
    prompts: list[str] = Field(default_factory=list)
    has_api_key: bool = False


class GatewayState(BaseModel):
    """What the gateway does right now (`GET /admin/state`)."""

    env: str
    generation: int = Field(description="route-table version; +1 per swap")
    routes: list[RouteState]
    in_flight: dict[str, int] = Field(description="release -> pinned requests not finished")
    served: dict[str, int] = Field(description="release -> requests finished")
    in_flight_total: int
    queued: int = Field(description="requests waiting for an in-flight slot")
    max_in_flight: int
    pid: int
    started_at: float = Field(description="unix time the gateway started")


class DrainRequest(BaseModel):
    """`POST /admin/drain`: wait up to `timeout_s` until `release_id` has nothing in flight."""

    model_config = ConfigDict(extra="forbid")

    release_id: str = Field(min_length=1)
    timeout_s: float = Field(30.0, ge=0, le=3600, allow_inf_nan=False)


class DrainResult(BaseModel):
    """Answer to a drain: `drained` once no request of the release is in flight."""

    release_id: str
    drained: bool
    in_flight: int
    waited_s: float


class GatewayEndpoint(BaseModel):
    """The ready file: where a started gateway listens and which process it is."""

    env: str
    url: str
    host: str
    port: int
    pid: int
    started_at: float


class _Feedback(BaseModel):
    model_config = ConfigDict(extra="ignore")

    response_id: str = Field(min_length=1, max_length=256)
    score: StrictFloat | StrictInt | Literal["up", "down"]


_Body = TypeVar("_Body", bound=BaseModel)


async def _admin_body(
    request: Request, model: type[_Body], *, what: str, code: str
) -> _Body | Response:
    """An admin request's JSON body as `model`, or the 422 answer listing every problem."""
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as exc:
        problems = _problems(exc)
        return _error(
            422,
            f"invalid {what}: " + "; ".join(problems),
            type_="invalid_request_error",
            code=code,
            extra={"problems": problems},
        )


def _problems(exc: ValidationError) -> list[str]:
    out = []
    for e in exc.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "(root)"
        out.append(f"{loc}: {e['msg']}")
    return out


def load_config(path: Path | str) -> GatewayConfig:
    """Read and validate a gateway config file; GatewayConfigError lists every problem."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise GatewayConfigError(p, [f"cannot read: {exc.strerror or exc}"]) from exc
    try:
        return GatewayConfig.model_validate_json(raw)
    except ValidationError as exc:
        raise GatewayConfigError(p, _problems(exc)) from exc


def render_prompt(route: Route, prompt: str, variables: Mapping[str, str]) -> list[dict[str, str]]:
    """The chat messages a route's template `prompt` renders to with `variables`.

    Raises PromptTemplateError naming an unknown prompt (with the known ones) or every
    missing variable.
    """
    tpl = route.prompts.get(prompt)
    if tpl is None:
        known = ", ".join(sorted(route.prompts)) or "none"
        raise PromptTemplateError(
            f"unknown prompt {prompt!r} for release {route.release_id} (known: {known})"
        )
    needed = _placeholders(tpl.user) | (_placeholders(tpl.system) if tpl.system else set())
    missing = sorted(needed - variables.keys())
    if missing:
        raise PromptTemplateError(
            f"prompt {prompt!r} needs variable(s) {', '.join(missing)} (release {route.release_id})"
        )
    msgs = []
    if tpl.system is not None:
        msgs.append({"role": "system", "content": _render(tpl.system, variables, strict=True)})
    msgs.append({"role": "user", "content": _render(tpl.user, variables, strict=True)})
    return msgs


# ----------------------------------------------------------------------------- internals


class _Table:
    """An immutable set of routes plus the smooth weighted round-robin cursor."""

    __slots__ = ("_current", "_live", "_total", "generation", "routes")

    def __init__(self, generation: int, routes: Sequence[Route]) -> None:
        self.generation = generation
        self.routes = tuple(routes)
        self._live = [r for r in self.routes if r.weight > 0]
        self._total = sum(r.weight for r in self._live)
        self._current = [0.0] * len(self._live)

    def share(self, route: Route) -> float:
        return route.weight / self._total if self._total and route.weight > 0 else 0.0

    def routed(self, release_id: str) -> bool:
        return any(r.release_id == release_id for r in self._live)

    def pick(self) -> Route | None:
        live = self._live
        if len(live) == 1:
            return live[0]
        if not live:
            return None
        cur = self._current
        best = 0
        for i, r in enumerate(live):
            cur[i] += r.weight
            if cur[i] > cur[best]:
                best = i
        cur[best] -= self._total
        return live[best]


class _TokenBuckets:
    """Per-key token buckets, bounded (least recently seen keys are forgotten)."""

    def __init__(self, limit: RateLimit, *, max_keys: int = 10_000) -> None:
        self.rps = limit.rps
        self.burst = float(limit.burst)
        self.max_keys = max_keys
        self._b: OrderedDict[str, list[float]] = OrderedDict()

    def take(self, key: str) -> float:
        """0.0 if a token was taken, else seconds until one is available."""
        now = time.monotonic()
        b = self._b.get(key)
        if b is None:
            b = self._b[key] = [self.burst, now]
            if len(self._b) > self.max_keys:
                self._b.popitem(last=False)
        else:
            self._b.move_to_end(key)
            b[0] = min(self.burst, b[0] + (now - b[1]) * self.rps)
            b[1] = now
        if b[0] >= 1.0:
            b[0] -= 1.0
            return 0.0
        return (1.0 - b[0]) / self.rps


class _ReleaseMetrics:
    __slots__ = ("chunks", "e2e", "in_flight", "overhead", "ttft", "upstream_wait")

    def __init__(self, m: _Metrics, release: str) -> None:
        env = m.env
        self.in_flight = m.in_flight.labels(env, release)
        self.ttft = m.ttft.labels(env, release)
        self.e2e = m.e2e.labels(env, release)
        self.upstream_wait = m.upstream_wait.labels(env, release)
        self.overhead = m.overhead.labels(env, release)
        self.chunks = m.chunks.labels(env, release)


class _Metrics:
    """The gateway's metric families (names are a contract with the watcher)."""

    def __init__(self, registry: CollectorRegistry, env: str) -> None:
        self.env = env
        rl = ["env", "release"]
        p = "releasekit_gateway_"
        self.requests = Counter(
            p + "requests", "Pinned requests by endpoint and status the client got",
            ["env", "release", "route", "status"], registry=registry,
        )  # fmt: skip
        self.in_flight = Gauge(p + "in_flight", "Pinned requests not finished", rl,
                               registry=registry)  # fmt: skip
        self.ttft = Histogram(p + "ttft_seconds", "Arrival to first content chunk (streams)",
                              rl, buckets=TTFT_BUCKETS, registry=registry)  # fmt: skip
        self.e2e = Histogram(p + "e2e_seconds", "Arrival to last byte relayed", rl,
                             buckets=E2E_BUCKETS, registry=registry)  # fmt: skip
        self.upstream_wait = Histogram(
            p + "upstream_wait_seconds", "Arrival to upstream response headers", rl,
            buckets=E2E_BUCKETS, registry=registry,
        )  # fmt: skip
        self.overhead = Histogram(
            p + "overhead_seconds", "Arrival to upstream request sent (gateway's share)", rl,
            buckets=OVERHEAD_BUCKETS, registry=registry,
        )  # fmt: skip
        self.queue_wait = Histogram(
            p + "queue_wait_seconds", "Admission wait for an in-flight slot", ["env"],
            buckets=QUEUE_BUCKETS, registry=registry,
        ).labels(env)  # fmt: skip
        self.queue_depth = Gauge(p + "queue_depth", "Requests waiting for a slot", ["env"],
                                 registry=registry).labels(env)  # fmt: skip
        self.chunks = Counter(p + "stream_chunks", "SSE chunks relayed", rl, registry=registry)
        self.stream_errors = Counter(
            p + "stream_errors", "Streams ended early", ["env", "release", "reason"],
            registry=registry,
        )  # fmt: skip
        self.rejections = Counter(p + "rejections", "Requests refused or failed by the gateway",
                                  ["env", "reason"], registry=registry)  # fmt: skip
        self.feedback = Counter(p + "feedback", "Feedback on responses",
                                ["env", "release", "score"], registry=registry)  # fmt: skip
        self.info = Gauge(p + "info", "1 per live route; weight = its traffic share",
                          ["env", "release", "weight"], registry=registry)  # fmt: skip
        self.weight = Gauge(p + "route_weight", "Traffic share per live route", rl,
                            registry=registry)  # fmt: skip
        self.generation = Gauge(p + "routes_generation", "Route-table version", ["env"],
                                registry=registry).labels(env)  # fmt: skip
        self.switches = Counter(p + "route_switches", "Route-table swaps", ["env"],
                                registry=registry).labels(env)  # fmt: skip
        self._rel: dict[str, _ReleaseMetrics] = {}
        self._req: dict[tuple[str, str, int], Any] = {}
        self._rej: dict[str, Any] = {}
        self._info_labels: list[tuple[str, str]] = []

    def release(self, release: str) -> _ReleaseMetrics:
        m = self._rel.get(release)
        if m is None:
            m = self._rel[release] = _ReleaseMetrics(self, release)
        return m

    def request(self, release: str, route: str, status: int) -> None:
        key = (release, route, status)
        c = self._req.get(key)
        if c is None:
            c = self._req[key] = self.requests.labels(self.env, release, route, str(status))
        c.inc()

    def reject(self, reason: str) -> None:
        c = self._rej.get(reason)
        if c is None:
            c = self._rej[reason] = self.rejections.labels(self.env, reason)
        c.inc()

    def set_routes(self, table: _Table) -> None:
        for labels in self._info_labels:
            with contextlib.suppress(KeyError):
                self.info.remove(self.env, *labels)
            with contextlib.suppress(KeyError):
                self.weight.remove(self.env, labels[0])
        self._info_labels = []
        for r in table.routes:
            share = table.share(r)
            if share <= 0:
                continue
            labels = (r.release_id, f"{share:.4g}")
            self.info.labels(self.env, *labels).set(1)
            self.weight.labels(self.env, r.release_id).set(share)
            self._info_labels.append(labels)
        self.generation.set(table.generation)


class _Flag:
    __slots__ = ("set",)

    def __init__(self) -> None:
        self.set = False


class _Flight:
    """One pinned request: its route, clocks and metrics; `finish` runs exactly once."""

    __slots__ = ("deadline", "done", "gw", "m", "route", "route_label", "t0")

    def __init__(self, gw: Gateway, route: Route, route_label: str, t0: float) -> None:
        self.gw = gw
        self.route = route
        self.route_label = route_label
        self.t0 = t0
        self.deadline = time.monotonic() + gw.config.request_timeout_s
        self.m = gw._metrics.release(route.release_id)
        self.done = False

    def finish(
        self, status: int, *, got_response: bool, chunks: int = 0, outcome: str | None = None
    ) -> None:
        if self.done:
            return
        self.done = True
        gw = self.gw
        rid = self.route.release_id
        gw._unpin(rid, self.m)
        gw._metrics.request(rid, self.route_label, status)
        if got_response:
            self.m.e2e.observe(time.perf_counter() - self.t0)
        if chunks:
            self.m.chunks.inc(chunks)
        if outcome is not None:
            gw._metrics.stream_errors.labels(gw.config.env, rid, outcome).inc()
            if outcome != "client_disconnect":
                gw._metrics.reject(outcome)


def _json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _error(
    status: int,
    message: str,
    *,
    type_: str,
    code: str,
    headers: Mapping[str, str] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Response:
    """An OpenAI-style error body: {"error": {"message", "type", "param", "code"}}."""
    err: dict[str, Any] = {"message": message, "type": type_, "param": None, "code": code}
    if extra:
        err.update(extra)
    return Response(
        _json_bytes({"error": err}),
        status_code=status,
        media_type="application/json",
        headers=dict(headers or {}),
    )


def _json(obj: BaseModel | dict[str, Any], status: int = 200) -> Response:
    body = obj.model_dump_json().encode() if isinstance(obj, BaseModel) else _json_bytes(obj)
    return Response(body, status_code=status, media_type="application/json")


def _route_label(path: str) -> str:
    tail = path[4:] if path.startswith("/v1/") else path
    return tail if tail in _KNOWN_ROUTES else "other"


def _bearer(request: Request) -> bytes | None:
    h = request.headers.get("authorization")
    if h is None or len(h) < 8 or h[:7].lower() != "bearer ":
        return None
    return h[7:].strip().encode()


async def _watch_disconnect(receive: Receive, flag: _Flag) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            flag.set = True
            return


class _Relay(Response):
    """Relays an upstream response: headers once, then each upstream read as it comes."""

    def __init__(
        self, flight: _Flight, upstream: aiohttp.ClientResponse, *, capture_id: bool
    ) -> None:
        self.flight = flight
        self.upstream = upstream
        self.status_code = upstream.status
        self.background = None
        self.capture_id = capture_id and 200 <= upstream.status < 300
        self.sse = upstream.content_type == "text/event-stream"
        raw = [(k.lower(), v) for k, v in upstream.raw_headers]
        raw = [(k, v) for k, v in raw if k not in _DROP_RESPONSE]
        raw.append((RELEASE_HEADER.encode(), flight.route.release_id.encode()))
        self.raw_headers = raw

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        flight = self.flight
        upstream = self.upstream
        sse = self.sse
        need_ttft = sse
        need_id = self.capture_id
        deadline = flight.deadline
        chunks = 0
        outcome: str | None = None
        completed = False
        flag = _Flag()
        watcher = asyncio.ensure_future(_watch_disconnect(receive, flag)) if sse else None
        try:
            start = {"type": "http.response.start", "status": self.status_code}
            await send({**start, "headers": self.raw_headers})
            try:
                async for chunk in upstream.content.iter_any():
                    if need_ttft and _CONTENT_RE.search(chunk):
                        flight.m.ttft.observe(time.perf_counter() - flight.t0)
                        need_ttft = False
                    if need_id:
                        need_id = False
                        found = _ID_RE.search(chunk)
                        if found:
                            flight.gw._remember(found.group(1).decode(), flight.route.release_id)
                    chunks += 1
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    if flag.set:
                        outcome = "client_disconnect"
                        break
                    if time.monotonic() > deadline:
                        outcome = "timeout"
                        break
            except TimeoutError:
                outcome = "timeout"
            except (aiohttp.ClientError, OSError) as exc:
                log.warning("upstream %s broke mid-response: %r", flight.route.base_url, exc)
                outcome = "upstream_error"
            if outcome in ("timeout", "upstream_error") and sse:
                msg = (
                    "upstream timed out mid-stream"
                    if outcome == "timeout"
                    else "upstream connection broke mid-stream"
                )
                err = {"message": msg, "type": "server_error", "param": None, "code": outcome}
                event = b"data: " + _json_bytes({"error": err}) + b"\n\n"
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            completed = True
        finally:
            if watcher is not None:
                watcher.cancel()
            if completed and outcome is None:
                upstream.release()  # fully read: the connection goes back to the pool
            else:
                upstream.close()  # cut: close the connection (vLLM aborts the request)
            flight.finish(
                self.status_code, got_response=True, chunks=chunks if sse else 0, outcome=outcome
            )


# ----------------------------------------------------------------------------- the gateway


class Gateway:
    """The gateway's state and ASGI app; `app()` builds the ASGI application.

    One instance serves one environment. Methods run on the event loop thread; `set_routes`
    may also be called before the server starts.
    """

    def __init__(
        self,
        config: GatewayConfig,
        *,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.config = config
        self.registry = registry if registry is not None else CollectorRegistry()
        self._metrics = _Metrics(self.registry, config.env)
        self._table = _Table(0, ())
        self._in_flight: dict[str, int] = {}
        self._served: dict[str, int] = {}
        self._idle: dict[str, asyncio.Event] = {}
        self._queued = 0
        self._in_flight_total = 0
        self._sem = asyncio.Semaphore(config.max_in_flight)
        self._session: aiohttp.ClientSession | None = None
        self._buckets = _TokenBuckets(config.rate_limit) if config.rate_limit else None
        self._responses: OrderedDict[str, list[Any]] = OrderedDict()
        self._api_keys = [k.encode() for k in config.api_keys]
        self._admin_token = config.admin_token.encode()
        c = config.upstream_connect_timeout_s
        first = min(config.upstream_first_byte_timeout_s, config.request_timeout_s)
        # sock_read bounds every wait for upstream bytes: the response headers first, then
        # (switched after the headers, see _forward) each gap between body chunks.
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=c, sock_connect=c, sock_read=first
        )
        self._idle_s = config.stream_idle_timeout_s
        self._retry_queue = str(max(1, math.ceil(config.max_queue_wait_s)))
        self.started_at = time.time()
        self.set_routes(RouteTable(routes=config.routes))

    # -- routing table

    def set_routes(self, table: RouteTable) -> GatewayState:
        """Swap the routing table (one reference assignment); answers the new state."""
        new = _Table(self._table.generation + 1, table.routes)
        self._table = new
        self._metrics.set_routes(new)
        self._metrics.switches.inc()
        return self.state()

    def state(self) -> GatewayState:
        """Routes, in-flight and served counts now."""
        t = self._table
        return GatewayState(
            env=self.config.env,
            generation=t.generation,
            routes=[
                RouteState(
                    release_id=r.release_id,
                    base_url=r.base_url,
                    weight=r.weight,
                    share=t.share(r),
                    model=r.model,
                    prompts=sorted(r.prompts),
                    has_api_key=r.api_key is not None,
                )
                for r in t.routes
            ],
            in_flight=dict(self._in_flight),
            served=dict(self._served),
            in_flight_total=self._in_flight_total,
            queued=self._queued,
            max_in_flight=self.config.max_in_flight,
            pid=os.getpid(),
            started_at=self.started_at,
        )

    async def drain(self, release_id: str, timeout_s: float) -> DrainResult:
        """Wait up to `timeout_s` until no request pinned to `release_id` is in flight.

        Raises GatewayRequestError (409) if the release still gets new traffic.
        """
        if self._table.routed(release_id):
            raise GatewayRequestError(
                f"release {release_id} still carries traffic; switch the routes first",
                status=409,
            )
        t = time.monotonic()
        if self._in_flight.get(release_id, 0) > 0:
            ev = self._idle.get(release_id)
            if ev is None:
                ev = self._idle[release_id] = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await ev.wait()
        n = self._in_flight.get(release_id, 0)
        return DrainResult(
            release_id=release_id, drained=n == 0, in_flight=n, waited_s=time.monotonic() - t
        )

    def _pin(self, rid: str, m: _ReleaseMetrics) -> None:
        self._in_flight[rid] = self._in_flight.get(rid, 0) + 1
        self._in_flight_total += 1
        m.in_flight.inc()

    def _unpin(self, rid: str, m: _ReleaseMetrics) -> None:
        n = self._in_flight[rid] - 1
        self._in_flight[rid] = n
        self._in_flight_total -= 1
        self._served[rid] = self._served.get(rid, 0) + 1
        m.in_flight.dec()
        self._sem.release()
        if n == 0:
            ev = self._idle.pop(rid, None)
            if ev is not None:
                ev.set()

    def _remember(self, response_id: str, release_id: str) -> None:
        r = self._responses
        r[response_id] = [release_id, False]
        if len(r) > self.config.feedback_capacity:
            r.popitem(last=False)

    # -- lifecycle

    async def startup(self) -> None:
        """Open the shared upstream connection pool (more connections than in-flight
        slots, so an admitted request never waits for one)."""
        connector = aiohttp.TCPConnector(
            limit=self.config.max_in_flight + 16,
            limit_per_host=0,
            keepalive_timeout=30.0,
            enable_cleanup_closed=False,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=self._timeout,
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            trust_env=False,
        )

    async def shutdown(self) -> None:
        """Close the upstream connection pool."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    def app(self) -> ASGIApp:
        """The ASGI application: plain `/v1/*` proxying on a direct path (it is the hot
        path: no router or middleware per chunk), everything else through Starlette's router
        (whose lifespan opens and closes the upstream pool)."""
        starlette = self._starlette()
        proxy = self._proxy

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == "http":
                path = scope["path"]
                if (
                    path.startswith("/v1/")
                    and path != "/v1/feedback"
                    and not path.startswith("/v1/templates/")
                ):
                    response = await proxy(Request(scope, receive))
                    await response(scope, receive, send)
                    return
            await starlette(scope, receive, send)

        return app

    def _starlette(self) -> Starlette:

        @contextlib.asynccontextmanager
        async def lifespan(app: Starlette) -> AsyncIterator[None]:
            await self.startup()
            try:
                yield
            finally:
                await self.shutdown()

        every = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
        routes = [
            _StarletteRoute("/health", self._health, methods=["GET", "HEAD"]),
            _StarletteRoute("/metrics", self._metrics_text, methods=["GET"]),
            _StarletteRoute("/admin/state", self._admin_state, methods=["GET"]),
            _StarletteRoute("/admin/routes", self._admin_routes, methods=["PUT"]),
            _StarletteRoute("/admin/drain", self._admin_drain, methods=["POST"]),
            _StarletteRoute("/v1/feedback", self._feedback, methods=["POST"]),
            _StarletteRoute(
                "/v1/templates/{prompt}/chat/completions", self._templated, methods=["POST"]
            ),
            _StarletteRoute("/v1/{path:path}", self._proxy, methods=every),
        ]
        return Starlette(routes=routes, lifespan=lifespan)

    # -- open endpoints

    async def _health(self, request: Request) -> Response:
        live = sum(1 for r in self._table.routes if r.weight > 0)
        body = {"status": "ok" if live else "no_routes", "env": self.config.env, "routes": live}
        return _json(body, 200 if live else 503)

    async def _metrics_text(self, request: Request) -> Response:
        return Response(_generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    # -- admin

    def _admin_denied(self, request: Request) -> Response | None:
        token = _bearer(request)
        if token is not None and hmac.compare_digest(token, self._admin_token):
            return None
        return _error(
            401,
            "admin token missing or wrong",
            type_="invalid_request_error",
            code="invalid_admin_token",
            headers={"www-authenticate": "Bearer"},
        )

    async def _admin_state(self, request: Request) -> Response:
        return self._admin_denied(request) or _json(self.state())

    async def _admin_routes(self, request: Request) -> Response:
        denied = self._admin_denied(request)
        if denied:
            return denied
        table = await _admin_body(request, RouteTable, what="route table", code="invalid_routes")
        if isinstance(table, Response):
            return table
        return _json(self.set_routes(table))

    async def _admin_drain(self, request: Request) -> Response:
        denied = self._admin_denied(request)
        if denied:
            return denied
        req = await _admin_body(request, DrainRequest, what="drain request", code="invalid_drain")
        if isinstance(req, Response):
            return req
        try:
            return _json(await self.drain(req.release_id, req.timeout_s))
        except GatewayRequestError as exc:
            return _error(exc.status, exc.message, type_="invalid_request_error", code="routed")

    # -- client endpoints

    def _client_denied(self, request: Request) -> Response | None:
        """Auth, then the per-key token bucket; None when the request may proceed."""
        key: str
        if self._api_keys:
            token = _bearer(request)
            ok = False
            if token is not None:
                for k in self._api_keys:  # no early exit: time does not tell which key
                    ok |= hmac.compare_digest(token, k)
            if not ok:
                self._metrics.reject("auth")
                return _error(
                    401,
                    "missing API key" if token is None else "incorrect API key provided",
                    type_="invalid_request_error",
                    code="invalid_api_key",
                    headers={"www-authenticate": "Bearer"},
                )
            key = token.decode(errors="replace") if token is not None else ""
        else:
            key = request.client.host if request.client else ""
        if self._buckets is not None:
            wait = self._buckets.take(key)
            if wait > 0:
                self._metrics.reject("rate_limit")
                return _error(
                    429,
                    "rate limit exceeded",
                    type_="rate_limit_error",
                    code="rate_limit_exceeded",
                    headers={"retry-after": str(max(1, math.ceil(wait)))},
                )
        return None

    async def _body(self, request: Request) -> bytes | Response:
        limit = self.config.max_request_bytes
        cl = request.headers.get("content-length")
        if cl is not None and cl.isdigit() and int(cl) > limit:
            body = None
        else:
            body = await request.body()
            if len(body) <= limit:
                return body
        self._metrics.reject("bad_request")
        return _error(
            413, f"request body over {limit} bytes", type_="invalid_request_error", code="too_large"
        )

    async def _admit(self) -> Response | None:
        """Take an in-flight slot, waiting up to max_queue_wait_s; 503 past that."""
        sem = self._sem
        m = self._metrics
        if not sem.locked():
            await sem.acquire()
            m.queue_wait.observe(0.0)
            return None
        t = time.perf_counter()
        self._queued += 1
        m.queue_depth.inc()
        try:
            async with asyncio.timeout(self.config.max_queue_wait_s):
                await sem.acquire()
        except TimeoutError:
            m.queue_wait.observe(time.perf_counter() - t)
            m.reject("queue_full")
            return _error(
                503,
                f"gateway busy: no slot within {self.config.max_queue_wait_s:g} s",
                type_="server_error",
                code="queue_full",
                headers={"retry-after": self._retry_queue},
            )
        finally:
            self._queued -= 1
            m.queue_depth.dec()
        m.queue_wait.observe(time.perf_counter() - t)
        return None

    async def _proxy(self, request: Request) -> Response:
        t0 = time.perf_counter()
        denied = self._client_denied(request)
        if denied:
            return denied
        body = await self._body(request)
        if isinstance(body, Response):
            return body
        path = request.scope["path"]
        return await self._forward(
            request, t0, path=path, body=body, route_label=_route_label(path), prompt=None
        )

    async def _templated(self, request: Request) -> Response:
        t0 = time.perf_counter()
        denied = self._client_denied(request)
        if denied:
            return denied
        body = await self._body(request)
        if isinstance(body, Response):
            return body
        return await self._forward(
            request,
            t0,
            path="/v1/chat/completions",
            body=body,
            route_label="templates",
            prompt=request.path_params["prompt"],
        )

    def _templated_body(self, route: Route, prompt: str, body: bytes) -> bytes:
        try:
            payload = json.loads(body)
        except ValueError as exc:
            raise PromptTemplateError(f"body is not JSON: {exc}") from exc
        if not isinstance(payload, dict):
            raise PromptTemplateError("body must be a JSON object")
        if "messages" in payload:
            raise PromptTemplateError(
                "a templated request must not set 'messages': the template renders them"
            )
        variables = payload.pop("variables", {})
        if not isinstance(variables, dict) or not all(
            isinstance(v, str | int | float) and not isinstance(v, bool) for v in variables.values()
        ):
            raise PromptTemplateError("'variables' must be an object of strings or numbers")
        payload["messages"] = render_prompt(
            route, prompt, {str(k): str(v) for k, v in variables.items()}
        )
        if "model" not in payload and route.model is not None:
            payload["model"] = route.model
        return _json_bytes(payload)

    def _upstream_headers(self, request: Request, route: Route) -> list[tuple[str, str]]:
        out = [
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in request.scope["headers"]
            if k not in _DROP_REQUEST
        ]
        out.append(("accept-encoding", "identity"))
        if route.api_key is not None:
            out.append(("authorization", "Bearer " + route.api_key))
        elif not self._api_keys:
            auth = request.headers.get("authorization")
            if auth is not None:
                out.append(("authorization", auth))
        return out

    async def _forward(
        self,
        request: Request,
        t0: float,
        *,
        path: str,
        body: bytes,
        route_label: str,
        prompt: str | None,
    ) -> Response:
        busy = await self._admit()
        if busy is not None:
            return busy
        # Pin and count in the same step (no await in between): a drain that sees 0 in
        # flight for a release no longer routed can trust it stays 0.
        route = self._table.pick()
        if route is None:
            self._sem.release()
            self._metrics.reject("no_route")
            return _error(503, "no release is routed", type_="server_error", code="no_route",
                          headers={"retry-after": "1"})  # fmt: skip
        flight = _Flight(self, route, route_label, t0)
        self._pin(route.release_id, flight.m)
        rel_header = {RELEASE_HEADER: route.release_id}
        try:
            if prompt is not None:
                body = self._templated_body(route, prompt, body)
        except PromptTemplateError as exc:
            flight.finish(400, got_response=False)
            self._metrics.reject("bad_request")
            return _error(400, exc.message, type_="invalid_request_error", code="bad_template",
                          headers=rel_header)  # fmt: skip
        session = self._session
        if session is None:  # pragma: no cover - lifespan not run
            flight.finish(503, got_response=False)
            return _error(503, "gateway starting", type_="server_error", code="starting")
        qs = request.scope["query_string"]
        url = route.base_url + path + ("?" + qs.decode("latin-1") if qs else "")
        try:
            headers = self._upstream_headers(request, route)
            flight.m.overhead.observe(time.perf_counter() - t0)
            upstream = await session.request(
                request.method, url, headers=headers, data=body or None, allow_redirects=False
            )
        except TimeoutError as exc:
            flight.finish(504, got_response=False)
            self._metrics.reject("timeout")
            return _error(504, f"upstream {route.release_id} timed out ({type(exc).__name__})",
                          type_="server_error", code="upstream_timeout",
                          headers=rel_header)  # fmt: skip
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            flight.finish(502, got_response=False)
            self._metrics.reject("upstream_error")
            log.warning("upstream %s failed: %r", route.base_url, exc)
            return _error(502, f"upstream {route.release_id} failed: {type(exc).__name__}",
                          type_="server_error", code="upstream_error",
                          headers=rel_header)  # fmt: skip
        except BaseException:
            flight.finish(499, got_response=False)
            raise
        flight.m.upstream_wait.observe(time.perf_counter() - t0)
        conn = upstream.connection
        if conn is not None and conn.protocol is not None:
            # From the next body chunk on, a gap over stream_idle_timeout_s is a stall.
            conn.protocol.read_timeout = self._idle_s
        return _Relay(flight, upstream, capture_id=request.method == "POST")

    async def _feedback(self, request: Request) -> Response:
        denied = self._client_denied(request)
        if denied:
            return denied
        body = await self._body(request)
        if isinstance(body, Response):
            return body
        try:
            fb = _Feedback.model_validate_json(body)
        except ValidationError as exc:
            return _error(400, "invalid feedback: " + "; ".join(_problems(exc)),
                          type_="invalid_request_error", code="bad_feedback")  # fmt: skip
        if isinstance(fb.score, str):
            score = 1.0 if fb.score == "up" else -1.0
        else:
            score = float(fb.score)
        if not -1.0 <= score <= 1.0:
            return _error(400, f"invalid feedback: score {score:g} is outside [-1, 1]",
                          type_="invalid_request_error", code="bad_feedback")  # fmt: skip
        seen = self._responses.get(fb.response_id)
        if seen is None:
            return _error(404, f"unknown response id {fb.response_id!r} (or too old)",
                          type_="invalid_request_error", code="unknown_response")  # fmt: skip
        release_id, already = seen
        label = "positive" if score > 0 else "negative" if score < 0 else "neutral"
        if not already:
            seen[1] = True
            self._metrics.feedback.labels(self.config.env, release_id, label).inc()
        return _json(
            {
                "response_id": fb.response_id,
                "release_id": release_id,
                "score": score,
                "label": label,
                "counted": not already,
            }
        )


# ----------------------------------------------------------------------------- serving


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket on host:port (0: the OS picks); GatewayStartError if
    the address is taken or not ours."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise GatewayStartError(f"gateway cannot listen on {host}:{port}: {exc}") from exc
    sock.set_inheritable(True)
    return sock


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _uvicorn_server(
    gw: Gateway,
    on_started: Callable[[], None] | None = None,
    on_stopped: Callable[[], None] | None = None,
) -> uvicorn.Server:
    import uvicorn

    class _Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            if self.started and on_started is not None:
                on_started()

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            try:
                await super().shutdown(sockets=sockets)
            finally:
                if on_stopped is not None:
                    on_stopped()

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            super().handle_exit(sig, frame)
            # uvicorn re-raises a captured SIGTERM after shutdown (exit status -15); for the
            # gateway a signalled stop is the normal, clean one: exit 0 once cleaned up.
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list):
                captured.clear()

    cfg = uvicorn.Config(
        gw.app(),
        loop="auto",
        http="auto",
        lifespan="on",
        access_log=False,
        log_level=gw.config.log_level,
        server_header=False,
        date_header=False,
        proxy_headers=False,  # never trust X-Forwarded-* from clients; one less layer per call
        timeout_graceful_shutdown=int(gw.config.shutdown_timeout_s) or None,
        timeout_keep_alive=30,
        backlog=max(2048, gw.config.max_in_flight * 2),
    )
    return _Server(cfg)


def _endpoint(gw: Gateway, sock: socket.socket) -> GatewayEndpoint:
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    return GatewayEndpoint(
        env=gw.config.env,
        url=f"http://{shown}:{port}",
        host=host,
        port=port,
        pid=os.getpid(),
        started_at=gw.started_at,
    )


def serve(config: GatewayConfig) -> None:
    """Run a gateway in this process until SIGTERM/SIGINT (graceful: in-flight requests get
    `shutdown_timeout_s` to finish). Writes `ready_file` once listening, removes it on exit.

    Raises GatewayStartError if the address cannot be bound.
    """
    gw = Gateway(config)
    sock = bind_socket(config.host, config.port)
    ready = Path(config.ready_file) if config.ready_file else None
    endpoint = _endpoint(gw, sock)

    def on_started() -> None:
        if ready is not None:
            _write_atomic(ready, endpoint.model_dump_json().encode())

    def on_stopped() -> None:
        if ready is not None:
            with contextlib.suppress(OSError, ValueError):
                if GatewayEndpoint.model_validate_json(ready.read_bytes()).pid == os.getpid():
                    ready.unlink()

    server = _uvicorn_server(gw, on_started, on_stopped)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        on_stopped()
    if not server.started:
        raise GatewayStartError(f"gateway for {config.env} did not start (see its log)")


class ThreadedGateway:
    """A gateway served by uvicorn in a background thread of this process (tests,
    benchmarks, embedding): `with ThreadedGateway(config) as tg: tg.url`."""

    def __init__(self, config: GatewayConfig, *, start_timeout_s: float = 10.0) -> None:
        self.gateway = Gateway(config)
        self.start_timeout_s = start_timeout_s
        self._sock = bind_socket(config.host, config.port)
        self.endpoint = _endpoint(self.gateway, self._sock)
        self._server = _uvicorn_server(self.gateway)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    @property
    def url(self) -> str:
        """http://host:port of the gateway."""
        return self.endpoint.url

    def start(self) -> ThreadedGateway:
        """Start serving; GatewayStartError if it is not up within start_timeout_s."""
        self._thread.start()
        deadline = time.monotonic() + self.start_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise GatewayStartError("threaded gateway did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Graceful stop (in-flight requests get shutdown_timeout_s), then join."""
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=self.gateway.config.shutdown_timeout_s + 10)
        self._sock.close()

    def __enter__(self) -> ThreadedGateway:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def running(config: GatewayConfig) -> Iterator[ThreadedGateway]:
    """`with running(config) as tg:` a started ThreadedGateway, stopped on exit."""
    tg = ThreadedGateway(config).start()
    try:
        yield tg
    finally:
        tg.stop()


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m releasekit.deploy.gateway --config FILE.json`; exit 0 after a clean stop,
    2 on a bad config or an address that cannot be bound."""
    parser = argparse.ArgumentParser(
        prog="python -m releasekit.deploy.gateway",
        description="Serve one environment's gateway (config written by the deployer).",
    )
    parser.add_argument("--config", required=True, type=Path, help="GatewayConfig JSON file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    try:
        config = load_config(args.config)
        logging.getLogger("releasekit.gateway").setLevel(config.log_level.upper())
        serve(config)
    except GatewayError as exc:
        print(f"error: {exc}" + (f" ({exc.remedy})" if exc.remedy else ""), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    # Run from the importable module, not this `__main__` copy, so that there is one set of
    # classes (pydantic resolves annotations by module name).
    from releasekit.deploy.gateway import main as _main

    sys.exit(_main())
