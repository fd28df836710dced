"""Workspace signing keys and the trust store (Ed25519, the ``cryptography`` package).

Each workspace has one signing key (``keys/signing.key``) and a trust store of public keys
(``keys/trusted/<fingerprint>.pub``); a key is named by its fingerprint.  Entry points:
:func:`signing_key`, :func:`trust_store`, :func:`rotate`, :func:`trust`, :func:`untrust`,
:func:`sign_digest` (a bundle's manifest digest under a fixed label) and
:func:`signature_problem` (why a signature does not verify, or nothing).

Details: docs/security.md (## Signed bundles, the registry's own records, serving's digest check).
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from core.base.errors import ConflictError, InputError
from core.access.users import Actor, authorize
from core.access.audit import security_event

if TYPE_CHECKING:  # pragma: no cover
    from core.records.store import Workspace

ALGORITHM = "ed25519"
#: What a bundle signature signs: this label, then the manifest digest (hex).
SIGNED_LABEL = b"rwb-bundle-signature/1\n"
KEYS_DIR = "keys"
PRIVATE_KEY = "signing.key"
TRUSTED_DIR = "trusted"
_FP_RE = re.compile(r"^[0-9a-f]{16}$")
_MAX_KEY_FILE = 16 * 1024


@dataclass(frozen=True)
class Signature:
    """``signature.json`` of a bundle: who signed which manifest digest."""

    algorithm: str
    fingerprint: str
    public_key: str  # base64 of the 32 raw public bytes
    manifest_digest: str
    signature: str  # base64 of the 64-byte Ed25519 signature

    def to_dict(self) -> dict[str, str]:
        return {"algorithm": self.algorithm, "fingerprint": self.fingerprint, "public_key": self.public_key,
                "manifest_digest": self.manifest_digest, "signature": self.signature}


def fingerprint(public: Ed25519PublicKey | bytes) -> str:
    """First 16 hex digits of the sha256 of the raw public key bytes."""
    raw = public if isinstance(public, bytes) else _raw(public)
    return hashlib.sha256(raw).hexdigest()[:16]


def _raw(public: Ed25519PublicKey) -> bytes:
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _pem(public: Ed25519PublicKey) -> str:
    return public.public_bytes(serialization.Encoding.PEM,
                               serialization.PublicFormat.SubjectPublicKeyInfo).decode("ascii")


def keys_dir(ws: "Workspace") -> Path:
    return Path(ws.root) / KEYS_DIR


def _write_private(path: Path, key: Ed25519PrivateKey) -> None:
    """Write the private key with mode 0600 from its creation (never readable by others)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    fd, tmp = tempfile.mkstemp(prefix=".signing.", suffix=".tmp", dir=path.parent)  # created 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _add_trusted(ws: "Workspace", public: Ed25519PublicKey) -> str:
    fp = fingerprint(public)
    folder = keys_dir(ws) / TRUSTED_DIR
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"{fp}.pub"
    fd, tmp = tempfile.mkstemp(prefix=f".{fp}.", suffix=".tmp", dir=folder)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(_pem(public))
    os.chmod(tmp, 0o644)
    os.replace(tmp, target)
    return fp


def signing_key(ws: "Workspace") -> Ed25519PrivateKey:
    """The workspace's private key, made (and trusted) on first need."""
    path = keys_dir(ws) / PRIVATE_KEY
    if not path.is_file():
        key = Ed25519PrivateKey.generate()
        _write_private(path, key)
        _add_trusted(ws, key.public_key())
        return key
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise ConflictError(f"the signing key {path} is readable by others (mode {mode:o}); "
                            f"`chmod 600 {path}` and rotate it (`rwb keys rotate`)")
    try:
        stored = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (ValueError, TypeError) as exc:
        raise InputError(f"the signing key is unreadable: {exc}", file=str(path)) from None
    if not isinstance(stored, Ed25519PrivateKey):
        raise InputError("the signing key is not an Ed25519 key", file=str(path))
    return stored


def trust_store(ws: "Workspace") -> dict[str, bytes]:
    """``{fingerprint: raw public key}`` of every key this workspace trusts (read only:
    nothing is created).  A file whose name is not its key's fingerprint is ignored."""
    folder = keys_dir(ws) / TRUSTED_DIR
    out: dict[str, bytes] = {}
    if not folder.is_dir():
        return out
    for path in sorted(folder.glob("*.pub")):
        try:
            public = _load_public(path.read_bytes(), str(path))
        except InputError:
            continue
        fp = fingerprint(public)
        if path.stem == fp:
            out[fp] = _raw(public)
    return out


def _load_public(data: bytes, file: str) -> Ed25519PublicKey:
    if len(data) > _MAX_KEY_FILE:
        raise InputError(f"a public key file is a few hundred bytes; this one has {len(data)}", file=file)
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise InputError(f"not a PEM public key ({exc})", file=file) from None
    if not isinstance(key, Ed25519PublicKey):
        raise InputError("not an Ed25519 public key (bundles are signed with Ed25519)", file=file)
    return key


# --------------------------------------------------------------------------- signatures
def _message(digest: str) -> bytes:
    return SIGNED_LABEL + digest.encode("ascii")


def sign_digest(key: Ed25519PrivateKey, digest: str) -> Signature:
    """The signature of a manifest digest by ``key``."""
    public = key.public_key()
    return Signature(algorithm=ALGORITHM, fingerprint=fingerprint(public),
                     public_key=base64.b64encode(_raw(public)).decode("ascii"), manifest_digest=digest,
                     signature=base64.b64encode(key.sign(_message(digest))).decode("ascii"))


