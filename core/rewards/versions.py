"""Versions of reward templates kept in a workspace: every save is a new version, never an overwrite.

Each save is a row of ``template_versions``; the templates shipped in ``reward_templates/``
are the version-0 seeds of their names.  :func:`save_template` names the version it was
edited from and is refused with a :class:`TemplateConflict` when someone saved a newer one
in between; :func:`get_template`, :func:`list_versions`, :func:`diff_versions` read them, and
:func:`resolve_template` turns ``finance_risk@3`` / ``finance_risk`` into a template.

Details: docs/rewards.md (## Template versions, ## Concurrent saves, ## Template references).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
import sqlite3
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from core.base import safe_yaml
from core.base.errors import ConflictError, InputError
from core.base.results import to_jsonable
from core.rewards.template import (Template, TemplateError, TemplateOutOfBounds, load_template,
                                   parse_template, templates_dir)
from core.rewards.template_text import edited_text
from core.access.audit import security_event
from core.access.users import Actor, authorize

if TYPE_CHECKING:  # pragma: no cover
    from core.records.store import Workspace

#: ``saved_by`` of the version-0 seeds shipped in ``reward_templates/``.
SHIPPED_BY = "reward-workbench"
#: Template names: what a file stem and a CLI argument can carry (no "@", no "/").
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
#: Versions listed by name in a conflict message (older ones are counted).
MAX_LISTED = 5

_COLUMNS = "name, version, yaml, sha256, base_version, saved_by, saved_at, message, meta"


# --------------------------------------------------------------------------- values
@dataclass(frozen=True)
class TemplateVersion:
    """One saved version of a template (version 0: the shipped seed)."""

    name: str
    version: int
    #: The YAML text exactly as saved (comments and layout kept).
    yaml: str
    sha256: str
    #: The version this one was edited from (None for a new template and for seeds).
    base_version: int | None
    saved_by: str
    saved_at: str | None
    message: str = ""
    #: Free-form JSON the saver attached (e.g. the tuning objective's figures).
    meta: Mapping[str, Any] = field(default_factory=dict)

    @property
    def shipped(self) -> bool:
        """True for the seed that ships in ``reward_templates/``."""
        return self.version == 0

    @property
    def label(self) -> str:
        """``name@version``: what ``--template`` accepts to name exactly this version."""
        return f"{self.name}@{self.version}"

    def template(self) -> Template:
        """The validated template (its ``source`` is :attr:`label`)."""
        return parse_template(self.yaml, file=self.label)

    def to_dict(self, *, with_yaml: bool = False) -> dict[str, Any]:
        """Plain data for ``--json`` (the YAML only when asked: it can be long)."""
        out: dict[str, Any] = {
            "name": self.name, "version": self.version, "label": self.label,
            "sha256": self.sha256, "base_version": self.base_version, "saved_by": self.saved_by,
            "saved_at": self.saved_at, "message": self.message, "meta": dict(self.meta),
            "shipped": self.shipped}
        if with_yaml:
            out["yaml"] = self.yaml
        return out


class TemplateConflict(ConflictError):
    """A save on top of a stale base version: someone saved a newer version in between.

    ``latest`` is the version the template is at now, ``saved_since`` every version
    saved after the caller's base (oldest first), so a UI can show what changed."""

    def __init__(self, message: str, *, name: str, base_version: int | None,
                 latest: TemplateVersion, saved_since: list[TemplateVersion]):
        super().__init__(message)
        self.name, self.base_version = name, base_version
        self.latest, self.saved_since = latest, saved_since


@dataclass(frozen=True)
class TemplateChange:
    """One change from one template to another (:func:`diff_templates`)."""

    #: template, return, gating, gate, level, component, weight, param, schedule or expectation
    section: str
    #: What changed within the section: a component, level, parameter (``component.param``) …
    key: str
    #: The value before, as JSON values (None: absent)
    a: Any
    #: The value after, as JSON values (None: absent)
    b: Any


