"""Git anchors of the ledger head: a commit chain on refs/releasekit/ledger."""

from __future__ import annotations

import hashlib
import subprocess
import threading
from pathlib import Path

import pytest

from releasekit.stores import anchor as anc
from releasekit.stores.anchor import AnchorError, AnchorMismatchError


def h(i: int, salt: str = "") -> str:
    """A stand-in record hash for seq i."""
    return hashlib.sha256(f"{salt}{i}".encode()).hexdigest()


def git(repo: Path, *args: str) -> str:
    """Run git in repo and return stdout."""
    return subprocess.run(
        ["git", "-C", str(repo), *args], check=True, capture_output=True, text=True
    ).stdout


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A git repository with one commit, a dirty working tree and a staged file."""
    r = tmp_path / "repo"
    r.mkdir()
    git(r, "init", "-q", "-b", "main")
    git(r, "config", "user.name", "Ada")
    git(r, "config", "user.email", "ada@example.com")
    (r / "a.txt").write_text("a")
    git(r, "add", "a.txt")
    git(r, "commit", "-q", "-m", "init")
    (r / "a.txt").write_text("dirty")
    (r / "b.txt").write_text("staged")
    git(r, "add", "b.txt")
    return r


def test_anchor_chain_round_trips_and_leaves_head_index_worktree_alone(repo: Path) -> None:
    """Anchors read back oldest first; HEAD, the index and the working tree are unchanged."""
    head = git(repo, "rev-parse", "HEAD")
    status = git(repo, "status", "--porcelain")
    for i in (1, 2, 3):
        a = anc.anchor(repo, i, h(i), key_id="0123456789abcdef" if i == 3 else None)
        assert a is not None and a.seq == i
    got = anc.read_anchors(repo)
    assert [(a.seq, a.hash) for a in got] == [(1, h(1)), (2, h(2)), (3, h(3))]
    assert got[2].key_id == "0123456789abcdef" and got[0].key_id is None
    assert git(repo, "rev-parse", "HEAD") == head
    assert git(repo, "status", "--porcelain") == status
    # The anchor commits hold the empty tree: nothing of the project is copied into them.
    tree = git(repo, "log", "-1", "--format=%T", anc.ANCHOR_REF).strip()
    assert git(repo, "ls-tree", tree) == ""
    assert anc.anchor_refs(repo) == [anc.ANCHOR_REF]


def test_anchor_only_moves_forward_and_refuses_a_contradiction(repo: Path) -> None:
    """Re-anchoring the same or an older head is a no-op; another hash for it raises."""
    anc.anchor(repo, 5, h(5))
    assert anc.anchor(repo, 5, h(5)) is None
    assert anc.anchor(repo, 3, h(3)) is None
    with pytest.raises(AnchorMismatchError, match="anchors record 5") as ei:
        anc.anchor(repo, 5, h(5, "forged"))
    assert ei.value.seq == 5
    assert len(anc.read_anchors(repo)) == 1


def test_concurrent_anchors_never_lose_an_update(repo: Path) -> None:
    """Threads racing to anchor rising heads leave one linear chain ending at the highest."""
    errors: list[BaseException] = []

    def worker(seqs: range) -> None:
        try:
            for s in seqs:
                anc.anchor(repo, s, h(s))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(range(k, 13, 3),)) for k in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    got = anc.read_anchors(repo)
    seqs = [a.seq for a in got]
    assert seqs == sorted(seqs) and seqs[-1] == 12
    assert all(a.hash == h(a.seq) for a in got)


def test_not_a_git_repository_is_an_anchor_error(tmp_path: Path) -> None:
    """Outside git, anchoring and reading fail with AnchorError (callers warn, not crash)."""
    with pytest.raises(AnchorError, match="not a git repository"):
        anc.anchor(tmp_path, 1, h(1))
    with pytest.raises(AnchorError, match="not a git repository"):
        anc.read_anchors(tmp_path)
    assert anc.git_dir(tmp_path) is None


def test_anchor_without_git_identity_uses_fallback(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A runner with no user.name/email still anchors (as releasekit)."""
    git(repo, "config", "--unset", "user.name")
    git(repo, "config", "--unset", "user.email")
    monkeypatch.setenv("HOME", str(repo.parent))  # no global identity either
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    for k in ("GIT_AUTHOR_NAME", "GIT_AUTHOR_EMAIL", "GIT_COMMITTER_NAME", "GIT_COMMITTER_EMAIL"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("EMAIL", "")
    assert anc.anchor(repo, 1, h(1)) is not None
    assert [a.seq for a in anc.read_anchors(repo)] == [1]


def test_ledger_that_extends_every_anchor_passes(repo: Path) -> None:
    """A ledger longer than its anchors, agreeing at each, is ok."""
    anc.anchor(repo, 2, h(2))
    anc.anchor(repo, 4, h(4))
    res = anc.check_extends([(i, h(i)) for i in range(1, 7)], anc.read_anchors(repo))
    assert res.ok and res.anchors == 2 and res.anchored_seq == 4


def test_rewritten_record_is_named_exactly_when_every_record_is_anchored(repo: Path) -> None:
    """With an anchor per record, the first differing seq is named exactly."""
    for i in range(1, 6):
        anc.anchor(repo, i, h(i))
    forged = [(i, h(i) if i < 3 else h(i, "x")) for i in range(1, 6)]
    res = anc.check_extends(forged, anc.read_anchors(repo))
    assert not res.ok and res.first_bad_seq == 3 and res.exact
    assert "record 3 was rewritten" in (res.problem or "")


def test_sparse_anchors_bound_the_change(repo: Path) -> None:
    """Between anchors 2 and 6, a change at 4 is reported as 3..6 (not exact)."""
    anc.anchor(repo, 2, h(2))
    anc.anchor(repo, 6, h(6))
    forged = [(i, h(i) if i < 4 else h(i, "x")) for i in range(1, 8)]
    res = anc.check_extends(forged, anc.read_anchors(repo))
    assert not res.ok and res.first_bad_seq == 3 and res.bad_anchor_seq == 6 and not res.exact
    assert "a record in 3..6" in (res.problem or "")


def test_truncated_and_deleted_ledgers_fail_against_the_anchor(repo: Path) -> None:
    """A ledger shorter than an anchor (rows deleted) or empty (database replaced) fails."""
    for i in range(1, 5):
        anc.anchor(repo, i, h(i))
    anchors = anc.read_anchors(repo)
    res = anc.check_extends([(1, h(1)), (2, h(2))], anchors)
    assert not res.ok and res.truncated and res.first_bad_seq == 3
    assert "records 3..4 were deleted" in (res.problem or "")
    res = anc.check_extends([], anchors)
    assert not res.ok and res.truncated and res.first_bad_seq == 1
    assert "the ledger is empty" in (res.problem or "")
    # Truncated and regrown with new records: the hash at the anchored seq differs.
    res = anc.check_extends([(1, h(1)), (2, h(2)), (3, h(3, "new")), (4, h(4, "new"))], anchors)
    assert not res.ok and not res.truncated and res.first_bad_seq == 3


def test_fetched_copy_of_the_anchor_ref_is_listed(repo: Path) -> None:
    """A pushed-and-fetched anchor ref beside the local one is checked too."""
    anc.anchor(repo, 1, h(1))
    anc.anchor(repo, 1, h(1), ref="refs/releasekit/origin-ledger")
    assert anc.anchor_refs(repo) == ["refs/releasekit/ledger", "refs/releasekit/origin-ledger"]


def test_malformed_anchor_commit_is_an_anchor_error(repo: Path) -> None:
    """A hand-made commit on the ref that is not an anchor is reported, not misread."""
    tree = git(repo, "write-tree").strip()
    c = subprocess.run(
        ["git", "-C", str(repo), "commit-tree", tree, "-m", "hello"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    git(repo, "update-ref", anc.ANCHOR_REF, c)
    with pytest.raises(AnchorError, match="malformed"):
        anc.read_anchors(repo)
