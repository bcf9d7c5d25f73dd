"""An environment's policy, read from a committed revision of releasekit.toml.

What may go live in an environment (`POLICY_FIELDS` of `[environments.NAME]`: whether gates
block, the environments a release must pass first, approvals, `perf_by_canary`, the smoke
suite, the quality floors and margin ceilings, the perf tolerance ceilings and the spread
cap) belongs to the environment, not to whoever runs one command. It is read the way the
ledger's trusted keys are (`releasekit.stores.signing.trusted_keys`): from releasekit.toml as
committed at the `trusted_keys_rev` revision (HEAD by default, e.g. a protected branch),
never from the working tree alone.

    policy = environment_policy(settings, "staging", cfg)     # PolicyError on a mismatch

Rules:
- in a git repository, the settings this command runs with (releasekit.toml on disk, any
  RELEASEKIT_* variable, a file RELEASEKIT_CONFIG points at) must give the environment the
  same policy as the committed file; a difference is refused with one line naming the
  fields that differ (commit the change, reviewed, to change the policy). An environment,
  or a releasekit.toml, that is not committed at that revision is refused the same way;
- outside a git repository there is no committed revision: the policy on disk is used and
  recorded as `uncommitted` (the same rule as the trusted keys, which are then read from the
  `keys/` folder as it is);
- every promote, gate_failed and rollback event carries the policy it was decided by and
  its source (`EnvironmentPolicy.evidence`): revision, commit and digest.

Rollback records its policy without refusing (`read_policy`): a way back must always work.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError

from releasekit._support.digests import digest_obj
from releasekit.config import CONFIG_FILE, POLICY_FIELDS, EnvironmentConfig, Settings
from releasekit.errors import ConfigError
from releasekit.stores.anchor import git_dir, read_committed_file, resolve_commit


class PolicyError(ConfigError):
    """Raised when an environment's policy for this command is not the committed one: a
    field differs (a RELEASEKIT_* variable, an uncommitted edit, another config file), or
    the environment or releasekit.toml is not committed at the policy revision."""

    remedy = (
        "commit the policy change to releasekit.toml (reviewed like code), or unset the "
        "variable or edit that changes it for this command"
    )


class PolicySource(BaseModel):
    """Where an environment's policy came from."""

    kind: Literal["committed", "uncommitted"]
    path: str = Field(CONFIG_FILE, description="the file, relative to the project root")
    rev: str | None = Field(None, description="the revision named (setting trusted_keys_rev)")
    commit: str | None = Field(None, description="the commit it resolved to")
    digest: str = Field(description="sha256 of the policy's canonical JSON")
    note: str = ""


class EnvironmentPolicy(BaseModel):
    """An environment's policy as a command applies it, with its source; `differs` names
    the fields where this command's settings disagree with the committed policy (empty
    when they agree, or when nothing is committed to compare with). A source of kind
    `uncommitted` with a `rev` is a git repository where the policy is not committed."""

    environment: str
    policy: dict[str, Any]
    source: PolicySource
    differs: list[str] = Field(default_factory=list)

    def evidence(self) -> dict[str, Any]:
        """What a ledger event records: the policy, its source, and any difference."""
        out: dict[str, Any] = {
            "policy": self.policy,
            "source": self.source.model_dump(mode="json", exclude_defaults=True),
        }
        if self.differs:
            out["differs_from_committed"] = self.differs
        return out

    @property
    def where(self) -> str:
        """The source in words: `releasekit.toml at HEAD (0123abcd4567)`."""
        s = self.source
        if s.kind == "uncommitted":
            return f"{s.path} (uncommitted{': ' + s.note if s.note else ''})"
        return f"{s.path} at {s.rev} ({(s.commit or '')[:12]})"


def _in_git(root: Path) -> bool:
    return root.is_dir() and git_dir(root) is not None


def _committed_table(
    root: Path, rev: str, env: str
) -> tuple[str, dict[str, Any] | None, str | None]:
    """(commit, the environment's committed table or None, why not)."""
    commit = resolve_commit(root, rev) or ""
    if not commit:
        return "", None, f"revision {rev} does not resolve (nothing committed yet?)"
    shown = read_committed_file(root, commit, CONFIG_FILE)
    if shown is None:
        return commit, None, f"{CONFIG_FILE} is not committed at {rev} ({commit[:12]})"
    try:
        data = tomllib.loads(shown.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise PolicyError(
            f"{CONFIG_FILE} at {rev} ({commit[:12]}) is not valid TOML: {exc}",
            remedy=f"fix {CONFIG_FILE} and commit it",
        ) from exc
    table = (data.get("environments") or {}).get(env)
    if not isinstance(table, dict):
        return commit, None, f"environment {env!r} is not in {CONFIG_FILE} at {rev} ({commit[:12]})"
    return commit, table, None


def read_policy(settings: Settings, env: str, cfg: EnvironmentConfig) -> EnvironmentPolicy:
    """The policy `cfg` (this command's settings for `env`) applies, with its source and the
    fields where it differs from the committed policy; never raises for a difference (see
    `environment_policy` for the refusing form)."""
    mine = cfg.policy()
    root, rev = settings.root, settings.trusted_keys_rev
    if not _in_git(root):
        return EnvironmentPolicy(
            environment=env,
            policy=mine,
            source=PolicySource(
                kind="uncommitted", digest=digest_obj(mine), note="not a git repository"
            ),
        )
    commit, table, why = _committed_table(root, rev, env)
    if table is None:
        return EnvironmentPolicy(
            environment=env,
            policy=mine,
            source=PolicySource(
                kind="uncommitted",
                rev=rev,
                commit=commit or None,
                digest=digest_obj(mine),
                note=why or "",
            ),
        )
    try:
        committed = EnvironmentConfig.model_validate(table).policy()
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
        )
        raise PolicyError(
            f"[environments.{env}] in {CONFIG_FILE} at {rev} ({commit[:12]}) is invalid: "
            f"{problems}",
            remedy=f"fix {CONFIG_FILE} and commit it",
        ) from exc
    differs = [f for f in POLICY_FIELDS if mine.get(f) != committed.get(f)]
    return EnvironmentPolicy(
        environment=env,
        policy=mine,
        source=PolicySource(kind="committed", rev=rev, commit=commit, digest=digest_obj(committed)),
        differs=differs,
    )


def environment_policy(settings: Settings, env: str, cfg: EnvironmentConfig) -> EnvironmentPolicy:
    """The committed policy of `env`, which this command's settings `cfg` must match;
    PolicyError naming the fields that differ (or saying what is not committed)."""
    pol = read_policy(settings, env, cfg)
    if pol.source.kind == "uncommitted" and pol.source.rev is not None:
        raise PolicyError(
            f"{env}'s policy is not committed: {pol.source.note}; a promotion is decided by "
            f"the policy committed at {settings.trusted_keys_rev}",
            remedy=f"commit {CONFIG_FILE} with [environments.{env}] (reviewed like code)",
        )
    if pol.differs:
        raise PolicyError(
            f"{env}'s policy for this command differs from {pol.where} in "
            f"{', '.join(pol.differs)}: a policy is changed by a commit, not for one command"
        )
    return pol
