"""Replaying the verdicts judged on live traffic: a canary step passed (`canary_step`), a
canary aborted (`canary_aborted`), a shadow comparison (`shadow`, action `compare`) and a
watch rollback (`rollback` by the watcher). The event holds the judge's inputs (the
windows' counts, quantiles and histograms the judge read, and the agreement's pair
counts: never a prompt or an answer); replay feeds them to the same judge code
(`rollout.judge.judge_step`, `watch.rules.judge`, `evaluate.agreement.answer_agreement`)
under parameters it derives again: the policy at the recorded commit (ceilings, watch
floor, agreement floor) and the release's verified manifest copy (its canary checks,
`sustain`, watch rules). A recorded parameter that is not the one derived is a
difference, and so is a verdict, limit or p-value that does not come out the same.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import ValidationError

from releasekit.audit.models import Check, DecisionReplay
from releasekit.config import EnvironmentConfig, Settings
from releasekit.evaluate.agreement import AnswerPair, answer_agreement
from releasekit.evaluate.answers import replay_answers
from releasekit.promote.answer_policy import answer_policy
from releasekit.promote.ceilings import canary_within, checks_within
from releasekit.promote.context import ReleaseInfo
from releasekit.rollout.baseline import canary_under_policy
from releasekit.rollout.canary_records import BREACH_RULE
from releasekit.rollout.inputs import check_params, replay_inputs
from releasekit.rollout.judge import StepJudgement, judge_step
from releasekit.spec.manifest import CanaryCheck, default_checks
from releasekit.stores.ledger import EventType, LedgerRecord
from releasekit.watch.rules import Baseline, Rule, from_manifest, judge
from releasekit.watch.service import read_baseline, release_rules
from releasekit.watch.windows import Window

JUDGED = (
    EventType.CANARY_STEP.value,
    EventType.CANARY_ABORTED.value,
    EventType.SHADOW.value,
    EventType.ROLLBACK.value,
)
"""The event types whose live verdicts replay recomputes (see `is_judged`)."""

NO_INPUTS = "the event records no judge inputs (recorded before events held them)"


def is_judged(rec: LedgerRecord) -> bool:
    """A judged verdict replay recomputes: a canary step or abort, a shadow comparison, a
    rollback the watcher or the Alertmanager receiver asked for."""
    ev = rec.evidence if isinstance(rec.evidence, dict) else {}
    if rec.type in (EventType.CANARY_STEP.value, EventType.CANARY_ABORTED.value):
        return True
    if rec.type == EventType.SHADOW.value:
        return ev.get("action") == "compare"
    if rec.type == EventType.ROLLBACK.value:
        return ev.get("trigger") in ("watch", "alertmanager")
    return False


def judged_release(rec: LedgerRecord) -> str | None:
    """The release whose traffic was judged: the candidate, or the one rolled back."""
    return rec.from_release if rec.type == EventType.ROLLBACK.value else rec.to_release


def replay_judged(
    d: DecisionReplay,
    rec: LedgerRecord,
    cfg: EnvironmentConfig,
    info: ReleaseInfo,
    settings: Settings,
) -> None:
    """Append to `d` the replayed verdicts of `rec` (inputs already checked)."""
    env = rec.environment or ""
    ev: dict[str, Any] = rec.evidence if isinstance(rec.evidence, dict) else {}
    if rec.type == EventType.ROLLBACK.value:
        d.checks += _watch(ev, cfg, info, settings, env)
        return
    judge_rec = ev.get("judge")
    manifest_canary = info.lm.manifest.promotion.canary
    if rec.type == EventType.SHADOW.value:
        asked = list(manifest_canary.checks) if manifest_canary else default_checks()
        checks, _ = checks_within(asked, cfg)
        sustain = None
        recorded = [
            {**c, "canary": c.get("candidate")} for c in ev.get("checks", []) if isinstance(c, dict)
        ]
        what = "shadow"
    else:
        canary = canary_under_policy(cfg.policy(), manifest_canary, env)
        if canary is None:
            d.checks.append(
                Check(
                    name="canary",
                    kind="parameters",
                    status="different",
                    detail="the release's manifest copy has no canary steps",
                )
            )
            return
        within = canary_within(canary, cfg, env).canary
        checks, sustain = list(within.checks), within.sustain
        steps = ev.get("steps") or [{}]
        last = ev if rec.type == EventType.CANARY_STEP.value else steps[-1]
        recorded = [c for c in last.get("checks", []) if isinstance(c, dict)]
        what = f"step {last.get('step', '?')}"
    if isinstance(judge_rec, dict):
        d.checks.append(_params(judge_rec, checks, sustain))
        try:
            _, cw, sw = replay_inputs(judge_rec)
        except (KeyError, TypeError, ValidationError) as exc:
            d.checks.append(
                Check(name="judge inputs", kind="record", status="different", detail=str(exc)[:200])
            )
        else:
            d.checks += _compare_checks(what, recorded, judge_step(checks, cw, sw))
    else:
        d.checks.append(
            Check(name=f"{what} checks", kind="canary", status="not replayable", detail=NO_INPUTS)
        )
    if rec.type == EventType.CANARY_ABORTED.value and sustain is not None:
        for b in ev.get("breaches", []):
            n = len(b.get("windows", []))
            d.checks.append(
                _verdict_check(
                    f"sustained breach of {b.get('metric')}",
                    "canary",
                    f"{n} breaching window(s)",
                    n >= sustain,
                    f"sustain {sustain}",
                )
            )
            if ev.get("breach_rule") == BREACH_RULE:  # records from before it: sustain alone
                d.checks.append(_confirmed(b))
    pol = cfg.policy()
    a = ev.get("agreement")
    if isinstance(a, dict):
        d.checks.append(_agreement(f"{what} answers", a, pol))
    if isinstance(ev.get("answers"), dict) and "comparison" in ev["answers"]:
        d.checks.append(_answers(f"{what} answers", ev["answers"], pol))


def _confirmed(b: dict[str, Any]) -> Check:
    """A breach under `BREACH_RULE`: its disjoint window (after every breaching window)
    breached too, or the record says why the breach stood without one."""
    c = b.get("confirmed_by")
    windows = [w for w in b.get("windows", []) if isinstance(w, dict)]
    last_end = max((float(w.get("end") or 0) for w in windows), default=0.0)
    if isinstance(c, dict):
        disjoint = float(c.get("start") or 0) >= last_end
        ok = c.get("verdict") == "breach" and disjoint
        recorded = f"disjoint window {c.get('verdict')}"
    else:
        ok, recorded = bool(b.get("stands")), f"stands: {b.get('stands') or '-'}"
    return _verdict_check(
        f"breach of {b.get('metric')} held past its window",
        "canary",
        recorded,
        ok,
        "a breach repeated over a disjoint window, or why it stood without one",
    )


def _params(judge_rec: dict[str, Any], checks: list[CanaryCheck], sustain: int | None) -> Check:
    recorded = {str(c.get("metric")): c for c in judge_rec.get("checks", [])}
    derived = {c["metric"]: c for c in check_params(checks)}
    diffs: list[str] = []
    for metric in sorted(set(recorded) | set(derived)):
        a, b = recorded.get(metric), derived.get(metric)
        if a is None or b is None:
            diffs.append(f"{metric}: {'not recorded' if a is None else 'not derived'}")
            continue
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                diffs.append(f"{metric} {k} {a.get(k)} recorded, {b.get(k)} derived")
    if sustain is not None and judge_rec.get("sustain") != sustain:
        diffs.append(f"sustain {judge_rec.get('sustain')} recorded, {sustain} derived")
    return Check(
        name="judge parameters",
        kind="parameters",
        status="different" if diffs else "same",
        detail="; ".join(diffs)
        or "the manifest copy's checks under the policy's ceilings at the recorded commit",
    )


def _close(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-12)


def _compare_checks(what: str, recorded: list[dict[str, Any]], j: StepJudgement) -> list[Check]:
    out = []
    for row in recorded:
        metric = str(row.get("metric"))
        got = j.by_metric(metric)
        name = f"{what} {metric}"
        if got is None:
            out.append(
                Check(
                    name=name,
                    kind="canary",
                    status="different",
                    recorded=str(row.get("verdict")),
                    detail="replay judges no such check",
                )
            )
            continue
        diffs = [
            f"{k} {row.get(k)} recorded, {v} replayed"
            for k, v in (
                ("canary", got.canary),
                ("stable", got.stable),
                ("limit", got.limit),
                ("p_value", got.p_value),
            )
            if k in row and not _close(row.get(k), v)
        ]
        same = row.get("verdict") == got.verdict and not diffs
        out.append(
            Check(
                name=name,
                kind="canary",
                status="same" if same else "different",
                recorded=str(row.get("verdict")),
                replayed=got.verdict,
                detail="; ".join(diffs) or got.reason[:300],
            )
        )
    return out


def _verdict_check(name: str, kind: str, recorded: str, ok: bool, rule: str) -> Check:
    return Check(
        name=name,
        kind=kind,
        status="same" if ok else "different",
        recorded=recorded,
        replayed=f"{'enough' if ok else 'too few'} ({rule})",
    )


def _agreement(name: str, a: dict[str, Any], pol: dict[str, Any]) -> Check:
    """The agreement judged again from its recorded pair counts under the policy's floor."""
    try:
        pairs, agreeing, not_judged = int(a["pairs"]), int(a["agreeing"]), int(a["not_judged"])
    except (KeyError, TypeError, ValueError):
        return Check(
            name=name,
            kind="agreement",
            status="not replayable",
            detail="the event records no pair counts",
        )
    synthetic = [
        *(AnswerPair(seq=i, stable="a", candidate="a") for i in range(agreeing)),
        *(AnswerPair(seq=i, stable="a", candidate="b") for i in range(pairs - agreeing)),
        *(AnswerPair(seq=i, stable=None, candidate=None, judged=False) for i in range(not_judged)),
    ]
    got = answer_agreement(
        synthetic,
        min_agreement=float(pol["shadow_min_agreement"]),
        min_pairs=int(pol["shadow_min_pairs"]),
        confidence=float(a.get("confidence") or 0.95),
    )
    diffs = [
        f"{k} {a.get(k)} recorded, {v} replayed"
        for k, v in (
            ("min_agreement", got.min_agreement),
            ("min_pairs", got.min_pairs),
            ("high", got.high),
        )
        if not _close(a.get(k), v)
    ]
    return _answers_check(name, a, got.verdict, diffs, got.reason)


