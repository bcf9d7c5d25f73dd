"""The auditor's page of one environment: a self-contained HTML page of what was live there
when, and of each decision (promote, override, gate_failed, rollback, canary steps and
aborts, shadow comparisons, watch rollbacks) with who made it and when, the policy it was
decided under (commit and digest), its gates and their figures, the evidence digests the
release's register event signed, the approvals, and its replay (same, different or not
replayable: `releasekit.audit.replay`).

    page = build_page(settings, "production")      # AuditPage (pydantic)
    html = render_page(page)
    page = write_page(settings, "production")      # under .releasekit/reports/audit/

What is shown as data is only what a signed record vouches for: a gate report's figures
when the report agrees with the verdicts its verified ledger record signed (else the
record's own verdicts, and the report shows as a failed check); the evidence files against
their register event's digests (`releasekit.stores.verified`). Reads only: the ledger is
opened read-only, and nothing but the page is written."""

from __future__ import annotations

import datetime as dt
import re
import urllib.parse
from pathlib import Path
from typing import Any

from releasekit._support.files import write_atomic
from releasekit._support.html import Templates
from releasekit.audit.gate_report import check_gate_report
from releasekit.audit.judged import is_judged, judged_release
from releasekit.audit.page_models import (
    Approval,
    AuditPage,
    DecisionEntry,
    EvidenceCheck,
    EvidenceFile,
    GateRow,
    LiveSpan,
    RegistryLink,
    ReplayState,
)
from releasekit.audit.replay import DECISIONS, replay_decision
from releasekit.config import Settings
from releasekit.errors import ReleasekitError
from releasekit.promote.report import TEMPLATE_DIR
from releasekit.stores.ledger import EventType, Ledger, LedgerRecord, open_ledger
from releasekit.stores.ledger.chain import VerifiedPrefix, verified_prefix
from releasekit.stores.verified import register_record, verify_release_evidence

DECISION_TYPES = (
    EventType.PROMOTE.value,
    EventType.OVERRIDE.value,
    EventType.GATE_FAILED.value,
    EventType.ROLLBACK.value,
    EventType.CANARY_STEP.value,
    EventType.CANARY_ABORTED.value,
    EventType.SHADOW.value,
)
"""The event types the page lists as decisions (a shadow event only for its verdicts)."""
SHADOW_VERDICTS = ("compare", "after_promotion")
"""The shadow events that judged something (not the start or stop of the mirror)."""


class AuditPageError(ReleasekitError):
    """Raised when the page is asked for an environment neither the configuration nor the
    ledger knows."""

    remedy = "name an environment of releasekit.toml or of `releasekit status`"


def default_out_dir(settings: Settings) -> Path:
    """Where the pages go unless told: the state dir's `reports/audit/`."""
    return settings.state_dir / "reports" / "audit"


def _records(led: Ledger, prefix: VerifiedPrefix, env: str) -> list[LedgerRecord]:
    try:
        return led.records(environment=env)
    except (ReleasekitError, ValueError):  # an unreadable row: the verified part only
        return [r for r in prefix.records if r.environment == env]


def _timeline(led: Ledger, records: list[LedgerRecord], env: str) -> list[LiveSpan]:
    """What was live, one span per event that counts as live (`Ledger.records(live=True)`)."""
    try:
        live = led.records(environment=env, live=True)
    except (ReleasekitError, ValueError):
        live = [r for r in records if r.live and r.type != EventType.ASSIGN.value]
    spans: list[LiveSpan] = []
    for i, r in enumerate(live):
        mv = r.evidence.get("model_version")
        spans.append(
            LiveSpan(
                seq=r.seq,
                event_id=r.event_id,
                type=r.type,
                release_id=r.to_release,
                model_name=_text(r.evidence.get("model_name")),
                model_version=None if mv is None else str(mv),
                actor=r.actor,
                reason=r.reason,
                since=r.time,
                until=live[i + 1].time if i + 1 < len(live) else None,
            )
        )
    return spans


def _text(v: Any) -> str | None:
    return None if v is None else str(v)


