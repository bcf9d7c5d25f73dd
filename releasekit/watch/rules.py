"""Watch rules: the rule model (absolute thresholds and limits relative to the release's own
load test at a similar request rate), the benchmark baseline a caller supplies, the judgement
of one rule on one window, and `RuleState`, which counts consecutive breaching windows.

A window with too little traffic (fewer than the rule's `min_requests` behind the figure), a
reset window (a server restarted) or a missing metric is **no data**: neither a pass nor a
breach. No-data windows neither reset nor advance the consecutive-breach count. Resetting
would let a regression hide behind a restart or a quiet minute between breaching windows (a
server that crash-loops under load would never be rolled back); advancing would count
restarts and quiet minutes as breaches. Only a passing window resets the count.
"""

from __future__ import annotations

import bisect
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

from releasekit.errors import ReleasekitError
from releasekit.watch.windows import METRICS, Source, Window

Verdict = Literal["pass", "breach", "no_data"]


class WatchRuleError(ReleasekitError):
    """Raised when a watch rule names a metric windows do not compute, or its fields
    disagree (an absolute rule without `above`, a relative one without `factor`)."""

    remedy = "fix the manifest's watch rule; metric names: " + ", ".join(sorted(METRICS))


class Rule(BaseModel):
    """One watch rule. `kind: absolute` breaches when the window's figure is above `above`;
    `kind: relative` when it is more than `factor` times the release's benchmark figure at a
    similar request rate. A breach must last `sustain` consecutive windows of `window_s`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field("", description="unique name; default: derived from metric and kind")
    metric: str = Field(description="a window figure (windows.METRICS), e.g. ttft_p95_s")
    kind: Literal["absolute", "relative"] = "absolute"
    above: float | None = Field(None, description="absolute: breach when value > above")
    factor: float | None = Field(
        None, gt=0, description="relative: breach when value > factor x benchmark"
    )
    window_s: float = Field(30.0, gt=0)
    sustain: int = Field(3, ge=1, description="consecutive breaching windows before acting")
    min_requests: int = Field(
        20, ge=0, description="fewest requests (observations) behind a figure to judge it"
    )
    rate_tolerance: float = Field(
        0.5,
        ge=0,
        description="relative: a benchmark point counts as 'similar' within this relative "
        "distance of the live request rate beyond the benchmarked range",
    )
    severity: Literal["critical", "warning"] = "critical"

    @model_validator(mode="before")
    @classmethod
    def _default_name(cls, data: object) -> object:
        if isinstance(data, dict) and not data.get("name") and data.get("metric"):
            return {**data, "name": f"{data['metric']}_{data.get('kind') or 'absolute'}"}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> Rule:
        if self.metric not in METRICS:
            raise ValueError(f"unknown metric {self.metric!r}; known: {', '.join(sorted(METRICS))}")
        if self.kind == "absolute" and self.above is None:
            raise ValueError("an absolute rule needs `above`")
        if self.kind == "relative" and self.factor is None:
            raise ValueError("a relative rule needs `factor`")
        return self

    def describe(self) -> str:
        """The rule in words: 'ttft_p95_s above 1 for 3 x 30 s windows'."""
        if self.kind == "absolute":
            what = f"{self.metric} above {self.above:g}"
        else:
            what = f"{self.metric} more than {self.factor:g}x its benchmark"
        return f"{what} for {self.sustain} x {self.window_s:g} s windows"


class BaselinePoint(BaseModel):
    """The release's load-test figures at one request rate (window figure names)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    request_rate: float = Field(gt=0)
    figures: dict[str, float]