def _answers_check(
    name: str, a: dict[str, Any], replayed: str, diffs: list[str], reason: str
) -> Check:
    """A replayed answers verdict against the recorded one (`a`): the same verdict and no
    differing parameter."""
    same = a.get("verdict") == replayed and not diffs
    return Check(
        name=name,
        kind="agreement",
        status="same" if same else "different",
        recorded=str(a.get("verdict")),
        replayed=replayed,
        detail="; ".join(diffs) or reason,
    )


def _answers(name: str, a: dict[str, Any], pol: dict[str, Any]) -> Check:
    """A live answer comparison judged again from its recorded counts under the policy."""
    try:
        got = replay_answers(a, answer_policy(pol))
    except (ValidationError, ValueError) as exc:
        return Check(
            name=name,
            kind="agreement",
            status="not replayable",
            detail=f"the event's answers verdict does not read: {str(exc)[:200]}",
        )
    diffs = [
        f"{k} {a.get(k)} recorded, {v} replayed"
        for k, v in (("max_excess", got.max_excess), ("min_pairs", got.min_pairs))
        if not _close(a.get(k), v)
    ]
    if a.get("comparison") != pol.get("answer_comparison", "exact"):
        diffs.append(
            f"comparison {a.get('comparison')} recorded, the policy names "
            f"{pol.get('answer_comparison', 'exact')}"
        )
    return _answers_check(name, a, got.verdict, diffs, got.reason[:300])


