"""The importer contract: one small class per foreign log format, registered by name.

An :class:`Importer` turns the records of one file (a :class:`Document`) into validated
:class:`~core.records.episodes.Episode` objects and their :class:`~core.records.episodes.ToolSchema`
list; it never touches the database (:func:`core.data.importers.import_file` does, in one
transaction).  A new format subclasses :class:`Importer`, implements ``sniff`` and ``read``,
and is added with :func:`register`.  This module also holds the reading of files a record
at a time, each bounded before it is parsed (:func:`open_document`), and the canonical
episode text every importer shares.

Details: docs/importers.md (## The importer contract, ## Reading files, ## Record numbering).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import io
import itertools
import json
import math
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, ClassVar, TypeGuard

import numpy as np
from pydantic import ValidationError
from pydantic_core import from_json

from core.records.episodes import MAX_TEXT_CHARS, Episode, ToolSchema, episode_dict
from core.base.bounded_json import deep_path as _deep_path, json_path as _json_path, max_depth_of as _max_depth
from core.base.errors import InputError

#: Largest episode accepted, as canonical JSON in UTF-8 bytes (and largest JSON Lines line).
MAX_RECORD_BYTES = 16 * 1024 * 1024
#: Deepest nesting of lists and objects accepted in one record.
MAX_JSON_DEPTH = 64

#: ``progress(done, total)``: called now and then while a file is read (bytes read of the
#: file's size; records of a file read whole).
ProgressFn = Callable[[int, int], None]


# --------------------------------------------------------------------------- safe JSON
def _reject_constant(name: str) -> Any:
    # Python's json accepts NaN/Infinity by default; they are not JSON and would
    # poison every sum downstream, so a file that holds them is refused.
    raise ValueError(f"non-finite number {name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # e.g. 1e400 overflows to inf
        raise ValueError(f"number {text[:40]} is too large to represent")
    return value


#: Built once: ``json.loads`` with hooks builds a new decoder per call, which costs more
#: than decoding the short texts (tool arguments, results) importers read by the thousand.
_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float)


def loads(text: str | bytes) -> Any:
    """``json.loads`` that refuses NaN, Infinity and numbers that overflow to inf."""
    if not isinstance(text, str):
        return json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    # The C scanner straight away: decode() first and last matches whitespace with a
    # Python-level regex, which costs more than scanning a short text.  Anything but a
    # value filling the whole text takes decode(), for its exact errors.
    try:
        # scan_once is set on every JSONDecoder instance; typeshed does not declare it
        value, end = _DECODER.scan_once(text, 0)  # type: ignore[attr-defined]
    except StopIteration:
        return _DECODER.decode(text)
    if end != len(text):
        return _DECODER.decode(text)
    return value


def dumps_canonical(obj: Any) -> str:
    """The workbench's canonical JSON text (same as ``Episode.to_json``), refusing NaN/inf."""
    return json.dumps(obj, ensure_ascii=False, sort_keys=True, separators=(",", ":"),
                      allow_nan=False)


def _not_json(value: Any) -> Any:
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


#: ``dumps_canonical`` without its per-call set-up (an encoder built once), for the
#: import hot path: returns the text in chunks.  No cycle check: values come from JSON
#: (a cycle would end in RecursionError, which callers treat as "not storable").
_encode_chunks = json.encoder.c_make_encoder(  # type: ignore[attr-defined]
    None, _not_json, json.encoder.encode_basestring, None, ":", ",", True, False, False,
) if getattr(json.encoder, "c_make_encoder", None) is not None else None


def _dumps_fast(value: Any) -> str:
    if _encode_chunks is None:  # no C accelerator: same text, slower
        return dumps_canonical(value)
    return "".join(_encode_chunks(value, 0))


_KEY_TEXT: dict[str, str] = {}


def canonical_text(data: dict[str, Any]) -> tuple[str, str]:
    """``(canonical JSON of an episode dict, its content hash)`` from one dump.

    The canonical text is ``{"k1":v1,"k2":v2,…}`` with keys sorted, so it is assembled from
    one dump per top-level value; the content hash is the sha256 of the same text without
    ``source`` (same content → same hash, wherever it came from).  Raises ValueError on
    NaN/inf anywhere, UnicodeEncodeError (a ValueError too) on unpaired surrogates."""
    parts: list[str] = []
    source = None
    for k in sorted(data):
        head = _KEY_TEXT.get(k)
        if head is None:
            head = _KEY_TEXT[k] = dumps_canonical(k) + ":"
        if k == "source":
            source = len(parts)
        parts.append(head + _dumps_fast(data[k]))
    body = "{" + ",".join(parts) + "}"
    if source is not None:
        parts[source].encode("utf-8")  # refuses unpaired surrogates (the rest: just below)
        del parts[source]
    hashed = ("{" + ",".join(parts) + "}").encode("utf-8")
    return body, hashlib.sha256(hashed).hexdigest()


@dataclass(slots=True)
class Prepared:
    """One validated episode as it is stored.

    ``data`` is the episode as a plain dict, equal to ``Episode.model_dump()`` (what rows
    are made of; :func:`read_file` drops it once the models are built, to save memory);
    ``body`` its canonical JSON (``Episode.to_json()``); ``episode`` the model when one was
    built (by :func:`read_file`, and for the records the fast path could not vouch for)."""

    data: dict[str, Any]
    body: str
    content_hash: str
    episode: Episode | None = None

    @property
    def domain(self) -> str:
        return self.data["domain"] if self.data else self.episode.domain  # type: ignore[union-attr]


