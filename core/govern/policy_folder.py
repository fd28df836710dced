"""The promoted-policies folder: where it is, its ``index.json``, and which version of a
promoted policy production serves (see :mod:`core.policies` for the layout).  The registry
and serving read the folder through this module, which sits below both;
:func:`core.policies.load`, above serving, builds an engine on it.

The folder is a cache of the registry, never an authority.  A workspace whose registry
holds the policy serves what the registry's recorded events say (:func:`resolve_active`);
a production workspace without those records serves what the index says only when the
policy's entry carries a registry's signature by a key it trusts and is not older than an
index it has already served (``policy_index_seen``).  Details: docs/governance.md
(## The policies index is a cache of the registry).
"""


from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.access.audit import security_event
from core.access.keys import trust_store
from core.base.bounded_json import loads as bounded_loads
from core.base.errors import InputError
from core.govern.bundle import BundleError, load_bundle
from core.govern.registry_records import (RegistryLogBroken, RegistryProduction, policy_names, promoted_digest_in,
                                          record_signature_problem, registry_production, sign_record)

if TYPE_CHECKING:  # pragma: no cover
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from core.access.users import Actor
    from core.govern.bundle import LoadedBundle
    from core.records.store import Workspace

INDEX = "index.json"
INDEX_FORMAT = 1
ENV_ROOT = "RWB_POLICIES_DIR"
#: The key of an index entry holding the registry's signature of it.
SIGNED = "signed"
#: What an index entry's signature signs: this label, then the canonical JSON of the entry.
INDEX_LABEL = b"rwb-policy-index-entry/1\n"
#: An index larger or deeper than this is refused before it is parsed.
MAX_INDEX_BYTES = 16 << 20
MAX_INDEX_DEPTH = 16
#: What the error of an unsigned, edited or stale index tells a person to do.
REPUBLISH = ("in the workspace whose registry promoted it, `rwb registry publish-index {name}` writes the "
             "index again from the registry's records (signed); the deployment trusts that workspace's key "
             "(`rwb keys trust`)")


class PolicyIndexRefused(InputError):
    """The policies index cannot say what production serves: an entry that no registry
    signed, one edited after it was signed, or one older than an index already served."""


def policies_root(root: str | Path | None = None) -> Path:
    """``root``, else ``$RWB_POLICIES_DIR``, else the ``core/policies`` package folder."""
    if root is not None:
        return Path(root)
    env = os.environ.get(ENV_ROOT)
    return Path(env) if env else Path(__file__).resolve().parents[1] / "policies"


@dataclass(frozen=True)
class PromotionTarget:
    """Where a promotion writes, said before it does (:func:`promotion_target`)."""

    #: The policies folder: a promoted version goes into ``<path>/<name>/<version>/``, and
    #: its entry into ``<path>/index.json``, which production reads
    path: str
    #: Whether this process can write there now
    writable: bool
    #: Why it cannot, in words (None when it can)
    reason: str | None


def _write_problem(folder: Path) -> str | None:
    """Why this process cannot write ``folder`` (made first when missing, as promotion does),
    or None.  ``os.access`` says yes to root even on a read-only file system, so a temp
    file is also made and removed."""
    probe = folder
    try:
        while not probe.exists():  # promotion makes the folder: its nearest existing parent must take it
            if probe.parent == probe:
                return f"no part of {folder} exists"
            probe = probe.parent
        if not probe.is_dir():
            return f"{probe} is a file, not a folder"
    except OSError as exc:
        return f"{probe} cannot be read ({exc.strerror or exc})"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is read-only for this user"
    try:
        fd, tmp = tempfile.mkstemp(prefix=".rwb-write-check-", dir=probe)
    except OSError as exc:
        return f"{probe} cannot be written ({exc.strerror or exc})"
    os.close(fd)
    os.unlink(tmp)
    return None


def promotion_target(root: str | Path | None = None) -> PromotionTarget:
    """The policies folder a promotion (or a rollback) would write into now — ``root``, else
    ``$RWB_POLICIES_DIR``, else ``core/policies`` in this checkout — and whether it can:
    what the Policies page shows before the click, and what :func:`core.govern.registry.promote`
    checks before it writes anything."""
    path = policies_root(root)
    problem = _write_problem(path)
    return PromotionTarget(path=str(path), writable=problem is None, reason=problem)


