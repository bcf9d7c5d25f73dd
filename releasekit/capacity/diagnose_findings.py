"""The symptom table of design.md ("Operating knowledge to encode") as checks over one
window: each finding classified (performance or quality) with its evidence, the line it
crossed, the likely cause, where to look and the remedy; findings ranked most urgent
first."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from pydantic import BaseModel, Field

from releasekit.capacity.diagnose_inputs import (
    Baseline,
    ChangeSummary,
    LiveWindow,
    Source,
    Thresholds,
)
from releasekit.capacity.diagnose_segments import (
    Segment,
)
from releasekit.capacity.diagnose_text import age_text

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


_SEVERITY_RANK = {"critical": 0, "warning": 1, "info": 2}


def make_evidence(
    metric: str,
    value: float | None,
    unit: str,
    source: Source,
    *,
    baseline: float | None = None,
    threshold: float | None = None,
    note: str | None = None,
) -> Evidence:
    """One number behind a finding (the fields of `Evidence`)."""
    return Evidence(
        metric=metric,
        value=value,
        unit=unit,
        source=source,
        baseline=baseline,
        threshold=threshold,
        note=note,
    )


class WindowChecks:
    """One window's checks that need no latency segment: the gauges (stalled, memory
    pressure) and quality (errors, negative feedback); `Judge` adds the segments and runs
    them all."""

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
                        make_evidence("waiting_requests_max", waiting, "requests", "vllm"),
                        make_evidence("running_requests", running, "requests", "vllm"),
                        make_evidence("requests", self.requests, "requests", "vllm"),
                        make_evidence("generation_tokens_per_s", tokens, "tokens/s", "vllm"),
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
                    make_evidence(
                        "kv_cache_usage",
                        kv,
                        "ratio",
                        "vllm",
                        baseline=self.bval("kv_cache_usage_peak"),
                        threshold=t.kv_usage_high,
                    ),
                    make_evidence(
                        "preemptions_per_s",
                        pre,
                        "1/s",
                        "vllm",
                        baseline=base_pre,
                        threshold=t.preemptions_per_s,
                    ),
                    make_evidence(
                        "running_requests", self.w.v("running_requests"), "requests", "vllm"
                    ),
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

    # -- quality -----------------------------------------------------------------------------

    def suspect(self) -> tuple[str, list[str]]:
        """The last change in words, and the command that shows its diff."""
        c = self.change
        if c is None:
            return "no live change in the ledger to compare with", []
        what = "; ".join(c.changed) if c.changed else "no input difference found"
        age = f", {age_text(c.age_s)} ago" if c.age_s is not None else ""
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
        suspect, cmds = self.suspect()
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
                    make_evidence("error_rate", err, "ratio", src, baseline=base, threshold=line),
                    make_evidence("timeout_rate", timeouts, "ratio", "gateway"),
                    make_evidence("requests", self.requests, "requests", src),
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
        suspect, cmds = self.suspect()
        self.add(
            Finding(
                kind="negative_feedback",
                category="quality",
                severity="critical" if neg >= 0.5 else "warning",
                title=f"{neg:.0%} of {n:g} feedback scores were negative",
                evidence=[
                    make_evidence(
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


def rank_findings(findings: Iterable[Finding]) -> list[Finding]:
    """Findings, most urgent first."""
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
