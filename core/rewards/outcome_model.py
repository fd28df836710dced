"""The outcome model behind ``learned_outcome``: features, nested CV, baselines, learning curve.

* Features come in named blocks (:data:`BLOCKS`): tool-use statistics, the domain-free
  signals of :mod:`core.rewards.agent_signals`, counts relative to the task's median run,
  the task's own criteria (:mod:`core.rewards.criteria`, when present), and sentence
  embeddings of the request and of the last answer.
* :func:`nested_cv` chooses the hyper-parameters (C, feature set, objective) in inner folds
  only, scores the outer folds' held-out tasks and checks that no held-out task reaches an
  inner training fold (:class:`FoldLeak`).
* Two objectives: ``all_pairs`` (logistic regression on every labelled episode) and
  ``within_task`` (a conditional logistic regression on feature differences of a success
  and a failure of the same task, its scale then fitted to the outcomes).
* :func:`baseline_counts` and :func:`baseline_counts_embed` are the plain baselines the
  model must beat, on the same outer folds; :func:`learning_curve` is the held-out AUC
  against the number of labelled episodes.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace

import numpy as np

from core.base.errors import InputError
from core.rewards import criteria
from core.rewards.components import ScoringContext
from core.rewards.criteria import TASK_IDS_KEY
from core.rewards.frame import FINAL_ANSWER, REPLY, TOOL_CALL, StepsFrame
from core.rewards.agent_signals import AnswerConsistency, UnrecoveredErrors, WriteActions
from core.rewards.outcomes import (AucFigure, Fidelity, auc, bootstrap_ci, fidelity, grouped_folds,  # noqa: F401
                                   tasks_with_both, within_task_auc, within_task_parts)

#: Tool-use statistics per episode, in column order.
STAT_FEATURES: tuple[str, ...] = (
    "steps", "tool_calls", "tool_errors", "invalid_calls", "distinct_tools", "repeated_calls",
    "replies", "ends_with_answer", "error_share", "repeat_share")
#: Domain-free success signals (core.rewards.agent_signals) per episode.
SIGNAL_FEATURES: tuple[str, ...] = ("write_calls", "unrecovered_errors")
#: The last words' agreement with the tool results before them.
ANSWER_FEATURES: tuple[str, ...] = ("answer_cosine", "answer_has_evidence")
#: The eight counts of the plain baseline, and the ones compared with the task's median run.
COUNT_FEATURES: tuple[str, ...] = (
    "steps", "tool_calls", "tool_errors", "invalid_calls", "distinct_tools", "repeated_calls",
    "replies", "write_calls")
#: Feature blocks, in the column order of a model's features.
BLOCKS: tuple[str, ...] = ("stats", "signals", "answer", "task_norm", "criteria", "request_emb", "answer_emb")
#: Feature sets the inner cross-validation chooses from (criteria join each when present).
FEATURE_SETS: dict[str, tuple[str, ...]] = {
    "counts": ("stats", "signals"),
    "counts_task": ("stats", "signals", "task_norm"),
    "full": ("stats", "signals", "answer", "task_norm", "request_emb", "answer_emb"),
}
OBJECTIVES: tuple[str, ...] = ("all_pairs", "within_task")
#: Inverse L2 strengths the inner cross-validation chooses from.
C_GRID: tuple[float, ...] = (0.01, 0.1, 1.0)
#: Most (success, failure) pairs one task adds to the within-task objective.
MAX_PAIRS_PER_TASK = 64
#: What the inner cross-validation maximises (``anchored``, ``mixed``: see :func:`choose_configs`).
SELECTIONS: tuple[str, ...] = ("anchored", "mixed", "both", "all_pairs", "within_task")
#: Configs whose models are averaged (the best of the inner cross-validation).
TOP_CONFIGS = 3


@contextmanager
def _one_thread():
    """BLAS on one thread: the hundreds of small fits of a nested CV run several times slower
    when each one's tiny matrix products are split over threads."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1):
        yield


class FoldLeak(RuntimeError):
    """A held-out task reached a training fold: the held-out figure would be flattering."""


