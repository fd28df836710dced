"""Outcome calibration: what a dataset's recorded outcomes say about a reward template.

For the labelled episodes of a scored dataset it measures

* the predictive power of every component (its per-episode sum for step components, its
  value for episode terms) and of the episode return: AUC for 0/1 outcomes, Spearman's rank
  correlation for graded ones, each with a 90% bootstrap interval over *tasks*; for 0/1
  outcomes also the within-task AUC (a success and a failure of the same task, the primary
  fidelity figure) with its interval and the number of tasks that have both outcomes;
* the ROC curve of the episode return (binary outcomes);
* the calibration of the return against success: a logistic map from return to success
  probability fitted with cross-validation grouped by task (no task on both sides), its
  held-out AUC and Brier score, and the observed success rate per return decile.

Example::

    >>> report = calibrate(ws, "tool_agent", dataset="tau2_grok")        # doctest: +SKIP
    >>> report.return_power.value, report.return_power.ci90              # doctest: +SKIP
    (0.52, (0.47, 0.58))
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from scipy.stats import spearmanr

from core.records.episodes import Episode
from core.base.errors import InputError
from core.rewards.api import load_frame, score
from core.rewards.labels import dataset_outcomes
from core.rewards.outcomes import (AucFigure, auc, bootstrap_ci, episode_groups, episode_labels, fidelity,
                                   grouped_folds, tasks_with_both)
from core.rewards.pyramid import ScoreResult

#: Fewest labelled episodes (and of each class, for 0/1 outcomes) calibration works on.
MIN_LABELLED = 10


@dataclass
class Power:
    """How well one score ranks the outcomes: ``value`` (AUC over all pairs or Spearman ρ) and
    its interval, and for 0/1 outcomes the within-task AUC beside it."""

    name: str
    level: str
    metric: str
    #: AUC over every (success, failure) pair, or Spearman's ρ for graded outcomes
    value: float
    #: 90% interval of ``value`` over resampled tasks
    ci90: tuple[float, float]
    #: AUC over pairs of a success and a failure of the same task, its 90% interval over the
    #: tasks that have both outcomes and their number (``n_tasks``); None for graded outcomes
    within_task: AucFigure | None = None


@dataclass
class CalibrationReport:
    """Everything :func:`calibrate_result` measured (see the module docstring)."""

    template: str
    n_episodes: int
    n_labelled: int
    n_tasks: int
    binary: bool
    success_rate: float
    metric: str
    return_power: Power
    components: list[Power]
    roc: dict[str, list[float]] = field(default_factory=dict)
    bins: list[dict[str, float]] = field(default_factory=list)
    heldout_auc: float | None = None
    heldout_brier: float | None = None
    folds: int = 0
    #: Tasks with at least one success and one failure: the pairs the within-task AUC compares
    tasks_with_both: int | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _power_fn(binary: bool):
    if binary:
        return "auc", auc

    def rho(scores: np.ndarray, labels: np.ndarray) -> float:
        if np.unique(scores).size < 2 or np.unique(labels).size < 2:
            return float("nan")
        return float(spearmanr(scores, labels).statistic)

    return "spearman", rho


def episode_component_values(result: ScoreResult) -> tuple[list[tuple[str, str]], np.ndarray]:
    """([(component, level)], [n_episodes, n_components]): each step component summed over
    its episode's steps (unweighted), each episode term as it is."""
    t, frame, m = result.template, result.frame, result.matrix
    level_of = {c.name: lv.key for lv in t.levels for c in lv.components}
    names = [(c.name, level_of.get(c.name, "penalty")) for c in t.step_components]
    sums = np.zeros((frame.n_episodes, len(names)))
    for j in range(len(names)):
        sums[:, j] = np.bincount(frame.episode, weights=m.step_values[j], minlength=frame.n_episodes)
    names += [(c.name, "episode") for c in t.episode_terms]
    return names, np.hstack([sums, m.episode_values])


def _roc(scores: np.ndarray, labels: np.ndarray) -> dict[str, list[float]]:
    from sklearn.metrics import roc_curve

    fpr, tpr, thr = roc_curve(labels > 0.5, scores)
    return {"fpr": fpr.round(4).tolist(), "tpr": tpr.round(4).tolist(),
            "threshold": np.nan_to_num(thr, posinf=float(scores.max()) + 1).round(4).tolist()}


def _bins(scores: np.ndarray, labels: np.ndarray, n_bins: int = 10) -> list[dict[str, float]]:
    edges = np.unique(np.quantile(scores, np.linspace(0, 1, n_bins + 1)))
    which = np.clip(np.searchsorted(edges, scores, side="right") - 1, 0, max(len(edges) - 2, 0))
    out = []
    for b in np.unique(which):
        sel = which == b
        out.append({"return_mean": float(scores[sel].mean()), "success_rate": float(labels[sel].mean()),
                    "episodes": int(sel.sum())})
    return out


