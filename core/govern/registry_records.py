"""What the policy registry has recorded, read back: its events, the names it holds and the
digest it recorded for a promoted copy.

Read-only and free of the registry's rules, so that serving can check a promoted policy
against the registry's records without depending on the registry itself
(:func:`core.serve.serving.load_promoted`); :mod:`core.govern.registry` writes these records.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import sqlite3

    from core.records.store import Workspace


@dataclass(frozen=True)
class RegistryEvent:
    """One row of the append-only ``registry_events`` table: a transition of one version."""

    #: Position in the log (events are ordered by it)
    id: int
    name: str
    version: str
    #: ``registered``, ``approved``, ``promoted`` or ``rolled_back``
    event: str
    #: Who did it, and in which role
    actor: str
    role: str
    at: str
    #: Why, in the actor's words (empty when none was given)
    comment: str
    #: What the registry recorded with it: for ``registered`` its own record of the bundle
    #: (sha256, signer, who trained the run, its evaluation), for ``approved`` the gate, for
    #: ``promoted`` and ``rolled_back`` the manifest digest of the copy installed
    detail: dict[str, Any]


def registry_events(conn: "sqlite3.Connection", name: str | None = None) -> list[RegistryEvent]:
    """Every registry event (of ``name``, when given), oldest first, its detail parsed."""
    sql = "SELECT id, name, version, event, actor, role, at, comment, detail FROM registry_events"
    args: tuple[Any, ...] = ()
    if name is not None:
        sql += " WHERE name=?"
        args = (name,)
    return [RegistryEvent(id=r[0], name=r[1], version=r[2], event=r[3], actor=r[4], role=r[5], at=r[6],
                          comment=r[7], detail=json.loads(r[8]) if r[8] else {})
            for r in conn.execute(sql + " ORDER BY id", args)]


def promoted_digest_in(events: Sequence[RegistryEvent], version: str) -> str | None:
    """The manifest digest of ``version``'s promoted copy as the registry last recorded it
    (its latest ``promoted`` or ``rolled_back`` event), or None when never promoted."""
    digest = None
    for e in events:
        if e.version == version and e.event in ("promoted", "rolled_back") and e.detail.get("manifest_digest"):
            digest = e.detail["manifest_digest"]
    return digest


def promoted_digest(ws: "Workspace", name: str, version: str) -> str | None:
    """The manifest digest this workspace's registry recorded for the promoted copy of
    ``name@version`` (None when this registry never promoted it).  Serving checks the copy
    it loads against it."""
    return promoted_digest_in(registry_events(ws.conn, name), version)


def policy_names(ws: "Workspace") -> list[str]:
    """Names with at least one registered version."""
    return [r[0] for r in ws.conn.execute("SELECT DISTINCT name FROM policy_versions ORDER BY name")]


__all__ = ["RegistryEvent", "policy_names", "promoted_digest", "promoted_digest_in", "registry_events"]