# --------------------------------------------------------------------------- features
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
    unique_calls: np.ndarray = np.zeros(frame.n_episodes)
    if ep.size:
        width = int(tool.max()) + 2
        distinct = np.bincount(np.unique(ep * width + tool + 1) // width, minlength=frame.n_episodes).astype(float)
        key_width = int(frame.call_key.max()) + 1
        keys = np.unique(ep * key_width + frame.call_key[call].astype(np.int64))
        unique_calls = np.bincount(keys // key_width, minlength=frame.n_episodes)
    repeats = calls - unique_calls
    replies = _per_episode(frame, np.isin(frame.kind, [REPLY, FINAL_ANSWER]))
    answered = np.zeros(frame.n_episodes)
    has = frame.ep_len > 0
    last = frame.ep_last[has]
    answered[has] = (np.isin(frame.kind[last], [REPLY, FINAL_ANSWER]) & (frame.output_len[last] > 0))
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


def frame_groups(frame: StepsFrame, group_key: str | None = None) -> np.ndarray:
    """The task of each episode as the frame tells it: the task ids a workspace load stamped on
    it (:func:`core.rewards.criteria.stamp_task_ids`, under ``group_key``), else ``group_key``
    (or ``task_id``) in the episode's meta, else its domain and request.  Used to compare an
    unlabelled episode with the other runs of its task when no task ids are given."""
    stamped: list | None = None
    stamp = frame._cache.get(TASK_IDS_KEY)
    if stamp is not None:
        stamped = stamp[1].get(group_key) or stamp[1].get(None)
    if stamped is not None and len(stamped) != frame.n_episodes:
        stamped = None                      # a subset of the stamped frame: its ids no longer line up
    out = []
    for i in range(frame.n_episodes):
        meta = frame.ep_meta[i] or {}
        found = stamped[i] if stamped is not None and stamped[i] is not None else meta.get(group_key or "task_id")
        out.append(f"{frame.domain[i] or ''}:{found}" if found is not None
                   else f"{frame.domain[i] or ''}|{frame.query[i]}")
    return np.array(out, dtype=object)


def task_relative(values: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """``log1p(values)`` minus its median over the rows of the same task (per column): how
    a run differs from its task's typical run.  A task with one run gives 0 (no contrast)."""
    logs = np.log1p(np.maximum(np.asarray(values, dtype=np.float64), 0.0))
    _, code = np.unique(np.asarray(groups).astype(str), return_inverse=True)
    out = np.zeros_like(logs)
    for g in np.unique(code):
        rows = np.flatnonzero(code == g)
        out[rows] = logs[rows] - np.median(logs[rows], axis=0)
    return out


def _encode_distinct(ctx: ScoringContext, texts: list[str], what: str) -> np.ndarray:
    uniq, inverse = np.unique(np.array(texts, dtype=object).astype(str), return_inverse=True)
    vectors = ctx.encode([str(t) for t in uniq], what=what).astype(np.float64)
    return vectors[inverse]


def criteria_block(frame: StepsFrame, ctx: ScoringContext, *, keep_empty: bool = False
                   ) -> tuple[list[str], np.ndarray] | None:
    """The task criteria features (:func:`core.rewards.criteria.criteria_features`) when (unless
    ``keep_empty``) some episode has criteria; None otherwise."""
    names, matrix = criteria.criteria_features(frame, ctx)
    names, matrix = list(names), np.asarray(matrix, dtype=np.float64)
    if not keep_empty and "has_criteria" in names and not matrix[:, names.index("has_criteria")].any():
        return None
    return [f"criteria_{n}" for n in names], matrix


def feature_blocks(frame: StepsFrame, ctx: ScoringContext, groups: np.ndarray,
                   blocks: Sequence[str] = BLOCKS, *, scoring: bool = False
                   ) -> dict[str, tuple[list[str], np.ndarray]]:
    """``{block: (names, [n_episodes, k])}`` for the requested blocks (see :data:`BLOCKS`);
    ``task_norm`` compares each run with the other runs of its task in ``frame`` (``groups``).
    When fitting, ``criteria`` is left out if no episode has criteria; when ``scoring`` with a
    model that uses them, episodes without criteria get them as ``has_criteria`` = 0 says."""
    out: dict[str, tuple[list[str], np.ndarray]] = {}
    stats, signals = episode_stats(frame), signal_features(frame)      # cheap: a few bincounts
    if "stats" in blocks:
        out["stats"] = (list(STAT_FEATURES), stats)
    if "signals" in blocks:
        out["signals"] = (list(SIGNAL_FEATURES), signals)
    if "answer" in blocks:
        cosine, has = AnswerConsistency().cosines(frame, ctx)
        out["answer"] = (list(ANSWER_FEATURES), np.column_stack([cosine, has.astype(np.float64)]))
    if "task_norm" in blocks:
        named = dict(zip(STAT_FEATURES, stats.T)) | dict(zip(SIGNAL_FEATURES, signals.T))
        counts = np.column_stack([named[n] for n in COUNT_FEATURES])
        out["task_norm"] = ([f"task_rel_{n}" for n in COUNT_FEATURES], task_relative(counts, groups))
    if "criteria" in blocks:
        found = criteria_block(frame, ctx, keep_empty=scoring)
        if found is not None:
            out["criteria"] = found
    if "request_emb" in blocks:
        v = _encode_distinct(ctx, [str(q or "") for q in frame.query], "learned_outcome")
        out["request_emb"] = ([f"request_{i}" for i in range(v.shape[1])], v)
    if "answer_emb" in blocks:
        v = _encode_distinct(ctx, last_words(frame), "learned_outcome")
        out["answer_emb"] = ([f"answer_{i}" for i in range(v.shape[1])], v)
    return out


@dataclass(frozen=True)
class FeatureTable:
    """Every feature block of a dataset as one matrix, with the columns of each block."""

    #: Column names, block after block
    names: list[str]
    #: [n_episodes, n_features]
    matrix: np.ndarray
    #: Block → its column indices
    columns: dict[str, np.ndarray]

    def select(self, blocks: Sequence[str]) -> np.ndarray:
        """Column indices of ``blocks`` (those present), in block order."""
        parts = [self.columns[b] for b in BLOCKS if b in blocks and b in self.columns]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def feature_table(frame: StepsFrame, ctx: ScoringContext, groups: np.ndarray,
                  blocks: Sequence[str] = BLOCKS, *, scoring: bool = False) -> FeatureTable:
    """:func:`feature_blocks` as one :class:`FeatureTable`."""
    found = feature_blocks(frame, ctx, groups, blocks, scoring=scoring)
    names: list[str] = []
    parts, columns = [], {}
    for b in BLOCKS:
        if b in found:
            n, m = found[b]
            columns[b] = np.arange(len(names), len(names) + len(n))
            names += n
            parts.append(m)
    matrix = np.hstack(parts) if parts else np.zeros((frame.n_episodes, 0))
    return FeatureTable(names, matrix, columns)


def set_columns(table: FeatureTable) -> dict[str, np.ndarray]:
    """Feature set name → its column indices in ``table`` (criteria join every set)."""
    return {name: table.select(blocks + ("criteria",)) for name, blocks in FEATURE_SETS.items()}


# --------------------------------------------------------------------------- linear models
@dataclass(frozen=True)
class Config:
    """One hyper-parameter choice of the outcome model."""

    #: Name of the feature set (:data:`FEATURE_SETS`)
    features: str
    #: ``all_pairs`` or ``within_task``
    objective: str
    #: Inverse L2 regularisation strength
    C: float


#: The model the learning curve fits when not given one: a level across tasks and a ranking within them.
CURVE_CONFIGS: tuple[Config, ...] = (Config("full", "all_pairs", 0.1), Config("counts_task", "within_task", 0.1))


#: The config ``select="anchored"`` always keeps: every feature, all pairs, mild regularisation.
ANCHOR = Config("full", "all_pairs", 1.0)


def config_grid(features: Sequence[str] = tuple(FEATURE_SETS), objectives: Sequence[str] = OBJECTIVES,
                cs: Sequence[float] = C_GRID) -> list[Config]:
    """Every combination of feature set, objective and C."""
    return [Config(f, o, float(c)) for f, o, c in itertools.product(features, objectives, cs)]


@dataclass(frozen=True)
class LinearModel:
    """A fitted logistic model on standardised features: p = σ(((x − mean) / scale) · coef + b)."""

    #: Per-feature centre
    mean: np.ndarray
    #: Per-feature scale (> 0)
    scale: np.ndarray
    #: Coefficients on the standardised features
    coef: np.ndarray
    #: Intercept
    intercept: float

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Success probability of each row of ``x``."""
        z = ((x - self.mean) / self.scale) @ self.coef + self.intercept
        return 1.0 / (1.0 + np.exp(-np.clip(z, -50, 50)))


def _standardise(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    mean, scale = x.mean(axis=0), x.std(axis=0)
    return mean, np.where(scale > 1e-6, scale, 1.0)      # a constant column (to rounding) stays as it is


def _pairs(y: np.ndarray, groups: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(success row, failure row) of every pair of the same task (at most
    :data:`MAX_PAIRS_PER_TASK` per task, drawn with ``rng``)."""
    _, code = np.unique(np.asarray(groups).astype(str), return_inverse=True)
    pos_rows, neg_rows = [], []
    for g in np.unique(code):
        rows = np.flatnonzero(code == g)
        p, n = rows[y[rows] == 1], rows[y[rows] == 0]
        if p.size and n.size:
            a, b = np.repeat(p, n.size), np.tile(n, p.size)
            if a.size > MAX_PAIRS_PER_TASK:
                keep = rng.choice(a.size, MAX_PAIRS_PER_TASK, replace=False)
                a, b = a[keep], b[keep]
            pos_rows.append(a)
            neg_rows.append(b)
    if not pos_rows:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    return np.concatenate(pos_rows), np.concatenate(neg_rows)


def fit_linear(x: np.ndarray, y: np.ndarray, groups: np.ndarray, objective: str, c: float,
               seed: int = 0) -> LinearModel | None:
    """Fit one logistic model; None when the data cannot support it (one outcome only, or no
    task with both outcomes for ``within_task``)."""
    from sklearn.linear_model import LogisticRegression

    if np.unique(y).size < 2:
        return None
    mean, scale = _standardise(x)
    z = (x - mean) / scale
    if objective == "all_pairs":
        model = LogisticRegression(C=c, max_iter=2000).fit(z, y)
        return LinearModel(mean, scale, model.coef_[0].copy(), float(model.intercept_[0]))
    if objective != "within_task":
        raise InputError(f"objective must be one of {', '.join(OBJECTIVES)}; got {objective!r}", field="objective")
    pos, neg = _pairs(y, groups, np.random.default_rng(seed))
    if pos.size < 2:
        return None
    diff = z[pos] - z[neg]
    d = np.vstack([diff, -diff])
    t = np.concatenate([np.ones(len(diff), dtype=int), np.zeros(len(diff), dtype=int)])
    w = LogisticRegression(C=c, max_iter=2000, fit_intercept=False).fit(d, t).coef_[0]
    # the pairwise fit ranks runs of one task; a 1-D logistic of its score turns it into probabilities
    s = (z @ w)[:, None]
    scaler = LogisticRegression(C=1e4, max_iter=2000).fit(s, y)
    slope = max(float(scaler.coef_[0, 0]), 1e-3)
    return LinearModel(mean, scale, w * slope, float(scaler.intercept_[0]))


def _fit_predict(x: np.ndarray, y: np.ndarray, groups: np.ndarray, train: np.ndarray, test: np.ndarray,
                 objective: str, c: float, seed: int) -> np.ndarray:
    model = fit_linear(x[train], y[train], groups[train], objective, c, seed)
    if model is None:
        return np.full(test.size, y[train].mean() if train.size else 0.5)
    return model.predict(x[test])


# --------------------------------------------------------------------------- cross-validation
def _group_set(groups: np.ndarray, rows: np.ndarray) -> set[str]:
    return set(np.asarray(groups)[rows].astype(str).tolist())


def check_no_leak(groups: np.ndarray, train: np.ndarray, heldout: np.ndarray, what: str) -> None:
    """Raise :class:`FoldLeak` when a task of ``heldout`` has rows in ``train``."""
    shared = _group_set(groups, train) & _group_set(groups, heldout)
    if shared:
        raise FoldLeak(f"{what}: {len(shared)} held-out task(s) also in the training rows, "
                       f"e.g. {sorted(shared)[0]!r}")


def _outer_splits(groups: np.ndarray, n_folds: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    folds = grouped_folds(groups, n_folds, seed=seed)
    every = np.concatenate(folds) if folds else np.zeros(0, dtype=np.int64)
    if every.size != groups.size or np.unique(every).size != groups.size:
        raise FoldLeak("outer folds must hold every labelled episode exactly once")
    out = []
    for i, held in enumerate(folds):
        train = np.setdiff1d(np.arange(groups.size), held)
        check_no_leak(groups, train, held, f"outer fold {i}")
        out.append((train, held))
    return out


def _cv_predictions(x: np.ndarray, y: np.ndarray, groups: np.ndarray, rows: np.ndarray,
                    configs: Sequence[Config], columns: dict[str, np.ndarray], n_folds: int, seed: int,
                    forbidden: np.ndarray | None = None) -> list[np.ndarray]:
    """Out-of-fold predictions over ``rows`` of each config, folds grouped by task; with
    ``forbidden`` (an outer fold's held-out rows) every training fold is checked against it."""
    sub_groups = groups[rows]
    folds = grouped_folds(sub_groups, n_folds, seed=seed)
    preds = [np.full(rows.size, np.nan) for _ in configs]
    for i, held in enumerate(folds):
        train = np.setdiff1d(np.arange(rows.size), held)
        check_no_leak(sub_groups, train, held, f"inner fold {i}")
        if forbidden is not None:
            check_no_leak(groups, rows[train], forbidden, f"inner fold {i} against its outer fold")
        for k, cfg in enumerate(configs):
            cols = columns[cfg.features]
            preds[k][held] = _fit_predict(x[rows][:, cols], y[rows], sub_groups, train, held,
                                          cfg.objective, cfg.C, seed)
    return preds


def selection_score(pred: np.ndarray, y: np.ndarray, groups: np.ndarray, select: str) -> float:
    """What the inner folds maximise: ``within_task`` AUC, ``all_pairs`` AUC, or their mean
    (``both``); a figure with no pairs (NaN) is left out of the mean."""
    if select not in SELECTIONS:
        raise InputError(f"select must be one of {', '.join(SELECTIONS)}; got {select!r}", field="select")
    if np.isnan(pred).any():
        return float("nan")
    a, w = auc(pred, y), within_task_auc(pred, y, groups)
    if select == "all_pairs":
        return a
    if select == "within_task":
        return w if not np.isnan(w) else a
    vals = [v for v in (a, w) if not np.isnan(v)]
    return float(np.mean(vals)) if vals else float("nan")


def choose_configs(x: np.ndarray, y: np.ndarray, groups: np.ndarray, rows: np.ndarray,
                   configs: Sequence[Config], columns: dict[str, np.ndarray], *, n_folds: int = 4,
                   seed: int = 0, select: str = "anchored", top: int = TOP_CONFIGS,
                   forbidden: np.ndarray | None = None) -> list[Config]:
    """The configs whose grouped cross-validated predictions over ``rows`` score best: with
    ``select="mixed"`` the best by all-pairs AUC, by within-task AUC and by their mean (a level
    across tasks and a ranking within them), ``"anchored"`` those and :data:`ANCHOR` (steadier
    with few tasks), else the ``top`` best by ``select``.  Their
    averaged logits are the model (:func:`fit_ensemble`), steadier than one config when the
    inner folds hold few tasks."""
    if np.unique(groups[rows].astype(str)).size < 2 or np.unique(y[rows]).size < 2:
        return [configs[0]]
    with _one_thread():
        preds = _cv_predictions(x, y, groups, rows, configs, columns, n_folds, seed, forbidden)
    if select in ("mixed", "anchored"):   # the best for each figure: a level across tasks, a ranking within them
        picked = [choose_from(preds, y[rows], groups[rows], configs, s, 1)[0]
                  for s in ("all_pairs", "within_task", "both")]
        if select == "anchored" and ANCHOR in configs:
            picked.insert(0, ANCHOR)
        return list(dict.fromkeys(picked))
    return choose_from(preds, y[rows], groups[rows], configs, select, top)


def choose_from(preds: Sequence[np.ndarray], y: np.ndarray, groups: np.ndarray, configs: Sequence[Config],
                select: str, top: int) -> list[Config]:
    """The ``top`` configs whose predictions score best by ``select`` (best first)."""
    scores = np.array([selection_score(p, y, groups, select) for p in preds])
    scores = np.where(np.isfinite(scores), scores, -np.inf)
    order = np.argsort(-scores, kind="stable")
    return [configs[int(i)] for i in order[:max(1, int(top))] if np.isfinite(scores[i])] or [configs[0]]


def fit_ensemble(x: np.ndarray, y: np.ndarray, groups: np.ndarray, configs: Sequence[Config],
                 columns: dict[str, np.ndarray], seed: int = 0) -> tuple[np.ndarray, LinearModel | None]:
    """(columns used, one linear model over them): the mean logit of one model per config,
    each fitted on its feature set's columns (zero weight on the others)."""
    used = np.unique(np.concatenate([columns[c.features] for c in configs]))
    mean, scale = _standardise(x[:, used]) if y.size else (np.zeros(used.size), np.ones(used.size))
    coef, intercept, n = np.zeros(used.size), 0.0, 0
    for cfg in configs:
        pos = np.searchsorted(used, columns[cfg.features])
        with _one_thread():
            model = fit_linear(x[:, used[pos]], y, groups, cfg.objective, cfg.C, seed)
        if model is None:
            continue
        coef[pos] += model.coef / model.scale * scale[pos]     # same column, same standardisation
        intercept += model.intercept + float(np.sum(model.coef * (mean[pos] - model.mean) / model.scale))
        n += 1
    if n == 0:
        return used, None
    return used, LinearModel(mean, scale, coef / n, intercept / n)


def _ensemble_predict(x: np.ndarray, y: np.ndarray, groups: np.ndarray, train: np.ndarray, test: np.ndarray,
                      configs: Sequence[Config], columns: dict[str, np.ndarray], seed: int) -> np.ndarray:
    used, model = fit_ensemble(x[train], y[train], groups[train], configs, columns, seed)
    if model is None:
        return np.full(test.size, y[train].mean() if train.size else 0.5)
    return model.predict(x[test][:, used])


@dataclass(frozen=True)
class NestedCV:
    """Held-out predictions of a nested cross-validation, grouped by task."""

    #: Out-of-fold success probability per labelled episode (its outer fold's model)
    predictions: np.ndarray
    #: The configs each outer fold's inner folds chose (best first)
    chosen: list[list[Config]]
    #: Outer folds' (training rows, held-out rows)
    splits: list[tuple[np.ndarray, np.ndarray]]


def nested_cv(table: FeatureTable, y: np.ndarray, groups: np.ndarray, *, configs: Sequence[Config] | None = None,
              outer_folds: int = 5, inner_folds: int = 4, seed: int = 0, select: str = "anchored",
              top_configs: int = 3) -> NestedCV:
    """Nested cross-validation over the rows of ``table`` (all labelled, ``y`` 0/1): each outer
    fold's held-out tasks are predicted by a model whose config was chosen on the other tasks'
    inner folds only.  Raises :class:`FoldLeak` if a held-out task reaches a training fold."""
    with _one_thread():
        return _nested_cv(table, y, groups, list(configs or config_grid()), outer_folds, inner_folds, seed,
                          select, top_configs)


def _nested_cv(table: FeatureTable, y: np.ndarray, groups: np.ndarray, configs: list[Config], outer_folds: int,
               inner_folds: int, seed: int, select: str, top_configs: int) -> NestedCV:
    columns = set_columns(table)
    x = table.matrix
    splits = _outer_splits(groups, outer_folds, seed)
    pred = np.full(y.size, np.nan)
    chosen = []
    for train, held in splits:
        top = choose_configs(x, y, groups, train, configs, columns, n_folds=inner_folds, seed=seed + 1,
                             select=select, top=top_configs, forbidden=held)
        chosen.append(top)
        pred[held] = _ensemble_predict(x, y, groups, train, held, top, columns, seed)
    return NestedCV(pred, chosen, splits)


# --------------------------------------------------------------------------- baselines
def _fixed_predictions(x: np.ndarray, y: np.ndarray, groups: np.ndarray,
                       splits: Sequence[tuple[np.ndarray, np.ndarray]], c: float = 1.0) -> np.ndarray:
    pred = np.full(y.size, np.nan)
    for train, held in splits:
        check_no_leak(groups, train, held, "baseline fold")
        pred[held] = _fit_predict(x, y, groups, train, held, "all_pairs", c, 0)
    return pred


def baseline_counts(table: FeatureTable, y: np.ndarray, groups: np.ndarray,
                    splits: Sequence[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """Held-out predictions of a plain logistic regression (C=1) on the eight counts of
    :data:`COUNT_FEATURES`, on the given outer folds."""
    cols = [table.names.index(n) for n in COUNT_FEATURES]
    return _fixed_predictions(table.matrix[:, cols], y, groups, splits)


def baseline_counts_embed(table: FeatureTable, y: np.ndarray, groups: np.ndarray,
                          splits: Sequence[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """Held-out predictions of the same plus the task-relative counts and the request and last
    answer embeddings, on the given outer folds."""
    cols = [table.names.index(n) for n in COUNT_FEATURES]
    extra = [table.columns[b] for b in ("task_norm", "request_emb", "answer_emb") if b in table.columns]
    return _fixed_predictions(table.matrix[:, np.concatenate([np.array(cols), *extra])], y, groups, splits)


# --------------------------------------------------------------------------- learning curve
@dataclass(frozen=True)
class CurvePoint:
    """Held-out AUC with a given number of labelled episodes (mean over seeds)."""

    #: Labelled episodes the model was fitted on (per outer fold)
    labelled: int
    #: Mean all-pairs AUC on held-out tasks over the seeds
    all_pairs: float
    #: Mean within-task AUC on held-out tasks over the seeds (NaN: no task with both outcomes)
    within_task: float
    #: Lowest and highest all-pairs AUC over the seeds
    all_pairs_range: tuple[float, float]
    #: Lowest and highest within-task AUC over the seeds
    within_task_range: tuple[float, float]
    #: Seeds measured
    seeds: int


@dataclass(frozen=True)
class LearningCurve:
    """Held-out AUC against the number of labelled episodes, labels drawn by task."""

    #: One point per size that the data allows, smallest first
    points: list[CurvePoint]
    #: Sizes asked for that exceed the labelled episodes a training fold holds
    skipped: list[int]
    #: The configs whose averaged model is fitted at every size
    configs: list[Config]
    #: Outer folds (held-out tasks) per seed
    folds: int
    #: Most labelled runs drawn per task (None: every run of a drawn task)
    per_task: int | None = None


def _draw_by_task(train: np.ndarray, groups: np.ndarray, n: int, rng: np.random.Generator,
                  per_task: int | None = None) -> np.ndarray:
    """``n`` rows of ``train``, task by task in a random order (the last one cut): every run
    of a task, or with ``per_task`` at most that many of its runs (labels spread over tasks)."""
    _, code = np.unique(groups[train].astype(str), return_inverse=True)
    picked: list[np.ndarray] = []
    total = 0
    for g in rng.permutation(code.max() + 1):
        rows = train[code == g]
        if per_task is not None:
            rows = rng.permutation(rows)[:max(1, int(per_task))]
        picked.append(rows)
        total += rows.size
        if total >= n:
            break
    return np.concatenate(picked)[:n]


def _poolsize(train: np.ndarray, groups: np.ndarray, per_task: int | None) -> int:
    """Rows :func:`_draw_by_task` can draw from ``train``."""
    if per_task is None:
        return int(train.size)
    _, counts = np.unique(groups[train].astype(str), return_counts=True)
    return int(np.minimum(counts, max(1, int(per_task))).sum())


def _as_configs(config: Config | Sequence[Config]) -> list[Config]:
    return [config] if isinstance(config, Config) else list(config)


def learning_curve_table(table: FeatureTable, y: np.ndarray, groups: np.ndarray, *,
                         sizes: Sequence[int] = (10, 20, 40, 80, 160), seeds: int = 3, folds: int = 5,
                         config: Config | Sequence[Config] = CURVE_CONFIGS,
                         per_task: int | None = None) -> LearningCurve:
    """:func:`learning_curve` on a built feature table (``y`` 0/1, every row labelled)."""
    configs = _as_configs(config)
    columns = set_columns(table)
    points, skipped = [], []
    with _one_thread():
        for n in sorted(int(s) for s in sizes):
            a_vals, w_vals = [], []
            for seed in range(seeds):
                splits = _outer_splits(groups, folds, seed)
                if min(_poolsize(tr, groups, per_task) for tr, _ in splits) < n:
                    break
                rng = np.random.default_rng(1000 + seed)
                pred = np.full(y.size, np.nan)
                for train, held in splits:
                    rows = _draw_by_task(train, groups, n, rng, per_task)
                    check_no_leak(groups, rows, held, "learning curve")
                    pred[held] = _ensemble_predict(table.matrix, y, groups, rows, held, configs, columns, seed)
                a_vals.append(auc(pred, y))
                w_vals.append(within_task_auc(pred, y, groups))
            if not a_vals:
                skipped.append(n)
                continue
            a = np.array(a_vals, dtype=float)
            w = np.array(w_vals, dtype=float)
            a, w = a[~np.isnan(a)], w[~np.isnan(w)]
            nan2 = (float("nan"), float("nan"))
            points.append(CurvePoint(
                n, float(a.mean()) if a.size else float("nan"), float(w.mean()) if w.size else float("nan"),
                (float(a.min()), float(a.max())) if a.size else nan2,
                (float(w.min()), float(w.max())) if w.size else nan2, len(a_vals)))
    return LearningCurve(points, skipped, configs, folds, per_task)


#: Most runs of one task the learning curve labels: as a labelling queue spreads its labels over
#: tasks (at least two, so that a task can give a within-task pair), not every run of a few tasks.
CURVE_RUNS_PER_TASK = 4


def learning_curve(frame: StepsFrame, labels: np.ndarray, groups: np.ndarray, ctx: ScoringContext | None = None,
                   sizes: Sequence[int] = (10, 20, 40, 80, 160), *, seeds: int = 3, folds: int = 5,
                   config: Config | Sequence[Config] = CURVE_CONFIGS,
                   per_task: int | None = CURVE_RUNS_PER_TASK) -> LearningCurve:
    """Held-out AUC (all pairs and within task) against the number of labelled episodes: per
    seed, the tasks are split into ``folds`` grouped folds; each fold's model (the configs'
    averaged logits; pass a fit's ``configs`` to follow it) is fitted on ``n`` labelled
    episodes drawn task by task from the other folds (all runs of each task, or at most
    ``per_task``, as a labelling queue spreads labels) and scores the fold's held-out tasks.
    ``labels`` NaN are unlabelled (their runs still count for the task-relative counts)."""
    ctx = ctx or ScoringContext()
    configs = _as_configs(config)
    labels = np.asarray(labels, dtype=np.float64)
    groups = np.asarray(groups).astype(str)
    keep = np.flatnonzero(~np.isnan(labels))
    if keep.size < 2 or np.unique(groups[keep]).size < 2:
        raise InputError(f"a learning curve needs labelled episodes of at least 2 tasks; this data has "
                         f"{keep.size} labelled over {np.unique(groups[keep]).size} tasks", field="outcome")
    blocks = tuple(dict.fromkeys(b for c in configs for b in FEATURE_SETS[c.features])) + ("criteria",)
    table = feature_table(frame, ctx, groups, blocks)
    sub = FeatureTable(table.names, table.matrix[keep], table.columns)
    return learning_curve_table(sub, (labels[keep] > 0.5).astype(int), groups[keep], sizes=sizes,
                                seeds=seeds, folds=folds, config=configs, per_task=per_task)


# --------------------------------------------------------------------------- held-out report
#: How much wider than the bootstrap over this set's tasks (and folds) an interval must be to
#: cover the figure on as many *new* tasks: √2 because that figure varies as much as this one,
#: the rest because the cross-validated models saw fewer tasks than the final one (a pessimistic
#: bias).  Measured on half-splits of the tau2_grok and agentdojo runs (fit on half the tasks,
#: score the other half, 4 splits each, both figures): √2 covered 11 of 16, 2 covers 15.
NEW_TASKS_WIDEN = 2.0


def for_new_tasks(fig: Fidelity, widen: float = NEW_TASKS_WIDEN) -> Fidelity:
    """``fig`` with each interval widened about its value by ``widen``: where the figure on as
    many new tasks falls (a prediction interval), not where this set's figure would be."""
    def one(f):
        lo, hi = f.ci90
        if np.isnan(f.value) or np.isnan(lo) or np.isnan(hi):
            return f
        return replace(f, ci90=(max(0.0, f.value - widen * (f.value - lo)), min(1.0, f.value + widen * (hi - f.value))))
    return Fidelity(one(fig.all_pairs), one(fig.within_task))


@dataclass(frozen=True)
class HeldOut:
    """The learned model and both plain baselines on the same held-out tasks; each interval is
    where the figure on as many new tasks falls (the bootstrap over tasks widened by
    :data:`NEW_TASKS_WIDEN`)."""

    #: The learned model (nested cross-validation)
    learned: Fidelity
    #: Logistic regression on the eight counts
    baseline_counts: Fidelity
    #: The same plus task-relative counts and request / last-answer embeddings
    baseline_counts_embed: Fidelity
    #: The learned model with the interval for this set's own figure (tasks and folds resampled)
    learned_this_set: Fidelity
    #: Labelled tasks that have both a success and a failure
    tasks_with_both: int
    #: Outer folds
    folds: int
    #: The configs each outer fold of each repeat chose
    chosen: list[list[Config]]


def repeated_fidelity(predictions: Sequence[np.ndarray], y: np.ndarray, groups: np.ndarray, *,
                      n_boot: int = 500, seed: int = 0) -> Fidelity:
    """Fidelity of the mean of several held-out predictions (one per repeat of the cross-
    validation, each with other folds), the interval from a bootstrap that resamples the tasks
    *and* draws one repeat per resample: it spreads with the choice of folds as well as of tasks."""
    preds = np.vstack(predictions)
    mean = preds.mean(axis=0)
    point = fidelity(mean, y, groups, n_boot=2, seed=seed)
    rng = np.random.default_rng(seed + 7)
    lo, hi = bootstrap_ci(lambda r: auc(preds[rng.integers(preds.shape[0])][r], y[r]), groups,
                          n_boot=n_boot, seed=seed)
    parts = [within_task_parts(p, y, groups) for p in preds]
    pairs = parts[0][1]
    both = np.flatnonzero(pairs > 0)
    w_ci = (float("nan"), float("nan"))
    if both.size >= 2:
        u = np.vstack([p[0] for p in parts])
        pick = both[rng.integers(0, both.size, size=(int(n_boot), both.size))]
        which = rng.integers(0, u.shape[0], size=int(n_boot))
        draws = u[which[:, None], pick].sum(axis=1) / pairs[pick].sum(axis=1)
        w_lo, w_hi = np.quantile(draws, [0.05, 0.95])
        w_ci = (float(w_lo), float(w_hi))
    return Fidelity(replace(point.all_pairs, ci90=(lo, hi)), replace(point.within_task, ci90=w_ci))


def heldout_report(table: FeatureTable, y: np.ndarray, groups: np.ndarray, *, configs: Sequence[Config] | None = None,
                   outer_folds: int = 5, inner_folds: int = 4, seed: int = 0, select: str = "anchored",
                   top_configs: int = TOP_CONFIGS, repeats: int = 3, n_boot: int = 500,
                   progress: Callable[[str], None] | None = None) -> tuple[HeldOut, NestedCV]:
    """Nested cross-validation of the learned model and both baselines on the same outer folds,
    ``repeats`` times with other folds (see :func:`repeated_fidelity`); the returned
    :class:`NestedCV` holds the mean held-out predictions, and the first repeat's folds."""
    runs, base1, base2 = [], [], []
    for r in range(max(1, int(repeats))):
        cv = nested_cv(table, y, groups, configs=configs, outer_folds=outer_folds, inner_folds=inner_folds,
                       seed=seed + 101 * r, select=select, top_configs=top_configs)
        with _one_thread():
            base1.append(baseline_counts(table, y, groups, cv.splits))
            base2.append(baseline_counts_embed(table, y, groups, cv.splits))
        runs.append(cv)
        if progress:
            progress(f"nested cross-validation {r + 1} of {repeats} done")
    fig = [repeated_fidelity(p, y, groups, n_boot=n_boot, seed=seed) for p in
           ([cv.predictions for cv in runs], base1, base2)]
    return HeldOut(for_new_tasks(fig[0]), for_new_tasks(fig[1]), for_new_tasks(fig[2]), fig[0],
                   tasks_with_both(y, groups), len(runs[0].splits), [c for cv in runs for c in cv.chosen]), \
        NestedCV(np.mean([cv.predictions for cv in runs], axis=0), runs[0].chosen, runs[0].splits)
