#!/usr/bin/env bash
# Install the system programs releasekit's watch tests and alert rules need:
# Prometheus (with promtool) and Alertmanager, from Debian's packages; and tcmalloc
# (libtcmalloc-minimal4), which vLLM's CPU build is started with when present; and a C
# compiler (gcc), with which the demo model's training builds releasekit/_support/mkl_intel_branch.c
# on processors that are not Intel's (without it, the training there gives other weights); and
# Chromium, in which the test of `releasekit audit page` opens the page headless (without it
# that test is skipped, and fails where CI is set).
# Does nothing when `prometheus`, `promtool` and `prometheus-alertmanager` are all on PATH,
# tcmalloc is installed and `cc` and `chromium` are on PATH.
#
# Elsewhere (no apt-get): download the release tarballs from
#   https://prometheus.io/download/  (prometheus-*.linux-amd64.tar.gz, alertmanager-*.tar.gz)
# and put `prometheus`, `promtool` and `alertmanager` on PATH (name the last one
# `prometheus-alertmanager`, or point RELEASEKIT_ALERTMANAGER at it); on macOS:
# `brew install prometheus alertmanager`.
set -euo pipefail

# Debian ships Alertmanager as `prometheus-alertmanager`; upstream calls it `alertmanager`.
need=()
command -v prometheus >/dev/null 2>&1 || need+=(prometheus)
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
if ! command -v prometheus-alertmanager >/dev/null 2>&1 \
  && ! command -v alertmanager >/dev/null 2>&1; then
  need+=(prometheus-alertmanager)
fi
if [[ $(uname -m) == x86_64 && ! -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ]]; then
  need+=(libtcmalloc-minimal4)
fi
command -v cc >/dev/null 2>&1 || need+=(gcc libc6-dev)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
if [[ ${#need[@]} -eq 0 ]]; then
  echo "system-deps: prometheus, promtool, alertmanager, tcmalloc, cc and chromium already installed"
  exit 0
fi
mapfile -t pkgs < <(printf '%s\n' "${need[@]}" | sort -u)

if ! command -v apt-get >/dev/null 2>&1; then
  echo "system-deps: apt-get not found; install ${pkgs[*]} by hand:" >&2
  echo "  download prometheus and alertmanager from https://prometheus.io/download/" >&2
  echo "  (or 'brew install prometheus alertmanager') and put prometheus, promtool and" >&2
  echo "  alertmanager on PATH; install Chromium (or Google Chrome as \`chromium\`) for the" >&2
  echo "  audit page's browser test" >&2
  exit 1
fi
SUDO=()
if [[ $(id -u) -ne 0 ]]; then
  if command -v sudo >/dev/null 2>&1; then
    SUDO=(sudo)
  else
    echo "system-deps: need root (or sudo) to apt-get install ${pkgs[*]}" >&2
    exit 1
  fi
fi

echo "system-deps: apt-get update"
"${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null
echo "system-deps: apt-get install --no-install-recommends ${pkgs[*]}"
# No systemd in containers: the packages' service start is refused, which is harmless;
# releasekit runs both as plain processes.
"${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive \
  apt-get install -y -q --no-install-recommends "${pkgs[@]}" >/dev/null
for bin in prometheus promtool chromium; do
  command -v "$bin" >/dev/null 2>&1 || { echo "system-deps: $bin still missing" >&2; exit 1; }
done
echo "system-deps: done ($(prometheus --version 2>&1 | head -1))"
