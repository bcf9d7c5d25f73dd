"""The gateway's models: its config file, the route table, and what the admin API answers."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

import httpx
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

from releasekit.deploy.gateway.errors import GatewayConfigError
from releasekit.spec.prompts import placeholders

PROMPT_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


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
    adapters: dict[str, str] = Field(
        default_factory=dict,
        description="LoRA adapters: the model name a client asks for -> the name the engine "
        "holds it under (the request's `model` is rewritten to it)",
    )
    lane: str | None = Field(
        None,
        max_length=128,
        description="the adapter lane this route belongs to (an adapter's client name): the "
        "route serves only that lane's adapter names, never the base's model or a request "
        "without `model`, so a lane's releases come and go without touching the base's "
        "traffic; None: the environment's base lane",
    )
    plain_chat_prompt: str | None = Field(
        None,
        description="the prompt (a key of `prompts`) a plain chat request goes through: its "
        "last user message fills the user template's one placeholder, and the system "
        "template goes first when the client sends no system message (the release's "
        "`prompts.plain_chat: template`); None: plain requests go as the client sent them",
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
            if not PROMPT_NAME.match(name):
                raise ValueError(f"prompt name {name!r} must match [A-Za-z0-9_.-]{{1,128}}")
        return v

    @model_validator(mode="after")
    def _check_plain_chat(self) -> Route:
        name = self.plain_chat_prompt
        if name is None:
            return self
        tpl = self.prompts.get(name)
        if tpl is None:
            raise ValueError(f"plain_chat_prompt {name!r} is not one of the route's prompts")
        if len(placeholders(tpl.user)) != 1 or (tpl.system and placeholders(tpl.system)):
            raise ValueError(
                f"prompt {name!r} cannot take a plain chat request: its user template needs "
                "exactly one placeholder and its system template none"
            )
        return self

    @model_validator(mode="after")
    def _check_adapters(self) -> Route:
        for name, engine in self.adapters.items():
            if not name or not engine:
                raise ValueError("an adapter's model name and engine name must not be empty")
            if name == self.model:
                raise ValueError(f"adapter {name!r} has the base's model name")
        if self.lane is not None and set(self.adapters) != {self.lane}:
            raise ValueError(f"a route of lane {self.lane!r} carries that adapter and no other")
        return self


MirrorPurpose = Literal["shadow", "after_promotion", "canary"]

PAIR_SUFFIX = ":pair"


def pair_label(release_id: str) -> str:
    """The gateway's name for the copies a canary's answers are paired with, sent to the
    live release's server: a label of its own, so the copies' figures (requests by status,
    TTFT, E2E) never land in the live release's series the canary is judged against."""
    return release_id + PAIR_SUFFIX


def paired_release(label: str) -> str:
    """The release a pair label names (`pair_label`'s inverse)."""
    return label[: -len(PAIR_SUFFIX)] if label.endswith(PAIR_SUFFIX) else label


