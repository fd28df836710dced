"""The audit trail: one append-only record per served decision (docs/design.md §9, S000 §2.2).

Records live in the workspace table ``audit``, made append-only by SQLite triggers; a row may
keep the request and the decoded action beside the record, so :func:`export` with
``as_episodes=True`` turns production traffic back into episodes.  :class:`AuditWriter` writes
records (synchronously, or in batches committed by size, age, ``flush()``, ``close()`` and at
exit), :func:`recover_unflushed` re-inserts records a failed final commit left on disk,
:func:`tail` reads the latest, and :func:`security_event` appends to the security log.

Details: docs/security.md (## The audit trail, ## Audit durability).
"""

from __future__ import annotations

import atexit
import hashlib
import itertools
import json
import os
import sqlite3
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from core.records.episodes import Action, ActionKind, Episode, Outcome, Source, Step, Task
from core.base.errors import ConflictError, InputError, RwbError
from core.access import security_log
from core.access.users import Actor, authorize
from core.records.catalog import OTHER, UNSET

if TYPE_CHECKING:  # pragma: no cover
    from core.records.store import Workspace

#: Record keys in the order they are written and exported.
RECORD_KEYS: tuple[str, ...] = ("timestamp", "input_hash", "rde_action", "rl_candidates",
                                "final_action", "reward_components", "policy_version",
                                "episode_id", "decision_id")
UNFLUSHED_DIR = "audit_unflushed"
_COLUMNS = ("decision_id", "timestamp", "episode_id", "policy_version", "input_hash",
            "final_action", "record", "request", "action", "written_by")


class AuditUnavailable(RwbError):
    """The audit trail cannot be written (so the decision must not be served)."""


# --------------------------------------------------------------------------- the record
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Candidate(_Strict):
    """One RL-Boost candidate: action token, its probability, its reward estimate."""

    id: int | str
    prob: float = Field(ge=0.0, le=1.0, allow_inf_nan=False)
    reward_est: float = Field(allow_inf_nan=False)


class RewardComponent(_Strict):
    """One reward component's value for the served action."""

    name: str = Field(min_length=1)
    value: float = Field(allow_inf_nan=False)


def _utc_iso(dt: datetime) -> str:
    # Fixed width with microseconds, so text order is time order in SQL.
    return dt.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def normalize_timestamp(value: str) -> str:
    """An ISO-8601 time with a zone, as a fixed-width UTC audit timestamp (ValueError if not)."""
    try:
        dt = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError as exc:
        raise ValueError(f"not an ISO-8601 time: {value!r}") from exc
    if dt.tzinfo is None:
        raise ValueError(f"time {value!r} has no time zone; use UTC ('…Z')")
    return _utc_iso(dt)


def now_iso() -> str:
    """The current UTC time as an audit timestamp."""
    return _utc_iso(datetime.now(timezone.utc))


class AuditRecord(_Strict):
    """One decision, exactly the seed's schema plus policy_version, episode_id, decision_id
    (what :func:`list_records` and :func:`tail` read back; frozen, like its parts)."""

    timestamp: str
    input_hash: str = Field(min_length=1, max_length=128)
    rde_action: int | str | None = None
    rl_candidates: list[Candidate] = Field(default_factory=list)
    final_action: int | str
    reward_components: list[RewardComponent] = Field(default_factory=list)
    policy_version: str | None = None
    episode_id: str | None = Field(default=None, max_length=512)
    decision_id: str = Field(min_length=1, max_length=128)

    @field_validator("timestamp")
    @classmethod
    def _iso_utc(cls, v: str) -> str:
        return normalize_timestamp(v)

    def to_dict(self) -> dict[str, Any]:
        """The record as a plain dict with keys in :data:`RECORD_KEYS` order."""
        d = self.model_dump(mode="json")
        return {k: d[k] for k in RECORD_KEYS}


def _canonical(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, sort_keys=True, separators=(",", ":"),
                      allow_nan=False)


def _request_json(request: Any) -> str:
    """The request's canonical JSON: what ``input_hash`` hashes and the trail keeps."""
    try:
        return _canonical(request)
    except (TypeError, ValueError) as exc:
        raise InputError(f"the request is not plain JSON: {exc}", field="request") from exc


def input_hash(request: Any) -> str:
    """sha256 of the request's canonical JSON (sorted keys, no spaces)."""
    return hashlib.sha256(_request_json(request).encode()).hexdigest()


