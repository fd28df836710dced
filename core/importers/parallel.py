"""Rows to store, and reading big ``rwb`` files on every core.

:class:`Rows` is what an import stores: one ``episodes`` row per episode (see
``core.store.episode_row``), its ``steps`` rows, and every tool call (for the action
catalog's INVALID count).  Small files and foreign formats get their rows from the
validated episodes in this process (:func:`rows_of`).

Validation dominates import time (pydantic builds every observation and result), so a big
``rwb`` file is cut into chunks that this process and ``workers - 1`` spawned worker
processes validate at the same time.  The work is shared dynamically: the workers take
chunks from the end of the file, this process from the start, and whichever reaches a
chunk first does it.  Results are consumed in file order, so the first bad record is
reported exactly as the one-process path reports it.  Workers send back plain rows
(text, numbers, lists) — never Episode objects.
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.episodes import Episode
from core.errors import InputError
from core.importers.base import (
    Document,
    ParsedFile,
    RawRecord,
    ReadOptions,
    convert_records,
)

#: Files with fewer episode lines than this are read in one process (workers cost ~1 s to start).
PARALLEL_MIN_RECORDS = 4000
#: Episode lines per chunk handed to a worker.
CHUNK_RECORDS = 1000
#: Whether this process takes chunks the workers have not started (False in tests only,
#: to make the workers do all but the first chunk).
MAIN_TAKES_CHUNKS = True


def import_workers() -> int:
    """Processes used to read big files: ``$RWB_IMPORT_WORKERS`` or the CPU count (≤ 8)."""
    env = os.environ.get("RWB_IMPORT_WORKERS", "").strip()
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            raise InputError(f"RWB_IMPORT_WORKERS must be a whole number, got {env!r}",
                             field="RWB_IMPORT_WORKERS") from None
    return max(1, min(8, os.cpu_count() or 1))


@dataclass
class Rows:
    """Rows to insert, in file order."""

    #: ``core.store.episode_row`` tuples: episode_id first, body last.
    episodes: list[tuple[Any, ...]] = field(default_factory=list)
    #: ``core.store.step_rows`` of each episode.
    steps: list[list[tuple[Any, ...]]] = field(default_factory=list)
    #: (tool, params, raw_arguments) of every tool-call step.
    calls: list[tuple[str, dict[str, Any], str | None]] = field(default_factory=list)
    domains: set[str] = field(default_factory=set)

    def extend(self, other: "Rows") -> None:
        self.episodes += other.episodes
        self.steps += other.steps
        self.calls += other.calls
        self.domains |= other.domains


def rows_of(episodes: list[Episode], bodies: list[tuple[str, str]]) -> Rows:
    """The rows of validated episodes with their ``(canonical body, content hash)``."""
    from core.store import episode_row, step_rows

    rows = Rows()
    for ep, (body, digest) in zip(episodes, bodies):
        rows.episodes.append(episode_row(ep, body, digest))
        rows.steps.append(step_rows(ep))
        rows.calls += [(s.action.tool or "", s.action.params, s.action.raw_arguments)
                       for s in ep.steps if s.action.kind == "tool_call"]
        rows.domains.add(ep.domain)
    return rows


def convert_rwb_chunk(file: str, items: list[tuple[int, int | None, str]],
                      skip_invalid: bool) -> dict[str, Any]:
    """Validate some episode lines of an rwb file (runs in a worker or in this process).

    Returns plain data: rows, rejected records, or the first error as ``InputError.to_dict()``."""
    from core.importers.rwb import episode_from_line

    doc = Document(Path(file), b"", "jsonl",
                   [RawRecord(None, record, line, text=text, file=file) for record, line, text in items])
    try:
        episodes, bodies, rejected = convert_records(
            doc, ReadOptions(skip_invalid=skip_invalid), lambda rec: episode_from_line(doc, rec), parse=False)
    except InputError as exc:
        return {"error": exc.to_dict()}
    rows = rows_of(episodes, bodies)
    return {"episodes": rows.episodes, "steps": rows.steps, "calls": rows.calls,
            "domains": sorted(rows.domains), "rejected": rejected}


def _error(d: dict[str, Any]) -> InputError:
    return InputError(d["reason"], file=d["file"], line=d["line"], record=d["record"], field=d["field"])


def read_rwb_rows(doc: Document, options: ReadOptions, workers: int) -> tuple[ParsedFile, Rows]:
    """Read an rwb document with ``workers`` processes (this one included).

    Same result as the one-process path: header domain and tools, rows in file order,
    rejected records (``skip_invalid``) in file order, the first bad record raised."""
    from core.importers.rwb import RwbImporter

    domain, tools, body_doc = RwbImporter().split_header(doc)
    items = [(r.record, r.line, r.text or "") for r in body_doc.records]
    size = max(1, min(CHUNK_RECORDS, -(-len(items) // (4 * workers))))  # ≥ 4 chunks per process
    chunks = [items[i:i + size] for i in range(0, len(items), size)]
    name = doc.name
    rows, rejected = Rows(), []
    # spawn, not fork: the app calls this from a threaded server, where fork is unsafe.
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=max(1, workers - 1), mp_context=context) as pool:
        futures: list[Future | None] = [None] * len(chunks)
        for i in reversed(range(1, len(chunks))):  # workers start from the end of the file
            futures[i] = pool.submit(convert_rwb_chunk, name, chunks[i], options.skip_invalid)
        try:
            for i, chunk in enumerate(chunks):
                fut = futures[i]
                if fut is None or (MAIN_TAKES_CHUNKS and fut.cancel()):  # not started yet: do it here
                    result = convert_rwb_chunk(name, chunk, options.skip_invalid)
                else:
                    result = fut.result()
                if "error" in result:
                    raise _error(result["error"])
                rows.extend(Rows(result["episodes"], result["steps"],
                                 [tuple(c) for c in result["calls"]], set(result["domains"])))
                rejected += result["rejected"]
                if options.progress is not None:
                    options.progress(sum(len(c) for c in chunks[:i + 1]), len(items))
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    common = next(iter(rows.domains)) if len(rows.domains) == 1 else None
    parsed = ParsedFile(format="rwb", episodes=[], tools=tools, rejected=rejected,
                        domain=domain if domain is not None else common,
                        default_dataset=doc.path.stem)
    return parsed, rows
