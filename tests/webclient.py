"""HTTP requests for tests, made as releasekit makes them: through the process's one TLS
context (`releasekit._support.http.tls`), not a new one per call. Clients come from
`releasekit._support.http.http_client` / `async_http_client`; these are the one-shot calls
(`httpx.get(...)` and the like, each of which would load the CA bundle again: about 50 ms of
CPU a call). tests/architecture checks that tests use them."""

from __future__ import annotations

from typing import Any

import httpx

from releasekit._support.http import tls


def get(url: str, **kwargs: Any) -> httpx.Response:
    """`httpx.get(url, **kwargs)` with the process's TLS context."""
    kwargs.setdefault("verify", tls())
    return httpx.get(url, **kwargs)


def post(url: str, **kwargs: Any) -> httpx.Response:
    """`httpx.post(url, **kwargs)` with the process's TLS context."""
    kwargs.setdefault("verify", tls())
    return httpx.post(url, **kwargs)


def put(url: str, **kwargs: Any) -> httpx.Response:
    """`httpx.put(url, **kwargs)` with the process's TLS context."""
    kwargs.setdefault("verify", tls())
    return httpx.put(url, **kwargs)
