"""Import a file into a workspace dataset, read one without storing it, export a dataset.

These are the core functions behind ``rwb episodes import|export`` and the Episodes page.

Example::

    >>> ws = Workspace.open("/tmp/ws")                                  # doctest: +SKIP
    >>> result = import_file(ws, "datasets/finance/sample.jsonl")       # doctest: +SKIP
    >>> result.episodes, result.steps, result.invalid_tokens            # doctest: +SKIP
    (60, 540, 0)
    >>> export_episodes(ws, "sample", "/tmp/sample.jsonl")              # doctest: +SKIP
    60
"""

from __future__ import annotations

import hashlib
import json
import marshal
import os
import sqlite3
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from core.records.episodes import Action, ToolSchema, episode_from_body
from core.base.errors import InputError
from core.data.importers.base import (
    open_input_file,
    IMPORTERS,
    Document,
    ParsedFile,
    ProgressFn,
    ReadOptions,
    assign_unique_ids,
    canonical_body,
    next_free_id,
    check_keys_supported,
    dumps_canonical,
    READ_BYTES,
    gc_paused,
    get_importer,
    open_document,
    prepare_episode,
)
from core.data.importers.parallel import Rows, import_workers, read_rwb_rows, rows_in_batches
from core.data.importers.rwb import header_line
from core.access.users import Actor, authorize, current_user
from core.records.catalog import build_catalog

if TYPE_CHECKING:  # the store (sqlite-utils) is imported by the functions that need it
    from core.records.store import Workspace

#: Longest dataset name accepted.
MAX_DATASET_NAME = 200


@dataclass
class ImportResult:
    """What one ``import_file`` call did."""

    dataset: str
    file: str
    format: str
    episodes: int
    steps: int
    tool_calls: int
    #: Tool calls the action catalog's normalizer maps to INVALID (unknown tool, bad arguments…).
    invalid_tokens: int
    #: ``InputError.to_dict()`` of every record skipped with ``skip_invalid``.
    rejected: list[dict[str, Any]] = field(default_factory=list)
    #: Episode ids that repeated (in the file or against the dataset); the copies were renamed.
    duplicate_ids: list[str] = field(default_factory=list)
    #: True when this exact file (sha256) was already imported into the dataset: nothing changed.
    already_imported: bool = False
    #: JSON report of the rejected records, under the workspace artifacts (None when none).
    report_path: str | None = None
    #: new id -> original id of every renamed episode.
    renamed: dict[str, str] = field(default_factory=dict)
    #: Most frequent reasons of the INVALID calls, with counts.
    invalid_reasons: dict[str, int] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    file_sha256: str = ""
    import_id: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------- reading
def detect_format(doc: Document, options: ReadOptions | None = None) -> str:
    """The registered format whose ``sniff`` accepts ``doc`` (``--format auto``)."""
    if doc.first is None:
        if doc.head and doc.head[0].error is not None:
            raise doc.head[0].error
        raise InputError("file holds no records", file=doc.name)
    options = options or ReadOptions()
    matches = [name for name, imp in IMPORTERS.items() if imp.sniff(doc, options)]
    if not matches:
        first = doc.first
        keys = ", ".join(sorted(map(str, first))[:12]) if isinstance(first, dict) else type(first).__name__
        raise InputError(
            f"cannot tell the format (first record has: {keys})",
            hint=f"give --format, one of {', '.join(IMPORTERS)} (openai files with the messages "
                 f"elsewhere also need --messages-key)",
            allowed=list(IMPORTERS), file=doc.name, field="format")
    return matches[0]


def _options(messages_key: str | None, reward_key: str | None, id_key: str | None,
             skip_invalid: bool, progress: ProgressFn | None) -> ReadOptions:
    for name, value in (("messages_key", messages_key), ("reward_key", reward_key), ("id_key", id_key)):
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise InputError(f"--{name.replace('_', '-')} must be a non-empty key", field=name)
    return ReadOptions(messages_key=messages_key, reward_key=reward_key, id_key=id_key,
                       skip_invalid=skip_invalid, progress=progress)


def _read(doc: Document, format: str, options: ReadOptions, rename: bool = True) -> ParsedFile:
    name = detect_format(doc, options) if format == "auto" else format
    importer = get_importer(name)
    check_keys_supported(importer, options)
    parsed = importer.read(doc, options)
    _check_tools(parsed.tools, doc)
    if parsed.prepared is None:  # an importer that left them to us
        parsed.prepared = [prepare_episode(ep) for ep in parsed.episodes]
    if rename:
        parsed.duplicate_ids, parsed.renamed = assign_unique_ids(parsed.episodes, set())
        _refresh_prepared(parsed, parsed.renamed)
    return parsed


