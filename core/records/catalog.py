"""Action catalog (docs/design.md §4): tool schemas → discrete ActionTokens, logged call → token.

Every tool becomes one token per parameter preset (``A<tool id>T<preset index>``), after
the three special tokens reply (``R0``), final answer (``F0``) and escalate (``E0``).
Token ids and the catalog ``version`` are stable for the same schemas and presets.
Entry points: :func:`build_catalog` (presets from the schemas and the logged calls, under a
per-tool cap) and :meth:`Catalog.normalize` / :meth:`Catalog.normalize_many` (a logged
call → its token, or INVALID with the reason).

Details: docs/actions.md (## Tokens, ## Preset rules, ## The per-tool cap, ## The
normalizer, ## Example).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from core.records.episodes import Action, Episode, ToolSchema
from core.base.errors import InputError

if TYPE_CHECKING:  # pragma: no cover
    from core.records.store import Workspace

#: Preset value of the catch-all preset ("any value not listed").
OTHER = "<other>"
#: Preset value of "the optional parameter was not given".
UNSET = "<unset>"

CATALOG_FORMAT = 1
RISK_LEVELS = ("low", "medium", "high")

#: Parameter names treated as free text (never learned as presets).
FREE_TEXT_NAMES = re.compile(
    r"(^|_)(query|text|message|messages|content|reason|description|comment|comments|note|notes|"
    r"body|summary|instructions?|prompt|title|address|answer|question|explanation|feedback)($|_)",
    re.IGNORECASE)

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int, float), "number": (int, float), "boolean": (bool,),
    "array": (list, tuple), "object": (dict,), "null": (type(None),),
}


# --------------------------------------------------------------------------- tokens
@dataclass(frozen=True)
class ActionToken:
    """One discrete action of the policy."""

    id: int
    name: str
    kind: str
    tool: str | None
    tool_id: int | None
    preset: dict
    label: str
    risk: str

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "kind": self.kind, "tool": self.tool,
                "tool_id": self.tool_id, "preset": self.preset, "label": self.label,
                "risk": self.risk}


@dataclass
class Normalized:
    """The token of one logged action, or INVALID (``token_id == -1``) with the reason."""

    token_id: int
    valid: bool
    reason: str | None
    tool_known: bool
    args_ok: bool
    #: Catalog tool id of the call (-1 for unknown tools and non-tool actions).
    tool_id: int = -1


@dataclass
class NormalizedBatch:
    """Tokens of many logged actions, as arrays (one entry per action)."""

    token_ids: np.ndarray
    tool_known: np.ndarray
    args_ok: np.ndarray
    reasons: list[str | None]
    #: Catalog tool id per action (-1 for unknown tools and non-tool actions).
    tool_ids: np.ndarray

    @property
    def valid(self) -> np.ndarray:
        return self.token_ids >= 0

    @property
    def n_invalid(self) -> int:
        return int((self.token_ids < 0).sum())

    def __len__(self) -> int:
        return len(self.token_ids)


# --------------------------------------------------------------------------- preset dimensions
_MISSING: Any = object()


def value_key(value: Any) -> tuple[str, Any]:
    """Type-aware key of a parameter value (True ≠ 1, while 3 == 3.0), for preset lookups."""
    if isinstance(value, bool):
        return ("b", value)
    if isinstance(value, (int, float)):
        return ("n", float(value))
    if isinstance(value, str):
        return ("s", value)
    if value is None:
        return ("z", None)
    return ("j", json.dumps(value, sort_keys=True, ensure_ascii=False))


def _fmt_num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _round_edge(x: float) -> float:
    """Three significant digits, so bucket labels read well."""
    if x == 0 or not math.isfinite(x):
        return float(x)
    return float(f"{x:.3g}")


@dataclass(frozen=True)
class PresetDim:
    """One parameter that multiplies a tool's tokens.

    ``kind == "values"``: presets ``values[0..n-1]``, then ``<other>`` when ``other``;
    ``kind == "buckets"``: bucket ``i`` holds ``edges[i-1] <= x < edges[i]``
    (``len(edges) + 1`` buckets).  Both end with ``<unset>`` when ``unset``."""

    param: str
    kind: str
    source: str
    values: tuple[Any, ...] = ()
    other: bool = False
    edges: tuple[float, ...] = ()
    unset: bool = False
    default: Any = _MISSING

    def __post_init__(self) -> None:
        # value → preset index, so mapping a call is a dict lookup, not a scan over values
        object.__setattr__(self, "_index", {value_key(v): i for i, v in reversed(list(enumerate(self.values)))})

    # -- shape
    def n_core(self) -> int:
        return (len(self.values) + int(self.other)) if self.kind == "values" else len(self.edges) + 1

    def size(self) -> int:
        return self.n_core() + int(self.unset)

    def preset_values(self) -> list[Any]:
        """Preset value per index, as it appears in ``ActionToken.preset``."""
        if self.kind == "values":
            out = list(self.values) + ([OTHER] if self.other else [])
        else:
            out = [f"bucket{i}" for i in range(len(self.edges) + 1)]
        return out + ([UNSET] if self.unset else [])

    def preset_labels(self) -> list[str]:
        """Readable text per index (bucket ranges spelled out)."""
        if self.kind == "values":
            out = [v if isinstance(v, str) else json.dumps(v) for v in self.values]
            out += [OTHER] if self.other else []
        else:
            e = self.edges
            out = [f"<{_fmt_num(e[0])}"]
            out += [f"[{_fmt_num(e[i - 1])},{_fmt_num(e[i])})" for i in range(1, len(e))]
            out += [f"≥{_fmt_num(e[-1])}"]
        return out + ([UNSET] if self.unset else [])

    # -- mapping (called once per distinct call; the normalizer caches results)
    def index_of_value(self, value: Any) -> int | None:
        if self.kind == "values":
            try:
                i = self._index.get(value_key(value))  # type: ignore[attr-defined]
            except TypeError:
                i = None
            if i is not None:
                return i
            return len(self.values) if self.other else None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        return bisect.bisect_right(self.edges, float(value))

    def index_absent(self) -> int | None:
        if self.default is not _MISSING:
            return self.index_of_value(self.default)
        if self.unset:
            return self.n_core()
        return None

    def shrunk(self, size: int, frequency: Mapping[tuple[str, Any], int]) -> "PresetDim | None":
        """This dimension cut down to ``size`` presets, or None when it cannot be."""
        core = size - int(self.unset)
        if core < 2:
            return None
        if self.kind == "buckets":
            # Keep evenly spaced edges (the middle one first), so buckets merge pairwise.
            n_edges, m = core - 1, len(self.edges)
            idx = {min(m - 1, max(0, round(i * (m + 1) / (n_edges + 1)) - 1)) for i in range(1, n_edges + 1)}
            edges = tuple(self.edges[i] for i in sorted(idx))
            return PresetDim(self.param, "buckets", self.source, edges=tuple(sorted(set(edges))),
                             unset=self.unset, default=self.default)
        keep_n = core - 1  # one slot for <other>
        order = sorted(range(len(self.values)),
                       key=lambda i: (-frequency.get(value_key(self.values[i]), 0), i))
        keep = sorted(order[:keep_n])
        return PresetDim(self.param, "values", self.source, values=tuple(self.values[i] for i in keep),
                         other=True, unset=self.unset, default=self.default)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"param": self.param, "kind": self.kind, "source": self.source}
        if self.kind == "values":
            d["values"] = list(self.values)
            d["other"] = self.other
        else:
            d["edges"] = list(self.edges)
        d["unset"] = self.unset
        if self.default is not _MISSING:
            d["default"] = self.default
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "PresetDim":
        return cls(param=d["param"], kind=d["kind"], source=d.get("source", "declared"),
                   values=tuple(d.get("values", ())), other=bool(d.get("other", False)),
                   edges=tuple(float(x) for x in d.get("edges", ())),
                   unset=bool(d.get("unset", False)), default=d.get("default", _MISSING))


# --------------------------------------------------------------------------- call validation
@dataclass(frozen=True)
class _ParamCheck:
    name: str
    types: tuple[str, ...] | None
    enum: frozenset | None
    enum_list: tuple[Any, ...] | None
    minimum: float | None
    maximum: float | None
    exclusive_minimum: float | None
    exclusive_maximum: float | None


#: Type names some tool docs use instead of JSON Schema's (BFCL: dict, float, tuple).
_TYPE_ALIASES = {"dict": "object", "float": "number", "tuple": "array", "int": "integer",
                 "str": "string", "bool": "boolean", "list": "array"}


def _schema_types(spec: Mapping[str, Any]) -> tuple[str, ...] | None:
    """The JSON types a parameter accepts, or None when the schema does not say (e.g. "any")."""
    t = spec.get("type")
    names = [t] if isinstance(t, str) else t
    if not isinstance(names, list) or not names:
        return None
    out = tuple(_TYPE_ALIASES.get(x, x) for x in names if isinstance(x, str))
    return out if len(out) == len(names) and all(x in _JSON_TYPES for x in out) else None


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _bounds(spec: Mapping[str, Any]) -> tuple[float | None, float | None, float | None, float | None]:
    """``(minimum, maximum, exclusive minimum, exclusive maximum)``; draft-4 schemas say
    ``exclusiveMinimum: true`` to make ``minimum`` itself exclusive."""
    lo, hi = _num(spec.get("minimum")), _num(spec.get("maximum"))
    xlo, xhi = spec.get("exclusiveMinimum"), spec.get("exclusiveMaximum")
    if xlo is True:
        xlo, lo = lo, None
    if xhi is True:
        xhi, hi = hi, None
    return lo, hi, _num(xlo), _num(xhi)


def _param_check(name: str, spec: Mapping[str, Any]) -> _ParamCheck:
    enum = spec.get("enum")
    lo, hi, xlo, xhi = _bounds(spec)
    return _ParamCheck(
        name=name, types=_schema_types(spec),
        enum=frozenset(value_key(v) for v in enum) if isinstance(enum, list) else None,
        enum_list=tuple(enum) if isinstance(enum, list) else None,
        minimum=lo, maximum=hi, exclusive_minimum=xlo, exclusive_maximum=xhi)


def _type_ok(value: Any, types: tuple[str, ...]) -> bool:
    for t in types:
        if t in ("integer", "number"):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if t == "integer" and isinstance(value, float) and not value.is_integer():
                continue
            return True
        if isinstance(value, _JSON_TYPES[t]) and not (t != "boolean" and isinstance(value, bool)):
            return True
    return False


def json_type_name(value: Any) -> str:
    """The JSON-schema type name of a decoded JSON value (``null`` for None; a tuple is an array)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "array"
    return "object" if isinstance(value, dict) else type(value).__name__


