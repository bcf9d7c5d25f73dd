"""The documentation site builds in strict mode with every page, its generated references
name every command and setting, a dead link fails the build naming the page and the link,
and the README stays a short front page whose links resolve."""

from __future__ import annotations

import html
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
PAGES = [
    "index.md",
    "install.md",
    "tutorial.md",
    "adopt.md",
    "concepts/releases.md",
    "concepts/gates.md",
    "concepts/progressive-delivery.md",
    "concepts/live-answers.md",
    "concepts/live-quality.md",
    "concepts/adapters.md",
    "concepts/ledger.md",
    "concepts/scale-out.md",
    "threat-models.md",
    "benchmarks.md",
    "gpu-hosts.md",
    "reference/commands.md",
    "reference/settings.md",
    "reference/layout.md",
]
HEADING = re.compile(r"<h([23])[^>]*>(.*?)</h\1>", re.DOTALL)
TAG = re.compile(r"<[^>]+>")


def _mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        capture_output=True,
        text=True,
        env=env,
        cwd=config.parent,
        timeout=300,
        check=False,
    )


def _page(site: Path, src: str) -> Path:
    """The HTML file a docs/ page builds to (directory URLs)."""
    stem = src.removesuffix(".md")
    return site / ("index.html" if stem == "index" else f"{stem}/index.html")


def _headings(page: Path, level: str) -> list[str]:
    found = HEADING.findall(page.read_text())
    texts = [html.unescape(TAG.sub("", text)) for lv, text in found if lv == level]
    return [t.replace("\u00b6", "").strip() for t in texts]


def _walk(command: Any, path: list[str], ctx: Any) -> Iterator[str]:
    import typer

    yield " ".join(path)
    if hasattr(command, "list_commands"):
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            yield from _walk(sub, [*path, name], typer.Context(sub, info_name=name, parent=ctx))


def _app_commands() -> list[str]:
    import typer
    import typer.main

    from releasekit.cli import app

    root = typer.main.get_command(app)
    return list(_walk(root, ["releasekit"], typer.Context(root, info_name="releasekit")))


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site") / "site"
    res = _mkdocs_build(REPO / "mkdocs.yml", out)
    assert res.returncode == 0, res.stderr[-3000:]
    return out


def test_the_strict_build_writes_every_page(site: Path) -> None:
    """`mkdocs build --strict` writes the tutorial, adopt, concept, threat-model, benchmarks
    and reference pages, and the result files the pages link to."""
    for src in PAGES:
        assert _page(site, src).is_file(), src
    for result in (REPO / "benchmarks" / "results").glob("*.json"):
        assert (site / "benchmarks" / "results" / result.name).is_file(), result.name


def test_the_command_reference_names_every_command(site: Path) -> None:
    """One section per command and subcommand of the typer app, walked here too."""
    got = _headings(_page(site, "reference/commands.md"), "2")
    assert set(_app_commands()) <= set(got)
    assert "releasekit promote" in got and "releasekit shadow compare" in got


def test_the_settings_reference_names_every_field(site: Path) -> None:
    """Every field of Settings, of an environment's table and of a manifest is in a table."""
    from releasekit.config import EnvironmentConfig, Settings
    from releasekit.spec.manifest import Manifest

    text = _page(site, "reference/settings.md").read_text()
    for model in (Settings, EnvironmentConfig, Manifest):
        for name, field in model.model_fields.items():
            assert f"<code>{field.alias or name}</code>" in text, f"{model.__name__}.{name}"
    assert "<code>RELEASEKIT_LEDGER_URL</code>" in text


def test_the_benchmarks_page_lists_every_result_file_with_its_host_kind(site: Path) -> None:
    text = _page(site, "benchmarks.md").read_text()
    for result in (REPO / "benchmarks" / "results").glob("*.json"):
        assert f">{result.name}</a>" in text, result.name


def _hook() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hook", DOCS / "_hooks" / "generated.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_text_is_the_same_every_time_and_names_no_host_path() -> None:
    hook = _hook()
    for name, generate in hook.GENERATORS.items():
        first = generate("")
        assert first == generate(""), name
        assert str(REPO) not in first and sys.executable not in first, name


def test_a_dead_link_fails_the_strict_build_naming_the_page_and_the_link(
    tmp_path: Path,
) -> None:
    shutil.copytree(DOCS, tmp_path / "docs")
    page = tmp_path / "docs" / "concepts" / "gates.md"
    page.write_text(page.read_text() + "\nSee [the missing page](no-such-page.md).\n")
    config = (REPO / "mkdocs.yml").read_text()
    hook = "docs/_hooks/generated.py"
    assert f"- {hook}" in config
    (tmp_path / "mkdocs.yml").write_text(config.replace(f"- {hook}", f"- {REPO / hook}"))
    res = _mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert res.returncode != 0
    assert (
        "Doc file 'concepts/gates.md' contains a link 'no-such-page.md', but the target "
        "'concepts/no-such-page.md' is not found among documentation files."
    ) in res.stderr, res.stderr[-3000:]


def test_the_readme_is_a_short_front_page_whose_links_resolve() -> None:
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    local = [ln.split("#", 1)[0] for ln in links if not re.match(r"[a-z]+:", ln)]
    assert local, "the README links nowhere"
    missing = sorted({ln for ln in local if ln and not (REPO / ln).exists()})
    assert missing == [], missing
    assert "bash scripts/test.sh" in text and "bash scripts/demo.sh" in text
    assert ".venv/bin/mkdocs serve" in text