def _schema_problem(params: Any) -> str | None:
    """Why a tool's ``parameters`` is not a usable JSON Schema object, or None."""
    if not isinstance(params, dict):
        return "parameters must be an object"
    props = params.get("properties", {})
    if not isinstance(props, dict):
        return "parameters.properties must be an object"
    for name, spec in props.items():
        if not isinstance(spec, dict):
            return f"parameters.properties.{name} must be an object"
        if "enum" in spec and not isinstance(spec["enum"], list):
            return f"parameters.properties.{name}.enum must be a list"
        if "type" in spec and not isinstance(spec["type"], (str, list)):
            return f"parameters.properties.{name}.type must be a type name"
    required = params.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        return "parameters.required must be a list of names"
    return None


def _check_tools(tools: list[ToolSchema], doc: Document) -> None:
    """Tool schemas must be usable JSON Schema objects and storable JSON (no NaN, no
    unpaired surrogates): the catalog is built from them."""
    for tool in tools:
        name = tool.name.encode("utf-8", "replace").decode("utf-8")
        problem = _schema_problem(tool.parameters)
        if problem is None:
            try:
                dumps_canonical(tool.model_dump(mode="json")).encode("utf-8")
            except (ValueError, RecursionError) as exc:
                problem = ("text holds an unpaired surrogate (not valid Unicode)"
                           if isinstance(exc, UnicodeEncodeError) else f"not storable as JSON: {str(exc)[:80]}")
        if problem is not None:
            raise InputError(f"tool schema {name!r}: {problem}", file=doc.name, field="tools") from None


def _refresh_prepared(parsed: ParsedFile, renamed: dict[str, str]) -> None:
    """Prepare renamed episodes again (the id is part of the stored body and its hash)."""
    if not renamed:
        return
    assert parsed.prepared is not None
    for i, ep in enumerate(parsed.episodes):
        if ep.episode_id in renamed:
            parsed.prepared[i] = prepare_episode(ep)


def read_file(path: str | Path, *, format: str = "auto", messages_key: str | None = None,
              reward_key: str | None = None, id_key: str | None = None,
              skip_invalid: bool = False, progress: ProgressFn | None = None) -> ParsedFile:
    """Read and validate a file without touching any workspace.

    Raises :class:`InputError` (file, line or record, field) on the first bad record,
    unless ``skip_invalid``: then bad records are listed in ``ParsedFile.rejected``.
    Repeated episode ids are renamed ``id~2``, ``id~3``… and listed in ``duplicate_ids``."""
    doc = open_document(path)
    with gc_paused():  # see gc_paused
        parsed = _read(doc, format, _options(messages_key, reward_key, id_key, skip_invalid, progress))
    for p in parsed.prepared or []:
        p.data = {}  # the models hold the same: keep one copy in memory (see Prepared)
    return parsed


# --------------------------------------------------------------------------- importing
#: Distinct logged tool calls of a file: (tool, raw_arguments, params as stored in the steps
#: table) -> [params of the first such call, how many calls].
CallCounts = dict[tuple[str, "str | None", "str | None"], list[Any]]


def _count_invalid(tools: list[ToolSchema], calls: CallCounts) -> tuple[int, int, dict[str, int]]:
    """(tool calls, INVALID tool calls, top reasons) under the catalog of ``tools`` (or of the
    logged calls when there are no schemas); presets are learned from the logged calls."""
    import numpy as np  # here: import workers load this module too, and need no numpy

    if not calls:
        return 0, 0, {}
    counts = [n for _, n in calls.values()]
    # What core.records.catalog.observed_calls takes from episodes: the params, or the raw
    # arguments when they are a JSON object — every call (a repeated call is the same pair
    # again, not a copy), in the order the calls came but with each distinct call's
    # repeats together, which keeps the order in which values first appear.
    observed: list[tuple[str, dict[str, Any]]] = []
    for (tool, raw, _), (params, n) in calls.items():
        if raw is None:
            observed += [(tool, params)] * n
    for (tool, raw, _), (_, n) in calls.items():
        if raw is None:
            continue
        try:
            parsed = json.loads(raw)
        except (ValueError, RecursionError):
            continue
        if isinstance(parsed, dict):
            observed += [(tool, parsed)] * n
    catalog = build_catalog(tools, calls=observed)
    del observed
    # Logs repeat the same calls a lot: each distinct call is normalized once, then counted.
    # The calls were validated when read (here or in a worker): no need to validate again.
    actions = [Action.model_construct(kind="tool_call", tool=tool, params=params, raw_arguments=raw)
               for (tool, raw, _), (params, _) in calls.items()]
    batch = catalog.normalize_many(actions)
    per_call = np.asarray(counts, dtype=np.int64)
    bad = np.asarray(batch.token_ids) < 0
    reasons: Counter[str] = Counter()
    for k in np.flatnonzero(bad).tolist():  # distinct INVALID calls, in order of first use
        reasons[(batch.reasons[k] or "invalid").split(":")[0]] += int(per_call[k])
    return int(per_call.sum()), int(per_call[bad].sum()), dict(reasons.most_common(8))