def _short(value: Any, n: int = 60) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= n else text[: n - 1] + "…"


def _check_value(c: _ParamCheck, value: Any) -> str | None:
    if c.types is not None and not _type_ok(value, c.types):
        return (f"type mismatch: param '{c.name}' expects {'|'.join(c.types)}, "
                f"got {json_type_name(value)} {_short(value, 40)}")
    if c.enum is not None:
        try:
            ok = value_key(value) in c.enum
        except TypeError:
            ok = False
        if not ok:
            shown = ", ".join(_short(v, 20) for v in (c.enum_list or ())[:8])
            more = ", …" if c.enum_list and len(c.enum_list) > 8 else ""
            return f"out-of-range value: param '{c.name}' = {_short(value)} is not one of [{shown}{more}]"
    x = _num(value)
    if x is not None:
        if not math.isfinite(x):
            return f"out-of-range value: param '{c.name}' = {value!r} is not a finite number"
        if c.minimum is not None and x < c.minimum:
            return f"out-of-range value: param '{c.name}' = {_fmt_num(x)} < minimum {_fmt_num(c.minimum)}"
        if c.maximum is not None and x > c.maximum:
            return f"out-of-range value: param '{c.name}' = {_fmt_num(x)} > maximum {_fmt_num(c.maximum)}"
        if c.exclusive_minimum is not None and x <= c.exclusive_minimum:
            return (f"out-of-range value: param '{c.name}' = {_fmt_num(x)} ≤ exclusive minimum "
                    f"{_fmt_num(c.exclusive_minimum)}")
        if c.exclusive_maximum is not None and x >= c.exclusive_maximum:
            return (f"out-of-range value: param '{c.name}' = {_fmt_num(x)} ≥ exclusive maximum "
                    f"{_fmt_num(c.exclusive_maximum)}")
    return None