def prepare_episode(ep: Episode) -> Prepared:
    """The stored form of a validated :class:`Episode` (the slow, obvious path).

    Dumps in Python mode, so that a NaN/inf anywhere (also where the models do not look,
    e.g. ``source.raw``) is refused rather than written as ``null``."""
    data = ep.model_dump()
    body, digest = canonical_text(data)
    check_record_size(data, body)
    return Prepared(data, body, digest, ep)


class RecordTooLarge(ValueError):
    """An episode over ``MAX_RECORD_BYTES``, or one holding a text over ``MAX_TEXT_CHARS``
    (``field`` says where)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


def check_record_size(data: dict[str, Any], body: str) -> None:
    """Refuse an episode whose canonical ``body`` is over ``MAX_RECORD_BYTES``, or that holds
    a text over ``MAX_TEXT_CHARS`` anywhere (also in the free-form fields: ``source.raw``,
    ``outcome.extra``, …).  A body no longer than ``MAX_TEXT_CHARS`` cannot hold a longer
    text, so only longer ones are walked."""
    if len(body) <= MAX_TEXT_CHARS:
        return
    size = len(body.encode("utf-8", "surrogatepass"))
    if size > MAX_RECORD_BYTES:
        raise RecordTooLarge(f"the episode takes {size} bytes as JSON, more than {MAX_RECORD_BYTES}")
    stack: list[tuple[Any, str]] = [(v, k) for k, v in data.items()]
    while stack:
        v, where = stack.pop()
        if isinstance(v, str) and len(v) > MAX_TEXT_CHARS:
            raise RecordTooLarge(f"text of {len(v)} characters is longer than {MAX_TEXT_CHARS}", where)
        if isinstance(v, dict):
            stack.extend((x, f"{where}.{k}") for k, x in v.items())
        elif isinstance(v, (list, tuple)):
            stack.extend((x, f"{where}[{i}]") for i, x in enumerate(v))


def prepare_fast(data: Any = None, *, json_text: str | None = None) -> Prepared | None:
    """The stored form of one episode validated in a single pydantic-core pass, or None
    when the fast path cannot vouch for it (then validate with :class:`Episode`, which
    locates the problem).  Same result as ``prepare_episode(Episode.model_validate(data))``.

    The models' per-field Python checks are replaced by whole-episode ones: the canonical
    dump refuses NaN/inf anywhere, and a body no longer than ``MAX_TEXT_CHARS`` cannot hold
    a longer text (longer bodies take the model path, which checks each field)."""
    d = episode_dict(data, json_text=json_text)
    if d is None:
        return None
    try:
        body, digest = canonical_text(d)
    except (ValueError, TypeError, RecursionError, OverflowError):
        return None
    if len(body) > MAX_TEXT_CHARS:
        return None
    return Prepared(d, body, digest)


def canonical_body(ep: Episode) -> tuple[str, str]:
    """``(ep.to_json(), ep.content_hash())`` from one dump, refusing what the database
    cannot hold: NaN/inf anywhere (ValueError) and unpaired surrogates (UnicodeEncodeError)."""
    prepared = prepare_episode(ep)
    return prepared.body, prepared.content_hash


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while a file is read and stored.

    An import creates millions of small dicts and lists (acyclic: reference counting frees
    them) and keeps many alive until they are stored; each collection would walk all of
    them again, which costs about a third of the import.  The collector runs again
    afterwards (and collects whatever cycles appeared meanwhile)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


# --------------------------------------------------------------------------- documents
class RawRecord:
    """One record of a file with where it sits; ``error`` when it does not parse.

    JSON Lines records keep their ``text`` and are parsed on first use of ``value`` (the
    ``rwb`` reader validates the text directly and never needs the dict).

    That parse is pydantic-core's (Rust, twice as fast as Python's, same values), which
    refuses NaN and Infinity but reads a number like 1e999 as inf; Python's strict
    :func:`loads` then tells the error of a text that does not parse, and
    :meth:`strict_error` re-reads a record whose conversion failed, so that such a number
    is reported as before ("invalid JSON: … too large").  Nothing non-finite is ever
    stored: the canonical dump refuses it (every importer keeps the record in
    ``source.raw``)."""

    __slots__ = ("record", "line", "text", "file", "_value", "_error", "_parsed", "_checked")

    def __init__(self, value: Any, record: int, line: int | None = None, *,
                 text: str | None = None, file: str | None = None):
        self.record, self.line, self.text, self.file = record, line, text, file
        self._value: Any = value
        self._error: InputError | None = None
        self._parsed = text is None
        self._checked = True  # numbers checked for overflow (by Python's strict parser)

    def _parse(self) -> None:
        self._parsed = True
        try:
            self._value = from_json(self.text or "", allow_inf_nan=False)
            self._checked = False
            return
        except ValueError:
            pass  # Python's parser says precisely what is wrong (or accepts a lone surrogate)
        try:
            self._value = loads(self.text or "")
        except (ValueError, RecursionError) as exc:
            self._error = InputError(_json_error_message(exc), file=self.file, line=self.line,
                                     record=self.record)

    def strict_error(self) -> InputError | None:
        """The error Python's strict parser finds in the text (a number too large), if any:
        what to report when converting the record failed."""
        if self._checked or self.text is None:
            return None
        self._checked = True
        try:
            loads(self.text)
        except (ValueError, RecursionError) as exc:
            return InputError(_json_error_message(exc), file=self.file, line=self.line, record=self.record)
        return None

    @property
    def value(self) -> Any:
        """The parsed JSON value (None when it did not parse; see ``error``)."""
        if not self._parsed:
            self._parse()
        return self._value

    @property
    def error(self) -> InputError | None:
        """Why the record's JSON does not parse, located; None when it does."""
        if not self._parsed:
            self._parse()
        return self._error