class Baseline(BaseModel):
    """A release's own load-test figures per request rate, supplied by the caller."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    release: str | None = None
    points: list[BaselinePoint] = Field(min_length=1)

    def figure_at(self, metric: str, rate: float, *, tolerance: float) -> tuple[float | None, str]:
        """The benchmark `metric` at request rate `rate`: interpolated linearly between the
        two points around it, the nearest end point within `tolerance` (relative) beyond the
        range, otherwise None. Returns (value, how it was found)."""
        pts = sorted(
            (p.request_rate, p.figures[metric]) for p in self.points if metric in p.figures
        )
        if not pts:
            return None, f"the benchmark has no {metric}"
        rates = [r for r, _ in pts]
        lo, hi = rates[0], rates[-1]
        if rate < lo:
            if rate >= lo / (1 + tolerance):
                return pts[0][1], f"benchmark at {lo:g} req/s"
            return None, f"live rate {rate:.3g} req/s is far below the benchmark's ({lo:g})"
        if rate > hi:
            if rate <= hi * (1 + tolerance):
                return pts[-1][1], f"benchmark at {hi:g} req/s"
            return None, f"live rate {rate:.3g} req/s is far above the benchmark's ({hi:g})"
        i = bisect.bisect_left(rates, rate)
        if rates[i] == rate:
            return pts[i][1], f"benchmark at {rate:g} req/s"
        (r0, v0), (r1, v1) = pts[i - 1], pts[i]
        value = v0 + (v1 - v0) * (rate - r0) / (r1 - r0)
        return value, f"benchmark interpolated between {r0:g} and {r1:g} req/s"


class Judgement(BaseModel):
    """One rule's verdict on one window, with the figure and limit it compared."""

    rule: str
    metric: str
    verdict: Verdict
    value: float | None = None
    limit: float | None = None
    source: Source | None = None
    count: float = 0.0
    reason: str
    window_start: float
    window_end: float


def judge(rule: Rule, window: Window, baseline: Baseline | None = None) -> Judgement:
    """Judge one window against one rule (pass, breach or no data, with the reason)."""
    fig = window.figure(rule.metric)

    def out(verdict: Verdict, reason: str, limit: float | None = None) -> Judgement:
        return Judgement(
            rule=rule.name,
            metric=rule.metric,
            verdict=verdict,
            value=fig.value,
            limit=limit,
            source=fig.source,
            count=fig.count,
            reason=reason,
            window_start=window.start,
            window_end=window.end,
        )

    if fig.value is None:
        return out("no_data", fig.reason or "no data")
    if fig.count < rule.min_requests:
        return out("no_data", f"too little traffic: {fig.count:g} < {rule.min_requests}")
    if rule.kind == "absolute":
        limit = rule.above if rule.above is not None else float("inf")
        how = f"limit {limit:g}"
    else:
        if baseline is None:
            return out("no_data", "relative rule but no benchmark baseline was supplied")
        rate = window.figure("request_rate").value
        if rate is None:
            return out("no_data", "no request rate to pick a benchmark point")
        bench, how = baseline.figure_at(rule.metric, rate, tolerance=rule.rate_tolerance)
        if bench is None:
            return out("no_data", how)
        limit = (rule.factor or 1.0) * bench
        how = f"{rule.factor:g}x {bench:.4g} ({how})"
    src = f" [{fig.source}]" if fig.source else ""
    if fig.value > limit:
        return out("breach", f"{rule.metric} {fig.value:.4g} > {how}{src}", limit)
    return out("pass", f"{rule.metric} {fig.value:.4g} <= {how}{src}", limit)


class BreachEvidence(BaseModel):
    """A breaching window and its judgement: what a rollback event records."""

    judgement: Judgement
    window: Window


class RuleState(BaseModel):
    """Consecutive breaching windows of one rule. A pass resets the count; a no-data window
    leaves it as it is (see the module docstring)."""

    rule: Rule
    consecutive: int = 0
    breaches: list[BreachEvidence] = Field(default_factory=list)
    last: Judgement | None = None

    def update(self, judgement: Judgement, window: Window) -> bool:
        """Record one judgement; True when the breach is sustained (>= `sustain` windows)."""
        self.last = judgement
        if judgement.verdict == "breach":
            self.consecutive += 1
            self.breaches.append(BreachEvidence(judgement=judgement, window=window))
            self.breaches = self.breaches[-self.rule.sustain :]
        elif judgement.verdict == "pass":
            self.reset()
        return self.sustained

    @property
    def sustained(self) -> bool:
        """Whether the last `sustain` judged windows all breached."""
        return self.consecutive >= self.rule.sustain

    def reset(self) -> None:
        """Forget the breach run (after a pass, or after the rollback it caused)."""
        self.consecutive = 0
        self.breaches = []


class ManifestWatchRule(Protocol):
    """What the manifest's `WatchRule` provides (releasekit.spec.manifest.WatchRule)."""

    @property
    def metric(self) -> str: ...
    @property
    def kind(self) -> Literal["absolute", "relative"]: ...
    @property
    def max(self) -> float | None: ...
    @property
    def factor(self) -> float | None: ...
    @property
    def window_s(self) -> float: ...
    @property
    def sustain(self) -> int: ...
    @property
    def min_requests(self) -> int | None: ...


