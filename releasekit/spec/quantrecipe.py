"""A quantisation recipe's weight arguments (the manifest's fields laid over llm-compressor's
scheme preset) and their checks against the model folder, the calibration set and
compressed-tensors' own argument model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from releasekit.spec.manifest import LoadedManifest, Quantisation

#: The preset weight arguments a recipe starts from (compressed-tensors' QuantizationArgs).
PRESET_KEYS = ("num_bits", "type", "symmetric", "strategy", "group_size", "dynamic")


def needs_calibration(q: Quantisation) -> bool:
    """Whether quantising with `q` reads its calibration set: GPTQ does, and static FP8
    calibrates its activation scales."""
    return q.scheme != "none" and (q.method == "gptq" or q.scheme == "FP8")


def preset_weights(scheme: str) -> dict[str, Any]:
    """The weight arguments of llm-compressor's preset `scheme` (imports compressed-tensors,
    which imports torch)."""
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    weights = PRESET_SCHEMES[scheme]["weights"]
    return dict(weights.model_dump(mode="json", include=set(PRESET_KEYS)))


def weight_args(preset: dict[str, Any], recipe: dict[str, Any]) -> dict[str, Any]:
    """The preset's weight arguments with a recipe's fields (Quantisation.weight_recipe) laid
    over: `strategy: channel` drops the groups; `group_size` (or `strategy: group`) makes the
    scales per group, of the preset's size unless given."""
    args = dict(preset)
    if "symmetric" in recipe:
        args["symmetric"] = recipe["symmetric"]
    if recipe.get("strategy") == "channel":
        args.update(strategy="channel", group_size=None)
    elif recipe.get("strategy") == "group" or "group_size" in recipe:
        args.update(strategy="group", group_size=recipe.get("group_size", args.get("group_size")))
    return args


