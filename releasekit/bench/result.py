"""The load-test result: every load point of a sweep, the knee and how it was found, and the
sweeps with LoRA adapters in traffic."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from releasekit.bench.loadgen import RequestRecord
from releasekit.bench.stats import PointResult
from releasekit.spec.loadprofile import SLO
from releasekit.spec.measured import MeasuredOn


class AdapterSweep(BaseModel):
    """One sweep of the profile's points (one run) with requests spread round-robin over the
    base and `adapters` LoRA adapters on the same engine: what serving that many costs."""

    adapters: int = Field(description="LoRA adapters in traffic (besides the base)")
    models: list[str] = Field(description="the model names requests went to, round-robin")
    copies: list[str] = Field(
        default_factory=list,
        description="extra copies of the release's adapters loaded for this sweep (a release "
        "with fewer adapters than `adapters`), unloaded after",
    )
    points: list[PointResult]
    knee: PointResult | None = None
    knee_stop: str | None = Field(None, description="what stopped the knee where it is")
    knee_rule: str | None = Field(None, description="the knee rule, in words")
    ttft_p95_s_at_knee: float | None = None
    goodput_at_knee: float | None = Field(None, description="req/s meeting every SLO")
    client_cpu_s: float | None = None


class MeasuredFor(BaseModel):
    """The release whose build ran a load test that another release cites as its own (the
    same engine on the same load profile: `releasekit.bench.reuse`)."""

    release_id: str
    register_seq: int = Field(description="the register event that signed its bench.json")
    bench_sha256: str = Field(description="its bench.json's sha256, as that event signed it")


class BenchResult(BaseModel):
    """A load-test result: one PointResult per load point (pooled over its repetitions) and
    the knee. `requests` (the raw per-request records) is written to requests.jsonl, not
    into bench.json."""

    release_id: str | None = None
    profile_digest: str | None = None
    profile_name: str
    model: str
    models: list[str] = Field(
        default_factory=list,
        description="the model names requests were spread over, round-robin (empty: `model` alone)",
    )
    base_url: str
    api: Literal["chat", "completions"]
    mode: Literal["concurrency", "rate"]
    slo: SLO
    started_at: str
    tokens_per_word: float = Field(description="prompt tokens per synthetic word (calibrated)")
    repetitions: int = Field(1, description="how many times the sweep ran")
    max_num_seqs: int | None = Field(
        None, description="the server's max-num-seqs, when known (cross-check of running)"
    )
    warmup_requests: int = 0
    warmup_ok: int = 0
    points: list[PointResult]
    knee: PointResult | None = None
    knee_share: float = Field(
        1.0, description="share of a point's repetitions that must hold (the knee rule)"
    )
    knee_rule: str | None = Field(None, description="the knee rule, in words")
    knee_stable: bool = Field(
        False,
        description="at least two repetitions ran and the rule's share of them gives the "
        "same knee alone",
    )
    knee_by_repetition: list[float | None] = Field(
        default_factory=list, description="the knee each repetition gives on its own"
    )
    knee_stop: str | None = Field(None, description="what stopped the knee where it is")
    flagged_points: list[float] = Field(
        default_factory=list,
        description="loads of points with too few unflagged repetitions to be trusted",
    )
    client_cpu_s: float | None = Field(None, description="client CPU seconds over all points")
    host: MeasuredOn | None = Field(
        None,
        description="where it was measured: host kind, cores, load (None: not recorded, an "
        "unknown host that no perf comparison accepts)",
    )
    server_memory_bytes: int | None = Field(
        None,
        description="memory the server's processes held once the model was loaded, before "
        "the load test (proportional set size, shared pages once; None: not measured)",
    )
    server_memory_peak_bytes: int | None = Field(
        None, description="the same, after the load test (weights plus the KV cache in use)"
    )
    adapters: list[str] = Field(
        default_factory=list, description="the LoRA adapters the release carries, by name"
    )
    adapter_sweeps: list[AdapterSweep] = Field(
        default_factory=list,
        description="after the main sweep (the base alone): one sweep per count of adapters "
        "in traffic, 1 to the engine's max-loras (empty: a release without adapters)",
    )
    bench_key: str | None = Field(
        None,
        description="what decides the main sweep's figures (the engine's serving key, the "
        "locked load profile, the served name, the harness); None: recorded before it was",
    )
    measured_for: MeasuredFor | None = Field(
        None,
        description="the main sweep was measured in another release's build with the same "
        "bench_key and is cited here as signed there (None: measured for this release)",
    )
    requests: list[RequestRecord] = Field(default_factory=list, exclude=True)

    @property
    def adapter_sweep(self) -> AdapterSweep | None:
        """The sweep with as many adapters in traffic as the release carries (None: no
        adapters, or no such sweep)."""
        n = len(self.adapters)
        return next((s for s in self.adapter_sweeps if n and s.adapters == n), None)
