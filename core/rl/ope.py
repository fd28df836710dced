"""Off-policy estimate of a trained policy on held-out logged episodes (``rwb evaluate``'s ``ope``).

From the logs alone, with no simulator in the loop: each logged episode is re-weighted by
how much more (or less) likely the policy was than the logger to take the logged actions.
:func:`pdwis` is the weighted importance-sampling estimator over flat per-step arrays,
:func:`behaviour_propensities` the logger's cross-fitted behaviour model,
:func:`off_policy_estimate` the ``ope`` report with its interval, support and verdict, and
:func:`off_policy_report` the same from a run's simulator tables and agent.

Details: docs/learning.md (## The off-policy estimate, ## Off-policy estimate: the pieces).
"""

from __future__ import annotations

import collections
import hashlib
import math
import threading
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import numpy as np

from core.base.errors import InputError
from core.rewards.outcomes import bootstrap_ci, grouped_folds

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from core.rl.sim import SimTables

#: Least behaviour propensity: ``μ`` is clipped to it, so one step's ratio is at most 1/floor.
PROPENSITY_FLOOR = 1e-3
#: Least effective sample size (Kish, of the episodes' final weights) of a reliable estimate.
MIN_ESS = 20.0
#: Least share of the policy's probability mass on actions with logged support.
MIN_SUPPORT = 0.8
METHOD = ("weighted importance sampling (success: whole-trajectory weights; return: per-decision), "
          "behaviour propensities by behaviour cloning")


# =========================================================================== the estimator
@dataclass(frozen=True)
class PDWISTerms:
    """Per-decision importance weights of E episodes over T steps (T: the longest episode).

    ``weights[i, t]`` is episode i's cumulative ratio ``Π_{k≤t} π/μ``, carried unchanged
    past its last step (a finished episode stays in an absorbing state where both policies
    agree), each column scaled by its largest entry (the estimate is self-normalised per
    step, so a column's scale cancels, and the scaling keeps long products finite);
    ``weighted[i, t]`` is ``weights[i, t] · γ^t · r[i, t]`` (0 past the last step).
    ``episodes`` are the episode labels of the rows (sorted), ``length`` their lengths."""

    weights: np.ndarray
    weighted: np.ndarray
    episodes: np.ndarray
    length: np.ndarray

    def estimate(self, multiplicity: np.ndarray | None = None) -> float | np.ndarray:
        """``Σ_t Σ_i m_i·w_it·γ^t·r_it / Σ_i m_i·w_it`` for episode multiplicities ``m``
        ([E], or [B, E] for B resamples at once; all ones when None).  NaN where at some
        step no episode keeps any weight (the policy leaves every logged path)."""
        m = np.ones(self.weights.shape[0]) if multiplicity is None else np.asarray(multiplicity, dtype=np.float64)
        den = m @ self.weights
        num = m @ self.weighted
        with np.errstate(invalid="ignore", divide="ignore"):
            per_step = np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)
        value = per_step.sum(axis=-1)
        return float(value) if np.ndim(value) == 0 else value

    @property
    def value(self) -> float:
        return float(self.estimate())

    def trajectory_estimate(self, values: np.ndarray, multiplicity: np.ndarray | None = None) -> float | np.ndarray:
        """Whole-trajectory weighted IS of one value per episode (e.g. its 0/1 outcome):
        ``Σ_i m_i·W_i·v_i / Σ_i m_i·W_i`` with ``W_i`` the final weight — a weighted mean of
        the logged values, so it stays within their range (per-decision normalisation does
        not, for an outcome that falls on the last step of episodes of different lengths).
        NaN where no episode keeps any weight; ``m`` as in :meth:`estimate`."""
        m = np.ones(self.weights.shape[0]) if multiplicity is None else np.asarray(multiplicity, dtype=np.float64)
        w = self.final_weights
        den = m @ w
        num = m @ (w * np.asarray(values, dtype=np.float64))
        with np.errstate(invalid="ignore", divide="ignore"):
            value = np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)
        return float(value) if np.ndim(value) == 0 else value

    @property
    def final_weights(self) -> np.ndarray:
        """[E] every episode's whole-trajectory weight (in the last column's scale)."""
        return self.weights[:, -1]


def effective_sample_size(weights: np.ndarray) -> float:
    """Kish's effective sample size ``(Σw)² / Σw²`` (0 when every weight is 0)."""
    w = np.asarray(weights, dtype=np.float64)
    sq = float((w * w).sum())
    return float(w.sum() ** 2 / sq) if sq > 0 else 0.0


