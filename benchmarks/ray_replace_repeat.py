"""The Ray killed-replica case, run again and again: does it pass every time on this host?

    .venv/bin/python benchmarks/ray_replace_repeat.py [--runs 5] [--out PATH]

Each run is the slow test `tests/deploy/test_ray_vllm.py -k killed` in its own pytest
process: a two-node Ray cluster on loopback, the demo's bf16 release on two real vLLM
replicas, one replica's Ray worker SIGKILLed while a client streams through the gateway,
Ray's replacement (a third vLLM start) serving streams itself. What may fail is only the
stream the killed replica was serving. Recorded per run: pass or fail, seconds, and the
test's own figures (streams before and after the kill, streams cut on the killed replica,
streams failed otherwise with their errors, seconds until the replacement was healthy).
Prints a line a run and writes benchmarks/results/ray_replace_repeat.<cpu kind>.json. Needs
models/demo-base, vLLM and Ray.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._results import REPO, RESULTS, host_kind, write_result

TEST = "tests/deploy/test_ray_vllm.py"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    kind = host_kind()
    out = args.out or RESULTS / f"ray_replace_repeat.{kind}.json"
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rk-ray-repeat-") as tmp:
        for i in range(1, args.runs + 1):
            raw = Path(tmp) / f"run{i}.json"
            env = {
                **os.environ,
                "RELEASEKIT_RAY_REPLACE_OUT": str(raw),
                "PYTHONPATH": os.pathsep.join(
                    p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p
                ),
                "HF_HUB_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false",
            }
            cmd = [sys.executable, "-m", "pytest", TEST, "-k", "killed", "-q", "-s"]
            cmd += ["-p", "no:cacheprovider"]
            t0 = time.monotonic()
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
            took = round(time.monotonic() - t0, 1)
            figures = json.loads(raw.read_text()) if raw.is_file() else {}
            figures.pop("run", None)
            run = {"run": i, "passed": proc.returncode == 0, "seconds": took, **figures}
            if proc.returncode != 0:
                run["pytest_tail"] = (proc.stdout + proc.stderr).strip().splitlines()[-20:]
            runs.append(run)
            print(
                f"run {i}: {'passed' if run['passed'] else 'FAILED'} in {took} s; streams ok "
                f"after the kill {figures.get('streams_ok_after_kill')}, cut on the killed "
                f"replica {figures.get('streams_cut_on_killed_replica')}, failed otherwise "
                f"{figures.get('streams_failed_otherwise')}, replacement healthy after "
                f"{figures.get('replacement_healthy_s')} s",
                flush=True,
            )
    passed = sum(1 for r in runs if r["passed"])
    result = {
        "what": "the Ray killed-replica case (tests/deploy/test_ray_vllm.py -k killed), "
        f"{args.runs} runs in a row, each in its own pytest process",
        "cpu_kind": kind,
        "runs_passed": passed,
        "runs": runs,
    }
    path = write_result(out, result)
    print(f"{passed} of {len(runs)} passed; wrote {path}")
    return 0 if passed == len(runs) else 1


if __name__ == "__main__":
    sys.exit(main())
