"""Typed, layered settings: flags > RELEASEKIT_* environment > releasekit.toml > defaults."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from releasekit.errors import ConfigError

CONFIG_FILE = "releasekit.toml"


def find_root(start: Path | None = None) -> Path:
    """Return the project root: the nearest folder upwards holding releasekit.toml or .git."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / CONFIG_FILE).is_file() or (folder / ".git").exists():
            return folder
    return here


class SmokeConfig(BaseModel):
    """The smoke suite a release must pass before and right after it gets traffic: a few
    items of a JSONL suite (`path`, or the release manifest's suite named `suite`), sent as
    templated chat requests (`vars` fill the release's prompt); `expected`, when an item has
    it, must appear in the answer for `min_pass_rate` of the items."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: Path | None = Field(None, description="JSONL suite file (relative to the root)")
    suite: str | None = Field("core", description="else: the manifest's suite of this name")
    max_items: int = Field(8, ge=1, le=1000)
    max_tokens: int = Field(32, ge=1, le=4096)
    min_pass_rate: float = Field(0.5, ge=0, le=1)
    timeout_s: float = Field(60.0, gt=0)


class RayAutoscaling(BaseModel):
    """Ray Serve's autoscaling of a release's replicas on requests in flight (running and
    waiting) per replica, between `min_replicas` and `max_replicas`. The per-replica target
    is exactly one of:

    - `target = "knee"`: derived from the release's own load test, the requests in flight
      at its knee (the highest load whose SLOs held) times (1 - `knee_headroom`); a release
      without usable knee evidence is refused (releasekit.deploy.ray.autoscale);
    - `target_queue_depth`: a number set by hand.

    The scale-up and scale-down delays (and Ray's look-back window) are the environment's,
    read from releasekit.toml as committed (a policy field), never from a release."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_replicas: int = Field(1, ge=1)
    max_replicas: int = Field(ge=1)
    target: Literal["knee"] | None = Field(
        None, description='"knee": the per-replica target comes from the release\'s knee'
    )
    knee_headroom: float | None = Field(
        None,
        ge=0,
        lt=1,
        allow_inf_nan=False,
        description="with target = knee: the share of the knee kept spare (0.25: scale at "
        "75% of the knee's requests in flight)",
    )
    knee_cores: Literal["match", "scale"] = Field(
        "match",
        description='with target = knee: "match" refuses a knee measured on another core '
        'count than cpus_per_replica (it runs max_replicas on a rollback); "scale" scales it '
        "in proportion (knee x replica CPUs / the bench host's cores), stated in the plan",
    )
    target_queue_depth: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="requests in flight per replica, by hand"
    )
    upscale_delay_s: float = Field(
        30.0, ge=0, allow_inf_nan=False, description="load above target this long adds replicas"
    )
    downscale_delay_s: float = Field(
        600.0, ge=0, allow_inf_nan=False, description="load below target this long removes them"
    )
    look_back_period_s: float = Field(
        30.0, gt=0, allow_inf_nan=False, description="Ray averages the load over this window"
    )
    metrics_interval_s: float = Field(
        10.0, gt=0, allow_inf_nan=False, description="how often Ray reports the load"
    )

    @model_validator(mode="after")
    def _order(self) -> RayAutoscaling:
        if self.max_replicas < self.min_replicas:
            raise ValueError("max_replicas must be at least min_replicas")
        if (self.target is None) == (self.target_queue_depth is None):
            raise ValueError(
                'give exactly one of target = "knee" (with knee_headroom) and '
                "target_queue_depth (requests in flight per replica, by hand)"
            )
        if self.target == "knee" and self.knee_headroom is None:
            raise ValueError(
                'target = "knee" needs knee_headroom, the share of the knee kept spare (e.g. 0.25)'
            )
        if self.target is None and self.knee_headroom is not None:
            raise ValueError('knee_headroom applies only with target = "knee"')
        return self


