"""Shared CLI plumbing: settings, the one error handler, JSON/table rendering.

Text from the core (messages, remedies, reasons, paths) is printed as it is: rich markup in
a print goes through `esc` first, and table cells are plain text, so that a bracketed
`[environments.NAME]` or `[a, b]` survives.

Tables are rich tables on a terminal. Piped (a file, `| cat`, CI logs), a table that does
not fit the width (80 columns unless COLUMNS says otherwise) is printed as one record per
row instead, `column: value` lines wrapped at the width, so that nothing is folded
mid-word."""

from __future__ import annotations

import functools
import json
import os
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Annotated, Any, ParamSpec, TypeVar

import typer
from pydantic import BaseModel
from rich.console import Console, RenderableType
from rich.markup import escape
from rich.measure import Measurement
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from rich.text import Text

from releasekit.config import Settings, load_settings
from releasekit.errors import ManifestError, ReleasekitError

P = ParamSpec("P")
R = TypeVar("R")

out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)


def esc(value: object) -> str:
    """`value` as literal text inside a rich markup string: brackets are printed, never
    read as a style tag."""
    return escape(str(value))


JsonOpt = Annotated[bool, typer.Option("--json", help="print machine-readable JSON")]


class State:
    """Per-invocation CLI state: flags from the root callback and settings, loaded once."""

    traceback: bool = False
    _settings: Settings | None = None

    @classmethod
    def settings(cls) -> Settings:
        if cls._settings is None:
            cls._settings = load_settings()
        return cls._settings

    @classmethod
    def reset(cls) -> None:
        cls.traceback = False
        cls._settings = None


