"""Rows to store, and reading big ``rwb`` files on the idle cores.

:class:`Rows` is what an import stores (episode rows, step rows, tool calls), a batch at a
time; small files and foreign formats get them in this process (:func:`rows_in_batches`).
A big ``rwb`` file is cut into chunks as it is read, which this process and worker
subprocesses (``python -m core.data.importers.parallel``, JSON over stdin/stdout, no
pickle) validate at the same time (:func:`read_rwb_rows`); results are used in file
order, so errors read as in one process, and a dead worker's chunk is done here.  Only
the chunks in flight are in memory, never the file.

Details: docs/importers.md (## Rows to store, ## Reading big files in parallel).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic_core import from_json, to_json

from core.base.errors import InputError
from core.data.importers.base import (
    Document,
    ParsedFile,
    Prepared,
    RawRecord,
    ReadOptions,
    convert_records,
)
from core.data.importers.rwb import RwbImporter, episode_from_line

#: Files with fewer episode lines than this are read in one process (starting workers costs more than they save).
PARALLEL_MIN_RECORDS = 4000
#: Episode lines per chunk handed to a worker (at most).
CHUNK_RECORDS = 1000
#: Bytes of episode lines per chunk (at most): a chunk ends at whichever comes first.
CHUNK_BYTES = 1024 * 1024
#: Chunks read ahead of the one stored next, per process: what bounds memory.
CHUNKS_AHEAD = 2
#: Bytes of canonical JSON per batch of rows built in this process (the one-process path).
BATCH_BYTES = 1024 * 1024
#: Whether this process takes chunks too (False in tests only, to make the workers do them all).
MAIN_TAKES_CHUNKS = True


def import_workers() -> int:
    """Processes used to read big files: ``$RWB_IMPORT_WORKERS``, else the CPUs the rest of
    the machine leaves idle (CPU count minus the 1-minute load average), 1 to 8.

    Sharing the work costs extra CPU time (a worker's start, chunks and rows moved between
    processes), which only buys wall-clock time when there are idle cores to run on."""
    env = os.environ.get("RWB_IMPORT_WORKERS", "").strip()
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            raise InputError(f"RWB_IMPORT_WORKERS must be a whole number, got {env!r}",
                             field="RWB_IMPORT_WORKERS") from None
    try:
        busy = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average on this platform
        busy = 0.0
    return max(1, min(8, round((os.cpu_count() or 1) - busy)))


#: One logged tool call: (tool, params, raw_arguments, params as stored in the steps table).
Call = tuple[str, dict[str, Any], "str | None", "str | None"]


@dataclass
class Rows:
    """Rows to insert, in file order."""

    #: ``core.records.store.episode_row`` tuples: episode_id first, body last.
    episodes: list[tuple[Any, ...]] = field(default_factory=list)
    #: ``core.records.store.step_rows`` of each episode.
    steps: list[list[tuple[Any, ...]]] = field(default_factory=list)
    #: Every tool-call step (see :data:`Call`).
    calls: list[Call] = field(default_factory=list)
    domains: set[str] = field(default_factory=set)

    def extend(self, other: "Rows") -> None:
        self.episodes += other.episodes
        self.steps += other.steps
        self.calls += other.calls
        self.domains |= other.domains


def _not_json(value: Any) -> Any:
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


_params_chunks = getattr(json.encoder, "c_make_encoder", None)
if _params_chunks is not None:  # built once: json.dumps builds an encoder per call
    _params_chunks = _params_chunks(None, _not_json, json.encoder.encode_basestring, None, ": ", ", ",
                                    True, False, True)


def params_text(params: dict[str, Any]) -> str | None:
    """The ``steps.params`` column: ``json.dumps(params, ensure_ascii=False, sort_keys=True)``,
    or None for no params."""
    if not params:
        return None
    if _params_chunks is None:
        return json.dumps(params, ensure_ascii=False, sort_keys=True)
    return "".join(_params_chunks(params, 0))


# The row builders of core.records.store (episode_row, step_rows) for an episode given as a plain
# dict (``Episode.model_dump()``, what the fast path validates).  Kept here so that import
# workers need not load core.records.store (sqlite-utils loads pandas, a slow start for every worker);
# tests check that both give the same rows.
def episode_row_of(data: dict[str, Any], body: str, content_hash: str) -> tuple[Any, ...]:
    """``core.records.store.episode_row`` of an episode given as a plain dict."""
    outcome, task, source = data["outcome"], data["task"], data["source"]
    resolved = outcome["resolved"]
    return (data["episode_id"], data["domain"], task["task_type"], task["query"], data["behaviour"],
            len(data["steps"]), None if resolved is None else int(resolved), outcome["final_reward"],
            outcome["business_metric"], content_hash, source["file"], source["format"], source["line"],
            body)


def step_rows_of(data: dict[str, Any]) -> list[tuple[Any, ...]]:
    """``core.records.store.step_rows`` of an episode given as a plain dict."""
    return [(s["t"], a["kind"], a["tool"], params_text(a["params"]), s["tool_error"], s["output_text"],
             s["latency_ms"]) for s in data["steps"] for a in (s["action"],)]


def rows_in_batches(items: Iterator[Prepared]) -> Iterator[Rows]:
    """The rows of prepared episodes, in batches of about ``BATCH_BYTES`` of JSON: the
    episode dicts of one batch at most are alive at a time."""
    batch: list[Prepared] = []
    size = 0
    for p in items:
        batch.append(p)
        size += len(p.body)
        if size >= BATCH_BYTES:
            yield rows_of(batch)
            batch, size = [], 0
    if batch:
        yield rows_of(batch)


def rows_of(items: list[Prepared]) -> Rows:
    """The rows of prepared episodes (see :class:`~core.data.importers.base.Prepared`)."""
    rows = Rows()
    for p in items:
        data = p.data
        rows.episodes.append(episode_row_of(data, p.body, p.content_hash))
        steps = step_rows_of(data)
        rows.steps.append(steps)
        rows.calls += [(row[2] or "", s["action"]["params"], s["action"]["raw_arguments"], row[3])
                       for row, s in zip(steps, data["steps"]) if row[1] == "tool_call"]
        rows.domains.add(data["domain"])
    return rows


def convert_rwb_chunk(file: str, items: list[tuple[int, int | None, str]],
                      skip_invalid: bool) -> dict[str, Any]:
    """Validate some episode lines of an rwb file (runs in a worker or in this process).

    Returns plain data: rows, rejected records, or the first error as ``InputError.to_dict()``."""
    doc = Document(Path(file), "jsonl",
                   [RawRecord(None, record, line, text=text, file=file) for record, line, text in items])
    try:
        prepared, rejected = convert_records(
            doc, ReadOptions(skip_invalid=skip_invalid, for_storage=True),
            lambda rec: episode_from_line(doc, rec, for_storage=True), parse=False)
    except InputError as exc:
        return {"error": exc.to_dict()}
    rows = rows_of(prepared)
    return {"episodes": rows.episodes, "steps": rows.steps, "calls": rows.calls,
            "domains": sorted(rows.domains), "rejected": rejected}


def _accepted_lines(items: list[tuple[int, int | None, str]], rejected: list[dict[str, Any]]) -> list[str]:
    """The texts of the chunk's lines that became episodes, in order (one row each)."""
    skipped = {r["record"] for r in rejected}
    return [text for record, _, text in items if record not in skipped]