def _merge_tools(existing: list[ToolSchema], new: list[ToolSchema]) -> list[ToolSchema]:
    merged = {t.name: t for t in existing}
    merged.update((t.name, t) for t in new)
    return [merged[k] for k in sorted(merged)]


def _check_dataset_name(name: Any, file: str) -> str:
    if not isinstance(name, str) or not name.strip():
        raise InputError("dataset name is empty", file=file, field="dataset")
    if len(name) > MAX_DATASET_NAME or any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise InputError(f"dataset name must be at most {MAX_DATASET_NAME} printable characters",
                         file=file, field="dataset")
    # The name becomes a folder under artifacts/ (import reports): one path part, ≤ 255 bytes.
    if "/" in name or "\\" in name or name.strip() in (".", ".."):
        raise InputError("dataset name must not contain / or \\ or be . or ..", file=file,
                         field="dataset")
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        raise InputError("dataset name is not valid Unicode", file=file, field="dataset") from None
    if size > 255:
        raise InputError(f"dataset name takes {size} bytes, more than 255", file=file, field="dataset")
    return name


def _already(conn: sqlite3.Connection, sha: str, dataset: str) -> tuple[Any, ...] | None:
    return conn.execute(
        "SELECT id, format, n_episodes, n_steps, report FROM imports WHERE file_sha256=? AND dataset=? "
        "ORDER BY id LIMIT 1", (sha, dataset)).fetchone()


def _noop_result(row: tuple[Any, ...], dataset: str, path: Path, sha: str) -> ImportResult:
    import_id, fmt, n_eps, n_steps, report = row
    summary = json.loads(report) if report else {}
    return ImportResult(dataset=dataset, file=str(path), format=fmt, episodes=n_eps, steps=n_steps,
                        tool_calls=summary.get("tool_calls", 0),
                        invalid_tokens=summary.get("invalid_tokens", 0),
                        already_imported=True, report_path=summary.get("report_path"),
                        file_sha256=sha, import_id=import_id,
                        warnings=[f"this file (sha256 {sha[:12]}…) was already imported into "
                                  f"dataset '{dataset}' (import #{import_id}); nothing changed"])


