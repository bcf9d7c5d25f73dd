"""Ed25519 signing of ledger records: key ids, key files, sign and verify."""

from __future__ import annotations

import hashlib
import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.rsa import generate_private_key

from releasekit.errors import LedgerError, LedgerIntegrityError
from releasekit.stores import signing
from releasekit.stores.signing import SignatureError, SigningKeyError

H1 = hashlib.sha256(b"one").hexdigest()
H2 = hashlib.sha256(b"two").hexdigest()


def test_keygen_writes_private_outside_repo_files_and_public_named_by_key_id(
    tmp_path: Path,
) -> None:
    """keygen puts a 0600 private PEM under .releasekit/keys and <key id>.pub under keys/;
    the key id is the first 16 hex of sha256 over the raw public key."""
    kp = signing.generate_keypair(tmp_path)
    assert kp.private_path == tmp_path / ".releasekit" / "keys" / f"{kp.key_id}.pem"
    assert kp.public_path == tmp_path / "keys" / f"{kp.key_id}.pub"
    assert stat.S_IMODE(kp.private_path.stat().st_mode) == 0o600
    pub = serialization.load_pem_public_key(kp.public_path.read_bytes())
    raw = pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    assert kp.key_id == hashlib.sha256(raw).hexdigest()[:16]
    assert signing.is_key_id(kp.key_id)
    assert b"PRIVATE" not in kp.public_path.read_bytes()


def test_sign_then_verify_with_the_repository_keys(tmp_path: Path) -> None:
    """A signature made with the private key verifies against the trusted public key."""
    kp = signing.generate_keypair(tmp_path)
    signer = signing.load_private_key(kp.private_path)
    assert signer.key_id == kp.key_id
    sig = signer.sign(H1)
    trusted = signing.trusted_keys(tmp_path)
    assert set(trusted) == {kp.key_id}
    signing.verify_signature(trusted, record_hash=H1, key_id=kp.key_id, signature=sig, seq=1)


def test_signature_over_another_hash_fails_naming_the_record(tmp_path: Path) -> None:
    """A signature does not carry over to a changed record: SignatureError names the seq."""
    kp = signing.generate_keypair(tmp_path)
    sig = signing.load_private_key(kp.private_path).sign(H1)
    with pytest.raises(SignatureError, match="record 7 was changed after it was signed") as ei:
        signing.verify_signature(
            signing.trusted_keys(tmp_path), record_hash=H2, key_id=kp.key_id, signature=sig, seq=7
        )
    assert ei.value.seq == 7
    assert isinstance(ei.value, LedgerIntegrityError)


def test_signature_bound_to_key_id(tmp_path: Path) -> None:
    """Relabelling a signature with another trusted key's id fails: the id is signed too."""
    a = signing.generate_keypair(tmp_path)
    b = signing.generate_keypair(tmp_path, private_path=tmp_path / "b.pem")
    sig = signing.load_private_key(a.private_path).sign(H1)
    trusted = signing.trusted_keys(tmp_path)
    with pytest.raises(SignatureError, match="does not match"):
        signing.verify_signature(trusted, record_hash=H1, key_id=b.key_id, signature=sig, seq=3)


def test_unknown_key_id_is_named(tmp_path: Path) -> None:
    """A record signed by a key the repository does not trust fails with that key id."""
    kp = signing.generate_keypair(tmp_path / "elsewhere")
    sig = signing.load_private_key(kp.private_path).sign(H1)
    with pytest.raises(SignatureError, match=f"key {kp.key_id}, which the repository") as ei:
        signing.verify_signature({}, record_hash=H1, key_id=kp.key_id, signature=sig, seq=2)
    assert ei.value.key_id == kp.key_id


def test_garbage_signature_is_a_signature_error(tmp_path: Path) -> None:
    """A signature that is not base64 is reported, not a traceback."""
    kp = signing.generate_keypair(tmp_path)
    with pytest.raises(SignatureError, match="not base64"):
        signing.verify_signature(
            signing.trusted_keys(tmp_path), record_hash=H1, key_id=kp.key_id, signature="!!", seq=1
        )


def test_find_signer_order_env_then_single_local_key(tmp_path: Path) -> None:
    """No key -> None (unsigned); one local key is used; RELEASEKIT_SIGNING_KEY wins;
    two local keys and none named is an error."""
    assert signing.find_signer(tmp_path, environ={}) is None
    a = signing.generate_keypair(tmp_path)
    assert signing.find_signer(tmp_path, environ={}).key_id == a.key_id  # type: ignore[union-attr]
    outside = tmp_path / "ci" / "key.pem"
    b = signing.generate_keypair(tmp_path, private_path=outside)
    env = {signing.SIGNING_KEY_ENV: str(outside)}
    assert signing.find_signer(tmp_path, environ=env).key_id == b.key_id  # type: ignore[union-attr]
    signing.generate_keypair(tmp_path)
    with pytest.raises(SigningKeyError, match="several signing keys"):
        signing.find_signer(tmp_path, environ={})


def test_keygen_never_overwrites_a_private_key(tmp_path: Path) -> None:
    """Generating onto an existing private key path refuses instead of destroying it."""
    p = tmp_path / "k.pem"
    p.write_text("precious")
    with pytest.raises(SigningKeyError, match="refusing to overwrite"):
        signing.generate_keypair(tmp_path, private_path=p)
    assert p.read_text() == "precious"


def test_bad_key_files_are_clear_errors(tmp_path: Path) -> None:
    """A missing file, a non-PEM file, an RSA key, and a renamed .pub are each named."""
    with pytest.raises(SigningKeyError, match="cannot read signing key"):
        signing.load_private_key(tmp_path / "missing.pem")
    junk = tmp_path / "junk.pem"
    junk.write_text("not a key")
    with pytest.raises(SigningKeyError, match="not an unencrypted PEM"):
        signing.load_private_key(junk)
    rsa = tmp_path / "rsa.pem"
    rsa.write_bytes(
        generate_private_key(public_exponent=65537, key_size=1024).private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    with pytest.raises(SigningKeyError, match="not an Ed25519 key"):
        signing.load_private_key(rsa)
    kp = signing.generate_keypair(tmp_path)
    kp.public_path.rename(kp.public_path.with_name("0123456789abcdef.pub"))
    with pytest.raises(SigningKeyError, match="is named 0123456789abcdef but holds key"):
        signing.trusted_keys(tmp_path)


def test_signing_errors_sit_under_ledger_error() -> None:
    """Both new errors are LedgerErrors with a remedy, so the CLI reports them in one line."""
    assert issubclass(SigningKeyError, LedgerError) and SigningKeyError.remedy
    assert issubclass(SignatureError, LedgerIntegrityError) and SignatureError.remedy


def test_sign_rejects_a_non_hash() -> None:
    """Only a 64-hex chain hash can be signed (no accidental signing of other data)."""
    signer = signing.Signer(key_id="0" * 16, private_key=Ed25519PrivateKey.generate())
    with pytest.raises(LedgerError, match="not a record hash"):
        signer.sign("hello")
