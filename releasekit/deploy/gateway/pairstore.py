"""Answer pairs on disk: the durable copy of a mirror's pairs, bounded.

The gateway keeps a mirror's latest pairs in memory (`mirror.PairBook`, what
`GET /admin/mirror/pairs` answers); with `GatewayConfig.pairs_dir` it also appends each
completed pair, as one JSON line (the same `MirrorPair`: never a header or a key, the
prompt text only with `Mirror.keep_prompts`), to `<pairs_dir>/<candidate>.jsonl`. A
gateway that restarts continues the candidate's numbering from the file, so `seq` stays
unique in it and the pairs of a window survive the restart (`read_pairs`; the shadow
comparison reads them there when the memory ring no longer holds its window).

Bounded: a segment grows to at most `Mirror.pairs_segment_mib`; the next pair starts a
new one and the segment before it (`<candidate>.1.jsonl`) is dropped, so the store holds
at most two segments (one pair longer than a segment alone is written whole in a fresh
one). Files are created mode 0600 (a prompt may be kept), in a 0700 folder.

Aged and bounded as a whole: `prune` deletes the files of releases no longer mirrored
that were last written more than a while ago, `prune_to_size` the oldest files until the
folder is under a size (never the file being written); the gateway runs both every
`GatewayConfig.pairs_prune_s`, off the event loop. `store_problem` says why a store cannot
take a new mirror's pairs (a folder that cannot be written, or one at its size bound).

Writes never touch the client's request: `append` puts the pair on a bounded queue and
returns (a full queue drops the pair, counted); one writer thread per store encodes and
writes. An OSError (a folder that cannot be made, a full disk) is logged and counted
(`failed`), never raised: the pair is still in memory and the client's answer is long gone.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import queue
import re
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import IO

from pydantic import ValidationError

from releasekit.deploy.gateway.pairs import MirrorPair

log = logging.getLogger("releasekit.gateway")

SEGMENT_MIB = 8.0
"""The default size of one segment (two are kept)."""
QUEUE_MAX = 10_000
"""Pairs waiting for the writer at most; one more is dropped (and counted)."""
TAIL_BYTES = 1 << 20
"""Bytes at the end of a segment read to find the last pair's seq."""
_SAFE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # no dot: "c.1" must not be c's older segment


def store_dir(state_dir: Path, env: str) -> Path:
    """Where an environment's gateway keeps its mirror pairs: `<state dir>/mirror-pairs/<env>`."""
    return state_dir / "mirror-pairs" / env


def segment_paths(directory: Path, release_id: str) -> tuple[Path, Path]:
    """(the segment written now, the older one) of `release_id`'s pairs in `directory`.
    The file is named by the release id where it is a plain name, else by its digest."""
    stem = (
        release_id
        if _SAFE.match(release_id)
        else hashlib.sha256(release_id.encode()).hexdigest()[:32]
    )
    return directory / f"{stem}.jsonl", directory / f"{stem}.1.jsonl"


def _pairs_of(path: Path) -> list[MirrorPair]:
    """The pairs of one segment file, skipping a line that does not parse (a write cut by a
    crash); [] when the file cannot be read."""
    try:
        data = path.read_bytes()
    except OSError:
        return []
    out: list[MirrorPair] = []
    for line in data.splitlines():
        if not line.strip():
            continue
        with contextlib.suppress(ValidationError, ValueError):
            out.append(MirrorPair.model_validate_json(line))
    return out


def read_pairs(
    directory: Path, release_id: str, *, since: int = 0, until: int | None = None
) -> list[MirrorPair]:
    """The stored pairs of `release_id` with `since` < seq <= `until`, oldest first."""
    now, older = segment_paths(directory, release_id)
    return [
        p
        for p in _pairs_of(older) + _pairs_of(now)
        if p.seq > since and (until is None or p.seq <= until)
    ]


def prune(
    directory: Path, *, keep_s: float, protect: Iterable[str] = (), now: float | None = None
) -> list[Path]:
    """Delete the stored pairs files in `directory` last written more than `keep_s` seconds
    before `now`, except those of the releases in `protect` (the ones mirrored now); the
    paths deleted. A file that cannot be read or removed is left as it is."""
    kept = {path.name for rid in protect for path in segment_paths(directory, rid)}
    at = time.time() if now is None else now
    gone: list[Path] = []
    try:
        files = sorted(directory.glob("*.jsonl"))
    except OSError:
        return gone
    for path in files:
        if path.name in kept:
            continue
        try:
            if at - path.stat().st_mtime <= keep_s:
                continue
            path.unlink()
        except OSError:
            continue
        gone.append(path)
    return gone


def mb_bytes(mb: float) -> int:
    """Bytes in `mb` megabytes (10^6 bytes), as `mirror_pairs_max_mb` counts them."""
    return int(mb * 1_000_000)


def _files(directory: Path) -> list[tuple[float, int, Path]]:
    """(mtime, size, path) of the stored pairs files in `directory`; [] when unreadable."""
    out: list[tuple[float, int, Path]] = []
    try:
        paths = list(directory.glob("*.jsonl"))
    except OSError:
        return out
    for path in paths:
        try:
            st = path.stat()
        except OSError:
            continue
        out.append((st.st_mtime, st.st_size, path))
    return out


def store_bytes(directory: Path) -> int:
    """Bytes of the stored pairs files in `directory` (0: none, or unreadable)."""
    return sum(size for _, size, _ in _files(directory))


