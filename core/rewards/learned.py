"""A learned outcome component: success probability fitted on labelled episodes.

:func:`fit_outcome_model` fits an L2-regularised logistic regression (scikit-learn) from
domain-free episode features — tool-use statistics of the steps frame, the success signals
of :mod:`core.rewards.agent_signals` and, optionally, the agreement of the agent's last
words with the tool results and their sentence embedding — to the recorded outcomes, measures it with
cross-validation grouped by task (no task on both sides), then refits on every labelled
episode.  The fitted model is plain numbers (feature names, standardisation, coefficients),
kept in the template itself as the ``learned_outcome`` episode term's parameters: it is
saved, versioned and diffed with the template, and loads without pickle.

On an unlabelled episode the component gives the predicted success probability, which
makes it the terminal outcome term of a pyramid, and the reward a run trains on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from core.base import embed as text_embedding
from core.base import safe_yaml
from core.base.errors import InputError
from core.rewards.agent_signals import AnswerConsistency, UnrecoveredErrors, WriteActions
from core.rewards.api import as_template, load_frame
from core.rewards.calibration import outcome_columns
from core.rewards.components import Component, ScoringContext, _check, register
from core.rewards.frame import FINAL_ANSWER, REPLY, TOOL_CALL, StepsFrame
from core.rewards.outcomes import auc, grouped_folds
from core.rewards.template import parse_template

#: Tool-use statistics per episode, in column order.
STAT_FEATURES: tuple[str, ...] = (
    "steps", "tool_calls", "tool_errors", "invalid_calls", "distinct_tools", "repeated_calls",
    "replies", "ends_with_answer", "error_share", "repeat_share")

#: Domain-free success signals (core.rewards.agent_signals) per episode, after the statistics;
#: the answer's agreement with the tool results only with the sentence model (``last_words``).
SIGNAL_FEATURES: tuple[str, ...] = ("write_calls", "unrecovered_errors")
ANSWER_FEATURES: tuple[str, ...] = ("answer_cosine", "answer_has_evidence")

#: Fewest labelled episodes, and tasks, a model is fitted on.
MIN_EPISODES, MIN_TASKS = 30, 5


def _per_episode(frame: StepsFrame, mask: np.ndarray) -> np.ndarray:
    return np.bincount(frame.episode[mask], minlength=frame.n_episodes).astype(np.float64)


def episode_stats(frame: StepsFrame) -> np.ndarray:
    """[n_episodes, len(STAT_FEATURES)] tool-use statistics (see :data:`STAT_FEATURES`)."""
    call = frame.kind == TOOL_CALL
    calls = _per_episode(frame, call)
    errors = _per_episode(frame, call & frame.tool_error)
    invalid = _per_episode(frame, call & ~(frame.tool_known & frame.args_ok))
    ep, tool = frame.episode[call].astype(np.int64), frame.tool[call].astype(np.int64)
    distinct = np.zeros(frame.n_episodes)
    if ep.size:
        pairs = np.unique(ep * (int(tool.max()) + 2) + tool + 1)
        distinct = np.bincount(pairs // (int(tool.max()) + 2), minlength=frame.n_episodes).astype(float)
        keys = np.unique(ep * (int(frame.call_key.max()) + 1) + frame.call_key[call].astype(np.int64))
        unique_calls: np.ndarray = np.bincount(keys // (int(frame.call_key.max()) + 1),
                                               minlength=frame.n_episodes)
    else:
        unique_calls = np.zeros(frame.n_episodes)
    repeats = calls - unique_calls
    replies = _per_episode(frame, np.isin(frame.kind, [REPLY, FINAL_ANSWER]))
    answered = np.zeros(frame.n_episodes)
    has = frame.ep_len > 0
    last = frame.ep_last[has]
    answered[has] = (np.isin(frame.kind[last], [REPLY, FINAL_ANSWER]) & (frame.output_len[last] > 0))
    with np.errstate(invalid="ignore", divide="ignore"):
        error_share = np.where(calls > 0, errors / np.maximum(calls, 1), 0.0)
        repeat_share = np.where(calls > 0, repeats / np.maximum(calls, 1), 0.0)
    return np.column_stack([frame.ep_len.astype(float), calls, errors, invalid, distinct, repeats,
                            replies, answered, error_share, repeat_share])


def last_words(frame: StepsFrame) -> list[str]:
    """Per episode the text of its last step that has words (empty when none does)."""
    rows = np.flatnonzero(frame.output_len > 0)
    last = np.full(frame.n_episodes, -1, dtype=np.int64)
    np.maximum.at(last, frame.episode[rows], rows)
    return [str(frame.output_text[r]) if r >= 0 else "" for r in last]


def signal_features(frame: StepsFrame) -> np.ndarray:
    """[n_episodes, len(SIGNAL_FEATURES)]: write calls and unrecovered errors per episode."""
    writes = WriteActions(per=1.0)(frame, ScoringContext())
    unrecovered = UnrecoveredErrors(per=1.0, cap=10 ** 9).unrecovered(frame)
    return np.column_stack([-np.bincount(frame.episode, weights=writes, minlength=frame.n_episodes),
                            _per_episode(frame, unrecovered)])


def outcome_features(frame: StepsFrame, ctx: ScoringContext, embed: str) -> tuple[list[str], np.ndarray]:
    """(feature names, [n_episodes, n_features]) of ``frame``: the tool-use statistics and the
    domain-free signals, then, with ``embed="last_words"``, the last words' agreement with the
    tool results before them (cosine, has evidence) and their sentence embedding."""
    names = [*STAT_FEATURES, *SIGNAL_FEATURES]
    x = np.hstack([episode_stats(frame), signal_features(frame)])
    if embed == "last_words":
        cosine, has = AnswerConsistency().cosines(frame, ctx)
        vectors = ctx.encode(last_words(frame), what="learned_outcome").astype(np.float64)
        names += [*ANSWER_FEATURES, *(f"last_words_{i}" for i in range(vectors.shape[1]))]
        x = np.hstack([x, cosine[:, None], has[:, None].astype(np.float64), vectors])
    return names, x


@dataclass
class OutcomeFit:
    """A fitted model's parameters (the component's) and how well it did held out."""

    params: dict[str, Any]
    heldout_auc: float
    folds: int
    n_labelled: int
    n_tasks: int


def _logistic(x: np.ndarray, y: np.ndarray, c: float):
    from sklearn.linear_model import LogisticRegression

    mean, scale = x.mean(axis=0), x.std(axis=0)
    scale = np.where(scale > 1e-12, scale, 1.0)
    model = LogisticRegression(C=c, max_iter=2000).fit((x - mean) / scale, y)
    return mean, scale, model


def fit_outcome_model(frame: StepsFrame, labels: np.ndarray, groups: np.ndarray, *,
                      ctx: ScoringContext | None = None, embed: str = "last_words", c: float = 1.0,
                      seed: int = 0) -> OutcomeFit:
    """Fit the learned outcome component on the labelled episodes of ``frame`` (``labels``
    > 0.5 is success, NaN unlabelled; ``groups`` the task of each episode)."""
    ctx = ctx or ScoringContext()
    keep = np.flatnonzero(~np.isnan(labels))
    y = (labels[keep] > 0.5).astype(int)
    n_tasks = int(np.unique(groups[keep].astype(str)).size)
    if keep.size < MIN_EPISODES or n_tasks < MIN_TASKS or min(y.sum(), (1 - y).sum()) < 5:
        raise InputError(f"a learned outcome needs at least {MIN_EPISODES} labelled episodes over "
                         f"{MIN_TASKS} tasks with 5 of each outcome; this data has {keep.size} "
                         f"over {n_tasks} tasks ({int(y.sum())} successful)", field="outcome")
    names, x_all = outcome_features(frame, ctx, embed)
    x = x_all[keep]
    folds = grouped_folds(groups[keep], 5, seed=seed)
    prob = np.empty(keep.size)
    for idx in folds:
        train = np.setdiff1d(np.arange(keep.size), idx)
        if np.unique(y[train]).size < 2:
            prob[idx] = y[train].mean()
            continue
        mean, scale, model = _logistic(x[train], y[train], c)
        prob[idx] = model.predict_proba((x[idx] - mean) / scale)[:, 1]
    mean, scale, model = _logistic(x, y, c)
    heldout = auc(prob, y)
    params = {"embed": embed, "features": names, "mean": mean.round(8).tolist(),
              "scale": scale.round(8).tolist(), "coef": model.coef_[0].round(8).tolist(),
              "intercept": round(float(model.intercept_[0]), 8),
              "heldout_auc": round(heldout, 4), "trained_on": int(keep.size)}
    return OutcomeFit(params=params, heldout_auc=heldout, folds=len(folds), n_labelled=int(keep.size),
                      n_tasks=n_tasks)


@register
class LearnedOutcome(Component):
    """Learned outcome: the success probability a logistic model fitted on labelled episodes gives this episode (its coefficients live in the template)."""

    name = "learned_outcome"
    level = "episode"
    scope = "episode"
    uses_embeddings = True

    def __init__(self, *, embed: Literal["last_words", "none"] = "last_words",
                 features: list[str] | None = None, mean: list[float] | None = None,
                 scale: list[float] | None = None, coef: list[float] | None = None,
                 intercept: float = 0.0, heldout_auc: float | None = None, trained_on: int = 0,
                 low: float = 0.0, high: float = 1.0):
        _check(embed in ("last_words", "none"), "embed must be last_words or none")
        self.features: list[str] = list(features or [])
        self.mean, self.scale, self.coef = list(mean or []), list(scale or []), list(coef or [])
        _check(len(self.features) == len(self.mean) == len(self.scale) == len(self.coef),
               "features, mean, scale and coef must have one entry per feature "
               "(fit them with rwb reward learn)")
        _check(all(s > 0 for s in self.scale), "every scale must be > 0")
        _check(low <= high, "need low ≤ high")
        self.embed = embed
        self.intercept, self.heldout_auc, self.trained_on = float(intercept), heldout_auc, int(trained_on)
        self.low, self.high = float(low), float(high)

    def __call__(self, frame: StepsFrame, ctx: ScoringContext) -> np.ndarray:
        if not self.features:
            return np.full(frame.n_episodes, (self.low + self.high) / 2)   # unfitted: no opinion
        names, x = outcome_features(frame, ctx, self.embed)
        if names != self.features:
            raise InputError(f"learned_outcome was fitted on {len(self.features)} features, this data "
                             f"gives {len(names)}; refit it (rwb reward learn)", field="learned_outcome")
        z = ((x - np.array(self.mean)) / np.array(self.scale)) @ np.array(self.coef) + self.intercept
        p = 1.0 / (1.0 + np.exp(-np.clip(z, -50, 50)))
        return self.low + (self.high - self.low) * p


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
          c: float = 1.0, weight: float = 1.0, seed: int = 0):
    """Fit the learned outcome on a workspace dataset's labelled episodes: (the template with
    the fitted ``learned_outcome`` term, the fit).  Nothing is saved."""
    base = as_template(template, ws)
    frame = load_frame(ws, dataset)
    labels, groups = outcome_columns(ws.load_episodes(dataset), group_key)
    fit = fit_outcome_model(frame, labels, groups, ctx=ScoringContext(embedder=text_embedding.workspace_embedder(ws)),
                            embed=embed, c=c, seed=seed)
    return with_learned_outcome(base, fit.params, weight), fit