def handle_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """Catch ReleasekitError once: print one red line (plus details) and exit 1."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except ReleasekitError as exc:
            if State.traceback or os.environ.get("RELEASEKIT_TRACEBACK"):
                raise
            report_error(exc)
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            err.print("[red]interrupted[/red]")
            raise typer.Exit(130) from None
        except Exception as exc:
            if State.traceback or os.environ.get("RELEASEKIT_TRACEBACK"):
                raise
            err.print(
                f"[red]unexpected error:[/red] {type(exc).__name__}: {esc(exc)} "
                "(rerun with --traceback and report it)",
                markup=True,
                highlight=False,
            )
            raise typer.Exit(2) from None

    return wrapper


def report_error(exc: ReleasekitError) -> None:
    """Print an error the way users see every error: what is wrong, then what to do."""
    if isinstance(exc, ManifestError):
        for p in exc.problems:
            err.print(f"[red]error:[/red] {esc(exc.path)}: {esc(p)}", markup=True, highlight=False)
    else:
        err.print(f"[red]error:[/red] {esc(exc.message)}", markup=True, highlight=False)
    if exc.remedy:
        err.print(f"  [dim]hint: {esc(exc.remedy)}[/dim]", markup=True, highlight=False)


def emit_json(data: BaseModel | Sequence[BaseModel] | dict[str, Any] | list[Any]) -> None:
    """Print JSON to stdout (pydantic models via model_dump)."""
    if isinstance(data, BaseModel):
        sys.stdout.write(data.model_dump_json(indent=2) + "\n")
        return
    if isinstance(data, list | tuple):
        data = [d.model_dump(mode="json") if isinstance(d, BaseModel) else d for d in data]
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def table(
    title: str | None,
    columns: Sequence[str],
    rows: Iterable[Sequence[Any]],
    *,
    no_wrap: Collection[str] = (),
    min_width: Mapping[str, int] | None = None,
    console: Console | None = None,
    row_line: Callable[[Sequence[str]], str] | None = None,
) -> None:
    """Print a table on stdout: rich on a terminal; piped, records when it would not fit
    (see the module docstring), or with `row_line`, that one line a row (wrapped at the
    width under a hanging indent). The title and the cells are plain text (no markup);
    `no_wrap` columns never wrap in the rich table (ids must stay copyable)."""
    con = console or out
    cells = [["" if v is None else str(v) for v in r] for r in rows]
    t = Table(title=None if title is None else Text(title), show_lines=False)
    for c in columns:
        if c in no_wrap:
            t.add_column(Text(c), no_wrap=True)
        else:
            t.add_column(Text(c), overflow="fold", min_width=(min_width or {}).get(c))
    for r in cells:
        t.add_row(*(Text(v) for v in r))
    natural = Measurement.get(con, con.options.update(max_width=100_000), t).maximum
    if con.is_terminal or natural <= con.width:
        con.print(t)
        return
    if row_line is not None:
        lines = [title] if title else []
        for r in cells:
            lines += textwrap.wrap(
                row_line(r),
                width=con.width,
                subsequent_indent="    ",
                break_long_words=False,
                break_on_hyphens=False,
            )
        for line in lines:
            con.print(line, markup=False, highlight=False, soft_wrap=True)
        return
    for line in records(title, columns, cells, width=con.width):
        con.print(line, markup=False, highlight=False, soft_wrap=True)


def records(
    title: str | None, columns: Sequence[str], rows: Sequence[Sequence[str]], *, width: int
) -> list[str]:
    """A table as lines no wider than `width` (but for a single word longer than a line):
    two columns as `key: value`; more as one record per row, the first cell as its heading
    and `  column: value` for each other cell that holds something (not "" or "-")."""
    lines = [title] if title else []

    def field(label: str, value: str, indent: str) -> list[str]:
        head = f"{indent}{label}: "
        first_word = value.split(" ", 1)[0]
        if len(head) + len(first_word) > width:
            lines_ = [head.rstrip()]
            head = indent + "  "
        else:
            lines_ = []
        body = textwrap.wrap(
            value,
            width=width,
            initial_indent=head,
            subsequent_indent=indent + "    ",
            break_long_words=False,
            break_on_hyphens=False,
        )
        return lines_ + (body or [head.rstrip()])

    for r in rows:
        if len(columns) == 2:
            lines += field(r[0], r[1], "")
            continue
        lines.append(r[0])
        for col, value in zip(columns[1:], r[1:], strict=False):
            if value.strip() not in ("", "-"):
                lines += field(col, value, "  ")
    return lines


def short_table(
    columns: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    cell_styles: Mapping[str, str] | None = None,
    console: Console | None = None,
) -> None:
    """Print a borderless table, one line a row, on a terminal and piped alike: columns two
    spaces apart, no trailing blanks. Only the first column gives way when a row would not
    fit the width (its text folds onto a second line); the others are short figures that
    never wrap. A cell whose whole text is a key of `cell_styles` is drawn in that style
    (colour shows on a terminal only). Cells are plain text."""
    con = console or out
    styles = cell_styles or {}
    widths = [max([len(c), *(len(r[i]) for r in rows)]) for i, c in enumerate(columns)]
    rest = sum(widths[1:]) + 2 * (len(widths) - 1)
    widths[0] = max(min(widths[0], con.width - rest), 12)

    def emit(cells: Sequence[str], *, header: bool = False) -> None:
        first = textwrap.wrap(cells[0], widths[0], break_on_hyphens=False) or [""]
        line = Text(first[0].ljust(widths[0]), style="bold" if header else "")
        for value, width in zip(cells[1:], widths[1:], strict=False):
            line.append("  ")
            style = "bold" if header else styles.get(value, "")
            line.append(value, style=style)
            line.append(" " * (width - len(value)))
        line.rstrip()
        con.print(line, soft_wrap=True, highlight=False)
        for more in first[1:]:
            con.print(Text("  " + more), soft_wrap=True, highlight=False)

    emit(columns, header=True)
    for r in rows:
        emit(r)


@dataclass
class _Step:
    """A step being logged: when it started, whether it counts to a total, and its parts
    (the labels that extend it) as they come: the current one and the longest so far."""

    started: float
    counted: bool = False
    done: int = 0
    total: int = 0
    part: str | None = None
    part_started: float = 0.0
    parts: int = 0
    longest: tuple[str, float] | None = None

    def next_part(self, part: str | None, now: float) -> None:
        """Move on to `part` (None: the step ends), timing the part it leaves."""
        if part == self.part:
            return
        if self.part is not None:
            self.parts += 1
            took = now - self.part_started
            if self.longest is None or took > self.longest[1]:
                self.longest = (self.part, took)
        self.part, self.part_started = part, now


class Reporter:
    """A progress(label, done, total) callback for the core, drawn as rich bars on a
    terminal (one row per label prefix, the text before ':'; total 0 = unknown). In logs and
    CI, where bars don't render, it writes one line per step when the step finishes, with
    its time (`  quantise  12.3 s`). A step is a label's text before ': ' (as a bar is);
    the rest names a part of it (`evidence: warm-up`), timed into the step's line (its
    longest part) rather than printed. A step counted to a total finishes when its own
    label's count reaches it; one of unknown length when another step starts, or when the
    work ends; a step over in less than `min_s` is not written, and none is with
    `step_lines` off (a caller that writes each step's time itself). While the work runs, a
    line `still running` comes when nothing was written for `quiet_s`, at most once every
    `every_s`. `print` writes above the bars."""

    def __init__(
        self,
        console: Console,
        *,
        enabled: bool = True,
        quiet_s: float = 45.0,
        every_s: float = 60.0,
        min_s: float = 0.0,
        step_lines: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.console = console
        self.enabled = enabled
        self.bars: Progress | None = None
        if enabled and console.is_terminal:
            self.bars = Progress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=console,
            )
        self._tasks: dict[str, TaskID] = {}
        self.quiet_s = quiet_s
        self.every_s = every_s
        self.min_s = min_s
        self.step_lines = step_lines
        self.clock = clock
        self._steps: dict[str, _Step] = {}
        self._lock = threading.Lock()
        self._opened = self._last_line = clock()
        self._last_still: float | None = None

    def __call__(self, label: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        if self.bars is None:
            with self._lock:
                self._log(label, done, total)
            return
        key = label.split(":", 1)[0]
        if key not in self._tasks:
            self._tasks[key] = self.bars.add_task(label, total=total or None)
        self.bars.update(self._tasks[key], description=label, completed=done, total=total or None)

    def _log(self, label: str, done: int, total: int) -> None:
        now = self.clock()
        key, _, part = label.partition(": ")
        step = self._steps.get(key)
        if step is None:
            for name, other in list(self._steps.items()):
                if not other.counted:
                    self._finish(name, now)
            # A step first seen part-way (a count of finished parts) began with the work.
            began = self._opened if done and not part else now
            step = self._steps[key] = _Step(started=began)
        step.next_part(part or None, now)
        if not part:
            step.counted = step.counted or total > 0
            step.done, step.total = done, total
            if total and done >= total:
                self._finish(key, now)

    def _finish(self, key: str, now: float, *, ended: bool = False) -> None:
        step = self._steps.pop(key)
        step.next_part(None, now)
        notes = []
        if ended and step.total and step.done < step.total:
            notes.append(f"stopped at {step.done}/{step.total}")
        if step.parts > 1 and step.longest is not None and len(step.longest[0]) <= 40:
            notes.append(f"longest: {step.longest[0]} {step.longest[1]:.1f} s")
        if not self.step_lines or (now - step.started < self.min_s and not notes):
            return  # a step over in a moment says nothing a person needs
        tail = f" ({'; '.join(notes)})" if notes else ""
        # A step seen only through one part is named by it (`inputs: demo-data`).
        name = f"{key}: {step.longest[0]}" if step.parts == 1 and step.longest else key
        self._line(f"  {name}  {now - step.started:.1f} s{tail}", now)

    def _line(self, text: str, now: float) -> None:
        self._last_line = now
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)

    def tick(self) -> None:
        """In logs: write `still running` when a step runs on with nothing written for
        `quiet_s`, at most once every `every_s` (called by `progress_reporter`'s timer)."""
        with self._lock:
            now = self.clock()
            if not self._steps or now - self._last_line < self.quiet_s:
                return
            if self._last_still is not None and now - self._last_still < self.every_s:
                return
            key, step = list(self._steps.items())[-1]
            at = ""
            if step.part is not None:
                at = "; now " + (step.part if len(step.part) <= 60 else step.part[:57] + "...")
            self._last_still = now
            self._line(f"  {key}: still running ({now - step.started:.0f} s{at})", now)

    def close(self) -> None:
        """In logs: finish every step still open (the work ended)."""
        with self._lock:
            now = self.clock()
            for key in list(self._steps):
                self._finish(key, now, ended=True)

    def print(self, renderable: RenderableType) -> None:
        """Print a table or line above the bars."""
        self.console.print(renderable)


@contextmanager
def progress_reporter(
    console: Console = err,
    *,
    enabled: bool = True,
    min_s: float = 15.0,
    quiet_s: float = 90.0,
    every_s: float = 120.0,
    step_lines: bool = True,
) -> Iterator[Reporter]:
    """Progress for long work: a Reporter, live while the block runs (in logs, with a timer
    for its `still running` lines after `quiet_s` without a line, at most once every
    `every_s`; the steps still open are written when the block ends; steps over in less than
    `min_s` are not written: a log a person reads keeps the steps that took a while)."""
    rep = Reporter(
        console,
        enabled=enabled,
        min_s=min_s,
        quiet_s=quiet_s,
        every_s=every_s,
        step_lines=step_lines,
    )
    if rep.bars is not None:
        with rep.bars:
            yield rep
        return
    if not enabled:
        yield rep
        return
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(1.0):
            rep.tick()

    timer = threading.Thread(target=beat, name="progress-still-running", daemon=True)
    timer.start()
    try:
        yield rep
    finally:
        stop.set()
        timer.join()
        rep.close()
