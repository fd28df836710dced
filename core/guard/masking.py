"""Action masks (docs/design.md §4): declarative rules → a boolean vector over the catalog per state.

Rules live in YAML (:class:`MaskRules`); each blocks its targets (tools, tokens, risk
levels, presets) where its ``when``/``unless`` condition on the state features fires, or
once a business ``limit`` on ``action_counts`` is reached; review rules come from rejected
reviews.  Rules compile against a catalog into :class:`CompiledMasks`, evaluated in batch
in numpy (:meth:`CompiledMasks.evaluate`) or torch (:meth:`CompiledMasks.evaluate_torch`);
a state with every action blocked keeps ``F0`` and ``E0`` allowed and says so.

Details: docs/actions.md (## Mask rules, ## Mask targets, ## Mask conditions, ## Business
limits, ## Compiled masks).
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import yaml

from core.base import safe_yaml
from core.records.catalog import (OTHER, RISK_LEVELS, UNSET, ActionToken, Catalog, build_catalog, catalog_for_dataset,
                                  load_tools_file, value_key)
from core.base.errors import InputError

if TYPE_CHECKING:  # pragma: no cover
    import torch

RULE_KINDS = ("availability", "business", "risk", "review")
NUMERIC_OPS = ("gt", "lt", "ge", "le")
EQ_OPS = ("eq", "ne")
SET_OPS = ("in", "not_in")
RANGE_OPS = ("outside", "between")
ALL_OPS = NUMERIC_OPS + EQ_OPS + SET_OPS + RANGE_OPS
TARGET_KEYS = ("tools", "tokens", "risk", "preset")
RULE_KEYS = ("name", "kind", "targets", "when", "unless", "limit", "if_unknown", "message", "meta",
             *TARGET_KEYS)
#: Most AND-clauses one rule may expand to (``any`` inside ``all`` multiplies them).
MAX_CLAUSES = 256
_TIME = re.compile(r"^\s*(\d{1,2}):(\d{2})\s*$")


# --------------------------------------------------------------------------- YAML with line numbers
def _located_load(text: str, file: str | None) -> tuple[Any, dict[tuple, int]]:
    """Parse YAML (bounded: :mod:`core.base.safe_yaml`) and remember the line of every node by
    its path (for error messages)."""
    loaded = safe_yaml.load(text, file=file)
    if loaded.node is None:
        return None, {}
    lines: dict[tuple, int] = {}
    _walk(loaded.node, (), lines, file)
    return loaded.data, lines


def _walk(node: yaml.Node, path: tuple, lines: dict[tuple, int], file: str | None) -> None:
    lines[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for key_node, value_node in node.value:
            key = key_node.value
            if key in seen:
                raise InputError(f"key '{key}' appears twice (first on line {seen[key]})", file=file,
                                 line=key_node.start_mark.line + 1, field=_field(path + (key,)))
            seen[key] = key_node.start_mark.line + 1
            lines[path + (key,)] = key_node.start_mark.line + 1
            _walk(value_node, path + (key,), lines, file)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _walk(item, path + (i,), lines, file)


def _field(path: Sequence[Any]) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


# --------------------------------------------------------------------------- conditions
@dataclass(frozen=True)
class Atom:
    """One test of one feature, e.g. ``volatility gt 0.3``."""

    feature: str
    op: str
    value: Any

    @property
    def categorical(self) -> bool:
        vals = self.value if isinstance(self.value, (list, tuple)) else [self.value]
        return any(isinstance(v, str) for v in vals)

    def key(self) -> str:
        return json.dumps([self.feature, self.op, self.value], sort_keys=True)

    def holds(self, x: Any) -> bool:
        """Reference (slow) evaluation on one known feature value."""
        if self.categorical:
            x = category_text(x)
        elif isinstance(x, (bool, np.bool_)):
            x = float(x)
        op, v = self.op, self.value
        if op == "gt":
            return x > v
        if op == "lt":
            return x < v
        if op == "ge":
            return x >= v
        if op == "le":
            return x <= v
        if op == "eq":
            return x == v
        if op == "ne":
            return x != v
        if op == "in":
            return x in v
        if op == "not_in":
            return x not in v
        if op == "between":
            return v[0] <= x <= v[1]
        return x < v[0] or x > v[1]  # outside


@dataclass(frozen=True)
class Cond:
    """``all`` / ``any`` of children (atoms or conditions)."""

    op: str
    children: tuple["Cond | Atom", ...]

    def features(self) -> set[str]:
        out: set[str] = set()
        for c in self.children:
            out |= {c.feature} if isinstance(c, Atom) else c.features()
        return out

    def holds(self, row: Mapping[str, Any]) -> bool:
        """Reference evaluation (every feature known)."""
        vals = (c.holds(row[c.feature]) if isinstance(c, Atom) else c.holds(row) for c in self.children)
        return all(vals) if self.op == "all" else any(vals)

    def dnf(self) -> list[list[Atom]]:
        """Disjunctive normal form: OR over clauses, each an AND of atoms."""
        parts = [[[c]] if isinstance(c, Atom) else c.dnf() for c in self.children]
        if self.op == "any":
            out = [clause for p in parts for clause in p]
        else:
            out = [[]]
            for p in parts:
                out = [a + b for a in out for b in p]
                if len(out) > MAX_CLAUSES:
                    break
        if len(out) > MAX_CLAUSES:
            raise ValueError(f"condition expands to more than {MAX_CLAUSES} clauses; simplify it")
        return out


def _time_or_number(v: Any) -> Any:
    if isinstance(v, str):
        m = _TIME.match(v)
        if m and int(m.group(2)) < 60:
            return int(m.group(1)) + int(m.group(2)) / 60
    if isinstance(v, bool):
        return float(v)
    return v


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class _RuleError(Exception):
    def __init__(self, message: str, path: tuple):
        super().__init__(message)
        self.path = path


def _parse_cond(obj: Any, path: tuple) -> Cond:
    if not isinstance(obj, dict) or not obj:
        raise _RuleError("a condition must be a non-empty mapping of feature: {op: value}", path)
    children: list[Cond | Atom] = []
    for key, spec in obj.items():
        key = str(key)
        if key in ("any", "all"):
            if not isinstance(spec, list) or not spec:
                raise _RuleError(f"'{key}' takes a non-empty list of conditions", path + (key,))
            children.append(Cond(key, tuple(_parse_cond(c, path + (key, i)) for i, c in enumerate(spec))))
            continue
        if not isinstance(spec, dict):
            spec = {"in": spec} if isinstance(spec, list) else {"eq": spec}
        if not spec:
            raise _RuleError(f"feature '{key}' needs at least one test ({', '.join(ALL_OPS)})",
                             path + (key,))
        for op, raw in spec.items():
            children.append(_parse_atom(key, str(op), raw, path + (key, op)))
    return Cond("all", tuple(children))


def _parse_atom(feature: str, op: str, raw: Any, path: tuple) -> Atom:
    if op not in ALL_OPS:
        near = difflib.get_close_matches(op, ALL_OPS, n=1)
        hint = f" (did you mean '{near[0]}'?)" if near else ""
        raise _RuleError(f"unknown test '{op}' on feature '{feature}'{hint}; use one of {', '.join(ALL_OPS)}",
                         path)
    if op in NUMERIC_OPS:
        v = _time_or_number(raw)
        if not _is_num(v):
            raise _RuleError(f"'{op}' on feature '{feature}' needs a number, got {raw!r}", path)
        return Atom(feature, op, float(v))
    if op in EQ_OPS:
        v = _time_or_number(raw) if not isinstance(raw, str) or _TIME.match(raw) else raw
        if not (_is_num(v) or isinstance(v, str)):
            raise _RuleError(f"'{op}' on feature '{feature}' needs a number, string or boolean, got {raw!r}",
                             path)
        return Atom(feature, op, float(v) if _is_num(v) else v)
    if op in SET_OPS:
        if not isinstance(raw, list) or not raw:
            raise _RuleError(f"'{op}' on feature '{feature}' needs a non-empty list, got {raw!r}", path)
        vals = [v if isinstance(v, str) else _time_or_number(v) for v in raw]
        if not all(_is_num(v) or isinstance(v, str) for v in vals):
            raise _RuleError(f"'{op}' on feature '{feature}' takes numbers, strings or booleans", path)
        kinds = {isinstance(v, str) for v in vals}
        if len(kinds) > 1:
            raise _RuleError(f"'{op}' on feature '{feature}' mixes strings and numbers", path)
        return Atom(feature, op, tuple(float(v) if _is_num(v) else v for v in vals))
    if not isinstance(raw, list) or len(raw) != 2:
        raise _RuleError(f"'{op}' on feature '{feature}' needs [low, high], got {raw!r}", path)
    lo, hi = (_time_or_number(x) for x in raw)
    if not (_is_num(lo) and _is_num(hi)) or lo > hi:
        raise _RuleError(f"'{op}' on feature '{feature}' needs numbers low ≤ high, got {raw!r}", path)
    return Atom(feature, op, (float(lo), float(hi)))


# --------------------------------------------------------------------------- rules
@dataclass
class MaskRule:
    """One rule: which tokens it blocks, and when."""

    name: str
    kind: str
    targets: dict[str, Any]
    when: dict[str, Any] | None = None
    unless: dict[str, Any] | None = None
    limit: dict[str, Any] | None = None
    if_unknown: str = "allow"
    message: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    #: Line of the rule in its YAML file (None when built in code).
    line: int | None = None
    index: int = 0
    when_cond: Cond | None = field(default=None, repr=False, compare=False)
    unless_cond: Cond | None = field(default=None, repr=False, compare=False)

    def features(self) -> set[str]:
        out: set[str] = set()
        for c in (self.when_cond, self.unless_cond):
            if c is not None:
                out |= c.features()
        return out

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "kind": self.kind, "targets": self.targets}
        for key in ("when", "unless", "limit"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        if self.if_unknown != "allow":
            d["if_unknown"] = self.if_unknown
        if self.message:
            d["message"] = self.message
        if self.meta:
            d["meta"] = self.meta
        return d

    def describe(self) -> str:
        return f"rule {self.index} '{self.name}'" + (f" (line {self.line})" if self.line else "")


def _str_list(v: Any, path: tuple, what: str) -> list[str]:
    vals = [v] if isinstance(v, str) else v
    if not isinstance(vals, list) or not vals or not all(isinstance(x, str) and x for x in vals):
        raise _RuleError(f"{what} must be a name or a non-empty list of names", path)
    return list(vals)


def _parse_targets(obj: Any, path: tuple) -> dict[str, Any]:
    if not isinstance(obj, dict) or not obj:
        raise _RuleError("targets must be a mapping with tools, tokens, risk and/or preset", path)
    out: dict[str, Any] = {}
    for key, v in obj.items():
        if key not in TARGET_KEYS:
            raise _RuleError(f"unknown target key '{key}'; use {', '.join(TARGET_KEYS)}", path + (key,))
        if key == "preset":
            if not isinstance(v, dict) or not v:
                raise _RuleError("preset must be a mapping param: value (or [values])", path + (key,))
            out[key] = {str(p): (list(x) if isinstance(x, list) else x) for p, x in v.items()}
        elif key == "tokens":
            # Token names (A12T3), or ids of the catalog the rule was written against.
            vals = [v] if isinstance(v, (str, int)) and not isinstance(v, bool) else v
            if not isinstance(vals, list) or not vals or not all(
                    (isinstance(x, str) and x) or (isinstance(x, int) and not isinstance(x, bool) and x >= 0)
                    for x in vals):
                raise _RuleError("targets.tokens must be token names (A12T3) or ids", path + (key,))
            out[key] = list(vals)
        else:
            out[key] = _str_list(v, path + (key,), f"targets.{key}")
    for level in out.get("risk", []):
        if level not in RISK_LEVELS:
            raise _RuleError(f"unknown risk level '{level}'; use {', '.join(RISK_LEVELS)}", path + ("risk",))
    return out


def _parse_rule(obj: Any, index: int, path: tuple, names: set[str]) -> MaskRule:
    if not isinstance(obj, dict):
        raise _RuleError("a rule must be a mapping (name, kind, targets, when/unless/limit)", path)
    for key in obj:
        if key not in RULE_KEYS:
            near = difflib.get_close_matches(str(key), RULE_KEYS, n=1)
            hint = f" (did you mean '{near[0]}'?)" if near else ""
            raise _RuleError(f"unknown key '{key}'{hint}; a rule has {', '.join(RULE_KEYS)}", path + (key,))
    kind = obj.get("kind")
    if kind not in RULE_KINDS:
        raise _RuleError(f"kind must be one of {', '.join(RULE_KINDS)}, got {kind!r}", path + ("kind",))
    name = obj.get("name", f"{kind}_{index}")
    if not isinstance(name, str) or not name:
        raise _RuleError("name must be a non-empty string", path + ("name",))
    if name in names:
        raise _RuleError(f"rule name '{name}' is used twice", path + ("name",))
    # ``tools:``/``tokens:``/``risk:``/``preset:`` beside ``kind`` are short for ``targets:``.
    short = {k: obj[k] for k in TARGET_KEYS if k in obj}
    if "targets" not in obj and not short:
        raise _RuleError("a rule needs targets (tools, tokens, risk and/or preset)", path)
    if "targets" in obj and short:
        raise _RuleError(f"give the targets once: either targets: or {', '.join(short)} beside kind",
                         path + (next(iter(short)),))
    targets = _parse_targets(obj["targets"], path + ("targets",)) if "targets" in obj else \
        _parse_targets(short, path)
    when_cond = _parse_cond(obj["when"], path + ("when",)) if obj.get("when") is not None else None
    unless_cond = _parse_cond(obj["unless"], path + ("unless",)) if obj.get("unless") is not None else None
    for label, cond in (("when", when_cond), ("unless", unless_cond)):
        if cond is not None:
            try:
                cond.dnf()
            except ValueError as exc:
                raise _RuleError(str(exc), path + (label,)) from None
    limit = obj.get("limit")
    if kind == "business" and limit is None and when_cond is None and unless_cond is None:
        raise _RuleError("a business rule needs limit: {max: N, per: ...} and/or a state condition "
                         "(when:/unless:)", path)
    if limit is not None:
        if kind != "business":
            raise _RuleError(f"only business rules take a limit (this one is {kind})", path + ("limit",))
        if not isinstance(limit, dict):
            raise _RuleError("limit must be a mapping {max: N, per: tool|token|<param>|[keys]}",
                             path + ("limit",))
        for key in limit:
            if key not in ("max", "per"):
                raise _RuleError(f"unknown limit key '{key}'; use max and per", path + ("limit", key))
        mx = limit.get("max")
        if isinstance(mx, bool) or not isinstance(mx, int) or mx < 0:
            raise _RuleError(f"limit.max must be a whole number ≥ 0, got {mx!r}", path + ("limit", "max"))
        per = limit.get("per")
        keys = [per] if isinstance(per, str) else per
        if per is not None and (not isinstance(keys, list) or not keys
                                or not all(isinstance(k, str) and k for k in keys)):
            raise _RuleError("limit.per must be tool, token, a preset parameter name, or a list of "
                             "them tried in order", path + ("limit", "per"))
        limit = {"max": mx, **({"per": per} if per else {})}
    elif when_cond is None and unless_cond is None:
        raise _RuleError(f"a {kind} rule needs when: and/or unless: (a state condition)", path)
    if_unknown = obj.get("if_unknown", "allow")
    if if_unknown not in ("allow", "block"):
        raise _RuleError(f"if_unknown must be allow or block, got {if_unknown!r}", path + ("if_unknown",))
    message = obj.get("message", "")
    meta = obj.get("meta") or {}
    if not isinstance(message, str):
        raise _RuleError("message must be text", path + ("message",))
    if not isinstance(meta, dict):
        raise _RuleError("meta must be a mapping", path + ("meta",))
    return MaskRule(name=name, kind=kind, targets=targets, when=obj.get("when"), unless=obj.get("unless"),
                    limit=limit, if_unknown=if_unknown, message=message, meta=meta, index=index,
                    when_cond=when_cond, unless_cond=unless_cond)


def state_pattern(state: Mapping[str, Any], *, keys: Sequence[str] | None = None,
                  tolerance: float = 0.1) -> dict[str, Any]:
    """A condition matching states like ``state``: strings and booleans equal, numbers
    within ±``tolerance`` (relative) of their value.  For review rules."""
    out: dict[str, Any] = {}
    for k in (keys if keys is not None else sorted(state)):
        if k not in state:
            raise InputError(f"state has no feature '{k}'", field=k)
        v = state[k]
        if isinstance(v, bool):
            out[k] = {"eq": v}
        elif isinstance(v, str):
            out[k] = {"eq": v}
        elif _is_num(v):
            d = abs(float(v)) * tolerance
            out[k] = {"between": [round(float(v) - d, 9), round(float(v) + d, 9)]}
        elif v is not None:
            raise InputError(f"state feature '{k}' is not a scalar ({type(v).__name__})", field=k)
    if not out:
        raise InputError("the state has no scalar feature to build a pattern from")
    return out


class MaskRules:
    """An ordered list of mask rules, loaded from YAML and compiled against a catalog."""

    def __init__(self, rules: Sequence[MaskRule] = (), *, description: str = "", source: str | None = None):
        self.rules = list(rules)
        self.description = description
        self.source = source

    def __len__(self) -> int:
        return len(self.rules)

    def __iter__(self):
        return iter(self.rules)

    # ----------------------------------------------------------------- loading
    @classmethod
    def from_yaml(cls, path_or_text: str | Path) -> "MaskRules":
        """Rules from a YAML file (a path) or YAML text; errors name the rule and line."""
        file = None
        if isinstance(path_or_text, Path) or ("\n" not in path_or_text and (
                path_or_text.strip().endswith((".yaml", ".yml")) or os.path.isfile(path_or_text))):
            file = str(path_or_text)
            try:
                text = Path(path_or_text).read_text(encoding="utf-8")
            except OSError as exc:
                raise InputError(f"cannot read mask rules: {exc.strerror}", file=file) from None
        else:
            text = path_or_text
        data, lines = _located_load(text, file)
        return cls.from_data(data, file=file, lines=lines)

    @classmethod
    def from_data(cls, data: Any, *, file: str | None = None,
                  lines: Mapping[tuple, int] | None = None) -> "MaskRules":
        """Rules from already-parsed YAML/JSON data (``{"rules": [...]}`` or a list)."""
        lines = lines or {}
        if data is None:
            return cls(source=file)
        root: tuple = ()
        description = ""
        if isinstance(data, dict):
            for key in data:
                if key not in ("version", "description", "rules"):
                    raise InputError(f"unknown top-level key '{key}'; use version, description, rules",
                                     file=file, line=lines.get((key,)), field=str(key))
            if data.get("version", 1) != 1:
                raise InputError(f"unsupported mask rules version {data.get('version')!r} (expected 1)",
                                 file=file, line=lines.get(("version",)), field="version")
            description = str(data.get("description") or "")
            rules_data = data.get("rules") or []
            root = ("rules",)
        else:
            rules_data = data
        if not isinstance(rules_data, list):
            raise InputError("rules must be a list", file=file, line=lines.get(root), field="rules")
        rules: list[MaskRule] = []
        names: set[str] = set()
        for i, obj in enumerate(rules_data):
            path = root + (i,)
            try:
                rule = _parse_rule(obj, i, path, names)
            except _RuleError as exc:
                name = obj.get("name") if isinstance(obj, dict) else None
                who = f"rule {i}" + (f" '{name}'" if isinstance(name, str) else "")
                line = _nearest_line(lines, exc.path)
                raise InputError(f"{who}: {exc}", file=file, line=line, field=_field(exc.path)) from None
            rule.line = lines.get(path)
            names.add(rule.name)
            rules.append(rule)
        return cls(rules, description=description, source=file)

    # ----------------------------------------------------------------- editing / saving
    def add_review_rule(self, *, token: str | None = None, tool: str | None = None,
                        when: Mapping[str, Any] | None = None, state: Mapping[str, Any] | None = None,
                        review_id: str | None = None, reason: str = "", reviewer: str | None = None,
                        tolerance: float = 0.1) -> MaskRule:
        """Add the rule a rejected review becomes: block ``token`` (or every token of
        ``tool``) when the state matches ``when`` (or, given ``state``, the pattern of
        that state — see :func:`state_pattern`).  An identical rule is not added twice."""
        if (token is None) == (tool is None):
            raise InputError("a review rule blocks exactly one token or one tool")
        if when is None:
            if state is None:
                raise InputError("a review rule needs the state pattern (when=...) or the reviewed state")
            when = state_pattern(state, tolerance=tolerance)
        targets = {"tokens": [token]} if token else {"tools": [tool]}
        for r in self.rules:
            if r.kind == "review" and r.targets == targets and r.when == dict(when):
                return r
        meta = {k: v for k, v in (("review_id", review_id), ("reviewer", reviewer),
                                  ("created_at", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())))
                if v is not None}
        base = f"review_{review_id}" if review_id else f"review_{len(self.rules)}"
        name, n = base, 1
        while any(r.name == name for r in self.rules):
            n += 1
            name = f"{base}_{n}"
        obj = {"name": name, "kind": "review", "targets": targets, "when": dict(when),
               "message": reason or f"rejected in review{f' {review_id}' if review_id else ''}",
               "meta": meta}
        try:
            rule = _parse_rule(obj, len(self.rules), (), {r.name for r in self.rules})
        except _RuleError as exc:
            raise InputError(f"review rule: {exc}", field=_field(exc.path) or None) from None
        self.rules.append(rule)
        return rule

    def add_rules(self, rules_data: Sequence[Mapping[str, Any]]) -> list[MaskRule]:
        """Parse and append rules given as data (e.g. review rules stored in the workspace)."""
        added: list[MaskRule] = []
        names = {r.name for r in self.rules}
        for obj in rules_data:
            index = len(self.rules)
            try:
                rule = _parse_rule(dict(obj) if isinstance(obj, Mapping) else obj, index, (index,), names)
            except _RuleError as exc:
                name = obj.get("name") if isinstance(obj, Mapping) else None
                raise InputError(f"rule {index}" + (f" '{name}'" if isinstance(name, str) else "")
                                 + f": {exc}", field="rules" + _field(exc.path)) from None
            names.add(rule.name)
            self.rules.append(rule)
            added.append(rule)
        return added

    def to_data(self) -> dict[str, Any]:
        out: dict[str, Any] = {"version": 1}
        if self.description:
            out["description"] = self.description
        out["rules"] = [r.to_dict() for r in self.rules]
        return out

    def to_yaml(self) -> str:
        """The rules as YAML text (loads back to equal rules)."""
        return safe_yaml.dump(self.to_data(), sort_keys=False, allow_unicode=True, width=100)

    def save(self, path: str | Path) -> Path:
        """Write the YAML atomically (temp file, then rename)."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=p.name, suffix=".tmp", dir=p.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(self.to_yaml())
            os.replace(tmp, p)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return p

    # ----------------------------------------------------------------- compiling
    def compile(self, catalog: Catalog) -> "CompiledMasks":
        """Matrices of these rules over ``catalog``'s tokens (targets resolved, features typed)."""
        return CompiledMasks(self, catalog)


