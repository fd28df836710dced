"""Ready-to-render views of recorded episodes: what the Episodes page (and the CLI) show.

Pages do no data shaping; they call one function here and render what it returns:

- :func:`list_episodes` — the filtered episode table of a dataset (:func:`episode_filter_choices`
  gives the values its filters can take);
- :func:`show_episode` — one episode with its steps, each action with its catalog token
  (or INVALID and why), what the agent saw, what the tool answered, and the outcome;
- :func:`import_upload` — import a file handed in through the browser;
- :func:`import_summary` — the figures and rejected records of an ``ImportResult``.

Example::

    >>> table = list_episodes(ws, "finance-sample", EpisodeFilter(behaviours=["hacker"]))  # doctest: +SKIP
    >>> catalog = catalog_for_dataset(ws, "finance-sample")                               # doctest: +SKIP
    >>> detail = show_episode(ws, "finance-sample", table.episode_ids[0], catalog)        # doctest: +SKIP
    >>> detail.steps[0].token                                                             # doctest: +SKIP
    'A10T0'
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Callable, Literal

from core.records.episodes import Action, Episode, Step
from core.base.errors import InputError
from core.records.store import DatasetInfo, Workspace
from core.access.users import authorize, current_user
from core.data.importers import IMPORTERS, import_file

if TYPE_CHECKING:  # names used in annotations only
    from core.records.catalog import Catalog
    from core.data.importers import ImportResult
    from core.access.users import Actor

ResolvedFilter = Literal["any", "resolved", "failed", "unknown"]

#: Most rows :func:`list_episodes` returns at once; the table says when more matched.
MAX_ROWS = 5000


# --------------------------------------------------------------------------- datasets
def dataset_label(info: DatasetInfo) -> str:
    """One line naming a dataset for a picker: ``finance-sample — finance · 200 episodes, 1,234 steps``."""
    domain = f"{info.domain} · " if info.domain else ""
    return f"{info.name} — {domain}{info.n_episodes:,} episodes, {info.n_steps:,} steps"


# --------------------------------------------------------------------------- episode table
@dataclass
class EpisodeFilter:
    """What the analyst narrowed the table to; empty lists mean "all"."""

    task_types: list[str] = field(default_factory=list)
    behaviours: list[str] = field(default_factory=list)
    resolved: ResolvedFilter = "any"
    #: Case-insensitive substring of the episode id or the user's request.
    search: str = ""


@dataclass
class EpisodeTable:
    """The episode table of one dataset after filtering."""

    dataset: str
    #: One dict per episode: episode_id, task_type, behaviour, steps, resolved, final_reward, query.
    rows: list[dict[str, Any]]
    #: Episodes in the dataset, and episodes matching the filter (rows may be capped at MAX_ROWS).
    total: int
    matched: int

    @property
    def episode_ids(self) -> list[str]:
        return [r["episode_id"] for r in self.rows]


def _distinct(ws: Workspace, dataset: str, column: str) -> list[str]:
    # column is one of two fixed names, never user text.
    return [r[0] for r in ws.conn.execute(
        f"SELECT DISTINCT {column} FROM episodes WHERE dataset=? AND {column} IS NOT NULL "
        f"ORDER BY {column}", (dataset,))]


@dataclass
class FilterChoices:
    """Values the episode filters can take in one dataset."""

    task_types: list[str]
    behaviours: list[str]


def episode_filter_choices(ws: Workspace, dataset: str) -> FilterChoices:
    """Distinct task types and behaviours of ``dataset``, for the filter widgets."""
    ws.require_dataset(dataset)
    return FilterChoices(task_types=_distinct(ws, dataset, "task_type"),
                         behaviours=_distinct(ws, dataset, "behaviour"))


def dataset_version(ws: Workspace, dataset: str) -> str:
    """Changes whenever episodes or tools of ``dataset`` change (a cache key for its catalog)."""
    n, last = ws.conn.execute(
        "SELECT COUNT(*), COALESCE(MAX(uid), 0) FROM episodes WHERE dataset=?", (dataset,)).fetchone()
    digest = hashlib.sha256(f"{n}:{last}".encode())
    for name, schema in ws.conn.execute(
            "SELECT name, schema FROM tools WHERE dataset=? ORDER BY name", (dataset,)):
        digest.update(f"\n{name}\t{schema}".encode())
    return digest.hexdigest()[:16]


def list_episodes(ws: Workspace, dataset: str, flt: EpisodeFilter | None = None, *,
                  limit: int = MAX_ROWS) -> EpisodeTable:
    """The episodes of ``dataset`` matching ``flt``, in import order, ready for a table."""
    ws.require_dataset(dataset)
    flt = flt or EpisodeFilter()
    where, args = ["dataset = ?"], [dataset]
    if flt.task_types:
        where.append(f"task_type IN ({','.join('?' * len(flt.task_types))})")
        args.extend(flt.task_types)
    if flt.behaviours:
        where.append(f"behaviour IN ({','.join('?' * len(flt.behaviours))})")
        args.extend(flt.behaviours)
    if flt.resolved == "resolved":
        where.append("resolved = 1")
    elif flt.resolved == "failed":
        where.append("resolved = 0")
    elif flt.resolved == "unknown":
        where.append("resolved IS NULL")
    elif flt.resolved != "any":
        raise InputError(f"unknown resolved filter {flt.resolved!r}; use any, resolved, failed or unknown",
                         field="resolved")
    if flt.search.strip():
        # instr() on lower-cased text: a literal substring match, no LIKE wildcards to escape.
        where.append("(instr(lower(episode_id), ?) > 0 OR instr(lower(COALESCE(query, '')), ?) > 0)")
        needle = flt.search.strip().lower()
        args.extend([needle, needle])
    sql_where = " AND ".join(where)
    matched = ws.conn.execute(f"SELECT COUNT(*) FROM episodes WHERE {sql_where}", args).fetchone()[0]
    total = ws.conn.execute("SELECT COUNT(*) FROM episodes WHERE dataset=?", (dataset,)).fetchone()[0]
    rows = [
        {"episode_id": r[0], "task_type": r[1], "behaviour": r[2], "steps": r[3],
         "resolved": None if r[4] is None else bool(r[4]), "final_reward": r[5], "query": r[6]}
        for r in ws.conn.execute(
            f"SELECT episode_id, task_type, behaviour, n_steps, resolved, final_reward, query "
            f"FROM episodes WHERE {sql_where} ORDER BY uid LIMIT ?", [*args, int(limit)])
    ]
    return EpisodeTable(dataset=dataset, rows=rows, total=total, matched=matched)


# --------------------------------------------------------------------------- one episode
@dataclass
class ChatLine:
    """One message the agent saw, as text."""

    role: str
    text: str


@dataclass
class StepView:
    """One step, every part ready to show."""

    t: int
    kind: str
    tool: str | None
    params: dict[str, Any]
    #: ``get_stock_data(symbol=600519, period=q3)``, or the kind for non-tool actions.
    action_label: str
    #: Catalog token name (``A12T3``, ``R0``…) or ``INVALID``; None when no catalog was given.
    token: str | None
    token_label: str | None
    risk: str | None
    invalid_reason: str | None
    messages: list[ChatLine]
    state: dict[str, Any]
    #: Anything else in the observation (foreign formats keep their own keys).
    observation_extra: Any
    tool_result: Any
    tool_error: str | None
    result_replayed: bool
    output_text: str | None
    latency_ms: float | None
    timestamp: str | None

    @property
    def status(self) -> str:
        """``ok``, why the call is INVALID, ``tool error`` or ``not replayed``, for the step table."""
        if self.token == "INVALID":
            return str(self.invalid_reason)
        if self.tool_error:
            return "tool error"
        if not self.result_replayed:
            return "not replayed"
        return "ok"


#: The recorded outcome's fields: (field, plain label, what it means).
OUTCOME_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("resolved", "Task done", "Whether the log says the user's task was resolved (resolved): yes, no, "
                              "or — when the log does not say."),
    ("final_reward", "Logged reward", "The reward the log gives the whole episode (final_reward), on the "
                                      "log's own scale: higher is better."),
    ("business_metric", "Business result", "The business figure the log records for the episode "
                                           "(business_metric), such as money recovered: higher is better."),
    ("sentiment", "User sentiment", "How the user felt at the end, as the log scores it: higher is happier "
                                    "(sentiment)."),
)


@dataclass(frozen=True)
class OutcomeFigure:
    """One figure of an episode's recorded outcome (:attr:`EpisodeDetail.outcome_rows`)."""

    label: str
    #: True/False for resolved, a number otherwise; None when the log does not record it
    value: Any
    #: The field's name in the episode format
    field: str
    #: What it means and what good looks like (a tooltip)
    meaning: str


