"""Outcome labels given by people, on top of the outcomes the logs recorded.

A label says whether one episode succeeded (1) or failed (0), with an optional note; ``None``
withdraws an earlier label.  Labels are append-only events in the workspace's
``label_events`` table: an episode's label is its latest event, every earlier one stays, and
the label set's version is the highest event id (so a figure can name the labels it used).
Writing a label needs the ``label`` permission (analysts, reviewers, admins).

:func:`dataset_outcomes` is what calibration, the learned outcome and tuning read: per
episode of a dataset, its label when a person gave one, else the outcome the log recorded.

Example::

    >>> add_label(ws, actor, "mine", "ep-17", 1, note="refund issued")   # doctest: +SKIP
    >>> labels, groups = dataset_outcomes(ws, "mine")                     # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from core.access.users import Actor, authorize
from core.base.errors import InputError
from core.rewards.outcomes import episode_groups, episode_labels

if TYPE_CHECKING:
    from core.records.store import Workspace


@dataclass(frozen=True)
class LabelEvent:
    """One label given by a person (``label_events``)."""

    id: int
    dataset: str
    episode_id: str
    #: 1 success, 0 failure, None: an earlier label withdrawn
    outcome: int | None
    note: str | None
    created_by: str
    created_at: str


def _now() -> str:
    import time

    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def add_label(ws: "Workspace", actor: Actor, dataset: str, episode_id: str, outcome: int | None, *,
              note: str | None = None) -> LabelEvent:
    """Label one episode of ``dataset`` a success (1) or a failure (0), or withdraw its label
    (None).  Needs the ``label`` permission."""
    authorize(ws, actor, "label")
    ws.require_dataset(dataset)
    if outcome is not None and outcome not in (0, 1):
        raise InputError(f"a label is 1 (success), 0 (failure) or none; got {outcome!r}", field="outcome")
    episode_id = str(episode_id).strip()
    if ws.conn.execute("SELECT 1 FROM episodes WHERE dataset=? AND episode_id=?",
                       (dataset, episode_id)).fetchone() is None:
        raise InputError(f"no episode {episode_id!r} in dataset {dataset!r}", field="episode_id")
    note = (note or "").strip() or None
    if note is not None and len(note) > 2000:
        raise InputError(f"a label's note is at most 2,000 characters; this one has {len(note)}", field="note")
    with ws.transaction() as conn:
        cur = conn.execute("INSERT INTO label_events(dataset, episode_id, outcome, note, created_by, created_at) "
                           "VALUES (?,?,?,?,?,?)",
                           (dataset, episode_id, outcome, note, actor.name, _now()))
        event_id = int(cur.lastrowid or 0)
    return label_history(ws, dataset, episode_id)[-1] if event_id else label_history(ws, dataset)[-1]


def label_history(ws: "Workspace", dataset: str, episode_id: str | None = None) -> list[LabelEvent]:
    """Every label event of a dataset (or of one episode), oldest first."""
    ws.require_dataset(dataset)
    sql = ("SELECT id, dataset, episode_id, outcome, note, created_by, created_at FROM label_events "
           "WHERE dataset=?")
    args: tuple = (dataset,)
    if episode_id is not None:
        sql += " AND episode_id=?"
        args += (episode_id,)
    return [LabelEvent(*row) for row in ws.conn.execute(sql + " ORDER BY id", args)]


def current_labels(ws: "Workspace", dataset: str) -> dict[str, int | None]:
    """Per labelled episode of ``dataset`` its latest label (None: withdrawn)."""
    rows = ws.conn.execute(
        "SELECT episode_id, outcome FROM label_events WHERE id IN (SELECT MAX(id) FROM label_events "
        "WHERE dataset=? GROUP BY episode_id)", (dataset,))
    return {eid: outcome for eid, outcome in rows}


def label_events(ws: "Workspace", dataset: str, *, withdrawn: bool = False) -> list[LabelEvent]:
    """The latest event of every labelled episode of ``dataset``, by episode id (those whose
    label was withdrawn only with ``withdrawn=True``)."""
    ws.require_dataset(dataset)
    rows = ws.conn.execute(
        "SELECT id, dataset, episode_id, outcome, note, created_by, created_at FROM label_events "
        "WHERE id IN (SELECT MAX(id) FROM label_events WHERE dataset=? GROUP BY episode_id) "
        "ORDER BY episode_id", (dataset,))
    return [e for e in (LabelEvent(*row) for row in rows) if withdrawn or e.outcome is not None]


#: Words a label is given by (``rwb labels add``), and what they mean.
OUTCOME_WORDS: dict[str, int | None] = {"success": 1, "failure": 0, "none": None}


def parse_outcome(word: str) -> int | None:
    """``success`` → 1, ``failure`` → 0, ``none`` → None (withdraw); anything else is refused."""
    key = str(word).strip().lower()
    if key not in OUTCOME_WORDS:
        raise InputError(f"a label is success, failure or none; got {word!r}", field="outcome")
    return OUTCOME_WORDS[key]


def labels_version(ws: "Workspace", dataset: str) -> int:
    """The label set's version: the id of its latest event (0 when nobody labelled)."""
    row = ws.conn.execute("SELECT MAX(id) FROM label_events WHERE dataset=?", (dataset,)).fetchone()
    return int(row[0] or 0)


def apply_labels(episode_ids: list[str], recorded: np.ndarray, given: dict[str, int | None]) -> np.ndarray:
    """``recorded`` outcomes (NaN unknown) with the people's labels put over them: a label
    replaces the recorded outcome, a withdrawn label brings the recorded one back."""
    out = np.asarray(recorded, dtype=np.float64).copy()
    for i, eid in enumerate(episode_ids):
        if eid in given and given[eid] is not None:
            out[i] = float(given[eid])  # type: ignore[arg-type]
    return out


def dataset_outcomes(ws: "Workspace", dataset: str, group_key: str | None = None
                     ) -> tuple[np.ndarray, np.ndarray]:
    """(outcome, task id) per episode of ``dataset``, in the order the steps frame holds them:
    a person's label where one was given, else the outcome the log recorded (NaN unknown)."""
    episodes = ws.load_episodes(dataset)
    recorded = episode_labels(episodes)
    labels = apply_labels([ep.episode_id for ep in episodes], recorded, current_labels(ws, dataset))
    return labels, episode_groups(episodes, group_key)