def schema_parts(schema: ToolSchema) -> tuple[dict[str, dict[str, Any]], tuple[str, ...], bool]:
    """``(properties, required, closed)`` of a tool's parameter schema, checked once.

    A malformed schema is refused (naming the tool and field) rather than half-read."""
    params = schema.parameters

    def bad(what: str, fld: str) -> InputError:
        return InputError(f"tool '{schema.name}': {what}", field=f"parameters.{fld}")

    props = params.get("properties", {})
    if props is None:
        props = {}
    if not isinstance(props, dict):
        raise bad("properties must be an object of parameter schemas", "properties")
    for name, spec in props.items():
        if not isinstance(spec, dict):
            raise bad(f"parameter '{name}' must be a JSON schema object", f"properties.{name}")
        if "enum" in spec and (not isinstance(spec["enum"], list) or not spec["enum"]):
            raise bad(f"enum of parameter '{name}' must be a non-empty list", f"properties.{name}.enum")
        for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            if key in spec and _num(spec[key]) is None and not (key.startswith("exclusive")
                                                               and isinstance(spec[key], bool)):
                raise bad(f"{key} of parameter '{name}' must be a number", f"properties.{name}.{key}")
    required = params.get("required", [])
    if required is None:
        required = []
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise bad("required must be a list of parameter names", "required")
    return props, tuple(required), params.get("additionalProperties") is False


@dataclass
class _ToolSpec:
    """Everything the normalizer needs about one tool, precomputed."""

    tool_id: int
    schema: ToolSchema
    dims: tuple[PresetDim, ...]
    checks: dict[str, _ParamCheck]
    required: tuple[str, ...]
    closed: bool  # additionalProperties: false

    @classmethod
    def make(cls, tool_id: int, schema: ToolSchema, dims: tuple[PresetDim, ...]) -> "_ToolSpec":
        props, required, closed = schema_parts(schema)
        checks = {name: _param_check(name, spec) for name, spec in props.items()}
        return cls(tool_id, schema, dims, checks, required, closed)

    def __post_init__(self) -> None:
        self._dim_pos = {d.param: k for k, d in enumerate(self.dims)}
        # Preset index of each dimension when its parameter is absent (None: it must be given).
        self._absent = [d.index_absent() for d in self.dims]
        # Memo per (param, value type, value) → (reason or None, dimension, preset index):
        # a call that is new as a whole is still mostly made of values seen before.
        self._values: dict[Any, tuple[str | None, int, int]] = {}

    def _param_entry(self, name: str, value: Any) -> tuple[str | None, int, int]:
        check = self.checks.get(name)
        if check is None:
            reason = f"unknown param '{name}' for tool '{self.schema.name}'" if self.closed else None
            return reason, -1, -1
        reason = _check_value(check, value)
        if reason is not None:
            return reason, -1, -1
        k = self._dim_pos.get(name)
        if k is None:
            return None, -1, -1
        i = self.dims[k].index_of_value(value)
        if i is None:
            return (f"out-of-range value: param '{name}' = {_short(value)} matches no preset of tool "
                    f"'{self.schema.name}'"), -1, -1
        return None, k, i

    def map_call(self, params: Mapping[str, Any]) -> tuple[str | None, tuple[int, ...]]:
        """``(reason, ())`` for an invalid call, ``(None, preset index)`` for a valid one.

        The reason names the first bad parameter in name order, then the first missing
        required parameter in schema order."""
        values = self._values
        idx = list(self._absent)
        bad: tuple[str, str] | None = None
        for name, value in params.items():
            try:
                key: Any = (name, value.__class__, value)
                entry = values.get(key)
            except TypeError:  # unhashable (list/dict): not memoised
                key, entry = None, None
            if entry is None:
                entry = self._param_entry(name, value)
                if key is not None and len(values) < 65_536:
                    values[key] = entry
            reason, k, i = entry
            if reason is not None:
                if bad is None or name < bad[0]:
                    bad = (name, reason)
            elif k >= 0:
                idx[k] = i
        if bad is not None:
            return bad[1], ()
        for name in self.required:
            if name not in params:
                return f"missing required param '{name}' for tool '{self.schema.name}'", ()
        for dim, preset in enumerate(idx):
            if preset is None:
                return f"missing required param '{self.dims[dim].param}' for tool '{self.schema.name}'", ()
        return None, tuple(idx)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- observed calls
@dataclass
class _ParamStats:
    n: int = 0
    strings: Counter = field(default_factory=Counter)
    numbers: list[float] = field(default_factory=list)
    types: Counter = field(default_factory=Counter)
    scalars: Counter = field(default_factory=Counter)


def _parsed_params(action: Action) -> dict[str, Any] | None:
    """The call's parameters as a dict, or None when the logged arguments do not parse."""
    if action.raw_arguments is None:
        return action.params
    try:
        parsed = json.loads(action.raw_arguments)
    except (ValueError, RecursionError):
        return None
    return parsed if isinstance(parsed, dict) else None


