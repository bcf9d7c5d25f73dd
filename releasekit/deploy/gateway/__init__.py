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
gateway knows upstreams only: it never reads MLflow, the ledger or any store (it writes
only its ready file and, with `pairs_dir`, the mirror's answer pairs).

Endpoints (one port)
--------------------
- `GET /health`            200 while at least one route carries traffic, 503 otherwise. Open.
- `GET /metrics`           Prometheus text of the gateway's own registry. Open.
- `/v1/*`                  the OpenAI routes vLLM serves (`GET /v1/models`; `POST` to
                           `/v1/completions`, `/v1/chat/completions`, `/v1/embeddings`,
                           `/v1/responses`, `/v1/score`, `/v1/rerank`) proxied to the pinned
                           route's upstream, `base_url + path + query`, body and status
                           untouched, hop-by-hop headers dropped; SSE relayed chunk by chunk as
                           the upstream sends it. With `release_header` (the default of a
                           bare config; a deployed environment opts in) every proxied
                           response carries `x-releasekit-release: <release id>`; without
                           it only a request carrying the admin token in
                           `x-releasekit-admin` (the deployer's smoke checks) sees it, and
                           that header never reaches an upstream. Any other path (vLLM's admin
                           and dev routes included), a path spelled with escapes, dot segments
                           or doubled slashes, gets 404; another method 405. Neither reaches
                           an upstream.
- `POST /v1/templates/{prompt}/chat/completions`
                           the templated route (below).
- `POST /v1/feedback`      `{"response_id": "...", "score": -1..1 | "up" | "down"}` (below).
- `/admin/*`               the admin API, guarded by `admin_token` (never by a client key):
  - `GET  /admin/state`    `GatewayState`: routes, in-flight and served counts per release.
  - `PUT  /admin/routes`   body `RouteTable`; swaps the table atomically, answers the new
                           `GatewayState`; 422 lists each `field: problem`.
  - `POST /admin/lease`    body `LeaseRenewal`; renews a leased table (`RouteTable.lease_s`):
                           without a renewal in time the gateway swaps in the table's
                           `fallback` by itself; 409 once that table is gone.
  - `POST /admin/drain`    body `DrainRequest`; waits (up to `timeout_s`) until the release
                           has no request in flight, answers `DrainResult`; 409 if the release
                           still carries traffic (switch first).

Routing
-------
The table is a list of `Route`s swapped by one reference assignment. A request is pinned to
a route when it is admitted and stays there until its last byte, whatever the table does
meanwhile: after a switch, the old release's in-flight count only falls, and a deployer waits
for 0 (`GatewayClient.wait_drained`) before stopping that server. Weights split traffic
at random in proportion (the OS's random source: a 9:1 canary gets about 1 request in 10,
and a client cannot count along a fixed sequence to aim at it). Weight 0
keeps a route in the table (its templates listed) without traffic.

Shadow traffic: a table's `mirror` copies exactly `share` of admitted requests to a
candidate that is not routed (`mirror`); its answers reach no client (each is kept only
beside the client's answer as an answer pair, `GET /admin/mirror/pairs`), copies take no
rate-limit token and no in-flight slot, and past `max_in_flight` copies are dropped. A
templated copy is rendered from its own deep copy of the request: the client's request is
never changed, and a copy that cannot be sent is dropped, never the client's request. The
candidate's figures are counted in the per-release families under its own release id. With
`pairs_dir` each pair is also appended to a bounded disk copy (`pairstore`: two segments of
at most `Mirror.pairs_segment_mib`, written off the event loop; a write error is counted,
never the client's), which outlives a restart of the gateway. A canary's mirror
(`purpose` canary) copies only the requests its `source` (the routed canary) answers, to
the live release's server under `pair_label(<live release>)`: the canary's answers paired
with the live release's, and the copies' figures never in the series the canary is judged
against. With `Mirror.floor` (the default) each copy taken also sends an A/A copy to the
reference release at the same moment (all of a request's copies or none), whose answer is
the pair's `floor`: a shadow's to its baseline or, without one, to the client's release
under its pair label; a canary's and an after-promotion mirror's a second copy to its
route. A pair names its client by a digest only (`client`). With `pairs_prune_s` the
gateway ages (`pairs_keep_s`) and bounds (`pairs_max_bytes`) the stored pairs on a
schedule, off the event loop.

Client credentials: with `api_keys` set, `/v1/*` needs `Authorization: Bearer <key>`
(401 otherwise, OpenAI-style JSON). The upstream gets the route's own `api_key` when set;
otherwise the client's Authorization header is dropped when the gateway checks keys (it is
the gateway's key, not the upstream's) and passed through when it does not.

Limits before any request code runs (`limits`): the request line and headers at most
`max_header_bytes` (60 KiB, Envoy's default) and `max_header_count` headers (100; 431 and
the connection closed), sent within
`header_timeout_s` of the connection opening or of a keep-alive request's first byte (408).

Admission and limits, in order: auth (401; after `auth_failure_limit.burst` wrong keys from
one address, 429 without checking the key), per-key token bucket (`rate_limit`; 429 with
Retry-After; keyed by API key, or by client address without keys, an IPv6 client by its
/64), the path allowlist (404/405), the body (counted while it streams, chunked or not: 413
past `max_request_bytes`, and the connection closed), JSON nesting past `max_json_depth`
(400), the client's own cap (`max_in_flight_per_client`: its requests admitted or queued
at once; 429 past it, so one key can neither hold every slot nor fill the queue), then the
in-flight limit `max_in_flight` with a queue: a request waits up to `max_queue_wait_s` for
a slot, then gets 503 with Retry-After. Every path after admission
frees its slot exactly once, errors included. Upstream: connect timeout and first-byte
timeout (time to the upstream's response headers; for a non-stream request that includes
generation) give 504; a refused or broken connection gives 502. A client that disconnects
while the upstream works cancels the upstream request (its connection is closed, so vLLM
aborts), stream or not. Once streaming, a gap longer than `stream_idle_timeout_s` between
upstream chunks, or passing `request_timeout_s` in total, ends the stream with an SSE error
event `data: {"error": {...}}` (a non-SSE body is cut); a client that stops reading for
`stream_idle_timeout_s` (its socket full) is cut too, and its slot freed.

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
that sets `messages` itself. Plain `/v1/*` requests are never rewritten, except for `model`
(below).

Models and LoRA adapters
------------------------
A route's `adapters` maps the model names clients ask for to the names its engine holds the
adapters under (`name@digest12`: two versions of one adapter side by side in one engine).
A JSON body (plain, templated, or a mirror's copy) whose `model` is one of the chosen
route's adapters goes upstream with `model` set to the engine's name; any other body is
forwarded byte for byte. A request whose `model` only some routed releases serve (a canary
whose release adds an adapter the stable one lacks) goes to one of those, chosen by their
weights renormalised. When the route has `model` set, a request whose `model` is neither
it nor one of its adapters gets 404 `{"error": {"message": "The model `x` does not exist
...", "type": "NotFoundError", "code": 404}}` and reaches no upstream and no mirror (an
engine's own name, `demo-json@...`, included); a mirror copy whose target does not serve
the request's model is dropped. A rollback restores the previous adapters' mapping with its
table. When every routed release has `model` set, `GET /v1/models` is answered by the
gateway from the routes (OpenAI's list: each base's served name, then each adapter's client
name with `parent` the base; never an engine's name), not relayed to one upstream.

Feedback
--------
The gateway remembers the `id` of recent successful responses (the JSON body's `id`, or the
first SSE chunk's), mapped to the release that served them and the client it served (a
digest of its key, or its address without keys), in a bounded LRU (`feedback_capacity`).
`POST /v1/feedback` counts a score per release: > 0 positive, < 0 negative, 0 neutral
(`up` = 1, `down` = -1); only feedback from the client that got the response counts, and
only its first (a repeat answers `counted: false`), and at most `feedback_limit` posts per
client (a bucket: 60, then one a second; 429 past it). Unknown, evicted or another client's
id: 404 (the same answer, so ids reveal nothing); malformed: 400.

Metrics (own CollectorRegistry; `env` is the gateway's environment)
-------------------------------------------------------------------
- `releasekit_gateway_requests_total{env,release,route,status}` counter: pinned requests by
  endpoint (`completions`, `chat/completions`, `models`, `templates`, `other`, ...) and the
  HTTP status the client got (the upstream's, or 400/499/502/504 from the gateway), except
  `client_timeout` for a non-stream request that outlasted the first-byte timeout (the
  client got 504; its first byte comes after the whole generation it asked for, so it is
  the client's outcome, not a server timeout).
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
  (`timeout`, `upstream_error`, and the client's own: `client_disconnect`, `client_stalled`).
- `releasekit_gateway_rejections_total{env,reason}` counter: `auth`, `rate_limit`,
  `client_in_flight` (a client at its cap), `feedback_limit`, `unknown_model` (404),
  `queue_full`, `no_route`, `timeout` (504 and mid-stream), `client_timeout` (a non-stream
  504), `upstream_error` (502 and mid-stream), `bad_request` (404/405 paths, 413, 431,
  invalid or too deep JSON, template errors). Every label value comes from a fixed set, the
  route table or the upstream's status code: nothing a client sends becomes a label.
- `releasekit_gateway_feedback_total{env,release,score}` counter: `positive`, `negative`,
  `neutral`.
- `releasekit_gateway_info{env,release,weight}` gauge, 1 per live route (`weight` is the
  route's share of traffic, e.g. "0.9"); `releasekit_gateway_route_weight{env,release}` the
  same share as a value; `releasekit_gateway_routes_generation{env}` the table version;
  `releasekit_gateway_route_switches_total{env}` table swaps.
- `releasekit_gateway_lease_expiries_total{env}` leased tables that reverted by themselves;
  `releasekit_gateway_mirrored_total{env,release,outcome}` shadow copies `sent`/`dropped`.
- `process_cpu_seconds_total`, `process_resident_memory_bytes`, ... (prometheus_client's
  process collector, on Linux): the gateway process's own CPU time and memory.

Modules
-------
- `errors`     the error tree (GatewayError and its subclasses)
- `config`     the config file, the route table and the admin API's models
- `templates`  prompt templates rendered into chat messages
- `models`     a request's model checked against its route, adapters' names mapped,
               the model list answered from the routes
- `routing`    the routing table and its weighted cursor
- `limits`     per-key token buckets
- `metrics`    the gateway's own Prometheus metrics
- `responses`  OpenAI-style error and JSON answers
- `admission`  in-flight slots and their queue, each client's cap, per-release counts
- `relay`      one pinned request and the response that streams the upstream's answer
- `checks`     a client request's checks: key, rate, path allowlist, body, JSON
- `lease`      leased tables that revert to their fallback
- `pairs`      the mirror's answer pairs (the models the admin API and the disk share)
- `pairstore`  the bounded disk copy of the mirror's answer pairs
- `mirror`     shadow copies to a candidate
- `upstream`   the upstream connection pool, a pinned request sent and relayed
- `admin`      the admin API (it drives the gateway through `GatewayControl`)
- `feedback`   response ids and `POST /v1/feedback`
- `app`        the `Gateway`: route table, lease and mirror, request handling, the ASGI app
- `server`     socket, uvicorn, ready file, `ThreadedGateway`, the process entry point

Errors: `releasekit.deploy.gateway.errors` holds the tree (every one a GatewayError).
"""

from __future__ import annotations

from releasekit.deploy.gateway.app import Gateway
from releasekit.deploy.gateway.config import (
    DrainRequest,
    DrainResult,
    GatewayConfig,
    GatewayEndpoint,
    GatewayState,
    LeaseRenewal,
    Mirror,
    PromptTemplate,
    RateLimit,
    Route,
    RouteState,
    RouteTable,
    load_config,
    pair_label,
    paired_release,
)
from releasekit.deploy.gateway.errors import (
    GatewayAuthError,
    GatewayConfigError,
    GatewayError,
    GatewayRequestError,
    GatewayStartError,
    GatewayUnreachableError,
    PromptTemplateError,
)
from releasekit.deploy.gateway.metrics import (
    E2E_BUCKETS,
    OVERHEAD_BUCKETS,
    QUEUE_BUCKETS,
    TTFT_BUCKETS,
)
from releasekit.deploy.gateway.pairs import MirrorPair, MirrorPairs, client_digest
from releasekit.deploy.gateway.pairstore import (
    PairStore,
    mb_bytes,
    prune,
    prune_to_size,
    read_pairs,
    store_bytes,
    store_dir,
    store_problem,
)
from releasekit.deploy.gateway.relay import ADMIN_HEADER, RELEASE_HEADER
from releasekit.deploy.gateway.server import ThreadedGateway, bind_socket, main, running, serve
from releasekit.deploy.gateway.templates import render_prompt

__all__ = [
    "ADMIN_HEADER",
    "E2E_BUCKETS",
    "OVERHEAD_BUCKETS",
    "QUEUE_BUCKETS",
    "RELEASE_HEADER",
    "TTFT_BUCKETS",
    "DrainRequest",
    "DrainResult",
    "Gateway",
    "GatewayAuthError",
    "GatewayConfig",
    "GatewayConfigError",
    "GatewayEndpoint",
    "GatewayError",
    "GatewayRequestError",
    "GatewayStartError",
    "GatewayState",
    "GatewayUnreachableError",
    "LeaseRenewal",
    "Mirror",
    "MirrorPair",
    "MirrorPairs",
    "PairStore",
    "PromptTemplate",
    "PromptTemplateError",
    "RateLimit",
    "Route",
    "RouteState",
    "RouteTable",
    "ThreadedGateway",
    "bind_socket",
    "client_digest",
    "load_config",
    "main",
    "mb_bytes",
    "pair_label",
    "paired_release",
    "prune",
    "prune_to_size",
    "read_pairs",
    "render_prompt",
    "running",
    "serve",
    "store_bytes",
    "store_dir",
    "store_problem",
]
