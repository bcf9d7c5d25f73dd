"""Evaluate a release end to end: lock its manifest, serve it (or use a given server), run
its suites, write its eval results, and compare with its baseline's results if they exist."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field

from releasekit._support.digests import sha256_file
from releasekit._support.procs import sigterm_as_interrupt
from releasekit._support.progress import (
    Progress,
)
from releasekit.config import Settings
from releasekit.errors import InputMissingError
from releasekit.evaluate.compare import Comparison, compare
from releasekit.evaluate.report import write_report
from releasekit.evaluate.runner import (
    EVAL_JSON,
    EvalResult,
    load_result,
    run_eval,
    write_outputs,
)
from releasekit.serving.vllm import check_reachable, serve_release
from releasekit.spec.lock import compute_inputs, locked_release, release_id_of
from releasekit.spec.manifest import load_manifest
from releasekit.stores.results import FILES


class EvalRun(BaseModel):
    """What `evaluate_release` did: where the results went and what they say."""

    release_id: str
    manifest: str
    base_url: str
    served: bool = Field(description="True if releasekit started (and stopped) the server")
    eval_dir: str
    report_dir: str | None = None
    baseline_release_id: str | None = None
    baseline_note: str | None = Field(None, description="why there is no comparison, if none")
    result: EvalResult
    comparison: Comparison | None = None


class Baseline(BaseModel):
    """Where a baseline's eval results are (they may not exist yet)."""

    eval_dir: Path
    release_id: str | None = None


def find_baseline(ref: Path, settings: Settings) -> Baseline:
    """Locate a baseline's eval folder from a manifest (its current release id's
    results/<id>/eval) or a folder (an eval folder, or a release folder holding eval/).
    InputMissingError if `ref` is neither."""
    if ref.is_dir():
        eval_dir = ref if (ref / EVAL_JSON).is_file() else ref / "eval"
        return Baseline(eval_dir=eval_dir)
    if ref.is_file():
        blm = load_manifest(ref, root=settings.root)
        rid = release_id_of(compute_inputs(blm))
        return Baseline(eval_dir=settings.release_dir(rid) / "eval", release_id=rid)
    raise InputMissingError(ref, what="baseline (manifest or results folder)")


def check_baseline_evidence(
    settings: Settings, release_id: str, eval_dir: Path, bench: Path | None = None
) -> None:
    """A baseline's eval results (and bench.json) against its `register` ledger event, where
    it is registered: a comparison is not built on swapped inputs. The files must be byte
    for byte those the event signed, wherever `eval_dir` is. A baseline never registered (or
    a project with no ledger yet) is compared as it is; the gates judge only registered
    releases' comparisons.

    Raises EvidenceIntegrityError naming the file and the record."""
    from releasekit.errors import LedgerNotFoundError, NotAProjectError
    from releasekit.stores.ledger import open_ledger
    from releasekit.stores.verified import (
        EvidenceIntegrityError,
        register_record,
        verify_release_evidence,
    )

    try:
        led = open_ledger(settings, read_only=True)
    except (LedgerNotFoundError, NotAProjectError):
        return  # no ledger here: nothing registered to check against
    try:
        if register_record(led, release_id) is None:
            return
        ve = verify_release_evidence(settings, release_id, led)
    finally:
        led.close()
    if ve.problem is not None:
        raise EvidenceIntegrityError(f"baseline {release_id[:12]}: {ve.problem}")
    paths = {"eval": eval_dir / EVAL_JSON, "eval_items": eval_dir / "items.jsonl"}
    if bench is not None:
        paths["bench"] = bench
    for key, path in paths.items():
        if not path.is_file():
            continue
        check = ve.files.get(key)
        signed = check.signed if check is not None else None
        if signed is None or sha256_file(path) != signed:
            raise EvidenceIntegrityError(
                f"baseline {path} is not the {FILES[key]} release {release_id[:12]}'s "
                f"register event #{ve.register_seq} signed"
                + ("" if signed else " (it signed none)")
            )