@dataclass(frozen=True)
class PolicyIndexEntry:
    """One policy's entry in the policies folder's ``index.json``, as
    :func:`core.govern.registry.promote` and :func:`core.govern.registry.rollback` leave it:
    written from the registry's records and signed by the registry's workspace."""

    #: The policy name (the entry's key in the file)
    name: str
    #: The version production serves
    active: str | None
    #: Earlier production versions, the one a rollback restores first
    previous: list[str]
    #: Per promoted version: manifest digest, who promoted and approved it, when
    versions: dict[str, dict[str, Any]]
    updated_at: str | None = None
    #: Versions rolled back from, oldest first: ``{version, at, by}``
    rolled_back: list[dict[str, Any]] = field(default_factory=list)
    #: The registry's signature of the entry: ``sequence`` (the id of the latest registry
    #: event it reflects), ``signed_at``, the key's ``fingerprint`` and ``public_key``, and
    #: the ``signature``; None for an entry no registry signed
    signed: dict[str, Any] | None = None

    @classmethod
    def from_document(cls, name: str, entry: Mapping[str, Any]) -> "PolicyIndexEntry":
        """The entry as ``index.json`` holds it under ``policies.<name>``."""
        signed = entry.get(SIGNED)
        return cls(name=name, active=entry.get("active"), previous=list(entry.get("previous") or []),
                   versions={v: dict(rec) for v, rec in (entry.get("versions") or {}).items()},
                   updated_at=entry.get("updated_at"), rolled_back=list(entry.get("rolled_back") or []),
                   signed=dict(signed) if isinstance(signed, Mapping) else None)

    @classmethod
    def read(cls, root: str | Path | None, name: str) -> "PolicyIndexEntry":
        """The entry of ``name`` in the index under ``root`` (InputError when it has none)."""
        entry = read_index(root).policies.get(name)
        if entry is None:
            raise InputError(f"no policy named {name!r} in the index of {policies_root(root)}", field="name")
        return entry


@dataclass(frozen=True)
class PolicyIndex:
    """The policies folder's ``index.json``, read: the entry of every promoted policy."""

    #: The index format (:data:`INDEX_FORMAT`)
    rwb_policies: int
    #: Per policy name, its entry
    policies: dict[str, PolicyIndexEntry]

    @classmethod
    def from_document(cls, document: Mapping[str, Any]) -> "PolicyIndex":
        """The index of an ``index.json`` document (one :func:`read_index_document` checked)."""
        return cls(rwb_policies=int(document["rwb_policies"]),
                   policies={name: PolicyIndexEntry.from_document(name, entry)
                             for name, entry in document["policies"].items()})


def empty_index() -> PolicyIndex:
    """The index of a folder where nothing was promoted yet."""
    return PolicyIndex(rwb_policies=INDEX_FORMAT, policies={})


def _index_problem(data: Any) -> str | None:
    """What makes ``data`` no policies index (None when it is one)."""
    if not isinstance(data, dict) or data.get("rwb_policies") != INDEX_FORMAT or \
            not isinstance(data.get("policies"), dict):
        return "not a Reward Workbench policies index (rwb_policies: 1)"
    for name, entry in data["policies"].items():
        if not isinstance(entry, dict):
            return f"the entry of {name!r} is not an object"
        if not isinstance(entry.get("previous") or [], list) or not isinstance(entry.get("rolled_back") or [], list):
            return f"the entry of {name!r} has a 'previous' or 'rolled_back' that is not a list"
        versions = entry.get("versions") or {}
        if not isinstance(versions, dict) or not all(isinstance(rec, dict) for rec in versions.values()):
            return f"the entry of {name!r} has 'versions' that are not objects"
        if not isinstance(entry.get(SIGNED) or {}, dict):
            return f"the entry of {name!r} has a '{SIGNED}' that is not an object"
    return None


def read_index_document(root: str | Path | None = None) -> dict[str, Any]:
    """``index.json`` as the file holds it (an empty index when the folder has none yet),
    size and nesting bounded before it is parsed; :func:`read_index` reads it typed."""
    path = policies_root(root) / INDEX
    if not path.is_file():
        return {"rwb_policies": INDEX_FORMAT, "policies": {}}
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_INDEX_BYTES + 1)
    except OSError as exc:
        raise InputError(f"the policies index is unreadable: {exc}", file=str(path)) from None
    data = bounded_loads(raw, max_bytes=MAX_INDEX_BYTES, max_depth=MAX_INDEX_DEPTH, file=str(path))
    problem = _index_problem(data)
    if problem is not None:
        raise InputError(problem, file=str(path))
    return dict(data)


