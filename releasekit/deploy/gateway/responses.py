"""OpenAI-style answers the gateway writes itself (errors and JSON bodies)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel
from starlette.responses import Response


def json_bytes(obj: Any) -> bytes:
    """Compact JSON bytes."""
    return json.dumps(obj, separators=(",", ":")).encode()


def error_response(
    status: int,
    message: str,
    *,
    type_: str,
    code: str | int,
    headers: Mapping[str, str] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Response:
    """An OpenAI-style error body: {"error": {"message", "type", "param", "code"}}."""
    err: dict[str, Any] = {"message": message, "type": type_, "param": None, "code": code}
    if extra:
        err.update(extra)
    return Response(
        json_bytes({"error": err}),
        status_code=status,
        media_type="application/json",
        headers=dict(headers or {}),
    )


def json_response(obj: BaseModel | dict[str, Any], status: int = 200) -> Response:
    """A JSON response of a model or a dict."""
    body = obj.model_dump_json().encode() if isinstance(obj, BaseModel) else json_bytes(obj)
    return Response(body, status_code=status, media_type="application/json")
