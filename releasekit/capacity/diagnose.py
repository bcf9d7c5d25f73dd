"""Diagnosis of a live service: what is wrong with an environment right now, ranked, each
finding with its evidence, likely cause, where to look and remedy (design.md, "Operating
knowledge to encode").

The judgement is plain data in, data out: `diagnose_window(window, baseline=..., change=...)`
reads a `LiveWindow` (per-window figures of the vLLM server and of the gateway, by the names
of releasekit.watch.windows.METRICS), a `Baseline` (the knee of the release's own load test)
and a `ChangeSummary` (the environment's most recent ledger change and its diff). `diagnose`
adds the lookups: what is live in the environment (the ledger), its bench result and the
diff against the release before it. Taking the window itself (two scrapes `window` seconds
apart) is the caller's: scraping lives in releasekit.watch, a layer above this package.

Method, as design.md writes it:

1. classify: performance (latency, memory, queueing) or quality (errors, negative feedback,
   with the last change as the suspect);
2. segment latency into gateway time (first token at the edge minus the engine's), intake
   (the engine's TTFT that queue and prefill do not explain: vLLM's API server front end),
   queueing (vLLM queue time, waiting requests), prefill and decode (vLLM's histograms;
   decode judged per token, by ITL), and name the segment that grew against the knee;
3. check the symptom table: memory pressure and preemptions, queueing behind too little
   capacity, slow decode, streaming that stutters between engine and client;
4. compare with the last change.

Every threshold is relative to the release's benchmark where it has the figure (`factor` x
the knee's value and at least `floor` above it), an absolute fallback otherwise; each finding
states the one it used. A window with too few requests is "not enough traffic to judge",
never healthy; a window in which a server restarted is not judged at all.

Errors raised here:

    ReleasekitError
    └── DiagnoseError     the window cannot be judged: nothing scraped, no URL known for
                          the environment, a bad window length
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel, Field

from releasekit.bench.runner import BenchResult
from releasekit.bench.stats import PointResult
from releasekit.capacity.plan import CapacityEvidenceError, read_bench
from releasekit.config import Settings
from releasekit.deploy.state import EnvState, read_state
from releasekit.errors import ReleasekitError
from releasekit.releases.queries import ReleaseDiff, diff
from releasekit.stores.ledger import Ledger, LedgerRecord, open_ledger

# -- errors ----------------------------------------------------------------------------------


class DiagnoseError(ReleasekitError):
    """Raised when a diagnosis cannot start or its window cannot be judged: no metrics URL
    known for the environment (nothing deployed, no --vllm-url), neither source answered
    both scrapes, or a window length that is not positive."""

    remedy = (
        "deploy the environment first (`releasekit promote`), or point diagnose at the "
        "servers with --vllm-url and --gateway-url"
    )


# -- inputs ----------------------------------------------------------------------------------

Source = Literal["vllm", "gateway", "bench", "ledger"]


class Observed(BaseModel):
    """One live figure over the window (the shape of releasekit.watch.windows.Figure)."""

    value: float | None = None
    source: str | None = None
    count: float = 0.0
    reason: str | None = None


class LiveWindow(BaseModel):
    """What the two scrapes saw: figures of the vLLM server alone (`vllm`) and of the
    gateway alone (`gateway`), by METRICS name, so that the engine's TTFT and the edge's can
    be set side by side."""

    duration_s: float = Field(gt=0)
    requests: float | None = Field(None, description="requests finished in the window")
    requests_source: str | None = None
    reset: list[str] = Field(default_factory=list, description="sources that restarted")
    scrape_errors: dict[str, str] = Field(default_factory=dict)
    vllm_url: str | None = None
    gateway_url: str | None = None
    vllm: dict[str, Observed] = Field(default_factory=dict)
    gateway: dict[str, Observed] = Field(default_factory=dict)

    def v(self, name: str) -> float | None:
        """A vLLM figure's value (None: no data)."""
        f = self.vllm.get(name)
        return None if f is None else f.value

    def g(self, name: str) -> float | None:
        """A gateway figure's value (None: no data)."""
        f = self.gateway.get(name)
        return None if f is None else f.value

    def count(self, source: Literal["vllm", "gateway"], name: str) -> float:
        """Observations behind a figure (0 when absent)."""
        f = (self.vllm if source == "vllm" else self.gateway).get(name)
        return 0.0 if f is None else f.count


class Baseline(BaseModel):
    """The healthy reference: the knee of the release's own load test (client figures from
    the load generator, server figures from vLLM's histograms over the same point)."""

    release_id: str | None = None
    load: float
    mode: str
    request_rate: float | None = None
    ttft_p95_s: float | None = None
    ttft_mean_s: float | None = None
    e2e_p95_s: float | None = None
    e2e_mean_s: float | None = None
    itl_mean_s: float | None = None
    itl_p95_s: float | None = None
    tpot_mean_s: float | None = None
    server_ttft_mean_s: float | None = None
    server_itl_mean_s: float | None = None
    queue_mean_s: float | None = None
    prefill_mean_s: float | None = None
    decode_mean_s: float | None = None
    kv_cache_usage_peak: float | None = None
    preemptions_per_s: float | None = None
    chunks_per_token: float | None = None
    prompt_tokens_mean: float | None = None
    error_rate: float | None = None
    slo_ttft_s: float | None = None
    slo_e2e_s: float | None = None
    slo_tpot_s: float | None = None
    slo_max_error_rate: float | None = None
    max_num_seqs: int | None = None


def _hist_mean(p: PointResult, name: str) -> float | None:
    if p.server is None:
        return None
    h = p.server.histograms.get(name)
    return None if h is None else h.mean_s


