"""The deployment manifest: the versioned schema that binds prompts, weights,
quantisation, serving, evaluation, load, gates, watch rules and the promotion strategy."""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from releasekit.config import WatchRule
from releasekit.errors import ManifestError
from releasekit.spec.adapters import Adapter, check_declared

API_VERSION = "releasekit/v1"
_NAME = r"^[a-z0-9][a-z0-9._-]{0,62}$"


# WatchRule lives in releasekit.config (an environment's `watch_floor` is made of them);
# a manifest's `watch:` rules are the same model.


class _Strict(BaseModel):
    """Base for every manifest section: unknown keys are errors (a typo must not pass)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSource(_Strict):
    """Where the weights come from and how they are served."""

    source: Path = Field(description="folder with HF-format weights, tokenizer and config")
    dtype: Literal["bfloat16", "float16", "float32", "auto"] = "bfloat16"
    served_name: str | None = Field(
        None, description="name the server exposes; default: manifest name"
    )


class Calibration(_Strict):
    """The calibration data llm-compressor sees."""

    dataset: Path = Field(description="JSONL file with a `text` field per line")
    samples: int = Field(128, ge=1, le=100_000)
    max_seq_length: int = Field(256, ge=8, le=32_768)


#: Quantisation schemes (llm-compressor's preset names): int8 weights and activations, 4-bit
#: weights, FP8 weights with per-token dynamic activations, FP8 with static (calibrated)
#: per-tensor activation scales.
Scheme = Literal["none", "W8A8", "W4A16", "FP8_DYNAMIC", "FP8"]
#: The schemes whose weight recipe (strategy, symmetric, group_size) a manifest may set.
RECIPE_SCHEMES = ("W4A16", "W8A8")
#: The weight recipe fields of `Quantisation` (None: the scheme's preset value).
WEIGHT_RECIPE_FIELDS = ("strategy", "symmetric", "group_size")


class Quantisation(_Strict):
    """The quantisation recipe; `scheme: none` passes the model through. FP8 schemes use
    `method: rtn`; static `FP8` calibrates its activation scales on `calibration`."""

    scheme: Scheme = "none"
    method: Literal["gptq", "rtn"] = "gptq"
    ignore: list[str] = Field(default_factory=lambda: ["lm_head"])
    calibration: Calibration | None = None
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = "auto"
    seed: int = 0
    dampening_frac: float = Field(0.01, gt=0, lt=1)
    # The weight recipe, over the scheme's preset (None keeps the preset's value); left out of
    # the lock's recipe dict while None, so manifests without them keep their release ids.
    strategy: Literal["group", "channel"] | None = Field(
        None,
        description="weight scales per group of `group_size` input columns, or one per output "
        "channel (no groups); default: the scheme's preset (W4A16 group, W8A8 channel)",
    )
    symmetric: bool | None = Field(
        None, description="symmetric weight scales (no zero points); default: the preset's"
    )
    group_size: int | None = Field(
        None,
        ge=1,
        description="input columns per weight scale (strategy group); default: the preset's "
        "(128 for W4A16); must divide the in-features of every quantised Linear layer",
    )

    @field_validator("strategy", "symmetric", "group_size")
    @classmethod
    def _int_schemes_only(cls, v: Any, info: ValidationInfo) -> Any:
        if "scheme" not in info.data:  # the scheme itself is wrong: reported on its own
            return v
        scheme = info.data["scheme"]
        if v is not None and scheme not in RECIPE_SCHEMES:
            raise ValueError(
                f"applies to the int schemes {' and '.join(RECIPE_SCHEMES)} only "
                f"(scheme {scheme} keeps llm-compressor's preset)"
            )
        if scheme == "W8A8" and (v == "group" or (info.field_name == "group_size" and v)):
            raise ValueError(
                "W8A8 takes per-channel weight scales (vLLM's int8 W8A8 kernels have no "
                "groups): leave group_size and strategy unset, or use W4A16"
            )
        if scheme == "W8A8" and info.field_name == "symmetric" and v is False:
            raise ValueError("W8A8 takes symmetric weight scales (vLLM's int8 W8A8 kernels)")
        strategy = info.data.get("strategy")
        if info.field_name == "group_size" and v is not None and strategy == "channel":
            raise ValueError(
                f"{v} with strategy channel: per-channel scales have no groups (drop one)"
            )
        return v

    def weight_recipe(self) -> dict[str, Any]:
        """The weight fields this recipe sets over the scheme's preset ({} for the preset)."""
        fields = {k: getattr(self, k) for k in WEIGHT_RECIPE_FIELDS}
        return {k: v for k, v in fields.items() if v is not None}

    @model_validator(mode="after")
    def _needs_calibration(self) -> Quantisation:
        if self.scheme in ("FP8_DYNAMIC", "FP8") and self.method != "rtn":
            raise ValueError(
                f"scheme {self.scheme} takes method rtn (FP8 rounds to nearest; gptq is for "
                "the int schemes)"
            )
        if self.scheme != "none" and self.method == "gptq" and self.calibration is None:
            raise ValueError("gptq needs a calibration set (quantisation.calibration)")
        if self.scheme == "FP8" and self.calibration is None:
            raise ValueError(
                "static FP8 calibrates its activation scales: set quantisation.calibration "
                "(or use FP8_DYNAMIC, which needs no data)"
            )
        return self


