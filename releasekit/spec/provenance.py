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
        dirty = repo.is_dirty(untracked_files=False)
    except git.GitCommandError as exc:
        raise GitError(f"cannot read git state at {root}: {exc.stderr.strip()}") from exc
    return Provenance(commit=commit, branch=branch, dirty=dirty, author=git_identity(root))
