"""An environment's settings and policy (`[environments.NAME]`): the smoke suite, the
ceilings a release's own bars are clamped to, the watch floor, and `EnvironmentConfig`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from releasekit.config.ray import RayTargetConfig


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


def _ceilings(description: str, defaults: dict[str, float]) -> Any:
    """A field of ceilings on what a manifest sets (metric -> largest, "*" for the rest),
    empty unless configured; `{defaults}` in `description` lists `defaults`."""
    listed = ", ".join(f"{k} {v:g}" for k, v in defaults.items())
    return Field(default_factory=dict, description=description.format(defaults=listed))


class AnswerJudgeConfig(BaseModel):
    """The pinned judge a `judge` answer comparison asks (any OpenAI-compatible endpoint):
    "same substance?", both orders, at temperature 0."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    endpoint: str = Field(description="base URL of the judge's OpenAI-compatible server")
    model: str = Field(description="the judge model's name on that server")
    prompt: Path | None = Field(
        None, description="prompt template (relative to the root); default: the built-in one"
    )
    api_key_env: str | None = Field(None, description="variable holding the judge's API key")
    timeout_s: float = Field(30.0, gt=0, le=600, allow_inf_nan=False)


AnswerCheckName = Literal["refusal", "json", "number"]


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


ANSWER_POLICY_FIELDS: tuple[str, ...] = (
    "answer_comparison",
    "max_excess_disagreement",
    "answer_max_client_share",
    "answer_min_pairs",
    "answer_checks",
    "answer_known_items",
    "answer_judge",
)
"""The policy fields every live answer comparison (shadow, canary, after promotion) is
judged by."""

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
    *ANSWER_POLICY_FIELDS,
    "after_promotion_looks",
    "after_promotion_sustain",
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
        4,
        ge=1,
        description="copies in flight at most (more are dropped, never queued); each mirrored "
        "request takes two: the judged release's copy and the reference's floor copy",
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
        description="the exact-agreement floor of answer comparisons recorded before "
        "max_excess_disagreement (kept to replay them; new comparisons do not read it)",
    )
    shadow_min_pairs: int = Field(
        30,
        ge=1,
        description="the pair minimum of answer comparisons recorded before answer_min_pairs "
        "(kept to replay them; new comparisons do not read it)",
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
        "least as long), a second copy of each to it again (its noise floor), and `watch` "
        "judges the answers with the environment's answer comparison at "
        "after_promotion_looks scheduled looks, rolling back on after_promotion_sustain "
        "breaching looks in a row (0: off)",
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
    mirror_pairs_max_mb: float = Field(
        256.0,
        gt=0,
        allow_inf_nan=False,
        description="the gateway's stored answer pairs of one environment are kept under this "
        "many MB (the oldest files go first); a shadow does not start when the store is full "
        "or cannot be written",
    )
    mirror_pairs_prune_s: float = Field(
        3600.0,
        gt=0,
        allow_inf_nan=False,
        description="the gateway ages out stored answer pairs (mirror_pairs_keep_days, "
        "mirror_pairs_max_mb) this often while it runs, besides when a shadow starts or stops",
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
        "figures under their own label), a second copy to it again (its noise floor), and "
        "every step also judges the answers with the environment's answer comparison: a "
        "step passes only once they pass, and a breach aborts the canary (off: canaries "
        "judge live figures only)",
    )
    answer_comparison: Literal["exact", "scorer", "judge"] = Field(
        "exact",
        description="how a shadow, a canary's answers and the after-promotion check compare "
        "two answers to the same request: `exact` (equal after normalisation), `scorer` (the "
        "known items of answer_known_items scored as their suites score them, else "
        "answer_checks), `judge` (answer_judge asked whether they say the same, both orders)",
    )
    max_excess_disagreement: float = Field(
        0.1,
        gt=0,
        le=1,
        allow_inf_nan=False,
        description="an answer comparison breaches when the candidate's answers are worse than "
        "(or, under `exact`, differ from) the live release's more often than the live "
        "release's own second answers do, by more than this (the 95% interval wholly above "
        "it); it passes when the interval lies wholly at or below it",
    )
    answer_max_client_share: float = Field(
        0.1,
        gt=0,
        le=1,
        allow_inf_nan=False,
        description="one client (API key, or address without keys) counts for at most this "
        "share of the answer pairs a verdict counts (its earliest pairs)",
    )
    answer_min_pairs: int | None = Field(
        None,
        ge=1,
        le=100_000,
        description="answer pairs a comparison needs before it can pass or breach (unset: "
        "sized from max_excess_disagreement, the fewest at which no difference at all passes)",
    )
    answer_checks: list[AnswerCheckName] = Field(
        default_factory=lambda: list[AnswerCheckName](["refusal"]),
        description="`scorer` comparison, for a request that is no known item: reference-free "
        "checks an answer must pass where the live release's answer passes them",
    )
    answer_known_items: list[Path] = Field(
        default_factory=list,
        description="`scorer` comparison: suite files (JSONL items, relative to the root) "
        "whose questions are known: a mirrored request asking one is scored by its suite's "
        "scorer against its expected answer",
    )
    answer_judge: AnswerJudgeConfig | None = Field(
        None, description="the pinned judge of the `judge` comparison"
    )
    after_promotion_looks: int = Field(
        4,
        ge=1,
        le=20,
        description="the after-promotion check judges the answers this many times, evenly "
        "over its window (each look at confidence 1 - 0.05 / looks), not at every tick",
    )
    after_promotion_sustain: int = Field(
        2,
        ge=1,
        le=20,
        description="breaching looks in a row before the after-promotion check rolls back "
        "(the window's last look breaches alone)",
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
    max_perf_tolerance: dict[str, float] = _ceilings(
        "ceilings on the perf tolerances the manifest sets at the knee: bench.knee metric -> "
        'largest tolerance, "*" for the rest (defaults: {defaults}); a wider tolerance is '
        "clamped to the ceiling",
        DEFAULT_MAX_PERF_TOLERANCE,
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
    max_canary_tolerance: dict[str, float] = _ceilings(
        "ceilings on the relative tolerance of the candidate manifest's canary checks (also "
        'used by its shadow comparisons): metric -> largest, "*" for the rest (default '
        "{defaults}); a wider one is clamped to the ceiling and reported",
        DEFAULT_MAX_CANARY_TOLERANCE,
    )
    max_canary_slack: dict[str, float] = _ceilings(
        "ceilings on the absolute slack of the candidate manifest's canary checks: metric -> "
        'largest, "*" for the rest (defaults: {defaults}); a wider one is clamped to the '
        "ceiling and reported",
        DEFAULT_MAX_CANARY_SLACK,
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
        if self.answer_comparison == "judge" and self.answer_judge is None:
            raise ValueError(
                'answer_comparison "judge" needs an [environments.NAME.answer_judge] table '
                "(endpoint, model)"
            )
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