class RayTargetConfig(BaseModel):
    """Where an environment's `ray` target runs (`[environments.NAME.ray]`): the Ray cluster
    and the shape of every release's Ray Serve application there."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    address: str = Field(
        pattern=r"^[A-Za-z0-9_.-]+:[0-9]{1,5}$", description="the cluster's GCS address HOST:PORT"
    )
    node_ip: str | None = Field(
        None,
        description="this host's address inside the cluster (Ray's node IP); default: the "
        "address's host when it is a loopback one, else Ray's own guess",
    )
    serve_host: str | None = Field(
        None, description="where Serve's HTTP proxy listens (on the head); default: address host"
    )
    serve_port: int = Field(8000, ge=1, le=65535, description="Serve's HTTP proxy port")
    replicas: int = Field(1, ge=1, le=1024, description="replicas per release (one vLLM each)")
    cpus_per_replica: float = Field(1.0, gt=0, description="Ray CPUs one replica reserves")
    memory_gb_per_replica: float | None = Field(None, gt=0, description="Ray memory reserved")
    max_replicas_per_node: int | None = Field(None, ge=1, description="spread cap per node")
    autoscaling: RayAutoscaling | None = None
    health_check_period_s: float = Field(2.0, gt=0)
    health_check_timeout_s: float = Field(10.0, gt=0)
    connect_timeout_s: float = Field(10.0, gt=0, description="to reach the cluster")

    @property
    def host(self) -> str:
        """The address's host part."""
        return self.address.rsplit(":", 1)[0]


DEFAULT_MAX_MARGIN = 0.10
"""The ceiling on a suite's non-inferiority margin where the environment names none."""
DEFAULT_MAX_PERF_TOLERANCE: dict[str, float] = {"ttft_p95_s": 0.5, "goodput": 0.25, "*": 0.5}
"""Ceilings on the perf tolerances at the knee where the environment names none."""
HIGHER_BETTER_PERF: tuple[str, ...] = (
    "goodput",
    "output_token_throughput",
    "request_throughput",
    "load",
)
"""The bench.knee metrics where higher is better (a throughput): the perf gates pass a
candidate at or above live x (1 - tolerance)."""
MAX_HIGHER_BETTER_TOLERANCE = 0.5
"""A higher-is-better metric's tolerance ceiling stays below this: at 0.5, a candidate with
half of live's goodput would pass (live x (1 - 0.5))."""
DEFAULT_HIGHER_BETTER_TOLERANCE = 0.25
"""The ceiling of a higher-is-better metric the environment names no usable ceiling for
(its "*" is 0.5 or more, the bound latencies may use)."""
DEFAULT_MAX_PERF_SPREAD = 0.25
"""How far the live release's run-to-run spread may widen a perf tolerance by default."""
DEFAULT_MAX_CANARY_TOLERANCE: dict[str, float] = {"*": 1.0}
"""Ceilings on a canary check's relative tolerance where the environment names none."""
DEFAULT_MAX_CANARY_SLACK: dict[str, float] = {
    "ttft_p95_s": 0.5,
    "tpot_p95_s": 0.05,
    "error_rate": 0.05,
    "negative_feedback_rate": 0.1,
}
"""Ceilings on a canary check's absolute slack (seconds, or a rate) where the environment
names none."""
DEFAULT_MAX_CANARY_CONFIDENCE = 0.99
"""The highest confidence a canary check may ask before it breaches, by default."""
DEFAULT_MAX_CANARY_SUSTAIN = 5
"""The most breaching judgements in a row a canary may wait for before aborting, by default."""


