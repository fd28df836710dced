"""What the policy registry has recorded, read back and checked: its events, the names it
holds, the production version and the digest it recorded for a promoted copy.

Every event the registry's own functions write is signed with the workspace's signing key
(:func:`sign_record`) over the whole row, its position in the log included, and names the
event of the same policy it follows (``after``).  :func:`registry_log` reads the log and
keeps apart what the registry recorded (a signature by a key the workspace trusts, the
chain of its policy whole) from rows that are not its own — a row inserted, copied or
changed with SQL, which cannot be signed without the key file.  Only recorded events count
for a decision: the stage of a version, its approval, the production version and its digest.

Read-only and free of the registry's rules, so that serving can check a promoted policy
against the registry's records without depending on the registry itself
(:func:`core.serve.serving.load_promoted`); :mod:`core.govern.registry` writes these records.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from core.access.keys import ALGORITHM, fingerprint, trust_store
from core.base.bounded_json import max_depth_of
from core.base.errors import ConflictError

if TYPE_CHECKING:  # pragma: no cover
    import sqlite3

    from core.records.store import Workspace

#: What an event signature signs: this label, then the canonical JSON of the row.
EVENT_LABEL = b"rwb-registry-event/1\n"
#: The key of an event's detail that holds its signature (everything else is signed).
SIGNATURE = "signature"
#: The key of an event's detail naming the recorded event of the same policy it follows.
AFTER = "after"
#: A detail larger or deeper than this is not one the registry wrote (its own are a few KB).
MAX_DETAIL_BYTES = 4 << 20
MAX_DETAIL_DEPTH = 32


class RegistryLogBroken(ConflictError):
    """The registry's log of a policy lost events: the registry will not act on it."""


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
    #: (sha256, signer, who trained the run, its evaluation), for ``approved`` the gate and
    #: the digests approved, for ``promoted`` and ``rolled_back`` the manifest digest of the
    #: copy installed; and the registry's ``signature`` of the row and the event it follows
    detail: dict[str, Any]


