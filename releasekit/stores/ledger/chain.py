"""Checking the ledger: the hash chain, every signature and every git anchor (`verify`)."""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field
from sqlalchemy import Connection, select

from releasekit._support.text import redact_url
from releasekit.errors import LedgerIntegrityError, SignatureError
from releasekit.stores import anchor as anchors
from releasekit.stores.ledger.schema import (
    GENESIS,
    LedgerRecord,
    _to_record,
    events_table,
    head_table,
    record_hash,
    signatures_table,
)
from releasekit.stores.signing import ApproverSet, trusted_keys, verify_signature

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey


class VerifyResult(BaseModel):
    """Outcome of checking the ledger: the chain, every signature, every git anchor.

    `first_bad_seq` names the first broken record; `signing` is "signed" (every record),
    "unsigned" (none), "partly signed" (records before signing began are not), or
    "not checked" (no trusted keys given); `anchoring` says whether git anchors were checked.
    """

    ok: bool
    url: str
    records: int
    head_seq: int | None = None
    head_hash: str | None = None
    first_bad_seq: int | None = None
    event_id: str | None = None
    problem: str | None = None
    signing: str = "not checked"
    signed: int = 0
    unsigned: int = 0
    key_ids: list[str] = Field(default_factory=list)
    anchoring: str = "not checked"
    anchors: int = 0
    anchored_seq: int | None = None
    approvals: str = Field(
        "not checked",
        description="'checked': every release put live in an environment that requires an "
        "approval had one signed by an approver other than the promoter; 'not checked': no "
        "approval policy known",
    )
    unapproved: list[int] = Field(
        default_factory=list, description="records that put a release live without it"
    )
    notes: list[str] = Field(default_factory=list)


class DecisionRecordsError(LedgerIntegrityError):
    """Raised before promote, rollback, shadow or the watcher acts, when the ledger records
    the decision rests on (approvals, mark_bad, what is live) do not verify: a broken
    chain, a record unsigned or signed by an untrusted key, a ledger behind its git anchor,
    or signed records while no key is trusted. `seq` is the first bad record."""

    remedy = (
        "run `releasekit ledger verify` for the details; restore the ledger from a backup, or "
        "commit the signer's keys/<key id>.pub if it is a legitimate key; nothing was "
        "changed; to go back meanwhile: `releasekit rollback ENV --break-glass --reason TEXT`"
    )


# Live events that put a release in place by a decision (not by going back: rollback).
_PROMOTIONS = frozenset({"promote", "override", "assign", "deploy"})