def observed_calls(episodes: Iterable[Episode]) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(tool, params)`` of every parsable logged tool call."""
    for ep in episodes:
        for step in ep.steps:
            a = step.action
            if a.kind == "tool_call" and a.tool:
                params = _parsed_params(a)
                if params is not None:
                    yield a.tool, params


def _collect_stats(calls: Iterable[tuple[str, Mapping[str, Any]]]
                   ) -> tuple[dict[str, int], dict[str, dict[str, _ParamStats]]]:
    n_calls: dict[str, int] = Counter()
    stats: dict[str, dict[str, _ParamStats]] = defaultdict(lambda: defaultdict(_ParamStats))
    for tool, params in calls:
        n_calls[tool] += 1
        for name, value in params.items():
            s = stats[tool][name]
            s.n += 1
            s.types[json_type_name(value)] += 1
            if isinstance(value, str):
                s.strings[value] += 1
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                if math.isfinite(value):
                    s.numbers.append(float(value))
            if isinstance(value, (str, int, float, bool)):
                s.scalars[value_key(value)] += 1
    return n_calls, stats


def _infer_schema(name: str, stats: Mapping[str, _ParamStats]) -> ToolSchema:
    """A schema for a tool seen only in logs: one JSON type per param when the logs agree.

    Nothing is marked required: a few logged calls cannot prove a parameter mandatory."""
    props: dict[str, Any] = {}
    for pname in sorted(stats):
        types = set(stats[pname].types)
        if types <= {"integer"}:
            props[pname] = {"type": "integer"}
        elif types <= {"integer", "number"}:
            props[pname] = {"type": "number"}
        elif len(types) == 1:
            props[pname] = {"type": next(iter(types))}
        else:
            props[pname] = {}
    return ToolSchema(name=name, description="(inferred from logged calls)",
                      parameters={"type": "object", "properties": props},
                      meta={"inferred": True})


# --------------------------------------------------------------------------- building presets
@dataclass(frozen=True)
class CatalogOptions:
    """Knobs of the preset rules (docs/actions.md, "Preset rules")."""

    #: Most presets (tokens) one tool may have.
    max_presets_per_tool: int = 32
    #: Buckets for a numeric parameter.
    numeric_buckets: int = 4
    #: Most frequent logged values kept for a low-cardinality string parameter.
    max_learned_values: int = 8
    #: Logged values needed before presets are learned from them.
    min_support: int = 20
    #: Largest enum kept whole (a longer one keeps its most frequent values + <other>).
    max_enum_values: int = 16

    def to_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in ("max_presets_per_tool", "numeric_buckets",
                                              "max_learned_values", "min_support", "max_enum_values")}


def _optional_extras(spec: Mapping[str, Any], required: bool) -> dict[str, Any]:
    """``unset``/``default`` of a dimension: how an absent parameter maps to a preset."""
    if required:
        return {}
    if "default" in spec:
        return {"default": spec["default"]}
    return {"unset": True}


def _values_dim(param: str, source: str, values: Sequence[Any], other: bool, extras: dict,
                freq: Mapping[tuple[str, Any], int], limit: int) -> PresetDim:
    seen: dict[tuple[str, Any], Any] = {}
    for v in values:
        seen.setdefault(value_key(v), v)
    vals = list(seen.values())
    dim = PresetDim(param, "values", source, values=tuple(vals), other=other, **extras)
    if len(vals) > limit:
        dim = dim.shrunk(limit + int(dim.unset) + 1, freq) or dim
    return dim


def _numeric_edges(spec: Mapping[str, Any], numbers: Sequence[float], opts: CatalogOptions,
                   integer: bool) -> tuple[tuple[float, ...], str] | None:
    lo, hi, xlo, xhi = _bounds(spec)
    lo = lo if lo is not None else xlo  # bucket edges only need the span
    hi = hi if hi is not None else xhi
    n = opts.numeric_buckets
    if n < 2:
        return None
    # Out-of-range logged values are invalid calls: they must not move the buckets.
    numbers = [x for x in numbers if (lo is None or x >= lo) and (hi is None or x <= hi)]
    if len(numbers) >= opts.min_support:
        arr = np.asarray(numbers, dtype=np.float64)
        qs = np.quantile(arr, [i / n for i in range(1, n)])
        source = "quantiles"
    elif lo is not None and hi is not None and hi > lo:
        if lo > 0 and hi / lo >= 1000:
            qs = np.geomspace(lo, hi, n + 1)[1:-1]
        else:
            qs = np.linspace(lo, hi, n + 1)[1:-1]
        source = "range"
    else:
        return None
    # Integer edges stay exact (years, lot sizes); real ones get three significant digits.
    edges = sorted({float(math.ceil(q)) if integer else _round_edge(float(q)) for q in qs})
    # An edge at or below the smallest possible value would leave bucket 0 empty.
    edges = [e for e in edges if (lo is None or e > lo) and (hi is None or e <= hi)]
    if source == "quantiles":
        # Drop edges that would leave a bucket without any logged value (ties, discrete data).
        arr = np.sort(np.asarray(numbers, dtype=np.float64))
        kept: list[float] = []
        for e in edges:
            below = np.searchsorted(arr, e, side="left") - np.searchsorted(
                arr, kept[-1] if kept else -math.inf, side="left")
            if below > 0 and arr[-1] >= e:
                kept.append(e)
        edges = kept
    return (tuple(edges), source) if edges else None


def _candidate_dims(schema: ToolSchema, stats: Mapping[str, _ParamStats], opts: CatalogOptions
                    ) -> list[tuple[tuple[int, int, str], PresetDim]]:
    """Every parameter that could multiply tokens, with its priority (lower = first)."""
    props, required_names, _ = schema_parts(schema)
    required = set(required_names)
    declared = (schema.meta or {}).get("presets") or {}
    if not isinstance(declared, dict):
        raise InputError(f"tool '{schema.name}': meta.presets must be a mapping of param → presets",
                         field="meta.presets")
    out: list[tuple[tuple[int, int, str], PresetDim]] = []
    for pname, spec in props.items():
        st = stats.get(pname) or _ParamStats()
        freq = st.scalars
        extras = _optional_extras(spec, pname in required)
        req_rank = 0 if pname in required else 1
        types = _schema_types(spec) or ()
        dim: PresetDim | None = None
        prio = 9
        if pname in declared:
            d = declared[pname]
            if d is None or d is False or d == []:
                continue
            if isinstance(d, dict) and isinstance(d.get("buckets"), list):
                edges = sorted({float(x) for x in d["buckets"] if _num(x) is not None})
                if edges:
                    dim = PresetDim(pname, "buckets", "declared", edges=tuple(edges), **extras)
            elif isinstance(d, list):
                enum = spec.get("enum")
                complete = isinstance(enum, list) and {value_key(v) for v in enum} <= {value_key(v) for v in d}
                dim = PresetDim(pname, "values", "declared", values=tuple(d), other=not complete, **extras)
            if dim is None:
                raise InputError(f"tool '{schema.name}': meta.presets.{pname} must be a list of values "
                                 f"or {{buckets: [edges]}}", field=f"meta.presets.{pname}")
            prio = 0
        elif isinstance(spec.get("enum"), list) and spec["enum"]:
            dim = _values_dim(pname, "enum", spec["enum"], False, extras, freq, opts.max_enum_values)
            prio = 1
        elif types == ("boolean",):
            dim = PresetDim(pname, "values", "boolean", values=(True, False), **extras)
            prio = 2
        elif types and set(types) <= {"integer", "number"}:
            integer = "integer" in types and "number" not in types
            lo, hi, _, _ = _bounds(spec)
            if (integer and lo is not None and hi is not None and lo.is_integer() and hi.is_integer()
                    and 1 <= hi - lo + 1 <= opts.numeric_buckets):
                dim = PresetDim(pname, "values", "range",
                                values=tuple(range(int(lo), int(hi) + 1)), **extras)
                prio = 2
            else:
                got = _numeric_edges(spec, st.numbers, opts, integer)
                if got:
                    dim = PresetDim(pname, "buckets", got[1], edges=got[0], **extras)
                    prio = 3
        elif (types == ("string",) or not types) and st.strings and "format" not in spec \
                and not FREE_TEXT_NAMES.search(pname):
            n_str = sum(st.strings.values())
            top = sorted(st.strings.items(), key=lambda kv: (-kv[1], kv[0]))[: opts.max_learned_values]
            top = [(v, c) for v, c in top if c >= 2]
            if n_str >= opts.min_support and top and sum(c for _, c in top) >= 0.8 * n_str:
                dim = PresetDim(pname, "values", "logged", values=tuple(v for v, _ in top),
                                other=True, **extras)
                prio = 4
        if dim is not None and dim.size() >= 2:
            out.append(((prio, req_rank, pname), dim))
    return sorted(out, key=lambda x: x[0])


def _choose_dims(schema: ToolSchema, stats: Mapping[str, _ParamStats], opts: CatalogOptions
                 ) -> tuple[PresetDim, ...]:
    """Greedy under the per-tool cap (docs/actions.md, "The per-tool cap")."""
    chosen: list[PresetDim] = []
    product = 1
    for _, dim in _candidate_dims(schema, stats, opts):
        size = dim.size()
        if product * size <= opts.max_presets_per_tool:
            chosen.append(dim)
            product *= size
            continue
        room = opts.max_presets_per_tool // product
        st = stats.get(dim.param) or _ParamStats()
        small = dim.shrunk(room, st.scalars) if room >= 2 else None
        if small is not None and 2 <= small.size() <= room:
            chosen.append(small)
            product *= small.size()
    return tuple(chosen)


# --------------------------------------------------------------------------- the catalog
_SPECIALS = (("R0", "reply", "reply to the user"),
             ("F0", "final_answer", "final answer / terminate"),
             ("E0", "escalate", "escalate to a human"))


class Catalog:
    """Tools × presets + reply/final/escalate, with a normalizer from logged calls.

    Build one with :func:`build_catalog` or :func:`catalog_for_dataset`; save it with
    :meth:`to_json`."""

    reply_id = 0
    final_id = 1
    escalate_id = 2
    #: Bound on the normalizer's memo of distinct calls (cleared when reached).
    CACHE_LIMIT = 262_144

    def __init__(self, tools: Sequence[ToolSchema], dims: Mapping[str, Sequence[PresetDim]], *,
                 options: CatalogOptions | None = None, inferred: bool = False):
        self.options = options or CatalogOptions()
        self.inferred = inferred
        ordered = sorted(tools, key=lambda t: t.name)
        names = [t.name for t in ordered]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise InputError(f"tool names must be unique; repeated: {', '.join(dup)}", field="tools")
        self.tools: dict[str, ToolSchema] = {t.name: t for t in ordered}
        self._specs: dict[str, _ToolSpec] = {
            t.name: _ToolSpec.make(i, t, tuple(dims.get(t.name, ()))) for i, t in enumerate(ordered)}
        self.tokens: list[ActionToken] = []
        self._token_index: dict[tuple[str, tuple[int, ...]], int] = {}
        for name, kind, label in _SPECIALS:
            self.tokens.append(ActionToken(len(self.tokens), name, kind, None, None, {}, label, "low"))
        for spec in self._specs.values():
            self._add_tool_tokens(spec)
        self._by_name = {t.name: t.id for t in self.tokens}
        self._by_tool: dict[str, list[int]] = {}
        for t in self.tokens:
            if t.tool is not None:
                self._by_tool.setdefault(t.tool, []).append(t.id)
        self.version = self._hash()
        self._cache: dict[Any, Normalized] = {}

    def _add_tool_tokens(self, spec: _ToolSpec) -> None:
        tool = spec.schema
        free = [p for p in spec.checks if p not in {d.param for d in spec.dims}]
        values = [d.preset_values() for d in spec.dims]
        labels = [d.preset_labels() for d in spec.dims]
        for t, idx in enumerate(np.ndindex(*[len(v) for v in values]) if values else [()]):
            idx = tuple(int(i) for i in idx)
            preset = {d.param: values[k][i] for k, (d, i) in enumerate(zip(spec.dims, idx))}
            parts = [f"{d.param}={labels[k][i]}" for k, (d, i) in enumerate(zip(spec.dims, idx))]
            if free:
                parts.append("…")
            token = ActionToken(id=len(self.tokens), name=f"A{spec.tool_id}T{t}", kind="tool_call",
                                tool=tool.name, tool_id=spec.tool_id, preset=preset,
                                label=f"{tool.name}({', '.join(parts)})", risk=tool.risk)
            self._token_index[(tool.name, idx)] = token.id
            self.tokens.append(token)

    def _body(self) -> dict[str, Any]:
        return {
            "format": CATALOG_FORMAT,
            "options": self.options.to_dict(),
            "inferred": self.inferred,
            "tools": [{"schema": json.loads(s.schema.model_dump_json()),
                       "dims": [d.to_dict() for d in s.dims]} for s in self._specs.values()],
        }

    def _hash(self) -> str:
        text = json.dumps(self._body(), sort_keys=True, ensure_ascii=False, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    # ----------------------------------------------------------------- lookups
    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    def token(self, name_or_id: str | int) -> ActionToken:
        """The token with this name (``"A12T3"``) or id."""
        if isinstance(name_or_id, int) and not isinstance(name_or_id, bool):
            if not 0 <= name_or_id < len(self.tokens):
                raise InputError(f"no token with id {name_or_id} in catalog {self.version} "
                                 f"({len(self.tokens)} tokens)")
            return self.tokens[name_or_id]
        position = self._by_name.get(name_or_id) if isinstance(name_or_id, str) else None
        if position is None:
            raise InputError(f"no token named {name_or_id!r} in catalog {self.version}")
        return self.tokens[position]

    def tool_id(self, tool: str) -> int:
        return self._specs[tool].tool_id

    def dims(self, tool: str) -> tuple[PresetDim, ...]:
        """The preset dimensions of a tool (parameters that multiply its tokens)."""
        return self._specs[tool].dims

    def tool_tokens(self, tool: str) -> list[int]:
        """Token ids of one tool, in preset order."""
        if tool not in self.tools:
            raise InputError(f"no tool named {tool!r} in catalog {self.version}")
        return list(self._by_tool.get(tool, []))

    def token_for(self, tool: str, preset_index: Sequence[int]) -> int:
        """The token of a tool at a preset index tuple (one index per dimension)."""
        return self._token_index[(tool, tuple(preset_index))]

    # ----------------------------------------------------------------- normalizer
    def _normalize_call(self, tool: str | None, params: dict[str, Any] | None, raw: str | None
                        ) -> Normalized:
        spec = self._specs.get(tool or "")
        if spec is None:
            return Normalized(-1, False, f"unknown tool '{tool}'", False, False)
        if raw is not None:
            try:
                parsed = json.loads(raw)
            except (ValueError, RecursionError):
                return Normalized(-1, False, f"unparsable arguments: {_short(raw, 40)}", True, False,
                                  spec.tool_id)
            if not isinstance(parsed, dict):
                return Normalized(-1, False, f"unparsable arguments: expected a JSON object, got "
                                  f"{json_type_name(parsed)}", True, False, spec.tool_id)
            params = parsed
        reason, idx = spec.map_call(params or {})
        if reason is None:
            return Normalized(self._token_index[(spec.schema.name, idx)], True, None, True, True,
                              spec.tool_id)
        return Normalized(-1, False, reason, True, False, spec.tool_id)

    _SPECIAL_KINDS = {"reply": 0, "final_answer": 1, "terminate": 1, "escalate": 2}

    def _lookup(self, tool: str | None, params: dict[str, Any], raw: str | None) -> Normalized:
        """Memoised :meth:`_normalize_call`, keyed by the call's tool and exact arguments."""
        try:
            # Value types are part of the key so that True, 1 and 1.0 do not share an entry.
            key: Any = (tool, raw, tuple(params.items()), tuple(map(type, params.values())))
            hit = self._cache.get(key)
        except TypeError:  # list/dict values are unhashable: key on their canonical JSON
            key = (tool, raw, json.dumps(params, sort_keys=True, default=str))
            hit = self._cache.get(key)
        if hit is None:
            hit = self._normalize_call(tool, params, raw)
            if len(self._cache) >= self.CACHE_LIMIT:
                self._cache.clear()
            self._cache[key] = hit
        return hit

    def normalize(self, action: Action) -> Normalized:
        """The token of one logged action, or INVALID with the reason."""
        if action.kind != "tool_call":
            return Normalized(self._SPECIAL_KINDS[action.kind], True, None, True, True)
        return self._lookup(action.tool, action.params, action.raw_arguments)

    def normalize_many(self, actions: Sequence[Action]) -> NormalizedBatch:
        """Tokens of many logged actions (memoised per distinct call; no scan over tokens)."""
        n = len(actions)
        token_ids = [0] * n
        tool_ids = [-1] * n
        known = [True] * n
        ok = [True] * n
        reasons: list[str | None] = [None] * n
        specials, lookup, cache = self._SPECIAL_KINDS, self._lookup, self._cache
        for i, a in enumerate(actions):
            kind = a.kind
            if kind != "tool_call":
                token_ids[i] = specials[kind]
                continue
            params = a.params
            try:  # the memo hit of _lookup, inlined: this loop is the hot path
                r = cache.get((a.tool, a.raw_arguments, tuple(params.items()),
                               tuple(map(type, params.values()))))
            except TypeError:
                r = None
            if r is None:
                r = lookup(a.tool, params, a.raw_arguments)
            token_ids[i] = r.token_id
            tool_ids[i] = r.tool_id
            if not r.valid:
                known[i] = r.tool_known
                ok[i] = r.args_ok
                reasons[i] = r.reason
        return NormalizedBatch(np.array(token_ids, np.int64), np.array(known, bool), np.array(ok, bool),
                               reasons, np.array(tool_ids, np.int64))

    # ----------------------------------------------------------------- serialisation
    def to_dict(self) -> dict[str, Any]:
        body = self._body()
        return {"rwb_catalog": CATALOG_FORMAT, "version": self.version, **body,
                "tokens": [t.to_dict() for t in self.tokens]}

    def to_json(self) -> str:
        """The catalog as JSON (tools, preset dimensions, tokens, version)."""
        return json.dumps(self.to_dict(), ensure_ascii=False, indent=1)

    @classmethod
    def from_json(cls, text: str, *, file: str | None = None) -> "Catalog":
        """Rebuild a catalog saved by :meth:`to_json`; a changed file is refused."""
        try:
            d = json.loads(text)
        except ValueError as exc:
            raise InputError(f"catalog is not valid JSON: {exc}", file=file) from None
        if not isinstance(d, dict) or d.get("rwb_catalog") != CATALOG_FORMAT:
            raise InputError("not a Reward Workbench catalog (missing rwb_catalog: 1)", file=file)
        try:
            tools = [ToolSchema.model_validate(t["schema"]) for t in d["tools"]]
            dims = {t["schema"]["name"]: [PresetDim.from_dict(x) for x in t["dims"]] for t in d["tools"]}
            cat = cls(tools, dims, options=CatalogOptions(**d.get("options", {})),
                      inferred=bool(d.get("inferred", False)))
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(f"catalog is malformed: {exc}", file=file) from None
        if cat.version != d.get("version"):
            raise InputError(f"catalog content hashes to {cat.version} but the file says version "
                             f"{d.get('version')}: it was changed by hand or is corrupt", file=file,
                             field="version")
        if "tokens" in d and [t.to_dict() for t in cat.tokens] != d["tokens"]:
            raise InputError("catalog tokens do not match its tools and presets", file=file,
                             field="tokens")
        return cat

    def summary(self) -> "CatalogSummary":
        """Version, counts, every tool and every token."""
        return CatalogSummary(
            version=self.version, n_tools=len(self.tools), n_tokens=len(self.tokens), inferred_tools=self.inferred,
            tools=[CatalogTool(tool_id=s.tool_id, name=n, risk=s.schema.risk,
                               n_presets=int(np.prod([d.size() for d in s.dims])) if s.dims else 1,
                               preset_params=[d.param for d in s.dims])
                   for n, s in self._specs.items()],
            tokens=list(self.tokens))


