"""The ledger beyond its hash chain, on SQLite and on a real PostgreSQL server: signatures,
git anchors, named locks across processes, and read-only opening that creates nothing."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, select, text

from releasekit.errors import SigningRequiredError
from releasekit.stores import anchor as anc
from releasekit.stores import signing
from releasekit.stores.ledger import (
    GENESIS,
    DecisionRecordsError,
    Event,
    EventType,
    Ledger,
    LedgerNotFoundError,
    events_table,
    head_table,
    record_hash,
    signatures_table,
)
from releasekit.stores.locks import LedgerLockTimeoutError

RID = "ab" * 32


def git(repo: Path, *args: str) -> str:
    """Run git in repo, return stdout."""
    return subprocess.run(
        ["git", "-C", str(repo), *args], check=True, capture_output=True, text=True
    ).stdout


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A git repository with a committed public key and its private key under .releasekit/."""
    r = tmp_path / "proj"
    r.mkdir()
    git(r, "init", "-q")
    git(r, "config", "user.name", "Ada")
    git(r, "config", "user.email", "ada@example.com")
    signing.generate_keypair(r)
    git(r, "add", "keys")
    git(r, "commit", "-q", "-m", "trust the release key")
    return r


def open_signed(url: str, repo: Path, **kw: Any) -> Ledger:
    """A ledger that signs with the repo's key and anchors in the repo."""
    return Ledger(
        url,
        actor="ci",
        signer=signing.find_signer(repo, environ={}),
        anchor_repo=repo,
        trusted=signing.trusted_keys(repo),
        **kw,
    )


def fill(led: Ledger, n: int = 5) -> None:
    """Append n events (a mix of types and environments)."""
    for i in range(n):
        led.append(
            Event(
                type=EventType.ASSIGN if i % 2 else EventType.BUILD,
                environment="production" if i % 2 else None,
                to_release=f"{i:064x}",
                live=bool(i % 2),
                reason=f"event {i}",
            )
        )


def forge(url: str, seq: int, reason: str) -> None:
    """What someone with write access to the database can do: edit record `seq`, then
    recompute every later hash and the head, so the chain itself is consistent."""
    engine = create_engine(url)
    with engine.begin() as conn:
        rows = [dict(r._mapping) for r in conn.execute(select(events_table).order_by("seq"))]
        prev = GENESIS
        for r in rows:
            if r["seq"] == seq:
                r["reason"] = reason
            r["prev_hash"] = prev
            r["hash"] = record_hash(r)
            prev = r["hash"]
        conn.execute(events_table.delete())
        conn.execute(events_table.insert(), rows)
        conn.execute(head_table.update().values(hash=prev))
    engine.dispose()


def truncate(url: str, keep: int) -> None:
    """Delete every record after `keep` and point the head at record `keep`."""
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(events_table.delete().where(events_table.c.seq > keep))
        conn.execute(signatures_table.delete().where(signatures_table.c.seq > keep))
        h = conn.execute(select(events_table.c.hash).where(events_table.c.seq == keep)).scalar()
        conn.execute(head_table.update().values(seq=keep, hash=h))
    engine.dispose()


def test_signed_and_anchored_ledger_verifies(ledger_db: str, repo: Path) -> None:
    """Every record is signed by the repo's key and each append advanced the git anchor."""
    led = open_signed(ledger_db, repo)
    fill(led)
    assert led.warnings == []
    res = led.verify()
    assert res.ok, res.problem
    assert (res.signing, res.signed, res.anchoring, res.anchored_seq) == (
        "signed",
        5,
        "anchored",
        5,
    )
    (kid,) = signing.trusted_keys(repo)
    assert res.key_ids == [kid]
    assert all(r.key_id == kid and r.signature for r in led.records())
    assert [a.seq for a in anc.read_anchors(repo)] == [1, 2, 3, 4, 5]


def test_forger_who_recomputes_chain_and_head_is_named(ledger_db: str, repo: Path) -> None:
    """Editing record 3 and recomputing every hash and the head passes the chain, but its
    signature and the git anchor no longer match: verify names record 3."""
    led = open_signed(ledger_db, repo)
    fill(led)
    forge(ledger_db, 3, "nothing to see here")
    bare = Ledger(ledger_db).verify(trusted=None)  # the chain alone is fooled
    assert bare.ok
    res = led.verify()
    assert not res.ok and res.first_bad_seq == 3
    assert "record 3 was changed after it was signed" in (res.problem or "")
    assert any("record 3 was rewritten" in n for n in res.notes)  # the anchor saw it too