@dataclass
class EpisodeDetail:
    """One episode as the Episodes page shows it."""

    dataset: str
    episode_id: str
    domain: str
    behaviour: str | None
    query: str
    task_type: str | None
    intents: list[str]
    #: resolved, final_reward, business_metric, sentiment (None = unknown) plus outcome extras.
    outcome: dict[str, Any]
    source: dict[str, Any]
    meta: dict[str, Any]
    steps: list[StepView]
    #: Catalog version used for the tokens (None when no catalog was given).
    catalog_version: str | None

    @property
    def step_rows(self) -> list[dict[str, Any]]:
        """The compact step table: t, action, token, status, latency."""
        return [{"t": s.t, "action": s.action_label, "token": s.token, "status": s.status,
                 "latency_ms": s.latency_ms} for s in self.steps]

    @property
    def n_invalid(self) -> int:
        return sum(s.token == "INVALID" for s in self.steps)

    @property
    def outcome_figures(self) -> list[tuple[str, str]]:
        """(label, shown value) of the outcome; unknown values read "unknown"."""
        o = self.outcome
        resolved = {True: "yes", False: "no", None: "unknown"}[o.get("resolved")]
        figures = [("resolved", resolved)]
        for key in ("final_reward", "business_metric", "sentiment"):
            value = o.get(key)
            figures.append((key.replace("_", " "), "unknown" if value is None else f"{value:.3g}"))
        return figures

    @property
    def outcome_rows(self) -> list[OutcomeFigure]:
        """The outcome as a page shows it: plain label, value (None: not recorded), what it
        means and the field's name."""
        o = self.outcome
        return [OutcomeFigure(label, o.get(key), key, meaning) for key, label, meaning in OUTCOME_FIELDS]

    @property
    def outcome_extra(self) -> dict[str, Any]:
        """Outcome fields beyond the four standard ones (foreign formats keep theirs)."""
        return {k: v for k, v in self.outcome.items()
                if k not in ("resolved", "final_reward", "business_metric", "sentiment")}

    @property
    def summary_line(self) -> str:
        """``finance · behaviour expert · task urgent_reduce · intents a, b · from f.jsonl line 3``."""
        parts = [self.domain]
        if self.behaviour:
            parts.append(f"behaviour {self.behaviour}")
        if self.task_type:
            parts.append(f"task {self.task_type}")
        if self.intents:
            parts.append("intents " + ", ".join(self.intents))
        if self.source.get("file"):
            where = Path(str(self.source["file"])).name
            if self.source.get("line") is not None:
                where += f" line {self.source['line']}"
            elif self.source.get("record") is not None:
                where += f" record {self.source['record']}"
            parts.append(f"from {where} ({self.source.get('format') or '?'})")
        parts.append(f"{len(self.steps)} steps")
        if self.catalog_version is not None:
            parts.append(f"{self.n_invalid} invalid")
        return " · ".join(parts)


