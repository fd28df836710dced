"""The human review queue for high-risk actions (docs/design.md §9, S000 §2.2-2.3).

Items come from training (curriculum level L3, or a recorded step sent with :func:`send_step`)
and from serving (a high-risk action served with low confidence), each a :class:`ReviewRequest`
put on the queue by :func:`enqueue`.  A reviewer claims an item (:func:`claim`, with a lease)
and decides it once (:func:`decide`): an approval becomes a training example
(:func:`approved_examples`), a rejection a mask rule (:func:`review_mask_rules`,
:func:`with_review_rules`).  Every write is one ``BEGIN IMMEDIATE`` transaction.
:func:`flag_rule` says which rule put an item on the queue and why, :func:`similar_decisions`
how items like it were decided (core.govern.review_context gathers the rest a reviewer reads).

Details: docs/governance.md (## Review queue: where items come from, ## Claiming and deciding,
## What a reviewer sees, ## Review concurrency).
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from core.guard import masking
from core.base.errors import ConflictError, InputError
from core.access.users import Actor, authorize
from core.records.catalog import catalog_for_dataset

if TYPE_CHECKING:  # pragma: no cover
    import sqlite3

    from core.records.catalog import ActionToken, Catalog
    from core.records.episodes import Episode
    from core.records.store import Workspace

ORIGINS: tuple[str, ...] = ("training", "serving")
DECISIONS: tuple[str, ...] = ("approve", "reject")
#: Label of an approved step in the training data (S000: "reasonable exploration").
EXPLORATION_LABEL = "reasonable_exploration"
DEFAULT_LEASE_SECONDS = 300.0

_rules_added = 0
_rules_lock = threading.Lock()  # += is no atomic step: decisions may run on several threads
_ITEM_COLUMNS = (
    "id", "origin", "reason", "dataset", "task_type", "state", "key_features", "token_id",
    "token_name", "action_label", "tool", "risk", "reward_components", "confidence", "run_id",
    "episode_id", "step_t", "decision_id", "status", "created_at", "created_by", "claimed_by",
    "claimed_at", "claim_expires", "decision", "decided_by", "decided_at", "comment")
_SELECT_ITEM = f"SELECT {', '.join(_ITEM_COLUMNS)} FROM review_items"


@dataclass(frozen=True)
class ReviewRequest:
    """One step to put on the review queue (validated by :func:`enqueue`)."""

    #: "training" (curriculum L3) or "serving" (high-risk final action, low confidence).
    origin: str
    #: Why it was queued, in words a reviewer reads ("same high-risk action 3× in a row").
    reason: str
    #: Flat scalar state features the action was taken in (Step.observation["state"]).
    state: Mapping[str, Any]
    #: The proposed action token (core.records.catalog.ActionToken.id).
    token_id: int
    token_name: str | None = None
    action_label: str | None = None
    tool: str | None = None
    risk: str | None = None
    #: [{"name", "value"}, ...] or {name: value}: the reward components of this step.
    reward_components: Sequence[Mapping[str, Any]] | Mapping[str, float] = ()
    task_type: str | None = None
    dataset: str | None = None
    #: The policy's / baseline's confidence in the action, when known.
    confidence: float | None = None
    #: The state features that define the pattern a rejection masks (default: the task
    #: type plus every non-numeric feature; see :func:`state_pattern`).
    key_features: Sequence[str] | None = None
    run_id: str | None = None
    episode_id: str | None = None
    step_t: int | None = None
    decision_id: str | None = None
    #: Free-form extra context shown to the reviewer (kept inside the state JSON under "_meta").
    meta: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ReviewEvent:
    """One entry of a review item's event log (:func:`item_events`)."""

    id: int
    #: "enqueued", "claimed", "released" or "decided".
    event: str
    #: The user who caused it.
    actor: str
    #: When, as ISO 8601 UTC text.
    at: str
    #: What else is known, e.g. {"lease_seconds": 300} for a claim, {"decision", "comment"}
    #: for a decision; None when nothing is.
    detail: dict[str, Any] | None


@dataclass(frozen=True)
class ReviewItem:
    """One item of the review queue as it stands (:func:`list_items`, :func:`claim`,
    :func:`decide`, ...).  Times are ISO 8601 UTC text."""

    id: int
    #: "training" or "serving".
    origin: str
    #: Why it was queued, in words a reviewer reads.
    reason: str
    dataset: str | None
    task_type: str | None
    #: Flat scalar state features the action was taken in.
    state: dict[str, Any]
    #: The state features a rejection's pattern is built from; None: every feature.
    key_features: list[str] | None
    #: The proposed action token and what the catalog says of it.
    token_id: int
    token_name: str | None
    action_label: str | None
    tool: str | None
    risk: str | None
    #: [{"name", "value"}, ...]: the reward components of this step.
    reward_components: list[dict[str, Any]]
    confidence: float | None
    #: Where the step comes from: a training run, an episode and step, a served decision.
    run_id: str | None
    episode_id: str | None
    step_t: int | None
    decision_id: str | None
    #: "pending", "claimed" or "decided".
    status: str
    created_at: str
    created_by: str
    #: The current (or last) claim: who holds it, since when, until when.
    claimed_by: str | None
    claimed_at: str | None
    claim_expires: str | None
    #: "approve" or "reject" once decided, with who decided, when and why.
    decision: str | None
    decided_by: str | None
    decided_at: str | None
    comment: str | None
    #: Free-form extra context for the reviewer (ReviewRequest.meta).
    meta: dict[str, Any]
    #: Claimed, but the lease ran out: claimable again.
    claim_expired: bool
    #: Seconds since it was queued.
    age_s: float


@dataclass(frozen=True)
class ReviewItemDetail(ReviewItem):
    """One review item with its event log (:func:`get_item`)."""

    #: Oldest first: enqueued, claimed, released, decided.
    events: list[ReviewEvent]


