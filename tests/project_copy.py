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
    publish(dst)
    return dst


def _git(project: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(project), *args], check=True, capture_output=True, text=True
    ).stdout


def publish(project: Path) -> Path:
    """Set up `project` (a git repository with a commit) the way a team has it: a bare
    repository beside it stands for the team's server (`origin`), the current branch is
    pushed there and tracks it, so its commits are on the protected ref
    (`refs/remotes/origin/<branch>`, releasekit.stores.trust) that policy, keys and
    approvers are read from. Returns the bare repository."""
    origin = project.parent / f"{project.name}-origin.git"
    _git(project.parent, "init", "-q", "--bare", str(origin))
    _git(project, "remote", "add", "origin", str(origin))
    branch = _git(project, "symbolic-ref", "--short", "HEAD").strip()
    _git(project, "push", "-q", "-u", "origin", f"HEAD:refs/heads/{branch}")
    return origin


def land(project: Path) -> None:
    """Land the current branch's new commits on the protected ref: push them to the branch's
    upstream (a reviewed merge, as far as releasekit can tell), which also moves the fetched
    `refs/remotes/origin/<branch>`."""
    _git(project, "push", "-q")


def commit_and_land(project: Path, message: str, *paths: str) -> None:
    """Commit `paths` as Test and land the commit (`land`)."""
    ident = ["-c", "user.name=Test", "-c", "user.email=t@example.com"]
    _git(project, "add", "--", *paths)
    _git(project, *ident, "commit", "-qm", message)
    land(project)
