"""Train the releasekit demo model from scratch: tokenizer, then a tiny Llama.

The result is a Hugging Face model directory (``config.json``,
``model.safetensors``, ``generation_config.json``, tokenizer files with the
chat template in ``tokenizer_config.json``) that vLLM's CPU build serves.

Deterministic on one CPU kind: seeded initialisation, a fixed data order,
deterministic algorithms, a fixed thread count, and MKL's conditional numerical
reproducibility in strict mode (``MKL_CBWR``; without it MKL may pick other code
paths from run to run, by data alignment). Float kernels still differ between CPU
kinds (AVX2, AVX-512, AVX-512 with AMX), so the same seeded training gives other
weights on another kind: the demo's weights are therefore shipped in git
(``models/demo-base``, recorded in ``shipped_weights.json``), and this script
reproduces them where it can.

Usage: ``python pipelines/demo/train.py --out models/demo-trained --compare-to models/demo-base``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# Before torch loads its kernels: the same float code paths on every x86-64 host this project
# meets (AVX2 is common to all three CPU kinds) and from run to run. MKL's conditional numerical
# reproducibility in strict mode on its AVX2 path, with a fixed thread count (MKL_DYNAMIC would
# otherwise use fewer threads on a busy host, which changes the order of its sums); ATen's
# vectorised kernels and oneDNN on AVX2 too (AVX-512 and AMX reduce in other orders).
# Only for a training run (this file run as a script): a process that imports this module
# keeps its environment, and so do the servers it starts. A vLLM server that inherited
# ONEDNN_MAX_CPU_ISA=AVX2 on a CPU with AMX aborts at its first request (vLLM picks its AMX
# kernels by CPUID, and torch refuses them under the cap).
if __name__ == "__main__":
    from releasekit._support.floatpins import CPU_PINS, load_mkl_intel_branch

    for _key, _value in CPU_PINS.items():
        os.environ.setdefault(_key, _value)
    if os.environ["MKL_CBWR"].startswith("AVX2"):
        print(f"train: {load_mkl_intel_branch()}", flush=True)

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).resolve().parent))

import world as w

from releasekit._support.floatpins import mkl_branch

ROOT = Path(__file__).resolve().parents[2]
PAD, BOS, EOS = "<|pad|>", w.BOS_TOKEN, "<|end|>"
SPECIAL_TOKENS = (PAD, BOS, EOS, "<|system|>", "<|user|>", "<|assistant|>")
IGNORE = -100
MAX_LEN = 512


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters; every linear layer's sizes are multiples of 128."""

    seed: int = 1234
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    head_dim: int = 32
    tokenizer_vocab: int = 1152
    steps: int = 800
    batch_size: int = 32
    lr: float = 2e-3
    warmup: int = 30
    weight_decay: float = 0.01
    threads: int = 1


def build_tokenizer(
    world: w.World, texts: Iterable[str], vocab_size: int, *, whole_names: bool = False
) -> Tokenizer:
    """A byte-level BPE tokenizer trained on the prompts, the phrasings, colours and
    numbers below 100.

    The known names are left out of its corpus, so every country and capital splits into
    pieces (as an unknown name does): a fact hangs on several tokens and the model has to
    put the name together in its layers, which quantisation touches. (With every name a
    single token, a fact lives in an embedding row, which quantisation leaves alone; see
    ``quant_probe.py``.) ``whole_names`` puts the names in the corpus and insists that
    each is one token, as an earlier world did.
    """
    corpus: list[str] = []
    if whole_names:
        for country in world.countries:
            # Countries follow a space in questions; capitals start an answer.
            corpus += [" " + country.name, country.capital] * 8
    corpus += [" ".join(str(n) for n in range(100))] * 8
    corpus += [str(n) for n in range(100)] * 8
    corpus += [" ".join(w.COLOURS), "\n".join(w.COLOURS)] * 8
    corpus += [p for ps in w.PHRASINGS.values() for p in ps] * 4
    corpus += list(texts) * 4
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    if whole_names:
        split = [
            n
            for c in world.countries
            for n in (" " + c.name, c.capital)
            if len(tokenizer.encode(n).ids) != 1
        ]
        if split:
            raise SystemExit(
                f"train: tokenizer vocab {vocab_size} too small, names split: {split[:5]}"
            )
    return tokenizer


