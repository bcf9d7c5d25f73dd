"""Git anchors for the ledger head: a ref holding a small commit chain of (seq, hash).

The ledger's own head row lives in the same database as the records, so whoever can write the
database can rewrite both. An anchor puts the head somewhere else: `refs/releasekit/ledger`
in the project's git repository points at a chain of commits with the empty tree, one per
anchored head, each message holding the sequence number, the record hash, the signing key id
and the time. A team pushes the ref with its code (`git push origin refs/releasekit/ledger`),
so a ledger rewritten, truncated or deleted behind a pushed anchor no longer extends it.

Only git plumbing is used (`mktree`, `commit-tree`, `update-ref` with the expected old value
as a compare-and-swap): the working tree, the index and HEAD are never touched, and no hooks
run except reference-transaction.
"""

from __future__ import annotations

import datetime as dt
import os
import re
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path

from pydantic import BaseModel, Field

from releasekit.errors import AnchorError, AnchorMismatchError

ANCHOR_REF = "refs/releasekit/ledger"
ANCHOR_PREFIX = "refs/releasekit/"
_SUBJECT = "releasekit ledger anchor"
_FIELD = re.compile(r"^(seq|hash|key|time|ledger): (.*)$", re.M)
_HASH = re.compile(r"^[0-9a-f]{64}$")
_FALLBACK_IDENT = {
    "GIT_AUTHOR_NAME": "releasekit",
    "GIT_AUTHOR_EMAIL": "releasekit@localhost",
    "GIT_COMMITTER_NAME": "releasekit",
    "GIT_COMMITTER_EMAIL": "releasekit@localhost",
}
# Inherited from a git hook or a wrapper, these would point our plumbing at another repository.
_GIT_ENV_DROP = ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_OBJECT_DIRECTORY")


class Anchor(BaseModel):
    """One anchored head: record `seq` had chain hash `hash` (signed by `key_id`)."""

    seq: int = Field(ge=1)
    hash: str
    key_id: str | None = None
    time: str | None = None
    commit: str | None = None
    ref: str = ANCHOR_REF


class AnchorCheck(BaseModel):
    """Whether a ledger extends every anchored head.

    `first_bad_seq` is the first record that differs from (or is missing behind) an anchor;
    when anchors are sparse it is the first record after the last anchor that still matched,
    and `exact` is False (the change lies in `first_bad_seq..bad_anchor_seq`).
    """

    ok: bool
    anchors: int = 0
    anchored_seq: int | None = Field(None, description="highest anchored seq checked")
    first_bad_seq: int | None = None
    bad_anchor_seq: int | None = None
    exact: bool = True
    truncated: bool = False
    ref: str | None = None
    problem: str | None = None


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _GIT_ENV_DROP}
    env["GIT_TERMINAL_PROMPT"] = "0"
    # Policy, keys and anchors are read as committed: a `git replace` must not swap them.
    env["GIT_NO_REPLACE_OBJECTS"] = "1"
    return env


