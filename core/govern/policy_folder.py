"""The promoted-policies folder: where it is, its ``index.json``, and the verified bundle of
a promoted version (see :mod:`core.policies` for the layout).  The registry and serving read
the folder through this module, which sits below both; :func:`core.policies.load`, above
serving, builds an engine on it."""


from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.base.errors import InputError
from core.govern.bundle import BundleError, load_bundle

if TYPE_CHECKING:  # pragma: no cover
    from core.govern.bundle import LoadedBundle

INDEX = "index.json"
INDEX_FORMAT = 1
ENV_ROOT = "RWB_POLICIES_DIR"


def policies_root(root: str | Path | None = None) -> Path:
    """``root``, else ``$RWB_POLICIES_DIR``, else the ``core/policies`` package folder."""
    if root is not None:
        return Path(root)
    env = os.environ.get(ENV_ROOT)
    return Path(env) if env else Path(__file__).resolve().parents[1] / "policies"


@dataclass(frozen=True)
class PolicyIndexEntry:
    """One policy's entry in the policies folder's ``index.json``, as
    :func:`core.govern.registry.promote` and :func:`core.govern.registry.rollback` leave it."""

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

    @classmethod
    def from_document(cls, name: str, entry: Mapping[str, Any]) -> "PolicyIndexEntry":
        """The entry as ``index.json`` holds it under ``policies.<name>``."""
        return cls(name=name, active=entry.get("active"), previous=list(entry.get("previous") or []),
                   versions={v: dict(rec) for v, rec in (entry.get("versions") or {}).items()},
                   updated_at=entry.get("updated_at"), rolled_back=list(entry.get("rolled_back") or []))

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
    return None


def read_index_document(root: str | Path | None = None) -> dict[str, Any]:
    """``index.json`` as the file holds it (an empty index when the folder has none yet), for
    the registry to edit and write back unchanged in form; :func:`read_index` reads it typed."""
    path = policies_root(root) / INDEX
    if not path.is_file():
        return {"rwb_policies": INDEX_FORMAT, "policies": {}}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InputError(f"the policies index is unreadable: {exc}", file=str(path)) from None
    problem = _index_problem(data)
    if problem is not None:
        raise InputError(problem, file=str(path))
    return dict(data)


def read_index(root: str | Path | None = None) -> PolicyIndex:
    """The index of promoted policies (an empty one when the folder has none yet)."""
    return PolicyIndex.from_document(read_index_document(root))


def active_version(name: str, root: str | Path | None = None) -> str:
    """The version of ``name`` that production serves (InputError when none is promoted)."""
    index = read_index(root)
    entry = index.policies.get(name)
    if entry is None or not entry.active:
        known = ", ".join(sorted(index.policies)) or "none"
        raise InputError(f"no promoted policy named {name!r} in {policies_root(root)} (promoted: {known}); "
                         "promote one with `rwb registry promote NAME VERSION`", field="name")
    return str(entry.active)


def load_bundle_for(name: str, *, root: str | Path | None = None, version: str | None = None,
                    trust: Mapping[str, bytes] | None = None) -> "LoadedBundle":
    """The verified bundle of ``name``'s active version (or ``version``, one the index
    lists).  Refused when verification fails (a missing or invalid signature, or — with
    ``trust``, a workspace's trust store — one by an untrusted key), when it is not
    ``name@version``, or when its manifest is not the one the index recorded at promotion.
    Serving (core.serve.serving) passes its workspace's trust store and also checks the digest
    its registry recorded; the index alone is a file anyone who can write the folder can
    edit."""
    base = policies_root(root)
    entry = read_index(root).policies.get(name)
    version = version or active_version(name, root)
    recorded = entry.versions.get(version) if entry is not None else None
    if recorded is None:
        raise InputError(f"version {version!r} of {name!r} was never promoted into {base}", field="version")
    bundle = load_bundle(base / name / version, trust=trust)
    if (bundle.name, bundle.version) != (name, version):
        raise BundleError(f"the folder {name}/{version} holds {bundle.policy_version}", file=str(base / name / version))
    if bundle.manifest.digest != recorded.get("manifest_digest"):
        raise BundleError(f"{name} {version} in {base} is not the bundle that was promoted (its manifest "
                          "digest differs from the index)", file=str(base / name / version))
    return bundle


__all__ = ["ENV_ROOT", "INDEX", "INDEX_FORMAT", "PolicyIndex", "PolicyIndexEntry", "active_version", "empty_index",
           "load_bundle_for", "policies_root", "read_index", "read_index_document"]