#: Bytes read from a file at a time (a JSON list is scanned piece by piece this size).
READ_BYTES = 1 << 18
#: Largest record of a JSON list, and largest file holding one JSON object, in bytes as
#: written (an indented record takes more room than its stored canonical JSON).
MAX_DOCUMENT_RECORD_BYTES = 4 * MAX_RECORD_BYTES
#: What JSON counts as whitespace between values.
_JSON_SPACE = b" \t\r\n"
_BOM = b"\xef\xbb\xbf"


def open_input_file(path: Path) -> BinaryIO:
    """``path`` opened for reading bytes; a missing file, a folder or an unreadable file is an
    :class:`InputError` naming it."""
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise InputError("file not found", file=str(path)) from None
    except IsADirectoryError:
        raise InputError("is a folder; give one file", file=str(path)) from None
    except OSError as exc:
        raise InputError(f"cannot read file: {exc.strerror}", file=str(path)) from None


def _may_nest_deeper(raw: bytes, limit: int) -> bool:
    """Whether JSON text ``raw`` may nest deeper than ``limit``: the vectorised scan of
    :func:`core.base.bounded_json.max_depth_of`, skipped when the text has too few brackets."""
    return raw.count(b"[") + raw.count(b"{") > limit and _max_depth(raw) > limit


def _too_deep(text: str, limit: int) -> str | None:
    """The JSON path of the first list or object of ``text`` nested deeper than ``limit``
    (None when there is none): the exact walk that confirms :func:`_may_nest_deeper`."""
    found = _deep_path(text, limit)
    return None if found is None else _json_path(found)


#: Per byte: a bracket, brace, quote, comma or backslash (what the nesting scan looks at).
_STRUCTURE = np.zeros(256, dtype=bool)
_STRUCTURE[list(b'[]{}",\\')] = True
_NESTING_STEP = np.zeros(256, dtype=np.int64)
_NESTING_STEP[list(b"[{")] = 1
_NESTING_STEP[list(b"]}")] = -1


class _NestingScan:
    """The brackets and commas outside strings of JSON text read piece by piece, with how
    deep each one leaves the text, vectorised (no Python loop per byte); the depth,
    "inside a string" and a pending backslash carry from one piece to the next.

    What the list reader needs to cut a JSON list into records without parsing it
    whole: the commas at depth 0 (relative to where the scan started) and the bracket
    that closes the list.  Exact for valid JSON; for invalid JSON each record's parser
    says what is wrong."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escape_next = False  # the piece before ended on an escaping backslash

    def feed(self, piece: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(offsets, bytes, depth after each) of the piece's brackets and commas outside strings."""
        a = np.frombuffer(piece, dtype=np.uint8)
        pos = np.flatnonzero(_STRUCTURE[a])
        c = a[pos]
        n = len(c)
        carried = self.escape_next and n > 0 and pos[0] == 0  # the piece's first byte is escaped
        self.escape_next = False
        if n == 0:
            return pos, c, np.zeros(0, dtype=np.int64)
        escaped = np.zeros(n, dtype=bool)
        backslash = c == 92
        if backslash.any():
            follows = np.empty(n, dtype=bool)  # right after the element before (element 0: the piece start)
            follows[0] = pos[0] == 0
            follows[1:] = np.diff(pos) == 1
            # In a run of backslashes each escaping one is followed by the one it escapes.
            run_start = backslash.copy()
            run_start[1:] &= ~(backslash[:-1] & follows[1:])
            index = np.arange(n)
            offset = index - np.maximum.accumulate(np.where(run_start, index, 0))
            if carried and backslash[0]:  # a run that began in the piece before: its first is escaped
                offset[np.cumsum(run_start) == 1] += 1
            escaping = backslash & (offset % 2 == 0)
            escaped[1:] = escaping[:-1] & follows[1:]
            self.escape_next = bool(escaping[-1]) and int(pos[-1]) == len(a) - 1
        escaped[0] |= carried
        quote = (c == 34) & ~escaped
        inside = ((np.cumsum(quote) + self.in_string) & 1).astype(bool)
        depth = self.depth + np.cumsum(np.where(inside, 0, _NESTING_STEP[c]))
        self.depth = int(depth[-1])
        self.in_string = bool(inside[-1])
        keep = ~inside & (c != 34) & (c != 92)
        return pos[keep], c[keep], depth[keep]


def _value_end(data: bytes) -> int | None:
    """The offset just past the JSON list or object that opens ``data`` (None when it does
    not end within ``data``)."""
    scan = _NestingScan()
    for base in range(0, len(data), READ_BYTES):
        offsets, _, depth = scan.feed(data[base:base + READ_BYTES])
        closed = np.flatnonzero(depth <= 0)
        if len(closed):
            return base + int(offsets[closed[0]]) + 1
    return None


