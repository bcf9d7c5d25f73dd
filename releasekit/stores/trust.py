"""The trust root: the one committed revision that policy, trusted keys and approvers are
read from, and the protected ref it must be reachable from.

No command, variable or config file chooses it for one run. The rules:

- **The protected ref** is the current branch's upstream remote-tracking branch (e.g.
  `refs/remotes/origin/main` after `git push -u origin main`): the branch as last fetched
  from the team's server, where commits land through review. Where the branch tracks no
  remote branch (a detached CI checkout, a branch never pushed), it is the ref named by
  `[trust] protected_revision` in releasekit.toml **as committed at HEAD** (never the
  working tree, a RELEASEKIT_* variable or RELEASEKIT_CONFIG): a remote-tracking branch
  (`origin/main`, `refs/remotes/origin/main`) or a tag (`refs/tags/reviewed`). A local
  branch, `HEAD` or a bare commit id is refused there: a commit cannot name a ref that
  would let it vouch for itself.
- **The trust commit** (`TrustRoot.commit`) is HEAD's commit when HEAD is reachable from
  the protected ref (equal to it, or an ancestor of it: a checkout behind the fetched
  branch). When HEAD is not (a local commit not yet landed), it is the protected ref's
  commit: a local commit never adds a trusted key, an approver or a looser policy. Where
  no protected ref is configured it is HEAD (so an ungated project keeps working), and
  `problem` says why a gated environment is refused.
- **Gated environments** (`gates_required` or `requires_approval` true, as committed at
  the trust commit or at HEAD, or in the command's settings) need a trust commit that is
  HEAD on the protected ref: `require_trusted` refuses, in one line, a HEAD that is not on
  it (naming the commit), a project with no protected ref, and a folder outside git.
  Environments with neither keep working anywhere: their policy is read at HEAD (outside
  git: from the file on disk) and recorded with its source.
- Every git read here runs with `GIT_NO_REPLACE_OBJECTS=1` (`releasekit.stores.anchor`):
  a `git replace` that swaps in a relaxed releasekit.toml is not seen.

    root = trust_root(settings.root)       # TrustRoot(commit=..., protected_ref=..., ...)
    table = committed_config(settings.root, root.commit)   # releasekit.toml at that commit
    require_trusted(settings.root, "production", cfg)      # TrustRootError when gated
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field

from releasekit.config import CONFIG_FILE
from releasekit.config.lanes import parent_env
from releasekit.errors import ConfigError
from releasekit.stores.anchor import (
    git_dir,
    is_ancestor,
    read_committed_file,
    resolve_commit,
    symbolic_full_name,
)

if TYPE_CHECKING:
    from releasekit.config import EnvironmentConfig

TRUST_TABLE = "trust"
PROTECTED_KEY = "protected_revision"
_PROTECTED_PREFIXES = ("refs/remotes/", "refs/tags/")


class TrustRootError(ConfigError):
    """Raised when the trust revision cannot be established for an environment with gates
    or approvals: HEAD is not on the protected ref, none is configured, or the project is
    not a git repository (see the module docstring)."""

    remedy = "land the commit on the protected ref (reviewed), then fetch"


class TrustRoot(BaseModel):
    """Where policy, trusted keys and approvers come from for this project."""

    commit: str | None = Field(None, description="the commit read (None outside git)")
    rev: str = Field("HEAD", description="the revision named")
    protected_ref: str | None = Field(None, description="the ref it is reachable from")
    in_git: bool = True
    head: str | None = Field(None, description="HEAD's commit (None outside git)")
    on_protected: bool = Field(False, description="HEAD is reachable from protected_ref")
    how: Literal["upstream", "committed", "none"] = Field(
        "none",
        description="how the protected ref was found: the branch's upstream, [trust] "
        "protected_revision committed at HEAD, or not at all",
    )
    problem: str | None = Field(
        None, description="why an environment with gates or approvals is refused (one line)"
    )
    remedy: str | None = None

    @property
    def protected_name(self) -> str | None:
        """The protected ref as people write it: `origin/main`, `refs/tags/reviewed`."""
        if self.protected_ref is None:
            return None
        return self.protected_ref.removeprefix("refs/remotes/")


def trust_root(root: Path) -> TrustRoot:
    """The trust revision of the project at `root` (never raises for a missing protected
    ref: `problem` says what a gated environment would be refused for)."""
    if not root.is_dir() or git_dir(root) is None:
        return TrustRoot(
            commit=None,
            in_git=False,
            problem=f"{root} is not a git repository",
            remedy="run it in the project's git clone, with the team's remote fetched",
        )
    head = resolve_commit(root, "HEAD")
    if head is None:
        return TrustRoot(
            commit=None,
            problem=f"{root} has no commit yet",
            remedy=f"commit {CONFIG_FILE} and keys/, push them to the team's remote",
        )
    ref, how, why = _protected_ref(root, head)
    if ref is None:
        return TrustRoot(
            commit=head,
            head=head,
            problem=why,
            remedy=(
                "push the branch and track it (`git push -u origin BRANCH`), or commit "
                f'[{TRUST_TABLE}] {PROTECTED_KEY} = "origin/main" in {CONFIG_FILE} and fetch'
            ),
        )
    name = ref.removeprefix("refs/remotes/")
    tip = resolve_commit(root, ref)
    if tip is None:
        return TrustRoot(
            commit=head,
            head=head,
            protected_ref=ref,
            how=how,
            problem=f"the protected ref {name} names no commit here",
            remedy=f"fetch it (`git fetch`), so {name} is there to check against",
        )
    if head == tip or is_ancestor(root, head, tip):
        return TrustRoot(
            commit=head, rev="HEAD", protected_ref=ref, head=head, on_protected=True, how=how
        )
    return TrustRoot(
        commit=tip,
        rev=name,
        protected_ref=ref,
        head=head,
        how=how,
        problem=(
            f"commit {head[:12]} is not on the protected ref {name}: policy, keys and "
            "approvers come only from commits that landed there"
        ),
        remedy=(
            f"land the commit on {name} (push it through review), then `git fetch`; or check "
            f"out a commit that is on {name}"
        ),
    )


def _protected_ref(
    root: Path, head: str
) -> tuple[str | None, Literal["upstream", "committed", "none"], str]:
    """(the protected ref's full name or None, how it was found, why none)."""
    upstream = symbolic_full_name(root, "@{upstream}")
    if upstream is not None and upstream.startswith("refs/remotes/"):
        return upstream, "upstream", ""
    table = committed_config(root, head) or {}
    trust = table.get(TRUST_TABLE)
    named = trust.get(PROTECTED_KEY) if isinstance(trust, Mapping) else None
    if named is None:
        return (
            None,
            "none",
            "no protected ref configured: the current branch tracks no remote branch and "
            f"{CONFIG_FILE} at HEAD ({head[:12]}) names no [{TRUST_TABLE}] {PROTECTED_KEY}",
        )
    if not isinstance(named, str) or not named.strip():
        return None, "none", f"[{TRUST_TABLE}] {PROTECTED_KEY} in {CONFIG_FILE} is not a ref name"
    full = None if named.strip().startswith("-") else symbolic_full_name(root, named.strip())
    if full is None or not full.startswith(_PROTECTED_PREFIXES):
        return (
            None,
            "none",
            f"[{TRUST_TABLE}] {PROTECTED_KEY} = {named!r} in {CONFIG_FILE} at HEAD is not a "
            "remote-tracking branch or tag here (fetch it; a local branch, HEAD or a commit "
            "id cannot be the protected ref)",
        )
    return full, "committed", ""


def committed_config(root: Path, commit: str) -> dict[str, Any] | None:
    """releasekit.toml as committed at `commit`, parsed; None when not committed there."""
    data = read_committed_file(root, commit, CONFIG_FILE)
    if data is None:
        return None
    try:
        return tomllib.loads(data.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise TrustRootError(
            f"{CONFIG_FILE} at {commit[:12]} is not valid TOML: {exc}",
            remedy=f"fix {CONFIG_FILE} and commit it",
        ) from exc


def is_gated(table: Mapping[str, Any] | EnvironmentConfig | None) -> bool:
    """True when an environment (a committed `[environments.NAME]` table or a config) has
    gates or approvals: `gates_required` (true unless set false) or `requires_approval`."""
    if table is None:
        return False
    if isinstance(table, Mapping):
        return table.get("gates_required", True) is not False or bool(
            table.get("requires_approval", False)
        )
    return bool(table.gates_required or table.requires_approval)


def _committed_env(root: Path, commit: str | None, env: str) -> Mapping[str, Any] | None:
    if commit is None:
        return None
    try:
        data = committed_config(root, commit) or {}
    except TrustRootError:
        return None
    envs = data.get("environments")
    table = envs.get(env) if isinstance(envs, Mapping) else None
    return table if isinstance(table, Mapping) else None


def env_gated(
    root: Path, env: str, cfg: EnvironmentConfig | None = None, tr: TrustRoot | None = None
) -> bool:
    """True when `env` has gates or approvals anywhere that counts: as committed at the
    trust commit, as committed at HEAD, or in this command's settings `cfg` (an adapter
    lane's are its environment's)."""
    env = parent_env(env)
    if is_gated(cfg):
        return True
    tr = tr or trust_root(root)
    return any(is_gated(_committed_env(root, c, env)) for c in {tr.commit, tr.head} if c)


def require_trusted(root: Path, env: str, cfg: EnvironmentConfig | None = None) -> TrustRoot:
    """The trust root, for a decision in `env`; TrustRootError (one line) when `env` has
    gates or approvals and HEAD is not a commit on the protected ref (or there is none, or
    no git repository)."""
    tr = trust_root(root)
    if tr.problem is None or not env_gated(root, env, cfg, tr):
        return tr
    if not tr.in_git:
        raise TrustRootError(
            f"{env} has gates or approvals, and {tr.problem}: its policy, keys and approvers "
            "are read only from a commit on a protected ref",
            remedy=tr.remedy,
        )
    raise TrustRootError(
        f"{tr.problem} (refusing {env}, which has gates or approvals)", remedy=tr.remedy
    )