#: Significant digits a figure keeps on a page (:func:`for_reading`).
READING_DIGITS = 4


def for_reading(value: Any, digits: int = READING_DIGITS) -> Any:
    """``value`` with every float rounded to ``digits`` significant digits, inside lists and
    objects too (``0.32000000000000006`` → ``0.32``, ``1289.1999999999998`` → ``1289``), for a
    page: a recorded figure never shows more digits than it means.  Whole results become ints."""
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return value
        rounded = float(f"{value:.{digits}g}")
        return int(rounded) if rounded.is_integer() and abs(rounded) < 1e15 else rounded
    if isinstance(value, dict):
        return {k: for_reading(v, digits) for k, v in value.items()}
    if isinstance(value, list):
        return [for_reading(v, digits) for v in value]
    return value


def _short(value: Any, limit: int = 40) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def action_label(action: Action) -> str:
    """A call as one readable line: ``tool(a=1, b=x)``; other kinds by their name."""
    if action.kind != "tool_call":
        return action.kind
    if action.raw_arguments is not None and not action.params:
        return f"{action.tool}({_short(action.raw_arguments)})"
    args = ", ".join(f"{k}={_short(v)}" for k, v in action.params.items())
    return f"{action.tool}({args})"


def _message_text(message: Any) -> ChatLine:
    if not isinstance(message, dict):
        return ChatLine(role="?", text=_short(message, 10_000))
    content = message.get("content")
    text = content if isinstance(content, str) else ("" if content is None else
                                                     json.dumps(content, ensure_ascii=False))
    calls = message.get("tool_calls") or ([message["function_call"]] if message.get("function_call")
                                          else [])
    for call in calls if isinstance(calls, list) else []:
        fn = call.get("function", call) if isinstance(call, dict) else {}
        if isinstance(fn, dict) and fn.get("name"):
            text += f"\n→ calls {fn['name']}({fn.get('arguments', '')})"
    return ChatLine(role=str(message.get("role", "?")), text=text.strip())


