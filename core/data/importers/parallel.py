"""Rows to store, and reading big ``rwb`` files on the idle cores.

:class:`Rows` is what an import stores (episode rows, step rows, tool calls); small files
and foreign formats get them in this process (:func:`rows_of`).  A big ``rwb`` file is cut
into chunks that this process and worker subprocesses (``python -m
core.data.importers.parallel``, JSON over stdin/stdout, no pickle) validate at the same
time (:func:`read_rwb_rows`); results are used in file order, so errors read as in one
process, and a dead worker's chunk is done here.

Details: docs/importers.md (## Rows to store, ## Reading big files in parallel).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
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
#: Episode lines per chunk handed to a worker.
CHUNK_RECORDS = 1000
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
    doc = Document(Path(file), b"", "jsonl",
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


def read_rwb_rows(doc: Document, options: ReadOptions, workers: int) -> tuple[ParsedFile, Rows]:
    """Read an rwb document with ``workers`` processes (this one included).

    Same result as the one-process path: header domain and tools, rows in file order,
    rejected records (``skip_invalid``) in file order, the first bad record raised."""
    domain, tools, body_doc = RwbImporter().split_header(doc)
    items = [(r.record, r.line, r.text or "") for r in body_doc.records]
    size = max(1, min(CHUNK_RECORDS, -(-len(items) // (4 * workers))))  # ≥ 4 chunks per process
    chunks = [items[i:i + size] for i in range(0, len(items), size)]
    name = doc.name
    results: list[dict[str, Any] | None] = [None] * len(chunks)
    lock = threading.Lock()
    bounds = {"front": 0, "back": len(chunks) - 1}

    def take(end: str) -> int | None:
        with lock:
            if bounds["front"] > bounds["back"]:
                return None
            i = bounds[end]
            bounds[end] += 1 if end == "front" else -1
            return i

    def drive(worker: _Worker) -> None:
        try:
            while (i := take("back")) is not None:
                try:
                    results[i] = worker.convert(name, chunks[i], options.skip_invalid)
                except (OSError, ValueError, KeyError):
                    return  # the worker broke: this chunk stays None and is done below
        finally:
            worker.close()

    threads = []
    for _ in range(max(0, workers - 1)):
        try:
            worker = _Worker()
        except OSError:  # cannot start a process here: the chunks are all done in this one
            break
        threads.append(threading.Thread(target=drive, args=(worker,), daemon=True))
        threads[-1].start()
    while MAIN_TAKES_CHUNKS and (i := take("front")) is not None:
        results[i] = convert_rwb_chunk(name, chunks[i], options.skip_invalid)
        if options.progress is not None:
            options.progress(sum(r is not None for r in results) * size, len(items))
    for t in threads:
        t.join()

    rows, rejected = Rows(), []
    for i, result in enumerate(results):
        if result is None:  # its worker failed (or none could start)
            result = convert_rwb_chunk(name, chunks[i], options.skip_invalid)
        if "error" in result:
            raise _error(result["error"])
        rows.extend(Rows([tuple(r) for r in result["episodes"]],
                         [[tuple(s) for s in steps] for steps in result["steps"]],
                         [tuple(c) for c in result["calls"]], set(result["domains"])))
        rejected += result["rejected"]
    if options.progress is not None:
        options.progress(len(items), len(items))
    common = next(iter(rows.domains)) if len(rows.domains) == 1 else None
    parsed = ParsedFile(format="rwb", episodes=[], tools=tools, rejected=rejected,
                        domain=domain if domain is not None else common,
                        default_dataset=doc.path.stem)
    return parsed, rows


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