def _watch(
    ev: dict[str, Any], cfg: EnvironmentConfig, info: ReleaseInfo, settings: Settings, env: str
) -> list[Check]:
    out: list[Check] = []
    check = ev.get("answers")
    if isinstance(check, dict) and isinstance(check.get("answers"), dict):
        pol = cfg.policy()
        out.append(_answers("answers after the promotion", check["answers"], pol))
    if isinstance(ev.get("answers"), dict) and isinstance(ev["answers"].get("agreement"), dict):
        out.append(
            _agreement("answers after the promotion", ev["answers"]["agreement"], cfg.policy())
        )
    breaches = [b for b in ev.get("breaches", []) if isinstance(b, dict)]
    if not breaches:
        if ev.get("alert") is not None:
            out.append(
                Check(
                    name="alert",
                    kind="watch",
                    status="not replayable",
                    detail="an Alertmanager alert is judged by Prometheus's rule",
                )
            )
        return out
    params = ev.get("rule_params")
    if not isinstance(params, list):
        out.append(
            Check(name="watch rules", kind="watch", status="not replayable", detail=NO_INPUTS)
        )
        return out
    floor = [from_manifest(r) for r in cfg.watch_floor]
    rules, _, _ = release_rules(info, floor, env)
    derived = {r.name: r for r in rules}
    baseline = read_baseline(settings, info.release_id, info.evidence)
    for p in params:
        name = str(p.get("name"))
        rule = derived.get(name)
        want = rule.model_dump(mode="json") if rule is not None else None
        diffs = (
            ["not derived from the manifest copy, the load profile or the floor"]
            if want is None
            else [
                f"{k} {p.get(k)} recorded, {want.get(k)} derived"
                for k in sorted(want)
                if p.get(k) != want.get(k)
            ]
        )
        out.append(
            Check(
                name=f"watch rule {name}",
                kind="parameters",
                status="different" if diffs else "same",
                detail="; ".join(diffs) or (rule.describe() if rule else ""),
            )
        )
        if rule is None:
            continue
        mine = [b for b in breaches if (b.get("judgement") or {}).get("rule") == name]
        out += _watch_windows(rule, mine, baseline)
    return out