class PromptFile(_Strict):
    """One prompt template file; `{{ name }}` placeholders bind from `variables` at lock
    time, and the rest (e.g. `{{ question }}`) from each eval item or request."""

    file: Path
    variables: dict[str, str] = Field(default_factory=dict)


PlainChat = Literal["as_sent", "template"]


class Prompts(_Strict):
    """The release's chat prompts: the offline suites and the gateway's templated route
    (`/v1/templates/chat/chat/completions`) always render them; `plain_chat` says whether a
    plain `/v1/chat/completions` request (the client's own messages) goes through them too."""

    system: PromptFile | None = None
    user: PromptFile
    plain_chat: PlainChat = Field(
        "as_sent",
        description="`as_sent`: a plain chat request reaches the engine as the client sent "
        "it. `template`: its last user message (text) is rendered through the user "
        "template (whose one placeholder it fills), and the system prompt is put first when "
        "the client sends no system message of its own",
    )


class Serving(_Strict):
    """vLLM engine arguments (flag names without `--`, `_` or `-` alike) and environment."""

    args: dict[str, str | int | float | bool | None] = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict)

    @field_validator("args")
    @classmethod
    def _no_owned_flags(cls, v: dict[str, Any]) -> dict[str, Any]:
        owned = {"model", "port", "host", "served-model-name", "dtype"}
        clash = sorted(k for k in v if k.replace("_", "-") in owned)
        if clash:
            raise ValueError(
                f"{', '.join(clash)} are set by releasekit (model.source/dtype/served_name, port)"
            )
        return v


ScorerName = Literal[
    "exact_match", "contains", "regex", "numeric", "json_schema", "refusal", "judge"
]


class Suite(_Strict):
    """One eval suite: a JSONL file of items, the default scorer and the pass criteria."""

    name: str = Field(pattern=_NAME)
    kind: Literal["core", "edge", "regression"]
    path: Path
    scorer: ScorerName = "exact_match"
    max_tokens: int = Field(32, ge=1, le=4096)
    min_pass_rate: float | None = Field(None, ge=0, le=1)
    margin: float = Field(
        0.05,
        ge=0,
        le=1,
        description="non-inferiority margin: candidate may be at most this much worse",
    )
    critical: bool = Field(
        False,
        description="a suite the business cannot lose on: the quantisation ladder stops at "
        "the first recipe inferior on it (decides, changes no evidence: not in the release id)",
    )
    adapter: str | None = Field(
        None,
        description="the adapter (adapters[].name) whose answers the suite scores; none: "
        "the base model's",
    )

    def locked_fields(self) -> dict[str, Any]:
        """The fields that shape the suite's evidence, as the lock digests them (its path is
        digested as file bytes; `critical` decides and changes no evidence; `adapter` only
        when set, so a suite of the base keeps the digest it had before adapters existed)."""
        exclude = {"path", "critical"} | ({"adapter"} if self.adapter is None else set())
        return self.model_dump(mode="json", exclude=exclude)


