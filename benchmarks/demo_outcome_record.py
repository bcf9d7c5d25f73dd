"""What one run of the demo did and where its time went, from the files it leaves in its
project: each step's seconds (`.releasekit/demo-steps.tsv`), each decision it announced
with the gate that made it (`.releasekit/demo-outcomes.jsonl`), and, given the captured
log, how many lines a person had to read.

    bash scripts/demo.sh > demo.log 2>&1
    .venv/bin/python benchmarks/demo_outcome_record.py --project . --log demo.log \
        --out benchmarks/results/demo_outcome.avx512.json

`--project` is the checkout the demo ran in. Reads only; writes the result file (with its
`run` block: host kind, date, commit) and prints the totals.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from _results import RESULTS, write_result


def outcome(project: Path, log: Path | None) -> dict[str, Any]:
    """The demo's steps (title, seconds, decisions) and totals, from `project`'s files."""
    state = project / ".releasekit"
    steps: list[dict[str, Any]] = []
    for line in (state / "demo-steps.tsv").read_text().splitlines():
        seconds, _, title = line.partition("\t")
        if title:
            steps.append({"step": title, "seconds": int(seconds), "decisions": []})
    by_title = {s["step"]: s for s in steps}
    outcomes = state / "demo-outcomes.jsonl"
    for line in outcomes.read_text().splitlines() if outcomes.is_file() else []:
        d = json.loads(line)
        if (s := by_title.get(d.get("step", ""))) is not None:
            s["decisions"].append({"decision": d.get("decision"), "by": d.get("by")})
    lines = None
    if log is not None:
        lines = len(log.read_text(errors="replace").splitlines())
    # The demo commits its key and approver on top of what was cloned: the code that ran is
    # the commit the clone started from.
    base = subprocess.run(
        ["git", "-C", str(project), "merge-base", "HEAD", "origin/HEAD"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return {
        "code_commit": base or None,
        "total_s": sum(s["seconds"] for s in steps),
        "log_lines": lines,
        "decisions": sum(len(s["decisions"]) for s in steps),
        "steps": steps,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--project", type=Path, default=Path("."))
    p.add_argument("--log", type=Path, default=None, help="the demo's captured output")
    p.add_argument("--out", type=Path, default=RESULTS / "demo_outcome.json")
    a = p.parse_args(argv)
    res = outcome(a.project, a.log)
    write_result(a.out, res, argv=argv)
    print(
        f"demo: {res['total_s'] // 60}:{res['total_s'] % 60:02d} over {len(res['steps'])} steps, "
        f"{res['decisions']} decisions, {res['log_lines']} log lines -> {a.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
