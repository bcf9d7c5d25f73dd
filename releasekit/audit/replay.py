"""Replaying a recorded decision: recompute each gate verdict of a `promote`, `override` or
`gate_failed` event from its verified inputs, and say for each whether it comes out the same.

    result = replay(settings, "12")          # a ledger seq or event id
    result = replay(settings, None, all_=True)

The inputs, each checked before it is used (a check that fails is a difference):
- the ledger record itself: it must lie in the verified part of the chain (chain,
  signature, git anchor: `stores.ledger.chain.verified_prefix`);
- the policy: `releasekit.toml` at the commit the event recorded, whose digest for the
  environment must be the one recorded (`evidence["policy"]["source"]`); the gates are
  recomputed under it;
- the evidence: both releases' files (eval, items, bench, compare, the manifest copy and
  lock) against the digests their `register` events signed (`stores.verified`);
- the judge's parameters: the manifest's margins and tolerances (in the manifest copy,
  bound to the lock) under the policy's ceilings, as the gates apply them.

Each gate then compares its recomputed verdict (pass / fail) with the recorded one; where
the event recorded the figures (`gates.verdicts`, written since replay exists), the
candidate, live and limit figures too. Older events list only their failed gates: every
other gate is taken as recorded passed. What an event does not record enough to recompute
(an approval's wait, a shadow comparison, canary steps judged on live traffic) is reported
"not replayable" with why, which is not a difference.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, Field, ValidationError

from releasekit.audit.models import Check, DecisionReplay
from releasekit.config import EnvironmentConfig, Settings
from releasekit.config.lanes import parent_env
from releasekit.errors import ReleasekitError
from releasekit.promote.answers_breach import GATE_NAME as BREACH_GATE
from releasekit.promote.answers_breach import breach_gate
from releasekit.promote.context import ReleaseContextError, load_release
from releasekit.promote.gates import GateReport, GateResult, evaluate_gates
from releasekit.promote.policy import digest_as_recorded
from releasekit.stores.ledger import EventType, Ledger, LedgerRecord, open_ledger
from releasekit.stores.ledger.chain import VerifiedPrefix, verified_prefix
from releasekit.stores.trust import committed_config
from releasekit.stores.verified import verify_release_evidence

DECISIONS = (EventType.PROMOTE.value, EventType.OVERRIDE.value, EventType.GATE_FAILED.value)
"""The event types whose gate verdicts replay recomputes."""

_NOT_RECOMPUTED = {
    "approval": "an approval is a signed ledger record: `releasekit ledger verify` audits it",
    "shadow": "a shadow comparison judged live answers the event does not hold",
}


class ReplayError(ReleasekitError):
    """Raised when the event to replay cannot be found in the ledger, or is not a decision
    with gates (promote, override, gate_failed)."""

    remedy = "name a ledger seq or event id from `releasekit history` (a promote or gate_failed)"


class ReplayResult(BaseModel):
    """Every decision replayed, and whether the ledger verified."""

    decisions: list[DecisionReplay] = Field(default_factory=list)
    ledger_ok: bool = True
    ledger_problem: str | None = None
    differences: int = 0

    @property
    def same(self) -> bool:
        """Every replayed verdict and input came out as recorded."""
        return self.differences == 0


def replay(settings: Settings, event: str | None, *, all_: bool = False) -> ReplayResult:
    """Replay the decision `event` (a ledger seq or event id), or every decision (`all_`).
    ReplayError when `event` names no decision. Reads only."""
    led = open_ledger(settings, read_only=True)
    prefix = verified_prefix(led)
    try:
        records = led.records()
    except (ReleasekitError, ValueError):  # an unreadable row: the verified part only
        records = prefix.records
    from releasekit.audit.judged import is_judged

    if all_:
        chosen = [r for r in records if r.type in DECISIONS or is_judged(r)]
    else:
        key = (event or "").strip()
        found = [r for r in records if str(r.seq) == key or r.event_id == key]
        if not found:
            raise ReplayError(f"no ledger record {key!r}")
        if found[0].type not in DECISIONS and not is_judged(found[0]):
            raise ReplayError(
                f"record {found[0].seq} is a {found[0].type} event, not a decision with gates "
                "or a verdict judged on live traffic"
            )
        chosen = found[:1]
    out = ReplayResult(ledger_ok=prefix.ok, ledger_problem=prefix.problem)
    for rec in chosen:
        d = replay_decision(settings, rec, ledger=led, prefix=prefix)
        out.decisions.append(d)
        out.differences += len(d.differences)
    return out


def replay_decision(
    settings: Settings, rec: LedgerRecord, *, ledger: Ledger, prefix: VerifiedPrefix
) -> DecisionReplay:
    """Replay one decision record (see the module docstring)."""
    if rec.type not in DECISIONS:
        return replay_judged_record(settings, rec, ledger=ledger, prefix=prefix)
    raw = rec.evidence.get("gates")
    gates: dict[str, Any] = raw if isinstance(raw, dict) else {}
    against = gates.get("against") if "against" in gates else rec.from_release
    d = DecisionReplay(
        seq=rec.seq,
        event_id=rec.event_id,
        type=rec.type,
        environment=rec.environment,
        release_id=rec.to_release,
        against=str(against) if against else None,
    )
    verified = {r.seq for r in prefix.records}
    if rec.seq not in verified:
        d.checks.append(
            Check(
                name=f"ledger record {rec.seq}",
                kind="record",
                status="different",
                detail=f"the ledger fails verification at record {prefix.first_bad_seq}: "
                f"{prefix.problem}",
            )
        )
        return d
    d.checks.append(
        Check(name=f"ledger record {rec.seq}", kind="record", status="same", detail="verified")
    )
    env = rec.environment or ""
    policy_check, cfg = _policy(settings, rec, env)
    d.checks.append(policy_check)
    if not gates:
        d.checks.append(
            Check(name="gates", kind="record", status="not replayable", detail="none recorded")
        )
        return d
    if cfg is None:
        return d
    inputs_ok = policy_check.status != "different"
    for rid, side in ((rec.to_release, "candidate"), (d.against, "live")):
        if not rid:
            continue
        ev = verify_release_evidence(settings, rid, ledger, chain=False)
        reg_ok = ev.register_seq is not None and ev.register_seq in verified
        problems = list(ev.problems)
        if ev.register_seq is not None and not reg_ok:
            problems.insert(0, f"its register event #{ev.register_seq} is not verified")
        d.checks.append(
            Check(
                name=f"evidence ({side} {rid[:12]})",
                kind="evidence",
                status="same" if ev.ok and reg_ok else "different",
                detail="; ".join(problems) or f"files match register event #{ev.register_seq}",
            )
        )
        inputs_ok = inputs_ok and ev.ok and reg_ok
    if not inputs_ok:
        d.checks.append(
            Check(
                name="gate verdicts",
                kind="record",
                status="not replayable",
                detail="not recomputed: an input above differs from what was recorded",
            )
        )
        return d
    try:
        cand = load_release(settings, str(rec.to_release), ledger=ledger)
        live = load_release(settings, d.against, ledger=ledger) if d.against else None
    except ReleaseContextError as exc:
        d.checks.append(
            Check(name="gate verdicts", kind="record", status="not replayable", detail=exc.message)
        )
        return d
    report = evaluate_gates(settings, env=env, candidate=cand, live=live, policy=cfg)
    # The answers breach gate, from the verified records before the decision (a decision
    # recorded before the gate existed names it only where it would have failed).
    breach = breach_gate([r for r in prefix.records if r.seq < rec.seq], cand.lock.inputs)
    rows = gates.get("verdicts")
    named = (
        isinstance(rows, list)
        and any(isinstance(r, dict) and r.get("name") == BREACH_GATE for r in rows)
    ) or BREACH_GATE in (gates.get("failed") or [])
    if named or not breach.passed:
        report = report.with_gates([breach])
    d.checks += _compare(gates, report, rec=rec, prefix=prefix)
    return d


def _record_check(rec: LedgerRecord, prefix: VerifiedPrefix) -> Check:
    if rec.seq in {r.seq for r in prefix.records}:
        return Check(
            name=f"ledger record {rec.seq}", kind="record", status="same", detail="verified"
        )
    return Check(
        name=f"ledger record {rec.seq}",
        kind="record",
        status="different",
        detail=f"the ledger fails verification at record {prefix.first_bad_seq}: {prefix.problem}",
    )


def _evidence_check(
    settings: Settings, rid: str, side: str, ledger: Ledger, prefix: VerifiedPrefix
) -> Check:
    """The release's evidence files (and manifest copy) against its verified register event."""
    ev = verify_release_evidence(settings, rid, ledger, chain=False)
    reg_ok = ev.register_seq is not None and ev.register_seq in {r.seq for r in prefix.records}
    problems = list(ev.problems)
    if ev.register_seq is not None and not reg_ok:
        problems.insert(0, f"its register event #{ev.register_seq} is not verified")
    return Check(
        name=f"evidence ({side} {rid[:12]})",
        kind="evidence",
        status="same" if ev.ok and reg_ok else "different",
        detail="; ".join(problems) or f"files match register event #{ev.register_seq}",
    )


