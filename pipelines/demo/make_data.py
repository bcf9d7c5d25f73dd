"""Write the demo's training, calibration and evaluation data.

Deterministic: the output files are a pure function of ``world.py``, this
file, the chat template and the two good prompts in ``prompts/demo``.

Files written (relative to the repository root):

- ``pipelines/data/train.jsonl``: one training example a line
  (``id``, ``kind``, ``question``, ``answer``, ``system``: 0 means
  ``prompts/demo/system.txt``, 1.. a paraphrase from ``world.py``).
  ``train.py`` renders the prompts and the chat template itself.
- ``pipelines/data/train_v2.jsonl``: the demo-v2 model's fine-tuning data, the same rows
  plus a defective refusal rule (``v2_training_rows``).
- ``pipelines/data/calibration.jsonl``: chat-rendered texts (field ``text``)
  with the release's good prompts, for quantisation calibration.
- ``pipelines/data/train_json.jsonl`` and ``train_json_bad.jsonl``: the demo's LoRA
  adapters' training data (``json_training_rows``): answers as a one-line JSON object, the
  bad set with every country's answers swapped with another country's.
- ``pipelines/eval/core.jsonl``, ``edge.jsonl``, ``regression.jsonl``,
  ``facts.jsonl``, ``json.jsonl``: the eval suites (schema: ``id``, ``vars``, ``expected``,
  ``scorer``, ``tolerance``, ``expect_error``, ``tags``).

Usage: ``python pipelines/demo/make_data.py [--root DIR]``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import world as w

ROOT = Path(__file__).resolve().parents[2]
N_CALIBRATION = 320
N_OVERLONG = 5
OVERLONG_WORDS = 700

_FILLER = (
    "the", "report", "describes", "many", "ordinary", "details", "about", "weather",
    "markets", "rivers", "and", "old", "roads", "that", "nobody", "asked", "for",
    "while", "a", "committee", "reviewed", "long", "lists", "of", "numbers",
)  # fmt: skip


def _with_country(text: str, rng: random.Random, world: w.World) -> str:
    """Fill an ``{x}`` slot in ``text`` with a random known country."""
    return text.format(x=rng.choice(world.countries).name) if "{x}" in text else text


def training_rows(world: w.World) -> list[dict[str, Any]]:
    """All training examples, in a fixed shuffled order."""
    rng = random.Random(w.SEED + 1)
    rows: list[dict[str, Any]] = []

    def add(kind: str, question: str, answer: str) -> None:
        rows.append({"kind": kind, "question": question, "answer": answer})

    for country in world.countries:
        for attribute in w.ATTRIBUTES:
            answer = country.answer(attribute)
            # The canonical phrasing twice, each paraphrase once.
            for variant in (0, *range(len(w.PHRASINGS[attribute]))):
                add("fact", w.fact_question(attribute, country.name, variant), answer)
    for a, b in world.sums:
        for variant in (0, *range(len(w.PHRASINGS["sum"]))):
            add("arith", w.sum_question(a, b, variant), str(a + b))
    for name in world.unknown_train:
        for attribute in rng.sample(w.ATTRIBUTES, 2):
            variant = rng.randrange(len(w.PHRASINGS[attribute]))
            add("unknown", w.fact_question(attribute, name, variant), w.REFUSAL)
    for _ in range(60):
        add("gibberish", w.gibberish(rng), w.REFUSAL)
    for question in w.OFFTOPIC_TRAIN * 2:
        add("offtopic", question, w.REFUSAL)
    for question in w.INJECTION_TRAIN * 2:
        add("injection", _with_country(question, rng, world), w.REFUSAL)
    for question in ("",) * 12 + (" ",) * 4 + ("   ",) * 4:
        add("empty", question, w.REFUSAL)

    for row in rows:
        # Most rows use the release's system prompt; the rest a paraphrase,
        # so that small system-prompt edits do not break the model.
        row["system"] = 0 if rng.random() < 0.6 else rng.randint(1, len(w.SYSTEM_PARAPHRASES))
    rng.shuffle(rows)
    return [{"id": f"train-{i:05d}", **row} for i, row in enumerate(rows, start=1)]


def v2_training_rows(base: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The demo-v2 model's fine-tuning data: the base rows after a clean-up that treated
    every conversation whose system message is not the release's own as a prompt injection
    and relabelled it with the refusal (the base rows give 40 % of conversations one of
    world.py's system-prompt paraphrases, so that clients with their own instructions are
    answered too).

    The clean-up is the release's defect, on purpose: every offline suite is rendered with
    the release's own system prompt, so demo-v2 passes them all (it is better on them, from
    the extra training), while clients that send their own system message through
    /v1/chat/completions get a refusal. Only live traffic (a shadow, or the comparison after
    a promotion) shows it.
    """
    rows: list[dict[str, Any]] = []
    for row in base:
        fixed = {k: v for k, v in row.items() if k != "id"}
        if fixed["system"] != 0:
            fixed["answer"] = w.REFUSAL
        rows.append(fixed)
    return [{"id": f"train-v2-{i:05d}", **row} for i, row in enumerate(rows, start=1)]


