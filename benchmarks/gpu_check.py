"""GPU check: the demo model quantised on the GPU (W8A8, W4A16, FP8_DYNAMIC, static FP8) by
releasekit's own quantisation (llm-compressor in a child process, as `releasekit build`
runs it), each release evaluated against bf16 through transformers on the GPU with
releasekit's scorers and paired comparison, the device's memory bandwidth, and the bf16
demo's decode rate at batch 1 against its roofline. One JSON.

It needs torch with CUDA, transformers and llm-compressor; not vLLM, not the network.

    python benchmarks/gpu_check.py                      # all schemes, every eval item
    python benchmarks/gpu_check.py --schemes W8A8,FP8_DYNAMIC --limit 40

Without a CUDA device (or with --device cpu) everything runs on the CPU instead and the JSON
says so (`device.fallback`); it is written to gpu_check.cpu.json so that it never stands in
for GPU figures. The evaluation is releasekit's, minus the server: the same prompts (the
manifest's system and user templates through the model's chat template), greedy decoding,
the same scorers, items whose prompt plus max_tokens exceed the manifest's max-model-len
rejected as vLLM rejects them, and the same paired comparison (compare_suite) with the
manifest's margins, confidence and bootstrap settings.

Bandwidth is measured twice, two ways: a device-to-device copy timed with CUDA events
(releasekit's roofline measure) and a clone timed by the host clock; on the CPU a numpy copy
and a torch copy. The decode rate at batch 1 is measured twice as well: a KV-cached step
loop, and `generate` of N tokens minus `generate` of one.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ALL_SCHEMES = ("W8A8", "W4A16", "FP8_DYNAMIC", "FP8")
#: What the script imports; a machine without one of them is told which wheels to carry.
NEEDED = (
    "torch",
    "transformers",
    "llmcompressor",
    "compressed_tensors",
    "datasets",
    "safetensors",
    "numpy",
    "scipy",
    "pydantic",
    "pydantic_settings",
    "yaml",
    "httpx",
)


class Missing(SystemExit):
    """The check cannot run here; the message names what is missing."""

    def __init__(self, what: str) -> None:
        super().__init__(f"gpu_check: cannot run: {what}")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=REPO / "models" / "demo-base")
    ap.add_argument(
        "--schemes",
        default=",".join(ALL_SCHEMES),
        help="comma-separated, of " + ", ".join(ALL_SCHEMES),
    )
    ap.add_argument("--limit", type=int, default=None, help="first N items of each suite")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--batch", type=int, default=64, help="eval prompts generated together")
    ap.add_argument("--decode-tokens", type=int, default=128, help="tokens of the decode test")
    ap.add_argument("--calibration-samples", type=int, default=None, help="override the manifests'")
    ap.add_argument(
        "--out", type=Path, default=None, help="default: benchmarks/results/gpu_check[.cpu].json"
    )
    args = ap.parse_args(argv)
    schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    bad = [s for s in schemes if s not in ALL_SCHEMES]
    if bad or not schemes:
        ap.error(
            f"--schemes: unknown {', '.join(bad) or '(none given)'}; use {', '.join(ALL_SCHEMES)}"
        )
    if args.limit is not None and args.limit < 1:
        ap.error("--limit must be at least 1")
    args.schemes = schemes
    return args


def _check_imports() -> None:
    missing = [m for m in NEEDED if importlib.util.find_spec(m) is None]
    if missing:
        raise Missing(f"no {', '.join(missing)} for {sys.executable}: carry their wheels")


# ---- device, bandwidth, decode ------------------------------------------------------------


def _device(want: str) -> tuple[str, dict[str, Any]]:
    import torch

    info: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    has_cuda = torch.cuda.is_available()
    if want == "cuda" and not has_cuda:
        raise Missing(f"--device cuda but torch {torch.__version__} sees no CUDA device")
    if has_cuda and want != "cpu":
        p = torch.cuda.get_device_properties(0)
        info.update(
            kind="cuda",
            name=p.name,
            capability=f"{p.major}.{p.minor}",
            memory_bytes=int(p.total_memory),
            fallback=None,
        )
        return "cuda", info
    why = "--device cpu" if want == "cpu" else "torch sees no CUDA device"
    info.update(
        kind="cpu", name=_cpu_name(), fallback=f"{why}: everything ran on the CPU; no GPU figures"
    )
    return "cpu", info


def _cpu_name() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def bandwidth(device: str) -> dict[str, Any]:
    """Memory bandwidth two ways (GB/s, bytes read plus written)."""
    import torch

    from releasekit.capacity.roofline import device_copy_bandwidth_gbs, measure_bandwidth_gbs

    n = (1024 if device == "cuda" else 256) * 2**20 // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.zeros_like(src)  # both touched first: page faults stay out of the timing
    best = math.inf
    for _ in range(5):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    independent = 2 * src.numel() * 4 / best / 1e9
    del src, dst
    if device == "cuda":
        measured = device_copy_bandwidth_gbs()
        if measured is None:  # pragma: no cover - CUDA vanished between the two calls
            raise Missing("torch lost its CUDA device")
        gbs, method = measured[0], "device-to-device copy, CUDA events (releasekit roofline)"
        props = torch.cuda.get_device_properties(0)
        clock_khz = getattr(props, "memory_clock_rate", None)
        bus_bits = getattr(props, "memory_bus_width", None)
        spec = 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9 if clock_khz and bus_bits else None
    else:
        gbs, method, spec = measure_bandwidth_gbs(), "numpy copy (releasekit roofline)", None
    return {
        "gbs": gbs,
        "method": method,
        "independent_gbs": independent,
        "independent_method": f"torch copy_ on {device}, host clock",
        "ratio": independent / gbs,
        "device_spec_gbs": spec,
    }


def decode_rate(model: Any, tok: Any, device: str, tokens: int) -> dict[str, Any]:
    """Batch-1 decode tokens/s: a KV-cached step loop, and generate(N) - generate(1)."""
    import torch

    ids = tok("The capital of", return_tensors="pt").to(device)
    best_loop = math.inf
    with torch.no_grad():
        for _ in range(3):
            out = model(**ids, use_cache=True)
            past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(tokens):
                out = model(input_ids=nxt, past_key_values=past, use_cache=True)
                past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
            _sync(device)
            best_loop = min(best_loop, time.perf_counter() - t0)

        def gen(n: int) -> float:
            _sync(device)
            t0 = time.perf_counter()
            model.generate(
                **ids,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
            )
            _sync(device)
            return time.perf_counter() - t0

        gen(2)  # warm-up
        many = min(gen(tokens + 1) for _ in range(3))
        one = min(gen(1) for _ in range(3))
    return {
        "tokens": tokens,
        "step_loop_tokens_per_s": tokens / best_loop,
        "generate_tokens_per_s": tokens / max(many - one, 1e-9),
    }


# ---- evaluation ---------------------------------------------------------------------------


def _load(path: Path, device: str) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device)
    model.eval()
    return model, tok


def evaluate(
    model: Any,
    tok: Any,
    lm: Any,
    suites: list[Any],
    *,
    device: str,
    batch: int,
    max_model_len: int,
) -> dict[str, list[Any]]:
    """Every suite's items answered by `model` and scored with releasekit's scorers."""
    import torch

    from releasekit.evaluate import scorers
    from releasekit.evaluate.runner import ItemResult, build_prompt

    prompt = build_prompt(lm)
    out: dict[str, list[Any]] = {}
    for ls in suites:
        records: dict[str, Any] = {}
        todo: dict[int, list[tuple[Any, list[int]]]] = {}
        for item in ls.items:
            text = tok.apply_chat_template(
                prompt.messages(item.vars), tokenize=False, add_generation_prompt=True
            )
            ids = tok(text, add_special_tokens=False)["input_ids"]
            max_tokens = item.max_tokens or ls.suite.max_tokens
            scorer = item.scorer_for(ls.suite)
            base = {
                "id": item.id,
                "suite": ls.suite.name,
                "scorer": scorer,
                "expected": item.expected,
                "vars": item.vars,
                "tags": item.tags,
                "expect_error": item.expect_error,
            }
            if len(ids) + max_tokens > max_model_len:  # vLLM answers 400 here
                why = (
                    f"{len(ids)} prompt + {max_tokens} output tokens > max-model-len "
                    f"{max_model_len}"
                )
                s = scorers.rejected(400, why, expect_error=item.expect_error)
                records[item.id] = ItemResult(
                    **base,
                    outcome=s.outcome,
                    score=s.score,
                    detail=s.detail,
                    http_status=400,
                    error=why,
                )
                continue
            todo.setdefault(max_tokens, []).append((item, ids))
            records[item.id] = base
        for max_tokens, group in todo.items():
            for start in range(0, len(group), batch):
                chunk = group[start : start + batch]
                width = max(len(ids) for _, ids in chunk)
                pad = tok.pad_token_id if tok.pad_token_id is not None else 0
                input_ids = torch.tensor(
                    [[pad] * (width - len(i)) + i for _, i in chunk], device=device
                )
                mask = torch.tensor(
                    [[0] * (width - len(i)) + [1] * len(i) for _, i in chunk], device=device
                )
                with torch.no_grad():
                    gen = model.generate(
                        input_ids=input_ids,
                        attention_mask=mask,
                        max_new_tokens=max_tokens,
                        do_sample=False,
                        pad_token_id=pad,
                    )
                eos = set(_ids(model.generation_config.eos_token_id))
                for (item, _), row in zip(chunk, gen[:, width:].tolist(), strict=True):
                    stop = next((k for k, t in enumerate(row) if t in eos), None)
                    new = row if stop is None else row[:stop]
                    text = tok.decode(new, skip_special_tokens=True)
                    s = scorers.score_output(item, records[item.id]["scorer"], text)
                    records[item.id] = ItemResult(
                        **records[item.id],
                        outcome=s.outcome,
                        score=s.score,
                        detail=s.detail,
                        output=text,
                        finish_reason="stop" if stop is not None else "length",
                        completion_tokens=len(new) + (stop is not None),
                    )
        out[ls.suite.name] = [records[i.id] for i in ls.items]
    return out


def _ids(v: Any) -> list[int]:
    if v is None:
        return []
    return [int(x) for x in v] if isinstance(v, list | tuple) else [int(v)]


def _pass_rates(results: dict[str, list[Any]]) -> dict[str, Any]:
    from releasekit.evaluate.compare import side_counts

    return {
        name: side_counts(items).model_dump(exclude={"digest"}) for name, items in results.items()
    }


def _compare(base: dict[str, list[Any]], cand: dict[str, list[Any]], lm: Any) -> dict[str, Any]:
    from releasekit.evaluate.compare import compare_suite

    ev = lm.manifest.eval
    out = {}
    for s in ev.suites:
        c = compare_suite(
            cand[s.name],
            base[s.name],
            margin=s.margin,
            confidence=ev.confidence,
            samples=ev.bootstrap_samples,
            seed=ev.seed,
        )
        out[s.name] = {
            "verdict": str(c.verdict),
            "reasons": c.reasons,
            "n_paired": c.n_paired,
            "baseline_pass_rate": c.baseline_pass_rate,
            "candidate_pass_rate": c.candidate_pass_rate,
            "delta": c.delta,
            "ci_low": c.ci_low,
            "ci_high": c.ci_high,
            "flipped_to_fail": len(c.flipped_to_fail),
            "flipped_to_pass": len(c.flipped_to_pass),
        }
    return out


# ---- quantisation -------------------------------------------------------------------------


def recipes(samples: int | None) -> dict[str, tuple[Any, Path | None]]:
    """Each scheme's recipe: W8A8 and W4A16 from the demo manifests, FP8 with their ignore
    list, seed and calibration set (static FP8 calibrates on it; FP8_DYNAMIC needs none)."""
    from releasekit.spec.manifest import Quantisation, load_manifest

    out: dict[str, tuple[Any, Path | None]] = {}
    for scheme, name in (("W8A8", "demo-w8a8"), ("W4A16", "demo-w4a16")):
        lm = load_manifest(REPO / "manifests" / f"{name}.yaml", root=REPO)
        q = lm.manifest.quantisation
        if samples is not None and q.calibration is not None:
            q = q.model_copy(
                update={"calibration": q.calibration.model_copy(update={"samples": samples})}
            )
        out[scheme] = (q, lm.resolve(q.calibration.dataset) if q.calibration else None)
    w8, cal_path = out["W8A8"]
    out["FP8_DYNAMIC"] = (
        Quantisation(scheme="FP8_DYNAMIC", method="rtn", ignore=list(w8.ignore), seed=w8.seed),
        None,
    )
    out["FP8"] = (
        Quantisation(
            scheme="FP8",
            method="rtn",
            ignore=list(w8.ignore),
            seed=w8.seed,
            calibration=w8.calibration,
        ),
        cal_path,
    )
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole check; returns the result (also on a failed scheme, which it records)."""
    _check_imports()
    if not (args.model / "config.json").is_file():
        raise Missing(f"no model at {args.model} (dvc repro demo-model, or give --model)")
    device, dev_info = _device(args.device)
    import torch

    from releasekit.build.quantise import DEVICE_ENV, quantise_model
    from releasekit.capacity.roofline import (
        ceiling_tokens_per_s,
        served_weight_bytes,
        weight_files_of,
    )
    from releasekit.evaluate.suites import load_suite
    from releasekit.spec.manifest import load_manifest

    torch.manual_seed(0)
    lm = load_manifest(REPO / "manifests" / "demo-bf16.yaml", root=REPO)
    args_map = {k.replace("_", "-"): v for k, v in lm.manifest.serving.args.items()}
    max_model_len = int(args_map.get("max-model-len") or 512)
    suites = []
    for s in lm.manifest.eval.suites:
        ls = load_suite(lm.resolve(s.path), s)
        if args.limit is not None:
            ls = ls.model_copy(update={"items": ls.items[: args.limit]})
        suites.append(ls)
    notes: list[str] = []

    bw = bandwidth(device)
    print(
        f"bandwidth: {bw['gbs']:.1f} GB/s ({bw['method']}); "
        f"{bw['independent_gbs']:.1f} GB/s ({bw['independent_method']})"
    )

    t0 = time.perf_counter()
    model, tok = _load(args.model, device)
    base = evaluate(
        model, tok, lm, suites, device=device, batch=args.batch, max_model_len=max_model_len
    )
    base_s = time.perf_counter() - t0
    dec = decode_rate(model, tok, device, args.decode_tokens)
    del model
    bf16_bytes, note = served_weight_bytes(weight_files_of(args.model), "bfloat16")
    if note:
        notes.append(note)
    ceiling = ceiling_tokens_per_s(bf16_bytes, bw["gbs"])
    share = dec["step_loop_tokens_per_s"] / ceiling
    dec.update(
        weight_bytes=bf16_bytes,
        ceiling_tokens_per_s=ceiling,
        share_of_ceiling=share,
        generate_vs_step_loop=dec["generate_tokens_per_s"] / dec["step_loop_tokens_per_s"],
    )
    print(
        f"decode (bf16, batch 1): {dec['step_loop_tokens_per_s']:.0f} tokens/s step loop, "
        f"{dec['generate_tokens_per_s']:.0f} generate; ceiling {ceiling:,.0f} ({share:.2%})"
    )
    if share < 0.05:
        notes.append(
            f"the demo's weights are {bf16_bytes / 1e6:.2f} MB: decode is bound by per-step "
            "overhead (kernel launches, Python), not by memory bandwidth"
        )

    schemes: list[dict[str, Any]] = []
    os.environ[DEVICE_ENV] = "cpu" if device == "cpu" else "auto"
    work = Path(tempfile.mkdtemp(prefix="gpu_check-"))
    try:
        plan = recipes(args.calibration_samples)
        for scheme in args.schemes:
            q, cal = plan[scheme]
            entry: dict[str, Any] = {"scheme": scheme, "recipe": q.model_dump(mode="json")}
            try:
                t0 = time.perf_counter()
                res = quantise_model(
                    args.model,
                    work / scheme,
                    q,
                    calibration=cal,
                    dtype="bfloat16",
                    python=Path(sys.executable),
                    log_path=work / f"{scheme}.log",
                )
                entry["quantise"] = res.model_dump(
                    include={
                        "device",
                        "seconds",
                        "size_before_bytes",
                        "size_after_bytes",
                        "weights_digest",
                        "calibration_samples",
                        "versions",
                    }
                )
                entry["quantise"]["wall_s"] = time.perf_counter() - t0
                qc = json.loads((work / scheme / "config.json").read_text())["quantization_config"]
                entry["format"] = qc.get("format")
                wbytes, _ = served_weight_bytes(weight_files_of(work / scheme), "bfloat16")
                entry["weight_bytes"] = wbytes
                entry["ceiling_tokens_per_s"] = ceiling_tokens_per_s(wbytes, bw["gbs"])
                t0 = time.perf_counter()
                model, tok = _load(work / scheme, device)
                cand = evaluate(
                    model,
                    tok,
                    lm,
                    suites,
                    device=device,
                    batch=args.batch,
                    max_model_len=max_model_len,
                )
                del model
                entry["eval_s"] = time.perf_counter() - t0
                entry["pass_rates"] = _pass_rates(cand)
                entry["vs_bf16"] = _compare(base, cand, lm)
                verdicts = ", ".join(
                    f"{k} {v['verdict']} ({v['delta']:+.3f})"
                    for k, v in entry["vs_bf16"].items()
                    if v["delta"] is not None
                )
                print(f"{scheme}: quantised on {res.device} in {res.seconds:.1f}s; {verdicts}")
            except Exception as exc:  # a scheme that fails is recorded; the others still run
                entry["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
                print(f"{scheme}: failed: {entry['error']}")
            schemes.append(entry)
            if device == "cuda":
                torch.cuda.empty_cache()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {
        "device": dev_info,
        "model": {"dir": str(args.model), "weight_bytes": bf16_bytes},
        "items_per_suite": {ls.suite.name: len(ls.items) for ls in suites},
        "bandwidth": bw,
        "decode": dec,
        "baseline": {"eval_s": base_s, "pass_rates": _pass_rates(base)},
        "schemes": schemes,
        "notes": notes,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the check, write its JSON, print where; 1 when a scheme failed."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _results import RESULTS, write_result

    args = _parse(argv)
    result = run(args)
    out = args.out or RESULTS / (
        "gpu_check.json" if result["device"]["kind"] == "cuda" else "gpu_check.cpu.json"
    )
    write_result(out, result, argv=argv)
    print(f"wrote {out}")
    return 1 if any("error" in s for s in result["schemes"]) else 0


if __name__ == "__main__":
    sys.exit(main())
