"""The quantisation lesson on the demo: what the real builds' paired comparisons say about
W8A8 and W4A16 against bf16, beside what the in-process probe measured on the same models.

    .venv/bin/python benchmarks/quant_lesson.py [--probe PROBE.json] [--out PATH]

Reads each quantised demo release's committed lock (manifests/demo-w8a8.lock.json,
demo-w4a16.lock.json, and demo-w4a16-narrow.lock.json when it exists) and the report its
`releasekit build` wrote (results/<release id>/report/compare.json: vLLM served both sides,
releasekit's scorers and paired comparison judged them), prints one table row per release
and suite (pass counts, delta, Newcombe 95% interval, exact McNemar p, verdict) and writes
benchmarks/results/quantisation.json. With `--probe` (the JSON that
pipelines/demo/quant_probe.py wrote for the demo's own variant) it puts the probe's pass
counts, evaluated through transformers instead of vLLM, beside each row: an independent
measure of the same weights. Exits 1, saying which, when a release has no report yet
(build it first: `releasekit build manifests/demo-w4a16.yaml`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import REPO, RESULTS, write_result

from releasekit.evaluate.comparison import load_comparison
from releasekit.spec.lock import read_lock

RELEASES = ("demo-w8a8", "demo-w4a16", "demo-w4a16-narrow")
PROBE_NAMES = {"demo-w8a8": "W8A8", "demo-w4a16": "W4A16", "demo-w4a16-narrow": "W4A16-narrow"}


def _probe_rows(path: Path | None) -> dict[tuple[str, str], dict[str, Any]]:
    """(model label, suite) -> the probe's row, from the probe's first variant."""
    if path is None:
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return {(r["model"], r["suite"]): r for r in data[0]["rows"]}


def collect(probe: Path | None) -> dict[str, Any]:
    """One row per release and suite, from the committed locks and the build reports."""
    probe_rows = _probe_rows(probe)
    rows: list[dict[str, Any]] = []
    for name in RELEASES:
        lock_path = REPO / "manifests" / f"{name}.lock.json"
        if not lock_path.is_file():
            continue
        lock = read_lock(lock_path)
        report = REPO / "results" / lock.release_id / "report" / "compare.json"
        if not report.is_file():
            raise SystemExit(
                f"quant_lesson: {name} ({lock.short_id}) has no report at {report}: "
                f"build it first (releasekit build manifests/{name}.yaml)"
            )
        comparison = load_comparison(report)
        for suite, s in comparison.suites.items():
            row: dict[str, Any] = {
                "release": name,
                "release_id": lock.release_id,
                "baseline_release_id": comparison.baseline_release_id,
                "suite": suite,
                "margin": s.margin,
                "n": s.n_paired,
                "baseline_passed": s.both_pass + len(s.flipped_to_fail),
                "candidate_passed": s.both_pass + len(s.flipped_to_pass),
                "to_fail": len(s.flipped_to_fail),
                "to_pass": len(s.flipped_to_pass),
                "delta": s.delta,
                "ci": [s.ci_low, s.ci_high],
                "mcnemar_p": s.mcnemar_p,
                "verdict": s.verdict.value,
            }
            p_base = probe_rows.get(("bf16", suite))
            p_cand = probe_rows.get((PROBE_NAMES[name], suite))
            if p_base and p_cand:
                row["probe"] = {
                    "baseline_passed": p_base["passed"],
                    "candidate_passed": p_cand["passed"],
                    "to_fail": p_cand.get("to_fail"),
                    "to_pass": p_cand.get("to_pass"),
                    "mcnemar_p": p_cand.get("mcnemar_p"),
                    "verdict": p_cand.get("verdict"),
                }
            rows.append(row)
    return {"rows": rows, "probe_file": str(probe) if probe else None}


def table(result: dict[str, Any]) -> str:
    """The rows as a Markdown table (the README's)."""
    lines = [
        "| release | suite | bf16 | quantised | delta | 95% interval | McNemar p | verdict |"
        " probe (transformers) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["rows"]:
        lo, hi = r["ci"]
        probe = r.get("probe")
        probe_text = f"{probe['baseline_passed']} -> {probe['candidate_passed']}" if probe else "-"
        lines.append(
            f"| {r['release']} | {r['suite']} | {r['baseline_passed']}/{r['n']} | "
            f"{r['candidate_passed']}/{r['n']} | {100 * r['delta']:+.1f} pts | "
            f"[{100 * lo:+.1f}, {100 * hi:+.1f}] | {r['mcnemar_p']:.3g} | {r['verdict']} | "
            f"{probe_text} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Collect, print and write."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probe", type=Path, default=None, help="quant_probe.py's JSON")
    parser.add_argument("--out", type=Path, default=RESULTS / "quantisation.json")
    args = parser.parse_args(argv)
    result = collect(args.probe)
    print(table(result))
    write_result(args.out, result, argv=argv)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
