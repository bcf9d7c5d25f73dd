"""The demo's closing summary: for each step, the decision it announced, the gate that made
it (as the ledger recorded it) and the time it took; then where the time went.

    python scripts/demo_outcome.py note DECISION [--by GATE]   # record one for this step
    python scripts/demo_outcome.py table                        # print the summary

`scripts/demo.sh` writes one line a step to the steps file when the step ends (its seconds,
a tab, its title) and names the running step in DEMO_STEP; `scripts/demo_expect.py` (and
`note`, for a decision the step's exit status announces) appends one JSON line per
decision to the outcomes file: {"step", "decision", "by"}. Both files live under
.releasekit/ (DEMO_STEPS, DEMO_OUTCOMES override them). Standard library only: it runs in
well under a second.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

STEPS = Path(".releasekit/demo-steps.tsv")
OUTCOMES = Path(".releasekit/demo-outcomes.jsonl")


def steps_path() -> Path:
    """The steps file: DEMO_STEPS, or .releasekit/demo-steps.tsv."""
    return Path(os.environ.get("DEMO_STEPS") or STEPS)


def outcomes_path() -> Path:
    """The outcomes file: DEMO_OUTCOMES, or .releasekit/demo-outcomes.jsonl."""
    return Path(os.environ.get("DEMO_OUTCOMES") or OUTCOMES)


def record(decision: str, by: str = "-", *, step: str | None = None) -> None:
    """Append a decision of the running step (DEMO_STEP) to the outcomes file. Outside the
    demo (no DEMO_STEP and no `step`) it records nothing."""
    step = step if step is not None else os.environ.get("DEMO_STEP", "")
    if not step:
        return
    path = outcomes_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps({"step": step, "decision": decision, "by": by or "-"}) + "\n")


def read_steps(path: Path) -> list[tuple[str, int]]:
    """(title, seconds) for each line `SECONDS<TAB>TITLE`; a garbled line is skipped."""
    steps: list[tuple[str, int]] = []
    if not path.is_file():
        return steps
    for line in path.read_text(encoding="utf-8").splitlines():
        seconds, _, title = line.partition("\t")
        if title and seconds.strip().isdigit():
            steps.append((title, int(seconds)))
    return steps


def read_outcomes(path: Path) -> list[dict[str, str]]:
    """The recorded decisions, in order; a garbled line is skipped."""
    rows: list[dict[str, str]] = []
    if not path.is_file():
        return rows
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and "step" in row:
            rows.append({k: str(row.get(k) or "-") for k in ("step", "decision", "by")})
    return rows


def clock(seconds: int) -> str:
    """Seconds as `M:SS` (`H:MM:SS` from an hour)."""
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3].rstrip() + "..."


def _grid(columns: Sequence[str], rows: Sequence[Sequence[str]], *, right: int = 1) -> list[str]:
    """Aligned columns two spaces apart; the first `right` columns (figures) right-aligned."""
    widths = [max([len(c), *(len(r[i]) for r in rows)]) for i, c in enumerate(columns)]
    return [
        "  ".join(
            cell.rjust(w) if i < right else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(r, widths, strict=True))
        ).rstrip()
        for r in [list(columns), *rows]
    ]


def render(
    steps: Sequence[tuple[str, int]],
    outcomes: Sequence[dict[str, str]],
    *,
    title_width: int = 44,
    top: int = 8,
) -> list[str]:
    """The summary's lines: the outcome table (a row a decision, a step without one shows
    "-", its time on its first row) and the largest steps first with their share."""
    by_step: dict[str, list[dict[str, str]]] = {}
    for o in outcomes:
        by_step.setdefault(o["step"], []).append(o)
    rows: list[list[str]] = []
    for title, seconds in steps:
        decisions = by_step.get(title) or [{"decision": "-", "by": "-"}]
        for i, d in enumerate(decisions):
            rows.append(
                [
                    clock(seconds) if i == 0 else "",
                    _short(title, title_width) if i == 0 else "",
                    d["decision"],
                    d["by"],
                ]
            )
    lines = ["outcome", *_grid(["time", "step", "decision", "decided by"], rows)]
    total = sum(s for _, s in steps)
    lines += ["", f"where the time went ({clock(total)} in all)"]
    ranked = sorted(steps, key=lambda s: s[1], reverse=True)[:top]
    lines += _grid(
        ["time", "share", "step"],
        [[clock(s), f"{(100 * s / total if total else 0):.0f}%", _short(t, 64)] for t, s in ranked],
        right=2,
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    note = sub.add_parser("note", help="record a decision of the running step")
    note.add_argument("decision")
    note.add_argument("--by", default="-", help="the gate or check that made it")
    sub.add_parser("table", help="print the outcome table and where the time went")
    args = parser.parse_args(argv)
    if args.command == "note":
        record(args.decision, args.by)
        return 0
    for line in render(read_steps(steps_path()), read_outcomes(outcomes_path())):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