def baseline_from_bench(bench: BenchResult) -> Baseline | None:
    """The knee of `bench` as a Baseline; None when the sweep has no knee."""
    k = bench.knee
    if k is None:
        return None
    s = k.server
    preempt = None
    if s is not None and s.preemptions is not None and s.interval_s > 0:
        preempt = s.preemptions / s.interval_s
    return Baseline(
        release_id=bench.release_id,
        load=k.load,
        mode=k.mode,
        request_rate=k.request_throughput,
        ttft_p95_s=k.ttft.p95,
        ttft_mean_s=k.ttft.mean,
        e2e_p95_s=k.e2e.p95,
        e2e_mean_s=k.e2e.mean,
        itl_mean_s=k.itl.mean,
        itl_p95_s=k.itl.p95,
        tpot_mean_s=k.tpot.mean,
        server_ttft_mean_s=_hist_mean(k, "ttft"),
        server_itl_mean_s=_hist_mean(k, "itl"),
        queue_mean_s=None if s is None else s.queue_time_mean_s,
        prefill_mean_s=None if s is None else s.prefill_time_mean_s,
        decode_mean_s=None if s is None else s.decode_time_mean_s,
        kv_cache_usage_peak=None if s is None else s.kv_cache_usage_peak,
        preemptions_per_s=preempt,
        chunks_per_token=k.chunks_per_token,
        prompt_tokens_mean=k.prompt_tokens_mean,
        error_rate=k.error_rate,
        slo_ttft_s=bench.slo.ttft_s,
        slo_e2e_s=bench.slo.e2e_s,
        slo_tpot_s=bench.slo.tpot_s,
        slo_max_error_rate=bench.slo.max_error_rate,
        max_num_seqs=bench.max_num_seqs,
    )


class ChangeSummary(BaseModel):
    """The environment's most recent live change (ledger) and what it changed."""

    seq: int
    event_type: str
    time: dt.datetime
    age_s: float | None = None
    actor: str
    reason: str
    from_release: str | None = None
    to_release: str | None = None
    changed: list[str] = Field(
        default_factory=list, description="what differs, one line per area (prompts, serving...)"
    )
    kinds: list[str] = Field(
        default_factory=list, description="areas that differ: prompts, model, quantisation..."
    )
    diff_command: str | None = None
    notes: list[str] = Field(default_factory=list)


class Thresholds(BaseModel):
    """Where diagnose draws its lines. `*_factor` and `*_floor_s` apply against the bench
    knee (live > factor x knee and live - knee > floor); `*_abs_s` when the bench lacks the
    figure."""

    min_requests: int = Field(10, description="fewer finished requests: not enough traffic")
    min_feedback: int = Field(5, description="fewer feedback scores: no feedback verdict")
    factor: float = Field(2.0, description="a segment grew when live > factor x the knee's")
    queue_floor_s: float = 0.05
    queue_abs_s: float = 0.5
    queue_share: float = Field(0.3, description="queue time's share of latency that dominates")
    prefill_floor_s: float = 0.05
    prefill_abs_s: float = 1.0
    itl_floor_s: float = 0.005
    itl_abs_s: float = 0.1
    gateway_floor_s: float = 0.1
    intake_floor_s: float = 0.1
    intake_abs_s: float = 0.5
    gateway_abs_s: float = 0.25
    gateway_queue_abs_s: float = 0.05
    kv_usage_high: float = 0.9
    preemptions_per_s: float = Field(0.0, description="more than this: preemptions happen")
    chunks_per_token_low: float = Field(
        0.5, description="fewer SSE chunks per output token: tokens arrive merged (bursts)"
    )
    stream_share_min: float = Field(0.5, description="share of streamed requests to judge chunks")
    error_rate_abs: float = Field(0.05, description="error-rate line without a bench SLO")
    negative_feedback_rate: float = 0.3
    recent_change_s: float = Field(
        24 * 3600.0, description="a change younger than this is named as a suspect"
    )


# -- outputs ---------------------------------------------------------------------------------

Severity = Literal["critical", "warning", "info"]
Category = Literal["performance", "quality"]
FindingKind = Literal[
    "stalled",
    "errors",
    "negative_feedback",
    "queueing",
    "gateway_queue",
    "memory_pressure",
    "slow_intake",
    "slow_prefill",
    "slow_decode",
    "streaming_stutter",
    "latency",
]
Verdict = Literal["healthy", "problems", "not_enough_traffic", "not_judged"]


class Evidence(BaseModel):
    """One number behind a finding, where it came from, and what it was held against."""

    metric: str
    value: float | None
    unit: str
    source: Source
    baseline: float | None = Field(None, description="the bench knee's figure, when known")
    threshold: float | None = None
    note: str | None = None


class Finding(BaseModel):
    """One ranked finding: what, the numbers, likely cause, where to look, what to do."""

    kind: FindingKind
    category: Category
    severity: Severity
    title: str
    evidence: list[Evidence] = Field(default_factory=list)
    threshold: str = Field(description="the line this finding crossed, in words")
    cause: str
    where: str
    remedy: str
    commands: list[str] = Field(default_factory=list)
    added_s: float | None = Field(
        None, description="seconds this adds per request over the benchmark (ranks findings)"
    )


class Segment(BaseModel):
    """One latency segment: its mean over the window, the knee's, and whether it grew."""

    name: Literal["gateway", "intake", "queue", "prefill", "decode"]
    live_s: float | None = None
    baseline_s: float | None = None
    source: Source | None = None
    share: float | None = Field(None, description="share of the segments' total")
    grew: bool = False
    rule: str = ""


class Diagnosis(BaseModel):
    """What `releasekit diagnose ENV` found. `verdict`: healthy, problems, not enough
    traffic to judge, or not judged (a server restarted in the window)."""

    env: str
    release_id: str | None = None
    window_s: float
    requests: float | None = None
    request_rate: float | None = None
    verdict: Verdict
    classification: Literal["performance", "quality", "performance+quality", "none"]
    summary: str
    findings: list[Finding] = Field(default_factory=list)
    segments: list[Segment] = Field(default_factory=list)
    key_figures: dict[str, float | None] = Field(default_factory=dict)
    baseline: Baseline | None = None
    last_change: ChangeSummary | None = None
    notes: list[str] = Field(default_factory=list)


# -- the judgement ---------------------------------------------------------------------------

_SEVERITY_RANK = {"critical": 0, "warning": 1, "info": 2}


def _s(x: float | None) -> str:
    if x is None:
        return "-"
    if abs(x) >= 10:
        return f"{x:.1f} s"
    if abs(x) >= 0.1:
        return f"{x:.2f} s"
    return f"{x * 1000:.1f} ms"


def _knee(base: float | None) -> str:
    return "" if base is None else f" (knee {_s(base)})"


