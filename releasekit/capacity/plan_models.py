"""What a capacity plan is made of: the traffic in business numbers, per-unit figures given
by hand, the working (steps), the warnings, the per-unit rate and where it comes from, what
the sweep measured, the plan itself and the points of its volume curve."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from releasekit.spec.measured import MeasuredOn

WarningCode = Literal[
    "beyond_sweep",
    "beyond_max_num_seqs",
    "prompt_length_mismatch",
    "output_length_mismatch",
    "little_vs_measured",
    "knee_at_sweep_top",
    "knee_few_requests",
    "knee_flagged",
    "knee_unstable",
    "no_measurement",
    "cores_scaled",
]


class Traffic(BaseModel):
    """The traffic to plan for, in business numbers, and how much spare to keep."""

    daily_requests: float = Field(description="requests a day")
    peak_hours: float = Field(description="length of the daily peak window, hours")
    peak_factor: float = Field(description="how much the peak exceeds an even spread over it")
    headroom: float = Field(1.0, description="multiplies the peak rate; 1.25 keeps 25% spare")
    min_units: int = Field(1, description="never plan fewer units than this")
    unit_cost_per_hour: float | None = Field(None, description="price of one unit-hour")
    prompt_tokens: float | None = Field(None, description="mean prompt tokens of the traffic")
    output_tokens: float | None = Field(None, description="mean output tokens of the traffic")


class HandUnit(BaseModel):
    """Per-unit figures given by hand, for planning before any load test exists."""

    concurrency: float = Field(description="sequences one unit serves at once")
    tokens_per_second: float = Field(description="decode rate of one sequence, tokens/s")
    output_tokens: float = Field(description="output tokens per request")
    overhead_s: float = Field(0.0, description="added to every request, e.g. TTFT")
    max_num_seqs: int | None = Field(None, description="the engine's max-num-seqs, if known")


class Step(BaseModel):
    """One line of the working: what is computed, with the numbers put in, and the result."""

    name: str
    working: str
    value: float
    unit: str


class PlanWarning(BaseModel):
    """Where the plan leaves what was measured, or the measurement is shaky."""

    code: WarningCode
    message: str


class UnitRate(BaseModel):
    """What one serving unit sustains, and where that figure comes from."""

    source: Literal["load test", "by hand"]
    requests_per_s: float = Field(description="the per-unit rate the plan uses")
    concurrency: float = Field(description="requests in flight per unit at that rate")
    seconds_per_request: float = Field(description="mean E2E (load test) or worked out by hand")
    little_requests_per_s: float = Field(description="concurrency / seconds per request")
    measured_requests_per_s: float | None = Field(
        None, description="request_throughput measured at the knee"
    )
    little_over_measured: float | None = None
    knee_load: float | None = None
    mode: Literal["concurrency", "rate"] | None = None
    measured_on: MeasuredOn | None = Field(
        None, description="the host the load test ran on (None: by hand, or not recorded)"
    )
    cores: float | None = Field(
        None,
        description="the cores of one unit the rate applies to: the bench host's, or the "
        "replica's when scaled to it (None: unknown)",
    )


class Measured(BaseModel):
    """What the release's sweep covered."""

    profile_name: str
    mode: Literal["concurrency", "rate"]
    loads: list[float]
    min_requests_per_s: float
    max_requests_per_s: float
    max_requests_per_s_load: float
    knee_load: float
    prompt_tokens_mean: float | None = None
    output_tokens_mean: float | None = None
    max_num_seqs: int | None = None


class CapacityPlan(BaseModel):
    """A capacity plan: peak rate, per-unit rate, units, utilisation, cost, the working and
    the warnings. `plot` is set once a plot was written."""

    release_id: str | None = None
    verified: bool | None = Field(
        None,
        description="True: from the release's files as its register event signed them; "
        "False: an unregistered release's files, unverified (a note says so); None: by hand",
    )
    traffic: Traffic
    peak_requests_per_s: float
    unit: UnitRate
    units: int
    utilisation: float = Field(description="peak rate / (units x per-unit rate)")
    load_per_unit_requests_per_s: float = Field(description="peak rate / units")
    cost_per_hour: float | None = Field(None, description="units x unit-hour price")
    cost_per_day: float | None = Field(None, description="a fleet sized for the peak, running 24 h")
    cost_per_1k_requests: float | None = Field(
        None, description="cost per day / daily requests x 1000"
    )
    cost_per_1k_requests_at_peak: float | None = Field(
        None, description="cost per hour / requests in a peak hour x 1000"
    )
    steps: list[Step]
    warnings: list[PlanWarning] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)
    measured: Measured | None = None
    adapters_in_traffic: int | None = Field(
        None,
        description="planned from the knee of the sweep with this many LoRA adapters in "
        "traffic, the count the release carries (None: the base's own sweep)",
    )
    plot: str | None = None


class CurvePoint(BaseModel):
    """Units needed at one daily volume, and whether a unit's load there was measured."""

    daily_requests: float
    units: int
    load_per_unit_requests_per_s: float
    measured: bool | None = Field(None, description="None when nothing was measured")
