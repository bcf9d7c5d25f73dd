"""Prompt templates: `{{ name }}` placeholders (MLflow prompt-registry syntax), rendering and
the chat messages a release sends."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from releasekit.errors import InputMissingError, PromptError

_VAR = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


def placeholders(template: str) -> set[str]:
    """Names of the `{{ name }}` placeholders in a template."""
    return set(_VAR.findall(template))


def render(template: str, variables: Mapping[str, str], *, strict: bool = False) -> str:
    """Fill the placeholders named in `variables`; others stay unless `strict`, when a
    placeholder without a value raises PromptError."""

    def sub(m: re.Match[str]) -> str:
        name = m.group(1)
        if name in variables:
            return str(variables[name])
        if strict:
            raise PromptError(f"prompt placeholder '{{{{ {name} }}}}' has no value")
        return m.group(0)

    return _VAR.sub(sub, template)


def read_template(path: Path) -> str:
    """Read a prompt file (UTF-8), raising InputMissingError if absent.

    The file's final line break is an editor convention, not part of the prompt: exactly
    one trailing newline is dropped, so `Answer:` is sent as written, not `Answer:\n`.
    """
    if not path.is_file():
        raise InputMissingError(path, what="prompt file")
    text = path.read_text(encoding="utf-8")
    for ending in ("\r\n", "\n"):
        if text.endswith(ending):
            return text[: -len(ending)]
    return text


class ChatPrompt:
    """The release's system and user templates with manifest-level variables bound."""

    def __init__(self, system: str | None, user: str) -> None:
        self.system = system
        self.user = user

    def messages(self, variables: Mapping[str, str]) -> list[dict[str, str]]:
        """Chat messages for one request (item variables bound strictly)."""
        msgs = []
        if self.system is not None:
            msgs.append({"role": "system", "content": render(self.system, variables, strict=True)})
        msgs.append({"role": "user", "content": render(self.user, variables, strict=True)})
        return msgs