def _split_observation(observation: Any) -> tuple[list[ChatLine], dict[str, Any], Any]:
    """Observation convention (core/records/episodes.py): optional "messages" and "state" keys."""
    if observation is None:
        return [], {}, None
    if not isinstance(observation, dict):
        return [], {}, observation
    messages = observation.get("messages")
    state = observation.get("state")
    extra = {k: v for k, v in observation.items() if k not in ("messages", "state")}
    lines = [_message_text(m) for m in messages] if isinstance(messages, list) else []
    if messages is not None and not isinstance(messages, list):
        extra["messages"] = messages
    if state is not None and not isinstance(state, dict):
        extra["state"] = state
    return lines, state if isinstance(state, dict) else {}, extra or None


def _tokens(catalog: Catalog, steps: list[Step]) -> list[tuple[str, str | None, str | None, str | None]]:
    """(token name or INVALID, token label, risk, invalid reason) per step, one batched call."""
    batch = catalog.normalize_many([s.action for s in steps])
    out: list[tuple[str, str | None, str | None, str | None]] = []
    for token_id, reason in zip(batch.token_ids.tolist(), batch.reasons):
        if token_id < 0:
            out.append(("INVALID", None, None, reason or "not in the catalog"))
        else:
            tok = catalog.tokens[token_id]
            out.append((tok.name, tok.label, tok.risk, None))
    return out


