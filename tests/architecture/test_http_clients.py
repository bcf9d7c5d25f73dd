"""Every HTTP client releasekit makes shares the process's TLS context: modules build clients
with `releasekit._support.http.http_client` / `async_http_client`, never `httpx.Client(...)`
themselves (httpx would load the CA bundle again for each: about 50 ms of CPU per client)."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "releasekit"
FACTORY = PKG / "_support" / "http.py"
CONSTRUCTORS = {"Client", "AsyncClient", "get", "post", "put", "delete", "request", "stream"}


def _direct_clients(source: str) -> list[str]:
    """`httpx.X(...)` calls of a client constructor or a module-level request helper (each
    of which builds a client), as 'line: httpx.X'."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "httpx"
            and node.func.attr in CONSTRUCTORS
        ):
            out.append(f"{node.lineno}: httpx.{node.func.attr}")
    return out


def test_no_module_builds_an_httpx_client_itself() -> None:
    found = {
        str(path.relative_to(PKG.parent)): hits
        for path in sorted(PKG.rglob("*.py"))
        if path != FACTORY and (hits := _direct_clients(path.read_text(encoding="utf-8")))
    }
    assert found == {}, f"use releasekit._support.http.http_client/async_http_client: {found}"


def test_the_check_sees_a_direct_client() -> None:
    src = (
        "import httpx\nc = httpx.Client(timeout=3)\nr = httpx.get('http://x')\n"
        "ok = httpx.Timeout(3)\n"
    )
    assert _direct_clients(src) == ["2: httpx.Client", "3: httpx.get"]