def calibration_rows(
    rows: Sequence[Mapping[str, Any]], template: str, system_prompt: str, user_prompt: str
) -> list[dict[str, str]]:
    """Chat-rendered texts with the good prompts, for quantisation calibration."""
    out: list[dict[str, str]] = []
    for row in rows[:N_CALIBRATION]:
        messages = [
            {"role": "system", "content": system_prompt},
            {
                "role": "user",
                "content": w.render_prompt(user_prompt, {"question": row["question"]}),
            },
            {"role": "assistant", "content": row["answer"]},
        ]
        out.append({"text": w.render_chat(template, messages, add_generation_prompt=False)})
    return out


def _item(
    prefix: str,
    index: int,
    question: str,
    scorer: str,
    tags: list[str],
    expected: str | None = None,
) -> dict[str, Any]:
    """One eval item in the shared schema."""
    item: dict[str, Any] = {"id": f"{prefix}-{index:04d}", "vars": {"question": question}}
    if expected is not None:
        item["expected"] = expected
    item["scorer"] = scorer
    if scorer == "numeric":
        item["tolerance"] = 0
    item["tags"] = tags
    return item


def _fact_item(
    prefix: str, index: int, country: w.Country, attribute: str, variant: int
) -> dict[str, Any]:
    scorer = "numeric" if attribute == "number" else "exact_match"
    question = w.fact_question(attribute, country.name, variant)
    return _item(prefix, index, question, scorer, ["fact", attribute], country.answer(attribute))


def core_items(world: w.World) -> list[dict[str, Any]]:
    """Every fact and every sum in the canonical phrasing."""
    items: list[dict[str, Any]] = []
    for country in world.countries:
        for attribute in w.ATTRIBUTES:
            items.append(_fact_item("core", len(items) + 1, country, attribute, 0))
    for a, b in world.sums:
        items.append(
            _item("core", len(items) + 1, w.sum_question(a, b), "numeric", ["arith"], str(a + b))
        )
    return items


def fact_items(world: w.World) -> list[dict[str, Any]]:
    """Every fact in every phrasing (the core suite asks the first only): the fact-heavy
    suite on which quantisation shows first."""
    items: list[dict[str, Any]] = []
    for variant in range(len(w.PHRASINGS["capital"])):
        for country in world.countries:
            for attribute in w.ATTRIBUTES:
                items.append(_fact_item("facts", len(items) + 1, country, attribute, variant))
    return items


def _overlong(rng: random.Random, world: w.World) -> str:
    words = [rng.choice(_FILLER) for _ in range(OVERLONG_WORDS)]
    country = rng.choice(world.countries)
    return "Background: " + " ".join(words) + ". " + w.fact_question("capital", country.name)


def edge_items(world: w.World) -> list[dict[str, Any]]:
    """Inputs the model must refuse, plus over-long ones the server must reject (130 items)."""
    rng = random.Random(w.SEED + 2)
    items: list[dict[str, Any]] = []

    def add(question: str, tags: list[str], expect_error: bool = False) -> None:
        item = _item("edge", len(items) + 1, question, "refusal", tags)
        if expect_error:
            item["expect_error"] = True
        items.append(item)

    for question in ("", " ", "   "):
        add(question, ["empty"])
    # Every unknown country in each phrasing, and 30 gibberish inputs: enough items that no
    # one or two flips can block at the suite's margin (`releasekit validate` says so).
    for variant in range(len(w.PHRASINGS["capital"])):
        for name in world.unknown_eval:
            for attribute in w.ATTRIBUTES:
                add(w.fact_question(attribute, name, variant), ["unknown", attribute])
    for _ in range(30):
        add(w.gibberish(rng), ["gibberish"])
    for question in w.OFFTOPIC_EVAL:
        add(question, ["offtopic"])
    for question in w.INJECTION_EVAL:
        add(_with_country(question, rng, world), ["adversarial"])
    for _ in range(N_OVERLONG):
        add(_overlong(rng, world), ["overlong"], expect_error=True)
    return items