def pdwis(pi_prob: np.ndarray, mu_prob: np.ndarray, rewards: np.ndarray, episode_index: np.ndarray,
          step_index: np.ndarray, gamma: float = 1.0, *, floor: float = PROPENSITY_FLOOR) -> PDWISTerms:
    """Per-decision weighted importance sampling terms of flat per-step arrays.

    ``pi_prob``/``mu_prob``: target and behaviour probability of the logged action at each
    step; ``mu`` is clipped below at ``floor``.  ``rewards``: per step, discounted here with
    ``γ^step`` (a terminal outcome is a reward on the last step with ``gamma=1``).
    ``episode_index``: any integer label per step; ``step_index``: 0 … L−1 within each
    episode, every step exactly once (order free).

    The estimate (:meth:`PDWISTerms.estimate`) self-normalises at each step t over all
    episodes, those already finished keeping their final weight: with ``π = μ`` it is the
    plain mean of the episodes' discounted returns, and it is consistent for episodes of
    different lengths.  (Normalising over the episodes still running at t instead would
    weight the late steps of long episodes as if every episode were long.)"""
    pi = np.asarray(pi_prob, dtype=np.float64).reshape(-1)
    mu = np.asarray(mu_prob, dtype=np.float64).reshape(-1)
    r = np.asarray(rewards, dtype=np.float64).reshape(-1)
    ep = np.asarray(episode_index).reshape(-1)
    t = np.asarray(step_index).reshape(-1)
    n = pi.shape[0]
    if not (mu.shape[0] == r.shape[0] == ep.shape[0] == t.shape[0] == n):
        raise InputError("pi_prob, mu_prob, rewards, episode_index and step_index need one entry per step "
                         f"(got {n}, {mu.shape[0]}, {r.shape[0]}, {ep.shape[0]}, {t.shape[0]})")
    if n == 0:
        raise InputError("no logged steps to estimate from")
    if not (np.isfinite(pi).all() and (pi >= 0).all() and (pi <= 1 + 1e-9).all()):
        raise InputError("pi_prob must be probabilities in [0, 1]", field="pi_prob")
    if not (np.isfinite(mu).all() and (mu >= 0).all()):
        raise InputError("mu_prob must be non-negative probabilities", field="mu_prob")
    if not np.isfinite(r).all():
        raise InputError("rewards must be finite numbers", field="rewards")
    if not 0 < float(floor) <= 1:
        raise InputError(f"floor must lie in (0, 1], not {floor}", field="floor")
    if not 0 < float(gamma) <= 1:
        raise InputError(f"gamma must lie in (0, 1], not {gamma}", field="gamma")
    if not np.issubdtype(t.dtype, np.integer):
        raise InputError("step_index must be integers", field="step_index")
    episodes, row = np.unique(ep, return_inverse=True)
    E = episodes.shape[0]
    length = np.bincount(row, minlength=E)
    T = int(length.max())
    if (t < 0).any() or (t >= length[row]).any() or np.bincount(row * T + t, minlength=E * T).max() > 1:
        raise InputError("step_index must number each episode's steps 0 … L−1, each once", field="step_index")

    # log ratios in an [E, T] grid, 0 (ratio 1) past each episode's end; π = 0 gives −inf,
    # which the cumulative sum carries to every later step (and never meets +inf: μ ≥ floor)
    log_ratio = np.zeros((E, T))
    with np.errstate(divide="ignore"):
        log_ratio[row, t] = np.log(pi) - np.log(np.maximum(mu, float(floor)))
    log_w = np.cumsum(log_ratio, axis=1)
    top = log_w.max(axis=0)
    weights = np.exp(log_w - np.where(np.isfinite(top), top, 0.0))
    discounted = np.zeros((E, T))
    discounted[row, t] = r * float(gamma) ** t
    return PDWISTerms(weights=weights, weighted=weights * discounted, episodes=episodes, length=length)


def terminal_rewards(outcome: np.ndarray, episode_index: np.ndarray, step_index: np.ndarray) -> np.ndarray:
    """[N] per step: the episode's outcome on its last step, 0 elsewhere.  ``outcome`` has
    one entry per episode, in the order of ``np.unique(episode_index)``."""
    episodes, row = np.unique(np.asarray(episode_index).reshape(-1), return_inverse=True)
    outcome = np.asarray(outcome, dtype=np.float64).reshape(-1)
    if outcome.shape[0] != episodes.shape[0]:
        raise InputError(f"outcome needs one entry per episode ({episodes.shape[0]}), got {outcome.shape[0]}",
                         field="outcome")
    t = np.asarray(step_index).reshape(-1)
    last = t == np.bincount(row, minlength=episodes.shape[0])[row] - 1
    return np.where(last, outcome[row], 0.0)


