"""Build evidence: read one release's build outputs (quantise, bench, eval, compare report)
into summaries, flat metric names and file digests. Any file may be missing."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from releasekit._support.digests import sha256_file
from releasekit.config import Settings
from releasekit.spec.lock import Lock
from releasekit.spec.measured import MeasuredOn
from releasekit.stores.results import FILES, ReleasePaths

M = TypeVar("M", bound=BaseModel)


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class SuiteResult(_Lenient):
    """One eval suite's totals."""

    kind: str | None = None
    scorer: str | None = None
    n: int | None = None
    passed: int | None = None
    failed: int | None = None
    errors: int | None = None
    pass_rate: float | None = None


class EvalSummary(_Lenient):
    """eval/eval.json: per-suite totals, the judge and the noise estimate (if any)."""

    release_id: str | None = None
    suites: dict[str, SuiteResult] = Field(default_factory=dict)
    judge: dict[str, Any] | None = None
    noise: dict[str, Any] | None = None


class Percentiles(_Lenient):
    """Latency percentiles of one load point, in seconds."""

    p50: float | None = None
    p90: float | None = None
    p95: float | None = None
    p99: float | None = None
    mean: float | None = None


class BenchPoint(_Lenient):
    """One load point of a sweep."""

    load: float | None = None
    mode: str | None = None
    n: int | None = None
    ok: int | None = None
    errors: int | None = None
    timeouts: int | None = None
    duration_s: float | None = None
    request_throughput: float | None = None
    output_token_throughput: float | None = None
    server_generation_tokens_per_s: float | None = None
    goodput: float | None = None
    slo_attainment: float | None = None
    slo_ok: bool | None = None
    trusted: bool | None = Field(None, description="passed the load test's cross-check")
    flags: list[dict[str, Any]] = Field(default_factory=list)
    ttft: Percentiles = Percentiles()
    tpot: Percentiles = Percentiles()
    itl: Percentiles = Percentiles()
    e2e: Percentiles = Percentiles()


class BenchSummary(_Lenient):
    """bench/bench.json: the sweep and its knee (the highest load whose SLOs hold)."""

    release_id: str | None = None
    profile_digest: str | None = None
    points: list[BenchPoint] = Field(default_factory=list)
    knee: BenchPoint | None = None


class MadeOn(_Lenient):
    """The host kind that produced a release's quantised weights (quantise.json `made_on`,
    the register event's `weights_made_on`): vendor, CPU model, instruction-set level and,
    where recorded, GPUs. None of it is required: older files record none of it."""

    cpu_vendor: str | None = None
    cpu_model: str | None = None
    isa: str | None = None
    gpus: list[str] | None = Field(None, description="None: not recorded (not: no GPUs)")

    @property
    def label(self) -> str:
        """The host kind in words: `AMD EPYC 9B14 (avx512_bf16)`."""
        cpu = self.cpu_model or self.cpu_vendor or "unknown CPU"
        gpus = f", {', '.join(self.gpus)}" if self.gpus else ""
        return f"{cpu} ({self.isa or 'unknown'}){gpus}"

    def record(self) -> dict[str, Any]:
        """The fields as signed in a register event (those recorded)."""
        return self.model_dump(mode="json", exclude_none=True)

    def differs_from(self, host: MeasuredOn) -> str | None:
        """How this host kind differs from where a measurement was made (None: it does not):
        vendor, CPU model and instruction-set level, and GPUs when the weights were made
        with some (weights quantised on the CPU do not depend on the host's GPUs)."""
        pairs = [
            ("CPU vendor", self.cpu_vendor, host.cpu_vendor),
            ("CPU model", self.cpu_model, host.cpu_model),
            ("instruction-set level", self.isa, host.isa),
        ]
        if self.gpus:
            pairs.append(("GPUs", ", ".join(self.gpus), ", ".join(host.gpus)))
        diff = [what for what, a, b in pairs if a != b]
        return ", ".join(diff) if diff else None


class QuantiseSummary(_Lenient):
    """quantise.json: what quantisation did and what it produced, where the weights were
    made (`made_on`) and the float code paths quantisation ran with (`float_paths`)."""

    scheme: str | None = None
    method: str | None = None
    size_before_bytes: int | None = None
    size_after_bytes: int | None = None
    seconds: float | None = None
    recipe_digest: str | None = None
    model_dir: str | None = None
    weights_digest: str | None = None
    made_on: MadeOn | None = None
    float_paths: dict[str, Any] | None = None

    @property
    def quantised(self) -> bool:
        """The served weights were produced by quantisation (not `scheme: none`)."""
        return self.scheme not in (None, "none")


class CompareSuite(_Lenient):
    """One suite of the paired comparison against the baseline."""

    delta: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    mcnemar_p: float | None = None
    flipped_to_fail: list[str] = Field(default_factory=list)
    flipped_to_pass: list[str] = Field(default_factory=list)
    margin: float | None = None
    verdict: str | None = None


class CompareSummary(_Lenient):
    """report/compare.json: the candidate against its baseline, suite by suite."""

    baseline_release_id: str | None = None
    candidate_release_id: str | None = None
    suites: dict[str, CompareSuite] = Field(default_factory=dict)


