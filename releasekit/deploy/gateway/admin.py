"""The gateway's admin API (`/admin/*`): state, the route table (with its lease), drain."""

from __future__ import annotations

import hmac
from typing import Protocol, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from releasekit.deploy.gateway.checks import bearer_token
from releasekit.deploy.gateway.config import (
    DrainRequest,
    DrainResult,
    GatewayState,
    LeaseRenewal,
    RouteTable,
    validation_problems,
)
from releasekit.deploy.gateway.errors import GatewayRequestError
from releasekit.deploy.gateway.pairs import MirrorPairs
from releasekit.deploy.gateway.responses import error_response, json_response

__all__ = ["PAIRS_LIMIT", "AdminAPI", "GatewayControl", "admin_body", "bearer_token"]

_Body = TypeVar("_Body", bound=BaseModel)

PAIRS_LIMIT = 2000
"""Answer pairs one `GET /admin/mirror/pairs` answers at most."""


async def admin_body(
    request: Request, model: type[_Body], *, what: str, code: str
) -> _Body | Response:
    """An admin request's JSON body as `model`, or the 422 answer listing every problem."""
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as exc:
        problems = validation_problems(exc)
        return error_response(
            422,
            f"invalid {what}: " + "; ".join(problems),
            type_="invalid_request_error",
            code=code,
            extra={"problems": problems},
        )


class GatewayControl(Protocol):
    """What the admin API drives: the gateway's state, its route table and lease, drains
    and the mirror's answer pairs."""

    def state(self) -> GatewayState:
        """Routes, in-flight and served counts now."""
        ...

    def set_routes(self, table: RouteTable) -> GatewayState:
        """Swap the route table; answers the new state."""
        ...

    def renew_lease(self, generation: int) -> bool:
        """Extend the leased table of `generation`; False when it is not in force."""
        ...

    async def drain(self, release_id: str, timeout_s: float) -> DrainResult:
        """Wait until `release_id` has nothing in flight (GatewayRequestError: still routed)."""
        ...

    def mirror_pairs(self, since: int, limit: int) -> MirrorPairs:
        """The mirror's answer pairs held with seq > `since`."""
        ...


class AdminAPI:
    """The admin endpoints of one gateway, guarded by its admin token (never a client key)."""

    def __init__(self, control: GatewayControl, admin_token: str) -> None:
        self.gw = control
        self._token = admin_token.encode()

    def denied(self, request: Request) -> Response | None:
        """None when the request carries the admin token, else the 401 answer."""
        token = bearer_token(request)
        if token is not None and hmac.compare_digest(token, self._token):
            return None
        return error_response(
            401,
            "admin token missing or wrong",
            type_="invalid_request_error",
            code="invalid_admin_token",
            headers={"www-authenticate": "Bearer"},
        )

    async def state(self, request: Request) -> Response:
        """GET /admin/state."""
        return self.denied(request) or json_response(self.gw.state())

    async def routes(self, request: Request) -> Response:
        """PUT /admin/routes: swap the table (a leased one reverts unless renewed)."""
        denied = self.denied(request)
        if denied:
            return denied
        table = await admin_body(request, RouteTable, what="route table", code="invalid_routes")
        if isinstance(table, Response):
            return table
        return json_response(self.gw.set_routes(table))

    async def lease(self, request: Request) -> Response:
        """POST /admin/lease: renew the leased table of `generation`; 409 when that table
        is no longer the gateway's (it expired and reverted, or another table replaced it)."""
        denied = self.denied(request)
        if denied:
            return denied
        req = await admin_body(request, LeaseRenewal, what="lease renewal", code="invalid_lease")
        if isinstance(req, Response):
            return req
        if not self.gw.renew_lease(req.generation):
            return error_response(
                409,
                f"no lease on table generation {req.generation} (it expired or was replaced)",
                type_="invalid_request_error",
                code="lease_gone",
            )
        return json_response(self.gw.state())

    async def drain(self, request: Request) -> Response:
        """POST /admin/drain."""
        denied = self.denied(request)
        if denied:
            return denied
        req = await admin_body(request, DrainRequest, what="drain request", code="invalid_drain")
        if isinstance(req, Response):
            return req
        try:
            return json_response(await self.gw.drain(req.release_id, req.timeout_s))
        except GatewayRequestError as exc:
            return error_response(
                exc.status, exc.message, type_="invalid_request_error", code="routed"
            )

    async def mirror_pairs(self, request: Request) -> Response:
        """GET /admin/mirror/pairs?since=SEQ&limit=N: the mirror's answer pairs held with
        seq > SEQ, oldest first (at most N, default and cap 2,000)."""
        denied = self.denied(request)
        if denied:
            return denied
        try:
            since = int(request.query_params.get("since", "0"))
            limit = int(request.query_params.get("limit", str(PAIRS_LIMIT)))
        except ValueError:
            return error_response(
                422,
                "since and limit must be integers",
                type_="invalid_request_error",
                code="invalid_query",
            )
        return json_response(self.gw.mirror_pairs(since, max(0, min(limit, PAIRS_LIMIT))))