def parse_signature(data: Any) -> Signature:
    """A :class:`Signature` from the parsed ``signature.json`` (ValueError naming the field)."""
    if not isinstance(data, Mapping):
        raise ValueError("signature.json is not a JSON object")
    fields = ("algorithm", "fingerprint", "public_key", "manifest_digest", "signature")
    extra = sorted(set(data) - set(fields))
    if extra:
        raise ValueError(f"signature.json has unknown fields {extra}")
    for f in fields:
        if not isinstance(data.get(f), str):
            raise ValueError(f"signature.json: {f} is missing or not text")
    return Signature(**{f: data[f] for f in fields})


def signature_problem(sig: Signature, digest: str, trusted: Mapping[str, bytes] | None) -> str | None:
    """Why ``sig`` does not vouch for a manifest with ``digest`` (None when it does).

    ``trusted`` is the verifier's trust store; None checks the signature only (for
    callers with no workspace), which proves integrity but not who signed."""
    if sig.algorithm != ALGORITHM:
        return f"signature algorithm {sig.algorithm!r} is not {ALGORITHM}"
    try:
        raw = base64.b64decode(sig.public_key, validate=True)
        signature = base64.b64decode(sig.signature, validate=True)
        public = Ed25519PublicKey.from_public_bytes(raw)
    except ValueError:
        return "signature.json: the public key or signature is not valid base64 Ed25519 data"
    if fingerprint(raw) != sig.fingerprint:
        return f"signature.json names key {sig.fingerprint} but carries key {fingerprint(raw)}"
    if sig.manifest_digest != digest:
        return ("the signature is for another manifest (signed digest "
                f"{sig.manifest_digest[:12]}…, this manifest {digest[:12]}…): the bundle changed after signing")
    try:
        public.verify(signature, _message(digest))
    except InvalidSignature:
        return f"the signature by {sig.fingerprint} does not verify: the bundle changed after signing"
    if trusted is not None and trusted.get(sig.fingerprint) != raw:
        return (f"signed by key {sig.fingerprint}, which this workspace does not trust "
                "(`rwb keys trust FILE` with the signer's public key)")
    return None


# --------------------------------------------------------------------------- rwb keys
@dataclass(frozen=True)
class KeyInfo:
    """What ``rwb keys show`` prints: the signing key's fingerprint and public key, and the
    trusted fingerprints (the workspace's own marked)."""

    fingerprint: str
    public_key_pem: str
    private_key_path: str
    trusted: list[dict[str, Any]]

    def to_dict(self) -> dict[str, Any]:
        return {"fingerprint": self.fingerprint, "public_key_pem": self.public_key_pem,
                "private_key_path": self.private_key_path, "trusted": self.trusted}


def show(ws: "Workspace") -> KeyInfo:
    """The workspace's signing key (made when missing) and its trust store."""
    public = signing_key(ws).public_key()
    own = fingerprint(public)
    return KeyInfo(fingerprint=own, public_key_pem=_pem(public),
                   private_key_path=str(keys_dir(ws) / PRIVATE_KEY),
                   trusted=[{"fingerprint": fp, "own": fp == own} for fp in sorted(trust_store(ws))])


def rotate(ws: "Workspace", actor: Actor) -> KeyInfo:
    """A new signing key replaces the old one; the old public key stays trusted (bundles it
    signed still verify) until :func:`untrust`.  The old private key is overwritten.  Needs
    ``manage_users`` (an administrator)."""
    authorize(ws, actor, "manage_users")
    old = fingerprint(signing_key(ws).public_key())
    key = Ed25519PrivateKey.generate()
    _add_trusted(ws, key.public_key())
    _write_private(keys_dir(ws) / PRIVATE_KEY, key)
    info = show(ws)
    security_event(ws, actor, "key_rotated", old=old, new=info.fingerprint)
    return info


def trust(ws: "Workspace", actor: Actor, file: str | Path) -> str:
    """Trust the Ed25519 public key in PEM ``file``; returns its fingerprint.  Needs ``manage_users``."""
    authorize(ws, actor, "manage_users")
    path = Path(file)
    if not path.is_file():
        raise InputError(f"no public key file at {path}", file=str(path))
    fp = _add_trusted(ws, _load_public(path.read_bytes()[:_MAX_KEY_FILE + 1], str(path)))
    security_event(ws, actor, "key_trusted", fingerprint=fp, file=str(path))
    return fp


def untrust(ws: "Workspace", actor: Actor, fp: str) -> str:
    """Stop trusting key ``fp``: bundles it signed no longer verify here.  The workspace's
    current signing key cannot be untrusted (rotate first).  Needs ``manage_users``."""
    authorize(ws, actor, "manage_users")
    fp = fp.strip().lower()
    if not _FP_RE.match(fp):
        raise InputError(f"{fp!r} is not a key fingerprint (16 hex digits; `rwb keys show` lists them)",
                         field="fingerprint")
    path = keys_dir(ws) / TRUSTED_DIR / f"{fp}.pub"
    if not path.is_file():
        raise InputError(f"key {fp} is not trusted here (trusted: {', '.join(sorted(trust_store(ws))) or 'none'})",
                         field="fingerprint")
    if (keys_dir(ws) / PRIVATE_KEY).is_file() and fingerprint(signing_key(ws).public_key()) == fp:
        raise ConflictError(f"{fp} is this workspace's signing key; `rwb keys rotate` first, then untrust it")
    path.unlink()
    security_event(ws, actor, "key_untrusted", fingerprint=fp)
    return fp


__all__ = ["ALGORITHM", "KeyInfo", "Signature", "fingerprint", "keys_dir", "parse_signature", "rotate", "show",
           "sign_digest", "signature_problem", "signing_key", "trust", "trust_store", "untrust"]