def _write_report(ws: Workspace, dataset: str, import_id: int, path: Path, sha: str,
                  result: ImportResult) -> Path:
    """The rejected records as JSON under ``artifacts/imports/<dataset>/`` (temp + rename)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in dataset)[:80] or "dataset"
    folder = ws.artifact_dir("imports", safe)
    out = folder / f"{import_id:05d}-{path.stem[:80]}-rejected.json"
    tmp = out.with_name(out.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({
        "file": str(path), "file_sha256": sha, "dataset": dataset, "format": result.format,
        "import_id": import_id, "episodes_imported": result.episodes,
        "rejected": result.rejected}, ensure_ascii=False, indent=1), encoding="utf-8")
    os.replace(tmp, out)
    return out


def _read_rows(doc: Document, format: str, options: ReadOptions) -> tuple[ParsedFile, Iterator[Rows]]:
    """Read a document into rows, a batch at a time: big rwb files on every core, the rest
    in this process.  The ParsedFile is complete once the rows are read."""
    name = detect_format(doc, options) if format == "auto" else format
    importer = get_importer(name)
    check_keys_supported(importer, options)
    workers = import_workers()
    if name == "rwb" and workers > 1 and doc.layout == "jsonl":
        return read_rwb_rows(doc, options, workers)
    # Stored only: the importers may take the fast path (dicts, no models).  import_file
    # renames repeated ids on the rows (against the file and the dataset).
    parsed, items = importer.stream(doc, replace(options, for_storage=True))
    return parsed, rows_in_batches(items)


class _RowSpool:
    """The rows of an import, written to an unnamed temporary file in the workspace folder
    as the file is read, and read back a batch at a time in the write transaction.

    So memory holds one batch, not the file, and the transaction takes the write lock for
    as long as before (storing, not reading and validating).  Alongside: the counts, the
    domains and the distinct tool calls (to count INVALID ones)."""

    def __init__(self, folder: Path):
        self.file: BinaryIO = tempfile.TemporaryFile(dir=folder, prefix=".import-rows-")
        self.episodes = 0
        self.steps = 0
        self.calls: CallCounts = {}
        self.domains: set[str] = set()

    def add(self, rows: Rows) -> None:
        # Column by column (plain str, int, float, None): marshal writes and reads columns
        # about twice as fast as the same rows as nested tuples.
        step_rows = [row for steps in rows.steps for row in steps]
        blob = marshal.dumps((list(zip(*rows.episodes)), list(zip(*step_rows)),
                              [len(steps) for steps in rows.steps]))
        self.file.write(len(blob).to_bytes(8, "little"))
        self.file.write(blob)
        self.episodes += len(rows.episodes)
        self.steps += sum(map(len, rows.steps))
        for tool, params, raw, text in rows.calls:
            seen = self.calls.get((tool, raw, text))
            if seen is None:
                self.calls[tool, raw, text] = [params, 1]
            else:
                seen[1] += 1
        self.domains |= rows.domains

    def batches(self) -> Iterator[tuple[list[tuple[Any, ...]], list[list[tuple[Any, ...]]]]]:
        """(episode rows, step rows per episode) of each batch, in the order added."""
        self.file.flush()
        self.file.seek(0)
        while head := self.file.read(8):
            episode_columns, step_columns, counts = marshal.loads(self.file.read(int.from_bytes(head, "little")))
            step_rows = list(zip(*step_columns))
            steps, at = [], 0
            for n in counts:
                steps.append(step_rows[at:at + n])
                at += n
            yield list(zip(*episode_columns)), steps

    def close(self) -> None:
        self.file.close()


def _file_sha256(path: Path) -> str:
    """The sha256 of the file's bytes, read a piece at a time."""
    digest = hashlib.sha256()
    with open_input_file(path) as f:
        while piece := f.read(READ_BYTES):
            digest.update(piece)
    return digest.hexdigest()


def _unique_rows(episodes: list[tuple[Any, ...]], taken: set[str], duplicates: list[str],
                 renamed: dict[str, str]) -> None:
    """Rename rows whose episode id is taken (by the dataset or an earlier row) to ``id~2``…,
    adding to ``duplicates`` (the repeated original ids) and ``renamed`` (new -> old).

    Same rule as :func:`~core.data.importers.base.assign_unique_ids`; a renamed episode gets its
    canonical body and hash again (the id is part of them)."""
    from core.records.store import episode_row  # deferred: loads pandas

    for i, row in enumerate(episodes):
        original = row[0]
        if original not in taken:
            taken.add(original)
            continue
        if original not in duplicates:
            duplicates.append(original)
        new = next_free_id(original, taken)
        taken.add(new)
        renamed[new] = original
        ep = episode_from_body(row[-1])  # its own canonical body: valid by construction
        ep.episode_id = new
        episodes[i] = episode_row(ep, *canonical_body(ep))


def import_file(ws: Workspace, path: str | Path, *, format: str = "auto", dataset: str | None = None,
                messages_key: str | None = None, reward_key: str | None = None,
                id_key: str | None = None, skip_invalid: bool = False,
                progress: ProgressFn | None = None, actor: Actor | None = None) -> ImportResult:
    """Import one file of recorded episodes into a dataset, all or nothing.

    ``format``: a registered importer name or ``"auto"`` (detected from the content).
    ``dataset``: defaults to the file stem (tau2: ``tau2_<domain>``).  The ``*_key`` options
    are dotted paths into each record (openai formats).  A bad record raises
    :class:`InputError` naming file, line or record, and field, and the workspace is left
    unchanged — unless ``skip_invalid``: then the good records are imported and the
    rejected ones are listed in the result and in a JSON report under the artifacts.
    Importing the same bytes into the same dataset again changes nothing
    (``already_imported``).  Big ``rwb`` files are validated by several processes when cores
    are idle (``$RWB_IMPORT_WORKERS`` to choose; see :mod:`core.data.importers.parallel`).
    ``actor`` needs the ``import`` permission (:mod:`core.access.users`); None stands for
    :func:`~core.access.users.current_user`: the local admin of a workspace without users, a
    refusal in a workspace with users (there the caller must say who imports)."""
    authorize(ws, current_user(ws) if actor is None else actor, "import")
    return seed_file(ws, path, format=format, dataset=dataset, messages_key=messages_key,
                     reward_key=reward_key, id_key=id_key, skip_invalid=skip_invalid,
                     progress=progress)


