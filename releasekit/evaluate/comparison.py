"""The comparison document: the strict models of a paired comparison (per side, per flipped
item, per suite, whole), which refuse a verdict their own numbers contradict, and
compare.json written and read back (EvidenceError for anything releasekit did not write)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from releasekit.errors import EvalError, InputMissingError
from releasekit.evaluate.runner import SuiteNoise
from releasekit.evaluate.suites import Expected
from releasekit.evaluate.verdicts import DEFAULT_MIN_PAIRED, Verdict, worst

COMPARE_JSON = "compare.json"
"""The comparison's file name in a release's report folder."""

_STRICT = ConfigDict(extra="forbid")


class EvidenceError(EvalError):
    """Raised when stored evidence (compare.json) cannot be read back by the strict model
    that wrote it: not JSON, an unknown field, a verdict spelled another way, or verdicts
    that contradict their own statistics."""

    remedy = (
        "do not edit evidence files by hand; rebuild the release's report "
        "(`releasekit eval MANIFEST` or `releasekit build MANIFEST`)"
    )


class SideCounts(BaseModel):
    """One release's outcomes in one suite. `passed` includes the errors of items that
    expect one (`expected_errors`); `errors` are the other errors, counted as failures."""

    model_config = _STRICT

    n: int
    passed: int
    failed: int
    errors: int
    expected_errors: int = 0
    pass_rate: float | None = Field(description="passed / n: errors count as failures")
    error_rate: float | None = Field(description="errors / n")
    digest: str = Field("", description="sha256 of the suite file this side read")


class FlippedItem(BaseModel):
    """An item whose verdict changed between baseline and candidate, with both answers (an
    error's message stands in for the answer)."""

    model_config = _STRICT

    id: str
    direction: Literal["pass->fail", "fail->pass"]
    vars: dict[str, str] = Field(default_factory=dict)
    expected: Expected = None
    baseline_output: str | None = None
    candidate_output: str | None = None
    baseline_detail: str = ""
    candidate_detail: str = ""


class SuiteComparison(BaseModel):
    """The paired comparison of one suite (see `releasekit.evaluate.compare`)."""

    model_config = _STRICT

    kind: str = ""
    adapter: str | None = Field(
        None, description="the adapter whose answers the suite scores (None: the base's)"
    )
    verdict: Verdict
    reasons: list[str] = Field(default_factory=list, description="why, in words")
    margin: float
    min_paired: int = DEFAULT_MIN_PAIRED
    n_paired: int = 0
    baseline: SideCounts | None = None
    candidate: SideCounts | None = None
    baseline_pass_rate: float | None = Field(None, description="over the paired items")
    candidate_pass_rate: float | None = Field(None, description="over the paired items")
    delta: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    interval_verdict: Verdict | None = Field(
        None, description="what the interval alone says against -margin (and 0)"
    )
    score_delta: float | None = None
    score_ci_low: float | None = None
    score_ci_high: float | None = None
    mcnemar_p: float | None = None
    both_pass: int = 0
    both_fail: int = 0
    flipped_to_fail: list[str] = Field(default_factory=list)
    flipped_to_pass: list[str] = Field(default_factory=list)
    errors_only_candidate: int = Field(0, description="pairs where only the candidate errored")
    errors_only_baseline: int = Field(0, description="pairs where only the baseline errored")
    error_regression_p: float | None = Field(
        None, description="one-sided exact test that the candidate errors more"
    )
    error_regression: bool = False
    unpaired: int = Field(0, description="ids present in only one of the two results")
    same_suite_file: bool | None = Field(
        None, description="both evals read a suite file with the same sha256"
    )
    baseline_noise: SuiteNoise | None = None
    candidate_noise: SuiteNoise | None = None
    flips: list[FlippedItem] = Field(default_factory=list)

    @property
    def passed(self) -> bool:
        """True when this suite passes a gate (`Verdict.passed`)."""
        return self.verdict.passed

    @model_validator(mode="after")
    def _consistent(self) -> SuiteComparison:
        # A verdict that its own numbers do not support is not evidence (hand-edited or
        # written by a bug): refuse it here, at construction and when read back.
        if not self.verdict.passed:
            return self
        lo = self.ci_low
        if self.n_paired < self.min_paired or lo is None or self.error_regression:
            raise ValueError(f"verdict {self.verdict.value} contradicts the statistics")
        bound = 0.0 if self.verdict is Verdict.SUPERIOR else -self.margin
        if not lo > bound:
            raise ValueError(f"verdict {self.verdict.value} contradicts ci_low {lo}")
        return self


class Comparison(BaseModel):
    """Candidate vs baseline across suites; `verdict` is the worst suite verdict and
    `passed` is what a gate reads."""

    model_config = _STRICT

    baseline_release_id: str | None
    candidate_release_id: str | None
    baseline_name: str = ""
    candidate_name: str = ""
    verdict: Verdict
    confidence: float
    interval: Literal["newcombe-hybrid-score-10"] = "newcombe-hybrid-score-10"
    min_paired: int = DEFAULT_MIN_PAIRED
    bootstrap_samples: int = Field(description="resamples for the score delta")
    seed: int
    rule: str = ""
    suites: dict[str, SuiteComparison]
    missing_suites: list[str] = Field(
        default_factory=list, description="suites not evaluated on both sides (missing_evidence)"
    )
    warnings: list[str] = Field(default_factory=list)

    @property
    def passed(self) -> bool:
        """True when every suite passes (`Verdict.passed` of the worst verdict)."""
        return self.verdict.passed

    def failing_suites(self) -> list[str]:
        """The names of the suites whose verdict fails a gate."""
        return [name for name, s in self.suites.items() if not s.passed]

    @model_validator(mode="after")
    def _consistent(self) -> Comparison:
        expected = worst([s.verdict for s in self.suites.values()])
        if self.verdict is not expected:
            raise ValueError(
                f"verdict {self.verdict.value} is not the worst suite verdict ({expected.value})"
            )
        return self


def _problems(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(document)"
        msg = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
        parts.append(f"{loc}: {msg}")
    return "; ".join(parts[:10]) + (f"; and {len(parts) - 10} more" if len(parts) > 10 else "")


def parse_comparison(data: str | bytes, *, source: str = "compare.json") -> Comparison:
    """Validate a comparison document with the strict model that wrote it. EvidenceError
    names each `field.path: problem` (an unknown field, a verdict spelled another way,
    a verdict its own numbers contradict)."""
    try:
        return Comparison.model_validate_json(data)
    except ValidationError as exc:
        raise EvidenceError(
            f"{source}: not a comparison releasekit wrote: {_problems(exc)}"
        ) from exc


def load_comparison(path: Path | str) -> Comparison:
    """Read a comparison back: `path` is a compare.json or a report folder holding one.
    InputMissingError if absent; EvidenceError if it is not exactly what releasekit writes."""
    p = Path(path)
    if p.is_dir():
        p = p / COMPARE_JSON
    if not p.is_file():
        raise InputMissingError(p, what="comparison (compare.json)")
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise EvidenceError(f"{p}: unreadable: {exc}") from exc
    return parse_comparison(data, source=str(p))


def dump_comparison(comparison: Comparison) -> bytes:
    """The compare.json bytes for `comparison` (what `load_comparison` reads back)."""
    return (comparison.model_dump_json(indent=2) + "\n").encode()