def support_mass(pi_probs: np.ndarray, supported: np.ndarray) -> np.ndarray:
    """[N] per state: the policy's probability mass on the actions that have logged support
    there (``pi_probs`` [N, A], ``supported`` bool [N, A])."""
    return (np.asarray(pi_probs, dtype=np.float64) * np.asarray(supported, dtype=bool)).sum(axis=1)


# =========================================================================== behaviour cloning
@dataclass(frozen=True)
class Propensities:
    """Cross-fitted behaviour cloning of the logger.

    ``logged`` [N]: ``μ̂(a_logged | s)`` of every step (unclipped; 0 where the action never
    occurs outside the step's fold); ``probs`` [N, len(classes)]: ``μ̂(· | s)`` over
    ``classes`` (the sorted logged actions); ``folds``: how many folds were held out in
    turn; ``accuracy`` and ``log_loss`` (with the floor) measure the held-out fit."""

    logged: np.ndarray
    probs: np.ndarray
    classes: np.ndarray
    folds: int
    accuracy: float
    log_loss: float


#: Fits :func:`behaviour_propensities` keeps, newest last: exporting a bundle and registering it
#: evaluate the same logs, and the fit depends on nothing else.
_FIT_CACHE: "collections.OrderedDict[str, Propensities]" = collections.OrderedDict()
_FIT_CACHE_SIZE = 4
_FIT_CACHE_LOCK = threading.Lock()


def behaviour_propensities(features: np.ndarray, actions: np.ndarray, groups: np.ndarray | None = None, *,
                           n_folds: int = 5, C: float = 0.03, n_components: int = 64, seed: int = 0,
                           max_iter: int = 150, floor: float = PROPENSITY_FLOOR) -> Propensities:
    """``μ̂(a | s)`` by multinomial logistic regression from ``features`` [N, D] to the logged
    ``actions`` [N] (any integer labels), cross-fitted: the steps of each fold of
    :func:`~core.rewards.outcomes.grouped_folds` over ``groups`` (one label per step, e.g.
    the task of its episode; None: every step its own) are predicted by a model fitted on
    the other folds only.

    Inside each fold's fit the features are standardised and, when wider than
    ``n_components``, projected on their leading principal components: the flat state is
    wide and mostly one-hot, and the full softmax costs far more per optimiser step for
    little better held-out fit (docs/learning.md, "Behaviour cloning defaults").
    ``C`` is the inverse L2 strength as in scikit-learn (loss ``C·Σ CE + ½‖W‖²``); the
    fit stops after ``max_iter`` L-BFGS iterations, past which the held-out fit barely
    moves.  An action absent from a fold's training steps gets probability 0 there; a fold
    whose training steps show one action only predicts it with certainty.

    The fit is a pure function of its inputs, so the last few are kept per process, keyed
    by a digest of every input (their arrays are read-only: callers share them)."""
    X = np.ascontiguousarray(features, dtype=np.float64)
    y = np.ascontiguousarray(actions).reshape(-1)
    g = None if groups is None else np.asarray(groups).reshape(-1)
    digest = hashlib.sha256()
    for part in (X, y, g):
        if part is not None:
            digest.update(f"{part.dtype.str}{part.shape}".encode())
            digest.update(part.tobytes() if part.dtype != object else "\x1f".join(map(str, part)).encode())
    digest.update(repr((g is None, n_folds, float(C), n_components, seed, max_iter, float(floor))).encode())
    key = digest.hexdigest()
    with _FIT_CACHE_LOCK:
        if key in _FIT_CACHE:
            _FIT_CACHE.move_to_end(key)
            return _FIT_CACHE[key]
    fitted = _fit_propensities(X, y, g, n_folds=n_folds, C=C, n_components=n_components, seed=seed,
                               max_iter=max_iter, floor=floor)
    for array in (fitted.logged, fitted.probs, fitted.classes):
        array.setflags(write=False)
    with _FIT_CACHE_LOCK:
        _FIT_CACHE[key] = fitted
        while len(_FIT_CACHE) > _FIT_CACHE_SIZE:
            _FIT_CACHE.popitem(last=False)
    return fitted