def replay_judged_record(
    settings: Settings, rec: LedgerRecord, *, ledger: Ledger, prefix: VerifiedPrefix
) -> DecisionReplay:
    """Replay a verdict judged on live traffic (a canary step or abort, a shadow
    comparison, a watch rollback: `audit.judged`) from the inputs its event recorded."""
    from releasekit.audit.judged import judged_release, replay_judged

    rid = judged_release(rec)
    d = DecisionReplay(
        seq=rec.seq,
        event_id=rec.event_id,
        type=rec.type,
        environment=rec.environment,
        release_id=rid,
        against=rec.to_release if rid == rec.from_release else rec.from_release,
    )
    d.checks.append(_record_check(rec, prefix))
    if d.checks[-1].status == "different":
        return d
    policy_check, cfg = _policy(settings, rec, rec.environment or "")
    d.checks.append(policy_check)
    if cfg is None or not rid:
        return d
    d.checks.append(_evidence_check(settings, rid, "judged", ledger, prefix))
    if any(c.status == "different" for c in d.checks):
        d.checks.append(
            Check(
                name="verdicts",
                kind="record",
                status="not replayable",
                detail="not recomputed: an input above differs from what was recorded",
            )
        )
        return d
    try:
        info = load_release(settings, rid, ledger=ledger)
    except ReleasekitError as exc:
        d.checks.append(
            Check(name="verdicts", kind="record", status="not replayable", detail=exc.message)
        )
        return d
    replay_judged(d, rec, cfg, info, settings)
    return d


