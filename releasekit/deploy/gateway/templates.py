"""Prompt templates on the gateway: a route's templates rendered into chat messages, literally
(the project's renderer: `{{ name }}` placeholders, no Jinja, no format strings), for the
templated route and, where the release says so (`Route.plain_chat_prompt`), for a plain chat
request's own messages."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from releasekit.deploy.gateway.config import Route
from releasekit.deploy.gateway.errors import PromptTemplateError
from releasekit.deploy.gateway.models import engine_body, engine_payload
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


SYSTEM_ROLES = ("system", "developer")
"""Roles a client's own system message comes in."""


def plain_chat_messages(route: Route, messages: list[Any]) -> list[Any] | None:
    """A plain chat request's `messages` through the route's `plain_chat_prompt`: the last
    user message whose content is text (a string, or text parts only) fills the user
    template's one placeholder, and the system template goes first when no message has a
    system (or developer) role. None when the route takes plain requests as sent or no user
    message is text (the request then goes as sent). `messages` itself is never changed."""
    name = route.plain_chat_prompt
    tpl = route.prompts.get(name) if name is not None else None
    if tpl is None:
        return None
    users = [i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"]
    at = users[-1] if users else None
    text = _text_of(messages[at].get("content")) if at is not None else None
    if at is None or text is None:
        return None
    (var,) = _placeholders(tpl.user)
    out = list(messages)
    out[at] = {**messages[at], "content": _render(tpl.user, {var: text}, strict=True)}
    has_system = any(isinstance(m, dict) and m.get("role") in SYSTEM_ROLES for m in messages)
    if tpl.system is not None and not has_system:
        out.insert(0, {"role": "system", "content": tpl.system})
    return out


def _text_of(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        parts = [p.get("text") if isinstance(p, dict) and p.get("type") == "text" else None
                 for p in content]  # fmt: skip
        if all(isinstance(p, str) for p in parts):
            return "\n".join(str(p) for p in parts)
    return None


def plain_body(route: Route, body: bytes, payload: Any) -> bytes:
    """The body `route`'s upstream gets for a plain (untemplated) request: a chat request
    through the route's `plain_chat_prompt` where it has one (`plain_chat_messages`), an
    adapter's model name mapped to the engine's, else `body` untouched."""
    if isinstance(payload, dict) and isinstance(payload.get("messages"), list):
        messages = plain_chat_messages(route, payload["messages"])
        if messages is not None:
            return json_bytes(engine_payload(route, {**payload, "messages": messages}))
    return engine_body(route, body, payload)
