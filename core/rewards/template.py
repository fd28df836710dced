"""Reward pyramid templates: YAML in, a validated immutable :class:`Template` out.

A template names the pyramid's levels (L1 base … L4 business) with their components and
weights, the penalties, the episode terms that make up ``R_final``, the gating switch, the
episode return ``a·Σγ^i r_i + b·R_final``, weight schedules and expectations.
:func:`parse_template` and :func:`load_template` read one; every validation error names
the key and the line.

Details: docs/rewards.md (## Template format).
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import json
import math
import types
import typing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Mapping

import yaml

from core.base import package_data
from core.base import safe_yaml
from core.base.errors import InputError
from core.rewards.components import COMPONENTS, LEVEL_TITLES, LEVELS, MAX_TEMPLATE_NUMBER

FORMAT_VERSION = 1
RESERVED_NAMES = {"episode_id", "t", "action", "kind", "tool", "total", "penalties", "return",
                  "discounted", "final", "n_steps", *LEVELS}
TOP_KEYS = ("version", "name", "description", "return", "gating", "levels", "penalties",
            "episode_terms", "schedules", "expectations")
COMPONENT_KEYS = ("component", "weight", "params", "description")
LEVEL_KEYS = ("title", "gate", "components")

# Expectation kinds and the keys each accepts (required keys first, then optional).
EXPECTATION_KINDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "episode_score": (("episodes",), ("below", "above", "metric")),
    "component_range": (("component",), ("steps", "max", "min", "value")),
    "twins_rank": ((), ("episodes", "twin_key", "margin", "metric")),
    "rank_auc": (("higher", "lower", "min"), ("metric",)),
}
EPISODE_FILTER_KEYS = ("episode_id", "behaviour", "task_type", "domain", "resolved")
STEP_FILTER_KEYS = EPISODE_FILTER_KEYS + ("kind", "tool", "t", "tool_error", "valid",
                                          "output_contains", "tool_result_contains", "last")
METRICS = ("return", "discounted", "final")


class TemplateError(InputError):
    """A template that cannot be used, with the key and line of the problem."""

    def __init__(self, message: str, *, file: str | None = None, line: int | None = None,
                 field: str | None = None):
        super().__init__(message, file=file, line=line, field=field)
        # the message already says "at line N" the way an analyst reads it; keep the file in front
        self.args = (f"{file}: {message}" if file else message,)


class TemplateOutOfBounds(TemplateError):
    """A template refused by a bound rather than a mistake of form: a number outside its range
    (:data:`NUMBER_RULE`, a weight's, a gate's or a parameter's declared range; NaN and
    infinities included), or a document too large, too deep or with aliases
    (:mod:`core.base.safe_yaml`).  A save refused this way is written to
    the security log (:func:`core.rewards.versions.save_template`)."""


# --------------------------------------------------------------------------- value types
@dataclass(frozen=True)
class ComponentSpec:
    """One component of a template: column name, registered class, weight, parameters."""

    name: str
    component: str
    weight: float
    params: Mapping[str, Any]
    group: str                   # level key ("L1" …), "penalty" or "episode"
    description: str = ""
    line: int | None = field(default=None, compare=False)

    def params_with_defaults(self) -> dict[str, Any]:
        """Parameters as the component sees them (defaults filled in)."""
        return build_component(self).params()

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.component != self.name:
            out["component"] = self.component
        out["weight"] = self.weight
        if self.params:
            out["params"] = copy.deepcopy(dict(self.params))
        if self.description:
            out["description"] = self.description
        return out


@dataclass(frozen=True)
class LevelSpec:
    """A pyramid level: key (L1…L4), title, gate threshold and its components."""

    key: str
    title: str
    gate: float | None
    components: tuple[ComponentSpec, ...]


@dataclass(frozen=True)
class ExpectationSpec:
    """One expectation (reward unit test): name, kind and the kind's fields."""

    name: str
    kind: str
    fields: Mapping[str, Any]
    description: str = ""
    line: int | None = field(default=None, compare=False)

    def to_dict(self) -> dict[str, Any]:
        out = {"name": self.name, "kind": self.kind, **copy.deepcopy(dict(self.fields))}
        if self.description:
            out["description"] = self.description
        return out


