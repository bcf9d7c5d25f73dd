#!/usr/bin/env bash
# Run the whole test suite (installs first; the demo model is shipped in git, nothing trains).
# Extra arguments go to pytest, e.g. `scripts/test.sh -m "not slow"`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
bash scripts/system-deps.sh  # Prometheus and Alertmanager for the watch tests
# A crash in native code (at exit too) prints every thread's Python stack.
export PATH="$PWD/.venv/bin:$PATH" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONFAULTHANDLER=1
.venv/bin/ruff check releasekit tests pipelines
.venv/bin/ruff format --check releasekit tests pipelines
.venv/bin/mypy releasekit
exec .venv/bin/pytest "$@"
