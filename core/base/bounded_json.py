"""JSON parsed within fixed bounds: size checked first, nesting measured before any
recursive parser runs, a refusal that names the file, record and JSON path.

Every JSON document a person or a process hands in (episode files, bundle manifests and
signatures, HTTP request bodies, policy indexes) goes through :func:`loads` or the
depth scan here, so a 100,000-level document ends in an :class:`InputError`, never a
``RecursionError``.  The depth scan is vectorised over the bytes (no Python loop per
character), so refusing a large document costs about as much as reading it once.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import numpy as np

from core.base.errors import InputError

#: The bytes that shape JSON once numbers, literals and the text inside strings are gone.
_NOT_STRUCTURE = bytes(c for c in range(256) if c not in b'[]{}"')
_DEPTH_STEP = np.zeros(256, dtype=np.int8)
_DEPTH_STEP[list(b"[{")] = 1
_DEPTH_STEP[list(b"]}")] = -1


def max_depth_of(data: bytes) -> int:
    """Deepest nesting of lists and objects in JSON text, vectorised over the bytes (no
    Python loop per character): escaped backslashes and quotes out, everything but brackets and
    quotes out, then the running sum of the brackets outside strings (after an even
    number of quotes).  Exact for valid JSON; for invalid JSON only a hint (the parser
    reports the real problem; :func:`deep_path` confirms before anything is refused)."""
    if b"\\" in data:
        data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    s = np.frombuffer(data.translate(None, _NOT_STRUCTURE), dtype=np.uint8)
    outside = (np.cumsum(s == ord('"'), dtype=np.int64) & 1) == 0
    steps = np.where(outside, _DEPTH_STEP[s], 0).astype(np.int32)
    return max(0, int(np.cumsum(steps).max(initial=0)))


_JSON_TOKEN = re.compile(r'"(?:[^"\\]+|\\.)*"|[\[\]{},:]')


def deep_path(text: str, limit: int) -> list[Any] | None:
    """The path (keys and indices) to the first list or object nested deeper than
    ``limit`` in JSON ``text``, or None when there is none (the slow, exact walk)."""
    stack: list[list[Any]] = []  # [bracket, key or index of the current member]
    last_string: Any = None
    for m in _JSON_TOKEN.finditer(text):
        tok = m.group()
        if tok == "[" or tok == "{":
            if len(stack) >= limit:
                return [member for _, member in stack]
            stack.append([tok, 0 if tok == "[" else None])
        elif tok == "]" or tok == "}":
            if stack:
                stack.pop()
        elif tok == ",":
            if stack and stack[-1][0] == "[":
                stack[-1][1] += 1
        elif tok == ":":
            if stack:
                stack[-1][1] = last_string
        else:
            try:
                last_string = json.loads(tok)
            except ValueError:
                last_string = tok[1:-1]
    return None


def json_path(path: list[Any]) -> str:
    """``["steps", 0, "observation"]`` -> ``steps[0].observation`` (a deep path keeps its
    first 8 and last 2 steps: ``a.b[0]…[0][0]``)."""
    def text(parts: list[Any], first: bool) -> str:
        out = ""
        for p in parts:
            out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out or not first else str(p))
        return out

    if len(path) > 10:
        return f"{text(path[:8], True)}…{text(path[-2:], False)} ({len(path)} levels)"
    return text(path, True) or "(top)"


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is too large to represent")
    return value


_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float)


def loads(data: bytes | str, *, max_bytes: int, max_depth: int, file: str | None = None,
          record: int | None = None, field: str | None = None) -> Any:
    """``data`` parsed as one JSON document, refused with an :class:`InputError` (naming
    ``file``/``record`` and the JSON path, under ``field`` when given) when it is longer
    than ``max_bytes``, nested deeper than ``max_depth``, not valid JSON, or holds a
    non-finite number.  Size and depth are checked before the parser runs."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    if len(raw) > max_bytes:
        raise InputError(f"{len(raw):,} bytes is more than the {max_bytes:,} allowed", file=file,
                         record=record, field=field)
    if max_depth_of(raw) > max_depth:
        text = raw.decode("utf-8", "replace")
        found = deep_path(text, max_depth)
        where = json_path(found) if found is not None else "(top)"
        if field:
            where = field if where == "(top)" else f"{field}.{where}"
        raise InputError(f"nested deeper than {max_depth} levels", file=file, record=record, field=where)
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InputError(f"not UTF-8 text (byte {exc.start})", file=file, record=record, field=field) from None
    try:
        return _DECODER.decode(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"invalid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})", file=file,
                         record=record, field=field) from None
    except (ValueError, RecursionError) as exc:
        raise InputError(f"invalid JSON: {exc}", file=file, record=record, field=field) from None


def depth_of(value: Any, limit: int) -> int:
    """Nesting of lists, tuples and dicts in an already-built value, counted without
    recursion and stopping once past ``limit`` (so a 100,000-level value costs ``limit``
    steps): ``limit + 1`` means "deeper than limit"."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            children: Any = v.values()
        elif isinstance(v, (list, tuple)):
            children = v
        else:
            continue
        d += 1
        if d > limit:
            return limit + 1
        deepest = max(deepest, d)
        stack.extend((c, d) for c in children)
    return deepest
