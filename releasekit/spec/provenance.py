"""Git provenance of a lock: commit, dirty state, author. Recorded, never hashed into ids."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel

from releasekit.errors import GitError


class Provenance(BaseModel):
    """Where a lock came from; `commit` is None outside a git repository."""

    commit: str | None = None
    branch: str | None = None
    dirty: bool | None = None
    author: str | None = None


def git_identity(root: Path) -> str | None:
    """`user.name <user.email>` from git config, or None."""
    try:
        import git

        reader = git.Repo(root, search_parent_directories=True).config_reader()
        name = reader.get_value("user", "name", default="")
        email = reader.get_value("user", "email", default="")
    except Exception:  # no repo, no config: identity is optional
        return None
    ident = f"{name} <{email}>" if email else str(name)
    return ident.strip() or None


def actor(root: Path, configured: str | None = None) -> str:
    """Who acts: RELEASEKIT_ACTOR / settings, then git identity, then the OS user."""
    return (
        configured
        or os.environ.get("RELEASEKIT_ACTOR")
        or git_identity(root)
        or os.environ.get("USER")
        or "unknown"
    )


def _is_lock_output(path: str) -> bool:
    name = path.rsplit(" -> ", 1)[-1].rsplit("/", 1)[-1]
    return name.endswith(".lock.json") or name == "dvc.lock"


def read_provenance(root: Path) -> Provenance:
    """Read commit, branch, dirty flag and author of the repository at `root`."""
    try:
        import git
    except ImportError as exc:  # pragma: no cover - dependency is pinned
        raise GitError("GitPython is not installed") from exc
    try:
        repo = git.Repo(root, search_parent_directories=True)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError):
        return Provenance(author=git_identity(root))
    try:
        commit = repo.head.commit.hexsha if repo.head.is_valid() else None
        branch = None if repo.head.is_detached else repo.active_branch.name
        # Lock files and dvc.lock are what locking and building write, not inputs: a tree
        # whose only changes are those is as clean as its commit.
        changed = repo.git.status("--porcelain", "--untracked-files=no").splitlines()
        dirty = any(not _is_lock_output(line[3:].strip().strip('"')) for line in changed)
    except git.GitCommandError as exc:
        raise GitError(f"cannot read git state at {root}: {exc.stderr.strip()}") from exc
    return Provenance(commit=commit, branch=branch, dirty=dirty, author=git_identity(root))