def test_forger_who_also_strips_signatures_fails_on_the_anchor(ledger_db: str, repo: Path) -> None:
    """Dropping every signature as well as recomputing the chain still fails: the anchor
    names record 3 (the hash changed) even though no signature is left to check."""
    led = open_signed(ledger_db, repo)
    fill(led)
    forge(ledger_db, 3, "forged")
    engine = create_engine(ledger_db)
    with engine.begin() as conn:
        conn.execute(signatures_table.delete())
    engine.dispose()
    res = led.verify()
    assert not res.ok and res.first_bad_seq == 3
    assert "rewritten" in (res.problem or "")


def test_stripping_a_signature_alone_is_named(ledger_db: str, repo: Path) -> None:
    """A record left unsigned after signed ones fails, even with no anchors to consult."""
    led = open_signed(ledger_db, repo)
    fill(led)
    engine = create_engine(ledger_db)
    with engine.begin() as conn:
        conn.execute(signatures_table.delete().where(signatures_table.c.seq == 4))
    engine.dispose()
    res = Ledger(ledger_db, trusted=signing.trusted_keys(repo)).verify()
    assert not res.ok and res.first_bad_seq == 4 and "unsigned" in (res.problem or "")


def test_unknown_signing_key_names_record_and_key(
    ledger_db: str, repo: Path, tmp_path: Path
) -> None:
    """A record signed by a key the repository does not trust (written by a process that
    checks no keys) fails with that key's id."""
    rogue = signing.generate_keypair(tmp_path / "rogue")
    Ledger(ledger_db, actor="x", signer=signing.load_private_key(rogue.private_path)).append(
        Event(type=EventType.BUILD, to_release=RID)
    )
    led = Ledger(ledger_db, actor="x", trusted=signing.trusted_keys(repo))
    res = led.verify()
    assert not res.ok and res.first_bad_seq == 1
    assert rogue.key_id in (res.problem or "") and "does not trust" in (res.problem or "")


def test_truncation_fails_against_the_anchor(ledger_db: str, repo: Path) -> None:
    """Deleting the newest records (and moving the head back) passes the chain, not the
    anchor: verify names the first missing record."""
    led = open_signed(ledger_db, repo)
    fill(led)
    truncate(ledger_db, 3)
    assert Ledger(ledger_db).verify(trusted=None).ok  # chain and head agree now
    res = led.verify()
    assert not res.ok and res.first_bad_seq == 4
    assert "records 4..5 were deleted" in (res.problem or "")


def test_emptied_ledger_with_anchors_fails(ledger_db: str, repo: Path) -> None:
    """A replaced, empty ledger (tables present, no rows) fails: the anchors say it had
    records."""
    led = open_signed(ledger_db, repo)
    fill(led, 2)
    engine = create_engine(ledger_db)
    with engine.begin() as conn:
        for t in (signatures_table, events_table, head_table):
            conn.execute(t.delete())
    engine.dispose()
    res = led.verify()
    assert not res.ok and res.first_bad_seq == 1 and res.records == 0
    assert "the ledger is empty" in (res.problem or "")


def test_unsigned_ledger_still_works_and_says_so(ledger_db: str, tmp_path: Path) -> None:
    """Without a key the ledger appends and verifies, and reports itself unsigned."""
    led = Ledger(ledger_db, actor="x", trusted={})
    fill(led, 2)
    res = led.verify()
    assert res.ok and res.signing == "unsigned" and res.unsigned == 2
    assert any("anchors not checked" in n or "no git repository" in n for n in res.notes)


def test_no_git_repository_is_a_warning_not_a_crash(ledger_db: str, tmp_path: Path) -> None:
    """Anchoring outside a git repository warns (on the ledger) and the append stands."""
    plain = tmp_path / "plain"
    plain.mkdir()
    led = Ledger(ledger_db, actor="x", anchor_repo=plain)
    rec = led.append(Event(type=EventType.BUILD, to_release=RID))
    assert rec.seq == 1 and led.count() == 1
    assert led.warnings and "not anchored in git" in led.warnings[0]


