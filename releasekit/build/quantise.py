"""Quantisation: llm-compressor's `oneshot` from a manifest's recipe (GPTQ or round-to-nearest,
W8A8, W4A16, FP8_DYNAMIC or static FP8), reproducibly, saved in compressed-tensors format,
recorded in quantise.json. llm-compressor runs on the GPU where torch sees one (its normal
path), on the CPU otherwise; RELEASEKIT_QUANTISE_DEVICE=cpu|cuda forces either, and the record
says which ran. The output format is the same either way.

On the CPU the quantisation process pins its float code paths before torch loads, as the
demo's training does (releasekit._support.floatpins): MKL's AVX2 branch in strict mode, ATen's
and oneDNN's AVX2 kernels, one thread; so the same recipe gives the same weights whatever the
caller's environment says. RELEASEKIT_QUANTISE_THREADS overrides the thread count (the record
then says the paths were not pinned). quantise.json records what ran (`float_paths`) and on
which host kind (`made_on`).

llm-compressor is heavy and configures global state (loguru, torch threads) on import, so it
runs in a child Python process (`python -m releasekit.build.quantise SPEC.json`); this module only
imports it inside that child.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from releasekit._support.digests import sha256_bytes
from releasekit._support.files import write_atomic
from releasekit._support.floatpins import (
    CPU_PINS,
    float_paths_ran,
    load_mkl_intel_branch,
    pinned_env,
)
from releasekit._support.procs import deferred_signals, die_with_parent_hook, tail
from releasekit._support.progress import (
    Progress,
    emit_marker,
    is_marker,
    parse_marker,
)
from releasekit.config import Settings
from releasekit.errors import QuantiseError
from releasekit.spec.adapters import weight_files, weights_digest
from releasekit.spec.hostcaps import nvidia_gpus
from releasekit.spec.lock import Lock, model_files
from releasekit.spec.manifest import LoadedManifest, Quantisation, Scheme
from releasekit.spec.measured import MeasuredOn, measure_host
from releasekit.spec.quantrecipe import check_recipe, config_groups, needs_calibration

QUANTISE_JSON = "quantise.json"
MODEL_DIR = "model"
THREADS_ENV = "RELEASEKIT_QUANTISE_THREADS"
DEVICE_ENV = "RELEASEKIT_QUANTISE_DEVICE"


class FloatPaths(BaseModel):
    """The float code paths a quantisation on the CPU ran (read back from torch and MKL)."""

    pinned: bool = Field(
        description="the pins held: one thread, MKL's AVX2 branch in strict mode, ATen on AVX2"
    )
    threads: int
    threads_from: Literal["pinned", "RELEASEKIT_QUANTISE_THREADS", "default"] = Field(
        "pinned", description="default: min(4, cores), the count where no pins apply (a GPU)"
    )
    mkl: str = Field(description="the branch MKL ran, as MKL_CBWR names it: AVX2,STRICT")
    aten: str = Field(description="ATen's vector kernels: avx2")
    onednn: str = Field(description="oneDNN's instruction-set cap: AVX2")
    mkl_vendor_check: str | None = Field(
        None, description="how MKL's vendor check was answered (non-Intel processors)"
    )


class QuantiseResult(BaseModel):
    """What quantisation did (written as results/<release_id>/quantise.json)."""

    scheme: Scheme
    method: Literal["gptq", "rtn"]
    size_before_bytes: int = Field(description="bytes of the source model's weight files")
    size_after_bytes: int = Field(description="bytes of the served model's weight files")
    seconds: float = Field(description="wall time of quantisation (0 for scheme none)")
    recipe_digest: str = Field(
        description="sha256 of the recipe.yaml llm-compressor wrote (bytes); for scheme "
        "none, the lock's quantisation/recipe digest"
    )
    model_dir: str = Field(
        description="folder vLLM serves, relative to the project root when inside it"
    )
    weights_digest: str = Field(description="sha256 over the served weight files' sha256s")
    release_id: str | None = None
    calibration_samples: int | None = Field(None, description="samples actually used")
    versions: dict[str, str] = Field(default_factory=dict)
    device: str | None = Field(
        None, description="where llm-compressor ran, e.g. `cuda:0 (NVIDIA H200)` or `cpu`"
    )
    weight_recipe: dict[str, Any] = Field(
        default_factory=dict,
        description="the recipe's weight fields over the scheme's preset ({}: the preset)",
    )
    float_paths: FloatPaths | None = Field(
        None, description="the CPU's float code paths (None on a GPU)"
    )
    made_on: MeasuredOn | None = Field(
        None,
        description="the host kind (CPU weights are byte-identical on hosts of one kind)",
    )


def weights_size(folder: Path) -> int:
    """Total bytes of a model folder's weight files."""
    return sum(p.stat().st_size for p in weight_files(folder))


