"""The deploy-target interface: run a release's server, check it, route an environment's
traffic to it, stop it. `local` (deploy/local.py) implements it on this host.

A target owns two things for an environment: release servers (one per serving config) and
the router that gives the environment one stable address. Promotion drives it as
blue/green: `start` the candidate next to the live server, `health` and `smoke` it (before
it has traffic, and again through the environment's router after the switch), `route` all
new traffic to it, `wait_drained` the old upstream, then `stop` it or keep it warm.

Mapping to Kubernetes (a target that implements this interface; not built here):

| interface                | local target                           | Kubernetes target            |
| ------------------------ | -------------------------------------- | ---------------------------- |
| `start(spec)`            | detached vLLM process on its own port  | a Deployment per release     |
|                          |                                        | (`<env>-<release short id>`) |
|                          |                                        | with the engine args as      |
|                          |                                        | container args, plus a       |
|                          |                                        | Service; waits for Ready     |
| `health(upstream)`       | GET /health and /v1/models             | readiness probe + /health    |
|                          |                                        | through the Service          |
| `smoke(upstream, probe)` | a private gateway in this process with | a port-forward (or a weight- |
|                          | only the candidate route               | 0 route with a header match) |
| `ensure_router(routes)`  | the env's gateway process              | a Gateway API HTTPRoute (or  |
|                          | (`releasekit.deploy.gateway`)          | the gateway as a Deployment) |
| `route(routes)`          | PUT /admin/routes (atomic)             | patch the HTTPRoute's        |
|                          |                                        | backendRefs weights          |
| `wait_drained(release)`  | POST /admin/drain                      | endpoints gone + preStop     |
|                          |                                        | sleep / terminationGrace     |
| `stop(upstream)`         | SIGTERM the process group, then KILL   | delete the Deployment        |
| `list()`                 | the state file, pruned of dead pids    | Deployments labelled with    |
|                          |                                        | the environment              |
| `stop_router()`          | SIGTERM the gateway                    | delete the HTTPRoute         |

Every method raises a subclass of `DeployError` (or the gateway's `GatewayError`) on
failure, except that an adapter the engine refuses is an `AdapterLoadError`; `start` never
leaves a process running when it raises.

A release with LoRA adapters (`ReleaseSpec.adapters`) has them loaded into its server at
run time (`load_adapters`: after `start`, or into a reused server whose serving key it
shares), and its route maps each adapter's client model name to the engine's name.
"""

from __future__ import annotations

import builtins
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

from pydantic import BaseModel, ConfigDict, Field

from releasekit.deploy.gateway import PromptTemplate, Route
from releasekit.deploy.state import ServerRecord
from releasekit.errors import ReleasekitError, ServerError


class DeployError(ReleasekitError):
    """Raised when a deploy target cannot do what was asked (start, route, stop)."""

    remedy = "read the message and the server or gateway log it names"


class ReleaseStartError(DeployError, ServerError):
    """Raised when a release's server fails to start or to become healthy; it never got
    traffic and nothing of it is left running. `log_tail` quotes its log."""

    remedy = "check the release's serving arguments and the server log; the old release serves"

    def __init__(self, message: str, *, log_tail: str = "", log_path: str | None = None) -> None:
        self.log_tail = log_tail
        self.log_path = log_path
        full = message + (f"\n--- last lines of the server log ---\n{log_tail}" if log_tail else "")
        super().__init__(full)


class KneeEvidence(BaseModel):
    """A release's knee as its verified load test measured it (bench.json made for this
    release, on its locked load profile): what `target = "knee"` autoscaling derives its
    per-replica target from."""

    model_config = ConfigDict(frozen=True)

    in_flight: float = Field(description="requests in flight on one server at the knee")
    load: float = Field(description="the knee's load (concurrency, or arrival rate in req/s)")
    mode: str = Field(description="concurrency (closed loop) or rate (open loop)")
    source: str = Field(description="the bench result it was read from")
    cores: int | None = Field(
        None, description="cores of the host it was measured on (None: not recorded)"
    )
    host: str | None = Field(None, description="that host, in words")


class ReleaseSpec(BaseModel):
    """What a target needs to run one release: its model, exact engine args, environment."""

    model_config = ConfigDict(frozen=True)

    release_id: str
    name: str = Field(description="the manifest name")
    serving_key: str = Field(description="digest of model bytes + engine args + env")
    model_dir: str
    served_name: str
    engine_args: dict[str, str] = Field(description="canonical engine args (serving_args)")
    env: dict[str, str] = Field(default_factory=dict, description="the server's environment")
    api_key: str | None = Field(None, repr=False)
    prompts: dict[str, PromptTemplate] = Field(
        default_factory=dict, description="templates the gateway renders on the templated route"
    )
    knee: KneeEvidence | None = Field(None, description="its knee, from verified bench evidence")
    knee_problem: str | None = Field(None, description="why `knee` is None, in words")
    plain_chat_prompt: str | None = Field(
        None,
        description="the prompt plain chat requests go through (`prompts.plain_chat: "
        "template`, as locked); None: as the client sent them",
    )
    adapters: dict[str, str] = Field(
        default_factory=dict,
        description="its LoRA adapters: the model name clients ask for -> the name the engine "
        "holds it under (`name@digest12`)",
    )
    adapter_dirs: dict[str, str] = Field(
        default_factory=dict,
        description="engine name -> the verified folder the engine loads it from",
    )
    adapters_problem: str | None = Field(
        None,
        description="why its adapters could not be staged (files that differ from its lock): "
        "a deploy of it fails at stage `adapters` before anything starts",
    )


