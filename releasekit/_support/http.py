"""One TLS context for every HTTP client releasekit makes.

httpx builds a fresh TLS context for each client it creates, loading the whole CA bundle:
about 50 ms of CPU, paid by every health poll, readiness probe, watch scrape and evaluation
run, nearly all of which talk plain HTTP on loopback. `tls()` builds that same context once
per process (`httpx.create_ssl_context()`: certifi's bundle, or SSL_CERT_FILE /
SSL_CERT_DIR when set) and every client is given it as `verify=tls()`.
"""

from __future__ import annotations

import functools
import ssl

import httpx


@functools.cache
def tls() -> ssl.SSLContext:
    """The process's TLS context for HTTP clients (certificates verified as httpx does)."""
    return httpx.create_ssl_context()