def read_calibration(path: Path, samples: int) -> list[str]:
    """The first `samples` `text` fields of a JSONL calibration file (file order: the
    calibration set is part of the lock, so no sampling happens here)."""
    texts: list[str] = []
    try:
        with path.open(encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as exc:
                    raise QuantiseError(f"{path}:{n}: not valid JSON ({exc})") from exc
                text = row.get("text") if isinstance(row, dict) else None
                if not isinstance(text, str) or not text:
                    raise QuantiseError(f"{path}:{n}: expected an object with a `text` string")
                texts.append(text)
                if len(texts) >= samples:
                    break
    except OSError as exc:
        raise QuantiseError(f"cannot read calibration set {path}: {exc}") from exc
    if not texts:
        raise QuantiseError(f"calibration set {path} has no samples")
    return texts


def _rel(p: Path, root: Path) -> str:
    """`p` relative to the project root (symlinks inside the project kept), else absolute."""
    absolute = p if p.is_absolute() else Path.cwd() / p
    for base in (root, root.resolve()):
        with contextlib.suppress(ValueError):
            return absolute.relative_to(base).as_posix()
    return absolute.as_posix()


def quantise_release(
    settings: Settings,
    lm: LoadedManifest,
    lock: Lock,
    *,
    progress: Progress | None = None,
) -> QuantiseResult:
    """Quantise a locked release into results/<release_id>/model and write quantise.json.

    `scheme: none` copies nothing: quantise.json points `model_dir` at the model source.
    Raises QuantiseError (quoting llm-compressor's log) if quantisation fails.
    """
    m = lm.manifest
    q = m.quantisation
    src = lm.resolve(m.model.source)
    out_root = settings.release_dir(lock.release_id)
    out_root.mkdir(parents=True, exist_ok=True)
    if q.scheme == "none":
        result = QuantiseResult(
            scheme=q.scheme,
            method=q.method,
            size_before_bytes=weights_size(src),
            size_after_bytes=weights_size(src),
            seconds=0.0,
            recipe_digest=lock.inputs.get("quantisation/recipe", ""),
            model_dir=_rel(src, settings.root),
            weights_digest=weights_digest(src),
            release_id=lock.release_id,
        )
    else:
        calibration = lm.resolve(q.calibration.dataset) if q.calibration else None
        log_path = settings.state_dir / "logs" / f"quantise-{m.name}-{lock.short_id}.log"
        result = quantise_model(
            src,
            out_root / MODEL_DIR,
            q,
            calibration=calibration,
            dtype=m.model.dtype,
            python=settings.python,
            log_path=log_path,
            progress=progress,
        )
        result.model_dir = _rel(out_root / MODEL_DIR, settings.root)
        result.release_id = lock.release_id
    write_atomic(out_root / QUANTISE_JSON, (result.model_dump_json(indent=2) + "\n").encode())
    return result


def quantise_model(
    src: Path,
    out: Path,
    q: Quantisation,
    *,
    calibration: Path | None,
    dtype: str = "bfloat16",
    python: Path | None = None,
    log_path: Path,
    progress: Progress | None = None,
) -> QuantiseResult:
    """Quantise the model folder `src` into `out` (replaced atomically) in a child process.

    Same inputs give byte-identical weights on hosts of one CPU kind (AVX2, AVX-512,
    AVX-512 with AMX: their float kernels differ): the seed is fixed and calibration samples
    are taken in file order (llm-compressor would otherwise shuffle with an unseeded sampler).
    """
    if q.scheme == "none":
        raise QuantiseError("scheme none has nothing to quantise")
    if not (src / "config.json").is_file():
        raise QuantiseError(f"not a model folder (no config.json): {src}")
    needs_data = needs_calibration(q)  # GPTQ; static FP8 calibrates its activation scales
    if needs_data and (q.calibration is None or calibration is None):
        raise QuantiseError(
            f"{q.method} {q.scheme} needs a calibration set (quantisation.calibration)"
        )
    device = os.environ.get(DEVICE_ENV, "auto")
    if device not in ("auto", "cpu", "cuda"):
        raise QuantiseError(
            f"{DEVICE_ENV} must be auto, cpu or cuda (got {device!r})",
            remedy=f"unset {DEVICE_ENV} to use the GPU when there is one",
        )
    if device == "cuda" and not nvidia_gpus():
        raise QuantiseError(
            f"{DEVICE_ENV}=cuda but no NVIDIA GPU is visible here (nvidia-smi lists none)",
            remedy=f"unset {DEVICE_ENV} (or set it to cpu) to quantise on the CPU",
        )
    problems = check_recipe(q, src, calibration if needs_data else None)
    if problems:  # before the child starts
        raise QuantiseError("\n".join(problems))
    if needs_data and calibration is not None and q.calibration is not None:
        read_calibration(calibration, q.calibration.samples)  # fail fast, before the import
    on_cpu = device == "cpu" or (device == "auto" and not nvidia_gpus())
    threads_env = os.environ.get(THREADS_ENV)
    if threads_env is not None and not (threads_env.isdigit() and int(threads_env) >= 1):
        raise QuantiseError(f"{THREADS_ENV} must be a whole number >= 1 (got {threads_env!r})")
    out.parent.mkdir(parents=True, exist_ok=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    spec = {
        "src": str(src),
        "out": str(work / "model"),
        "result": str(work / "result.json"),
        "scheme": q.scheme,
        "method": q.method,
        "ignore": list(q.ignore),
        "seed": q.seed,
        "dampening_frac": q.dampening_frac,
        "dtype": dtype,
        "calibration": str(calibration) if needs_data and calibration else None,
        "samples": q.calibration.samples if q.calibration else 0,
        "max_seq_length": q.calibration.max_seq_length if q.calibration else 0,
        "device": device,
        "weight_recipe": q.weight_recipe(),
        "pinned": on_cpu,
        "threads": int(threads_env) if threads_env else (1 if on_cpu else min(4, _cpus())),
        "threads_from": THREADS_ENV if threads_env else ("pinned" if on_cpu else "default"),
    }
    (work / "spec.json").write_text(json.dumps(spec, indent=2))
    try:
        _run_worker(python or Path(sys.executable), work / "spec.json", log_path, progress)
        try:
            data = json.loads((work / "result.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise QuantiseError(
                f"quantisation wrote no result ({exc}); log: {log_path}\n{tail(log_path)}"
            ) from exc
        if "error" in data:
            raise QuantiseError(
                f"llm-compressor failed: {data['error']} (log: {log_path})\n{tail(log_path)}"
            )
        result = QuantiseResult.model_validate(data)
        if result.float_paths is not None:  # CPU weights depend on the host kind
            result.made_on = measure_host(gpus=[]).model_copy(update={"load_start": None})
        with deferred_signals():  # never leave a half-replaced model folder
            if out.exists():
                shutil.rmtree(out)
            os.replace(work / "model", out)
        result.model_dir = str(out)
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run_worker(python: Path, spec: Path, log_path: Path, progress: Progress | None) -> None:
    """Run the quantisation child; stream its log to `log_path` and its progress markers to
    `progress`. The child dies with us (Ctrl-C, SIGTERM, or our death)."""
    spec_data = json.loads(spec.read_text())
    cpu_only = spec_data.get("device") == "cpu"
    base = dict(os.environ)
    if spec_data.get("pinned"):  # the pins win over the caller's environment
        base = pinned_env(base, int(spec_data["threads"]))
    env = {
        **base,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
        # llm-compressor onloads to any accelerator torch sees: hide them to force the CPU.
        **({"CUDA_VISIBLE_DEVICES": ""} if cpu_only else {}),
    }
    proc: subprocess.Popen[str] | None = None
    with log_path.open("w", encoding="utf-8") as log:
        try:
            with deferred_signals():  # no window where the child runs and nobody stops it
                proc = subprocess.Popen(
                    [str(python), "-m", "releasekit.build.quantise", str(spec)],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    text=True,
                    errors="replace",
                    preexec_fn=die_with_parent_hook(),
                )
            for line in proc.stdout or ():
                if is_marker(line):
                    if progress is not None and (call := parse_marker(line)) is not None:
                        progress(*call)
                    continue
                log.write(line)
                log.flush()
            rc = proc.wait()
        finally:
            if proc is not None and proc.poll() is None:
                with deferred_signals():
                    proc.terminate()
                    try:
                        proc.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
    if rc != 0 and not Path(json.loads(spec.read_text())["result"]).is_file():
        raise QuantiseError(
            f"quantisation process exited with code {rc} (log: {log_path})\n{tail(log_path)}"
        )


# ---- the child process ------------------------------------------------------------------


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str] = {}
    for dist in ("llmcompressor", "compressed-tensors", "transformers", "torch"):
        with contextlib.suppress(PackageNotFoundError):
            out[dist] = version(dist)
    return out


def _copy_side_files(src: Path, out: Path) -> None:
    """Tokenizer files, chat template and generation config, verbatim from the source, so
    the quantised release formats prompts and samples exactly as the source does."""
    weights = {p.resolve() for p in weight_files(src)}
    for f in model_files(src):
        rel = f.relative_to(src)
        if f.resolve() in weights or rel.as_posix() in ("config.json", "recipe.yaml"):
            continue
        dst = out / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, dst)


def _cpus() -> int:
    return os.cpu_count() or 1


def _child(spec_path: Path) -> int:  # pragma: no cover - runs in the worker process
    spec: dict[str, Any] = json.loads(spec_path.read_text())
    result_path = Path(spec["result"])
    if spec.get("pinned") and os.environ.get("MKL_CBWR", "").startswith("AVX2"):
        # Before torch: MKL keeps to its AVX2 branch only on processors it takes for Intel's.
        spec["mkl_vendor_check"] = load_mkl_intel_branch()
        print(f"quantise: {spec['mkl_vendor_check']}", flush=True)
    try:
        result = _quantise_in_process(spec)
    except Exception as exc:
        import traceback

        traceback.print_exc()
        result_path.write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        return 1
    result_path.write_text(result.model_dump_json())
    return 0


def _device_used(torch: Any) -> str:
    """The device llm-compressor's pipelines onload to (`get_main_device`: the accelerator
    when torch has one, else the CPU), named for the record."""
    if not torch.accelerator.is_available():
        return "cpu"
    kind = torch.accelerator.current_accelerator().type
    name = torch.cuda.get_device_name(0) if kind == "cuda" else kind
    return f"{kind}:0 ({name})"


def _quantise_in_process(spec: dict[str, Any]) -> QuantiseResult:
    """Load, calibrate, quantise and save; heavy imports happen here only."""
    from releasekit.spec.lock import chat_template_of

    src, out = Path(spec["src"]), Path(spec["out"])
    emit_marker("quantise: load", 0, 4)
    import torch

    device = _device_used(torch)
    if spec.get("device") == "cuda" and device == "cpu":
        raise QuantiseError(f"{DEVICE_ENV}=cuda but torch {torch.__version__} sees no GPU")
    torch.set_num_threads(int(spec["threads"]))
    torch.manual_seed(int(spec["seed"]))
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()  # time taken by quantisation itself, imports excluded
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype.get(spec["dtype"], "auto"))
    tokenizer = AutoTokenizer.from_pretrained(src)
    # The preset by name, as always, unless the recipe sets weight fields: then the preset's
    # groups with those fields laid over (spec.quantrecipe).
    weight_recipe = spec.get("weight_recipe") or {}
    what: dict[str, Any] = {"targets": "Linear", "scheme": spec["scheme"]}
    if weight_recipe:
        q = Quantisation(scheme=spec["scheme"], method="rtn", **weight_recipe)
        what = {"config_groups": config_groups(q, ["Linear"])}
    modifier: Any
    if spec["method"] == "gptq":
        modifier = GPTQModifier(
            **what, ignore=spec["ignore"], dampening_frac=spec["dampening_frac"]
        )
    else:
        modifier = QuantizationModifier(**what, ignore=spec["ignore"])
    kwargs: dict[str, Any] = {}
    used: int | None = None
    if spec["calibration"]:
        from datasets import Dataset

        texts = read_calibration(Path(spec["calibration"]), int(spec["samples"]))
        bos = tokenizer.bos_token
        rows: dict[str, list[list[int]]] = {"input_ids": [], "attention_mask": []}
        for text in texts:
            enc = tokenizer(
                text,
                truncation=True,
                max_length=int(spec["max_seq_length"]),
                # Calibration text that already starts with BOS (chat-formatted) keeps it once.
                add_special_tokens=not (bos and text.startswith(bos)),
            )
            rows["input_ids"].append(list(enc["input_ids"]))
            rows["attention_mask"].append(list(enc["attention_mask"]))
        used = len(texts)
        kwargs = {
            "dataset": Dataset.from_dict(rows),
            "num_calibration_samples": used,
            "max_seq_length": int(spec["max_seq_length"]),
            "shuffle_calibration_samples": False,
        }
    emit_marker("quantise: calibrate", 1, 4)
    torch.manual_seed(int(spec["seed"]))
    oneshot(model=model, tokenizer=tokenizer, recipe=modifier, **kwargs)
    float_paths = None
    if device == "cpu":
        ran = float_paths_ran()
        float_paths = FloatPaths(
            pinned=bool(spec.get("pinned"))
            and spec.get("threads_from") == "pinned"
            and ran["threads"] == 1
            and ran["mkl"] == CPU_PINS["MKL_CBWR"]
            and ran["aten"] == CPU_PINS["ATEN_CPU_CAPABILITY"],
            threads=int(ran["threads"]),
            threads_from=spec.get("threads_from", "pinned"),
            mkl=str(ran["mkl"]),
            aten=str(ran["aten"]),
            onednn=str(ran["onednn"]),
            mkl_vendor_check=spec.get("mkl_vendor_check"),
        )
    emit_marker("quantise: save", 2, 4)
    model.save_pretrained(out, save_compressed=True)
    _copy_side_files(src, out)
    emit_marker("quantise: check", 3, 4)
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    if "quantization_config" not in config:
        raise QuantiseError(f"llm-compressor wrote no quantization_config in {out}/config.json")
    if chat_template_of(out) != chat_template_of(src):
        raise QuantiseError("the quantised model's chat template differs from the source's")
    recipe = out / "recipe.yaml"
    # recipe.yaml holds !!python/tuple tags that yaml.safe_load refuses: digest its bytes.
    recipe_digest = sha256_bytes(recipe.read_bytes()) if recipe.is_file() else ""
    result = QuantiseResult(
        scheme=spec["scheme"],
        method=spec["method"],
        size_before_bytes=weights_size(src),
        size_after_bytes=weights_size(out),
        seconds=round(time.monotonic() - started, 3),
        recipe_digest=recipe_digest,
        model_dir=str(out),
        weights_digest=weights_digest(out),
        calibration_samples=used,
        versions=_versions(),
        device=device,
        weight_recipe=weight_recipe,
        float_paths=float_paths,
    )
    emit_marker("quantise: done", 4, 4)
    return result


if __name__ == "__main__":  # pragma: no cover
    sys.exit(_child(Path(sys.argv[1])))