def _policy(
    settings: Settings, rec: LedgerRecord, env: str
) -> tuple[Check, EnvironmentConfig | None]:
    """The policy check, and the environment's config to recompute the gates under (an
    adapter lane's policy is its environment's)."""
    env = parent_env(env)
    pol = rec.evidence.get("policy")
    if not isinstance(pol, dict) or not isinstance(pol.get("source"), dict):
        return (
            Check(
                name="policy",
                kind="policy",
                status="not replayable",
                detail="the event records no policy",
            ),
            None,
        )
    src: dict[str, Any] = pol["source"]
    recorded = str(src.get("digest") or "")
    commit = src.get("commit")
    if src.get("kind") != "committed" or not commit:
        base = settings.environments.get(env)
        cfg = None
        if base is not None and isinstance(pol.get("policy"), dict):
            try:
                cfg = EnvironmentConfig.model_validate(
                    {**base.model_dump(), **{k: v for k, v in pol["policy"].items()}}
                )
            except ValidationError:
                cfg = None
        return (
            Check(
                name="policy",
                kind="policy",
                status="not replayable",
                recorded=recorded[:12],
                detail="decided by an uncommitted policy; replayed under the one recorded",
            ),
            cfg,
        )
    where = f"releasekit.toml at {str(commit)[:12]}"
    try:
        data = committed_config(settings.root, str(commit))
    except ReleasekitError as exc:
        data, why = None, exc.message
    else:
        why = f"{where} cannot be read (the commit is gone, or the file is not in it)"
    table = ((data or {}).get("environments") or {}).get(env)
    if not isinstance(table, dict):
        why = why if data is None else f"{where} has no [environments.{env}]"
        return (
            Check(
                name="policy", kind="policy", status="different", recorded=recorded[:12], detail=why
            ),
            None,
        )
    try:
        cfg = EnvironmentConfig.model_validate(table)
    except ValidationError as exc:
        return (
            Check(
                name="policy",
                kind="policy",
                status="different",
                recorded=recorded[:12],
                detail=f"[environments.{env}] in {where} is invalid: {exc.errors()[0]['msg']}",
            ),
            None,
        )
    got = digest_as_recorded(cfg.policy(), pol.get("policy"))
    return (
        Check(
            name="policy",
            kind="policy",
            status="same" if got == recorded else "different",
            recorded=recorded[:12],
            replayed=got[:12],
            detail=where if got == recorded else f"{where} is not the policy the event recorded",
        ),
        cfg,
    )