@dataclass(frozen=True)
class ReviewMaskRule:
    """A mask rule born from a rejected review (:func:`review_mask_rules`), with the fields of
    core.guard.masking's rule form; :meth:`to_rule_data` is what ``MaskRules.add_rules`` reads."""

    #: "review_<item id>".
    name: str
    #: Always "review".
    kind: str
    #: {"tokens": [token name, or id when it has no name]}: the action it blocks.
    targets: dict[str, Any]
    #: The state pattern (a core.guard.masking condition) in which it blocks it.
    when: dict[str, Any]
    #: "rejected in review <id>: <the reviewer's comment>".
    message: str
    #: {"review_id", "reviewer", "created_at", "dataset"}.
    meta: dict[str, Any]

    def to_rule_data(self) -> dict[str, Any]:
        """The rule as data for :meth:`core.guard.masking.MaskRules.add_rules`."""
        return {"name": self.name, "kind": self.kind, "targets": self.targets,
                "when": self.when, "message": self.message, "meta": self.meta}


@dataclass(frozen=True)
class ApprovedExample:
    """An approved review step as a labelled training example (:func:`approved_examples`)."""

    item_id: int
    dataset: str | None
    task_type: str | None
    #: Flat scalar state features the action was taken in.
    state: dict[str, Any]
    token_id: int
    token_name: str | None
    tool: str | None
    #: Always :data:`EXPLORATION_LABEL`.
    label: str
    origin: str
    run_id: str | None
    episode_id: str | None
    step_t: int | None
    decided_by: str
    decided_at: str


# --------------------------------------------------------------------------- helpers
def _iso_text(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int((t % 1) * 1000):03d}Z"


def _iso(t: float | None) -> str | None:
    return None if t is None else _iso_text(t)


def _json(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, sort_keys=True, separators=(",", ":"),
                      allow_nan=False)


def _check_scalar(name: str, value: Any, where: str) -> None:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            raise InputError(f"state feature {name!r} is {value!r}; features must be finite",
                             field=f"{where}.{name}")
        return
    raise InputError(f"state feature {name!r} is a {type(value).__name__}; the state must be a "
                     "flat dict of scalars (numbers, text, booleans)", field=f"{where}.{name}")


def _components(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, Mapping):
        items = [{"name": k, "value": v} for k, v in value.items()]
    else:
        items = [dict(c) for c in value]
    out = []
    for c in items:
        if set(c) != {"name", "value"} or not isinstance(c["name"], str) or not c["name"]:
            raise InputError("each reward component is {name, value}", field="reward_components")
        v = c["value"]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise InputError(f"reward component {c['name']!r} has value {v!r}; need a finite "
                             "number", field="reward_components")
        out.append({"name": c["name"], "value": float(v)})
    return out


def _validated_row(req: ReviewRequest, actor: Actor, now: float) -> dict[str, Any]:
    if req.origin not in ORIGINS:
        raise InputError(f"origin must be one of {', '.join(ORIGINS)}, not {req.origin!r}",
                         field="origin")
    if not isinstance(req.reason, str) or not req.reason.strip():
        raise InputError("say why the step is queued (reason)", field="reason")
    if not isinstance(req.state, Mapping):
        raise InputError("state must be a dict of scalar features", field="state")
    for k, v in req.state.items():
        if not isinstance(k, str):
            raise InputError("state feature names must be text", field="state")
        _check_scalar(k, v, "state")
    if isinstance(req.token_id, bool) or not isinstance(req.token_id, int) or req.token_id < 0:
        raise InputError(f"token_id must be an action token id ≥ 0, not {req.token_id!r}",
                         field="token_id")
    if req.confidence is not None and not (isinstance(req.confidence, (int, float))
                                           and math.isfinite(req.confidence)):
        raise InputError("confidence must be a finite number", field="confidence")
    keys = None
    if req.key_features is not None:
        keys = [str(k) for k in req.key_features]
        missing = [k for k in keys if k not in req.state and k != "task_type"]
        if missing:
            raise InputError(f"key features {missing} are not in the state", field="key_features")
    state = dict(req.state)
    if req.meta:
        state["_meta"] = dict(req.meta)
    source = (req.run_id, req.episode_id, req.step_t, req.decision_id)
    # The same source step queued twice (a retried training job, a replayed request) is one item.
    source_key = (None if all(s is None for s in source)
                  else _json([req.origin, *source, req.token_id]))
    if req.run_id is None and req.decision_id is None and req.episode_id is not None:
        # A recorded step (send_step): episode ids are unique only within their dataset.
        source_key = _json(["recorded", req.dataset, req.episode_id, req.step_t, req.token_id])
    try:
        state_json, comps_json = _json(state), _json(_components(req.reward_components))
    except (TypeError, ValueError) as exc:
        raise InputError(f"not plain JSON: {exc}", field="state") from exc
    return {"origin": req.origin, "reason": req.reason.strip(), "dataset": req.dataset,
            "task_type": req.task_type, "state": state_json,
            "key_features": None if keys is None else _json(keys), "token_id": req.token_id,
            "token_name": req.token_name, "action_label": req.action_label, "tool": req.tool,
            "risk": req.risk, "reward_components": comps_json,
            "confidence": None if req.confidence is None else float(req.confidence),
            "run_id": req.run_id, "episode_id": req.episode_id, "step_t": req.step_t,
            "decision_id": req.decision_id, "source_key": source_key, "created_at": now,
            "created_by": actor.name}


def _event(conn: "sqlite3.Connection", item_id: int, event: str, actor: Actor, now: float,
           detail: Mapping[str, Any] | None = None) -> None:
    conn.execute("INSERT INTO review_events(item_id, event, actor, at, detail) VALUES (?,?,?,?,?)",
                 (item_id, event, actor.name, now, None if detail is None else _json(detail)))


def _item_fields(row: Sequence[Any], now: float | None = None) -> dict[str, Any]:
    """The fields of a :class:`ReviewItem` from one ``_SELECT_ITEM`` row."""
    d = dict(zip(_ITEM_COLUMNS, row))
    now = time.time() if now is None else now
    state = json.loads(d["state"])
    d["meta"] = state.pop("_meta", {})
    d["state"] = state
    d["key_features"] = None if d["key_features"] is None else json.loads(d["key_features"])
    d["reward_components"] = json.loads(d["reward_components"])
    d["claim_expired"] = d["status"] == "claimed" and d["claim_expires"] < now
    d["age_s"] = round(now - d["created_at"], 3)
    for k in ("created_at", "claimed_at", "claim_expires", "decided_at"):
        d[k] = _iso(d[k])
    return d


