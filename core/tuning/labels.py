"""What a study is judged by, and how its episodes are split: the outcome label of each episode
(:func:`outcome_labels`), the group each episode belongs to (:func:`split_keys`,
:func:`task_groups`), the held-out split of whole groups (:func:`split_episodes`), and the check
that the labelled data is large enough to tune on (:func:`check_outcome_data`).

**Small data.**  Fewer than :data:`MIN_LABELLED` labelled episodes, :data:`MIN_TASKS` tasks or
:data:`MIN_PER_CLASS` episodes of either outcome is refused (the numbers found and needed are
named).  Below the comfortable sizes (:data:`COMFORTABLE_LABELLED`, :data:`COMFORTABLE_TASKS`,
:data:`COMFORTABLE_PER_CLASS`) the study runs with a warning in its result and the search
shrinks toward the template's weights (:data:`SMALL_DATA_PENALTY`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from core.base.errors import InputError
from core.records.episodes import Episode
from core.rewards.frame import StepsFrame
from core.rewards.outcomes import episode_groups

#: Fewest labelled episodes, distinct tasks and episodes of each outcome (successful,
#: failed) the outcome objective tunes on; below any of them a study is refused: with 4
#: failures among 13 runs the best of a few hundred weightings ranks them perfectly by
#: chance, and the held-out half cannot tell.
MIN_LABELLED = 40
MIN_TASKS = 8
MIN_PER_CLASS = 10
#: Sizes from which the outcome objective runs without a warning and without the pull
#: toward the template's weights (:data:`SMALL_DATA_PENALTY`).
COMFORTABLE_LABELLED = 200
COMFORTABLE_TASKS = 40
COMFORTABLE_PER_CLASS = 50
#: Below the comfortable sizes: value −= this × mean over tuned weights of
#: ((w − w_template) / (high − low))²; moving every weight across its whole range costs
#: 0.2 of AUC, moving one of five weights half its range costs 0.01.
SMALL_DATA_PENALTY = 0.2


@dataclass(frozen=True)
class Labels:
    """Per episode: ``success`` (1/0, NaN unknown) and ``value`` (the label as a number, for τ)."""

    success: np.ndarray
    value: np.ndarray

    @property
    def known(self) -> np.ndarray:
        known: np.ndarray = ~np.isnan(self.success)
        return known


def with_people_labels(frame: StepsFrame, given: Mapping[str, int | None], version: int) -> StepsFrame:
    """The frame with people's labels (``{episode id: 1, 0 or None}``, :func:`core.rewards.labels.current_labels`)
    over the recorded outcomes, as :func:`core.rewards.labels.dataset_outcomes` reads them: a label
    sets the episode's ``resolved`` (so the ``success`` and ``resolved`` labels of
    :func:`outcome_labels` follow it), a withdrawn one (None) leaves the recorded outcome.  A frame
    that a label changes gets its own content hash, naming the label set's ``version``."""
    ids = frame.episode_ids.tolist()
    hit = [(i, float(given[e])) for i, e in enumerate(ids) if given.get(e) is not None]   # type: ignore[arg-type]
    if not hit:
        return frame
    resolved = frame.resolved.astype(np.float64).copy()
    rows, values = zip(*hit)
    resolved[list(rows)] = values
    digest = hashlib.sha256(f"{frame.content_hash}|labels-v{int(version)}".encode()).hexdigest()
    return replace(frame, resolved=resolved, content_hash=digest, _cache={})


def outcome_labels(frame: StepsFrame, label: str = "success", threshold: float = 0.0) -> Labels:
    """The label each episode is judged by (see :class:`~core.tuning.config.TuneConfig`)."""
    resolved = frame.resolved.astype(np.float64)
    if label in ("success", "resolved"):
        success = resolved.copy()
        if label == "success":
            fr = frame.final_reward.astype(np.float64)
            fill = np.isnan(success) & ~np.isnan(fr)
            success[fill] = (fr[fill] > threshold).astype(np.float64)
        return Labels(success=success, value=success)
    value = getattr(frame, label).astype(np.float64)
    success = np.where(np.isnan(value), np.nan, (value > threshold).astype(np.float64))
    return Labels(success=success, value=value)


def split_keys(frame: StepsFrame, split_by: str) -> np.ndarray:
    """The group key of each episode for ``split_by`` (episodes sharing a key stay together)."""
    if split_by == "episode":
        keys = frame.episode_ids
    elif split_by == "task":
        # the request text; an episode without one is a task of its own
        keys = np.array([q if q else f"\x00{e}" for q, e in zip(frame.query.tolist(),
                                                               frame.episode_ids.tolist())], dtype=object)
    elif split_by in ("task_type", "domain", "behaviour"):
        keys = getattr(frame, split_by)
    else:
        name = split_by[5:]
        keys = np.array([m.get(name) for m in frame.ep_meta], dtype=object)
        if all(k is None for k in keys.tolist()):
            raise InputError(f"no episode has meta.{name}; choose another split_by", field="split_by")
    return np.array([json.dumps(k, sort_keys=True, default=str) for k in keys.tolist()], dtype=object)


