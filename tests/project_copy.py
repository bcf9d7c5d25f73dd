"""A throwaway copy of the project for a test: its manifests, prompts and pipelines in a
fresh git repository, the demo model linked."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEMO_MODEL = REPO / "models" / "demo-base"


def make_project(dst: Path) -> Path:
    """A throwaway copy of the project's manifests, prompts and pipelines in a fresh git
    repository at `dst`; the demo model folder is linked, not copied."""
    dst.mkdir()
    for name in ("manifests", "prompts", "pipelines"):
        shutil.copytree(REPO / name, dst / name, ignore=shutil.ignore_patterns("*.lock.json"))
    (dst / "models").mkdir()
    if DEMO_MODEL.is_dir():
        (dst / "models" / "demo-base").symlink_to(DEMO_MODEL, target_is_directory=True)
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "Test",
        "GIT_AUTHOR_EMAIL": "t@example.com",
        "GIT_COMMITTER_NAME": "Test",
        "GIT_COMMITTER_EMAIL": "t@example.com",
    }
    subprocess.run(["git", "init", "-q"], cwd=dst, check=True)
    subprocess.run(["git", "add", "-A"], cwd=dst, check=True, env=env)
    subprocess.run(["git", "commit", "-qm", "init"], cwd=dst, check=True, env=env)
    return dst
