"""The streaming load generator: seeded request shapes, closed-loop concurrency and open-loop
Poisson arrivals, and one raw record per request (send time, every chunk's arrival, tokens,
status, error).

The client must never queue a request inside itself, or it measures its own queue: every
request in flight has its own connection (an aiohttp connector sized to the load, which hands
an idle connection to exactly one request and opens a new one otherwise), and `sent` is taken
immediately before the request is written. Open-loop points time each request from its
scheduled arrival, so a late send (the client or its in-flight cap holding it back) counts as
latency instead of vanishing (coordinated omission).

The hot path does as little as possible, because the client shares the CPU with the server
it measures: per network read it stores `(time.perf_counter(), bytes)` and nothing else. The
SSE stream is split after the load point has ended (`streams.parse_stream`), classifying
content events from their bytes; only the final usage event (and anything odd) is
JSON-parsed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any, Literal

import aiohttp
import httpx
import numpy as np
from pydantic import BaseModel, Field
from yarl import URL

from releasekit.errors import BenchError, ServerUnreachableError
from releasekit.spec.loadprofile import LengthDist, LoadProfile

Status = Literal["ok", "error", "timeout"]

# Plain words for synthetic prompts; the token count per word is calibrated against the
# server's tokenizer (`tokens_per_word`), so prompt lengths follow the profile.
# fmt: off
_WORDS: tuple[str, ...] = (
    "the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at",
    "from", "his", "her", "an", "which", "are", "be", "this", "were", "had", "have", "not", "but",
    "or", "one", "all", "their", "they", "he", "she", "we", "you", "it", "been", "more", "when",
    "who", "will", "no", "there", "can", "if", "so", "time", "two", "about", "than", "into",
    "them", "some", "could", "other", "only", "new", "after", "first", "also", "these", "may",
    "what", "year", "any", "over", "where", "most", "out", "many", "then", "such", "made",
    "through", "people", "would", "our", "years", "its", "like", "way", "before", "between",
    "now", "down", "great", "well", "should", "because", "each", "just", "those", "how", "long",
    "day", "being", "under", "three", "world", "life", "while", "back", "still", "state", "water",
    "last", "own", "high", "work", "small", "without", "part", "large", "city", "place", "around",
    "number", "same", "another", "during", "house", "several", "country", "found", "against",
    "since", "both", "river", "north", "south", "early", "music", "school", "group", "line",
    "name", "left", "right", "point", "family", "form", "sea", "land", "light", "word", "body",
    "order", "book", "side", "head", "power", "war", "end", "field", "story", "game", "market",
    "road", "paper",
)
# fmt: on
# Idle connections are dropped after 2 s, before uvicorn's 5 s keep-alive timeout closes them:
# reusing a connection the server is closing at that instant fails the request through no
# fault of the server.
_KEEPALIVE_S = 2.0
_HEADERS = {"content-type": "application/json", "accept-encoding": "identity"}


class RequestRecord(BaseModel):
    """One request as the client saw it. Times are seconds. `sent_s` (when the request was
    written) and `scheduled_s` (open loop: its planned arrival) are relative to the start of
    the bench run; `chunk_s` and `end_s` are relative to the request's start: its scheduled
    arrival in open loop, the moment it was sent in closed loop."""

    point: int = Field(description="index of the load point (-1 for warm-up)")
    index: int = Field(description="index of the request within its point")
    repetition: int = Field(0, description="which repetition of the sweep sent it")
    warmup: bool = False
    sent_s: float
    scheduled_s: float | None = Field(
        None, description="open loop: planned arrival time, relative to the run start"
    )
    chunk_s: list[float] = Field(
        default_factory=list,
        description="arrival of every content event, after the request's start (events "
        "that arrived in the same network read share a time)",
    )
    end_s: float | None = Field(None, description="arrival of the last event, after the start")
    prompt_words: int
    max_tokens: int
    prompt_tokens: int | None = None
    output_tokens: int = 0
    tokens_from: Literal["usage", "chunks"] = "usage"
    status: Status
    http_status: int | None = None
    error: str | None = None

    @property
    def send_lag_s(self) -> float | None:
        """Open loop: how late the request went out after its scheduled arrival."""
        return None if self.scheduled_s is None else self.sent_s - self.scheduled_s

    @property
    def ttft_s(self) -> float | None:
        """Request start to first content chunk."""
        return self.chunk_s[0] if self.chunk_s else None

    @property
    def e2e_s(self) -> float | None:
        """Request start to last chunk."""
        return self.end_s

    @property
    def tpot_s(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1); undefined for fewer than two tokens."""
        ttft, e2e = self.ttft_s, self.e2e_s
        if ttft is None or e2e is None or self.output_tokens < 2:
            return None
        return (e2e - ttft) / (self.output_tokens - 1)

    @property
    def itl_s(self) -> list[float]:
        """Gaps between consecutive content chunks."""
        c = self.chunk_s
        return [b - a for a, b in pairwise(c)]

    @property
    def deliveries(self) -> int:
        """Distinct arrival times of content: how many times text reached the client. Far
        fewer than output tokens means the stream came in bursts."""
        return len(set(self.chunk_s))


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """A request to send: its pre-encoded JSON body and the shape it was drawn with."""

    index: int
    body: bytes
    prompt_words: int
    max_tokens: int