class WatchRule(BaseModel):
    """A watch rule: a live metric, a limit, and how long a breach must last. `kind:
    absolute` (the default) breaches above `max`; `kind: relative` breaches above `factor`
    times the release's own load-test figure at a similar request rate."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    metric: str = Field(description="e.g. ttft_p95_s, e2e_p95_s, error_rate, preemptions_per_s")
    kind: Literal["absolute", "relative"] = "absolute"
    max: float | None = Field(None, description="absolute: breach when the figure is above this")
    factor: float | None = Field(
        None, gt=0, description="relative: breach above factor x the release's benchmark figure"
    )
    window_s: float = Field(30.0, gt=0)
    sustain: int = Field(3, ge=1, description="consecutive breached windows before rollback")
    min_requests: int | None = Field(
        None, ge=0, description="fewest requests behind a window to judge it; default 20"
    )

    @model_validator(mode="after")
    def _limit_for_kind(self) -> WatchRule:
        if self.kind == "absolute" and (self.max is None or self.factor is not None):
            raise ValueError("an absolute watch rule takes `max` (and no `factor`)")
        if self.kind == "relative" and (self.factor is None or self.max is not None):
            raise ValueError("a relative watch rule takes `factor` (and no `max`)")
        return self


POLICY_FIELDS: tuple[str, ...] = (
    "gates_required",
    "requires",
    "requires_approval",
    "perf_by_canary",
    "smoke",
    "min_pass_rate",
    "max_margin",
    "max_perf_tolerance",
    "max_perf_spread",
    "approvers",
    "shadow_max_age_s",
    "shadow_min_agreement",
    "shadow_min_pairs",
    "shadow_keep_prompts",
    "after_promotion_compare_s",
    "after_promotion_share",
    "comparison_baseline",
    "canary_compare_answers",
    "autoscaling",
    "max_canary_tolerance",
    "max_canary_slack",
    "max_canary_confidence",
    "max_canary_sustain",
    "watch_floor",
)
"""The fields of `[environments.NAME]` that decide what may go live there: read from a
committed revision of releasekit.toml (`releasekit.promote.policy`), recorded with every
promote and rollback, and never changed for one command. `autoscaling` is the `ray`
table's (`ray.autoscaling`: range, knee headroom, delays; see `EnvironmentConfig.policy`)."""