def _watch_windows(
    rule: Rule, breaches: list[dict[str, Any]], baseline: Baseline | None
) -> list[Check]:
    out: list[Check] = []
    for i, b in enumerate(breaches, 1):
        rj = b.get("judgement") or {}
        try:
            got = judge(rule, Window.model_validate(b.get("window")), baseline)
        except ValidationError as exc:
            out.append(
                Check(
                    name=f"{rule.name} window {i}",
                    kind="watch",
                    status="different",
                    detail=f"the recorded window is unreadable: {exc.errors()[0]['msg']}",
                )
            )
            continue
        diffs = [
            f"{k} {rj.get(k)} recorded, {getattr(got, k)} replayed"
            for k in ("value", "limit")
            if not _close(rj.get(k), getattr(got, k))
        ]
        same = rj.get("verdict") == got.verdict and not diffs
        out.append(
            Check(
                name=f"{rule.name} window {i}",
                kind="watch",
                status="same" if same else "different",
                recorded=str(rj.get("verdict")),
                replayed=got.verdict,
                detail="; ".join(diffs) or got.reason,
            )
        )
    out.append(
        _verdict_check(
            f"sustained breach of {rule.name}",
            "watch",
            f"{len(breaches)} breaching window(s)",
            len(breaches) >= rule.sustain,
            f"sustain {rule.sustain}",
        )
    )
    return out
