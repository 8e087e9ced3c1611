"""Signing keys and signatures for bundles: ed25519 in PEM (`cryptography`), DSSE signatures.

- `generate(path)`: a new key pair, `path` (PKCS#8 PEM, mode 0600) and `path.pub`
  (SubjectPublicKeyInfo PEM).
- `load_signer(path) -> KeySigner`: the one call a writer of bundles needs: the private key, checked
  (owned by root or by the recorder's uid, only its owner may read it, ed25519, not encrypted),
  ready to pass to `writer.write_bundle(..., signer=)` or `Recorder.finish(..., signer=)`. Load it
  once, before anything runs, so that a bad key stops the run before it starts.
- `load_public_key(path)` and `check(attestation, key) -> keyid`: the signature check, by the DSSE
  protocol (the signature is over PAE(payloadType, payload)), so any DSSE implementation agrees.

The keyid is the lowercase hex sha256 of the public key's DER SubjectPublicKeyInfo encoding (the
bytes that the `.pub` PEM file holds in base64): `openssl pkey -pubin -in KEY.pub -outform DER |
sha256sum` prints it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
from pathlib import Path

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from evidence.bundle.attestation import Attestation
from evidence.errors import UsageError
from evidence.files import write_atomic

logger = logging.getLogger(__name__)

PUBLIC_SUFFIX = ".pub"
_MAX_KEY_FILE = 64 * 1024


class SignatureError(ValueError):
    """The attestation is not signed by the given key (the message says why)."""


def keyid(public_key: Ed25519PublicKey) -> str:
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest()


class KeySigner:
    """Signs with an ed25519 private key (attestation.Signer)."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._key = private_key
        self._keyid = keyid(private_key.public_key())

    @property
    def keyid(self) -> str:
        return self._keyid

    def sign(self, data: bytes) -> bytes:
        return self._key.sign(data)


def generate(path: str | os.PathLike[str]) -> tuple[Path, Path, str]:
    """Write a new key pair: (private key path, public key path, keyid). Refuses to overwrite."""
    private = Path(path)
    public = private.with_name(private.name + PUBLIC_SUFFIX)
    for p in (private, public):
        if p.exists() or p.is_symlink():
            raise UsageError(f"{p} exists: not overwriting a key", "remove it first, or choose another --out")
    if not private.parent.is_dir():
        raise UsageError(f"cannot write {private}: {private.parent} is not a directory")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    pub = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    try:
        write_atomic(private, pem, mode=0o600)
        write_atomic(public, pub, mode=0o644)
    except OSError as e:
        raise UsageError(f"cannot write the key: {e.strerror or e}") from None
    return private, public, keyid(key.public_key())


def _read(path: Path, what: str) -> bytes:
    try:
        # O_NONBLOCK: a FIFO given as a key must not hang the command (a regular file ignores it)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise UsageError(f"{what} {path}: not a regular file")
            if what == "private key" and st.st_mode & 0o077:
                raise UsageError(
                    f"{what} {path} is accessible by others (mode {stat.S_IMODE(st.st_mode):04o})",
                    f"chmod 600 {path}",
                )
            if what == "private key" and st.st_uid not in (0, os.geteuid()):
                # its owner reads it whatever the mode: a job of that uid could sign anything
                raise UsageError(
                    f"{what} {path} belongs to uid {st.st_uid}, who can read it: only root or the "
                    f"recorder (uid {os.geteuid()}) may own the key",
                    f"chown {os.geteuid()} {path}",
                )
            data = f.read(_MAX_KEY_FILE + 1)
    except OSError as e:
        raise UsageError(f"cannot read {what} {path}: {e.strerror or e}") from None
    if len(data) > _MAX_KEY_FILE:
        raise UsageError(f"{what} {path}: not a PEM key (too large)")
    return data


def load_signer(path: str | os.PathLike[str]) -> KeySigner:
    """The signer for an ed25519 private key file (PEM, PKCS#8 as `evidence keygen` writes it, not
    encrypted, readable by its owner only, owned by root or by this process's uid: a key of the
    job's uid is the job's). Raises UsageError (exit 2) saying what is wrong."""
    p = Path(path)
    data = _read(p, "private key")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except TypeError:
        raise UsageError(
            f"private key {p} is encrypted", "use an unencrypted key (evidence keygen)"
        ) from None
    except (ValueError, UnsupportedAlgorithm):
        raise UsageError(
            f"private key {p}: not a PEM private key", "make one with: evidence keygen"
        ) from None
    if not isinstance(key, Ed25519PrivateKey):
        raise UsageError(f"private key {p} is not an ed25519 key", "make one with: evidence keygen")
    return KeySigner(key)


def load_public_key(path: str | os.PathLike[str]) -> Ed25519PublicKey:
    p = Path(path)
    data = _read(p, "public key")
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, UnsupportedAlgorithm):
        hint = "give the .pub file beside it" if b"PRIVATE KEY" in data else None
        raise UsageError(f"public key {p}: not a PEM public key", hint) from None
    if not isinstance(key, Ed25519PublicKey):
        raise UsageError(f"public key {p} is not an ed25519 key")
    return key


def check(att: Attestation, public_key: Ed25519PublicKey) -> str:
    """The keyid of `public_key` if one of the envelope's signatures verifies with it over the DSSE
    PAE; else SignatureError. Every signature is tried (a keyid is only a hint, never trusted to pick
    one), but the one that verifies must carry the key's own keyid: DSSE leaves the keyid outside
    what is signed, and a bundle whose envelope was altered there must not verify as unchanged."""
    message = att.signed_message()
    want = keyid(public_key)
    for label, sig in att.signatures:
        try:
            public_key.verify(sig, message)
        except InvalidSignature:
            continue
        if label != want:
            raise SignatureError(
                f"the signature that verifies with key {want} is labelled keyid {label} (the envelope was altered)"
            )
        return want
    if want in att.keyids:
        raise SignatureError(f"the signature by keyid {want} does not verify (tampered?)")
    raise SignatureError(f"not signed by key {want} (signed by keyid {', '.join(att.keyids)})")