@dataclass(slots=True)
class RawResult:
    """What the hot path keeps for one request; turned into a RequestRecord afterwards."""

    spec: RequestSpec
    sent: float
    scheduled: float | None = None
    end: float | None = None
    reads: list[tuple[float, bytes]] = field(default_factory=list)
    status: Status = "ok"
    http_status: int | None = None
    error: str | None = None


def sample_lengths(dist: LengthDist, n: int, rng: np.random.Generator) -> np.ndarray:
    """Draw `n` token lengths (>= 1) from a profile's length distribution."""
    if dist.dist == "fixed":
        return np.full(n, int(dist.value or 1), dtype=np.int64)
    if dist.dist == "uniform":
        return rng.integers(int(dist.min or 1), int(dist.max or 1), size=n, endpoint=True)
    draws = rng.normal(float(dist.mean or 1.0), float(dist.std or 0.0), size=n)
    return np.clip(np.rint(draws), 1, None).astype(np.int64)


def iter_specs(
    profile: LoadProfile,
    model: str | Sequence[str],
    *,
    key: int,
    tokens_per_word: float = 1.0,
    batch: int = 64,
) -> Iterator[RequestSpec]:
    """An endless, seeded stream of request specs for one load point (`key` keeps the
    prompts of different points apart, so the prefix cache does not favour later points).
    Given several models, request i asks for model i mod len(models): round-robin, the same
    in every run."""
    models = [model] if isinstance(model, str) else list(model)
    if not models:
        raise BenchError("no model to send requests to")
    rng = np.random.default_rng([profile.seed, key])
    tpw = max(tokens_per_word, 1e-3)
    index = 0
    while True:
        prompt_lens = sample_lengths(profile.prompt_tokens, batch, rng)
        out_lens = sample_lengths(profile.output_tokens, batch, rng)
        for p_len, o_len in zip(prompt_lens, out_lens, strict=True):
            words = max(1, round(int(p_len) / tpw))
            text = " ".join(_WORDS[i] for i in rng.integers(0, len(_WORDS), size=words))
            yield RequestSpec(
                index=index,
                body=request_body(profile, models[index % len(models)], text, int(o_len)),
                prompt_words=words,
                max_tokens=int(o_len),
            )
            index += 1


def request_body(profile: LoadProfile, model: str, text: str, max_tokens: int) -> bytes:
    """The JSON body of one streaming request (greedy, fixed length when ignore_eos)."""
    payload: dict[str, Any] = {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": profile.ignore_eos,
    }
    if profile.api == "chat":
        payload["messages"] = [{"role": "user", "content": text}]
    else:
        payload["prompt"] = text
    return json.dumps(payload).encode()