def prune_to_size(directory: Path, *, max_bytes: int, protect: Iterable[Path] = ()) -> list[Path]:
    """Delete the stored pairs files in `directory`, oldest (last written) first, until
    what is left is under `max_bytes`, never one in `protect` (the file being written);
    the paths deleted. A file that cannot be removed is left as it is."""
    kept = {Path(p).name for p in protect}
    files = sorted(_files(directory))
    total = sum(size for _, size, _ in files)
    gone: list[Path] = []
    for _, size, path in files:
        if total < max_bytes:
            break
        if path.name in kept:
            continue
        try:
            path.unlink()
        except OSError:
            continue
        total -= size
        gone.append(path)
    return gone


def store_problem(directory: Path, *, max_bytes: int) -> str | None:
    """Why the store in `directory` cannot take a new mirror's pairs (one line), or None:
    a folder that cannot be made or written, or stored pairs at `max_bytes` already."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".probe-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return f"the answer pairs folder {directory} cannot be written: {exc.strerror or exc}"
    used = store_bytes(directory)
    if used >= max_bytes:
        return (
            f"the answer pairs folder {directory} is full: {used / 1e6:.1f} MB stored, "
            f"at most {max_bytes / 1e6:g} MB (mirror_pairs_max_mb)"
        )
    return None


def _last_seq(path: Path) -> int | None:
    """The seq of the last whole pair in a segment (None: none readable)."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - TAIL_BYTES))
            tail = f.read()
    except OSError:
        return None
    for line in reversed(tail.splitlines()):
        try:
            return MirrorPair.model_validate_json(line).seq
        except (ValidationError, ValueError):
            continue
    return None


class PairStore:
    """The disk copy of one candidate's pairs (see the module doc). `seq` is the last seq
    given out (`PairBook` numbers the candidate's pairs from it): at start the last one on
    disk, or that of `after`, the same candidate's store this one replaces (whose writer
    finishes before this one writes)."""

    def __init__(
        self,
        directory: Path,
        release_id: str,
        *,
        segment_bytes: int,
        after: PairStore | None = None,
    ) -> None:
        self.directory = directory
        self.release_id = release_id
        self.segment_bytes = max(1, segment_bytes)
        self.path, self.older = segment_paths(directory, release_id)
        self.written = 0
        self.errors = 0
        self.dropped = 0
        self._after = after if after is not None and after.release_id == release_id else None
        self.seq: int = (
            self._after.seq
            if self._after is not None
            else _last_seq(self.path) or _last_seq(self.older) or 0
        )
        self._queue: queue.Queue[MirrorPair | None] = queue.Queue(maxsize=QUEUE_MAX)
        self._thread: threading.Thread | None = None
        self._closing = False
        self._warned = False

    @property
    def closing(self) -> bool:
        """Closed: it takes no more pairs."""
        return self._closing

    @property
    def failed(self) -> int:
        """Pairs that did not reach the disk: write errors and pairs dropped at a full queue."""
        return self.errors + self.dropped

    def append(self, pair: MirrorPair) -> None:
        """Queue one pair for the writer; never raises, never waits."""
        self.seq = max(self.seq, pair.seq)
        if self._closing:
            self.dropped += 1
            return
        try:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"pairstore-{self.release_id[:12]}", daemon=True
                )
                self._thread.start()
            self._queue.put_nowait(pair)
        except queue.Full:
            self.dropped += 1
        except Exception:  # a thread that cannot start: the pair stays in memory only
            self.dropped += 1
            log.exception("answer pair store writer not started")

    def close(self, timeout_s: float | None = None) -> None:
        """Stop taking pairs; the writer finishes what is queued. With `timeout_s`, wait for
        it that long."""
        self._closing = True
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)
        if timeout_s is not None:
            self.join(timeout_s)

    def join(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the writer to finish (once closed)."""
        t = self._thread
        if t is not None and t.is_alive() and t is not threading.current_thread():
            t.join(timeout_s)

    # -- the writer thread

    def _run(self) -> None:
        if self._after is not None:  # the store replaced writes the same files: let it finish
            self._after.join(30.0)
            self._after = None
        f: IO[bytes] | None = None
        size = 0
        try:
            while True:
                try:
                    item = self._queue.get(timeout=0.5)
                except queue.Empty:
                    if self._closing:
                        return
                    continue
                if item is None:
                    return
                try:
                    line = item.model_dump_json().encode() + b"\n"
                    f, size = self._write(f, size, line)
                    self.written += 1
                except OSError as exc:
                    self.errors += 1
                    if f is not None:
                        with contextlib.suppress(OSError):
                            f.close()
                        f = None
                    self._warn(exc)
        finally:
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()

    def _open(self) -> tuple[IO[bytes], int]:
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with contextlib.suppress(OSError):  # a file made before, under another mode
            os.fchmod(fd, 0o600)
        f = os.fdopen(fd, "ab")
        size = f.seek(0, os.SEEK_END)
        if size > 0:
            with self.path.open("rb") as r:
                r.seek(size - 1)
                if r.read(1) != b"\n":  # a line cut by a crash: end it, so the next parses
                    f.write(b"\n")
                    size += 1
        return f, size

    def _write(self, f: IO[bytes] | None, size: int, line: bytes) -> tuple[IO[bytes], int]:
        if f is None:
            f, size = self._open()
        if size > 0 and size + len(line) > self.segment_bytes:
            f.close()
            os.replace(self.path, self.older)  # the segment before it is dropped
            f, size = self._open()
        f.write(line)
        f.flush()
        return f, size + len(line)

    def _warn(self, exc: OSError) -> None:
        if not self._warned or self.errors % 1000 == 0:
            self._warned = True
            log.warning(
                "answer pairs not written to %s (%d so far; they stay in memory): %s",
                self.path,
                self.errors,
                exc.strerror or exc,
            )