def test_read_only_open_creates_nothing(tmp_path: Path, pg_url: str) -> None:
    """create=False on a missing SQLite file or a database without ledger tables raises
    LedgerNotFoundError naming the URL, and creates neither file nor tables."""
    missing = tmp_path / "typo" / "ledger.db"
    with pytest.raises(LedgerNotFoundError, match="no ledger at sqlite:///"):
        Ledger(f"sqlite:///{missing}", create=False)
    assert not missing.exists() and not missing.parent.exists()
    with pytest.raises(LedgerNotFoundError, match="has no ledger tables"):
        Ledger(pg_url, create=False)
    engine = create_engine(pg_url)
    with engine.connect() as conn:
        n = conn.execute(
            text("SELECT count(*) FROM information_schema.tables WHERE table_schema='public'")
        ).scalar_one()
    engine.dispose()
    assert n == 0


def test_legacy_ledger_without_signature_table_reads_read_only(tmp_path: Path) -> None:
    """A ledger written before signatures existed opens read-only without being changed."""
    url = f"sqlite:///{tmp_path / 'old.db'}"
    fill(Ledger(url, actor="x"), 2)
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text("DROP TABLE event_signatures"))
    engine.dispose()
    ro = Ledger(url, create=False, trusted={})
    assert [r.key_id for r in ro.records()] == [None, None]
    assert ro.verify().signing == "unsigned"


WORKER = textwrap.dedent(
    """
    import sys, time
    from releasekit.stores.ledger import Event, EventType, Ledger
    url, spans, hold = sys.argv[1], sys.argv[2], float(sys.argv[3])
    led = Ledger(url, actor="w", timeout_s=120)
    with led.lock("env:production"):
        t0 = time.monotonic()
        if hold > 5:
            open(spans + ".held", "w").write("1")
        led.append(Event(type=EventType.BUILD, to_release="cd" * 32))
        time.sleep(hold)
        t1 = time.monotonic()
    with open(spans, "a") as f:
        f.write(f"{t0} {t1}\\n")
    """
)


def _spawn(url: str, spans: Path, hold: float) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", WORKER, url, str(spans), str(hold)])


def test_lock_serialises_processes(ledger_db: str, tmp_path: Path) -> None:
    """Eight processes taking one environment's lock never overlap inside it."""
    Ledger(ledger_db, actor="x").close()  # schema first: the test is about the lock
    spans = tmp_path / "spans.txt"
    procs = [_spawn(ledger_db, spans, 0.05) for _ in range(8)]
    assert [p.wait(timeout=120) for p in procs] == [0] * 8
    ivs = sorted(tuple(map(float, line.split())) for line in spans.read_text().splitlines())
    assert len(ivs) == 8
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(ivs)), ivs
    assert Ledger(ledger_db).verify(trusted=None).records == 8


def test_lock_of_a_killed_holder_is_released(ledger_db: str, tmp_path: Path) -> None:
    """SIGKILL while holding the lock does not wedge the environment: the database drops a
    dead connection's row lock (PostgreSQL), a dead pid's lease is taken over (SQLite)."""
    Ledger(ledger_db, actor="x").close()
    spans = tmp_path / "spans.txt"
    p = _spawn(ledger_db, spans, 60)
    deadline = time.monotonic() + 60
    while not Path(str(spans) + ".held").exists():
        assert p.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    led = Ledger(ledger_db, actor="x")
    with (
        pytest.raises(LedgerLockTimeoutError, match="env:production is locked"),
        led.lock("env:production", timeout_s=0.5),
    ):
        pass
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=30)
    with led.lock("env:production", timeout_s=30) as info:
        assert info.name == "env:production"


def test_concurrent_first_opens_of_a_postgres_ledger(pg_url: str) -> None:
    """Four processes creating the same fresh PostgreSQL ledger at once all succeed."""
    code = "import sys; from releasekit.stores.ledger import Ledger; Ledger(sys.argv[1]).close()"
    procs = [
        subprocess.Popen([sys.executable, "-c", code, pg_url], stderr=subprocess.PIPE)
        for _ in range(4)
    ]
    outs = [(p.wait(timeout=120), p.stderr.read() if p.stderr else b"") for p in procs]
    assert all(rc == 0 for rc, _ in outs), outs


# ----------------------------------------------------------------------------- swapped ledger


def strip_and_rechain(url: str) -> None:
    """The swap with database access but no key: recompute the chain (as `forge`), then
    delete every signature row."""
    forge(url, 3, "swapped")
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(signatures_table.delete())
    engine.dispose()