_TYPE_TAGS = frozenset({"int", "str", "float", "bool", "none", "list", "dict"})


def make_record(record: Mapping[str, Any] | AuditRecord, *, request: Any = None) -> AuditRecord:
    """Validate one record, filling ``timestamp`` (now), ``decision_id`` (a fresh uuid)
    and ``input_hash`` (from ``request``) when missing.  A given ``input_hash`` must match
    the request's."""
    return _make_record(record, None if request is None else _request_json(request))


def _make_record(record: Mapping[str, Any] | AuditRecord, request_json: str | None) -> AuditRecord:
    """:func:`make_record` with the request already in canonical JSON (a writer needs the
    text for the row too: serialised once)."""
    if isinstance(record, AuditRecord):
        data = record.model_dump()
    elif isinstance(record, Mapping):
        data = dict(record)
    else:
        raise InputError(f"an audit record must be a mapping, not {type(record).__name__}")
    if "timestamp" not in data:
        data["timestamp"] = now_iso()
    if "decision_id" not in data:  # (not setdefault: a uuid costs a system call)
        data["decision_id"] = uuid.uuid4().hex
    if request_json is not None:
        computed = hashlib.sha256(request_json.encode()).hexdigest()
        if data.get("input_hash") is None:
            data["input_hash"] = computed
        elif data["input_hash"] != computed:
            raise InputError("input_hash does not match the sha256 of the request's canonical "
                             "JSON (core.access.audit.input_hash)", field="input_hash")
    try:
        return AuditRecord.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        # Union members show up in the location ("final_action", "int"): keep the path only.
        where = ".".join(str(p) for p in err["loc"]
                         if not (isinstance(p, str) and (p in _TYPE_TAGS or "[" in p)))
        raise InputError(f"invalid audit record: {err['msg']}", field=where or None) from exc


def _row(record: AuditRecord, request_json: str | None, action: Action | Mapping[str, Any] | None,
         written_by: str) -> tuple[Any, ...]:
    if action is not None and not isinstance(action, Action):
        try:
            action = Action.model_validate(action)
        except ValidationError as exc:
            raise InputError(f"invalid action: {exc.errors()[0]['msg']}", field="action") from exc
    d = record.to_dict()
    return (record.decision_id, record.timestamp, record.episode_id, record.policy_version,
            record.input_hash, _canonical(record.final_action),
            # Keys in RECORD_KEYS order (not sorted): the stored text is what tail/export print.
            json.dumps(d, ensure_ascii=False, separators=(",", ":"), allow_nan=False),
            request_json, None if action is None else action.model_dump_json(), written_by)


_INSERT = f"INSERT INTO audit({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})"


def _connect(ws: "Workspace", *, synchronous: bool, busy_timeout_s: float
             ) -> sqlite3.Connection:
    from core.records.store import DB_NAME  # deferred: loads pandas

    conn = sqlite3.connect(ws.root / DB_NAME, timeout=busy_timeout_s, isolation_level=None,
                           check_same_thread=False)
    conn.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
    conn.execute(f"PRAGMA synchronous={'FULL' if synchronous else 'NORMAL'}")
    return conn


def _insert_rows(conn: sqlite3.Connection, rows: Sequence[tuple[Any, ...]]
                 ) -> list[tuple[Any, ...]]:
    """Insert rows inside the caller's transaction; returns the rows whose decision_id is
    already recorded with *different* content (the same content is an idempotent retry)."""
    try:
        conn.executemany(_INSERT, rows)
        return []
    except sqlite3.IntegrityError:
        pass  # some decision_id is already there: sort the rows out one by one
    conflicts = []
    for row in rows:
        try:
            conn.execute(_INSERT, row)
        except sqlite3.IntegrityError:
            have = conn.execute("SELECT record FROM audit WHERE decision_id=?",
                                (row[0],)).fetchone()
            if have is None or have[0] != row[6]:
                conflicts.append(row)
    return conflicts


