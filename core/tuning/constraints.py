"""The template's expectations as Optuna constraints (``trial.set_constraint``; feasible ⇔
value ≤ 0), compiled to index arrays over the training split (:class:`ExpectationConstraints`,
tested against :func:`~core.rewards.expectations.evaluate_expectations`).

Infeasible trials steer the sampler but are never the best trial.  Expectations the weights
cannot change are checked once: one that holds is left out, one that fails stops the study
before it starts (no trial could satisfy it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from core.base.errors import InputError
from core.rewards.expectations import episode_mask, step_mask
from core.rewards.frame import StepsFrame
from core.rewards.template import Template
from core.tuning.reweighting import Combined, ReturnModel
from core.tuning.statistics import auc

#: Smallest violation reported for a strict inequality that holds with equality.
STRICT_EPS = 1e-12


@dataclass
class _Compiled:
    name: str
    kind: str
    evaluate: Callable[[ScoredTrial], float]


@dataclass
class ScoredTrial:
    """A trial's weights (and parameters) applied: the returns and gates they give
    (``combined``), the weight vectors, and the component values they were applied to."""

    combined: Combined
    w_step: np.ndarray
    w_episode: np.ndarray
    step_values: np.ndarray
    episode_values: np.ndarray
    model: ReturnModel


#: What an expectation reads of a trial: one value per episode (its return, discounted or final).
TrialMetric = Callable[[ScoredTrial], np.ndarray]


def _strict(v: float) -> float:
    """A strict inequality that holds with equality is violated (by the smallest amount)."""
    return v if v < 0 else max(v, STRICT_EPS)


class ExpectationConstraints:
    """The template's expectations compiled over a set of episodes (the training split).

    :meth:`values` gives one number per expectation for a trial: ≤ 0 exactly when
    :func:`~core.rewards.expectations.evaluate_expectations` on those episodes passes it
    (Optuna's convention for feasibility).  ``skipped`` lists expectations that match no
    episode here (they cannot be checked) or do not depend on what is tuned."""

    def __init__(self, template: Template, frame: StepsFrame, episodes: np.ndarray,
                 tuned_components: set[str]):
        self.compiled: list[_Compiled] = []
        self.skipped: list[dict[str, Any]] = []
        self.constant: list[_Compiled] = []
        in_set = np.zeros(frame.n_episodes, dtype=bool)
        in_set[episodes] = True
        step_in_set = in_set[frame.episode]
        step_names = [c.name for c in template.step_components]
        episode_names = [c.name for c in template.episode_terms]
        for spec in template.expectations:
            f = spec.fields
            metric = f.get("metric", "return")

            def metric_of(tr: ScoredTrial, metric: str = metric) -> np.ndarray:
                c = tr.combined
                return {"return": c.returns, "discounted": c.discounted, "final": c.final}[metric]

            if spec.kind == "episode_score":
                idx = np.flatnonzero(episode_mask(frame, f["episodes"]) & in_set)
                if idx.size == 0:
                    self._skip(spec.name, "no episode of the training split matches its filter")
                    continue
                below, above = f.get("below"), f.get("above")

                def score_violation(tr: ScoredTrial, idx: np.ndarray = idx, below: float | None = below,
                                    above: float | None = above, metric_of: TrialMetric = metric_of) -> float:
                    v = metric_of(tr)[idx]
                    worst = -math.inf
                    if below is not None:
                        worst = max(worst, float(v.max() - below))
                    if above is not None:
                        worst = max(worst, float(above - v.min()))
                    return _strict(worst)
                self.compiled.append(_Compiled(spec.name, spec.kind, score_violation))
            elif spec.kind == "twins_rank":
                key = f.get("twin_key", "twin_of")
                margin = float(f.get("margin", 0.0))
                probes = np.flatnonzero(episode_mask(frame, f.get("episodes") or {"behaviour": "hacker"}) & in_set)
                index = frame.episode_index()
                twins = [(i, frame.ep_meta[i].get(key)) for i in probes.tolist()]
                pairs = [(i, index[t]) for i, t in twins if t is not None and t in index and in_set[index[t]]]
                if not pairs:
                    self._skip(spec.name, "no probe episode of the training split has its twin there")
                    continue
                if len(pairs) < probes.size:
                    self.skipped.append({"name": spec.name, "reason": f"{probes.size - len(pairs)} probe "
                                         "episodes have no twin in the training split; the others are checked",
                                         "partial": True})
                p = np.array(pairs, dtype=np.int64)

                def twin_violation(tr: ScoredTrial, p: np.ndarray = p, margin: float = margin,
                                   metric_of: TrialMetric = metric_of) -> float:
                    v = metric_of(tr)
                    return _strict(float((margin - (v[p[:, 1]] - v[p[:, 0]])).max()))
                self.compiled.append(_Compiled(spec.name, spec.kind, twin_violation))
            elif spec.kind == "rank_auc":
                hi = np.flatnonzero(episode_mask(frame, f["higher"]) & in_set)
                lo = np.flatnonzero(episode_mask(frame, f["lower"]) & in_set)
                if hi.size == 0 or lo.size == 0:
                    self._skip(spec.name, f"needs episodes in both groups of the training split "
                                          f"(higher: {hi.size}, lower: {lo.size})")
                    continue
                both = np.concatenate([hi, lo])
                y = np.concatenate([np.ones(hi.size), np.zeros(lo.size)])
                minimum = float(f["min"])

                def auc_shortfall(tr: ScoredTrial, both: np.ndarray = both, y: np.ndarray = y,
                                  minimum: float = minimum, metric_of: TrialMetric = metric_of) -> float:
                    value = auc(metric_of(tr)[both], y)
                    assert value is not None, "the AUC is defined: both groups have episodes"
                    return float(minimum - value)
                self.compiled.append(_Compiled(spec.name, spec.kind, auc_shortfall))
            elif spec.kind == "component_range":
                name = f["component"]
                use = f.get("value", "raw")
                filt = dict(f.get("steps") or {})
                lo_b, hi_b = f.get("min"), f.get("max")
                depends = name in tuned_components if use == "raw" else True

                def bounds_violation(values: np.ndarray, lo_b: float | None = lo_b,
                                     hi_b: float | None = hi_b) -> float:
                    worst = -math.inf
                    if hi_b is not None:
                        worst = max(worst, float(values.max() - hi_b))
                    if lo_b is not None:
                        worst = max(worst, float(lo_b - values.min()))
                    return worst
                if name in step_names:
                    j = step_names.index(name)
                    rows = np.flatnonzero(step_mask(frame, filt) & step_in_set)
                    if rows.size == 0:
                        self._skip(spec.name, "no step of the training split matches its filter")
                        continue
                    if use == "contribution":
                        def step_contribution(tr: ScoredTrial, j: int = j, rows: np.ndarray = rows,
                                              bv: Callable[[np.ndarray], float] = bounds_violation) -> float:
                            lvl = tr.model.col_level[j]
                            earn = tr.combined.earn[lvl, rows] if lvl < tr.model.n_levels else True
                            return bv(tr.w_step[j] * tr.step_values[j, rows] * earn)
                        evaluate: Callable[[ScoredTrial], float] = step_contribution
                    else:
                        def step_value(tr: ScoredTrial, j: int = j, rows: np.ndarray = rows,
                                       bv: Callable[[np.ndarray], float] = bounds_violation) -> float:
                            return bv(tr.step_values[j, rows])
                        evaluate = step_value
                else:
                    k = episode_names.index(name)
                    last_ok = step_mask(frame, {**filt, "last": True}) & step_in_set
                    eps = np.unique(frame.episode[last_ok])
                    if eps.size == 0:
                        self._skip(spec.name, "no episode of the training split matches its filter")
                        continue
                    if use == "contribution":
                        def episode_contribution(tr: ScoredTrial, k: int = k, eps: np.ndarray = eps,
                                                 bv: Callable[[np.ndarray], float] = bounds_violation) -> float:
                            return bv(tr.episode_values[eps, k] * tr.w_episode[k])
                        evaluate = episode_contribution
                    else:
                        def episode_value(tr: ScoredTrial, k: int = k, eps: np.ndarray = eps,
                                          bv: Callable[[np.ndarray], float] = bounds_violation) -> float:
                            return bv(tr.episode_values[eps, k])
                        evaluate = episode_value
                target = self.compiled if depends else self.constant
                target.append(_Compiled(spec.name, spec.kind, evaluate))

    def _skip(self, name: str, reason: str) -> None:
        self.skipped.append({"name": name, "reason": reason})

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.compiled]

    def values(self, trial: ScoredTrial) -> dict[str, float]:
        """Constraint value per expectation (≤ 0: satisfied)."""
        return {c.name: c.evaluate(trial) for c in self.compiled}

    def check_constant(self, trial: ScoredTrial) -> None:
        """Expectations no tuned quantity changes: drop those that hold, refuse the study when
        one fails (no trial could be feasible)."""
        for c in self.constant:
            v = c.evaluate(trial)
            if v > 0:
                raise InputError(f"expectation {c.name!r} fails on the training episodes whatever the "
                                 f"weights (it checks raw component values, violated by {v:.4g}); fix "
                                 "the expectation, or tune that component's parameters", field="expectations")
            self.skipped.append({"name": c.name, "reason": "holds whatever the weights (raw values)"})
        self.constant = []
