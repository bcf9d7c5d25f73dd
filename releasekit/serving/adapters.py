"""LoRA adapters on a running vLLM engine: load, unload and list them through its run-time
API (`/v1/load_lora_adapter`, started with VLLM_ALLOW_RUNTIME_LORA_UPDATING), with the
engine's refusals translated into AdapterLoadError."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import httpx

from releasekit._support.http import http_client
from releasekit.errors import AdapterLoadError, ServerUnreachableError

RUNTIME_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
"""What a server that loads adapters at run time needs in its environment."""


def _headers(api_key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {api_key}"} if api_key else {}


def _reason(r: httpx.Response) -> str:
    """The engine's reason for a refusal, on one line (its messages can span several)."""
    try:
        body = r.json()
    except ValueError:
        return " ".join(r.text.split())[:300] or f"HTTP {r.status_code}"
    err = body.get("error") if isinstance(body, dict) else None
    msg = err.get("message") if isinstance(err, dict) else None
    return " ".join(str(msg or body).split())[:300]


def loaded_adapters(
    base_url: str, *, api_key: str | None = None, timeout_s: float = 10.0
) -> dict[str, str]:
    """The adapters the engine at `base_url` holds: model name -> the path it loaded (its
    `/v1/models` entries that have a parent)."""
    try:
        with http_client(base_url=base_url, timeout=timeout_s, trust_env=False) as c:
            r = c.get("/v1/models", headers=_headers(api_key))
    except httpx.HTTPError as exc:
        raise ServerUnreachableError(f"{base_url}: {exc}") from exc
    if r.status_code != 200:
        raise AdapterLoadError(f"{base_url}/v1/models answered {r.status_code}: {_reason(r)}")
    try:
        data = r.json().get("data", [])
    except (ValueError, AttributeError) as exc:
        raise AdapterLoadError(f"{base_url}/v1/models did not answer JSON") from exc
    return {
        str(m["id"]): str(m.get("root", ""))
        for m in data
        if isinstance(m, dict) and m.get("parent") and "id" in m
    }


def load_adapter(
    base_url: str, name: str, path: Path, *, api_key: str | None = None, timeout_s: float = 60.0
) -> None:
    """Load the adapter folder `path` into the engine under model name `name`.
    AdapterLoadError (with the engine's reason) when it refuses: a rank above its
    max-lora-rank, a folder it cannot read, a name already taken."""
    body = {"lora_name": name, "lora_path": str(path)}
    try:
        with http_client(base_url=base_url, timeout=timeout_s, trust_env=False) as c:
            r = c.post("/v1/load_lora_adapter", json=body, headers=_headers(api_key))
    except httpx.HTTPError as exc:
        raise ServerUnreachableError(f"{base_url}: {exc}") from exc
    if r.status_code != 200:
        raise AdapterLoadError(
            f"the engine at {base_url} did not load adapter {name}: {_reason(r)}"
        )


def unload_adapter(
    base_url: str, name: str, *, api_key: str | None = None, timeout_s: float = 30.0
) -> None:
    """Unload adapter `name` from the engine; one it does not hold is not an error."""
    try:
        with http_client(base_url=base_url, timeout=timeout_s, trust_env=False) as c:
            r = c.post(
                "/v1/unload_lora_adapter", json={"lora_name": name}, headers=_headers(api_key)
            )
    except httpx.HTTPError as exc:
        raise ServerUnreachableError(f"{base_url}: {exc}") from exc
    if r.status_code != 200 and r.status_code != 404:
        raise AdapterLoadError(
            f"the engine at {base_url} did not unload adapter {name}: {_reason(r)}"
        )


def ensure_adapters(
    base_url: str,
    adapters: Mapping[str, Path],
    *,
    api_key: str | None = None,
    timeout_s: float = 60.0,
) -> list[str]:
    """Load each of `adapters` (model name -> folder) the engine does not hold yet under that
    name; return the names loaded now. One held under another path is unloaded first."""
    held = loaded_adapters(base_url, api_key=api_key)
    loaded: list[str] = []
    for name, path in adapters.items():
        if name in held and Path(held[name]) == Path(path):
            continue
        if name in held:
            unload_adapter(base_url, name, api_key=api_key)
        load_adapter(base_url, name, path, api_key=api_key, timeout_s=timeout_s)
        loaded.append(name)
    return loaded
