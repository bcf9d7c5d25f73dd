"""Keep a quantisation ladder's run as a result file: its table and recommendation (the
`ladder.json` that `releasekit quantise ladder` wrote), each rung's quantised-weights digest
and what made it (the pins, the host kind, the quantise seconds, from the release's
quantise.json), and the host's kind, so that two kinds' files can be compared digest by
digest. It runs nothing: run the ladder first.

    releasekit quantise ladder manifests/demo-bf16.yaml --recipes manifests/ladder/demo.yaml
    python benchmarks/ladder_record.py --out benchmarks/results/quant_ladder.avx512.json

`--project` reads another checkout's ladder (a fresh clone the ladder ran in).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import REPO, write_result


def record(project: Path, ladder_stem: str) -> dict[str, Any]:
    """The ladder's result, the commit the project was at, and, per built rung, what its
    quantise.json says made it."""
    ladder = json.loads(
        (project / ".releasekit" / "ladder" / ladder_stem / "ladder.json").read_text()
    )
    weights: dict[str, Any] = {}
    for row in ladder["rows"]:
        rid = row.get("release_id")
        q_path = project / "results" / str(rid) / "quantise.json"
        if not rid or not q_path.is_file():
            continue
        q = json.loads(q_path.read_text())
        weights[row["name"]] = {
            "release_id": rid,
            "weights_digest": q.get("weights_digest"),
            "size_after_bytes": q.get("size_after_bytes"),
            "quantise_seconds": q.get("seconds"),
            "float_paths": q.get("float_paths"),
            "made_on": q.get("made_on"),
        }
    head = subprocess.run(
        ["git", "-C", str(project), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    commit = head.stdout.strip() if head.returncode == 0 else "unknown"
    return {"ladder_commit": commit, "ladder": ladder, "weights": weights}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--project", type=Path, default=REPO, help="the checkout the ladder ran in")
    ap.add_argument("--ladder", default="demo", help="the ladder file's stem (default: demo)")
    ap.add_argument("--out", type=Path, required=True, help="the result file to write")
    args = ap.parse_args(argv)
    data = record(args.project.resolve(), args.ladder)
    write_result(args.out, data)
    lad = data["ladder"]
    print(f"{args.out}: recommended {lad['recommended']}; {len(data['weights'])} rungs' weights")
    return 0


if __name__ == "__main__":
    sys.exit(main())
