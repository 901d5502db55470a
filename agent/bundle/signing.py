"""Ed25519 signatures over a bundle's manifest (which carries every file's sha256).

`bundle.sig` is JSON: {algorithm, key_id, signature}. A device trusts one or more public keys
(rotation: add the new key, ship bundles signed with it, remove the old one).
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from agent.errors import SignatureError
from agent.fsio import write_atomic
from agent.vocabulary.manifest import MANIFEST_NAME, SIGNATURE_NAME


def key_id(public: Ed25519PublicKey) -> str:
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def keygen(private_path: Path, public_path: Path) -> str:
    """Write a new key pair (private key 0600). Returns the key id."""
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    private_path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(private_path, pem)
    private_path.chmod(0o600)
    pub = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    write_atomic(public_path, pub)
    return key_id(key.public_key())


def load_private(path: Path) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except (OSError, ValueError) as exc:
        raise SignatureError(f"{path}: not a readable Ed25519 private key: {exc}") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise SignatureError(f"{path}: not an Ed25519 private key")
    return key


def load_public(path: Path) -> Ed25519PublicKey:
    try:
        key = serialization.load_pem_public_key(Path(path).read_bytes())
    except (OSError, ValueError) as exc:
        raise SignatureError(f"{path}: not a readable Ed25519 public key: {exc}") from exc
    if not isinstance(key, Ed25519PublicKey):
        raise SignatureError(f"{path}: not an Ed25519 public key")
    return key


def sign_bundle(root: Path, private_path: Path) -> str:
    key = load_private(private_path)
    manifest = (root / MANIFEST_NAME).read_bytes()
    doc = {"algorithm": "ed25519", "key_id": key_id(key.public_key()),
           "signature": base64.b64encode(key.sign(manifest)).decode()}
    write_atomic(root / SIGNATURE_NAME, (json.dumps(doc, indent=2) + "\n").encode())
    return doc["key_id"]


@dataclass(frozen=True)
class SignatureCheck:
    signed: bool
    key_id: str | None


def verify_signature(root: Path, trusted: Sequence[Path], allow_unsigned: bool = False) -> SignatureCheck:
    """Raise SignatureError unless bundle.sig verifies bundle.yaml with one of the trusted keys."""
    sig_path = root / SIGNATURE_NAME
    sig = sig_path.read_bytes() if sig_path.exists() else None
    return verify_manifest_bytes((root / MANIFEST_NAME).read_bytes(), sig, trusted, allow_unsigned, where=str(sig_path))


def verify_manifest_bytes(manifest: bytes, sig: bytes | None, trusted: Sequence[Path], allow_unsigned: bool = False,
                          where: str = SIGNATURE_NAME) -> SignatureCheck:
    """The check itself, on bytes: used before anything of an archive is unpacked."""
    if sig is None:
        if allow_unsigned:
            return SignatureCheck(False, None)
        raise SignatureError(f"{where}: missing: unsigned bundles are refused (updates.allow_unsigned is false)")
    try:
        doc = json.loads(sig.decode("utf-8"))
        signature = base64.b64decode(doc["signature"], validate=True)
        kid = str(doc["key_id"])
        if doc.get("algorithm") != "ed25519":
            raise ValueError(f"algorithm {doc.get('algorithm')!r} is not ed25519")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, RecursionError) as exc:
        raise SignatureError(f"{where}: malformed signature file: {exc}") from exc
    keys = {key_id(k): k for k in (load_public(p) for p in trusted)}
    if kid not in keys:
        raise SignatureError(f"{where}: signed by unknown key {kid} (trusted: {sorted(keys) or 'none'})")
    try:
        keys[kid].verify(signature, manifest)
    except InvalidSignature as exc:
        raise SignatureError(f"{where}: bad signature: bundle.yaml was not signed by key {kid}") from exc
    return SignatureCheck(True, kid)
