"""Analysts' preference labels ("episode A is better than episode B") kept in the workspace,
what the ``preferences`` objective tunes towards."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from core.access.users import Actor, authorize
from core.base.errors import ConflictError, InputError
from core.rewards.frame import StepsFrame
from core.tuning.records import now_iso

if TYPE_CHECKING:  # pragma: no cover
    from core.records.store import Workspace


@dataclass(frozen=True)
class PreferenceLabel:
    """An analyst's label "episode ``better`` is better than episode ``worse``" (:func:`list_preferences`)."""

    id: int
    #: The dataset that holds both episodes
    dataset: str
    #: Episode ids
    better: str
    worse: str
    #: Why it is better; None when the analyst gave no reason
    comment: str | None
    created_by: str
    created_at: str


def add_preference(ws: "Workspace", actor: Actor, dataset: str, better: str, worse: str,
                   comment: str | None = None) -> PreferenceLabel:
    """Record an analyst's label "episode ``better`` is better than episode ``worse``".

    Both episodes must be in ``dataset``; the same person cannot label the same ordered pair
    twice (:class:`~core.base.errors.ConflictError`).  Needs ``edit_template``."""
    authorize(ws, actor, "edit_template")
    ws.require_dataset(dataset)
    better, worse = str(better).strip(), str(worse).strip()
    if better == worse:
        raise InputError("a preference compares two different episodes", field="worse")
    known = {r[0] for r in ws.conn.execute(
        "SELECT episode_id FROM episodes WHERE dataset=? AND episode_id IN (?, ?)", (dataset, better, worse))}
    for eid, what in ((better, "better"), (worse, "worse")):
        if eid not in known:
            raise InputError(f"no episode {eid!r} in dataset {dataset!r}", field=what)
    with ws.transaction() as conn:
        dup = conn.execute("SELECT id FROM preferences WHERE dataset=? AND better_id=? AND worse_id=? "
                           "AND created_by=?", (dataset, better, worse, actor.name)).fetchone()
        if dup is not None:
            raise ConflictError(f"{actor.name} already labelled {better} better than {worse} "
                                f"(preference #{dup[0]})")
        cur = conn.execute("INSERT INTO preferences(dataset, better_id, worse_id, comment, created_by, "
                           "created_at) VALUES (?,?,?,?,?,?)",
                           (dataset, better, worse, (comment or "").strip() or None, actor.name, now_iso()))
        pid = cur.lastrowid
    return next(p for p in list_preferences(ws, dataset) if p.id == pid)


def list_preferences(ws: "Workspace", dataset: str | None = None) -> list[PreferenceLabel]:
    """Preference labels (oldest first), of one dataset or all."""
    sql = "SELECT id, dataset, better_id, worse_id, comment, created_by, created_at FROM preferences"
    args: tuple[str, ...] = ()
    if dataset is not None:
        sql += " WHERE dataset=?"
        args = (dataset,)
    return [PreferenceLabel(*r) for r in ws.conn.execute(sql + " ORDER BY id", args)]


def preference_pairs(ws: "Workspace", dataset: str, frame: StepsFrame) -> tuple[np.ndarray, np.ndarray]:
    """(better, worse) episode indices of ``dataset``'s preference labels in ``frame``."""
    prefs = list_preferences(ws, dataset)
    if not prefs:
        raise InputError(f"dataset {dataset!r} has no preference labels yet; add some (rwb tune prefer "
                         "BETTER WORSE --dataset NAME, or the Tuning page)", field="preferences")
    index = frame.episode_index()
    missing = sorted({eid for p in prefs for eid in (p.better, p.worse) if eid not in index})
    if missing:
        raise InputError(f"preference labels name episodes that are not in the data: "
                         f"{', '.join(missing[:5])}", field="preferences")
    return (np.array([index[p.better] for p in prefs], dtype=np.int64),
            np.array([index[p.worse] for p in prefs], dtype=np.int64))