def _grew(
    live: float | None, base: float | None, *, factor: float, floor: float, absolute: float
) -> tuple[bool, str]:
    """Whether `live` grew past the knee's `base` (or past `absolute` without one)."""
    if live is None:
        return False, "no data"
    if base is not None:
        line = max(base * factor, base + floor)
        return live > line, (
            f"> max({factor:g} x knee {_s(base)}, knee + {_s(floor)}) = {_s(line)}"
        )
    return live > absolute, f"> {_s(absolute)} (absolute: the bench has no figure)"


def _sub(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _ev(
    metric: str,
    value: float | None,
    unit: str,
    source: Source,
    *,
    baseline: float | None = None,
    threshold: float | None = None,
    note: str | None = None,
) -> Evidence:
    return Evidence(
        metric=metric,
        value=value,
        unit=unit,
        source=source,
        baseline=baseline,
        threshold=threshold,
        note=note,
    )


class _Judge:
    """The checks of one window, in the order design.md's method takes them."""

    def __init__(
        self,
        w: LiveWindow,
        base: Baseline | None,
        change: ChangeSummary | None,
        t: Thresholds,
        env: str,
        release_id: str | None,
    ) -> None:
        self.w, self.b, self.change, self.t = w, base, change, t
        self.env, self.release_id = env, release_id
        self.findings: list[Finding] = []
        self.segments: list[Segment] = []
        self.notes: list[str] = []
        self.requests = w.requests or 0.0
        self.enough = self.requests >= t.min_requests

    def bval(self, name: str) -> float | None:
        return None if self.b is None else getattr(self.b, name)

    def add(self, f: Finding) -> None:
        self.findings.append(f)

    # -- gauges: judged whatever the traffic -------------------------------------------------

    def stalled(self) -> None:
        waiting = self.w.v("waiting_requests_max")
        running = self.w.v("running_requests")
        tokens = self.w.v("generation_tokens_per_s")
        # Long answers may finish after the window: stalled only when no token came out.
        if waiting and waiting > 0 and self.requests == 0 and not tokens:
            self.add(
                Finding(
                    kind="stalled",
                    category="performance",
                    severity="critical",
                    title=f"requests wait ({waiting:g}) but none finished in "
                    f"{self.w.duration_s:g} s: the engine is stalled",
                    evidence=[
                        _ev("waiting_requests_max", waiting, "requests", "vllm"),
                        _ev("running_requests", running, "requests", "vllm"),
                        _ev("requests", self.requests, "requests", "vllm"),
                        _ev("generation_tokens_per_s", tokens, "tokens/s", "vllm"),
                    ],
                    threshold="waiting > 0 with no request finished and no token generated "
                    "in the window",
                    cause="a hung engine or a request that holds the batch (very long output, "
                    "a stuck step)",
                    where="the vLLM server's log; vllm:num_requests_running",
                    remedy="restart the server (the gateway keeps the old one until the new is "
                    "healthy); set request timeouts and max_tokens at the gateway",
                )
            )

    def memory(self) -> None:
        kv = self.w.v("kv_cache_usage")
        pre = self.w.v("preemptions_per_s")
        t = self.t
        high = kv is not None and kv >= t.kv_usage_high
        preempting = pre is not None and pre > t.preemptions_per_s
        if not (high or preempting):
            return
        base_pre = self.bval("preemptions_per_s")
        sev: Severity = "critical" if (high and preempting) else "warning"
        parts = []
        if high and kv is not None:
            parts.append(f"KV cache {kv:.0%} full")
        if preempting and pre is not None:
            parts.append(f"{pre:.2f} preemptions/s")
        self.add(
            Finding(
                kind="memory_pressure",
                category="performance",
                severity=sev,
                title="memory pressure: " + ", ".join(parts),
                evidence=[
                    _ev(
                        "kv_cache_usage",
                        kv,
                        "ratio",
                        "vllm",
                        baseline=self.bval("kv_cache_usage_peak"),
                        threshold=t.kv_usage_high,
                    ),
                    _ev(
                        "preemptions_per_s",
                        pre,
                        "1/s",
                        "vllm",
                        baseline=base_pre,
                        threshold=t.preemptions_per_s,
                    ),
                    _ev("running_requests", self.w.v("running_requests"), "requests", "vllm"),
                ],
                threshold=f"KV usage >= {t.kv_usage_high:.0%} or preemptions/s > "
                f"{t.preemptions_per_s:g} (absolute; the knee's figures shown beside them)",
                cause="concurrency or batch too large for the KV cache: sequences are "
                "preempted and recomputed (latency grows, worse over time)",
                where="vllm:kv_cache_usage_perc, vllm:num_preemptions_total, the release's "
                "max-num-seqs and max-model-len",
                remedy="lower max-num-seqs, quantise the KV cache (--kv-cache-dtype fp8), give "
                "the cache more memory (gpu-memory-utilization, VLLM_CPU_KVCACHE_SPACE); a "
                "restart policy if it worsens over time",
            )
        )

    # -- latency segments --------------------------------------------------------------------

    def segment(self) -> None:
        w, b, t = self.w, self.b, self.t
        f = t.factor
        edge_ttft = w.g("ttft_mean_s")
        eng_ttft = w.v("ttft_mean_s")
        gw_live = _sub(edge_ttft, eng_ttft)
        gw_base = None
        if b is not None:
            gw_base = _sub(b.ttft_mean_s, b.server_ttft_mean_s)
            if gw_base is not None:
                gw_base = max(gw_base, 0.0)
        if gw_live is None:
            gw_live = _sub(w.g("e2e_mean_s"), w.v("e2e_mean_s"))
        if gw_live is not None:
            gw_live = max(gw_live, 0.0)
        decode_live = w.v("decode_mean_s")
        # The engine's TTFT counts from the API server's arrival; what queue and prefill do
        # not explain is the server's front end (HTTP, tokenisation, handing to the engine).
        queue_live, prefill_live = w.v("queue_mean_s"), w.v("prefill_mean_s")
        intake_live = _sub(
            eng_ttft,
            None if queue_live is None or prefill_live is None else queue_live + prefill_live,
        )
        if intake_live is not None:
            intake_live = max(intake_live, 0.0)
        intake_base = None
        if b is not None and b.queue_mean_s is not None and b.prefill_mean_s is not None:
            intake_base = _sub(b.server_ttft_mean_s, b.queue_mean_s + b.prefill_mean_s)
            if intake_base is not None:
                intake_base = max(intake_base, 0.0)
        specs: list[tuple[Any, float | None, float | None, Source, float, float]] = [
            ("gateway", gw_live, gw_base, "gateway", t.gateway_floor_s, t.gateway_abs_s),
            ("intake", intake_live, intake_base, "vllm", t.intake_floor_s, t.intake_abs_s),
            (
                "queue",
                w.v("queue_mean_s"),
                self.bval("queue_mean_s"),
                "vllm",
                t.queue_floor_s,
                t.queue_abs_s,
            ),
            (
                "prefill",
                w.v("prefill_mean_s"),
                self.bval("prefill_mean_s"),
                "vllm",
                t.prefill_floor_s,
                t.prefill_abs_s,
            ),
        ]
        segs: list[Segment] = []
        for name, live, base, src, floor, absolute in specs:
            grew, rule = _grew(live, base, factor=f, floor=floor, absolute=absolute)
            segs.append(
                Segment(
                    name=name,
                    live_s=live,
                    baseline_s=base,
                    source=src if live is not None else None,
                    grew=grew,
                    rule=rule,
                )
            )
        # Decode time scales with output length: whether it grew is judged per token (ITL).
        itl_live, itl_base = w.v("itl_mean_s"), self._itl_base()
        grew, rule = _grew(itl_live, itl_base, factor=f, floor=t.itl_floor_s, absolute=t.itl_abs_s)
        segs.append(
            Segment(
                name="decode",
                live_s=decode_live,
                baseline_s=self.bval("decode_mean_s"),
                source="vllm" if decode_live is not None else None,
                grew=grew,
                rule=f"per token: ITL {_s(itl_live)} {rule}",
            )
        )
        total = sum(s.live_s for s in segs if s.live_s is not None)
        if total > 0:
            for s in segs:
                if s.live_s is not None:
                    s.share = s.live_s / total
        self.segments = segs

    def _itl_base(self) -> float | None:
        b = self.b
        if b is None:
            return None
        return b.server_itl_mean_s or b.itl_mean_s or b.tpot_mean_s

    def seg(self, name: str) -> Segment:
        return next(s for s in self.segments if s.name == name)

    def queueing(self) -> None:
        w, t = self.w, self.t
        q = self.seg("queue")
        waiting = w.v("waiting_requests_max")
        dominant = q.share is not None and q.share >= t.queue_share
        if not q.grew or not (dominant or (waiting or 0) > 0):
            return
        ttft_p95 = w.v("ttft_p95_s")
        slo = self.bval("slo_ttft_s")
        knee_rate = self.bval("request_rate")
        rate = w.g("request_rate") if w.g("request_rate") is not None else w.v("request_rate")
        running = w.v("running_requests")
        mns = self.bval("max_num_seqs")
        # Critical: queueing is most of the latency, TTFT breaks the profile's SLO, or more
        # requests wait than run (the engine is full over and over).
        severe = (
            (q.share or 0) >= 0.5
            or (slo is not None and (ttft_p95 or 0) > slo)
            or (running is not None and running > 0 and (waiting or 0) >= running)
        )
        ev = [
            _ev(
                "queue_mean_s",
                q.live_s,
                "s",
                "vllm",
                baseline=q.baseline_s,
                note=f"{q.share:.0%} of request latency" if q.share is not None else None,
            ),
            _ev("waiting_requests_max", waiting, "requests", "vllm"),
            _ev(
                "running_requests",
                running,
                "requests",
                "vllm",
                note=f"max-num-seqs {mns}" if mns is not None else None,
            ),
            _ev(
                "ttft_p95_s",
                ttft_p95,
                "s",
                "vllm",
                baseline=self.bval("ttft_p95_s"),
                threshold=slo,
                note="threshold: the profile's TTFT SLO" if slo is not None else None,
            ),
            _ev(
                "request_rate",
                rate,
                "1/s",
                "gateway" if w.g("request_rate") is not None else "vllm",
                baseline=knee_rate,
                note="baseline: the rate measured at the knee" if knee_rate else None,
            ),
        ]
        over = ""
        cause = (
            "too little capacity for the traffic: requests queue for a slot before prefill "
            "(high TTFT)"
        )
        if rate is not None and knee_rate:
            if rate > knee_rate:
                over = f"; traffic {rate:.2f} req/s over the knee's {knee_rate:.2f} req/s"
            else:
                cause = (
                    f"requests queue although traffic ({rate:.2f} req/s) is below the knee's "
                    f"{knee_rate:.2f} req/s: requests heavier than the benchmark's (longer "
                    "prompts or outputs), or fewer served at once (max-num-seqs, KV cache)"
                )
        rid = (self.release_id or "RELEASE")[:12]
        self.add(
            Finding(
                kind="queueing",
                category="performance",
                severity="critical" if severe else "warning",
                title=f"queueing: requests wait {_s(q.live_s)} in vLLM's queue"
                f"{_knee(q.baseline_s)}, {waiting or 0:g} waiting{over}",
                evidence=ev,
                threshold=f"queue mean {q.rule}, and queue time >= {t.queue_share:.0%} of "
                "latency or requests waiting",
                cause=cause,
                where="vllm:num_requests_waiting, vllm:request_queue_time_seconds, the request "
                "rate against the knee's",
                remedy="add serving units (size them with `releasekit capacity`), rate-limit "
                "at the gateway (rate_limit, max_in_flight), or a shorter batch window",
                commands=[
                    f"releasekit capacity {rid} --daily-requests N --peak-hours H --peak-factor F"
                ],
                added_s=_sub(q.live_s, q.baseline_s) or q.live_s,
            )
        )

    def gateway_queue(self) -> None:
        w, t = self.w, self.t
        gq = w.g("gateway_queue_mean_s")
        if gq is None or gq <= t.gateway_queue_abs_s:
            return
        waiting = w.v("waiting_requests_max")
        engine_room = (waiting or 0) == 0
        self.add(
            Finding(
                kind="gateway_queue",
                category="performance",
                severity="warning",
                title=f"requests wait {_s(gq)} for a slot at the gateway",
                evidence=[
                    _ev(
                        "gateway_queue_mean_s", gq, "s", "gateway", threshold=t.gateway_queue_abs_s
                    ),
                    _ev("gateway_queue_p95_s", w.g("gateway_queue_p95_s"), "s", "gateway"),
                    _ev("in_flight", w.g("in_flight"), "requests", "gateway"),
                    _ev("waiting_requests_max", waiting, "requests", "vllm"),
                ],
                threshold=f"gateway admission wait mean > {_s(t.gateway_queue_abs_s)} (absolute)",
                cause="the gateway's max_in_flight is below what the engine can hold"
                if engine_room
                else "too little capacity: both the gateway and the engine queue",
                where="releasekit_gateway_queue_wait_seconds, the gateway's max_in_flight",
                remedy="raise the gateway's max_in_flight towards max-num-seqs"
                if engine_room
                else "add serving units (`releasekit capacity`) or rate-limit",
                added_s=gq,
            )
        )

    def intake(self) -> None:
        i = self.seg("intake")
        if not i.grew:
            return
        w = self.w
        self.add(
            Finding(
                kind="slow_intake",
                category="performance",
                severity="warning",
                title=f"the API server holds requests {_s(i.live_s)} before vLLM's queue"
                f"{_knee(i.baseline_s)}",
                evidence=[
                    _ev(
                        "intake_mean_s",
                        i.live_s,
                        "s",
                        "vllm",
                        baseline=i.baseline_s,
                        note="vLLM TTFT mean minus queue and prefill means",
                    ),
                    _ev("ttft_mean_s", w.v("ttft_mean_s"), "s", "vllm"),
                    _ev("queue_mean_s", w.v("queue_mean_s"), "s", "vllm"),
                    _ev("prefill_mean_s", w.v("prefill_mean_s"), "s", "vllm"),
                    _ev("running_requests", w.v("running_requests"), "requests", "vllm"),
                ],
                threshold=f"intake mean {i.rule}",
                cause="the server's front end is CPU-bound (HTTP, tokenisation, detokenising "
                "and streaming every token) and hands requests to the engine late",
                where="vllm:time_to_first_token_seconds against request_queue_time_seconds + "
                "request_prefill_time_seconds; the API server process's CPU",
                remedy="more API server processes (--api-server-count), more CPU for the front "
                "end, or fewer, larger stream chunks; add units if the engine is full too",
                added_s=_sub(i.live_s, i.baseline_s) or i.live_s,
            )
        )

    def prefill(self) -> None:
        p = self.seg("prefill")
        if not p.grew:
            return
        w = self.w
        ptok = w.v("prompt_tokens_per_s")
        per_req = None
        if ptok is not None and self.requests > 0:
            per_req = ptok * w.duration_s / self.requests
        base_tok = self.bval("prompt_tokens_mean")
        longer = per_req is not None and base_tok is not None and per_req > 1.5 * base_tok
        self.add(
            Finding(
                kind="slow_prefill",
                category="performance",
                severity="warning",
                title=f"slow prefill: {_s(p.live_s)} per request{_knee(p.baseline_s)}",
                evidence=[
                    _ev("prefill_mean_s", p.live_s, "s", "vllm", baseline=p.baseline_s),
                    _ev(
                        "prompt_tokens_per_request",
                        per_req,
                        "tokens",
                        "vllm",
                        baseline=base_tok,
                        note="baseline: the load profile's prompt length",
                    ),
                ],
                threshold=f"prefill mean {p.rule}",
                cause="prompts longer than the benchmark's (a prompt or context change)"
                if longer
                else "prefill competes with decode in the batch, or prompts are long",
                where="vllm:request_prefill_time_seconds, vllm:prompt_tokens_total, the last "
                "prompt change",
                remedy="shorter prompts or context; enable prefix caching and chunked prefill; "
                "lower max-num-batched-tokens",
                added_s=_sub(p.live_s, p.baseline_s) or p.live_s,
            )
        )

    def decode(self) -> None:
        d = self.seg("decode")
        if not d.grew:
            return
        w = self.w
        itl, base = w.v("itl_mean_s"), self._itl_base()
        running = w.v("running_requests")
        tokens = None
        if self.requests > 0 and w.v("generation_tokens_per_s") is not None:
            tokens = (w.v("generation_tokens_per_s") or 0.0) * w.duration_s / self.requests
        added = None
        if itl is not None and base is not None and tokens:
            added = (itl - base) * tokens
        rid = (self.release_id or "RELEASE")[:12]
        self.add(
            Finding(
                kind="slow_decode",
                category="performance",
                severity="warning",
                title=f"slow decode: {_s(itl)} between tokens{_knee(base)}, decode "
                f"{_s(d.live_s)} per request",
                evidence=[
                    _ev("itl_mean_s", itl, "s", "vllm", baseline=base),
                    _ev(
                        "itl_p95_s", w.v("itl_p95_s"), "s", "vllm", baseline=self.bval("itl_p95_s")
                    ),
                    _ev("decode_mean_s", d.live_s, "s", "vllm", baseline=d.baseline_s),
                    _ev("running_requests", running, "requests", "vllm"),
                    _ev("output_tokens_per_request", tokens, "tokens", "vllm"),
                ],
                threshold=d.rule,
                cause="a batch larger than the benchmark's, weights read slower than at the "
                "benchmark (another tenant, a quantisation change), or preemptions",
                where="vllm:inter_token_latency_seconds, vllm:num_requests_running, the "
                "roofline of the release",
                remedy="lower max-num-seqs for latency, quantise the weights (less to read per "
                "step), or add units",
                commands=[f"releasekit capacity {rid} --roofline"],
                added_s=added if added is not None else _sub(d.live_s, d.baseline_s),
            )
        )

    def streaming(self) -> None:
        w, t = self.w, self.t
        cpr = w.g("chunks_per_request")
        gen = w.v("generation_tokens_per_s")
        streams = self.w.count("gateway", "ttft_mean_s")
        share = streams / self.requests if self.requests > 0 else 0.0
        evidence: list[Evidence] = []
        problems: list[str] = []
        cpt = None
        if cpr is not None and gen and share >= t.stream_share_min:
            tokens_per_req = gen * w.duration_s / self.requests
            if tokens_per_req > 0:
                cpt = cpr / min(share, 1.0) / tokens_per_req
        base_cpt = self.bval("chunks_per_token")
        line = t.chunks_per_token_low
        if base_cpt is not None:
            line = min(line, base_cpt / t.factor)
        if cpt is not None and cpt < line:
            problems.append(f"{cpt:.2f} chunks per output token")
            evidence.append(
                _ev(
                    "chunks_per_token",
                    cpt,
                    "chunks/token",
                    "gateway",
                    baseline=base_cpt,
                    threshold=line,
                    note="gateway chunks over vLLM generation tokens (streamed requests)",
                )
            )
        g = self.seg("gateway")
        gq = w.g("gateway_queue_mean_s") or 0.0
        late = None
        if g.grew and g.live_s is not None:
            late = g.live_s - gq
            grew_beyond_queue, _ = _grew(
                late,
                g.baseline_s,
                factor=t.factor,
                floor=t.gateway_floor_s,
                absolute=t.gateway_abs_s,
            )
            if grew_beyond_queue:
                problems.append(f"first token reaches the edge {_s(g.live_s)} after the engine's")
                evidence += [
                    _ev(
                        "edge_minus_engine_ttft_s",
                        g.live_s,
                        "s",
                        "gateway",
                        baseline=g.baseline_s,
                        note="gateway TTFT mean minus vLLM TTFT mean",
                    ),
                    _ev("ttft_mean_s (edge)", w.g("ttft_mean_s"), "s", "gateway"),
                    _ev("ttft_mean_s (engine)", w.v("ttft_mean_s"), "s", "vllm"),
                    _ev("gateway_queue_mean_s", gq, "s", "gateway"),
                ]
            else:
                late = None
        if not problems:
            return
        self.add(
            Finding(
                kind="streaming_stutter",
                category="performance",
                severity="warning",
                title="streaming stutters: " + "; ".join(problems),
                evidence=evidence,
                threshold=(
                    f"chunks per token < {line:.2f} (min({t.chunks_per_token_low:g}, knee / "
                    f"{t.factor:g})); first-token gap at the edge {g.rule}"
                ),
                cause="slow or buffered forwarding between the layers (engine -> gateway -> "
                "client): tokens arrive merged, in bursts",
                where="per-segment timing: vLLM TTFT vs the gateway's TTFT, "
                "releasekit_gateway_stream_chunks_total, any proxy between them",
                remedy="batch chunk forwarding (flush every few ms instead of per token, or "
                "stop a buffering proxy); check the gateway's relay and its host's CPU",
                added_s=late,
            )
        )

    def latency(self) -> None:
        """TTFT or E2E above the knee with no segment that explains it."""
        if any(
            f.kind in ("queueing", "slow_intake", "slow_prefill", "slow_decode")
            for f in self.findings
        ):
            return
        if any(f.kind in ("streaming_stutter", "gateway_queue") for f in self.findings):
            return
        w, t = self.w, self.t
        for name, slo_name in (("ttft_p95_s", "slo_ttft_s"), ("e2e_p95_s", "slo_e2e_s")):
            live = w.g(name) if w.g(name) is not None else w.v(name)
            src: Source = "gateway" if w.g(name) is not None else "vllm"
            base, slo = self.bval(name), self.bval(slo_name)
            if live is None or base is None:
                continue
            line = max(base * t.factor, slo or 0.0)
            if live <= line:
                continue
            self.add(
                Finding(
                    kind="latency",
                    category="performance",
                    severity="warning",
                    title=f"{name[:-2].replace('_', ' ')} {_s(live)} vs {_s(base)} at the knee; "
                    "no single segment grew",
                    evidence=[_ev(name, live, "s", src, baseline=base, threshold=line)]
                    + [
                        _ev(
                            f"{s.name}_mean_s",
                            s.live_s,
                            "s",
                            s.source or "vllm",
                            baseline=s.baseline_s,
                        )
                        for s in self.segments
                    ],
                    threshold=f"> max({t.factor:g} x knee, SLO)",
                    cause="latency spread over the segments: heavier traffic shape (longer "
                    "prompts or outputs) than the benchmark's",
                    where="the segments above; prompt and output tokens per request",
                    remedy="compare the live traffic's lengths with the load profile; rerun "
                    "the bench with a profile that matches it",
                )
            )
            return

    # -- quality -----------------------------------------------------------------------------

    def _suspect(self) -> tuple[str, list[str]]:
        c = self.change
        if c is None:
            return "no live change in the ledger to compare with", []
        what = "; ".join(c.changed) if c.changed else "no input difference found"
        age = f", {_age(c.age_s)} ago" if c.age_s is not None else ""
        text = (
            f"the last change: {c.event_type} #{c.seq}{age} by {c.actor} "
            f"({(c.from_release or '-')[:12]} -> {(c.to_release or '-')[:12]}): {what}"
        )
        cmds = [c.diff_command] if c.diff_command else []
        return text, cmds

    def errors(self) -> None:
        w, t = self.w, self.t
        src: Source = "gateway" if w.g("error_rate") is not None else "vllm"
        err = w.g("error_rate") if src == "gateway" else w.v("error_rate")
        if err is None or not self.enough:
            return
        slo = self.bval("slo_max_error_rate")
        line = slo if slo is not None else t.error_rate_abs
        base = self.bval("error_rate")
        if base is not None:
            line = max(line, base * t.factor)
        if err <= line:
            return
        timeouts = w.g("timeout_rate")
        suspect, cmds = self._suspect()
        timeout_heavy = timeouts is not None and timeouts >= 0.5 * err
        cause = (
            "requests time out: look at the latency findings (queueing, decode)"
            if timeout_heavy
            else f"failing answers; suspect {suspect}"
        )
        self.add(
            Finding(
                kind="errors",
                category="performance" if timeout_heavy else "quality",
                severity="critical" if err >= max(0.1, 2 * line) else "warning",
                title=f"{err:.1%} of requests failed ({self.requests:g} in the window)",
                evidence=[
                    _ev("error_rate", err, "ratio", src, baseline=base, threshold=line),
                    _ev("timeout_rate", timeouts, "ratio", "gateway"),
                    _ev("requests", self.requests, "requests", src),
                ],
                threshold=f"error rate > {line:.1%} ("
                + ("the profile's max_error_rate" if slo is not None else "absolute")
                + ")",
                cause=cause,
                where="releasekit_gateway_requests_total by status, the vLLM log, "
                "`releasekit history " + self.env + "`",
                remedy=f"if it began with the last change, roll back: `releasekit rollback "
                f"{self.env} --reason ...`; read the diff",
                commands=[*cmds, f"releasekit rollback {self.env} --reason 'errors after change'"],
            )
        )

    def feedback(self) -> None:
        w, t = self.w, self.t
        neg = w.g("negative_feedback_rate")
        n = self.w.count("gateway", "negative_feedback_rate")
        if neg is None or n < t.min_feedback or neg < t.negative_feedback_rate:
            return
        suspect, cmds = self._suspect()
        self.add(
            Finding(
                kind="negative_feedback",
                category="quality",
                severity="critical" if neg >= 0.5 else "warning",
                title=f"{neg:.0%} of {n:g} feedback scores were negative",
                evidence=[
                    _ev(
                        "negative_feedback_rate",
                        neg,
                        "ratio",
                        "gateway",
                        threshold=t.negative_feedback_rate,
                    )
                ],
                threshold=f"negative share >= {t.negative_feedback_rate:.0%} of at least "
                f"{t.min_feedback} scores (absolute: the bench measures no feedback)",
                cause=f"a quality drop: model, prompt or context change; suspect {suspect}",
                where="the last release diff; the eval report of the live release",
                remedy=f"roll back (`releasekit rollback {self.env} --reason ...`) and read the "
                "diff; add the failing answers to the regression suite",
                commands=[*cmds, f"releasekit rollback {self.env} --reason 'quality drop'"],
            )
        )

    # -- everything --------------------------------------------------------------------------

    def run(self) -> None:
        self.stalled()
        self.memory()
        self.segment()
        if not self.enough:
            return
        self.errors()
        self.feedback()
        self.queueing()
        self.gateway_queue()
        self.intake()
        self.prefill()
        self.decode()
        self.streaming()
        self.latency()


def _age(s: float) -> str:
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    if s < 172800:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} days"