def split_episodes(keys: np.ndarray, success: np.ndarray, heldout_fraction: float, seed: int
                   ) -> np.ndarray:
    """Held-out mask over episodes: whole groups (same key) go to one side, stratified by
    outcome so both sides get successes and failures.

    Groups are ordered by their success rate (ties broken by a seeded hash of the key) and
    dealt out in that order: a group goes to the held-out side when, counting half of it,
    that side stays within ``heldout_fraction`` of the episodes dealt so far — so both sides
    sample the whole range of success rates."""
    uniq, inverse = np.unique(keys, return_inverse=True)
    n_groups = uniq.shape[0]
    if n_groups < 2:
        raise InputError(f"split_by puts every episode in one group ({n_groups}); choose a field "
                         "with at least two values", field="split_by")
    size = np.bincount(inverse, minlength=n_groups).astype(np.float64)
    known = ~np.isnan(success)
    pos = np.bincount(inverse[known], weights=success[known], minlength=n_groups)
    cnt = np.bincount(inverse[known], minlength=n_groups)
    rate = np.where(cnt > 0, pos / np.maximum(cnt, 1), -1.0)
    jitter = np.array([int(hashlib.sha256(f"{seed}|{k}".encode()).hexdigest()[:12], 16) for k in uniq])
    order = np.lexsort((jitter, rate))
    held_group = np.zeros(n_groups, dtype=bool)
    held_n = dealt = 0.0
    for g in order:
        dealt += size[g]
        if held_n + size[g] / 2 <= heldout_fraction * dealt + 1e-9:
            held_group[g] = True
            held_n += size[g]
    if held_group.all() or not held_group.any():
        raise InputError(f"{n_groups} groups are too few to hold out {heldout_fraction:.0%}",
                         field="heldout_fraction")
    return held_group[inverse]


def task_groups(frame: StepsFrame, episodes: Sequence[Episode], group_key: str | None = None
                ) -> np.ndarray:
    """The task of each episode of ``frame`` (in its order) from the ``episodes`` it was
    built from: :func:`core.rewards.outcomes.episode_groups` (the log's own task id, or the
    record key ``group_key``)."""
    groups = episode_groups(episodes, group_key)
    position = {ep.episode_id: i for i, ep in enumerate(episodes)}
    missing = [e for e in frame.episode_ids.tolist() if e not in position]
    if missing:
        raise ValueError(f"episodes {missing[:3]} of the frame are not among those given")
    return groups[[position[e] for e in frame.episode_ids.tolist()]]


@dataclass(frozen=True)
class OutcomeDataCheck:
    """How much labelled data the outcome objective has: counts, the warnings of a
    small-but-usable set, and the pull toward the template's weights it gets."""

    labelled: int
    successes: int
    failures: int
    groups: int
    warnings: tuple[str, ...]
    penalty: float


def check_outcome_data(labels: Labels, groups: np.ndarray, split_by: str = "task") -> OutcomeDataCheck:
    """Refuse (InputError naming the numbers found and needed) labelled data below
    :data:`MIN_LABELLED` episodes, :data:`MIN_TASKS` groups or :data:`MIN_PER_CLASS` of
    either outcome; warn and regularise (:data:`SMALL_DATA_PENALTY`) below the comfortable
    sizes."""
    known = labels.known
    y = labels.success[known]
    n, pos = int(known.sum()), int((y == 1).sum())
    neg = n - pos
    n_groups = int(np.unique(groups[known].astype(str)).size)
    what = "tasks" if split_by == "task" else f"groups (split by {split_by})"
    found = f"{n} labelled episodes from {n_groups} {what} ({pos} successful, {neg} failed)"
    if n < MIN_LABELLED or n_groups < MIN_TASKS or min(pos, neg) < MIN_PER_CLASS:
        raise InputError(f"too few labelled episodes to tune towards outcomes: the data has {found}; "
                         f"tuning needs at least {MIN_LABELLED} labelled episodes from at least {MIN_TASKS} "
                         f"{what}, with at least {MIN_PER_CLASS} successful and {MIN_PER_CLASS} failed. "
                         "Label more episodes (import them with --reward-key), or tune on preference labels",
                         field="outcome")
    if n < COMFORTABLE_LABELLED or n_groups < COMFORTABLE_TASKS or min(pos, neg) < COMFORTABLE_PER_CLASS:
        warning = (f"small labelled set: {found}, under the comfortable {COMFORTABLE_LABELLED} episodes, "
                   f"{COMFORTABLE_TASKS} {what} and {COMFORTABLE_PER_CLASS} of each outcome; the weights are "
                   f"pulled toward the template's (penalty {SMALL_DATA_PENALTY} × mean squared relative change) "
                   "and the held-out AUC is coarse")
        return OutcomeDataCheck(n, pos, neg, n_groups, (warning,), SMALL_DATA_PENALTY)
    return OutcomeDataCheck(n, pos, neg, n_groups, (), 0.0)