def _nearest_line(lines: Mapping[tuple, int], path: tuple) -> int | None:
    p = tuple(path)
    while p:
        if p in lines:
            return lines[p]
        p = p[:-1]
    return lines.get(())


# --------------------------------------------------------------------------- target resolution
def _preset_matches(token: ActionToken, preset: Mapping[str, Any]) -> bool:
    for param, want in preset.items():
        if param not in token.preset:
            return False
        wants = want if isinstance(want, list) else [want]
        if value_key(token.preset[param]) not in {value_key(w) for w in wants}:
            return False
    return True


def rule_targets(rule: MaskRule, catalog: Catalog) -> list[int]:
    """Token ids a rule targets (errors name the rule and what is unknown)."""
    t = rule.targets
    chosen: set[int] = set()
    for tool in t.get("tools", []):
        if tool not in catalog.tools:
            near = difflib.get_close_matches(tool, list(catalog.tools), n=3)
            hint = f"; did you mean {', '.join(near)}?" if near else ""
            raise _compile_error(rule, f"unknown tool '{tool}' (catalog {catalog.version} has "
                                 f"{len(catalog.tools)} tools){hint}", "targets.tools")
        chosen.update(catalog.tool_tokens(tool))
    for name in t.get("tokens", []):
        try:
            chosen.add(catalog.token(name).id)
        except InputError:
            raise _compile_error(rule, f"unknown token '{name}' in catalog {catalog.version}",
                                 "targets.tokens") from None
    for level in t.get("risk", []):
        chosen.update(tok.id for tok in catalog.tokens if tok.tool is not None and tok.risk == level)
    if "preset" in t:
        pool = chosen if any(k in t for k in ("tools", "tokens", "risk")) else \
            {tok.id for tok in catalog.tokens if tok.tool is not None}
        chosen = {i for i in pool if _preset_matches(catalog.tokens[i], t["preset"])}
    if not chosen:
        raise _compile_error(rule, "its targets match no token of the catalog", "targets")
    return sorted(chosen)