@dataclass
class TemplateDiff:
    """What changed between two versions of a template."""

    name: str
    a: int
    b: int
    #: Unified diff of the two YAML texts (empty when they are identical).
    unified: str
    #: Structured changes (:func:`diff_templates`)
    changes: list[TemplateChange]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "a": self.a, "b": self.b, "changes": to_jsonable(self.changes),
                "unified": self.unified}


# --------------------------------------------------------------------------- helpers
def sha256_text(text: str) -> str:
    """sha256 of the UTF-8 bytes of a template's text."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def check_name(name: str) -> str:
    """Refuse template names that cannot be a file stem or a ``--template`` argument."""
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise InputError(f"template name {name!r} is not usable: use letters, digits, '_', '-' "
                         "or '.', starting with a letter or digit (at most 64 characters)",
                         field="name")
    return name


def shipped_path(name: str) -> Path:
    """Where the shipped seed of ``name`` lives (it may not exist)."""
    return templates_dir() / f"{name}.yaml"


def shipped_version(name: str) -> TemplateVersion | None:
    """The shipped file of ``name`` as version 0, or None when no template of that name ships."""
    path = shipped_path(name)
    if not NAME_RE.match(name) or not path.is_file():
        return None
    text = path.read_text(encoding="utf-8")
    return TemplateVersion(name=name, version=0, yaml=text, sha256=sha256_text(text),
                           base_version=None, saved_by=SHIPPED_BY, saved_at=None,
                           message=f"shipped with Reward Workbench ({path.name})")


def _row(row: tuple[Any, ...]) -> TemplateVersion:
    return TemplateVersion(name=row[0], version=int(row[1]), yaml=row[2], sha256=row[3],
                           base_version=row[4], saved_by=row[5], saved_at=row[6],
                           message=row[7] or "", meta=json.loads(row[8]) if row[8] else {})


def _workspace_rows(conn: sqlite3.Connection, name: str, after: int = 0) -> list[TemplateVersion]:
    return [_row(r) for r in conn.execute(
        f"SELECT {_COLUMNS} FROM template_versions WHERE name=? AND version>? ORDER BY version",
        (name, after))]


def template_names(ws: "Workspace") -> list[str]:
    """Every template name the workspace knows: shipped seeds and saved templates, sorted."""
    shipped = {p.stem for p in templates_dir().glob("*.yaml") if NAME_RE.match(p.stem)}
    saved = {r[0] for r in ws.conn.execute("SELECT DISTINCT name FROM template_versions")}
    return sorted(shipped | saved)


def _unknown(ws: "Workspace", name: str) -> InputError:
    known = ", ".join(template_names(ws)) or "none"
    return InputError(f"no template named {name!r} in the workspace or shipped; known: {known}",
                      field="name")


def list_versions(ws: "Workspace", name: str) -> list[TemplateVersion]:
    """Every version of ``name``, oldest first (version 0 first when a seed ships)."""
    check_name(name)
    seed = shipped_version(name)
    out = ([seed] if seed else []) + _workspace_rows(ws.conn, name)
    if not out:
        raise _unknown(ws, name)
    return out


def get_template(ws: "Workspace", name: str, version: int | None = None) -> TemplateVersion:
    """One version of ``name``: the latest by default (the shipped seed is version 0).

    ``.template()`` of the result is the validated :class:`Template`."""
    check_name(name)
    if version is None:
        row = ws.conn.execute(f"SELECT {_COLUMNS} FROM template_versions WHERE name=? "
                              "ORDER BY version DESC LIMIT 1", (name,)).fetchone()
        if row is not None:
            return _row(row)
        seed = shipped_version(name)
        if seed is None:
            raise _unknown(ws, name)
        return seed
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise InputError(f"a template version is a number ≥ 0, got {version!r}", field="version")
    if version == 0:
        seed = shipped_version(name)
        if seed is None:
            raise InputError(f"template {name!r} has no shipped version 0 (it was created in the "
                             "workspace; its versions start at 1)", field="version")
        return seed
    row = ws.conn.execute(f"SELECT {_COLUMNS} FROM template_versions WHERE name=? AND version=?",
                          (name, version)).fetchone()
    if row is None:
        versions = [v.version for v in list_versions(ws, name)]
        raise InputError(f"template {name!r} has no version {version}; versions: "
                         f"{', '.join(map(str, versions))}", field="version")
    return _row(row)


def parse_spec(spec: str) -> tuple[str, int | None]:
    """``"finance_risk@3"`` → ``("finance_risk", 3)``; ``"finance_risk"`` or
    ``"finance_risk@latest"`` → ``("finance_risk", None)``."""
    name, at, version = spec.partition("@")
    if not at or version == "latest":
        return check_name(name), None
    if not version.isdigit():
        raise InputError(f"template reference {spec!r}: after '@' comes a version number "
                         "(finance_risk@3) or 'latest'", field="template")
    return check_name(name), int(version)


def resolve_template(ws: "Workspace | None", spec: str) -> Template:
    """The template a ``--template`` argument names, workspace versions included.

    A path to an existing file is read as is.  ``name@N`` is version N of ``name``
    (``@0``: the shipped file); a bare name is the latest workspace version, else the
    shipped file.  Without a workspace only files and shipped names resolve."""
    path = Path(spec)
    if path.is_file() or str(spec).endswith((".yaml", ".yml")):
        return load_template(path)
    if ws is None:
        if "@" in str(spec):
            raise InputError(f"template reference {spec!r} names a workspace version; open a "
                             "workspace (--workspace) to use it", field="template")
        return load_template(spec)
    name, version = parse_spec(str(spec))
    return get_template(ws, name, version).template()


def _key_line(text: str, key: str) -> int | None:
    """1-based line of a top-level key of a YAML mapping (None when absent or unparsable)."""
    try:
        node = safe_yaml.load(text).node
    except InputError:
        return None
    if isinstance(node, yaml.MappingNode):
        for k, _ in node.value:
            if k.value == key:
                return k.start_mark.line + 1
    return None


def _since_text(saved_since: list[TemplateVersion]) -> str:
    newest = saved_since[-1]
    parts = [f"saved by {newest.saved_by} at {newest.saved_at or 'release'}"]
    older = saved_since[:-1][::-1]
    for v in older[:MAX_LISTED - 1]:
        parts.append(f"version {v.version} by {v.saved_by} at {v.saved_at or 'release'}")
    if len(older) > MAX_LISTED - 1:
        parts.append(f"{len(older) - (MAX_LISTED - 1)} older")
    return "; ".join(parts)


# --------------------------------------------------------------------------- saving
def template_text(ws: "Workspace", name: str, base_version: int | None, template: Template) -> str:
    """The YAML a save of ``template`` as ``name`` writes: written onto the text of version
    ``base_version`` of ``name`` (:func:`~core.rewards.template_text.edited_text`: its comments,
    key order and layout kept, only the changed values rewritten); :meth:`Template.to_yaml`
    for a new name or a base version that does not exist."""
    named = replace(template, name=name) if template.name != name else template
    if base_version is None:
        return named.to_yaml()
    try:
        base = get_template(ws, name, base_version)
    except InputError:
        return named.to_yaml()  # no such version: the save itself says why
    return edited_text(base.yaml, named)


def save_template(ws: "Workspace", actor: Actor, name: str, yaml_text: str | Template,
                  base_version: int | None, message: str = "", *,
                  meta: Mapping[str, Any] | None = None) -> TemplateVersion:
    """Save a new version of template ``name`` and return it (``.version`` is its number).

    * ``yaml_text``: the template's YAML (kept verbatim; its ``name:`` must be ``name``),
      or a :class:`Template`, which is written onto the text of ``base_version``
      (:func:`template_text`: that text's comments and key order kept, only the changed
      values rewritten), else with :meth:`Template.to_yaml`, under ``name``.
    * ``base_version``: the version the edit started from — the ``.version`` of the
      :func:`get_template` result that was edited (0 for a shipped seed, None or 0 for a
      brand-new name).  When a newer version exists the save is refused with
      :class:`TemplateConflict` (a :class:`~core.base.errors.ConflictError`) naming who saved
      what since.
    * ``message``: why (shown in ``rwb reward versions``); ``meta``: JSON-able extras.

    The actor needs the ``edit_template`` permission; the text is validated first
    (:class:`~core.rewards.template.TemplateError` names key and line), and a template
    refused by a bound (a number out of range, :class:`~core.rewards.template.TemplateOutOfBounds`)
    is also written to the security log as ``template_refused``.  The version
    check and the insert are one transaction: of concurrent saves on one base exactly
    one wins.  This signature is stable (``rwb tune apply`` calls it)."""
    authorize(ws, actor, "edit_template")
    check_name(name)
    if base_version is not None and (isinstance(base_version, bool) or not isinstance(base_version, int)
                                     or base_version < 0):
        raise InputError(f"base version must be a number ≥ 0, got {base_version!r}",
                         field="base_version")
    if isinstance(yaml_text, Template):
        text = template_text(ws, name, base_version, yaml_text)
    elif isinstance(yaml_text, str):
        text = yaml_text
    else:
        raise InputError(f"a template is YAML text, got {type(yaml_text).__name__}", field="yaml")
    if not text.strip():
        raise InputError("the template text is empty", field="yaml")
    try:  # the whole template is validated before anything is written
        template = parse_template(text, file=f"template {name!r}")
    except TemplateOutOfBounds as exc:
        security_event(ws, actor, "template_refused", template=name, field=exc.field,
                       line=exc.line, reason=exc.reason, yaml_sha256=sha256_text(text))
        raise
    if template.name != name:
        line = _key_line(text, "name")
        raise TemplateError(f"the YAML names the template {template.name!r}"
                            f"{f' at line {line}' if line else ''} but it is saved as {name!r}; "
                            "make them agree", file=f"template {name!r}", line=line, field="name")
    if not isinstance(message, str):
        raise InputError("the save message must be text", field="message")
    meta_json = json.dumps(dict(meta), sort_keys=True, default=str) if meta else None
    seed = shipped_version(name)
    with ws.transaction() as conn:
        # Read the head inside the write transaction: BEGIN IMMEDIATE holds the write lock,
        # so no other save can slip in between this check and the insert.
        saved_latest = conn.execute("SELECT MAX(version) FROM template_versions WHERE name=?",
                                    (name,)).fetchone()[0]
        current = saved_latest if saved_latest is not None else (0 if seed else None)
        fresh = current is None and base_version in (None, 0)
        if not fresh and base_version != current:
            if base_version is not None and (current is None or base_version > current):
                raise InputError(f"template {name!r} has no version {base_version} to edit "
                                 f"(latest: {'none' if current is None else current})",
                                 field="base_version")
            since = _workspace_rows(conn, name, after=base_version or 0)
            if base_version is None and seed is not None:
                since = [seed] + since
            head = since[-1]
            edited = ("started a new template" if base_version is None
                      else f"edited version {base_version}")
            raise TemplateConflict(
                f"template {name!r} is at version {head.version} ({_since_text(since)}); you "
                f"{edited} — reload and re-apply your change",
                name=name, base_version=base_version, latest=head, saved_since=since)
        version = (current or 0) + 1
        saved = TemplateVersion(name=name, version=version, yaml=text, sha256=sha256_text(text),
                                # a brand-new name has no version to have been edited from
                                base_version=None if current is None else base_version,
                                saved_by=actor.name, saved_at=_now(), message=message.strip(),
                                meta=dict(meta or {}))
        try:
            conn.execute(f"INSERT INTO template_versions({_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?)",
                         (saved.name, saved.version, saved.yaml, saved.sha256, saved.base_version,
                          saved.saved_by, saved.saved_at, saved.message, meta_json))
        except sqlite3.IntegrityError as exc:  # pragma: no cover - the write lock prevents it
            raise ConflictError(f"template {name!r} version {version} was saved concurrently; "
                                "reload and re-apply your change") from exc
    return saved


# --------------------------------------------------------------------------- diffs
def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def diff_templates(old: Template, new: Template) -> list[TemplateChange]:
    """Structured changes from ``old`` to ``new``: weights, parameters (defaults filled in),
    components added/removed/moved, gating and gates, return coefficients, schedules,
    expectations, each a :class:`TemplateChange`."""
    out: list[TemplateChange] = []

    def add(section: str, key: str, a: Any, b: Any) -> None:
        if a != b:
            out.append(TemplateChange(section=section, key=key, a=_jsonable(a), b=_jsonable(b)))

    add("template", "name", old.name, new.name)
    add("template", "description", old.description, new.description)
    for key in ("a", "b", "gamma"):
        add("return", key, getattr(old, key), getattr(new, key))
    add("gating", "enabled", old.gating, new.gating)
    old_levels = {lv.key: lv for lv in old.levels}
    new_levels = {lv.key: lv for lv in new.levels}
    for key in sorted(old_levels.keys() | new_levels.keys()):
        a, b = old_levels.get(key), new_levels.get(key)
        if a is None or b is None:
            add("level", key, a and a.title, b and b.title)
            continue
        add("level", f"{key}.title", a.title, b.title)
        add("gate", key, a.gate, b.gate)
    old_comps = {c.name: c for c in old.all_components}
    new_comps = {c.name: c for c in new.all_components}
    for name in [c.name for c in old.all_components] + [c.name for c in new.all_components
                                                        if c.name not in old_comps]:
        ca, cb = old_comps.get(name), new_comps.get(name)
        if ca is None or cb is None:
            add("component", name, ca and f"{ca.group} {ca.component}", cb and f"{cb.group} {cb.component}")
            continue
        add("component", name, f"{ca.group} {ca.component}", f"{cb.group} {cb.component}")
        add("weight", name, ca.weight, cb.weight)
        if ca.component == cb.component:
            pa, pb = ca.params_with_defaults(), cb.params_with_defaults()
            for p in pa:
                add("param", f"{name}.{p}", pa[p], pb.get(p))
        else:
            add("param", name, dict(ca.params), dict(cb.params))
    for name in sorted(old.schedules.keys() | new.schedules.keys()):
        sa, sb = old.schedules.get(name), new.schedules.get(name)
        add("schedule", name, sa and [list(p) for p in sa], sb and [list(p) for p in sb])
    old_exp = {e.name: e for e in old.expectations}
    new_exp = {e.name: e for e in new.expectations}
    for name in [e.name for e in old.expectations] + [e.name for e in new.expectations
                                                      if e.name not in old_exp]:
        ea, eb = old_exp.get(name), new_exp.get(name)
        add("expectation", name, ea and ea.to_dict(), eb and eb.to_dict())
    return out


def diff_versions(ws: "Workspace", name: str, a: int, b: int) -> TemplateDiff:
    """Unified diff of the YAML of versions ``a`` and ``b`` of ``name`` plus the structured
    changes of weights, parameters, gating, return, schedules and expectations."""
    va, vb = get_template(ws, name, a), get_template(ws, name, b)
    unified = "".join(difflib.unified_diff(
        va.yaml.splitlines(keepends=True), vb.yaml.splitlines(keepends=True),
        fromfile=va.label, tofile=vb.label))
    if unified and not unified.endswith("\n"):
        unified += "\n"
    return TemplateDiff(name=name, a=a, b=b, unified=unified,
                        changes=diff_templates(va.template(), vb.template()))


__all__ = ["SHIPPED_BY", "TemplateChange", "TemplateConflict", "TemplateDiff", "TemplateVersion", "check_name",
           "diff_templates", "diff_versions", "get_template", "list_versions", "parse_spec",
           "resolve_template", "save_template", "sha256_text", "shipped_version", "template_names", "template_text"]
