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