def _item(row: Sequence[Any], now: float | None = None) -> ReviewItem:
    return ReviewItem(**_item_fields(row, now))


def _get_row(conn: "sqlite3.Connection", item_id: int) -> tuple[Any, ...]:
    row = conn.execute(f"{_SELECT_ITEM} WHERE id=?", (int(item_id),)).fetchone()
    if row is None:
        raise InputError(f"no review item {item_id}", field="item_id")
    return row


# --------------------------------------------------------------------------- enqueue
def enqueue_many(ws: "Workspace", actor: Actor, requests: Sequence[ReviewRequest], *,
                 ids: Sequence[int] | None = None, created_at: float | None = None) -> list[int]:
    """Queue several steps in one transaction; returns their item ids (an already queued
    source step returns its existing item).  Needs ``enqueue_review``.

    ``ids``: ids taken from :func:`reserve_item_ids`, one per request, which the items get
    (then a source step queued already is a :class:`ConflictError`, nothing written: the
    caller has handed its reserved id out).  ``created_at``: the time the steps were
    queued, when they are written later (default now)."""
    authorize(ws, actor, "enqueue_review")
    now = time.time() if created_at is None else float(created_at)
    rows = [_validated_row(r, actor, now) for r in requests]
    if ids is not None and len(ids) != len(rows):
        raise InputError(f"{len(ids)} reserved ids for {len(rows)} review requests", field="ids")
    out: list[int] = []
    with ws.transaction() as conn:
        for k, row in enumerate(rows):
            if ids is not None:
                row = {"id": int(ids[k]), **row}
            cur = conn.execute(
                f"INSERT INTO review_items({', '.join(row)}) VALUES ({', '.join('?' * len(row))}) "
                "ON CONFLICT(source_key) DO NOTHING", list(row.values()))
            if cur.rowcount == 1:
                assert cur.lastrowid is not None  # an INSERT sets it
                item_id = int(cur.lastrowid)
                _event(conn, item_id, "enqueued", actor, now, {"origin": row["origin"]})
            elif ids is not None:  # rolled back with the transaction
                raise ConflictError(f"review request {k}: its source step is queued already, under "
                                    f"another id than the reserved {ids[k]}")
            else:  # this source step is queued already
                item_id = int(conn.execute("SELECT id FROM review_items WHERE source_key=?",
                                           (row["source_key"],)).fetchone()[0])
            out.append(item_id)
    return out


def reserve_item_ids(ws: "Workspace", actor: Actor, n: int) -> list[int]:
    """``n`` item ids no other writer will give out (one transaction moving the table's
    AUTOINCREMENT counter past them), for items written later with
    ``enqueue_many(ids=...)``: a decision engine hands an item's id out with the decision
    and writes the item off the request's path.  An id reserved and never written is a
    gap in the numbering, nothing more.  Needs ``enqueue_review``."""
    authorize(ws, actor, "enqueue_review")
    if n < 1:
        raise InputError(f"reserve at least one id, not {n}", field="n")
    with ws.transaction() as conn:
        row = conn.execute("SELECT seq FROM sqlite_sequence WHERE name='review_items'").fetchone()
        top = int(conn.execute("SELECT COALESCE(MAX(id), 0) FROM review_items").fetchone()[0])
        start = max(top, 0 if row is None else int(row[0])) + 1
        if row is None:
            conn.execute("INSERT INTO sqlite_sequence(name, seq) VALUES ('review_items', ?)", (start + n - 1,))
        else:
            conn.execute("UPDATE sqlite_sequence SET seq=? WHERE name='review_items'", (start + n - 1,))
    return list(range(start, start + n))


def enqueue(ws: "Workspace", actor: Actor, request: ReviewRequest) -> int:
    """Queue one step for review; returns the item id.  Needs ``enqueue_review``."""
    return enqueue_many(ws, actor, [request])[0]


# --------------------------------------------------------------------------- recorded steps
#: Longest reason a person may give when sending a recorded step to review.
MAX_REASON_CHARS = 500
#: How many steps of each sample dataset a fresh workspace puts on the queue.
SAMPLE_ITEMS_PER_DATASET = 3


@dataclass(frozen=True)
class RecordedStep:
    """One step of a recorded episode with its catalog token (what :func:`send_step` queues)."""

    dataset: str
    episode_id: str
    step_t: int
    task_type: str | None
    #: Flat scalar state features the step was taken in (observation["state"]).
    state: dict[str, Any]
    token: "ActionToken"
    #: The episode's outcome: resolved (None when unknown) and final reward.
    resolved: bool | None
    final_reward: float | None
    #: How many times in a row (ending at this step) the episode took this same token.
    repeats: int


def _scalar_state(observation: Any) -> dict[str, Any]:
    """The flat scalar features of a step's observation["state"] (others are left out: a
    review item's state is a dict of scalars)."""
    state = observation.get("state") if isinstance(observation, Mapping) else None
    if not isinstance(state, Mapping):
        return {}
    return {k: v for k, v in state.items()
            if isinstance(k, str) and (v is None or isinstance(v, (bool, int, str))
                                       or (isinstance(v, float) and math.isfinite(v)))}


def recorded_steps(episode: "Episode", dataset: str, catalog: "Catalog") -> list[RecordedStep]:
    """The steps of one recorded episode that map to a catalog token (INVALID ones are left
    out: a review decides about a token), in order."""
    if not episode.steps:
        return []
    batch = catalog.normalize_many([s.action for s in episode.steps])
    out: list[RecordedStep] = []
    last, repeats = None, 0
    for step, token_id in zip(episode.steps, batch.token_ids.tolist()):
        repeats = repeats + 1 if token_id == last else 1
        last = token_id
        if token_id < 0:
            continue
        out.append(RecordedStep(
            dataset=dataset, episode_id=episode.episode_id, step_t=step.t,
            task_type=episode.task.task_type, state=_scalar_state(step.observation),
            token=catalog.tokens[token_id], resolved=episode.outcome.resolved,
            final_reward=episode.outcome.final_reward, repeats=repeats))
    return out