def _rank(findings: Iterable[Finding]) -> list[Finding]:
    # Severity first; within it quality before performance (a wrong answer outranks a slow
    # one), then the seconds a finding adds per request.
    return sorted(
        findings,
        key=lambda f: (
            _SEVERITY_RANK[f.severity],
            0 if f.category == "quality" else 1,
            -(f.added_s or 0.0),
        ),
    )


def _key_figures(w: LiveWindow) -> dict[str, float | None]:
    def pick(name: str) -> float | None:
        g = w.g(name)
        return g if g is not None else w.v(name)

    return {
        "request_rate": pick("request_rate"),
        "error_rate": pick("error_rate"),
        "ttft_p95_s": pick("ttft_p95_s"),
        "e2e_p95_s": pick("e2e_p95_s"),
        "engine_ttft_p95_s": w.v("ttft_p95_s"),
        "queue_mean_s": w.v("queue_mean_s"),
        "itl_mean_s": w.v("itl_mean_s"),
        "waiting_requests_max": w.v("waiting_requests_max"),
        "running_requests": w.v("running_requests"),
        "kv_cache_usage": w.v("kv_cache_usage"),
        "preemptions_per_s": w.v("preemptions_per_s"),
        "negative_feedback_rate": w.g("negative_feedback_rate"),
    }