def read_index(root: str | Path | None = None) -> PolicyIndex:
    """The index of promoted policies (an empty one when the folder has none yet), as the
    file says: a cache, checked by :func:`signed_entry` before anything is served from it."""
    return PolicyIndex.from_document(read_index_document(root))


# --------------------------------------------------------------------------- signed entries
def _entry_payload(name: str, entry: Mapping[str, Any], signed: Mapping[str, Any]) -> dict[str, Any]:
    """What an entry's signature covers: the name, the whole entry less the signature, the
    registry event sequence it reflects and when it was signed."""
    return {"name": name, "entry": {k: v for k, v in entry.items() if k != SIGNED},
            "sequence": signed.get("sequence"), "signed_at": signed.get("signed_at")}


def sign_entry(key: "Ed25519PrivateKey", name: str, entry: Mapping[str, Any], sequence: int) -> dict[str, Any]:
    """``entry`` with the registry's signature (by ``key``) under ``signed``, reflecting the
    registry's events up to ``sequence``."""
    stamp = {"sequence": int(sequence), "signed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    body = {k: v for k, v in entry.items() if k != SIGNED}
    return {**body, SIGNED: {**stamp, **sign_record(key, INDEX_LABEL, _entry_payload(name, body, stamp))}}


@dataclass(frozen=True)
class SignedEntry:
    """An index entry whose registry signature verified: what production may serve."""

    entry: PolicyIndexEntry
    #: The active version and the manifest digest the registry recorded for its copy
    active: str
    manifest_digest: str
    #: The id of the latest registry event the entry reflects
    sequence: int
    #: The key that signed it
    fingerprint: str


def entry_signature_problem(name: str, entry: Mapping[str, Any], trust: Mapping[str, bytes] | None) -> str | None:
    """Why ``entry`` (as ``index.json`` holds it) does not carry a valid registry signature
    (by a key in ``trust``; None: integrity only), or None."""
    signed = entry.get(SIGNED)
    if not isinstance(signed, Mapping):
        return "no registry signed it (it was written by hand, or by a version that did not sign the index)"
    if not isinstance(signed.get("sequence"), int) or isinstance(signed.get("sequence"), bool):
        return "its signature names no registry event sequence"
    problem = record_signature_problem(signed, INDEX_LABEL, _entry_payload(name, entry, signed), trust)
    return None if problem is None else problem.replace("it was changed", "the entry was changed")


def signed_entry(name: str, root: str | Path | None = None, *,
                 trust: Mapping[str, bytes] | None = None) -> SignedEntry:
    """The entry of ``name``, its registry signature verified (by a key in ``trust``, the
    workspace's trust store; None checks integrity alone).  InputError when the index has
    no promoted ``name``; :class:`PolicyIndexRefused` when the entry is unsigned or was
    changed after it was signed."""
    base = policies_root(root)
    document = read_index_document(root)
    raw = document["policies"].get(name)
    if raw is None or not raw.get("active"):
        known = ", ".join(sorted(document["policies"])) or "none"
        raise InputError(f"no promoted policy named {name!r} in {base} (promoted: {known}); promote one with "
                         "`rwb registry promote NAME VERSION`", field="name")
    problem = entry_signature_problem(name, raw, trust)
    if problem is not None:
        raise PolicyIndexRefused(f"the index entry of {name} cannot be served: {problem}",
                                 file=str(base / INDEX), hint=REPUBLISH.format(name=name))
    entry = PolicyIndexEntry.from_document(name, raw)
    active = str(entry.active)
    digest = (entry.versions.get(active) or {}).get("manifest_digest")
    if not isinstance(digest, str):
        raise PolicyIndexRefused(f"the signed index entry of {name} records no manifest digest for {active}",
                                 file=str(base / INDEX), hint=REPUBLISH.format(name=name))
    stamp = raw[SIGNED]  # verified above
    return SignedEntry(entry=entry, active=active, manifest_digest=digest, sequence=int(stamp["sequence"]),
                       fingerprint=str(stamp["fingerprint"]))


def active_version(name: str, root: str | Path | None = None) -> str:
    """The version of ``name`` that the folder's signed index names active (InputError when
    none is promoted, :class:`PolicyIndexRefused` when its entry is unsigned or edited).
    Serving asks :func:`resolve_active`, which also reads the workspace's registry."""
    return signed_entry(name, root).active


def load_copy(base: Path, name: str, version: str, digest: str, *, trust: Mapping[str, bytes] | None,
              authority: str) -> "LoadedBundle":
    """The verified bundle in ``base/name/version``: every hash, the signature (by a key in
    ``trust``), its name and version, and its manifest digest, which must be ``digest``
    (what ``authority``, in words, recorded for it)."""
    folder = base / name / version
    bundle = load_bundle(folder, trust=trust)
    if (bundle.name, bundle.version) != (name, version):
        raise BundleError(f"the folder {name}/{version} holds {bundle.policy_version}", file=str(folder))
    if bundle.manifest.digest != digest:
        raise BundleError(f"{name}@{version} in {base} is not the copy {authority} (manifest digest "
                          f"{bundle.manifest.digest[:12]}…, recorded {digest[:12]}…); it was swapped or edited — "
                          "promote or roll back again from the registry", file=str(folder))
    return bundle


def load_bundle_for(name: str, *, root: str | Path | None = None, version: str | None = None,
                    trust: Mapping[str, bytes] | None = None) -> "LoadedBundle":
    """The verified bundle of ``name``'s active version (or ``version``, one the signed
    entry lists), for a script with no workspace.  Refused when the index entry is not
    signed by a registry (or, with ``trust``, a workspace's trust store, by a key it does
    not trust), when the entry was changed after signing, when verification fails, when
    the folder is not ``name@version``, or when its manifest is not the one the signed
    entry records.  Serving (:func:`resolve_active`) also reads its workspace's registry
    and refuses an index older than one it has served."""
    base = policies_root(root)
    signed = signed_entry(name, root, trust=trust)
    version = version or signed.active
    recorded = signed.entry.versions.get(version)
    if recorded is None or not isinstance(recorded.get("manifest_digest"), str):
        raise InputError(f"version {version!r} of {name!r} was never promoted into {base}", field="version")
    return load_copy(base, name, version, recorded["manifest_digest"], trust=trust,
                     authority="the registry's signed index records")


# --------------------------------------------------------------------------- what production serves
@dataclass(frozen=True)
class ActivePolicy:
    """The version of a promoted policy production serves, and who says so."""

    name: str
    version: str
    #: The manifest digest of the copy the registry installed for it
    manifest_digest: str
    #: The registry event sequence the answer reflects
    sequence: int | None
    #: ``registry`` (this workspace's recorded events) or ``signed index`` (the folder's
    #: index entry, signed by a registry whose key the workspace trusts)
    source: str

    @property
    def policy_version(self) -> str:
        return f"{self.name}@{self.version}"

    @property
    def authority(self) -> str:
        """Who recorded the digest, in the words of a refusal."""
        return "the registry promoted" if self.source == "registry" else "the registry's signed index records"


def index_high_water(ws: "Workspace", name: str) -> int | None:
    """The highest registry event sequence of a signed index entry of ``name`` that ``ws``
    has served from (None when it never served ``name`` from a signed index)."""
    row = ws.conn.execute("SELECT sequence FROM policy_index_seen WHERE name=?", (name,)).fetchone()
    return None if row is None else int(row[0])


def _note_seen(ws: "Workspace", signed: SignedEntry) -> None:
    """Raise ``ws``'s high-water mark of ``signed.entry.name`` to ``signed.sequence``."""
    with ws.transaction() as conn:
        conn.execute("INSERT INTO policy_index_seen (name, sequence, fingerprint, active, manifest_digest, seen_at) "
                     "VALUES (?,?,?,?,?,?) ON CONFLICT(name) DO UPDATE SET sequence=excluded.sequence, "
                     "fingerprint=excluded.fingerprint, active=excluded.active, "
                     "manifest_digest=excluded.manifest_digest, seen_at=excluded.seen_at "
                     "WHERE excluded.sequence > policy_index_seen.sequence",
                     (signed.entry.name, signed.sequence, signed.fingerprint, signed.active,
                      signed.manifest_digest, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())))


