"""The demo checks its own story: after a promotion, read what the ledger recorded for the
release in the environment and stop the demo if a different gate decided than the step
announced.

    python scripts/demo_expect.py blocked ENV MANIFEST --by "suite facts" [--only]
    python scripts/demo_expect.py blocked ENV MANIFEST --by "suite core" --kind quality
    python scripts/demo_expect.py promoted ENV MANIFEST
    python scripts/demo_expect.py shadow-failed ENV MANIFEST --by answers
    python scripts/demo_expect.py rolled-back ENV MANIFEST --by answers --wait 180
    python scripts/demo_expect.py shadow-passed ENV MANIFEST
    python scripts/demo_expect.py kept ENV MANIFEST --wait 330

`blocked`: the latest event for the release in ENV is `gate_failed` and its failed gates
include every `--by` gate; with `--only` they are exactly those; with `--kind K`, every
failed gate is of kind K (read from the gate report the event links). `promoted`: the latest
event is a `promote` (not an override) with no failed gate, advisory or not.
`shadow-failed`: the latest shadow comparison of the release in ENV failed; with `--by
answers`, its answers' excess over their A/A floor breached the margin, and with `--only`
nothing else did.
`rolled-back`: within `--wait` seconds the release was rolled back in ENV by `watch`; with
`--by answers`, on the after-promotion comparison of its answers.
`shadow-passed`: the latest shadow comparison of the release in ENV passed. `kept`: within
`--wait` seconds the after-promotion comparison of the release in ENV ended with a pass (the
watch's signed record at the window's end), and nothing rolled it back. A confirmed decision
prints nothing: the command that made it printed its verdict. Reads only: the ledger is
opened read-only.
Exit 1 with one line saying what decided instead. A confirmed decision is also recorded
for the demo's closing outcome table (`scripts/demo_outcome.py`), with the gate that made it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from demo_outcome import record

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


def _answers(ev: dict[str, Any]) -> dict[str, Any]:
    """An event's answers verdict: an answer comparison's (`answers`), else an older exact
    agreement's (`agreement`, or the watch's `answers.agreement`)."""
    a = ev.get("answers")
    if isinstance(a, dict) and "comparison" in a:
        return a
    if isinstance(a, dict) and isinstance(a.get("answers"), dict):  # a watch rollback's check
        return dict(a["answers"])
    if isinstance(a, dict) and isinstance(a.get("agreement"), dict):
        return dict(a["agreement"])
    return dict(ev.get("agreement") or {})


def _in_brief(a: dict[str, Any]) -> str:
    """The verdict in a few words for the outcome table."""
    if "comparison" in a:
        from releasekit.evaluate.answers import AnswerVerdict

        return AnswerVerdict.model_validate(a).line()
    floor = a.get("min_agreement", "-")
    return f"answers agreed {a.get('agreeing')} of {a.get('pairs')} (floor {floor})"


def _shadows(ledger: Any, env: str, release: str, action: str) -> list[Any]:
    """The release's `shadow` records in ENV with this action (`compare`, `after_promotion`)."""
    return [
        r
        for r in ledger.records(environment=env, types=["shadow"])
        if r.to_release == release and r.evidence.get("action") == action
    ]


def _polled(ledger_at: Any, wait_s: float, look: Callable[[Any], Any]) -> Any:
    """`look(ledger)` on a freshly opened read-only ledger every 2 s until it finds
    something or `wait_s` is over; what it found last."""
    deadline = time.monotonic() + wait_s
    while True:
        ledger = ledger_at()
        try:
            found = look(ledger)
        finally:
            ledger.close()
        if found or time.monotonic() >= deadline:
            return found
        time.sleep(2)


def _shadow_failed(
    ledger: Any, env: str, release: str, by: list[str], only: bool
) -> tuple[str, dict[str, Any]]:
    """A problem ('' if none) and the agreement of the latest shadow comparison."""
    compares = _shadows(ledger, env, release, "compare")
    if not compares:
        return "no shadow comparison recorded", {}
    ev = compares[-1].evidence
    agreement = _answers(ev)
    breached = [c["metric"] for c in ev.get("checks") or [] if c.get("verdict") == "breach"]
    if agreement.get("verdict") == "breach":
        breached.append("answers")
    what = f"verdict {ev.get('verdict')} (breached: {', '.join(breached) or '-'})"
    if ev.get("verdict") != "breach":
        return f"expected the shadow comparison to fail, got {what}", agreement
    missing = [b for b in by if b not in breached]
    if missing:
        return f"expected {', '.join(missing)} to fail it, got {what}", agreement
    if only and [b for b in breached if b not in by]:
        return f"expected only {', '.join(by)} to fail it, got {what}", agreement
    return "", agreement