@dataclass(frozen=True)
class CatalogTool:
    """One tool of a catalog, as :meth:`Catalog.summary` lists it."""

    tool_id: int
    name: str
    #: The risk its schema declares ("low", "medium", "high").
    risk: str
    #: Tokens of the tool: the product of its preset dimensions' sizes (1 without presets).
    n_presets: int
    #: The parameters its presets vary, one per preset dimension.
    preset_params: list[str]


@dataclass(frozen=True)
class CatalogSummary:
    """A catalog's version, counts, tools and tokens (:meth:`Catalog.summary`)."""

    version: str
    n_tools: int
    n_tokens: int
    #: Whether the tools were inferred from logged calls (the dataset had no tool schemas).
    inferred_tools: bool
    tools: list[CatalogTool]
    #: Every action token, in id order.
    tokens: list[ActionToken]


@dataclass(frozen=True)
class ShownCatalog:
    """The catalog of a dataset or a tools file, as ``rwb catalog show`` prints it
    (:func:`show_catalog`): where it comes from, then the fields of :class:`CatalogSummary`."""

    #: "dataset NAME" or the tools file's path.
    source: str
    version: str
    n_tools: int
    n_tokens: int
    #: Whether the tools were inferred from logged calls (the dataset had no tool schemas).
    inferred_tools: bool
    tools: list[CatalogTool]
    #: Every action token, in id order.
    tokens: list[ActionToken]


