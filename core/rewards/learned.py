"""A learned outcome component: success probability fitted on labelled episodes.

:func:`fit_outcome_model` fits the model of :mod:`core.rewards.outcome_model` — feature
blocks of tool-use statistics, domain-free signals, counts relative to the task's other
runs, the task criteria when present, and sentence embeddings of the request and the last
answer; an all-pairs or a within-task (pairwise) logistic objective; C, feature set and
objective chosen by grouped inner cross-validation — and measures it by *nested*
cross-validation grouped by task, beside two plain baselines on the same outer folds.  It
then refits on every labelled episode.  The fitted model is plain numbers (feature blocks
and names, standardisation, coefficients), kept in the template as the ``learned_outcome``
episode term's parameters: saved, versioned and diffed with the template, loaded without
pickle.

On an unlabelled episode the component gives the predicted success probability.  Counts
relative to the task compare an episode with the other runs of its task *in the scored
data* (by task id where the episode's meta has one, else by domain and request); an
episode alone in its task gets 0 there, as a task with one run did when fitting.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from core.base import embed as text_embedding
from core.base import safe_yaml
from core.base.errors import InputError
from core.rewards.agent_signals import AnswerConsistency
from core.rewards.api import as_template, load_frame
from core.rewards.labels import dataset_outcomes
from core.rewards.components import Component, ScoringContext, _check, register
from core.rewards.criteria import frame_criteria
from core.rewards.frame import StepsFrame
from core.rewards.template import parse_template
from core.rewards.outcome_model import (ANSWER_FEATURES, BLOCKS, C_GRID, FEATURE_SETS, OBJECTIVES,  # noqa: F401
                                        SIGNAL_FEATURES, STAT_FEATURES, TOP_CONFIGS, Config, FeatureTable,
                                        SELECTIONS, HeldOut, config_grid, choose_configs, episode_stats, feature_table,
                                        fit_ensemble, frame_groups, heldout_report, last_words, set_columns,
                                        signal_features)

#: Fewest labelled episodes, and tasks, a model is fitted on.
MIN_EPISODES, MIN_TASKS = 30, 5
#: Feature sets without the sentence model (``embed="none"``).
NO_EMBED_SETS: tuple[str, ...] = ("counts", "counts_task")


def outcome_features(frame: StepsFrame, ctx: ScoringContext, embed: str) -> tuple[list[str], np.ndarray]:
    """(feature names, matrix) of a model saved before feature blocks: the tool-use
    statistics and signals, then with ``embed="last_words"`` the answer's agreement with the
    tool results and its sentence embedding."""
    names = [*STAT_FEATURES, *SIGNAL_FEATURES]
    x = np.hstack([episode_stats(frame), signal_features(frame)])
    if embed == "last_words":
        cosine, has = AnswerConsistency().cosines(frame, ctx)
        vectors = ctx.encode(last_words(frame), what="learned_outcome").astype(np.float64)
        names += [*ANSWER_FEATURES, *(f"last_words_{i}" for i in range(vectors.shape[1]))]
        x = np.hstack([x, cosine[:, None], has[:, None].astype(np.float64), vectors])
    return names, x


@dataclass(frozen=True)
class OutcomeFit:
    """A fitted model's parameters (the component's) and how it did on held-out tasks."""

    #: The ``learned_outcome`` term's parameters (plain numbers)
    params: dict[str, Any]
    #: Learned model and both plain baselines on the nested cross-validation's held-out tasks
    heldout: HeldOut
    #: The configs the final model averages (chosen by cross-validation on every label)
    configs: list[Config]
    #: Held-out all-pairs AUC of the learned model (``heldout.learned.all_pairs.value``)
    heldout_auc: float
    #: Outer folds
    folds: int
    #: Labelled episodes fitted on
    n_labelled: int
    #: Labelled tasks
    n_tasks: int
    #: Held-out success probability per labelled episode (the outer folds' models)
    predictions: np.ndarray


def _figure(f) -> dict[str, Any]:
    return {"value": round(float(f.value), 4), "ci90": [round(float(v), 4) for v in f.ci90],
            "n_tasks": int(f.n_tasks), "n_pairs": int(f.n_pairs)}


def fit_outcome_model(frame: StepsFrame, labels: np.ndarray, groups: np.ndarray, *,
                      ctx: ScoringContext | None = None, embed: str = "last_words",
                      cs: Sequence[float] = C_GRID, c: float | None = None, objectives: Sequence[str] = OBJECTIVES,
                      outer_folds: int = 5, inner_folds: int = 4, select: str = "anchored", repeats: int = 3,
                      top_configs: int = TOP_CONFIGS, group_key: str | None = None,
                      n_boot: int = 500, seed: int = 0) -> OutcomeFit:
    """Fit the learned outcome on the labelled episodes of ``frame`` (``labels`` > 0.5 is
    success, NaN unlabelled; ``groups`` the task of each episode): nested cross-validation for
    the held-out figures (with both baselines), then the final model on every label.  ``c``
    fixes the regularisation (else chosen from ``cs``)."""
    if c is not None:
        cs = (float(c),)
    ctx = ctx or ScoringContext()
    _check(embed in ("last_words", "none"), "embed must be last_words or none")
    _check(select in SELECTIONS, f"select must be one of {', '.join(SELECTIONS)}")
    labels = np.asarray(labels, dtype=np.float64)
    groups = np.asarray(groups).astype(str)
    if labels.shape[0] != frame.n_episodes or groups.shape[0] != frame.n_episodes:
        raise InputError(f"labels ({labels.shape[0]}) and groups ({groups.shape[0]}) need one entry per "
                         f"episode ({frame.n_episodes})", field="outcome")
    keep = np.flatnonzero(~np.isnan(labels))
    y = (labels[keep] > 0.5).astype(int)
    n_tasks = int(np.unique(groups[keep]).size)
    if keep.size < MIN_EPISODES or n_tasks < MIN_TASKS or min(y.sum(), (1 - y).sum()) < 5:
        raise InputError(f"a learned outcome needs at least {MIN_EPISODES} labelled episodes over "
                         f"{MIN_TASKS} tasks with 5 of each outcome; this data has {keep.size} "
                         f"over {n_tasks} tasks ({int(y.sum())} successful)", field="outcome")
    sets = tuple(FEATURE_SETS) if embed == "last_words" else NO_EMBED_SETS
    blocks = tuple(dict.fromkeys(b for name in sets for b in FEATURE_SETS[name])) + ("criteria",)
    full = feature_table(frame, ctx, groups, blocks)     # task-relative counts over every run, labelled or not
    table = FeatureTable(full.names, full.matrix[keep], full.columns)
    configs = config_grid(sets, objectives, cs)
    report, cv = heldout_report(table, y, groups[keep], configs=configs, outer_folds=outer_folds,
                                inner_folds=inner_folds, seed=seed, select=select, top_configs=top_configs,
                                repeats=repeats, n_boot=n_boot)
    columns = set_columns(table)
    final = choose_configs(table.matrix, y, groups[keep], np.arange(y.size), configs, columns,
                           n_folds=outer_folds, seed=seed + 1, select=select, top=top_configs)
    used, model = fit_ensemble(table.matrix, y, groups[keep], final, columns, seed)
    if model is None:
        raise InputError("no model could be fitted on these labels (one outcome only)", field="outcome")
    names = [table.names[i] for i in used]
    used_blocks = [b for b in BLOCKS if b in table.columns and np.isin(table.columns[b], used).all()]
    params = {"blocks": used_blocks, "group_key": group_key, "features": names,
              "mean": model.mean.round(8).tolist(), "scale": model.scale.round(8).tolist(),
              "coef": model.coef.round(8).tolist(), "intercept": round(float(model.intercept), 8),
              "models": [f"{c.features}/{c.objective}/C={c.C:g}" for c in final],
              "heldout": {"all_pairs": _figure(report.learned.all_pairs),
                          "within_task": _figure(report.learned.within_task),
                          "tasks_with_both": report.tasks_with_both, "folds": report.folds},
              "heldout_auc": round(float(report.learned.all_pairs.value), 4), "trained_on": int(keep.size)}
    return OutcomeFit(params=params, heldout=report, configs=final,
                      heldout_auc=float(report.learned.all_pairs.value), folds=report.folds,
                      n_labelled=int(keep.size), n_tasks=n_tasks, predictions=cv.predictions)


@register
class LearnedOutcome(Component):
    """Learned outcome: the success probability a logistic model fitted on labelled episodes gives this episode (its coefficients live in the template)."""

    name = "learned_outcome"
    level = "episode"
    scope = "episode"
    episode_local = False      # counts relative to the task read the task's other runs
    uses_embeddings = True

    def __init__(self, *, embed: Literal["last_words", "none"] = "last_words",
                 blocks: list[str] | None = None, group_key: str | None = None,
                 features: list[str] | None = None, mean: list[float] | None = None,
                 scale: list[float] | None = None, coef: list[float] | None = None,
                 intercept: float = 0.0, models: list[str] | None = None,
                 heldout: dict[str, Any] | None = None, heldout_auc: float | None = None,
                 trained_on: int = 0, low: float = 0.0, high: float = 1.0):
        _check(embed in ("last_words", "none"), "embed must be last_words or none")
        self.features: list[str] = list(features or [])
        self.mean, self.scale, self.coef = list(mean or []), list(scale or []), list(coef or [])
        _check(len(self.features) == len(self.mean) == len(self.scale) == len(self.coef),
               "features, mean, scale and coef must have one entry per feature "
               "(fit them with rwb reward learn)")
        _check(all(s > 0 for s in self.scale), "every scale must be > 0")
        _check(low <= high, "need low ≤ high")
        unknown = sorted(set(blocks or []) - set(BLOCKS))
        _check(not unknown, f"unknown feature blocks {unknown}; known: {', '.join(BLOCKS)}")
        self.embed = embed
        self.blocks = list(blocks) if blocks is not None else None
        self.group_key = group_key
        self.models, self.heldout = list(models or []), dict(heldout or {})
        self.intercept, self.heldout_auc, self.trained_on = float(intercept), heldout_auc, int(trained_on)
        self.low, self.high = float(low), float(high)

    def features_of(self, frame: StepsFrame, ctx: ScoringContext,
                    groups: np.ndarray | None = None) -> tuple[list[str], np.ndarray]:
        """(names, matrix) of the features this model was fitted on; ``groups`` the task of
        each episode (default: :func:`~core.rewards.outcome_model.frame_groups`)."""
        if self.blocks is None:                       # saved before feature blocks
            return outcome_features(frame, ctx, self.embed)
        if groups is None:
            groups = frame_groups(frame, self.group_key)
        table = feature_table(frame, ctx, np.asarray(groups).astype(str), self.blocks, scoring=True)
        return table.names, table.matrix

    def predict(self, frame: StepsFrame, ctx: ScoringContext, groups: np.ndarray | None = None) -> np.ndarray:
        """Success probability per episode, scaled to [low, high]; pass ``groups`` (task ids)
        when known, so runs of a task are compared with each other."""
        if not self.features:
            return np.full(frame.n_episodes, (self.low + self.high) / 2)   # unfitted: no opinion
        names, x = self.features_of(frame, ctx, groups)
        if names != self.features:
            raise InputError(f"learned_outcome was fitted on {len(self.features)} features, this data "
                             f"gives {len(names)}; refit it (rwb reward learn)", field="learned_outcome")
        z = ((x - np.array(self.mean)) / np.array(self.scale)) @ np.array(self.coef) + self.intercept
        p = 1.0 / (1.0 + np.exp(-np.clip(z, -50, 50)))
        return self.low + (self.high - self.low) * p

    def __call__(self, frame: StepsFrame, ctx: ScoringContext) -> np.ndarray:
        return self.predict(frame, ctx)


def with_learned_outcome(template, params: dict[str, Any], weight: float = 1.0):
    """``template`` with its ``learned_outcome`` episode term set to the fitted ``params``
    (added with ``weight`` when the template has none, else its weight kept)."""
    data = template.to_dict()
    terms = data.setdefault("episode_terms", {})
    entry = dict(terms.get("learned_outcome") or {"weight": float(weight)})
    entry["params"] = params
    terms["learned_outcome"] = entry
    return parse_template(safe_yaml.dump(data, sort_keys=False), file=template.source)


def without_learned_outcome(template):
    """``template`` without its ``learned_outcome`` episode term (itself when it has none): the
    hand-built pyramid a fitted term is compared with, never one that already learned the labels."""
    data = template.to_dict()
    terms = data.get("episode_terms") or {}
    kept = {k: v for k, v in terms.items() if (v or {}).get("component", k) != "learned_outcome"}
    if len(kept) == len(terms):
        return template
    data["episode_terms"] = kept
    return parse_template(safe_yaml.dump(data, sort_keys=False), file=template.source)


def learn(ws, template, *, dataset: str, group_key: str | None = None, embed: str = "last_words",
          c: float | None = None, weight: float = 1.0, seed: int = 0, n_boot: int = 500):
    """Fit the learned outcome on a workspace dataset's labelled episodes (people's labels over
    the recorded outcomes): (the template with the fitted ``learned_outcome`` term, the fit).
    ``c`` fixes the regularisation instead of choosing it.  Nothing is saved."""
    base = as_template(template, ws)
    frame = load_frame(ws, dataset)
    labels, groups = dataset_outcomes(ws, dataset, group_key)
    ctx = ScoringContext(embedder=text_embedding.workspace_embedder(ws), criteria=frame_criteria(ws, frame))
    fit = fit_outcome_model(frame, labels, groups, ctx=ctx,
                            embed=embed, c=c, group_key=group_key,
                            seed=seed, n_boot=n_boot)
    return with_learned_outcome(base, fit.params, weight), fit