def _spill(ws: "Workspace", rows: Sequence[tuple[Any, ...]], why: str) -> Path:
    """Write rows that could not be committed to artifacts/audit_unflushed/ (temp + rename)."""
    folder = ws.artifact_dir(UNFLUSHED_DIR)
    path = folder / f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-{uuid.uuid4().hex[:8]}.jsonl"
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(_canonical({**dict(zip(_COLUMNS, row)), "why": why}) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


# --------------------------------------------------------------------------- the writer
_LIVE_WRITERS: "weakref.WeakSet[AuditWriter]" = weakref.WeakSet()


@atexit.register
def _close_all_at_exit() -> None:
    for writer in list(_LIVE_WRITERS):
        writer._close_at_exit()


class AuditWriter:
    """Appends audit records with batched commits.  Thread-safe; one per process.

    ``batch_size`` records or ``flush_interval_s`` seconds trigger a commit by a background
    thread; ``synchronous=True`` commits inside every ``write()``; ``max_pending`` bounds
    the backlog when commits keep failing (then ``write()`` refuses); ``busy_timeout_s`` is
    how long a commit waits for another writer's lock.  docs/security.md (## Audit durability)
    says exactly when an accepted record is durable."""

    def __init__(self, ws: "Workspace", actor: Actor, *, batch_size: int = 256,
                 flush_interval_s: float = 0.5, synchronous: bool = False,
                 max_pending: int = 100_000, busy_timeout_s: float = 30.0):
        authorize(ws, actor, "write_audit")
        if batch_size < 1 or flush_interval_s <= 0 or max_pending < batch_size:
            raise InputError("batch_size ≥ 1, flush_interval_s > 0 and max_pending ≥ batch_size")
        self.ws = ws
        self.actor = actor
        self.batch_size = batch_size
        self.flush_interval_s = flush_interval_s
        self.synchronous = synchronous
        self.max_pending = max_pending
        self._pid = os.getpid()
        self._conn = _connect(ws, synchronous=synchronous, busy_timeout_s=busy_timeout_s)
        self._conn_lock = threading.Lock()   # one commit at a time on our connection
        self._buf_lock = threading.Lock()    # guards _pending; held only for list operations
        self._pending: list[tuple[Any, ...]] = []
        self._oldest: float | None = None    # monotonic time of the oldest pending record
        self._wake = threading.Event()
        self._closed = False
        self.last_error: BaseException | None = None
        self.committed = 0
        self._thread: threading.Thread | None = None
        _LIVE_WRITERS.add(self)

    # ---------------------------------------------------------------- writing
    def write(self, record: Mapping[str, Any] | AuditRecord, *, request: Any = None,
              action: Action | Mapping[str, Any] | None = None) -> str:
        """Accept one record (see :func:`make_record`); returns its ``decision_id``.

        ``request`` (the served input, JSON) and ``action`` (the decoded final action) are
        kept next to the record for :func:`export` ``as_episodes``.  Raises InputError for
        an invalid record and :class:`AuditUnavailable` when the trail cannot take it;
        in both cases nothing was accepted."""
        request_json = None if request is None else _request_json(request)
        rec = _make_record(record, request_json)
        self._accept([_row(rec, request_json, action, self.actor.name)])
        return rec.decision_id

    def write_many(self, records: Sequence[Mapping[str, Any] | AuditRecord]) -> list[str]:
        """Accept several records (no requests/actions attached); all or none are accepted."""
        recs = [make_record(r) for r in records]
        self._accept([_row(r, None, None, self.actor.name) for r in recs])
        return [r.decision_id for r in recs]

    def write_batch(self, items: Sequence[tuple[Mapping[str, Any] | AuditRecord, Any,
                                                Action | Mapping[str, Any] | None]]) -> list[str]:
        """Accept several ``(record, request, action)`` (as :meth:`write` takes them), all or
        none: every row is built and validated before any is accepted, and they are
        committed in one transaction (in the same background commit, or at once when
        ``synchronous``).  What a batch of decisions is audited with."""
        rows, ids = [], []
        for record, request, action in items:
            request_json = None if request is None else _request_json(request)
            rec = _make_record(record, request_json)
            rows.append(_row(rec, request_json, action, self.actor.name))
            ids.append(rec.decision_id)
        if rows:
            self._accept(rows)
        return ids

    def _accept(self, rows: list[tuple[Any, ...]]) -> None:
        if self.synchronous:
            with self._conn_lock:
                if self._closed:
                    raise AuditUnavailable("this audit writer is closed")
                self._commit_locked(rows)
            return
        with self._buf_lock:
            full = len(self._pending) >= self.max_pending
        if full:
            # Backpressure: the background commits keep failing.  Try once here and refuse
            # the records rather than hold an unbounded backlog.
            try:
                self.flush()
            except Exception as exc:
                raise AuditUnavailable(f"the audit trail cannot be written ({exc}); "
                                       f"{self.pending} records are waiting") from exc
        with self._buf_lock:
            # Checked under the lock that close() takes to set it: nothing is appended
            # after close() has taken its last batch.
            if self._closed:
                raise AuditUnavailable("this audit writer is closed")
            self._pending.extend(rows)
            if self._oldest is None:
                self._oldest = time.monotonic()
            n = len(self._pending)
        if self._thread is None:
            self._start_thread()
        if n >= self.batch_size:
            self._wake.set()

    @property
    def pending(self) -> int:
        """Records accepted but not yet committed."""
        with self._buf_lock:
            return len(self._pending)

    # ---------------------------------------------------------------- committing
    def _commit_locked(self, rows: list[tuple[Any, ...]]) -> None:
        """Commit rows in one transaction (caller holds ``_conn_lock``; raises on failure,
        nothing half-written)."""
        conn = self._conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            conflicts = _insert_rows(conn, rows)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        self.committed += len(rows) - len(conflicts)
        if conflicts:
            # Same decision_id, different content: never overwrite the trail, never drop ours.
            path = _spill(self.ws, conflicts, "decision_id already recorded with other content")
            raise ConflictError(f"{len(conflicts)} audit record(s) reuse a recorded decision_id "
                                f"with different content; kept in {path}")

    def flush(self) -> int:
        """Commit every record accepted so far; returns how many this call committed.

        When it returns, every record accepted before the call is committed (a batch a
        concurrent flush is committing is waited for).  On failure the records stay
        pending (a later flush retries them) and the error is raised."""
        if os.getpid() != self._pid:
            return 0  # a forked child: these records belong to the parent
        # Holding the connection lock from the swap to the commit serialises flushes, so a
        # flush never returns while an earlier batch is still on its way.
        with self._conn_lock:
            with self._buf_lock:
                batch, self._pending, self._oldest = self._pending, [], None
            if not batch:
                return 0
            try:
                self._commit_locked(batch)
            except ConflictError as exc:  # the rest is committed; the conflicts are spilled
                self.last_error = exc
                raise
            except BaseException as exc:
                with self._buf_lock:
                    # Put the batch back in front: order is kept and nothing is lost.
                    self._pending[:0] = batch
                    self._oldest = time.monotonic()
                self.last_error = exc
                raise
        return len(batch)

    def _start_thread(self) -> None:
        with self._buf_lock:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name="rwb-audit-writer",
                                            daemon=True)
        self._thread.start()

    def _run(self) -> None:
        """Background commits: on a full batch, or when the oldest record waited long enough."""
        while not self._closed:
            self._wake.wait(self.flush_interval_s / 2)
            self._wake.clear()
            with self._buf_lock:
                n, oldest = len(self._pending), self._oldest
            due = oldest is not None and time.monotonic() - oldest >= self.flush_interval_s
            if n and (n >= self.batch_size or due):
                try:
                    self.flush()
                except Exception:  # kept in last_error; flush()/close() raise it to the caller
                    time.sleep(min(self.flush_interval_s, 1.0))

    # ---------------------------------------------------------------- closing
    def close(self) -> None:
        """Commit everything pending and stop.  Raises (and keeps the records pending, to be
        retried by another close() or at exit) when the commit fails."""
        if os.getpid() != self._pid:
            return
        with self._buf_lock:
            self._closed = True
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=60)
        self.flush()
        _LIVE_WRITERS.discard(self)
        with self._conn_lock:
            self._conn.close()

    def _close_at_exit(self) -> None:
        if os.getpid() != self._pid:
            return
        try:
            self.close()
        except Exception as exc:
            with self._buf_lock:
                rows, self._pending = self._pending, []
            if rows:
                path = _spill(self.ws, rows, f"commit failed at exit: {exc}")
                sys.stderr.write(f"rwb audit: {len(rows)} record(s) could not be committed "
                                 f"({exc}); kept in {path} — run `rwb audit recover`\n")

    def __enter__(self) -> "AuditWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def write_record(ws: "Workspace", actor: Actor, record: Mapping[str, Any] | AuditRecord, *,
                 request: Any = None, action: Action | Mapping[str, Any] | None = None) -> str:
    """Append one record and commit it before returning (no writer to manage)."""
    authorize(ws, actor, "write_audit")
    request_json = None if request is None else _request_json(request)
    rec = _make_record(record, request_json)
    row = _row(rec, request_json, action, actor.name)
    with ws.transaction() as conn:
        conflicts = _insert_rows(conn, [row])
    if conflicts:
        raise ConflictError(f"decision {rec.decision_id!r} is already recorded with other content")
    return rec.decision_id