def _rolled_back(
    ledger_at: Any, env: str, release: str, by: list[str], wait_s: float
) -> tuple[str, dict[str, Any]]:
    """Wait up to `wait_s` for `watch` to roll the release back in ENV."""
    rollbacks = _polled(ledger_at, wait_s, lambda led: _rollbacks(led, env, release))
    if not rollbacks:
        return f"not rolled back within {wait_s:g} s", {}
    ev = rollbacks[-1].evidence
    rules = list(ev.get("rules") or [])
    if "answers" in by and not any(r.startswith("after_promotion") for r in rules):
        return f"rolled back on {', '.join(rules) or '-'}, not on its answers", {}
    return "", _answers(ev)


def _rollbacks(ledger: Any, env: str, release: str) -> list[Any]:
    """The rollbacks of the release in ENV."""
    return [
        r for r in ledger.records(environment=env, types=["rollback"]) if r.from_release == release
    ]


def _shadow_passed(ledger: Any, env: str, release: str) -> tuple[str, dict[str, Any]]:
    """A problem ('' if none) and the evidence of the latest shadow comparison."""
    compares = _shadows(ledger, env, release, "compare")
    if not compares:
        return "no shadow comparison recorded", {}
    ev = compares[-1].evidence
    if ev.get("verdict") != "pass":
        return f"expected the shadow comparison to pass, got {ev.get('verdict')}", ev
    return "", ev


def _kept(ledger_at: Any, env: str, release: str, wait_s: float) -> tuple[str, dict[str, Any]]:
    """Wait up to `wait_s` for the after-promotion comparison of the release to end."""

    def look(led: Any) -> tuple[list[Any], list[Any]] | None:
        ended = _shadows(led, env, release, "after_promotion")
        rolled = _rollbacks(led, env, release)
        return (ended, rolled) if ended or rolled else None

    ended, rolled = _polled(ledger_at, wait_s, look) or ([], [])
    if rolled:
        return f"rolled back ({rolled[-1].reason[:200]})", {}
    if not ended:
        return f"its after-promotion comparison did not end within {wait_s:g} s", {}
    ev = ended[-1].evidence
    if ev.get("verdict") != "pass":
        return f"expected its after-promotion comparison to pass, got {ev.get('verdict')}", ev
    return "", ev


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "outcome",
        choices=["blocked", "promoted", "shadow-failed", "rolled-back", "shadow-passed", "kept"],
    )
    parser.add_argument("env")
    parser.add_argument("manifest", type=Path)
    parser.add_argument("--by", action="append", default=[], help="a gate that must have failed")
    parser.add_argument("--only", action="store_true", help="no other gate may have failed")
    parser.add_argument("--kind", help="every failed gate must be of this kind")
    parser.add_argument("--wait", type=float, default=0.0, help="rolled-back: seconds to wait")
    args = parser.parse_args(argv)

    release = read_lock(lock_path_for(args.manifest)).release_id
    settings = load_settings()
    if args.outcome in ("shadow-passed", "kept"):
        if args.outcome == "shadow-passed":
            ledger = open_ledger(settings, read_only=True)
            problem, ev = _shadow_passed(ledger, args.env, release)
            ledger.close()
        else:
            problem, ev = _kept(
                lambda: open_ledger(settings, read_only=True), args.env, release, args.wait
            )
        if problem:
            print(f"demo: stopped: {args.manifest} in {args.env}: {problem}")
            return 1
        answers = _answers(ev)
        what = "shadow passed" if args.outcome == "shadow-passed" else "kept after its window"
        # The comparison or the watch printed the verdict; the outcome table records it.
        record(f"{what} in {args.env}: {args.manifest.stem}", _in_brief(answers))
        return 0
    if args.outcome in ("shadow-failed", "rolled-back"):
        if args.outcome == "shadow-failed":
            ledger = open_ledger(settings, read_only=True)
            problem, agreement = _shadow_failed(ledger, args.env, release, args.by, args.only)
            ledger.close()
        else:
            problem, agreement = _rolled_back(
                lambda: open_ledger(settings, read_only=True), args.env, release, args.by, args.wait
            )
        if problem:
            print(f"demo: stopped: {args.manifest} in {args.env}: {problem}")
            return 1
        record(
            f"{args.outcome} in {args.env}: {args.manifest.stem}",
            _in_brief(agreement),
        )
        return 0  # the comparison or the watch printed the verdict
    ledger = open_ledger(settings, read_only=True)
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
    verdicts = gates.get("verdicts") or []
    passed = f"all {len(verdicts)} gates passed" if verdicts else "every gate passed"
    record(f"{args.outcome} in {args.env}: {args.manifest.stem}", ", ".join(failed) or passed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