class Judge(_Strict):
    """A pinned LLM judge on any OpenAI-compatible endpoint."""

    endpoint: str
    model: str
    prompt: Path = Field(description="judge prompt template file (digested into the lock)")
    rubric: str
    temperature: float = Field(0.0, ge=0, le=0)
    timeout_s: float = Field(30.0, gt=0)
    api_key_env: str | None = None


class Eval(_Strict):
    """Evaluation: suites, optional judge, the baseline to compare with."""

    suites: list[Suite] = Field(min_length=1)
    judge: Judge | None = None
    baseline: Path | None = Field(None, description="manifest of the baseline release")
    confidence: float = Field(0.95, gt=0.5, lt=1)
    bootstrap_samples: int = Field(2000, ge=100, le=100_000)
    seed: int = 0

    @model_validator(mode="after")
    def _unique(self) -> Eval:
        names = [s.name for s in self.suites]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"suite names must be unique: {', '.join(dupes)}")
        if self.judge is None and any(s.scorer == "judge" for s in self.suites):
            raise ValueError("a suite uses scorer 'judge' but eval.judge is not set")
        return self


class Load(_Strict):
    """The load profile (a file, so releases compared share it byte for byte)."""

    profile: Path


class Gate(_Strict):
    """One promotion gate, compared against the release live in the target environment."""

    metric: str = Field(description="e.g. eval.core.pass_rate, bench.knee.ttft_p95_s")
    kind: Literal["non_inferior", "max_increase", "min", "max"] = "non_inferior"
    threshold: float | None = None
    margin: float | None = None


CanaryMetric = Literal["ttft_p95_s", "tpot_p95_s", "error_rate", "negative_feedback_rate"]
LATENCY_CHECKS = frozenset({"ttft_p95_s", "tpot_p95_s"})
"""The canary checks that judge latency (quantiles); the others judge rates."""
QUANTILE_MIN_SAMPLES = 10
"""Fewest samples a quantile check may judge on: below it a p95 check at confidence 0.95
can hardly breach (at 1 sample it never can; `rollout.power`)."""


class CanaryCheck(_Strict):
    """One figure a canary step compares with the stable release over the same window: it
    breaches when the canary's value is above `stable x (1 + tolerance) + slack` by more
    than sampling noise explains (`confidence`). Below `min_samples` (requests, or feedback
    answers) on either side the check waits."""

    metric: CanaryMetric
    tolerance: float = Field(0.5, ge=0, description="relative to stable's figure")
    slack: float = Field(0.0, ge=0, description="absolute allowance on top (rates: 0.02)")
    min_samples: int = Field(20, ge=1)
    confidence: float = Field(
        0.95,
        gt=0.5,
        lt=1.0,
        description="a figure above its limit breaches only when the canary's count above it "
        "(observations over the limit, errors, negative answers) is this unlikely to be "
        "sampling noise: one-sided binomial p-value below 1 - confidence",
    )
    required: bool = Field(
        True,
        description="the step waits for this check's samples; False: judged when it has "
        "them (feedback is often sparse)",
    )

    @field_validator("min_samples")
    @classmethod
    def _enough_for_a_quantile(cls, v: int, info: Any) -> int:
        metric = str(info.data.get("metric", ""))
        if re.search(r"_p\d+_s$", metric) and v < QUANTILE_MIN_SAMPLES:
            raise ValueError(
                f"min_samples must be at least {QUANTILE_MIN_SAMPLES} for a quantile check "
                f"({metric}), got {v}: below it the check can hardly breach"
            )
        return v


def default_checks() -> list[CanaryCheck]:
    """The canary checks a manifest gets when it names none."""
    return [
        CanaryCheck(metric="ttft_p95_s", tolerance=0.5, slack=0.05),
        CanaryCheck(metric="tpot_p95_s", tolerance=0.5, slack=0.005, required=False),
        CanaryCheck(metric="error_rate", tolerance=0.0, slack=0.02),
        CanaryCheck(
            metric="negative_feedback_rate",
            tolerance=0.5,
            slack=0.05,
            min_samples=10,
            required=False,
        ),
    ]