def recorded_step_request(step: RecordedStep, reason: str, meta: Mapping[str, Any]) -> ReviewRequest:
    """The review request of one recorded step (``meta``: extra context for the reviewer)."""
    tok = step.token
    # origin "training": a recorded step is what training learns from; approving it labels it
    # as training data, rejecting it masks its action (no run_id: it comes from a dataset).
    return ReviewRequest(
        origin="training", reason=reason, state=step.state, token_id=tok.id, token_name=tok.name,
        action_label=tok.label, tool=tok.tool, risk=tok.risk, task_type=step.task_type,
        dataset=step.dataset, episode_id=step.episode_id, step_t=step.step_t,
        meta={"source": "recorded episode", **meta})


def _open_or_decided(conn: "sqlite3.Connection", source_key: str) -> dict[str, Any] | None:
    row = conn.execute(f"{_SELECT_ITEM} WHERE source_key=?", (source_key,)).fetchone()
    return None if row is None else dict(zip(_ITEM_COLUMNS, row))


def send_step(ws: "Workspace", actor: Actor, dataset: str, episode_id: str, step_t: int,
              reason: str = "", *, catalog: "Catalog | None" = None) -> ReviewItem:
    """Put one step of a recorded episode on the review queue; returns the new item.
    Needs ``enqueue_review``.

    Any step whose action maps to a catalog token may be sent (an INVALID action has no
    token to approve or mask).  ``reason`` (at most :data:`MAX_REASON_CHARS` characters;
    default: who sent it) is what the reviewer reads.  A step already on the queue is
    refused with ConflictError naming its item, pending or decided (a decision is final).
    ``catalog``: the dataset's (``core.records.catalog.catalog_for_dataset``; the app passes its
    cached one)."""
    from core.records.store import WorkspaceError  # deferred: loads pandas

    authorize(ws, actor, "enqueue_review")
    if not isinstance(reason, str):
        raise InputError("the reason is text", field="reason")
    reason = reason.strip()
    if len(reason) > MAX_REASON_CHARS:
        raise InputError(f"the reason is {len(reason)} characters long; keep it to "
                         f"{MAX_REASON_CHARS}", field="reason")
    if isinstance(step_t, bool) or not isinstance(step_t, int) or step_t < 0:
        raise InputError(f"the step is a step number ≥ 0, not {step_t!r}", field="step")
    try:
        episode = ws.get_episode(dataset, episode_id)
    except WorkspaceError as exc:
        raise InputError(str(exc), field="episode") from exc
    if not any(s.t == step_t for s in episode.steps):
        ts = [s.t for s in episode.steps]
        raise InputError(f"episode {episode_id!r} has no step {step_t}; its steps are "
                         + (f"{ts[0]}…{ts[-1]}" if ts else "none"), field="step")
    catalog = catalog if catalog is not None else catalog_for_dataset(ws, dataset)
    step = next((s for s in recorded_steps(episode, dataset, catalog) if s.step_t == step_t), None)
    if step is None:
        raise InputError(f"step {step_t} of episode {episode_id!r} is INVALID (not an action of the "
                         "catalog): there is no action token to approve or mask", field="step")
    request = recorded_step_request(step, reason or f"sent to review by {actor.name}",
                            {"sent_by": actor.name})
    row = _validated_row(request, actor, time.time())
    with ws.transaction() as conn:
        now = time.time()
        held = _open_or_decided(conn, row["source_key"])
        if held is not None:
            state = (f"decided ({held['decision']} by {held['decided_by']}): a decision is final"
                     if held["status"] == "decided" else f"{held['status']}")
            raise ConflictError(f"step {step_t} of episode {episode_id!r} is already on the review "
                                f"queue as item #{held['id']}, {state}")
        cur = conn.execute(f"INSERT INTO review_items({', '.join(row)}) "
                           f"VALUES ({', '.join('?' * len(row))})", list(row.values()))
        assert cur.lastrowid is not None  # an INSERT sets it
        item_id = int(cur.lastrowid)
        _event(conn, item_id, "enqueued", actor, now,
               {"origin": row["origin"], "source": "recorded episode", "dataset": dataset})
        return _item(_get_row(conn, item_id), now)


def sample_review_steps(ws: "Workspace", dataset: str, catalog: "Catalog | None" = None,
                        limit: int = SAMPLE_ITEMS_PER_DATASET) -> list[RecordedStep]:
    """The recorded steps of ``dataset`` most worth a reviewer's look: high-risk actions in
    episodes that failed (resolved false), the longest run of the same high-risk action
    first (curriculum L3 flags such runs in training), then the worst final reward; one
    step per episode, at most ``limit``."""
    catalog = catalog if catalog is not None else catalog_for_dataset(ws, dataset)
    best: dict[str, RecordedStep] = {}
    for episode in ws.load_episodes(dataset):
        if episode.outcome.resolved is not False:
            continue
        for step in recorded_steps(episode, dataset, catalog):
            if step.token.risk != "high":
                continue
            kept = best.get(step.episode_id)
            if kept is None or step.repeats > kept.repeats:
                best[step.episode_id] = step
    ranked = sorted(best.values(), key=lambda s: (
        -s.repeats, math.inf if s.final_reward is None else s.final_reward, s.episode_id))
    return ranked[:max(int(limit), 0)]


def sample_review_reason(step: RecordedStep) -> str:
    """Why :func:`sample_review_steps` picked ``step``, in a reviewer's words."""
    reward = "" if step.final_reward is None else f" (final reward {step.final_reward:.2f})"
    repeated = f", {step.repeats} times in a row" if step.repeats > 1 else ""
    return (f"high-risk action {step.token.label}{repeated} in an episode that failed{reward}")


