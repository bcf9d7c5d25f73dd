"""The one loader of the package's page templates (Jinja2): autoescaped, strict about names.

Each layer keeps its templates in a `templates/` folder beside its modules and renders them
through one `Templates` object, which searches its own folder first, then the folders it is
given (a lower layer's, whose page layout and sections it reuses), then this package's
`templates/` (the bare page layout every page extends):

    TEMPLATES = Templates(Path(__file__).parent / "templates", filters={"pct": pct})
    page = TEMPLATES.render("report.html", report=report)

Autoescape is on for every template but `.md` and `.txt` ones, and for templates built from
strings; a name a template reads that the context lacks is an error (StrictUndefined), never
an empty cell. A value already escaped (`Markup`, what `render_markup` returns) is inserted
as it is."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
from markupsafe import Markup

__all__ = ["Markup", "Templates"]

SHARED = Path(__file__).resolve().parent / "templates"
"""The layout every page extends (`page.html`)."""


def fmt(value: float, spec: str) -> str:
    """`value` formatted by the format spec `spec` (the filter `fmt`: `{{ x | fmt('.1%') }}`)."""
    return format(value, spec)


def num(value: float | None) -> str:
    """A figure in four significant digits, "-" for none (the filter `num`)."""
    return "-" if value is None else f"{value:.4g}"


FILTERS: dict[str, Callable[..., Any]] = {"fmt": fmt, "num": num}
"""The filters every template set has."""


class Templates:
    """A set of templates: `folder` first, then `below` (lower layers' folders), then the
    shared layout. Nothing is read until the first render."""

    def __init__(
        self,
        folder: Path,
        *,
        below: Sequence[Path] = (),
        filters: Mapping[str, Callable[..., Any]] | None = None,
        globals: Mapping[str, Any] | None = None,
    ) -> None:
        self.folders = [folder, *below, SHARED]
        self._filters = {**FILTERS, **(filters or {})}
        self._globals = dict(globals or {})

    @functools.cached_property
    def env(self) -> jinja2.Environment:
        """The Jinja2 environment (built on first use)."""
        env = jinja2.Environment(
            loader=jinja2.FileSystemLoader([str(f) for f in self.folders]),
            autoescape=jinja2.select_autoescape(
                enabled_extensions=("html",),
                disabled_extensions=("md", "txt"),
                default_for_string=True,
                default=True,
            ),
            undefined=jinja2.StrictUndefined,
            keep_trailing_newline=True,
        )
        env.filters.update(self._filters)
        env.globals.update(self._globals)
        return env

    def render(self, name: str, /, **context: Any) -> str:
        """The template `name` rendered with `context`."""
        return self.env.get_template(name).render(**context)

    def render_markup(self, name: str, /, **context: Any) -> Markup:
        """`render` as markup another template inserts without escaping it again (a page
        section)."""
        return Markup(self.render(name, **context))