def build_catalog(tools: Sequence[ToolSchema] | None, episodes: Sequence[Episode] | None = None, *,
                  calls: Iterable[tuple[str, Mapping[str, Any]]] | None = None,
                  options: CatalogOptions | None = None) -> Catalog:
    """The catalog of ``tools``; logged ``episodes`` (or ``calls``) teach presets.

    With no tool schemas, the tools are inferred from the logged calls."""
    opts = options or CatalogOptions()
    all_calls: list[tuple[str, Mapping[str, Any]]] = list(calls or [])
    if episodes is not None:
        all_calls.extend(observed_calls(episodes))
    n_calls, stats = _collect_stats(all_calls)
    inferred = not tools
    schemas = list(tools) if tools else [_infer_schema(n, stats.get(n, {})) for n in sorted(n_calls)]
    dims = {t.name: _choose_dims(t, stats.get(t.name, {}), opts) for t in schemas}
    return Catalog(schemas, dims, options=opts, inferred=inferred)


def _dataset_calls(ws: "Workspace", dataset: str) -> Iterator[tuple[str, dict[str, Any]]]:
    rows = ws.conn.execute(
        """SELECT s.tool, s.params FROM steps s JOIN episodes e ON e.uid = s.episode_uid
           WHERE e.dataset = ? AND s.kind = 'tool_call' AND s.tool IS NOT NULL
           ORDER BY s.episode_uid, s.t""", (dataset,))
    for tool, params in rows:
        p = json.loads(params) if params else {}
        if isinstance(p, dict):
            yield tool, p


