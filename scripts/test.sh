#!/usr/bin/env bash
# Run the whole test suite (installs first; the demo model is shipped in git, nothing trains).
# With arguments it is one pytest run with them, e.g. `scripts/test.sh -m "not slow" -n 2`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
bash scripts/system-deps.sh  # Prometheus and Alertmanager for the watch tests
# A crash in native code (at exit too) prints every thread's Python stack.
export PATH="$PWD/.venv/bin:$PATH" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONFAULTHANDLER=1
.venv/bin/ruff check releasekit tests pipelines
.venv/bin/ruff format --check releasekit tests pipelines
.venv/bin/mypy releasekit
if [ "$#" -gt 0 ]; then
  exec .venv/bin/pytest "$@"
fi
# The whole suite, in two parts. The fast selection runs on two workers (pytest-xdist, a
# file per worker at a time): its tests spend about half their time waiting on the servers
# and commands they start, so one worker leaves a core idle; each worker binds its own
# share of the test port ranges (tests/portbands.py). The slow tests then run one at a
# time, as each vLLM start, build or training already keeps both cores busy.
status=0
.venv/bin/pytest -m "not slow" -n 2 --dist loadfile || status=$?
.venv/bin/pytest -m slow || status=$?
exit "$status"
