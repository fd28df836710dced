"""The one way a result becomes JSON: :func:`to_jsonable` and :func:`dumps`.

Public functions return frozen dataclasses (a run, a report, a decision); the CLI's
``--json``, the HTTP service and the pages' downloads turn them into JSON here and
nowhere else, so a field added to a result appears in every output at once.  Dataclasses,
pydantic models, mappings, collections, enums, paths, times, bytes and numpy values are
converted recursively; anything else becomes its ``str()``; NaN and ±infinity are written
as ``NaN`` and ``Infinity`` rather than ``null``.

Details: docs/results.md (## Conversion rules, ## Numbers that are not numbers).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import enum
import json
from collections.abc import Mapping
from pathlib import PurePath
from typing import Any, TypeAlias

#: Field metadata key naming a dataclass field in JSON when its own name cannot be the key:
#: ``return_: float = field(metadata={JSON_NAME: "return"})`` is written as ``"return"``
#: (a Python keyword is no field name).
JSON_NAME = "json_name"
#: What :func:`to_jsonable` returns: the values :func:`json.dumps` writes without help.
JSONValue: TypeAlias = "dict[str, JSONValue] | list[JSONValue] | str | int | float | bool | None"


def _numpy_value(obj: Any) -> tuple[bool, JSONValue]:
    """``(True, value)`` when ``obj`` is a numpy scalar or array, ``(False, None)`` otherwise.

    numpy is imported only when a value's type comes from it, so that serialising a plain
    result does not load it."""
    if type(obj).__module__ != "numpy":
        return False, None
    import numpy as np

    if isinstance(obj, np.ndarray):
        return True, to_jsonable(obj.tolist())
    if isinstance(obj, np.generic):
        return True, to_jsonable(obj.item())
    return False, None


def _sorted_members(members: set[Any] | frozenset[Any]) -> list[Any]:
    try:
        return sorted(members)
    except TypeError:  # members of mixed or unordered types keep the set's own order
        return list(members)


def _key(key: Any) -> str:
    """A mapping key as JSON writes it: ``True`` → ``"true"``, ``None`` → ``"null"``, ``2`` → ``"2"``."""
    if isinstance(key, str):
        return str(key)
    if key is None or isinstance(key, (bool, int, float)):
        return json.dumps(key)
    return str(key)


def to_jsonable(obj: Any) -> JSONValue:
    """``obj`` as values :func:`json.dumps` writes as they are (docs/results.md, "Conversion rules").

    >>> from dataclasses import dataclass
    >>> @dataclass(frozen=True)
    ... class Run:
    ...     name: str
    ...     reward: float
    >>> to_jsonable({"runs": [Run("a", 1.5)]})
    {'runs': [{'name': 'a', 'reward': 1.5}]}
    """
    if isinstance(obj, enum.Enum):
        return to_jsonable(obj.value)
    if obj is None:
        return None
    if isinstance(obj, bool):
        return bool(obj)
    if isinstance(obj, str):
        return str(obj)
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):  # numpy.float64 among them
        return float(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.metadata.get(JSON_NAME, f.name): to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {_key(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, (set, frozenset)):
        return [to_jsonable(v) for v in _sorted_members(obj)]
    if isinstance(obj, PurePath):
        return str(obj)
    if isinstance(obj, (_dt.datetime, _dt.date, _dt.time)):
        return obj.isoformat()
    if isinstance(obj, (bytes, bytearray)):
        return bytes(obj).hex()
    is_numpy, value = _numpy_value(obj)
    if is_numpy:
        return value
    model_dump = getattr(obj, "model_dump", None)  # a pydantic model
    if callable(model_dump):
        return to_jsonable(model_dump(mode="json"))
    return str(obj)


def dumps(obj: Any) -> str:
    """``obj`` as one line of JSON text (UTF-8 characters kept as they are, not escaped)."""
    return json.dumps(to_jsonable(obj), ensure_ascii=False)
