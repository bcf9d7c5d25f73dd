"""The load profile: request shapes, the sweep, and the SLOs that define goodput and the knee."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from releasekit.errors import ManifestError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LengthDist(_Strict):
    """A token-length distribution: fixed, uniform[min, max] or normal(mean, std) clipped."""

    dist: Literal["fixed", "uniform", "normal"] = "fixed"
    value: int | None = Field(None, ge=1)
    min: int | None = Field(None, ge=1)
    max: int | None = Field(None, ge=1)
    mean: float | None = Field(None, gt=0)
    std: float | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _shape(self) -> LengthDist:
        need = {"fixed": ("value",), "uniform": ("min", "max"), "normal": ("mean", "std")}
        missing = [k for k in need[self.dist] if getattr(self, k) is None]
        if missing:
            raise ValueError(f"dist '{self.dist}' needs {', '.join(missing)}")
        if self.dist == "uniform" and (self.min or 0) > (self.max or 0):
            raise ValueError("min must be <= max")
        return self


class Sweep(_Strict):
    """Load points: closed-loop concurrency levels or open-loop Poisson arrival rates."""

    mode: Literal["concurrency", "rate"] = "concurrency"
    points: list[float] = Field(min_length=1)
    requests_per_point: int | None = Field(64, ge=1)
    duration_s: float | None = Field(None, gt=0)
    # Under open-loop arrivals, cap in-flight requests so a dead server can't pile up sockets.
    max_in_flight: int = Field(256, ge=1)
    repetitions: int = Field(
        3, ge=1, le=20, description="runs of each point (the whole sweep repeats)"
    )
    knee_share: float = Field(
        0.66,
        gt=0,
        le=1,
        description="a point holds when its SLOs hold, unflagged, in at least this share of "
        "its runs (0.66: 2 of 3); 1 asks for every run",
    )
    extra_runs: int = Field(
        2,
        ge=0,
        le=10,
        description="more runs of a point whose repetitions disagree on TTFT p95 or goodput "
        "by more than settle_spread; from five runs its spread sets one outlying run aside "
        "on each side (0: never)",
    )
    settle_spread: float = Field(
        0.4,
        gt=0,
        description="relative spread ((max - min) / median of the runs) above which a point "
        "gets its extra_runs (just under the demo environments' max_perf_spread, 0.45: a "
        "point that the perf gates could still judge is not rerun)",
    )

    @model_validator(mode="after")
    def _bounded(self) -> Sweep:
        if self.requests_per_point is None and self.duration_s is None:
            raise ValueError("set requests_per_point or duration_s")
        if any(p <= 0 for p in self.points):
            raise ValueError("points must be > 0")
        if self.mode == "concurrency" and any(p != int(p) for p in self.points):
            raise ValueError("concurrency points must be whole numbers")
        return self


class SLO(_Strict):
    """Per-request SLOs (a request is 'good' when it meets all set ones), and the share of
    good requests a load point needs for its SLOs to hold."""

    ttft_s: float | None = Field(None, gt=0)
    tpot_s: float | None = Field(None, gt=0)
    e2e_s: float | None = Field(None, gt=0)
    attainment: float = Field(0.95, gt=0, le=1)
    max_error_rate: float = Field(0.01, ge=0, le=1)


class LoadProfile(_Strict):
    """A complete, reproducible load profile."""

    name: str
    seed: int = 0
    api: Literal["chat", "completions"] = "completions"
    prompt_tokens: LengthDist = LengthDist(dist="uniform", min=16, max=64)
    output_tokens: LengthDist = LengthDist(dist="fixed", value=64)
    ignore_eos: bool = True
    warmup_requests: int = Field(4, ge=0)
    request_timeout_s: float = Field(60.0, gt=0)
    sweep: Sweep
    slo: SLO = SLO()


def load_profile(path: Path) -> LoadProfile:
    """Read and validate a load profile file; ManifestError lists every problem."""
    if not path.is_file():
        raise ManifestError(path, ["file not found"])
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        return LoadProfile.model_validate(data)
    except yaml.YAMLError as exc:
        raise ManifestError(path, [f"not valid YAML ({exc})"]) from exc
    except ValidationError as exc:
        from releasekit.spec.manifest import _problems

        raise ManifestError(path, _problems(exc)) from exc
