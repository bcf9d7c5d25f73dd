"""MkDocs hook: the generated reference pages (commands, settings, benchmark result files)
and the committed benchmark result files that pages link to.

A page asks for generated text with a marker line, replaced at build time:

- `<!-- generated: commands -->`: every command of the `releasekit` app, recursively, with
  its help, arguments and options (type, default, bounds);
- `<!-- generated: settings -->`: `releasekit.config.Settings`, the deployment manifest
  (`releasekit.spec.manifest`) and the load profile (`releasekit.spec.loadprofile`), with
  every model they nest;
- `<!-- generated: benchmarks -->`: one row per `benchmarks/results/*.json`, with the host
  kind, CPU, date, commit and command its `run` block records.

The text depends only on the code and the committed files, never on the host that builds
it: defaults that are computed where releasekit runs (the project root, the interpreter)
are named, not shown.
"""

from __future__ import annotations

import inspect
import json
import re
import sys
import types
import typing
from collections.abc import Callable, Iterator
from enum import Enum
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
MARKER = re.compile(r"^<!-- generated: ([a-z]+) -->$", re.MULTILINE)


# -- mkdocs events ---------------------------------------------------------------------


def on_files(files: Any, config: Any) -> Any:
    """Add the committed benchmark result files, so pages can link to them."""
    from mkdocs.structure.files import File

    for path in sorted(RESULTS.glob("*.json")):
        uri = f"benchmarks/results/{path.name}"
        if files.get_file_from_path(uri) is None:
            files.append(File(uri, str(REPO), config["site_dir"], config["use_directory_urls"]))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Replace each marker line with its generated Markdown."""

    def replace(match: re.Match[str]) -> str:
        kind = match.group(1)
        if kind not in GENERATORS:
            raise ValueError(f"{page.file.src_uri}: no generator named {kind!r}")
        depth = page.file.src_uri.count("/")
        return GENERATORS[kind]("../" * depth)

    return MARKER.sub(replace, markdown)


# -- shared formatting -----------------------------------------------------------------


def cell(text: str) -> str:
    """Text fit for one Markdown table cell."""
    return " ".join(str(text).split()).replace("|", "\\|")


def code(value: str) -> str:
    """Inline code, with a fence long enough for the backticks inside."""
    ticks = "``" if "`" in value else "`"
    pad = " " if value.startswith("`") or value.endswith("`") else ""
    return f"{ticks}{pad}{value}{pad}{ticks}"


def prose(text: str) -> str:
    """Markdown-safe prose: `<`, `>` and `*` escaped outside code spans."""
    pieces = re.split(r"(`[^`]*`)", text)
    for i in range(0, len(pieces), 2):
        pieces[i] = pieces[i].replace("<", "&lt;").replace(">", "&gt;").replace("*", "\\*")
    return "".join(pieces)


def type_name(annotation: Any) -> str:
    """A readable name for a type annotation: `list[str]`, `int | None`, `"a" | "b"`."""
    if annotation is type(None):
        return "None"
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(type_name(a) for a in args)}]" if args else name
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def literal(value: Any) -> str:
    """A default value as it would be written (JSON-like), or how it is computed."""
    from pydantic import BaseModel

    if isinstance(value, Path) and value.is_absolute():
        if str(value) == sys.executable:
            return "the interpreter running releasekit"
        return "computed where releasekit runs"
    if isinstance(value, BaseModel):
        dumped = value.model_dump(mode="json", exclude_defaults=True, by_alias=True)
        return code(json.dumps(dumped)) if dumped else "its fields' defaults"
    if isinstance(value, Enum):
        value = value.value
    if isinstance(value, (list, tuple)) and any(isinstance(v, BaseModel) for v in value):
        value = [
            v.model_dump(mode="json", exclude_defaults=True, by_alias=True)
            if isinstance(v, BaseModel)
            else v
            for v in value
        ]
    if isinstance(value, Path):
        value = str(value)
    return code(json.dumps(value, default=str))


# -- commands --------------------------------------------------------------------------


def walk_commands(command: Any, path: list[str], ctx: Any) -> Iterator[tuple[list[str], Any]]:
    """Every command under `command` (itself first), depth first in the app's own order."""
    import typer

    yield path, command
    if hasattr(command, "list_commands"):
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            sub_ctx = typer.Context(sub, info_name=name, parent=ctx)
            yield from walk_commands(sub, [*path, name], sub_ctx)


def all_commands() -> list[tuple[list[str], Any]]:
    """(path, command) for the `releasekit` app and every command under it."""
    import typer
    import typer.main

    from releasekit.cli import app

    root = typer.main.get_command(app)
    return list(walk_commands(root, ["releasekit"], typer.Context(root, info_name="releasekit")))


def _help(text: str | None) -> str:
    lines = [ln for ln in inspect.cleandoc(text or "").splitlines() if ln.strip() != "\b"]
    return "\n".join(lines).strip()


