"""Defaults that follow the user: the dataset and reward template each person chose last.

Every picker of the app opens on what *this* user used last (:func:`last_choice`), else on
the newest dataset, and on the template saved most recently for the dataset's domain
(``finance_risk`` for ``finance`` data, ``tool_agent`` for imported logs of no known domain).
A dataset with fewer episodes than the page needs is never the default (:func:`pick_dataset`,
:func:`pick_template`).  Choosing in a picker stores the choice (:func:`remember_choice`), per
user, per kind ("dataset", or "template" per dataset domain), in the workspace table
``user_choices`` — a preference, so neither role-checked nor audited: it changes no data.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from core.access.users import LOCAL_ADMIN, Actor, multi_user
from core.base.errors import InputError

if TYPE_CHECKING:  # pragma: no cover
    from core.records.store import Workspace

#: What a choice can be about; a template choice is kept per dataset domain.
KINDS: tuple[str, ...] = ("dataset", "template")
#: The template for imported logs whose domain matches no template's name.
GENERIC_TEMPLATE = "tool_agent"
#: The longest value stored (a dataset or ``name@N`` spec is far shorter).
MAX_VALUE_CHARS = 200

# A personal preference is no governed record: the table is created on first use, so that the
# workspace's schema version (core.records.store.MIGRATIONS) stays about the data.
_TABLE = """
CREATE TABLE IF NOT EXISTS user_choices (
    user TEXT NOT NULL,
    kind TEXT NOT NULL,
    scope TEXT NOT NULL DEFAULT '',
    value TEXT NOT NULL,
    page TEXT,
    chosen_at TEXT NOT NULL,
    PRIMARY KEY (user, kind, scope)
)
"""


def _owner(ws: "Workspace", user: Actor | str | None) -> str | None:
    """Whose choice: an actor's name, or a user name as given; without users the local
    admin's; None for nobody signed in to a multi-user workspace."""
    if user is None:
        return None if multi_user(ws) else LOCAL_ADMIN.name
    name = user.name if isinstance(user, Actor) else str(user).strip().lower()
    return name or None


def _check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise InputError(f"unknown kind of choice {kind!r}", field="kind", allowed=KINDS)
    return kind


def remember_choice(ws: "Workspace", user: Actor | str | None, kind: str, value: str, *,
                    scope: str | None = None, page: str | None = None) -> bool:
    """Store ``value`` as ``user``'s last ``kind`` (a template per ``scope``, the dataset's
    domain); True when stored, False for nobody signed in (a read-only visitor of a
    multi-user workspace keeps no preferences).

    >>> remember_choice(ws, LOCAL_ADMIN, "dataset", "finance")            # doctest: +SKIP
    True
    """
    _check_kind(kind)
    if not isinstance(value, str) or not value.strip() or len(value) > MAX_VALUE_CHARS:
        raise InputError(f"a {kind} choice is a name of 1 to {MAX_VALUE_CHARS} characters",
                         field=kind)
    name = _owner(ws, user)
    if name is None:
        return False
    with ws.transaction() as conn:
        conn.execute(_TABLE)
        conn.execute(
            """INSERT INTO user_choices(user, kind, scope, value, page, chosen_at) VALUES (?,?,?,?,?,?)
               ON CONFLICT(user, kind, scope) DO UPDATE SET value=excluded.value,
               page=excluded.page, chosen_at=excluded.chosen_at""",
            (name, kind, scope or "", value.strip(), page,
             time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())))
    return True


def last_choice(ws: "Workspace", user: Actor | str | None, kind: str,
                scope: str | None = None) -> str | None:
    """``user``'s last ``kind`` (per ``scope`` for a template), None when there is none."""
    _check_kind(kind)
    name = _owner(ws, user)
    if name is None:
        return None
    try:
        row = ws.conn.execute("SELECT value FROM user_choices WHERE user=? AND kind=? AND scope=?",
                              (name, kind, scope or "")).fetchone()
    except sqlite3.OperationalError as exc:  # nobody has chosen anything in this workspace yet
        if "no such table" in str(exc):
            return None
        raise
    return None if row is None else str(row[0])


# --------------------------------------------------------------------------- defaults
@dataclass(frozen=True)
class DatasetPick:
    """What a dataset picker opens on, and why."""

    #: The default (None: no options)
    default: str | None
    #: Why, in words ("the dataset you used last", "the newest dataset")
    reason: str
    #: Episodes per option (options unknown to the workspace count 0)
    episodes: dict[str, int]
    #: Options with fewer episodes than the page needs (never the default)
    too_small: tuple[str, ...]


