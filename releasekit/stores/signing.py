"""Ed25519 signatures on ledger records: keys outside the ledger database, public keys in git.

How a team issues and names keys:

- `releasekit ledger keygen` (`generate_keypair`) makes an Ed25519 keypair. The private key is
  written as an unencrypted PKCS#8 PEM to `.releasekit/keys/<key id>.pem` (mode 0600; the state
  folder is git-ignored) or wherever `RELEASEKIT_SIGNING_KEY` points on a CI runner or a
  release machine; it never enters the ledger database. The public key goes to
  `keys/<key id>.pub` in the repository, and a team commits it like code: the set of `.pub`
  files committed in the repository *are* the list of trusted signers, reviewed in pull
  requests: keys are read at the trust commit (`releasekit.stores.trust`: HEAD when it is on
  the protected ref, else the protected ref's commit), never from the working tree, so an
  uncommitted `.pub`, or one committed locally and not landed, counts for nothing. Once the
  repository trusts a key, every record must be signed: an unsigned append after a signed
  record is refused, an append signed by a key the repository does not trust (or revoked)
  is refused, and `verify` fails a ledger whose head is not signed by a trusted key.
- A key id is the first 16 hex digits of sha256 over the raw 32-byte public key, so anyone can
  recompute it from the `.pub` file. Each ledger record stores the id of the key that signed
  it next to its signature.
- Retiring a key: keep its `.pub` (old records stay verifiable) and stop configuring its
  private half. A compromised key: keep its `.pub` and commit a line `<key id> after <seq>`
  to `keys/revoked` (`# comments` allowed): the records it signed up to and including `seq`
  still verify, any later record signed by it fails `verify` ("revoked after record N") and
  no process appends with it again. Deleting the `.pub` instead would fail every record the
  key ever signed, and with them every decision read from the ledger.

What is signed: the record's chain hash (which covers every stored field and the previous
hash), framed with a domain tag and the key id, so a signature cannot be replayed onto another
record, another key, or another protocol.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from releasekit.errors import LedgerError, SignatureError, SigningKeyError
from releasekit.stores.anchor import read_tree_files, revision_exists
from releasekit.stores.trust import TrustRoot, trust_root

SIGNING_KEY_ENV = "RELEASEKIT_SIGNING_KEY"
PRIVATE_KEYS_DIR = Path(".releasekit") / "keys"  # relative to the project root, git-ignored
PUBLIC_KEYS_DIR = Path("keys")  # relative to the project root, committed
REVOKED_FILE = "revoked"  # keys/revoked: `<key id> after <seq>` lines, committed
SIG_DOMAIN = b"releasekit-ledger-signature/1\n"
KEY_ID_LEN = 16
_KEY_ID = re.compile(rf"^[0-9a-f]{{{KEY_ID_LEN}}}$")
_HASH = re.compile(r"^[0-9a-f]{64}$")
_REVOKED_LINE = re.compile(rf"^([0-9a-f]{{{KEY_ID_LEN}}})\s+after\s+([0-9]+)$")


class TrustedKeys(dict[str, "Ed25519PublicKey"]):
    """The public keys a repository trusts, by key id, with their revocations: `revoked`
    maps a key id to the last record seq it may sign (keys/revoked); `where` says where they
    were read, for messages."""

    def __init__(
        self,
        keys: Mapping[str, Ed25519PublicKey] | None = None,
        *,
        revoked: Mapping[str, int] | None = None,
        where: str = "",
    ) -> None:
        super().__init__(keys or {})
        self.revoked: dict[str, int] = dict(revoked or {})
        self.where = where


def revoked_after(trusted: Mapping[str, Ed25519PublicKey], key_id: str) -> int | None:
    """The last record seq `key_id` may sign (None: not revoked)."""
    revoked = getattr(trusted, "revoked", None) or {}
    return revoked.get(key_id)


def parse_revoked(data: bytes, where: str) -> dict[str, int]:
    """keys/revoked: one `<key id> after <seq>` a line (blank lines and `#` comments
    allowed); SigningKeyError naming the line for anything else."""
    out: dict[str, int] = {}
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SigningKeyError(f"{where} is not UTF-8 text") from exc
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = _REVOKED_LINE.match(line)
        if m is None:
            raise SigningKeyError(
                f"{where} line {n} is not `<key id> after <seq>`: {line!r}",
                remedy=f"fix {where} (e.g. `0123456789abcdef after 41`) and commit it",
            )
        kid, seq = m.group(1), int(m.group(2))
        out[kid] = min(seq, out.get(kid, seq))  # the earliest cut-off named wins
    return out


def key_id_of(public_key: Ed25519PublicKey) -> str:
    """The key id: first 16 hex digits of sha256 over the raw 32-byte public key."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:KEY_ID_LEN]


