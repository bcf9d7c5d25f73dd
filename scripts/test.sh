#!/usr/bin/env bash
# Run the whole test suite (installs first; the demo model is shipped in git, nothing trains).
# With arguments it is one pytest run with them, e.g. `scripts/test.sh -m "not slow" -n 2`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
bash scripts/system-deps.sh  # Prometheus and Alertmanager for the watch tests
# A crash in native code (at exit too) prints every thread's Python stack.
export PATH="$PWD/.venv/bin:$PATH" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONFAULTHANDLER=1
.venv/bin/ruff check releasekit tests pipelines docs/_hooks
.venv/bin/ruff format --check releasekit tests pipelines docs/_hooks
if [ "$#" -gt 0 ]; then
  .venv/bin/mypy releasekit
  exec .venv/bin/pytest "$@"
fi
# The whole suite, in two runs. The first is the fast selection and the slow tests marked
# parallel_safe (their verdicts read no timing and they share no session server or build:
# training, quantising, MLflow races, interrupted commands), on two workers (pytest-xdist,
# a file per worker at a time): the fast tests spend about half their time waiting on the
# servers and commands they start, so one worker leaves a core idle; each worker binds its
# own share of the test port ranges (tests/portbands.py). The second runs the other slow
# tests one at a time, alone on the host: the demo builds' load tests, the session's vLLM
# server and the tests that judge latency or a replica's health.
# mypy (one core, about two minutes without its cache) checks beside the first run, which
# leaves about a third of the host idle; its result is printed when that run ends.
status=0
mypy_log=$(mktemp)
.venv/bin/mypy releasekit >"$mypy_log" 2>&1 &
mypy_pid=$!
.venv/bin/pytest -m "not slow or parallel_safe" -n 2 --dist loadfile || status=$?
wait "$mypy_pid" || status=$?
echo "mypy releasekit:"
cat "$mypy_log"
rm -f "$mypy_log"
.venv/bin/pytest -m "slow and not parallel_safe" || status=$?
exit "$status"
