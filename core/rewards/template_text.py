"""An edited template written onto the text it was edited from, so that a save keeps that
text's comments, key order and layout (:func:`edited_text`).

Only what changed is rewritten: the edited template's data (:meth:`Template.to_dict`) is
compared with the source template's.  When only values changed (weights, parameters, gates,
return coefficients: what the editors and tuning change), each is replaced where it stands in
the text, found through ruamel.yaml's round-trip positions, and every other character is kept.
An edit that adds or removes keys is set in the round-trip tree and the tree written back
(comments and key order kept; a flow mapping that spanned lines is joined).  The source text has been validated by the bounded loader
(:mod:`core.base.safe_yaml`, through :func:`~core.rewards.template.parse_template`) before
ruamel reads it, and the rewritten text must parse back to the edited template; otherwise the
plain :meth:`Template.to_yaml` is written.

Details: docs/rewards.md (## Template versions).
"""

from __future__ import annotations

import io
import json
import re
from typing import Any

import yaml

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.error import YAMLError

from core.base.errors import InputError
from core.rewards.template import Template, parse_template

#: (mapping, sequence, offset) indents tried, in order, to write a text back in its own layout:
#: block lists flush with their key (``key:\n- a``) or indented under it (``key:\n  - a``).
INDENTS: tuple[tuple[int, int, int], ...] = ((2, 2, 0), (2, 4, 2), (4, 4, 0), (4, 6, 4))
#: Line width of the rewritten text: wide enough that no existing line is re-wrapped.
WIDTH = 4096


def _yaml(indent: tuple[int, int, int]) -> YAML:
    y = YAML(typ="rt")
    y.preserve_quotes = True
    y.width = WIDTH
    y.indent(mapping=indent[0], sequence=indent[1], offset=indent[2])
    return y


def _dump(y: YAML, tree: Any) -> str:
    out = io.StringIO()
    y.dump(tree, out)
    return out.getvalue()


def _layout(text: str, tree: Any) -> YAML:
    """The writer whose output of the unedited tree is closest to ``text`` (its own indents)."""
    lines = text.splitlines()
    best, best_misses = _yaml(INDENTS[0]), None
    for indent in INDENTS:
        y = _yaml(indent)
        dumped = _dump(y, tree)
        if dumped == text:
            return y
        misses = sum(a != b for a, b in zip(lines, dumped.splitlines())) + abs(len(lines) - dumped.count("\n"))
        if best_misses is None or misses < best_misses:
            best, best_misses = y, misses
    return best


def _merge(node: Any, old: Any, new: Any) -> Any:
    """``node`` (the source text's tree of ``old``) changed to hold ``new``: the node itself
    where nothing changed, else the node edited in place, else ``new``."""
    if old == new:
        return node
    if isinstance(node, CommentedMap) and isinstance(old, dict) and isinstance(new, dict):
        for key, value in new.items():
            if key in node:
                node[key] = _merge(node[key], old.get(key), value)
            elif old.get(key) != value:
                node[key] = value        # a key the edit adds (or a default the text left out, changed)
        for key in [k for k in node if k not in new and k in old]:
            del node[key]                # a key the edit removed
        return node
    if isinstance(node, CommentedSeq) and isinstance(old, list) and isinstance(new, list) and len(old) == len(new) \
            and len(node) == len(new):
        for i, value in enumerate(new):
            node[i] = _merge(node[i], old[i], value)
        return node
    return new


#: A text value written as it is (else as a JSON string, which YAML reads as a quoted one).
PLAIN_TEXT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-/]*")

#: One value to replace in the source text: (0-based line, column, in a flow collection, new value).
Spot = tuple[int, int, bool, Any]


