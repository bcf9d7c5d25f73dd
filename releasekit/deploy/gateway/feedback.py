"""Feedback on responses: the bounded memory of recent response ids and `POST /v1/feedback`."""

from __future__ import annotations

import hmac
import math
from collections import OrderedDict
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response

from releasekit.deploy.gateway.checks import ClientChecks
from releasekit.deploy.gateway.config import Feedback, validation_problems
from releasekit.deploy.gateway.limits import TokenBuckets
from releasekit.deploy.gateway.responses import error_response, json_response


class FeedbackBook:
    """Recent successful response ids -> (release, counted yet, client), in an LRU of
    `capacity`; counts one score per response, from the client it served, and at most
    `feedback_limit` posts per client (a bucket: one client cannot vote in bulk). A post
    passes the same client checks (`checks`) as any client request."""

    def __init__(self, checks: ClientChecks, capacity: int) -> None:
        self.checks = checks
        self.metrics = checks.metrics
        self.capacity = capacity
        self._seen: OrderedDict[str, list[Any]] = OrderedDict()
        self._limit = TokenBuckets(checks.config.feedback_limit)

    def remember(self, response_id: str, release_id: str, client: str) -> None:
        """Note that `release_id` served `response_id` to `client`."""
        r = self._seen
        r[response_id] = [release_id, False, client]
        if len(r) > self.capacity:
            r.popitem(last=False)

    async def endpoint(self, request: Request) -> Response:
        """POST /v1/feedback."""
        denied, client = self.checks.client_denied(request)
        if denied:
            return denied
        wait = self._limit.take(client)
        if wait > 0:
            self.metrics.reject("feedback_limit")
            return error_response(
                429,
                "too much feedback from this client",
                type_="rate_limit_error",
                code="feedback_limit",
                headers={"retry-after": str(max(1, math.ceil(wait)))},
            )
        body = await self.checks.read_body(request)
        if isinstance(body, Response):
            return body
        try:
            fb = Feedback.model_validate_json(body)
        except ValidationError as exc:
            return error_response(
                400,
                "invalid feedback: " + "; ".join(validation_problems(exc)),
                type_="invalid_request_error",
                code="bad_feedback",
            )
        if isinstance(fb.score, str):
            score = 1.0 if fb.score == "up" else -1.0
        else:
            score = float(fb.score)
        if not -1.0 <= score <= 1.0:
            return error_response(
                400,
                f"invalid feedback: score {score:g} is outside [-1, 1]",
                type_="invalid_request_error",
                code="bad_feedback",
            )
        seen = self._seen.get(fb.response_id)
        # Another client's response answers exactly like an unknown one: ids are not a
        # way to learn what others asked, nor to vote on their answers.
        if seen is None or not hmac.compare_digest(seen[2], client):
            return error_response(
                404,
                f"unknown response id {fb.response_id!r} (or too old)",
                type_="invalid_request_error",
                code="unknown_response",
            )
        release_id, already, _ = seen
        label = "positive" if score > 0 else "negative" if score < 0 else "neutral"
        if not already:
            seen[1] = True
            self.metrics.feedback.labels(self.metrics.env, release_id, label).inc()
        return json_response(
            {
                "response_id": fb.response_id,
                "release_id": release_id,
                "score": score,
                "label": label,
                "counted": not already,
            }
        )
