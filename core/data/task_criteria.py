"""Task criteria: what a task's success requires, read from a file and joined to episodes by task id.

Three formats are read into one normalised record per task id, ``{"expected_calls": [{"name",
"arguments"}], "communicate": [str], "forbidden_tools"?: [str], "call_budget"?: int}``: the
workbench's own JSON Lines (``rwb``), tau2 task files (``tau2``: ``evaluation_criteria``) and
tau-bench v1 task records (``tau-bench``: ``actions``/``outputs``, or ``info.task`` of a trajectory
record).  :func:`import_criteria` stores them per (dataset, task id) in ``task_criteria``, replacing
earlier records of the same task ids in one transaction; :func:`criteria_for` reads them back and
:func:`criteria_coverage` says how many of the dataset's episodes they cover.  Every input is
bounded (size, records, nesting, string length), and errors name the file, record and field.

Details: docs/criteria.md.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.access.users import Actor, authorize
from core.base.errors import InputError

if TYPE_CHECKING:
    from core.records.episodes import Episode
    from core.records.store import Workspace

#: Criteria formats read, with what each one is.
FORMATS: dict[str, str] = {
    "rwb": "the workbench's own JSON Lines: one {task_id, expected_calls, communicate, forbidden, call_budget} "
           "per line",
    "tau2": "tau2-bench task file (tasks.json): evaluation_criteria.actions and communicate_info",
    "tau-bench": "tau-bench (v1) task records, JSON Lines: {task_id, actions: [{name, kwargs}], outputs} "
                 "or trajectory records with info.task",
}
#: Record keys tried, in order, for an episode's task id (the same as
#: ``core.rewards.outcomes.DEFAULT_GROUP_KEYS``, which groups episodes by task; a test keeps them equal).
TASK_ID_KEYS: tuple[str, ...] = ("task_id", "task.id", "meta.task_id")

#: Bounds on what a criteria file may hold.
MAX_FILE_BYTES = 64 * 1024 * 1024
MAX_RECORDS = 100_000
MAX_DEPTH = 32
MAX_STRING = 10_000
MAX_CALLS = 500
MAX_COMMUNICATE = 200


@dataclass(frozen=True)
class CriteriaImport:
    """What :func:`import_criteria` read and how it joins the dataset's episodes."""

    #: Dataset the criteria belong to
    dataset: str
    #: The file read (its name as the user gave it)
    file: str
    #: Format read: rwb, tau2 or tau-bench
    format: str
    #: Distinct task ids read from the file
    tasks_read: int
    #: Of those, task ids that at least one episode of the dataset has
    tasks_matched: int
    #: Stored records that this import replaced (same task ids imported before)
    replaced: int
    #: Episodes of the dataset
    episodes: int
    #: Episodes whose task has criteria (from this import or an earlier one)
    episodes_with_criteria: int
    #: Episodes whose task has none (their criteria terms take the neutral value)
    episodes_without_criteria: int
    #: Up to 10 task ids of the file that no episode of the dataset has
    unmatched_task_ids: list[str]

    @property
    def coverage_line(self) -> str:
        """``criteria for 180 of 240 episodes``."""
        return f"criteria for {self.episodes_with_criteria:,} of {self.episodes:,} episodes"


@dataclass(frozen=True)
class CriteriaCoverage:
    """How many of a dataset's episodes have task criteria."""

    dataset: str
    #: Episodes of the dataset
    episodes: int
    #: Episodes whose task has criteria
    episodes_with_criteria: int
    #: Task ids with stored criteria
    tasks_with_criteria: int
    #: Of those, task ids that at least one episode has
    tasks_matched: int

    @property
    def line(self) -> str:
        """``criteria for 180 of 240 episodes``."""
        return f"criteria for {self.episodes_with_criteria:,} of {self.episodes:,} episodes"


# --------------------------------------------------------------------------- reading
@dataclass(frozen=True)
class _Raw:
    record: Any
    line: int | None
    index: int


