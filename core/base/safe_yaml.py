"""The one YAML loader for text a person wrote: bounded in size, depth and number length.

Plain ``yaml.safe_load`` trusts its input: nine levels of aliases (``&a [*a, *a, …]``)
grow a 459-byte file into gigabytes, deep nesting ends in RecursionError, and a
400-digit number in OverflowError wherever it meets a float.  :func:`load` refuses all
of that while it composes the document, before anything is built:

* aliases and anchors (``*name``, ``&name``) — templates and rules never need them;
* input longer than ``MAX_BYTES`` (UTF-8), nesting deeper than ``MAX_DEPTH``, more than
  ``MAX_NODES`` values, a scalar longer than ``MAX_SCALAR_CHARS``, a number literal
  longer than ``MAX_NUMBER_CHARS``, a mapping key that is a list or a mapping.

Every refusal is an :class:`~core.base.errors.InputError` naming the file, the line and the
key path (``levels.L1.components[0].weight``), so it reaches the analyst without a
traceback in the CLI and the app alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml
from yaml.events import AliasEvent, MappingStartEvent, ScalarEvent, SequenceStartEvent

from core.base.errors import InputError

#: Longest YAML text accepted, in UTF-8 bytes (the shipped templates are under 10 kB).
MAX_BYTES = 1_000_000
#: Deepest nesting of mappings and lists (the template format needs 6).
MAX_DEPTH = 32
#: Most values (scalars, lists, mappings) in one document.
MAX_NODES = 100_000
#: Longest single text value, in characters.
MAX_SCALAR_CHARS = 100_000
#: Longest number literal, in characters (a float holds ~17 significant digits).
MAX_NUMBER_CHARS = 64

_NUMBER_TAGS = frozenset({"tag:yaml.org,2002:int", "tag:yaml.org,2002:float"})


def key_path(path: tuple[Any, ...]) -> str | None:
    """``("levels", "L1", "components", 0)`` -> ``levels.L1.components[0]`` (None for the root)."""
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


class _BoundedLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` whose composer refuses aliases, anchors and oversized documents."""

    def __init__(self, text: str, file: str | None):
        super().__init__(text)
        self.file = file
        self.path: list[Any] = []
        self.n_nodes = 0

    def _refuse(self, message: str, mark: yaml.Mark | None, path: list[Any]) -> InputError:
        return InputError(message, file=self.file, line=None if mark is None else mark.line + 1,
                          field=key_path(tuple(path)))

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        event = self.peek_event()
        is_key = isinstance(parent, yaml.MappingNode) and index is None
        if is_key or parent is None:
            here = list(self.path)
        elif isinstance(index, yaml.ScalarNode):
            here = self.path + [index.value]
        else:
            here = self.path + [index]
        if isinstance(event, AliasEvent):
            raise self._refuse(f"aliases (*{event.anchor}) are not allowed; write the value out",
                               event.start_mark, here)
        if event.anchor is not None:
            raise self._refuse(f"anchors (&{event.anchor}) are not allowed; write the value out",
                               event.start_mark, here)
        self.n_nodes += 1
        if self.n_nodes > MAX_NODES:
            raise self._refuse(f"more than {MAX_NODES} values in one document", event.start_mark, here)
        collection = isinstance(event, (MappingStartEvent, SequenceStartEvent))
        if is_key and collection:
            raise self._refuse("a key must be plain text, not a list or a mapping", event.start_mark, here)
        if collection and len(here) >= MAX_DEPTH:
            raise self._refuse(f"nested deeper than {MAX_DEPTH} levels", event.start_mark, here)
        if isinstance(event, ScalarEvent) and len(event.value) > MAX_SCALAR_CHARS:
            raise self._refuse(f"a value of {len(event.value)} characters is longer than "
                               f"{MAX_SCALAR_CHARS}", event.start_mark, here)
        saved, self.path = self.path, here
        try:
            node = super().compose_node(parent, index)
        finally:
            self.path = saved
        if isinstance(node, yaml.ScalarNode) and node.tag in _NUMBER_TAGS \
                and len(node.value) > MAX_NUMBER_CHARS:
            raise self._refuse(f"a number of {len(node.value)} characters is longer than "
                               f"{MAX_NUMBER_CHARS}", node.start_mark, here)
        return node


@dataclass(frozen=True)
class Loaded:
    """A parsed document: ``data`` (plain dicts, lists, scalars) and its ``node`` tree
    (for the line of every key); both None for an empty document."""

    data: Any
    node: yaml.Node | None


def load(text: str | bytes, *, file: str | None = None) -> Loaded:
    """Parse one YAML document within the bounds above; :class:`InputError` otherwise.

    >>> load("a: [1, 2]").data
    {'a': [1, 2]}
    """
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            raise InputError(f"not UTF-8 text (byte {exc.start})", file=file) from None
    if not isinstance(text, str):
        raise InputError(f"YAML must be text, got {type(text).__name__}", file=file)
    if len(text) > MAX_BYTES or len(text.encode("utf-8", "surrogatepass")) > MAX_BYTES:
        raise InputError(f"YAML text is longer than {MAX_BYTES} bytes", file=file)
    loader: _BoundedLoader | None = None
    try:
        loader = _BoundedLoader(text, file)  # refuses non-printable characters (NUL…) already
        node = loader.get_single_node()
        data = None if node is None else loader.construct_document(node)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        raise InputError(f"not valid YAML: {exc.problem or exc.context or exc}", file=file,
                         line=None if mark is None else mark.line + 1) from None
    except yaml.YAMLError as exc:
        raise InputError(f"not valid YAML: {exc}", file=file) from None
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:
        # A value whose tag its text does not fit (``!!float abc``, a 13th month) or
        # that cannot be hashed as a key.
        raise InputError(f"not valid YAML: {exc}", file=file) from None
    finally:
        if loader is not None:
            loader.dispose()
    return Loaded(data, node)


def safe_load(text: str | bytes, *, file: str | None = None) -> Any:
    """The parsed value of ``text`` (``yaml.safe_load`` within bounds)."""
    return load(text, file=file).data


class _NoAliasDumper(yaml.SafeDumper):
    """``yaml.SafeDumper`` that writes a value used twice out twice: :func:`load` refuses
    the anchors and aliases the plain dumper writes for shared lists and mappings."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def dump(data: Any, **options: Any) -> str:
    """``yaml.safe_dump(data, **options)`` without anchors or aliases, so that what the
    workbench writes, :func:`load` reads back."""
    return yaml.dump(data, Dumper=_NoAliasDumper, **options)