class Upstream(BaseModel):
    """A running release server (a handle the target gave back from `start`)."""

    release_id: str
    serving_key: str
    base_url: str
    model: str
    api_key: str | None = Field(None, repr=False)
    handle: dict[str, str | int | float | None] = Field(
        default_factory=dict, description="target-specific: pid, port, log (local)"
    )

    @classmethod
    def of_record(cls, rec: ServerRecord, handle: dict[str, str | int | float | None]) -> Upstream:
        """The handle of a server the deploy state recorded; `handle` is the target's own
        part (pid and log on `local`, the Serve application on `ray`)."""
        return cls(
            release_id=rec.release_id,
            serving_key=rec.serving_key,
            base_url=rec.base_url,
            model=rec.model,
            api_key=rec.api_key,
            handle=handle,
        )

    def route(self, spec: ReleaseSpec | None = None, *, weight: float = 1.0) -> Route:
        """The gateway route that sends traffic here, with `spec`'s templates (a release
        that shares this server but has other prompts brings its own spec)."""
        return Route(
            release_id=spec.release_id if spec else self.release_id,
            base_url=self.base_url,
            weight=weight,
            api_key=self.api_key,
            model=self.model,
            prompts=dict(spec.prompts) if spec else {},
            adapters=dict(spec.adapters) if spec else {},
            plain_chat_prompt=spec.plain_chat_prompt if spec else None,
        )


class SmokeItem(BaseModel):
    """One smoke request: variables for the release's prompt, and text the answer must hold."""

    id: str
    vars: dict[str, str] = Field(default_factory=dict)
    expected: str | None = None


class SmokeProbe(BaseModel):
    """A smoke suite ready to send: items, the prompt to render, the pass rule."""

    name: str = "smoke"
    prompt: str = Field("chat", description="the templated route's prompt name")
    items: list[SmokeItem]
    max_tokens: int = 32
    min_pass_rate: float = 0.5
    timeout_s: float = 60.0


class SmokeItemResult(BaseModel):
    """What one smoke request got."""

    id: str
    ok: bool = Field(description="HTTP 200 with a non-empty answer from the right release")
    passed: bool = Field(description="ok and, if the item expects text, the answer holds it")
    status: int | None = None
    release: str | None = Field(None, description="the release that answered (gateway header)")
    output: str | None = None
    error: str | None = None
    latency_s: float | None = None
    adapter: str | None = Field(
        None, description="the adapter (client model name) this request asked; None: the base"
    )


class SmokeResult(BaseModel):
    """A smoke run: it passes when every request answered and enough answers held their
    expected text."""

    where: str = Field(description="what was probed: 'preview' or 'gateway'")
    url: str
    release_id: str
    passed: bool
    n: int
    answered: int
    pass_rate: float | None
    min_pass_rate: float
    items: list[SmokeItemResult]
    problem: str | None = None


OnSpawn = Callable[[Upstream], None]
"""Called by `start` once the process exists (before it is healthy), to record it."""


class DeployTarget(ABC):
    """One environment's release servers and router on some infrastructure."""

    name: str = "abstract"

    @abstractmethod
    def start(self, spec: ReleaseSpec, *, on_spawn: OnSpawn | None = None) -> Upstream:
        """Start `spec`'s server and return once it is healthy and holds `spec`'s adapters.
        ReleaseStartError (and no process left) if it exits or is not healthy in time;
        AdapterLoadError (and no process left) if it refuses an adapter."""

    def load_adapters(self, upstream: Upstream, spec: ReleaseSpec) -> builtins.list[str]:
        """Make the running server `upstream` hold `spec`'s adapters (engine names), loading
        the ones it lacks; returns the names loaded now. AdapterLoadError when one cannot be
        loaded (nothing routed changes). Default: a target that carries no adapters refuses
        a spec that has some."""
        if spec.adapters:
            raise DeployError(f"the {self.name} target does not carry LoRA adapters")
        return []

    @abstractmethod
    def health(self, upstream: Upstream) -> bool:
        """True while the server answers /health and lists its model."""

    @abstractmethod
    def smoke(self, upstream: Upstream, spec: ReleaseSpec, probe: SmokeProbe) -> SmokeResult:
        """Run `probe` against `upstream` with `spec`'s templates, without giving it any of
        the environment's traffic."""

    @abstractmethod
    def stop(self, upstream: Upstream, *, grace_s: float = 10.0) -> None:
        """Stop the server (graceful, then forced after `grace_s`); idempotent."""

    @abstractmethod
    def list(self) -> list[Upstream]:
        """The release servers this target runs for the environment."""

    @abstractmethod
    def ensure_router(self, routes: Sequence[Route]) -> str:
        """Make sure the environment's router runs (with `routes` if it must be started);
        returns its client-facing URL."""

    @abstractmethod
    def route(self, routes: Sequence[Route]) -> str:
        """Replace the environment's routing table atomically; what it did besides, in words
        ("; ..." clauses, "" for nothing: e.g. adapters a switch back unloaded)."""

    @abstractmethod
    def wait_drained(self, release_id: str, *, deadline_s: float) -> bool:
        """True once nothing is in flight to `release_id` (False at the deadline)."""

    @abstractmethod
    def stop_router(self) -> None:
        """Stop the environment's router (in-flight requests get its grace period)."""

    def reconcile(self) -> builtins.list[str]:
        """Bring the recorded state in line with what runs (a crashed command's leftovers);
        returns what it did, in words. Default: nothing to do."""
        return []

    def after_change(self) -> None:
        """Called once a deploy has settled (e.g. to schedule the end of a warm period).
        Default: nothing."""
        return None
