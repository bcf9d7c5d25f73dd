"""The demo's quantisation lesson, read off its real builds: W8A8 and W4A16 against bf16.

`releasekit build` quantises each release with llm-compressor, serves it with vLLM's CPU
build, evaluates every suite against it and compares it item by item with its baseline
(bf16); this script reads those comparisons (each release's `report/compare.json`, found
through the manifests' locks), prints one table and writes it as JSON with the host's CPU
kind. It builds nothing: run the builds first.

    releasekit build manifests/demo-bf16.yaml manifests/demo-w8a8.yaml manifests/demo-w4a16.yaml
    python benchmarks/quant_table.py --out benchmarks/results/quant_lesson.json

On a host without AVX-512 vLLM's CPU build cannot serve W4A16: the demo skips it, and so
does this table (it says so).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from releasekit.config import load_settings
from releasekit.errors import ReleasekitError
from releasekit.evaluate.comparison import load_comparison
from releasekit.spec.hostcaps import cpu_facts
from releasekit.spec.lock import read_lock
from releasekit.stores.results import ReleasePaths

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_result

ROOT = Path(__file__).resolve().parents[1]
CANDIDATES = ("demo-w8a8", "demo-w4a16")


def cpu_kind() -> str:
    """avx512_amx, avx512 or avx2: the families whose float kernels (and so weights and
    answers) differ."""
    cpu = cpu_facts()
    if cpu.has("avx512f"):
        return "avx512_amx" if cpu.has("amx_bf16") else "avx512"
    return "avx2" if cpu.has("avx2") else "unknown"


def suite_rows(name: str) -> list[dict[str, Any]] | str:
    """One row per suite of `name`'s comparison with its baseline, or why there is none."""
    lock_path = ROOT / "manifests" / f"{name}.lock.json"
    if not lock_path.is_file():
        return f"{lock_path.name} is missing: run `releasekit lock manifests/{name}.yaml`"
    release = read_lock(lock_path).release_id
    report = ReleasePaths.of(load_settings(), release).report_dir
    try:
        cmp = load_comparison(report)
    except ReleasekitError as exc:
        return f"release {release[:12]} has no comparison ({exc}): build it first"
    rows = []
    for suite, sc in cmp.suites.items():
        rows.append(
            {
                "release": name,
                "release_id": release,
                "baseline_id": cmp.baseline_release_id,
                "suite": suite,
                "n": sc.n_paired,
                "baseline_pass_rate": sc.baseline_pass_rate,
                "candidate_pass_rate": sc.candidate_pass_rate,
                "delta": sc.delta,
                "ci": [sc.ci_low, sc.ci_high],
                "confidence": cmp.confidence,
                "margin": sc.margin,
                "to_fail": len(sc.flipped_to_fail),
                "to_pass": len(sc.flipped_to_pass),
                "mcnemar_p": sc.mcnemar_p,
                "verdict": sc.verdict.value,
            }
        )
    return rows


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.2f}"


def main(argv: Sequence[str] | None = None) -> int:
    """Print the table; write it to --out."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write the rows here as JSON")
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []
    missing: dict[str, str] = {}
    for name in CANDIDATES:
        got = suite_rows(name)
        if isinstance(got, str):
            missing[name] = got
        else:
            rows += got
    print(
        f"{'release':<12} {'suite':<11} {'n':>5} {'bf16':>7} {'quant':>7} {'delta pts':>9}  "
        f"{'95% CI (pts)':<17} {'flips':>7} {'McNemar p':>9}  verdict (margin)"
    )
    for r in rows:
        lo, hi = r["ci"]
        base, cand = 100 * (r["baseline_pass_rate"] or 0), 100 * (r["candidate_pass_rate"] or 0)
        p = f"{r['mcnemar_p']:.4g}" if r["mcnemar_p"] is not None else "-"
        print(
            f"{r['release']:<12} {r['suite']:<11} {r['n']:>5} {base:>6.1f}% {cand:>6.1f}% "
            f"{_pct(r['delta']):>9}  [{_pct(lo)}, {_pct(hi)}]{'':<2} "
            f"{r['to_fail']:>3}/{r['to_pass']:<3} {p:>9}  "
            f"{r['verdict']} ({100 * r['margin']:g} pts)"
        )
    for name, why in missing.items():
        print(f"{name}: not shown: {why}")
    if args.out is not None:
        doc = {
            "_comment": "the demo's real builds (vLLM CPU serving each release, the suites run "
            "against it), compared item by item with bf16; written by benchmarks/quant_table.py",
            "cpu_kind": cpu_kind(),
            "rows": rows,
            "missing": missing,
        }
        write_result(args.out, doc)
        print(f"wrote {args.out}")
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