def seed_file(ws: Workspace, path: str | Path, *, format: str = "auto", dataset: str | None = None,
              messages_key: str | None = None, reward_key: str | None = None,
              id_key: str | None = None, skip_invalid: bool = False,
              progress: ProgressFn | None = None) -> ImportResult:
    """:func:`import_file` without an acting user, for setting up a workspace: the bundled
    samples an empty workspace is seeded with when it is first opened
    (:func:`core.sample.workspace_setup.ensure_samples`), like the schema migration.  Whatever a
    person imports goes through :func:`import_file`, which checks their role."""
    with gc_paused():  # millions of short-lived dicts: see gc_paused
        return _import_file(ws, Path(path), format=format, dataset=dataset, messages_key=messages_key,
                            reward_key=reward_key, id_key=id_key, skip_invalid=skip_invalid,
                            progress=progress)


def _import_file(ws: Workspace, path: Path, *, format: str, dataset: str | None,
                 messages_key: str | None, reward_key: str | None, id_key: str | None,
                 skip_invalid: bool, progress: ProgressFn | None) -> ImportResult:
    options = _options(messages_key, reward_key, id_key, skip_invalid, progress)
    sha = _file_sha256(path)
    if dataset is not None:
        _check_dataset_name(dataset, str(path))
        row = _already(ws.conn, sha, dataset)
        if row is not None:
            return _noop_result(row, dataset, path, sha)
    doc = open_document(path)
    spool = _RowSpool(ws.root)
    try:
        parsed, batches = _read_rows(doc, format, options)
        for rows in batches:
            spool.add(rows)
        _check_tools(parsed.tools, doc)
        return _store(ws, path, sha, dataset, parsed, spool, {
            "messages_key": messages_key, "reward_key": reward_key, "id_key": id_key,
            "skip_invalid": skip_invalid, "format_requested": format})
    finally:
        spool.close()


def _store(ws: Workspace, path: Path, sha: str, dataset: str | None, parsed: ParsedFile, spool: _RowSpool,
           options: dict[str, Any]) -> ImportResult:
    """Store what :func:`_import_file` read (the rows in ``spool``) in one transaction."""
    dataset = _check_dataset_name(dataset or parsed.default_dataset or path.stem, str(path))
    if not spool.episodes:
        first = f"; first problem: {parsed.rejected[0]['message']}" if parsed.rejected else ""
        raise InputError(f"no episode to import{first}", file=str(path))

    existing_tools = ws.tools(dataset) if ws.has_dataset(dataset) else []
    n_calls, n_invalid, reasons = _count_invalid(_merge_tools(existing_tools, parsed.tools), spool.calls)
    result = ImportResult(
        dataset=dataset, file=str(path), format=parsed.format, episodes=spool.episodes,
        steps=spool.steps, tool_calls=n_calls, invalid_tokens=n_invalid, rejected=parsed.rejected,
        invalid_reasons=reasons, warnings=list(parsed.warnings), file_sha256=sha)

    report: Path | None = None
    try:
        with ws.transaction() as conn:
            row = _already(conn, sha, dataset)  # checked again under the write lock
            if row is not None:
                return _noop_result(row, dataset, path, sha)
            archived = conn.execute("SELECT archived_at FROM datasets WHERE name=?", (dataset,)).fetchone()
            if archived is not None and archived[0] is not None:
                raise InputError(f"dataset '{dataset}' is archived: restore it first, or import into another "
                                 "dataset", field="dataset")
            ws.ensure_dataset(conn, dataset, parsed.domain)
            taken = {r[0] for r in conn.execute("SELECT episode_id FROM episodes WHERE dataset=?",
                                                (dataset,))}
            cur = conn.execute(
                "INSERT INTO imports(dataset, file, file_sha256, format, options, n_episodes, n_steps, "
                "report, at) VALUES (?,?,?,?,?,?,?,?,?)",
                (dataset, str(path), sha, parsed.format, json.dumps(options), result.episodes, result.steps,
                 None, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())))
            assert cur.lastrowid is not None  # an INSERT sets it
            result.import_id = int(cur.lastrowid)
            for episodes, steps in spool.batches():  # a batch at a time, all in this one transaction
                _unique_rows(episodes, taken, result.duplicate_ids, result.renamed)
                ws.insert_rows(conn, dataset, episodes, steps, import_id=result.import_id)
            if result.renamed:
                result.warnings.append(f"{len(result.renamed)} episode(s) renamed because their id "
                                       f"repeated: " + ", ".join(
                                           f"{old!r} -> {new!r}" for new, old in list(result.renamed.items())[:5])
                                       + (" …" if len(result.renamed) > 5 else ""))
            ws.upsert_tools(conn, dataset, parsed.tools)
            if result.rejected:
                report = _write_report(ws, dataset, result.import_id, path, sha, result)
                result.report_path = str(report)
            conn.execute("UPDATE imports SET report=? WHERE id=?", (json.dumps({
                "tool_calls": n_calls, "invalid_tokens": n_invalid,
                "rejected": len(result.rejected), "duplicate_ids": result.duplicate_ids,
                "report_path": result.report_path}), result.import_id))
    except BaseException:
        if report is not None:  # the import was rolled back: its report must not linger
            report.unlink(missing_ok=True)
        raise
    return result


