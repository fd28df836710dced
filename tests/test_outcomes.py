"""Outcome labels, task groups and the grouped statistics (core.rewards.outcomes)."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from _real_logs import REAL
from core.base.errors import InputError
from core.data.importers import read_file
from core.rewards.outcomes import auc, bootstrap_ci, episode_groups, episode_labels, grouped_folds


def test_auc_matches_sklearn_with_ties():
    rng = np.random.default_rng(3)
    scores = rng.integers(0, 5, 200).astype(float)       # many ties
    labels = (rng.random(200) < 0.4).astype(float)
    assert auc(scores, labels) == pytest.approx(roc_auc_score(labels, scores))
    assert np.isnan(auc(scores, np.ones(200)))


def test_grouped_folds_never_split_a_group_and_cover_every_row():
    groups = np.array([f"t{i % 13}" for i in range(100)], dtype=object)
    folds = grouped_folds(groups, 5, seed=1)
    rows = np.concatenate(folds)
    assert sorted(rows.tolist()) == list(range(100))
    seen = {}
    for f, idx in enumerate(folds):
        for g in set(groups[idx]):
            assert seen.setdefault(g, f) == f
    with pytest.raises(InputError, match="at least 2 tasks"):
        grouped_folds(np.array(["a"] * 5, dtype=object))


def test_bootstrap_interval_contains_the_point_estimate():
    rng = np.random.default_rng(0)
    groups = np.array([f"t{i // 4}" for i in range(200)], dtype=object)
    labels = (rng.random(200) < 0.5).astype(float)
    scores = labels + rng.normal(0, 0.8, 200)
    point = auc(scores, labels)
    lo, hi = bootstrap_ci(lambda r: auc(scores[r], labels[r]), groups, n_boot=100)
    assert lo < point < hi and 0.5 < lo


def test_real_tau2_runs_carry_labels_and_task_groups():
    parsed = read_file(REAL / "tau2_whissle" / "episodes.jsonl", reward_key="outcome", id_key="id")
    labels = episode_labels(parsed.episodes)
    assert labels.shape == (50,) and set(np.unique(labels)) == {0.0, 1.0}
    assert int(labels.sum()) == 28                      # the README's 28 of 50
    groups = episode_groups(parsed.episodes)
    assert len(set(groups)) == 50                       # one run per task
    with pytest.raises(InputError, match="no value at group key"):
        episode_groups(parsed.episodes, "no.such.key")


# --------------------------------------------------------------------------- within-task AUC

def _hand_within_task(scores, labels, groups):
    """Every (success, failure) pair of the same task compared one by one."""
    right = pairs = 0.0
    for task in set(groups):
        rows = [i for i, g in enumerate(groups) if g == task]
        for i in rows:
            for j in rows:
                if labels[i] > 0.5 and labels[j] <= 0.5:
                    pairs += 1
                    right += 1.0 if scores[i] > scores[j] else 0.5 if scores[i] == scores[j] else 0.0
    return right / pairs


def test_within_task_auc_matches_a_hand_computation_with_ties():
    from core.rewards.outcomes import tasks_with_both, within_task_auc

    scores = np.array([3.0, 1.0, 2.0, 2.0, 5.0, 0.0, 4.0, 4.0, 1.0])
    labels = np.array([1, 0, 1, 0, 0, 1, 1, 0, 1], dtype=float)
    groups = np.array(["a", "a", "b", "b", "c", "c", "d", "d", "e"])
    # a: right; b: tie; c: wrong; d: tie; e: one outcome only (no pair)
    assert within_task_auc(scores, labels, groups) == pytest.approx(0.5)
    assert tasks_with_both(labels, groups) == 4
    rng = np.random.default_rng(3)
    s = rng.integers(0, 5, 200).astype(float)          # many ties
    y = (rng.random(200) < 0.4).astype(float)
    g = rng.integers(0, 25, 200).astype(str)
    assert within_task_auc(s, y, g) == pytest.approx(_hand_within_task(s, y, g))


def test_within_task_ignores_differences_between_tasks():
    from core.rewards.outcomes import auc, within_task_auc

    # task b is easy and scores high; inside each task the failure scores higher
    scores = np.array([1.0, 2.0, 10.0, 11.0])
    labels = np.array([1, 0, 1, 0], dtype=float)
    groups = np.array(["a", "a", "b", "b"])
    assert within_task_auc(scores, labels, groups) == 0.0
    assert auc(scores, labels) == 0.25                 # one cross-task pair is right


def test_fidelity_reports_both_figures_with_intervals_and_counts():
    from core.rewards.outcomes import fidelity

    rng = np.random.default_rng(0)
    g = np.repeat(np.arange(40).astype(str), 5)
    y = (rng.random(200) < 0.5).astype(float)
    s = y + rng.normal(scale=1.0, size=200)
    y[:3] = np.nan                                      # unlabelled: left out
    f = fidelity(s, y, g, n_boot=300)
    for figure in (f.all_pairs, f.within_task):
        assert 0.5 < figure.value < 1.0
        assert figure.ci90[0] < figure.value < figure.ci90[1]
    assert f.all_pairs.n_tasks == 40 and f.within_task.n_tasks <= 40
    assert f.within_task.n_pairs < f.all_pairs.n_pairs
    none = fidelity(s[:5], np.array([1, 1, 1, 1, 1.0]), g[:5])
    assert np.isnan(none.within_task.value) and none.within_task.n_tasks == 0
