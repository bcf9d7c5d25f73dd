"""Autoscaling from the knee under a load step, on a real two-node Ray cluster on loopback.

Runs the load step of tests/deploy/test_ray_autoscale.py (a `ray` environment with
`autoscaling = { target = "knee", knee_headroom = 0.75, min_replicas = 1, max_replicas = 2,
... }`; the release's knee is concurrency 16, so the target is 4 in flight per replica):
1 client streaming back to back through the environment's gateway, then 12 concurrent
streams, then 1 client again. It records Ray Serve's own replica count over time (its
`serve.status()`, read through `deploy-status`), TTFT p95 at the gateway per phase, when the
second replica came up and went away, and every failure, and writes them with the run block
to benchmarks/results/autoscale_step.json.

By default the replicas' engine is the deploy tests' stand-in vLLM (each stream 15 chunks
0.2 s apart, knee 16 written by the bench's own writer): the figures then measure releasekit's
and Ray's part (the derived target, the scale-up and scale-down, requests through the gateway
during both), not an engine's latency. With `--engine vllm` the replicas are real vLLM: the
demo's bf16 release is built for real first (`releasekit build`: quantise, serve, load test,
eval), its knee is its own load test's, the environment keeps 87.5% of it spare, and the step
is 16 concurrent streams (a second vLLM starts on the same two cores while the first serves
them); result in benchmarks/results/autoscale_step.vllm.json.

    .venv/bin/python benchmarks/autoscale_step.py [--engine stand-in|vllm] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._results import REPO, RESULTS, write_result

TEST = "tests/deploy/test_ray_autoscale.py"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("stand-in", "vllm"), default="stand-in")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    real = args.engine == "vllm"
    out = args.out or RESULTS / ("autoscale_step.vllm.json" if real else "autoscale_step.json")
    with tempfile.TemporaryDirectory(prefix="rk-autoscale-") as tmp:
        raw = Path(tmp) / "step.json"
        env = {
            **os.environ,
            "RELEASEKIT_AUTOSCALE_OUT": str(raw),
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p
            ),
            "HF_HUB_OFFLINE": "1",
            "RELEASEKIT_TEST_RAY_VLLM": "1" if real else "0",
        }
        which = "real_vllm" if real else "above_the_knee_target"
        cmd = [sys.executable, "-m", "pytest", TEST, "-q", "-s", "-p", "no:cacheprovider"]
        cmd += ["-k", which]
        proc = subprocess.run(cmd, cwd=REPO, env=env, check=False)
        if not raw.is_file():
            print(f"autoscale_step: the load step did not finish (pytest exit {proc.returncode})")
            return 1
        result = json.loads(raw.read_text())
    result["test_passed"] = proc.returncode == 0
    path = write_result(out, result)
    phases = result["phases"]
    print(f"{'phase':<8} {'requests':>8} {'failed':>6} {'TTFT p95 s':>10}")
    for name, p in phases.items():
        print(f"{name:<8} {p['requests']:>8} {p['failed']:>6} {p['ttft_p95_s']!s:>10}")
    print(
        f"second replica running at {result['scaled_up_at_s']} s, back to one at "
        f"{result['scaled_down_at_s']} s; {len(result['failures'])} failed; wrote {path}"
    )
    return 0 if proc.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