def recover_unflushed(ws: "Workspace", actor: Actor) -> dict[str, int]:
    """Re-insert records spilled to ``artifacts/audit_unflushed/`` by a failed commit.

    Records already recorded identically are skipped; a file is removed once all its
    records are in; files with conflicting records stay and are counted."""
    authorize(ws, actor, "write_audit")
    folder = ws.artifacts / UNFLUSHED_DIR
    out = {"files": 0, "inserted": 0, "already": 0, "conflicts": 0}
    if not folder.exists():
        return out
    for path in sorted(folder.glob("*.jsonl")):
        rows = []
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                try:
                    d = json.loads(line)
                    rows.append(tuple(d[c] for c in _COLUMNS))
                except (ValueError, KeyError) as exc:
                    raise InputError(f"unreadable spilled audit record: {exc}", file=str(path),
                                     line=n) from exc
        with ws.transaction() as conn:
            before = conn.execute("SELECT COUNT(*) FROM audit").fetchone()[0]
            conflicts = _insert_rows(conn, rows)
            inserted = conn.execute("SELECT COUNT(*) FROM audit").fetchone()[0] - before
        out["files"] += 1
        out["inserted"] += inserted
        out["already"] += len(rows) - inserted - len(conflicts)
        out["conflicts"] += len(conflicts)
        if not conflicts:
            path.unlink()
    return out