def catalog_for_dataset(ws: "Workspace", dataset: str, *, options: CatalogOptions | None = None
                        ) -> Catalog:
    """The catalog of a dataset: its tool schemas (or, when none, the logged calls),
    with presets learned from its logged calls."""
    if not ws.has_dataset(dataset):
        known = ", ".join(d.name for d in ws.datasets()) or "none yet"
        raise InputError(f"no dataset named {dataset!r} in the workspace; known: {known}")
    return build_catalog(ws.tools(dataset), calls=_dataset_calls(ws, dataset), options=options)


# --------------------------------------------------------------------------- coverage
#: Why a logged tool call is off a catalog, from the catalog's point of view.
OFF_CATALOG_KINDS = ("unknown_tool", "outside_presets", "invalid_arguments")


def _off_catalog_kind(tool_known: bool, reason: str | None) -> str:
    """``unknown_tool`` (no such tool in the catalog), ``outside_presets`` (a value the tool's
    schema accepts but no preset holds, see ``_ToolSpec._param_entry``) or
    ``invalid_arguments`` (the call breaks the tool's schema)."""
    if not tool_known:
        return "unknown_tool"
    if reason is not None and "matches no preset of tool" in reason:
        return "outside_presets"
    return "invalid_arguments"


@dataclass(frozen=True)
class OffCatalogCalls:
    """Off-catalog tool calls of one (tool, kind) pair."""

    tool: str | None
    kind: str
    count: int
    #: Of these, calls that are invalid under the episodes' own catalog too (None: not known).
    own_invalid: int | None