def from_manifest(rule: ManifestWatchRule, *, min_requests: int = 20) -> Rule:
    """Convert a manifest `WatchRule` to a `Rule` (`max` becomes `above`; `min_requests`
    defaults to the given one). Raises WatchRuleError."""
    data: dict[str, object] = {
        "metric": rule.metric,
        "kind": rule.kind,
        "window_s": rule.window_s,
        "sustain": rule.sustain,
        "min_requests": rule.min_requests if rule.min_requests is not None else min_requests,
    }
    if rule.kind == "relative":
        data["factor"] = rule.factor
    else:
        data["above"] = rule.max
    try:
        return Rule.model_validate(data)
    except ValueError as exc:
        raise WatchRuleError(f"watch rule {rule.metric!r}: {_first_problem(exc)}") from exc


def with_floor(rules: list[Rule], floor: list[Rule], *, env: str) -> tuple[list[Rule], list[str]]:
    """The release's `rules` under `env`'s floor (`watch_floor`, committed policy): a rule
    of the floor's metric and kind is kept at most as loose as the floor's (its limit,
    `sustain`, `window_s` and `min_requests` lowered to the floor's), and a floor rule the
    release has no rule for is added (`watch: []` still gets the floor). Returns the rules
    and one line per change, "clamped by <env>'s policy: ..."."""
    out = list(rules)
    notes: list[str] = []
    for f in floor:
        same = [i for i, r in enumerate(out) if r.metric == f.metric and r.kind == f.kind]
        if not same:
            out.append(f.model_copy(update={"name": _floor_name(f, out)}))
            notes.append(
                f"clamped by {env}'s policy: watch rule {f.describe()} added "
                "(the release's watch has none for it)"
            )
            continue
        for i in same:
            r = out[i]
            update: dict[str, float | int] = {}
            words: list[str] = []
            for field in ("above", "factor", "sustain", "window_s", "min_requests"):
                mine, most = getattr(r, field), getattr(f, field)
                if most is not None and (mine is None or mine > most):
                    update[field] = most
                    was = "none" if mine is None else f"{mine:g}"
                    words.append(f"{field} {was} -> {most:g}")
            if update:
                out[i] = r.model_copy(update=update)
                notes.append(f"clamped by {env}'s policy: watch rule {r.name}: {', '.join(words)}")
    return out, notes


def _floor_name(rule: Rule, rules: list[Rule]) -> str:
    names = {r.name for r in rules}
    return rule.name if rule.name not in names else f"floor_{rule.name}"


class SLOLike(Protocol):
    """What a load profile's SLO provides (releasekit.spec.loadprofile.SLO)."""

    @property
    def ttft_s(self) -> float | None: ...
    @property
    def e2e_s(self) -> float | None: ...
    @property
    def attainment(self) -> float: ...
    @property
    def max_error_rate(self) -> float: ...


_QUANTILES = (0.5, 0.9, 0.95, 0.99)


def rules_from_slo(
    slo: SLOLike, *, window_s: float = 60.0, sustain: int = 3, min_requests: int = 20
) -> list[Rule]:
    """Absolute rules from a load profile's SLOs: TTFT and E2E at the attainment quantile
    (rounded up to one windows compute: p50/p90/p95/p99) and the error rate. TPOT has no
    per-window figure and is left out."""
    q = next((x for x in _QUANTILES if x >= slo.attainment - 1e-9), _QUANTILES[-1])
    pq = f"p{round(q * 100)}"
    out = []
    for short, limit in (("ttft", slo.ttft_s), ("e2e", slo.e2e_s)):
        if limit is not None:
            out.append(
                Rule(
                    name=f"slo_{short}_{pq}",
                    metric=f"{short}_{pq}_s",
                    above=limit,
                    window_s=window_s,
                    sustain=sustain,
                    min_requests=min_requests,
                )
            )
    out.append(
        Rule(
            name="slo_error_rate",
            metric="error_rate",
            above=slo.max_error_rate,
            window_s=window_s,
            sustain=sustain,
            min_requests=min_requests,
        )
    )
    return out


def _first_problem(exc: ValueError) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        msgs = [str(e.get("msg", "")).removeprefix("Value error, ") for e in errors()]
        return "; ".join(m for m in msgs if m) or str(exc)
    return str(exc)