# --------------------------------------------------------------------------- claim / release
def claim(ws: "Workspace", actor: Actor, item_id: int | None = None,
          lease_seconds: float = DEFAULT_LEASE_SECONDS, *, dataset: str | None = None,
          origin: str | None = None) -> ReviewItem | None:
    """Claim an item for ``lease_seconds``; returns it, or None when nothing is claimable.

    Without ``item_id``: the oldest item that is pending or whose claim expired (optionally
    of one dataset / origin).  With ``item_id``: that item — refused (ConflictError) when
    decided or claimed by someone else whose lease still runs; your own claim is renewed.
    Needs ``review``."""
    authorize(ws, actor, "review")
    if not (isinstance(lease_seconds, (int, float)) and 0 < lease_seconds <= 7 * 24 * 3600):
        raise InputError("lease_seconds must be between 0 and one week", field="lease_seconds")
    with ws.transaction() as conn:
        # BEGIN IMMEDIATE holds the write lock: the read below and the update are one step.
        now = time.time()
        if item_id is None:
            sql = ("SELECT id FROM review_items WHERE (status='pending' OR "
                   "(status='claimed' AND claim_expires < ?))")
            args: list[Any] = [now]
            if dataset is not None:
                sql += " AND dataset=?"
                args.append(dataset)
            if origin is not None:
                sql += " AND origin=?"
                args.append(origin)
            found = conn.execute(sql + " ORDER BY id LIMIT 1", args).fetchone()
            if found is None:
                return None
            item_id = int(found[0])
        row = dict(zip(_ITEM_COLUMNS, _get_row(conn, item_id)))
        if row["status"] == "decided":
            raise ConflictError(f"review item {item_id} was already decided ({row['decision']} "
                                f"by {row['decided_by']})")
        held = row["status"] == "claimed" and row["claim_expires"] >= now
        if held and row["claimed_by"] != actor.name:
            raise ConflictError(f"review item {item_id} is claimed by {row['claimed_by']} until "
                                f"{_iso(row['claim_expires'])}")
        conn.execute("UPDATE review_items SET status='claimed', claimed_by=?, claimed_at=?, "
                     "claim_expires=? WHERE id=?", (actor.name, now, now + lease_seconds, item_id))
        detail: dict[str, Any] = {"lease_seconds": lease_seconds}
        if row["status"] == "claimed" and not held:
            detail["expired_claim_of"] = row["claimed_by"]
        elif held:
            detail["renewed"] = True
        _event(conn, item_id, "claimed", actor, now, detail)
        return _item(_get_row(conn, item_id), now)


def release(ws: "Workspace", actor: Actor, item_id: int) -> ReviewItem:
    """Give a claimed item back to the queue undecided; returns the item.  Only its holder
    (or an admin).  Needs ``review``."""
    authorize(ws, actor, "review")
    with ws.transaction() as conn:
        now = time.time()
        row = dict(zip(_ITEM_COLUMNS, _get_row(conn, item_id)))
        if row["status"] != "claimed":
            raise ConflictError(f"review item {item_id} is {row['status']}, not claimed")
        if row["claimed_by"] != actor.name and actor.role != "admin":
            raise ConflictError(f"review item {item_id} is claimed by {row['claimed_by']}, "
                                "not by you")
        conn.execute("UPDATE review_items SET status='pending', claimed_by=NULL, claimed_at=NULL, "
                     "claim_expires=NULL WHERE id=?", (item_id,))
        _event(conn, item_id, "released", actor, now, {"claimed_by": row["claimed_by"]})
        return _item(_get_row(conn, item_id), now)


# --------------------------------------------------------------------------- decide
def state_pattern(item: ReviewItem, *, tolerance: float = 0.1) -> dict[str, Any]:
    """The state pattern a rejection of ``item`` masks, as a core.guard.masking condition:
    ``task_type`` equal, and each key feature (given at enqueue time; default: every
    feature of the state) equal for text and booleans, within ±``tolerance`` (relative)
    for numbers — see :func:`core.guard.masking.state_pattern`."""
    state = {k: v for k, v in item.state.items() if k != "task_type"}
    keys = (sorted(state) if item.key_features is None
            else [k for k in item.key_features if k != "task_type"])
    pattern: dict[str, Any] = {}
    if item.task_type is not None:
        pattern["task_type"] = {"eq": item.task_type}
    if any(state.get(k) is not None for k in keys):
        pattern.update(masking.state_pattern(state, keys=keys, tolerance=tolerance))
    if not pattern:
        raise InputError(f"review item {item.id} has no task type and no state features to "
                         "build a mask pattern from; give the pattern explicitly", field="pattern")
    return pattern


def decide(ws: "Workspace", actor: Actor, item_id: int, decision: str, comment: str = "", *,
           pattern: Mapping[str, Any] | None = None) -> ReviewItem:
    """Decide a claimed item, exactly once; returns the decided item.  Needs ``review``.

    Only the holder of an unexpired claim may decide; a decided item, an unclaimed one,
    someone else's claim and an expired claim (claim it again) are refused with
    ConflictError.  ``reject`` needs a comment and stores a review mask rule blocking the
    item's action token when the state matches ``pattern`` (a core.guard.masking condition;
    default :func:`state_pattern`); ``approve`` makes the step a labelled "reasonable
    exploration" example.  The decision, its event and the mask rule commit together."""
    authorize(ws, actor, "review")
    if decision not in DECISIONS:
        raise InputError(f"decision must be approve or reject, not {decision!r}", field="decision")
    comment = (comment or "").strip()
    if decision == "reject" and not comment:
        raise InputError("say why the action is rejected (comment): the reason stays with the "
                         "mask rule it creates", field="comment")
    if pattern is not None and (decision != "reject" or not isinstance(pattern, Mapping)):
        raise InputError("a pattern is a mapping (a mask condition), given only to reject",
                         field="pattern")
    global _rules_added
    with ws.transaction() as conn:
        now = time.time()
        row = dict(zip(_ITEM_COLUMNS, _get_row(conn, item_id)))
        if row["status"] == "decided":
            raise ConflictError(f"review item {item_id} was already decided: {row['decision']} "
                                f"by {row['decided_by']} at {_iso(row['decided_at'])}")
        if row["status"] != "claimed" or row["claimed_by"] != actor.name:
            holder = (f"it is claimed by {row['claimed_by']}" if row["status"] == "claimed"
                      else "it is not claimed")
            raise ConflictError(f"review item {item_id}: {holder}; claim it before deciding")
        if row["claim_expires"] < now:
            raise ConflictError(f"your claim on review item {item_id} expired at "
                                f"{_iso(row['claim_expires'])}; claim it again")
        cur = conn.execute(
            "UPDATE review_items SET status='decided', decision=?, decided_by=?, decided_at=?, "
            "comment=? WHERE id=? AND status='claimed' AND claimed_by=? AND claim_expires >= ?",
            (decision, actor.name, now, comment, item_id, actor.name, now))
        if cur.rowcount != 1:  # pragma: no cover - guarded by the write lock held since BEGIN
            raise ConflictError(f"review item {item_id} changed while deciding; try again")
        _event(conn, item_id, "decided", actor, now, {"decision": decision, "comment": comment})
        item = _item(_get_row(conn, item_id), now)
        if decision == "reject":
            pat = dict(pattern) if pattern is not None else state_pattern(item)
            rule = _mask_rule(item, pat, comment, actor, now)
            conn.execute(
                """INSERT INTO mask_rules_from_reviews(item_id, dataset, task_type, pattern,
                       token_id, token_name, tool, rule, comment, created_at, created_by)
                   VALUES (?,?,?,?,?,?,?,?,?,?,?)""",
                (item_id, item.dataset, item.task_type, _json(pat), item.token_id,
                 item.token_name, item.tool, _json(rule.to_rule_data()), comment, now, actor.name))
    if decision == "reject":  # committed: engines in this process re-read the rules now
        with _rules_lock:
            _rules_added += 1
    return item