def _healthy_line(k: dict[str, float | None], base: Baseline | None, requests: float) -> str:
    parts = [f"{requests:g} requests"]
    if k["request_rate"] is not None:
        parts[0] += f" ({k['request_rate']:.2f} req/s)"
    if k["ttft_p95_s"] is not None:
        knee = f" (knee {_s(base.ttft_p95_s)})" if base and base.ttft_p95_s is not None else ""
        parts.append(f"TTFT p95 {_s(k['ttft_p95_s'])}{knee}")
    if k["queue_mean_s"] is not None:
        parts.append(f"queue {_s(k['queue_mean_s'])}")
    if k["error_rate"] is not None:
        parts.append(f"errors {k['error_rate']:.1%}")
    if k["kv_cache_usage"] is not None:
        parts.append(f"KV {k['kv_cache_usage']:.0%}")
    return "healthy: " + ", ".join(parts)


def diagnose_window(
    window: LiveWindow,
    *,
    env: str,
    release_id: str | None = None,
    baseline: Baseline | None = None,
    change: ChangeSummary | None = None,
    thresholds: Thresholds | None = None,
    notes: Iterable[str] = (),
) -> Diagnosis:
    """Judge one live window against the release's benchmark knee: ranked findings, the
    latency segments, the key figures, and a one-line summary."""
    t = thresholds or Thresholds()
    all_notes = list(notes)
    all_notes += [f"{src} scrape failed: {p}" for src, p in window.scrape_errors.items()]
    if baseline is None:
        all_notes.append("no bench knee for the live release: absolute thresholds used")
    base_kw: dict[str, Any] = {
        "env": env,
        "release_id": release_id,
        "window_s": window.duration_s,
        "requests": window.requests,
        "baseline": baseline,
        "last_change": change,
    }
    if window.reset:
        return Diagnosis(
            **base_kw,
            verdict="not_judged",
            classification="none",
            summary=f"not judged: {', '.join(window.reset)} restarted during the window; "
            "run diagnose again",
            notes=all_notes,
        )
    j = _Judge(window, baseline, change, t, env, release_id)
    j.run()
    findings = _rank(j.findings)
    keys = _key_figures(window)
    cats = {f.category for f in findings}
    classification: Literal["performance", "quality", "performance+quality", "none"] = (
        "performance+quality"
        if cats == {"performance", "quality"}
        else "performance"
        if cats == {"performance"}
        else "quality"
        if cats == {"quality"}
        else "none"
    )
    if findings:
        verdict: Verdict = "problems"
        top = findings[0]
        more = f" (+{len(findings) - 1} more)" if len(findings) > 1 else ""
        summary = f"{classification} problem: {top.title}{more}"
    elif not j.enough:
        verdict = "not_enough_traffic"
        summary = (
            f"not enough traffic to judge: {j.requests:g} requests in "
            f"{window.duration_s:g} s (need {t.min_requests}); use a longer --window"
        )
    else:
        verdict = "healthy"
        summary = _healthy_line(keys, baseline, j.requests)
    recent = change is not None and change.age_s is not None and change.age_s <= t.recent_change_s
    if recent and not any(f.category == "quality" for f in findings):
        all_notes.append(f"recent change: {j._suspect()[0]}")
    return Diagnosis(
        **base_kw,
        request_rate=keys["request_rate"],
        verdict=verdict,
        classification=classification,
        summary=summary,
        findings=findings,
        segments=j.segments,
        key_figures=keys,
        notes=all_notes + j.notes,
    )