# --------------------------------------------------------------------------- reading
def _filters(episode_id: str | None, policy_version: str | None, since: str | None,
             until: str | None, final_action: int | str | None) -> tuple[str, list[Any]]:
    where, args = [], []
    if episode_id is not None:
        where.append("episode_id = ?")
        args.append(episode_id)
    if policy_version is not None:
        where.append("policy_version = ?")
        args.append(policy_version)
    if since is not None:
        where.append("timestamp >= ?")
        args.append(since)
    if until is not None:
        where.append("timestamp < ?")
        args.append(until)
    if final_action is not None:
        where.append("final_action = ?")
        args.append(_canonical(final_action))
    return (" WHERE " + " AND ".join(where)) if where else "", args


def _parse_time(value: str | None, name: str) -> str | None:
    if value is None:
        return None
    try:
        return normalize_timestamp(value)
    except ValueError as exc:
        raise InputError(str(exc), field=name) from exc


def list_records(ws: "Workspace", *, episode_id: str | None = None,
                 policy_version: str | None = None, since: str | None = None,
                 until: str | None = None, final_action: int | str | None = None,
                 limit: int = 100, offset: int = 0, newest_first: bool = True
                 ) -> list[AuditRecord]:
    """Audit records matching the filters (``since`` ≤ timestamp < ``until``)."""
    since, until = _parse_time(since, "since"), _parse_time(until, "until")
    where, args = _filters(episode_id, policy_version, since, until, final_action)
    order = "DESC" if newest_first else "ASC"
    rows = ws.conn.execute(f"SELECT record FROM audit{where} ORDER BY timestamp {order}, "
                           f"seq {order} LIMIT ? OFFSET ?", [*args, int(limit), int(offset)])
    return [AuditRecord.model_validate_json(r[0]) for r in rows]


def tail(ws: "Workspace", n: int = 20, *, episode_id: str | None = None,
         policy_version: str | None = None) -> list[AuditRecord]:
    """The last ``n`` records (by timestamp), oldest first."""
    return list(reversed(list_records(ws, episode_id=episode_id, policy_version=policy_version,
                                      limit=n)))


@dataclass(frozen=True)
class AuditStats:
    """The audit trail in numbers (:func:`stats`)."""

    records: int
    #: Distinct episodes the records belong to
    episodes: int
    #: Timestamp (ISO 8601, UTC) of the first and the last record; None while the trail is empty
    first: str | None
    last: str | None
    #: Records per policy version, most first ("none" for records without one)
    per_policy_version: dict[str, int]