def _load(path: str, data: bytes) -> tuple[list[_Raw], bool]:
    """Records of the file and whether it was one JSON document (else JSON Lines)."""
    if len(data) > MAX_FILE_BYTES:
        raise InputError(f"the file is {len(data):,} bytes; criteria files are limited to "
                         f"{MAX_FILE_BYTES:,}", file=path)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InputError(f"not UTF-8 text (byte {exc.start})", file=path) from None
    if not text.strip():
        raise InputError("the file is empty", file=path)
    stripped = text.lstrip()
    if stripped[0] == "[" or (stripped[0] == "{" and "\n" in stripped.strip() and _one_document(text)):
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InputError(f"invalid JSON: {exc.msg}", file=path, line=exc.lineno) from None
        except RecursionError:
            raise InputError(f"nested deeper than {MAX_DEPTH} levels", file=path) from None
        if isinstance(doc, dict):
            if not isinstance(doc.get("tasks"), list):
                raise InputError("a JSON object must hold a 'tasks' list (a tau2 results file); "
                                 "otherwise give a list of tasks or JSON Lines", file=path, field="tasks")
            doc = doc["tasks"]
        if len(doc) > MAX_RECORDS:
            raise InputError(f"{len(doc):,} records; at most {MAX_RECORDS:,}", file=path)
        return [_Raw(r, None, i) for i, r in enumerate(doc)], True
    out: list[_Raw] = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        if len(out) >= MAX_RECORDS:
            raise InputError(f"more than {MAX_RECORDS:,} records", file=path, line=n)
        try:
            out.append(_Raw(json.loads(line), n, len(out)))
        except json.JSONDecodeError as exc:
            raise InputError(f"invalid JSON: {exc.msg}", file=path, line=n) from None
        except RecursionError:
            raise InputError(f"nested deeper than {MAX_DEPTH} levels", file=path, line=n) from None
    return out, False


def _one_document(text: str) -> bool:
    """Is a text that starts with ``{`` one (pretty-printed) JSON object rather than JSON Lines?"""
    first = text.lstrip().split("\n", 1)[0]
    try:
        json.loads(first)
    except json.JSONDecodeError:
        return True
    return False


def detect_format(record: Any) -> str | None:
    """The criteria format a record is in, or None when it is none of them."""
    if not isinstance(record, dict):
        return None
    if "evaluation_criteria" in record:
        return "tau2"
    if "expected_calls" in record or "communicate" in record:
        return "rwb"
    task = record.get("info", {}).get("task") if isinstance(record.get("info"), dict) else None
    if isinstance(task, dict) or ("actions" in record and ("outputs" in record or "user_id" in record)):
        return "tau-bench"
    if "task_id" in record:   # the workbench's format with only optional keys (or a misspelt one)
        return "rwb"
    return None


class _Where:
    """Where a value sits, for error messages."""

    def __init__(self, path: str, raw: _Raw):
        self.path, self.raw = path, raw

    def error(self, message: str, field: str) -> InputError:
        return InputError(message, file=self.path, line=self.raw.line,
                          record=None if self.raw.line is not None else self.raw.index, field=field)


def _check_value(value: Any, where: _Where, field: str, depth: int = 0) -> Any:
    """A JSON value within the bounds (depth, string length), returned unchanged."""
    if depth > MAX_DEPTH:
        raise where.error(f"nested deeper than {MAX_DEPTH} levels", field)
    if isinstance(value, str):
        if len(value) > MAX_STRING:
            raise where.error(f"a string of {len(value):,} characters; at most {MAX_STRING:,}", field)
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_value(k, where, field, depth + 1)
            _check_value(v, where, f"{field}.{k}", depth + 1)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_value(v, where, f"{field}[{i}]", depth + 1)
    elif value is not None and not isinstance(value, (bool, int, float)):
        raise where.error(f"unexpected value of type {type(value).__name__}", field)
    return value


def _task_id(value: Any, where: _Where, field: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)) or str(value).strip() == "":
        raise where.error("a task id must be a non-empty string or an integer", field)
    text = str(value).strip()
    if len(text) > 500:
        raise where.error("a task id is at most 500 characters", field)
    return text


def _list(value: Any, where: _Where, field: str, limit: int) -> list:
    if value is None:
        return []
    if not isinstance(value, list):
        raise where.error(f"must be a list, not {type(value).__name__}", field)
    if len(value) > limit:
        raise where.error(f"{len(value):,} entries; at most {limit:,}", field)
    return value


def _calls(items: list, where: _Where, field: str, args_key: str) -> list[dict[str, Any]]:
    out = []
    for i, item in enumerate(items):
        f = f"{field}[{i}]"
        if not isinstance(item, dict):
            raise where.error(f"a call must be an object with a name, not {type(item).__name__}", f)
        if item.get("requestor") == "user":   # tau2: a call the simulated user makes, not the agent
            continue
        name = item.get("name")
        if not isinstance(name, str) or not name.strip():
            raise where.error("a call needs a 'name' (the tool's name)", f"{f}.name")
        args = item.get(args_key)
        if args is None:
            args = {}
        if not isinstance(args, dict):
            raise where.error(f"'{args_key}' must be an object, not {type(args).__name__}", f"{f}.{args_key}")
        compare = item.get("compare_args")     # tau2: only these arguments are checked
        if isinstance(compare, list):
            args = {k: v for k, v in args.items() if k in compare}
        out.append({"name": name.strip(), "arguments": _check_value(args, where, f"{f}.{args_key}")})
    return out


