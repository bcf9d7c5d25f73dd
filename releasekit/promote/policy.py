"""An environment's policy, read from a committed revision of releasekit.toml.

What may go live in an environment (`POLICY_FIELDS` of `[environments.NAME]`: whether gates
block, the environments a release must pass first, approvals, `perf_by_canary`, the smoke
suite, the quality floors and margin ceilings, the perf tolerance ceilings and the spread
cap) belongs to the environment, not to whoever runs one command. It is read the way the
ledger's trusted keys are (`releasekit.stores.signing.trusted_keys`): from releasekit.toml as
committed at the trust commit (`releasekit.stores.trust`: HEAD when it is on the protected
ref, the branch as fetched from the team's remote), never from the working tree alone, and
no variable, flag or config file names another revision.

    policy = environment_policy(settings, "staging", cfg)     # PolicyError on a mismatch

Rules:
- an environment with gates or approvals (`gates_required`, true unless set false, or
  `requires_approval`) is decided only from a commit on the protected ref: a HEAD that is
  not there (a local commit not landed), a project with no protected ref, or a folder
  outside git is refused with one line (TrustRootError) naming the commit or what is
  missing. An environment with neither is read at HEAD (outside git: from the file on
  disk, recorded as `uncommitted`);
- in a git repository, the settings this command runs with (releasekit.toml on disk, any
  RELEASEKIT_* variable, a file RELEASEKIT_CONFIG points at) must give the environment the
  same policy as the committed file; a difference is refused with one line naming the
  fields that differ (commit the change, reviewed, to change the policy). An environment,
  or a releasekit.toml, that is not committed at that revision is refused the same way;
- every promote, gate_failed and rollback event carries the policy it was decided by and
  its source (`EnvironmentPolicy.evidence`): revision, commit, protected ref and digest;
  `ledger verify --remote` recomputes each digest at its recorded commit
  (`check_recorded_policies`).

Rollback records its policy without refusing (`read_policy`): a way back must always work.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field, ValidationError

from releasekit._support.digests import digest_obj
from releasekit.config import CONFIG_FILE, POLICY_FIELDS, EnvironmentConfig, Settings
from releasekit.config.lanes import parent_env
from releasekit.errors import ConfigError
from releasekit.stores.anchor import is_ancestor, remote_head_ref, resolve_commit
from releasekit.stores.trust import (
    TrustRootError,
    committed_config,
    env_gated,
    require_trusted,
    trust_root,
)

if TYPE_CHECKING:
    from releasekit.stores.ledger import Ledger, VerifyResult


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
    rev: str | None = Field(None, description="the revision read: HEAD, or the protected ref")
    commit: str | None = Field(None, description="the commit it resolved to")
    protected_ref: str | None = Field(
        None, description="the protected ref the commit is on (releasekit.stores.trust)"
    )
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


def _committed_table(
    root: Path, commit: str, rev: str, env: str
) -> tuple[dict[str, Any] | None, str | None]:
    """(the environment's table in releasekit.toml committed at `commit`, or None; why not)."""
    try:
        data = committed_config(root, commit)
    except TrustRootError as exc:
        raise PolicyError(exc.message, remedy=f"fix {CONFIG_FILE} and commit it") from exc
    if data is None:
        return None, f"{CONFIG_FILE} is not committed at {rev} ({commit[:12]})"
    table = (data.get("environments") or {}).get(env)
    if not isinstance(table, dict):
        return None, f"environment {env!r} is not in {CONFIG_FILE} at {rev} ({commit[:12]})"
    return table, None


def _policy_of(table: dict[str, Any], env: str, where: str) -> dict[str, Any]:
    try:
        return EnvironmentConfig.model_validate(table).policy()
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
        )
        raise PolicyError(
            f"[environments.{env}] in {CONFIG_FILE} at {where} is invalid: {problems}",
            remedy=f"fix {CONFIG_FILE} and commit it",
        ) from exc