def evaluate_release(
    manifest_path: Path | str,
    *,
    settings: Settings,
    url: str | None = None,
    baseline: Path | None = None,
    out_dir: Path | None = None,
    noise_runs: int = 2,
    concurrency: int = 16,
    progress: Progress | None = None,
) -> EvalRun:
    """Lock `manifest_path` and evaluate its release.

    Without `url`, serve the release on its own vLLM (results/<release_id>/model if built,
    else model.source; the manifest's engine arguments and environment), stopped afterwards
    also on Ctrl-C or SIGTERM. Results go to `out_dir` (default results/<release_id>/eval).
    The baseline (`baseline`, else the manifest's eval.baseline) is compared with when its
    results exist; the report goes to results/<release_id>/report (with `out_dir`:
    `out_dir`/report). An explicitly given baseline without results is an error; the
    manifest's is noted and skipped.
    """
    lm, lk = locked_release(manifest_path, root=settings.root)
    m = lm.manifest
    release_dir = settings.release_dir(lk.release_id)
    eval_dir = out_dir or release_dir / "eval"
    report_dir = out_dir / "report" if out_dir else release_dir / "report"
    eval_dir.mkdir(parents=True, exist_ok=True)

    if url is not None:
        check_reachable(url)
        result = run_eval(
            url,
            m.served_name,
            lm,
            release_id=lk.release_id,
            noise_runs=noise_runs,
            concurrency=concurrency,
            progress=progress,
        )
        base_url = url
    else:
        # Same model folder and engine args as bench and serve; refuses a quantised
        # release that was not built instead of evaluating the base weights.
        server = serve_release(settings, lm, lk, log_path=eval_dir / "server.log")
        with sigterm_as_interrupt():
            if progress is not None:
                progress("starting vLLM", 0, 0)
            with server:
                base_url = server.base_url
                result = run_eval(
                    base_url,
                    m.served_name,
                    lm,
                    release_id=lk.release_id,
                    noise_runs=noise_runs,
                    concurrency=concurrency,
                    progress=progress,
                )
    write_outputs(result, eval_dir)

    run = EvalRun(
        release_id=lk.release_id,
        manifest=lk.manifest,
        base_url=base_url,
        served=url is None,
        eval_dir=str(eval_dir),
        result=result,
    )
    ref = baseline or (lm.resolve(m.eval.baseline) if m.eval.baseline else None)
    if ref is None:
        return run.model_copy(update={"baseline_note": "no baseline configured"})
    found = find_baseline(ref, settings)
    if found.release_id == lk.release_id:
        return run.model_copy(update={"baseline_note": "the baseline is this release"})
    if not (found.eval_dir / EVAL_JSON).is_file():
        if baseline is not None:
            raise InputMissingError(
                found.eval_dir / EVAL_JSON, what=f"eval results of baseline {ref}"
            )
        return run.model_copy(
            update={
                "baseline_release_id": found.release_id,
                "baseline_note": f"baseline {ref} has no eval results yet "
                f"({found.eval_dir}); build it first to compare",
            }
        )
    if found.release_id is not None:
        check_baseline_evidence(settings, found.release_id, found.eval_dir)
    base_result = load_result(found.eval_dir)
    bench_b = (
        settings.release_dir(base_result.release_id) / "bench" / "bench.json"
        if base_result.release_id
        else None
    )
    if base_result.release_id:
        check_baseline_evidence(settings, base_result.release_id, found.eval_dir, bench_b)
    comparison = compare(result, base_result, lm)
    bench_c = release_dir / "bench" / "bench.json"
    write_report(
        comparison,
        report_dir,
        candidate_bench=bench_c if bench_c.is_file() else None,
        baseline_bench=bench_b if bench_b is not None and bench_b.is_file() else None,
    )
    return run.model_copy(
        update={
            "baseline_release_id": base_result.release_id,
            "report_dir": str(report_dir),
            "comparison": comparison,
        }
    )
