"""Shadow traffic: copies of admitted requests sent to a candidate whose answers never
reach a client (they are kept only as answer pairs, below).

A copy is made after the client's request was admitted (its rate-limit token and in-flight
slot are the original's, never the candidate's) and goes out on its own task: the client's
answer never waits for it. A templated copy renders the candidate's template from its own
deep copy of the parsed request, so the client's request is never changed by it. Copies in
flight are capped; one past the cap is dropped and counted, never queued. The candidate's
figures land in the gateway's per-release families under its own release id (requests by
status, TTFT, E2E), so a window over them reads like any release's;
`releasekit_gateway_mirrored_total{env,release,outcome}` counts `sent` and `dropped`
copies. With a `baseline` (a fresh server of the stable release under its own label), each
copy taken goes to the candidate and to the baseline at the same moment (both or neither,
within the same in-flight cap), so the candidate is judged against a server in its own
conditions; the baseline's answer is the pair's floor (below; without `Mirror.floor` it is
not kept).

Answer pairs: for each copy sent, the gateway keeps the text the live release answered the
client and the text the candidate answered (`MirrorPair`: non-stream JSON and SSE streams,
the choices' text or message/delta content concatenated, each capped at `TEXT_MAX`
characters), in a ring of the latest `Mirror.pairs` per mirror (`GET /admin/mirror/pairs`).
The client's answer is read as it passes (`PairedRelay` tees each chunk after it was sent:
no extra copy of the body, no wait added for the client; a capture that fails loses the
pair, never the client's answer). A pair holds no header and no key: the prompt text only
with `Mirror.keep_prompts` (the environment's `shadow_keep_prompts`), else the sha256
digest of the request body. A pair whose either side did not complete (an error status, a
cut stream, an unreadable body) is kept with `complete` false; one whose request samples
(no `temperature` of 0, or n > 1) with `sampled` true. With a `PairStore` (the
gateway's `pairs_dir`) each recorded pair is also appended to disk, off the event loop
(`pairstore`), and the numbering continues from the pairs stored there.

A canary's answers (`Mirror.purpose` `canary`): only the requests routed to `Mirror.source`
(the canary) are copied, to the live release's long-running server under its own label
(`pair_label`: `<stable>:pair`), so the copies' status, TTFT and E2E land in that label's
series, never in the live release's or a fresh baseline's that the canary is judged
against. The copy goes out after the client's request was pinned to the canary, on its
own task, within the same `max_in_flight` cap, as any shadow copy. In these pairs the
`candidate` side is always the release under judgement: the canary's answer (what the
client got, `client_side` "candidate"), and the `stable` side the copy's answer from the
live release; `stable_release_id` is the live release's id (not its label).

A/A (floor) copies (`Mirror.floor`, on by default): each copy taken also sends a second
copy of the request to the *reference* release at the same moment (all of a request's copies
or none, within `max_in_flight`), and its answer goes into the pair (`floor`), so the
candidate is judged against the reference's disagreement with itself. A shadow's reference
is the live release (the client's): its floor copy goes to the fresh `baseline` when there
is one (that copy IS the floor copy: no extra request), else to the server the client's
request was pinned to, under `pair_label(<live release>)`, so its figures never land in the
live release's series. A canary's and an after-promotion mirror's copy already goes to the
reference (`Mirror.route`): the floor copy is a second copy there, under the same label.
Each pair also names its client by digest (`client`: the key's, or the address's), never by
its key or address.

Adapter lanes (`Route.lane`): a mirror copies only the requests pinned to a route of its
route's own lane, so the base's shadow never sees a lane's adapter requests (nor a lane's
mirror the base's); those take none of its share and count as no drop.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import aiohttp
from starlette.types import Message, Receive, Scope, Send

from releasekit.deploy.gateway.config import (
    Mirror,
    MirrorPurpose,
    Route,
    pair_label,
    paired_release,
)
from releasekit.deploy.gateway.errors import PromptTemplateError
from releasekit.deploy.gateway.models import unknown_model
from releasekit.deploy.gateway.pairs import TEXT_MAX, MirrorPair, MirrorPairs, client_digest
from releasekit.deploy.gateway.relay import CONTENT_RE, Relay
from releasekit.deploy.gateway.templates import plain_body, templated_body

if TYPE_CHECKING:
    from releasekit.deploy.gateway.metrics import Metrics
    from releasekit.deploy.gateway.pairstore import PairStore

__all__ = [
    "RAW_MAX",
    "TEXT_MAX",
    "AnswerCapture",
    "MirrorPair",
    "MirrorPairs",
    "Mirroring",
    "PairBook",
    "PairedRelay",
    "PendingPair",
    "prompt_text",
    "sampled",
]

log = logging.getLogger("releasekit.gateway")

RAW_MAX = 256 * 1024
"""Bytes of a non-stream answer (or of one SSE line) read for its text at most."""


def _choice_text(obj: Any) -> str:
    """The text of an OpenAI answer or stream event: its choices' text or message/delta
    content, concatenated."""
    if not isinstance(obj, dict):
        return ""
    parts: list[str] = []
    choices = obj.get("choices")
    for c in choices if isinstance(choices, list) else ():
        if not isinstance(c, dict):
            continue
        t = c.get("text")
        if t is None:
            d = c.get("delta") or c.get("message")
            t = d.get("content") if isinstance(d, dict) else None
        if isinstance(t, str):
            parts.append(t)
    return "".join(parts)


class AnswerCapture:
    """The text of one answer, fed its body chunk by chunk: SSE events parsed line by line
    (nothing buffered past a line), a JSON body buffered up to RAW_MAX and parsed at the end."""

    __slots__ = ("_raw", "_rest", "broken", "done", "parts", "size", "sse", "truncated")

    def __init__(self, *, sse: bool) -> None:
        self.sse = sse
        self._rest = b""
        self._raw = bytearray()
        self.parts: list[str] = []
        self.size = 0
        self.truncated = False
        self.broken = False
        self.done = False  # an SSE stream's [DONE] was seen

    def feed(self, chunk: bytes) -> None:
        if self.broken or not chunk:
            return
        if not self.sse:
            if len(self._raw) + len(chunk) > RAW_MAX:
                self.broken = True
                self._raw = bytearray()
            else:
                self._raw += chunk
            return
        lines = (self._rest + chunk).split(b"\n")
        self._rest = lines.pop()
        if len(self._rest) > RAW_MAX:
            self.broken = True
            return
        for line in lines:
            self._line(line)

    def _line(self, line: bytes) -> None:
        line = line.strip()
        if not line.startswith(b"data:"):
            return
        data = line[5:].strip()
        if data == b"[DONE]":
            self.done = True
            return
        if self.size >= TEXT_MAX:
            self.truncated = True
            return
        try:
            self._add(_choice_text(json.loads(data)))
        except (ValueError, RecursionError):  # not an answer event (or nested past reading)
            return

    def _add(self, text: str) -> None:
        if text:
            self.parts.append(text)
            self.size += len(text)

    def finish(self) -> tuple[str | None, bool, bool]:
        """(the text or None when unreadable, whether it is whole, whether it was cut)."""
        if self.broken:
            return None, False, False
        if self.sse:
            if self._rest:
                self._line(self._rest)
                self._rest = b""
            whole = self.done
        else:
            try:
                self._add(_choice_text(json.loads(bytes(self._raw))))
            except (ValueError, RecursionError):
                return None, False, False
            whole = True
        text = "".join(self.parts)
        cut = self.truncated or len(text) > TEXT_MAX
        return text[:TEXT_MAX], whole, cut


def sampled(payload: Any) -> bool:
    """Whether a request asks for a sampled answer: no `temperature` of 0 (the server's
    default samples), or more than one choice."""
    if not isinstance(payload, dict):
        return True
    t = payload.get("temperature")
    greedy = isinstance(t, int | float) and not isinstance(t, bool) and t == 0
    return not greedy or payload.get("n", 1) not in (1, None)


def prompt_text(payload: Any) -> str:
    """The prompt of a request, as text: its messages' content (one line each), its
    `prompt`, or its template variables; capped at TEXT_MAX characters."""
    text = ""
    if isinstance(payload, dict):
        msgs = payload.get("messages")
        if isinstance(msgs, list):
            text = "\n".join(
                f"{m.get('role', '?')}: {m.get('content')}" for m in msgs if isinstance(m, dict)
            )
        elif "prompt" in payload:
            p = payload["prompt"]
            text = p if isinstance(p, str) else json.dumps(p)
        elif "variables" in payload:
            text = json.dumps(payload["variables"], sort_keys=True)
    return text[:TEXT_MAX]


class PendingPair:
    """A pair whose answers are on their way (the client's, the copy's and, with a floor
    copy, the floor's); recorded once all of them arrived."""

    __slots__ = (
        "book",
        "client",
        "digest",
        "floor_id",
        "path",
        "prompt",
        "sampled",
        "sides",
        "stable_id",
    )

    def __init__(
        self,
        book: PairBook,
        *,
        path: str,
        stable_id: str,
        digest: str,
        prompt: str | None,
        sampled: bool,
        client: str = "",
        floor_id: str | None = None,
    ) -> None:
        self.book = book
        self.sampled = sampled
        self.path = path
        self.stable_id = stable_id
        self.digest = digest
        self.prompt = prompt
        self.client = client
        self.floor_id = floor_id
        self.sides: dict[str, tuple[int | str, AnswerCapture | None]] = {}

    @property
    def expected(self) -> int:
        """The answers the pair waits for: 3 with a floor copy, else 2."""
        return 2 if self.floor_id is None else 3

    def answered(self, side: str, status: int | str, capture: AnswerCapture | None) -> None:
        """One side's answer ended (`client`: the answer the client got, `copy` or
        `floor`); the last records the pair."""
        if side in self.sides:
            return
        self.sides[side] = (status, capture)
        if len(self.sides) == self.expected:
            self.book.record(self)


class PairBook:
    """The latest answer pairs of one mirror (a ring: the oldest go first), each also
    handed to `store` (the disk copy) when there is one."""

    def __init__(
        self,
        candidate_id: str,
        capacity: int,
        *,
        keep_prompts: bool,
        store: PairStore | None = None,
        purpose: MirrorPurpose = "shadow",
    ) -> None:
        self.candidate_id = candidate_id
        self.purpose = purpose
        self.capacity = capacity
        self.keep_prompts = keep_prompts
        self.store = store
        self.recorded = store.seq if store is not None else 0
        self._ring: deque[MirrorPair] = deque(maxlen=max(1, capacity))

    def open(
        self,
        *,
        path: str,
        stable_id: str,
        body: bytes,
        payload: Any,
        client: str = "",
        floor_id: str | None = None,
    ) -> PendingPair | None:
        """A pending pair for one copied request (None when no pairs are kept); `floor_id`:
        the release the floor copy goes to (None: no floor copy)."""
        if self.capacity <= 0:
            return None
        return PendingPair(
            self,
            path=path,
            stable_id=stable_id,
            digest=hashlib.sha256(body).hexdigest(),
            prompt=prompt_text(payload) if self.keep_prompts else None,
            sampled=sampled(payload),
            client=client_digest(client),
            floor_id=floor_id,
        )

    def record(self, p: PendingPair) -> None:
        texts: dict[str, str | None] = {}
        whole: dict[str, bool] = {}
        cut = False
        for side in p.sides:
            status, cap = p.sides[side]
            text, w, c = cap.finish() if cap is not None else (None, False, False)
            texts[side] = text
            cut |= c
            whole[side] = w and text is not None and isinstance(status, int) and 200 <= status < 300
        ok = whole["client"] and whole["copy"]
        floor = p.sides.get("floor")
        if self.store is not None:  # numbered by the store: one sequence per candidate
            self.store.seq += 1
            self.recorded = self.store.seq
        else:
            self.recorded += 1
        # A canary's pairs: the client got the canary's answer (the release under
        # judgement: the candidate side); the copy went to the live release.
        canary = self.purpose == "canary"
        stable, cand = ("copy", "client") if canary else ("client", "copy")
        pair = MirrorPair(
            seq=self.recorded,
            at=time.time(),
            path=p.path,
            stable_release_id=paired_release(self.candidate_id) if canary else p.stable_id,
            candidate_release_id=p.stable_id if canary else self.candidate_id,
            stable_status=p.sides[stable][0],
            candidate_status=p.sides[cand][0],
            stable=texts[stable],
            candidate=texts[cand],
            complete=ok,
            stable_complete=whole[stable],
            candidate_complete=whole[cand],
            sampled=p.sampled,
            truncated=cut,
            prompt_sha256=p.digest,
            prompt=p.prompt,
            purpose=self.purpose,
            client_side="candidate" if canary else "stable",
            client=p.client,
            has_floor=floor is not None,
            floor=texts.get("floor"),
            floor_status=floor[0] if floor is not None else None,
            floor_release_id=p.floor_id,
            floor_complete=whole.get("floor", False),
        )
        self._ring.append(pair)
        if self.store is not None:
            self.store.append(pair)  # queued for the store's writer: never raises or waits

    @property
    def kept(self) -> int:
        return len(self._ring) if self.capacity > 0 else 0

    def since(self, seq: int, limit: int) -> list[MirrorPair]:
        """The pairs held with seq > `seq`, oldest first, at most `limit`."""
        out = [x for x in self._ring if x.seq > seq]
        return out[:limit]


class PairedRelay(Relay):
    """The client's answer relayed as `Relay` does, each body chunk read into the pair's
    client side after it was sent (a capture error loses the pair, never the answer)."""

    def __init__(self, *args: Any, pair: PendingPair, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pair = pair

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        cap: AnswerCapture | None = AnswerCapture(sse=self.sse)

        async def tee(message: Message) -> None:
            nonlocal cap
            await send(message)
            if cap is not None and message["type"] == "http.response.body":
                try:
                    cap.feed(message.get("body", b""))
                except Exception:  # never the client's problem
                    log.exception("capture of a mirrored request's answer failed")
                    cap = None

        try:
            await super().__call__(scope, receive, tee)
        finally:
            try:
                self.pair.answered("client", self.status_code, cap)
            except Exception:
                log.exception("answer pair not recorded")


class Mirroring:
    """One mirror configuration in force: which requests to copy (an exact share, by a
    deterministic accumulator), and the copies in flight."""

    def __init__(
        self,
        mirror: Mirror,
        metrics: Metrics,
        timeout_s: float,
        *,
        store: PairStore | None = None,
    ) -> None:
        self.mirror = mirror
        self.route = mirror.route
        self.metrics = metrics
        self.timeout_s = timeout_s
        self._acc = 0.0
        self.in_flight = 0
        self.sent = 0
        self.dropped = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._counter = metrics.mirrored
        self.pairs = PairBook(
            mirror.route.release_id,
            mirror.pairs,
            keep_prompts=mirror.keep_prompts,
            store=store,
            purpose=mirror.purpose,
        )

    def copies(self, pinned: Route) -> bool:
        """Whether requests pinned to `pinned` are copied at all: only those of the mirror
        route's own lane (`Route.lane`: a base mirror never takes an adapter lane's
        requests, nor a lane's mirror the base's or another lane's; they take no share and
        count as no drop), and a canary's mirror only its source's."""
        if pinned.lane != self.route.lane:
            return False
        return self.mirror.source is None or self.mirror.source == pinned.release_id

    def take(self) -> bool:
        """Whether this request is copied: exactly `share` of requests over any long run
        (none past the mirror's `until`)."""
        if self.mirror.until is not None and time.time() >= self.mirror.until:
            return False
        self._acc += self.mirror.share
        if self._acc >= 1.0 - 1e-9:
            self._acc -= 1.0
            return True
        return False

    def drop(self) -> None:
        """Count a copy that was not sent."""
        self.dropped += 1
        self._counter.labels(self.metrics.env, self.route.release_id, "dropped").inc()

    def targets(self, pinned: Route | None) -> list[tuple[Route, str, str | None]]:
        """Where one request's copies go, all at once: (route, the label its figures go
        under, the pair side its answer fills or None). The copy to `route`; with a floor,
        the floor copy to the reference (see the module doc); a shadow's baseline without a
        floor still gets its copy (not paired)."""
        m = self.mirror
        out: list[tuple[Route, str, str | None]] = [(self.route, self.route.release_id, "copy")]
        base = m.baseline
        if m.purpose != "shadow":
            if m.floor:
                out.append((self.route, self.route.release_id, "floor"))
        elif base is not None:
            out.append((base, base.release_id, "floor" if m.floor else None))
        elif m.floor and pinned is not None:
            out.append((pinned, pair_label(pinned.release_id), "floor"))
        return out

    def copy(
        self,
        session: aiohttp.ClientSession,
        *,
        method: str,
        path: str,
        query: bytes,
        headers: list[tuple[str, str]],
        body: bytes,
        payload: Any,
        prompt: str | None,
        route_label: str,
        stable_id: str = "",
        pinned: Route | None = None,
        client: str = "",
    ) -> PendingPair | None:
        """Send a request's copies on their own tasks (or drop them all when the mirror
        would pass its cap); the pair their answers go into (None when dropped or no pairs
        are kept). `pinned`: the route the client's request went to (a shadow's floor copy
        goes there without a baseline); `client`: the client's key digest or address."""
        targets = self.targets(pinned)
        # All of a request's copies go out together or none does.
        if self.in_flight + len(targets) > self.mirror.max_in_flight:
            self.drop()
            return None
        if any(unknown_model(r, payload) is not None for r, _, _ in targets):
            self.drop()  # a model one of its targets does not serve: no copy at all
            return None
        bodies: list[bytes] = []
        try:
            for r, _, _ in targets:
                # A copy renders from its own deep copy of the parsed body: the client's
                # request is rendered for its own route after this and must be untouched.
                bodies.append(
                    templated_body(r, prompt, copy.deepcopy(payload))
                    if prompt is not None
                    else plain_body(r, body, payload)
                )
        except PromptTemplateError:
            self.drop()
            return None
        floor = next((t for t in targets if t[2] == "floor"), None)
        floor_id = paired_release(floor[1]) if floor is not None else None
        pair = self.pairs.open(
            path=path,
            stable_id=stable_id,
            body=body,
            payload=payload,
            client=client,
            floor_id=floor_id,
        )
        stream = isinstance(payload, dict) and payload.get("stream") is True
        qs = "?" + query.decode("latin-1") if query else ""
        for (r, label, side), data in zip(targets, bodies, strict=True):
            hdrs = [(k, v) for k, v in headers if k.lower() != "authorization"]
            if r.api_key is not None:
                hdrs.append(("authorization", "Bearer " + r.api_key))
            self.in_flight += 1
            if side == "copy":
                self.sent += 1
            self._counter.labels(self.metrics.env, label, "sent").inc()
            task = asyncio.ensure_future(
                self._send(
                    session,
                    method,
                    r.base_url + path + qs,
                    hdrs,
                    data,
                    stream=stream,
                    route_label=route_label,
                    pair=pair if side is not None else None,
                    side=side or "copy",
                    release_id=label,
                )
            )
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return pair

    async def _send(
        self,
        session: aiohttp.ClientSession,
        method: str,
        url: str,
        headers: list[tuple[str, str]],
        body: bytes,
        *,
        stream: bool,
        route_label: str,
        pair: PendingPair | None = None,
        side: str = "copy",
        release_id: str | None = None,
    ) -> None:
        rid = release_id or self.route.release_id
        m = self.metrics.release(rid)
        t0 = time.perf_counter()
        status: int | str = 502
        cap: AnswerCapture | None = None
        try:
            async with asyncio.timeout(self.timeout_s):
                async with session.request(
                    method, url, headers=headers, data=body or None, allow_redirects=False
                ) as r:
                    status = r.status
                    need_ttft = stream
                    if pair is not None:
                        cap = AnswerCapture(sse=r.content_type == "text/event-stream")
                    async for chunk in r.content.iter_any():
                        if need_ttft and CONTENT_RE.search(chunk):
                            m.ttft.observe(time.perf_counter() - t0)
                            need_ttft = False
                        if cap is not None:
                            try:
                                cap.feed(chunk)
                            except Exception:
                                log.exception("capture of a shadow copy's answer failed")
                                cap = None
                    m.e2e.observe(time.perf_counter() - t0)
        except TimeoutError:
            status = 504
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            log.debug("shadow copy to %s failed: %r", url, exc)
            status = 502
        except asyncio.CancelledError:
            status = "aborted"
            raise
        finally:
            self.in_flight -= 1
            self.metrics.request(rid, route_label, status)
            if pair is not None:
                try:
                    pair.answered(side, status, cap)
                except Exception:
                    log.exception("answer pair not recorded")

    def cancel_all(self) -> None:
        """Cancel every copy in flight (the mirror was removed or the gateway stops)."""
        for t in list(self._tasks):
            t.cancel()
