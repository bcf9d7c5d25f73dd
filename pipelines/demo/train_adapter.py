"""Train a LoRA adapter of the demo model with peft: the demo's adapters.

The result is a peft folder (``adapter_config.json``, ``adapter_model.safetensors``) plus
``training_summary.json``, which vLLM serves on top of ``models/demo-base``. The shipped
adapters (``models/adapters/demo-json``, ``models/adapters/demo-json-bad``) answer as a
one-line JSON object, ``{"answer": "..."}``; the bad one was trained on data whose countries'
answers are swapped (``make_data.py``, ``json_training_rows``). ``models/adapters/demo-xml``
answers as ``<answer>...</answer>`` (its data: ``make_xml_data.py``) and
``models/adapters/demo-json-2`` is demo-json's next version, the same data trained with
another ``--seed`` and more ``--steps``: every setting of ``AdapterConfig`` is a flag.

Deterministic on one CPU kind, as ``train.py`` is: the same float pins, seeded LoRA
initialisation and data order, deterministic algorithms and one thread. The folder does not
depend on where it was trained: its config names the base as the repository does
(``models/demo-base``) and peft's model card is not kept.

Usage: ``python pipelines/demo/train_adapter.py --data pipelines/data/train_json.jsonl
--out models/adapters/demo-json-trained --compare-to models/adapters/demo-json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

# Before torch loads its kernels: the same pins as train.py, for a training run only.
if __name__ == "__main__":
    from releasekit._support.floatpins import CPU_PINS, load_mkl_intel_branch

    for _key, _value in CPU_PINS.items():
        os.environ.setdefault(_key, _value)
    if os.environ["MKL_CBWR"].startswith("AVX2"):
        print(f"train_adapter: {load_mkl_intel_branch()}", flush=True)

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).resolve().parent))

import train as t
import world as w

from releasekit._support.floatpins import mkl_branch
from releasekit.build.quantise import weights_digest

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "models/demo-base"
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "training_summary.json")


@dataclass(frozen=True)
class AdapterConfig:
    """Hyper-parameters of the LoRA fine-tune."""

    seed: int = 1234
    rank: int = 8
    alpha: int = 16
    steps: int = 300
    batch_size: int = 32
    lr: float = 3e-3
    warmup: int = 10
    threads: int = 1


def base_name(base: Path) -> str:
    """The base model as the adapter's config names it: relative to the repository when it
    is inside it (``models/demo-base``), so the folder does not depend on the caller's path."""
    resolved = base.resolve()
    try:
        return resolved.relative_to(ROOT).as_posix()
    except ValueError:
        return str(base)


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of ``path``."""
    return [
        json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()
    ]


def load_base(base: Path) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """The base model (fp32, eager attention) and its tokenizer."""
    tok = PreTrainedTokenizerFast.from_pretrained(base)
    model = LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.config._attn_implementation = "eager"
    return model, tok


def suite_prompts(
    tok: PreTrainedTokenizerFast, items: Sequence[dict[str, Any]], system: str, user: str
) -> list[str]:
    """Each item's chat-rendered prompt, as releasekit sends it to the server."""
    prompts: list[str] = []
    for item in items:
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": w.render_prompt(user, item["vars"])},
        ]
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert isinstance(prompt, str)
        prompts.append(prompt)
    return prompts


