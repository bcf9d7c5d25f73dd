#!/usr/bin/env bash
# A two-node Ray cluster on this host's loopback, for the `ray` deploy target:
#   bash scripts/ray-cluster.sh start [DIR]   head on 127.0.0.1:6390, a second node beside it
#   bash scripts/ray-cluster.sh stop  [DIR]   ends exactly those nodes' processes (by session)
# Each node gets RAY_NODE_CPUS logical CPUs (default 2), its own ports and its own temp dir
# under DIR (default /tmp/rk-ray-cluster). Both nodes are on 127.0.0.1 (Ray tells them
# apart by node id): Ray binds its GCS, raylets and agents to loopback only when the node
# address is exactly 127.0.0.1 (on 127.0.0.2 it listens on every interface). Ray has no
# authentication: whoever reaches these ports runs code as this user (docs/concepts/scale-out.md: serving on a
# Ray cluster). Nodes start through `python -m releasekit.deploy.ray.loopback start`
# (`ray start` that keeps "127.0.0.1" in the cluster address as given and lets a second node
# join on it; see that module) with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, which everything
# they start inherits; releasekit sets it for its drivers.
# Never `ray stop --force`: it kills every Ray process on the host by name.
set -euo pipefail
cd "$(dirname "$0")/.."
CMD=${1:-start}
DIR=${2:-/tmp/rk-ray-cluster}
PORT=${RAY_HEAD_PORT:-6390}
CPUS=${RAY_NODE_CPUS:-2}
PY=${PYTHON:-$(command -v python || true)}
[[ -x $(dirname "${PY:-.}")/ray ]] || PY=.venv/bin/python

node() {  # node INDEX EXTRA...
  local i=$1; shift
  local base=$((PORT + 10 + i * 20))
  mkdir -p "$DIR/node$i"
  # RAY_worker_niceness=0: Ray otherwise runs workers, so replicas and their vLLM, at nice 15.
  RAY_USAGE_STATS_ENABLED=0 RAY_worker_niceness=0 RAY_TMPDIR="$DIR/node$i" \
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 \
    setsid "$PY" -m releasekit.deploy.ray.loopback start "$@" \
    --num-cpus="$CPUS" --memory=$((4 * 1024 ** 3)) --object-store-memory=$((256 * 1024 ** 2)) \
    --node-ip-address=127.0.0.1 --disable-usage-stats \
    --node-manager-port=$base --object-manager-port=$((base + 1)) \
    --runtime-env-agent-port=$((base + 2)) --metrics-export-port=$((base + 3)) \
    --dashboard-agent-listen-port=$((base + 4)) --dashboard-agent-grpc-port=$((base + 5)) \
    --min-worker-port=$((base + 6)) --max-worker-port=$((base + 19)) --block \
    >"$DIR/node$i.log" 2>&1 &
  echo $! >"$DIR/node$i.sid"
}

case $CMD in
  start)
    node 0 --head --port="$PORT" --include-dashboard=false \
      --dashboard-port=$((PORT + 1)) --ray-client-server-port=$((PORT + 2)) \
      --temp-dir="$DIR/node0"
    for _ in $(seq 120); do
      grep -q "Ray runtime started" "$DIR/node0.log" 2>/dev/null && break; sleep 1
    done
    node 1 --address="127.0.0.1:$PORT"
    for _ in $(seq 120); do
      grep -q "Ray runtime started" "$DIR/node1.log" 2>/dev/null && break; sleep 1
    done
    echo "ray cluster: address 127.0.0.1:$PORT, 2 nodes on 127.0.0.1 ($CPUS CPUs each)"
    echo "logs and session ids under $DIR; stop with: bash scripts/ray-cluster.sh stop $DIR"
    ;;
  stop)
    for f in "$DIR"/node1.sid "$DIR"/node0.sid; do
      [[ -f $f ]] || continue
      sid=$(cat "$f")
      pids=$(ps -eo pid=,sid= | awk -v s="$sid" '$2 == s {print $1}')
      [[ -n $pids ]] && kill $pids 2>/dev/null || true
      sleep 3
      pids=$(ps -eo pid=,sid= | awk -v s="$sid" '$2 == s {print $1}')
      [[ -n $pids ]] && kill -9 $pids 2>/dev/null || true
      rm -f "$f"
    done
    echo "ray cluster under $DIR stopped"
    ;;
  *) echo "usage: $0 start|stop [DIR]" >&2; exit 2 ;;
esac