# -- lookups: the ledger, the bench, the deploy state ----------------------------------------

#: Ledger event types that change what an environment runs.
LIVE_TYPES = ("assign", "promote", "rollback", "deploy", "override")


def _diff_lines(d: ReleaseDiff) -> tuple[list[str], list[str]]:
    lines: list[str] = []
    kinds: list[str] = []
    changed_prompts = [p.role for p in d.prompts if not p.same]
    if changed_prompts:
        kinds.append("prompts")
        lines.append("prompts changed: " + ", ".join(changed_prompts))
    # `identity` (the manifest's name and description) differs between any two releases.
    inputs = [c for c in d.inputs if c.key != "identity"]
    for kind, changes in (
        ("model", d.model),
        ("quantisation", d.quantisation),
        ("serving", d.serving),
        ("inputs", inputs),
    ):
        if not changes:
            continue
        kinds.append(kind)
        shown = []
        for c in changes[:4]:
            if kind == "serving":
                shown.append(f"{c.key} {c.a} -> {c.b}")
            else:
                shown.append(c.key)
        extra = f" (+{len(changes) - 4} more)" if len(changes) > 4 else ""
        lines.append(f"{kind} changed: {', '.join(shown)}{extra}")
    return lines, kinds


def last_change(
    settings: Settings,
    env: str,
    *,
    ledger: Ledger,
    now: dt.datetime | None = None,
) -> ChangeSummary | None:
    """The environment's most recent live change, with what it changed against the release
    before it (releasekit.releases.queries.diff); None when nothing was ever live there."""
    recs: list[LedgerRecord] = ledger.records(
        environment=env, live=True, newest_first=True, limit=1
    )
    if not recs:
        return None
    rec = recs[0]
    now = now or dt.datetime.now(dt.UTC)
    when = rec.time if rec.time.tzinfo else rec.time.replace(tzinfo=dt.UTC)
    summary = ChangeSummary(
        seq=rec.seq,
        event_type=rec.type,
        time=when,
        age_s=max((now - when).total_seconds(), 0.0),
        actor=rec.actor,
        reason=rec.reason,
        from_release=rec.from_release,
        to_release=rec.to_release,
    )
    if rec.from_release and rec.to_release and rec.from_release != rec.to_release:
        summary.diff_command = f"releasekit diff {rec.from_release[:12]} {rec.to_release[:12]}"
        try:
            d = diff(settings, rec.from_release, rec.to_release, ledger=ledger)
        except ReleasekitError as exc:
            summary.notes.append(f"no diff: {exc.message}")
        else:
            summary.changed, summary.kinds = _diff_lines(d)
    elif not rec.from_release:
        summary.notes.append("first release in this environment: nothing to diff against")
    return summary


