"""The trust root: policy, trusted keys and approvers come from a commit on the protected
ref (releasekit.stores.trust), with real git repositories: a bare repository stands for the
team's server, as in `project_copy.publish`.

Each test is an attack or a mistake a user could make: a variable or config file naming
another revision, a local commit that relaxes the policy or adds a key, a `git replace`
that swaps releasekit.toml, a folder outside git, a revoked key, a key nobody committed,
and a ledger record whose policy digest does not match its commit."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from project_copy import land, publish
from typer.testing import CliRunner

from releasekit._support.digests import digest_obj
from releasekit.cli import app
from releasekit.cli._common import State
from releasekit.config import Settings, load_settings
from releasekit.errors import ConfigError, SignatureError, SigningKeyError
from releasekit.promote.policy import PolicyError, environment_policy, read_policy
from releasekit.stores import signing
from releasekit.stores.ledger import Event, EventType, Ledger, open_ledger
from releasekit.stores.trust import TrustRootError, require_trusted, trust_root

RID = "cd" * 32

TOML = """\
[environments.staging]
port = 18780
requires_approval = true
approvers = ["{approver}"]
min_pass_rate = {{ core = 0.90 }}

[environments.dev]
port = 18790
gates_required = false
"""


def git(repo: Path, *args: str) -> str:
    """Run git in repo as Ada, return stdout."""
    return subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=Ada", "-c", "user.email=ada@example.com", *args],
        check=True,
        capture_output=True,
        text=True,
    ).stdout


@pytest.fixture
def proj(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A project as a team has it: releasekit.toml (a gated `staging` with an approver, an
    ungated `dev`), the release key and the approver's key committed, all pushed to a bare
    `origin` the branch tracks. The release key signs (RELEASEKIT_SIGNING_KEY)."""
    root = tmp_path / "proj"
    root.mkdir()
    git(root, "init", "-q")
    release = signing.generate_keypair(root)
    approver = signing.generate_keypair(root, private_path=tmp_path / "approver.pem")
    (root / "releasekit.toml").write_text(TOML.format(approver=approver.key_id))
    git(root, "add", "releasekit.toml", "keys")
    git(root, "commit", "-qm", "policy and keys")
    publish(root)
    for var in ("RELEASEKIT_CONFIG", "RELEASEKIT_TRUSTED_KEYS_REV", "RELEASEKIT_SIGNING_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RELEASEKIT_ROOT", str(root))
    monkeypatch.setenv("RELEASEKIT_SIGNING_KEY", str(release.private_path))
    monkeypatch.chdir(root)
    State.reset()
    return root


def settings_of(root: Path) -> Settings:
    return load_settings(root=root)


def staging_policy(root: Path) -> str:
    s = settings_of(root)
    return environment_policy(s, "staging", s.environments["staging"]).source.digest


# -- no per-command override --------------------------------------------------------------