def _param_type(param: Any) -> str:
    descriptor = getattr(param, "type_descriptor", None)
    annotation = getattr(descriptor, "annotation", None)
    if annotation is None:
        kind = getattr(param, "type", None)
        return str(getattr(kind, "name", "text"))
    if getattr(param, "nargs", 1) == -1 or getattr(param, "multiple", False):
        args = typing.get_args(annotation)
        if typing.get_origin(annotation) is list and args:
            return f"{type_name(args[0])}, repeatable"
    return type_name(annotation)


def _param_bounds(param: Any) -> str:
    low, high = getattr(param, "min", None), getattr(param, "max", None)
    parts = ([f"≥ {low}"] if low is not None else []) + ([f"≤ {high}"] if high is not None else [])
    return ", ".join(parts)


def _param_default(param: Any) -> str:
    if getattr(param, "required", False):
        return "required"
    default = param.default
    if callable(default):
        return "computed"
    if default is None or default == ():
        return ""
    return literal(list(default) if isinstance(default, tuple) else default)


def _param_name(param: Any) -> str:
    if getattr(param, "param_type_name", "") == "argument":
        name = param.name.upper()
        return f"{name}..." if param.nargs == -1 else name
    opts = " / ".join(param.opts + list(getattr(param, "secondary_opts", [])))
    return opts


def _usage(path: list[str], command: Any) -> str:
    pieces = [" ".join(path), "[OPTIONS]"]
    for param in command.params:
        if getattr(param, "param_type_name", "") != "argument" or param.hidden:
            continue
        name = _param_name(param)
        pieces.append(name if param.required else f"[{name}]")
    if hasattr(command, "list_commands"):
        pieces.append("COMMAND [ARGS]...")
    return " ".join(pieces)


def commands_markdown(up: str = "") -> str:
    """The command reference: one section per command, in the app's order."""
    out: list[str] = []
    for path, command in all_commands():
        out.append(f"## {' '.join(path)}\n")
        if command.hidden:
            out.append("*Internal: hidden from `--help`; DVC's build stages run it.*\n")
        out.append(f"```text\n{_usage(path, command)}\n```\n")
        if help_text := _help(command.help):
            out.append(prose(help_text) + "\n")
        if hasattr(command, "list_commands"):
            ctx_names = sorted(getattr(command, "commands", {}))
            subs = ", ".join(code(f"{' '.join(path)} {n}") for n in ctx_names)
            out.append(f"Commands: {subs}.\n")
        params = [p for p in command.params if not getattr(p, "hidden", False)]
        if params:
            out.append("| argument or option | type | default | bounds | help |")
            out.append("| --- | --- | --- | --- | --- |")
            for p in params:
                row = [
                    code(_param_name(p)),
                    cell(_param_type(p)),
                    cell(_param_default(p)),
                    cell(_param_bounds(p)),
                    prose(cell(getattr(p, "help", None) or "")),
                ]
                out.append("| " + " | ".join(row) + " |")
            out.append("")
    return "\n".join(out)


# -- settings and manifests ------------------------------------------------------------


def _models_in(annotation: Any) -> list[type]:
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found: list[type] = []
    for arg in typing.get_args(annotation):
        found += _models_in(arg)
    return found


def _where(annotation: Any, base: str, key: str) -> str:
    """The place a nested model's table sits, as a dotted path (`environments.NAME.ray`)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _where(inner[0], base, key) if len(inner) == 1 else f"{base}{key}"
    if origin is dict:
        return f"{base}{key}.NAME"
    if origin is list:
        return f"{base}{key}[]"
    return f"{base}{key}"


def walk_models(root: type, start: str) -> dict[type, list[str]]:
    """`root` and every pydantic model its fields nest, breadth first, each with the
    paths it is found at (`environments.NAME.ray`)."""
    seen: dict[type, list[str]] = {root: [start]}
    queue = [root]
    while queue:
        model = queue.pop(0)
        base = f"{seen[model][0]}." if seen[model][0] else ""
        for name, field in model.model_fields.items():  # type: ignore[attr-defined]
            key = field.alias or name
            for nested in _models_in(field.annotation):
                where = _where(field.annotation, base, key)
                if nested not in seen:
                    seen[nested] = [where]
                    queue.append(nested)
                elif where not in seen[nested]:
                    seen[nested].append(where)
    return seen


BOUNDS = (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<"))


def field_bounds(field: Any) -> str:
    """The bounds a field's metadata sets (Ge/Gt/Le/Lt, MinLen/MaxLen, a pattern)."""
    parts: list[str] = []
    for meta in field.metadata:
        for attr, sign in BOUNDS:
            if getattr(meta, attr, None) is not None:
                parts.append(f"{sign} {getattr(meta, attr)}")
        if getattr(meta, "min_length", None) is not None:
            parts.append(f"at least {meta.min_length} long")
        if getattr(meta, "max_length", None) is not None:
            parts.append(f"at most {meta.max_length} long")
        if getattr(meta, "pattern", None) is not None:
            parts.append(f"matches {code(meta.pattern)}")
    return ", ".join(parts)


