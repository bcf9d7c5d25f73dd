"""Evaluation: run a release's eval suites against a served release, score the answers,
compare them with a baseline release (paired, with confidence intervals and McNemar), and
write the comparison report.

    result = run_eval(base_url, model, lm, release_id=lock.release_id)
    write_outputs(result, release_dir / "eval")
    comparison = compare(result, load_result(baseline_dir / "eval"), lm)
    write_report(comparison, release_dir / "report", candidate_bench=..., baseline_bench=...)
"""

from __future__ import annotations

from releasekit.evaluate.compare import (
    Comparison,
    EvidenceError,
    SuiteComparison,
    Verdict,
    compare,
    load_comparison,
)
from releasekit.evaluate.judge import JudgeIdentity, LLMJudge
from releasekit.evaluate.report import write_report
from releasekit.evaluate.runner import (
    EvalResult,
    ItemResult,
    Noise,
    SuiteNoise,
    SuiteSummary,
    load_result,
    run_eval,
    run_eval_async,
    write_outputs,
)
from releasekit.evaluate.suites import EvalItem, load_suite

__all__ = [
    "Comparison",
    "EvalItem",
    "EvalResult",
    "EvidenceError",
    "ItemResult",
    "JudgeIdentity",
    "LLMJudge",
    "Noise",
    "SuiteComparison",
    "SuiteNoise",
    "SuiteSummary",
    "Verdict",
    "compare",
    "load_comparison",
    "load_result",
    "load_suite",
    "run_eval",
    "run_eval_async",
    "write_outputs",
    "write_report",
]