def test_a_variable_or_config_file_naming_the_trust_revision_is_refused(
    proj: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """RELEASEKIT_TRUSTED_KEYS_REV, a `trusted_keys_rev` in a file RELEASEKIT_CONFIG
    points at, or one passed as a setting, are refused with one line: no command chooses
    the revision its policy and keys are read from."""
    monkeypatch.setenv("RELEASEKIT_TRUSTED_KEYS_REV", "HEAD~0")
    with pytest.raises(ConfigError, match="trust revision is not a setting") as info:
        load_settings(root=proj)
    assert "\n" not in info.value.message
    monkeypatch.delenv("RELEASEKIT_TRUSTED_KEYS_REV")
    other = tmp_path / "other.toml"
    other.write_text('trusted_keys_rev = "HEAD"\n' + (proj / "releasekit.toml").read_text())
    monkeypatch.setenv("RELEASEKIT_CONFIG", str(other))
    with pytest.raises(ConfigError, match="trusted_keys_rev"):
        load_settings(root=proj)
    monkeypatch.delenv("RELEASEKIT_CONFIG")
    with pytest.raises(ConfigError, match="trusted_keys_rev"):
        load_settings(root=proj, trusted_keys_rev="HEAD")
    r = CliRunner().invoke(app, ["ledger", "verify"], env={"RELEASEKIT_TRUSTED_KEYS_REV": "x"})
    assert r.exit_code == 1 and "trust revision is not a setting" in r.output
    assert "Traceback" not in r.output


def test_a_protected_revision_in_another_config_file_is_ignored(
    proj: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`[trust] protected_revision` counts only as committed at HEAD: one in a file
    RELEASEKIT_CONFIG points at (naming a local branch the user controls) changes nothing,
    and a committed one that names a local branch is refused."""
    git(proj, "branch", "mine")
    other = tmp_path / "other.toml"
    other.write_text(
        '[trust]\nprotected_revision = "mine"\n' + (proj / "releasekit.toml").read_text()
    )
    monkeypatch.setenv("RELEASEKIT_CONFIG", str(other))
    load_settings(root=proj)  # accepted ...
    tr = trust_root(proj)
    assert tr.how == "upstream" and tr.protected_name == f"origin/{branch(proj)}"  # ... unused
    monkeypatch.delenv("RELEASEKIT_CONFIG")
    # Without an upstream, the committed pin decides; a local branch cannot be one.
    git(proj, "branch", "--unset-upstream")
    text = (proj / "releasekit.toml").read_text()
    (proj / "releasekit.toml").write_text('[trust]\nprotected_revision = "mine"\n' + text)
    git(proj, "commit", "-qam", "pin a local branch")
    with pytest.raises(TrustRootError, match="not a remote-tracking branch or tag"):
        require_trusted(proj, "staging")


def branch(root: Path) -> str:
    return git(root, "symbolic-ref", "--short", "HEAD").strip()


# -- the protected ref --------------------------------------------------------------------


def test_a_local_commit_that_relaxes_the_policy_is_refused_naming_the_commit(proj: Path) -> None:
    """A commit that lowers staging's floor and is not pushed is not the policy: promote's
    policy check refuses it in one line naming the commit and the protected ref, and the
    policy recorded for a rollback (`read_policy`) is still the one on origin. Once the
    commit lands on origin, it is the policy."""
    before = staging_policy(proj)
    toml = proj / "releasekit.toml"
    toml.write_text(toml.read_text().replace("core = 0.90", "core = 0.10"))
    git(proj, "commit", "-qam", "relax staging")
    head = git(proj, "rev-parse", "HEAD").strip()
    s = settings_of(proj)
    with pytest.raises(TrustRootError) as info:
        environment_policy(s, "staging", s.environments["staging"])
    msg = info.value.message
    assert f"commit {head[:12]} is not on the protected ref origin/{branch(proj)}" in msg
    assert "\n" not in msg and "land the commit" in info.value.remedy
    pol = read_policy(s, "staging", s.environments["staging"])
    assert pol.source.commit != head and pol.source.rev == f"origin/{branch(proj)}"
    assert pol.differs == ["min_pass_rate"] and pol.source.digest == before
    # The ungated environment keeps working from the local commit.
    assert environment_policy(s, "dev", s.environments["dev"]).source.commit == head
    land(proj)
    assert staging_policy(proj) != before


def test_a_checkout_behind_the_protected_ref_is_trusted(proj: Path) -> None:
    """HEAD an ancestor of the fetched branch (a clone that has not pulled yet) is on it."""
    first = git(proj, "rev-parse", "HEAD").strip()
    (proj / "notes.txt").write_text("x\n")
    git(proj, "add", "notes.txt")
    git(proj, "commit", "-qm", "notes")
    land(proj)
    git(proj, "reset", "-q", "--hard", first)
    tr = require_trusted(proj, "staging")
    assert tr.on_protected and tr.commit == first


def test_no_protected_ref_refuses_a_gated_environment_and_a_committed_pin_serves(
    proj: Path,
) -> None:
    """A branch that tracks nothing, with no `[trust] protected_revision` committed: a gated
    environment is refused (one line saying so), an ungated one works. Committing a pin
    that names the remote-tracking branch (a detached CI checkout's case) restores it."""
    git(proj, "branch", "--unset-upstream")
    s = settings_of(proj)
    with pytest.raises(TrustRootError, match="no protected ref configured"):
        environment_policy(s, "staging", s.environments["staging"])
    environment_policy(s, "dev", s.environments["dev"])
    text = (proj / "releasekit.toml").read_text()
    pin = f'[trust]\nprotected_revision = "origin/{branch(proj)}"\n'
    (proj / "releasekit.toml").write_text(pin + text)
    git(proj, "commit", "-qam", "pin the protected ref")
    git(proj, "push", "-q", "origin", f"HEAD:refs/heads/{branch(proj)}")
    git(proj, "checkout", "-q", "--detach")
    tr = require_trusted(proj, "staging")
    assert tr.how == "committed" and tr.on_protected
    environment_policy(settings_of(proj), "staging", s.environments["staging"])


def test_outside_git_a_gated_environment_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no git repository the working tree would be the policy: an environment with
    gates or approvals is refused in one line; one with neither works (recorded as
    uncommitted)."""
    root = tmp_path / "plain"
    root.mkdir()
    (root / "releasekit.toml").write_text(TOML.format(approver="0" * 16))
    monkeypatch.setenv("RELEASEKIT_ROOT", str(root))
    monkeypatch.delenv("RELEASEKIT_CONFIG", raising=False)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    s = load_settings(root=root)
    with pytest.raises(TrustRootError, match="is not a git repository") as info:
        environment_policy(s, "staging", s.environments["staging"])
    assert "staging has gates or approvals" in info.value.message
    pol = environment_policy(s, "dev", s.environments["dev"])
    assert pol.source.kind == "uncommitted"


def test_git_replace_does_not_swap_the_committed_policy(proj: Path) -> None:
    """`git replace` of releasekit.toml's blob by a relaxed one (git itself then shows the
    relaxed file at HEAD) is not seen: the policy read is the committed one, and the
    relaxed settings on disk are refused as differing from it."""
    before = staging_policy(proj)
    toml = proj / "releasekit.toml"
    relaxed = toml.read_text().replace("core = 0.90", "core = 0.10")
    real_blob = git(proj, "rev-parse", "HEAD:releasekit.toml").strip()
    fake_blob = subprocess.run(
        ["git", "-C", str(proj), "hash-object", "-w", "--stdin"],
        input=relaxed,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    git(proj, "replace", real_blob, fake_blob)
    assert "core = 0.10" in git(proj, "show", "HEAD:releasekit.toml")  # what git shows
    toml.write_text(relaxed)
    s = settings_of(proj)
    pol = read_policy(s, "staging", s.environments["staging"])
    assert pol.source.digest == before and pol.differs == ["min_pass_rate"]
    with pytest.raises(PolicyError, match=r"differs from releasekit\.toml at HEAD"):
        environment_policy(s, "staging", s.environments["staging"])


# -- keys: untrusted appends, revocation ------------------------------------------------------


def test_an_append_signed_by_an_untrusted_key_is_refused(proj: Path, tmp_path: Path) -> None:
    """A key nobody committed (or committed locally, not landed) cannot sign: the append is
    refused with one line naming the key, and nothing is written."""
    rogue = signing.generate_keypair(proj, private_path=tmp_path / "rogue.pem")
    led = open_ledger(settings_of(proj))
    led.append(Event(type=EventType.BUILD, to_release=RID))
    for step in ("uncommitted", "committed locally"):
        if step == "committed locally":
            git(proj, "add", "keys")
            git(proj, "commit", "-qm", "trust my own key")
        s = load_settings(root=proj, signing_key=rogue.private_path)
        with pytest.raises(SigningKeyError) as info:
            open_ledger(s).append(Event(type=EventType.BUILD, to_release=RID, reason=step))
        assert f"signing key {rogue.key_id} is not trusted" in info.value.message
        assert "\n" not in info.value.message and "nothing was written" in info.value.remedy
    assert led.count() == 1 and led.verify().ok
    land(proj)  # reviewed and landed: now it signs
    s = load_settings(root=proj, signing_key=rogue.private_path)
    open_ledger(s).append(Event(type=EventType.BUILD, to_release=RID, reason="landed"))
    assert open_ledger(s, read_only=True).verify().ok


def test_revoking_a_key_after_a_record_keeps_earlier_records_and_fails_later_ones(
    proj: Path, tmp_path: Path
) -> None:
    """`keys/revoked` with `<kid> after 2`: records 1-2 signed by the key still verify,
    record 3 (signed before the revocation landed, e.g. by a stolen key) fails naming the
    cut-off, and the key appends nothing more; another trusted key carries on."""
    s = settings_of(proj)
    led = open_ledger(s)
    for i in range(3):
        led.append(Event(type=EventType.BUILD, to_release=RID, reason=f"r{i}"))
    kid = led.signer.key_id if led.signer else ""
    (proj / "keys" / "revoked").write_text(f"# stolen laptop\n{kid} after 2\n")
    git(proj, "add", "keys/revoked")
    git(proj, "commit", "-qm", "revoke the release key after record 2")
    land(proj)
    res = open_ledger(s, read_only=True).verify()
    assert not res.ok and res.first_bad_seq == 3
    assert f"key {kid}, which keys/revoked revokes after record 2" in (res.problem or "")
    with pytest.raises(SigningKeyError, match="revoked after record 2"):
        open_ledger(s).append(Event(type=EventType.BUILD, to_release=RID))
    trusted = signing.trusted_keys(proj)
    with pytest.raises(SignatureError, match="revokes after record 2"):
        rec = open_ledger(s, read_only=True).records()[2]
        signing.verify_signature(
            trusted, record_hash=rec.hash, key_id=kid, signature=rec.signature or "", seq=3
        )
    # Record 2 and before still verify under the revocation.
    rec = open_ledger(s, read_only=True).records()[1]
    signing.verify_signature(
        trusted, record_hash=rec.hash, key_id=kid, signature=rec.signature or "", seq=2
    )


def test_a_malformed_revocation_line_is_one_clear_error(proj: Path) -> None:
    (proj / "keys" / "revoked").write_text("everything after 3\n")
    git(proj, "add", "keys/revoked")
    git(proj, "commit", "-qm", "bad line")
    land(proj)
    with pytest.raises(SigningKeyError, match=r"keys/revoked line 1 is not `<key id> after <seq>`"):
        signing.trusted_keys(proj)


def test_approvers_come_from_the_protected_commit_not_the_commands_config(
    proj: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A config file naming the promoter's own key as staging's approver does not make it
    one: the ledger's approver set is the committed one."""
    release_kid = signing.find_signer(proj).key_id  # type: ignore[union-attr]
    text = (proj / "releasekit.toml").read_text()
    other = tmp_path / "other.toml"
    committed_approver = text.split('approvers = ["')[1].split('"')[0]
    other.write_text(text.replace(committed_approver, release_kid))
    monkeypatch.setenv("RELEASEKIT_CONFIG", str(other))
    open_ledger(load_settings(root=proj)).append(Event(type=EventType.BUILD, to_release=RID))
    led = open_ledger(load_settings(root=proj), read_only=True)
    assert led.approvers["staging"].key_ids == [committed_approver]


# -- ledger verify --remote: each decision's policy at its commit ------------------------------


def _promote_event(s: Settings, *, digest: str | None = None, commit: str | None = None) -> Event:
    ev = read_policy(s, "staging", s.environments["staging"]).evidence()
    if digest is not None:
        ev["source"]["digest"] = digest
    if commit is not None:
        ev["source"]["commit"] = commit
    return Event(
        type=EventType.PROMOTE,
        environment="staging",
        to_release=RID,
        live=True,
        reason="ship",
        evidence={"policy": ev},
    )


def test_verify_remote_recomputes_each_decisions_policy_digest_at_its_commit(
    proj: Path, tmp_path: Path
) -> None:
    """A promote record whose policy digest matches releasekit.toml at its commit passes
    `ledger verify --remote origin`; one whose digest does not (the decision was made by
    another policy than the commit it names), or whose commit never landed on origin,
    fails, naming the record."""
    s = settings_of(proj)
    approver = signing.load_private_key(tmp_path / "approver.pem")
    Ledger(
        s.ledger_url or "", signer=approver, anchor_repo=proj, trusted=signing.trusted_keys(proj)
    ).append(Event(type=EventType.APPROVE, environment="staging", to_release=RID, reason="ok"))
    led = open_ledger(s)
    led.append(_promote_event(s))
    git(proj, "push", "-q", "origin", "refs/releasekit/ledger")
    git(proj, "symbolic-ref", "HEAD", f"refs/heads/{branch(proj)}")
    runner = CliRunner()
    r = runner.invoke(app, ["ledger", "verify", "--remote", "origin"])
    assert r.exit_code == 0, r.output
    assert "policies: 1 decision(s) recomputed" in r.output
    led.append(_promote_event(s, digest=digest_obj({"gates_required": False})))
    git(proj, "push", "-q", "origin", "+refs/releasekit/ledger")
    State.reset()
    r = runner.invoke(app, ["ledger", "verify", "--remote", "origin"])
    assert r.exit_code == 1
    text = " ".join(r.output.split())
    assert "record 3 (promote in staging) records policy digest" in text
    assert "was not made by the policy committed there" in text and "Traceback" not in text
    # A decision read at a local commit that never reached origin.
    toml = proj / "releasekit.toml"
    toml.write_text(toml.read_text() + "\n# local\n")
    git(proj, "commit", "-qam", "local only")
    local = git(proj, "rev-parse", "HEAD").strip()
    res_led = open_ledger(s)
    res_led.append(_promote_event(s, commit=local))
    from releasekit.promote.policy import check_recorded_policies

    on = git(proj, "rev-parse", f"origin/{branch(proj)}").strip()
    _n, problems = check_recorded_policies(res_led, proj, on=on, on_name="origin")
    seqs = {seq: p for seq, p in problems}
    assert 4 in seqs and "not on origin: a commit that never landed" in seqs[4]


def test_ungated_policy_and_keys_work_without_a_remote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A repository with no remote (a laptop trying releasekit): an ungated environment's
    policy is read at HEAD, and keys committed at HEAD sign."""
    root = tmp_path / "solo"
    root.mkdir()
    git(root, "init", "-q")
    key = signing.generate_keypair(root)
    (root / "releasekit.toml").write_text(
        "[environments.dev]\nport = 18790\ngates_required = false\n"
    )
    git(root, "add", "-A")
    git(root, "commit", "-qm", "solo")
    monkeypatch.setenv("RELEASEKIT_ROOT", str(root))
    monkeypatch.delenv("RELEASEKIT_CONFIG", raising=False)
    s = load_settings(root=root, signing_key=key.private_path)
    assert environment_policy(s, "dev", s.environments["dev"]).source.kind == "committed"
    led = open_ledger(s)
    led.append(Event(type=EventType.BUILD, to_release=RID))
    assert led.verify().ok


def test_verify_remote_judges_a_record_by_the_policy_fields_it_holds(proj: Path) -> None:
    """A shadow or canary record holds only its policy's source: its digest is recomputed,
    and no policy copy is asked of it. A decision recorded before a policy field existed is
    judged by the fields it held; the same record with one of those values changed is not."""
    from releasekit.promote.policy import check_recorded_policies

    s = settings_of(proj)
    led = open_ledger(s)
    source = _promote_event(s).evidence["policy"]["source"]
    led.append(
        Event(
            type=EventType.SHADOW,
            environment="staging",
            to_release=RID,
            reason="compared",
            evidence={"policy": {"source": source}},
        )
    )
    older = _promote_event(s)
    fields = dict(older.evidence["policy"]["policy"])
    fields.pop("watch_floor", None)  # a field this record's release of releasekit lacked
    older.evidence["policy"]["policy"] = fields
    older.evidence["policy"]["source"]["digest"] = digest_obj(fields)
    led.append(older)
    checked, problems = check_recorded_policies(led, proj)
    assert checked == 2 and problems == []
    changed = _promote_event(s)
    changed.evidence["policy"]["policy"] = {**fields, "gates_required": False}
    changed.evidence["policy"]["source"]["digest"] = digest_obj(
        changed.evidence["policy"]["policy"]
    )
    led.append(changed)
    _checked, problems = check_recorded_policies(led, proj)
    assert [seq for seq, _ in problems] == [3]
    assert "was not made by the policy committed there" in problems[0][1]
