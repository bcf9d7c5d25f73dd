"""One vLLM server per engine across the releases of one `releasekit build`.

A release that cites its load test (`releasekit.bench.reuse`: the same engine, load profile
and served name as a registered release) needs a server of its engine only for what stays
its own: its suites, its adapters' sweeps, its memory. When the release built just before it
in the same `releasekit build` ran on that engine, its evidence stage takes the server that
release left running instead of starting vLLM again (about 30 s on 2 cores).

- `releasekit build` holds a folder (`kept_engines`) that its stages find in
  `ENGINES_ENV`. A stage that starts vLLM there stops every server kept before (one engine
  at a time: a load test never runs beside an idle server) and, when it succeeds, leaves its
  server in the folder, one JSON file named by its process group. A stage that fails stops
  its server.
- A stage takes a kept server only for a release that does not measure the main load test,
  and only when the server's serving key (weights, chat template, quantisation, engine
  arguments and environment: `serving_key`) and model folder are its release's. It unloads
  the adapters that are not its release's and loads its own, as a fresh server holds them.
- The server's log is kept beside the folder; each release's `server.log` is the part of it
  written while that release's stage used the server, after a line saying where the server
  came from.
- `releasekit build` stops every kept server when it ends, also on Ctrl-C. A folder whose
  build was killed is stopped by the next build.

A measurement is never taken on a kept server: a release that measures starts its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
from pydantic import BaseModel, Field, ValidationError

from releasekit._support.files import write_atomic
from releasekit._support.http import http_client
from releasekit._support.procs import group_alive, pid_alive, reap_registered, stop_groups
from releasekit.config import Settings
from releasekit.serving.adapters import ensure_adapters, loaded_adapters, unload_adapter
from releasekit.serving.vllm import AttachedServer

ENGINES_ENV = "RELEASEKIT_BUILD_ENGINES"
"""The folder where a build's stages leave and find running servers (set by `releasekit
build` for the stages DVC runs; unset, every stage starts and stops its own server)."""

_OWNER = "owner"  # the file naming the build process that holds the folder


class KeptEngine(BaseModel):
    """A running server a stage left for the next release of the build on its engine."""

    pid: int = Field(description="its process group")
    base_url: str
    serving_key: str
    model_dir: str
    served_name: str
    log_path: str = Field(description="the server's whole log (each release keeps its part)")
    loaded_bytes: int | None = Field(
        None, description="the memory its processes held once it had loaded, before any request"
    )
    started_for: str = Field(description="the release whose stage started it")


class EnginePool:
    """The folder of one build's kept servers."""

    def __init__(self, root: Path, *, grace_s: float = 10.0) -> None:
        self.root = root
        self.grace_s = grace_s

    @classmethod
    def from_env(cls, *, grace_s: float = 10.0) -> EnginePool | None:
        """The build's pool, when this stage runs under a `releasekit build` that keeps one."""
        raw = os.environ.get(ENGINES_ENV)
        return cls(Path(raw), grace_s=grace_s) if raw and Path(raw).is_dir() else None

    def log_path(self, release_id: str) -> Path:
        """Where a server started for `release_id` logs (its stage copies its part)."""
        return self.root / f"server-{release_id[:12]}.log"

    def _entries(self) -> list[tuple[Path, KeptEngine | None]]:
        out: list[tuple[Path, KeptEngine | None]] = []
        for f in sorted(self.root.iterdir()):
            if not f.name.isdigit():
                continue
            try:
                out.append((f, KeptEngine.model_validate_json(f.read_bytes())))
            except (OSError, ValidationError):
                out.append((f, None))
        return out

    def take(self, serving_key: str, model_dir: Path, api_key: str | None) -> KeptEngine | None:
        """The kept server of this engine if one answers (it stays in the folder, so the build
        stops it should this stage die); every other kept server is stopped."""
        found: KeptEngine | None = None
        for f, e in self._entries():
            if (
                found is None
                and e is not None
                and e.serving_key == serving_key
                and Path(e.model_dir) == model_dir
                and group_alive(e.pid)
                and _answers(e, model_dir, api_key)
            ):
                found = e
                continue
            _stop(f, self.grace_s)
        return found

    def clear(self) -> None:
        """Stop every kept server (a stage is about to start one of its own)."""
        reap_registered(self.root, grace_s=self.grace_s)

    def keep(self, engine: KeptEngine) -> None:
        """Leave `engine` running for the next release of the build."""
        write_atomic(self.root / str(engine.pid), engine.model_dump_json().encode())

    def drop(self, pid: int) -> None:
        """Stop the kept server `pid` (its stage failed)."""
        _stop(self.root / str(pid), self.grace_s)


def _answers(e: KeptEngine, model_dir: Path, api_key: str | None) -> bool:
    """Whether the kept server answers and serves the release's model folder under its
    served name (vLLM's /v1/models `root`), not just what its pool file says."""
    try:
        with http_client(base_url=e.base_url, timeout=5.0, trust_env=False) as c:
            r = c.get(
                "/v1/models", headers={"authorization": f"Bearer {api_key}"} if api_key else {}
            )
        models = r.json().get("data", []) if r.status_code == 200 else []
    except (httpx.HTTPError, ValueError, AttributeError):
        return False
    return any(
        isinstance(m, dict) and m.get("id") == e.served_name and m.get("root") == str(model_dir)
        for m in models
    )


def _stop(f: Path, grace_s: float) -> None:
    """Stop the server group named by pool file `f` and forget it."""
    stop_groups([int(f.name)], grace_s=grace_s)
    f.unlink(missing_ok=True)


def hold_adapters(server_url: str, adapters: dict[str, Path], api_key: str | None) -> None:
    """Make a kept server hold exactly a release's adapters, as a fresh one would: unload
    the others, then `ensure_adapters` (which also replaces one held from another folder)."""
    for name in loaded_adapters(server_url, api_key=api_key):
        if name not in adapters:
            unload_adapter(server_url, name, api_key=api_key)
    ensure_adapters(server_url, adapters, api_key=api_key)


def attach(e: KeptEngine, adapters: dict[str, Path]) -> AttachedServer:
    """A kept server, as the stage's server."""
    return AttachedServer(e.base_url, e.pid, adapters=adapters, log_path=Path(e.log_path))


def copy_log_part(source: Path, offset: int, dest: Path, header: str) -> None:
    """`dest`: `header`, then what `source` holds from byte `offset` on."""
    try:
        with source.open("rb") as fh:
            fh.seek(offset)
            body = fh.read()
    except OSError:
        body = b""
    write_atomic(dest, header.encode() + b"\n" + body)


@contextlib.contextmanager
def kept_engines(settings: Settings) -> Iterator[Path]:
    """A folder for one build's kept servers (`ENGINES_ENV`); every server in it is stopped
    when the block ends, however it ends. Folders left by a build that was killed are
    stopped first."""
    base = settings.state_dir / "build-engines"
    base.mkdir(parents=True, exist_ok=True)
    for old in base.iterdir():
        owner = _owner(old)
        if owner is None or not pid_alive(owner):
            if old.is_dir():
                reap_registered(old, grace_s=settings.server_stop_grace_s)
            shutil.rmtree(old, ignore_errors=True)
    root = base / str(os.getpid())
    root.mkdir(exist_ok=True)
    (root / _OWNER).write_text(json.dumps({"pid": os.getpid()}))
    try:
        yield root
    finally:
        reap_registered(root, grace_s=settings.server_stop_grace_s)
        shutil.rmtree(root, ignore_errors=True)


def _owner(folder: Path) -> int | None:
    try:
        return int(json.loads((folder / _OWNER).read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