def live_baseline(settings: Settings, release_id: str) -> tuple[Baseline | None, str | None]:
    """The live release's bench knee, or None and why not."""
    try:
        bench = read_bench(settings, release_id)
    except CapacityEvidenceError as exc:
        return None, exc.message
    base = baseline_from_bench(bench)
    if base is None:
        return None, f"release {release_id[:12]}'s load test has no knee"
    return base, None


class LiveTargets(BaseModel):
    """Where an environment's metrics are: the live vLLM server's and the gateway's."""

    env: str
    release_id: str | None = None
    vllm_metrics_url: str | None = None
    gateway_metrics_url: str | None = None


def _metrics_url(base: str) -> str:
    return base.rstrip("/") + "/metrics"


def live_targets(settings: Settings, env: str, *, release_id: str | None = None) -> LiveTargets:
    """The /metrics URLs of `env` from the deploy state: the gateway's, and the server the
    gateway routes `release_id` to (or the first live server). Raises DeployStateError when
    the state is unreadable."""
    st: EnvState = read_state(settings.state_dir, env)
    vllm = None
    if release_id is not None:
        route = next((r for r in st.routes if r.release_id == release_id), None)
        if route is not None:
            vllm = route.base_url
        elif (srv := st.server_for(release_id)) is not None:
            vllm = srv.base_url
    if vllm is None and st.live_servers():
        vllm = st.live_servers()[0].base_url
    return LiveTargets(
        env=env,
        release_id=release_id,
        vllm_metrics_url=_metrics_url(vllm) if vllm else None,
        gateway_metrics_url=_metrics_url(st.gateway.url) if st.gateway else None,
    )


