"""Text helpers with no domain words: URL redaction and flattening nested data to dotted keys."""

from __future__ import annotations

import urllib.parse
from typing import Any


def redact_url(url: str) -> str:
    """A URL (database, tracking server) with any password replaced by ***, safe to print or
    store. SQLAlchemy URLs (`postgresql+psycopg://u:p@h/db`) and plain ones alike."""
    try:
        parts = urllib.parse.urlsplit(url)
        password = parts.password
    except ValueError:
        return url
    if password is None:
        return url
    host = parts.hostname or ""
    if parts.port:
        host += f":{parts.port}"
    netloc = f"{parts.username}:***@{host}" if parts.username else f"***@{host}"
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def flatten(obj: Any, prefix: str = "", *, as_text: bool = False) -> dict[str, Any]:
    """Nested dicts as one level of dotted keys: `{"a": {"b": 1}}` -> `{"a.b": 1}`.

    With `as_text`, lists are walked too (`a.0`, `a.1`), every leaf becomes a string (None is
    ""), and empty containers stay visible as "{}" / "[]": the form MLflow params need.
    Without it, lists and other values are leaves kept as they are.
    """
    out: dict[str, Any] = {}

    def walk(key: str, value: Any) -> None:
        if isinstance(value, dict):
            if not value and as_text:
                out[key] = "{}"
            for k, v in value.items():
                walk(f"{key}.{k}" if key else str(k), v)
        elif as_text and isinstance(value, list):
            if not value:
                out[key] = "[]"
            for i, v in enumerate(value):
                walk(f"{key}.{i}" if key else str(i), v)
        elif as_text:
            out[key] = "" if value is None else str(value)
        else:
            out[key] = value

    walk(prefix, obj)
    return out