def wrap_tokenizer(tokenizer: Tokenizer, chat_template: str) -> PreTrainedTokenizerFast:
    """The transformers wrapper with special tokens and the chat template."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=list(SPECIAL_TOKENS[3:]),
        chat_template=chat_template,
        model_max_length=MAX_LEN,
        clean_up_tokenization_spaces=False,
    )


def messages_for(row: dict[str, Any], system_prompt: str, user_prompt: str) -> list[dict[str, str]]:
    """System and user messages of a training row, rendered as releasekit would."""
    system = system_prompt if row["system"] == 0 else w.SYSTEM_PARAPHRASES[row["system"] - 1]
    user = w.render_prompt(user_prompt, {"question": row["question"]})
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def encode(
    tok: PreTrainedTokenizerFast, messages: list[dict[str, str]], answer: str, template: str
) -> tuple[list[int], list[int]]:
    """Token ids and labels; only the answer and the end-of-turn token are labelled."""
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert isinstance(prompt, str)
    assert prompt == w.render_chat(template, messages, add_generation_prompt=True), (
        "template mismatch"
    )
    prompt_ids: list[int] = tok(prompt, add_special_tokens=False)["input_ids"]
    answer_ids: list[int] = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    full = tok(prompt + answer + EOS, add_special_tokens=False)["input_ids"]
    assert full == prompt_ids + answer_ids, f"prompt/answer boundary splits a token: {answer!r}"
    return prompt_ids + answer_ids, [IGNORE] * len(prompt_ids) + answer_ids


def collate(batch: Sequence[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a batch of (ids, labels) pairs."""
    width = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, (row_ids, row_labels) in enumerate(batch):
        ids[i, : len(row_ids)] = torch.tensor(row_ids)
        labels[i, : len(row_labels)] = torch.tensor(row_labels)
        mask[i, : len(row_ids)] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def answer_accuracy(
    model: LlamaForCausalLM, examples: Sequence[tuple[list[int], list[int]]], pad_id: int
) -> float:
    """Share of examples whose every labelled token is the greedy prediction."""
    model.eval()
    right = 0
    with torch.no_grad():
        for start in range(0, len(examples), 64):
            batch = collate(examples[start : start + 64], pad_id)
            logits = model(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
            ).logits
            pred = logits[:, :-1].argmax(-1)
            gold = batch["labels"][:, 1:]
            ok = (pred == gold) | (gold == IGNORE)
            right += int(ok.all(dim=1).sum())
    model.train()
    return right / max(len(examples), 1)