def _fit_propensities(features: np.ndarray, actions: np.ndarray, groups: np.ndarray | None, *, n_folds: int,
                      C: float, n_components: int, seed: int, max_iter: int, floor: float) -> Propensities:
    """:func:`behaviour_propensities` itself (no cache)."""
    X = np.asarray(features, dtype=np.float64)
    y = np.asarray(actions).reshape(-1)
    if X.ndim != 2 or X.shape[0] != y.shape[0]:
        raise InputError(f"features must be [steps, dims] with one row per action (got {X.shape} for "
                         f"{y.shape[0]} actions)", field="features")
    if not np.isfinite(X).all():
        raise InputError("features must be finite numbers", field="features")
    if not float(C) > 0:
        raise InputError(f"C must be positive, not {C}", field="C")
    groups = np.arange(y.shape[0]) if groups is None else np.asarray(groups).reshape(-1)
    if groups.shape[0] != y.shape[0]:
        raise InputError(f"groups needs one label per step ({y.shape[0]}), got {groups.shape[0]}", field="groups")
    folds = grouped_folds(groups, n_folds=n_folds, seed=seed)
    classes, y_code = np.unique(y, return_inverse=True)
    probs = np.zeros((y.shape[0], classes.shape[0]))
    for held in folds:
        train = np.ones(y.shape[0], dtype=bool)
        train[held] = False
        seen, y_train = np.unique(y_code[train], return_inverse=True)
        if seen.shape[0] == 1:
            probs[held, seen[0]] = 1.0
            continue
        Z_train, Z_held = _standardised_components(X[train], X[held], n_components, seed)
        probs[np.ix_(held, seen)] = _softmax_regression(Z_train, y_train, seen.shape[0], float(C), Z_held,
                                                             max_iter=max_iter)
    logged = probs[np.arange(y.shape[0]), y_code]
    return Propensities(logged=logged, probs=probs, classes=classes, folds=len(folds),
                        accuracy=float((probs.argmax(axis=1) == y_code).mean()),
                        log_loss=float(-np.log(np.maximum(logged, floor)).mean()))


def _standardised_components(train: np.ndarray, other: np.ndarray, n_components: int, seed: int
                             ) -> tuple[np.ndarray, np.ndarray]:
    """Both blocks standardised with the training rows' mean and spread (constant columns
    dropped), then projected on the training rows' leading ``n_components`` principal axes
    when there are more columns than that."""
    from sklearn.utils.extmath import randomized_svd

    mean, std = train.mean(axis=0), train.std(axis=0)
    keep = std > 1e-12
    a = (train[:, keep] - mean[keep]) / std[keep]
    b = (other[:, keep] - mean[keep]) / std[keep]
    k = min(int(n_components), a.shape[0] - 1)
    if a.shape[1] > k >= 1:
        _, _, vt = randomized_svd(a, k, random_state=seed)
        a, b = a @ vt.T, b @ vt.T
    return a, b


def _softmax_regression(X: np.ndarray, y: np.ndarray, n_classes: int, C: float, X_predict: np.ndarray,
                        max_iter: int = 150) -> np.ndarray:
    """Class probabilities [len(X_predict), n_classes] of an L2-regularised multinomial
    logistic regression fitted on ``(X, y)`` by L-BFGS with the analytic gradient
    (scikit-learn's objective divided by ``C·n``: mean cross-entropy + ‖W‖²/(2·C·n), the
    bias unpenalised)."""
    from scipy.optimize import minimize
    from scipy.special import log_softmax

    n, d = X.shape
    onehot = np.zeros((n, n_classes))
    onehot[np.arange(n), y] = 1.0
    l2 = 1.0 / (C * n)

    def loss_and_grad(theta: np.ndarray) -> tuple[float, np.ndarray]:
        W, b = theta[: d * n_classes].reshape(d, n_classes), theta[d * n_classes:]
        logp = log_softmax(X @ W + b, axis=1)
        resid = (np.exp(logp) - onehot) / n
        loss = -float((logp * onehot).sum()) / n + 0.5 * l2 * float((W * W).sum())
        return loss, np.concatenate([(X.T @ resid + l2 * W).ravel(), resid.sum(axis=0)])

    res = minimize(loss_and_grad, np.zeros(d * n_classes + n_classes), jac=True, method="L-BFGS-B",
                   options={"maxiter": int(max_iter), "gtol": 1e-8, "ftol": 1e-12})
    W, b = res.x[: d * n_classes].reshape(d, n_classes), res.x[d * n_classes:]
    return np.exp(log_softmax(X_predict @ W + b, axis=1))


# =========================================================================== the report
@dataclass(frozen=True)
class PolicyEstimate:
    """The off-policy estimate of one policy on the logged episodes, with its own verdict."""

    #: Estimated success rate (None: no logged episode keeps any weight)
    policy_success: float | None
    #: Estimated return (None: no logged episode keeps any weight)
    policy_return: float | None
    #: Mean over logged steps of the policy's probability mass on actions with logged support
    support: float
    #: Kish's effective sample size of the episodes' whole-trajectory weights
    effective_sample_size: float
    #: Whether the logs support the policy enough for the figures to be trusted
    reliable: bool
    #: "reliable", or the first reason they cannot be ("thin support", "one task" …)
    verdict: str
    #: Every reason, in words a reader follows
    note: str