def api_path(profile: LoadProfile) -> str:
    """The OpenAI-compatible endpoint a profile targets."""
    return "/v1/chat/completions" if profile.api == "chat" else "/v1/completions"


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The Authorization header for a server started with --api-key (none without a key)."""
    return {"authorization": f"Bearer {api_key}"} if api_key else {}


class LoadClient:
    """The load client: one aiohttp session whose connector holds at least one connection
    per request in flight, so no request ever waits for a connection inside the client.

    Use it as an async context manager; `send` never raises for a failed request.
    """

    def __init__(
        self, base_url: str, *, max_connections: int, timeout_s: float, api_key: str | None = None
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.max_connections = max(1, max_connections)
        self.timeout_s = timeout_s
        self._headers = {**_HEADERS, **auth_headers(api_key)}
        self._session: aiohttp.ClientSession | None = None
        self._urls: dict[str, URL] = {}

    async def __aenter__(self) -> LoadClient:
        # Two spare connections, so a /metrics sample never takes a request's connection.
        connector = aiohttp.TCPConnector(
            limit=self.max_connections + 2,
            limit_per_host=self.max_connections + 2,
            keepalive_timeout=_KEEPALIVE_S,
            force_close=False,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            headers=self._headers,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=min(self.timeout_s, 10.0)),
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def url(self, path: str) -> URL:
        """The absolute URL of `path`, parsed once."""
        u = self._urls.get(path)
        if u is None:
            u = self._urls[path] = URL(self.base_url + path)
        return u

    async def get_text(self, path: str) -> str | None:
        """GET `path` (e.g. /metrics) and return its body; None on any failure."""
        session = self._session
        if session is None:
            raise RuntimeError("LoadClient used outside `async with`")
        try:
            async with session.get(self.url(path)) as resp:
                if resp.status != 200:
                    return None
                return (await resp.read()).decode(errors="replace")
        except (aiohttp.ClientError, TimeoutError):
            return None

    async def send(
        self, path: str, spec: RequestSpec, *, scheduled: float | None = None
    ) -> RawResult:
        """Send one streaming request and keep every read with its arrival time."""
        session = self._session
        if session is None:
            raise RuntimeError("LoadClient used outside `async with`")
        url = self.url(path)
        clock = time.perf_counter
        raw = RawResult(spec=spec, sent=0.0, scheduled=scheduled)
        append = raw.reads.append
        try:
            async with asyncio.timeout(self.timeout_s):
                raw.sent = clock()
                async with session.post(url, data=spec.body) as resp:
                    raw.http_status = resp.status
                    if resp.status != 200:
                        body = await resp.read()
                        raw.status = "error"
                        raw.error = f"HTTP {resp.status}: {snippet(body)}"
                    else:
                        async for data in resp.content.iter_any():
                            append((clock(), data))
        except TimeoutError:
            raw.status = "timeout"
            raw.error = f"no complete answer within {self.timeout_s:g} s"
        except aiohttp.ClientError as exc:
            raw.status = "error"
            raw.error = _describe(exc)
        raw.end = clock()
        if raw.sent == 0.0:
            raw.sent = raw.end
        return raw


def _describe(exc: BaseException) -> str:
    """`Type: message`, falling back to the underlying cause when the library says nothing."""
    detail = str(exc) or repr(exc.__cause__ or exc.__context__ or "")
    return f"{type(exc).__name__}: {detail}" if detail and detail != "''" else type(exc).__name__


def snippet(body: bytes, limit: int = 200) -> str:
    """The start of a body, on one line, for an error message."""
    text = body.decode(errors="replace").strip().replace("\n", " ")
    return text[:limit]


ProgressFn = Callable[[], None]

LAG_EVERY_S = 0.01
"""How often the client's lag monitor wakes up."""


class LoopLag:
    """How far behind the load client's own event loop runs: a timer due every `every_s`
    notes how late it fires. Every chunk the client records is late by at most the lag at
    that moment (the loop was busy, or the process was waiting for a CPU), so this measures
    the client itself, independently of the server it loads. Cheap: 100 wake-ups a second.

    Use `async with LoopLag() as lag:` around the load; `lag.samples` holds the lateness of
    each wake-up, in seconds, and `lag.elapsed_s` how long it watched.

    One stall of L seconds delays whatever arrives during it by L/2 on average, so the
    delay the client added to a random observation is sum(L^2) / (2 x elapsed)
    (`mean_delay_s`): a 1.6 s stall in a 3 s window adds about 0.43 s, a 70 ms one 0.8 ms.
    A percentile of the samples would miss a long stall, which yields one sample."""

    def __init__(self, every_s: float = LAG_EVERY_S) -> None:
        self.every_s = every_s
        self.samples: list[float] = []
        self.elapsed_s = 0.0
        self._task: asyncio.Task[None] | None = None
        self._t0 = 0.0

    @property
    def mean_delay_s(self) -> float | None:
        """The delay the client's own stalls added to a random moment of the window."""
        if not self.samples or self.elapsed_s <= 0:
            return None
        return sum(v * v for v in self.samples) / (2.0 * self.elapsed_s)

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        every, append = self.every_s, self.samples.append
        due = loop.time() + every
        while True:
            await asyncio.sleep(max(0.0, due - loop.time()))
            now = loop.time()
            append(max(0.0, now - due))
            due = now + every

    async def __aenter__(self) -> LoopLag:
        self._t0 = time.perf_counter()
        self._task = asyncio.create_task(self._watch())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.elapsed_s = time.perf_counter() - self._t0
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


