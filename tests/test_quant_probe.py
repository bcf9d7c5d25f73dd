"""The quantisation probe's variants: the default is the demo's own world, and its knobs
change what they say (run in a child process: the probe swaps the world module's builder)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

DEMO = Path(__file__).resolve().parents[1] / "pipelines" / "demo"

CHECK = """
import sys
sys.path.insert(0, {demo!r})
import world as w
demo_world = w.build_world()
import quant_probe as qp
assert qp.configure_world({{}}) == demo_world, "the default variant is not the demo's world"
small = qp.configure_world({{"countries": "64", "numbers": "1-99"}})
assert len(small.countries) == 64 and w.build_world() is small
assert all(1 <= c.number <= 99 for c in small.countries)
assert small.countries[0].name == demo_world.countries[0].name
qp.use_whole_names(True)
whole = qp.tr.build_tokenizer(small, [w.REFUSAL], 1536)
qp.use_whole_names(False)
pieces = qp.tr.build_tokenizer(small, [w.REFUSAL], 1536)
name = " " + small.countries[0].name
assert len(whole.encode(name).ids) == 1 and len(pieces.encode(name).ids) > 1
big = qp.configure_world({{}})
facts = qp.md.fact_items(big)
assert len(facts) == len(big.countries) * len(w.ATTRIBUTES) * len(w.PHRASINGS["capital"])
assert len({{f["vars"]["question"] for f in facts}}) == len(facts)
number = next(f for f in facts if f["tags"] == ["fact", "number"])
assert number["scorer"] == "numeric" and 100 <= int(number["expected"]) <= 999
cfg = qp.train_config({{"steps": "600", "wd": "0.3"}})
assert (cfg.steps, cfg.weight_decay, cfg.hidden_size) == (600, 0.3, 128)
print("ok")
"""


def test_probe_variants_change_the_world_and_tokenizer_they_name() -> None:
    """No knob: the demo's world; countries/numbers/names/steps do what they say; the facts
    suite asks every fact in every phrasing."""
    res = subprocess.run(
        [sys.executable, "-c", CHECK.format(demo=str(DEMO))],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout + res.stderr