# --------------------------------------------------------------------------- signatures
def canonical(value: Any) -> bytes:
    """The one byte form a signature covers: sorted keys, no spaces, UTF-8."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def sign_record(key: Ed25519PrivateKey, label: bytes, payload: Any) -> dict[str, str]:
    """``{algorithm, fingerprint, public_key, signature}``: ``key``'s Ed25519 signature of
    ``label`` followed by the canonical JSON of ``payload``."""
    public = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return {"algorithm": ALGORITHM, "fingerprint": fingerprint(public),
            "public_key": base64.b64encode(public).decode("ascii"),
            "signature": base64.b64encode(key.sign(label + canonical(payload))).decode("ascii")}


def record_signature_problem(signature: Any, label: bytes, payload: Any,
                             trust: Mapping[str, bytes] | None) -> str | None:
    """Why ``signature`` (:func:`sign_record`'s form) does not vouch for ``payload`` under
    ``label`` (None when it does).  ``trust`` is the verifier's trust store; None checks
    the signature alone (integrity, not who signed), for a caller with no workspace."""
    if not isinstance(signature, Mapping):
        return "it carries no registry signature"
    fields = ("algorithm", "fingerprint", "public_key", "signature")
    if not all(isinstance(signature.get(f), str) for f in fields) or signature["algorithm"] != ALGORITHM:
        return "its signature is not an Ed25519 registry signature"
    try:
        raw = base64.b64decode(signature["public_key"], validate=True)
        sig = base64.b64decode(signature["signature"], validate=True)
        public = Ed25519PublicKey.from_public_bytes(raw)
    except ValueError:
        return "its signature is not valid base64 Ed25519 data"
    fp = fingerprint(raw)
    if fp != signature["fingerprint"]:
        return f"its signature names key {signature['fingerprint']} but carries key {fp}"
    try:
        public.verify(sig, label + canonical(payload))
    except InvalidSignature:
        return f"the signature by {fp} does not verify: it was changed after the registry signed it"
    if trust is not None and trust.get(fp) != raw:
        return f"it is signed by key {fp}, which this workspace does not trust"
    return None


def event_payload(event: RegistryEvent) -> dict[str, Any]:
    """What an event's signature covers: the whole row, its id included, less the signature."""
    return {"id": event.id, "name": event.name, "version": event.version, "event": event.event,
            "actor": event.actor, "role": event.role, "at": event.at, "comment": event.comment,
            "detail": {k: v for k, v in event.detail.items() if k != SIGNATURE}}


# --------------------------------------------------------------------------- reading
def _detail(text: str | None) -> dict[str, Any]:
    """An event's detail, parsed within bounds (a row the registry did not write may hold
    anything; an unreadable one is kept as a reason, and its signature cannot verify)."""
    if not text:
        return {}
    raw = text.encode("utf-8", "surrogatepass")
    if len(raw) > MAX_DETAIL_BYTES or max_depth_of(raw) > MAX_DETAIL_DEPTH:
        return {"unreadable": f"{len(raw):,} bytes, deeper or longer than a registry record"}
    try:
        value = json.loads(text)
    except ValueError as exc:
        return {"unreadable": f"not JSON ({exc})"}
    return value if isinstance(value, dict) else {"unreadable": "not a JSON object"}


def registry_events(conn: "sqlite3.Connection", name: str | None = None) -> list[RegistryEvent]:
    """Every registry event (of ``name``, when given), oldest first, its detail parsed: the
    raw log, rows not written by the registry included (:func:`registry_log` tells them apart)."""
    sql = "SELECT id, name, version, event, actor, role, at, comment, detail FROM registry_events"
    args: tuple[Any, ...] = ()
    if name is not None:
        sql += " WHERE name=?"
        args = (name,)
    return [RegistryEvent(id=r[0], name=r[1], version=r[2], event=r[3], actor=r[4], role=r[5], at=r[6],
                          comment=r[7], detail=_detail(r[8]))
            for r in conn.execute(sql + " ORDER BY id", args)]


@dataclass(frozen=True)
class UnrecordedEvent:
    """A row of the log that the registry did not write, and why it does not count."""

    event: RegistryEvent
    reason: str


@dataclass(frozen=True)
class RegistryLog:
    """The registry's log (of one policy, or all), checked."""

    #: Every row, oldest first
    events: list[RegistryEvent]
    #: The rows the registry's own functions wrote: signed by a key the workspace trusts
    recorded: list[RegistryEvent]
    #: The other rows, each with why it does not count
    unrecorded: list[UnrecordedEvent]
    #: Why the chain of recorded events is broken (events were removed), None when whole
    gap: str | None

    def last_sequence(self, name: str) -> int | None:
        """The id of ``name``'s latest recorded event (None when it has none)."""
        ids = [e.id for e in self.recorded if e.name == name]
        return ids[-1] if ids else None

    def check_whole(self, name: str) -> None:
        """Raise :class:`RegistryLogBroken` when the chain of ``name``'s events is broken."""
        if self.gap is not None:
            raise RegistryLogBroken(f"the registry's log of {name} lost events ({self.gap}); it will not act on "
                                    "it: restore the workspace database from a backup")


def registry_log(conn: "sqlite3.Connection", name: str | None, trust: Mapping[str, bytes]) -> RegistryLog:
    """The log (of ``name``, or all), each row checked: its signature by a key in ``trust``
    (the workspace's trust store) over the row, and the recorded event it names as the one
    it follows, which must be the policy's previous recorded event (else rows were removed)."""
    events = registry_events(conn, name)
    recorded: list[RegistryEvent] = []
    unrecorded: list[UnrecordedEvent] = []
    last: dict[str, int] = {}
    gap = None
    for e in events:
        problem = (e.detail["unreadable"] if "unreadable" in e.detail else
                   record_signature_problem(e.detail.get(SIGNATURE), EVENT_LABEL, event_payload(e), trust))
        if problem is not None:
            unrecorded.append(UnrecordedEvent(e, problem))
            continue
        after = e.detail.get(AFTER)
        if after != last.get(e.name) and gap is None:
            gap = (f"event {e.id} follows event {after}, but the recorded event before it is "
                   f"{last.get(e.name)}")
        recorded.append(e)
        last[e.name] = e.id
    return RegistryLog(events=events, recorded=recorded, unrecorded=unrecorded, gap=gap)


# --------------------------------------------------------------------------- what they say
def production_stack(events: Sequence[RegistryEvent]) -> tuple[dict[str, str], list[str]]:
    """``(stage per version, production stack)`` of one name from its events, in order:
    a promotion pushes onto the stack, a rollback pops the top (the stack's top is
    production)."""
    stage: dict[str, str] = {}
    stack: list[str] = []
    for e in events:
        v = e.version
        if e.event == "registered":
            stage[v] = "candidate"
        elif e.event == "approved":
            stage[v] = "approved"
        elif e.event == "promoted":
            if stack and stack[-1] != v:
                stage[stack[-1]] = "approved"
            stack.append(v)
            stage[v] = "production"
        elif e.event == "rolled_back":
            if stack:
                stage[stack.pop()] = "rolled_back"
            stage[v] = "production"
            if not stack or stack[-1] != v:  # a log that restored a version off the stack
                stack.append(v)
    return stage, stack


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
    return promoted_digest_in(registry_log(ws.conn, name, trust_store(ws)).recorded, version)


@dataclass(frozen=True)
class RegistryProduction:
    """What the registry's recorded events say production serves for one name."""

    name: str
    #: The production version, None when nothing is in production
    version: str | None
    #: The manifest digest of the copy the registry installed for it
    manifest_digest: str | None
    #: The id of the name's latest recorded event (what an index written now reflects)
    sequence: int | None
    #: The log the answer was read from (its unrecorded rows, for the security log)
    log: RegistryLog


def registry_production(conn: "sqlite3.Connection", name: str, trust: Mapping[str, bytes]) -> RegistryProduction:
    """The production version of ``name`` and its digest, from the recorded events only
    (:class:`RegistryLogBroken` when the log lost events)."""
    log = registry_log(conn, name, trust)
    log.check_whole(name)
    stack = production_stack(log.recorded)[1]
    version = stack[-1] if stack else None
    return RegistryProduction(name=name, version=version,
                              manifest_digest=promoted_digest_in(log.recorded, version) if version else None,
                              sequence=log.last_sequence(name), log=log)


def policy_names(ws: "Workspace") -> list[str]:
    """Names with at least one registered version."""
    return [r[0] for r in ws.conn.execute("SELECT DISTINCT name FROM policy_versions ORDER BY name")]


__all__ = ["AFTER", "EVENT_LABEL", "RegistryEvent", "RegistryLog", "RegistryLogBroken", "RegistryProduction",
           "SIGNATURE", "UnrecordedEvent", "canonical", "event_payload", "policy_names", "production_stack",
           "promoted_digest", "promoted_digest_in", "record_signature_problem", "registry_events", "registry_log",
           "registry_production", "sign_record"]