def _strings(items: list, where: _Where, field: str) -> list[str]:
    out = []
    for i, item in enumerate(items):
        if isinstance(item, bool) or not isinstance(item, (str, int, float)):
            raise where.error(f"must be a string or a number, not {type(item).__name__}", f"{field}[{i}]")
        text = str(item).strip()
        if len(text) > MAX_STRING:
            raise where.error(f"a string of {len(text):,} characters; at most {MAX_STRING:,}", f"{field}[{i}]")
        if text:
            out.append(text)
    return out


def _normalise(fmt: str, rec: Any, where: _Where) -> tuple[str, dict[str, Any]]:
    """(task id, normalised criteria) of one record in format ``fmt``."""
    if not isinstance(rec, dict):
        raise where.error(f"a record must be a JSON object, not {type(rec).__name__}", "record")
    if fmt == "tau2":
        tid = _task_id(rec.get("id"), where, "id")
        crit = rec.get("evaluation_criteria")
        if crit is None:
            crit = {}
        if not isinstance(crit, dict):
            raise where.error("must be an object", "evaluation_criteria")
        calls = _calls(_list(crit.get("actions"), where, "evaluation_criteria.actions", MAX_CALLS),
                       where, "evaluation_criteria.actions", "arguments")
        say = _strings(_list(crit.get("communicate_info"), where, "evaluation_criteria.communicate_info",
                             MAX_COMMUNICATE), where, "evaluation_criteria.communicate_info")
        return tid, {"expected_calls": calls, "communicate": say}
    if fmt == "tau-bench":
        info = rec.get("info")
        task, prefix = rec, ""
        if isinstance(info, dict) and "task" in info:
            task, prefix = info["task"], "info.task."
            if not isinstance(task, dict):
                raise where.error("must be an object", "info.task")
        raw_id = rec.get("task_id", task.get("task_id"))
        if raw_id is None and isinstance(info, dict):
            raw_id = info.get("task_id")
        tid = _task_id(raw_id, where, "task_id")
        calls = _calls(_list(task.get("actions"), where, f"{prefix}actions", MAX_CALLS), where,
                       f"{prefix}actions", "kwargs")
        say = _strings(_list(task.get("outputs"), where, f"{prefix}outputs", MAX_COMMUNICATE), where,
                       f"{prefix}outputs")
        return tid, {"expected_calls": calls, "communicate": say}
    # the workbench's own format
    known = {"task_id", "expected_calls", "communicate", "forbidden", "call_budget"}
    unknown = sorted(set(rec) - known)
    if unknown:
        raise where.error(f"unknown key(s) {', '.join(unknown)}; a record has {', '.join(sorted(known))}",
                          unknown[0])
    tid = _task_id(rec.get("task_id"), where, "task_id")
    out: dict[str, Any] = {
        "expected_calls": _calls(_list(rec.get("expected_calls"), where, "expected_calls", MAX_CALLS),
                                 where, "expected_calls", "arguments"),
        "communicate": _strings(_list(rec.get("communicate"), where, "communicate", MAX_COMMUNICATE),
                                where, "communicate"),
    }
    forbidden = _list(rec.get("forbidden"), where, "forbidden", MAX_CALLS)
    if forbidden:
        names = _strings(forbidden, where, "forbidden")
        out["forbidden_tools"] = sorted(set(names))
    budget = rec.get("call_budget")
    if budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, int) or not 0 <= budget <= 100_000:
            raise where.error("call_budget must be a whole number from 0 to 100000", "call_budget")
        out["call_budget"] = budget
    return tid, out


class _FieldWhere(_Where):
    """Where a value of a record given in memory sits: a field under ``prefix``."""

    def __init__(self, prefix: str):
        self.prefix = prefix

    def error(self, message: str, field: str) -> InputError:
        return InputError(message, field=f"{self.prefix}.{field}")


