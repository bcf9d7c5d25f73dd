"""A decision's gate report checked against its signed ledger record: the file's sha256
where the record signed one (`gate_report_sha256`), and in every case its gates must be the
verdicts and figures the verified record holds (`evidence["gates"]["verdicts"]`)."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from releasekit._support.digests import sha256_bytes
from releasekit.audit.page_models import GateReportCheck
from releasekit.config import Settings
from releasekit.promote.gates import GateReport
from releasekit.stores.ledger import LedgerRecord


def _href(path: Path, out_dir: Path) -> str:
    """`path` relative to the page's folder (a URL path)."""
    try:
        return Path(os.path.relpath(path, out_dir)).as_posix()
    except ValueError:  # another drive
        return path.as_uri()


def _same(a: Any, b: float | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    try:
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-12)
    except (TypeError, ValueError):
        return False


def _mismatch(rec: LedgerRecord, report: GateReport) -> str | None:
    """How the report differs from what the record signed, or None."""
    if report.candidate_release_id != rec.to_release:
        return f"it is a report on release {report.candidate_release_id[:12]}"
    if report.environment != rec.environment:
        return f"it is a report for {report.environment}"
    gates = rec.evidence.get("gates")
    gates = gates if isinstance(gates, dict) else {}
    rows = gates.get("verdicts")
    if not isinstance(rows, list):  # older records: the failed gates only
        signed = {str(n) for n in [*gates.get("failed", []), *gates.get("advisory_failed", [])]}
        shown = {g.name for g in report.gates if not g.passed}
        return None if signed == shown else "its failed gates are not the ones the record lists"
    signed_rows = {str(r.get("name")): r for r in rows if isinstance(r, dict)}
    if set(signed_rows) != {g.name for g in report.gates}:
        return "its gates are not the ones the record lists"
    for g in report.gates:
        r = signed_rows[g.name]
        if bool(r.get("passed")) != g.passed:
            return f"gate {g.name!r} is recorded {'passed' if r.get('passed') else 'failed'}"
        for name in ("candidate", "live", "limit"):
            if not _same(r.get(name), getattr(g, name)):
                return f"gate {g.name!r}: {name} {r.get(name)} recorded, {getattr(g, name)} here"
    return None


def check_gate_report(
    settings: Settings, rec: LedgerRecord, *, verified: bool, out_dir: Path
) -> tuple[GateReportCheck, GateReport | None]:
    """The report `rec` links (`gate_report`, or a gate_failed event's `report`) read and
    checked: the report when it agrees with the verdicts the verified record signed, else
    None with the check saying why (`failed`, `missing`, `not linked`)."""
    raw = rec.evidence.get("gate_report") or rec.evidence.get("report")
    if not isinstance(raw, str) or not raw:
        return GateReportCheck(status="not linked", detail="the event links no gate report"), None
    path = Path(raw) if Path(raw).is_absolute() else settings.root / raw
    page = path.with_suffix(".html")
    check = GateReportCheck(
        status="verified",
        path=raw,
        href=_href(path, out_dir),
        html_href=_href(page, out_dir) if page.is_file() else None,
    )

    def failed(why: str, status: str = "failed") -> tuple[GateReportCheck, None]:
        return check.model_copy(update={"status": status, "detail": why}), None

    if not path.is_file():
        return failed(f"{raw} is gone", "missing")
    if not verified:
        return failed(f"ledger record {rec.seq} does not verify: nothing vouches for the report")
    signed = rec.evidence.get("gate_report_sha256")
    data = path.read_bytes()
    if isinstance(signed, str) and sha256_bytes(data) != signed:
        return failed(f"{path.name} differs from the sha256 record {rec.seq} signed")
    try:
        report = GateReport.model_validate_json(data)
    except (OSError, ValidationError) as exc:
        return failed(f"{path.name} is unreadable as a gate report: {str(exc).splitlines()[0]}")
    why = _mismatch(rec, report)
    if why is not None:
        return failed(f"{path.name} is not the report record {rec.seq} signed: {why}")
    return check.model_copy(update={"detail": f"agrees with signed record {rec.seq}"}), report
