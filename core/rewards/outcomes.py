"""Outcome labels of recorded episodes, their task groups, and ranking statistics over them.

Shared by outcome calibration, the learned outcome component and tuning towards outcomes:

* :func:`episode_labels` — one label per episode from what the log recorded (``resolved``,
  else ``final_reward``), NaN when the episode carries no outcome;
* :func:`episode_groups` — the task each episode belongs to, from a dotted key of the
  imported record (``task_id`` by default, as tau2 and many agent logs name it), else the
  user's request; episodes of one task are never split across folds;
* :func:`auc` (ties count half), :func:`grouped_folds` and :func:`bootstrap_ci`, which
  resamples whole tasks, so an interval reflects how many distinct tasks were labelled.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from core.records.episodes import Episode
from core.base.errors import InputError

#: Record keys tried, in order, for an episode's task id when no group key is given.
DEFAULT_GROUP_KEYS: tuple[str, ...] = ("task_id", "task.id", "meta.task_id")


def episode_labels(episodes: Sequence[Episode]) -> np.ndarray:
    """Per episode its recorded outcome: ``resolved`` as 0/1, else ``final_reward``; NaN when
    neither is known."""
    out = np.full(len(episodes), np.nan)
    for i, ep in enumerate(episodes):
        if ep.outcome.resolved is not None:
            out[i] = float(ep.outcome.resolved)
        elif ep.outcome.final_reward is not None:
            out[i] = float(ep.outcome.final_reward)
    return out


def _dotted(value: Any, path: str) -> Any:
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def episode_groups(episodes: Sequence[Episode], group_key: str | None = None) -> np.ndarray:
    """Per episode the id of its task (a string).  ``group_key`` is a dotted path into the
    imported record (``source.raw``) or the episode's ``meta``; without one the keys of
    :data:`DEFAULT_GROUP_KEYS` are tried, then the task type and the user's request."""
    keys = (group_key,) if group_key else DEFAULT_GROUP_KEYS
    out = []
    for ep in episodes:
        found = None
        for key in keys:
            for root in (ep.source.raw, ep.meta):
                found = _dotted(root, key)
                if found is not None:
                    break
            if found is not None:
                break
        if found is None and group_key:
            raise InputError(f"episode {ep.episode_id!r} has no value at group key {group_key!r}",
                             field=group_key)
        if found is None:
            found = f"{ep.task.task_type or ''}|{ep.task.query}"
        domain = ep.domain or ""
        out.append(f"{domain}:{found}")
    return np.array(out, dtype=object)


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve of ``scores`` for binary ``labels`` (labels > 0.5 count as
    positive; ties between a positive and a negative count half); NaN with one class only."""
    scores = np.asarray(scores, dtype=np.float64)
    pos = np.asarray(labels, dtype=np.float64) > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    if np.isnan(scores).any():
        return float("nan")
    ranks = average_ranks(scores)
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def average_ranks(values: np.ndarray) -> np.ndarray:
    """1-based ranks, ties sharing their average rank (``scipy.stats.rankdata``'s default, in
    numpy alone: tuning ranks every trial's returns, where scipy's per-call overhead dominates)."""
    order = np.argsort(values, kind="mergesort")
    sorted_values = values[order]
    new_group = np.concatenate([[True], sorted_values[1:] != sorted_values[:-1]])
    group = np.cumsum(new_group) - 1
    starts = np.flatnonzero(new_group)
    ends = np.append(starts[1:], values.size)
    ranks = np.empty(values.size)
    ranks[order] = ((starts + 1 + ends) / 2.0)[group]
    return ranks


def grouped_folds(groups: np.ndarray, n_folds: int = 5, seed: int = 0) -> list[np.ndarray]:
    """Fold index arrays (the held-out rows of each fold) with every group in exactly one
    fold; groups are shuffled with ``seed`` and dealt to balance the fold sizes."""
    uniq, inverse = np.unique(groups.astype(str), return_inverse=True)
    if uniq.shape[0] < 2:
        raise InputError(f"grouped cross-validation needs at least 2 tasks; the data has {uniq.shape[0]}")
    k = int(min(max(2, n_folds), uniq.shape[0]))
    rng = np.random.default_rng(seed)
    sizes = np.bincount(inverse, minlength=uniq.shape[0])
    order = rng.permutation(uniq.shape[0])
    order = order[np.argsort(-sizes[order], kind="stable")]   # largest tasks first
    fold_of_group = np.empty(uniq.shape[0], dtype=np.int64)
    load = np.zeros(k, dtype=np.int64)
    for g in order:
        f = int(np.argmin(load))
        fold_of_group[g] = f
        load[f] += sizes[g]
    fold = fold_of_group[inverse]
    return [np.flatnonzero(fold == f) for f in range(k)]


def bootstrap_ci(stat, groups: np.ndarray, *, n_boot: int = 200, level: float = 0.90,
                 seed: int = 0) -> tuple[float, float]:
    """Percentile interval of ``stat(rows)`` over resamples of whole groups (tasks) with
    replacement; resamples where the statistic is NaN (one class only) are skipped."""
    uniq, inverse = np.unique(groups.astype(str), return_inverse=True)
    members = [np.flatnonzero(inverse == g) for g in range(uniq.shape[0])]
    rng = np.random.default_rng(seed)
    values = []
    for _ in range(int(n_boot)):
        pick = rng.integers(0, uniq.shape[0], size=(uniq.shape[0],))
        rows = np.concatenate([members[g] for g in pick])
        v = stat(rows)
        if v is not None and math.isfinite(v):
            values.append(v)
    if not values:
        return float("nan"), float("nan")
    lo, hi = np.quantile(values, [(1 - level) / 2, 1 - (1 - level) / 2])
    return float(lo), float(hi)