def _error(d: dict[str, Any]) -> InputError:
    return InputError(d["reason"], file=d["file"], line=d["line"], record=d["record"], field=d["field"])


def _send(stream: Any, header: dict[str, Any], texts: list[str]) -> None:
    """One message: a JSON header line, then the texts as raw UTF-8 (lengths in the header).

    Raw bytes rather than JSON strings: episode lines and bodies are already JSON, and
    escaping them again would cost as much as the work being shared."""
    blobs = [t.encode("utf-8") for t in texts]
    header = dict(header, lengths=[len(b) for b in blobs])
    # pydantic-core's JSON (Rust): the header carries every step row of the chunk, and
    # Python's json costs a good part of what sharing the work saves.  Floats and big
    # ints come back exactly.
    stream.write(to_json(header) + b"\n")
    stream.write(b"".join(blobs))
    stream.flush()


def _receive(stream: Any) -> tuple[dict[str, Any], list[str]] | None:
    """The next message from :func:`_send` (None at end of stream)."""
    line = stream.readline()
    if not line:
        return None
    header = from_json(line)
    data = stream.read(sum(header["lengths"])) if header["lengths"] else b""
    texts, pos = [], 0
    for n in header["lengths"]:
        texts.append(data[pos:pos + n].decode("utf-8"))
        pos += n
    if pos != len(data) or len(data) != sum(header["lengths"]):
        raise OSError("truncated message from import worker")
    return header, texts