# --------------------------------------------------------------------------- exporting
def export_episodes(ws: Workspace, dataset: str, out: str | Path) -> int:
    """Write ``dataset`` as the workbench's JSON Lines (header with domain and tools, then one
    ``Episode.to_json()`` per line, in import order); returns the number of episodes.

    Importing the file again (format ``rwb``) and exporting gives the same bytes."""
    if not ws.has_dataset(dataset):
        known = ", ".join(d.name for d in ws.datasets()) or "none yet"
        raise InputError(f"no dataset named {dataset!r}; known: {known}", field="dataset")
    out = Path(out)
    if out.is_dir():
        raise InputError("is a folder; give a file name", file=str(out))
    if not out.parent.exists():
        raise InputError("folder does not exist", file=str(out.parent))
    domain = ws.conn.execute("SELECT domain FROM datasets WHERE name=?", (dataset,)).fetchone()[0]
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    n = 0
    try:
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            f.write(dumps_canonical(header_line(domain, ws.tools(dataset))) + "\n")
            # The stored body is the canonical line itself: no re-validation needed.
            for (body,) in ws.conn.execute("SELECT body FROM episodes WHERE dataset=? ORDER BY uid",
                                           (dataset,)):
                f.write(body + "\n")
                n += 1
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return n


# --------------------------------------------------------------------------- look-ups
def single_dataset(ws: Workspace) -> str:
    """The workspace's only dataset (InputError when there are none or several)."""
    names = [d.name for d in ws.datasets()]
    if len(names) == 1:
        return names[0]
    if not names:
        raise InputError("the workspace has no dataset yet; import a file first", field="dataset")
    raise InputError(f"several datasets ({', '.join(names)}); say which with --dataset", field="dataset")


def find_episode(ws: Workspace, episode_id: str, dataset: str | None = None) -> str:
    """The dataset holding ``episode_id`` (checked when given; InputError when absent or
    when the id is in several datasets and none was named)."""
    if dataset is not None:
        if not ws.has_dataset(dataset):
            known = ", ".join(d.name for d in ws.datasets()) or "none yet"
            raise InputError(f"no dataset named {dataset!r}; known: {known}", field="dataset")
        sql = "SELECT dataset FROM episodes WHERE episode_id=? AND dataset=?"
        args: tuple[str, ...] = (episode_id, dataset)
    else:
        sql, args = "SELECT dataset FROM episodes WHERE episode_id=? ORDER BY dataset", (episode_id,)
    found = [r[0] for r in ws.conn.execute(sql, args)]
    if not found:
        where = f" in dataset {dataset!r}" if dataset else ""
        raise InputError(f"no episode {episode_id!r}{where}", field="episode_id")
    if len(found) > 1:
        raise InputError(f"episode {episode_id!r} is in several datasets ({', '.join(found)}); "
                         f"say which with --dataset", field="dataset")
    return found[0]