class RecordStream:
    """The records of a JSON Lines file or of a JSON list, read from the file one at a time
    (memory: one record, whatever the file's size).  Each iteration reads the file again
    from its start; a record nested deeper than ``MAX_JSON_DEPTH``, a line over
    ``MAX_RECORD_BYTES``, bytes that are not UTF-8 and, in a JSON list, a syntax error
    end the iteration with an :class:`InputError` naming the line or record.

    ``position``/``size``: bytes read so far in the current pass, and the file's size."""

    def __init__(self, opener: Callable[[], BinaryIO], name: str, layout: str, size: int, *,
                 start: int = 0, line: int = 1, column: int = 1, skip: int = 0):
        self._opener, self.name, self.layout, self.size = opener, name, layout, size
        # where the records begin: after the list's "[" (a JSON list), the file's start (JSON Lines)
        self._start, self._line, self._column = start, line, column
        self._skip = skip
        self.position = 0

    def after_first(self) -> "RecordStream":
        """The same records but the first (e.g. those after a header line)."""
        return RecordStream(self._opener, self.name, self.layout, self.size, start=self._start,
                            line=self._line, column=self._column, skip=self._skip + 1)

    def __iter__(self) -> Iterator[RawRecord]:
        records = self._jsonl() if self.layout == "jsonl" else self._json_list()
        return itertools.islice(records, self._skip, None) if self._skip else records

    def _jsonl(self) -> Iterator[RawRecord]:
        name = self.name
        self.position = 0
        with self._opener() as f:
            record = 0
            for lineno in itertools.count(1):
                offset = self.position
                # at most one byte past the longest line allowed, so a longer one is never held
                raw = f.readline(MAX_RECORD_BYTES + 1)
                if not raw:
                    return
                self.position += len(raw)
                if lineno == 1 and raw.startswith(_BOM):
                    raw, offset = raw[3:], offset + 3
                if raw.endswith(b"\n"):
                    raw = raw[:-1]
                elif len(raw) > MAX_RECORD_BYTES:
                    raise InputError(f"the line is longer than {MAX_RECORD_BYTES} bytes", file=name,
                                     line=lineno, record=record)
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise InputError(f"not UTF-8 text (byte {offset + exc.start})", file=name,
                                     line=lineno) from None
                if not text or text.isspace():
                    continue
                if _may_nest_deeper(raw, MAX_JSON_DEPTH):
                    where = _too_deep(text, MAX_JSON_DEPTH)
                    if where is not None:
                        raise InputError(f"nested deeper than {MAX_JSON_DEPTH} levels", file=name,
                                         line=lineno, record=record, field=where)
                yield RawRecord(None, record, lineno, text=text, file=name)
                record += 1

    def _json_list(self) -> Iterator[RawRecord]:
        """The list's records, cut at the commas at depth 0 by :class:`_NestingScan`, each
        parsed by itself (Python's strict parser, as a whole list was before)."""
        self.position = self._start
        line, column = self._line, self._column  # where the current record's bytes begin
        with self._opener() as f:
            f.seek(self._start)
            scan = _NestingScan()
            pending = bytearray()  # the current record's bytes read so far
            deepest = 0  # its nesting so far
            record = 0
            record_start = self._start  # its offset in the file
            while True:
                piece = f.read(READ_BYTES)
                if not piece:
                    raise InputError("invalid JSON: the file ends inside the list (no closing ']')",
                                     file=self.name, line=line + pending.count(b"\n"))
                piece_start = self.position
                self.position += len(piece)
                offsets, chars, depth = scan.feed(piece)
                cuts = np.flatnonzero(((chars == 44) & (depth == 0)) | (depth < 0))
                begin, taken = 0, 0  # element and byte where the current record starts in the piece
                for k in cuts.tolist():
                    if k > begin:
                        deepest = max(deepest, int(depth[begin:k].max()))
                    end = int(offsets[k])
                    pending += piece[taken:end]
                    closing = int(depth[k]) < 0
                    if not (closing and record == 0 and not pending.strip(_JSON_SPACE)):  # not "[]"
                        yield self._list_record(bytes(pending), record, deepest, line, column, record_start)
                        record += 1
                    if closing:
                        if chars[k] != ord("]"):
                            raise InputError("invalid JSON: the list is closed by '}'", file=self.name,
                                             line=line + pending.count(b"\n"))
                        self._expect_end(f, piece[end + 1:], line + pending.count(b"\n"))
                        return
                    line, column = _advance(line, column, bytes(pending) + b",")
                    pending = bytearray()
                    deepest = 0
                    begin, taken = k + 1, end + 1
                    record_start = piece_start + taken
                if len(depth) > begin:
                    deepest = max(deepest, int(depth[begin:].max()))
                pending += piece[taken:]
                if len(pending) > MAX_DOCUMENT_RECORD_BYTES:
                    raise InputError(f"a record is longer than {MAX_DOCUMENT_RECORD_BYTES} bytes",
                                     file=self.name, record=record)

    def _list_record(self, raw: bytes, record: int, deepest: int, line: int, column: int,
                     offset: int) -> RawRecord:
        """Record ``record`` of the list: its bytes ``raw`` start at byte ``offset`` of the file,
        on ``line`` and ``column``; ``deepest``: its nesting as the scan measured it."""
        name = self.name
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InputError(f"not UTF-8 text (byte {offset + exc.start})", file=name,
                             line=line + raw[:exc.start].count(b"\n"), record=record) from None
        if deepest > MAX_JSON_DEPTH:
            where = _too_deep(text, MAX_JSON_DEPTH)
            if where is not None:
                raise InputError(f"nested deeper than {MAX_JSON_DEPTH} levels", file=name, record=record,
                                 field=where)
        try:
            return RawRecord(loads(text), record, file=name)
        except (ValueError, RecursionError) as exc:
            if isinstance(exc, json.JSONDecodeError):  # located in the file, not in the record
                at_line = line + exc.lineno - 1
                at_column = exc.colno + (column - 1 if exc.lineno == 1 else 0)
                raise InputError(f"invalid JSON: {exc.msg} (column {at_column})", file=name,
                                 line=at_line, record=record) from None
            raise InputError(_json_error_message(exc), file=name, line=line, record=record) from None

    def _expect_end(self, f: BinaryIO, rest: bytes, line: int) -> None:
        """Only whitespace may follow the list."""
        while True:
            extra = len(rest) - len(rest.lstrip(_JSON_SPACE))
            if extra < len(rest):
                raise InputError("invalid JSON: Extra data after the list", file=self.name,
                                 line=line + rest.count(b"\n", 0, extra))
            line += rest.count(b"\n")
            rest = f.read(READ_BYTES)
            if not rest:
                return