def _float(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _is_decision(r: LedgerRecord) -> bool:
    if r.type not in DECISION_TYPES:
        return False
    return r.type != EventType.SHADOW.value or r.evidence.get("action") in SHADOW_VERDICTS


def _signed_gates(ev: dict[str, Any]) -> list[GateRow]:
    """The gate verdicts a promote, override or gate_failed event signed."""
    gates = ev.get("gates")
    if not isinstance(gates, dict):
        return []
    rows = gates.get("verdicts")
    if isinstance(rows, list):
        out = []
        for g in rows:
            if not isinstance(g, dict):
                continue
            passed = bool(g.get("passed"))
            advisory = bool(g.get("advisory"))
            out.append(
                GateRow(
                    name=str(g.get("name")),
                    kind=str(g.get("kind") or ""),
                    passed=passed,
                    result="pass" if passed else ("fail (advisory)" if advisory else "FAIL"),
                    candidate=_float(g.get("candidate")),
                    live=_float(g.get("live")),
                    limit=_float(g.get("limit")),
                )
            )
        return out
    failed = [*gates.get("failed", []), *gates.get("advisory_failed", [])]
    return [GateRow(name=str(n), result="FAIL", passed=False) for n in failed]


def _check_rows(checks: Any) -> list[GateRow]:
    """Live checks as an event holds them (a canary step's, a shadow comparison's)."""
    out = []
    for c in checks if isinstance(checks, list) else []:
        if not isinstance(c, dict):
            continue
        verdict = str(c.get("verdict") or "")
        out.append(
            GateRow(
                name=str(c.get("metric") or c.get("name") or "check"),
                kind="live",
                result=verdict.replace("_", " "),
                passed=verdict == "pass" if verdict in ("pass", "breach") else None,
                candidate=_float(c.get("candidate", c.get("canary"))),
                live=_float(c.get("stable")),
                limit=_float(c.get("limit")),
            )
        )
    return out


def _judged_rows(r: LedgerRecord) -> list[GateRow]:
    """The figures a judged event signed: its checks, the last step's, or the breaches."""
    ev = r.evidence
    if r.type == EventType.CANARY_ABORTED.value:
        steps = ev.get("steps")
        last = steps[-1] if isinstance(steps, list) and steps else {}
        rows = _check_rows(
            ev.get("checks") or (last.get("checks") if isinstance(last, dict) else [])
        )
        return rows + [
            _confirmation_row(b) for b in ev.get("breaches") or [] if isinstance(b, dict)
        ]
    if r.type == EventType.ROLLBACK.value:
        rows = []
        for b in ev.get("breaches") or []:
            j = b.get("judgement") if isinstance(b, dict) else None
            if not isinstance(j, dict):
                continue
            rows.append(
                GateRow(
                    name=str(j.get("rule") or j.get("metric") or "rule"),
                    kind="watch",
                    result="breach",
                    passed=False,
                    candidate=_float(j.get("value")),
                    live=_float(j.get("baseline")),
                    limit=_float(j.get("threshold", j.get("limit"))),
                    detail=str(j.get("reason") or j.get("detail") or ""),
                )
            )
        answers = ev.get("answers")
        if isinstance(answers, dict) and isinstance(answers.get("answers"), dict):
            rows.append(_answers_row("after-promotion answers", answers["answers"]))
        ag = answers.get("agreement") if isinstance(answers, dict) else None
        if isinstance(ag, dict):
            rows.append(
                GateRow(
                    name="after-promotion answers",
                    kind="answers",
                    result=str(ag.get("verdict") or ""),
                    passed=ag.get("verdict") == "pass",
                    candidate=_float(ag.get("rate")),
                    limit=_float(ag.get("min_agreement")),
                    detail=f"{ag.get('agreeing')} of {ag.get('pairs')} pairs agree",
                )
            )
        return rows
    rows = _check_rows(ev.get("checks"))
    first = ev.get("unconfirmed_breach")
    if isinstance(first, dict):  # a canary step's start-up transient, not a breach
        window = first.get("window") or [0, 0]
        rows.append(
            GateRow(
                name="breach not confirmed",
                kind="canary",
                result="start-up transient",
                passed=True,
                detail=f"{', '.join(map(str, first.get('breached') or []))} breached over "
                f"{float(window[1]) - float(window[0]):.0f} s and not over the disjoint window",
            )
        )
    if isinstance(ev.get("answers"), dict) and "comparison" in ev["answers"]:
        rows.append(_answers_row("answers", ev["answers"]))
    ag = ev.get("agreement")
    if isinstance(ag, dict) and ag.get("verdict") is not None:
        rows.append(
            GateRow(
                name="answers agree",
                kind="answers",
                result=str(ag.get("verdict")),
                passed=ag.get("verdict") == "pass",
                candidate=_float(ag.get("rate")),
                limit=_float(ag.get("min_agreement")),
                detail=f"{ag.get('agreeing')} of {ag.get('pairs')} pairs agree",
            )
        )
    return rows


def _confirmation_row(b: dict[str, Any]) -> GateRow:
    """How a canary's breach held: its disjoint window's figures, or why it stood without
    one (records from before that rule say neither)."""
    c = b.get("confirmed_by")
    name = f"{b.get('metric')}: disjoint window"
    if isinstance(c, dict):
        return GateRow(
            name=name,
            kind="canary",
            result=str(c.get("verdict") or ""),
            passed=c.get("verdict") != "breach",
            candidate=_float(c.get("canary")),
            live=_float(c.get("stable")),
            limit=_float(c.get("limit")),
            detail=str(c.get("reason") or ""),
        )
    stood = str(b.get("stands") or "not recorded (decided by sustain alone)")
    return GateRow(name=name, kind="canary", result="none", passed=False, detail=stood)


def _answers_row(name: str, a: dict[str, Any]) -> GateRow:
    """A live answer comparison as a gate row: the largest excess over the A/A floor among
    its strata, against the policy's max_excess_disagreement."""
    strata = [s for s in a.get("strata") or [] if isinstance(s, dict)]
    excess = [v for s in strata if (v := _float(s.get("excess"))) is not None]
    detail = ", ".join(
        f"{s.get('stratum')} {s.get('pairs')} pairs: {s.get('worse')} worse vs "
        f"{s.get('floor_worse')} on the A/A floor"
        for s in strata
    )
    return GateRow(
        name=f"{name} ({a.get('comparison')})",
        kind="answers",
        result=str(a.get("verdict") or ""),
        passed=a.get("verdict") == "pass",
        candidate=max(excess) if excess else None,
        limit=_float(a.get("max_excess")),
        detail=detail or str(a.get("reason") or ""),
    )


def _evidence(settings: Settings, rid: str, led: Ledger, prefix: VerifiedPrefix) -> EvidenceCheck:
    """The release's evidence files against its register event (verified in the chain)."""
    ve = verify_release_evidence(settings, rid, led, chain=False)
    problem = ve.problem
    if ve.register_seq is not None and ve.register_seq not in {r.seq for r in prefix.records}:
        problem = problem or f"its register event #{ve.register_seq} is not verified"
    files = [
        EvidenceFile(
            path=f.path.split(f"{rid}/", 1)[-1],  # relative to the release's folder
            signed=f.signed,
            actual=f.actual,
            ok=f.problem is None and problem is None,
            problem=f.problem,
        )
        for f in ve.files.values()
    ]
    return EvidenceCheck(
        release_id=rid,
        register_seq=ve.register_seq,
        ok=problem is None and all(f.ok for f in files),
        problem=problem,
        files=files,
    )


def _approvals(r: LedgerRecord, records: list[LedgerRecord], rid: str | None) -> list[Approval]:
    """The approval the event names, and every approve event of its release for its
    environment recorded before it."""
    out: dict[int | None, Approval] = {}
    for a in records:
        if a.seq < r.seq and a.type == EventType.APPROVE.value and a.to_release == rid and rid:
            out[a.seq] = Approval(seq=a.seq, actor=a.actor, time=a.time, reason=a.reason)
    named = r.evidence.get("approval")
    if isinstance(named, dict):
        seq = named.get("seq") if isinstance(named.get("seq"), int) else None
        if seq not in out:
            out[seq] = Approval(
                seq=seq, actor=str(named.get("by") or "?"), reason=str(named.get("reason") or "")
            )
    return sorted(out.values(), key=lambda a: a.seq or 0)


def _registry(led: Ledger, rid: str) -> RegistryLink | None:
    """The MLflow run and model version the release's register event names, with links
    where the tracking URI is a web address."""
    reg = register_record(led, rid)
    if reg is None:
        return None
    e = reg.evidence
    mv = e.get("model_version")
    link = RegistryLink(
        model_name=_text(e.get("model_name")),
        model_version=None if mv is None else str(mv),
        run_id=_text(e.get("mlflow_run_id")),
    )
    uri = str(e.get("tracking_uri") or "")
    if urllib.parse.urlsplit(uri).scheme in {"http", "https"}:
        base, exp = uri.rstrip("/"), e.get("mlflow_experiment_id")
        if link.run_id and exp:
            link.run_url = f"{base}/#/experiments/{exp}/runs/{link.run_id}"
        if link.model_name and link.model_version:
            link.model_url = f"{base}/#/models/{link.model_name}/versions/{link.model_version}"
    if not (link.model_name or link.run_id):
        return None
    return link


def _replay_state(settings: Settings, r: LedgerRecord, entry: DecisionEntry, **kw: Any) -> None:
    """Replay the decision into `entry`: same, different, or not replayable (and why)."""
    if r.type not in DECISIONS and not is_judged(r):
        entry.replay_note = "a decision replay does not recompute (no gates or judged verdicts)"
        return
    try:
        d = replay_decision(settings, r, **kw)
    except ReleasekitError as exc:
        entry.replay_note = exc.message
        return
    entry.replay_checks = d
    state: ReplayState = "not replayable"
    if d.differences:
        state = "different"
    elif any(
        c.status == "same" and c.kind not in ("record", "policy", "evidence") for c in d.checks
    ):
        state = "same"
    else:
        why = [c.detail for c in d.checks if c.status == "not replayable" and c.detail]
        entry.replay_note = "; ".join(why) or "nothing recomputed"
    entry.replay = state


def _decision(
    settings: Settings,
    r: LedgerRecord,
    *,
    led: Ledger,
    prefix: VerifiedPrefix,
    records: list[LedgerRecord],
    out_dir: Path,
    verified: set[int],
) -> DecisionEntry:
    ev = r.evidence
    judged = is_judged(r)
    rid = judged_release(r) if judged else r.to_release
    pol = ev.get("policy")
    src = pol.get("source") if isinstance(pol, dict) else None
    src = src if isinstance(src, dict) else {}
    action = ev.get("action") if r.type == EventType.SHADOW.value else ev.get("trigger")
    entry = DecisionEntry(
        seq=r.seq,
        event_id=r.event_id,
        type=r.type,
        action=_text(action),
        time=r.time,
        actor=r.actor,
        reason=r.reason,
        release_id=rid,
        against=r.to_release if judged and rid == r.from_release else r.from_release,
        live=r.live,
        policy_kind=_text(src.get("kind")),
        policy_commit=_text(src.get("commit")),
        policy_digest=_text(src.get("digest")),
        approvals=_approvals(r, records, rid),
    )
    if r.type in DECISIONS:
        check, report = check_gate_report(settings, r, verified=r.seq in verified, out_dir=out_dir)
        entry.gate_report = check
        if report is not None:
            entry.gates = [
                GateRow(
                    name=g.name,
                    kind=g.kind,
                    passed=g.passed,
                    result="pass" if g.passed else ("fail (advisory)" if g.advisory else "FAIL"),
                    candidate=g.candidate,
                    live=g.live,
                    limit=g.limit,
                    rule=g.rule,
                    detail=g.detail,
                )
                for g in report.gates
            ]
            entry.gates_from = "the gate report, as its signed ledger record vouches for it"
        else:
            entry.gates = _signed_gates(ev)
            entry.gates_from = "the signed ledger record (the gate report is not shown)"
    else:
        entry.gates = _judged_rows(r)
        entry.gates_from = "the signed ledger record"
    if rid:
        entry.evidence = _evidence(settings, rid, led, prefix)
        entry.registry = _registry(led, rid)
    _replay_state(settings, r, entry, ledger=led, prefix=prefix)
    return entry


def known_environment(settings: Settings, env: str, records: list[LedgerRecord]) -> bool:
    """The configuration names `env`, or the ledger holds records of it."""
    return env in settings.environments or bool(records)


def build_page(settings: Settings, env: str, *, out_dir: Path | None = None) -> AuditPage:
    """The page's data for `env` (links relative to `out_dir`, default `default_out_dir`).
    AuditPageError for an environment nobody knows. Reads only."""
    out_dir = (out_dir or default_out_dir(settings)).resolve()
    led = open_ledger(settings, read_only=True)
    try:
        prefix = verified_prefix(led)
        records = _records(led, prefix, env)
        if not known_environment(settings, env, records):
            raise AuditPageError(
                f"unknown environment {env!r}: not in releasekit.toml and no ledger record names it"
            )
        verified = {r.seq for r in prefix.records}
        decisions = [
            _decision(
                settings,
                r,
                led=led,
                prefix=prefix,
                records=records,
                out_dir=out_dir,
                verified=verified,
            )
            for r in records
            if _is_decision(r)
        ]
        return AuditPage(
            environment=env,
            generated_at=dt.datetime.now(dt.UTC),
            ledger_ok=prefix.ok,
            ledger_problem=prefix.problem,
            records=len(records),
            timeline=_timeline(led, records, env),
            decisions=decisions,
        )
    finally:
        led.close()


def _short(v: str | None, n: int = 12) -> str:
    return "-" if not v else v[:n]


def _when(t: dt.datetime | None) -> str:
    return "-" if t is None else t.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


TEMPLATES = Templates(
    Path(__file__).resolve().parent / "templates",
    below=[TEMPLATE_DIR],
    filters={"short": _short, "when": _when},
)
"""The page's template (`audit_page.html`, in the report pages' layout)."""


def render_page(page: AuditPage) -> str:
    """The page as one self-contained HTML document (style and script inline)."""
    return TEMPLATES.render("audit_page.html", page=page)


def page_name(env: str) -> str:
    """The page's file name for `env` (anything but letters, digits, `-`, `_`, `.` as `_`)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", env) + ".html"


def write_page(settings: Settings, env: str, *, out_dir: Path | None = None) -> AuditPage:
    """Build and write the page of `env` into `out_dir` (default `default_out_dir`); the
    page's data with its path. Nothing is written for an unknown environment."""
    out = (out_dir or default_out_dir(settings)).resolve()
    page = build_page(settings, env, out_dir=out)
    path = out / page_name(env)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(path, render_page(page).encode())
    path.chmod(0o644)
    return page.model_copy(update={"path": str(path)})
