"""Raw HTTP/1.1 over a socket, for tests that send what no HTTP client would (a header
flood, a header block that never ends): the servers' own protocol limits answer them."""

from __future__ import annotations

import socket
import time


def _address(where: str | tuple[str, int]) -> tuple[str, int]:
    if isinstance(where, tuple):
        return where
    host, port = where.removeprefix("http://").rstrip("/").rsplit(":", 1)
    return host, int(port)


def raw_exchange(where: str | tuple[str, int], data: bytes, *, wait_s: float = 5.0) -> bytes:
    """Send `data` to the server at `where` (`http://host:port` or (host, port)) and read
    its answer: until it closes the connection, a response with a Content-Length is
    complete, or `wait_s` passes."""
    out = b""
    with socket.create_connection(_address(where), timeout=wait_s) as s:
        s.sendall(data)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                got = s.recv(65536)
            except (TimeoutError, ConnectionResetError):
                break
            if not got:
                break
            out += got
            head, sep, body = out.partition(b"\r\n\r\n")
            if sep and b"content-length: " in head.lower():
                n = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                if len(body) >= n:
                    break
    return out


def status_of(response: bytes) -> int:
    """The status code of a raw HTTP/1.1 response (0 when there is none)."""
    return int(response.split(b" ", 2)[1]) if response.startswith(b"HTTP/1.1 ") else 0