class CanaryStep(_Strict):
    """One step: send `weight` percent of new requests to the canary, for at least
    `min_duration_s` and `min_requests` canary requests, then judge."""

    weight: float = Field(gt=0, le=100, description="percent of traffic to the canary")
    min_duration_s: float = Field(30.0, ge=0)
    min_requests: int = Field(20, ge=0)
    max_duration_s: float = Field(
        600.0, gt=0, description="without enough samples by then: abort (insufficient evidence)"
    )


class Canary(_Strict):
    """Canary steps (promotion.canary): weights that rise to 100, each judged live against
    the stable release; a breach sends all traffic back to stable at once."""

    steps: list[CanaryStep] = Field(min_length=1)
    checks: list[CanaryCheck] = Field(default_factory=default_checks)
    interval_s: float = Field(2.0, gt=0, le=60, description="seconds between judgements")
    sustain: int = Field(
        2, ge=1, description="consecutive breaching judgements of a check before aborting"
    )
    warmup_requests: int = Field(
        8,
        ge=0,
        le=256,
        description="requests sent at once straight to a canary on its own server before its "
        "first step (answers discarded, never judged): a fresh vLLM's first requests are slow",
    )
    settle_s: float = Field(
        4.0,
        ge=0,
        le=300,
        description="seconds after each weight change left out of the step's window",
    )
    baseline: Literal["live", "fresh"] = Field(
        "live",
        description="what the canary is judged against: `live`, the servers serving now; "
        "`fresh`, a new server of the live release started with the canary, warmed and "
        "placed like it and given the same share of traffic (baseline + canary): both "
        "are judged under the same conditions",
    )

    @model_validator(mode="after")
    def _rising(self) -> Canary:
        weights = [s.weight for s in self.steps]
        if any(b <= a for a, b in itertools.pairwise(weights)):
            raise ValueError(f"canary weights must rise step by step, got {weights}")
        over = [w for w in weights if 50 < w < 100]
        if self.baseline == "fresh" and over:
            raise ValueError(
                f"with baseline: fresh the baseline takes as much traffic as the canary, so "
                f"a judged step's weight can be at most 50, got {over}"
            )
        metrics = [c.metric for c in self.checks]
        dupes = sorted({m for m in metrics if metrics.count(m) > 1})
        if dupes:
            raise ValueError(f"canary checks name a metric twice: {', '.join(dupes)}")
        return self

    @property
    def judges_latency(self) -> bool:
        """True when these steps can stand in for the offline perf comparison with the live
        release: some step below 100% is judged, and a latency quantile check
        (`ttft_p95_s` or `tpot_p95_s`) is required there. A canary of `[{weight: 100}]`
        (never judged), `checks: []` or only rate checks judges no latency."""
        judged = any(s.weight < 100 for s in self.steps)
        return judged and any(c.required and c.metric in LATENCY_CHECKS for c in self.checks)


class Promotion(_Strict):
    """How a release takes traffic when promoted (not part of the release id, like `watch`)."""

    canary: Canary | None = Field(None, description="canary steps; none: one switch")


class Environment(_Strict):
    """Where a release can be promoted to."""

    name: str = Field(pattern=_NAME)
    requires: str | None = Field(None, description="environment it must pass first")


