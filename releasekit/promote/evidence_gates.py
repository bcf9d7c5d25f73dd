"""A release's evidence as read and checked against its register event and lock
(`read_release_evidence`), and the evidence gates over it."""

from __future__ import annotations

from dataclasses import dataclass, field

from releasekit._support.digests import digest_obj
from releasekit.bench.runner import BenchResult, load_bench
from releasekit.config import Settings
from releasekit.errors import ReleasekitError
from releasekit.evaluate.runner import ITEMS_JSONL, EvalResult, load_result, parse_result
from releasekit.promote.context import ReleaseInfo
from releasekit.promote.gate_results import GateResult
from releasekit.spec.measured import same_host
from releasekit.stores.results import ReleasePaths


@dataclass
class Evidence:
    """One release's eval and bench results as read (None, with why, when unusable)."""

    info: ReleaseInfo
    eval: EvalResult | None = None
    bench: BenchResult | None = None
    eval_problems: list[str] = field(default_factory=list)
    bench_problems: list[str] = field(default_factory=list)


def read_release_evidence(settings: Settings, info: ReleaseInfo) -> Evidence:
    """Read and check a release's eval and bench results: first against the digests its
    verified register event signed (`info.evidence`, from `load_release`; a file that
    differs is a problem naming it, and is not read), then against its own lock."""
    paths = ReleasePaths.of(settings, info.release_id)
    ev = Evidence(info=info)
    ve = info.evidence
    unchecked = f"release {info.short_id}'s evidence was not checked against its register event"
    eval_signed = ve.problems_for("eval", "eval_items") if ve is not None else [unchecked]
    if eval_signed:
        ev.eval_problems += eval_signed
    elif ve is not None:
        try:
            if not (paths.eval.is_file() and (paths.eval_dir / ITEMS_JSONL).is_file()):
                ev.eval = load_result(paths.eval_dir)  # raises: names the missing file
            else:
                ev.eval = parse_result(
                    ve.read_bytes("eval"), ve.read_bytes("eval_items"), paths.eval_dir
                )
        except ReleasekitError as exc:
            ev.eval_problems.append(f"no usable eval results: {exc.message}")
    if ev.eval is not None:
        if ev.eval.release_id != info.release_id:
            ev.eval_problems.append(
                f"eval results are for release {str(ev.eval.release_id)[:12]}, not this one"
            )
        for s in info.lm.manifest.eval.suites:
            got = ev.eval.suites.get(s.name)
            if got is None:
                ev.eval_problems.append(f"suite {s.name} was not evaluated")
                continue
            locked = info.lock.inputs.get(f"eval/{s.name}")
            made = digest_obj({"file": got.digest, "suite": s.locked_fields()})
            if not got.digest or locked != made:
                ev.eval_problems.append(
                    f"suite {s.name} was evaluated on a file or config other than the locked one"
                )
    bench_signed = ve.problems_for("bench") if ve is not None else [unchecked]
    if bench_signed:
        ev.bench_problems += bench_signed
    elif ve is not None:
        try:
            if not paths.bench.is_file():
                ev.bench = load_bench(paths.bench_dir)  # raises: names the missing file
            else:
                ev.bench = BenchResult.model_validate_json(ve.read_bytes("bench"))
        except ReleasekitError as exc:
            ev.bench_problems.append(f"no usable bench results: {exc.message}")
        except ValueError as exc:
            first = str(exc).strip().splitlines()[0]
            ev.bench_problems.append(f"no usable bench results: unreadable {paths.bench}: {first}")
    if ev.bench is not None:
        if ev.bench.release_id != info.release_id:
            ev.bench_problems.append(
                f"bench results are for release {str(ev.bench.release_id)[:12]}, not this one"
            )
        if ev.bench.profile_digest != info.lock.inputs.get("load/profile"):
            ev.bench_problems.append("bench results were made with another load profile")
        if ev.bench.measured_for is not None:
            cited = _citation_problem(settings, ev.bench, info)
            if cited is not None:
                ev.bench_problems.append(cited)
    return ev