def _advance(line: int, column: int, passed: bytes) -> tuple[int, int]:
    """(line, column) after the bytes ``passed``, from (line, column)."""
    newlines = passed.count(b"\n")
    if not newlines:
        return line, column + len(passed)
    return line + newlines, len(passed) - passed.rfind(b"\n")


class Document:
    """A file's records: a JSON list, a JSON Lines file or one JSON object.

    ``records`` is a list (a file read whole, or a chunk of one) or a :class:`RecordStream`
    that reads them from the file one at a time, again on each pass; either way
    ``for rec in doc.records`` reads them in order."""

    def __init__(self, path: Path, layout: str, records: list[RawRecord] | RecordStream):
        self.path = path
        self.layout = layout  # "json-list" | "json-object" | "jsonl"
        self.records = records
        self._head: list[RawRecord] | None = None
        self._first: tuple[Any] | None = None

    @property
    def name(self) -> str:
        return str(self.path)

    @property
    def head(self) -> list[RawRecord]:
        """The first two records (fewer when the file holds fewer)."""
        if self._head is None:
            self._head = list(itertools.islice(self.records, 2))
        return self._head

    @property
    def first(self) -> Any:
        """The first record that parsed (None when none did) — what ``sniff`` looks at."""
        if self._first is None:
            self._first = (next((r.value for r in self.records if r.error is None), None),)
        return self._first[0]

    def after_first(self) -> "Document":
        """This document without its first record (e.g. a header line)."""
        rest = self.records.after_first() if isinstance(self.records, RecordStream) else self.records[1:]
        return Document(self.path, self.layout, rest)

    def progress(self, index: int) -> tuple[int, int]:
        """``(done, total)`` for a progress bar once ``index`` records were read: records of
        a list, bytes of a streamed file."""
        if isinstance(self.records, RecordStream):
            return self.records.position, self.records.size
        return index, len(self.records)

    def error(self, message: str, rec: RawRecord | None = None, field: str | None = None) -> InputError:
        """An :class:`InputError` located at ``rec`` (and ``field``) of this file."""
        return InputError(message, file=self.name, line=None if rec is None else rec.line,
                          record=None if rec is None else rec.record, field=field)


def _json_error_message(exc: json.JSONDecodeError | ValueError | RecursionError) -> str:
    if isinstance(exc, json.JSONDecodeError):
        return f"invalid JSON: {exc.msg} (column {exc.colno})"
    if isinstance(exc, RecursionError):
        return "invalid JSON: nested too deeply"
    return f"invalid JSON: {exc}"


def open_document(path: str | Path, data: bytes | None = None) -> Document:
    """``path`` (or the given bytes) as a JSON list, one JSON object, or JSON Lines, its
    records read one at a time as they are used (see :class:`RecordStream`): memory holds
    one record, whatever the file's size.  A file holding one JSON object is read whole
    (up to ``MAX_DOCUMENT_RECORD_BYTES``).

    A syntax error in a JSON document is fatal (raised, located by line); in a JSON
    Lines file it only spoils that line's record (kept with ``error`` set), so that
    ``skip_invalid`` can import the others.  A record nested deeper than
    ``MAX_JSON_DEPTH``, a JSON Lines line over ``MAX_RECORD_BYTES`` and bytes that are
    not UTF-8 are fatal too, whatever ``skip_invalid`` says."""
    path = Path(path)
    name = str(path)
    if data is not None:
        size = len(data)

        def opener() -> BinaryIO:
            return io.BytesIO(data)
    else:
        with open_input_file(path) as probe:
            size = os.fstat(probe.fileno()).st_size

        def opener() -> BinaryIO:
            return open_input_file(path)
    with opener() as f:
        layout, start, line, column = _layout(f, name)
        if layout == "json-object":
            whole = _one_object(f, name, start, line)
            if whole is not None:
                return Document(path, layout, [whole])
    if layout == "json-list":
        return Document(path, layout, RecordStream(opener, name, layout, size, start=start, line=line,
                                                   column=column))
    return Document(path, "jsonl", RecordStream(opener, name, "jsonl", size))