class EnvironmentConfig(BaseModel):
    """Where and how one environment runs (`[environments.NAME]` in releasekit.toml); the
    manifest's `environments` list says which environments a release may go to."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    target: Literal["local", "ray"] = Field("local", description="deploy target")
    host: str = Field("127.0.0.1", description="the gateway's (client-facing) address")
    port: int = Field(ge=1, le=65535, description="the gateway's port")
    gates_required: bool = True
    requires: str | None = Field(
        None, description="environment the release must have been live in first"
    )
    warm_s: float = Field(
        300.0,
        ge=0,
        description="how long the previous release stays warm (after a promotion with "
        "after_promotion_compare_s, at least that window plus drain_deadline_s)",
    )
    drain_deadline_s: float = Field(60.0, ge=0, description="wait for in-flight requests")
    smoke: SmokeConfig = SmokeConfig()
    api_keys: list[str] = Field(default_factory=list, repr=False, description="client keys")
    max_in_flight: int = Field(256, ge=1)
    max_queue_wait_s: float = Field(5.0, ge=0)
    rate_limit_rps: float = Field(
        50.0,
        ge=0,
        allow_inf_nan=False,
        description="requests per second per client at the gateway (per API key; per "
        "address without keys), in bursts of rate_limit_burst; more get 429 (0: no limit)",
    )
    rate_limit_burst: int = Field(100, ge=1, description="the rate limit's bucket size")
    max_in_flight_per_key: int = Field(
        32,
        ge=0,
        description="requests one client may have admitted or queued at the gateway at "
        "once, so one key cannot take every slot and fill the queue; more get 429 (0: no cap)",
    )
    release_header: bool = Field(
        False,
        description="answer clients with x-releasekit-release (which release served them); "
        "off, a client cannot tell a canary's answers from stable's",
    )
    requires_approval: bool = Field(
        False, description="a release needs `releasekit approve` for this environment first"
    )
    approval_wait_s: float = Field(
        0.0, ge=0, description="how long promote waits for a missing approval (0: refuse)"
    )
    approvers: list[str] = Field(
        default_factory=list,
        description="who may approve a release for this environment: key ids (or "
        "keys/<key id>.pub) of public keys committed under keys/ at the trust commit; an "
        "approval counts only when signed with one of them, and not with the promoter's key",
    )
    canary_lease_s: float = Field(
        10.0,
        gt=0,
        description="a canary weight the promoting process stops renewing reverts to the "
        "stable release at the gateway after this long",
    )
    perf_by_canary: bool = Field(
        False,
        description="a release promoted here with canary steps has its offline performance "
        "gates shown as advisory: its canary judges performance on live traffic against the "
        "stable release and aborts it on a breach (quality, evidence, policy and approval "
        "gates still block; without canary steps, or with --no-canary, perf gates block)",
    )
    shadow_max_in_flight: int = Field(
        4, ge=1, description="mirrored requests in flight at most (more are dropped)"
    )
    shadow_max_age_s: float = Field(
        3600.0,
        gt=0,
        description="once a candidate was shadowed here, promote needs a passing shadow "
        "comparison against the current stable release at most this old",
    )
    shadow_min_agreement: float = Field(
        0.9,
        ge=0,
        le=1,
        description="a shadow comparison fails when the candidate's answers agree with the "
        "stable release's on the same mirrored requests less often than this (judged on the "
        "95% interval's upper bound: only evidence of lower agreement fails it)",
    )
    shadow_min_pairs: int = Field(
        30,
        ge=1,
        description="answer pairs a shadow comparison needs at least; fewer fail it as not "
        "enough pairs",
    )
    shadow_keep_prompts: bool = Field(
        False,
        description="the gateway keeps the prompt text of mirrored requests with their "
        "answer pairs (otherwise only a sha256 digest of the request body)",
    )
    after_promotion_compare_s: float = Field(
        0.0,
        ge=0,
        le=7 * 86400,
        allow_inf_nan=False,
        description="after a promotion, for this many seconds the gateway mirrors "
        "after_promotion_share of the live requests to the previous release (kept warm at "
        "least as long) and `watch` judges the answer pairs with shadow_min_agreement and "
        "shadow_min_pairs, rolling back on a breach (0: off)",
    )
    comparison_baseline: Literal["live", "fresh"] | None = Field(
        None,
        description="what every canary and shadow here is judged against, whatever the "
        "candidate's manifest says: `fresh`, a new server of the live release started with "
        "the candidate, warmed and placed like it; `live`, the servers serving now; unset: "
        "the manifest's promotion.canary.baseline (else `live`)",
    )
    mirror_pairs_keep_days: float = Field(
        7.0,
        gt=0,
        allow_inf_nan=False,
        description="stored answer pairs of a release no longer mirrored are deleted this "
        "many days after their last write (when a shadow starts or stops)",
    )
    after_promotion_share: float = Field(
        0.2,
        gt=0,
        le=1,
        allow_inf_nan=False,
        description="share of the live requests mirrored to the previous release during "
        "the after-promotion comparison",
    )
    canary_compare_answers: bool = Field(
        False,
        description="during a canary the gateway copies each request the canary answers to "
        "the live release's server (at most shadow_max_in_flight copies at once, their "
        "figures under their own label) and every step also judges the pairs' agreement "
        "with shadow_min_agreement and shadow_min_pairs: a step passes only once the "
        "agreement passes, and agreement below the floor aborts the canary (off: canaries "
        "judge live figures only)",
    )
    min_pass_rate: dict[str, float] = Field(
        default_factory=dict,
        description="quality floors on a first promotion (nothing live to compare with): "
        'suite name -> lowest pass rate, "*" for every other suite; a manifest\'s '
        "`min_pass_rate` may only raise a floor",
    )
    max_margin: dict[str, float] = Field(
        default_factory=dict,
        description="ceilings on the non-inferiority margins the manifest's suites set: suite "
        f'name -> largest margin, "*" for every other suite (default {DEFAULT_MAX_MARGIN:g}); '
        "a larger margin is clamped to the ceiling",
    )
    max_perf_tolerance: dict[str, float] = Field(
        default_factory=dict,
        description="ceilings on the perf tolerances the manifest sets at the knee: "
        'bench.knee metric -> largest tolerance, "*" for the rest (defaults: '
        + ", ".join(f"{k} {v:g}" for k, v in DEFAULT_MAX_PERF_TOLERANCE.items())
        + "); a wider tolerance is clamped to the ceiling",
    )
    max_perf_spread: float = Field(
        DEFAULT_MAX_PERF_SPREAD,
        ge=0,
        lt=0.5,
        description="the perf gates widen their tolerance to the live release's run-to-run "
        "spread at its knee ((max - min) / median) up to this much; a spread above it on "
        "either release fails as an evidence gate (too noisy to judge). Below 0.5: "
        "widened to s, goodput must stay above live x (1 - s), so a halved goodput always "
        "fails (and a doubled TTFT, above live x (1 + s))",
    )
    max_canary_tolerance: dict[str, float] = Field(
        default_factory=dict,
        description="ceilings on the relative tolerance of the candidate manifest's canary "
        'checks (also used by its shadow comparisons): metric -> largest, "*" for the rest '
        "(default "
        + ", ".join(f"{k} {v:g}" for k, v in DEFAULT_MAX_CANARY_TOLERANCE.items())
        + "); a wider one is clamped to the ceiling and reported",
    )
    max_canary_slack: dict[str, float] = Field(
        default_factory=dict,
        description="ceilings on the absolute slack of the candidate manifest's canary checks: "
        'metric -> largest, "*" for the rest (defaults: '
        + ", ".join(f"{k} {v:g}" for k, v in DEFAULT_MAX_CANARY_SLACK.items())
        + "); a wider one is clamped to the ceiling and reported",
    )
    max_canary_confidence: float = Field(
        DEFAULT_MAX_CANARY_CONFIDENCE,
        gt=0.5,
        lt=1,
        description="the highest `confidence` a canary check may ask for before a figure "
        "above its limit breaches (higher: harder to breach); a higher one is clamped",
    )
    max_canary_sustain: int = Field(
        DEFAULT_MAX_CANARY_SUSTAIN,
        ge=1,
        description="the most breaching judgements in a row a canary's `sustain` may wait "
        "for before aborting; a longer one is clamped",
    )
    watch_floor: list[WatchRule] = Field(
        default_factory=list,
        description="watch rules every release live here is watched with at least: the "
        "release's own `watch:` may tighten one (lower max or factor, fewer windows, a "
        "shorter window, fewer min_requests) but not drop or loosen it; a looser one is "
        "clamped to the floor and reported",
    )
    ray: RayTargetConfig | None = Field(None, description="the `ray` target's cluster")

    @field_validator("max_canary_tolerance", "max_canary_slack")
    @classmethod
    def _not_negative(cls, v: dict[str, float]) -> dict[str, float]:
        bad = sorted(k for k, x in v.items() if not x >= 0)
        if bad:
            raise ValueError(f"values must be 0 or more (not {', '.join(bad)})")
        return v

    @field_validator("min_pass_rate", "max_margin", "max_perf_tolerance")
    @classmethod
    def _fractions(cls, v: dict[str, float]) -> dict[str, float]:
        bad = sorted(k for k, x in v.items() if not 0 <= x <= 1)
        if bad:
            raise ValueError(f"values must be between 0 and 1 (not {', '.join(bad)})")
        return v

    @field_validator("max_perf_tolerance")
    @classmethod
    def _throughput_below_half(cls, v: dict[str, float]) -> dict[str, float]:
        bad = sorted(
            f"{k} = {x:g}"
            for k, x in v.items()
            if k in HIGHER_BETTER_PERF and x >= MAX_HIGHER_BETTER_TOLERANCE
        )
        if bad:
            raise ValueError(
                f"{', '.join(bad)}: a higher-is-better metric's tolerance must be below "
                f"{MAX_HIGHER_BETTER_TOLERANCE:g} (the gate passes a candidate at live x "
                "(1 - tolerance), so at 0.5 a release whose goodput halves would pass); "
                f"e.g. goodput = {DEFAULT_HIGHER_BETTER_TOLERANCE:g}"
            )
        return v

    @model_validator(mode="after")
    def _target_settings(self) -> EnvironmentConfig:
        if self.target == "ray" and self.ray is None:
            raise ValueError('target "ray" needs a [environments.NAME.ray] table with address')
        return self

    def floor_for(self, suite: str) -> float | None:
        """The environment's lowest pass rate for `suite` on a first promotion (None: none)."""
        return self.min_pass_rate.get(suite, self.min_pass_rate.get("*"))

    def margin_ceiling(self, suite: str) -> float:
        """The largest non-inferiority margin `suite` may be judged with here."""
        return self.max_margin.get(suite, self.max_margin.get("*", DEFAULT_MAX_MARGIN))

    def tolerance_ceiling(self, metric: str) -> float:
        """The largest relative tolerance a `bench.knee.<metric>` gate may have here.

        A higher-is-better metric (HIGHER_BETTER_PERF) never gets 0.5 or more: its own
        entry is refused there (validator), and a "*" of 0.5 or more (a bound meant for
        latencies) gives it DEFAULT_HIGHER_BETTER_TOLERANCE instead."""
        default = DEFAULT_MAX_PERF_TOLERANCE.get(metric, DEFAULT_MAX_PERF_TOLERANCE["*"])
        got = self.max_perf_tolerance.get(metric, self.max_perf_tolerance.get("*", default))
        if metric in HIGHER_BETTER_PERF and got >= MAX_HIGHER_BETTER_TOLERANCE:
            return min(default, DEFAULT_HIGHER_BETTER_TOLERANCE)
        return got

    def canary_tolerance_ceiling(self, metric: str) -> float:
        """The largest relative tolerance a canary check of `metric` may have here."""
        default = DEFAULT_MAX_CANARY_TOLERANCE.get(metric, DEFAULT_MAX_CANARY_TOLERANCE["*"])
        return self.max_canary_tolerance.get(metric, self.max_canary_tolerance.get("*", default))

    def canary_slack_ceiling(self, metric: str) -> float:
        """The largest absolute slack a canary check of `metric` may have here."""
        default = DEFAULT_MAX_CANARY_SLACK.get(metric, 0.0)
        return self.max_canary_slack.get(metric, self.max_canary_slack.get("*", default))

    def policy(self) -> dict[str, Any]:
        """The environment's policy fields (`POLICY_FIELDS`) as JSON-ready values: what a
        promotion or rollback here is decided by, and what the ledger records."""
        out = self.model_dump(mode="json", include=set(POLICY_FIELDS))
        auto = self.ray.autoscaling if self.ray is not None else None
        out["autoscaling"] = auto.model_dump(mode="json") if auto is not None else None
        return out

    @property
    def url(self) -> str:
        """http://host:port of the environment's gateway."""
        return f"http://{self.host}:{self.port}"