def normalise_task(record: Any, field: str = "task") -> dict[str, Any]:
    """The normalised criteria of one task record given in memory: the workbench's record
    (``task_id`` optional) or a tau2 task (``evaluation_criteria``); errors name ``field.<key>``."""
    if not isinstance(record, dict):
        raise InputError(f"task criteria are an object, not {type(record).__name__}", field=field)
    fmt = "tau2" if "evaluation_criteria" in record else "rwb"
    rec = {"id" if fmt == "tau2" else "task_id": "task", **record}
    return _normalise(fmt, rec, _FieldWhere(field))[1]


def parse_criteria(path: str | Path, data: bytes | None = None, *, format: str | None = None
                   ) -> tuple[str, dict[str, tuple[dict[str, Any], int | None]]]:
    """Read a criteria file: ``(format, {task id: (criteria, line or record index)})``.

    ``data`` are the file's bytes when they do not come from ``path`` (an upload); ``format``
    (rwb, tau2, tau-bench) overrides detection.  A task id given twice with the same criteria
    (a tau-bench trajectory file holds each task once per run) is read once; with different
    criteria it is an error naming both places."""
    name = str(path)
    if format is not None and format not in FORMATS:
        raise InputError(f"unknown criteria format {format!r}", field="format", allowed=list(FORMATS))
    if data is None:
        try:
            size = Path(path).stat().st_size
        except OSError as exc:
            raise InputError(f"cannot read the file: {exc.strerror}", file=name) from None
        if size > MAX_FILE_BYTES:
            raise InputError(f"the file is {size:,} bytes; criteria files are limited to {MAX_FILE_BYTES:,}",
                             file=name)
        data = Path(path).read_bytes()
    raws, _ = _load(name, data)
    if not raws:
        raise InputError("the file holds no records", file=name)
    fmt = format
    if fmt is None:
        fmt = detect_format(raws[0].record)
        if fmt is None:
            where = _Where(name, raws[0])
            raise where.error("not a criteria record of any known format (" + "; ".join(
                f"{k}: {v}" for k, v in FORMATS.items()) + "); give --format to say which", "record")
    out: dict[str, tuple[dict[str, Any], int | None]] = {}
    for raw in raws:
        where = _Where(name, raw)
        tid, crit = _normalise(fmt, raw.record, where)
        place = raw.line if raw.line is not None else raw.index
        if tid in out and out[tid][0] != crit:
            kind = "line" if raw.line is not None else "record"
            raise where.error(f"task id {tid!r} is given twice with different criteria "
                              f"({kind} {out[tid][1]} and {place})", "task_id")
        out.setdefault(tid, (crit, place))
    return fmt, out


# --------------------------------------------------------------------------- joining
def _dotted(value: Any, path: str) -> Any:
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def recorded_task_id(ep: "Episode", keys: Sequence[str] = TASK_ID_KEYS) -> Any:
    """The value at the first of ``keys`` (dotted paths) that the episode's imported record or
    its meta holds; None when none does."""
    for key in keys:
        for root in (ep.source.raw, ep.meta):
            found = _dotted(root, key)
            if found is not None:
                return found
    return None


def episode_task_ids(episodes: Sequence["Episode"], group_key: str | None = None) -> list[str | None]:
    """Per episode its raw task id (without the domain prefix that task groups carry): the
    value at ``group_key`` (or the first of :data:`TASK_ID_KEYS`) in the imported record or
    the episode's meta; None when it has none."""
    keys = (group_key,) if group_key else TASK_ID_KEYS
    out: list[str | None] = []
    for ep in episodes:
        found = recorded_task_id(ep, keys)
        out.append(None if found is None or isinstance(found, (dict, list)) else str(found).strip())
    return out


def criteria_for(ws: "Workspace", dataset: str) -> dict[str, dict[str, Any]]:
    """Task id → normalised criteria stored for ``dataset`` (empty when none were imported)."""
    rows = ws.conn.execute("SELECT task_id, criteria FROM task_criteria WHERE dataset = ? ORDER BY task_id",
                           (dataset,)).fetchall()
    return {r[0]: json.loads(r[1]) for r in rows}


