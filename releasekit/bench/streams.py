"""Reading a recorded SSE stream after its load point: content events and their arrival
times, the final usage, and the RequestRecord of each raw result.

Only the arrival time and bytes of each network read are kept while the point runs
(`loadgen`); this module splits them into events afterwards, classifying content events from
their bytes and JSON-parsing only the final usage event (and anything odd).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from releasekit.bench.loadgen import RawResult, RequestRecord, snippet


@dataclass(slots=True)
class ParsedStream:
    """What an SSE stream said, with the arrival time of each event."""

    chunk_times: list[float] = field(default_factory=list)
    last_time: float | None = None
    done: bool = False
    usage_output_tokens: int | None = None
    usage_prompt_tokens: int | None = None
    error: str | None = None


_COMPLETION_KEY = b'"text":'
_CHAT_KEY = b'"content":'


def _has_text(payload: bytes, key: bytes) -> bool | None:
    """Whether an event carries non-empty text, read from its bytes: True, False, or None
    when the bytes do not say (then the caller parses the JSON)."""
    i = payload.find(key)
    if i < 0:
        return None
    j = i + len(key)
    c = payload[j : j + 1]
    if c == b" ":
        j += 1
        c = payload[j : j + 1]
    if c == b'"':  # a string: empty when the next byte closes it
        return payload[j + 1 : j + 2] not in (b'"', b"")
    if c == b"n":  # null
        return False
    return None


def _event_text(event: dict[str, Any], chat: bool) -> bool:
    choices = event.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return False
    choice = choices[0]
    text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
    return bool(text)


def _fast_parse(reads: list[tuple[float, bytes]], chat: bool) -> ParsedStream | None:
    """The usual stream, counted from its bytes: every read holds whole `data: {...}` events
    (or the final `data: [DONE]`), none is an error. Per read it costs two byte counts; only
    events that may carry usage (`_tokens` in them) are JSON-parsed. None when the stream is
    anything else (then `parse_stream` goes event by event)."""
    if not reads:
        return None
    whole = b"".join(d for _, d in reads)
    objects = whole.count(b"}\n\n")
    if (
        b'"error"' in whole
        or whole.count(b"\n\n") != objects + whole.count(b"data: [DONE]\n\n")
        or whole.count(b"data: {") != objects
    ):
        return None
    key = b'"content":' if chat else b'"text":'
    if key + b' "' in whole:  # `"key": "..."`: the json.dumps default separators
        key += b" "
    text, empty = key + b'"', key + b'""'
    parsed = ParsedStream()
    times = parsed.chunk_times
    nn = b"\n\n"
    for t, data in reads:
        if not data.endswith(nn):
            return None
        n = data.count(text) - data.count(empty)
        if n == 1:
            times.append(t)
        elif n:
            times.extend([t] * n)
    parsed.last_time = reads[-1][0]
    parsed.done = whole.startswith(b"data: [DONE]") or b"\ndata: [DONE]\n" in whole
    at = whole.find(b"_tokens")
    while at >= 0:
        start = whole.rfind(b"data:", 0, at)
        end = whole.find(nn, at)
        try:
            event = json.loads(whole[start + 5 : end])
        except ValueError:
            return None
        usage = event.get("usage") if isinstance(event, dict) else None
        if isinstance(usage, dict):
            if usage.get("completion_tokens") is not None:
                parsed.usage_output_tokens = int(usage["completion_tokens"])
            if usage.get("prompt_tokens") is not None:
                parsed.usage_prompt_tokens = int(usage["prompt_tokens"])
        at = whole.find(b"_tokens", end)
    return parsed


def parse_stream(reads: list[tuple[float, bytes]], *, chat: bool) -> ParsedStream:
    """Split raw reads into SSE `data:` events; an event is timed by the read that completed
    it. Content chunks are events whose choice carries non-empty text.

    Ordinary streams are counted from their bytes without a JSON parse per event
    (`_fast_parse`); anything else goes event by event, where token events are still
    classified from their bytes and only usage, errors and odd events are parsed."""
    fast = _fast_parse(reads, chat)
    if fast is not None:
        return fast
    parsed = ParsedStream()
    key = _CHAT_KEY if chat else _COMPLETION_KEY
    times = parsed.chunk_times
    buf = b""
    for t, data in reads:
        if buf:
            data = buf + data
            buf = b""
        if b"\n" not in data:
            buf = data
            continue
        *lines, buf = data.split(b"\n")
        for line in lines:
            if not line.startswith(b"data:"):
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
            payload = line[5:].strip()
            parsed.last_time = t
            if payload == b"[DONE]":
                parsed.done = True
                continue
            if (
                payload[:1] == b"{"
                and payload[-1:] == b"}"
                and b"_tokens" not in payload
                and b'"error"' not in payload
            ):
                is_text = _has_text(payload, key)
                if is_text is not None:
                    if is_text:
                        times.append(t)
                    continue
            _parse_event(parsed, payload, t, chat)
    return parsed


def _parse_event(parsed: ParsedStream, payload: bytes, t: float, chat: bool) -> None:
    try:
        event = json.loads(payload)
    except ValueError:
        parsed.error = f"unparseable stream event: {snippet(payload, 120)}"
        return
    if not isinstance(event, dict):
        return
    if event.get("error"):
        err = event["error"]
        msg = err.get("message", err) if isinstance(err, dict) else err
        parsed.error = f"server error in stream: {snippet(str(msg).encode(), 160)}"
        return
    if _event_text(event, chat):
        parsed.chunk_times.append(t)
    usage = event.get("usage")
    if isinstance(usage, dict):
        if usage.get("completion_tokens") is not None:
            parsed.usage_output_tokens = int(usage["completion_tokens"])
        if usage.get("prompt_tokens") is not None:
            parsed.usage_prompt_tokens = int(usage["prompt_tokens"])


def to_record(
    raw: RawResult, *, point: int, run_start: float, chat: bool, repetition: int = 0
) -> RequestRecord:
    """Turn a raw result into a RequestRecord (parses the stream; call after the point).
    Latencies count from the scheduled arrival when there is one, else from sending."""
    parsed = parse_stream(raw.reads, chat=chat)
    status, error = raw.status, raw.error
    if status == "ok":
        if parsed.error is not None:
            status, error = "error", parsed.error
        elif not parsed.done:
            status, error = "error", "stream ended before [DONE]"
        elif not parsed.chunk_times:
            status, error = "error", "stream carried no content"
    tokens_from: Literal["usage", "chunks"] = "usage"
    if parsed.usage_output_tokens is not None:
        out_tokens = parsed.usage_output_tokens
    else:
        out_tokens, tokens_from = len(parsed.chunk_times), "chunks"
    origin = raw.scheduled if raw.scheduled is not None else raw.sent
    return RequestRecord(
        point=point,
        index=raw.spec.index,
        repetition=repetition,
        warmup=point < 0,
        sent_s=round(raw.sent - run_start, 6),
        scheduled_s=None if raw.scheduled is None else round(raw.scheduled - run_start, 6),
        chunk_s=[round(t - origin, 6) for t in parsed.chunk_times],
        end_s=None if parsed.last_time is None else round(parsed.last_time - origin, 6),
        prompt_words=raw.spec.prompt_words,
        max_tokens=raw.spec.max_tokens,
        prompt_tokens=parsed.usage_prompt_tokens,
        output_tokens=out_tokens,
        tokens_from=tokens_from,
        status=status,
        http_status=raw.http_status,
        error=error,
    )
