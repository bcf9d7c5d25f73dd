"""The checks a client request passes before it is admitted: its key, its rate, the path
allowlist, the body's size and its JSON; each refusal counted and answered OpenAI-style."""

from __future__ import annotations

import hashlib
import hmac
import math
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from releasekit.deploy.gateway.config import GatewayConfig
from releasekit.deploy.gateway.limits import JsonBodyError, TokenBuckets, client_address, parse_json
from releasekit.deploy.gateway.limits import read_body as _read_body
from releasekit.deploy.gateway.metrics import Metrics
from releasekit.deploy.gateway.relay import ADMIN_HEADER
from releasekit.deploy.gateway.responses import error_response
from releasekit.deploy.gateway.routing import UPSTREAM_ROUTES


def bearer_token(request: Request) -> bytes | None:
    """The token of an `Authorization: Bearer ...` header, or None."""
    h = request.headers.get("authorization")
    if h is None or len(h) < 8 or h[:7].lower() != "bearer ":
        return None
    return h[7:].strip().encode()


class ClientChecks:
    """A gateway's checks on client requests (its API keys, rate limits and size limits);
    every refusal is counted under its reason in `metrics`."""

    def __init__(self, config: GatewayConfig, metrics: Metrics) -> None:
        self.config = config
        self.metrics = metrics
        self._buckets = TokenBuckets(config.rate_limit) if config.rate_limit else None
        self._auth_failures = TokenBuckets(config.auth_failure_limit)
        self._api_keys = [k.encode() for k in config.api_keys]
        self._admin_token = config.admin_token.encode()

    @property
    def checks_keys(self) -> bool:
        """Whether clients must present one of the gateway's API keys."""
        return bool(self._api_keys)

    def client_denied(self, request: Request) -> tuple[Response | None, str]:
        """Auth, then the per-key token bucket: (None, client) when the request may proceed,
        else (the answer, client). `client` names the caller without holding its key: a
        digest of the key, or the client's address when the gateway has no keys."""
        address = client_address(request)
        if self._api_keys:
            if self._auth_failures.wait(address) > 0:
                # Too many wrong keys from this address: refuse without checking this one,
                # so a guess cannot be confirmed while throttled.
                return self._too_many(self._auth_failures.wait(address), "auth"), address
            token = bearer_token(request)
            ok = False
            if token is not None:
                for k in self._api_keys:  # no early exit: time does not tell which key
                    ok |= hmac.compare_digest(token, k)
            if not ok:
                self._auth_failures.take(address)
                answer = self.reject(
                    "auth",
                    401,
                    "missing API key" if token is None else "incorrect API key provided",
                    type_="invalid_request_error",
                    code="invalid_api_key",
                    headers={"www-authenticate": "Bearer"},
                )
                return answer, address
            client = "key:" + hashlib.blake2b(token or b"", digest_size=12).hexdigest()
        else:
            client = address
        if self._buckets is not None:
            wait = self._buckets.take(client)
            if wait > 0:
                return self._too_many(wait, "rate_limit"), client
        return None, client

    def reject(
        self,
        reason: str,
        status: int,
        message: str,
        *,
        type_: str,
        code: str | int,
        headers: dict[str, str] | None = None,
    ) -> Response:
        """Count a refused request under `reason` and build its OpenAI-style error answer."""
        self.metrics.reject(reason)
        return error_response(status, message, type_=type_, code=code, headers=headers)

    def _too_many(self, wait: float, why: str) -> Response:
        return self.reject(
            why,
            429,
            "too many failed authentications" if why == "auth" else "rate limit exceeded",
            type_="rate_limit_error",
            code="rate_limit_exceeded",
            headers={"retry-after": str(max(1, math.ceil(wait)))},
        )

    async def read_body(self, request: Request) -> bytes | Response:
        """The request body (counted as it streams), or the 413 answer past the limit."""
        limit = self.config.max_request_bytes
        body = await _read_body(request, limit)
        if body is not None:
            return body
        # Close the connection: the rest of an oversize body is not worth reading.
        return self.reject(
            "bad_request",
            413,
            f"request body over {limit} bytes",
            type_="invalid_request_error",
            code="too_large",
            headers={"connection": "close"},
        )

    def json(self, body: bytes) -> Any:
        """A request body parsed (None when empty), or the 400 answer."""
        if not body:
            return None
        try:
            return parse_json(body, self.config.max_json_depth)
        except JsonBodyError as exc:
            return self.reject(
                "bad_request", 400, str(exc), type_="invalid_request_error", code="invalid_json"
            )

    def refuse_path(self, request: Request) -> Response | None:
        """404 for a path outside the allowlist (or spelled with escapes or dot segments),
        405 for a method the route does not take; None when it may go upstream."""
        scope = request.scope
        path: str = scope["path"]
        raw = scope.get("raw_path")
        methods = UPSTREAM_ROUTES.get(path)
        if methods is None or (raw is not None and raw != path.encode("latin-1")):
            return self.reject(
                "bad_request",
                404,
                f"unknown route {path[:200]!r}",
                type_="invalid_request_error",
                code="unknown_route",
            )
        if request.method not in methods:
            return self.reject(
                "bad_request",
                405,
                f"{request.method} is not allowed on {path}",
                type_="invalid_request_error",
                code="method_not_allowed",
                headers={"allow": ", ".join(methods)},
            )
        return None

    def reveals_release(self, request: Request) -> bool:
        """Whether the answer names the release that served it: always with
        `release_header`, else only for a request carrying the admin token in
        x-releasekit-admin (the deployer's smoke checks)."""
        if self.config.release_header:
            return True
        given = request.headers.get(ADMIN_HEADER)
        return given is not None and hmac.compare_digest(given.encode(), self._admin_token)

    async def checked(
        self, request: Request, *, check_path: bool
    ) -> Response | tuple[str, bytes, Any]:
        """The checks every inference request passes before it is forwarded: the client's
        key and rate, (for plain routes) the path allowlist, the body's size and its JSON.
        A Response when one refuses it, else (client, body, payload)."""
        denied, client = self.client_denied(request)
        if denied:
            return denied
        if check_path:
            refused = self.refuse_path(request)
            if refused:
                return refused
        body = await self.read_body(request)
        if isinstance(body, Response):
            return body
        payload = self.json(body)
        if isinstance(payload, Response):
            return payload
        return client, body, payload