def criteria_digest(criteria: dict[str, dict[str, Any]]) -> str:
    """A stable digest of a task id → criteria mapping (empty string when there are none)."""
    if not criteria:
        return ""
    body = json.dumps(criteria, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()


def criteria_group_keys(criteria: dict[str, dict[str, Any]]) -> list[str | None]:
    """The distinct join keys the stored criteria were imported with (None: the default keys)."""
    return sorted({c.get("group_key") for c in criteria.values()}, key=lambda k: (k is not None, k or ""))


def episode_criteria(criteria: dict[str, dict[str, Any]],
                     task_ids: dict[str | None, list[str | None]]) -> list[dict[str, Any] | None]:
    """Per episode its criteria, given its task id under each join key in use (``task_ids``:
    join key → per-episode task ids, as :func:`episode_task_ids` gives them)."""
    n = len(next(iter(task_ids.values()))) if task_ids else 0
    out: list[dict[str, Any] | None] = [None] * n
    for key, ids in task_ids.items():
        for i, tid in enumerate(ids):
            crit = criteria.get(tid) if tid is not None else None
            if out[i] is None and crit is not None and crit.get("group_key") == key:
                out[i] = crit
    return out


def _coverage_counts(ws: "Workspace", dataset: str, criteria: dict[str, dict[str, Any]]
                     ) -> tuple[int, int, set[str]]:
    """(episodes, episodes with criteria, task ids some episode has)."""
    episodes = ws.load_episodes(dataset)
    keys = criteria_group_keys(criteria) or [None]
    ids = {key: episode_task_ids(episodes, key) for key in keys}
    per_episode = episode_criteria(criteria, ids)
    seen = {t for key_ids in ids.values() for t in key_ids if t is not None}
    return len(episodes), sum(c is not None for c in per_episode), seen & set(criteria)


def criteria_coverage(ws: "Workspace", dataset: str) -> CriteriaCoverage:
    """How many of ``dataset``'s episodes have task criteria ("criteria for 180 of 240 episodes")."""
    ws.require_dataset(dataset)
    criteria = criteria_for(ws, dataset)
    if not criteria:   # nothing to join: count the episodes without loading them
        return CriteriaCoverage(dataset=dataset, episodes=len(ws.episode_ids(dataset)), episodes_with_criteria=0,
                                tasks_with_criteria=0, tasks_matched=0)
    n, with_criteria, matched = _coverage_counts(ws, dataset, criteria)
    return CriteriaCoverage(dataset=dataset, episodes=n, episodes_with_criteria=with_criteria,
                            tasks_with_criteria=len(criteria), tasks_matched=len(matched))


# --------------------------------------------------------------------------- importing
def import_criteria(ws: "Workspace", actor: Actor, path: str | Path, dataset: str, *,
                    format: str | None = None, group_key: str | None = None,
                    data: bytes | None = None) -> CriteriaImport:
    """Read a criteria file and store it for ``dataset``, one record per task id; records of
    the same task ids imported before are replaced, all in one transaction.  ``group_key``
    is the dotted key of the episodes' task id when it is not ``task_id``; ``data`` are the
    file's bytes when they come from an upload (``path`` is then its name).  Needs the
    ``import`` permission."""
    authorize(ws, actor, "import")
    ws.require_dataset(dataset)
    if group_key is not None and not group_key.strip():
        group_key = None
    fmt, parsed = parse_criteria(path, data, format=format)
    name = Path(str(path)).name if data is not None else str(path)
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    with ws.transaction() as conn:
        replaced = 0
        for start in range(0, len(parsed), 500):   # SQLite limits the variables of one statement
            chunk = list(parsed)[start:start + 500]
            replaced += conn.execute(
                f"SELECT COUNT(*) FROM task_criteria WHERE dataset = ? AND task_id IN ({','.join('?' * len(chunk))})",
                (dataset, *chunk)).fetchone()[0]
        rows = []
        for tid, (crit, place) in parsed.items():
            stored = dict(crit, group_key=group_key) if group_key else crit
            rows.append((dataset, tid, json.dumps(stored, sort_keys=True, ensure_ascii=False), name,
                         place, fmt, actor.name, now))
        conn.executemany(
            "INSERT OR REPLACE INTO task_criteria (dataset, task_id, criteria, source_file, source_line, "
            "source_format, imported_by, imported_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)
    criteria = criteria_for(ws, dataset)
    n, with_criteria, seen = _coverage_counts(ws, dataset, criteria)
    matched = seen & set(parsed)
    return CriteriaImport(dataset=dataset, file=name, format=fmt, tasks_read=len(parsed),
                          tasks_matched=len(matched), replaced=int(replaced), episodes=n,
                          episodes_with_criteria=with_criteria, episodes_without_criteria=n - with_criteria,
                          unmatched_task_ids=sorted(set(parsed) - seen)[:10])


__all__ = ["FORMATS", "TASK_ID_KEYS", "CriteriaCoverage", "CriteriaImport", "criteria_coverage",
           "criteria_digest", "criteria_for", "criteria_group_keys", "detect_format", "episode_criteria",
           "episode_task_ids", "import_criteria", "parse_criteria"]