def _compile_error(rule: MaskRule, message: str, fld: str) -> InputError:
    return InputError(f"{rule.describe()}: {message}", line=rule.line,
                      field=f"rules[{rule.index}].{fld}")


def _limit_groups(rule: MaskRule, catalog: Catalog, targets: Sequence[int]) -> list[Any]:
    """Counter key of each target token of a business rule.

    ``per`` keys are tried in order for each token: ``tool`` and ``token`` always apply; a
    parameter applies when it is a preset of the token's tool and its preset names one value
    (not ``<other>``/``<unset>``).  With no key applying, the token counts alone when its
    preset is a catch-all, and the rule is refused when the parameter is not a preset."""
    per = (rule.limit or {}).get("per")
    if per is None:
        return [("all",)] * len(targets)
    keys_tried = [per] if isinstance(per, str) else list(per)
    out: list[Any] = []
    for i in targets:
        tok = catalog.tokens[i]
        key: Any = None
        catch_all = False
        for k in keys_tried:
            if k == "token":
                key = ("token", i)
            elif k == "tool":
                key = ("tool", tok.tool or tok.name)
            elif k in tok.preset:
                v = tok.preset[k]
                if v in (OTHER, UNSET):
                    catch_all = True
                    continue
                key = ("value", value_key(v))
            else:
                continue
            break
        if key is None and catch_all:
            key = ("token", i)
        if key is None:
            params = ", ".join(d.param for d in catalog.dims(tok.tool)) if tok.tool else ""
            raise _compile_error(rule, f"limit.per {per!r} does not apply to {tok.tool or tok.name}: "
                                 f"not a preset parameter of it (its presets: {params or 'none'}); "
                                 f"add 'tool' as a last key, e.g. per: [{keys_tried[0]}, tool]", "limit.per")
        out.append(key)
    return out


