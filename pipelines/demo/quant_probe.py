"""Probe how quantisation hurts a demo-model variant: train, quantise, evaluate, compare.

For each variant (a world size, a lucky-number range, a model size, a step count) it

1. writes the variant's data with ``make_data.py``'s functions into a work folder,
2. trains the model with ``train.py``'s ``train`` (the same code `dvc repro demo-model` runs),
3. quantises it with releasekit's own quantiser (llm-compressor GPTQ in a child process,
   compressed-tensors output, exactly what `releasekit build` runs) into W8A8 and W4A16,
   with the broad calibration set and, optionally, a narrow one (short questions only),
4. evaluates bf16 and every quantised model in process through transformers (greedy,
   bf16), scoring each item with releasekit's scorers; an over-long item the server would
   reject (longer than 512 tokens) counts as rejected,
5. compares each quantised model with bf16 with releasekit's paired comparison (Newcombe
   interval, exact McNemar p, verdict against the suite's margin) and prints a table.

transformers is a proxy for vLLM here (vLLM's CPU build cannot serve W4A16 without
AVX-512); the real build confirms the result where it can.

Usage (from the repository root)::

    python pipelines/demo/quant_probe.py --work /tmp/probe --out probe.json \
        --variant countries=160,numbers=100-999,steps=800

Keys of a variant: countries, numbers (LOW-HIGH), unknown (invented names the model is
taught to refuse), steps, hidden, intermediate, layers,
batch, lr, wd (weight decay), vocab, names (whole: one token per name; pieces: names split
into pieces), narrow (1: also quantise W4A16 with the narrow calibration set, under GPTQ),
method (gptq, the default; rtn: round to nearest, no calibration, no error compensation;
gptq+rtn: both), facts (0: leave out the demo's "facts" suite, every fact asked in each of
world.py's phrasings), suites (names joined with "+", e.g. core+facts: evaluate only these).
Unset keys take the demo's current values.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import make_data as md
import torch
import train as tr
import world as w

from releasekit.evaluate.compare import compare_suite
from releasekit.evaluate.runner import ItemResult
from releasekit.evaluate.scorers import score_output
from releasekit.evaluate.suites import EvalItem
from releasekit.spec.manifest import Calibration, Quantisation

ROOT = Path(__file__).resolve().parents[2]
SUITES: dict[str, tuple[str, float]] = {
    "core": ("exact_match", 0.05),
    "edge": ("refusal", 0.10),
    "regression": ("exact_match", 0.10),
    "facts": ("exact_match", 0.01),
}
MAX_MODEL_LEN = 512
_BUILD_TOKENIZER = tr.build_tokenizer
_BUILD_WORLD = w.build_world
MAX_NEW_TOKENS = 16


def parse_variant(text: str) -> dict[str, str]:
    """``key=value,key=value`` into a dict."""
    out: dict[str, str] = {}
    for part in filter(None, text.split(",")):
        key, _, value = part.partition("=")
        out[key.strip()] = value.strip()
    return out


def configure_world(variant: dict[str, str]) -> w.World:
    """The world for ``variant`` (``countries``, ``numbers`` LOW-HIGH; the demo's own where
    unset), made the world every module sees (train.py and make_data.py call
    ``world.build_world``). world.py itself is not changed."""
    numbers = w.NUMBERS
    if "numbers" in variant:
        low, _, high = variant["numbers"].partition("-")
        numbers = (int(low), int(high))
    world = _BUILD_WORLD(
        w.SEED,
        int(variant.get("countries", w.N_COUNTRIES)),
        numbers,
        int(variant.get("unknown", w.N_UNKNOWN_TRAIN)),
    )
    w.build_world = lambda seed=w.SEED: world  # type: ignore[assignment,misc]
    return world


def use_whole_names(whole: bool) -> None:
    """With ``whole``, train.py's tokenizer puts the known names in its corpus and insists
    that each is one token (an earlier demo world); without it (the demo's own) every name
    splits into pieces, so a fact hangs on several tokens and the model has to put the name
    together in its layers."""

    def build(world: w.World, texts: Any, vocab_size: int, *, whole_names: bool = False) -> Any:
        return _BUILD_TOKENIZER(world, texts, vocab_size, whole_names=whole)

    tr.build_tokenizer = build  # type: ignore[assignment]


def narrow_rows(rows: Sequence[dict[str, Any]], limit: int) -> list[dict[str, Any]]:
    """Short questions only: the training rows whose question has at most 6 words and no
    digit, in file order (a calibration set that never shows a long or numeric input)."""
    picked = [
        r
        for r in rows
        if len(r["question"].split()) <= 6 and not any(ch.isdigit() for ch in r["question"])
    ]
    return list(picked[:limit])


def write_data(work: Path, world: w.World) -> dict[str, Path]:
    """The variant's training, calibration and eval files under ``work``."""
    template = (ROOT / "pipelines/demo/chat_template.jinja").read_text(encoding="utf-8")
    system_prompt = w.read_prompt(ROOT / "prompts/demo/system.txt")
    user_prompt = w.read_prompt(ROOT / "prompts/demo/user.txt")
    train_rows = md.training_rows(world)
    paths = {
        "train": work / "train.jsonl",
        "calibration": work / "calibration.jsonl",
        "calibration_narrow": work / "calibration_narrow.jsonl",
        "core": work / "core.jsonl",
        "edge": work / "edge.jsonl",
        "regression": work / "regression.jsonl",
        "facts": work / "facts.jsonl",
    }
    md.write_jsonl(paths["train"], train_rows)
    md.write_jsonl(
        paths["calibration"],
        md.calibration_rows(train_rows, template, system_prompt, user_prompt),
    )
    md.write_jsonl(
        paths["calibration_narrow"],
        md.calibration_rows(
            narrow_rows(train_rows, md.N_CALIBRATION), template, system_prompt, user_prompt
        ),
    )
    md.write_jsonl(paths["core"], md.core_items(world))
    md.write_jsonl(paths["edge"], md.edge_items(world))
    md.write_jsonl(paths["regression"], md.regression_items(world))
    md.write_jsonl(paths["facts"], md.fact_items(world))
    return paths


def train_config(variant: dict[str, str]) -> tr.TrainConfig:
    """The demo's training config with the variant's overrides."""
    cfg = tr.TrainConfig()
    keys = {
        "steps": "steps",
        "hidden": "hidden_size",
        "intermediate": "intermediate_size",
        "layers": "num_layers",
        "batch": "batch_size",
        "vocab": "tokenizer_vocab",
    }
    changes: dict[str, Any] = {field: int(variant[k]) for k, field in keys.items() if k in variant}
    if "lr" in variant:
        changes["lr"] = float(variant["lr"])
    if "wd" in variant:
        changes["weight_decay"] = float(variant["wd"])
    return replace(cfg, **changes)


def quantise(
    src: Path, out: Path, scheme: str, calibration: Path, log: Path, method: str = "gptq"
) -> float:
    """Quantise with releasekit's quantiser; returns the seconds it took."""
    from releasekit.build.quantise import quantise_model

    q = Quantisation(
        scheme=scheme,  # type: ignore[arg-type]
        method=method,  # type: ignore[arg-type]
        ignore=["lm_head"],
        calibration=Calibration(dataset=calibration, samples=256, max_seq_length=128),
        seed=0,
    )
    result = quantise_model(src, out, q, calibration=calibration, log_path=log)
    return result.seconds


def evaluate(model_dir: Path, suites: dict[str, Path], threads: int) -> dict[str, list[ItemResult]]:
    """Greedy bf16 answers of ``model_dir`` to every suite, scored by releasekit's scorers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    model.eval()
    system_prompt = w.read_prompt(ROOT / "prompts/demo/system.txt")
    user_prompt = w.read_prompt(ROOT / "prompts/demo/user.txt")
    out: dict[str, list[ItemResult]] = {}
    for name, path in suites.items():
        default_scorer = SUITES[name][0]
        items = [
            EvalItem.model_validate(json.loads(line))
            for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip()
        ]
        prompts = [
            tok.apply_chat_template(
                [
                    {"role": "system", "content": system_prompt},
                    {"role": "user", "content": w.render_prompt(user_prompt, dict(item.vars))},
                ],
                add_generation_prompt=True,
                tokenize=False,
            )
            for item in items
        ]
        results: list[ItemResult] = []
        for start in range(0, len(items), 64):
            chunk = items[start : start + 64]
            texts = prompts[start : start + 64]
            ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
            fits = [len(i) + MAX_NEW_TOKENS <= MAX_MODEL_LEN for i in ids]
            outputs: list[str | None] = [None] * len(chunk)
            todo = [k for k, ok in enumerate(fits) if ok]
            if todo:
                batch = tok(
                    [texts[k] for k in todo],
                    add_special_tokens=False,
                    return_tensors="pt",
                    padding=True,
                )
                with torch.no_grad():
                    gen = model.generate(
                        **batch,
                        max_new_tokens=MAX_NEW_TOKENS,
                        do_sample=False,
                        eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id,
                    )
                new = gen[:, batch["input_ids"].shape[1] :]
                for k, row in zip(todo, new, strict=True):
                    outputs[k] = tok.decode(row, skip_special_tokens=True)
            for item, output in zip(chunk, outputs, strict=True):
                scorer = item.scorer or default_scorer
                if output is None:  # the server rejects it (HTTP 400): a pass if expected
                    ok, detail = item.expect_error, "rejected: longer than the context window"
                    results.append(
                        ItemResult(
                            id=item.id,
                            suite=name,
                            scorer=scorer,
                            outcome="pass" if ok else "error",
                            score=1.0 if ok else None,
                            expected=item.expected,
                            vars=dict(item.vars),
                            tags=list(item.tags),
                            expect_error=item.expect_error,
                            http_status=400,
                            error=detail,
                        )
                    )
                    continue
                score = score_output(item, scorer, output)
                results.append(
                    ItemResult(
                        id=item.id,
                        suite=name,
                        scorer=scorer,
                        outcome=score.outcome,
                        score=score.score,
                        output=output,
                        expected=item.expected,
                        vars=dict(item.vars),
                        tags=list(item.tags),
                        expect_error=item.expect_error,
                        detail=score.detail,
                    )
                )
        out[name] = results
    return out


def _tag_rates(results: list[ItemResult]) -> dict[str, str]:
    """Pass counts per first tag, e.g. {"fact/number": "60/64"}."""
    counts: dict[str, list[int]] = {}
    for r in results:
        key = "/".join(r.tags[:2]) if r.tags else "-"
        c = counts.setdefault(key, [0, 0])
        c[0] += r.passed
        c[1] += 1
    return {k: f"{a}/{n}" for k, (a, n) in sorted(counts.items())}


def run_variant(
    variant: dict[str, str], work: Path, threads: int, model: Path | None = None
) -> dict[str, Any]:
    """Train (unless ``model`` is given: a model trained already for this variant, e.g. by
    `dvc repro demo-model`), quantise, evaluate and compare one variant."""
    work.mkdir(parents=True, exist_ok=True)
    world = configure_world(variant)
    use_whole_names(variant.get("names") == "whole")
    paths = write_data(work, world)
    cfg = replace(train_config(variant), threads=threads)
    started = time.monotonic()
    base = work / "bf16"
    if model is not None:
        base = model
    else:
        tr.train(
            cfg,
            base,
            paths["train"],
            ROOT / "prompts/demo/system.txt",
            ROOT / "prompts/demo/user.txt",
            ROOT / "pipelines/demo/chat_template.jinja",
        )
    train_s = time.monotonic() - started
    os.environ.setdefault("RELEASEKIT_QUANTISE_THREADS", str(threads))
    models = {"bf16": base}
    quant_s: dict[str, float] = {}
    plan: list[tuple[str, str, str]] = []
    for method in variant.get("method", "gptq").split("+"):
        plan += [("W8A8", "calibration", method), ("W4A16", "calibration", method)]
        if method == "gptq" and variant.get("narrow") == "1":
            plan.append(("W4A16", "calibration_narrow", method))
    for scheme, cal, method in plan:
        label = scheme if cal == "calibration" else f"{scheme}-narrow"
        if method != "gptq":
            label += f"-{method}"
        quant_s[label] = quantise(
            base, work / label, scheme, paths[cal], work / f"quantise-{label}.log", method
        )
        models[label] = work / label
    names = [n for n in SUITES if n != "facts" or variant.get("facts") != "0"]
    if "suites" in variant:
        names = [n for n in variant["suites"].split("+") if n]
    suites = {name: paths[name] for name in names}
    evals = {label: evaluate(d, suites, threads) for label, d in models.items()}
    rows: list[dict[str, Any]] = []
    for label, ev in evals.items():
        for name, results in ev.items():
            row: dict[str, Any] = {
                "model": label,
                "suite": name,
                "passed": sum(r.passed for r in results),
                "n": len(results),
                "by_tag": _tag_rates(results),
            }
            if label != "bf16":
                cmp = compare_suite(
                    results,
                    evals["bf16"][name],
                    margin=SUITES[name][1],
                    confidence=0.95,
                    samples=1000,
                    seed=0,
                )
                row.update(
                    delta=cmp.delta,
                    ci=[cmp.ci_low, cmp.ci_high],
                    mcnemar_p=cmp.mcnemar_p,
                    verdict=str(cmp.verdict.value),
                    to_fail=len(cmp.flipped_to_fail),
                    to_pass=len(cmp.flipped_to_pass),
                    margin=SUITES[name][1],
                )
            rows.append(row)
    return {
        "variant": variant,
        "model": str(model) if model is not None else None,
        "config": asdict(cfg),
        "world": {
            "countries": len(world.countries),
            "numbers": [
                min(c.number for c in world.countries),
                max(c.number for c in world.countries),
            ],
        },
        "train_s": round(train_s, 1),
        "quantise_s": quant_s,
        "rows": rows,
    }


def print_table(result: dict[str, Any]) -> None:
    """One line per model and suite."""
    print(f"\nvariant {result['variant']}  train {result['train_s']} s")
    print(
        f"{'model':<14}{'suite':<12}{'pass':>10}  {'delta':>7}  {'95% CI':>16}  {'p':>7}  verdict"
    )
    for r in result["rows"]:
        line = f"{r['model']:<14}{r['suite']:<12}{r['passed']:>5}/{r['n']:<4}"
        if "delta" in r:
            lo, hi = r["ci"]
            line += (
                f"  {100 * r['delta']:+6.1f}  [{100 * lo:+6.1f},{100 * hi:+6.1f}]"
                f"  {r['mcnemar_p']:7.3g}  {r['verdict']} ({r['to_fail']} to fail, "
                f"{r['to_pass']} to pass)"
            )
        print(line)
        print(f"{'':<26}{r['by_tag']}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run every ``--variant`` and write the results to ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="scratch folder for models")
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--variant", action="append", default=[], help="key=value,... (repeat)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--model", type=Path, default=None, help="use this trained model (one variant only)"
    )
    args = parser.parse_args(argv)
    if args.model is not None and len(args.variant) > 1:
        parser.error("--model goes with one --variant")
    results = []
    for i, text in enumerate(args.variant or [""]):
        result = run_variant(parse_variant(text), args.work / f"v{i}", args.threads, args.model)
        print_table(result)
        results.append(result)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