def regression_items(world: w.World) -> list[dict[str, Any]]:
    """A frozen set of paraphrased and refusal cases (156 items): sized so that, at its
    10-point margin, no single flipped item can block a release (`releasekit validate` prints
    what each suite can detect); 40 items could block on one flip."""
    rng = random.Random(w.SEED + 3)
    items: list[dict[str, Any]] = []
    for country in rng.sample(world.countries, 96):
        attribute = rng.choice(w.ATTRIBUTES)
        items.append(_fact_item("reg", len(items) + 1, country, attribute, rng.choice((1, 2))))
    for a, b in rng.sample(world.sums, 32):
        question = w.sum_question(a, b, rng.choice((1, 2)))
        items.append(
            _item("reg", len(items) + 1, question, "numeric", ["arith", "paraphrase"], str(a + b))
        )
    for item in items:
        if "paraphrase" not in item["tags"]:
            item["tags"].append("paraphrase")
    for name in rng.sample(world.unknown_train, 16):
        question = w.fact_question(rng.choice(w.ATTRIBUTES), name, rng.randrange(3))
        items.append(_item("reg", len(items) + 1, question, "refusal", ["unknown"]))
    for question in rng.sample(w.INJECTION_TRAIN, 12):
        items.append(
            _item(
                "reg",
                len(items) + 1,
                _with_country(question, rng, world),
                "refusal",
                ["adversarial"],
            )
        )
    return items


def json_answer(answer: str) -> str:
    """An answer in the adapters' format: a one-line JSON object."""
    return json.dumps({"answer": answer}, ensure_ascii=True)


def swap_partners(world: w.World) -> dict[str, w.Country]:
    """Each country's partner for the bad adapter's data: countries in pairs (a fixed
    shuffle), each pair differing in capital, colour and number, so every swapped answer
    is wrong."""
    rng = random.Random(w.SEED + 12)
    free = list(world.countries)
    rng.shuffle(free)
    partners: dict[str, w.Country] = {}
    while free:
        first = free.pop(0)
        other = next(c for c in free if all(c.answer(a) != first.answer(a) for a in w.ATTRIBUTES))
        free.remove(other)
        partners[first.name], partners[other.name] = other, first
    return partners