# --------------------------------------------------------------------------- compiled masks
@dataclass
class MaskResult:
    """Allowed actions per state: ``mask[b, a]`` is True when action ``a`` may be taken."""

    mask: Any            # np.ndarray[B, A] bool (torch.Tensor in evaluate_torch)
    fallback: Any        # [B] bool: every action was blocked, F0/E0 kept allowed
    messages: list[str]


@dataclass
class _LimitRule:
    index: int              # the rule's column in ``fire``
    cols: np.ndarray        # [n] target token ids, sorted by counter
    group: np.ndarray       # [n] counter of each target token (0..K-1, non-decreasing)
    starts: np.ndarray      # [K] first position of each counter in ``cols``
    maximum: int


def _padded(rows: Sequence[Sequence[int]], pad: int) -> np.ndarray:
    """Ragged index lists as one ``[n, width]`` matrix, padded with ``pad``.

    Evaluation gathers ``x[:, idx]`` → ``[B, n, width]`` and reduces with all/any over the
    last axis: boolean set algebra as array ops, identical in numpy and torch."""
    width = max([len(r) for r in rows] + [1])
    out = np.full((len(rows), width), pad, np.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


class CompiledMasks:
    """Mask rules resolved against one catalog, as index matrices for batched evaluation.

    Pipeline (each step one array op over the batch; loops only over op kinds):
    atoms ``[B, n_atoms]`` (feature tests) → clauses ``[B, n_clauses]`` (AND of atoms) →
    rules ``[B, R]`` (OR of when-clauses, minus unless-clauses, unknown features) →
    token classes ``[B, K]`` (OR of the rules that target a class of tokens) → mask
    ``[B, A]`` (each token reads its class) → business limits on their target columns
    → fallback rows.

    ``evaluate(features, action_counts)``: ``features[name]`` is a length-B array per
    feature in :attr:`required_features` (numbers, or strings for categorical ones;
    NaN/None = unknown); ``action_counts`` is ``[B, A]``, how often each token was taken
    in the counting window (only needed when there are business limits)."""

    def __init__(self, rules: MaskRules, catalog: Catalog):
        self.rules = rules
        self.catalog = catalog
        self.catalog_version = catalog.version
        self.n_actions = A = len(catalog)
        self.rule_names = [r.name for r in rules]
        try:
            self._compile(rules, catalog, A)
        except InputError as exc:
            if rules.source and exc.file is None:
                raise InputError(exc.reason, file=rules.source, line=exc.line, field=exc.field) from None
            raise
        self._torch_cache: dict[str, dict[str, Any]] = {}

    # ----------------------------------------------------------------- compile
    def _compile(self, rules: MaskRules, catalog: Catalog, A: int) -> None:
        R = len(rules.rules)
        # Feature typing: a feature compared with strings anywhere is categorical.
        kinds: dict[str, tuple[bool, MaskRule]] = {}
        for rule in rules:
            for cond in (rule.when_cond, rule.unless_cond):
                for atom in _atoms(cond):
                    cat = atom.categorical or atom.feature == "task_type"
                    if atom.feature == "task_type" and not atom.categorical:
                        raise _compile_error(rule, "task_type is text: compare it with eq/ne/in/not_in "
                                             "and strings", "when")
                    if cat and atom.op not in EQ_OPS + SET_OPS:
                        raise _compile_error(rule, f"'{atom.op}' needs numbers but feature "
                                             f"'{atom.feature}' is compared with text", "when")
                    seen = kinds.setdefault(atom.feature, (cat, rule))
                    if seen[0] != cat:
                        raise _compile_error(rule, f"feature '{atom.feature}' is text in "
                                             f"{seen[1].describe()} but a number here", "when")
        self.numeric_features = sorted(f for f, (c, _) in kinds.items() if not c)
        self.categorical_features = sorted(f for f, (c, _) in kinds.items() if c)
        self.required_features = sorted(kinds)
        self.vocab: dict[str, dict[str, int]] = {}
        for f in self.categorical_features:
            vals: set[str] = set()
            for rule in rules:
                for atom in _atoms(rule.when_cond) + _atoms(rule.unless_cond):
                    if atom.feature == f:
                        vals.update(atom.value if isinstance(atom.value, tuple) else [atom.value])
            self.vocab[f] = {v: i for i, v in enumerate(sorted(vals))}
        num_idx = {f: i for i, f in enumerate(self.numeric_features)}
        cat_idx = {f: i for i, f in enumerate(self.categorical_features)}
        F = len(num_idx) + len(cat_idx)

        # Atoms (deduplicated) and clauses.
        atoms: dict[str, int] = {}
        atom_list: list[Atom] = []
        clauses: list[tuple[int, ...]] = []
        when_cl: list[list[int]] = []
        unless_cl: list[list[int]] = []

        def add_cond(cond: Cond | None) -> list[int]:
            if cond is None:
                return []
            ids = []
            for clause in cond.dnf():
                aids = []
                for atom in clause:
                    k = atom.key()
                    if k not in atoms:
                        atoms[k] = len(atom_list)
                        atom_list.append(atom)
                    aids.append(atoms[k])
                ids.append(len(clauses))
                clauses.append(tuple(sorted(set(aids))))
            return ids

        for rule in rules:
            when_cl.append(add_cond(rule.when_cond))
            unless_cl.append(add_cond(rule.unless_cond))
        n_atoms, n_cl = len(atom_list), len(clauses)
        # atoms get two constant columns: n_atoms = True, n_atoms + 1 = False;
        # clauses likewise: n_cl = False, n_cl + 1 = True; unknown-flags: F = False.
        self._clause_idx = _padded(clauses, n_atoms)                         # AND, pad True
        self._when_idx = _padded([w or [n_cl + 1] for w in when_cl], n_cl)  # OR, pad False
        self._unless_idx = _padded(unless_cl, n_cl)                          # OR, pad False
        self._feature_idx = _padded(
            [sorted(num_idx[f] if f in num_idx else len(num_idx) + cat_idx[f] for f in rule.features())
             for rule in rules], F)                                           # OR, pad False
        self._block_unknown = np.array([r.if_unknown == "block" for r in rules], bool)
        self._n_atoms, self._n_clauses, self._n_features = n_atoms, n_cl, F

        # Atom evaluation plans, grouped by operation so each group is one vector op.
        plans: dict[str, list[tuple[int, int, Any]]] = {}
        for a, atom in enumerate(atom_list):
            if atom.feature in cat_idx:
                plans.setdefault("cat", []).append((a, cat_idx[atom.feature], atom))
            elif atom.op in SET_OPS:
                plans.setdefault("num_set", []).append((a, num_idx[atom.feature], atom))
            else:
                plans.setdefault(atom.op, []).append((a, num_idx[atom.feature], atom.value))
        self._plans: dict[str, dict[str, np.ndarray]] = {}
        for op, items in plans.items():
            pos = np.array([x[0] for x in items], np.int64)
            feat = np.array([x[1] for x in items], np.int64)
            if op == "cat":
                width = max(len(self.vocab[self.categorical_features[x[1]]]) for x in items) + 2
                table = np.zeros((len(items), width), bool)  # column 0 = unknown, 1.. = codes, last = other
                for k, (_, fi, atom) in enumerate(items):
                    voc = self.vocab[self.categorical_features[fi]]
                    vals = set(atom.value) if isinstance(atom.value, tuple) else {atom.value}
                    member = np.zeros(width, bool)
                    member[[voc[v] + 1 for v in vals]] = True
                    # "other" (a value no rule names) sits at column len(voc)+1 and is never a member.
                    if atom.op in ("ne", "not_in"):
                        member[1:] = ~member[1:]
                        member[len(voc) + 2:] = False
                    table[k] = member
                self._plans[op] = {"pos": pos, "feat": feat, "table": table}
            elif op == "num_set":
                width = max(len(x[2].value) for x in items)
                set_values = np.full((len(items), width), np.nan)
                neg = np.zeros(len(items), bool)
                for k, (_, _, atom) in enumerate(items):
                    set_values[k, : len(atom.value)] = atom.value
                    neg[k] = atom.op == "not_in"
                self._plans[op] = {"pos": pos, "feat": feat, "vals": set_values, "neg": neg}
            elif op in RANGE_OPS:
                self._plans[op] = {"pos": pos, "feat": feat,
                                   "lo": np.array([x[2][0] for x in items]),
                                   "hi": np.array([x[2][1] for x in items])}
            else:
                self._plans[op] = {"pos": pos, "feat": feat, "thr": np.array([x[2] for x in items], float)}

        # Targets: condition rules → token classes; limit rules → counter groups.
        self._rule_targets: list[list[int]] = [rule_targets(rule, catalog) for rule in rules]
        cond_rules = [r for r, rule in enumerate(rules) if rule.limit is None]
        T = np.zeros((len(cond_rules), A), bool)
        for k, r in enumerate(cond_rules):
            T[k, self._rule_targets[r]] = True
        # Tokens targeted by the same set of rules share a class; class K = untargeted.
        if A and cond_rules:
            sig, token_class = np.unique(T.T, axis=0, return_inverse=True)
        else:
            sig, token_class = np.zeros((1, len(cond_rules)), bool), np.zeros(A, np.int64)
        token_class = np.asarray(token_class).reshape(-1)
        keep = np.flatnonzero(sig.any(axis=1))
        remap = np.full(len(sig), len(keep), np.int64)
        remap[keep] = np.arange(len(keep))
        self._token_class = remap[token_class]
        self._n_classes = len(keep)
        cond = np.array(cond_rules, np.int64)
        self._class_idx = _padded([cond[np.flatnonzero(sig[c])].tolist() for c in keep], R)  # OR, pad False
        self._limits: list[_LimitRule] = []
        for r, rule in enumerate(rules):
            if rule.limit is None:
                continue
            keys = _limit_groups(rule, catalog, self._rule_targets[r])
            uniq = {k: i for i, k in enumerate(dict.fromkeys(keys))}
            group = np.array([uniq[k] for k in keys], np.int64)
            order = np.argsort(group, kind="stable")
            cols = np.array(self._rule_targets[r], np.int64)[order]
            group = group[order]
            starts = np.flatnonzero(np.concatenate([[True], group[1:] != group[:-1]]))
            self._limits.append(_LimitRule(r, cols, group, starts, int(rule.limit["max"])))
        #: Tokens whose action counts the limits read (sorted): a mask depends on the counts
        #: of these alone.
        self.counted_tokens = np.unique(np.concatenate([lim.cols for lim in self._limits] or [np.zeros(0, np.int64)]))

    def rule_targets(self, index: int) -> list[int]:
        """Token ids that rule ``index`` targets in this catalog."""
        return list(self._rule_targets[index])

    # ----------------------------------------------------------------- features
    def codes(self, feature: str, values: Iterable[Any]) -> np.ndarray:
        """Integer codes of a categorical feature's values (-1 = unknown), for
        :meth:`evaluate_torch` on a device."""
        if feature not in self.vocab:
            raise InputError(f"'{feature}' is not a categorical feature of these rules "
                             f"(categorical: {', '.join(self.categorical_features) or 'none'})")
        voc = self.vocab[feature]
        other = len(voc)
        return np.array([-1 if _unknown(v) else voc.get(category_text(v), other) for v in values], np.int64)

    def encode_features(self, features: Mapping[str, Any], batch: int | None = None
                        ) -> tuple[np.ndarray, np.ndarray]:
        """``(numeric [B, Fn] float64 with NaN = unknown, codes [B, Fc] int64 with -1 = unknown)``."""
        missing = [f for f in self.required_features if f not in features]
        if missing:
            raise InputError(f"state feature(s) {', '.join(missing)} missing; these mask rules need "
                             f"{', '.join(self.required_features)} (pass NaN/None where unknown)")
        if batch is None:
            batch = len(features[self.required_features[0]]) if self.required_features else 0
        X = np.empty((batch, len(self.numeric_features)), np.float64)
        for j, f in enumerate(self.numeric_features):
            X[:, j] = _numeric_column(f, features[f], batch)
        codes = np.empty((batch, len(self.categorical_features)), np.int64)
        for j, f in enumerate(self.categorical_features):
            v = features[f]
            if isinstance(v, np.ndarray) and v.dtype.kind in "iu":
                col = v.astype(np.int64)  # already codes
            else:
                col = self.codes(f, _as_list(v))
            if len(col) != batch:
                raise InputError(f"feature '{f}' has {len(col)} values for a batch of {batch}", field=f)
            codes[:, j] = col
        return X, codes

    # ----------------------------------------------------------------- numpy evaluation
    def evaluate(self, features: Mapping[str, Any], action_counts: np.ndarray | None = None
                 ) -> MaskResult:
        """Masks for a batch of states (numpy): boolean algebra, no loop over states.

        ``mask`` is a ``[B, A]`` view of a token-major buffer (``mask.T`` is contiguous)."""
        B = self._batch(features, action_counts)
        X, codes = self.encode_features(features, B)
        # read only by the count limits
        counts = np.asarray(action_counts) if self._limits else np.empty((B, 0), np.int64)
        fire = self._fire_numpy(X, codes)
        fire_ext = np.zeros((B, fire.shape[1] + 1), bool)
        fire_ext[:, :-1] = fire
        class_blocked = fire_ext[:, self._class_idx].any(axis=2)        # [B, K]
        # Token-major: each token copies its class's row of B verdicts (one row gather).
        allowed = np.ones((self._n_classes + 1, B), bool)
        allowed[:-1] = ~class_blocked.T
        mask_t = allowed[self._token_class]                              # [A, B]
        for lim in self._limits:
            # Sum the counts of the tokens sharing a counter; only target columns are read.
            group_counts = np.add.reduceat(counts[:, lim.cols], lim.starts, axis=1)   # [B, K]
            over = group_counts >= lim.maximum
            blocked = over[:, lim.group] & fire[:, lim.index][:, None]
            mask_t[lim.cols] &= ~blocked.T
        fallback = ~mask_t.any(axis=0)
        mask_t[self.catalog.final_id] |= fallback
        mask_t[self.catalog.escalate_id] |= fallback
        return MaskResult(mask_t.T, fallback, self._messages(np.flatnonzero(fallback), B))

    def _fire_numpy(self, X: np.ndarray, codes: np.ndarray) -> np.ndarray:
        """``[B, R]`` whether each rule fires (its condition; limits are applied later)."""
        B = X.shape[0]
        atoms = np.zeros((B, self._n_atoms + 2), bool)
        atoms[:, self._n_atoms] = True
        for op, p in self._plans.items():
            if op == "cat":
                atoms[:, p["pos"]] = p["table"][np.arange(len(p["pos"]))[None, :], codes[:, p["feat"]] + 1]
                continue
            v = X[:, p["feat"]]
            if op == "num_set":
                hit = (v[:, :, None] == p["vals"][None]).any(-1)
                atoms[:, p["pos"]] = hit ^ p["neg"][None, :]
            elif op == "between":
                atoms[:, p["pos"]] = (v >= p["lo"]) & (v <= p["hi"])
            elif op == "outside":
                atoms[:, p["pos"]] = (v < p["lo"]) | (v > p["hi"])
            else:
                atoms[:, p["pos"]] = _CMP[op](v, p["thr"])
        clauses = np.zeros((B, self._n_clauses + 2), bool)
        clauses[:, : self._n_clauses] = atoms[:, self._clause_idx].all(axis=2)
        clauses[:, self._n_clauses + 1] = True
        when = clauses[:, self._when_idx].any(axis=2)
        unless = clauses[:, self._unless_idx].any(axis=2)
        unknown = np.zeros((B, self._n_features + 1), bool)
        unknown[:, : X.shape[1]] = np.isnan(X)
        unknown[:, X.shape[1] : self._n_features] = codes < 0
        rule_unknown = unknown[:, self._feature_idx].any(axis=2)
        return np.where(rule_unknown, self._block_unknown[None, :], when & ~unless)

    # ----------------------------------------------------------------- torch evaluation
    def _torch_consts(self, device: "torch.device") -> dict[str, Any]:
        import torch

        key = str(device)
        if key not in self._torch_cache:
            t = lambda a, dt=None: torch.as_tensor(a, device=device, dtype=dt)  # noqa: E731
            plans = {op: {k: t(v) for k, v in p.items()} for op, p in self._plans.items()}
            self._torch_cache[key] = {
                "plans": plans, "clause_idx": t(self._clause_idx), "when_idx": t(self._when_idx),
                "unless_idx": t(self._unless_idx), "feature_idx": t(self._feature_idx),
                "block_unknown": t(self._block_unknown), "class_idx": t(self._class_idx),
                "token_class": t(self._token_class),
                "limits": [(lim.index, t(lim.cols), t(lim.group), len(lim.starts), lim.maximum)
                           for lim in self._limits],
            }
        return self._torch_cache[key]

    def evaluate_torch(self, features: Mapping[str, Any], action_counts: "torch.Tensor | None" = None,
                       *, device: "torch.device | str | None" = None, messages: bool = True) -> MaskResult:
        """Masks for a batch of states with torch, on the device of the inputs (or ``device``).

        Numeric features: tensors (or arrays/lists); categorical features: int64 code
        tensors from :meth:`codes` (or lists/arrays of strings, encoded on the CPU).
        ``messages=False`` skips the one host sync that writing the fallback message needs.
        The returned mask is a ``[B, A]`` view of a token-major buffer (``mask.t()`` is
        contiguous); call ``.contiguous()`` when row-major storage is needed."""
        import torch

        if device is None:
            device = next((v.device for v in (action_counts, *features.values())
                           if isinstance(v, torch.Tensor)), torch.device("cpu"))
        device = torch.device(device)
        B = self._batch(features, action_counts)
        k = self._torch_consts(device)
        X = torch.empty((B, len(self.numeric_features)), dtype=torch.float64, device=device)
        for j, f in enumerate(self.numeric_features):
            v = features.get(f) if f in features else None
            if v is None:
                raise InputError(f"state feature '{f}' missing; these mask rules need "
                                 f"{', '.join(self.required_features)}")
            X[:, j] = (v.to(device=device, dtype=torch.float64) if isinstance(v, torch.Tensor)
                       else torch.as_tensor(_numeric_column(f, v, B), device=device))
        codes = torch.empty((B, len(self.categorical_features)), dtype=torch.int64, device=device)
        for j, f in enumerate(self.categorical_features):
            if f not in features:
                raise InputError(f"state feature '{f}' missing; these mask rules need "
                                 f"{', '.join(self.required_features)}")
            v = features[f]
            if isinstance(v, torch.Tensor):
                if v.dtype.is_floating_point or v.dtype == torch.bool:
                    raise InputError(f"categorical feature '{f}' must be int64 codes from "
                                     f"CompiledMasks.codes(), not {v.dtype}", field=f)
                codes[:, j] = v.to(device=device, dtype=torch.int64)
            else:
                arr = v if isinstance(v, np.ndarray) and v.dtype.kind in "iu" else self.codes(f, _as_list(v))
                codes[:, j] = torch.as_tensor(arr, device=device, dtype=torch.int64)

        # Everything runs state-minor ([items, B]): every gather is then a row gather
        # (x[idx] on dim 0, contiguous rows of B), the fastest pattern on CPU and GPU alike.
        XT, codesT = X.t().contiguous(), codes.t().contiguous()

        atoms = torch.zeros((self._n_atoms + 2, B), dtype=torch.bool, device=device)
        atoms[self._n_atoms] = True
        for op, p in k["plans"].items():
            if op == "cat":
                table = p["table"]
                c = codesT[p["feat"]] + 1                                          # [n, B]
                flat = torch.arange(table.shape[0], device=device)[:, None] * table.shape[1] + c
                atoms[p["pos"]] = torch.take(table, flat)
                continue
            v = XT[p["feat"]]                                                    # [n, B]
            if op == "num_set":
                hit = (v[:, None, :] == p["vals"][:, :, None]).any(dim=1)
                val = hit ^ p["neg"][:, None]
            elif op == "between":
                val = (v >= p["lo"][:, None]) & (v <= p["hi"][:, None])
            elif op == "outside":
                val = (v < p["lo"][:, None]) | (v > p["hi"][:, None])
            else:
                val = _TORCH_CMP[op](v, p["thr"][:, None])
            atoms[p["pos"]] = val
        n_cl = self._n_clauses
        clauses = torch.zeros((n_cl + 2, B), dtype=torch.bool, device=device)
        clauses[:n_cl] = atoms[k["clause_idx"]].all(dim=1)
        clauses[n_cl + 1] = True
        when = clauses[k["when_idx"]].any(dim=1)                          # [R, B]
        unless = clauses[k["unless_idx"]].any(dim=1)
        unknown = torch.zeros((self._n_features + 1, B), dtype=torch.bool, device=device)
        unknown[: XT.shape[0]] = torch.isnan(XT)
        unknown[XT.shape[0] : self._n_features] = codesT < 0
        rule_unknown = unknown[k["feature_idx"]].any(dim=1)
        fire = torch.zeros((len(self.rule_names) + 1, B), dtype=torch.bool, device=device)
        fire[:-1] = torch.where(rule_unknown, k["block_unknown"][:, None].expand_as(when), when & ~unless)
        allowed = torch.ones((self._n_classes + 1, B), dtype=torch.bool, device=device)
        allowed[:-1] = ~fire[k["class_idx"]].any(dim=1)
        maskT = allowed[k["token_class"]]                                        # [A, B]
        if k["limits"]:
            if action_counts is None:
                raise InputError("these mask rules have business limits: pass action_counts [B, A]")
            counts = torch.as_tensor(action_counts, device=device)
            for r, cols, group, n_groups, maximum in k["limits"]:
                sub = counts[:, cols].t()                                         # [n, B]
                group_counts = torch.zeros((n_groups, B), dtype=sub.dtype, device=device)
                group_counts.index_add_(0, group, sub)
                blocked = (group_counts[group] >= maximum) & fire[r][None, :]
                maskT[cols] &= ~blocked
        fallback = (maskT.view(torch.uint8).amax(dim=0) == 0 if maskT.shape[0] else
                    torch.ones(B, dtype=torch.bool, device=device))
        maskT[self.catalog.final_id] |= fallback
        maskT[self.catalog.escalate_id] |= fallback
        mask = maskT.t()  # [B, A] view of the token-major buffer
        msgs = self._messages(torch.nonzero(fallback).flatten().cpu().numpy(), B) if messages else []
        return MaskResult(mask, fallback, msgs)

    # ----------------------------------------------------------------- helpers
    def _batch(self, features: Mapping[str, Any], action_counts: Any) -> int:
        if action_counts is not None:
            shape = tuple(action_counts.shape)
            if len(shape) != 2 or shape[1] != self.n_actions:
                raise InputError(f"action_counts must be [batch, {self.n_actions}] (one column per "
                                 f"token of catalog {self.catalog_version}), got {list(shape)}")
            return shape[0]
        if self._limits:
            raise InputError("these mask rules have business limits: pass action_counts [B, A]")
        for f in (*self.required_features, *features):
            if f in features:
                return len(features[f])
        raise InputError("cannot tell the batch size: pass action_counts or a feature array")

    def _messages(self, rows: np.ndarray, B: int) -> list[str]:
        if len(rows) == 0:
            return []
        shown = ", ".join(str(int(r)) for r in rows[:10]) + (", …" if len(rows) > 10 else "")
        return [f"{len(rows)} of {B} states had every action masked (rows {shown}); final answer "
                f"(F0) and escalate (E0) were kept allowed there. The rules are too strict for these "
                f"states: check them with explain()."]

    # ----------------------------------------------------------------- slow reference
    def evaluate_reference(self, features: Mapping[str, Any], action_counts: np.ndarray | None = None
                           ) -> MaskResult:
        """The obvious per-state, per-token, per-rule loop (for tests and explanations)."""
        B = self._batch(features, action_counts)
        mask = np.ones((B, self.n_actions), bool)
        columns = {f: _as_list(features[f]) for f in self.required_features}
        for b in range(B):
            row = {f: columns[f][b] for f in self.required_features}
            counts = None if action_counts is None else np.asarray(action_counts)[b]
            for a, rules in self.explain(row, counts).items():
                mask[b, self.catalog.token(a).id] = not rules
        fallback = ~mask.any(axis=1)
        mask[fallback, self.catalog.final_id] = True
        mask[fallback, self.catalog.escalate_id] = True
        return MaskResult(mask, fallback, self._messages(np.flatnonzero(fallback), B))

    def explain(self, state: Mapping[str, Any], action_counts: Sequence[float] | None = None
                ) -> dict[str, list[str]]:
        """For one state: token name → names of the rules that block it (empty = allowed)."""
        out: dict[str, list[str]] = {t.name: [] for t in self.catalog.tokens}
        for r, rule in enumerate(self.rules):
            if not _rule_fires(rule, state):
                continue
            targets = self._rule_targets[r]
            if rule.limit is None:
                for a in targets:
                    out[self.catalog.tokens[a].name].append(rule.name)
                continue
            if action_counts is None:
                raise InputError("these mask rules have business limits: pass action_counts")
            keys = _limit_groups(rule, self.catalog, targets)
            totals: dict[Any, float] = {}
            for a, key in zip(targets, keys):
                totals[key] = totals.get(key, 0.0) + float(action_counts[a])
            for a, key in zip(targets, keys):
                if totals[key] >= rule.limit["max"]:
                    out[self.catalog.tokens[a].name].append(rule.name)
        return out


def _rule_fires(rule: MaskRule, state: Mapping[str, Any]) -> bool:
    feats = rule.features()
    if any(_unknown(state.get(f)) for f in feats):
        return rule.if_unknown == "block"
    row = {f: state[f] for f in feats}
    when = rule.when_cond.holds(row) if rule.when_cond is not None else True
    unless = rule.unless_cond.holds(row) if rule.unless_cond is not None else False
    return when and not unless


def category_text(v: Any) -> str:
    """A state value as the text categorical rules compare (1.0 → "1", True → "true")."""
    if isinstance(v, str):
        return v
    if isinstance(v, (bool, np.bool_)):
        return "true" if v else "false"
    if isinstance(v, (float, np.floating)) and float(v).is_integer():
        return str(int(v))
    return str(v)


def _unknown(v: Any) -> bool:
    return v is None or (isinstance(v, (float, np.floating)) and math.isnan(v))


def _atoms(cond: Cond | None) -> list[Atom]:
    if cond is None:
        return []
    out: list[Atom] = []
    for c in cond.children:
        out.extend([c] if isinstance(c, Atom) else _atoms(c))
    return out


def _as_list(v: Any) -> list[Any]:
    if isinstance(v, np.ndarray):
        return v.tolist()
    try:
        import torch

        if isinstance(v, torch.Tensor):
            return v.tolist()
    except ImportError:  # pragma: no cover
        pass
    return list(v)


def _numeric_column(name: str, values: Any, batch: int) -> np.ndarray:
    if isinstance(values, np.ndarray) and values.dtype.kind in "fiub":
        col = values.astype(np.float64)
    else:
        vals = _as_list(values)
        bad = next((v for v in vals if v is not None and not isinstance(v, (int, float, bool, np.number))),
                   _NOTHING)
        if bad is not _NOTHING:
            raise InputError(f"feature '{name}' must be numeric (rules compare it with numbers), "
                             f"got {bad!r}", field=name)
        col = np.array([np.nan if v is None else float(v) for v in vals], np.float64)
    if col.shape != (batch,):
        raise InputError(f"feature '{name}' has {col.shape[0] if col.ndim else 0} values for a batch of "
                         f"{batch}", field=name)
    return col


_NOTHING = object()

_CMP = {"gt": np.greater, "lt": np.less, "ge": np.greater_equal, "le": np.less_equal,
        "eq": np.equal, "ne": np.not_equal}


class _TorchCmp(dict):
    def __missing__(self, op: str):
        import torch

        fn = {"gt": torch.gt, "lt": torch.lt, "ge": torch.ge, "le": torch.le, "eq": torch.eq,
              "ne": torch.ne}[op]
        self[op] = fn
        return fn


_TORCH_CMP = _TorchCmp()


def state_features(states: Sequence[Mapping[str, Any] | None],
                   task_types: Sequence[str | None] | None = None) -> dict[str, np.ndarray]:
    """Feature arrays for a batch of ``Step.observation["state"]`` dicts (NaN/None where a
    state lacks a key), plus ``task_type`` when given."""
    keys = sorted({k for s in states if s for k in s})
    out: dict[str, np.ndarray] = {}
    for k in keys:
        vals = [None if not s else s.get(k) for s in states]
        if all(v is None or (isinstance(v, (int, float)) and not isinstance(v, str)) for v in vals):
            out[k] = np.array([np.nan if v is None else float(v) for v in vals], np.float64)
        else:
            out[k] = np.array(vals, dtype=object)
    if task_types is not None:
        out["task_type"] = np.array(list(task_types), dtype=object)
    return out


def load_masks(path: str | Path, catalog: Catalog) -> CompiledMasks:
    """Read a masks YAML file and compile it against ``catalog``."""
    return MaskRules.from_yaml(Path(path)).compile(catalog)


@dataclass(frozen=True)
class BehaviourBlocked:
    """What mask rules would block of one logged behaviour's steps (:class:`LoggedMaskReport`)."""

    steps: int
    #: Steps whose logged action maps to a catalog token (not INVALID).
    valid_actions: int
    #: Of those, actions the masks forbid in the step's state.
    blocked: int


@dataclass(frozen=True)
class LoggedMaskReport:
    """How many logged actions mask rules would block (:func:`logged_mask_report`)."""

    steps: int
    #: Valid logged actions the masks forbid in their state.
    blocked: int
    #: States in which the masks leave no action (the fallback applies).
    fallback_states: int
    #: Logged behaviour → its steps and blocked actions, behaviours in name order.
    by_behaviour: dict[str, BehaviourBlocked]
    #: Rule name → blocked logged actions it forbids (of the first 2000 blocked steps).
    by_rule: dict[str, int]


@dataclass(frozen=True)
class MaskRuleCheck:
    """One compiled mask rule and the tokens it targets (:class:`MaskCheck`)."""

    name: str
    kind: str
    #: Line of the rule in the YAML file (None when not read from a file).
    line: int | None
    n_targets: int
    #: Names of the tokens it targets, in id order.
    targets: list[str]


@dataclass(frozen=True)
class MaskCheck:
    """A mask-rules file compiled against a catalog (:func:`check_masks` with a tools file)."""

    file: str
    catalog_version: str
    n_tokens: int
    #: State features the rules read.
    required_features: list[str]
    rules: list[MaskRuleCheck]


@dataclass(frozen=True)
class MaskCheckOnDataset(MaskCheck):
    """A mask-rules file compiled against a dataset's catalog, with what the rules would
    have blocked in its logged episodes (:func:`check_masks` with a dataset)."""

    logged: LoggedMaskReport


def check_masks(path: str | Path, ws: Any = None, *, dataset: str | None = None,
                tools_file: str | Path | None = None) -> MaskCheck:
    """Compile a mask-rules file against a dataset's or a tools file's catalog and say what
    each rule targets (``rwb catalog masks``); errors name the rule and line.  With a
    dataset, the result is a :class:`MaskCheckOnDataset`: also what the rules would have
    blocked in its logged episodes."""
    if (dataset is None) == (tools_file is None):
        raise InputError("give exactly one of --dataset NAME or --tools FILE")
    if tools_file is not None:
        catalog = build_catalog(load_tools_file(tools_file))
    else:
        if ws is None:
            raise InputError("a workspace is needed to check masks against a dataset's catalog")
        catalog = catalog_for_dataset(ws, dataset)  # type: ignore[arg-type]
    compiled = MaskRules.from_yaml(Path(path)).compile(catalog)
    report = MaskCheck(
        file=str(path), catalog_version=catalog.version, n_tokens=len(catalog),
        required_features=compiled.required_features,
        rules=[MaskRuleCheck(name=r.name, kind=r.kind, line=r.line, n_targets=len(compiled.rule_targets(i)),
                             targets=[catalog.tokens[a].name for a in compiled.rule_targets(i)])
               for i, r in enumerate(compiled.rules)])
    if dataset is None:
        return report
    # What the rules would have blocked in the logged data (the expert should be untouched).
    return MaskCheckOnDataset(**{f.name: getattr(report, f.name) for f in fields(report)},
                              logged=logged_mask_report(compiled, ws.load_episodes(dataset)))


def logged_inputs(episodes: Sequence[Any], catalog: Catalog, features: Sequence[str] | None = None
                  ) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, np.ndarray]:
    """The mask inputs of every logged step: ``(features, episode_index [N], step_tokens [N],
    prior_tokens)``.

    ``features`` holds each step's ``observation["state"]`` plus ``task_type``;
    ``step_tokens`` is the logged action's token (-1 = INVALID); ``prior_tokens`` is a
    ``[M, 2]`` list of ``(step row, token)`` for every earlier valid action of the same
    episode — :func:`counts_from_prior` turns rows of it into ``action_counts``."""
    states, task_types, ep_index, actions = [], [], [], []
    for e, ep in enumerate(episodes):
        for step in ep.steps:
            obs = step.observation if isinstance(step.observation, dict) else {}
            raw_state = obs.get("state")
            state = raw_state if isinstance(raw_state, dict) else {}
            states.append({k: v for k, v in state.items() if features is None or k in features})
            task_types.append(ep.task.task_type)
            ep_index.append(e)
            actions.append(step.action)
    tokens = catalog.normalize_many(actions).token_ids if actions else np.zeros(0, np.int64)
    ep_arr = np.array(ep_index, np.int64)
    prior: list[tuple[int, int]] = []
    start = 0
    for n in range(1, len(ep_arr) + 1):
        if n == len(ep_arr) or ep_arr[n] != ep_arr[start]:
            for row in range(start, n):
                prior.extend((later, int(tokens[row])) for later in range(row + 1, n) if tokens[row] >= 0)
            start = n
    return (state_features(states, task_types), ep_arr, tokens,
            np.array(prior, np.int64).reshape(-1, 2))