class Manifest(_Strict):
    """A deployment manifest (apiVersion releasekit/v1)."""

    api_version: Literal["releasekit/v1"] = Field(alias="apiVersion")
    kind: Literal["Deployment"] = "Deployment"
    name: str = Field(pattern=_NAME)
    description: str = ""
    model: ModelSource
    adapters: list[Adapter] = Field(
        default_factory=list,
        description="LoRA adapters served on the base, each under its own model name",
    )
    quantisation: Quantisation = Quantisation()
    prompts: Prompts
    serving: Serving = Serving()
    eval: Eval
    load: Load
    gates: list[Gate] = Field(default_factory=list)
    watch: list[WatchRule] = Field(default_factory=list)
    promotion: Promotion = Promotion()
    environments: list[Environment] = Field(
        default_factory=lambda: [
            Environment(name="staging"),
            Environment(name="production", requires="staging"),
        ]
    )

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @property
    def served_name(self) -> str:
        """Name the vLLM server exposes the model under."""
        return self.model.served_name or self.name

    @model_validator(mode="after")
    def _adapters(self) -> Manifest:
        problems = check_declared(
            self.adapters, served_name=self.served_name, serving_args=self.serving.args
        )
        names = {a.name for a in self.adapters}
        problems += [
            f"eval.suites[{i}].adapter: {s.adapter!r} is not one of adapters[].name"
            for i, s in enumerate(self.eval.suites)
            if s.adapter is not None and s.adapter not in names
        ]
        if problems:
            raise ValueError("; ".join(problems))
        return self


class LoadedManifest(BaseModel):
    """A manifest with the path it came from; relative paths resolve against `base`."""

    model_config = ConfigDict(frozen=True)

    path: Path
    base: Path
    manifest: Manifest

    def resolve(self, p: Path) -> Path:
        """Resolve a manifest path (relative to the project root)."""
        return p if p.is_absolute() else (self.base / p)


