"""Prompt templates on the gateway: a route's templates rendered into chat messages, literally
(the project's renderer: `{{ name }}` placeholders, no Jinja, no format strings)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from releasekit.deploy.gateway.config import Route
from releasekit.deploy.gateway.errors import PromptTemplateError
from releasekit.deploy.gateway.models import engine_payload
from releasekit.deploy.gateway.responses import json_bytes

# The project's prompt renderer, imported in this one place (it moved from releasekit.prompts
# to releasekit.spec.prompts with the package reshape).
from releasekit.spec.prompts import placeholders as _placeholders
from releasekit.spec.prompts import render as _render


def render_prompt(route: Route, prompt: str, variables: Mapping[str, str]) -> list[dict[str, str]]:
    """The chat messages a route's template `prompt` renders to with `variables`.

    Raises PromptTemplateError naming an unknown prompt (with the known ones) or every
    missing variable.
    """
    tpl = route.prompts.get(prompt)
    if tpl is None:
        known = ", ".join(sorted(route.prompts)) or "none"
        raise PromptTemplateError(
            f"unknown prompt {prompt!r} for release {route.release_id} (known: {known})"
        )
    needed = _placeholders(tpl.user) | (_placeholders(tpl.system) if tpl.system else set())
    missing = sorted(needed - variables.keys())
    if missing:
        raise PromptTemplateError(
            f"prompt {prompt!r} needs variable(s) {', '.join(missing)} (release {route.release_id})"
        )
    msgs = []
    if tpl.system is not None:
        msgs.append({"role": "system", "content": _render(tpl.system, variables, strict=True)})
    msgs.append({"role": "user", "content": _render(tpl.user, variables, strict=True)})
    return msgs


def templated_body(route: Route, prompt: str, payload: Any) -> bytes:
    """The upstream chat-completions body of a templated request (`payload`, its parsed
    JSON body): `variables` rendered by the route's template `prompt` into `messages`,
    `model` defaulting to the route's (an adapter's model name mapped to the engine's).
    `payload` itself is never changed (the body is built
    from a copy), so one parsed request can be rendered for two routes (a mirror's copy).

    Raises PromptTemplateError for a body that is not a JSON object, sets `messages`, has
    `variables` that are not strings or numbers, or misses what the template needs.
    """
    if not isinstance(payload, dict):
        raise PromptTemplateError("body must be a JSON object")
    if "messages" in payload:
        raise PromptTemplateError(
            "a templated request must not set 'messages': the template renders them"
        )
    payload = dict(payload)
    variables = payload.pop("variables", {})
    if not isinstance(variables, dict) or not all(
        isinstance(v, str | int | float) and not isinstance(v, bool) for v in variables.values()
    ):
        raise PromptTemplateError("'variables' must be an object of strings or numbers")
    payload["messages"] = render_prompt(
        route, prompt, {str(k): str(v) for k, v in variables.items()}
    )
    if "model" not in payload and route.model is not None:
        payload["model"] = route.model
    return json_bytes(engine_payload(route, payload))