@dataclass(frozen=True)
class TemplatePick:
    """What a template picker opens on for one dataset, and why."""

    default: str | None
    reason: str
    #: The dataset's domain (None: imported logs of no known domain)
    domain: str | None


def dataset_domain(ws: "Workspace", dataset: str | None) -> str | None:
    """The domain recorded for ``dataset`` (None when unknown or not recorded)."""
    if not dataset:
        return None
    row = ws.conn.execute("SELECT domain FROM datasets WHERE name=?", (dataset,)).fetchone()
    return None if row is None or not row[0] else str(row[0])


def pick_dataset(ws: "Workspace", user: Actor | str | None, options: Sequence[str], *,
                 min_episodes: int = 1) -> DatasetPick:
    """The default of a dataset picker: ``user``'s last dataset if it is an option with at
    least ``min_episodes`` episodes, else the newest such option, else (every option too
    small) the option with the most episodes."""
    options = list(dict.fromkeys(options))
    if not options:
        return DatasetPick(None, "no dataset yet", {}, ())
    marks = ",".join("?" * len(options))
    rows = ws.conn.execute(
        f"""SELECT d.name, d.created_at, d.rowid, COUNT(e.uid) FROM datasets d
            LEFT JOIN episodes e ON e.dataset = d.name WHERE d.name IN ({marks})
            GROUP BY d.name""", options).fetchall()
    episodes = {name: 0 for name in options} | {str(r[0]): int(r[3]) for r in rows}
    newest_first = [str(r[0]) for r in sorted(rows, key=lambda r: (r[1], r[2]), reverse=True)]
    too_small = tuple(o for o in options if episodes[o] < min_episodes)
    usable = [o for o in options if o not in too_small]
    last = last_choice(ws, user, "dataset")
    if last in usable:
        return DatasetPick(last, "the dataset you used last", episodes, too_small)
    newest = [o for o in newest_first if o in usable]
    if newest:
        return DatasetPick(newest[0], "the newest dataset", episodes, too_small)
    if usable:
        return DatasetPick(usable[0], "the first dataset", episodes, too_small)
    fullest = max(options, key=lambda o: episodes[o])
    return DatasetPick(fullest, f"no dataset has the {min_episodes} episodes this page needs",
                       episodes, too_small)


def template_name(spec: str) -> str:
    """``"finance_risk@3"`` → ``"finance_risk"``."""
    return spec.partition("@")[0]


def _version(spec: str) -> int:
    version = spec.partition("@")[2]
    return int(version) if version.isdigit() else 1 << 30  # a bare name is the latest


def template_matches_domain(name: str, domain: str | None) -> bool:
    """Whether template ``name`` is made for ``domain``: ``finance_risk`` (or ``finance``)
    for ``finance``; no template matches an unknown domain."""
    if not domain:
        return False
    return name == domain or name.startswith(domain + "_")


def _newest_saved(ws: "Workspace", specs: Sequence[str]) -> str:
    """The spec among ``specs`` saved last (a shipped ``@0`` counts as oldest), highest
    version first among equals."""
    saved: dict[tuple[str, int], str] = {}
    names = sorted({template_name(s) for s in specs})
    if names:
        marks = ",".join("?" * len(names))
        saved = {(str(r[0]), int(r[1])): str(r[2]) for r in ws.conn.execute(
            f"SELECT name, version, saved_at FROM template_versions WHERE name IN ({marks})", names)}
    return max(specs, key=lambda s: (saved.get((template_name(s), _version(s)), ""), _version(s)))


def pick_template(ws: "Workspace", user: Actor | str | None, options: Sequence[str], *,
                  dataset: str | None) -> TemplatePick:
    """The default of a template picker (``options`` are ``name@N`` specs) for ``dataset``:
    ``user``'s last template on that dataset's domain, else the newest saved version of a
    template made for the domain, else the newest ``tool_agent``, else the first option."""
    options = list(dict.fromkeys(options))
    domain = dataset_domain(ws, dataset)
    if not options:
        return TemplatePick(None, "no template yet", domain)
    last = last_choice(ws, user, "template", scope=domain)
    if last in options:
        return TemplatePick(last, "the template you used last on this kind of data", domain)
    matching = [o for o in options if template_matches_domain(template_name(o), domain)]
    if matching:
        return TemplatePick(_newest_saved(ws, matching),
                            f"the newest template made for {domain} data", domain)
    generic = [o for o in options if template_name(o) == GENERIC_TEMPLATE]
    if generic:
        return TemplatePick(_newest_saved(ws, generic),
                            "the generic template for tool-using agents", domain)
    return TemplatePick(options[0], "the first template", domain)
