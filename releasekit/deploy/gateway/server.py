"""Serving a gateway: the listening socket, uvicorn, the ready file, and the process entry
point (`python -m releasekit.deploy.gateway --config FILE.json`)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from releasekit.deploy.gateway.app import Gateway
from releasekit.deploy.gateway.config import GatewayConfig, GatewayEndpoint, load_config
from releasekit.deploy.gateway.errors import GatewayError, GatewayStartError
from releasekit.deploy.gateway.limits import guarded_http_protocol

if TYPE_CHECKING:
    import uvicorn


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket on host:port (0: the OS picks); GatewayStartError if
    the address is taken or not ours."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise GatewayStartError(f"gateway cannot listen on {host}:{port}: {exc}") from exc
    sock.set_inheritable(True)
    return sock


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temporary file and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def uvicorn_server(
    gw: Gateway,
    on_started: Callable[[], None] | None = None,
    on_stopped: Callable[[], None] | None = None,
) -> uvicorn.Server:
    """A uvicorn server for `gw` (its socket is passed to `run`), calling `on_started` once
    it listens and `on_stopped` after shutdown."""
    import uvicorn

    class _Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            if self.started and on_started is not None:
                on_started()

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            try:
                await super().shutdown(sockets=sockets)
            finally:
                if on_stopped is not None:
                    on_stopped()

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            super().handle_exit(sig, frame)
            # uvicorn re-raises a captured SIGTERM after shutdown (exit status -15); for the
            # gateway a signalled stop is the normal, clean one: exit 0 once cleaned up.
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list):
                captured.clear()

    c = gw.config
    # Header limits live in the protocol: httptools buffers header bytes without a limit, so
    # the guarded protocol counts them and times the header block; h11 (without httptools)
    # enforces the size itself.
    guarded = guarded_http_protocol(
        max_header_bytes=c.max_header_bytes,
        header_timeout_s=c.header_timeout_s,
        max_header_count=c.max_header_count,
    )
    cfg = uvicorn.Config(
        gw.app(),
        loop="auto",
        http=guarded if guarded is not None else "h11",
        h11_max_incomplete_event_size=c.max_header_bytes,
        lifespan="on",
        access_log=False,
        log_level=gw.config.log_level,
        server_header=False,
        date_header=False,
        proxy_headers=False,  # never trust X-Forwarded-* from clients; one less layer per call
        timeout_graceful_shutdown=int(gw.config.shutdown_timeout_s) or None,
        timeout_keep_alive=30,
        backlog=max(2048, gw.config.max_in_flight * 2),
    )
    return _Server(cfg)


def endpoint_of(gw: Gateway, sock: socket.socket) -> GatewayEndpoint:
    """The ready-file contents for a gateway listening on `sock`."""
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    return GatewayEndpoint(
        env=gw.config.env,
        url=f"http://{shown}:{port}",
        host=host,
        port=port,
        pid=os.getpid(),
        started_at=gw.started_at,
    )


def serve(config: GatewayConfig) -> None:
    """Run a gateway in this process until SIGTERM/SIGINT (graceful: in-flight requests get
    `shutdown_timeout_s` to finish). Writes `ready_file` once listening, removes it on exit.

    Raises GatewayStartError if the address cannot be bound.
    """
    gw = Gateway(config)
    sock = bind_socket(config.host, config.port)
    ready = Path(config.ready_file) if config.ready_file else None
    endpoint = endpoint_of(gw, sock)

    def on_started() -> None:
        if ready is not None:
            write_atomic(ready, endpoint.model_dump_json().encode())

    def on_stopped() -> None:
        if ready is not None:
            with contextlib.suppress(OSError, ValueError):
                if GatewayEndpoint.model_validate_json(ready.read_bytes()).pid == os.getpid():
                    ready.unlink()

    server = uvicorn_server(gw, on_started, on_stopped)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        on_stopped()
    if not server.started:
        raise GatewayStartError(f"gateway for {config.env} did not start (see its log)")


class ThreadedGateway:
    """A gateway served by uvicorn in a background thread of this process (tests,
    benchmarks, embedding): `with ThreadedGateway(config) as tg: tg.url`."""

    def __init__(self, config: GatewayConfig, *, start_timeout_s: float = 10.0) -> None:
        self.gateway = Gateway(config)
        self.start_timeout_s = start_timeout_s
        self._sock = bind_socket(config.host, config.port)
        self.endpoint = endpoint_of(self.gateway, self._sock)
        self._server = uvicorn_server(self.gateway)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    @property
    def url(self) -> str:
        """http://host:port of the gateway."""
        return self.endpoint.url

    def start(self) -> ThreadedGateway:
        """Start serving; GatewayStartError if it is not up within start_timeout_s."""
        self._thread.start()
        deadline = time.monotonic() + self.start_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise GatewayStartError("threaded gateway did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Graceful stop (in-flight requests get shutdown_timeout_s), then join."""
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=self.gateway.config.shutdown_timeout_s + 10)
        self._sock.close()

    def __enter__(self) -> ThreadedGateway:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def running(config: GatewayConfig) -> Iterator[ThreadedGateway]:
    """`with running(config) as tg:` a started ThreadedGateway, stopped on exit."""
    tg = ThreadedGateway(config).start()
    try:
        yield tg
    finally:
        tg.stop()


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m releasekit.deploy.gateway --config FILE.json`; exit 0 after a clean stop,
    2 on a bad config or an address that cannot be bound."""
    parser = argparse.ArgumentParser(
        prog="python -m releasekit.deploy.gateway",
        description="Serve one environment's gateway (config written by the deployer).",
    )
    parser.add_argument("--config", required=True, type=Path, help="GatewayConfig JSON file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    try:
        config = load_config(args.config)
        logging.getLogger("releasekit.gateway").setLevel(config.log_level.upper())
        serve(config)
    except GatewayError as exc:
        print(f"error: {exc}" + (f" ({exc.remedy})" if exc.remedy else ""), file=sys.stderr)
        return 2
    return 0
