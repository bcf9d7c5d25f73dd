"""`python -m releasekit.deploy.gateway --config FILE.json`: serve one environment's gateway."""

from __future__ import annotations

import sys

from releasekit.deploy.gateway.server import main

if __name__ == "__main__":
    sys.exit(main())