def reanchor(url: str, repo: Path) -> None:
    """... and with write access to the local git repo: re-anchor the forged head locally."""
    git(repo, "update-ref", "-d", anc.ANCHOR_REF)
    led = Ledger(url)
    head = led.head()
    assert head is not None
    anc.anchor(repo, head[0], head[1])
    led.close()


def test_swapped_unsigned_ledger_fails_when_keys_are_trusted(ledger_db: str, repo: Path) -> None:
    """Recomputed chain, signatures deleted, anchor re-made locally: verify still fails,
    because the repository trusts a key and no record is signed."""
    led = open_signed(ledger_db, repo)
    fill(led)
    strip_and_rechain(ledger_db)
    reanchor(ledger_db, repo)
    res = open_signed(ledger_db, repo).verify()
    assert not res.ok and res.first_bad_seq == 5
    assert "no record is signed although the repository trusts" in (res.problem or "")


def test_uncommitted_public_key_is_not_trusted(ledger_db: str, repo: Path, tmp_path: Path) -> None:
    """A .pub dropped into keys/ without a commit does not count: records signed by its key
    fail as signed by an untrusted key."""
    rogue = signing.generate_keypair(
        repo, private_path=tmp_path / "rogue.pem", public_dir=repo / "keys"
    )
    assert rogue.public_path.is_file()
    trusted = signing.trusted_keys(repo)
    assert rogue.key_id not in trusted and len(trusted) == 1
    unchecked = Ledger(
        ledger_db, actor="x", signer=signing.load_private_key(rogue.private_path), anchor_repo=repo
    )
    fill(unchecked, 2)
    led = Ledger(ledger_db, actor="x", anchor_repo=repo, trusted=trusted)
    res = led.verify()
    assert not res.ok and res.first_bad_seq == 1
    assert f"key {rogue.key_id}, which the repository does not trust" in (res.problem or "")


def test_unsigned_append_after_a_signed_record_is_refused(ledger_db: str, repo: Path) -> None:
    """A writer without the key cannot append after signed records (nothing is written),
    whether or not it was told which keys are trusted; the error says what to do."""
    led = open_signed(ledger_db, repo)
    fill(led, 2)
    for trusted in (None, signing.trusted_keys(repo)):
        keyless = Ledger(ledger_db, actor="x", anchor_repo=repo, trusted=trusted)
        with pytest.raises(SigningRequiredError) as info:
            keyless.append(Event(type=EventType.BUILD, to_release=RID))
        assert "RELEASEKIT_SIGNING_KEY" in info.value.remedy
        keyless.close()
    assert led.count() == 2 and led.verify().ok


def test_trusting_a_key_requires_signed_appends(ledger_db: str, repo: Path) -> None:
    """Once the repository trusts a key, even the first record must be signed."""
    keyless = Ledger(ledger_db, actor="x", trusted=signing.trusted_keys(repo))
    with pytest.raises(SigningRequiredError, match="every record must be signed"):
        keyless.append(Event(type=EventType.BUILD, to_release=RID))
    assert keyless.count() == 0


def test_trusted_keys_come_from_the_pinned_revision(repo: Path) -> None:
    """`rev` pins the revision read: a key committed later on another branch is not
    trusted at the pinned one."""
    first = git(repo, "rev-parse", "HEAD").strip()
    git(repo, "checkout", "-q", "-b", "side")
    extra = signing.generate_keypair(repo, private_path=repo.parent / "extra.pem")
    git(repo, "add", "keys")
    git(repo, "commit", "-q", "-m", "another key")
    assert extra.key_id in signing.trusted_keys(repo)
    assert extra.key_id not in signing.trusted_keys(repo, rev=first)