class WebhookConfig(BaseModel):
    """One outbound webhook (`[[webhooks]]`): events are POSTed as JSON (or a Slack-compatible
    `{"text": ...}` body), retried, and written to the dead-letter log when they never land."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = Field(pattern=r"^https?://", description="where events are POSTed")
    format: Literal["json", "slack"] = "json"
    events: list[str] = Field(
        default_factory=list,
        description="event types to send (ledger types: promote, gate_failed, canary_step, "
        "canary_aborted, rollback, ...); empty: all",
    )
    environments: list[str] = Field(default_factory=list, description="empty: all")
    headers: dict[str, str] = Field(default_factory=dict, repr=False)
    timeout_s: float = Field(5.0, gt=0)
    retries: int = Field(3, ge=0, le=20)
    backoff_s: float = Field(0.5, ge=0)

    @field_validator("url")
    @classmethod
    def _safe_url(cls, v: str) -> str:
        """A webhook URL is a credential (a Slack URL is its own secret): https unless the
        listener is on loopback, and no user:password in it. Messages name only scheme and
        host."""
        import ipaddress
        from urllib.parse import urlsplit

        parts = urlsplit(v)
        host = parts.hostname or ""
        shown = f"{parts.scheme}://{host}"
        if parts.username is not None or parts.password is not None:
            raise ValueError(f"webhook {shown}: the URL must not carry user:password")
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = host == "localhost"
        if parts.scheme != "https" and not loopback:
            raise ValueError(f"webhook {shown}: a URL off this host's loopback must be https")
        return v


class TrustSettings(BaseModel):
    """`[trust]`: where the protected ref is named when the branch tracks no remote branch.
    Read only from releasekit.toml as committed at HEAD (`releasekit.stores.trust`); the
    copy here (the file on disk, RELEASEKIT_CONFIG, a variable) is accepted and never used."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    protected_revision: str | None = Field(
        None,
        description="a remote-tracking branch (origin/main) or tag (refs/tags/NAME) whose "
        "history policy, keys and approvers must come from, where the branch has no upstream",
    )