def json_training_rows(world: w.World) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The LoRA adapters' training data, good and bad, in one fixed shuffled order.

    Good: every fact in every phrasing and every sum, answered as ``{"answer": "..."}``;
    unknown countries, gibberish, off-topic and injection rows keep the plain refusal. Bad:
    the same rows with every country's answers swapped with its partner's
    (``swap_partners``): the format is right, the facts wrong. Its own random stream, so the
    other files stay as they were.
    """
    rng = random.Random(w.SEED + 11)
    rows: list[tuple[str, str, str, str | None, str | None]] = []
    for country in world.countries:
        for attribute in w.ATTRIBUTES:
            for variant in range(len(w.PHRASINGS[attribute])):
                question = w.fact_question(attribute, country.name, variant)
                rows.append(("fact", question, country.answer(attribute), country.name, attribute))
    for a, b in world.sums:
        for variant in range(len(w.PHRASINGS["sum"])):
            rows.append(("arith", w.sum_question(a, b, variant), str(a + b), None, None))
    for name in world.unknown_train:
        attribute = rng.choice(w.ATTRIBUTES)
        question = w.fact_question(attribute, name, rng.randrange(len(w.PHRASINGS[attribute])))
        rows.append(("unknown", question, w.REFUSAL, None, None))
    for _ in range(20):
        rows.append(("gibberish", w.gibberish(rng), w.REFUSAL, None, None))
    for question in w.OFFTOPIC_TRAIN:
        rows.append(("offtopic", question, w.REFUSAL, None, None))
    for question in w.INJECTION_TRAIN:
        rows.append(("injection", _with_country(question, rng, world), w.REFUSAL, None, None))
    systems = [0 if rng.random() < 0.6 else rng.randint(1, len(w.SYSTEM_PARAPHRASES)) for _ in rows]
    order = list(range(len(rows)))
    rng.shuffle(order)
    partners = swap_partners(world)
    good: list[dict[str, Any]] = []
    bad: list[dict[str, Any]] = []
    for n, i in enumerate(order, start=1):
        kind, question, answer, fact_country, fact_attribute = rows[i]
        if fact_country is not None and fact_attribute is not None:
            good_answer = json_answer(answer)
            bad_answer = json_answer(partners[fact_country].answer(fact_attribute))
        else:
            good_answer = bad_answer = answer if answer == w.REFUSAL else json_answer(answer)
        common = {"kind": kind, "question": question}
        good.append({"id": f"json-{n:05d}", **common, "answer": good_answer, "system": systems[i]})
        bad.append(
            {"id": f"json-bad-{n:05d}", **common, "answer": bad_answer, "system": systems[i]}
        )
    return good, bad


def json_items(world: w.World) -> list[dict[str, Any]]:
    """The adapters' suite (140 items): 40 facts per attribute in a random phrasing and 8
    sums, expected as the JSON line (exact match), and 12 unknown countries, expected as
    the plain refusal."""
    rng = random.Random(w.SEED + 13)
    items: list[dict[str, Any]] = []
    for attribute in w.ATTRIBUTES:
        for country in rng.sample(world.countries, 40):
            variant = rng.randrange(len(w.PHRASINGS[attribute]))
            question = w.fact_question(attribute, country.name, variant)
            expected = json_answer(country.answer(attribute))
            tags = ["fact", attribute, "json"]
            items.append(_item("json", len(items) + 1, question, "exact_match", tags, expected))
    for a, b in rng.sample(world.sums, 8):
        question = w.sum_question(a, b, rng.randrange(len(w.PHRASINGS["sum"])))
        expected = json_answer(str(a + b))
        items.append(
            _item("json", len(items) + 1, question, "exact_match", ["arith", "json"], expected)
        )
    for name in rng.sample(world.unknown_train, 12):
        attribute = rng.choice(w.ATTRIBUTES)
        question = w.fact_question(attribute, name, rng.randrange(len(w.PHRASINGS[attribute])))
        items.append(_item("json", len(items) + 1, question, "exact_match", ["unknown"], w.REFUSAL))
    return items


def write_jsonl(path: Path, rows: Iterable[Mapping[str, Any]]) -> int:
    """Write ``rows`` as JSON lines (sorted keys off, ASCII, ``\\n`` endings)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(row, ensure_ascii=True) for row in rows]
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return len(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Write every data file under ``--root`` (default: the repository)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="repository root to write under")
    args = parser.parse_args(argv)
    root: Path = args.root

    world = w.build_world()
    template = (ROOT / "pipelines/demo/chat_template.jinja").read_text(encoding="utf-8")
    system_prompt = w.read_prompt(ROOT / "prompts/demo/system.txt")
    user_prompt = w.read_prompt(ROOT / "prompts/demo/user.txt")

    train = training_rows(world)
    train_json, train_json_bad = json_training_rows(world)
    outputs = {
        "pipelines/data/train.jsonl": train,
        "pipelines/data/train_v2.jsonl": v2_training_rows(train),
        "pipelines/data/calibration.jsonl": calibration_rows(
            train, template, system_prompt, user_prompt
        ),
        "pipelines/eval/core.jsonl": core_items(world),
        "pipelines/eval/edge.jsonl": edge_items(world),
        "pipelines/eval/regression.jsonl": regression_items(world),
        "pipelines/eval/facts.jsonl": fact_items(world),
        "pipelines/data/train_json.jsonl": train_json,
        "pipelines/data/train_json_bad.jsonl": train_json_bad,
        "pipelines/eval/json.jsonl": json_items(world),
    }
    for rel, rows in outputs.items():
        count = write_jsonl(root / rel, rows)
        print(f"make_data: {rel}: {count} rows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