def _citation_problem(settings: Settings, bench: BenchResult, info: ReleaseInfo) -> str | None:
    """Why a bench that cites another release's load test cannot stand for this release
    (`releasekit.bench.reuse.check_citation`), or None."""
    from releasekit.bench.reuse import check_citation
    from releasekit.stores.ledger import open_ledger

    try:
        ledger = open_ledger(settings, read_only=True)
    except ReleasekitError as exc:
        return f"the load test it cites cannot be checked: {exc.message}"
    try:
        return check_citation(settings, bench, info.lock, ledger)
    finally:
        ledger.close()


def _registered_gates(cand: Evidence) -> list[GateResult]:
    """The candidate's manifest and comparison report are the ones its register event
    signed: a manifest edited after registration, or a compare.json / report.html that
    differs, fails as evidence (the comparison is then not taken from the file)."""
    info, gates = cand.info, []
    if info.edited_manifest is not None:
        gates.append(
            GateResult(
                name="manifest as registered",
                kind="evidence",
                passed=False,
                rule="the manifest's gates, environments, promotion and watch sections are "
                "the ones the release's register event signed",
                detail=info.edited_manifest,
            )
        )
    ve = info.evidence
    if ve is not None and ("compare" in ve.files or "report_html" in ve.files):
        probs = [p for k in ("compare", "report_html") if (p := ve.file_problem(k))]
        if probs:
            gates.append(
                GateResult(
                    name="comparison report (candidate)",
                    kind="evidence",
                    passed=False,
                    rule="the comparison report is the one the release's register event signed",
                    detail="; ".join(probs),
                )
            )
    return gates


def _weights_maker(side: str, ev: Evidence) -> tuple[str | None, str | None]:
    """Who made a release's quantised weights, in words (None when it is not quantised),
    and why that counts as another host than its own load test's (None: it does not, or
    its register event does not record the maker)."""
    info = ev.info
    if info.lm.manifest.quantisation.scheme == "none":
        return None, None
    made = info.evidence.weights_made_on if info.evidence is not None else None
    if made is None:
        return f"{side}: not recorded", None
    host = ev.bench.host if ev.bench is not None else None
    diff = made.differs_from(host) if host is not None else None
    why = (
        f"the {side}'s weights were quantised on another host kind than its load test ran on "
        f"({diff} differ)"
        if diff
        else None
    )
    return f"{side}: {made.label}", why


def _host_gate(cand: Evidence, live: Evidence) -> GateResult | None:
    """A failed evidence gate when the two releases were benched on different host kinds or
    core counts (or either bench records no host), or when a release's quantised weights
    were made on another host kind than its own load test ran on (as its register event
    signed the maker): their perf cannot be compared. The detail names where each load test
    ran and where each release's quantised weights were made."""
    assert cand.bench is not None and live.bench is not None
    ch, lh = cand.bench.host, live.bench.host
    why = same_host(ch, lh)
    makers = [_weights_maker("candidate", cand), _weights_maker("live", live)]
    made_whys = [w for _, w in makers if w is not None]
    if why is None and not made_whys:
        return None
    where = "; ".join(
        f"{side}: {h.label if h is not None else 'no host recorded'}"
        for side, h in (("candidate", ch), ("live", lh))
    )
    labels = [label for label, _ in makers if label is not None]
    if labels:
        where += f"; weights quantised on {'; '.join(labels)}"
    if why is not None:
        reasons = "; ".join([why, *made_whys])
        detail = (
            f"benched on another host ({reasons}; {where}): rebench live beside it, on the "
            "candidate's host kind and core count, or let a canary judge performance against "
            "live traffic"
        )
    else:
        detail = (
            f"weights made on another host ({'; '.join(made_whys)}; {where}): quantise the "
            "release on the host kind its load test runs on, or let a canary judge "
            "performance against live traffic"
        )
    return GateResult(
        name="benched on the same host kind as live",
        kind="evidence",
        against_live=True,
        passed=False,
        rule="a perf comparison is made only between load tests of one host kind (CPU "
        "vendor, model and instruction-set level, GPUs) and core count, of quantised weights "
        "made on the host kind that measured them",
        detail=detail,
    )


def _evidence_gate(name: str, problems: list[str], what: str) -> GateResult:
    return GateResult(
        name=name,
        kind="evidence",
        passed=not problems,
        rule=f"{what} must exist, be made for this release, on its locked inputs",
        detail="; ".join(problems) or "ok",
    )