def _from_registry(ws: "Workspace", name: str, base: Path, trust: Mapping[str, bytes],
                   actor: "Actor | None") -> ActivePolicy:
    """What ``ws``'s registry says production serves; the index is compared, never followed."""
    try:
        prod = registry_production(ws.conn, name, trust)
    except RegistryLogBroken as exc:
        security_event(ws, actor, "registry_log_broken", policy=name, reason=str(exc))
        raise
    for row in prod.log.unrecorded:
        security_event(ws, actor, "registry_record_refused", policy=name, event_id=row.event.id,
                       event_type=row.event.event, version=row.event.version, by=row.event.actor, reason=row.reason)
    if prod.version is None or prod.manifest_digest is None:
        raise InputError(f"the registry of this workspace has no production version of {name}: promote one "
                         "(`rwb registry promote NAME VERSION`)", field="name")
    _compare_index(ws, name, base, trust, actor, prod)
    return ActivePolicy(name=name, version=prod.version, manifest_digest=prod.manifest_digest,
                        sequence=prod.sequence, source="registry")


def _compare_index(ws: "Workspace", name: str, base: Path, trust: Mapping[str, bytes], actor: "Actor | None",
                   prod: RegistryProduction) -> None:
    """Log an index entry of ``name`` that was edited or is not the registry's; refuse when
    the registry's own signed entry reflects events its log no longer holds (the newest
    events were removed from the database)."""
    try:
        raw = read_index_document(base)["policies"].get(name)
    except InputError as exc:
        security_event(ws, actor, "policy_index_refused", policy=name, path=str(base / INDEX),
                       reason=exc.reason, served_from="registry")
        return
    if raw is None:
        return
    problem = entry_signature_problem(name, raw, trust)
    if problem is not None:
        security_event(ws, actor, "policy_index_refused", policy=name, path=str(base / INDEX), reason=problem,
                       index_active=raw.get("active"), served=prod.version, served_from="registry")
        return
    signed = PolicyIndexEntry.from_document(name, raw)
    version = signed.active
    ours = version is not None and (signed.versions.get(version) or {}).get("manifest_digest") == \
        promoted_digest_in(prod.log.recorded, version)
    sequence = int((signed.signed or {}).get("sequence", 0))
    if ours and sequence > (prod.sequence or 0):
        reason = (f"the registry's signed index of {name} reflects event {sequence}, but the registry's log ends "
                  f"at event {prod.sequence}: events were removed from the database")
        security_event(ws, actor, "registry_log_broken", policy=name, reason=reason)
        raise RegistryLogBroken(reason + "; restore the workspace database from a backup")


