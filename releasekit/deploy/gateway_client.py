"""A typed client for a gateway's admin API, and launching a gateway as its own process.

Deploy, promote and rollback talk to a running gateway only through `GatewayClient`:

    gw = GatewayClient(endpoint.url, admin_token=token)
    gw.set_routes([Route(release_id=new, base_url=new_url)])   # atomic switch
    if gw.wait_drained(old, deadline_s=60):                     # old upstream idle
        stop(old_server)

`launch_gateway` writes a config file (mode 0600: it holds the admin token), starts
`python -m releasekit.deploy.gateway --config FILE` in its own session so that it outlives
the caller, and returns once the ready file exists and the admin API answers.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
from pydantic import ValidationError

from releasekit._support.http import http_client
from releasekit._support.retry import RetryPolicy
from releasekit.deploy.gateway import (
    DrainResult,
    GatewayAuthError,
    GatewayConfig,
    GatewayEndpoint,
    GatewayRequestError,
    GatewayStartError,
    GatewayState,
    GatewayUnreachableError,
    MirrorPairs,
    Route,
    RouteTable,
)

__all__ = ["GatewayClient", "LaunchedGateway", "launch_gateway", "read_endpoint"]


class GatewayClient:
    """The admin API of one gateway (`/admin/*`), authenticated with its admin token.

    Errors: GatewayUnreachableError (no answer), GatewayAuthError (401),
    GatewayRequestError (422 invalid table, 409 drain of a routed release).
    """

    def __init__(
        self,
        base_url: str,
        *,
        admin_token: str,
        timeout_s: float = 10.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._http = http_client(
            base_url=self.base_url,
            headers={"authorization": f"Bearer {admin_token}"},
            timeout=timeout_s,
            transport=transport,
            trust_env=False,
        )

    def close(self) -> None:
        """Close the HTTP connection pool."""
        self._http.close()

    def __enter__(self) -> GatewayClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(
        self, method: str, path: str, *, json: object = None, timeout_s: float | None = None
    ) -> httpx.Response:
        try:
            r = self._http.request(
                method, path, json=json, timeout=timeout_s if timeout_s else self.timeout_s
            )
        except httpx.HTTPError as exc:
            raise GatewayUnreachableError(
                f"gateway at {self.base_url} does not answer: {exc!r}"
            ) from exc
        if r.status_code == 401:
            raise GatewayAuthError(f"gateway at {self.base_url} refused the admin token")
        if r.status_code >= 400:
            message, problems = f"{r.status_code}", []
            with contextlib.suppress(ValueError, KeyError, TypeError):
                err = r.json()["error"]
                message = str(err["message"])
                problems = [str(p) for p in err.get("problems", [])]
            raise GatewayRequestError(
                f"gateway at {self.base_url} answered {r.status_code}: {message}",
                status=r.status_code,
                problems=problems,
            )
        return r

    def health(self) -> bool:
        """True when `/health` answers 200 (some route carries traffic)."""
        try:
            return self._http.get("/health").status_code == 200
        except httpx.HTTPError:
            return False

    def state(self) -> GatewayState:
        """Routes, in-flight and served counts per release, right now."""
        return GatewayState.model_validate_json(self._call("GET", "/admin/state").content)

    def set_routes(self, routes: Sequence[Route] | RouteTable) -> GatewayState:
        """Replace the whole routing table atomically; answers the new state."""
        table = routes if isinstance(routes, RouteTable) else RouteTable(routes=list(routes))
        r = self._call("PUT", "/admin/routes", json=table.model_dump(mode="json"))
        return GatewayState.model_validate_json(r.content)

    def mirror_pairs(self, since: int = 0) -> MirrorPairs:
        """The mirror's answer pairs held with seq > `since`, oldest first."""
        r = self._call("GET", f"/admin/mirror/pairs?since={int(since)}")
        return MirrorPairs.model_validate_json(r.content)

    def renew_lease(self, generation: int) -> GatewayState:
        """Keep the leased table of `generation` for another lease period; GatewayRequestError
        (409) when it is no longer in force (it expired and reverted, or was replaced)."""
        r = self._call("POST", "/admin/lease", json={"generation": generation})
        return GatewayState.model_validate_json(r.content)

    def switch_to(self, route: Route) -> GatewayState:
        """Send all new traffic to one route (blue/green switch)."""
        return self.set_routes([route])

    def drain(self, release_id: str, *, timeout_s: float) -> DrainResult:
        """Wait on the gateway (up to `timeout_s`) until `release_id` has nothing in flight."""
        r = self._call(
            "POST",
            "/admin/drain",
            json={"release_id": release_id, "timeout_s": timeout_s},
            timeout_s=timeout_s + self.timeout_s,
        )
        return DrainResult.model_validate_json(r.content)

    def wait_drained(self, release_id: str, deadline_s: float) -> bool:
        """True once no request pinned to `release_id` is in flight, False if some still are
        after `deadline_s` seconds. GatewayRequestError if the release still gets traffic."""
        end = time.monotonic() + deadline_s
        while True:
            left = max(0.0, end - time.monotonic())
            if self.drain(release_id, timeout_s=min(left, 30.0)).drained:
                return True
            if left <= 0:
                return False

    def wait_ready(self, *, timeout_s: float = 30.0) -> GatewayState:
        """Poll the admin API until it answers (GatewayUnreachableError after `timeout_s`)."""
        policy = RetryPolicy.every(0.1, deadline_s=timeout_s, retry_on=(GatewayUnreachableError,))
        return policy.call(self.state)