def show_episode(ws: Workspace, dataset: str, episode_id: str,
                 catalog: Catalog | None = None, *, reading: bool = False) -> EpisodeDetail:
    """One episode with its steps; actions carry their catalog token when ``catalog`` is given
    (``core.records.catalog.catalog_for_dataset(ws, dataset)``; the app passes its cached one).

    ``reading``: every recorded figure (call arguments, state, tool results, outcome) rounded
    by :func:`for_reading`, as a page shows it; the tokens are found from the exact values."""
    ep: Episode = ws.get_episode(dataset, episode_id)
    tokens = _tokens(catalog, ep.steps) if catalog is not None and ep.steps else \
        [(None, None, None, None)] * len(ep.steps)
    shown = for_reading if reading else (lambda value: value)
    steps = []
    for step, (token, token_label, risk, reason) in zip(ep.steps, tokens):
        messages, state, extra = _split_observation(shown(step.observation))
        action = step.action.model_copy(update={"params": shown(dict(step.action.params))}) if reading \
            else step.action
        steps.append(StepView(
            t=step.t, kind=step.action.kind, tool=step.action.tool, params=dict(action.params),
            action_label=action_label(action), token=token, token_label=token_label, risk=risk,
            invalid_reason=reason, messages=messages, state=state, observation_extra=extra,
            tool_result=shown(step.tool_result), tool_error=step.tool_error,
            result_replayed=step.result_replayed, output_text=step.output_text,
            latency_ms=step.latency_ms, timestamp=step.timestamp))
    o = ep.outcome
    outcome = {"resolved": o.resolved, "final_reward": o.final_reward,
               "business_metric": o.business_metric, "sentiment": o.sentiment, **shown(dict(o.extra))}
    source = {"file": ep.source.file, "format": ep.source.format, "line": ep.source.line,
              "record": ep.source.record}
    return EpisodeDetail(
        dataset=dataset, episode_id=ep.episode_id, domain=ep.domain, behaviour=ep.behaviour,
        query=ep.task.query, task_type=ep.task.task_type, intents=list(ep.task.intents),
        outcome=outcome, source=source, meta=dict(ep.meta), steps=steps,
        catalog_version=None if catalog is None else catalog.version)


# --------------------------------------------------------------------------- importing
def import_formats() -> dict[str, str]:
    """Format name -> one-line description, ``auto`` first (for a format picker)."""
    formats = {"auto": "detect the format from the file's content"}
    formats.update({name: imp.description for name, imp in IMPORTERS.items()})
    return formats


#: Longest file name most file systems take, in UTF-8 bytes.
MAX_FILE_NAME_BYTES = 255


def _safe_name(filename: str) -> str:
    """The last part of an uploaded file's name, refused (InputError) when it cannot be a
    file name: empty, ``.``/``..``, control characters (NUL…), not valid Unicode, or over
    ``MAX_FILE_NAME_BYTES``."""
    if not isinstance(filename, str):
        raise InputError("the uploaded file has no usable name", file="<upload>")
    shown = filename.encode("utf-8", "backslashreplace").decode("utf-8")[:80]
    if any(ord(c) < 32 or ord(c) == 127 for c in filename):
        raise InputError("the file name holds a control character (such as NUL); rename the file",
                         file=repr(shown))
    name = Path(filename.replace("\\", "/")).name.strip()
    if not name or name in (".", ".."):
        raise InputError("the uploaded file has no usable name", file=shown or "<upload>")
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        raise InputError("the file name is not valid Unicode; rename the file", file=shown) from None
    if size > MAX_FILE_NAME_BYTES:
        raise InputError(f"the file name is {size} bytes long, more than {MAX_FILE_NAME_BYTES}; "
                         "rename the file", file=shown + "…")
    return name