class Evidence(BaseModel):
    """Everything one release's build left behind, read tolerantly.

    `present`/`missing` list FILES keys; `problems` names files that exist but could not be
    read (the caller decides whether that is fatal); `digests` maps each present file's
    relative path to its sha256.
    """

    release_id: str
    directory: Path
    present: list[str] = Field(default_factory=list)
    missing: list[str] = Field(default_factory=list)
    problems: list[str] = Field(default_factory=list)
    lock: Lock | None = None
    quantise: QuantiseSummary | None = None
    bench: BenchSummary | None = None
    eval: EvalSummary | None = None
    compare: CompareSummary | None = None
    metrics: dict[str, float] = Field(default_factory=dict)
    digests: dict[str, str] = Field(default_factory=dict)

    def path(self, key: str) -> Path | None:
        """Absolute path of a present build output (a FILES key), else None."""
        return self.directory / FILES[key] if key in self.present else None


def _read_json(path: Path, problems: list[str]) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        problems.append(f"{path}: not readable JSON ({exc})")
        return None


def _model(cls: type[M], data: Any, path: Path, problems: list[str]) -> M | None:
    if data is None:
        return None
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(top level)"
        problems.append(f"{path}: {where}: {first['msg']}")
        return None


def read_evidence_dir(directory: Path, release_id: str) -> Evidence:
    """Read the build outputs in `directory` (a release folder) for `release_id`."""
    present = [k for k, rel in FILES.items() if (directory / rel).is_file()]
    missing = [k for k in FILES if k not in present]
    problems: list[str] = []
    digests: dict[str, str] = {}
    for k in present:
        try:
            digests[FILES[k]] = sha256_file(directory / FILES[k])
        except OSError as exc:
            problems.append(f"{directory / FILES[k]}: unreadable ({exc})")

    def load(key: str, cls: type[M]) -> M | None:
        if key not in present:
            return None
        path = directory / FILES[key]
        return _model(cls, _read_json(path, problems), path, problems)

    lock = load("lock", Lock)
    if lock is not None and lock.release_id != release_id:
        problems.append(f"{directory / FILES['lock']}: belongs to release {lock.release_id}")
    ev = Evidence(
        release_id=release_id,
        directory=directory,
        present=present,
        missing=missing,
        problems=problems,
        lock=lock,
        quantise=load("quantise", QuantiseSummary),
        bench=load("bench", BenchSummary),
        eval=load("eval", EvalSummary),
        compare=load("compare", CompareSummary),
        digests=digests,
    )
    for key, owner in (("bench", ev.bench), ("eval", ev.eval)):
        rid = getattr(owner, "release_id", None)
        if rid and rid != release_id:
            problems.append(f"{directory / FILES[key]}: belongs to release {rid}")
    if ev.compare and ev.compare.candidate_release_id not in (None, release_id):
        problems.append(
            f"{directory / FILES['compare']}: compares release {ev.compare.candidate_release_id}"
        )
    return ev.model_copy(update={"metrics": flat_metrics(ev), "problems": problems})


def read_evidence(settings: Settings, release_id: str) -> Evidence:
    """Read a release's build outputs from Settings.release_dir(release_id)."""
    return read_evidence_dir(ReleasePaths.of(settings, release_id).root, release_id)


def _put(out: dict[str, float], name: str, value: Any) -> None:
    if isinstance(value, bool) or value is None:
        return
    if isinstance(value, int | float) and math.isfinite(value):
        out[name] = float(value)


def point_metrics(p: BenchPoint) -> dict[str, float]:
    """A load point's figures under the flat names gates use (latencies in seconds)."""
    out: dict[str, float] = {}
    _put(out, "load", p.load)
    for lat in ("ttft", "tpot", "itl", "e2e"):
        pct: Percentiles = getattr(p, lat)
        for q in ("p50", "p90", "p95", "p99"):
            _put(out, f"{lat}_{q}_s", getattr(pct, q))
        _put(out, f"{lat}_mean_s", pct.mean)
    for name in (
        "request_throughput",
        "output_token_throughput",
        "server_generation_tokens_per_s",
        "goodput",
        "slo_attainment",
    ):
        _put(out, name, getattr(p, name))
    if p.n:
        _put(out, "error_rate", ((p.errors or 0) + (p.timeouts or 0)) / p.n)
    return out


def flat_metrics(ev: Evidence) -> dict[str, float]:
    """Every numeric figure under its flat name: eval.<suite>.pass_rate, bench.knee.ttft_p95_s,
    quantise.size_after_bytes, compare.<suite>.delta, ..."""
    out: dict[str, float] = {}
    if ev.eval:
        for suite, r in ev.eval.suites.items():
            for field in ("pass_rate", "n", "passed", "failed", "errors"):
                _put(out, f"eval.{suite}.{field}", getattr(r, field))
    if ev.bench:
        _put(out, "bench.points", len(ev.bench.points))
        if ev.bench.knee is not None:
            for k, v in point_metrics(ev.bench.knee).items():
                out[f"bench.knee.{k}"] = v
    if ev.quantise:
        for field in ("size_before_bytes", "size_after_bytes", "seconds"):
            _put(out, f"quantise.{field}", getattr(ev.quantise, field))
    if ev.compare:
        for suite, c in ev.compare.suites.items():
            for field in ("delta", "ci_low", "ci_high", "mcnemar_p", "margin"):
                _put(out, f"compare.{suite}.{field}", getattr(c, field))
            _put(out, f"compare.{suite}.flipped_to_fail", len(c.flipped_to_fail))
            _put(out, f"compare.{suite}.flipped_to_pass", len(c.flipped_to_pass))
    return dict(sorted(out.items()))


def sweep_series(ev: Evidence) -> list[tuple[str, float, int]]:
    """The sweep as (bench.sweep.<figure>, value, step) triples, step = point index, for
    plotting against load in MLflow."""
    series: list[tuple[str, float, int]] = []
    if ev.bench:
        for i, p in enumerate(ev.bench.points):
            for k, v in point_metrics(p).items():
                series.append((f"bench.sweep.{k}", v, i))
    return series