def _from_signed_index(ws: "Workspace", name: str, root: str | Path | None, trust: Mapping[str, bytes],
                       actor: "Actor | None") -> ActivePolicy:
    """What the folder's signed index says, when it is signed by a trusted key and not older
    than an index ``ws`` has served; the high-water mark is raised to it."""
    base = policies_root(root)
    try:
        signed = signed_entry(name, root, trust=trust)
    except PolicyIndexRefused as exc:
        security_event(ws, actor, "policy_index_refused", policy=name, path=str(base / INDEX), reason=exc.reason)
        raise
    seen = index_high_water(ws, name)
    if seen is not None and signed.sequence < seen:
        security_event(ws, actor, "policy_index_stale", policy=name, path=str(base / INDEX),
                       sequence=signed.sequence, seen=seen, active=signed.active)
        raise PolicyIndexRefused(f"the index entry of {name} reflects registry event {signed.sequence}, older than "
                                 f"event {seen} of an index this workspace already served: an old index was put "
                                 "back", file=str(base / INDEX), hint=REPUBLISH.format(name=name))
    _note_seen(ws, signed)
    return ActivePolicy(name=name, version=signed.active, manifest_digest=signed.manifest_digest,
                        sequence=signed.sequence, source="signed index")


def resolve_active(ws: "Workspace", name: str, *, root: str | Path | None = None,
                   actor: "Actor | None" = None) -> ActivePolicy:
    """The version of ``name`` production serves, and the manifest digest its copy must have.

    When ``ws``'s registry holds ``name``, its recorded events say (the index is compared:
    an edited entry is logged and ignored).  Otherwise the folder's index entry, only when a
    registry whose key ``ws`` trusts signed it and it reflects no earlier registry event than
    an entry ``ws`` already served.  Each refusal, and each row or entry that does not
    count, is written to the security log."""
    trust = trust_store(ws)
    if name in policy_names(ws):
        return _from_registry(ws, name, policies_root(root), trust, actor)
    return _from_signed_index(ws, name, root, trust, actor)


__all__ = ["ActivePolicy", "ENV_ROOT", "INDEX", "INDEX_FORMAT", "INDEX_LABEL", "PolicyIndex", "PolicyIndexEntry",
           "PolicyIndexRefused", "PromotionTarget", "SIGNED", "SignedEntry", "active_version", "empty_index",
           "entry_signature_problem", "index_high_water", "load_bundle_for", "load_copy", "policies_root",
           "promotion_target", "read_index", "read_index_document", "resolve_active", "sign_entry", "signed_entry"]