@dataclass(frozen=True)
class OffPolicyEstimate:
    """The ``ope`` report of :func:`off_policy_estimate`: the policy's estimated success and
    return against the logged ones, intervals over tasks, support and a verdict."""

    #: The estimator, in words
    method: str
    policy_success: float | None
    #: The logged episodes' own success rate
    logged_success: float
    #: 90% percentile interval of ``policy_success`` over resampled tasks
    policy_success_ci90: tuple[float | None, float | None]
    policy_return: float | None
    #: The logged episodes' own mean return
    logged_return: float
    #: 90% percentile interval of ``policy_return`` over resampled tasks
    policy_return_ci90: tuple[float | None, float | None]
    #: Mean over logged steps of the policy's probability mass on actions with logged support
    support: float
    episodes: int
    steps: int
    tasks: int
    #: Kish's effective sample size of the episodes' whole-trajectory weights
    effective_sample_size: float
    #: Least behaviour propensity (μ is clipped to it)
    propensity_floor: float
    reliable: bool
    verdict: str
    note: str
    #: The same estimate for the greedy policy, without intervals (None: not asked for)
    greedy: PolicyEstimate | None


@dataclass(frozen=True)
class BehaviourModelFit:
    """The logger's behaviour model behind an off-policy report, and its held-out fit."""

    #: The model, in words
    model: str
    #: Folds held out in turn
    folds: int
    #: "task" or "episode": what a fold holds out
    held_out_by: str
    #: Held-out accuracy on the logged actions
    accuracy: float
    #: Held-out log loss (with the propensity floor)
    log_loss: float


@dataclass(frozen=True)
class OffPolicyReport(OffPolicyEstimate):
    """The ``ope`` report of an agent on a run's logged episodes (:func:`off_policy_report`)."""

    behaviour_model: BehaviourModelFit
    #: Share of logged steps where the greedy action has logged support
    greedy_support: float
    #: Evaluated episodes without a recorded step (left out of the estimate)
    episodes_without_steps: int


@dataclass(frozen=True)
class OffPolicyUnavailable:
    """The ``ope`` report when the episodes cannot carry an estimate at all: the report's
    keys with no figures, and why (``note``)."""

    method: str
    policy_success: None
    logged_success: None
    policy_success_ci90: None
    policy_return: None
    logged_return: None
    support: None
    effective_sample_size: None
    episodes: int
    tasks: None
    #: Always False
    reliable: bool
    #: "no estimate"
    verdict: str
    note: str


def _verdict(value: float, ess: float, support: float, n_tasks: int, *, min_ess: float,
             min_support: float) -> tuple[bool, str, str]:
    """``(reliable, verdict, note)``: the verdict names the first reason the logs cannot
    carry the estimate, the note gives every one."""
    if not math.isfinite(value):
        return False, "no overlap", ("Not reliable: the policy gives every logged episode zero probability (the "
                                     "logger never took its actions), so the logs say nothing about it.")
    problems = []
    if support < min_support:
        problems.append(("thin support", f"thin support: only {support:.0%} of the policy's probability mass "
                         f"falls on actions the logs took in similar states (at least {min_support:.0%} needed), "
                         "the rest is extrapolation"))
    if ess < min_ess:
        problems.append(("low effective sample size", f"few effective episodes: the importance weights "
                         f"concentrate on {ess:.1f} effective episodes (at least {min_ess:g} needed), the policy "
                         "rarely does what the logger did"))
    if n_tasks < 2:
        problems.append(("one task", "one task: every episode belongs to the same task, so the interval over "
                         "tasks is degenerate"))
    if problems:
        return False, problems[0][0], "Not reliable: " + "; ".join(p[1] for p in problems) + "."
    return True, "reliable", (f"{ess:.0f} effective episodes over {n_tasks} tasks; {support:.0%} of the policy's "
                              "mass falls on actions the logs took in similar states.")