def rules_added() -> int:
    """How many review mask rules this process committed so far (a decision engine
    re-reads the rules when it changed, and otherwise checks the workspace only now and
    then for rules other processes added)."""
    return _rules_added


# --------------------------------------------------------------------------- mask rules
def _mask_rule(item: ReviewItem, pattern: Mapping[str, Any], comment: str, actor: Actor,
               now: float) -> ReviewMaskRule:
    """The review rule of one rejected item (the same shape as
    :meth:`core.guard.masking.MaskRules.add_review_rule` makes), checked by core.guard.masking."""
    token = item.token_name if item.token_name else item.token_id
    rule = ReviewMaskRule(
        name=f"review_{item.id}",
        kind="review",
        targets={"tokens": [token]},
        when=dict(pattern),
        message=f"rejected in review {item.id}: {comment}",
        meta={"review_id": str(item.id), "reviewer": actor.name,
              "created_at": _iso(now), "dataset": item.dataset},
    )
    masking.MaskRules().add_rules([rule.to_rule_data()])  # raises InputError naming what is wrong
    return rule


def review_mask_rules(ws: "Workspace", dataset: str | None = None) -> list[ReviewMaskRule]:
    """Mask rules born from rejected reviews, oldest first (:func:`with_review_rules` adds
    them to a rule set; ``MaskRules.add_rules`` reads each one's
    :meth:`~ReviewMaskRule.to_rule_data`).

    With ``dataset``: the rules of that dataset plus those queued without a dataset."""
    sql = "SELECT rule FROM mask_rules_from_reviews"
    args: tuple[Any, ...] = ()
    if dataset is not None:
        sql += " WHERE dataset=? OR dataset IS NULL"
        args = (dataset,)
    return [ReviewMaskRule(**json.loads(r[0])) for r in ws.conn.execute(sql + " ORDER BY id", args)]


def with_review_rules(rules: "masking.MaskRules", ws: "Workspace",
                      dataset: str | None = None) -> "masking.MaskRules":
    """``rules`` plus the review rules of the workspace (for training and the decision
    engine): a copy, so the caller's rules are not changed.  A review rule already in
    ``rules`` (same targets and pattern, e.g. saved into a bundle's masks.yaml) is not
    added twice."""
    out = masking.MaskRules(list(rules.rules), description=rules.description,
                            source=rules.source)
    have = {(_json(r.targets), _json(r.when)) for r in out.rules if r.kind == "review"}
    names = {r.name for r in out.rules}
    fresh = []
    for rule in review_mask_rules(ws, dataset):
        if (_json(rule.targets), _json(rule.when)) in have:
            continue
        name, n = rule.name, 1
        while name in names:  # a review of the same number from elsewhere (another workspace)
            n += 1
            name = f"{rule.name}_{n}"
        names.add(name)
        fresh.append({**rule.to_rule_data(), "name": name})
    out.add_rules(fresh)
    return out


# --------------------------------------------------------------------------- training data
def approved_examples(ws: "Workspace", dataset: str | None = None) -> list[ApprovedExample]:
    """Approved steps as labelled training examples, oldest decision first.  With
    ``dataset``: that dataset's plus those without one."""
    sql = f"{_SELECT_ITEM} WHERE decision='approve'"
    args: tuple[Any, ...] = ()
    if dataset is not None:
        sql += " AND (dataset=? OR dataset IS NULL)"
        args = (dataset,)
    out = []
    now = time.time()
    for row in ws.conn.execute(sql + " ORDER BY decided_at, id", args):
        d = _item(row, now)
        assert d.decided_by is not None and d.decided_at is not None  # decided: both are set
        out.append(ApprovedExample(
            item_id=d.id, dataset=d.dataset, task_type=d.task_type, state=d.state,
            token_id=d.token_id, token_name=d.token_name, tool=d.tool, label=EXPLORATION_LABEL,
            origin=d.origin, run_id=d.run_id, episode_id=d.episode_id, step_t=d.step_t,
            decided_by=d.decided_by, decided_at=d.decided_at))
    return out


# --------------------------------------------------------------------------- reading
def get_item(ws: "Workspace", item_id: int) -> ReviewItemDetail:
    """One item with its events (oldest first)."""
    return ReviewItemDetail(**_item_fields(_get_row(ws.conn, item_id)),
                            events=item_events(ws, item_id))


def item_events(ws: "Workspace", item_id: int) -> list[ReviewEvent]:
    """The event log of one item: enqueued, claimed, released, decided."""
    return [ReviewEvent(id=r[0], event=r[1], actor=r[2], at=_iso_text(r[3]),
                        detail=None if r[4] is None else json.loads(r[4]))
            for r in ws.conn.execute("SELECT id, event, actor, at, detail FROM review_events "
                                     "WHERE item_id=? ORDER BY id", (int(item_id),))]


