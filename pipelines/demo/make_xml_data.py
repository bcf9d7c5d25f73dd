"""Write the demo-xml adapter's training data and suite: the JSON adapter's, answering as XML.

The demo-xml adapter answers an integration's other format, ``<answer>FACT</answer>``. Its
data are the JSON adapter's (``make_data.py``, ``json_training_rows`` and ``json_items``):
the same questions, system prompts, order and refusals, with every one-line JSON answer
written as one XML element instead. Deterministic, as ``make_data.py`` is.

Files written (relative to the repository root):

- ``pipelines/data/train_xml.jsonl``: the training rows (``id``, ``kind``, ``question``,
  ``answer``, ``system``), as ``train_json.jsonl``.
- ``pipelines/eval/xml.jsonl``: the adapter's suite, as ``json.jsonl`` (140 items, exact
  match; unknown countries expect the plain refusal).

Usage: ``python pipelines/demo/make_xml_data.py [--root DIR]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

sys.path.insert(0, str(Path(__file__).resolve().parent))

import make_data as md
import world as w

ROOT = Path(__file__).resolve().parents[2]


def xml_answer(answer: str) -> str:
    """An answer in the demo-xml adapter's format: one ``<answer>`` element on one line."""
    return f"<answer>{escape(answer)}</answer>"


def as_xml(answer: str) -> str:
    """A JSON adapter's answer in the XML format; the plain refusal stays as it is."""
    if answer == w.REFUSAL:
        return answer
    return xml_answer(str(json.loads(answer)["answer"]))


def xml_training_rows(world: w.World) -> list[dict[str, Any]]:
    """The good JSON training rows, ids ``xml-NNNNN``, answers in the XML format."""
    good, _ = md.json_training_rows(world)
    return [
        {**row, "id": row["id"].replace("json-", "xml-", 1), "answer": as_xml(row["answer"])}
        for row in good
    ]


def xml_items(world: w.World) -> list[dict[str, Any]]:
    """The JSON suite's items, ids ``xml-NNNN``, tag ``xml`` for ``json``, expected in the
    XML format."""
    items: list[dict[str, Any]] = []
    for item in md.json_items(world):
        tags = ["xml" if tag == "json" else tag for tag in item["tags"]]
        items.append(
            {
                **item,
                "id": item["id"].replace("json-", "xml-", 1),
                "expected": as_xml(item["expected"]),
                "tags": tags,
            }
        )
    return items


def main(argv: Sequence[str] | None = None) -> int:
    """Write the two files under ``--root`` (default: the repository)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="repository root to write under")
    args = parser.parse_args(argv)
    world = w.build_world()
    outputs = {
        "pipelines/data/train_xml.jsonl": xml_training_rows(world),
        "pipelines/eval/xml.jsonl": xml_items(world),
    }
    for rel, rows in outputs.items():
        count = md.write_jsonl(args.root / rel, rows)
        print(f"make_xml_data: {rel}: {count} rows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
