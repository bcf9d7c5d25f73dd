"""The demo checks its own story: after a promotion, read what the ledger recorded for the
release in the environment and stop the demo if a different gate decided than the step
announced.

    python scripts/demo_expect.py blocked ENV MANIFEST --by "suite facts" [--only]
    python scripts/demo_expect.py blocked ENV MANIFEST --by "suite core" --kind quality
    python scripts/demo_expect.py promoted ENV MANIFEST

`blocked`: the latest event for the release in ENV is `gate_failed` and its failed gates
include every `--by` gate; with `--only` they are exactly those; with `--kind K`, every
failed gate is of kind K (read from the gate report the event links). `promoted`: the latest
event is a `promote` (not an override) with no failed gate, advisory or not. Reads only: the
ledger is opened read-only. Exit 1 with one line saying what decided instead.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from releasekit.config import load_settings
from releasekit.spec.lock import lock_path_for, read_lock
from releasekit.stores.ledger import open_ledger


def _failed_kinds(evidence: dict[str, Any]) -> dict[str, str]:
    """Failed gate name -> kind, from the gate report the event links (empty if unreadable)."""
    path = evidence.get("report") or evidence.get("gate_report")
    try:
        report = json.loads(Path(str(path)).read_text()) if path else {}
    except (OSError, ValueError):
        return {}
    gates = report.get("gates") or []
    return {g["name"]: g.get("kind", "?") for g in gates if not g.get("passed", True)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outcome", choices=["blocked", "promoted"])
    parser.add_argument("env")
    parser.add_argument("manifest", type=Path)
    parser.add_argument("--by", action="append", default=[], help="a gate that must have failed")
    parser.add_argument("--only", action="store_true", help="no other gate may have failed")
    parser.add_argument("--kind", help="every failed gate must be of this kind")
    args = parser.parse_args(argv)

    release = read_lock(lock_path_for(args.manifest)).release_id
    ledger = open_ledger(load_settings(), read_only=True)
    events = [r for r in ledger.records(environment=args.env) if r.to_release == release]
    if not events:
        print(f"demo: stopped, nothing recorded for {args.manifest} in {args.env}")
        return 1
    last = events[-1]
    gates = last.evidence.get("gates") or {}
    failed = list(gates.get("failed") or [])
    advisory = list(gates.get("advisory_failed") or [])
    what = (
        f"{last.type} (failed: {', '.join(failed) or '-'}; advisory: {', '.join(advisory) or '-'})"
    )
    problem = ""
    if args.outcome == "promoted":
        if last.type != "promote" or failed or advisory:
            problem = f"expected a promotion through every gate, got {what}"
    elif last.type != "gate_failed":
        problem = f"expected it blocked by {', '.join(args.by)}, got {what}"
    else:
        missing = [g for g in args.by if g not in failed]
        extra = [g for g in failed if g not in args.by]
        kinds = _failed_kinds(last.evidence)
        wrong_kind = [g for g in failed if args.kind and kinds.get(g) not in (None, args.kind)]
        if missing:
            problem = f"expected {', '.join(missing)} to block it, got {what}"
        elif args.only and extra:
            problem = f"expected only {', '.join(args.by)} to block it, got {what}"
        elif wrong_kind:
            problem = f"expected only {args.kind} gates to block it, got {what}"
    if problem:
        report = last.evidence.get("report") or last.evidence.get("gate_report") or "-"
        print(f"demo: stopped: {args.manifest}: {problem} (gate report: {report})")
        return 1
    print(f"as announced: {args.manifest} in {args.env}: {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