def _finite(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def off_policy_estimate(pi_prob: np.ndarray, mu_prob: np.ndarray, episode_index: np.ndarray,
                        step_index: np.ndarray, rewards: np.ndarray, gamma: float, success: np.ndarray, *,
                        support: np.ndarray, groups: np.ndarray | None = None,
                        greedy_prob: np.ndarray | None = None, greedy_support: np.ndarray | None = None,
                        method: str = METHOD, floor: float = PROPENSITY_FLOOR, min_ess: float = MIN_ESS,
                        min_support: float = MIN_SUPPORT, n_boot: int = 1000, seed: int = 0) -> OffPolicyEstimate:
    """The ``ope`` report of a policy on logged episodes (flat per-step arrays as in :func:`pdwis`).

    ``rewards`` [N]: per-step rewards whose ``γ^t``-discounted sum is the episode's return;
    ``success`` [E] and ``groups`` [E] (task per episode; None: every episode its own task)
    in the order of ``np.unique(episode_index)``.  ``support`` [N]: the policy's
    probability mass on actions with logged support at each state (:func:`support_mass`);
    the reported ``support`` is its mean over steps.  ``greedy_prob``/``greedy_support``
    (optional, [N]): the same for the greedy policy (1 where the logged action is its
    argmax), reported under ``greedy`` (None without them).

    ``policy_success_ci90``/``policy_return_ci90``: percentile intervals over resampled
    tasks.  ``effective_sample_size``: Kish's, of the episodes' whole-trajectory weights.
    ``reliable`` is False (``verdict`` and ``note`` say why) when the mean support is below
    ``min_support``, the effective sample size below ``min_ess``, there is one task only,
    or no episode keeps any weight; the numbers are then given but must not be trusted."""
    episode_index = np.asarray(episode_index).reshape(-1)
    step_index = np.asarray(step_index).reshape(-1)
    episodes = np.unique(episode_index)
    E = episodes.shape[0]
    success = np.asarray(success, dtype=np.float64).reshape(-1)
    if success.shape[0] != E:
        raise InputError(f"success needs one entry per episode ({E}), got {success.shape[0]}", field="success")
    if not np.isfinite(success).all():
        raise InputError("success must be finite (0/1 outcomes)", field="success")
    groups = np.arange(E) if groups is None else np.asarray(groups).reshape(-1)
    if groups.shape[0] != E:
        raise InputError(f"groups needs one task per episode ({E}), got {groups.shape[0]}", field="groups")
    support = np.asarray(support, dtype=np.float64).reshape(-1)
    if support.shape[0] != episode_index.shape[0]:
        raise InputError("support needs one entry per step", field="support")

    rewards = np.asarray(rewards, dtype=np.float64).reshape(-1)
    outcome_rewards = terminal_rewards(success, episode_index, step_index)
    n_tasks = int(np.unique(groups.astype(str)).shape[0])

    def estimate(pi: np.ndarray, support_steps: np.ndarray) -> tuple[PolicyEstimate, PDWISTerms, PDWISTerms]:
        """The estimate of the policy with logged-action probabilities ``pi``, and the
        weighted terms of its success and its return (what the intervals resample)."""
        succ = pdwis(pi, mu_prob, outcome_rewards, episode_index, step_index, 1.0, floor=floor)
        ret = pdwis(pi, mu_prob, rewards, episode_index, step_index, gamma, floor=floor)
        value_s, value_r = float(succ.trajectory_estimate(success)), ret.value  # one outcome per episode: a float
        ess = effective_sample_size(succ.final_weights)
        share = float(np.mean(support_steps))
        reliable, verdict, note = _verdict(value_s, ess, share, n_tasks, min_ess=min_ess, min_support=min_support)
        return (PolicyEstimate(policy_success=_finite(value_s), policy_return=_finite(value_r), support=share,
                               effective_sample_size=ess, reliable=reliable, verdict=verdict, note=note),
                succ, ret)

    def over_tasks(stat: Any) -> tuple[float | None, float | None]:
        lo, hi = bootstrap_ci(stat, groups, n_boot=n_boot, level=0.90, seed=seed)
        return _finite(lo), _finite(hi)

    main, succ, ret = estimate(np.asarray(pi_prob, dtype=np.float64), support)
    success_ci = over_tasks(lambda rows: succ.trajectory_estimate(success, np.bincount(rows, minlength=E)))
    return_ci = over_tasks(lambda rows: ret.estimate(np.bincount(rows, minlength=E)))
    returns = np.bincount(np.unique(episode_index, return_inverse=True)[1],
                          weights=rewards * float(gamma) ** step_index, minlength=E)
    greedy = None
    if greedy_prob is not None:
        g_support = support if greedy_support is None else np.asarray(greedy_support, dtype=np.float64)
        greedy = estimate(np.asarray(greedy_prob, dtype=np.float64), g_support)[0]
    return OffPolicyEstimate(
        method=method,
        policy_success=main.policy_success, logged_success=float(success.mean()), policy_success_ci90=success_ci,
        policy_return=main.policy_return, logged_return=float(returns.mean()), policy_return_ci90=return_ci,
        support=main.support, episodes=int(E), steps=int(episode_index.shape[0]), tasks=n_tasks,
        effective_sample_size=main.effective_sample_size, propensity_floor=float(floor),
        reliable=main.reliable, verdict=main.verdict, note=main.note, greedy=greedy,
    )


# =========================================================================== from a run
@dataclass
class LoggedStates:
    """The recorded steps of some episodes as the policy sees them when it follows the log.

    ``steps`` [N] (indices into the tables' steps, episode by episode, in order),
    ``episode`` [N], ``t`` [N], ``token`` [N] (logged token, -1 = INVALID), ``obs`` (encoder
    input, the log's own trace) and ``mask`` [N, A] (the mask rules with the counts of the
    episode's earlier logged calls) — what :class:`core.rl.sim.BatchedSim` shows there."""

    steps: np.ndarray
    episode: np.ndarray
    t: np.ndarray
    token: np.ndarray
    obs: dict[str, "torch.Tensor"]
    mask: "torch.Tensor"


def logged_states(tables: "SimTables", episodes: "torch.Tensor | np.ndarray", device: str = "cpu") -> LoggedStates:
    """Every recorded step of ``episodes`` (episode indices) with its observation and mask, at once."""
    import torch

    ep_ids = np.asarray(torch.as_tensor(episodes).reshape(-1).cpu().numpy(), dtype=np.int64)
    if ep_ids.size == 0:
        raise InputError("no episodes to estimate on", field="episodes")
    if ep_ids.min() < 0 or ep_ids.max() >= tables.n_episodes or np.unique(ep_ids).size != ep_ids.size:
        raise InputError(f"episode indices must be distinct and lie in 0..{tables.n_episodes - 1}", field="episodes")
    start = tables.ep_start.cpu().numpy()[ep_ids]
    length = tables.ep_len.cpu().numpy()[ep_ids]
    first = np.repeat(np.cumsum(length) - length, length)          # row of each step's episode start
    t = np.arange(int(length.sum())) - first
    steps = np.repeat(start, length) + t
    token = tables.token.cpu().numpy()[steps]
    A = tables.n_actions
    # the episode's own earlier calls (INVALID ones are not tokens and do not count)
    calls = np.zeros((steps.size, A), dtype=np.int32)
    valid = token >= 0
    calls[np.flatnonzero(valid), token[valid]] = 1
    before = np.cumsum(calls, axis=0) - calls
    counts = before - before[first]
    dev = torch.device(device)
    compiled = tables.compiled_masks
    columns = tables.mask_inputs(compiled)
    idx = torch.as_tensor(steps, device=tables.device)
    feats = {name: col.index_select(0, idx).to(dev) for name, col in columns.items()}
    mask = compiled.evaluate_torch(feats, torch.as_tensor(counts, device=dev), device=dev, messages=False).mask
    return LoggedStates(steps=steps, episode=np.repeat(ep_ids, length), t=t, token=token,
                        obs=tables.logged_batch(steps, device=dev), mask=mask.contiguous())


def policy_probs(agent: Any, obs: dict[str, "torch.Tensor"], mask: "torch.Tensor", batch: int = 4096) -> np.ndarray:
    """[N, A] the agent's masked softmax over the catalog at each state (float64)."""
    import torch

    from core.rl.common import MaskedCategorical  # deferred with torch: estimates from logged numbers need neither

    n = int(mask.shape[0])
    out = []
    with torch.no_grad():
        for lo in range(0, n, batch):
            part = {k: v[lo:lo + batch] for k, v in obs.items()}
            logits, _ = agent.heads(agent.state(part))
            out.append(MaskedCategorical(logits, mask[lo:lo + batch]).probs.double().cpu().numpy())
    return np.concatenate(out, axis=0)


def off_policy_report(tables: "SimTables", agent: Any, episodes: "torch.Tensor | np.ndarray", *,
                      groups: np.ndarray | None = None, device: str = "cpu", seed: int = 0,
                      n_boot: int = 1000, n_folds: int = 5) -> OffPolicyReport:
    """The ``ope`` report of ``agent`` on the logged ``episodes`` of ``tables``.

    ``groups``: the task of every episode — one entry per episode of the tables, or one per
    entry of ``episodes`` (e.g. :func:`core.rewards.outcomes.episode_groups`); None makes
    every episode its own task.  ``π(a_logged | s)`` is the agent's masked softmax
    probability of the logged token at the logged state (0 for a logged INVALID call,
    which is no token of the catalog, and for a logged token the mask forbids); ``μ`` is
    cross-fitted behaviour cloning over task folds from :func:`core.rl.sim.flatten_obs` of the
    same states (the features the policy sees) — over episodes when there is one task only.

    Support: the mean over logged steps of the policy's probability mass on tokens that
    some held-out logged step took in the same (task type, state cluster) — the
    simulator's own notion of "a similar state" (:func:`core.rl.sim.support_table`).  It is
    read from the logs themselves rather than from ``μ̂ ≥ floor``, because a softmax
    behaviour model gives every action some probability and would call anything supported.
    Success is the episode's recorded outcome; the return the template's, from the
    per-step rewards ``a·r_t`` plus ``b·R_final/γ^t`` on the last step."""
    import torch

    from core.rl.sim import flatten_obs  # deferred with torch: estimates from logged numbers need neither

    tables = tables.to(device)
    ep_ids = np.asarray(torch.as_tensor(episodes).reshape(-1).cpu().numpy(), dtype=np.int64)
    order = np.argsort(ep_ids, kind="stable")
    if groups is not None:
        groups = np.asarray(groups).reshape(-1)
        if groups.shape[0] == tables.n_episodes:
            groups = groups[ep_ids]
        elif groups.shape[0] != ep_ids.shape[0]:
            raise InputError(f"groups needs one task per episode of the tables ({tables.n_episodes}) or per "
                             f"evaluated episode ({ep_ids.shape[0]}), got {groups.shape[0]}", field="groups")
        groups = groups[order]                      # the order of np.unique(episode labels)
    ep_ids = ep_ids[order]
    states = logged_states(tables, ep_ids, device=device)
    # an episode without a recorded step has no decision to weigh: it is left out (and counted)
    used = np.isin(ep_ids, states.episode)
    ep_ids, groups = ep_ids[used], None if groups is None else groups[used]

    # π: the agent's masked distribution at the logged states
    pi_all = policy_probs(agent, states.obs, states.mask)
    rows = np.arange(states.steps.size)
    pi_logged = np.where(states.token >= 0, pi_all[rows, np.maximum(states.token, 0)], 0.0)
    greedy = pi_all.argmax(axis=1)
    greedy_logged = (greedy == states.token).astype(np.float64)

    # μ: behaviour cloning, cross-fitted over tasks (episodes when there is only one task)
    features = flatten_obs(states.obs, tables.n_actions).double().cpu().numpy()
    row_of_ep = np.searchsorted(ep_ids, states.episode)
    step_groups, held_out_by = (None, "episode") if groups is None else (groups[row_of_ep].astype(str), "task")
    if step_groups is None or np.unique(step_groups).size < 2:
        step_groups, held_out_by = states.episode.astype(str), "episode"
    if np.unique(step_groups).size < 2:
        raise InputError("an off-policy estimate needs at least 2 held-out episodes", field="episodes")
    mu = behaviour_propensities(features, states.token, step_groups, n_folds=n_folds, seed=seed)

    # support: tokens some held-out logged step took in the same (task type, state cluster)
    A, K = tables.n_actions, tables.n_clusters
    task = tables.task_code.cpu().numpy()[states.episode]
    base = (task * K + tables.cluster.cpu().numpy()[states.steps]) * A
    valid = states.token >= 0
    taken = np.bincount(base[valid] + states.token[valid], minlength=len(tables.task_names) * K * A) > 0
    supported = taken[base[:, None] + np.arange(A)[None, :]]
    support = support_mass(pi_all, supported)
    greedy_support = supported[rows, greedy].astype(np.float64)

    # rewards: Σ_t γ^t (a·r_t + [last]·b·R_final/γ^t) is the template's return
    gamma = float(tables.gamma)
    r = tables.step_reward64.cpu().numpy()[states.steps]
    final = tables.final.cpu().numpy()[states.episode]
    last = tables.step_last.cpu().numpy()[states.steps]
    rewards = tables.a * r + np.where(last, tables.b * final / gamma ** states.t, 0.0)
    success = tables.success.double().cpu().numpy()[ep_ids]

    estimate = off_policy_estimate(pi_logged, mu.logged, states.episode, states.t, rewards, gamma, success,
                                   support=support, groups=groups, greedy_prob=greedy_logged,
                                   greedy_support=greedy_support, n_boot=n_boot, seed=seed)
    return OffPolicyReport(
        **{f.name: getattr(estimate, f.name) for f in fields(estimate)},
        behaviour_model=BehaviourModelFit(
            model="multinomial logistic regression on the policy's flat state features",
            folds=mu.folds, held_out_by=held_out_by, accuracy=mu.accuracy, log_loss=mu.log_loss),
        greedy_support=float(greedy_support.mean()),
        episodes_without_steps=int((~used).sum()),
    )


__all__ = ["BehaviourModelFit", "LoggedStates", "METHOD", "MIN_ESS", "MIN_SUPPORT", "OffPolicyEstimate",
           "OffPolicyReport", "OffPolicyUnavailable", "PDWISTerms", "PROPENSITY_FLOOR", "PolicyEstimate", "Propensities",
           "behaviour_propensities", "effective_sample_size", "logged_states", "off_policy_estimate",
           "off_policy_report", "pdwis", "policy_probs", "support_mass", "terminal_rewards"]