class LedgerVerification:
    """The checking half of `Ledger` (a mixin: it reads through the ledger's connection)."""

    url: str
    trusted: Mapping[str, Ed25519PublicKey] | None
    trusted_from: str | None
    anchor_repo: Path | None
    approvers: dict[str, ApproverSet]
    _has_sigs: bool
    _verified: tuple[int, str] | None

    if TYPE_CHECKING:

        def _read(self) -> AbstractContextManager[Connection]: ...

        def head(self) -> tuple[int, str] | None: ...

    def verified(self, *, again: bool = False) -> None:
        """Check the whole ledger (chain, signatures against the trusted keys, git anchors)
        before a decision reads it; raise DecisionRecordsError naming what failed. A head
        already verified by this ledger object is not checked again (the ledgers are small:
        one pass per command) unless `again`: a long-running process (the watcher) checks
        afresh before each decision, since a record edited in place leaves the head as it was."""
        head = self.head()
        if not again and head is not None and head == self._verified:
            return
        res = self.verify(audit=False)
        if not res.ok:
            raise DecisionRecordsError(
                f"refusing to act on ledger {res.url}: {res.problem}", seq=res.first_bad_seq
            )
        if res.head_seq is not None and res.head_hash is not None:
            self._verified = (res.head_seq, res.head_hash)

    def verify(
        self,
        *,
        trusted: Mapping[str, Ed25519PublicKey] | None = None,
        anchor_repo: Path | None = None,
        remote: str | None = None,
        audit: bool = True,
    ) -> VerifyResult:
        """Check the whole ledger; name the first record that was edited, deleted, reordered,
        re-signed or rewritten behind a git anchor.

        Checks, in one pass: the chain (seq, prev_hash, hash) and the head row; every
        signature against `trusted` (default: the keys the ledger was opened with; None
        and no keys configured: signatures are not checked) and that no record after a signed
        one is unsigned; and that the ledger extends every anchored head in `anchor_repo`
        (default: the ledger's anchor repository). Once keys are trusted, a ledger whose
        records are all unsigned fails too (its signatures were removed).

        `remote` (a git remote of the anchor repository) fetches the anchor that was pushed
        there and the remote's default branch: the ledger must extend that anchor, and the
        keys trusted are the ones committed on that branch, so neither a re-anchored local
        ref nor a locally committed key can vouch for a replaced ledger.

        With `audit` and an approval policy (`approvers`, set by `open_ledger` from the
        settings), every record that put a release live (promote, override, assign, deploy)
        in an environment that requires an approval must follow an `approve` record of that
        release for that environment signed by one of its approvers with a key other than
        the record's own; those that do not are listed in `unapproved` and fail.

        An empty set of trusted keys while records (or the git anchors) are signed fails:
        nothing could be checked, and an unsigned replacement ledger would pass.

        Returns a result (ok or not) rather than raising, so a caller can report it; use
        `check()` to raise instead.
        """
        url = redact_url(self.url)
        trusted = self.trusted if trusted is None else trusted
        trusted_from = self.trusted_from
        repo = anchor_repo or self.anchor_repo
        remote_ref: str | None = None
        remote_bad: tuple[int, str, str | None] | None = None
        if remote is not None:
            if repo is None:
                remote_bad = (1, f"cannot check remote {remote}: no git repository", None)
            else:
                try:
                    remote_ref, remote_head = anchors.fetch_remote(repo, remote)
                except anchors.AnchorError as exc:
                    remote_bad = (1, exc.message, None)
                else:
                    if remote_head is None:
                        # Fail closed: the keys to trust come from the remote, never
                        # silently from this clone (which a forger may have changed).
                        remote_bad = (
                            1,
                            f"cannot read the default branch of remote {remote}, whose "
                            "committed keys are the ones to trust",
                            None,
                        )
                    else:
                        trusted = trusted_keys(repo, rev=remote_head)
                        trusted_from = f"{remote}'s default branch"
        expected_seq, prev_hash, n = 1, GENESIS, 0
        chain_bad: tuple[int, str, str | None] | None = None
        sig_bad: tuple[int, str, str | None] | None = None
        pairs: list[tuple[int, str]] = []
        signed = unsigned = 0
        first_signed: int | None = None
        key_ids: set[str] = set()
        # (seq, environment, release, key id) of approvals and of live promotions.
        approved: list[tuple[int, str | None, str | None, str | None]] = []
        promoted: list[tuple[int, str, str | None, str | None, str | None]] = []

        with self._read() as conn:
            head = conn.execute(select(head_table).where(head_table.c.id == 1)).first()
            sigs: dict[int, tuple[str, str]] = {}
            if self._has_sigs:
                for srow in conn.execute(select(signatures_table)):
                    sigs[int(srow.seq)] = (str(srow.key_id), str(srow.signature))
            result = conn.execution_options(yield_per=2000).execute(
                select(events_table).order_by(events_table.c.seq)
            )
            for row in result:
                m = dict(row._mapping)
                n += 1
                seq = m["seq"]
                pairs.append((seq, m["hash"]))
                if chain_bad is None:
                    chain_bad = _chain_problem(m, expected_seq, prev_hash)
                    prev_hash = m["hash"]
                    expected_seq = seq + 1
                got = sigs.get(seq)
                kid = got[0] if got is not None else None
                if m["type"] == "approve":
                    approved.append((seq, m["environment"], m["to_release"], kid))
                elif m["type"] in _PROMOTIONS and m["live"]:
                    promoted.append((seq, m["type"], m["environment"], m["to_release"], kid))
                if got is not None:
                    signed += 1
                    key_ids.add(got[0])
                    first_signed = first_signed or seq
                    if trusted is not None and not trusted and sig_bad is None:
                        sig_bad = (
                            seq,
                            f"record {seq} is signed by key {got[0]}, but the repository "
                            "trusts no key"
                            + (f" ({trusted_from} holds no .pub)" if trusted_from else "")
                            + ": nothing can be verified",
                            m["event_id"],
                        )
                    elif trusted is not None and sig_bad is None:
                        try:
                            verify_signature(
                                trusted,
                                record_hash=m["hash"],
                                key_id=got[0],
                                signature=got[1],
                                seq=seq,
                            )
                        except SignatureError as exc:
                            sig_bad = (seq, exc.message, m["event_id"])
                else:
                    unsigned += 1
                    if first_signed is not None and sig_bad is None:
                        sig_bad = (
                            seq,
                            f"record {seq} is unsigned although record {first_signed} before "
                            "it is signed: its signature was removed, or it was written by a "
                            "process without the signing key",
                            m["event_id"],
                        )
        last_seq = expected_seq - 1
        if chain_bad is None:
            if head is None:
                if n:
                    chain_bad = (last_seq + 1, "the ledger head record is missing (deleted)", None)
            elif (head.seq, head.hash) != (last_seq, prev_hash):
                if head.seq > last_seq:
                    chain_bad = (
                        last_seq + 1,
                        f"records {last_seq + 1}..{head.seq} are missing (deleted from the "
                        f"end): the head says the chain ends at {head.seq}",
                        None,
                    )
                else:
                    chain_bad = (
                        last_seq,
                        f"the ledger head does not match record {last_seq} (edited)",
                        None,
                    )
        if trusted and n and signed == 0 and sig_bad is None:
            sig_bad = (
                last_seq,
                f"no record is signed although the repository trusts key(s) "
                f"{', '.join(sorted(trusted))}: the signatures were removed (and the chain "
                "perhaps rewritten), or the ledger was written without the signing key",
                None,
            )

        notes: list[str] = []
        anchor_bad: tuple[int, str, str | None] | None = None
        anchoring = "not checked"
        n_anchors = 0
        anchored_seq: int | None = None
        if repo is None:
            notes.append("no git repository configured: anchors not checked")
        else:
            try:
                refs = anchors.anchor_refs(repo)
                checked = [(ref, anchors.read_anchors(repo, ref=ref)) for ref in refs]
            except anchors.AnchorError as exc:
                notes.append(f"anchors not checked: {exc.message}")
                checked = []
            else:
                anchoring = "anchored" if any(a for _, a in checked) else "no anchors yet"
            if remote_ref is not None and not any(r == remote_ref and a for r, a in checked):
                remote_bad = (1, f"remote {remote} holds no ledger anchor", None)
            for _ref, found in checked:
                n_anchors += len(found)
                if found:
                    anchored_seq = max(anchored_seq or 0, found[-1].seq)
                res = anchors.check_extends(pairs, found)
                if not res.ok and res.first_bad_seq is not None:
                    cand = (res.first_bad_seq, res.problem or "anchor mismatch", None)
                    if anchor_bad is None or cand[0] < anchor_bad[0]:
                        anchor_bad = cand
                    continue
                for a in found:  # the signer an anchor saw must still be there
                    if a.key_id is None:
                        continue
                    if trusted is not None and not trusted:
                        cand = (
                            a.seq,
                            f"{a.ref} anchored record {a.seq} signed by key {a.key_id}, but "
                            "the repository trusts no key: a ledger checked against no key "
                            "proves nothing",
                            None,
                        )
                        if anchor_bad is None or cand[0] < anchor_bad[0]:
                            anchor_bad = cand
                        break
                    now = sigs.get(a.seq)
                    if now is None or now[0] != a.key_id:
                        what = "unsigned" if now is None else f"signed by key {now[0]}"
                        cand = (
                            a.seq,
                            f"record {a.seq} was signed by key {a.key_id} when {a.ref} "
                            f"anchored it; it is now {what}",
                            None,
                        )
                        if anchor_bad is None or cand[0] < anchor_bad[0]:
                            anchor_bad = cand
                        break
        if trusted is None:
            signing = "not checked"
        elif n == 0:
            signing = "empty"
        elif signed == n:
            signing = "signed"
        elif signed == 0:
            signing = "unsigned"
        else:
            signing = "partly signed"
        if signing == "partly signed" and first_signed:
            notes.append(f"records 1..{first_signed - 1} predate signing (unsigned)")
        if trusted_from:
            notes.append(f"trusted keys: {trusted_from}")
        approvals = "not checked"
        unapproved: list[int] = []
        approval_bad: tuple[int, str, str | None] | None = None
        policy = getattr(self, "approvers", None) or {}
        if audit and policy:
            approvals = "checked"
            for seq, etype, env, rid, kid in promoted:
                aset = policy.get(env)
                if aset is None or not aset.required:
                    continue
                ok = [
                    a_seq
                    for a_seq, a_env, a_rid, a_kid in approved
                    if a_seq < seq and (a_env, a_rid) == (env, rid)
                    if a_kid is not None and a_kid in aset.keys and a_kid != kid
                ]
                if ok:
                    continue
                unapproved.append(seq)
                if approval_bad is None:
                    approval_bad = (
                        seq,
                        f"record {seq} ({etype}) put {(rid or '-')[:12]} live in {env}, which "
                        f"requires an approval, without one signed by an approver of {env} "
                        "other than the promoter's key",
                        None,
                    )
            if len(unapproved) > 1:
                notes.append(
                    "put live without a distinct approver: records "
                    + ", ".join(str(q) for q in unapproved)
                )
        problems = [
            p for p in (chain_bad, sig_bad, anchor_bad, remote_bad, approval_bad) if p is not None
        ]
        base = {
            "url": url,
            "records": n,
            "signing": signing,
            "signed": signed,
            "unsigned": unsigned,
            "key_ids": sorted(key_ids),
            "anchoring": anchoring,
            "anchors": n_anchors,
            "anchored_seq": anchored_seq,
            "approvals": approvals,
            "unapproved": unapproved,
        }
        if problems:
            first = min(problems, key=lambda p: p[0])  # stable: chain, then signature, anchor
            others = [p[1] for p in problems if p is not first]
            return VerifyResult(
                ok=False,
                first_bad_seq=first[0],
                event_id=first[2],
                problem=first[1],
                notes=notes + others,
                **base,
            )
        return VerifyResult(
            ok=True,
            head_seq=last_seq or None,
            head_hash=prev_hash if n else None,
            notes=notes,
            **base,
        )

    def check(self) -> VerifyResult:
        """Like `verify()`, but raise LedgerIntegrityError naming the first bad record."""
        res = self.verify()
        if not res.ok:
            raise LedgerIntegrityError(f"ledger {res.url}: {res.problem}", seq=res.first_bad_seq)
        return res