def _verdict(passed: bool) -> str:
    return "pass" if passed else "fail"


def _figures_differ(rec: dict[str, Any], g: GateResult) -> list[str]:
    out = []
    for name in ("candidate", "live", "limit"):
        a, b = rec.get(name), getattr(g, name)
        if a is None and b is None:
            continue
        if (
            a is None
            or b is None
            or not math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-12)
        ):
            out.append(f"{name} {a} recorded, {b} replayed")
    return out


def _compare(
    gates: dict[str, Any], report: GateReport, *, rec: LedgerRecord, prefix: VerifiedPrefix
) -> list[Check]:
    """Each recomputed gate against the record (the verdicts and figures where recorded,
    else the failed lists)."""
    checks: list[Check] = []
    recomputed = {g.name: g for g in report.gates}
    rows = gates.get("verdicts")
    recorded: dict[str, dict[str, Any]] = {}
    only_failed = not isinstance(rows, list)
    if isinstance(rows, list):
        recorded = {str(r.get("name")): r for r in rows if isinstance(r, dict)}
    else:
        failed = {str(n) for n in [*gates.get("failed", []), *gates.get("advisory_failed", [])]}
        recorded = {name: {"passed": name not in failed} for name in recomputed}
        recorded.update({n: {"passed": False} for n in failed})
    for name, row in recorded.items():
        g = recomputed.get(name)
        kind = str(row.get("kind") or (g.kind if g else ""))
        if g is None:
            replayed = _policy_gate(name, rec=rec, prefix=prefix)
            if replayed is not None:
                checks.append(
                    Check(
                        name=name,
                        kind="policy",
                        status="same" if replayed == bool(row.get("passed")) else "different",
                        recorded=_verdict(bool(row.get("passed"))),
                        replayed=_verdict(replayed),
                        detail="on the verified records before the decision",
                    )
                )
                continue
            why = _NOT_RECOMPUTED.get(kind, "")
            if not why and name.startswith("approved for "):
                why = _NOT_RECOMPUTED["approval"]
            checks.append(
                Check(
                    name=name,
                    kind=kind or "gate",
                    status="not replayable" if why else "different",
                    recorded=_verdict(bool(row.get("passed"))),
                    detail=why or "recorded, but replay computes no such gate",
                )
            )
            continue
        same = bool(row.get("passed")) == g.passed
        figures = [] if only_failed else _figures_differ(row, g)
        checks.append(
            Check(
                name=name,
                kind=g.kind,
                status="same" if same and not figures else "different",
                recorded=_verdict(bool(row.get("passed"))),
                replayed=_verdict(g.passed),
                detail="; ".join(figures)
                + ("" if not only_failed else "(recorded: the failed gates only)"),
            )
        )
    for name, g in recomputed.items():
        if name not in recorded:
            checks.append(
                Check(
                    name=name,
                    kind=g.kind,
                    status="different",
                    replayed=_verdict(g.passed),
                    detail="replay computes this gate; the event does not record it",
                )
            )
    return checks


def _policy_gate(name: str, *, rec: LedgerRecord, prefix: VerifiedPrefix) -> bool | None:
    """A policy gate (not marked bad, live first) replayed on the verified records before
    the decision: passed or not; None for any other gate."""
    before = [r for r in prefix.records if r.seq < rec.seq]
    rid = rec.to_release
    if name == "not marked bad":
        return not any(r.type == EventType.MARK_BAD.value and r.to_release == rid for r in before)
    if name.startswith("live in ") and name.endswith(" first"):
        need = name.removeprefix("live in ").removesuffix(" first")
        return any(
            r.environment == need and r.live and r.type != EventType.ASSIGN.value
            and r.to_release == rid
            for r in before
        )  # fmt: skip
    return None
