#!/usr/bin/env bash
# The main job on the demo: install, make the demo model, validate and lock the demo
# manifests, then run the release lifecycle as far as it is built.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export PATH="$PWD/.venv/bin:$PATH" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

step "demo model: dvc repro (trains only when its inputs changed)"
dvc repro demo-data demo-model

MANIFESTS=(manifests/demo-bf16.yaml manifests/demo-w8a8.yaml manifests/demo-w4a16.yaml manifests/demo-damaged-prompt.yaml)
step "validate the demo manifests"
releasekit validate "${MANIFESTS[@]}"

step "lock: one content-addressed release per manifest"
for m in "${MANIFESTS[@]}"; do
  printf '%-40s %s\n' "$m" "$(releasekit lock "$m")"
done
