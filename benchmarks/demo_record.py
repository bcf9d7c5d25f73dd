"""What the demo's progressive-delivery block and its live-only regression did, from its
project's own ledger and state: the approval and the refusal before it, the shadow
comparisons (their answer agreement included), each canary step's judgement (figures,
limits, counts over the limit, p-values), every promotion a gate refused (the `gate_failed`
events: the damaged prompt's quality gates, the approval gate, the perf gates of a
`--no-canary` promotion) with the figures of the gate report each event links, the abort,
the watch's rollback after a promotion, and what the streaming clients and the users got.

    bash scripts/demo.sh && .venv/bin/python benchmarks/demo_record.py [--project DIR]

`--project` is the checkout the demo ran in (default: this one). Prints one line per event
and writes benchmarks/results/demo_progressive.json; the README's "In the demo" figures
point at it. Reads only: the ledger is opened read-only and nothing in the project changes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from _results import RESULTS, write_result

BLOCK_TYPES = (
    "approve",
    "gate_failed",
    "shadow",
    "canary_step",
    "canary_aborted",
    "mark_bad",
    "promote",
    "rollback",
)


def _checks(ev: dict[str, Any]) -> list[dict[str, Any]]:
    steps = ev.get("canary", {}).get("steps") or ev.get("steps") or []
    return [c for s in steps for c in s.get("checks", [])]


def _gates(evidence: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Every gate of the gate report an event links (its figures: candidate, live, limit,
    detail), read through the model promote writes it with; None without a readable one."""
    from pydantic import ValidationError

    from releasekit.promote.gates import GateReport

    path = evidence.get("report") if isinstance(evidence, dict) else None
    if not isinstance(path, str):
        return None
    try:
        report = GateReport.model_validate_json(Path(path).read_bytes())
    except (OSError, ValidationError):
        return None
    keep = ("name", "kind", "passed", "advisory", "candidate", "live", "limit", "detail")
    return [g.model_dump(mode="json", include=set(keep)) for g in report.gates]


def collect(project: Path, env: str) -> dict[str, Any]:
    """The block's events in `env` (from its first approval on, with the refusals of the
    approved releases just before it), the kept shadow comparisons and the streaming
    clients' summary."""
    os.environ["RELEASEKIT_ROOT"] = str(project)
    from releasekit.config import load_settings
    from releasekit.stores.ledger import open_ledger

    settings = load_settings()
    led = open_ledger(settings, read_only=True)
    recs = led.records(environment=env, types=list(BLOCK_TYPES))
    first = next((i for i, r in enumerate(recs) if r.type == "approve"), None)
    if first is None:
        sys.exit(f"demo_record: no approval in {env}'s ledger: run scripts/demo.sh first")
    approved = {r.to_release for r in recs[first:] if r.type == "approve"}
    while (
        first > 0
        and recs[first - 1].type == "gate_failed"
        and recs[first - 1].to_release in approved
    ):
        first -= 1  # the promotion the approval gate refused, before anyone approved
    events = [
        {
            "seq": r.seq,
            "type": r.type,
            "time": r.time.isoformat(),
            "to_release": r.to_release,
            "from_release": r.from_release,
            "reason": r.reason,
            "evidence": r.evidence,
            "gates": _gates(r.evidence),
        }
        for r in recs[first:]
    ]
    shadow_dir = project / ".releasekit" / "shadow"
    shadows = [json.loads(p.read_text()) for p in sorted(shadow_dir.glob("*.json")) if p.is_file()]

    def lines(name: str) -> list[str]:
        path = project / ".releasekit" / name
        return path.read_text().strip().splitlines() if path.is_file() else []

    return {
        "env": env,
        "events": events,
        "shadow_comparisons": shadows,
        "clients": lines("demo-traffic.out"),
        "users": lines("demo-users.out"),
    }


def _head(project: Path) -> str | None:
    """The commit the demo's checkout was at (None when it is not a git checkout)."""
    import subprocess

    r = subprocess.run(
        ["git", "-C", str(project), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    return r.stdout.strip() or None if r.returncode == 0 else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--project", type=Path, default=Path(__file__).resolve().parents[1])
    ap.add_argument("--env", default="staging")
    ap.add_argument("--out", type=Path, default=RESULTS / "demo_progressive.json")
    args = ap.parse_args()
    result = collect(args.project.resolve(), args.env)
    for e in result["events"]:
        print(f"{e['seq']:>4} {e['type']:<15} {str(e['to_release'])[:12]:<12} {e['reason'][:150]}")
        for c in _checks(e["evidence"]):
            if c.get("verdict") in ("pass", "breach"):
                print(f"       {c['metric']}: {c['reason'][:160]}")
    for s in result["shadow_comparisons"]:
        rid, why = str(s.get("release_id"))[:12], str(s.get("reason", ""))[:160]
        print(f"shadow {rid}: {s.get('verdict')} ({why})")
    for line in result["clients"]:
        print(f"clients: {line}")
    for line in result["users"]:
        print(f"users: {line}")
    path = write_result(args.out, result)
    # The demo ran from the project's checkout: its commit is the one the figures belong to.
    data = json.loads(path.read_text())
    data["run"]["demo_project_commit"] = _head(args.project.resolve())
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