def load_document(path: str | Path, data: bytes | None = None) -> Document:
    """:func:`open_document` with every record read into a list (for the small files read
    whole: tau2's side files, BFCL answers, tests)."""
    doc = open_document(path, data)
    if isinstance(doc.records, RecordStream):
        doc.records = list(doc.records)
    return doc


def _layout(f: BinaryIO, name: str) -> tuple[str, int, int, int]:
    """(layout, offset just after a JSON list's "[", its line, its column) of the file ``f``.

    The first JSON value decides: a list or object that ends on its own first line with
    more after it is the first record of a JSON Lines file; a list is otherwise a JSON
    list; an object spread over lines is one JSON object unless one of the first two
    lines is an object by itself (JSON Lines with a bad first line)."""
    offset, lineno = 0, 0
    while True:  # the first line that is not blank
        raw = f.readline(MAX_RECORD_BYTES + 1)
        if not raw:
            raise InputError("file is empty", file=name)
        lineno += 1
        skipped = 3 if lineno == 1 and raw.startswith(_BOM) else 0
        content = raw[skipped:].lstrip(_JSON_SPACE)
        if content and not content.isspace():
            break
        offset += len(raw)
    indent = len(raw) - len(content)
    first = content[:1]
    if first not in (b"[", b"{"):
        return "jsonl", 0, 1, 1
    end = _value_end(content)
    if end is not None:
        more = content[end:].translate(None, _JSON_SPACE) or _more_content(f)
        if first == b"{" or (more and _is_json(content[:end])):
            return "jsonl", 0, 1, 1
        return "json-list", offset + indent + 1, lineno, indent - skipped + 2
    if first == b"[":
        return "json-list", offset + indent + 1, lineno, indent - skipped + 2
    if not raw.endswith(b"\n"):  # one line (or one longer than a record may be): JSON Lines
        return "jsonl", 0, 1, 1
    return "json-object", offset + indent, lineno, indent - skipped + 1


def _is_json(raw: bytes) -> bool:
    """Whether ``raw`` is one JSON value (one nested too deep counts: the line reader refuses it, naming it)."""
    if _may_nest_deeper(raw, MAX_JSON_DEPTH):
        return True
    try:
        loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):
        return False
    return True


def _more_content(f: BinaryIO) -> bool:
    """Whether anything but whitespace is left to read in ``f``."""
    while piece := f.read(READ_BYTES):
        if piece.translate(None, _JSON_SPACE):
            return True
    return False


def _one_object(f: BinaryIO, name: str, start: int, line: int) -> RawRecord | None:
    """The one JSON object a file holds (it opens with an object spread over lines), or None
    when the file is JSON Lines whose first line is bad after all (as before: one of its
    first two lines is an object by itself and the whole is not one object)."""
    f.seek(start)
    data = f.read(MAX_DOCUMENT_RECORD_BYTES + 1)
    if len(data) > MAX_DOCUMENT_RECORD_BYTES:
        if _looks_like_jsonl(f):
            return None
        raise InputError(f"one JSON object of more than {MAX_DOCUMENT_RECORD_BYTES} bytes is not read; "
                         "write one record per line (JSON Lines)", file=name)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"not UTF-8 text (byte {start + exc.start})", file=name,
                         line=line + data[:exc.start].count(b"\n")) from None
    if _may_nest_deeper(data, MAX_JSON_DEPTH):
        where = _too_deep(text, MAX_JSON_DEPTH)
        if where is not None:
            if _looks_like_jsonl(f):
                return None
            raise InputError(f"nested deeper than {MAX_JSON_DEPTH} levels", file=name, record=0, field=where)
    try:
        return RawRecord(loads(text), 0)
    except (ValueError, RecursionError) as exc:
        if _looks_like_jsonl(f):
            return None
        error_line = line + exc.lineno - 1 if isinstance(exc, json.JSONDecodeError) else None
        raise InputError(_json_error_message(exc), file=name, line=error_line) from None


def _looks_like_jsonl(f: BinaryIO) -> bool:
    """True when one of the first two non-blank lines of ``f`` is a JSON object on its own."""
    f.seek(0)
    lines = []
    for _ in range(8):
        raw = f.readline(MAX_RECORD_BYTES + 1)
        if not raw:
            break
        if raw.strip():
            lines.append(raw.removeprefix(_BOM))
        if len(lines) == 2:
            break
    for raw in lines:
        try:
            if isinstance(loads(raw.decode("utf-8")), dict):
                return True
        except (ValueError, RecursionError):
            continue
    return False


# --------------------------------------------------------------------------- options & result
@dataclass
class ReadOptions:
    """How to read a file; the ``*_key`` options are dotted paths into each record."""

    messages_key: str | None = None
    reward_key: str | None = None
    id_key: str | None = None
    skip_invalid: bool = False
    progress: ProgressFn | None = None
    #: Set by ``import_file``: the episodes are only stored, so importers may validate them
    #: on the fast path into plain dicts (:func:`prepare_fast`) and build no models.
    for_storage: bool = False
    #: Set by the chat importers when every value at ``reward_key`` is 0 or 1: the key is a
    #: success flag, so each value sets the outcome's ``resolved`` beside its ``final_reward``.
    reward_is_flag: bool = False


