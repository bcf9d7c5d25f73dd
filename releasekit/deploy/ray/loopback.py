"""`ray start` for nodes that listen on loopback only:

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 python -m releasekit.deploy.ray.loopback start \\
        --node-ip-address=127.0.0.1 [--head | --address=127.0.0.1:PORT] ...

Ray 2.60 binds its GCS, raylets and agents to loopback only when the node address is
exactly 127.0.0.1 (on 127.0.0.2 they listen on every interface). Two things stand in the
way of a cluster of several nodes on 127.0.0.1 (told apart by node id and ports):

- without RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, Ray rewrites "127.0.0.1" in a cluster
  address to the host's outward address (where the GCS does not listen), in `ray start`
  and in every driver and worker;
- with it, `ray start --address` refuses to add a node ("Multi-node Ray clusters are not
  supported on Windows and OSX").

This entry point is `ray start` with the refusal lifted and the address kept as given;
everything it starts inherits the variable. scripts/ray-cluster.sh and the tests' cluster
helper start their nodes with it; `connect` sets the variable for releasekit's drivers.
"""

from __future__ import annotations

import sys

LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def main() -> int:
    """`ray start ...` (the arguments after the module name) on loopback."""
    import ray._private.ray_constants as constants
    import ray._private.services as services
    from ray.scripts.scripts import main as ray_main

    constants.ENABLE_RAY_CLUSTER = True  # type: ignore[attr-defined]  # lifts the refusal only
    services.resolve_ip_for_localhost = lambda host: host  # keeps 127.0.0.1 as given
    sys.argv = ["ray", *sys.argv[1:]]
    ray_main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