@dataclass(frozen=True)
class Template:
    """A validated reward pyramid (immutable; ``with_*`` return edited copies)."""

    name: str
    description: str
    levels: tuple[LevelSpec, ...]
    penalties: tuple[ComponentSpec, ...]
    episode_terms: tuple[ComponentSpec, ...]
    gating: bool = True
    a: float = 0.7
    b: float = 0.3
    gamma: float = 0.95
    schedules: Mapping[str, tuple[tuple[int, float], ...]] = field(default_factory=dict)
    expectations: tuple[ExpectationSpec, ...] = ()
    version: int = FORMAT_VERSION
    source: str | None = field(default=None, compare=False)

    # ------------------------------------------------------------------ views
    @property
    def step_components(self) -> tuple[ComponentSpec, ...]:
        """Level components (in level order) then penalties: the columns of the step matrix."""
        return tuple(c for lv in self.levels for c in lv.components) + self.penalties

    @property
    def all_components(self) -> tuple[ComponentSpec, ...]:
        return self.step_components + self.episode_terms

    def component(self, name: str) -> ComponentSpec:
        for c in self.all_components:
            if c.name == name:
                return c
        raise TemplateError(f"no component named {name!r} in template {self.name!r}; "
                            f"known: {', '.join(c.name for c in self.all_components)}",
                            file=self.source)

    def weights(self) -> dict[str, float]:
        """Current weight of every component, by name."""
        return {c.name: c.weight for c in self.all_components}

    def weights_at(self, training_step: int) -> dict[str, float]:
        """Weights at a training step: scheduled components interpolate linearly between their
        (step, weight) points and hold the end values outside them."""
        weights = self.weights()
        for name, points in self.schedules.items():
            steps = [p[0] for p in points]
            values = [p[1] for p in points]
            weights[name] = float(_interp(training_step, steps, values))
        return weights

    # ------------------------------------------------------------------ edits
    def _map_components(self, fn) -> "Template":
        levels = tuple(replace(lv, components=tuple(fn(c) for c in lv.components)) for lv in self.levels)
        return replace(self, levels=levels, penalties=tuple(fn(c) for c in self.penalties),
                       episode_terms=tuple(fn(c) for c in self.episode_terms))

    def with_weights(self, weights: Mapping[str, float]) -> "Template":
        """A copy with some weights changed (unknown names and bad weights are refused)."""
        known = {c.name for c in self.all_components}
        for name, w in weights.items():
            if name not in known:
                raise TemplateError(f"no component named {name!r}; known: {', '.join(sorted(known))}",
                                    file=self.source)
            _check_weight(w, f"weight of {name!r}", None, self.source)
        return self._map_components(
            lambda c: replace(c, weight=float(weights[c.name])) if c.name in weights else c)

    def with_params(self, name: str, params: Mapping[str, Any]) -> "Template":
        """A copy with component ``name``'s parameters replaced (validated)."""
        spec = self.component(name)
        new = replace(spec, params=dict(params))
        _validate_params(new, self.source, {})
        return self._map_components(lambda c: new if c.name == name else c)

    def with_gating(self, enabled: bool | None = None,
                    gates: Mapping[str, float | None] | None = None) -> "Template":
        """A copy with gating switched and/or level gate thresholds changed."""
        gates = dict(gates or {})
        keys = {lv.key for lv in self.levels}
        for k, g in gates.items():
            if k not in keys:
                raise TemplateError(f"no level {k!r}; levels: {', '.join(sorted(keys))}",
                                    file=self.source)
            if g is not None and not _in_bounds(g):
                error = TemplateOutOfBounds if _is_number(g) else TemplateError
                raise error(f"gate of level {k} must be a finite number ({NUMBER_RULE})",
                            file=self.source)
        gate_of = {k: None if g is None else float(g) for k, g in gates.items()}
        levels = tuple(replace(lv, gate=gate_of[lv.key]) if lv.key in gate_of else lv for lv in self.levels)
        return replace(self, levels=levels, gating=self.gating if enabled is None else bool(enabled))

    def with_return(self, *, a: float | None = None, b: float | None = None,
                    gamma: float | None = None) -> "Template":
        """A copy with the episode-return coefficients changed."""
        a, b, gamma = (self.a if a is None else a, self.b if b is None else b,
                       self.gamma if gamma is None else gamma)
        _check_return(a, b, gamma, None, self.source)  # before float(): a huge int would overflow
        return replace(self, a=float(a), b=float(b), gamma=float(gamma))

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        """The template as plain data (what :meth:`to_yaml` writes)."""
        out: dict[str, Any] = {"version": self.version, "name": self.name}
        if self.description:
            out["description"] = self.description
        out["return"] = {"a": self.a, "b": self.b, "gamma": self.gamma}
        out["gating"] = {"enabled": self.gating}
        out["levels"] = {}
        for lv in self.levels:
            body: dict[str, Any] = {"title": lv.title}
            if lv.gate is not None:
                body["gate"] = lv.gate
            body["components"] = {c.name: c.to_dict() for c in lv.components}
            out["levels"][lv.key] = body
        if self.penalties:
            out["penalties"] = {c.name: c.to_dict() for c in self.penalties}
        if self.episode_terms:
            out["episode_terms"] = {c.name: c.to_dict() for c in self.episode_terms}
        if self.schedules:
            out["schedules"] = {k: [[s, w] for s, w in v] for k, v in self.schedules.items()}
        if self.expectations:
            out["expectations"] = [e.to_dict() for e in self.expectations]
        return out

    def to_yaml(self) -> str:
        """YAML text that :func:`parse_template` reads back to an equal template."""
        return safe_yaml.dump(self.to_dict(), sort_keys=False, allow_unicode=True, width=100)

    def components_hash(self) -> str:
        """Hash of the component classes and parameters (not weights): equal hashes mean the
        cached component matrix can be reused."""
        body = [(c.name, c.component, sorted(c.params_with_defaults().items(), key=lambda kv: kv[0]))
                for c in self.all_components]
        return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def _interp(x: float, xs: list[int], ys: list[float]) -> float:
    if x <= xs[0]:
        return ys[0]
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[-1]


