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
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
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
) -> None:
    """Print a table on stdout: rich on a terminal; piped, records when it would not fit
    (see the module docstring). The title and the cells are plain text (no markup);
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


class Reporter:
    """A progress(label, done, total) callback for the core, drawn as rich bars on a
    terminal (one row per label prefix, the text before ':'; total 0 = unknown) and as
    one line per step started and finished in logs and CI, where bars don't render.
    `print` writes above the bars."""

    def __init__(self, console: Console, *, enabled: bool = True) -> None:
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
        self._seen: set[tuple[str, bool]] = set()

    def __call__(self, label: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        if self.bars is None:
            finished = bool(total) and done >= total
            if (label, finished) not in self._seen:
                self._seen.add((label, finished))
                self.console.print(f"{'done' if finished else '...'}  {label}", highlight=False)
            return
        key = label.split(":", 1)[0]
        if key not in self._tasks:
            self._tasks[key] = self.bars.add_task(label, total=total or None)
        self.bars.update(self._tasks[key], description=label, completed=done, total=total or None)

    def print(self, renderable: RenderableType) -> None:
        """Print a table or line above the bars."""
        self.console.print(renderable)


@contextmanager
def progress_reporter(console: Console = err, *, enabled: bool = True) -> Iterator[Reporter]:
    """Progress for long work: a Reporter, live while the block runs."""
    rep = Reporter(console, enabled=enabled)
    if rep.bars is None:
        yield rep
        return
    with rep.bars:
        yield rep
