"""Live judgement of a canary against the stable release over the same window.

Each release's figures come from two windows over the same two instants: the gateway's
per-release edge metrics (what clients see: requests by status, TTFT, feedback) and the
release's own vLLM /metrics (engine side: TTFT, TPOT). `watch.windows.build_window` makes
both; `watch.rules.judge` compares one figure with its limit, so "too little traffic" means
the same here as in the watcher: wait, never decide.

Which figure is trusted (the gates' rule, applied live):

- TTFT p95: the edge figure, unless the stream is bursty on either side (fewer than
  `BURSTY_DELIVERIES_PER_TOKEN` chunks per output token: tokens arrive merged, so the
  edge's first chunk comes late for reasons of the front end, not of the release); then
  the engine's, for both releases. Both sides always use the same source.
- TPOT p95: the engine's (`vllm:request_time_per_output_token_seconds`); the edge cannot
  see tokens. Not measured when both releases share one server (a prompt-only canary).
- error rate: the edge's, 5xx and timeouts only: a client's own cancellation (499), a
  non-stream request that outlasted its own timeout, 4xx and rate limits never count.
- negative-feedback rate: the edge's (`POST /v1/feedback`).

A check breaches when the canary's figure is above its limit, `stable x (1 + tolerance) +
slack`, by more than sampling noise explains: a p95 over 20-50 requests is their second- or
third-slowest, and two such figures from the same server differ by half on a busy host. So
the judge counts the canary's observations above the limit (latency: from its histogram,
read as its quantiles are; rates: its errors or negative answers) and asks how likely that
many would be if the canary's figure were at the limit, which allows `1 - q` of them above
it for a q-quantile, or the limit's rate for a rate. A breach needs that one-sided binomial
p-value below `1 - confidence` as well as the figure above the limit; a figure above the
limit by chance is a pass, and the reason says so with the counts. A release that is really
slower is not slowed down by this: `max-num-seqs: 1` under steady load puts most of its
requests above the limit (p below 1e-10 at 20 samples).
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, Field

from releasekit.spec.manifest import CanaryCheck
from releasekit.watch.rules import Judgement, Rule, judge
from releasekit.watch.windows import Figure, Window

CheckVerdict = Literal["pass", "breach", "wait", "not_measured"]
BURSTY_DELIVERIES_PER_TOKEN = 0.5
FEEDBACK_FAMILY = "releasekit_gateway_feedback_total"
NO_FEEDBACK = "no feedback sent through the gateway yet (POST /v1/feedback)"
_QUANTILE_METRIC = re.compile(r"^(?P<short>[a-z0-9]+)_p(?P<q>\d+)_s$")


class ReleaseWindows(BaseModel):
    """One release's two windows over the same instants: edge (gateway) and engine (vLLM;
    None when its server is not its own or was not scraped)."""

    release_id: str
    edge: Window
    engine: Window | None = None
    engine_missing: str | None = Field(
        None, description="why `engine` is None: not scraped (a shared server), no answer"
    )

    @property
    def requests(self) -> float:
        """Requests the gateway finished for this release in the window."""
        return self.edge.requests or 0.0

    def deliveries_per_token(self) -> float | None:
        """Streamed chunks per output token (None without both sides' figures)."""
        chunks = self.edge.figure("chunks_per_request")
        if self.engine is None or chunks.value is None:
            return None
        tok = self.engine.figure("generation_tokens_per_s").value
        reqs = self.engine.requests
        if not tok or not reqs:
            return None
        per_request = tok * self.engine.duration_s / reqs
        return chunks.value / per_request if per_request > 0 else None


class CheckResult(BaseModel):
    """One check's verdict on one window: both releases' figures, the limit, the source."""

    metric: str
    verdict: CheckVerdict
    required: bool
    canary: float | None = None
    stable: float | None = None
    limit: float | None = None
    source: str | None = None
    canary_count: float = 0.0
    stable_count: float = 0.0
    above: float | None = Field(
        None, description="canary observations above the limit (latency) or counted (rates)"
    )
    allowed_share: float | None = Field(
        None, description="share of them the limit allows: 1 - q for a q-quantile, the rate"
    )
    p_value: float | None = Field(
        None, description="one-sided binomial: that many or more if the canary were at the limit"
    )
    reason: str
    window_start: float
    window_end: float

    def over_limit(self) -> str:
        """' (3 of 40 over the limit, p=0.32)' for a figure over its limit, else ''."""
        if self.above is None or self.canary is None or self.limit is None:
            return ""
        if self.canary <= self.limit or self.p_value is None:
            return ""
        return (
            f" ({self.above:.0f} of {self.canary_count:.0f} over the limit, p={self.p_value:.2g})"
        )

    def brief(self) -> str:
        """'ttft_p95_s 0.93 vs 0.64 pass', with the counts over the limit when over it; or
        'tpot_p95_s not measured (why)', 'negative_feedback_rate wait (why)'."""
        if self.verdict in ("pass", "breach"):
            cv = "-" if self.canary is None else f"{self.canary:.3g}"
            sv = "-" if self.stable is None else f"{self.stable:.3g}"
            return f"{self.metric} {cv} vs {sv} {self.verdict}{self.over_limit()}"
        return f"{self.metric} {self.verdict.replace('_', ' ')} ({self.reason})"


class StepJudgement(BaseModel):
    """Every check on one window of one step."""

    window_start: float
    window_end: float
    canary_requests: float
    stable_requests: float
    checks: list[CheckResult] = Field(default_factory=list)

    def by_metric(self, metric: str) -> CheckResult | None:
        """The result of the check on `metric`, if any."""
        return next((c for c in self.checks if c.metric == metric), None)


def _bursty(rw: ReleaseWindows) -> bool:
    d = rw.deliveries_per_token()
    return d is not None and d < BURSTY_DELIVERIES_PER_TOKEN


def _pick(
    check: CanaryCheck, canary: ReleaseWindows, stable: ReleaseWindows
) -> tuple[Figure, Figure, Window | None, str, str]:
    """(canary figure, stable figure, canary window, source, why) for one check."""
    metric = check.metric
    ce, se = canary.engine, stable.engine
    if metric == "tpot_p95_s":
        if ce is None or se is None:
            return Figure(), Figure(), None, "vllm", _no_engine(canary, stable)
        return ce.figure(metric), se.figure(metric), ce, "vllm", "engine-side"
    if metric == "ttft_p95_s":
        bursty = _bursty(canary) or _bursty(stable)
        edge_c, edge_s = canary.edge.figure(metric), stable.edge.figure(metric)
        edge_ok = edge_c.has_data and edge_s.has_data
        if ce is not None and se is not None and (bursty or not edge_ok):
            why = "engine-side: the stream is bursty" if bursty else "engine-side: no edge TTFT"
            return ce.figure(metric), se.figure(metric), ce, "vllm", why
        return edge_c, edge_s, canary.edge, "gateway", "edge"
    return canary.edge.figure(metric), stable.edge.figure(metric), canary.edge, "gateway", "edge"


def _no_engine(canary: ReleaseWindows, stable: ReleaseWindows) -> str:
    """Why there are no engine figures for both: 'no engine figures: the canary's vLLM
    /metrics did not answer (timed out after 5 s)'."""
    c = canary.engine_missing if canary.engine is None else None
    s = stable.engine_missing if stable.engine is None else None
    if c is not None and c == s:
        return f"no engine figures: {c}"
    parts = [f"the {who}'s vLLM {why}" for who, why in (("canary", c), ("stable", s)) if why]
    if canary.engine is None and c is None:
        parts.insert(0, "the canary's vLLM was not scraped")
    if stable.engine is None and s is None:
        parts.append("the stable release's vLLM was not scraped")
    return "no engine figures: " + "; ".join(parts)


def _measurable(fig: Figure, window: Window | None) -> bool:
    """False when the source does not produce the figure at all (as opposed to too few
    observations so far)."""
    if window is None:
        return False
    if fig.has_data:
        return True
    reason = fig.reason or ""
    return "observations" in reason or reason.startswith(("no requests", "no feedback"))


def judge_check(
    check: CanaryCheck, canary: ReleaseWindows, stable: ReleaseWindows
) -> tuple[CheckResult, Judgement | None]:
    """One check of the canary against stable over the same window."""
    fc, fs, cw, source, why = _pick(check, canary, stable)
    start, end = canary.edge.start, canary.edge.end

    def result(
        verdict: CheckVerdict,
        reason: str,
        limit: float | None = None,
        evidence: Exceedance | None = None,
    ) -> CheckResult:
        return CheckResult(
            metric=check.metric,
            verdict=verdict,
            required=check.required,
            canary=fc.value,
            stable=fs.value,
            limit=limit,
            source=source,
            canary_count=fc.count,
            stable_count=fs.count,
            above=evidence.above if evidence else None,
            allowed_share=evidence.allowed if evidence else None,
            p_value=evidence.p_value if evidence else None,
            reason=reason,
            window_start=start,
            window_end=end,
        )

    if cw is None:
        return result("not_measured", why), None
    if not _measurable(fc, cw):
        if check.metric == "negative_feedback_rate" and FEEDBACK_FAMILY in cw.missing:
            return result("not_measured", NO_FEEDBACK), None
        return result("not_measured", f"{why}: {fc.reason or 'no source'}"), None
    if fs.value is None or fs.count < check.min_samples:
        n = fs.count if fs.value is not None else 0
        what = f"stable has {n:g} < {check.min_samples} samples"
        return result("wait", f"{what}: {fs.reason}" if fs.reason else what), None
    limit = fs.value * (1 + check.tolerance) + check.slack
    evidence = _exceedance(check.metric, fc, cw, limit)
    rule = Rule(
        name=f"canary {check.metric}",
        metric=check.metric,
        above=limit,
        min_requests=check.min_samples,
        sustain=1,
    )
    j = judge(rule, cw)
    words = f"{fs.value:.4g} x {1 + check.tolerance:g} + {check.slack:g}"
    if j.verdict == "no_data":
        return result("wait", f"canary: {j.reason}", limit), j
    value = fc.value if fc.value is not None else float("nan")
    alpha = 1 - check.confidence
    if j.verdict != "breach":
        return result("pass", f"{value:.4g} <= {words} [{source}, {why}]", limit, evidence), j
    if evidence is None or evidence.p_value < alpha:
        more = f"; {evidence.words()} < {alpha:g}" if evidence else ""
        return result(
            "breach", f"{value:.4g} > {words}{more} [{source}, {why}]", limit, evidence
        ), j
    noise = f"{value:.4g} > {words} within sampling noise: {evidence.words()} >= {alpha:g}"
    return result("pass", f"{noise} [{source}, {why}]", limit, evidence), j.model_copy(
        update={"verdict": "pass", "reason": noise}
    )


class Exceedance(BaseModel):
    """How many of the canary's observations are above the limit, and how likely that many
    would be if its figure were at the limit (module docstring)."""

    above: float
    n: float
    allowed: float
    p_value: float

    def words(self) -> str:
        """'14 of 54 above the limit (26%; at most 5% expected), p = 2e-05'."""
        share = self.above / self.n if self.n else 0.0
        return (
            f"{self.above:.0f} of {self.n:.0f} above the limit ({share:.0%}; "
            f"{self.allowed:.0%} allowed), p = {self.p_value:.2g}"
        )


def _exceedance(metric: str, fig: Figure, window: Window | None, limit: float) -> Exceedance | None:
    """The canary's count above `limit` and its binomial p-value, or None where the window
    has no histogram for a latency quantile (then the figure alone decides)."""
    from scipy.stats import binomtest  # imported here: scipy adds ~0.4 s to CLI start-up

    if window is None or fig.value is None:
        return None
    m = _QUANTILE_METRIC.match(metric)
    if m is not None:
        hist = window.histograms.get(m["short"])
        if hist is None or hist.count <= 0:
            return None
        n = hist.count
        above = hist.count_above(limit)
        allowed = 1 - int(m["q"]) / 100
    else:  # a rate over `count` requests or answers
        n = fig.count
        if n <= 0:
            return None
        above = fig.value * n
        allowed = min(max(limit, 0.0), 1.0)
    k, trials = round(above), round(n)
    if allowed >= 1.0 or k <= 0 or trials <= 0:
        p = 1.0
    elif allowed <= 0.0:
        p = 0.0
    else:
        p = float(binomtest(min(k, trials), trials, allowed, alternative="greater").pvalue)
    return Exceedance(above=above, n=n, allowed=allowed, p_value=p)


def judge_step(
    checks: list[CanaryCheck], canary: ReleaseWindows, stable: ReleaseWindows
) -> StepJudgement:
    """Every check on the same window."""
    out = StepJudgement(
        window_start=canary.edge.start,
        window_end=canary.edge.end,
        canary_requests=canary.requests,
        stable_requests=stable.requests,
    )
    for c in checks:
        out.checks.append(judge_check(c, canary, stable)[0])
    return out