def import_upload(ws: Workspace, filename: str, data: bytes | BinaryIO, *, format: str = "auto",
                  dataset: str | None = None, messages_key: str | None = None,
                  reward_key: str | None = None, id_key: str | None = None,
                  skip_invalid: bool = False,
                  progress: Callable[[int, int], None] | None = None,
                  actor: Actor | None = None) -> ImportResult:
    """Import a file handed in through the browser; returns the ``ImportResult``.

    ``data``: the file's bytes, or a binary file object (such as Streamlit's
    ``UploadedFile``), copied a piece at a time.  The bytes are kept in the workspace under
    ``artifacts/uploads/<sha256>/<original name>`` (the dataset defaults to the original
    name's stem, and the import record points at the kept copy), then imported from there
    as any file is (a record at a time).  When the import fails the kept copy is removed
    again, so the workspace is left as it was, and the error names the file by its
    original name.  ``actor`` as for :func:`~core.data.importers.api.import_file` (checked
    before any byte is kept)."""
    actor = current_user(ws) if actor is None else actor
    authorize(ws, actor, "import")
    name = _safe_name(filename)
    if isinstance(data, (bytes, bytearray, memoryview)):
        data = io.BytesIO(bytes(data))
    data.seek(0)
    if not data.read(1):
        raise InputError("the uploaded file is empty", file=name)
    uploads = ws.artifact_dir("uploads")
    tmp = uploads / f".upload.{os.getpid()}.{threading.get_ident()}.tmp"  # short: the name may take all 255 bytes
    try:
        digest = _copy_hashing(data, tmp)
        folder = ws.artifact_dir("uploads", digest[:16])
        path = folder / name
        created = not path.exists()
        if created:
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    try:
        return import_file(ws, path, format=format, dataset=dataset or None,
                           messages_key=messages_key or None, reward_key=reward_key or None,
                           id_key=id_key or None, skip_invalid=skip_invalid, progress=progress,
                           actor=actor)
    except BaseException as exc:
        if created:
            path.unlink(missing_ok=True)
            try:
                folder.rmdir()
            except OSError:  # another upload of the same bytes under another name is there
                pass
        if isinstance(exc, InputError) and exc.file == str(path):
            # Name the file as the analyst knows it, not the (now removed) kept copy.
            raise exc.relocated(file=name) from None
        raise


def _copy_hashing(source: BinaryIO, out: Path) -> str:
    """Copy ``source`` from its start into the file ``out``, a piece at a time; its sha256."""
    digest = hashlib.sha256()
    source.seek(0)
    with open(out, "wb") as f:
        while piece := source.read(UPLOAD_PIECE_BYTES):
            digest.update(piece)
            f.write(piece)
    return digest.hexdigest()


#: Bytes copied at a time from an upload into the workspace.
UPLOAD_PIECE_BYTES = 1 << 20


@dataclass
class ImportSummary:
    """An ``ImportResult`` as the page shows it."""

    headline: str
    #: (label, value) figures in display order.
    figures: list[tuple[str, int]]
    #: One row per rejected record: where (its line, else its place in a list), field and why.
    rejected: list[dict[str, Any]]
    duplicate_ids: list[str]
    report_path: str | None
    already_imported: bool
    #: Most frequent reasons of INVALID tool calls: rows of reason, calls.
    invalid_reasons: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def _where(line: int | None, record: int | None) -> str | None:
    """Where a rejected record sits: its line (1-based, as an editor numbers it), else its
    place in a JSON list (``record 0`` is the first)."""
    if line is not None:
        return f"line {line}"
    return None if record is None else f"record {record}"


def import_summary(result: ImportResult) -> ImportSummary:
    """Headline, figures and rejected-record rows of an ``ImportResult``."""
    name = Path(str(result.file)).name
    if result.already_imported:
        headline = (f"{name} was already imported into dataset '{result.dataset}'; "
                    "nothing changed.")
    else:
        headline = (f"Imported {result.episodes:,} episodes from {name} ({result.format}) "
                    f"into dataset '{result.dataset}'.")
    figures = [("episodes", result.episodes), ("steps", result.steps),
               ("tool calls", result.tool_calls), ("invalid tokens", result.invalid_tokens),
               ("duplicate ids renamed", len(result.duplicate_ids)),
               ("records rejected", len(result.rejected))]
    rejected = [{"where": _where(r.get("line"), r.get("record")), "field": r.get("field"),
                 "reason": r.get("reason") or r.get("message")} for r in result.rejected]
    reasons = sorted(result.invalid_reasons.items(), key=lambda kv: (-kv[1], kv[0]))
    return ImportSummary(headline=headline, figures=figures, rejected=rejected,
                         duplicate_ids=list(result.duplicate_ids), report_path=result.report_path,
                         already_imported=bool(result.already_imported),
                         invalid_reasons=[{"reason": r, "calls": n} for r, n in reasons],
                         warnings=list(result.warnings))