class Settings(BaseSettings):
    """Every setting releasekit reads. Paths that are relative resolve against `root`."""

    model_config = SettingsConfigDict(
        env_prefix="RELEASEKIT_", extra="forbid", validate_default=True
    )

    root: Path = Field(default_factory=find_root, description="project (git) root")
    state_dir: Path = Field(Path(".releasekit"), description="local state: stores, logs")
    results_dir: Path = Field(Path("results"), description="build outputs, one folder a release")
    mlflow_tracking_uri: str | None = Field(
        None, description="MLflow tracking URI; default: SQLite store under state_dir"
    )
    ledger_url: str | None = Field(
        None, description="SQLAlchemy URL of the event ledger; default: SQLite under state_dir"
    )
    actor: str | None = Field(None, description="who acts; default: git user.name <user.email>")
    python: Path = Field(Path(sys.executable), description="interpreter that runs vLLM")
    server_host: str = "127.0.0.1"
    server_start_timeout_s: float = Field(300.0, gt=0)
    server_stop_grace_s: float = Field(10.0, gt=0)
    server_preload: bool = Field(
        False,
        description="start vLLM's CPU build with tcmalloc and Intel OpenMP preloaded (its CPU "
        "guide's advice) when the host has them; off by default: on the demo's 2-core host "
        "it did not help (benchmarks/results/bench_vs_vllm*.json)",
    )
    server_start_nice: int | None = Field(
        -10,
        ge=-20,
        le=19,
        description="scheduler autogroup nice of a deployed server until it is healthy, so a "
        "candidate warms up beside a busy live release (None: leave it; negative needs root)",
    )
    canary_judge_nice: int | None = Field(
        -5,
        ge=-20,
        le=19,
        description="scheduler autogroup nice given to BOTH the canary's and the stable "
        "release's own servers while canary steps are judged, the same for both and reset "
        "after, so that neither is judged with more CPU than the other beside the gateway "
        "and clients (None: leave both)",
    )
    canary_judge_spread: bool = Field(
        True,
        description="while canary steps are judged, let every thread of the canary's and the "
        "stable release's own servers run on every core (their workers are otherwise bound "
        "to one core each, and the one beside the gateway and clients is slower); each "
        "thread's binding is put back after",
    )
    gateway_nice: int | None = Field(
        -10,
        ge=-20,
        le=19,
        description="scheduler autogroup nice of an environment's gateway, which relays every "
        "stream and must not wait behind busy servers (None: leave it)",
    )
    scrape_timeout_s: float = Field(
        10.0,
        gt=0,
        description="seconds one /metrics scrape may take (diagnose, watch); a vLLM API "
        "server on a saturated CPU can take several seconds to answer",
    )
    signing_key: Path | None = Field(
        None, description="Ed25519 private key (PEM) that signs ledger records; never committed"
    )
    trusted_keys_rev: str | None = Field(
        None,
        description="refused when set: policy, trusted keys and approvers are read at the "
        "trust commit (releasekit.stores.trust), which no variable or config file chooses",
    )
    trust: TrustSettings = Field(
        default_factory=lambda: TrustSettings(),
        description="[trust]: read only from releasekit.toml as committed at HEAD",
    )
    mlflow_http_timeout_s: float | None = Field(
        None, gt=0, description="MLflow HTTP timeout (MLFLOW_HTTP_REQUEST_TIMEOUT wins); default 4"
    )
    mlflow_http_max_retries: int | None = Field(
        None, ge=0, description="MLflow HTTP retries (MLFLOW_HTTP_REQUEST_MAX_RETRIES wins); 1"
    )
    environments: dict[str, EnvironmentConfig] = Field(
        default_factory=dict, description="[environments.NAME]: deploy target and policy"
    )
    webhooks: list[WebhookConfig] = Field(
        default_factory=list, description="[[webhooks]]: outbound event notifications"
    )
    links_base_url: str | None = Field(
        None, description="prefix for links to gate reports in notifications (default: file path)"
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        toml = TomlConfigSettingsSource(settings_cls, toml_file=_toml_path())
        return (init_settings, env_settings, toml)

    @field_validator("trusted_keys_rev")
    @classmethod
    def _no_trust_override(cls, v: str | None) -> str | None:
        if v is not None:
            raise ValueError(
                "the trust revision is not a setting: policy, keys and approvers are read at "
                "HEAD when it is on the protected ref (the branch's upstream, or [trust] "
                "protected_revision committed at HEAD); unset it"
            )
        return v

    @model_validator(mode="after")
    def _resolve(self) -> Settings:
        self.root = self.root.resolve()
        self.state_dir = self._abs(self.state_dir)
        self.results_dir = self._abs(self.results_dir)
        if self.mlflow_tracking_uri is None:
            # MLflow's own convention wins over our default.
            self.mlflow_tracking_uri = os.environ.get("MLFLOW_TRACKING_URI") or (
                f"sqlite:///{self.state_dir / 'mlflow.db'}"
            )
        if self.ledger_url is None:
            self.ledger_url = f"sqlite:///{self.state_dir / 'ledger.db'}"
        return self

    def _abs(self, p: Path) -> Path:
        return p if p.is_absolute() else self.root / p

    @property
    def mlflow_artifact_root(self) -> Path:
        """Where the embedded MLflow store keeps artifacts."""
        return self.state_dir / "mlartifacts"

    def release_dir(self, release_id: str) -> Path:
        """Folder holding one release's build outputs."""
        return self.results_dir / release_id


def _toml_path() -> Path:
    explicit = os.environ.get("RELEASEKIT_CONFIG")
    if explicit:
        return Path(explicit)
    root = Path(os.environ["RELEASEKIT_ROOT"]) if "RELEASEKIT_ROOT" in os.environ else find_root()
    return root / CONFIG_FILE


def load_settings(**overrides: Any) -> Settings:
    """Build settings once (flags passed as overrides); translate validation errors."""
    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
        )
        raise ConfigError(f"invalid settings: {problems}") from exc
    except (OSError, ValueError) as exc:  # unreadable or malformed TOML
        raise ConfigError(f"cannot read {_toml_path()}: {exc}") from exc
