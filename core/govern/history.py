"""The governance history: every decision people made in the workbench, accepted or refused.

Template saves, outcome labels, review decisions, policy registrations, approvals,
promotions, rollbacks and datasets archived or deleted, each read from the append-only
record its own area keeps (``template_versions``, ``label_events``, ``review_events``, the
registry's signed ``registry_events``, ``dataset_events``), and the refusals from the
security log, where :mod:`core.govern.registry` records a refused registration, approval,
promotion or rollback (and :mod:`core.rewards.versions` a template refused by a bound).
Read-only: it reads the other areas' tables directly and depends on none of their rules.

:func:`governance_history` is what the Audit page and ``rwb audit history`` show.
Details: docs/governance.md (## The governance history).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from core.access.audit import normalize_timestamp, security_events
from core.access.keys import trust_store
from core.base.errors import InputError
from core.govern.registry_records import registry_log

if TYPE_CHECKING:  # pragma: no cover
    from core.records.store import Workspace

#: Each kind of decision and its plain label.
KINDS: dict[str, str] = {
    "template_save": "Reward template saved",
    "label": "Outcome label",
    "review": "Review decision",
    "registration": "Policy registered",
    "approval": "Approval",
    "promotion": "Promotion",
    "rollback": "Rollback",
    "dataset": "Dataset archived or deleted",
}
OUTCOMES: tuple[str, ...] = ("accepted", "refused")
#: The security-log events that record a refused decision, and its kind.
REFUSED: dict[str, str] = {
    "template_refused": "template_save",
    "register_refused": "registration",
    "approve_refused": "approval",
    "promote_refused": "promotion",
    "rollback_refused": "rollback",
}
_REGISTRY_KINDS = {"registered": "registration", "approved": "approval", "promoted": "promotion",
                   "rolled_back": "rollback"}
_LABEL_WORDS = {1: "success", 0: "failure", None: "label withdrawn"}
DEFAULT_LIMIT = 500


@dataclass(frozen=True)
class GovernanceEvent:
    """One decision, as its area recorded it."""

    #: When (UTC, the audit trail's fixed-width ISO form, so text order is time order)
    when: str
    #: Who decided (None when no signed-in person did)
    who: str | None
    #: Their role, when the record keeps it
    role: str | None
    #: One of :data:`KINDS`
    kind: str
    #: What it was about: ``finance_risk v3``, ``finance / ep-12``, ``review item 7 …``, ``svc 0.2.0``
    subject: str
    #: What was decided, in words: ``saved version 3``, ``success``, ``rejected the action``, ``approved`` …
    decision: str
    #: ``accepted`` (it happened) or ``refused`` (the workbench said no)
    outcome: str
    #: Why: the person's comment or note for an accepted one, the refusal for a refused one
    reason: str
    #: What else the record says (digests, the gate's verdict, the folder written …)
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def kind_label(self) -> str:
        """The kind in plain words (:data:`KINDS`)."""
        return KINDS[self.kind]


# --------------------------------------------------------------------------- times
def _when(value: Any) -> str:
    """A stored time (ISO text, or seconds since the epoch) in the audit trail's form."""
    if isinstance(value, (int, float)):
        return datetime.fromtimestamp(float(value), timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    try:
        return normalize_timestamp(str(value))
    except ValueError:
        return str(value)


def _bound(value: str | None, name: str) -> str | None:
    """A filter time: ISO 8601 with a zone, or a date alone (midnight UTC)."""
    if value is None or not str(value).strip():
        return None
    text = str(value).strip()
    if len(text) == 10:
        text += "T00:00:00Z"
    try:
        return normalize_timestamp(text)
    except ValueError as exc:
        raise InputError(f"{exc}; give a date (2025-03-01) or an ISO time with its zone (2025-03-01T09:00:00Z)",
                         field=name) from None


def _second(bound: str, *, end: bool = False) -> str:
    """A filter time to the second, for comparing text times stored in either form
    (``…T09:00:00Z`` or ``…T09:00:00.123456Z``): ``end`` sorts after every time of that second."""
    return bound[:19] + ("~" if end else "")


def _epoch(bound: str) -> float:
    return datetime.fromisoformat(bound.replace("Z", "+00:00")).timestamp()


# --------------------------------------------------------------------------- the sources
def _sql_filters(column: str, who: str | None, since: str | None, until: str | None, *, epoch: bool = False,
                 who_column: str | None = None) -> tuple[str, list[Any]]:
    """``AND …`` conditions a source's query adds: a superset of the rows the filters keep
    (whole seconds), narrowed exactly once the times are read."""
    where: list[str] = []
    args: list[Any] = []
    if who is not None and who_column is not None:
        where.append(f"{who_column} = ? COLLATE NOCASE")
        args.append(who)
    if since is not None:
        where.append(f"{column} >= ?")
        args.append(_epoch(since) - 1.0 if epoch else _second(since))
    if until is not None:
        where.append(f"{column} <= ?")
        args.append(_epoch(until) + 1.0 if epoch else _second(until, end=True))
    return "".join(f" AND {w}" for w in where), args


def _templates(ws: "Workspace", who: str | None, since: str | None, until: str | None) -> list[GovernanceEvent]:
    cond, args = _sql_filters("saved_at", who, since, until, who_column="saved_by")
    rows = ws.conn.execute("SELECT name, version, base_version, saved_by, saved_at, message, sha256 "
                           f"FROM template_versions WHERE saved_at IS NOT NULL{cond} ORDER BY saved_at, rowid", args)
    return [GovernanceEvent(
        when=_when(at), who=by, role=None, kind="template_save", subject=f"{name} v{version}",
        decision=f"saved version {version}" + (f" (edited from version {base})" if base else ""),
        outcome="accepted", reason=message or "", details={"template": name, "version": version,
                                                           "base_version": base, "sha256": sha})
        for name, version, base, by, at, message, sha in rows]


def _labels(ws: "Workspace", who: str | None, since: str | None, until: str | None) -> list[GovernanceEvent]:
    cond, args = _sql_filters("created_at", who, since, until, who_column="created_by")
    rows = ws.conn.execute("SELECT id, dataset, episode_id, outcome, note, created_by, created_at "
                           f"FROM label_events WHERE 1=1{cond} ORDER BY id", args)
    return [GovernanceEvent(
        when=_when(at), who=by, role=None, kind="label", subject=f"{dataset} / {episode}",
        decision=_LABEL_WORDS.get(outcome, str(outcome)), outcome="accepted", reason=note or "",
        details={"dataset": dataset, "episode": episode, "label event": event_id})
        for event_id, dataset, episode, outcome, note, by, at in rows]


def _reviews(ws: "Workspace", who: str | None, since: str | None, until: str | None) -> list[GovernanceEvent]:
    cond, args = _sql_filters("e.at", who, since, until, epoch=True, who_column="e.actor")
    rows = ws.conn.execute(
        "SELECT e.item_id, e.actor, e.at, e.detail, i.dataset, i.action_label, i.token_name, i.tool, i.reason "
        "FROM review_events e JOIN review_items i ON i.id = e.item_id "
        f"WHERE e.event = 'decided'{cond} ORDER BY e.id", args)
    out = []
    for item, by, at, detail, dataset, label, token, tool, flagged in rows:
        d = json.loads(detail) if detail else {}
        decision = str(d.get("decision"))
        action = label or token or tool or "an action"
        out.append(GovernanceEvent(
            when=_when(at), who=by, role=None, kind="review", subject=f"review item {item}: {action}",
            decision={"approve": "approved the action", "reject": "rejected the action (a mask rule now blocks it)"}
            .get(decision, decision),
            outcome="accepted", reason=d.get("comment") or "",
            details={"item": item, "dataset": dataset, "flagged because": flagged}))
    return out


def _registry(ws: "Workspace") -> list[GovernanceEvent]:
    """The registry's recorded events (signed by the workspace); rows it did not write count
    for nothing and are not decisions (``rwb registry history`` lists them)."""
    out = []
    for e in registry_log(ws.conn, None, trust_store(ws)).recorded:
        kind = _REGISTRY_KINDS.get(e.event)
        if kind is None:
            continue
        d = e.detail
        if e.event == "registered":
            decision, details = "registered as a candidate", {"bundle sha256": str(d.get("bundle_sha256", ""))[:16],
                                                              "evaluated from": d.get("evaluated_from")}
        elif e.event == "approved":
            gate = d.get("gate")
            decision = "approved"
            details = {"promotion gate": gate.get("reason") if isinstance(gate, Mapping) else None}
        elif e.event == "promoted":
            decision = "promoted to production" + (f" (replacing {d['from']})" if d.get("from") else "")
            details = {"written to": d.get("path"), "approved by": ", ".join(d.get("approved_by") or [])}
        else:
            decision = f"rolled back to {e.version}" + (f" from {d['from']}" if d.get("from") else "")
            details = {"written to": d.get("path"), "copy written again": bool(d.get("reinstalled"))}
        out.append(GovernanceEvent(when=_when(e.at), who=e.actor, role=e.role, kind=kind,
                                   subject=f"{e.name} {e.version}", decision=decision, outcome="accepted",
                                   reason=e.comment or "", details={"registry event": e.id, **details}))
    return out


_DATASET_WORDS = {"archived": "archived", "restored": "restored from the archive", "deleted": "deleted",
                  "archive_refused": "archiving refused", "delete_refused": "deletion refused"}


def _datasets(ws: "Workspace", who: str | None, since: str | None, until: str | None) -> list[GovernanceEvent]:
    """Datasets archived, restored or deleted, refusals included (``dataset_events``, kept
    by :mod:`core.data.datasets` in workspaces whose schema has it)."""
    if ws.conn.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='dataset_events'").fetchone() is None:
        return []
    cond, args = _sql_filters("at", who, since, until, who_column="actor")
    out = []
    for dataset, event, by, role, at, detail in ws.conn.execute(
            f"SELECT dataset, event, actor, role, at, detail FROM dataset_events WHERE 1=1{cond} ORDER BY id",
            args):
        d = json.loads(detail) if detail else {}
        refused = str(event).endswith("_refused")
        out.append(GovernanceEvent(
            when=_when(at), who=by, role=role, kind="dataset", subject=dataset,
            decision=_DATASET_WORDS.get(event, str(event)), outcome="refused" if refused else "accepted",
            reason=str(d.get("reason") or d.get("comment") or ""),
            details={k: (", ".join(map(str, v)) if isinstance(v, list) else v) for k, v in d.items()
                     if k not in ("reason", "comment")}))
    return out


def _subject(detail: Mapping[str, Any]) -> str:
    if detail.get("policy"):
        return str(detail["policy"]).replace("@", " ", 1)
    if detail.get("template"):
        return str(detail["template"])
    return str(detail.get("file") or "—")


def _refusals(ws: "Workspace") -> list[GovernanceEvent]:
    """Refused decisions, from the security log."""
    out = []
    for e in security_events(ws):
        kind = REFUSED.get(e.event)
        if kind is None:
            continue
        d = e.detail
        keep = {k: v for k, v in d.items()
                if k not in ("reason", "policy", "template", "action", "error") and v not in (None, "")}
        out.append(GovernanceEvent(when=_when(e.at), who=e.actor, role=e.role, kind=kind, subject=_subject(d),
                                   decision=f"{KINDS[kind].lower()} refused", outcome="refused",
                                   reason=str(d.get("reason") or ""), details=keep))
    return out


# --------------------------------------------------------------------------- the history
def _kinds(kinds: Iterable[str] | None) -> set[str]:
    if kinds is None:
        return set(KINDS)
    wanted = {str(k) for k in ([kinds] if isinstance(kinds, str) else kinds)}
    unknown = sorted(wanted - set(KINDS))
    if unknown:
        raise InputError(f"no kind of decision named {', '.join(unknown)} (kinds: {', '.join(KINDS)})", field="kind",
                         allowed=list(KINDS))
    return wanted


def governance_history(ws: "Workspace", *, kinds: Iterable[str] | None = None, who: str | None = None,
                       subject: str | None = None, since: str | None = None, until: str | None = None,
                       outcome: str | None = None, limit: int = DEFAULT_LIMIT) -> list[GovernanceEvent]:
    """Decisions made in the workbench, newest first, at most ``limit``.

    Filters: ``kinds`` (names of :data:`KINDS`), ``who`` (a person's name, any case),
    ``subject`` (text the subject contains, any case), ``since`` ≤ when < ``until``
    (ISO 8601 with a zone, or a date: midnight UTC) and ``outcome`` (``accepted`` or
    ``refused``).  Bad filters raise InputError naming the field."""
    wanted = _kinds(kinds)
    if outcome is not None and outcome not in OUTCOMES:
        raise InputError(f"an outcome is accepted or refused, not {outcome!r}", field="outcome",
                         allowed=list(OUTCOMES))
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise InputError(f"limit is a whole number ≥ 1, not {limit!r}", field="limit")
    lo, hi = _bound(since, "since"), _bound(until, "until")
    who = (who or "").strip() or None
    needle = (subject or "").strip().casefold() or None
    events: list[GovernanceEvent] = []
    if outcome != "refused":
        if "template_save" in wanted:
            events += _templates(ws, who, lo, hi)
        if "label" in wanted:
            events += _labels(ws, who, lo, hi)
        if "review" in wanted:
            events += _reviews(ws, who, lo, hi)
        if wanted & set(_REGISTRY_KINDS.values()):
            events += _registry(ws)
    if outcome != "accepted":
        events += _refusals(ws)
    if "dataset" in wanted:  # one table holds both outcomes
        events += _datasets(ws, who, lo, hi)
    kept = [e for e in events
            if e.kind in wanted and (outcome is None or e.outcome == outcome)
            and (who is None or (e.who or "").casefold() == who.casefold())
            and (needle is None or needle in e.subject.casefold())
            and (lo is None or e.when >= lo) and (hi is None or e.when < hi)]
    # Each source lists its records oldest first; reversed, a stable sort keeps the later of
    # two records of one second first (most tables store whole seconds).
    kept.reverse()
    kept.sort(key=lambda e: e.when, reverse=True)
    return kept[:limit]


def governance_people(ws: "Workspace") -> list[str]:
    """Everyone the governance history names, by name (for a filter's choices)."""
    names: set[str] = set()
    for sql in ("SELECT DISTINCT saved_by FROM template_versions WHERE saved_at IS NOT NULL",
                "SELECT DISTINCT created_by FROM label_events",
                "SELECT DISTINCT actor FROM review_events WHERE event = 'decided'",
                "SELECT DISTINCT actor FROM registry_events"):
        names.update(r[0] for r in ws.conn.execute(sql) if r[0])
    names.update(e.who for e in _datasets(ws, None, None, None) if e.who)
    names.update(e.actor for e in security_events(ws) if e.event in REFUSED and e.actor)
    return sorted(names, key=str.casefold)


__all__ = ["DEFAULT_LIMIT", "GovernanceEvent", "KINDS", "OUTCOMES", "REFUSED", "governance_history",
           "governance_people"]