@dataclass
class ParsedFile:
    """What one file holds once read and validated (nothing stored yet)."""

    format: str
    #: The validated models (empty when read for storage: see ``prepared``).
    episodes: list[Episode]
    tools: list[ToolSchema]
    rejected: list[dict[str, Any]] = field(default_factory=list)
    #: Each episode as stored (dict, canonical JSON, content hash), in file order; None
    #: when the importer left them to the caller.
    prepared: list[Prepared] | None = None
    #: Ids that repeated within the file (each later copy was renamed, see ``renamed``).
    duplicate_ids: list[str] = field(default_factory=list)
    #: new id -> original id, for every episode renamed because its id repeated.
    renamed: dict[str, str] = field(default_factory=dict)
    #: Dataset name to use when the caller gives none (the file stem unless the format knows better).
    default_dataset: str | None = None
    #: Domain of the dataset, when the file says (rwb header) or all episodes agree.
    domain: str | None = None
    warnings: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- registry
class Importer(ABC):
    """One foreign log format.  Subclasses are small and stateless."""

    #: Registry name, used by ``--format``.
    format: ClassVar[str]
    #: One line for ``rwb episodes import --help`` and the app.
    description: ClassVar[str]
    #: Which of ``messages_key``/``reward_key``/``id_key`` the format understands.
    accepts_keys: ClassVar[frozenset[str]] = frozenset()

    @abstractmethod
    def sniff(self, doc: Document, options: ReadOptions) -> bool:
        """True when ``doc`` looks like this format (used by ``--format auto``); ``options``
        carries the keys the user gave (``messages_key``…)."""

    @abstractmethod
    def read(self, doc: Document, options: ReadOptions) -> ParsedFile:
        """Convert every record of ``doc``; raise :class:`InputError` on the first bad one
        unless ``options.skip_invalid``, in which case collect it in ``rejected``."""

    def stream(self, doc: Document, options: ReadOptions) -> tuple[ParsedFile, Iterator[Prepared]]:
        """The file's episodes one at a time, as stored (what :func:`import_file` uses, so that
        memory holds one record, not the file).  The :class:`ParsedFile`'s ``tools``,
        ``rejected``, ``domain`` and ``warnings`` are complete once the iterator is
        exhausted; errors are raised as by ``read``.

        This default reads the whole file with ``read``; the formats of big files (``rwb``,
        ``openai``) stream."""
        parsed = self.read(doc, options)
        items = parsed.prepared if parsed.prepared is not None else [prepare_episode(ep) for ep in parsed.episodes]
        parsed.prepared, parsed.episodes = None, []
        return parsed, iter(items)


IMPORTERS: dict[str, Importer] = {}


def register(cls: type[Importer]) -> type[Importer]:
    """Class decorator: make ``cls`` available under ``cls.format``."""
    IMPORTERS[cls.format] = cls()
    return cls


def get_importer(name: str) -> Importer:
    """The importer registered as ``name`` (InputError listing the known ones otherwise)."""
    try:
        return IMPORTERS[name]
    except KeyError:
        known = ", ".join(["auto", *IMPORTERS])
        raise InputError(f"unknown format {name!r}; known formats: {known}",
                         field="format") from None


# --------------------------------------------------------------------------- helpers
_MISSING = object()


def get_path(obj: Any, dotted: str, default: Any = _MISSING) -> Any:
    """``obj["a"]["b"]`` for ``dotted="a.b"``; list items by number (``"turns.0"``).

    A key that itself contains dots is found too (``{"meta.score": 1}``)."""
    if isinstance(obj, dict) and dotted in obj:
        return obj[dotted]
    cur = obj
    for part in dotted.split("."):
        if isinstance(cur, dict) and part in cur:
            cur = cur[part]
        elif isinstance(cur, list) and part.lstrip("-").isdigit() and -len(cur) <= int(part) < len(cur):
            cur = cur[int(part)]
        else:
            if default is _MISSING:
                raise KeyError(dotted)
            return default
    return cur


def validation_to_input_error(exc: ValidationError, doc: Document, rec: RawRecord,
                              field_map: Callable[[tuple[Any, ...]], str] | None = None) -> InputError:
    """The first pydantic error as an :class:`InputError` naming the field."""
    err = exc.errors(include_url=False)[0]
    loc = tuple(err.get("loc", ()))
    if field_map is not None:
        where = field_map(loc)
    else:
        where = loc_to_path(loc)
    msg = str(err.get("msg", "invalid value"))
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    return doc.error(msg, rec, where or None)


