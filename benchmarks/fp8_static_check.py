"""Static FP8 (calibrated per-tensor activation scales) built and served for real on this host.

`releasekit doctor` reports static FP8 from vLLM's kernel selection: refused on a CPU without
AMX (the CPU build's static FP8 quantisation op is a stub, so the engine fails at start), and
on a CPU with AMX only a path vLLM would take (its AMX kernel `fp8_scaled_mm_cpu`, FP8
weights, activations kept in bf16). This script settles the second case by doing it: in a
throwaway copy of the project it writes `demo-fp8` (demo-w8a8's recipe with `scheme: FP8`,
`method: rtn`, the same calibration set), builds it and demo-bf16 with `releasekit build`
(quantise with llm-compressor, serve with vLLM, load test, every eval suite, item-by-item
comparison with bf16), and records what doctor said before, whether the build served,
the linear kernel vLLM logged, and each suite's pass rate against bf16.

    .venv/bin/python benchmarks/fp8_static_check.py [--out PATH]

Result: benchmarks/results/fp8_static.json (with the host's CPU kind; the verdict belongs to
the host kind it ran on).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _demo_project import REPO, free_port, make_project, preflight
from _results import RESULTS, write_result

KERNEL_LINE = re.compile(r"(Selected|Using) \S*(Kernel|kernel)\S* .*|\S+Fp8\S+Kernel")


def fp8_manifest(w8a8: str) -> str:
    """demo-w8a8.yaml with static FP8 in place of GPTQ W8A8 (same ignore list, same data)."""
    text = w8a8.replace("name: demo-w8a8", "name: demo-fp8")
    text = text.replace("scheme: W8A8", "scheme: FP8").replace("method: gptq", "method: rtn")
    desc = "Demo assistant, static FP8 (FP8 weights, calibrated per-tensor activation scales)."
    text = re.sub(r"(?m)^# .*$", f"# {desc}", text, count=1)
    return re.sub(r"(?m)^description: .*$", f"description: {desc}", text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "fp8_static.json")
    args = parser.parse_args(argv)
    preflight()
    from releasekit.evaluate.comparison import load_comparison
    from releasekit.spec.hostcaps import host_facts, scheme_support
    from releasekit.spec.lock import read_lock

    before = scheme_support("FP8", host_facts(sys.executable))
    print(f"doctor before: FP8 {before.status}: {before.how}")
    with tempfile.TemporaryDirectory(prefix="rk-fp8-") as tmp:
        lo = free_port(18300, 18390)
        root = make_project(Path(tmp), gateway_ports=(lo, lo))
        (root / "manifests" / "demo-fp8.yaml").write_text(
            fp8_manifest((REPO / "manifests" / "demo-w8a8.yaml").read_text())
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RELEASEKIT_", "MLFLOW_"))}
        env.update(
            HF_HUB_OFFLINE="1",
            TOKENIZERS_PARALLELISM="false",
            RELEASEKIT_CONFIG=str(root / "releasekit.toml"),
            RELEASEKIT_PORT_RANGE="18400-18499",
            RELEASEKIT_ACTOR="fp8-check <bench@releasekit.local>",
            RELEASEKIT_SERVER_START_TIMEOUT_S="600",
        )
        subprocess.run(["git", "add", "-A"], cwd=root, check=True)
        who = ["-c", "user.name=bench", "-c", "user.email=bench@localhost"]
        subprocess.run(["git", *who, "commit", "-qm", "demo-fp8"], cwd=root, check=True)
        cmd = [str(Path(sys.executable).parent / "releasekit"), "build"]
        cmd += ["manifests/demo-bf16.yaml", "manifests/demo-fp8.yaml"]
        print("building demo-bf16 and demo-fp8 (a few minutes)", flush=True)
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
        result: dict[str, Any] = {
            "what": "demo-w8a8's recipe with scheme FP8 (static, calibrated per-tensor "
            "activation scales, method rtn), built and served with `releasekit build` on this "
            "host, compared with demo-bf16 on every suite",
            "doctor_before": {"status": before.status, "how": before.how},
            "build_exit": proc.returncode,
        }
        lock = root / "manifests" / "demo-fp8.lock.json"
        rid = read_lock(lock).release_id if lock.is_file() else None
        log = root / "results" / rid / "server.log" if rid else None
        if log is not None and not log.is_file():
            found = sorted((root / "results" / rid).rglob("server.log")) if rid else []
            log = found[0] if found else None
        log_text = log.read_text(errors="replace") if log is not None else ""
        result["kernel_lines"] = sorted({m.group(0) for m in KERNEL_LINE.finditer(log_text)})
        if proc.returncode != 0:
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
            result["served"] = False
            result["build_output_tail"] = tail
            result["server_log_tail"] = log_text.strip().splitlines()[-15:]
        else:
            result["served"] = True
            assert rid is not None
            cmp = load_comparison(root / "results" / rid / "report")
            result["release_id"] = rid
            result["suites"] = {
                name: {
                    "n": sc.n_paired,
                    "bf16": sc.baseline_pass_rate,
                    "fp8": sc.candidate_pass_rate,
                    "delta": sc.delta,
                    "ci": [sc.ci_low, sc.ci_high],
                    "margin": sc.margin,
                    "mcnemar_p": sc.mcnemar_p,
                    "verdict": sc.verdict.value,
                }
                for name, sc in cmp.suites.items()
            }
            bench = json.loads((root / "results" / rid / "bench" / "bench.json").read_text())
            result["knee"] = bench.get("knee")
    path = write_result(args.out, result)
    print(f"served: {result['served']}; kernels: {result['kernel_lines'] or 'none logged'}")
    for name, s in result.get("suites", {}).items():
        print(
            f"  {name:<11} n={s['n']:>5} bf16 {s['bf16']:.3f} fp8 {s['fp8']:.3f} "
            f"p={s['mcnemar_p']} {s['verdict']}"
        )
    for line in result.get("build_output_tail", []):
        print(f"  | {line}")
    print(f"wrote {path}")
    return 0 if result["served"] else 1


if __name__ == "__main__":
    sys.exit(main())