class _Worker:
    """One ``python -m core.data.importers.parallel`` subprocess, driven by a thread of ours."""

    def __init__(self) -> None:
        root = str(Path(__file__).resolve().parents[3])  # the folder that holds the core package
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [root, *filter(None, [os.environ.get("PYTHONPATH")])]))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "core.data.importers.parallel"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)

    def convert(self, file: str, items: list[tuple[int, int | None, str]], skip_invalid: bool) -> dict[str, Any]:
        _send(self.proc.stdin, {"file": file, "where": [[r, line] for r, line, _ in items],
                                "skip_invalid": skip_invalid}, [text for _, _, text in items])
        message = _receive(self.proc.stdout)
        if message is None:
            raise OSError("import worker stopped")
        result, bodies = message
        if "error" not in result:
            lines = _accepted_lines(items, result["rejected"])
            for k in result.pop("same"):  # bodies the worker did not send back: see _serve
                bodies[k] = lines[k]
            result["episodes"] = [(*row, body) for row, body in zip(result["episodes"], bodies)]
        return result

    def close(self) -> None:
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


def read_rwb_rows(doc: Document, options: ReadOptions, workers: int) -> tuple[ParsedFile, Iterator[Rows]]:
    """Read an rwb document with up to ``workers`` processes (this one included), a chunk
    of lines at a time as the file is read.

    Same result as the one-process path: the header's domain and tools, rows in file order
    (one :class:`Rows` per chunk), rejected records (``skip_invalid``) in file order in
    the ParsedFile, the first bad record raised.  Workers start once the file has shown
    ``PARALLEL_MIN_RECORDS`` episode lines; the ParsedFile is complete once the rows are."""
    domain, tools, body_doc = RwbImporter().split_header(doc)
    parsed = ParsedFile(format="rwb", episodes=[], tools=tools, domain=domain,
                        default_dataset=doc.path.stem)
    return parsed, _Pipeline(body_doc, options, workers, parsed).rows()


Chunk = list[tuple[int, "int | None", str]]


def _chunks(doc: Document) -> Iterator[Chunk]:
    """The episode lines of ``doc`` as (record, line, text), ``CHUNK_RECORDS`` lines or
    ``CHUNK_BYTES`` bytes at a time."""
    chunk: Chunk = []
    size = 0
    for rec in doc.records:
        text = rec.text or ""
        chunk.append((rec.record, rec.line, text))
        size += len(text)
        if len(chunk) >= CHUNK_RECORDS or size >= CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