def loc_to_path(loc: tuple[Any, ...]) -> str:
    """``("steps", 3, "action", "params")`` -> ``"steps[3].action.params"``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def next_free_id(original: str, taken: set[str]) -> str:
    """``original~2``, ``original~3``… the first not in ``taken``."""
    k = 2
    while f"{original}~{k}" in taken:
        k += 1
    return f"{original}~{k}"


def assign_unique_ids(episodes: list[Episode], taken: set[str]) -> tuple[list[str], dict[str, str]]:
    """Rename every episode whose id is already in ``taken`` (or repeats) to ``id~2``, ``id~3``…

    Never drops nor merges: each episode keeps its place; the renaming is deterministic
    (file order, smallest free suffix).  Returns (the repeated original ids, new -> old)."""
    duplicates: list[str] = []
    renamed: dict[str, str] = {}
    for ep in episodes:
        original = ep.episode_id
        if original not in taken:
            taken.add(original)
            continue
        if original not in duplicates:
            duplicates.append(original)
        new = next_free_id(original, taken)
        ep.episode_id = new
        taken.add(new)
        renamed[new] = original
    return duplicates, renamed


def iter_good_records(doc: Document, options: ReadOptions, rejected: list[dict[str, Any]],
                      parse: bool = True) -> Iterator[RawRecord]:
    """Records that parsed; an unparsable JSON Lines record is raised, or rejected when
    ``options.skip_invalid``.  ``parse=False`` hands the records over unparsed (the
    converter reads ``rec.text`` itself and reports bad JSON)."""
    progress = options.progress
    every = PROGRESS_EVERY if isinstance(doc.records, RecordStream) else max(1, len(doc.records) // 100)
    i = 0
    for i, rec in enumerate(doc.records):
        if progress is not None and i % every == 0:
            progress(*doc.progress(i))
        if parse and rec.error is not None:
            if not options.skip_invalid:
                raise rec.error
            rejected.append(rec.error.to_dict())
            continue
        yield rec
    if progress is not None:
        _, total = doc.progress(i)
        progress(total, total)


#: Records read between two calls of ``progress`` on a streamed file.
PROGRESS_EVERY = 256


class _NotStorable(Exception):
    """``prepare_episode`` met a value json cannot write (the TypeError is its argument)."""


def convert_each(doc: Document, options: ReadOptions, convert: Callable[[RawRecord], Episode | Prepared],
                 rejected: list[dict[str, Any]], parse: bool = True) -> Iterator[Prepared]:
    """Apply ``convert`` to each record and prepare what is stored (:func:`prepare_episode`,
    unless ``convert`` already did it on the fast path), one record at a time.

    Errors raise, or are appended to ``rejected`` with ``skip_invalid``."""
    for rec in iter_good_records(doc, options, rejected, parse):
        try:
            try:
                out = convert(rec)
                if not isinstance(out, Prepared):
                    try:
                        out = prepare_episode(out)
                    except TypeError as exc:  # a Python object json cannot write
                        raise _NotStorable(exc) from None
            except UnicodeEncodeError:
                raise doc.error("text holds an unpaired surrogate (not valid Unicode)", rec) from None
            except RecordTooLarge as exc:
                raise doc.error(str(exc), rec, exc.field) from None
            except (ValueError, RecursionError, OverflowError, _NotStorable) as exc:
                cause = exc.args[0] if isinstance(exc, _NotStorable) else exc
                raise doc.error(f"value cannot be stored as JSON ({type(cause).__name__}: "
                                f"{str(cause)[:80]})", rec) from None
        except InputError as exc:
            # A number too large for a float parses as inf (see RawRecord): that is the
            # error to report, as the strict parser would have before anything else.
            error = rec.strict_error() or exc
            if not options.skip_invalid:
                raise error from None
            rejected.append(error.to_dict())
            continue
        yield out


def convert_records(doc: Document, options: ReadOptions,
                    convert: Callable[[RawRecord], Episode | Prepared], parse: bool = True
                    ) -> tuple[list[Prepared], list[dict[str, Any]]]:
    """:func:`convert_each` into a list: (prepared episodes, rejected)."""
    rejected: list[dict[str, Any]] = []
    items = list(convert_each(doc, options, convert, rejected, parse))
    return items, rejected


def models_of(items: list[Prepared], options: ReadOptions) -> list[Episode]:
    """The models of prepared episodes for :attr:`ParsedFile.episodes` (none when read for
    storage, where the fast path builds none)."""
    if options.for_storage:
        return []
    return [p.episode if p.episode is not None else Episode.model_validate(p.data) for p in items]


def read_whole(streamed: tuple[ParsedFile, Iterator[Prepared]], options: ReadOptions) -> ParsedFile:
    """A streamed file (:meth:`Importer.stream`) read whole: ``prepared`` and the models."""
    parsed, items = streamed
    parsed.prepared = list(items)
    parsed.episodes = models_of(parsed.prepared, options)
    return parsed


def common_domain(episodes: list[Episode] | list[Prepared]) -> str | None:
    """The domain shared by all episodes, or None when they differ (or there are none)."""
    domains = {ep.domain for ep in episodes}
    return domains.pop() if len(domains) == 1 else None


def check_keys_supported(importer: Importer, options: ReadOptions) -> None:
    """Refuse ``--messages-key`` & co. for formats that have no use for them (no silent ignore)."""
    for name in ("messages_key", "reward_key", "id_key"):
        if getattr(options, name) is not None and name not in importer.accepts_keys:
            flag = "--" + name.replace("_", "-")
            raise InputError(f"{flag} does not apply to format {importer.format!r}; it is for "
                             f"the openai formats", field=name)


def dedupe_tools(tools: list[ToolSchema]) -> list[ToolSchema]:
    """Tools by name, first definition wins, order kept."""
    seen: dict[str, ToolSchema] = {}
    for t in tools:
        seen.setdefault(t.name, t)
    return list(seen.values())


def is_finite_number(v: Any) -> TypeGuard[int | float]:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