def live_release(settings: Settings, env: str, *, ledger: Ledger | None = None) -> str | None:
    """The release live in `env` per the ledger (None: nothing live, or no ledger yet)."""
    led = ledger or _ledger_or_none(settings)
    if led is None:
        return None
    try:
        rec = led.live_at(env)
    finally:
        if ledger is None:
            led.close()
    return None if rec is None else rec.to_release


def _ledger_or_none(settings: Settings) -> Ledger | None:
    try:
        return open_ledger(settings, read_only=True)
    except ReleasekitError:
        return None


def diagnose(
    settings: Settings,
    env: str,
    window: LiveWindow,
    *,
    release_id: str | None = None,
    ledger: Ledger | None = None,
    thresholds: Thresholds | None = None,
    now: dt.datetime | None = None,
) -> Diagnosis:
    """Diagnose `env` from a live window: the release live there (the ledger, unless
    `release_id` says), its bench knee as the healthy reference, and its most recent
    change with the diff against the release before it."""
    if window.requests is None and not window.vllm and not window.gateway:
        raise DiagnoseError(
            f"no metrics for {env}: "
            + ("; ".join(f"{k}: {v}" for k, v in window.scrape_errors.items()) or "nothing scraped")
        )
    notes: list[str] = []
    led = ledger or _ledger_or_none(settings)
    change = None
    rid = release_id
    if led is None:
        notes.append("no ledger: the live release and its last change are unknown")
    else:
        try:
            rid = rid or live_release(settings, env, ledger=led)
            change = last_change(settings, env, ledger=led, now=now)
        finally:
            if ledger is None:
                led.close()
    base = None
    if rid is not None:
        base, why = live_baseline(settings, rid)
        if why:
            notes.append(why)
    else:
        notes.append(f"no release live in {env} per the ledger")
    return diagnose_window(
        window,
        env=env,
        release_id=rid,
        baseline=base,
        change=change,
        thresholds=thresholds,
        notes=notes,
    )