def list_items(ws: "Workspace", *, status: str | None = None, origin: str | None = None,
               dataset: str | None = None, decision: str | None = None,
               claimed_by: str | None = None, limit: int = 100, offset: int = 0
               ) -> list[ReviewItem]:
    """Items, oldest first.  ``status``: pending, claimed, decided, or ``open``
    (pending or with an expired claim: what :func:`claim` would hand out).  ``claimed_by``
    with ``status="claimed"`` lists one reviewer's current claims."""
    where: list[str] = []
    args: list[str | float] = []
    if status is not None:
        if status == "open":
            where.append("(status='pending' OR (status='claimed' AND claim_expires < ?))")
            args.append(time.time())
        elif status in ("pending", "claimed", "decided"):
            where.append("status=?")
            args.append(status)
        else:
            raise InputError(f"unknown status {status!r}; use pending, claimed, decided or open",
                             field="status")
    for col, val in (("origin", origin), ("dataset", dataset), ("decision", decision),
                     ("claimed_by", claimed_by)):
        if val is not None:
            where.append(f"{col}=?")
            args.append(val)
    sql = _SELECT_ITEM + (" WHERE " + " AND ".join(where) if where else "")
    now = time.time()
    rows = ws.conn.execute(sql + " ORDER BY id LIMIT ? OFFSET ?", [*args, int(limit), int(offset)])
    return [_item(r, now) for r in rows]


@dataclass(frozen=True)
class ReviewQueueStats:
    """The review queue in numbers (:func:`stats`)."""

    pending: int
    #: Claims whose lease still runs
    claimed: int
    #: Claims whose lease ran out: claimable again
    expired_claims: int
    decided: int
    approved: int
    rejected: int
    #: approved / decided; None before any decision
    approve_rate: float | None
    #: Age in seconds of the oldest open item (pending or expired claim); None when none is open
    oldest_pending_age_s: float | None

    @property
    def open(self) -> int:
        """Items still to be decided: pending, claimed or with an expired claim."""
        return self.pending + self.claimed + self.expired_claims


def stats(ws: "Workspace", dataset: str | None = None) -> ReviewQueueStats:
    """Queue statistics of the workspace (of one ``dataset``'s items when given)."""
    now = time.time()
    where, args = ("WHERE dataset=?", [dataset]) if dataset is not None else ("", [])
    row = ws.conn.execute(
        f"""SELECT
              COALESCE(SUM(status='pending'), 0),
              COALESCE(SUM(status='claimed' AND claim_expires >= ?), 0),
              COALESCE(SUM(status='claimed' AND claim_expires < ?), 0),
              COALESCE(SUM(status='decided'), 0),
              COALESCE(SUM(decision='approve'), 0),
              COALESCE(SUM(decision='reject'), 0),
              MIN(CASE WHEN status='pending' OR (status='claimed' AND claim_expires < ?)
                       THEN created_at END)
            FROM review_items {where}""", [now, now, now, *args]).fetchone()
    pending, claimed, expired, decided, approved, rejected, oldest = row
    return ReviewQueueStats(
        pending=int(pending), claimed=int(claimed), expired_claims=int(expired), decided=int(decided),
        approved=int(approved), rejected=int(rejected),
        approve_rate=None if decided == 0 else approved / decided,
        oldest_pending_age_s=None if oldest is None else round(now - oldest, 3))


# --------------------------------------------------------------------------- why an item is here
#: How many decided items :func:`similar_decisions` reads at most (the newest first).
SIMILAR_SCAN = 2000
_BELOW = re.compile(r"\(below ([0-9]*\.?[0-9]+)\)")
_IN_A_ROW = re.compile(r"(\d+) times in a row")
_FINAL_REWARD = re.compile(r"final reward (-?[0-9]*\.?[0-9]+)")


@dataclass(frozen=True)
class FlagRule:
    """The rule that put an item on the queue, in a reviewer's words (:func:`flag_rule`)."""

    #: Stable key, the same for every item the rule flags: "low_confidence_high_risk"
    #: (serving), "repeated_high_risk" (training, curriculum L3), "high_risk_in_failed_episode"
    #: (the sample workspace's set-up), "sent_by_person" (a step sent from Episodes) or
    #: "queued" (any other producer: its reason says why).
    name: str
    #: A plain title: "Risky action served with low confidence".
    title: str
    #: One or two sentences: what the rule checks, the value that tripped it and its threshold.
    why: str
    #: What the rule measures, in words ("the policy's confidence"); None for a person's send.
    measure: str | None
    #: The value that tripped the rule and the threshold it is compared with (None: not recorded).
    value: float | None
    threshold: float | None
    #: The risk level of the action (from the tool's schema) that made the rule look at it.
    risk: str | None
    #: The unit of ``value`` and ``threshold``: "share" (a fraction of 1), "times", or None.
    unit: str | None = None


def _number_in(pattern: re.Pattern[str], text: str) -> float | None:
    found = pattern.search(text)
    return None if found is None else float(found.group(1))


def _rule_name(item: ReviewItem) -> str:
    if item.origin == "serving":
        return "low_confidence_high_risk"
    if item.run_id is not None:
        return "repeated_high_risk"
    if "sent_by" in item.meta:
        return "sent_by_person"
    if "picked_by" in item.meta:
        return "high_risk_in_failed_episode"
    return "queued"