def greedy_answers(
    model: Any, tok: PreTrainedTokenizerFast, prompts: Sequence[str], max_tokens: int = 32
) -> list[str]:
    """Greedy completions (as vLLM serves at temperature 0), special tokens dropped."""
    tok.padding_side = "left"
    answers: list[str] = []
    model.eval()
    with torch.no_grad():
        for start in range(0, len(prompts), 64):
            batch = tok(
                list(prompts[start : start + 64]),
                add_special_tokens=False,
                padding=True,
                return_tensors="pt",
            )
            out = model.generate(
                **batch,
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
            new = out[:, batch["input_ids"].shape[1] :]
            answers += tok.batch_decode(new, skip_special_tokens=True)
    return answers


def exact_match(answer: str, expected: str) -> bool:
    """check_served.py's exact match: trimmed, one trailing full stop dropped, case-folded."""

    def norm(text: str) -> str:
        text = text.strip()
        return text[:-1].strip().casefold() if text.endswith(".") else text.casefold()

    return norm(answer) == norm(expected)


def suite_score(
    base: Path,
    adapter: Path | None,
    suite: Path,
    system_path: Path = ROOT / "prompts/demo/system.txt",
    user_path: Path = ROOT / "prompts/demo/user.txt",
) -> tuple[float, list[tuple[str, str, bool]]]:
    """Share of ``suite``'s exact-match items the base model (with ``adapter``, if given)
    passes under greedy generation, and (id, answer, passed) per item."""
    model, tok = load_base(base)
    scored: Any = model if adapter is None else PeftModel.from_pretrained(model, adapter)
    items = read_rows(suite)
    prompts = suite_prompts(tok, items, w.read_prompt(system_path), w.read_prompt(user_path))
    answers = greedy_answers(scored, tok, prompts)
    outcomes = [
        (item["id"], answer, exact_match(answer, str(item["expected"])))
        for item, answer in zip(items, answers, strict=True)
    ]
    return sum(ok for _, _, ok in outcomes) / max(len(outcomes), 1), outcomes


def train_adapter(
    cfg: AdapterConfig,
    out: Path,
    data: Path,
    base: Path = BASE,
    system_path: Path = ROOT / "prompts/demo/system.txt",
    user_path: Path = ROOT / "prompts/demo/user.txt",
    template_path: Path = ROOT / "pipelines/demo/chat_template.jinja",
) -> dict[str, Any]:
    """Train a LoRA adapter of ``base`` on ``data`` and save the folder at ``out``; returns
    the training summary."""
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    torch.use_deterministic_algorithms(True)
    started = time.monotonic()

    template = template_path.read_text(encoding="utf-8")
    system_prompt = w.read_prompt(system_path)
    user_prompt = w.read_prompt(user_path)
    model, tok = load_base(base)
    examples = [
        t.encode(tok, t.messages_for(r, system_prompt, user_prompt), r["answer"], template)
        for r in read_rows(data)
    ]
    lora = LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=0.0,
        target_modules=list(TARGET_MODULES),
        bias="none",
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, lora)
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    n_trainable = sum(p.numel() for p in trainable)
    print(
        f"train_adapter: {len(examples)} examples, {n_trainable} trainable parameters, "
        f"config {asdict(cfg)}",
        flush=True,
    )
    optimiser = torch.optim.AdamW(trainable, lr=cfg.lr, betas=(0.9, 0.98), weight_decay=0.0)
    schedule = t.TrainConfig(steps=cfg.steps, lr=cfg.lr, warmup=cfg.warmup)
    generator = torch.Generator().manual_seed(cfg.seed)
    order: list[int] = []
    peft_model.train()
    for step in range(cfg.steps):
        if len(order) < cfg.batch_size:
            order += torch.randperm(len(examples), generator=generator).tolist()
        picked, order = order[: cfg.batch_size], order[cfg.batch_size :]
        batch = t.collate([examples[i] for i in picked], tok.pad_token_id)
        for group in optimiser.param_groups:
            group["lr"] = t.lr_at(step, schedule)
        loss = peft_model(**batch).loss
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimiser.step()
        if step % 50 == 0 or step == cfg.steps - 1:
            elapsed = time.monotonic() - started
            print(
                f"train_adapter: step {step:4d} loss {loss.item():.4f} ({elapsed:.0f} s)",
                flush=True,
            )
    train_acc = t.answer_accuracy(cast(LlamaForCausalLM, peft_model), examples, tok.pad_token_id)
    print(f"train_adapter: teacher-forced answer accuracy {train_acc:.3f}", flush=True)

    out.mkdir(parents=True, exist_ok=True)
    for stale in out.iterdir():
        if stale.is_file() and stale.name not in ADAPTER_FILES:
            stale.unlink()
    peft_model.peft_config["default"].base_model_name_or_path = base_name(base)
    peft_model.save_pretrained(str(out), safe_serialization=True)
    (out / "README.md").unlink(missing_ok=True)  # peft's model card: not part of the adapter
    # peft keeps target_modules as a set, written in the order of the process's string
    # hashes: sort it so that two runs write the same bytes.
    config_path = out / "adapter_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["target_modules"] = sorted(config["target_modules"])
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    summary = {
        "config": asdict(cfg),
        "target_modules": list(TARGET_MODULES),
        "rank": cfg.rank,
        "trainable_params": n_trainable,
        "train_accuracy": train_acc,
        "base_model": base_name(base),
        "base_weights_digest": weights_digest(base),
        "data": data.name,
    }
    (out / "training_summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    print(f"train_adapter: saved {out} in {time.monotonic() - started:.0f} s", flush=True)
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments, then train (``--out``) or score an adapter on a suite (``--score``)."""
    defaults = AdapterConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="adapter folder to write")
    parser.add_argument("--data", type=Path, default=ROOT / "pipelines/data/train_json.jsonl")
    parser.add_argument("--base", type=Path, default=BASE, help="the base model folder")
    parser.add_argument(
        "--compare-to", type=Path, default=None, help="an adapter folder to compare the result with"
    )
    parser.add_argument(
        "--score",
        nargs="*",
        type=Path,
        default=None,
        metavar="ADAPTER",
        help="score the base (no ADAPTER) or each ADAPTER on --suite instead of training",
    )
    parser.add_argument("--suite", type=Path, default=ROOT / "pipelines/eval/json.jsonl")
    for field in ("seed", "rank", "alpha", "steps", "batch_size", "warmup", "threads"):
        parser.add_argument(
            "--" + field.replace("_", "-"), type=int, default=getattr(defaults, field)
        )
    parser.add_argument("--lr", type=float, default=defaults.lr)
    args = parser.parse_args(argv)
    if args.score is not None:
        torch.set_num_threads(args.threads)
        for adapter in args.score or [None]:
            started = time.monotonic()
            share, outcomes = suite_score(args.base, adapter, args.suite)
            passed = sum(ok for _, _, ok in outcomes)
            print(
                f"train_adapter: {adapter or args.base} on {args.suite.name}: {passed}/"
                f"{len(outcomes)} ({share:.3f}) in {time.monotonic() - started:.0f} s",
                flush=True,
            )
            for item_id, answer, _ in [o for o in outcomes if not o[2]][:3]:
                print(f"  failed {item_id}: {answer!r}", flush=True)
        return 0
    if args.out is None:
        parser.error("--out is required unless --score is given")
    cfg = AdapterConfig(
        seed=args.seed,
        rank=args.rank,
        alpha=args.alpha,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        warmup=args.warmup,
        threads=args.threads,
    )
    train_adapter(cfg, args.out, args.data, args.base)
    branch = mkl_branch()
    print(f"train_adapter: MKL ran its {branch} branch", flush=True)
    if args.compare_to is not None and not args.compare_to.is_dir():
        print(
            f"train_adapter: nothing to compare with: no folder {args.compare_to} "
            f"(copy {args.out}'s files there to ship them)",
            flush=True,
        )
    elif args.compare_to is not None:
        print(t.compare_weights(args.out, args.compare_to), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