# --------------------------------------------------------------------------- YAML with lines
def _line_map(node: yaml.Node, path: tuple, out: dict[tuple, int], file: str | None) -> None:
    """Record the 1-based line of every key/item path; refuse duplicate mapping keys."""
    out[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = key_node.value
            line = key_node.start_mark.line + 1
            if key in seen:
                raise TemplateError(f"duplicate key '{key}' at line {line} (first at line {seen[key]})",
                                    file=file, line=line, field=".".join(map(str, path + (key,))))
            seen[key] = line
            _line_map(value_node, path + (key,), out, file)
            out[path + (key,)] = line
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _line_map(item, path + (i,), out, file)


class _Ctx:
    """Where we are while validating: the file name and the line of every path."""

    def __init__(self, lines: dict[tuple, int], file: str | None):
        self.lines, self.file = lines, file

    def line(self, path: tuple) -> int | None:
        while path not in self.lines and path:
            path = path[:-1]
        return self.lines.get(path)

    def fail(self, path: tuple, message: str, error: type[TemplateError] = TemplateError) -> typing.NoReturn:
        line = self.line(path)
        where = f" at line {line}" if line is not None else ""
        raise error(message.replace("{at}", where), file=self.file, line=line,
                    field=".".join(map(str, path)) or None)

    def mapping(self, value: Any, path: tuple, allowed: tuple[str, ...] | None = None) -> dict:
        if not isinstance(value, dict):
            self.fail(path, f"'{'.'.join(map(str, path)) or 'template'}'{{at}} must be a mapping")
        if allowed is not None:
            for k in value:
                if k not in allowed:
                    hint = difflib.get_close_matches(str(k), allowed, n=1)
                    extra = f" (did you mean '{hint[0]}'?)" if hint else ""
                    self.fail(path + (k,), f"unknown key '{k}'{{at}}{extra}; allowed: {', '.join(allowed)}")
        return value


# --------------------------------------------------------------------------- numbers
#: How a refusal states the rule every number of a template follows.
NUMBER_RULE = f"every number in a template is at most {MAX_TEMPLATE_NUMBER:,} in size"


def _shown(value: Any) -> str:
    """A number as a message shows it (a huge integer by its length, not its digits)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        if value.bit_length() < 14_000:  # str() refuses integers of more than 4,300 digits
            return f"an integer of {len(str(abs(value)))} digits"
        return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    return repr(value)


def _bound(x: float) -> str:
    """A range end for a message: ``10,000,000``, ``0.5``, ``1e-06``."""
    return f"{int(x):,}" if float(x).is_integer() and abs(x) < 1e16 else f"{x:g}"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _in_bounds(value: Any, low: float = -MAX_TEMPLATE_NUMBER, high: float = MAX_TEMPLATE_NUMBER) -> bool:
    """A number within [low, high] (NaN and infinities are not); compared without
    converting, so a huge integer is refused rather than overflowing a float."""
    return _is_number(value) and value == value and low <= value <= high


def _check_numbers(data: Any, ctx: _Ctx) -> None:
    """Refuse any number of the document larger than :data:`MAX_TEMPLATE_NUMBER` in size,
    wherever it is (the specific checks above have already given their own messages)."""
    stack: list[tuple[Any, tuple]] = [(data, ())]
    while stack:
        value, path = stack.pop()
        if isinstance(value, dict):
            stack.extend((v, path + (k,)) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((v, path + (i,)) for i, v in enumerate(value))
        elif _is_number(value) and value == value and not _in_bounds(value):
            ctx.fail(path, f"'{safe_yaml.key_path(path)}'{{at}} is {_shown(value)}; {NUMBER_RULE}",
                     TemplateOutOfBounds)


def _check_weight(w: Any, what: str, ctx: _Ctx | None, file: str | None, path: tuple = ()) -> float:
    problem = None
    if isinstance(w, bool) or not isinstance(w, (int, float)):
        problem = f"{what}{{at}} must be a number, got {w!r}"
    elif w != w:
        problem = f"{what}{{at}} is NaN; weights must be finite numbers ≥ 0"
    elif w in (math.inf, -math.inf):
        problem = f"{what}{{at}} is infinite; weights must be finite numbers ≥ 0"
    elif w < 0:
        problem = (f"{what}{{at}} is negative ({_shown(w)}); weights must be ≥ 0 — penalties "
                   f"already carry their own sign")
    elif w > MAX_TEMPLATE_NUMBER:
        problem = f"{what}{{at}} is {_shown(w)}; {NUMBER_RULE}"
    if problem:
        error = TemplateOutOfBounds if _is_number(w) else TemplateError
        if ctx is not None:
            ctx.fail(path, problem, error)
        raise error(problem.replace("{at}", ""), file=file)
    return float(w)


def _check_return(a: Any, b: Any, gamma: Any, ctx: _Ctx | None, file: str | None) -> None:
    for key, v in (("a", a), ("b", b), ("gamma", gamma)):
        bad = not _in_bounds(v)
        if not bad and key == "gamma" and not 0 < v <= 1:
            bad = True
        if bad:
            msg = (f"return.{key}{{at}} must be a finite number" +
                   (" in (0, 1]" if key == "gamma" else f" ({NUMBER_RULE})") + f", got {_shown(v)}")
            error = TemplateOutOfBounds if _is_number(v) else TemplateError
            if ctx is not None:
                ctx.fail(("return", key), msg, error)
            raise error(msg.replace("{at}", ""), file=file)


def _type_ok(value: Any, annotation: Any) -> bool:
    """Does a YAML value fit a constructor annotation (float, int, str, Literal, list[…], X | None)?"""
    if annotation is Any:
        return True
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in args)
    if annotation is type(None):
        return value is None
    if origin is Literal:
        return value in args
    if origin is list:
        return isinstance(value, list) and (not args or all(_type_ok(v, args[0]) for v in value))
    if origin is dict or annotation is dict:
        return isinstance(value, dict)
    if annotation is float:  # an int is finite (and math.isfinite would overflow on a huge one)
        return _is_number(value) and (isinstance(value, int) or math.isfinite(value))
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    return isinstance(value, annotation) if isinstance(annotation, type) else True


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def build_component(spec: ComponentSpec):
    """Instantiate the registered class of ``spec`` with its parameters."""
    return COMPONENTS[spec.component](**dict(spec.params))


def _validate_params(spec: ComponentSpec, file: str | None, lines: dict[tuple, int],
                     path: tuple = ()) -> None:
    ctx = _Ctx(lines, file)
    cls = COMPONENTS[spec.component]
    specs = cls.param_specs()
    for k, v in spec.params.items():
        if k not in specs:
            hint = difflib.get_close_matches(str(k), list(specs), n=1)
            extra = f" (did you mean '{hint[0]}'?)" if hint else ""
            ctx.fail(path + ("params", k), f"unknown parameter '{k}' of component '{spec.component}'"
                     f"{{at}}{extra}; known: {', '.join(specs) or 'none'}")
        annotation = specs[k][0]
        if not _type_ok(v, annotation):
            ctx.fail(path + ("params", k), f"parameter '{k}' of '{spec.name}'{{at}} must be "
                     f"{_type_name(annotation)}, got {_shown(v)}")
        low, high = cls.param_range(k)
        for where, number in ([((), v)] if _is_number(v) else
                              [((i,), x) for i, x in enumerate(v) if _is_number(x)]
                              if isinstance(v, list) else []):
            if not _in_bounds(number, low, high):
                ctx.fail(path + ("params", k) + where,
                         f"parameter '{k}' of '{spec.name}'{{at}} is {_shown(number)}; it must be "
                         f"between {_bound(low)} and {_bound(high)}", TemplateOutOfBounds)
    try:
        build_component(spec)
    except (ValueError, TypeError) as exc:
        ctx.fail(path + ("params",), f"parameters of '{spec.name}'{{at}}: {exc}")


def _component_specs(value: Any, path: tuple, group: str, ctx: _Ctx) -> tuple[ComponentSpec, ...]:
    entries = ctx.mapping(value, path)
    out = []
    for name, body in entries.items():
        cpath = path + (name,)
        if body is None:
            body = {}
        body = ctx.mapping(body, cpath, COMPONENT_KEYS)
        comp = body.get("component", name)
        if comp not in COMPONENTS:
            hint = difflib.get_close_matches(str(comp), list(COMPONENTS), n=1)
            extra = f" (did you mean '{hint[0]}'?)" if hint else ""
            ctx.fail(cpath + (("component",) if "component" in body else ()),
                     f"unknown component '{comp}'{{at}}{extra}; known: {', '.join(COMPONENTS)}")
        cls = COMPONENTS[comp]
        expected = cls.level
        if group in LEVELS and expected != group:
            where = {"penalty": "penalties", "episode": "episode_terms"}.get(expected, f"level {expected}")
            ctx.fail(cpath, f"component '{comp}'{{at}} belongs in {where}, not level {group}")
        if group in ("penalty", "episode") and expected != group:
            where = {"penalty": "penalties", "episode": "episode_terms"}.get(expected, f"level {expected}")
            ctx.fail(cpath, f"component '{comp}'{{at}} belongs in {where}, not "
                     f"{'penalties' if group == 'penalty' else 'episode_terms'}")
        if "weight" not in body:
            ctx.fail(cpath, f"component '{name}'{{at}} needs a weight")
        weight = _check_weight(body["weight"], f"weight of '{name}'", ctx, ctx.file, cpath + ("weight",))
        params = body.get("params") or {}
        ctx.mapping(params, cpath + ("params",))
        desc = body.get("description", "")
        if not isinstance(desc, str):
            ctx.fail(cpath + ("description",), "description{at} must be text")
        spec = ComponentSpec(name=str(name), component=comp, weight=weight, params=params, group=group,
                             description=desc, line=ctx.line(cpath))
        _validate_params(spec, ctx.file, ctx.lines, cpath)
        out.append(spec)
    return tuple(out)


def _validate_filter(value: Any, path: tuple, allowed: tuple[str, ...], ctx: _Ctx) -> None:
    filt = ctx.mapping(value, path)
    for k, v in filt.items():
        ok = k in allowed or str(k).startswith("meta.") or \
            (str(k).startswith("param.") and "tool" in allowed)
        if not ok:
            ctx.fail(path + (k,), f"unknown filter key '{k}'{{at}}; allowed: {', '.join(allowed)}, "
                     f"meta.<key>" + (", param.<name>" if "tool" in allowed else ""))
        if isinstance(v, (dict,)):
            ctx.fail(path + (k,), f"filter value of '{k}'{{at}} must be a value or a list of values")


def _expectations(value: Any, names: set[str], ctx: _Ctx) -> tuple[ExpectationSpec, ...]:
    if not isinstance(value, list):
        ctx.fail(("expectations",), "expectations{at} must be a list")
    out = []
    seen: set[str] = set()
    for i, item in enumerate(value):
        path = ("expectations", i)
        item = ctx.mapping(item, path)
        kind = item.get("kind")
        if kind not in EXPECTATION_KINDS:
            ctx.fail(path + ("kind",), f"unknown expectation kind {kind!r}{{at}}; known: "
                     f"{', '.join(EXPECTATION_KINDS)}")
        required, optional = EXPECTATION_KINDS[kind]
        ctx.mapping(item, path, ("name", "kind", "description") + required + optional)
        name = item.get("name")
        if not isinstance(name, str) or not name:
            ctx.fail(path, "expectation{at} needs a name")
        if name in seen:
            ctx.fail(path + ("name",), f"duplicate expectation name '{name}'{{at}}")
        seen.add(name)
        for r in required:
            if r not in item:
                ctx.fail(path, f"expectation '{name}'{{at}} ({kind}) needs '{r}'")
        for k in ("below", "above", "max", "min", "margin"):
            if k in item and not _in_bounds(item[k]):
                ctx.fail(path + (k,), f"'{k}' of expectation '{name}'{{at}} must be a finite "
                         f"number ({NUMBER_RULE})",
                         TemplateOutOfBounds if _is_number(item[k]) else TemplateError)
        if "metric" in item and item["metric"] not in METRICS:
            ctx.fail(path + ("metric",), f"metric{{at}} must be one of {', '.join(METRICS)}")
        if kind == "episode_score":
            if "below" not in item and "above" not in item:
                ctx.fail(path, f"expectation '{name}'{{at}} needs 'below' and/or 'above'")
            _validate_filter(item["episodes"], path + ("episodes",), EPISODE_FILTER_KEYS, ctx)
        elif kind == "component_range":
            if item["component"] not in names:
                ctx.fail(path + ("component",), f"expectation '{name}'{{at}} names component "
                         f"'{item['component']}', which is not in this template; known: "
                         f"{', '.join(sorted(names))}")
            if "max" not in item and "min" not in item:
                ctx.fail(path, f"expectation '{name}'{{at}} needs 'max' and/or 'min'")
            if item.get("value", "raw") not in ("raw", "contribution"):
                ctx.fail(path + ("value",), "value{at} must be raw or contribution")
            if "steps" in item:
                _validate_filter(item["steps"], path + ("steps",), STEP_FILTER_KEYS, ctx)
        elif kind == "twins_rank":
            if "episodes" in item:
                _validate_filter(item["episodes"], path + ("episodes",), EPISODE_FILTER_KEYS, ctx)
            if not isinstance(item.get("twin_key", "twin_of"), str):
                ctx.fail(path + ("twin_key",), "twin_key{at} must be text")
        elif kind == "rank_auc":
            for k in ("higher", "lower"):
                _validate_filter(item[k], path + (k,), EPISODE_FILTER_KEYS, ctx)
            if not 0 <= item["min"] <= 1:
                ctx.fail(path + ("min",), "min{at} must be an AUC in [0, 1]")
        fields = {k: v for k, v in item.items() if k not in ("name", "kind", "description")}
        out.append(ExpectationSpec(name=name, kind=kind, fields=fields,
                                   description=str(item.get("description", "")), line=ctx.line(path)))
    return tuple(out)


def _yaml_error(exc: InputError, file: str | None) -> TemplateError:
    """A refusal of :mod:`core.base.safe_yaml` worded the way template errors read."""
    at = f" at line {exc.line}" if exc.line is not None else ""
    prefix = "not valid YAML: "
    if exc.reason.startswith(prefix):
        message = f"not valid YAML{at}: {exc.reason[len(prefix):]}"
        return TemplateError(message, file=file, line=exc.line, field=exc.field)
    message = f"{f'key {exc.field!r}' if exc.field else 'the template'}{at}: {exc.reason}"
    return TemplateOutOfBounds(message, file=file, line=exc.line, field=exc.field)


def parse_template(text: str, *, file: str | None = None) -> Template:
    """Validate YAML text into a :class:`Template`; :class:`TemplateError` names key and line."""
    try:
        loaded = safe_yaml.load(text, file=file)
    except InputError as exc:
        raise _yaml_error(exc, file) from None
    node, data = loaded.node, loaded.data
    if node is None:
        raise TemplateError("the template is empty", file=file)
    lines: dict[tuple, int] = {}
    _line_map(node, (), lines, file)
    ctx = _Ctx(lines, file)
    top = ctx.mapping(data, (), TOP_KEYS)

    version = top.get("version")
    if version is None:
        ctx.fail((), "the template needs a 'version' (the template format version, currently 1){at}")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        ctx.fail(("version",), f"version{{at}} must be a positive integer, got {version!r}")
    if version > FORMAT_VERSION:
        ctx.fail(("version",), f"template format version {version}{{at}} is newer than this Reward "
                 f"Workbench ({FORMAT_VERSION}); upgrade the package")
    name = top.get("name")
    if not isinstance(name, str) or not name.strip():
        ctx.fail(("name",) if "name" in top else (), "the template needs a 'name'{at}")
    description = top.get("description", "") or ""
    if not isinstance(description, str):
        ctx.fail(("description",), "description{at} must be text")

    ret = ctx.mapping(top.get("return") or {}, ("return",), ("a", "b", "gamma"))
    a, b, gamma = ret.get("a", 0.7), ret.get("b", 0.3), ret.get("gamma", 0.95)
    _check_return(a, b, gamma, ctx, file)

    gating_cfg = ctx.mapping(top.get("gating") or {}, ("gating",), ("enabled",))
    gating = gating_cfg.get("enabled", True)
    if not isinstance(gating, bool):
        ctx.fail(("gating", "enabled"), "gating.enabled{at} must be true or false")

    if "levels" not in top:
        ctx.fail((), "the template needs 'levels'{at}")
    levels_in = ctx.mapping(top["levels"], ("levels",))
    levels = []
    previous = -1
    for key, body in levels_in.items():
        lpath = ("levels", key)
        if key not in LEVELS:
            ctx.fail(lpath, f"unknown level '{key}'{{at}}; levels are {', '.join(LEVELS)}")
        if LEVELS.index(key) <= previous:
            ctx.fail(lpath, f"level '{key}'{{at}} is out of order; list levels from L1 upwards")
        previous = LEVELS.index(key)
        body = ctx.mapping(body or {}, lpath, LEVEL_KEYS)
        gate = body.get("gate")
        if gate is not None and not _in_bounds(gate):
            ctx.fail(lpath + ("gate",), f"gate of level {key}{{at}} must be a finite number "
                     f"({NUMBER_RULE})", TemplateOutOfBounds if _is_number(gate) else TemplateError)
        title = body.get("title", LEVEL_TITLES[key])
        if not isinstance(title, str):
            ctx.fail(lpath + ("title",), "title{at} must be text")
        comps = _component_specs(body.get("components") or {}, lpath + ("components",), key, ctx)
        levels.append(LevelSpec(key=key, title=title, gate=None if gate is None else float(gate),
                                components=comps))
    penalties = _component_specs(top.get("penalties") or {}, ("penalties",), "penalty", ctx)
    episode_terms = _component_specs(top.get("episode_terms") or {}, ("episode_terms",), "episode", ctx)

    all_specs = [c for lv in levels for c in lv.components] + list(penalties) + list(episode_terms)
    if not all_specs:
        ctx.fail(("levels",), "the template has no components{at}")
    seen: dict[str, ComponentSpec] = {}
    for c in all_specs:
        if c.name in RESERVED_NAMES:
            ctx.fail((), f"component name '{c.name}' at line {c.line} is reserved; rename it")
        if c.name in seen:
            ctx.fail((), f"component name '{c.name}' at line {c.line} is used twice "
                     f"(first at line {seen[c.name].line})")
        seen[c.name] = c

    schedules: dict[str, tuple[tuple[int, float], ...]] = {}
    for comp_name, points in ctx.mapping(top.get("schedules") or {}, ("schedules",)).items():
        spath = ("schedules", comp_name)
        if comp_name not in seen:
            ctx.fail(spath, f"schedule for unknown component '{comp_name}'{{at}}; known: "
                     f"{', '.join(seen)}")
        if not isinstance(points, list) or not points:
            ctx.fail(spath, "a schedule{at} is a non-empty list of [training_step, weight] pairs")
        parsed: list[tuple[int, float]] = []
        for j, p in enumerate(points):
            if not (isinstance(p, list) and len(p) == 2 and isinstance(p[0], int)
                    and not isinstance(p[0], bool) and 0 <= p[0] <= MAX_TEMPLATE_NUMBER):
                huge = isinstance(p, list) and len(p) == 2 and _is_number(p[0]) and p[0] > MAX_TEMPLATE_NUMBER
                ctx.fail(spath + (j,), f"schedule points{{at}} are [training_step, weight] pairs "
                         f"with 0 ≤ training_step ≤ {MAX_TEMPLATE_NUMBER:,}",
                         TemplateOutOfBounds if huge else TemplateError)
            w = _check_weight(p[1], f"scheduled weight of '{comp_name}'", ctx, file, spath + (j,))
            if parsed and p[0] <= parsed[-1][0]:
                ctx.fail(spath + (j,), "schedule steps{at} must increase")
            parsed.append((int(p[0]), w))
        schedules[str(comp_name)] = tuple(parsed)

    expectations = _expectations(top.get("expectations") or [], set(seen), ctx)
    _check_numbers(data, ctx)
    return Template(name=name.strip(), description=description, levels=tuple(levels),
                    penalties=penalties, episode_terms=episode_terms, gating=gating, a=float(a),
                    b=float(b), gamma=float(gamma), schedules=schedules, expectations=expectations,
                    version=int(version), source=file)


def templates_dir() -> Path:
    """The shipped templates (``reward_templates/`` in the checkout)."""
    return package_data.templates_dir()


def list_templates() -> list[dict[str, str]]:
    """Shipped templates: name, path and description (read from each file)."""
    out = []
    for path in sorted(templates_dir().glob("*.yaml")):
        t = load_template(path)
        out.append({"name": path.stem, "path": str(path), "description": t.description})
    return out


def load_template(source: str | Path) -> Template:
    """A template from a file path or the name of a shipped template (``finance_risk``)."""
    path = Path(source)
    if not path.exists() and not str(source).endswith((".yaml", ".yml")):
        shipped = templates_dir() / f"{source}.yaml"
        if shipped.exists():
            path = shipped
    if not path.exists():
        names = ", ".join(p.stem for p in sorted(templates_dir().glob("*.yaml"))) or "none"
        raise TemplateError(f"no template file or shipped template {str(source)!r}; known: {names}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TemplateError(f"cannot read the template: {exc}", file=str(path)) from None
    return parse_template(text, file=str(path))