class _Pipeline:
    """Chunks read in order, validated by whichever process is free, stored in order.

    Worker threads (one per worker process) take chunks from ``waiting``; this process reads
    the file, and validates a chunk itself while it waits for the next one to store
    (``MAIN_TAKES_CHUNKS``, or when no worker is left).  At most ``CHUNKS_AHEAD`` chunks
    per process are read ahead of the one stored next."""

    def __init__(self, doc: Document, options: ReadOptions, workers: int, parsed: ParsedFile):
        self.doc, self.options, self.workers, self.parsed = doc, options, workers, parsed
        self.cond = threading.Condition()
        self.waiting: deque[int] = deque()  # chunks no process has taken yet
        self.chunks: dict[int, Chunk] = {}  # chunks read and not stored yet
        self.results: dict[int, dict[str, Any] | None] = {}  # None: its worker broke
        self.threads: list[threading.Thread] = []
        self.live = 0  # worker threads still taking chunks
        self.closed = False

    def _start_workers(self) -> None:
        for _ in range(self.workers - 1):
            try:
                worker = _Worker()
            except OSError:  # cannot start a process here: the chunks are all done in this one
                break
            self.threads.append(threading.Thread(target=self._drive, args=(worker,), daemon=True))
            self.live += 1
            self.threads[-1].start()

    def _drive(self, worker: _Worker) -> None:
        try:
            while True:
                with self.cond:
                    while not self.waiting and not self.closed:
                        self.cond.wait()
                    if self.closed:
                        return
                    i = self.waiting.popleft()
                    chunk = self.chunks[i]
                try:
                    result: dict[str, Any] | None = worker.convert(self.doc.name, chunk, self.options.skip_invalid)
                except (OSError, ValueError, KeyError):
                    result = None  # the worker broke: this chunk is done in this process
                with self.cond:
                    self.results[i] = result
                    self.cond.notify_all()
                if result is None:
                    return
        finally:
            worker.close()
            with self.cond:
                self.live -= 1
                self.cond.notify_all()

    def _here(self, i: int) -> dict[str, Any]:
        return convert_rwb_chunk(self.doc.name, self.chunks[i], self.options.skip_invalid)

    def _result(self, i: int) -> dict[str, Any]:
        """Chunk ``i``'s result, validating chunks here while it is not there yet."""
        while True:
            with self.cond:
                if i in self.results:
                    result = self.results.pop(i)
                    break
                if not (self.waiting and (MAIN_TAKES_CHUNKS or self.live == 0)):
                    self.cond.wait()
                    continue
                j = self.waiting.popleft()
            done = self._here(j)
            with self.cond:
                self.results[j] = done
        if result is None:  # its worker failed
            result = self._here(i)
        del self.chunks[i]
        return result

    def _ready(self, i: int) -> bool:
        with self.cond:
            return i in self.results

    def _store(self, i: int, domains: set[str]) -> Rows:
        result = self._result(i)
        if "error" in result:
            raise _error(result["error"])
        self.parsed.rejected += result["rejected"]
        domains.update(result["domains"])
        return Rows([tuple(r) for r in result["episodes"]], [[tuple(s) for s in steps] for steps in result["steps"]],
                    [tuple(c) for c in result["calls"]], set(result["domains"]))

    def rows(self) -> Iterator[Rows]:
        progress = self.options.progress
        domains: set[str] = set()
        chunks = _chunks(self.doc)
        read = stored = lines = 0
        read_error: InputError | None = None
        try:
            while True:
                try:
                    chunk = next(chunks)
                except StopIteration:
                    break
                except InputError as exc:  # a line the reader refuses: the chunks before it first
                    read_error = exc
                    break
                with self.cond:
                    self.chunks[read] = chunk
                    if self.threads:
                        self.waiting.append(read)
                        self.cond.notify()
                if not self.threads:
                    self.results[read] = self._here(read)
                read += 1
                lines += len(chunk)
                if not self.threads and self.workers > 1 and lines >= PARALLEL_MIN_RECORDS:
                    self._start_workers()
                ahead = CHUNKS_AHEAD * max(1, len(self.threads) + 1)
                while stored < read and (read - stored >= ahead or self._ready(stored)):
                    yield self._store(stored, domains)
                    stored += 1
                    if progress is not None:
                        progress(*self.doc.progress(lines))
            while stored < read:
                yield self._store(stored, domains)
                stored += 1
            if read_error is not None:
                raise read_error
        finally:
            with self.cond:
                self.closed = True
                self.cond.notify_all()
            for t in self.threads:
                t.join()
        if progress is not None:
            _, total = self.doc.progress(lines)
            progress(total, total)
        if self.parsed.domain is None and len(domains) == 1:
            self.parsed.domain = domains.pop()


def _serve() -> None:
    """Worker main loop: one chunk per request on stdin, its rows answered on stdout."""
    gc.disable()  # a worker only builds acyclic rows (see core.data.importers.base.gc_paused)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while (message := _receive(stdin)) is not None:
        request, texts = message
        items = [(r, line, text) for (r, line), text in zip(request["where"], texts)]
        result = convert_rwb_chunk(request["file"], items, request["skip_invalid"])
        bodies = []
        if "error" not in result:
            # A line already in canonical form is its own body (an exported file is all
            # such lines): say so instead of sending the same bytes back.
            lines = _accepted_lines(items, result["rejected"])
            bodies = [row[-1] for row in result["episodes"]]
            result["same"] = [k for k, (body, line) in enumerate(zip(bodies, lines)) if body == line]
            for k in result["same"]:
                bodies[k] = ""
            result["episodes"] = [row[:-1] for row in result["episodes"]]
        _send(stdout, result, bodies)


if __name__ == "__main__":
    _serve()