@dataclass(frozen=True)
class Signer:
    """A loaded private key and its id; `sign` makes a record's signature."""

    key_id: str
    private_key: Ed25519PrivateKey
    path: Path | None = None

    def sign(self, record_hash: str) -> str:
        """Base64 Ed25519 signature over a record's chain hash."""
        return sign(self, record_hash)


@dataclass(frozen=True)
class KeyPair:
    """Where `generate_keypair` wrote a new key, and its id."""

    key_id: str
    private_path: Path
    public_path: Path


def _message(key_id: str, record_hash: str) -> bytes:
    if not _HASH.match(record_hash):
        raise LedgerError(f"not a record hash: {record_hash!r}")
    return SIG_DOMAIN + key_id.encode() + b"\n" + record_hash.encode()


def sign(signer: Signer, record_hash: str) -> str:
    """Base64 Ed25519 signature over `record_hash`, bound to the signer's key id."""
    sig = signer.private_key.sign(_message(signer.key_id, record_hash))
    return base64.b64encode(sig).decode()


def verify_signature(
    trusted: Mapping[str, Ed25519PublicKey],
    *,
    record_hash: str,
    key_id: str,
    signature: str,
    seq: int | None = None,
) -> None:
    """Check one record's signature against the trusted public keys.

    Raises SignatureError naming the record when the key id is not trusted, the signature is
    not base64, or it does not verify.
    """
    where = f"record {seq}" if seq is not None else "record"
    cut = revoked_after(trusted, key_id)
    if cut is not None and (seq is None or seq > cut):
        raise SignatureError(
            f"{where} is signed by key {key_id}, which {PUBLIC_KEYS_DIR}/{REVOKED_FILE} revokes "
            f"after record {cut}: no record it signs after that is trusted",
            seq=seq,
            key_id=key_id,
        )
    pub = trusted.get(key_id)
    if pub is None:
        raise SignatureError(
            f"{where} is signed by key {key_id}, which the repository does not trust "
            f"(no committed {PUBLIC_KEYS_DIR}/{key_id}.pub)",
            seq=seq,
            key_id=key_id,
        )
    try:
        raw = base64.b64decode(signature.encode(), validate=True)
    except ValueError as exc:
        raise SignatureError(
            f"{where}: its signature is not base64", seq=seq, key_id=key_id
        ) from exc
    try:
        pub.verify(raw, _message(key_id, record_hash))
    except InvalidSignature as exc:
        raise SignatureError(
            f"{where} was changed after it was signed: its signature by key {key_id} does "
            "not match its contents",
            seq=seq,
            key_id=key_id,
        ) from exc


