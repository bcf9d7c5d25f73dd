"""One TLS context for every HTTP client releasekit makes.

httpx builds a fresh TLS context for each client it creates, loading the whole CA bundle:
about 50 ms of CPU, paid by every health poll, readiness probe, watch scrape and evaluation
run, nearly all of which talk plain HTTP on loopback. `tls()` builds that same context once
per process (`httpx.create_ssl_context()`: certifi's bundle, or SSL_CERT_FILE /
SSL_CERT_DIR when set), and releasekit makes every client with `http_client(...)` or
`async_http_client(...)`, which give it as `verify=` (tests/architecture checks that no module
builds an httpx client itself).
"""

from __future__ import annotations

import functools
import ssl
from typing import Any

import httpx


@functools.cache
def tls() -> ssl.SSLContext:
    """The process's TLS context for HTTP clients (certificates verified as httpx does)."""
    return httpx.create_ssl_context()


def http_client(*, local_address: str | None = None, **kwargs: Any) -> httpx.Client:
    """`httpx.Client(**kwargs)` with the process's TLS context (unless `verify` is given);
    with `local_address`, its connections leave from that address (a client of its own)."""
    kwargs.setdefault("verify", tls())
    if local_address is not None:
        kwargs["transport"] = httpx.HTTPTransport(
            local_address=local_address, verify=kwargs["verify"]
        )
    return httpx.Client(**kwargs)


def async_http_client(**kwargs: Any) -> httpx.AsyncClient:
    """`httpx.AsyncClient(**kwargs)` with the process's TLS context (unless `verify` is given)."""
    kwargs.setdefault("verify", tls())
    return httpx.AsyncClient(**kwargs)