def stats(ws: "Workspace") -> AuditStats:
    """Counts for a dashboard: records, episodes, first/last time, records per policy version."""
    n, n_eps, first, last = ws.conn.execute(
        "SELECT COUNT(*), COUNT(DISTINCT episode_id), MIN(timestamp), MAX(timestamp) "
        "FROM audit").fetchone()
    per_policy = {(v if v is not None else "none"): c for v, c in ws.conn.execute(
        "SELECT policy_version, COUNT(*) FROM audit GROUP BY policy_version ORDER BY 2 DESC")}
    return AuditStats(records=int(n), episodes=int(n_eps), first=first, last=last, per_policy_version=per_policy)


# --------------------------------------------------------------------------- export
@dataclass
class ExportResult:
    path: str
    records: int
    episodes: int
    as_episodes: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def token_action(catalog: Any, token: int | str) -> Action:
    """Decode an action token (id or name) with a ``core.records.catalog.Catalog``.

    A token names a tool and a parameter *preset*; only parameters the preset pins to one
    value become call arguments (a bucket, ``<other>`` or ``<unset>`` preset is no value).
    Writers that know the real call pass it as ``action=`` instead."""
    try:
        found = catalog.token(token)
    except (IndexError, KeyError, InputError):
        found = None
    if found is None or (isinstance(token, int) and found.id != token):
        raise InputError(f"action token {token!r} is not in the catalog "
                         f"(version {getattr(catalog, 'version', '?')})", field="final_action")
    kind: ActionKind = "final_answer" if found.kind == "terminate" else found.kind
    if kind != "tool_call":
        return Action(kind=kind)
    pinned = {d.param for d in catalog.dims(found.tool) if d.kind == "values"}
    params = {k: v for k, v in found.preset.items() if k in pinned and v not in (OTHER, UNSET)}
    return Action(kind="tool_call", tool=found.tool, params=params)


def _observation(request: Any) -> dict[str, Any] | None:
    if not isinstance(request, Mapping):
        return None
    obs = {k: request[k] for k in ("state", "messages") if k in request}
    return obs or None


def _episode(key: str, rows: list[tuple[str, str | None, str | None]], catalog: Any,
             domain: str | None) -> Episode:
    steps, served = [], []
    first_request: Mapping[str, Any] = {}
    for t, (record_json, request_json, action_json) in enumerate(rows):
        record = json.loads(record_json)
        request = json.loads(request_json) if request_json else None
        if t == 0 and isinstance(request, Mapping):
            first_request = request
        if action_json:
            action = Action.model_validate_json(action_json)
        elif catalog is not None:
            action = token_action(catalog, record["final_action"])
        else:
            raise InputError(f"decision {record['decision_id']} has no decoded action; give the "
                             "policy's catalog to decode action tokens (--catalog catalog.json)",
                             field="final_action")
        steps.append(Step(t=t, observation=_observation(request), action=action,
                          timestamp=record["timestamp"]))
        served.append(record)
    raw_state = first_request.get("state")
    state: Mapping[str, Any] = raw_state if isinstance(raw_state, Mapping) else {}
    task_type = first_request.get("task_type") or state.get("task_type")
    versions = sorted({r["policy_version"] for r in served if r["policy_version"] is not None})
    return Episode(
        episode_id=key,
        domain=str(first_request.get("domain") or domain or "serving"),
        task=Task(query=str(first_request.get("query") or ""),
                  task_type=None if task_type is None else str(task_type)),
        steps=steps,
        outcome=Outcome(),
        source=Source(format="rwb-audit"),
        behaviour=versions[0] if len(versions) == 1 else None,
        # One audit record per step (index = step t): reward components, candidates, hashes.
        meta={"audit": served, "policy_versions": versions},
    )