def flag_rule(item: ReviewItem, *, repeat_threshold: int | None = None,
              resolved: bool | None = None, final_reward: float | None = None) -> FlagRule:
    """Why ``item`` is on the queue: the rule, its threshold and the value that tripped it.

    The item's origin names the rule (see :attr:`FlagRule.name`); its numbers come from the
    item (confidence, the reason its producer wrote, ``meta``) and from what the caller knows
    besides: ``repeat_threshold`` (the training run's ``high_risk_repeat``), ``resolved`` and
    ``final_reward`` (the recorded episode's outcome)."""
    name = _rule_name(item)
    action = item.action_label or item.token_name or f"token {item.token_id}"
    risk = item.risk
    risky = f"a {risk}-risk action" if risk else "an action"
    if name == "low_confidence_high_risk":
        threshold = item.meta.get("review_confidence")
        if not isinstance(threshold, (int, float)):
            threshold = _number_in(_BELOW, item.reason)
        conf = item.confidence
        sure = "an unknown confidence" if conf is None else f"{conf:.0%} confidence"
        limit = ("a threshold that was not recorded" if threshold is None
                 else f"below {float(threshold):.0%}")
        return FlagRule(
            name=name, title="Risky action served with low confidence",
            why=(f"The policy chose {action}, {risky}, with {sure}. Risky actions served with "
                 f"confidence {limit} go to a person before they count."),
            measure="the policy's confidence in its choice", value=conf,
            threshold=None if threshold is None else float(threshold), risk=risk, unit="share")
    if name == "repeated_high_risk":
        repeats = _number_in(_IN_A_ROW, item.reason)
        value = repeats if repeats is not None else 1.0
        need = ("" if repeat_threshold is None
                else " Every such action goes to a person." if repeat_threshold == 1
                else f" {repeat_threshold} times in a row sends it to a person.")
        update = item.meta.get("update")
        when = f" (training update {update})" if isinstance(update, int) else ""
        return FlagRule(
            name=name, title="Risky action repeated while training",
            why=(f"While training{when} the policy took {action}, {risky},"
                 + (" once" if value == 1 else f" {int(value)} times in a row") + f".{need}").strip(),
            measure="times in a row the policy took the same risky action", value=value,
            threshold=None if repeat_threshold is None else float(repeat_threshold), risk=risk, unit="times")
    if name == "sent_by_person":
        who = str(item.meta.get("sent_by") or item.created_by)
        return FlagRule(
            name=name, title=f"Sent to review by {who}",
            why=f"{who} sent this step of a recorded conversation to review: “{item.reason}”",
            measure=None, value=None, threshold=None, risk=risk)
    if name == "queued":
        return FlagRule(name=name, title=f"Queued by {item.created_by}", why=item.reason,
                        measure=None, value=None, threshold=None, risk=risk)
    reward = final_reward if final_reward is not None else _number_in(_FINAL_REWARD, item.reason)
    failed = ("failed" if resolved is False or resolved is None
              else "was marked resolved")
    outcome = "" if reward is None else f" with a final reward of {reward:.2f}"
    return FlagRule(
        name=name, title="Risky action in a conversation that failed",
        why=(f"{action} is {risky} (its tool's schema says so), taken in a recorded conversation "
             f"that {failed}{outcome}. The sample workspace puts such steps on the queue so that "
             "a person checks them."),
        measure="the conversation's final reward", value=reward, threshold=None, risk=risk)


@dataclass(frozen=True)
class SimilarDecision:
    """One decided item like another (:func:`similar_decisions`)."""

    item_id: int
    #: "approve" or "reject".
    decision: str
    decided_by: str
    decided_at: str
    #: The reviewer's note (may be empty).
    comment: str
    action: str


@dataclass(frozen=True)
class SimilarDecisions:
    """How the decided items sharing one trait with an item were decided."""

    #: "tool" or "rule".
    by: str
    #: What they share, in words: "the tool return_order", "the rule “Risky action …”".
    basis: str
    approved: int
    rejected: int
    #: The newest few, newest first.
    last: list[SimilarDecision]

    @property
    def decided(self) -> int:
        return self.approved + self.rejected


def similar_decisions(ws: "Workspace", item: ReviewItem, *, last: int = 3) -> list[SimilarDecisions]:
    """How items like ``item`` were decided: those with the same tool (the same action
    token when it has no tool) and those flagged by the same rule (:func:`flag_rule`), of
    the same dataset when it has one; ``item`` itself is left out.  Counts cover the newest
    :data:`SIMILAR_SCAN` decisions; ``last`` newest of each group come with their notes."""
    where = ["status='decided'", "id<>?"]
    args: list[Any] = [item.id]
    if item.dataset is not None:
        where.append("dataset=?")
        args.append(item.dataset)
    rows = ws.conn.execute(f"{_SELECT_ITEM} WHERE {' AND '.join(where)} "
                           "ORDER BY decided_at DESC, id DESC LIMIT ?", [*args, SIMILAR_SCAN])
    decided = [_item(r) for r in rows]
    if item.tool is not None:
        same_tool = [d for d in decided if d.tool == item.tool]
        tool_basis = f"the tool {item.tool}"
    else:
        same_tool = [d for d in decided if d.token_id == item.token_id]
        tool_basis = f"the action {item.action_label or item.token_name or item.token_id}"
    rule = _rule_name(item)
    same_rule = [d for d in decided if _rule_name(d) == rule]
    title = flag_rule(item).title
    out = []
    for by, basis, group in (("tool", tool_basis, same_tool), ("rule", f"the rule “{title}”", same_rule)):
        out.append(SimilarDecisions(
            by=by, basis=basis, approved=sum(d.decision == "approve" for d in group),
            rejected=sum(d.decision == "reject" for d in group),
            last=[SimilarDecision(item_id=d.id, decision=str(d.decision), decided_by=str(d.decided_by),
                                  decided_at=str(d.decided_at), comment=d.comment or "",
                                  action=d.action_label or d.token_name or str(d.token_id))
                  for d in group[:max(int(last), 0)]]))
    return out


def _number_text(v: Any) -> str:
    x = float(v)
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.4g}"


def _atom_text(feature: str, test: Mapping[str, Any]) -> str:
    name = "task type" if feature == "task_type" else feature.replace("_", " ")
    op, value = next(iter(test.items()))
    words = {"eq": "is", "ne": "is not", "gt": ">", "lt": "<", "ge": "≥", "le": "≤",
             "in": "is one of", "not_in": "is none of"}
    if op in ("between", "outside") and isinstance(value, (list, tuple)) and len(value) == 2:
        lo, hi = (_number_text(v) for v in value)
        if op == "between" and lo == hi:
            return f"{name} is {lo}"
        return f"{name} {'between' if op == 'between' else 'outside'} {lo} and {hi}"
    shown = value
    if isinstance(value, bool):
        shown = "yes" if value else "no"
    elif isinstance(value, (int, float)):
        shown = _number_text(value)
    return f"{name} {words.get(op, op)} {shown}"


def pattern_text(pattern: Mapping[str, Any]) -> str:
    """A mask condition of one test per feature (what :func:`state_pattern` makes) in words:
    ``task type is exchange_item, hour between 18.9 and 23.1``; other shapes as JSON."""
    if all(isinstance(k, str) and k not in ("all", "any", "not") and isinstance(v, Mapping)
           and len(v) == 1 for k, v in pattern.items()):
        return ", ".join(_atom_text(k, v) for k, v in pattern.items())
    return _json(pattern)
