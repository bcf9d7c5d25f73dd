#!/usr/bin/env bash
# The main job on the demo: install, make the demo model, then take the demo releases
# through the lifecycle: validate, lock, build (quantise, bench, eval, report), register
# in MLflow, assign to environments, and answer the auditor's questions.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export PATH="$PWD/.venv/bin:$PATH" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export RELEASEKIT_ACTOR="${RELEASEKIT_ACTOR:-demo <demo@releasekit.local>}"
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

step "build: quantise, load-test, evaluate, compare with bf16, register in MLflow"
for m in "${MANIFESTS[@]}"; do
  releasekit build "$m"
done

step "assign: bf16 to staging and production, then W4A16 to staging"
releasekit assign manifests/demo-bf16.yaml --env staging --reason "demo: baseline to staging"
releasekit assign manifests/demo-bf16.yaml --env production --reason "demo: baseline to production"
releasekit assign manifests/demo-w4a16.yaml --env staging --reason "demo: 4-bit candidate to staging"

step "audit"
releasekit status
releasekit history --env staging
releasekit diff manifests/demo-bf16.yaml manifests/demo-w4a16.yaml
releasekit ledger verify

printf '\nReports: results/<release id>/report/report.html; MLflow UI: mlflow ui --backend-store-uri sqlite:///.releasekit/mlflow.db\n'