def make_model(cfg: TrainConfig, tok: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    """A freshly initialised Llama sized by ``cfg``; vocab padded to 128."""
    vocab = math.ceil(len(tok) / 128) * 128
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=MAX_LEN,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        attention_dropout=0.0,
    )
    config._attn_implementation = "eager"
    return LlamaForCausalLM(config)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(cfg.steps - cfg.warmup, 1)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(
    cfg: TrainConfig,
    out: Path,
    data: Path,
    system_path: Path,
    user_path: Path,
    template_path: Path,
    init_from: Path | None = None,
) -> None:
    """Train and save the model directory at ``out``: from scratch, or, with ``init_from``,
    fine-tune that model folder (its tokenizer and weights) on ``data``."""
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    torch.use_deterministic_algorithms(True)
    started = time.monotonic()

    world = w.build_world()
    template = template_path.read_text(encoding="utf-8")
    system_prompt = w.read_prompt(system_path)
    user_prompt = w.read_prompt(user_path)
    rows = [
        json.loads(line) for line in data.read_text(encoding="utf-8").splitlines() if line.strip()
    ]

    if init_from is None:
        prompt_texts = [system_prompt, user_prompt, w.REFUSAL, *w.SYSTEM_PARAPHRASES]
        tok = wrap_tokenizer(build_tokenizer(world, prompt_texts, cfg.tokenizer_vocab), template)
    else:
        tok = PreTrainedTokenizerFast.from_pretrained(init_from)
        # from_pretrained records whether the hub was off (HF_HUB_OFFLINE) in the config it
        # saves: keep the saved value fixed so the folder does not depend on the caller's
        # environment (the shipped demo-v2 was saved with it false).
        tok.init_kwargs["local_files_only"] = False
    examples = [
        encode(tok, messages_for(r, system_prompt, user_prompt), r["answer"], template)
        for r in rows
    ]
    core = [
        encode(
            tok, messages_for({"system": 0, "question": q}, system_prompt, user_prompt), a, template
        )
        for q, a in _core_pairs(world)
    ]
    lengths = sorted(len(ids) for ids, _ in examples)
    print(
        f"train: {len(examples)} examples, tokens/example median {lengths[len(lengths) // 2]} "
        f"max {lengths[-1]}, tokenizer vocab {len(tok)}",
        flush=True,
    )

    if init_from is None:
        model = make_model(cfg, tok)
    else:
        model = LlamaForCausalLM.from_pretrained(init_from, dtype=torch.float32)
        model.config._attn_implementation = "eager"
    params = sum(p.numel() for p in model.parameters())
    print(f"train: {params} parameters, config {asdict(cfg)}", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimiser = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(0.9, 0.98),
    )
    generator = torch.Generator().manual_seed(cfg.seed)
    order: list[int] = []
    model.train()
    for step in range(cfg.steps):
        if len(order) < cfg.batch_size:
            order += torch.randperm(len(examples), generator=generator).tolist()
        picked, order = order[: cfg.batch_size], order[cfg.batch_size :]
        batch = collate([examples[i] for i in picked], tok.pad_token_id)
        for group in optimiser.param_groups:
            group["lr"] = lr_at(step, cfg)
        loss = model(**batch).loss
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimiser.step()
        if step % 50 == 0 or step == cfg.steps - 1:
            elapsed = time.monotonic() - started
            print(f"train: step {step:4d} loss {loss.item():.4f} ({elapsed:.0f} s)", flush=True)

    train_acc = answer_accuracy(model, examples, tok.pad_token_id)
    core_acc = answer_accuracy(model, core, tok.pad_token_id)
    print(
        f"train: teacher-forced answer accuracy train {train_acc:.3f} core {core_acc:.3f}",
        flush=True,
    )

    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out, save_jinja_files=False)
    summary = {
        "params": params,
        "config": asdict(cfg),
        "train_accuracy": train_acc,
        "core_accuracy": core_acc,
        **({"fine_tuned_from": file_digests(init_from)} if init_from is not None else {}),
    }
    (out / "training_summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    print(f"train: saved {out} in {time.monotonic() - started:.0f} s", flush=True)


def _core_pairs(world: w.World) -> list[tuple[str, str]]:
    """(question, answer) of every core item, canonical phrasing."""
    pairs = [
        (w.fact_question(attribute, c.name), c.answer(attribute))
        for c in world.countries
        for attribute in w.ATTRIBUTES
    ]
    return pairs + [(w.sum_question(a, b), str(a + b)) for a, b in world.sums]


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments and train."""
    defaults = TrainConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="model directory to write")
    parser.add_argument("--data", type=Path, default=ROOT / "pipelines/data/train.jsonl")
    parser.add_argument("--system", type=Path, default=ROOT / "prompts/demo/system.txt")
    parser.add_argument("--user", type=Path, default=ROOT / "prompts/demo/user.txt")
    parser.add_argument(
        "--template", type=Path, default=ROOT / "pipelines/demo/chat_template.jinja"
    )
    for field in (
        "seed",
        "steps",
        "batch_size",
        "hidden_size",
        "intermediate_size",
        "num_layers",
        "threads",
    ):
        parser.add_argument(
            "--" + field.replace("_", "-"), type=int, default=getattr(defaults, field)
        )
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument(
        "--compare-to", type=Path, default=None, help="a model folder to compare the result with"
    )
    parser.add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="fine-tune this model folder (its tokenizer and weights) instead of training anew",
    )
    parser.add_argument("--warmup", type=int, default=defaults.warmup)
    args = parser.parse_args(argv)
    cfg = TrainConfig(
        seed=args.seed,
        steps=args.steps,
        batch_size=args.batch_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_layers=args.num_layers,
        threads=args.threads,
        lr=args.lr,
        warmup=args.warmup,
    )
    train(cfg, args.out, args.data, args.system, args.user, args.template, args.init_from)
    branch = mkl_branch()
    print(f"train: MKL ran its {branch} branch", flush=True)
    if not branch.startswith("AVX2"):
        print(
            "train: warning: not MKL's AVX2 branch, with which the shipped weights were "
            "trained: expect other weights (see releasekit/_support/mkl_intel_branch.c)",
            flush=True,
        )
    if args.compare_to is not None:
        print(compare_weights(args.out, args.compare_to), flush=True)
    return 0


def file_digests(folder: Path) -> dict[str, str]:
    """sha256 of every file of a model folder, by name."""
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
        if p.is_file()
    }


def compare_weights(trained: Path, shipped: Path) -> str:
    """One line: whether the weights trained here are byte-identical to the shipped ones."""
    mine, theirs = file_digests(trained), file_digests(shipped)
    differ = sorted(n for n in set(mine) | set(theirs) if mine.get(n) != theirs.get(n))
    if not differ:
        return f"train: {trained} is byte-identical to {shipped}"
    return (
        f"train: {trained} differs from {shipped} in {', '.join(differ)} (float kernels differ "
        "between CPU kinds; the demo serves the shipped weights on every host)"
    )


if __name__ == "__main__":
    raise SystemExit(main())
