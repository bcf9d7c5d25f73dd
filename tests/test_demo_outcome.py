"""The demo's closing summary (scripts/demo_outcome.py): a row per decision with the step's
time, steps without a decision shown too, and the largest steps first."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "demo_outcome.py"


@pytest.fixture(scope="module")
def demo_outcome() -> ModuleType:
    spec = importlib.util.spec_from_file_location("demo_outcome", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["demo_outcome"] = module
    spec.loader.exec_module(module)
    return module


def test_outcome_table_and_where_the_time_went(
    demo_outcome: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps as demo.sh writes them and decisions as demo_expect.py records them from the
    ledger: each decision is a row with the gate that made it, a step with two decisions
    shows its time once, a step with none shows "-", and the summary ranks the steps."""
    steps = tmp_path / "steps.tsv"
    outcomes = tmp_path / "outcomes.jsonl"
    monkeypatch.setenv("DEMO_STEPS", str(steps))
    monkeypatch.setenv("DEMO_OUTCOMES", str(outcomes))
    steps.write_text(
        "95\tsetup: install the toolkit\n"
        "not a line\n"
        "1210\tbuild: quantise, load-test and evaluate on one server\n"
        "41\tpromote W8A8 over bf16: staging, then production\n"
        "12\ttry the damaged prompt against live bf16\n"
    )
    for step, decision, by in [
        ("promote W8A8 over bf16: staging, then production", "promoted in staging: demo-w8a8",
         "all 17 gates passed"),
        ("promote W8A8 over bf16: staging, then production",
         "promoted in production: demo-w8a8", "all 16 gates passed"),
    ]:  # fmt: skip
        demo_outcome.record(decision, by, step=step)
    monkeypatch.setenv("DEMO_STEP", "try the damaged prompt against live bf16")
    demo_outcome.record("blocked in staging: demo-damaged-prompt", "suite core, suite facts")
    monkeypatch.delenv("DEMO_STEP")
    demo_outcome.record("outside the demo: not recorded")
    assert len(outcomes.read_text().splitlines()) == 3
    assert json.loads(outcomes.read_text().splitlines()[2])["by"] == "suite core, suite facts"

    lines = demo_outcome.render(
        demo_outcome.read_steps(steps), demo_outcome.read_outcomes(outcomes)
    )
    assert lines[0] == "outcome"
    assert lines[1].split() == ["time", "step", "decision", "decided", "by"]
    assert lines[2].split()[:2] == ["1:35", "setup:"] and lines[2].endswith("-")
    assert lines[3].startswith("20:10  build: quantise, load-test and evaluate o...  -")
    assert lines[2].startswith(" 1:35  setup: install the toolkit")  # times right-aligned
    w8a8 = [line for line in lines if "demo-w8a8" in line]
    assert w8a8[0].startswith(" 0:41  promote W8A8") and w8a8[0].endswith("all 17 gates passed")
    assert w8a8[1].startswith(" " * 7) and "promoted in production" in w8a8[1]
    damaged = next(line for line in lines if "damaged" in line and "0:12" in line)
    assert damaged.endswith("blocked in staging: demo-damaged-prompt  suite core, suite facts")
    at = lines.index("where the time went (22:38 in all)")
    ranked = lines[at + 2 :]
    assert [r.split()[0] for r in ranked] == ["20:10", "1:35", "0:41", "0:12"]
    assert ranked[0].split()[1] == "89%"
    assert all(line == line.rstrip() for line in lines)


def test_missing_files_give_an_empty_summary(demo_outcome: ModuleType, tmp_path: Path) -> None:
    lines = demo_outcome.render(
        demo_outcome.read_steps(tmp_path / "none.tsv"),
        demo_outcome.read_outcomes(tmp_path / "none.jsonl"),
    )
    assert lines[0] == "outcome" and "where the time went (0:00 in all)" in lines