def _chain_problem(
    m: dict[str, Any], expected_seq: int, prev_hash: str
) -> tuple[int, str, str | None] | None:
    """The first chain problem at this row, or None: a gap, a broken link, an edited row."""
    seq = m["seq"]
    if seq != expected_seq:
        what = (
            f"record {expected_seq} is missing (deleted)"
            if expected_seq == seq - 1
            else f"records {expected_seq}..{seq - 1} are missing (deleted)"
        )
        return (expected_seq, f"{what}: the chain jumps from {expected_seq - 1} to {seq}", None)
    if m["prev_hash"] != prev_hash:
        return (
            seq,
            f"record {seq} does not follow record {seq - 1}: its prev_hash does not match "
            f"(records were reordered, or record {seq - 1} was rewritten)",
            m["event_id"],
        )
    if record_hash(m) != m["hash"]:
        return (
            seq,
            f"record {seq} (event {m['event_id']}) was edited: its contents do not match its hash",
            m["event_id"],
        )
    return None


class VerifiedPrefix(BaseModel):
    """The part of the ledger that verifies: every record before the first bad one.

    `ok`: the whole ledger verifies (`records` is all of it). Otherwise `first_bad_seq` and
    `problem` say which record failed and how, and `records` holds only the records before
    it, each checked (chain, signature, git anchor) as `verify` checks the whole ledger."""

    ok: bool
    first_bad_seq: int | None = None
    event_id: str | None = None
    problem: str | None = None
    records: list[LedgerRecord] = Field(default_factory=list)

    @property
    def head_seq(self) -> int | None:
        """The last verified record's seq (None: nothing verifies)."""
        return self.records[-1].seq if self.records else None

    def failure(self) -> dict[str, Any]:
        """What a record written past the failure says about it (ledger evidence)."""
        return {
            "first_bad_seq": self.first_bad_seq,
            "event_id": self.event_id,
            "problem": self.problem,
            "verified_up_to": self.head_seq,
        }


def first_bad(ledger: LedgerVerification) -> VerifyResult:
    """Verify the ledger as a decision does (chain, signatures, anchors; not the approval
    audit): the result names the first record that fails, if any."""
    return ledger.verify(audit=False)


def verified_prefix(ledger: Any) -> VerifiedPrefix:
    """The records of `ledger` (a `Ledger`) that verify: all of them, or those before the
    first bad record. A record at or after the first failure is never in it, whatever it
    says, so a decision read from the prefix cannot be steered by a forged or junk row."""
    res = first_bad(ledger)
    q = ledger._select()
    if not res.ok:  # rows at and after the failure are not even parsed
        q = q.where(events_table.c.seq < (res.first_bad_seq or 1))
    with ledger._read() as conn:
        recs = [_to_record(r) for r in conn.execute(q.order_by(events_table.c.seq))]
    if res.ok:
        return VerifiedPrefix(ok=True, records=recs)
    return VerifiedPrefix(
        ok=False,
        first_bad_seq=res.first_bad_seq,
        event_id=res.event_id,
        problem=res.problem,
        records=recs,
    )
