#!/usr/bin/env bash
# Write the CPU stack's lock files from its pins: requirements/stack.lock.txt (every package
# of stack.txt's stages, with the remove stage's packages gone) and requirements/ray.lock.txt
# (what requirements/ray.txt adds on top). Run it after changing stack.txt or ray.txt and
# commit the three files together; scripts/install.sh installs exactly the locked versions.
#
# The stages are resolved as they always were, one pip call each in a scratch venv (they
# conflict on purpose: see stack.txt), so the lock records what that order gives.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"$PY" -m venv "$WORK/venv"
PIP=("$WORK/venv/bin/python" -m pip --disable-pip-version-check)
read -r -a EXTRA <<< "${RELEASEKIT_PIP_ARGS:-}"
stage() {
  awk -v s="$1" '/^## stage /{on=($3==s); next} on && $0 !~ /^[[:space:]]*(#|$)/' \
    requirements/stack.txt
}
freeze() { "${PIP[@]}" freeze --exclude-editable | LC_ALL=C sort -f; }
for s in serving quantise tools; do
  mapfile -t reqs < <(stage "$s")
  echo "lock: stage $s"
  "${PIP[@]}" install -q --no-compile "${EXTRA[@]}" "${reqs[@]}"
done
mapfile -t gone < <(stage remove)
[[ ${#gone[@]} -eq 0 ]] || "${PIP[@]}" uninstall -y -q "${gone[@]}"
freeze > "$WORK/core.txt"
echo "lock: Ray"
"${PIP[@]}" install -q --no-compile "${EXTRA[@]}" -r requirements/ray.txt
freeze > "$WORK/all.txt"
changed=$(grep -v -x -F -f "$WORK/all.txt" "$WORK/core.txt" || true)
if [[ -n $changed ]]; then
  echo "lock: Ray's install changed packages of the stack; pin them in stack.txt:" >&2
  echo "$changed" >&2
  exit 1
fi
header() {
  echo "# Written by scripts/lock-stack.sh from $1; do not edit by hand."
  echo "# scripts/install.sh installs exactly these versions (CPU stack)."
}
{ header "requirements/stack.txt"; cat "$WORK/core.txt"; } > requirements/stack.lock.txt
{ header "requirements/ray.txt (what it adds to stack.lock.txt)"
  grep -v -x -F -f "$WORK/core.txt" "$WORK/all.txt"; } > requirements/ray.lock.txt
echo "lock: wrote requirements/stack.lock.txt ($(grep -vc '^#' requirements/stack.lock.txt) packages)" \
  "and requirements/ray.lock.txt ($(grep -vc '^#' requirements/ray.lock.txt))"