def _format_loc(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts[-1:] = [f"{parts[-1]}[{item}]"] if parts else [f"[{item}]"]
        elif item in ("function-after", "function-before") or str(item).startswith(
            ("function-", "literal[")
        ):
            continue
        else:
            parts.append(str(item))
    return ".".join(parts) or "(top level)"


def _problems(exc: ValidationError) -> list[str]:
    out = []
    for err in exc.errors():
        loc = _format_loc(tuple(err["loc"]))
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key (typo?)"
        elif err["type"] == "missing":
            msg = "required field is missing"
        msg = re.sub(r"^Value error, ", "", msg)
        out.append(f"{loc}: {msg}")
    return out


def parse_manifest(data: Any, *, path: Path) -> Manifest:
    """Validate already-loaded YAML data; raise ManifestError listing every problem."""
    if not isinstance(data, dict):
        raise ManifestError(path, ["(top level): expected a mapping of manifest fields"])
    try:
        return Manifest.model_validate(data)
    except ValidationError as exc:
        raise ManifestError(path, _problems(exc)) from exc


def load_manifest(path: Path | str, *, root: Path | None = None) -> LoadedManifest:
    """Read and validate a manifest file. Relative paths inside it resolve against `root`
    (the project root), defaulting to the manifest's parent's project root."""
    from releasekit.config import find_root

    path = Path(path)
    if not path.is_file():
        raise ManifestError(
            path, ["file not found"], remedy="check the path; manifests live under manifests/"
        )
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        where = getattr(exc, "problem_mark", None)
        line = f"line {where.line + 1}: " if where is not None else ""
        raise ManifestError(
            path, [f"{line}not valid YAML ({getattr(exc, 'problem', exc)})"]
        ) from exc
    manifest = parse_manifest(data, path=path)
    base = (root or find_root(path.resolve().parent)).resolve()
    return LoadedManifest(path=path.resolve(), base=base, manifest=manifest)


class NamedFile(BaseModel):
    """One file or folder a manifest names: its field path, the path as written, its role."""

    field: str
    path: Path
    is_dir: bool = False
    role: Literal[
        "model", "adapter", "prompt", "profile", "calibration", "suite", "judge", "baseline"
    ]


def named_files(m: Manifest) -> list[NamedFile]:
    """Every file a manifest names, in field order: the one list validate, lock and build
    read (paths as written; resolve them with LoadedManifest.resolve)."""
    out = [NamedFile(field="model.source", path=m.model.source, is_dir=True, role="model")]
    out += [
        NamedFile(field=f"adapters[{i}].path", path=a.path, is_dir=True, role="adapter")
        for i, a in enumerate(m.adapters)
    ]
    if m.prompts.system:
        out.append(
            NamedFile(field="prompts.system.file", path=m.prompts.system.file, role="prompt")
        )
    out.append(NamedFile(field="prompts.user.file", path=m.prompts.user.file, role="prompt"))
    out.append(NamedFile(field="load.profile", path=m.load.profile, role="profile"))
    if m.quantisation.calibration:
        out.append(
            NamedFile(
                field="quantisation.calibration.dataset",
                path=m.quantisation.calibration.dataset,
                role="calibration",
            )
        )
    for i, s in enumerate(m.eval.suites):
        out.append(NamedFile(field=f"eval.suites[{i}].path", path=s.path, role="suite"))
    if m.eval.judge:
        out.append(NamedFile(field="eval.judge.prompt", path=m.eval.judge.prompt, role="judge"))
    if m.eval.baseline:
        out.append(NamedFile(field="eval.baseline", path=m.eval.baseline, role="baseline"))
    return out


def check_files(lm: LoadedManifest) -> list[str]:
    """Return `field.path: problem` for each file the manifest names that is missing."""
    checks = [(f.field, f.path, f.is_dir) for f in named_files(lm.manifest)]
    problems = []
    for field, p, is_dir in checks:
        full = lm.resolve(p)
        ok = full.is_dir() if is_dir else full.is_file()
        if not ok:
            hint = " (run `dvc repro` to produce it)" if is_dir else ""
            problems.append(f"{field}: {'folder' if is_dir else 'file'} not found: {p}{hint}")
    return problems


def _gate_line(g: Gate) -> str:
    extra = "".join(
        f", {k}: {v:g}"
        for k, v in (("threshold", g.threshold), ("margin", g.margin))
        if v is not None
    )
    return f"{{metric: {g.metric}, kind: {g.kind}{extra}}}"


def check_gates(m: Manifest) -> list[str]:
    """`gates[i]: problem` for each gate line that decides nothing, saying which field
    decides instead: a relative line on an eval suite (the quality gate compares every suite
    with the live release at the suite's `margin`), a `min`/`max` line without a
    `threshold`, a field the line's kind ignores, a metric no gate reads, or a line that
    repeats an earlier one (only the first is read)."""
    suites = {s.name: i for i, s in enumerate(m.eval.suites)}
    problems: list[str] = []
    seen: dict[tuple[str, str], int] = {}
    for i, g in enumerate(m.gates):
        where, line = f"gates[{i}]", _gate_line(g)
        parts = g.metric.split(".")
        relative = g.kind in ("non_inferior", "max_increase")
        if parts[0] == "eval" and len(parts) == 3:
            if parts[1] not in suites:
                problems.append(
                    f"{where}: {line} names suite {parts[1]!r}, which eval.suites does not have"
                )
                continue
            if relative:
                k = suites[parts[1]]
                problems.append(
                    f"{where}: {line} is never read: the quality gate compares suite "
                    f"{parts[1]} with the live release at eval.suites[{k}].margin (capped by "
                    "the environment's max_margin), and on a first promotion holds it to the "
                    "environment's min_pass_rate (eval.suites[].min_pass_rate may raise it); "
                    "remove the line, or use kind min with a threshold"
                )
                continue
        elif not (parts[:2] == ["bench", "knee"] and len(parts) == 3 and parts[2]):
            problems.append(
                f"{where}: {line} is never read: gates read eval.<suite>.<figure> "
                "(kind min or max, with a threshold) or bench.knee.<figure>"
            )
            continue
        if not relative and g.threshold is None:
            problems.append(
                f"{where}: {line} does nothing without a threshold: set threshold (the bound "
                f"{g.metric} must meet), or remove the line"
            )
            continue
        if not relative and g.margin is not None:
            problems.append(
                f"{where}: {line}: kind {g.kind} reads threshold, not margin; remove margin"
            )
        if relative and g.threshold is not None:
            problems.append(
                f"{where}: {line}: kind {g.kind} reads margin (a fraction of the live "
                "release's figure), not threshold; remove threshold, or use kind min or max"
            )
        key = (g.metric, "relative" if relative else g.kind)
        if key in seen:
            problems.append(
                f"{where}: {line} is never read: gates[{seen[key]}] already sets "
                f"{g.metric} ({'margin' if relative else 'threshold'}), and only the first is read"
            )
        else:
            seen[key] = i
    return problems