def committed_policy(root: Path, commit: str, env: str) -> dict[str, Any] | None:
    """`env`'s policy (`EnvironmentConfig.policy`) as releasekit.toml commits it at
    `commit`; None when the file or the environment is not committed there."""
    table, _why = _committed_table(root, commit, commit[:12], env)
    return None if table is None else _policy_of(table, env, commit[:12])


def read_policy(settings: Settings, env: str, cfg: EnvironmentConfig) -> EnvironmentPolicy:
    """The policy `cfg` (this command's settings for `env`) applies, with its source and the
    fields where it differs from the committed policy; never raises for a difference or for
    a HEAD off the protected ref (see `environment_policy` for the refusing form).

    The committed policy is read at the trust commit (`releasekit.stores.trust`) for an
    environment with gates or approvals, and at HEAD for one without. An adapter lane's
    policy is its environment's."""
    env = parent_env(env)
    mine = cfg.policy()
    root = settings.root
    tr = trust_root(root)
    if not tr.in_git:
        return EnvironmentPolicy(
            environment=env,
            policy=mine,
            source=PolicySource(
                kind="uncommitted", digest=digest_obj(mine), note="not a git repository"
            ),
        )
    if env_gated(root, env, cfg, tr):
        commit, rev = tr.commit, tr.rev
    else:
        commit, rev = tr.head, "HEAD"
    protected = tr.protected_name if tr.on_protected or rev != "HEAD" else None

    def uncommitted(note: str, **where: str | None) -> EnvironmentPolicy:
        source = PolicySource(
            kind="uncommitted", rev=rev, digest=digest_obj(mine), note=note, **where
        )
        return EnvironmentPolicy(environment=env, policy=mine, source=source)

    if commit is None:
        return uncommitted(f"revision {rev} does not resolve (nothing committed yet?)")
    table, why = _committed_table(root, commit, rev, env)
    if table is None:
        return uncommitted(why or "", commit=commit, protected_ref=protected)
    committed = _policy_of(table, env, f"{rev} ({commit[:12]})")
    differs = [f for f in POLICY_FIELDS if mine.get(f) != committed.get(f)]
    return EnvironmentPolicy(
        environment=env,
        policy=mine,
        source=PolicySource(
            kind="committed",
            rev=rev,
            commit=commit,
            protected_ref=protected,
            digest=digest_obj(committed),
        ),
        differs=differs,
    )


def environment_policy(settings: Settings, env: str, cfg: EnvironmentConfig) -> EnvironmentPolicy:
    """The committed policy of `env`, which this command's settings `cfg` must match;
    TrustRootError when `env` has gates or approvals and HEAD is not a commit on the
    protected ref (or there is none, or no git repository); PolicyError naming the fields
    that differ (or saying what is not committed)."""
    require_trusted(settings.root, env, cfg)
    pol = read_policy(settings, env, cfg)
    if pol.source.kind == "uncommitted" and pol.source.rev is not None:
        raise PolicyError(
            f"{env}'s policy is not committed: {pol.source.note}; a promotion is decided by "
            f"the policy committed at {pol.source.rev}",
            remedy=f"commit {CONFIG_FILE} with [environments.{env}] (reviewed like code)",
        )
    if pol.differs:
        raise PolicyError(
            f"{env}'s policy for this command differs from {pol.where} in "
            f"{', '.join(pol.differs)}: a policy is changed by a commit, not for one command"
        )
    return pol


def digest_as_recorded(policy: dict[str, Any], recorded: Any) -> str:
    """The digest of `policy` (a committed environment's `EnvironmentConfig.policy()`) over
    the fields a recorded decision's policy holds: a decision recorded before a policy
    field existed is judged by the fields it knew, which is how its digest was computed."""
    if isinstance(recorded, dict) and recorded:
        return digest_obj({k: policy.get(k) for k in recorded})
    return digest_obj(policy)