async def run_closed_loop(
    client: LoadClient,
    path: str,
    specs: Iterable[RequestSpec],
    *,
    concurrency: int,
    requests: int | None,
    duration_s: float | None,
    on_done: ProgressFn | None = None,
) -> list[RawResult]:
    """`concurrency` workers each send their next request as soon as the previous one ends,
    until `requests` were sent or `duration_s` has passed (whichever comes first)."""
    results: list[RawResult] = []
    it = iter(specs)
    issued = 0
    stop_at = time.perf_counter() + duration_s if duration_s is not None else None

    async def worker() -> None:
        nonlocal issued
        while True:
            if requests is not None and issued >= requests:
                return
            if stop_at is not None and time.perf_counter() >= stop_at:
                return
            issued += 1
            spec = next(it)
            results.append(await client.send(path, spec))
            if on_done is not None:
                on_done()

    await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))
    return results


async def run_open_loop(
    client: LoadClient,
    path: str,
    specs: Iterable[RequestSpec],
    *,
    rate: float,
    rng: np.random.Generator,
    requests: int | None,
    duration_s: float | None,
    max_in_flight: int,
    on_done: ProgressFn | None = None,
) -> list[RawResult]:
    """Poisson arrivals at `rate` requests/s, independent of how fast answers come back,
    capped at `max_in_flight` outstanding requests. An arrival held back by the cap (or by a
    busy client) is still timed from its scheduled arrival."""
    results: list[RawResult] = []
    gate = asyncio.Semaphore(max_in_flight)
    tasks: list[asyncio.Task[None]] = []
    start = time.perf_counter()
    arrival = start

    async def fire(spec: RequestSpec, scheduled: float) -> None:
        try:
            results.append(await client.send(path, spec, scheduled=scheduled))
        finally:
            gate.release()
        if on_done is not None:
            on_done()

    for i, spec in enumerate(specs):
        if requests is not None and i >= requests:
            break
        if i > 0:
            arrival += float(rng.exponential(1.0 / rate))
        if duration_s is not None and arrival - start > duration_s:
            break
        delay = arrival - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        await gate.acquire()
        tasks.append(asyncio.create_task(fire(spec, arrival)))
    if tasks:
        await asyncio.gather(*tasks)
    return results


async def check_server(client: httpx.AsyncClient, model: str) -> None:
    """Check that the server answers /health and serves `model`; translate httpx errors."""
    base = str(client.base_url).rstrip("/")
    try:
        health = await client.get("/health")
        if health.status_code != 200:
            raise ServerUnreachableError(f"{base}/health answered HTTP {health.status_code}")
        models = await client.get("/v1/models")
    except httpx.HTTPError as exc:
        raise ServerUnreachableError(f"cannot reach {base}: {exc}") from exc
    if models.status_code == 401:
        raise BenchError(
            f"{base}/v1/models answered HTTP 401: the server wants an API key",
            remedy="pass --api-key (or set VLLM_API_KEY) with the server's key",
        )
    if models.status_code != 200:
        raise ServerUnreachableError(f"{base}/v1/models answered HTTP {models.status_code}")
    try:
        served = [str(m.get("id")) for m in models.json().get("data", [])]
    except (ValueError, AttributeError) as exc:
        raise ServerUnreachableError(f"{base}/v1/models answered unparseable JSON") from exc
    if model not in served:
        raise BenchError(
            f"{base} does not serve model '{model}' (it serves: {', '.join(served) or 'none'})",
            remedy="pass the served model name (`--model`), as listed by GET /v1/models",
        )


async def tokens_per_word(client: httpx.AsyncClient, model: str) -> float:
    """How many tokens one prompt word costs on this server's tokenizer (vLLM's /tokenize);
    1.0 when the server cannot tell."""
    sample = " ".join(_WORDS)
    try:
        resp = await client.post(
            "/tokenize", json={"model": model, "prompt": sample, "add_special_tokens": False}
        )
        count = int(resp.json()["count"]) if resp.status_code == 200 else 0
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        count = 0
    return count / len(_WORDS) if count > 0 else 1.0