def field_default(field: Any) -> str:
    """A field's default as written, `required`, or how it is computed."""
    from pydantic_core import PydanticUndefined

    factory: Callable[[], Any] | None = field.default_factory
    if factory is not None:
        if factory in (list, dict):
            return code("[]" if factory is list else "{}")
        value = factory()  # type: ignore[call-arg]
        if isinstance(value, Path):
            return f"computed where releasekit runs ({code(factory.__name__ + '()')})"
        return literal(value)
    if field.default is PydanticUndefined:
        return "required"
    return literal(field.default)


def _anchor(model: type) -> str:
    return model.__name__.lower()


def _type_cell(annotation: Any, documented: set[type]) -> str:
    text = cell(type_name(annotation))
    for model in _models_in(annotation):
        if model in documented:
            text = re.sub(rf"\b{model.__name__}\b", f"[{model.__name__}](#{_anchor(model)})", text)
    return text


def models_markdown(parts: list[tuple[str, type, str]], *, env_prefix: str | None = None) -> str:
    """Per part (a heading, a root model, what its top level is), one section per model it
    nests that no earlier part documented: where it sits, its docstring, a table of fields."""
    walks = [(heading, root, what, walk_models(root, "")) for heading, root, what in parts]
    places: dict[type, list[tuple[str, str]]] = {}
    for _, _, what, found in walks:
        for model, paths in found.items():
            places.setdefault(model, []).extend((what, p) for p in paths)
    documented = set(places)
    done: set[type] = set()
    out: list[str] = []
    for heading, root, _what, found in walks:
        out.append(f"## {heading}\n")
        for model in found:
            if model in done:
                continue
            done.add(model)
            out += _model_section(model, places[model], documented, root, env_prefix)
    return "\n".join(out)


def _model_section(
    model: type,
    places: list[tuple[str, str]],
    documented: set[type],
    root: type,
    env_prefix: str | None,
) -> list[str]:
    out = [f"### {model.__name__} {{#{_anchor(model)}}}\n"]
    where = "; ".join(f"{what}: {code(p)}" if p else f"{what}: the top level" for what, p in places)
    out.append(f"Where: {where}.\n")
    if model.__doc__ and not model.__doc__.startswith(model.__name__ + "("):
        out.append(prose(inspect.cleandoc(model.__doc__)) + "\n")
    out.append("| field | type | default | bounds | description |")
    out.append("| --- | --- | --- | --- | --- |")
    for name, field in model.model_fields.items():  # type: ignore[attr-defined]
        shown = code(field.alias or name)
        if env_prefix and model is root:
            shown += f"<br>{code(env_prefix + name.upper())}"
        row = [
            shown,
            _type_cell(field.annotation, documented),
            cell(field_default(field)),
            cell(field_bounds(field)),
            prose(cell(field.description or "")),
        ]
        out.append("| " + " | ".join(row) + " |")
    out.append("")
    return out


def settings_markdown(up: str = "") -> str:
    """The settings reference: `Settings` (releasekit.toml and RELEASEKIT_*), the deployment
    manifest, the load profile and the quantisation ladder file, with every model they nest."""
    from releasekit.config import Settings
    from releasekit.spec.ladder import Ladder
    from releasekit.spec.loadprofile import LoadProfile
    from releasekit.spec.manifest import Manifest

    return models_markdown(
        [
            ("releasekit.toml and RELEASEKIT_* variables", Settings, "releasekit.toml"),
            ("The deployment manifest", Manifest, "a manifest"),
            ("The load profile", LoadProfile, "a load profile"),
            ("The quantisation ladder file", Ladder, "a ladder file"),
        ],
        env_prefix="RELEASEKIT_",
    )


# -- benchmark result files ------------------------------------------------------------


def benchmarks_markdown(up: str = "") -> str:
    """One row per committed result file, from its `run` block."""
    out = [
        "| file | host kind | CPU, cores | date | commit | uncommitted changes | command |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for path in sorted(RESULTS.glob("*.json")):
        run = json.loads(path.read_text()).get("run") or {}
        host = run.get("host") or {}
        commit = str(run.get("releasekit_commit", "unknown"))
        row = [
            f"[{path.name}]({up}benchmarks/results/{path.name})",
            cell(host.get("kind", "unknown")),
            cell(f"{host.get('cpu_model', 'unknown')}, {host.get('cores', 'unknown')}"),
            cell(str(run.get("date", "unknown"))[:10]),
            code(commit[:12]) if commit != "unknown" else "unknown",
            cell(str(run.get("uncommitted_changes", "unknown")).lower()),
            code(cell(str(run.get("command", "unknown")))),
        ]
        out.append("| " + " | ".join(row) + " |")
    return "\n".join(out) + "\n"


GENERATORS: dict[str, Callable[[str], str]] = {
    "commands": commands_markdown,
    "settings": settings_markdown,
    "benchmarks": benchmarks_markdown,
}