def check_recorded_policies(
    ledger: Ledger, root: Path, *, on: str | None = None, on_name: str = ""
) -> tuple[int, list[tuple[int, str]]]:
    """Recompute the policy digest of every recorded decision (a record whose evidence
    carries `policy` with a committed source: promote, gate_failed, rollback) at the commit
    it names, from releasekit.toml as committed there. Returns (decisions checked,
    [(seq, problem)]): a digest that does not match the commit, a recorded policy that
    does not match its digest, a commit this repository lacks, and, given `on` (a commit,
    e.g. the remote's default branch, named `on_name`), a commit that is not in its
    history."""
    checked = 0
    problems: list[tuple[int, str]] = []
    for rec in ledger.records():
        ev = rec.evidence.get("policy") if isinstance(rec.evidence, dict) else None
        if not isinstance(ev, dict):
            continue
        source = ev.get("source")
        if not isinstance(source, dict) or source.get("kind") != "committed":
            continue
        checked += 1
        what = f"record {rec.seq} ({rec.type} in {rec.environment or ''})"
        env = parent_env(rec.environment or "")  # an adapter lane's policy: its environment's
        commit = str(source.get("commit") or "")
        if not commit or resolve_commit(root, commit) != commit:
            problems.append(
                (
                    rec.seq,
                    f"{what} names policy commit {commit[:12] or '-'}, which this repository "
                    "does not hold: fetch it, or the record names a commit that never existed",
                )
            )
            continue
        try:
            pol = committed_policy(root, commit, env)
        except PolicyError as exc:
            problems.append((rec.seq, f"{what}: {exc.message}"))
            continue
        if pol is None:
            problems.append(
                (rec.seq, f"{what}: [environments.{env}] is not in {CONFIG_FILE} at {commit[:12]}")
            )
            continue
        digest = digest_as_recorded(pol, ev.get("policy"))
        if digest != source.get("digest"):
            problems.append(
                (
                    rec.seq,
                    f"{what} records policy digest {str(source.get('digest'))[:12]} for "
                    f"{CONFIG_FILE} at {commit[:12]}, which gives {digest[:12]}: the decision "
                    "was not made by the policy committed there",
                )
            )
            continue
        recorded = ev.get("policy")
        # A record that holds the policy itself (promote, gate_failed, rollback) must hold
        # the committed one; one that holds only its source (shadow, canary) is checked by
        # the digest above.
        if (
            isinstance(recorded, dict)
            and not ev.get("differs_from_committed")
            and digest_obj(recorded) != digest
        ):
            problems.append(
                (
                    rec.seq,
                    f"{what} records a policy that is not the one committed at {commit[:12]} "
                    "and names no difference",
                )
            )
            continue
        if on is not None and not is_ancestor(root, commit, on):
            problems.append(
                (
                    rec.seq,
                    f"{what} was decided by the policy at {commit[:12]}, which is not on "
                    f"{on_name or on[:12]}: a commit that never landed",
                )
            )
    return checked, problems


def verify_with_policies(ledger: Ledger, root: Path, *, remote: str) -> VerifyResult:
    """`ledger verify --remote`: the ledger checked against the remote (`Ledger.verify`),
    and every recorded decision's policy digest recomputed at its commit, which must be on
    the remote's default branch (`check_recorded_policies`). A mismatch fails the result,
    naming the record."""
    res = ledger.verify(remote=remote)
    on = resolve_commit(root, remote_head_ref(remote))
    checked, problems = check_recorded_policies(
        ledger, root, on=on, on_name=f"{remote}'s default branch"
    )
    notes = [*res.notes, f"policies: {checked} decision(s) recomputed at their commits"]
    if not problems:
        return res.model_copy(update={"notes": notes})
    if res.ok:
        seq, problem = problems[0]
        return res.model_copy(
            update={
                "ok": False,
                "first_bad_seq": seq,
                "problem": problem,
                "notes": notes + [p for _, p in problems[1:]],
            }
        )
    return res.model_copy(update={"notes": notes + [p for _, p in problems]})