def generate_keypair(
    root: Path,
    *,
    private_path: Path | None = None,
    public_dir: Path | None = None,
) -> KeyPair:
    """Make a new Ed25519 keypair: the private PEM (0600) at `private_path` (default
    `<root>/.releasekit/keys/<key id>.pem`), the public PEM at `<public_dir>/<key id>.pub`
    (default `<root>/keys/`). Never overwrites an existing private key file."""
    key = Ed25519PrivateKey.generate()
    kid = key_id_of(key.public_key())
    priv = private_path or root / PRIVATE_KEYS_DIR / f"{kid}.pem"
    pub_dir = public_dir or root / PUBLIC_KEYS_DIR
    pub = pub_dir / f"{kid}.pub"
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    pub_pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    try:
        priv.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(priv, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
        pub_dir.mkdir(parents=True, exist_ok=True)
        pub.write_bytes(pub_pem)
    except FileExistsError as exc:
        raise SigningKeyError(f"refusing to overwrite the existing key file {priv}") from exc
    except OSError as exc:
        raise SigningKeyError(f"cannot write the new key: {exc}") from exc
    return KeyPair(key_id=kid, private_path=priv, public_path=pub)


def load_private_key(path: Path) -> Signer:
    """Read an Ed25519 private key (PKCS#8 PEM, unencrypted) and compute its key id."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise SigningKeyError(f"cannot read signing key {path}: {exc}") from exc
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise SigningKeyError(
            f"{path} is not an unencrypted PEM private key: {exc}",
            remedy="point at the .pem file `releasekit ledger keygen` wrote",
        ) from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise SigningKeyError(
            f"{path} holds a {type(key).__name__}, not an Ed25519 key",
            remedy="create an Ed25519 key with `releasekit ledger keygen`",
        )
    return Signer(key_id=key_id_of(key.public_key()), private_key=key, path=path)


def find_signer(
    root: Path,
    *,
    path: Path | str | None = None,
    environ: Mapping[str, str] | None = None,
) -> Signer | None:
    """The signing key in force, or None when none is configured (the ledger is unsigned).

    Order: `path` (a flag or setting) > `RELEASEKIT_SIGNING_KEY` > the one `.pem` file under
    `<root>/.releasekit/keys/`. Several local keys and none named is an error, not a guess.
    """
    env = os.environ if environ is None else environ
    explicit = path or env.get(SIGNING_KEY_ENV) or None
    if explicit:
        p = Path(explicit).expanduser()
        return load_private_key(p if p.is_absolute() else root / p)
    local = sorted((root / PRIVATE_KEYS_DIR).glob("*.pem"))
    if not local:
        return None
    if len(local) > 1:
        names = ", ".join(p.name for p in local)
        raise SigningKeyError(
            f"several signing keys in {root / PRIVATE_KEYS_DIR} ({names}) and none chosen",
            remedy=f"set {SIGNING_KEY_ENV} to the one to sign with",
        )
    return load_private_key(local[0])


def load_public_key(path: Path) -> Ed25519PublicKey:
    """Read an Ed25519 public key (PEM SubjectPublicKeyInfo)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise SigningKeyError(f"cannot read public key {path}: {exc}") from exc
    return _public_key(data, str(path))


TRUSTED_REV = "HEAD"
"""What `approver_set` names as the keys' revision when it is not told (messages only)."""


def trusted_keys(
    root: Path,
    *,
    public_dir: Path | None = None,
    rev: str | None = None,
    trust: TrustRoot | None = None,
) -> TrustedKeys:
    """Every public key the repository trusts, by key id, with the revocations of
    `keys/revoked`: the `keys/*.pub` files committed at the trust commit
    (`releasekit.stores.trust.trust_root`: HEAD when it is on the protected ref, else the
    protected ref's commit), or at git revision `rev` when given (`ledger verify --remote`
    reads the remote's branch), never what the working tree holds, so a `.pub` file dropped
    in `keys/`, or committed locally and not landed, is not trusted. Outside a git
    repository, or with `public_dir` given, the folder's files are read as they are.
    `trust`: the trust root, when the caller has it already.

    A file's name must be its key id: a renamed or swapped file is an error, so a reviewer
    can trust the names they read in a diff.
    """
    if public_dir is None:
        if rev is not None:
            if not revision_exists(root, rev):
                # A revision that names nothing trusts nothing, and an unsigned replacement
                # ledger would then verify: refuse.
                raise SigningKeyError(
                    f"revision {rev!r} does not name a commit in {root}: no key could be trusted",
                    remedy="fetch that revision (e.g. `git fetch origin`)",
                )
            committed = read_tree_files(root, rev, str(PUBLIC_KEYS_DIR)) or {}
            return _trusted_of(committed, f"{rev}:{PUBLIC_KEYS_DIR}")
        tr = trust or trust_root(root)
        if tr.in_git:
            if tr.commit is None:  # no commit yet: nothing is trusted
                return TrustedKeys(where=f"HEAD:{PUBLIC_KEYS_DIR}")
            committed = read_tree_files(root, tr.commit, str(PUBLIC_KEYS_DIR)) or {}
            return _trusted_of(committed, f"{tr.rev} ({tr.commit[:12]}):{PUBLIC_KEYS_DIR}")
    folder = public_dir or root / PUBLIC_KEYS_DIR
    if not folder.is_dir():
        return TrustedKeys(where=str(folder))
    files = {}
    for p in sorted(folder.iterdir()):
        if not (p.name.endswith(".pub") or p.name == REVOKED_FILE) or not p.is_file():
            continue
        try:
            files[p.name] = p.read_bytes()
        except OSError as exc:
            raise SigningKeyError(f"cannot read {p}: {exc}") from exc
    return _trusted_of(files, str(folder))


def _trusted_of(files: Mapping[str, bytes], where: str) -> TrustedKeys:
    pubs = {name: data for name, data in files.items() if name.endswith(".pub")}
    revoked = (
        parse_revoked(files[REVOKED_FILE], f"{where}/{REVOKED_FILE}")
        if REVOKED_FILE in files
        else {}
    )
    return TrustedKeys(dict(_keys_of(pubs, where)), revoked=revoked, where=where)


def _keys_of(files: Mapping[str, bytes], where: str) -> list[tuple[str, Ed25519PublicKey]]:
    out = []
    for name in sorted(files):
        path = f"{where}/{name}"
        key = _public_key(files[name], path)
        kid = key_id_of(key)
        stem = name.removesuffix(".pub")
        if stem != kid:
            raise SigningKeyError(
                f"{path}: the file is named {stem} but holds key {kid}",
                remedy=f"rename it to {kid}.pub (a key's file name is its id)",
            )
        out.append((kid, key))
    return out


def _public_key(data: bytes, path: str) -> Ed25519PublicKey:
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as exc:
        raise SigningKeyError(
            f"{path} is not a PEM public key: {exc}",
            remedy=f"restore the file from git, or remove it from {PUBLIC_KEYS_DIR}/",
        ) from exc
    if not isinstance(key, Ed25519PublicKey):
        raise SigningKeyError(f"{path} holds a {type(key).__name__}, not an Ed25519 key")
    return key


def is_key_id(text: str) -> bool:
    """True for a well-formed key id (16 lowercase hex digits)."""
    return bool(_KEY_ID.match(text))


def approver_key_id(entry: str) -> str | None:
    """The key id an `approvers` entry names: a key id, or `keys/<key id>.pub`; None when
    the entry is neither."""
    text = entry.strip()
    prefix = f"{PUBLIC_KEYS_DIR}/"
    if text.startswith(prefix):
        text = text[len(prefix) :]
    text = text.removesuffix(".pub")
    return text if is_key_id(text) else None


@dataclass(frozen=True)
class ApproverSet:
    """Who may approve releases for one environment: the public keys its `approvers` name,
    each one committed under keys/ at the trusted revision (the same keys the ledger
    trusts), and what could not be resolved (an entry naming no committed key)."""

    environment: str
    required: bool
    keys: Mapping[str, Ed25519PublicKey]
    problems: tuple[str, ...] = ()

    @property
    def key_ids(self) -> list[str]:
        """The approvers' key ids, sorted."""
        return sorted(self.keys)


def approver_set(
    environment: str,
    entries: Sequence[str],
    trusted: Mapping[str, Ed25519PublicKey],
    *,
    required: bool,
    where: str = f"{TRUSTED_REV}:{PUBLIC_KEYS_DIR}",
) -> ApproverSet:
    """Resolve an environment's `approvers` entries against the trusted keys: an entry
    that is not a key id (or keys/<key id>.pub), or names a key not committed at the
    trusted revision, approves nothing and is listed in `problems`."""
    keys: dict[str, Ed25519PublicKey] = {}
    problems: list[str] = []
    for entry in entries:
        kid = approver_key_id(entry)
        if kid is None:
            problems.append(
                f"approver {entry!r} of {environment} is not a key id or {PUBLIC_KEYS_DIR}/"
                "<key id>.pub"
            )
        elif kid not in trusted:
            problems.append(
                f"approver key {kid} of {environment} is not committed at {where} (no "
                f"{PUBLIC_KEYS_DIR}/{kid}.pub there)"
            )
        else:
            keys[kid] = trusted[kid]
    revoked = {k: v for k, v in (getattr(trusted, "revoked", None) or {}).items() if k in keys}
    return ApproverSet(
        environment=environment,
        required=required,
        keys=TrustedKeys(keys, revoked=revoked, where=where),
        problems=tuple(problems),
    )
