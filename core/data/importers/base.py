"""The importer contract: one small class per foreign log format, registered by name.

An :class:`Importer` turns the records of one file (a :class:`Document`) into validated
:class:`~core.records.episodes.Episode` objects and their :class:`~core.records.episodes.ToolSchema`
list; it never touches the database (:func:`core.data.importers.import_file` does, in one
transaction).  A new format subclasses :class:`Importer`, implements ``sniff`` and ``read``,
and is added with :func:`register`.  This module also holds the bounded JSON reading and
the canonical episode text every importer shares.

Details: docs/importers.md (## The importer contract, ## Record numbering).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import itertools
import json
import math
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeGuard

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

#: ``progress(done, total)``: called now and then while a file is read and stored.
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


@dataclass
class Document:
    """A file read once: its records (a JSON list, a JSON Lines file or one JSON object)."""

    path: Path
    data: bytes
    layout: str  # "json-list" | "json-object" | "jsonl"
    records: list[RawRecord]

    @property
    def name(self) -> str:
        return str(self.path)

    @property
    def first(self) -> Any:
        """The first record that parsed (None when none did) — what ``sniff`` looks at."""
        for r in self.records:
            if r.error is None:
                return r.value
        return None

    def error(self, message: str, rec: RawRecord | None = None, field: str | None = None) -> InputError:
        """An :class:`InputError` located at ``rec`` (and ``field``) of this file."""
        return InputError(message, file=self.name, line=None if rec is None else rec.line,
                          record=None if rec is None else rec.record, field=field)


def _check_bounds(doc: Document) -> None:
    """Refuse a file with a record nested deeper than ``MAX_JSON_DEPTH`` or, in JSON Lines,
    a line longer than ``MAX_RECORD_BYTES`` — the whole file, before anything is validated
    or stored, naming the record (line) and the JSON path.  Such records are not skipped
    with ``skip_invalid``: JSON Lines records travel as text to the parallel readers."""
    name, data, layout = doc.name, doc.data, doc.layout
    outer = 1 if layout == "json-list" else 0  # the list around the records
    too_long = layout == "jsonl" and len(data) > MAX_RECORD_BYTES
    too_deep = _max_depth(data) > MAX_JSON_DEPTH + outer
    if not (too_long or too_deep):
        return
    text = data.decode("utf-8-sig")
    if layout == "jsonl":
        record = 0
        for lineno, line in enumerate(text.split("\n"), start=1):
            if not line or line.isspace():
                continue
            if too_long and len(line.encode("utf-8", "surrogatepass")) > MAX_RECORD_BYTES:
                raise InputError(f"the line is longer than {MAX_RECORD_BYTES} bytes", file=name,
                                 line=lineno, record=record)
            found = _deep_path(line, MAX_JSON_DEPTH) if too_deep else None
            if found is not None:
                raise InputError(f"nested deeper than {MAX_JSON_DEPTH} levels", file=name, line=lineno,
                                 record=record, field=_json_path(found))
            record += 1
        return
    found = _deep_path(text, MAX_JSON_DEPTH + outer)
    if found is not None:
        record = found.pop(0) if outer else 0
        raise InputError(f"nested deeper than {MAX_JSON_DEPTH} levels", file=name, record=record,
                         field=_json_path(found))


def _json_error_message(exc: json.JSONDecodeError | ValueError | RecursionError) -> str:
    if isinstance(exc, json.JSONDecodeError):
        return f"invalid JSON: {exc.msg} (column {exc.colno})"
    if isinstance(exc, RecursionError):
        return "invalid JSON: nested too deeply"
    return f"invalid JSON: {exc}"


def load_document(path: str | Path, data: bytes | None = None) -> Document:
    """Read ``path`` (or the given bytes) as a JSON list, one JSON object, or JSON Lines.

    A syntax error in a JSON document is fatal (raised, located by line); in a JSON
    Lines file it only spoils that line's record (kept with ``error`` set), so that
    ``skip_invalid`` can import the others.  A record nested deeper than
    ``MAX_JSON_DEPTH``, or a JSON Lines line over ``MAX_RECORD_BYTES``, is fatal too,
    whatever ``skip_invalid`` says (see :func:`_check_bounds`)."""
    doc = _read_document(path, data)
    _check_bounds(doc)
    return doc


def _read_document(path: str | Path, data: bytes | None = None) -> Document:
    path = Path(path)
    if data is None:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise InputError("file not found", file=str(path)) from None
        except IsADirectoryError:
            raise InputError("is a folder; give one file", file=str(path)) from None
        except OSError as exc:
            raise InputError(f"cannot read file: {exc.strerror}", file=str(path)) from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise InputError(f"not UTF-8 text (byte {exc.start})", file=str(path), line=line) from None
    # Look at the text where it starts without copying it (files are often tens of MB).
    start = _NOT_SPACE.search(text)
    if start is None:
        raise InputError("file is empty", file=str(path))
    first = text[start.start()]
    if first == "[":
        try:
            value = loads(text)
        except (ValueError, RecursionError) as exc:
            if isinstance(exc, json.JSONDecodeError) and exc.msg.startswith("Extra data"):
                return _load_jsonl(path, data, text)  # JSON Lines whose records are lists
            error_line = exc.lineno if isinstance(exc, json.JSONDecodeError) else None
            raise InputError(_json_error_message(exc), file=str(path), line=error_line) from None
        return Document(path, data, "json-list",
                        [RawRecord(v, i) for i, v in enumerate(value)])
    if first == "{" and text.find("\n", start.start(), _content_end(text)) >= 0:
        # One pretty-printed object, or JSON Lines?  A whole-document parse decides;
        # JSON Lines fail it right after their first line ("Extra data").
        try:
            return Document(path, data, "json-object", [RawRecord(loads(text), 0)])
        except (ValueError, RecursionError) as exc:
            if not _looks_like_jsonl(text):
                error_line = exc.lineno if isinstance(exc, json.JSONDecodeError) else None
                raise InputError(_json_error_message(exc), file=str(path), line=error_line) from None
    return _load_jsonl(path, data, text)


def _looks_like_jsonl(text: str) -> bool:
    """True when one of the first two non-blank lines is a JSON object on its own."""
    lines = [ln for ln in itertools.islice(_lines(text), 8) if ln.strip()][:2]
    for ln in lines:
        try:
            if isinstance(loads(ln), dict):
                return True
        except (ValueError, RecursionError):
            continue
    return False


def _load_jsonl(path: Path, data: bytes, text: str) -> Document:
    records: list[RawRecord] = []
    # split on "\n" only: str.splitlines would also cut at U+2028 & co., which JSON
    # strings may hold unescaped.
    name = str(path)
    for lineno, line in enumerate(text.split("\n"), start=1):
        if line and not line.isspace():  # not blank (as line.strip(), without the copy)
            records.append(RawRecord(None, len(records), lineno, text=line, file=name))
    return Document(path, data, "jsonl", records)


def _lines(text: str) -> Iterator[str]:
    """The lines of ``text`` (split on "\n"), one at a time."""
    pos = 0
    while True:
        end = text.find("\n", pos)
        if end < 0:
            yield text[pos:]
            return
        yield text[pos:end]
        pos = end + 1


#: The first character that is not whitespace.
_NOT_SPACE = re.compile(r"\S")


def _content_end(text: str) -> int:
    """``len(text.rstrip())``, without copying the text."""
    end = len(text)
    while end > 0:
        tail = text[max(0, end - 4096):end].rstrip()
        if tail:
            return max(0, end - 4096) + len(tail)
        end = max(0, end - 4096)
    return 0


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
    total = len(doc.records)
    step = max(1, total // 100)
    for i, rec in enumerate(doc.records):
        if options.progress is not None and i % step == 0:
            options.progress(i, total)
        if parse and rec.error is not None:
            if not options.skip_invalid:
                raise rec.error
            rejected.append(rec.error.to_dict())
            continue
        yield rec
    if options.progress is not None:
        options.progress(total, total)


class _NotStorable(Exception):
    """``prepare_episode`` met a value json cannot write (the TypeError is its argument)."""


def convert_records(doc: Document, options: ReadOptions,
                    convert: Callable[[RawRecord], Episode | Prepared], parse: bool = True
                    ) -> tuple[list[Prepared], list[dict[str, Any]]]:
    """Apply ``convert`` to each record and prepare what is stored (:func:`prepare_episode`,
    unless ``convert`` already did it on the fast path).

    Returns (prepared episodes, rejected).  Errors raise, or are collected in rejected with
    ``skip_invalid``."""
    items: list[Prepared] = []
    rejected: list[dict[str, Any]] = []
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
        items.append(out)
    return items, rejected


def models_of(items: list[Prepared], options: ReadOptions) -> list[Episode]:
    """The models of prepared episodes for :attr:`ParsedFile.episodes` (none when read for
    storage, where the fast path builds none)."""
    if options.for_storage:
        return []
    return [p.episode if p.episode is not None else Episode.model_validate(p.data) for p in items]


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