class Mirror(BaseModel):
    """Shadow traffic: a copy of `share` of the admitted requests goes to `route` (a
    candidate that takes no traffic); its answers reach no client (the latest `pairs` are
    kept beside the client's answers), it takes no rate-limit token and no in-flight slot,
    and at most `max_in_flight` copies run at once (more are dropped, never queued).

    `purpose` says why: a `shadow` candidate, the previous release after a promotion
    (`after_promotion`: the pairs' stable side is the new live release, the candidate side
    the release it replaced), or a `canary`: copies of the requests the routed release
    `source` (the canary) answers go to the live release's server, under the label
    `pair_label(<live release>)` (its figures its own), and each pair's candidate side is
    the canary's answer (what the client got), its stable side the copy's. With `floor`
    (the default), each copy taken also sends an A/A copy to the reference release at the
    same moment (a shadow's: its `baseline`, else the client's release under
    `pair_label(<live release>)`; the other purposes': `route` again), whose answer goes into
    the pair as its floor: the reference's disagreement with itself. Past `until`
    (unix time) the gateway copies nothing more by itself, so a mirror nobody removed never
    outlives the server it copies to."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    route: Route
    share: float = Field(gt=0, le=1, allow_inf_nan=False)
    max_in_flight: int = Field(4, ge=1, le=10_000)
    pairs: int = Field(
        2000, ge=0, le=100_000, description="answer pairs kept (the latest; 0: none)"
    )
    keep_prompts: bool = Field(
        False, description="keep the prompt text with a pair (else a digest of the body)"
    )
    baseline: Route | None = Field(
        None,
        description="a fresh server of the stable release, under its own label, that gets "
        "the same copies as `route` at the same moment: the candidate is judged against it "
        "(both fresh, both copies), not against the long-running live server",
    )
    purpose: MirrorPurpose = Field(
        "shadow", description="a shadow, after a promotion, or a canary's answers"
    )
    source: str | None = Field(
        None,
        min_length=1,
        max_length=200,
        description="purpose canary: the routed release whose answered requests are copied "
        "(None: every routed request, the other purposes)",
    )
    until: float | None = Field(
        None, allow_inf_nan=False, description="unix time copying stops (None: no end)"
    )
    floor: bool = Field(
        True,
        description="send each copy's A/A (floor) copy to the reference release at the same "
        "moment and keep its answer in the pair (a shadow's baseline copy is its floor copy)",
    )
    pairs_segment_mib: float = Field(
        8.0,
        gt=0,
        le=1024,
        allow_inf_nan=False,
        description="with the gateway's pairs_dir: MiB of one segment of the pairs' disk "
        "copy (two are kept, the oldest dropped)",
    )

    @model_validator(mode="after")
    def _check_purpose(self) -> Mirror:
        if self.purpose != "canary":
            if self.source is not None:
                raise ValueError("only a canary's mirror has a source")
            return self
        if self.source is None:
            raise ValueError("a canary's mirror needs its source (the canary's release)")
        if self.baseline is not None:
            raise ValueError("a canary's mirror has no baseline")
        if not self.route.release_id.endswith(PAIR_SUFFIX) or self.route.release_id == PAIR_SUFFIX:
            raise ValueError(
                f"a canary's copies go under a label of their own: <live release>{PAIR_SUFFIX}"
            )
        if paired_release(self.route.release_id) == self.source:
            raise ValueError("a canary's copies go to another release than the canary")
        return self


class RouteTable(BaseModel):
    """The whole routing table (`PUT /admin/routes`): release ids unique, and at least one
    route with weight > 0 unless the table is empty.

    With `lease_s`, the table is leased: unless `POST /admin/lease` renews it within
    `lease_s`, the gateway swaps in `fallback` by itself (a canary whose controller died
    never keeps its weight). `mirror` copies a share of requests to a shadow candidate."""

    model_config = ConfigDict(extra="forbid")

    routes: list[Route] = Field(default_factory=list)
    lease_s: float | None = Field(None, gt=0, le=3600, allow_inf_nan=False)
    fallback: list[Route] = Field(default_factory=list)
    mirror: Mirror | None = None

    @model_validator(mode="after")
    def _check(self) -> RouteTable:
        for what, routes in (("routes", self.routes), ("fallback", self.fallback)):
            seen: set[str] = set()
            for r in routes:
                if r.release_id in seen:
                    raise ValueError(f"release {r.release_id!r} appears twice in {what}")
                seen.add(r.release_id)
            if routes and not any(r.weight > 0 for r in routes):
                raise ValueError(f"at least one route of {what} needs weight > 0")
        if self.lease_s is not None and not self.fallback:
            raise ValueError("a leased table needs a fallback to revert to")
        if self.fallback and self.lease_s is None:
            raise ValueError("a fallback needs lease_s (when to revert to it)")
        if self.mirror is not None and any(
            r.release_id == self.mirror.route.release_id for r in self.routes
        ):
            raise ValueError("the mirrored release must not also be routed")
        b = self.mirror.baseline if self.mirror is not None else None
        if b is not None and (
            b.release_id == self.mirror.route.release_id  # type: ignore[union-attr]
            or any(r.release_id == b.release_id for r in self.routes)
        ):
            raise ValueError("the mirror's baseline needs a label of its own")
        return self


class LeaseRenewal(BaseModel):
    """`POST /admin/lease`: keep the leased table of `generation` for another `lease_s`."""

    model_config = ConfigDict(extra="forbid")

    generation: int = Field(ge=0)


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
    max_in_flight_per_client: int | None = Field(
        None,
        ge=1,
        le=100_000,
        description="requests one client (key, or address without keys) may have admitted "
        "or queued at once; more get 429 (None: no cap)",
    )
    release_header: bool = Field(
        True,
        description="answer x-releasekit-release to every client (False: only to a request "
        "carrying the admin token in x-releasekit-admin, the deployer's smoke checks)",
    )
    feedback_limit: RateLimit = Field(
        default_factory=lambda: RateLimit(rps=1.0, burst=60),
        description="feedback posts per client: a bucket of `burst`, refilled at `rps`",
    )
    max_queue_wait_s: float = Field(5.0, ge=0, allow_inf_nan=False)
    request_timeout_s: float = Field(600.0, gt=0, allow_inf_nan=False)
    upstream_connect_timeout_s: float = Field(5.0, gt=0, allow_inf_nan=False)
    upstream_first_byte_timeout_s: float = Field(120.0, gt=0, allow_inf_nan=False)
    stream_idle_timeout_s: float = Field(60.0, gt=0, allow_inf_nan=False)
    max_request_bytes: int = Field(16 * 1024 * 1024, ge=1024, description="body, as it streams")
    max_header_bytes: int = Field(60 * 1024, ge=1024, description="request line and headers")
    max_header_count: int = Field(100, ge=8, le=10_000, description="headers in one request")
    header_timeout_s: float = Field(
        10.0, gt=0, allow_inf_nan=False, description="time to send the request headers"
    )
    max_json_depth: int = Field(64, ge=2, le=512, description="array/object nesting in bodies")
    auth_failure_limit: RateLimit = Field(
        default_factory=lambda: RateLimit(rps=1.0, burst=10),
        description="failed authentications per client address",
    )
    feedback_capacity: int = Field(100_000, ge=1)
    shutdown_timeout_s: float = Field(30.0, ge=0, description="uvicorn graceful shutdown")
    ready_file: str | None = Field(None, description="where to write GatewayEndpoint when up")
    log_level: Literal["debug", "info", "warning", "error"] = "warning"
    routes: list[Route] = Field(default_factory=list, description="the initial table")
    mirror: Mirror | None = Field(
        None, description="the initial mirror (a restarted gateway keeps mirroring)"
    )
    pairs_dir: str | None = Field(
        None,
        description="folder for the disk copy of the mirror's answer pairs (None: memory only)",
    )
    pairs_prune_s: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="with pairs_dir: age and size the stored pairs out this often, off the "
        "event loop (None: never while it runs)",
    )
    pairs_keep_s: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="stored pairs files of a release no longer mirrored, last written longer "
        "ago than this, are deleted at each prune (None: kept whatever their age)",
    )
    pairs_max_bytes: int | None = Field(
        None,
        ge=1,
        description="at each prune, the oldest stored pairs files are deleted until the folder "
        "is under this many bytes; never the file being written (None: no bound)",
    )

    @field_validator("api_keys")
    @classmethod
    def _check_keys(cls, v: list[str]) -> list[str]:
        if any(not k for k in v):
            raise ValueError("an API key is empty")
        return v

    @model_validator(mode="after")
    def _check_routes(self) -> GatewayConfig:
        RouteTable(routes=self.routes, mirror=self.mirror)
        return self


class RouteState(BaseModel):
    """A route as `GET /admin/state` shows it (no upstream key)."""

    release_id: str
    base_url: str
    weight: float
    share: float = Field(description="fraction of new traffic it gets")
    model: str | None = None
    prompts: list[str] = Field(default_factory=list)
    adapters: dict[str, str] = Field(
        default_factory=dict, description="adapter model name -> the engine's name for it"
    )
    lane: str | None = Field(None, description="the adapter lane it belongs to (None: base)")
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
    lease_left_s: float | None = Field(
        None, description="seconds before a leased table reverts to its fallback"
    )
    fallback: list[str] = Field(default_factory=list, description="releases of the fallback")
    lease_expiries: int = Field(0, description="leased tables that reverted by themselves")
    mirror: str | None = Field(None, description="release receiving shadow copies")
    mirror_share: float = 0.0
    mirrored: int = Field(0, description="shadow copies sent")
    mirror_dropped: int = Field(0, description="shadow copies dropped (mirror at its limit)")
    mirror_pairs: int = Field(
        0,
        description="the last answer pair's seq (pairs recorded; with pairs_dir the numbering "
        "goes on from the candidate's pairs on disk)",
    )
    mirror_pairs_kept: int = Field(0, description="answer pairs held now (the latest ones)")
    mirror_purpose: MirrorPurpose | None = Field(None, description="why the mirror copies")
    mirror_source: str | None = Field(
        None, description="a canary's mirror: the release whose answered requests are copied"
    )
    mirror_until: float | None = Field(None, description="unix time the mirror stops copying")
    mirror_pairs_stored: int = Field(
        0, description="answer pairs written to the disk copy by this gateway process"
    )
    mirror_pairs_store_failed: int = Field(
        0, description="answer pairs not written to the disk copy (write errors, writer behind)"
    )


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


class Feedback(BaseModel):
    """`POST /v1/feedback`: a score for a response the gateway served."""

    model_config = ConfigDict(extra="ignore")

    response_id: str = Field(min_length=1, max_length=256)
    score: StrictFloat | StrictInt | Literal["up", "down"]


def validation_problems(exc: ValidationError) -> list[str]:
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
        raise GatewayConfigError(p, validation_problems(exc)) from exc