def _heldout(scores: np.ndarray, labels: np.ndarray, groups: np.ndarray, seed: int
             ) -> tuple[float, float, int]:
    """Grouped-CV logistic map from return to success: held-out AUC, Brier score, folds."""
    from sklearn.linear_model import LogisticRegression

    folds = grouped_folds(groups, 5, seed=seed)
    prob = np.full(scores.shape[0], np.nan)
    x = scores.reshape(-1, 1)
    y = (labels > 0.5).astype(int)
    for idx in folds:
        train = np.setdiff1d(np.arange(scores.shape[0]), idx)
        if np.unique(y[train]).size < 2:
            prob[idx] = y[train].mean()
            continue
        model = LogisticRegression(max_iter=1000).fit(x[train], y[train])
        prob[idx] = model.predict_proba(x[idx])[:, 1]
    return auc(prob, y), float(np.mean((prob - y) ** 2)), len(folds)


def outcome_columns(episodes: list[Episode], group_key: str | None = None
                    ) -> tuple[np.ndarray, np.ndarray]:
    """(recorded label, task group) per episode, without people's labels (a workspace dataset
    reads :func:`core.rewards.labels.dataset_outcomes`, which puts them over these)."""
    return episode_labels(episodes), episode_groups(episodes, group_key)


def calibrate_result(result: ScoreResult, labels_all: np.ndarray, groups_all: np.ndarray, *,
                     n_boot: int = 200, seed: int = 0) -> CalibrationReport:
    """Calibrate a scored dataset against its recorded outcomes: ``labels_all`` and
    ``groups_all`` per episode of the scored frame, in its order (see :func:`outcome_columns`;
    unlabelled episodes, NaN, are left out)."""
    frame = result.frame
    if labels_all.shape[0] != frame.n_episodes or groups_all.shape[0] != frame.n_episodes:
        raise InputError(f"{labels_all.shape[0]} labels for {frame.n_episodes} scored episodes")
    labelled = np.flatnonzero(~np.isnan(labels_all))
    labels = labels_all[labelled]
    distinct = np.unique(labels)
    binary = bool(np.all(np.isin(distinct, [0.0, 1.0])))
    if labelled.size < MIN_LABELLED or distinct.size < 2 or (
            binary and min((labels > 0.5).sum(), (labels < 0.5).sum()) < 2):
        raise InputError(f"calibration needs at least {MIN_LABELLED} labelled episodes with both "
                         f"outcomes; this data has {labelled.size} labelled "
                         f"({int((labels > 0.5).sum())} successful)", field="outcome")
    groups = groups_all[labelled]
    metric, power = _power_fn(binary)

    def measure(name: str, level: str, scores: np.ndarray) -> Power:
        if binary:   # the same all-pairs interval as below, and the within-task figure beside it
            fid = fidelity(scores, labels, groups, n_boot=n_boot, seed=seed)
            return Power(name, level, metric, fid.all_pairs.value, fid.all_pairs.ci90, fid.within_task)
        lo, hi = bootstrap_ci(lambda r: power(scores[r], labels[r]), groups, n_boot=n_boot, seed=seed)
        return Power(name, level, metric, power(scores, labels), (lo, hi))

    returns = result.returns[labelled]
    names, values = episode_component_values(result)
    components = [measure(n, lv, values[labelled, j]) for j, (n, lv) in enumerate(names)]
    report = CalibrationReport(
        template=result.template.name, n_episodes=int(frame.n_episodes), n_labelled=int(labelled.size),
        n_tasks=int(np.unique(groups.astype(str)).size), binary=binary,
        success_rate=float((labels > 0.5).mean()) if binary else float(labels.mean()), metric=metric,
        return_power=measure("return", "episode", returns), components=components)
    if binary:
        report.tasks_with_both = tasks_with_both(labels, groups)
        report.roc = _roc(returns, labels)
        report.bins = _bins(returns, labels)
        if report.n_tasks >= 2:
            report.heldout_auc, report.heldout_brier, report.folds = _heldout(returns, labels, groups, seed)
    return report


def calibrate(ws, template, *, dataset: str, group_key: str | None = None, n_boot: int = 200,
              seed: int = 0, progress=None) -> CalibrationReport:
    """Score a workspace dataset with ``template`` and calibrate it (:func:`calibrate_result`);
    ``progress`` as for :func:`core.rewards.api.score`.  The outcomes are the dataset's
    recorded ones with people's labels over them (:func:`core.rewards.labels.dataset_outcomes`)."""
    frame = load_frame(ws, dataset)
    result = score(ws, template, frame=frame, progress=progress)
    labels, groups = dataset_outcomes(ws, dataset, group_key)
    return calibrate_result(result, labels, groups, n_boot=n_boot, seed=seed)
