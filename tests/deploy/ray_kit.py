"""A throwaway Ray cluster on loopback for the Ray target's tests: a head and, on demand,
more nodes (`ray start --address`), each with its own CPU share and its own ports from
31000-31999 (these tests' range, see CONTRIBUTING.md) and temp dir under /tmp/rk-ray-*.
Every node is on 127.0.0.1 (Ray tells them apart by node id): only then does Ray bind its
GCS, raylets and agents to loopback alone (`listening_sockets` lists what they opened).

Each node is started with `setsid`, so its daemons (GCS, raylet, workers) share one session;
`stop()` ends exactly that session's processes (and the process groups of the servers its
replicas started), never other clusters on the host (`ray stop --force` kills by name).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from portbands import share

# `ray start` through releasekit's loopback entry point (deploy/ray/loopback.py): several
# nodes on 127.0.0.1, the cluster address kept as given.
RAY_START = [sys.executable, "-m", "releasekit.deploy.ray.loopback", "start"]
PORT_BASE = 31000
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def _sid_members(sid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if os.getsid(int(d.name)) == sid:
                out.append(int(d.name))
        except (ProcessLookupError, PermissionError):
            continue
    return out


def _children_groups(pids: list[int]) -> set[int]:
    """Process groups of the direct children of `pids` that left the session (servers)."""
    groups: set[int] = set()
    want = set(pids)
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid in want:
                groups.add(os.getpgid(int(d.name)))
        except (OSError, ValueError, IndexError):
            continue
    return groups


@dataclass
class RayNode:
    """One `ray start` node: its session id (the setsid'd starter), temp dir, ports."""

    sid: int
    temp_dir: Path
    log: Path
    head: bool

    def pids(self) -> list[int]:
        return _sid_members(self.sid)


@dataclass
class RayCluster:
    """A head on 127.0.0.1 and the nodes added to it (on 127.0.0.1 too, with their own
    ports); `address` is the GCS address."""

    slot: int
    root: Path
    nodes: list[RayNode] = field(default_factory=list)

    @property
    def gcs_port(self) -> int:
        return PORT_BASE + self.slot * 100

    @staticmethod
    def node_ip(i: int) -> str:
        """Every node's address: 127.0.0.1, the one address on which Ray listens on
        loopback only (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 keeps Ray from rewriting it to
        the host's outward address)."""
        return "127.0.0.1"

    @property
    def address(self) -> str:
        return f"{self.node_ip(0)}:{self.gcs_port}"

    @property
    def serve_port(self) -> int:
        return self.gcs_port + 90

    def _ports(self, i: int) -> list[str]:
        b = self.gcs_port + 1 + i * 20  # 20 ports per node: 9 named ones, then workers
        return [
            f"--node-manager-port={b}",
            f"--object-manager-port={b + 1}",
            f"--runtime-env-agent-port={b + 2}",
            f"--metrics-export-port={b + 3}",
            f"--dashboard-agent-listen-port={b + 4}",
            f"--dashboard-agent-grpc-port={b + 5}",
            f"--min-worker-port={b + 6}",
            f"--max-worker-port={b + 19}",
        ]

    @property
    def dashboard_port(self) -> int:
        return self.gcs_port + 98

    def add_node(
        self, *, num_cpus: int = 2, memory_gb: float = 4.0, dashboard: bool = False
    ) -> RayNode:
        """Start the head (first call) or one more node joined to it; waits until the
        cluster counts it. `dashboard`: the head runs Ray's dashboard (on 127.0.0.1 at
        `dashboard_port`), which Ray's `serve deploy` talks to."""
        i = len(self.nodes)
        head = i == 0
        temp = Path(tempfile.mkdtemp(prefix=f"rk-ray-{self.slot}-{i}-", dir="/tmp"))
        log = self.root / f"ray-node-{i}.log"
        argv = [
            "setsid",
            *RAY_START,
            *(
                [
                    "--head",
                    f"--port={self.gcs_port}",
                    f"--ray-client-server-port={self.gcs_port + 99}",
                    f"--include-dashboard={'true' if dashboard else 'false'}",
                    *(["--dashboard-host=127.0.0.1"] if dashboard else []),
                    f"--dashboard-port={self.dashboard_port}",
                ]
                if head
                else [f"--address={self.address}"]
            ),
            f"--num-cpus={num_cpus}",
            f"--memory={int(memory_gb * 1024**3)}",
            f"--object-store-memory={256 * 1024**2}",
            f"--node-ip-address={self.node_ip(i)}",
            "--disable-usage-stats",
            *self._ports(i),
            *([f"--temp-dir={temp}"] if head else []),
            "--block",
        ]
        env = {
            **os.environ,
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_TMPDIR": str(temp),
            # Ray starts workers (so replicas and their vLLM) at niceness 15 by default.
            "RAY_worker_niceness": "0",
            **LOOPBACK_ENV,
        }
        with log.open("ab") as fh:
            proc = subprocess.Popen(
                argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
            )
        node = RayNode(sid=proc.pid, temp_dir=temp, log=log, head=head)
        self.nodes.append(node)
        self._wait_nodes(len(self.nodes), log, proc)
        return node

    def _wait_nodes(self, n: int, log: Path, proc: subprocess.Popen[bytes]) -> None:
        probe = (
            "import ray,sys;ray.init(address=sys.argv[1],_node_ip_address=sys.argv[2],"
            "logging_level='ERROR',log_to_driver=False);"
            "print(sum(1 for x in ray.nodes() if x['Alive']))"
        )
        end = time.monotonic() + 180
        while time.monotonic() < end:
            if proc.poll() is not None:
                pytest.fail(f"ray start exited {proc.returncode}: {log.read_text()[-2000:]}")
            r = subprocess.run(
                [sys.executable, "-c", probe, self.address, self.node_ip(0)],
                capture_output=True,
                text=True,
                check=False,
                env={**os.environ, **LOOPBACK_ENV},
            )
            if r.returncode == 0 and r.stdout.strip().isdigit() and int(r.stdout) >= n:
                return
            time.sleep(1.0)
        pytest.fail(f"Ray node {n} did not join in time: {log.read_text()[-2000:]}")

    def pids(self) -> list[int]:
        """Every process of every node now (GCS, raylets, agents, workers)."""
        return [pid for node in self.nodes for pid in node.pids()]

    def listening_sockets(self) -> list[tuple[int, str, str, int]]:
        """(pid, process name, address, port) of every TCP socket the cluster's processes
        listen on."""
        import psutil

        out = []
        for pid in self.pids():
            try:
                proc = psutil.Process(pid)
                name = proc.name()
                conns = proc.net_connections(kind="inet")
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            for c in conns:
                if c.status == psutil.CONN_LISTEN and c.laddr:
                    out.append((pid, name, c.laddr.ip, c.laddr.port))
        return out

    def stop(self) -> None:
        """End every process of every node (by session), and the servers they started."""
        for node in reversed(self.nodes):
            pids = node.pids()
            groups = _children_groups(pids)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGTERM)
            end = time.monotonic() + 3
            while node.pids() and time.monotonic() < end:
                time.sleep(0.2)
            for pid in node.pids():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            for g in groups:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(g, signal.SIGKILL)
            shutil.rmtree(node.temp_dir, ignore_errors=True)
        self.nodes.clear()


def free_slot() -> int:
    """A 100-port slot of 31000-31899 (this worker's share of the nine) whose GCS port is
    free."""
    import socket

    slots = share(0, 8)
    for slot in slots:
        with socket.socket() as s:
            try:
                s.bind((RayCluster.node_ip(0), PORT_BASE + slot * 100))
            except OSError:
                continue
            return slot
    pytest.skip(f"no free Ray port slot among {list(slots)} of 31000-31899")


def env_lines(c: RayCluster, **extra: Any) -> list[str]:
    """releasekit.toml lines that put an environment on cluster `c` (2 replicas, quick
    health checks), for make_kit's `toml_lines`."""
    fields = {"address": f'"{c.address}"', "serve_port": str(c.serve_port), "replicas": "2"}
    fields.update({"health_check_period_s": "1", "health_check_timeout_s": "5"})
    fields.update({k: str(v) for k, v in extra.items()})
    inner = ", ".join(f"{k} = {v}" for k, v in fields.items())
    return ['target = "ray"', f"ray = {{ {inner} }}"]