def served_episodes(ws: "Workspace", *, episode_id: str | None = None,
                    policy_version: str | None = None, since: str | None = None,
                    until: str | None = None, catalog: Any = None,
                    domain: str | None = None) -> Iterator[Episode]:
    """Served episodes rebuilt from the trail: records grouped by episode_id (a record
    without one is an episode of its own), steps in time order, episodes by start time."""
    since, until = _parse_time(since, "since"), _parse_time(until, "until")
    where, args = _filters(episode_id, policy_version, since, until, None)
    # One sorted pass: episodes by their first timestamp, then steps by time.
    rows = ws.conn.execute(
        f"""SELECT COALESCE(episode_id, decision_id) AS ep,
                   MIN(timestamp) OVER (PARTITION BY COALESCE(episode_id, decision_id)) AS start,
                   record, request, action
            FROM audit{where} ORDER BY start, ep, timestamp, seq""", args)
    for key, group in itertools.groupby(rows, key=lambda r: r[0]):
        yield _episode(key, [(r[2], r[3], r[4]) for r in group], catalog, domain)


def export(ws: "Workspace", actor: Actor, out: str | Path, *, as_episodes: bool = False,
           episode_id: str | None = None, policy_version: str | None = None,
           since: str | None = None, until: str | None = None, catalog: Any = None,
           domain: str | None = None) -> ExportResult:
    """Write the trail to ``out`` (JSONL; temp file then rename).  Needs ``export_audit``.

    Default: one audit record per line, in time order.  ``as_episodes``: the workbench's
    rwb JSONL (one :class:`~core.records.episodes.Episode` per line, see :func:`served_episodes`)
    ready for ``rwb import``; a ``catalog`` decodes action tokens of records written
    without an action, and adds an ``rwb_header`` with its tools."""
    authorize(ws, actor, "export_audit")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    n_records = n_episodes = 0
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            if as_episodes:
                if catalog is not None:
                    tools = [t.model_dump(mode="json") for t in catalog.tools.values()]
                    f.write(_canonical({"rwb_header": {"version": 1, "domain": domain,
                                                       "tools": tools}}) + "\n")
                for ep in served_episodes(ws, episode_id=episode_id,
                                          policy_version=policy_version, since=since,
                                          until=until, catalog=catalog, domain=domain):
                    f.write(ep.to_json() + "\n")
                    n_episodes += 1
                    n_records += ep.n_steps
            else:
                since_, until_ = _parse_time(since, "since"), _parse_time(until, "until")
                where, args = _filters(episode_id, policy_version, since_, until_, None)
                for (record,) in ws.conn.execute(
                        f"SELECT record FROM audit{where} ORDER BY timestamp, seq", args):
                    f.write(record + "\n")
                    n_records += 1
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    return ExportResult(path=str(out), records=n_records, episodes=n_episodes,
                        as_episodes=as_episodes)


# --------------------------------------------------------------------------- security events
#: The security log: one JSON object per line, appended and never rewritten (key rotation,
#: trust changes, refused bundles and refused promoted copies).  It lives beside the
#: decision trail rather than in it: decision records have a fixed schema that auditors
#: export as episodes; a refusal is not a decision.  The file itself is written by
#: core.access.security_log (which core.access.users writes through too).
SECURITY_LOG = security_log.SECURITY_LOG
security_log_path = security_log.security_log_path


@dataclass(frozen=True)
class SecurityEvent:
    """One entry of the security log (:func:`security_event`, :func:`security_events`)."""

    #: When it was recorded (audit timestamp, UTC)
    at: str
    #: What happened: ``key_rotated``, ``key_trusted``, ``key_untrusted``, ``bundle_refused``,
    #: ``promoted_copy_refused``
    event: str
    #: Who caused it and their role; None when no signed-in user did
    actor: str | None
    role: str | None
    #: What it concerned: fingerprints, digests, paths and reasons, never a secret
    detail: dict[str, Any]


def security_event(ws: "Workspace", actor: Actor | None, event: str, **detail: Any) -> SecurityEvent:
    """Append one security event (``event``, who, when, ``detail``) to the workspace's
    security log with one ``O_APPEND`` write, flushed to disk before returning.  Never
    holds a secret: callers pass fingerprints, digests and paths."""
    return SecurityEvent(**security_log.append(ws, event, actor=actor.name if actor else None,
                                               role=actor.role if actor else None, detail=detail,
                                               at=now_iso()))


def security_events(ws: "Workspace", event: str | None = None) -> list[SecurityEvent]:
    """The security log, oldest first (only ``event`` events when given)."""
    path = security_log_path(ws)
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            rec = json.loads(line)
            if event is None or rec.get("event") == event:
                out.append(SecurityEvent(at=rec["at"], event=rec["event"], actor=rec["actor"], role=rec["role"],
                                         detail=rec["detail"]))
    return out
