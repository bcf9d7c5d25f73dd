"""Every HTTP client releasekit makes shares the process's TLS context: modules build clients
with `releasekit._support.http.http_client` / `async_http_client`, never `httpx.Client(...)`
themselves (httpx would load the CA bundle again for each: about 50 ms of CPU per client).
The tests do the same, with `tests/webclient.py` for one-shot requests, so that the suite
measures and exercises the clients releasekit makes."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "releasekit"
TESTS = ROOT / "tests"
FACTORIES = {PKG / "_support" / "http.py", TESTS / "webclient.py"}
CONSTRUCTORS = {
    "Client", "AsyncClient", "HTTPTransport", "AsyncHTTPTransport",
    "get", "post", "put", "patch", "delete", "head", "options", "request", "stream",
}  # fmt: skip


def _direct_clients(source: str) -> list[str]:
    """`httpx.X(...)` calls of a client or transport constructor or a module-level request
    helper (each of which builds a TLS context) that give no `verify=`, as 'line: httpx.X'."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "httpx"
            and node.func.attr in CONSTRUCTORS
            and not any(k.arg == "verify" for k in node.keywords)
        ):
            out.append(f"{node.lineno}: httpx.{node.func.attr}")
    return out


def _found(root: Path) -> dict[str, list[str]]:
    return {
        str(path.relative_to(ROOT)): hits
        for path in sorted(root.rglob("*.py"))
        if path not in FACTORIES and (hits := _direct_clients(path.read_text(encoding="utf-8")))
    }


def test_no_module_builds_an_httpx_client_itself() -> None:
    found = _found(PKG)
    assert found == {}, f"use releasekit._support.http.http_client/async_http_client: {found}"


def test_no_test_builds_an_httpx_client_itself() -> None:
    found = _found(TESTS)
    assert found == {}, f"use http_client/async_http_client or tests/webclient.py: {found}"


def test_the_check_sees_a_direct_client() -> None:
    src = (
        "import httpx\nc = httpx.Client(timeout=3)\nr = httpx.get('http://x')\n"
        "ok = httpx.Timeout(3)\nt = httpx.HTTPTransport(retries=1)\n"
        "fine = httpx.HTTPTransport(verify=ctx)\n"
    )
    assert _direct_clients(src) == ["2: httpx.Client", "3: httpx.get", "5: httpx.HTTPTransport"]