def test_verify_against_the_pushed_anchor_catches_a_local_reanchor(
    ledger_db: str, repo: Path, tmp_path: Path
) -> None:
    """The anchor pushed to a remote outlives a local re-anchor: `verify(remote=...)` fails
    on the swapped ledger even after the forger also drops the trusted key locally, because
    it trusts the keys committed on the remote's default branch."""
    remote = tmp_path / "remote.git"
    git(tmp_path, "init", "-q", "--bare", str(remote))
    git(repo, "remote", "add", "origin", str(remote))
    led = open_signed(ledger_db, repo)
    fill(led)
    git(repo, "push", "-q", "origin", "HEAD:refs/heads/main", anc.ANCHOR_REF)
    git(remote, "symbolic-ref", "HEAD", "refs/heads/main")
    assert led.verify(remote="origin").ok
    strip_and_rechain(ledger_db)
    reanchor(ledger_db, repo)
    git(repo, "rm", "-q", "-r", "keys")
    git(repo, "commit", "-q", "-m", "drop the key")
    local = Ledger(ledger_db, anchor_repo=repo, trusted=signing.trusted_keys(repo))
    assert signing.trusted_keys(repo) == {}
    git(repo, "update-ref", "-d", anc.remote_anchor_ref("origin"))  # the fetched copy too
    assert local.verify().ok  # what a local-only check is fooled into
    res = local.verify(remote="origin")
    assert not res.ok
    assert "rewritten" in (res.problem or "") or "no record is signed" in (res.problem or "")


def test_verify_against_a_remote_without_an_anchor_fails(
    ledger_db: str, repo: Path, tmp_path: Path
) -> None:
    """A remote that never got the anchor ref is a failure with the push command, not a pass."""
    remote = tmp_path / "empty.git"
    git(tmp_path, "init", "-q", "--bare", str(remote))
    git(repo, "remote", "add", "origin", str(remote))
    led = open_signed(ledger_db, repo)
    fill(led, 1)
    res = led.verify(remote="origin")
    assert not res.ok and "git push origin refs/releasekit/ledger" in (res.problem or "")


def test_no_trusted_key_while_records_are_signed_fails_verify(tmp_path: Path, repo: Path) -> None:
    """Signed records checked against an empty set of trusted keys (the keys were deleted
    from the trusted revision) fail verify, naming the first signed record; a revision that
    names no commit (`verify --remote` reading a branch not fetched) trusts nothing and is
    refused outright, so a swapped, unsigned and re-anchored ledger can no longer verify
    against no key at all."""
    url = f"sqlite:///{tmp_path / 'signed.db'}"
    led = open_signed(url, repo)
    fill(led)
    git(repo, "rm", "-q", "-r", "keys")
    git(repo, "commit", "-q", "-m", "trust nobody")
    assert signing.trusted_keys(repo) == {}
    res = Ledger(url, anchor_repo=repo, trusted={}).verify()
    assert not res.ok and res.first_bad_seq == 1
    assert "trusts no key" in (res.problem or "")
    # The swap: chain recomputed, signatures deleted, anchor re-made; a revision that does
    # not resolve (a branch not fetched here) used to trust nothing, and this then passed.
    strip_and_rechain(url)
    reanchor(url, repo)
    with pytest.raises(signing.SigningKeyError, match="does not name a commit"):
        signing.trusted_keys(repo, rev="origin/main")


def test_a_decision_refuses_an_unverified_ledger_with_one_line(tmp_path: Path, repo: Path) -> None:
    """`verified()` (what promote, rollback, shadow and the watcher call before they read
    the records they decide on) raises DecisionRecordsError naming the first bad record
    and saying what to do; a ledger that verifies passes, and a forger who rewrites the
    chain and its head is caught by the next check."""
    url = f"sqlite:///{tmp_path / 'decide.db'}"
    led = open_signed(url, repo)
    fill(led, 3)
    led.verified()
    led.verified()  # the head it verified: not read again
    forge(url, 2, "edited")
    with pytest.raises(DecisionRecordsError) as info:
        led.verified()
    assert info.value.seq == 2 and "refusing to act on ledger" in info.value.message
    assert "\n" not in info.value.message and "ledger verify" in info.value.remedy


def test_verify_against_a_remote_whose_branch_cannot_be_read_fails_closed(
    ledger_db: str, repo: Path, tmp_path: Path
) -> None:
    """A remote that has the anchor but no default branch to read the trusted keys from
    fails the check; it never falls back to this clone's keys (which a forger controls)."""
    remote = tmp_path / "anchor-only.git"
    git(tmp_path, "init", "-q", "--bare", str(remote))
    git(repo, "remote", "add", "origin", str(remote))
    led = open_signed(ledger_db, repo)
    fill(led, 2)
    git(repo, "push", "-q", "origin", anc.ANCHOR_REF)  # the anchor only, no branch
    assert led.verify().ok
    res = led.verify(remote="origin")
    assert not res.ok and "default branch of remote origin" in (res.problem or "")