@dataclass(frozen=True)
class CatalogCoverage:
    """How much of a set of logged episodes a catalog covers: the tool calls it maps to
    INVALID (off-catalog), by kind, and the (tool, kind) pairs with most of them."""

    catalog_version: str
    n_tokens: int
    episodes: int
    steps: int
    tool_calls: int
    off_catalog: int
    #: Off-catalog calls per kind (every kind of :data:`OFF_CATALOG_KINDS`, zeros included).
    by_kind: dict[str, int]
    #: Off-catalog calls that are invalid under the episodes' own catalog too: the log's own
    #: invalid calls (None when no own catalog was given).
    own_invalid: int | None
    #: Valid calls of the episodes (under their own catalog) that the catalog cannot express.
    foreign_valid: int | None
    top: list[OffCatalogCalls]

    @property
    def share_of_steps(self) -> float:
        return self.off_catalog / self.steps if self.steps else 0.0

    @property
    def share_of_tool_calls(self) -> float:
        return self.off_catalog / self.tool_calls if self.tool_calls else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"catalog_version": self.catalog_version, "n_tokens": self.n_tokens, "episodes": self.episodes,
                "steps": self.steps, "tool_calls": self.tool_calls, "off_catalog": self.off_catalog,
                "share_of_steps": self.share_of_steps, "share_of_tool_calls": self.share_of_tool_calls,
                "by_kind": dict(self.by_kind), "own_invalid": self.own_invalid,
                "foreign_valid": self.foreign_valid,
                "top": [{"tool": t.tool, "kind": t.kind, "count": t.count, "own_invalid": t.own_invalid}
                        for t in self.top]}


def catalog_coverage(episodes: Sequence[Episode], catalog: Catalog, *, own_catalog: Catalog | None = None,
                     top: int = 10) -> CatalogCoverage:
    """The off-catalog tool calls of ``episodes`` mapped onto ``catalog`` (e.g. a run's).

    ``own_catalog`` (the catalog of the episodes' own tools and logs) tells the log's own
    invalid calls (INVALID under it too) from valid calls the catalog cannot express;
    ``top`` bounds the list of (tool, kind) pairs, most calls first.

    Example::

        >>> cov = catalog_coverage(grok_episodes, whissle_run_catalog)  # doctest: +SKIP
        >>> cov.off_catalog, f"{cov.share_of_tool_calls:.1%}", cov.top[0].tool
        (117, '3.4%', 'get_details_by_id')
    """
    actions = [s.action for ep in episodes for s in ep.steps]
    mapped = catalog.normalize_many(actions)
    off = np.flatnonzero(~mapped.valid)
    own_bad = None if own_catalog is None else ~own_catalog.normalize_many([actions[i] for i in off]).valid
    pairs: Counter = Counter()
    pairs_own: Counter = Counter()
    by_kind = dict.fromkeys(OFF_CATALOG_KINDS, 0)
    for j, i in enumerate(off.tolist()):
        kind = _off_catalog_kind(bool(mapped.tool_known[i]), mapped.reasons[i])
        key = (actions[i].tool, kind)
        by_kind[kind] += 1
        pairs[key] += 1
        if own_bad is not None and own_bad[j]:
            pairs_own[key] += 1
    n_own = None if own_bad is None else int(own_bad.sum())
    ranked = sorted(pairs.items(), key=lambda kv: (-kv[1], str(kv[0][0]), kv[0][1]))[: max(0, int(top))]
    return CatalogCoverage(
        catalog_version=catalog.version, n_tokens=len(catalog.tokens), episodes=len(episodes),
        steps=len(actions), tool_calls=sum(a.kind == "tool_call" for a in actions), off_catalog=int(off.size),
        by_kind=by_kind, own_invalid=n_own, foreign_valid=None if n_own is None else int(off.size) - n_own,
        top=[OffCatalogCalls(tool, kind, n, None if own_bad is None else pairs_own[(tool, kind)])
             for (tool, kind), n in ranked])


def load_tools_file(path: str | Path) -> list[ToolSchema]:
    """Tool schemas from a JSON list of OpenAI tools, ``{"tools": [...]}``, or an rwb JSONL
    file whose header carries ``tools``."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(f"cannot read tools file: {exc.strerror}", file=str(p)) from None
    try:
        data: Any = json.loads(text)
    except ValueError:
        first = text.splitlines()[0] if text.strip() else ""
        try:
            data = json.loads(first)
        except ValueError as exc:
            raise InputError(f"not JSON: {exc}", file=str(p), line=1) from None
    if isinstance(data, dict) and "rwb_header" in data:
        data = data["rwb_header"].get("tools") or []
    elif isinstance(data, dict) and "tools" in data:
        data = data["tools"]
    if not isinstance(data, list):
        raise InputError("expected a list of tool schemas (or an object with 'tools')", file=str(p))
    tools = []
    for i, obj in enumerate(data):
        try:
            tools.append(ToolSchema.from_openai(obj))
        except ValueError as exc:
            raise InputError(f"invalid tool schema: {exc}", file=str(p), record=i) from None
    return tools


def show_catalog(ws: "Workspace | None" = None, *, dataset: str | None = None,
                 tools_file: str | Path | None = None) -> ShownCatalog:
    """The catalog of a dataset or of a tools file, summarised for display (``rwb catalog show``)."""
    if (dataset is None) == (tools_file is None):
        raise InputError("give exactly one of --dataset NAME or --tools FILE")
    if tools_file is not None:
        cat = build_catalog(load_tools_file(tools_file))
        source = str(tools_file)
    else:
        if ws is None:
            raise InputError("a workspace is needed to show a dataset's catalog")
        cat = catalog_for_dataset(ws, dataset)  # type: ignore[arg-type]
        source = f"dataset {dataset}"
    summary = cat.summary()
    return ShownCatalog(source=source, **{f.name: getattr(summary, f.name) for f in fields(summary)})
