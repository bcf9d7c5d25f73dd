"""The LoRA adapters one deploy loads into a running engine, and their unloading again when
that deploy fails part-way.

A release that differs from the live one only in its adapters reuses the running engine: its
adapters are loaded there before the route moves (`DeployLoads.load`). When the deploy
then fails (an adapter after the first is refused, the preview smoke fails, a canary aborts,
the route is switched back), `DeployLoads.unload` takes out again the versions this deploy
loaded and no route, fallback or running mirror of the environment names, best effort, and
says so in words for the failure's detail. Until the route names them they are listed on the
server's warm list (`ServerRecord.adapters_warm`) for the environment's warm window, so a
deploy that dies half-way leaves them to the expirer, and an unload the engine does not do
stays there, due at once, for the expirer to try again.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

from releasekit.deploy.state import ServerRecord, StateHandle
from releasekit.deploy.target import ReleaseSpec, Upstream
from releasekit.deploy.warm_adapters import drain_unrouted, named_adapters
from releasekit.errors import AdapterLoadError, ReleasekitError
from releasekit.serving.adapters import loaded_adapters, unload_adapter

Loader = Callable[[Upstream, ReleaseSpec], list[str]]
"""Loads a release's adapters the engine behind an upstream lacks; the engine names it loaded
(an AdapterLoadError when the engine refuses one or cannot be reached)."""


class DeployLoads:
    """What one deploy loaded into running engines (engine names per server URL), kept in
    the environment's state (`handle`, whose lock the deploy holds) while the route does not
    name them: `load` loads and lists them, `unload` takes out the ones nothing names."""

    def __init__(
        self,
        handle: StateHandle,
        *,
        hold_s: float,
        drain_s: float,
        after: Callable[[], None] | None = None,
    ) -> None:
        self.handle = handle
        self.hold_s = hold_s
        self.drain_s = drain_s
        self.after = after
        self.loaded: dict[str, list[str]] = {}
        self.said = ""  # what every `unload` of this deploy said, for a later report
        self._keys: dict[str, str | None] = {}

    def _server(self, base_url: str) -> ServerRecord | None:
        return next((s for s in self.handle.state.servers if s.base_url == base_url), None)

    def _track(self, upstream: Upstream, names: list[str], *, until: float) -> None:
        self.loaded.setdefault(upstream.base_url, []).extend(names)
        self._keys[upstream.base_url] = upstream.api_key
        server = self._server(upstream.base_url)
        if server is not None:
            for name in names:
                server.adapters_warm[name] = max(until, server.adapters_warm.get(name, until))
        self.handle.save()

    def load(
        self, upstream: Upstream, spec: ReleaseSpec, loader: Loader, *, now: float | None = None
    ) -> list[str]:
        """Load `spec`'s adapters with `loader`, remembering the versions it loaded: listed
        as warm for `hold_s` (the route that names them takes them off the list). When the
        engine refuses one after loading others, those are unloaded again and the error
        says so."""
        t = time.time() if now is None else now
        try:
            before: set[str] | None = set(
                loaded_adapters(upstream.base_url, api_key=upstream.api_key)
            )
        except ReleasekitError:
            before = None  # the load below fails the same way
        try:
            names = loader(upstream, spec)
        except AdapterLoadError as exc:
            partial = self._loaded_since(upstream, spec, before)
            if not partial:
                raise
            self._track(upstream, partial, until=t + self.hold_s)
            said = self.unload(now=t)
            raise AdapterLoadError(exc.message.splitlines()[0] + said) from exc
        self._track(upstream, names, until=t + self.hold_s)
        return names

    @staticmethod
    def _loaded_since(upstream: Upstream, spec: ReleaseSpec, before: set[str] | None) -> list[str]:
        """Which of `spec`'s adapters the engine holds now and did not before (a load that
        failed part-way), best effort."""
        if before is None:
            return []
        try:
            now_held = loaded_adapters(upstream.base_url, api_key=upstream.api_key)
        except ReleasekitError:
            return []
        return [n for n in spec.adapters.values() if n in now_held and n not in before]

    @contextlib.contextmanager
    def unloaded_on_error(self) -> Iterator[None]:
        """Around a step that checks what was loaded (the preview smoke): when it raises,
        `unload` first."""
        try:
            yield
        except BaseException:
            self.unload()
            raise

    def unload(self, *, drain: bool = False, now: float | None = None) -> str:
        """Unload the versions this deploy loaded that no route, fallback or running mirror
        of the environment names now (after the gateway drained the releases it no longer
        routes, when `drain`), best effort: one unloaded leaves the warm list; one the engine
        did not unload stays on it, due now, for the expirer to try again. The words for a
        failure's detail, starting '; ' ('' when there was nothing to unload)."""
        t = time.time() if now is None else now
        st = self.handle.state
        todo: list[tuple[str, str]] = []
        for url, names in self.loaded.items():
            routed, mirrored = named_adapters(st, url, now=t)
            todo += [(url, n) for n in names if n not in routed and n not in mirrored]
        if not todo:
            return ""
        if drain:
            drain_unrouted(st, self.drain_s)
        done: list[str] = []
        left: list[str] = []
        for url, name in todo:
            self.loaded[url].remove(name)
            server = self._server(url)
            try:
                unload_adapter(url, name, api_key=self._keys.get(url))
            except ReleasekitError as exc:
                if server is not None:
                    server.adapters_warm[name] = t
                left.append(f"{name} ({exc.message.splitlines()[0]})")
                continue
            if server is not None:
                server.adapters_warm.pop(name, None)
            done.append(name)
        self.handle.save()
        said = ""
        if done:
            said += f"; the adapters this deploy loaded were unloaded again: {', '.join(done)}"
        if left:
            said += f"; still loaded, the unload is tried again by the expiry: {', '.join(left)}"
            if self.after is not None:
                self.after()
        self.said += said
        return said