def _git(
    repo: Path,
    *args: str,
    input: str | None = None,
    env: dict[str, str] | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(
            ["git", "-C", str(repo), *args],
            input=input,
            capture_output=True,
            text=True,
            env=env or _env(),
            timeout=30,
        )
    except FileNotFoundError as exc:
        raise AnchorError("git is not installed (needed for ledger anchors)") from exc
    except subprocess.TimeoutExpired as exc:
        raise AnchorError(f"git {args[0]} timed out in {repo}") from exc
    if check and proc.returncode != 0:
        raise AnchorError(f"git {' '.join(args[:2])} failed in {repo}: {proc.stderr.strip()}")
    return proc


def git_dir(repo: Path) -> Path | None:
    """The repository's git folder, or None when `repo` is not inside a git repository."""
    try:
        proc = _git(repo, "rev-parse", "--absolute-git-dir", check=False)
    except AnchorError:
        return None
    return Path(proc.stdout.strip()) if proc.returncode == 0 else None


def _require_repo(repo: Path) -> None:
    if not repo.is_dir() or git_dir(repo) is None:
        raise AnchorError(f"{repo} is not a git repository: the ledger head cannot be anchored")


def _resolve(repo: Path, ref: str) -> str | None:
    proc = _git(repo, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}", check=False)
    if proc.returncode != 0:
        return None
    return proc.stdout.strip() or None


def _parse(message: str, commit: str, ref: str) -> Anchor:
    fields = dict(_FIELD.findall(message))
    try:
        seq = int(fields["seq"])
        h = fields["hash"].strip()
    except (KeyError, ValueError) as exc:
        raise AnchorError(f"anchor commit {commit[:12]} on {ref} is malformed") from exc
    if not _HASH.match(h) or seq < 1:
        raise AnchorError(f"anchor commit {commit[:12]} on {ref} is malformed")
    key = fields.get("key", "").strip()
    return Anchor(
        seq=seq,
        hash=h,
        key_id=key if key and key != "-" else None,
        time=fields.get("time", "").strip() or None,
        commit=commit,
        ref=ref,
    )


def read_anchors(repo: Path, *, ref: str = ANCHOR_REF) -> list[Anchor]:
    """Every anchor on `ref`, oldest first; [] when the ref does not exist yet."""
    _require_repo(repo)
    if _resolve(repo, ref) is None:
        return []
    proc = _git(
        repo,
        "-c",
        "log.showSignature=false",
        "log",
        "-z",
        "--first-parent",
        "--format=%H%n%B",
        ref,
        "--",
    )
    anchors = []
    for chunk in proc.stdout.split("\0"):
        chunk = chunk.strip("\n")
        if not chunk:
            continue
        commit, _, body = chunk.partition("\n")
        anchors.append(_parse(body, commit, ref))
    anchors.reverse()
    return anchors


def anchor_refs(repo: Path) -> list[str]:
    """Every anchor ref in the repository: `refs/releasekit/ledger` and any copies fetched
    beside it (e.g. `refs/releasekit/origin-ledger`), so a pushed anchor is checked too."""
    _require_repo(repo)
    proc = _git(repo, "for-each-ref", "--format=%(refname)", ANCHOR_PREFIX)
    return sorted(r for r in proc.stdout.split() if r.endswith("ledger"))


def _ident_env(repo: Path) -> dict[str, str]:
    env = _env()
    if _git(repo, "var", "GIT_COMMITTER_IDENT", env=env, check=False).returncode != 0:
        # No identity configured (a CI runner): anchor anyway, as "releasekit".
        env.update(_FALLBACK_IDENT)
    return env


def anchor(
    repo: Path,
    seq: int,
    record_hash: str,
    *,
    key_id: str | None = None,
    ref: str = ANCHOR_REF,
    ledger: str | None = None,
    attempts: int = 20,
) -> Anchor | None:
    """Advance `ref` to an anchor of (seq, record_hash); return it, or None when the ref
    already anchors `seq` or a later record (anchors only move forward).

    Safe against concurrent anchoring: the ref moves by compare-and-swap and a loser re-reads.
    Raises AnchorMismatchError when the ref already anchors `seq` with another hash.
    """
    if seq < 1 or not _HASH.match(record_hash):
        raise AnchorError(f"not an anchorable head: seq={seq} hash={record_hash!r}")
    _require_repo(repo)
    env = _ident_env(repo)
    tree = _git(repo, "mktree", input="", env=env).stdout.strip()
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    lines = [f"seq: {seq}", f"hash: {record_hash}", f"key: {key_id or '-'}", f"time: {now}"]
    if ledger:
        lines.append(f"ledger: {ledger}")
    message = f"{_SUBJECT} {seq}\n\n" + "\n".join(lines) + "\n"
    for _ in range(attempts):
        old = _resolve(repo, ref)
        if old is not None:
            top = _parse(_git(repo, "log", "-1", "--format=%B", old, "--").stdout, old, ref)
            if top.seq > seq:
                return None
            if top.seq == seq:
                if top.hash != record_hash:
                    raise AnchorMismatchError(
                        f"{ref} anchors record {seq} with hash {top.hash[:16]}..., not "
                        f"{record_hash[:16]}...: the ledger diverged from its anchor",
                        seq=seq,
                    )
                return None
        parent = ["-p", old] if old else []
        commit = _git(
            repo, "commit-tree", tree, *parent, "-F", "-", input=message, env=env
        ).stdout.strip()
        # The old value makes this a compare-and-swap; all zeros means "must not exist".
        proc = _git(
            repo,
            "update-ref",
            "-m",
            f"releasekit: anchor ledger record {seq}",
            ref,
            commit,
            old or "0" * len(commit),
            env=env,
            check=False,
        )
        if proc.returncode == 0:
            return Anchor(
                seq=seq, hash=record_hash, key_id=key_id, time=now, commit=commit, ref=ref
            )
    raise AnchorError(f"could not move {ref}: other writers kept moving it")


def check_extends(
    ledger: Sequence[tuple[int, str]] | Iterable[tuple[int, str]],
    anchors: Sequence[Anchor],
) -> AnchorCheck:
    """Check that a ledger, given as (seq, hash) pairs in chain order, extends every anchor.

    Names the first record that differs from an anchored head, or reports truncation when
    the ledger is shorter than an anchor (records deleted, or the database replaced).
    """
    hashes = dict(ledger)
    last = max(hashes, default=0)
    ordered = sorted(anchors, key=lambda a: a.seq)
    if not ordered:
        return AnchorCheck(ok=True)
    good = 0  # the highest anchored seq that matched
    for a in ordered:
        have = hashes.get(a.seq)
        if have == a.hash:
            good = a.seq
            continue
        first = good + 1
        exact = first == a.seq
        where = f"record {a.seq}" if exact else f"a record in {first}..{a.seq}"
        if have is None and a.seq > last:
            top = ordered[-1]  # name the whole missing span, up to the newest anchor
            return AnchorCheck(
                ok=False,
                anchors=len(ordered),
                anchored_seq=ordered[-1].seq,
                first_bad_seq=last + 1,
                bad_anchor_seq=top.seq,
                exact=True,
                truncated=True,
                ref=top.ref,
                problem=(
                    f"the ledger ends at record {last} but {top.ref} anchors record "
                    f"{top.seq}: records {last + 1}..{top.seq} were deleted (truncated, or the "
                    "database was replaced)"
                    if last
                    else f"the ledger is empty but {top.ref} anchors record {top.seq}: the "
                    "database was deleted or replaced"
                ),
            )
        return AnchorCheck(
            ok=False,
            anchors=len(ordered),
            anchored_seq=ordered[-1].seq,
            first_bad_seq=first,
            bad_anchor_seq=a.seq,
            exact=exact,
            ref=a.ref,
            problem=(
                f"{where} was rewritten: record {a.seq}'s hash no longer matches the one "
                f"{a.ref} anchored (commit {(a.commit or '')[:12]})"
            ),
        )
    return AnchorCheck(ok=True, anchors=len(ordered), anchored_seq=ordered[-1].seq)


def remote_anchor_ref(remote: str) -> str:
    """Where `fetch_remote` keeps a remote's copy of the anchor ref (listed by
    `anchor_refs`, so later local checks include it)."""
    return f"{ANCHOR_PREFIX}remotes/{remote}/ledger"


def remote_head_ref(remote: str) -> str:
    """Where `fetch_remote` keeps the commit the remote's HEAD (default branch) points at."""
    return f"{ANCHOR_PREFIX}remotes/{remote}/head"


def fetch_remote(repo: Path, remote: str) -> tuple[str, str | None]:
    """Fetch a git remote's anchor ref and its default branch; return the local refs they
    were stored at: (anchor ref, head ref or None when the remote has no branch).

    Raises AnchorError when the remote cannot be reached or has no anchor ref (nothing was
    pushed: `git push <remote> refs/releasekit/ledger`)."""
    _require_repo(repo)
    if not re.match(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,99}$", remote) or ".." in remote:
        raise AnchorError(f"not a git remote name: {remote!r}")
    ref = remote_anchor_ref(remote)
    proc = _git(
        repo, "fetch", "--no-tags", "--quiet", "--", remote, f"+{ANCHOR_REF}:{ref}", check=False
    )
    if proc.returncode != 0:
        why = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "fetch failed"
        if "couldn't find remote ref" in proc.stderr:
            why = f"{remote} has no {ANCHOR_REF} (push it: `git push {remote} {ANCHOR_REF}`)"
        raise AnchorError(f"cannot read the ledger anchor of remote {remote}: {why}")
    head = remote_head_ref(remote)
    proc = _git(repo, "fetch", "--no-tags", "--quiet", "--", remote, f"+HEAD:{head}", check=False)
    return ref, head if proc.returncode == 0 else None


def revision_exists(repo: Path, rev: str) -> bool:
    """True when `rev` names a commit in the git repository `repo` (False outside one)."""
    if not repo.is_dir() or git_dir(repo) is None:
        return False
    return _resolve(repo, rev) is not None


def resolve_commit(repo: Path, rev: str) -> str | None:
    """The commit `rev` names in the git repository `repo`; None when it names none (or
    `repo` is not a git repository)."""
    if not repo.is_dir() or git_dir(repo) is None:
        return None
    return _resolve(repo, rev)


def symbolic_full_name(repo: Path, name: str) -> str | None:
    """The full ref name `name` stands for (`origin/main` -> `refs/remotes/origin/main`,
    `@{upstream}` -> the branch's upstream); None when it names no ref (a commit id, an
    unknown name, no upstream) or `repo` is not a git repository."""
    if not repo.is_dir() or git_dir(repo) is None:
        return None
    proc = _git(repo, "rev-parse", "--symbolic-full-name", name, "--", check=False)
    if proc.returncode != 0:
        return None
    full = proc.stdout.strip().splitlines()[0] if proc.stdout.strip() else ""
    return full if full.startswith("refs/") else None


def is_ancestor(repo: Path, commit: str, of: str) -> bool:
    """True when `commit` is an ancestor of (or equal to) `of` in the git repository."""
    proc = _git(repo, "merge-base", "--is-ancestor", commit, of, check=False)
    return proc.returncode == 0


def _blob(repo: Path, obj: str) -> bytes | None:
    """A blob's bytes, as committed (`obj`: a blob id or `<commit>:<path>`)."""
    try:
        proc = subprocess.run(
            ["git", "-C", str(repo), "cat-file", "blob", obj],
            capture_output=True,
            env=_env(),
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def read_committed_file(repo: Path, commit: str, path: str) -> bytes | None:
    """The bytes of `path` (relative to the repository root) as committed at `commit`; None
    when it is not committed there. What the working tree holds does not matter."""
    return _blob(repo, f"{commit}:{path.removeprefix('./')}")


def read_tree_files(repo: Path, rev: str, folder: str) -> dict[str, bytes] | None:
    """The files directly in `folder` at the committed revision `rev`, by name: {} when
    `rev` does not resolve (no commit yet), None when `repo` is not a git repository. What
    the working tree holds does not matter."""
    if not repo.is_dir() or git_dir(repo) is None:
        return None
    commit = _resolve(repo, rev)
    if commit is None:
        return {}
    proc = _git(repo, "ls-tree", "-z", commit, "--", folder.rstrip("/") + "/", check=False)
    out: dict[str, bytes] = {}
    for entry in proc.stdout.split("\0"):
        if not entry:
            continue
        meta, _, path = entry.partition("\t")
        _mode, kind, obj = meta.split()
        if kind != "blob":
            continue
        data = _blob(repo, obj)
        if data is not None:
            out[path.rsplit("/", 1)[-1]] = data
    return out
