"""The package's imports point one way: no cycles, and no subpackage imports one above it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "releasekit"

# Heights, lowest first: a module may import its own subpackage and anything lower.
LAYERS: list[set[str]] = [
    {"errors"},
    {"config"},
    {"_support"},
    {"spec"},
    {"notify"},
    {"stores", "serving"},
    {"releases", "deploy", "bench", "evaluate"},
    {"promote", "build", "capacity"},
    {"watch", "ladder"},
    {"rollout"},
    {"audit"},
    {"cli", "__main__"},
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MAX_MODULE_LINES = 700


def _all_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of the tree, `if TYPE_CHECKING:` bodies included: a module that names
    another's type depends on it as much as one that calls it, so a circle of types is a
    circle."""
    return list(ast.walk(tree))


def _imports(path: Path, modules: set[str]) -> set[str]:
    """Every releasekit module a file imports, function bodies and type-only imports included."""
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found: set[str] = set()
    for node in _all_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            for a in node.names:
                # `from pkg import mod` imports the module pkg.mod; `from mod import name`, mod
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
    found = {m for m in found if m in modules}
    found.discard(me)
    return found


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PKG.rglob("*.py")}
    modules = set(files)
    return {name: _imports(path, modules) for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle in `graph` as a list of modules (first repeated at the end), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def _height(module: str) -> int:
    top = module.split(".")[1] if "." in module else "__init__"
    for i, layer in enumerate(LAYERS):
        if top in layer:
            return i
    raise AssertionError(f"{module}: subpackage {top!r} has no place in LAYERS")


def test_no_import_cycles() -> None:
    """No chain of imports, even inside functions or under TYPE_CHECKING, leads from a
    module back to itself."""
    cycle = find_cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_imports_point_down() -> None:
    """A subpackage imports only its own modules and those of lower layers."""
    wrong = []
    for mod, deps in _graph().items():
        if mod == "releasekit":
            continue
        for dep in deps:
            same = mod.split(".")[:2] == dep.split(".")[:2]
            if dep != "releasekit" and not same and _height(dep) >= _height(mod):
                wrong.append(f"{mod} -> {dep}")
    assert not wrong, "imports pointing up or sideways: " + ", ".join(sorted(wrong))


@pytest.mark.parametrize(
    ("graph", "expected"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
    ],
)
def test_cycle_finder_sees_cycles(graph: dict[str, set[str]], expected: list[str] | None) -> None:
    """The checker itself reports a planted cycle (so the real test can fail)."""
    assert find_cycle(graph) == expected


def test_function_body_import_counts(tmp_path: Path) -> None:
    """An import hidden inside a function body is part of the graph."""
    f = PKG / "spec" / "manifest.py"
    assert "releasekit.config" in _imports(f, set(_graph()))


def test_type_only_import_counts() -> None:
    """An import under `if TYPE_CHECKING:` is part of the graph (a circle of types is a circle)."""
    src = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import releasekit.config\n"
    nodes = _all_nodes(ast.parse(src))
    assert any(isinstance(n, ast.Import) and n.names[0].name == "releasekit.config" for n in nodes)


def test_no_module_over_700_lines() -> None:
    """Every module stays small enough to read in one sitting: at most 700 lines."""
    big = sorted(
        f"{p.relative_to(PKG.parent)} ({n} lines)"
        for p in PKG.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    )
    assert not big, f"modules over {MAX_MODULE_LINES} lines: " + ", ".join(big)