def read_endpoint(path: Path) -> GatewayEndpoint | None:
    """The ready file a gateway wrote, or None if it is absent or unreadable."""
    try:
        return GatewayEndpoint.model_validate_json(path.read_bytes())
    except (OSError, ValidationError):
        return None


class LaunchedGateway:
    """A gateway process started by `launch_gateway`: where it listens and its pid."""

    def __init__(
        self,
        endpoint: GatewayEndpoint,
        config_path: Path,
        log_path: Path,
        process: subprocess.Popen[bytes] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.process = process
        self.config_path = config_path
        self.log_path = log_path

    @property
    def url(self) -> str:
        """http://host:port of the gateway."""
        return self.endpoint.url

    @property
    def pid(self) -> int:
        """The gateway's process id (also its process-group id)."""
        return self.endpoint.pid


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_bytes()[-8192:].decode(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def launch_gateway(
    config: GatewayConfig,
    *,
    config_path: Path,
    log_path: Path,
    python: Path | None = None,
    timeout_s: float = 30.0,
    new_session: bool = True,
) -> LaunchedGateway:
    """Write `config` to `config_path` (0600) and start the gateway as a detached process
    (own session: it outlives this one; stop it with SIGTERM to its process group).
    `new_session=False` keeps it in the caller's session, in its own process group (the
    benchmark does, so that the scheduler treats it like the processes it is compared with).

    Returns once its ready file exists and its admin API answers. Raises GatewayStartError
    (quoting its log) if it exits first or is not ready within `timeout_s`.
    """
    ready = Path(config.ready_file) if config.ready_file else config_path.with_suffix(".ready")
    config = config.model_copy(update={"ready_file": str(ready)})
    config_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    ready.unlink(missing_ok=True)
    fd = os.open(config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(config.model_dump_json(indent=2).encode())
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [
                str(python or sys.executable),
                "-m",
                "releasekit.deploy.gateway",
                "--config",
                str(config_path),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=new_session,
            process_group=None if new_session else 0,
        )
    end = time.monotonic() + timeout_s

    def written() -> GatewayEndpoint | None:
        rc = proc.poll()
        if rc is not None:
            raise GatewayStartError(
                f"gateway for {config.env} exited with code {rc} (log: {log_path})",
                log_tail=_tail(log_path),
            )
        endpoint = read_endpoint(ready)
        return endpoint if endpoint is not None and endpoint.pid == proc.pid else None

    endpoint = RetryPolicy.poll(interval_s=0.05, deadline_s=timeout_s).call(written)
    if endpoint is None:
        proc.terminate()
        raise GatewayStartError(
            f"gateway for {config.env} not ready within {timeout_s:g} s (log: {log_path})",
            log_tail=_tail(log_path),
        )
    with GatewayClient(endpoint.url, admin_token=config.admin_token) as client:
        try:
            client.wait_ready(timeout_s=max(1.0, end - time.monotonic()))
        except GatewayUnreachableError as exc:
            proc.terminate()
            raise GatewayStartError(
                f"gateway for {config.env} wrote its ready file but does not answer: {exc}",
                log_tail=_tail(log_path),
            ) from exc
    return LaunchedGateway(endpoint, config_path, log_path, proc)