def config_groups(q: Quantisation, targets: list[str]) -> dict[str, Any]:
    """llm-compressor's `config_groups` for a recipe that sets weight fields: the scheme's
    preset (its input activations included, as W8A8's) with the weights from `weight_args`."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    preset = PRESET_SCHEMES[q.scheme]
    weights = QuantizationArgs.model_validate(
        weight_args(preset_weights(q.scheme), q.weight_recipe())
    )
    scheme = QuantizationScheme(
        targets=targets,
        weights=weights,
        input_activations=preset.get("input_activations"),
    )
    return {"group_0": scheme}


def check_weight_args(q: Quantisation) -> list[str]:
    """`quantisation: problem` when compressed-tensors' QuantizationArgs refuses the recipe's
    weight arguments (checked only when the recipe sets a weight field; [] where
    compressed-tensors is not installed: the quantisation process checks again)."""
    recipe = q.weight_recipe()
    if not recipe:
        return []
    try:
        from compressed_tensors.quantization import QuantizationArgs
        from pydantic import ValidationError
    except ImportError:
        return []
    try:
        QuantizationArgs.model_validate(weight_args(preset_weights(q.scheme), recipe))
    except ValidationError as exc:
        first = exc.errors()[0]
        msg = str(first.get("msg", exc)).removeprefix("Value error, ").splitlines()[0]
        given = ", ".join(f"{k} {v}" for k, v in recipe.items())
        return [f"quantisation: compressed-tensors refuses the weight recipe ({given}): {msg}"]
    return []


def linear_in_features(model_dir: Path) -> dict[str, int]:
    """The in-features of a decoder's Linear layers, from its config.json, by the config key
    they come from ({} if unreadable): hidden_size (attention and MLP inputs),
    intermediate_size (the MLP's down projection), heads x head_dim (attention output)."""
    try:
        cfg = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    cfg = cfg.get("text_config", cfg) if isinstance(cfg, dict) else {}
    out = {k: cfg[k] for k in ("hidden_size", "intermediate_size") if isinstance(cfg.get(k), int)}
    heads, head_dim = cfg.get("num_attention_heads"), cfg.get("head_dim")
    if isinstance(heads, int) and isinstance(head_dim, int):
        out["num_attention_heads x head_dim"] = heads * head_dim
    return out


def check_group_size(q: Quantisation, model_dir: Path) -> list[str]:
    """`quantisation.group_size: problem` when the recipe's group size does not divide the
    in-features of every Linear layer of the model (its config.json)."""
    if q.group_size is None:
        return []
    sizes = linear_in_features(model_dir)
    bad = {k: n for k, n in sizes.items() if n % q.group_size}
    if not bad:
        return []
    listed = ", ".join(f"{k} {n}" for k, n in bad.items())
    return [
        f"quantisation.group_size: {q.group_size} does not divide the in-features of the "
        f"model's Linear layers ({listed} in {model_dir / 'config.json'})"
    ]


def calibration_samples(path: Path) -> int:
    """The number of non-blank lines of a JSONL calibration file (0 if unreadable)."""
    try:
        with path.open(encoding="utf-8", errors="replace") as fh:
            return sum(1 for line in fh if line.strip())
    except OSError:
        return 0


def check_calibration(q: Quantisation, calibration: Path | None) -> list[str]:
    """`quantisation.calibration.dataset: problem` when the set a recipe reads has no
    samples. (More `samples` than the file has is no problem: all of it is used, and
    quantise.json records how many.)"""
    if not needs_calibration(q) or q.calibration is None or calibration is None:
        return []
    if calibration.is_file() and calibration_samples(calibration) == 0:
        return [f"quantisation.calibration.dataset: {q.calibration.dataset} has no samples"]
    return []


def check_recipe(q: Quantisation, model_dir: Path, calibration: Path | None) -> list[str]:
    """Every problem of a quantisation recipe that needs the model folder, the calibration
    file or compressed-tensors to see, as `field.path: problem` lines."""
    return check_group_size(q, model_dir) + check_calibration(q, calibration) + check_weight_args(q)


def check_manifest_recipe(lm: LoadedManifest) -> list[str]:
    """check_recipe for a loaded manifest (its model folder and calibration set)."""
    q = lm.manifest.quantisation
    calibration = lm.resolve(q.calibration.dataset) if q.calibration else None
    return check_recipe(q, lm.resolve(lm.manifest.model.source), calibration)


def calibration_notes(lm: LoadedManifest) -> list[str]:
    """What a calibration set gives the quantiser once its rows are cut at `max_seq_length`:
    a note when they collapse into a few distinct sequences (rows that share a prefix longer
    than the cut, such as a system prompt, all become that prefix: the calibration then sees
    no question). Tokenised with the model's own `tokenizer.json`; no note where there is
    none to read. A note, not a problem: the recipe is valid, and a ladder shows what it
    costs."""
    q = lm.manifest.quantisation
    if not needs_calibration(q) or q.calibration is None:
        return []
    tok_path = lm.resolve(lm.manifest.model.source) / "tokenizer.json"
    data = lm.resolve(q.calibration.dataset)
    if not tok_path.is_file() or not data.is_file():
        return []
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tok_path))
    cut = q.calibration.max_seq_length
    seen: set[tuple[int, ...]] = set()
    rows = 0
    with data.open(encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if rows >= q.calibration.samples:
                break
            try:
                text = json.loads(line).get("text") if line.strip() else None
            except (ValueError, AttributeError):
                text = None
            if not isinstance(text, str):
                continue
            rows += 1
            seen.add(tuple(tokenizer.encode(text).ids[:cut]))
    if rows >= 10 and len(seen) * 10 <= rows:
        return [
            f"quantisation.calibration.max_seq_length: cut at {cut} tokens, the {rows} "
            f"calibration rows are {len(seen)} distinct sequence{'s' if len(seen) != 1 else ''} "
            "(they share a longer prefix, such as the system prompt): the quantiser calibrates "
            "on that prefix alone"
        ]
    return []