def _spots(node: Any, old: Any, new: Any, out: list[Spot]) -> bool:
    """The scalar values to replace to turn ``old`` (held by ``node``) into ``new``, added to
    ``out``; False when the edit changes the structure (keys added or removed, lists resized)."""
    if old == new:
        return True
    if isinstance(node, CommentedMap) and isinstance(old, dict) and isinstance(new, dict):
        if any(k not in node and old.get(k) != v for k, v in new.items()) or \
                any(k in old and k not in new for k in node):
            return False
        return all(_spot(node, k, old.get(k), v, out) for k, v in new.items() if k in node)
    if isinstance(node, CommentedSeq) and isinstance(old, list) and isinstance(new, list) \
            and len(node) == len(old) == len(new):
        return all(_spot(node, i, old[i], v, out) for i, v in enumerate(new))
    return False


def _spot(parent: CommentedMap | CommentedSeq, key: Any, old: Any, new: Any, out: list[Spot]) -> bool:
    if old == new:
        return True
    child = parent[key]
    if isinstance(child, (CommentedMap, CommentedSeq)):
        return _spots(child, old, new, out)
    if isinstance(new, (dict, list)):
        return False
    line, col = parent.lc.value(key) if isinstance(parent, CommentedMap) else parent.lc.item(key)
    out.append((line, col, bool(parent.fa.flow_style()), new))
    return True


def _scalar(value: Any) -> str:
    """``value`` as one YAML scalar token."""
    if isinstance(value, str):
        return value if PLAIN_TEXT.fullmatch(value) and yaml.safe_load(value) == value else json.dumps(value)
    return str(yaml.safe_dump(value)).splitlines()[0]


def _token_end(line: str, col: int, flow: bool) -> int | None:
    """Where the scalar starting at ``col`` ends (None: a block scalar or an unclosed quote)."""
    first = line[col:col + 1]
    if first in ("|", ">") or not first:
        return None
    if first in ("'", '"'):
        i = col + 1
        while i < len(line):
            if line[i] == "\\" and first == '"':
                i += 2
                continue
            if line[i] == first:
                if first == "'" and line[i + 1:i + 2] == "'":
                    i += 2
                    continue
                return i + 1
            i += 1
        return None
    end = len(line.rstrip("\r\n"))
    comment = line.find(" #", col)
    if comment != -1:
        end = min(end, comment)
    if flow:
        stops = [i for i in (line.find(c, col) for c in ",]}") if i != -1]
        end = min([end, *stops])
    return len(line[:end].rstrip())


def _patched(text: str, spots: list[Spot]) -> str | None:
    """``text`` with each spot's scalar replaced (None when one cannot be replaced in place)."""
    lines = text.splitlines(keepends=True)
    for line_no, col, flow, value in sorted(spots, reverse=True):
        if line_no >= len(lines):
            return None
        line = lines[line_no]
        end = _token_end(line, col, flow)
        if end is None:
            return None
        lines[line_no] = line[:col] + _scalar(value) + line[end:]
    return "".join(lines)


def edited_text(source_text: str, edited: Template) -> str:
    """``edited`` as YAML written onto ``source_text`` (the version it was edited from): that
    text with only the changed values rewritten, its comments and key order kept; the plain
    :meth:`Template.to_yaml` when the source cannot carry the edit."""
    plain = edited.to_yaml()
    try:
        source = parse_template(source_text, file="the edited version")  # bounded, validated read first
    except InputError:
        return plain
    if source == edited:
        return source_text
    try:
        tree = YAML(typ="rt").load(source_text)
        spots: list[Spot] = []
        text = None
        if _spots(tree, source.to_dict(), edited.to_dict(), spots):
            text = _patched(source_text, spots)
        if text is not None and _same(text, edited):
            return text
        text = _dump(_layout(source_text, tree), _merge(tree, source.to_dict(), edited.to_dict()))
    except (YAMLError, ValueError, TypeError, KeyError, IndexError):
        return plain
    return text if _same(text, edited) else plain


def _same(text: str, edited: Template) -> bool:
    """Whether ``text`` reads back (through the bounded loader) as ``edited``."""
    try:
        return parse_template(text, file="the edited version") == edited
    except InputError:
        return False