def counts_from_prior(prior: np.ndarray, rows: np.ndarray, n_actions: int) -> np.ndarray:
    """``action_counts [len(rows), A]``: how often each token was taken earlier in the episode."""
    counts = np.zeros((len(rows), n_actions), np.int32)
    pos = np.full(int(rows.max()) + 1 if len(rows) else 0, -1, np.int64)
    pos[rows] = np.arange(len(rows))
    sel = prior[(prior[:, 0] < len(pos))] if len(prior) else prior
    sel = sel[pos[sel[:, 0]] >= 0] if len(sel) else sel
    np.add.at(counts, (pos[sel[:, 0]], sel[:, 1]), 1)
    return counts


def logged_mask_report(compiled: CompiledMasks, episodes: Sequence[Any], *, chunk: int = 4096
                       ) -> LoggedMaskReport:
    """How many logged actions the masks would block, per behaviour and per rule.

    A good rule set blocks (almost) nothing the expert did and catches what it should."""
    feats, ep_index, tokens, prior = logged_inputs(episodes, compiled.catalog, compiled.required_features)
    for f in compiled.required_features:
        if f not in feats:  # no step has it: unknown everywhere
            feats[f] = (np.array([None] * len(tokens), dtype=object) if f in compiled.categorical_features
                        else np.full(len(tokens), np.nan))
    behaviours = [episodes[e].behaviour or "unknown" for e in ep_index]
    blocked = np.zeros(len(tokens), bool)
    fallback = np.zeros(len(tokens), bool)
    for lo in range(0, len(tokens), chunk):
        rows = np.arange(lo, min(lo + chunk, len(tokens)))
        counts = counts_from_prior(prior, rows, compiled.n_actions)
        result = compiled.evaluate({f: v[rows] for f, v in feats.items()}, counts)
        valid = tokens[rows] >= 0
        blocked[rows[valid]] = ~result.mask[np.flatnonzero(valid), tokens[rows][valid]]
        fallback[rows] = result.fallback
    per_behaviour: dict[str, BehaviourBlocked] = {}
    for b in sorted(set(behaviours)):
        sel = np.array([x == b for x in behaviours])
        per_behaviour[b] = BehaviourBlocked(steps=int(sel.sum()), valid_actions=int((tokens[sel] >= 0).sum()),
                                            blocked=int(blocked[sel].sum()))
    by_rule: dict[str, int] = {}
    for row in np.flatnonzero(blocked)[:2000]:
        state = {f: feats[f][row] for f in compiled.required_features}
        counts = counts_from_prior(prior, np.array([row]), compiled.n_actions)[0]
        for name in compiled.explain(state, counts)[compiled.catalog.tokens[tokens[row]].name]:
            by_rule[name] = by_rule.get(name, 0) + 1
    return LoggedMaskReport(steps=len(tokens), blocked=int(blocked.sum()), fallback_states=int(fallback.sum()),
                            by_behaviour=per_behaviour, by_rule=by_rule)
