"""Signing packs: ed25519 over the pack manifest's bytes, with a key pair the user owns.

The manifest pins every file of the pack by sha256, so a valid signature over it vouches for all of them.
The signature member (tdpack.sig) is JSON: {"algorithm": "ed25519", "key_id": ..., "signature": hex}.
Keys are PEM files (PKCS#8 private key, mode 0600; SubjectPublicKeyInfo public key), written by
`python -m tiledispatch keygen KEYFILE`. This needs the published `cryptography` package, an optional
extra: pip install 'tiledispatch[sign]'.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Optional

from .errors import BundleError

ALGORITHM = "ed25519"


def _crypto():
    try:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:
        raise BundleError("signing and verifying packs needs the 'cryptography' package: "
                          "pip install 'tiledispatch[sign]'") from None
    return ed25519, serialization, InvalidSignature


def key_id(public_raw: bytes) -> str:
    """A short name of a public key for messages: the first 16 hex digits of its sha256."""
    return hashlib.sha256(public_raw).hexdigest()[:16]


def _raw(public_key) -> bytes:
    _, serialization, _ = _crypto()
    return public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def keygen(path) -> tuple[Path, Path, str]:
    """Write a new private key to path (mode 0600, refusing to overwrite) and its public key to
    path + '.pub'; returns both paths and the key id."""
    ed25519, serialization, _ = _crypto()
    path = Path(path)
    pub = path.with_name(path.name + ".pub")
    private = ed25519.Ed25519PrivateKey.generate()
    pem = private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        raise BundleError(f"{path} exists: keygen never overwrites a key") from None
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    public = private.public_key()
    pub.write_bytes(public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return path, pub, key_id(_raw(public))


def _private_key(keyfile):
    ed25519, serialization, _ = _crypto()
    try:
        data = Path(keyfile).read_bytes()
    except OSError as e:
        raise BundleError(f"signing key {keyfile}: cannot be read: {e.strerror or e}") from None
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as e:
        raise BundleError(f"signing key {keyfile}: not an unencrypted PEM private key: {e}") from None
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise BundleError(f"signing key {keyfile}: a {type(key).__name__}, packs are signed with ed25519 keys")
    return key


def public_key(trust):
    """trust= as an ed25519 public key: a PEM file's path, PEM text or bytes, 32 raw bytes, or the key."""
    ed25519, serialization, _ = _crypto()
    if isinstance(trust, ed25519.Ed25519PublicKey):
        return trust
    if isinstance(trust, ed25519.Ed25519PrivateKey):
        return trust.public_key()
    data, what = trust, "trust="
    if isinstance(trust, (str, os.PathLike)) and not str(trust).lstrip().startswith("-----BEGIN"):
        what = f"trust={trust}"
        try:
            data = Path(trust).read_bytes()
        except OSError as e:
            raise BundleError(f"{what}: the public key cannot be read: {e.strerror or e}") from None
    if isinstance(data, str):
        data = data.encode()
    if not isinstance(data, bytes):
        raise BundleError(f"trust= must be an ed25519 public key (a PEM file, PEM text or 32 raw bytes), "
                          f"got {type(trust).__name__}")
    try:
        key = (ed25519.Ed25519PublicKey.from_public_bytes(data) if len(data) == 32
               else serialization.load_pem_public_key(data))
    except (ValueError, TypeError) as e:
        raise BundleError(f"{what}: not an ed25519 public key: {e}") from None
    if not isinstance(key, ed25519.Ed25519PublicKey):
        raise BundleError(f"{what}: a {type(key).__name__}, packs are signed with ed25519 keys")
    return key


def sign(manifest_bytes: bytes, keyfile) -> bytes:
    """The signature member's bytes for a manifest."""
    key = _private_key(keyfile)
    return json.dumps({"algorithm": ALGORITHM, "key_id": key_id(_raw(key.public_key())),
                       "signature": key.sign(manifest_bytes).hex()}, sort_keys=True).encode()


def verify(manifest_bytes: bytes, signature: Optional[bytes], trust, *, what: str) -> str:
    """The key id when `signature` is a valid signature of the manifest by the trusted key; else a
    BundleError saying whether the pack is unsigned, signed by another key, or carries a bad signature."""
    _, _, InvalidSignature = _crypto()
    key = public_key(trust)
    want = key_id(_raw(key))
    if signature is None:
        raise BundleError(f"{what}: the pack is not signed, and trust= requires a signature by key {want}")
    try:
        sig = json.loads(signature)
        if not isinstance(sig, dict) or sig.get("algorithm") != ALGORITHM:
            raise ValueError(sig)
        raw = bytes.fromhex(sig["signature"])
        signer = str(sig.get("key_id", "?"))[:64]
    except (ValueError, TypeError, KeyError):
        raise BundleError(f"{what}: the signature member is malformed (expected {ALGORITHM} JSON)") from None
    try:
        key.verify(raw, manifest_bytes)
    except InvalidSignature:
        if signer != want:
            raise BundleError(f"{what}: signed by key {signer}, not by the trusted key {want}") from None
        raise BundleError(f"{what}: the signature does not match the manifest (key {want}): the pack was "
                          f"changed after it was signed") from None
    return want
