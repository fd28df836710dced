"""Outcome labels of recorded episodes, their task groups, and ranking statistics over them.

Shared by outcome calibration, the learned outcome component and tuning towards outcomes:

* :func:`episode_labels` — one label per episode from what the log recorded (``resolved``,
  else ``final_reward``), NaN when the episode carries no outcome;
* :func:`episode_groups` — the task each episode belongs to, from a dotted key of the
  imported record (``task_id`` by default, as tau2 and many agent logs name it), else the
  user's request; episodes of one task are never split across folds;
* :func:`auc` (ties count half), :func:`grouped_folds` and :func:`bootstrap_ci`, which
  resamples whole tasks, so an interval reflects how many distinct tasks were labelled;
* :func:`within_task_auc` (pairs of a success and a failure of the same task: the primary
  fidelity figure) and :func:`fidelity`, both figures with their intervals over tasks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from core.data.task_criteria import TASK_ID_KEYS, recorded_task_id
from core.records.episodes import Episode
from core.base.errors import InputError

#: Record keys tried, in order, for an episode's task id when no group key is given.
DEFAULT_GROUP_KEYS: tuple[str, ...] = TASK_ID_KEYS


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


def episode_groups(episodes: Sequence[Episode], group_key: str | None = None) -> np.ndarray:
    """Per episode the id of its task (a string).  ``group_key`` is a dotted path into the
    imported record (``source.raw``) or the episode's ``meta``; without one the keys of
    :data:`DEFAULT_GROUP_KEYS` are tried, then the task type and the user's request."""
    keys = (group_key,) if group_key else DEFAULT_GROUP_KEYS
    out = []
    for ep in episodes:
        found = recorded_task_id(ep, keys)
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


# --------------------------------------------------------------------------- within-task ranking
# A trainer with a per-task baseline (GRPO, PPO with a per-task critic) only ever compares runs
# of the same task, so the primary fidelity figure is the AUC over pairs of a success and a
# failure of the *same* task; the all-pairs AUC is reported beside it.

@dataclass(frozen=True)
class AucFigure:
    """One ranking figure with its 90% bootstrap interval over tasks."""

    #: AUC (NaN when no pair exists)
    value: float
    #: 90% percentile interval over resampled tasks
    ci90: tuple[float, float]
    #: Tasks that contribute pairs (within-task: those with both outcomes)
    n_tasks: int
    #: (success, failure) pairs compared
    n_pairs: int


@dataclass(frozen=True)
class Fidelity:
    """How well a score ranks recorded outcomes: over all pairs and within each task."""

    all_pairs: AucFigure
    within_task: AucFigure


def _codes(groups: np.ndarray) -> tuple[np.ndarray, int]:
    groups = np.asarray(groups)
    # integer task codes (tuning precomputes them once) group as they are: no string round trip per call
    uniq, inverse = np.unique(groups if groups.dtype.kind in "iu" else groups.astype(str), return_inverse=True)
    return inverse.astype(np.int64), int(uniq.shape[0])


def within_task_parts(scores: np.ndarray, labels: np.ndarray, groups: np.ndarray
                      ) -> tuple[np.ndarray, np.ndarray]:
    """(Mann-Whitney U, pairs) per task: U counts the (success, failure) pairs of that task the
    score orders right, ties half; pairs is successes × failures (0 for a one-outcome task)."""
    scores = np.asarray(scores, dtype=np.float64)
    pos = np.asarray(labels, dtype=np.float64) > 0.5
    code, n_groups = _codes(groups)
    if scores.size == 0:
        return np.zeros(n_groups), np.zeros(n_groups)
    order = np.lexsort((scores, code))
    s, g = scores[order], code[order]
    new_tie = np.concatenate([[True], (s[1:] != s[:-1]) | (g[1:] != g[:-1])])
    tie = np.cumsum(new_tie) - 1
    starts = np.flatnonzero(new_tie)
    ends = np.append(starts[1:], s.size)
    group_start = np.searchsorted(g, np.arange(n_groups), side="left")
    avg_rank = ((starts + 1 + ends) / 2.0)[tie] - group_start[g]   # 1-based rank inside the task
    ranks = np.empty(scores.size)
    ranks[order] = avg_rank
    n_pos = np.bincount(code, weights=pos.astype(np.float64), minlength=n_groups)
    n_all = np.bincount(code, minlength=n_groups).astype(np.float64)
    rank_sum = np.bincount(code[pos], weights=ranks[pos], minlength=n_groups)
    u = rank_sum - n_pos * (n_pos + 1) / 2.0
    return u, n_pos * (n_all - n_pos)


def within_task_auc(scores: np.ndarray, labels: np.ndarray, groups: np.ndarray) -> float:
    """AUC over every pair of a success and a failure of the same task (each pair counts
    once; ties half); NaN when no task has both outcomes."""
    if np.isnan(np.asarray(scores, dtype=np.float64)).any():
        return float("nan")
    u, pairs = within_task_parts(scores, labels, groups)
    total = pairs.sum()
    return float(u.sum() / total) if total > 0 else float("nan")


def tasks_with_both(labels: np.ndarray, groups: np.ndarray) -> int:
    """How many tasks have at least one success and one failure."""
    pos = np.asarray(labels, dtype=np.float64) > 0.5
    code, n_groups = _codes(groups)
    n_pos = np.bincount(code, weights=pos.astype(np.float64), minlength=n_groups)
    n_all = np.bincount(code, minlength=n_groups)
    return int(((n_pos > 0) & (n_pos < n_all)).sum())


def fidelity(scores: np.ndarray, labels: np.ndarray, groups: np.ndarray, *, n_boot: int = 200,
             seed: int = 0) -> Fidelity:
    """All-pairs and within-task AUC of ``scores`` against 0/1 ``labels`` (NaN labels left
    out), each with a 90% interval over resampled tasks.  The within-task interval resamples
    the tasks' own pair counts, so a task drawn twice counts its pairs twice."""
    scores = np.asarray(scores, dtype=np.float64)
    labels = np.asarray(labels, dtype=np.float64)
    keep = ~np.isnan(labels)
    scores, labels, groups = scores[keep], labels[keep], np.asarray(groups)[keep]
    pos = labels > 0.5
    lo, hi = bootstrap_ci(lambda r: auc(scores[r], labels[r]), groups, n_boot=n_boot, seed=seed) \
        if scores.size else (float("nan"), float("nan"))
    all_pairs = AucFigure(auc(scores, labels), (lo, hi), int(np.unique(groups.astype(str)).size),
                          int(pos.sum()) * int((~pos).sum()))
    u, pairs = within_task_parts(scores, labels, groups)
    both = np.flatnonzero(pairs > 0)
    value = float(u.sum() / pairs.sum()) if both.size and not np.isnan(scores).any() else float("nan")
    w_lo = w_hi = float("nan")
    if both.size >= 2 and not np.isnan(value):
        rng = np.random.default_rng(seed)
        pick = both[rng.integers(0, both.size, size=(int(n_boot), both.size))]
        draws = u[pick].sum(axis=1) / pairs[pick].sum(axis=1)
        w_lo, w_hi = (float(x) for x in np.quantile(draws, [0.05, 0.95]))
    within = AucFigure(value, (w_lo, w_hi), int(both.size), int(pairs.sum()))
    return Fidelity(all_pairs, within)
