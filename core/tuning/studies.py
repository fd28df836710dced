"""Optuna studies over a reward pyramid's weights and chosen component parameters (docs/design.md §5, §10).

A study asks: which weights (within bounds the analyst sets) make the pyramid agree
best with what we know about the episodes?  Three objectives, one per study:

* ``outcome`` — episodes with a known outcome (imported logs with a reward or success
  key, generated data): the pyramid's episode return should rank successful episodes
  above failed ones.  Episodes are grouped by task (``split_by="task"``: the log's own
  task id, :func:`~core.rewards.outcomes.episode_groups`, or ``group_key``; or another
  ``split_by`` field), and whole tasks go to one of two sides, stratified by outcome:

  - an **outer held-out** set of tasks (``heldout_fraction``) that Optuna never sees and
    on which nothing is selected;
  - the **design** tasks, dealt into ``cv_folds`` task-grouped folds
    (:func:`~core.rewards.outcomes.grouped_folds`).

  A trial's value is the statistic (smooth AUC :func:`soft_auc`, AUC or Kendall τ) on
  each design fold, averaged over the folds, less a pull toward the template's weights on
  small data (below).  Nothing is fitted per fold (a trial's weights are the fit), so the
  folds do not make the choice among trials honest; they make the value task-balanced
  and give its spread across tasks.  The honest figure is the outer held-out one: every
  trial records its held-out AUC (``held_out_auc``), and the study's result is the
  best-value trial's held-out AUC — chosen by the design folds, read off the held-out
  tasks, never chosen by them.  The outcome is **withheld from the components**
  (``withhold_outcome``): a template whose R_final reads the recorded outcome would
  otherwise rank it perfectly and teach nothing.

  **Small data.**  Fewer than :data:`MIN_LABELLED` labelled episodes, :data:`MIN_TASKS`
  tasks or :data:`MIN_PER_CLASS` episodes of either outcome is refused (the numbers
  found and needed are named).  Below the comfortable sizes (:data:`COMFORTABLE_LABELLED`,
  :data:`COMFORTABLE_TASKS`, :data:`COMFORTABLE_PER_CLASS`) the study runs with a warning
  in its result and the search shrinks: each weight is penalised by its squared distance
  from the template's weight, relative to its bounds, times :data:`SMALL_DATA_PENALTY`
  (averaged over the tuned weights), so a weighting must earn its departure.
* ``preferences`` — analysts' "A is better than B" labels on episode pairs, stored in
  the workspace (:func:`add_preference`); the value is the share of training pairs the
  returns order the same way (ties count half).
* ``policy`` — a short PPO run (:func:`core.rl.ppo.train`) per trial on the simulator
  under the trial's rewards; the value is the success rate of the trained greedy
  policy started from the training episodes, reported on the held-out ones.  Each
  update reports the rollout success rate, so Optuna's median pruner stops hopeless
  trials early.

**Expectations are constraints.**  Every expectation of the template becomes an Optuna
constraint (``trial.set_constraint``, Optuna's successor of ``constraints_func``;
feasible ⇔ value ≤ 0), evaluated on the training split: infeasible trials steer the
sampler but are never the best trial.  Expectations the weights cannot change are
checked once: one that holds is left out, one that fails stops the study before it
starts (no trial could satisfy it).

**Speed.**  The component matrix is computed once (and cached in the workspace); a
weight-only trial is a matrix product plus gating and a rank statistic
(:class:`ReturnModel`, tested against :class:`~core.rewards.pyramid.ScoreResult`), and
the expectations are compiled to index arrays (:class:`ExpectationConstraints`,
tested against :func:`~core.rewards.expectations.evaluate_expectations`).  A trial
that changes a component's parameters recomputes that one column (memoised per
parameter value).  Storage: see :mod:`core.tuning.storage`.

The module, in order: configuration (:class:`SearchSpace`, :class:`TuneConfig`), labels
and splits, statistics, the fast re-weighting (:class:`ReturnModel`), expectations as
constraints, the problem and its objectives, preference labels, :func:`tune`, the
workspace's study records (:func:`list_studies`, :func:`launch_tuning`,
:func:`stop_tuning`), :func:`apply_study` and :func:`study_report` (the page's view).

Example::

    >>> config = TuneConfig(objective="outcome", split_by="task")
    >>> result = tune(ws, actor, "finance_risk", dataset="finance", config=config,
    ...               trials=300)                                               # doctest: +SKIP
    >>> result.best["figures"]["held_out"]["auc"]                              # doctest: +SKIP
    0.81
    >>> apply_study(ws, actor, result.study)["label"]                           # doctest: +SKIP
    'finance_risk@1'
"""

from __future__ import annotations

import abc
import hashlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import optuna

from core.base.errors import ConflictError, InputError, RwbError
from core.base.package_data import import_root
from core.rewards.frame import StepsFrame
from core.rewards.template import ComponentSpec, Template, TemplateError, build_component
from core.tuning.storage import (BatchedTrialWriter, default_storage_url, describe_url, open_storage,
                                 study_id)
from core.access.users import Actor, authorize

if TYPE_CHECKING:  # pragma: no cover
    from core.records.episodes import Episode
    from core.rewards.pyramid import ComponentMatrix
    from core.records.store import Workspace

OBJECTIVES: tuple[str, ...] = ("outcome", "preferences", "policy")
#: What "successful" means: ``success`` is resolved where known, else final_reward > threshold.
LABELS: tuple[str, ...] = ("success", "resolved", "final_reward", "business_metric", "sentiment")
METRICS: tuple[str, ...] = ("soft_auc", "auc", "kendall")
#: Temperature of the soft AUC, in standard deviations of the returns.
SOFT_AUC_TEMPERATURE = 0.1
#: (success, failure) pairs a soft AUC averages over at most (a fixed sample beyond).
SOFT_AUC_PAIRS = 100_000
SPLIT_FIELDS: tuple[str, ...] = ("task", "episode", "task_type", "domain", "behaviour")
SAMPLERS: tuple[str, ...] = ("tpe", "random")
#: Task-grouped folds of the design tasks (outcome objective) unless the study says otherwise.
CV_FOLDS = 5
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
#: Trials of one call listed in its result (the most recent).
TRIAL_ROWS = 500
#: Registered components that read the recorded outcome (their columns carry the label).
OUTCOME_COMPONENTS = frozenset({"business_impact", "terminal_outcome", "resolved_bonus", "sentiment_bonus"})
#: Study user attribute holding the configuration every worker and `apply` reads.
CONFIG_ATTR = "rwb"
#: Smallest violation reported for a strict inequality that holds with equality.
STRICT_EPS = 1e-12
#: Component columns kept in memory for trials that tune parameters (most recent).
COLUMN_MEMO = 32
#: The ``rwb`` command as a child process of this interpreter (works without the console script).
CLI: tuple[str, ...] = (sys.executable, "-c", "from core.cli import console; console()")
#: PPO settings of one policy trial unless the study overrides them (a short run).
POLICY_DEFAULTS: dict[str, Any] = {"total_steps": 16_384, "n_envs": 64, "rollout_len": 32,
                                   "checkpoint_every": 1_000_000, "bc_epochs": 5, "heldout_fraction": 0.5}


class NoFeasibleTrial(RwbError):
    """The study has no completed trial that satisfies every expectation."""


# =========================================================================== configuration
@dataclass(frozen=True)
class ParamRange:
    """Bounds of one tuned quantity: ``low``–``high`` (floats, or integers when ``integer``)
    or a list of ``choices``."""

    low: float | None = None
    high: float | None = None
    choices: tuple[Any, ...] | None = None
    integer: bool = False

    def suggest(self, trial: optuna.Trial, name: str) -> Any:
        """Draw a value from ``trial``."""
        if self.choices is not None:
            return trial.suggest_categorical(name, list(self.choices))
        if self.integer:
            return trial.suggest_int(name, int(self.low), int(self.high))
        return trial.suggest_float(name, float(self.low), float(self.high))

    def to_dict(self) -> dict[str, Any]:
        if self.choices is not None:
            return {"choices": list(self.choices)}
        return {"low": self.low, "high": self.high, **({"integer": True} if self.integer else {})}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ParamRange":
        if "choices" in d:
            return cls(choices=tuple(d["choices"]))
        return cls(low=d["low"], high=d["high"], integer=bool(d.get("integer", False)))


@dataclass(frozen=True)
class SearchSpace:
    """What a study varies: component weights (name → bounds) and component parameters
    (``"component.param"`` → bounds or choices).  Everything else keeps the template's value.

    Optuna parameter names are the component names for weights and
    ``component.param`` for parameters, so the dashboard reads like the template."""

    weights: Mapping[str, tuple[float, float]]
    params: Mapping[str, ParamRange] = field(default_factory=dict)

    @classmethod
    def for_template(cls, template: Template, bounds: Mapping[str, Any] | None = None,
                     fixed: Sequence[str] = (), *, exclude: Sequence[str] = ()) -> "SearchSpace":
        """The default space of ``template`` — every weight in ``[0, max(1, 2·w)]`` — with
        analyst ``bounds`` (``{name: (low, high)}`` for weights, ``{"comp.param": (low,
        high) or [choices]}`` for parameters) applied, ``fixed`` weights and the
        ``exclude``d components (e.g. outcome readers when the outcome is withheld) held."""
        known = {c.name: c for c in template.all_components}
        bounds = dict(bounds or {})
        for name in fixed:
            if name not in known:
                raise InputError(f"cannot fix {name!r}: no such component; known: {', '.join(known)}",
                                 field="fix")
        weights: dict[str, tuple[float, float]] = {}
        for c in template.all_components:
            if c.name in fixed or (c.name in exclude and c.name not in bounds):
                continue
            weights[c.name] = (0.0, max(1.0, 2.0 * c.weight))
        params: dict[str, ParamRange] = {}
        for key, value in bounds.items():
            if "." in key:
                comp_name, param = key.split(".", 1)
                params[key] = _param_range(template, known, comp_name, param, value)
                continue
            if key not in known:
                raise InputError(f"bounds for {key!r}: no such component; known: {', '.join(known)}",
                                 field="bounds")
            if key in fixed:
                raise InputError(f"{key!r} is both fixed and given bounds", field="bounds")
            low, high = _pair(value, key)
            if low < 0 or high < low:
                raise InputError(f"bounds of weight {key!r} must satisfy 0 ≤ low ≤ high, got {low}:{high}",
                                 field="bounds")
            weights[key] = (low, high)
        if not weights and not params:
            raise InputError("nothing to tune: every weight is fixed and no parameter has bounds",
                             field="bounds")
        return cls(weights=weights, params=params)

    def suggest(self, trial: optuna.Trial) -> tuple[dict[str, float], dict[str, dict[str, Any]]]:
        """The weights and parameters of one trial."""
        weights = {}
        for name, (low, high) in self.weights.items():
            weights[name] = low if low == high else trial.suggest_float(name, low, high)
        params: dict[str, dict[str, Any]] = {}
        for key, rng in self.params.items():
            comp, param = key.split(".", 1)
            params.setdefault(comp, {})[param] = rng.suggest(trial, key)
        return weights, params

    def decode(self, values: Mapping[str, Any]) -> tuple[dict[str, float], dict[str, dict[str, Any]]]:
        """Weights and parameters from a finished trial's ``params``."""
        weights = {name: float(values.get(name, low)) for name, (low, high) in self.weights.items()}
        params: dict[str, dict[str, Any]] = {}
        for key in self.params:
            comp, param = key.split(".", 1)
            if key in values:
                params.setdefault(comp, {})[param] = values[key]
        return weights, params

    def to_dict(self) -> dict[str, Any]:
        return {"weights": {k: list(v) for k, v in self.weights.items()},
                "params": {k: v.to_dict() for k, v in self.params.items()}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SearchSpace":
        return cls(weights={k: (float(v[0]), float(v[1])) for k, v in d["weights"].items()},
                   params={k: ParamRange.from_dict(v) for k, v in d.get("params", {}).items()})


def _pair(value: Any, key: str) -> tuple[float, float]:
    if isinstance(value, str) and ":" in value:
        value = value.split(":", 1)
    try:
        low, high = (float(v) for v in value)
    except (TypeError, ValueError):
        raise InputError(f"bounds of {key!r} must be LOW:HIGH numbers, got {value!r}", field="bounds") from None
    if not (math.isfinite(low) and math.isfinite(high)):
        raise InputError(f"bounds of {key!r} must be finite", field="bounds")
    return low, high


def _param_range(template: Template, known: Mapping[str, ComponentSpec], comp_name: str, param: str,
                 value: Any) -> ParamRange:
    from core.rewards.components import COMPONENTS

    if comp_name not in known:
        raise InputError(f"bounds for '{comp_name}.{param}': no component {comp_name!r}; known: "
                         f"{', '.join(known)}", field="bounds")
    spec = known[comp_name]
    specs = COMPONENTS[spec.component].param_specs()
    if param not in specs:
        raise InputError(f"bounds for '{comp_name}.{param}': component {spec.component!r} has no "
                         f"parameter {param!r}; known: {', '.join(specs) or 'none'}", field="bounds")
    annotation = specs[param][0]
    if isinstance(value, (list, tuple)) and not (len(value) == 2 and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)) or \
            (isinstance(value, str) and ":" not in value):
        choices = tuple(value.split(",")) if isinstance(value, str) else tuple(value)
        choices = tuple(_coerce_choice(c, annotation) for c in choices)
        for c in choices:  # each choice must be a valid parameter value
            try:
                template.with_params(comp_name, {**dict(spec.params), param: c})
            except TemplateError as exc:
                raise InputError(f"choice {c!r} of '{comp_name}.{param}': {exc}", field="bounds") from None
        return ParamRange(choices=choices)
    low, high = _pair(value, f"{comp_name}.{param}")
    if high < low:
        raise InputError(f"bounds of '{comp_name}.{param}' need low ≤ high", field="bounds")
    integer = annotation is int
    if integer and (low != int(low) or high != int(high)):
        raise InputError(f"'{comp_name}.{param}' is an integer parameter; give integer bounds",
                         field="bounds")
    for v in (int(low), int(high)) if integer else (low, high):
        try:
            template.with_params(comp_name, {**dict(spec.params), param: v})
        except TemplateError as exc:
            raise InputError(f"bound {v} of '{comp_name}.{param}': {exc}", field="bounds") from None
    return ParamRange(low=int(low) if integer else low, high=int(high) if integer else high, integer=integer)


def _coerce_choice(text: Any, annotation: Any) -> Any:
    """A ``--bound`` choice as the parameter's type (text stays text for text parameters)."""
    if not isinstance(text, str):
        return text
    text = text.strip()
    if annotation is str:
        return text
    if text in ("true", "false"):
        return text == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            continue
    return text


def parse_bounds(items: Sequence[str]) -> dict[str, Any]:
    """CLI ``--bound`` values: ``NAME=LOW:HIGH`` for a weight or a numeric parameter
    (``param_reasonableness.z_ok=1.5:3``), ``COMP.PARAM=a,b,c`` for choices."""
    out: dict[str, Any] = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or not name.strip() or not value.strip():
            raise InputError(f"--bound {item!r}: write NAME=LOW:HIGH or COMPONENT.PARAM=a,b,c",
                             field="bound")
        out[name.strip()] = value.strip()
    return out


@dataclass(frozen=True)
class TuneConfig:
    """How a study measures a trial (stored with the study; workers must agree on it)."""

    objective: str = "outcome"
    """outcome | preferences | policy"""
    split_by: str = "task"
    """episodes with the same value stay on one side of the train/held-out split: task (the
    request text), episode, task_type, domain, behaviour or meta.<key>"""
    heldout_fraction: float = 0.5
    """share of the episodes (of the preference pairs) held out for reporting"""
    label: str = "success"
    """outcome objective: success (resolved, else final_reward > threshold), resolved, or a
    numeric outcome field (final_reward, business_metric, sentiment)"""
    success_threshold: float = 0.0
    """a numeric label counts as success above this value (for the AUC)"""
    metric: str = "soft_auc"
    """outcome objective: soft_auc (smooth AUC, the default: see :func:`soft_auc`), auc, or
    kendall (τ-b between returns and the label)"""
    withhold_outcome: bool | None = None
    """hide the recorded outcome from the components (default: yes, except for policy)"""
    seed: int = 0
    """seed of the split and the sampler"""
    sampler: str = "tpe"
    """tpe (multivariate TPE) or random"""
    policy: Mapping[str, Any] = field(default_factory=dict)
    """PPO settings of one policy trial (core.rl.ppo.PPOConfig fields), over POLICY_DEFAULTS"""
    group_key: str | None = None
    """split_by task: dotted key of the imported record holding the task id (default: the
    log's task_id, else the user's request; :func:`core.rewards.outcomes.episode_groups`)"""
    cv_folds: int = CV_FOLDS
    """outcome objective: task-grouped folds of the design tasks"""

    def validate(self) -> "TuneConfig":
        """Refuse settings that make no sense (InputError naming the field)."""
        for name, value, allowed in (("objective", self.objective, OBJECTIVES),
                                     ("label", self.label, LABELS), ("metric", self.metric, METRICS),
                                     ("sampler", self.sampler, SAMPLERS)):
            if value not in allowed:
                raise InputError(f"{name} must be one of {', '.join(allowed)}, not {value!r}", field=name)
        if self.split_by not in SPLIT_FIELDS and not (self.split_by.startswith("meta.") and
                                                      len(self.split_by) > 5):
            raise InputError(f"split_by must be one of {', '.join(SPLIT_FIELDS)} or meta.<key>, not "
                             f"{self.split_by!r}", field="split_by")
        if not 0.0 < float(self.heldout_fraction) < 1.0:
            raise InputError(f"heldout_fraction must lie strictly between 0 and 1, not "
                             f"{self.heldout_fraction}", field="heldout_fraction")
        if self.group_key is not None and (self.split_by != "task" or not str(self.group_key).strip()):
            raise InputError(f"group_key names where the task id is; it applies to split_by task, not "
                             f"{self.split_by!r}", field="group_key")
        if isinstance(self.cv_folds, bool) or not isinstance(self.cv_folds, int) or self.cv_folds < 2:
            raise InputError(f"cv_folds must be a whole number ≥ 2, not {self.cv_folds!r}", field="cv_folds")
        if self.metric == "kendall" and self.objective != "outcome":
            raise InputError("metric applies to the outcome objective only", field="metric")
        return self

    @property
    def withholds(self) -> bool:
        """Whether the components see the outcome withheld."""
        if self.withhold_outcome is None:
            return self.objective != "policy"
        return bool(self.withhold_outcome)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["policy"] = dict(self.policy)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TuneConfig":
        names = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - names
        if unknown:
            raise InputError(f"unknown tuning settings: {', '.join(sorted(unknown))}", field="config")
        return cls(**dict(d)).validate()


# =========================================================================== labels and splits
@dataclass(frozen=True)
class Labels:
    """Per episode: ``success`` (1/0, NaN unknown) and ``value`` (the label as a number, for τ)."""

    success: np.ndarray
    value: np.ndarray

    @property
    def known(self) -> np.ndarray:
        return ~np.isnan(self.success)


def outcome_labels(frame: StepsFrame, label: str = "success", threshold: float = 0.0) -> Labels:
    """The label each episode is judged by (see :class:`TuneConfig`)."""
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


def task_groups(frame: StepsFrame, episodes: Sequence["Episode"], group_key: str | None = None
                ) -> np.ndarray:
    """The task of each episode of ``frame`` (in its order) from the ``episodes`` it was
    built from: :func:`core.rewards.outcomes.episode_groups` (the log's own task id, or the
    record key ``group_key``)."""
    from core.rewards.outcomes import episode_groups

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


# =========================================================================== statistics
def average_ranks(values: np.ndarray) -> np.ndarray:
    """1-based ranks, ties sharing their average rank (``scipy.stats.rankdata``'s default)."""
    order = np.argsort(values, kind="mergesort")
    sorted_values = values[order]
    new_group = np.concatenate([[True], sorted_values[1:] != sorted_values[:-1]])
    group = np.cumsum(new_group) - 1
    starts = np.flatnonzero(new_group)
    ends = np.append(starts[1:], values.size)
    ranks = np.empty(values.size)
    ranks[order] = ((starts + 1 + ends) / 2.0)[group]
    return ranks


def auc(scores: np.ndarray, success: np.ndarray) -> float | None:
    """P(a random success scores above a random failure), ties half (None without both)."""
    y = success.astype(bool)
    n1, n0 = int(y.sum()), int((~y).sum())
    if n1 == 0 or n0 == 0:
        return None
    ranks = average_ranks(scores)
    return float((ranks[y].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def kendall_tau(scores: np.ndarray, values: np.ndarray) -> float | None:
    """Kendall's τ-b between returns and the label (None when undefined)."""
    from scipy.stats import kendalltau  # scipy.stats takes seconds to import: only when asked

    if scores.size < 2 or np.all(values == values[0]) or np.all(scores == scores[0]):
        return None
    tau = kendalltau(scores, values).statistic
    return None if tau is None or not math.isfinite(tau) else float(tau)


def soft_auc(scores: np.ndarray, better: np.ndarray, worse: np.ndarray) -> float | None:
    """Smooth AUC over index pairs: mean of σ((s_better − s_worse) / (T·std(s))), T = 0.1.

    Why the objective uses it: the AUC is a step function of the weights, and on a small
    training split many weightings reach the same (often perfect) AUC, so the sampler
    cannot tell them apart and the first one wins.  The soft AUC also rewards the margin
    by which successes outscore failures, relative to the spread of the returns (so it
    is scale-free, like the AUC).  Measured on the ToolBench runs (6-7 training
    episodes, 10 splits, tuning from deliberately bad weights): held-out AUC 0.91 on
    average (worst 0.70) against 0.77 (worst 0.40) when optimising the AUC itself; on
    400 generated episodes both give the same held-out AUC (0.82-0.83)."""
    if better.size == 0:
        return None
    spread = float(scores.std())
    if spread == 0.0:
        return 0.5
    z = (scores[better] - scores[worse]) / (SOFT_AUC_TEMPERATURE * spread)
    return float((0.5 * (1.0 + np.tanh(0.5 * z))).mean())   # the logistic σ(z), without overflow


def outcome_pairs(success: np.ndarray, seed: int = 0, limit: int = SOFT_AUC_PAIRS) -> tuple[np.ndarray, np.ndarray]:
    """(success, failure) index pairs of a 0/1 vector: all of them, or a fixed sample of
    ``limit`` when there are more."""
    pos, neg = np.flatnonzero(success == 1), np.flatnonzero(success == 0)
    if pos.size * neg.size <= limit:
        return np.repeat(pos, neg.size), np.tile(neg, pos.size)
    rng = np.random.default_rng(seed)
    return rng.choice(pos, limit), rng.choice(neg, limit)


def pair_agreement(returns: np.ndarray, better: np.ndarray, worse: np.ndarray) -> float | None:
    """Share of ``(better, worse)`` pairs whose returns agree (ties count half)."""
    if better.size == 0:
        return None
    a, b = returns[better], returns[worse]
    return float(((a > b) + 0.5 * (a == b)).mean())


# =========================================================================== fast re-weighting
@dataclass
class Combined:
    """What one set of weights gives: per episode ``returns``, ``discounted`` (Σγ^t r),
    ``final`` (R_final); per step ``step_reward``; ``earn`` [L, N]: level l counts at step i."""

    returns: np.ndarray
    discounted: np.ndarray
    final: np.ndarray
    step_reward: np.ndarray
    earn: np.ndarray


def matrix_layout(matrix: "ComponentMatrix", frame: StepsFrame, template: Template
                  ) -> tuple[np.ndarray, np.ndarray, bool, bool]:
    """The matrix as ``(M [C, N] component-major step values, E [E, K] episode terms)``,
    plus whether each was stored transposed (to hand matrices back to the pyramid).

    The orientation is read from the shapes; when a square matrix leaves it open (tiny
    data), the one whose returns equal :class:`~core.rewards.pyramid.ScoreResult`'s under
    random weights is taken — tuning never misreads a matrix."""
    C, N = len(matrix.step_names), frame.n_steps
    K, E = len(matrix.episode_names), frame.n_episodes
    M, Ev = matrix.step_values, matrix.episode_values
    step_options = [(m, tr) for m, tr, ok in ((M, False, M.shape == (C, N)), (M.T, True, M.shape == (N, C))) if ok]
    ep_options = [(m, tr) for m, tr, ok in ((Ev, False, Ev.shape == (E, K)), (Ev.T, True, Ev.shape == (K, E))) if ok]
    if not step_options or not ep_options:
        raise ValueError(f"component matrix of shape {M.shape}/{Ev.shape} does not fit {N} steps, "
                         f"{E} episodes, {C}+{K} components")
    if len(step_options) > 1 or len(ep_options) > 1:
        from core.rewards.pyramid import ScoreResult

        rng = np.random.default_rng(0)
        weights = {c.name: float(rng.uniform(0.5, 1.5)) for c in template.all_components}
        reference = ScoreResult(template, frame, matrix, weights).returns
        model = ReturnModel(template, frame)
        ws, we = model.weight_vectors(weights)
        for m, m_t in step_options:
            for ev, ev_t in ep_options:
                if np.allclose(model.combine(ws, we, np.asarray(m), np.asarray(ev)).returns, reference):
                    return np.ascontiguousarray(m), np.ascontiguousarray(ev), m_t, ev_t
    (m, m_t), (ev, ev_t) = step_options[0], ep_options[0]
    return np.ascontiguousarray(m), np.ascontiguousarray(ev), m_t, ev_t


class ReturnModel:
    """Episode returns as a function of the weights, over a fixed component matrix.

    The same combination as :class:`~core.rewards.pyramid.ScoreResult` (gated level sums,
    penalties, R_final, ``a·Σγ^t r + b·R_final``) without building a template per trial:
    one ``[L+1, C] @ [C, N]`` product, the gates, a ``reduceat``."""

    def __init__(self, template: Template, frame: StepsFrame):
        self.template = template
        levels = template.levels
        self.n_levels = len(levels)
        self.step_names = [c.name for c in template.step_components]
        self.episode_names = [c.name for c in template.episode_terms]
        self.col_level = np.array([next((i for i, lv in enumerate(levels) if lv.key == c.group), self.n_levels)
                                   for c in template.step_components], dtype=np.int64)
        self.gates = [lv.gate for lv in levels]
        self.gating = template.gating
        self.discount = np.power(template.gamma, frame.t.astype(np.float64))
        self.has_steps = frame.ep_len > 0
        self.starts = frame.ep_start[self.has_steps]
        self.n_steps, self.n_episodes = frame.n_steps, frame.n_episodes
        self.a, self.b = template.a, template.b

    def weight_vectors(self, weights: Mapping[str, float]) -> tuple[np.ndarray, np.ndarray]:
        """(step weights [C], episode-term weights [K]) from a name → weight mapping (names
        not given keep the template's weight)."""
        base = self.template.weights()
        ws = np.array([float(weights.get(n, base[n])) for n in self.step_names], dtype=np.float64)
        we = np.array([float(weights.get(n, base[n])) for n in self.episode_names], dtype=np.float64)
        return ws, we

    def combine(self, w_step: np.ndarray, w_episode: np.ndarray, step_values: np.ndarray,
                episode_values: np.ndarray) -> Combined:
        """Returns under weight vectors ``w_step`` [C], ``w_episode`` [K] and component values
        ``step_values`` [C, N], ``episode_values`` [E, K]."""
        L, C = self.n_levels, w_step.shape[0]
        # S[l] = Σ_{c in level l} w_c·M[c]: a weighted row sum per component.  Not a BLAS
        # matmul: for a [L+1, C] @ [C, N] product with C ≈ 10, a multithreaded BLAS spends
        # far more time waking its threads than computing (10× slower on a busy 2-core box).
        S = np.zeros((L + 1, self.n_steps))
        wsum = np.zeros(L + 1)
        scratch = np.empty(self.n_steps)
        for j in range(C):
            w = w_step[j]
            if w != 0.0:
                lvl = self.col_level[j]
                np.multiply(step_values[j], w, out=scratch)
                S[lvl] += scratch
                wsum[lvl] += w
        earn = np.ones((L, self.n_steps), dtype=bool)
        reward = S[L].copy()                       # penalties are never gated
        running: np.ndarray | None = None          # AND of the gates below the current level
        for li in range(L):
            if self.gating and running is not None:
                earn[li] = running
                np.add(reward, S[li], out=reward, where=running)
            else:
                reward += S[li]
            gate = self.gates[li]
            if gate is not None and wsum[li] > 0 and self.gating:
                ok = S[li] >= (gate - 1e-9) * wsum[li]
                running = ok if running is None else running & ok
        final = episode_values @ w_episode if w_episode.size else np.zeros(self.n_episodes)
        discounted = np.zeros(self.n_episodes)
        if self.starts.size:
            discounted[self.has_steps] = np.add.reduceat(reward * self.discount, self.starts)
        return Combined(returns=self.a * discounted + self.b * final, discounted=discounted, final=final,
                        step_reward=reward, earn=earn)

    def contributions(self, combined: Combined, w_step: np.ndarray, step_values: np.ndarray) -> np.ndarray:
        """Weighted, gated contribution of every step component ``[C, N]`` (penalties ungated)."""
        out = step_values * w_step[:, None]
        for j, lvl in enumerate(self.col_level.tolist()):
            if lvl < self.n_levels:
                out[j] *= combined.earn[lvl]
        return out


# =========================================================================== expectations as constraints
@dataclass
class _Compiled:
    name: str
    kind: str
    evaluate: Callable[["_Trial"], float]


@dataclass
class _Trial:
    combined: Combined
    w_step: np.ndarray
    w_episode: np.ndarray
    step_values: np.ndarray
    episode_values: np.ndarray
    model: ReturnModel


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
        from core.rewards.expectations import episode_mask, step_mask

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

            def metric_of(tr: _Trial, metric: str = metric) -> np.ndarray:
                c = tr.combined
                return {"return": c.returns, "discounted": c.discounted, "final": c.final}[metric]

            if spec.kind == "episode_score":
                idx = np.flatnonzero(episode_mask(frame, f["episodes"]) & in_set)
                if idx.size == 0:
                    self._skip(spec.name, "no episode of the training split matches its filter")
                    continue
                below, above = f.get("below"), f.get("above")

                def fn(tr, idx=idx, below=below, above=above, metric_of=metric_of):
                    v = metric_of(tr)[idx]
                    worst = -math.inf
                    if below is not None:
                        worst = max(worst, float(v.max() - below))
                    if above is not None:
                        worst = max(worst, float(above - v.min()))
                    return _strict(worst)
                self.compiled.append(_Compiled(spec.name, spec.kind, fn))
            elif spec.kind == "twins_rank":
                key = f.get("twin_key", "twin_of")
                margin = float(f.get("margin", 0.0))
                probes = np.flatnonzero(episode_mask(frame, f.get("episodes") or {"behaviour": "hacker"}) & in_set)
                index = frame.episode_index()
                pairs = [(i, index[frame.ep_meta[i].get(key)]) for i in probes.tolist()
                         if frame.ep_meta[i].get(key) in index and in_set[index[frame.ep_meta[i].get(key)]]]
                if not pairs:
                    self._skip(spec.name, "no probe episode of the training split has its twin there")
                    continue
                if len(pairs) < probes.size:
                    self.skipped.append({"name": spec.name, "reason": f"{probes.size - len(pairs)} probe "
                                         "episodes have no twin in the training split; the others are checked",
                                         "partial": True})
                p = np.array(pairs, dtype=np.int64)

                def fn(tr, p=p, margin=margin, metric_of=metric_of):
                    v = metric_of(tr)
                    return _strict(float((margin - (v[p[:, 1]] - v[p[:, 0]])).max()))
                self.compiled.append(_Compiled(spec.name, spec.kind, fn))
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

                def fn(tr, both=both, y=y, minimum=minimum, metric_of=metric_of):
                    return float(minimum - auc(metric_of(tr)[both], y))
                self.compiled.append(_Compiled(spec.name, spec.kind, fn))
            elif spec.kind == "component_range":
                name = f["component"]
                use = f.get("value", "raw")
                filt = dict(f.get("steps") or {})
                lo_b, hi_b = f.get("min"), f.get("max")
                depends = name in tuned_components if use == "raw" else True

                def bounds_violation(values: np.ndarray, lo_b=lo_b, hi_b=hi_b) -> float:
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
                        def fn(tr, j=j, rows=rows, bv=bounds_violation):
                            lvl = tr.model.col_level[j]
                            earn = tr.combined.earn[lvl, rows] if lvl < tr.model.n_levels else True
                            return bv(tr.w_step[j] * tr.step_values[j, rows] * earn)
                    else:
                        def fn(tr, j=j, rows=rows, bv=bounds_violation):
                            return bv(tr.step_values[j, rows])
                else:
                    k = episode_names.index(name)
                    last_ok = step_mask(frame, {**filt, "last": True}) & step_in_set
                    eps = np.unique(frame.episode[last_ok])
                    if eps.size == 0:
                        self._skip(spec.name, "no episode of the training split matches its filter")
                        continue
                    if use == "contribution":
                        def fn(tr, k=k, eps=eps, bv=bounds_violation):
                            return bv(tr.episode_values[eps, k] * tr.w_episode[k])
                    else:
                        def fn(tr, k=k, eps=eps, bv=bounds_violation):
                            return bv(tr.episode_values[eps, k])
                target = self.compiled if depends else self.constant
                target.append(_Compiled(spec.name, spec.kind, fn))

    def _skip(self, name: str, reason: str) -> None:
        self.skipped.append({"name": name, "reason": reason})

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.compiled]

    def values(self, trial: _Trial) -> dict[str, float]:
        """Constraint value per expectation (≤ 0: satisfied)."""
        return {c.name: c.evaluate(trial) for c in self.compiled}

    def check_constant(self, trial: _Trial) -> None:
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


# =========================================================================== the problem
class TuningProblem:
    """The data and the fixed parts of a study: template, frame(s), component matrix,
    split, search space, return model and compiled constraints.

    :meth:`trial_state` is the one per-trial computation shared by the objectives."""

    def __init__(self, template: Template, frame: StepsFrame, matrix: "ComponentMatrix",
                 space: SearchSpace, held_out: np.ndarray, *, ctx: Any = None,
                 label_frame: StepsFrame | None = None):
        self.template, self.frame, self.matrix, self.space = template, frame, matrix, space
        #: the same episodes with their recorded outcomes: what expectation filters such as
        #: ``{resolved: true}`` select on, even while the components see the outcome withheld
        self.label_frame = label_frame if label_frame is not None else frame
        if self.label_frame.content_hash != frame.content_hash and \
                not np.array_equal(self.label_frame.ep_len, frame.ep_len):
            raise ValueError("label_frame must hold the same episodes as frame")
        self.held_out = held_out
        self.train_idx = np.flatnonzero(~held_out)
        self.held_idx = np.flatnonzero(held_out)
        self.model = ReturnModel(template, frame)
        #: step values [C, N] and episode terms [E, K] (see matrix_layout)
        self.M, self.E, self._m_transposed, self._e_transposed = matrix_layout(matrix, frame, template)
        self.ctx = ctx
        # columns of components under trial parameters, most recent last (bounded: a
        # continuous parameter gives every trial a new column)
        self._columns: OrderedDict[tuple[str, str], np.ndarray] = OrderedDict()
        #: components evaluated because a trial changed their parameters (the rest is reused)
        self.recomputed: list[str] = []
        tuned = {k.split(".", 1)[0] for k in space.params}
        self.constraints = ExpectationConstraints(template, self.label_frame, self.train_idx, tuned)
        baseline = self.trial_state(template.weights(), {})
        self.constraints.check_constant(baseline)

    def _column(self, name: str, params: Mapping[str, Any]) -> tuple[np.ndarray, bool]:
        """Values of component ``name`` under ``params`` (memoised; ``True`` = episode term)."""
        spec = self.template.component(name)
        merged = {**dict(spec.params), **dict(params)}
        key = (name, json.dumps(merged, sort_keys=True, default=str))
        scope_episode = spec.group == "episode"
        if key in self._columns:
            self._columns.move_to_end(key)
            return self._columns[key], scope_episode
        from core.rewards.components import ScoringContext

        # Not through the workspace's component cache: a continuous parameter would leave
        # one column file per trial on disk.  The sentence embeddings stay cached (ctx).
        comp = build_component(replace(spec, params=merged))
        values = np.asarray(comp(self.frame, self.ctx or ScoringContext()), dtype=np.float64)
        if values.shape != ((self.frame.n_episodes,) if scope_episode else (self.frame.n_steps,)) \
                or not np.isfinite(values).all():
            raise InputError(f"component {name!r} with parameters {merged} gave unusable values",
                             field="bounds")
        self.recomputed.append(name)
        self._columns[key] = values
        if len(self._columns) > COLUMN_MEMO:
            self._columns.popitem(last=False)
        return values, scope_episode

    def trial_state(self, weights: Mapping[str, float], params: Mapping[str, Mapping[str, Any]]) -> _Trial:
        """Everything a trial's weights and parameters give (returns, gates, values)."""
        M, E = self.M, self.E
        if params:
            M, E = M.copy(), E.copy()
            for name, p in params.items():
                values, is_episode = self._column(name, p)
                if is_episode:
                    E[:, self.model.episode_names.index(name)] = values
                else:
                    M[self.model.step_names.index(name)] = values
        ws, we = self.model.weight_vectors(weights)
        combined = self.model.combine(ws, we, M, E)
        return _Trial(combined=combined, w_step=ws, w_episode=we, step_values=M, episode_values=E,
                      model=self.model)

    def pyramid_matrix(self, template: Template, step_values: np.ndarray, episode_values: np.ndarray,
                       episodes: np.ndarray | None = None) -> "ComponentMatrix":
        """A :class:`~core.rewards.pyramid.ComponentMatrix` in the pyramid's own layout, of
        all episodes or of ``episodes`` only (their steps, in order)."""
        from core.rewards.pyramid import ComponentMatrix

        M, E = step_values, episode_values
        if episodes is not None:
            f = self.frame
            lens, starts = f.ep_len[episodes], f.ep_start[episodes]
            rows = np.arange(int(lens.sum()), dtype=np.int64) + np.repeat(
                starts - np.concatenate([[0], np.cumsum(lens)[:-1]]), lens)
            M, E = M[:, rows], E[episodes]
        return ComponentMatrix(self.matrix.step_names, np.ascontiguousarray(M.T if self._m_transposed else M),
                               self.matrix.episode_names,
                               np.ascontiguousarray(E.T if self._e_transposed else E),
                               template.components_hash())

    def template_for(self, weights: Mapping[str, float], params: Mapping[str, Mapping[str, Any]]) -> Template:
        """The template with a trial's weights and parameters written in."""
        t = self.template.with_weights({k: float(v) for k, v in weights.items()})
        for name, p in params.items():
            t = t.with_params(name, {**dict(t.component(name).params), **dict(p)})
        return t


# =========================================================================== objectives
class TuningObjective(abc.ABC):
    """An Optuna objective over a :class:`TuningProblem` (maximised).

    Contract: ``__call__(trial)`` draws the trial's weights and parameters from the
    problem's space, sets one constraint per compiled expectation
    (``trial.set_constraint``), stores the held-out figure as the user attribute
    ``held_out`` and returns the training figure.  :meth:`figures` gives the full
    train/held-out figures of any weights (for the baseline and the best trial)."""

    name: str = ""
    #: Prune trials that break an expectation before measuring them (worth it when
    #: measuring is expensive; they can never be the best trial anyway).
    skip_infeasible: bool = False

    def __init__(self, problem: TuningProblem):
        self.problem = problem

    def __call__(self, trial: optuna.Trial) -> float:
        weights, params = self.problem.space.suggest(trial)
        state = self.problem.trial_state(weights, params)
        broken = []
        for key, value in self.problem.constraints.values(state).items():
            trial.set_constraint(key, value)
            if value > 0:
                broken.append(key)
        if broken and self.skip_infeasible:
            raise optuna.TrialPruned(f"breaks {', '.join(broken)}: not trained")
        train, held = self.measure(state, trial)
        if train is None:
            raise optuna.TrialPruned("the training split gives no figure for these weights")
        trial.set_user_attr("held_out", held)
        return train

    @abc.abstractmethod
    def measure(self, state: _Trial, trial: optuna.Trial | None) -> tuple[float | None, float | None]:
        """(training figure, held-out figure) of one trial."""

    @abc.abstractmethod
    def figures(self, weights: Mapping[str, float], params: Mapping[str, Mapping[str, Any]]
                ) -> dict[str, dict[str, Any]]:
        """``{"train": {...}, "held_out": {...}}`` for the given weights."""


class OutcomeObjective(TuningObjective):
    """Returns should rank successful episodes above failed ones: the statistic (soft AUC,
    AUC or Kendall τ) averaged over task-grouped folds of the design tasks (the problem's
    training side), less :meth:`penalty`; reported on the outer held-out tasks (see the
    module docstring for why this design and not a choice by held-out figures).

    Each trial records the user attributes ``held_out`` (the statistic on the held-out
    tasks), ``held_out_auc``, ``cv`` (the mean over folds, before the penalty), ``cv_auc``
    (the mean fold AUC), ``cv_auc_folds`` and ``penalty``.  Folds whose episodes all share
    one outcome cannot rank anything and are left out (:attr:`folds` holds the others)."""

    name = "outcome"

    def __init__(self, problem: TuningProblem, labels: Labels, metric: str = "soft_auc", *,
                 groups: np.ndarray, n_folds: int = CV_FOLDS, seed: int = 0, penalty: float = 0.0):
        from core.rewards.outcomes import grouped_folds

        super().__init__(problem)
        self.labels, self.metric, self.penalty_weight = labels, metric, float(penalty)
        known = labels.known
        self.train = problem.train_idx[known[problem.train_idx]]
        self.held = problem.held_idx[known[problem.held_idx]]
        for side, idx in (("design (training)", self.train), ("held-out", self.held)):
            s = labels.success[idx]
            if idx.size == 0 or s.min() == s.max():
                raise InputError(f"the {side} split needs episodes with a known outcome of both kinds "
                                 f"(it has {int((s == 1).sum())} successful and {int((s == 0).sum())} "
                                 "failed); import outcomes (--reward-key), choose another label, split_by "
                                 "or held-out fraction", field="split_by")
        dealt = [self.train[rows] for rows in grouped_folds(groups[self.train], n_folds, seed=seed)]
        #: the design folds that hold both outcomes (episode indices)
        self.dealt = dealt
        self.folds = [f for f in dealt if 0 < labels.success[f].sum() < f.size]
        if len(self.folds) < 2:
            raise InputError(f"only {len(self.folds)} of the {len(dealt)} task-grouped folds of the design "
                             "episodes hold both outcomes; use fewer folds (--folds) or a smaller held-out "
                             "fraction", field="cv_folds")
        self.groups = groups
        # fixed (success, failure) pairs of each fold and of the held-out side (positions within it)
        self.fold_pairs = [outcome_pairs(labels.success[f]) for f in self.folds]
        self.held_pairs = outcome_pairs(labels.success[self.held])
        space = problem.space
        self.tuned = [k for k, (lo, hi) in space.weights.items() if hi > lo]
        base = problem.template.weights()
        self.anchor = np.array([min(max(base[k], space.weights[k][0]), space.weights[k][1]) for k in self.tuned])
        self.span = np.array([space.weights[k][1] - space.weights[k][0] for k in self.tuned])
        names = problem.model.step_names + problem.model.episode_names
        self._position = np.array([names.index(k) for k in self.tuned], dtype=np.int64)

    def penalty(self, state: _Trial) -> float:
        """:data:`SMALL_DATA_PENALTY`-style pull: weight × mean over the tuned weights of
        ((w − w_template) / (high − low))² (0 when the data is comfortable)."""
        if self.penalty_weight == 0.0 or not self.tuned:
            return 0.0
        w = np.concatenate([state.w_step, state.w_episode])[self._position]
        return float(self.penalty_weight * np.mean(((w - self.anchor) / self.span) ** 2))

    def _stat(self, returns: np.ndarray, idx: np.ndarray, pairs: tuple[np.ndarray, np.ndarray],
              metric: str) -> float | None:
        if metric == "soft_auc":
            return soft_auc(returns[idx], *pairs)
        if metric == "auc":
            return auc(returns[idx], self.labels.success[idx])
        return kendall_tau(returns[idx], self.labels.value[idx])

    def _cv(self, returns: np.ndarray, metric: str) -> tuple[float | None, list[float | None]]:
        per_fold = [self._stat(returns, f, p, metric) for f, p in zip(self.folds, self.fold_pairs)]
        values = [v for v in per_fold if v is not None]
        return (float(np.mean(values)) if values else None), per_fold

    def measure(self, state, trial):
        r = state.combined.returns
        cv, _ = self._cv(r, self.metric)
        held = self._stat(r, self.held, self.held_pairs, self.metric)
        penalty = self.penalty(state)
        if trial is not None:
            cv_auc, folds = self._cv(r, "auc")
            trial.set_user_attr("cv", cv)
            trial.set_user_attr("cv_auc", cv_auc)
            trial.set_user_attr("cv_auc_folds", folds)
            trial.set_user_attr("held_out_auc", auc(r[self.held], self.labels.success[self.held]))
            trial.set_user_attr("penalty", penalty)
        return (None if cv is None else cv - penalty), held

    def figures(self, weights, params):
        state = self.problem.trial_state(weights, params)
        r = state.combined.returns
        y = self.labels.success
        cv_auc, auc_folds = self._cv(r, "auc")
        train = {"auc": cv_auc, "soft_auc": self._cv(r, "soft_auc")[0], "kendall_tau": self._cv(r, "kendall")[0],
                 "auc_folds": auc_folds, "folds": len(self.folds), "penalty": self.penalty(state),
                 "episodes": int(self.train.size), "successes": int(y[self.train].sum())}
        held = {"auc": auc(r[self.held], y[self.held]), "soft_auc": soft_auc(r[self.held], *self.held_pairs),
                "kendall_tau": kendall_tau(r[self.held], self.labels.value[self.held]),
                "episodes": int(self.held.size), "successes": int(y[self.held].sum())}
        return {"train": train, "held_out": held}

    def split_summary(self) -> dict[str, Any]:
        """Which tasks (groups) lie where: the held-out ones and those of each design fold
        (``unused_folds``: positions of the folds left out for holding one outcome only)."""
        def names(idx: np.ndarray) -> list[str]:
            return sorted({str(g) for g in self.groups[idx].tolist()})
        used = {id(f) for f in self.folds}
        return {"held_out_groups": names(self.problem.held_idx), "design_folds": [names(f) for f in self.dealt],
                "folds_used": len(self.folds),
                "unused_folds": [i for i, f in enumerate(self.dealt) if id(f) not in used],
                "labelled_design_episodes": int(self.train.size),
                "labelled_held_out_episodes": int(self.held.size)}


class PreferenceObjective(TuningObjective):
    """Returns should order each analyst-labelled pair as the analyst did."""

    name = "preferences"

    def __init__(self, problem: TuningProblem, better: np.ndarray, worse: np.ndarray):
        super().__init__(problem)
        held = problem.held_out[better]  # a pair goes with its preferred episode's group
        self.train = (better[~held], worse[~held])
        self.held = (better[held], worse[held])
        if self.train[0].size == 0:
            raise InputError("no preference pair falls in the training split; add more pairs or "
                             "change split_by / the held-out fraction", field="preferences")

    def measure(self, state, trial):
        r = state.combined.returns
        return pair_agreement(r, *self.train), pair_agreement(r, *self.held)

    def figures(self, weights, params):
        r = self.problem.trial_state(weights, params).combined.returns
        return {side: {"agreement": pair_agreement(r, *pairs), "pairs": int(pairs[0].size)}
                for side, pairs in (("train", self.train), ("held_out", self.held))}


class PolicyObjective(TuningObjective):
    """A short PPO run per trial: success rate of the trained greedy policy.

    Each update reports the rollout success rate (``trial.report``) so the pruner can stop
    the run; review requests of the curriculum's L3 are not enqueued from tuning runs."""

    name = "policy"
    skip_infeasible = True

    def __init__(self, problem: TuningProblem, training_data: Any, cfg: Any):
        import torch

        super().__init__(problem)
        tables = training_data.tables
        if [str(x) for x in problem.frame.episode_ids.tolist()] != list(tables.episode_ids):
            raise InputError("the simulator lists the episodes in another order than the reward frame; "
                             "rebuild the dataset's state features", field="dataset")
        self.base, self.cfg = training_data, cfg
        self.train = torch.as_tensor(problem.train_idx, dtype=torch.int64)
        self.held = torch.as_tensor(problem.held_idx, dtype=torch.int64)

    def _tables(self, state: _Trial) -> Any:
        import torch

        tb = self.base.tables
        contrib = self.problem.model.contributions(state.combined, state.w_step, state.step_values)
        tensors = dict(tb.tensors)
        tensors.update({
            "step_reward": torch.as_tensor(state.combined.step_reward, dtype=torch.float32),
            "step_reward64": torch.as_tensor(state.combined.step_reward, dtype=torch.float64),
            "components": torch.as_tensor(np.ascontiguousarray(contrib.T), dtype=torch.float32),
            "final": torch.as_tensor(state.combined.final, dtype=torch.float64),
            "episode_return": torch.as_tensor(state.combined.returns, dtype=torch.float64)})
        return replace(tb, tensors={k: v.to(tb.device) for k, v in tensors.items()})

    def _train(self, state: _Trial, trial: optuna.Trial | None) -> tuple[Any, Any]:
        from core.rl import ppo
        from core.rl.sim import logged_returns

        tables = self._tables(state)
        data = ppo.TrainingData(tables=tables, train_episodes=self.train, heldout_episodes=self.held,
                                logged_returns=logged_returns(tables, self.train), approved=self.base.approved,
                                dataset=self.base.dataset, source=self.base.source)
        with tempfile.TemporaryDirectory(prefix="rwb-tune-ppo-") as tmp:
            recorder = _TrialRecorder(trial, Path(tmp))
            result = ppo.train(self.cfg, data, recorder=recorder)
        if recorder.pruned:
            raise optuna.TrialPruned(f"pruned after update {recorder.last_step}")
        return result.agent, tables

    def _success(self, tables: Any, agent: Any, episodes: Any) -> float | None:
        from core.rl.ppo import episode_stats

        if episodes.numel() == 0:
            return None
        stats = episode_stats(tables, agent, episodes, every_episode=True, seed=self.cfg.seed,
                              device=agent_device(agent))
        value = stats["success_rate"]
        return None if value is None or not math.isfinite(value) else float(value)

    def measure(self, state, trial):
        agent, tables = self._train(state, trial)
        return self._success(tables, agent, self.train), self._success(tables, agent, self.held)

    def figures(self, weights, params):
        agent, tables = self._train(self.problem.trial_state(weights, params), None)
        return {"train": {"success_rate": self._success(tables, agent, self.train)},
                "held_out": {"success_rate": self._success(tables, agent, self.held)}}


def agent_device(agent: Any) -> Any:
    """The device an agent's parameters live on."""
    return next(agent.parameters()).device


@dataclass
class _TrialRecorder:
    """core.rl.ppo's Recorder for one tuning trial: reports, prunes, keeps no checkpoint."""

    trial: optuna.Trial | None
    folder: Path
    run_id: str = "tuning"
    pruned: bool = False
    last_step: int = 0

    def on_update(self, update_idx: int, env_steps: int, metrics: Mapping[str, Any]) -> bool:
        self.last_step = update_idx
        value = metrics.get("success_rate")
        if self.trial is None or value is None or not math.isfinite(float(value)):
            return False
        self.trial.report(float(value), update_idx)
        if self.trial.should_prune():
            self.pruned = True
            return True
        return False

    def checkpoint_dir(self, update_idx: int) -> Path:
        return self.folder / f"{update_idx:06d}"

    def on_checkpoint(self, update_idx: int, env_steps: int, path: Path) -> None:
        shutil.rmtree(path, ignore_errors=True)  # a trial's policy is not kept

    def on_review(self, requests: Sequence[Any]) -> int:
        return 0


# =========================================================================== preference labels
def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def add_preference(ws: "Workspace", actor: Actor, dataset: str, better: str, worse: str,
                   comment: str | None = None) -> dict[str, Any]:
    """Record an analyst's label "episode ``better`` is better than episode ``worse``".

    Both episodes must be in ``dataset``; the same person cannot label the same ordered pair
    twice (:class:`~core.base.errors.ConflictError`).  Needs ``edit_template``."""
    authorize(ws, actor, "edit_template")
    ws.require_dataset(dataset)
    better, worse = str(better).strip(), str(worse).strip()
    if better == worse:
        raise InputError("a preference compares two different episodes", field="worse")
    known = {r[0] for r in ws.conn.execute(
        "SELECT episode_id FROM episodes WHERE dataset=? AND episode_id IN (?, ?)", (dataset, better, worse))}
    for eid, what in ((better, "better"), (worse, "worse")):
        if eid not in known:
            raise InputError(f"no episode {eid!r} in dataset {dataset!r}", field=what)
    with ws.transaction() as conn:
        dup = conn.execute("SELECT id FROM preferences WHERE dataset=? AND better_id=? AND worse_id=? "
                           "AND created_by=?", (dataset, better, worse, actor.name)).fetchone()
        if dup is not None:
            raise ConflictError(f"{actor.name} already labelled {better} better than {worse} "
                                f"(preference #{dup[0]})")
        cur = conn.execute("INSERT INTO preferences(dataset, better_id, worse_id, comment, created_by, "
                           "created_at) VALUES (?,?,?,?,?,?)",
                           (dataset, better, worse, (comment or "").strip() or None, actor.name, _now()))
        pid = cur.lastrowid
    return next(p for p in list_preferences(ws, dataset) if p["id"] == pid)


def list_preferences(ws: "Workspace", dataset: str | None = None) -> list[dict[str, Any]]:
    """Preference labels (oldest first), of one dataset or all."""
    sql = "SELECT id, dataset, better_id, worse_id, comment, created_by, created_at FROM preferences"
    args: tuple[Any, ...] = ()
    if dataset is not None:
        sql += " WHERE dataset=?"
        args = (dataset,)
    cols = ("id", "dataset", "better", "worse", "comment", "created_by", "created_at")
    return [dict(zip(cols, r)) for r in ws.conn.execute(sql + " ORDER BY id", args)]


def preference_pairs(ws: "Workspace", dataset: str, frame: StepsFrame) -> tuple[np.ndarray, np.ndarray]:
    """(better, worse) episode indices of ``dataset``'s preference labels in ``frame``."""
    prefs = list_preferences(ws, dataset)
    if not prefs:
        raise InputError(f"dataset {dataset!r} has no preference labels yet; add some (rwb tune prefer "
                         "BETTER WORSE --dataset NAME, or the Tuning page)", field="preferences")
    index = frame.episode_index()
    missing = sorted({p[k] for p in prefs for k in ("better", "worse") if p[k] not in index})
    if missing:
        raise InputError(f"preference labels name episodes that are not in the data: "
                         f"{', '.join(missing[:5])}", field="preferences")
    return (np.array([index[p["better"]] for p in prefs], dtype=np.int64),
            np.array([index[p["worse"]] for p in prefs], dtype=np.int64))


# =========================================================================== data and template
@dataclass(frozen=True)
class TemplateRef:
    """The template a study tunes: its text, and the workspace version it came from."""

    template: Template
    name: str
    version: int | None
    yaml: str
    ref: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.yaml.encode("utf-8")).hexdigest()


def resolve_template_ref(ws: "Workspace | None", template: Template | str | Path) -> TemplateRef:
    """A ``--template`` argument (file, ``name``, ``name@N``, or a Template) with its version."""
    from core.rewards.template import parse_template
    from core.rewards.versions import get_template, parse_spec

    if isinstance(template, Template):
        return TemplateRef(template, template.name, None, template.to_yaml(), template.name)
    spec = str(template)
    path = Path(spec)
    if path.is_file() or spec.endswith((".yaml", ".yml")):
        if not path.is_file():
            raise InputError(f"no template file {spec!r}", field="template")
        text = path.read_text(encoding="utf-8")
        t = parse_template(text, file=str(path))
        return TemplateRef(t, t.name, None, text, spec)
    if ws is None:
        from core.rewards.template import load_template

        t = load_template(spec)
        return TemplateRef(t, t.name, None, t.to_yaml(), spec)
    name, version = parse_spec(spec)
    tv = get_template(ws, name, version)
    return TemplateRef(tv.template(), name, tv.version, tv.yaml, spec)


def withhold_outcomes(frame: StepsFrame) -> StepsFrame:
    """The frame with every outcome field unknown (components see no label); its own cache key."""
    nan = np.full(frame.n_episodes, np.nan)
    digest = hashlib.sha256(f"{frame.content_hash}|outcome-withheld".encode()).hexdigest()
    return replace(frame, resolved=nan, final_reward=nan.copy(), business_metric=nan.copy(),
                   sentiment=nan.copy(), content_hash=digest, _cache={})


def load_data(ws: "Workspace | None", *, dataset: str | None, episodes: str | Path | None) -> StepsFrame:
    """The steps frame of a workspace dataset or an episodes file."""
    return load_episodes_and_frame(ws, dataset=dataset, episodes=episodes)[1]


def load_episodes_and_frame(ws: "Workspace | None", *, dataset: str | None, episodes: str | Path | None
                            ) -> tuple[list["Episode"], StepsFrame]:
    """The episodes of a workspace dataset or an episodes file, and their steps frame (the
    episodes carry what the frame does not: the imported record, where task ids live)."""
    from core.rewards.api import frame_from_episodes
    from core.rewards.frame import build_frame

    if (dataset is None) == (episodes is None):
        raise InputError("give exactly one of a dataset (--dataset NAME) or an episodes file "
                         "(--episodes FILE)", field="dataset")
    if episodes is not None:
        from core.data.importers import read_file

        if not Path(episodes).is_file():
            raise InputError(f"no episodes file {str(episodes)!r}", file=str(episodes))
        parsed = read_file(episodes)
        return parsed.episodes, frame_from_episodes(parsed.episodes, parsed.tools)
    if ws is None:
        raise InputError("tuning on a dataset needs a workspace", field="dataset")
    from core.records.catalog import catalog_for_dataset

    eps = ws.load_episodes(dataset)
    return eps, build_frame(eps, catalog_for_dataset(ws, dataset))


def default_study_name(ref: TemplateRef, cfg: TuneConfig, data_name: str, space: SearchSpace) -> str:
    """``<template>-<objective>-<data>-<hash>``: the same template text, data, settings and
    space give the same name (so running again adds trials to the same study)."""
    body = json.dumps({"template": ref.sha256, "config": cfg.to_dict(), "space": space.to_dict(),
                       "data": data_name}, sort_keys=True, default=str)
    short = hashlib.sha256(body.encode()).hexdigest()[:8]
    return f"{ref.name}-{cfg.objective}-{data_name}-{short}"


def _data_name(dataset: str | None, episodes: str | Path | None) -> str:
    return dataset if dataset is not None else Path(str(episodes)).stem


def make_sampler(cfg: TuneConfig, *, distributed: bool) -> optuna.samplers.BaseSampler:
    """Multivariate TPE (weights interact through the gates), with the constant-liar
    heuristic when several workers share the study; or random search."""
    if cfg.sampler == "random":
        return optuna.samplers.RandomSampler(seed=cfg.seed)
    # Distributed workers get different seeds: identical seeds would propose identical points.
    seed = cfg.seed if not distributed else (cfg.seed * 1_000_003 + os.getpid()) % 2**31
    return optuna.samplers.TPESampler(seed=seed, multivariate=True, constant_liar=distributed,
                                      n_startup_trials=10)


# =========================================================================== workspace records
def _store_url(url: str | None) -> str | None:
    """What the workspace keeps of a storage URL: nothing for the default, the URL with any
    password masked otherwise (secrets stay out of the workspace database)."""
    return None if url is None else describe_url(url)


def _record_study(ws: "Workspace", actor: Actor, name: str, storage: str | None, attrs: Mapping[str, Any]) -> None:
    with ws.transaction() as conn:
        conn.execute(
            "INSERT OR IGNORE INTO tuning_studies(name, storage, objective, template_name, template_version, "
            "template_sha256, dataset, episodes_file, config, created_by, created_at) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            (name, _store_url(storage), attrs["config"]["objective"], attrs["template"]["name"],
             attrs["template"]["version"], attrs["template"]["sha256"], attrs["data"]["dataset"],
             attrs["data"]["episodes_file"], json.dumps(attrs["config"], sort_keys=True), actor.name, _now()))


def _process_alive(pid: int | None, host: str | None) -> bool | None:
    from core.rl.runs import process_alive

    return process_alive(pid, host)


#: Seconds a launched worker may sit without a recorded process and still count as running.
LAUNCH_GRACE_S = 60


def _running_local(ws: "Workspace", name: str, exclude_run: int | None) -> dict[str, Any] | None:
    """The worker run (id, pid, host) that tunes study ``name`` on the workspace's storage now:
    its process alive (or on another host), or launched under :data:`LAUNCH_GRACE_S` ago and its
    process not recorded yet.  None when there is none."""
    recent = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - LAUNCH_GRACE_S))
    for row in ws.conn.execute(
            "SELECT r.id, r.pid, r.host, r.status, r.started_at FROM tuning_runs r JOIN tuning_studies s "
            "ON s.name = r.study WHERE r.study=? AND r.status IN ('starting','running') AND s.storage IS NULL",
            (name,)):
        if row[0] == exclude_run or (row[1] is not None and row[1] == os.getpid()):
            continue
        queued = row[1] is None and row[3] == "starting" and (row[4] or "") >= recent
        if queued or (row[1] is not None and _process_alive(row[1], row[2]) is not False):
            return {"run": row[0], "pid": row[1], "host": row[2]}
    return None


def _start_run(ws: "Workspace", actor: Actor, study: str, trials: int, run_id: int | None) -> int:
    with ws.transaction() as conn:
        if run_id is not None:
            row = conn.execute("SELECT study, status FROM tuning_runs WHERE id=?", (run_id,)).fetchone()
            if row is None or row[0] != study:
                raise InputError(f"no tuning run {run_id} of study {study!r}", field="run_id")
            conn.execute("UPDATE tuning_runs SET status='running', pid=?, host=?, heartbeat_at=? WHERE id=?",
                         (os.getpid(), socket.gethostname(), _now(), run_id))
            return run_id
        cur = conn.execute(
            "INSERT INTO tuning_runs(study, status, trials_requested, pid, host, started_by, started_at, "
            "heartbeat_at) VALUES (?, 'running', ?, ?, ?, ?, ?, ?)",
            (study, trials, os.getpid(), socket.gethostname(), actor.name, _now(), _now()))
        return int(cur.lastrowid)


def _heartbeat(ws: "Workspace", run_id: int, done: int, best: float | None) -> bool:
    """Record progress; True when a stop was requested."""
    with ws.transaction() as conn:
        conn.execute("UPDATE tuning_runs SET trials_done=?, best_value=?, heartbeat_at=? WHERE id=?",
                     (done, best, _now(), run_id))
        row = conn.execute("SELECT stop_requested FROM tuning_runs WHERE id=?", (run_id,)).fetchone()
    return bool(row and row[0])


def _end_run(ws: "Workspace", run_id: int, status: str, *, done: int, best: float | None,
             per_min: float | None = None, error: str | None = None) -> None:
    with ws.transaction() as conn:
        conn.execute("UPDATE tuning_runs SET status=?, trials_done=?, best_value=?, trials_per_min=?, "
                     "error=?, ended_at=?, heartbeat_at=? WHERE id=?",
                     (status, done, best, per_min, error, _now(), _now(), run_id))


def _best_value(study: optuna.Study) -> float | None:
    """The feasible best value so far (None before any feasible trial)."""
    try:
        return float(study.best_value)
    except ValueError:
        return None


# =========================================================================== running a study
@dataclass
class TuneResult:
    """What :func:`tune` returns (``--json`` prints :meth:`to_dict`)."""

    study: str
    storage: str
    objective: str
    metric: str
    trials_run: int
    trials_total: int
    feasible_trials: int
    stopped: bool
    seconds: float
    trials_per_min: float
    #: process CPU seconds of the optimisation (on a shared machine, wall time includes waiting)
    cpu_seconds: float
    baseline: dict[str, Any]
    best: dict[str, Any] | None
    skipped_expectations: list[dict[str, Any]]
    split: dict[str, Any]
    recomputed_components: list[str]
    run_id: int | None = None
    #: what the analyst should know about the result (small labelled set, …)
    warnings: list[str] = field(default_factory=list)
    #: the trials this call ran (at most TRIAL_ROWS, the most recent): number, state, value,
    #: held_out, held_out_auc, cv_auc, penalty, params, feasible
    trials: list[dict[str, Any]] = field(default_factory=list)

    @property
    def best_value(self) -> float | None:
        return None if self.best is None else self.best["value"]

    def to_dict(self) -> dict[str, Any]:
        return _finite(asdict(self) | {"best_value": self.best_value,
                                       "best_weights": None if self.best is None else self.best["weights"]})


def _finite(x: Any) -> Any:
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    if isinstance(x, np.generic):
        return _finite(x.item())
    return x


def _objective_metric(cfg: TuneConfig) -> str:
    return {"outcome": cfg.metric if cfg.metric != "kendall" else "kendall_tau", "preferences": "agreement",
            "policy": "success_rate"}[cfg.objective]


def tune(ws: "Workspace", actor: Actor, template: Template | str | Path, *, dataset: str | None = None,
         episodes: str | Path | None = None, frame: StepsFrame | None = None,
         config: TuneConfig | None = None, trials: int = 100,
         storage: str | None = None, study: str | None = None, bounds: Mapping[str, Any] | None = None,
         fixed: Sequence[str] = (), timeout: float | None = None, flush_seconds: float = 1.0,
         run_id: int | None = None, progress: Callable[[dict[str, Any]], None] | None = None,
         groups: np.ndarray | None = None) -> TuneResult:
    """Run (or continue) a study: ``trials`` more trials of ``config.objective`` over the
    weights (and bounded parameters) of ``template`` on a dataset, an episodes file, or a
    steps ``frame`` the caller already holds (notebooks, benchmarks).  With a frame, the
    task of each episode is ``groups`` (:func:`task_groups` of the episodes it was built
    from) or, without them, the request text.

    ``progress``, when given, is called after every trial with ``{"study", "trials_done",
    "trials", "best_value", "trial": <the trial's row, as in TuneResult.trials>}``.

    ``storage``: None for the workspace's Optuna journal (in-memory trials, written in
    batches every ``flush_seconds``), or an SQLAlchemy URL (Optuna's RDB storage) or a
    journal file used directly (several workers may share it).  ``study``: its name (default: from the
    template, objective, data and settings, so a rerun continues it).  The first trial of a
    new study is the template's own weights (the baseline).  Needs ``train``."""
    from core.rewards.cache import ComponentCache
    from core.rewards.components import ScoringContext
    from core.rewards.pyramid import Pyramid

    authorize(ws, actor, "train")
    cfg = (config or TuneConfig()).validate()
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise InputError(f"trials must be a whole number ≥ 1, got {trials!r}", field="trials")
    if not flush_seconds > 0:
        raise InputError("flush_seconds must be > 0", field="flush_seconds")
    if cfg.objective == "preferences" and dataset is None:
        raise InputError("preference labels belong to a workspace dataset: give --dataset", field="dataset")

    # ------------------------------------------------------------------ data, template, split
    ref = resolve_template_ref(ws, template)
    t = ref.template
    if frame is not None:
        if dataset is not None or episodes is not None:
            raise InputError("give one of a dataset, an episodes file or a frame", field="dataset")
        if cfg.objective == "policy":
            raise InputError("the policy objective trains on a dataset or an episodes file, not a frame",
                             field="frame")
        full, loaded = frame, None
    else:
        if groups is not None:
            raise InputError("task groups go with a frame; a dataset or file has its own", field="groups")
        loaded, full = load_episodes_and_frame(ws, dataset=dataset, episodes=episodes)
    if full.n_episodes < 2:
        raise InputError("tuning needs at least two episodes", field="dataset")
    scoring = withhold_outcomes(full) if cfg.withholds else full
    outcome_readers = [c.name for c in t.all_components if c.component in OUTCOME_COMPONENTS]
    space = SearchSpace.for_template(t, bounds, fixed, exclude=outcome_readers if cfg.withholds else ())
    labels = outcome_labels(full, cfg.label, cfg.success_threshold)
    if groups is not None:
        if cfg.split_by != "task" or np.asarray(groups).shape != (full.n_episodes,):
            raise InputError(f"groups must give the task of each of the frame's {full.n_episodes} episodes "
                             "(split_by task)", field="groups")
        keys = np.asarray(groups, dtype=object)
    elif cfg.split_by == "task" and loaded is not None:
        keys = task_groups(full, loaded, cfg.group_key)
    else:
        if cfg.group_key is not None:
            raise InputError("group_key reads the imported records; give a dataset or an episodes file "
                             "(or the frame's task groups)", field="group_key")
        keys = split_keys(full, cfg.split_by)
    data_check = check_outcome_data(labels, keys, cfg.split_by) if cfg.objective == "outcome" else None
    held = split_episodes(keys, labels.success, cfg.heldout_fraction, cfg.seed)

    # ------------------------------------------------------------------ component matrix (once)
    from core.base.embed import workspace_embedder

    ctx = ScoringContext(embedder=workspace_embedder(ws))
    cache = ComponentCache.for_workspace(ws)
    matrix = Pyramid(t).compute_matrix(scoring, ctx=ctx, cache=cache)
    problem = TuningProblem(t, scoring, matrix, space, held, ctx=ctx, label_frame=full)
    if cfg.objective == "outcome":
        objective: TuningObjective = OutcomeObjective(problem, labels, cfg.metric, groups=keys, n_folds=cfg.cv_folds,
                                                      seed=cfg.seed, penalty=data_check.penalty)
    elif cfg.objective == "preferences":
        objective = PreferenceObjective(problem, *preference_pairs(ws, dataset, full))
    else:
        objective = _policy_objective(ws, problem, ref, cfg, dataset, episodes)

    base_weights = {k: t.weights()[k] for k in space.weights}
    baseline = {"weights": t.weights(),
                "figures": objective.figures(t.weights(), {}) if cfg.objective != "policy" else None,
                # the template's own weights against its expectations (training split)
                "constraints": problem.constraints.values(problem.trial_state(t.weights(), {}))}
    data_name = _data_name(dataset, episodes) if frame is None else f"frame-{full.content_hash[:8]}"
    name = study or default_study_name(ref, cfg, data_name, space)
    attrs = {
        "config": cfg.to_dict(), "space": space.to_dict(),
        "template": {"name": ref.name, "version": ref.version, "ref": ref.ref, "sha256": ref.sha256,
                     "yaml": ref.yaml},
        "data": {"dataset": dataset, "episodes_file": None if episodes is None else str(Path(episodes).resolve()),
                 "content_hash": full.content_hash, "n_episodes": full.n_episodes, "n_steps": full.n_steps},
        "split": {"by": cfg.split_by, "group_key": cfg.group_key, "groups": int(np.unique(keys.astype(str)).size),
                  "train_episodes": int((~held).sum()), "held_out_episodes": int(held.sum()),
                  **(objective.split_summary() if isinstance(objective, OutcomeObjective) else {})},
        "baseline": _finite(baseline), "metric": _objective_metric(cfg),
    }

    # ------------------------------------------------------------------ storage and study
    url = storage if storage is not None else default_storage_url(ws)
    distributed = storage is not None
    rdb = open_storage(url, heartbeat=distributed)
    sampler = make_sampler(cfg, distributed=distributed)
    pruner = (optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=2) if cfg.objective == "policy"
              else optuna.pruners.NopPruner())
    persisted = optuna.create_study(storage=rdb, study_name=name, direction="maximize", load_if_exists=True,
                                    sampler=sampler, pruner=pruner)
    existing = persisted.user_attrs.get(CONFIG_ATTR)
    if existing is None:
        persisted.set_user_attr(CONFIG_ATTR, attrs)
    else:
        _check_same_study(name, existing, attrs)
    _record_study(ws, actor, name, storage, attrs)
    if not distributed:
        other = _running_local(ws, name, run_id)
        if other is not None:
            raise ConflictError(f"study {name!r} is being tuned by process {other['pid']} on {other['host']} "
                                "(run {}); stop it first, or run several workers on a shared storage "
                                "(--storage)".format(other["run"]))
    if distributed:
        working, writer = persisted, None
    else:
        working = optuna.create_study(direction="maximize", sampler=sampler, pruner=pruner, study_name=name)
        prior = persisted.get_trials(deepcopy=False)
        working.add_trials(prior)
        writer = BatchedTrialWriter(rdb, name)
        if writer.written != len(prior):  # pragma: no cover - a writer between the two reads
            raise ConflictError(f"study {name!r} changed while it was being opened; try again")
    first = len(working.get_trials(deepcopy=False))   # this call's trials start here
    if not first:
        working.enqueue_trial({k: min(max(v, space.weights[k][0]), space.weights[k][1])
                               for k, v in base_weights.items()}, user_attrs={"baseline": True})

    # ------------------------------------------------------------------ optimise
    run = _start_run(ws, actor, name, trials, run_id)
    state = {"done": 0, "flushed_at": time.monotonic(), "stop": False, "stopped": False,
             "best": _best_value(working), "first": first}

    def flush(study_obj: optuna.Study, in_loop: bool = True) -> None:
        if writer is not None:
            fresh = []
            for tr in study_obj.get_trials(deepcopy=False)[writer.written:]:
                if not tr.state.is_finished():
                    break  # keep the written numbers contiguous
                fresh.append(tr)
            writer.write(fresh)
        best = _best_value(study_obj)
        if _heartbeat(ws, run, state["done"], best) or state["stop"]:
            state["stopped"] = True
            if in_loop:  # Study.stop works only from inside optimize (a callback)
                study_obj.stop()
        state["flushed_at"] = time.monotonic()

    def after_trial(study_obj: optuna.Study, frozen: optuna.trial.FrozenTrial) -> None:
        state["done"] += 1
        if progress is not None:
            row = trial_row(frozen)
            if row["feasible"] and (state["best"] is None or row["value"] > state["best"]):
                state["best"] = row["value"]   # running best: study.best_value is O(trials) per call
            progress({"study": name, "trials_done": state["done"], "trials": trials, "best_value": state["best"],
                      "trial": row})
        if state["stop"] or time.monotonic() - state["flushed_at"] >= flush_seconds:
            flush(study_obj)

    def on_sigterm(signum: int, frame: Any) -> None:  # noqa: ARG001 - stop politely after this trial
        state["stop"] = True

    previous = None
    try:
        previous = signal.signal(signal.SIGTERM, on_sigterm)
    except ValueError:  # not the main thread (a server): no handler, the stop flag still works
        previous = None
    t0, c0 = time.perf_counter(), time.process_time()
    status, error = "finished", None
    run_objective: Callable[[optuna.Trial], float] = objective
    if distributed:
        worker = f"{socket.gethostname()}:{os.getpid()}"

        def run_objective(trial: optuna.Trial) -> float:
            trial.set_user_attr("worker", worker)  # which worker ran it, in the shared study
            return objective(trial)
    try:
        working.optimize(run_objective, n_trials=trials, timeout=timeout, callbacks=[after_trial],
                         gc_after_trial=False, show_progress_bar=False)
    except BaseException as exc:
        status, error = "failed", f"{type(exc).__name__}: {exc}"
        raise
    finally:
        seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
        per_min = state["done"] / seconds * 60 if seconds > 0 else 0.0
        try:
            flush(working, in_loop=False)
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            if status == "finished" and state["stopped"]:
                status = "stopped"
            _end_run(ws, run, status, done=state["done"], best=_best_value(working), per_min=per_min, error=error)

    # ------------------------------------------------------------------ report
    all_trials = working.get_trials(deepcopy=False)
    complete = [tr for tr in all_trials if tr.state == optuna.trial.TrialState.COMPLETE]
    feasible = [tr for tr in complete if all(v <= 0 for v in tr.constraints.values())]
    best = None
    if feasible:
        bt = working.best_trial
        weights, params = space.decode(bt.params)
        full_weights = {**t.weights(), **weights}
        best = {"trial": bt.number, "value": bt.value, "held_out_value": bt.user_attrs.get("held_out"),
                "held_out_auc": bt.user_attrs.get("held_out_auc"), "cv_auc": bt.user_attrs.get("cv_auc"),
                "weights": full_weights, "params": params, "constraints": dict(bt.constraints)}
        if cfg.objective != "policy":
            best["figures"] = objective.figures(full_weights, params)
            best_t = problem.template_for(full_weights, params)
            best["expectations"] = _expectation_checks(best_t, problem, params)
    return TuneResult(
        study=name, storage=describe_url(url), objective=cfg.objective, metric=_objective_metric(cfg),
        trials_run=state["done"], trials_total=len(all_trials), feasible_trials=len(feasible),
        stopped=state["stopped"], seconds=seconds, trials_per_min=per_min, cpu_seconds=cpu_seconds,
        baseline=_finite(baseline),
        best=_finite(best), skipped_expectations=problem.constraints.skipped, split=attrs["split"],
        recomputed_components=sorted(set(problem.recomputed)), run_id=run,
        warnings=list(data_check.warnings) if data_check is not None else [],
        trials=_finite([trial_row(tr) for tr in all_trials[state["first"]:]][-TRIAL_ROWS:]))


def trial_row(trial: optuna.trial.FrozenTrial) -> dict[str, Any]:
    """One trial as the CLI, the result and the page list it."""
    complete = trial.state == optuna.trial.TrialState.COMPLETE
    attrs = trial.user_attrs
    return {"trial": trial.number, "state": trial.state.name.lower(), "value": trial.value,
            "held_out": attrs.get("held_out"), "held_out_auc": attrs.get("held_out_auc"),
            "cv_auc": attrs.get("cv_auc"), "penalty": attrs.get("penalty"), "params": dict(trial.params),
            "feasible": complete and all(v <= 0 for v in trial.constraints.values()),
            "baseline": bool(attrs.get("baseline", False))}


def _expectation_checks(template: Template, problem: TuningProblem,
                        params: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """``rwb reward check`` of a template on the train and held-out splits (slow path: the
    reference the compiled constraints are tested against)."""
    from core.rewards.expectations import evaluate_expectations
    from core.rewards.pyramid import ScoreResult

    if not template.expectations:
        return {}
    state = problem.trial_state(template.weights(), params)
    out = {}
    for side, idx in (("train", problem.train_idx), ("held_out", problem.held_idx)):
        # component values from the full matrix: history-dependent components keep the
        # whole data's context, as while tuning
        sub = problem.pyramid_matrix(template, state.step_values, state.episode_values, idx)
        report = evaluate_expectations(ScoreResult(template, problem.label_frame.take_episodes(idx), sub))
        out[side] = {"passed": report.passed,
                     "results": {r.name: {"passed": r.passed, "message": r.message} for r in report.results}}
    return out


def _check_same_study(name: str, existing: Mapping[str, Any], attrs: Mapping[str, Any]) -> None:
    """Workers (and reruns) of one study must tune the same thing."""
    diffs = []
    if existing["template"]["sha256"] != attrs["template"]["sha256"]:
        diffs.append("the template text")
    if existing["config"] != attrs["config"]:
        keys = sorted(k for k in set(existing["config"]) | set(attrs["config"])
                      if existing["config"].get(k) != attrs["config"].get(k))
        diffs.append("settings " + ", ".join(keys))
    if existing["space"] != attrs["space"]:
        diffs.append("the search space (bounds, fixed weights)")
    if existing["data"]["content_hash"] != attrs["data"]["content_hash"]:
        diffs.append("the episodes")
    if diffs:
        raise ConflictError(f"study {name!r} already exists with different {'; '.join(diffs)}; give another "
                            "--study name to start a new study")


def _policy_objective(ws: "Workspace", problem: TuningProblem, ref: TemplateRef, cfg: TuneConfig,
                      dataset: str | None, episodes: str | Path | None) -> PolicyObjective:
    from core.rl import ppo

    settings = {**POLICY_DEFAULTS, **dict(cfg.policy)}
    ppo_cfg = ppo.PPOConfig.from_dict(settings).validate()
    data = ppo.load_training_data(ws, ref.template, dataset=dataset, episodes_file=episodes, config=ppo_cfg)
    return PolicyObjective(problem, data, ppo_cfg)


# =========================================================================== studies of a workspace
_RUN_COLUMNS = ("id", "study", "status", "trials_requested", "trials_done", "best_value", "pid", "host",
                "log_path", "stop_requested", "started_by", "started_at", "heartbeat_at", "ended_at",
                "trials_per_min", "error")


def _run_dict(row: Sequence[Any]) -> dict[str, Any]:
    d = dict(zip(_RUN_COLUMNS, row))
    d["stop_requested"] = bool(d["stop_requested"])
    d["process_alive"] = _process_alive(d["pid"], d["host"]) if d["status"] in ("starting", "running") else False
    return d


def list_studies(ws: "Workspace") -> list[dict[str, Any]]:
    """Studies started from this workspace, newest first, each with its latest run."""
    out = []
    rows = ws.conn.execute("SELECT name, storage, objective, template_name, template_version, dataset, "
                           "episodes_file, created_by, created_at FROM tuning_studies ORDER BY created_at DESC, "
                           "name").fetchall()
    for r in rows:
        d = dict(zip(("name", "storage", "objective", "template_name", "template_version", "dataset",
                      "episodes_file", "created_by", "created_at"), r))
        runs = study_runs(ws, d["name"])
        d["runs"] = len(runs)
        d["latest_run"] = runs[-1] if runs else None
        d["status"] = _study_status(runs)
        out.append(d)
    return out


def study_runs(ws: "Workspace", name: str) -> list[dict[str, Any]]:
    """Worker processes that ran a study from this workspace, oldest first."""
    return [_run_dict(r) for r in ws.conn.execute(
        f"SELECT {', '.join(_RUN_COLUMNS)} FROM tuning_runs WHERE study=? ORDER BY id", (name,))]


def _study_status(runs: Sequence[Mapping[str, Any]]) -> str:
    if any(r["status"] in ("starting", "running") and r["process_alive"] is not False for r in runs):
        return "running"
    if not runs:
        return "new"
    last = runs[-1]
    return "interrupted" if last["status"] in ("starting", "running") else last["status"]


def get_study(ws: "Workspace", name: str) -> dict[str, Any]:
    """One study's workspace record (InputError when this workspace never ran it)."""
    for s in list_studies(ws):
        if s["name"] == name:
            return s
    known = ", ".join(s["name"] for s in list_studies(ws)[:10]) or "none yet"
    raise InputError(f"no tuning study {name!r} in this workspace; known: {known} (a study on a shared "
                     "storage that was started elsewhere needs --storage URL)", field="study")


def storage_for(ws: "Workspace", name: str, storage: str | None = None) -> str:
    """The storage URL of a study: ``storage`` when given, else what this workspace recorded."""
    if storage is not None:
        return storage
    row = ws.conn.execute("SELECT storage FROM tuning_studies WHERE name=?", (name,)).fetchone()
    if row is None:
        return default_storage_url(ws)
    if row[0] is None:
        return default_storage_url(ws)
    if "***" in row[0]:
        raise InputError(f"the storage of study {name!r} ({row[0]}) needs a password that the workspace "
                         "does not keep; give --storage with the full URL", field="storage")
    return row[0]


def load_study(ws: "Workspace", name: str, storage: str | None = None) -> optuna.Study:
    """The Optuna study ``name`` (from its recorded or the given storage)."""
    url = storage_for(ws, name, storage)
    rdb = open_storage(url)
    if study_id(rdb, name) is None:
        raise InputError(f"no study {name!r} in {describe_url(url)}", field="study")
    return optuna.load_study(study_name=name, storage=rdb)


def _study_attrs(study: optuna.Study) -> dict[str, Any]:
    attrs = study.user_attrs.get(CONFIG_ATTR)
    if not isinstance(attrs, dict):
        raise InputError(f"study {study.study_name!r} was not created by Reward Workbench (no {CONFIG_ATTR!r} "
                         "attribute)", field="study")
    return attrs


def stop_tuning(ws: "Workspace", actor: Actor, name: str) -> dict[str, Any]:
    """Ask the running workers of a study (started from this workspace) to stop after their
    current trial; a run whose process is gone is marked stopped at once.  Needs ``train``."""
    authorize(ws, actor, "train")
    runs = [r for r in study_runs(ws, name) if r["status"] in ("starting", "running")]
    if not runs:
        raise ConflictError(f"study {name!r} has no running worker")
    with ws.transaction() as conn:
        for r in runs:
            conn.execute("UPDATE tuning_runs SET stop_requested=1 WHERE id=?", (r["id"],))
    for r in runs:
        if r["process_alive"] is False:
            _end_run(ws, r["id"], "stopped", done=r["trials_done"], best=r["best_value"],
                     error="stopped while no worker process was running")
    return get_study(ws, name)


def launch_tuning(ws: "Workspace", actor: Actor, template: str, *, dataset: str | None = None,
                  episodes: str | Path | None = None, config: TuneConfig | None = None, trials: int = 200,
                  storage: str | None = None, study: str | None = None,
                  bounds: Mapping[str, Any] | None = None, fixed: Sequence[str] = ()) -> dict[str, Any]:
    """Start :func:`tune` as a detached background process (``rwb tune … --run-id N``).

    It has its own session, so it survives the page that launched it (and the app); its
    output goes to ``artifacts/tuning/logs/``.  The study name is settled here, so the
    page can watch it at once.  Needs ``train``."""
    authorize(ws, actor, "train")
    cfg = (config or TuneConfig()).validate()
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise InputError(f"trials must be a whole number ≥ 1, got {trials!r}", field="trials")
    ref = resolve_template_ref(ws, template)
    if (dataset is None) == (episodes is None):
        raise InputError("give exactly one of a dataset or an episodes file", field="dataset")
    if dataset is not None:
        ws.require_dataset(dataset)
    outcome_readers = [c.name for c in ref.template.all_components if c.component in OUTCOME_COMPONENTS]
    space = SearchSpace.for_template(ref.template, bounds, fixed,
                                     exclude=outcome_readers if cfg.withholds else ())
    name = study or default_study_name(ref, cfg, _data_name(dataset, episodes), space)
    logs = ws.artifact_dir("tuning", "logs")
    log_path = logs / f"{name}-{time.strftime('%Y%m%dT%H%M%S')}.log"
    with ws.transaction() as conn:
        # checked in the write transaction that adds the worker, so two launches cannot both pass
        other = _running_local(ws, name, None) if storage is None else None
        if other is not None:
            process = "not started yet" if other["pid"] is None else f"process {other['pid']}"
            raise ConflictError(f"study {name!r} is already running (tuning run {other['run']}, {process}): "
                                "watch it or stop it first, or give another study name to start a new one")
        # the study row exists before the worker starts, so lists show it at once
        conn.execute(
            "INSERT OR IGNORE INTO tuning_studies(name, storage, objective, template_name, template_version, "
            "template_sha256, dataset, episodes_file, config, created_by, created_at) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            (name, _store_url(storage), cfg.objective, ref.name, ref.version, ref.sha256, dataset,
             None if episodes is None else str(Path(episodes).resolve()), json.dumps(cfg.to_dict(), sort_keys=True),
             actor.name, _now()))
        cur = conn.execute(
            "INSERT INTO tuning_runs(study, status, trials_requested, log_path, started_by, started_at) "
            "VALUES (?, 'starting', ?, ?, ?, ?)", (name, trials, str(log_path), actor.name, _now()))
        run_id = int(cur.lastrowid)
    cmd = [*CLI, "--workspace", str(ws.root), "tune", "--template", ref.ref,
           "--objective", cfg.objective, "--split-by", cfg.split_by, "--heldout", str(cfg.heldout_fraction),
           "--label", cfg.label, "--threshold", str(cfg.success_threshold), "--metric", cfg.metric,
           "--seed", str(cfg.seed), "--sampler", cfg.sampler, "--trials", str(trials), "--study", name,
           "--run-id", str(run_id), "--json"]
    cmd += ["--dataset", dataset] if dataset is not None else ["--episodes", str(Path(episodes).resolve())]
    if cfg.withhold_outcome is not None:
        cmd.append("--withhold-outcome" if cfg.withhold_outcome else "--show-outcome")
    if cfg.group_key is not None:
        cmd += ["--group-key", cfg.group_key]
    if cfg.cv_folds != CV_FOLDS:
        cmd += ["--folds", str(cfg.cv_folds)]
    for key, value in (bounds or {}).items():
        text = value if isinstance(value, str) else (
            ",".join(map(str, value)) if not (isinstance(value, (list, tuple)) and len(value) == 2 and
                                              all(isinstance(v, (int, float)) for v in value))
            else f"{value[0]}:{value[1]}")
        cmd += ["--bound", f"{key}={text}"]
    for name_fixed in fixed:
        cmd += ["--fix", name_fixed]
    if cfg.policy:
        cmd += ["--policy-config", json.dumps(dict(cfg.policy))]
    root = import_root()  # the folder that holds the core package, for an uninstalled checkout
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    if storage is not None:
        env["RWB_TUNE_STORAGE"] = storage  # not on the command line: it may carry a password
    else:
        env.pop("RWB_TUNE_STORAGE", None)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, cwd=str(ws.root), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env=env)
    with ws.transaction() as conn:
        conn.execute("UPDATE tuning_runs SET pid=?, host=? WHERE id=?", (proc.pid, socket.gethostname(), run_id))
    return {"study": name, "run_id": run_id, "pid": proc.pid, "log": str(log_path)}


def tuning_log(ws: "Workspace", name: str, tail: int = 4000) -> str:
    """The end of the latest background run's log of a study (empty when none)."""
    runs = [r for r in study_runs(ws, name) if r["log_path"]]
    if not runs or not Path(runs[-1]["log_path"]).is_file():
        return ""
    return Path(runs[-1]["log_path"]).read_bytes()[-tail:].decode("utf-8", errors="replace")


# =========================================================================== applying a result
def apply_study(ws: "Workspace", actor: Actor, name: str, *, storage: str | None = None,
                trial: int | None = None, message: str | None = None) -> dict[str, Any]:
    """Write a study's best feasible weights (or trial ``trial``'s) as a **new version** of
    the template it tuned, with the diff and the objective's figures recorded.

    The save names the version the study started from, so it is refused
    (:class:`~core.rewards.versions.TemplateConflict`) when someone saved a newer version
    since; nothing is overwritten.  Needs ``edit_template``."""
    from core.rewards.template import parse_template
    from core.rewards.versions import diff_templates, save_template

    authorize(ws, actor, "edit_template")
    url = storage_for(ws, name, storage)
    st = load_study(ws, name, url)
    attrs = _study_attrs(st)
    if trial is None:
        try:
            chosen = st.best_trial
        except ValueError:
            raise NoFeasibleTrial(f"study {name!r} has no completed trial that satisfies every expectation; "
                                  "run more trials or widen the bounds") from None
    else:
        matches = [tr for tr in st.get_trials(deepcopy=False) if tr.number == trial]
        if not matches or matches[0].state != optuna.trial.TrialState.COMPLETE:
            raise InputError(f"study {name!r} has no completed trial {trial}", field="trial")
        chosen = matches[0]
        if any(v > 0 for v in chosen.constraints.values()):
            bad = ", ".join(k for k, v in chosen.constraints.items() if v > 0)
            raise InputError(f"trial {trial} breaks expectations ({bad}); choose a feasible trial", field="trial")
    space = SearchSpace.from_dict(attrs["space"])
    weights, params = space.decode(chosen.params)
    tinfo = attrs["template"]
    base = parse_template(tinfo["yaml"], file=f"study {name}")
    new = base.with_weights(weights)
    for comp, p in params.items():
        new = new.with_params(comp, {**dict(new.component(comp).params), **dict(p)})
    diff = diff_templates(base, new)
    if not diff:
        raise InputError(f"trial {chosen.number} of study {name!r} keeps the template's own weights; there is "
                         "nothing to apply", field="study")
    metric = attrs.get("metric", "value")
    figures = _finite({
        "study": name, "trial": chosen.number, "storage": describe_url(url), "objective": attrs["config"]["objective"],
        "metric": metric, "train": chosen.value, "held_out": chosen.user_attrs.get("held_out"),
        "held_out_auc": chosen.user_attrs.get("held_out_auc"),
        "constraints": dict(chosen.constraints), "baseline": attrs.get("baseline"),
        "split": attrs.get("split"), "data": {k: v for k, v in attrs["data"].items()},
        "base": {"name": tinfo["name"], "version": tinfo["version"], "sha256": tinfo["sha256"]}})
    held = figures["held_out"]
    text = message or (f"tuned by study {name} (trial {chosen.number}): {metric} {chosen.value:.3f} on the "
                       f"training split" + (f", {held:.3f} held out" if isinstance(held, (int, float)) else ""))
    saved = save_template(ws, actor, tinfo["name"], new, tinfo["version"], text,
                          meta={"tuning": figures, "diff": diff})
    with ws.transaction() as conn:
        conn.execute("INSERT INTO tuning_applications(study, trial_number, template_name, base_version, version, "
                     "figures, diff, applied_by, applied_at) VALUES (?,?,?,?,?,?,?,?,?)",
                     (name, chosen.number, tinfo["name"], tinfo["version"], saved.version,
                      json.dumps(figures, sort_keys=True), json.dumps(diff, sort_keys=True), actor.name, _now()))
    return {"study": name, "trial": chosen.number, "template": tinfo["name"], "base_version": tinfo["version"],
            "version": saved.version, "label": saved.label, "diff": diff, "figures": figures,
            "message": saved.message}


def list_applications(ws: "Workspace", name: str | None = None) -> list[dict[str, Any]]:
    """Template versions written from studies (newest first)."""
    sql = ("SELECT id, study, trial_number, template_name, base_version, version, figures, diff, applied_by, "
           "applied_at FROM tuning_applications")
    args: tuple[Any, ...] = ()
    if name is not None:
        sql += " WHERE study=?"
        args = (name,)
    cols = ("id", "study", "trial", "template", "base_version", "version", "figures", "diff", "applied_by",
            "applied_at")
    out = []
    for r in ws.conn.execute(sql + " ORDER BY id DESC", args):
        d = dict(zip(cols, r))
        d["figures"], d["diff"] = json.loads(d["figures"]), json.loads(d["diff"])
        out.append(d)
    return out


# =========================================================================== watching a study
#: Trials drawn in the (slow to render) parameter plots of a large study.
PLOT_IMPORTANCE_TRIALS = 300
PLOT_PARALLEL_TRIALS = 200
#: Trials listed in the report's table (the most recent).
REPORT_TRIALS = 200


@dataclass
class StudyReport:
    """Everything the Tuning page shows about one study (figures are plotly figures)."""

    name: str
    storage: str
    status: str
    objective: str
    metric: str
    template: dict[str, Any]
    data: dict[str, Any]
    split: dict[str, Any]
    counts: dict[str, int]
    best: dict[str, Any] | None
    baseline: dict[str, Any] | None
    weights: list[dict[str, Any]]
    params: list[dict[str, Any]]
    constraints: list[dict[str, Any]]
    trials: list[dict[str, Any]]
    runs: list[dict[str, Any]]
    figures: dict[str, Any]
    notes: list[str]
    #: per completed trial, in order: ``trial``, ``objective`` (the value) and ``held-out AUC``
    #: (outcome studies; None elsewhere) — the page's chart of the two side by side
    held_out_series: dict[str, list[Any]] = field(default_factory=dict)


def study_fingerprint(ws: "Workspace", name: str, storage: str | None = None) -> tuple[int, str]:
    """(number of trials, storage) of a study: changes whenever a trial is written (cheap; the
    page recomputes its report only then)."""
    from core.tuning.storage import count_trials

    url = storage_for(ws, name, storage)
    rdb = open_storage(url)
    sid = study_id(rdb, name)
    return (0 if sid is None else count_trials(rdb, sid), describe_url(url))


def study_report(ws: "Workspace", name: str, storage: str | None = None) -> StudyReport:
    """The state of a study for the Tuning page: counts, best vs template weights, the
    constraint status of each recent trial, and Optuna's plotly figures (optimisation
    history, parameter importances, parallel coordinates)."""
    from optuna.trial import TrialState
    from optuna.visualization import (plot_optimization_history, plot_parallel_coordinate,
                                      plot_param_importances)

    url = storage_for(ws, name, storage)
    runs = study_runs(ws, name)
    rdb = open_storage(url)
    if study_id(rdb, name) is None:
        # launched, the worker has not created it yet
        rec = get_study(ws, name)
        return StudyReport(name=name, storage=describe_url(url), status=rec["status"], objective=rec["objective"],
                           metric="", template={"name": rec["template_name"], "version": rec["template_version"]},
                           data={"dataset": rec["dataset"], "episodes_file": rec["episodes_file"]}, split={},
                           counts={}, best=None, baseline=None, weights=[], params=[], constraints=[], trials=[],
                           runs=runs, figures={}, notes=["the worker is preparing the study (scoring the data)"],
                           held_out_series={})
    st = optuna.load_study(study_name=name, storage=rdb)
    attrs = _study_attrs(st)
    trials = st.get_trials(deepcopy=False)
    counts = {s.name.lower(): 0 for s in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL,
                                          TrialState.RUNNING, TrialState.WAITING)}
    for tr in trials:
        counts[tr.state.name.lower()] = counts.get(tr.state.name.lower(), 0) + 1
    complete = [tr for tr in trials if tr.state == TrialState.COMPLETE]
    feasible = [tr for tr in complete if all(v <= 0 for v in tr.constraints.values())]
    counts["feasible"] = len(feasible)
    counts["infeasible"] = len(complete) - len(feasible)
    space = SearchSpace.from_dict(attrs["space"])
    current = dict(attrs["baseline"]["weights"])
    best = None
    if feasible:
        bt = st.best_trial
        bw, bp = space.decode(bt.params)
        best = {"trial": bt.number, "value": bt.value, "held_out": bt.user_attrs.get("held_out"),
                "held_out_auc": bt.user_attrs.get("held_out_auc"), "cv_auc": bt.user_attrs.get("cv_auc"),
                "weights": {**current, **bw}, "params": bp, "constraints": dict(bt.constraints)}
    weights = [{"component": k, "template": v, "best": None if best is None else best["weights"].get(k),
                "low": space.weights[k][0] if k in space.weights else None,
                "high": space.weights[k][1] if k in space.weights else None, "tuned": k in space.weights}
               for k, v in current.items()]
    params = [{"parameter": k, "range": v.to_dict(), "best": None if best is None else
               best["params"].get(k.split(".", 1)[0], {}).get(k.split(".", 1)[1])} for k, v in space.params.items()]
    names = sorted({k for tr in complete for k in tr.constraints})
    base_cons = (attrs.get("baseline") or {}).get("constraints") or {}
    best_cons = best["constraints"] if best else {}
    constraint_rows = [{"expectation": n, "satisfied": sum(1 for tr in complete if tr.constraints.get(n, 0) <= 0),
                        "violated": sum(1 for tr in complete if tr.constraints.get(n, 0) > 0),
                        "template weights": _status(base_cons.get(n)), "best trial": _status(best_cons.get(n))}
                       for n in names]
    table = []
    for tr in trials[-REPORT_TRIALS:][::-1]:
        row = {"trial": tr.number, "state": tr.state.name.lower(), "value": tr.value,
               "held_out": tr.user_attrs.get("held_out"), "held_out_auc": tr.user_attrs.get("held_out_auc"),
               "cv_auc": tr.user_attrs.get("cv_auc"),
               "feasible": None if tr.state != TrialState.COMPLETE else all(v <= 0 for v in tr.constraints.values())}
        row.update({f"c: {k}": v for k, v in sorted(tr.constraints.items())})
        table.append(row)
    figures: dict[str, Any] = {}
    notes: list[str] = []
    if complete:
        figures["history"] = plot_optimization_history(st)
    tuned = [k for k in list(space.weights) + list(space.params)]
    if len(complete) >= 2 and tuned:
        recent = _view_study(st, complete[-PLOT_IMPORTANCE_TRIALS:])
        try:
            figures["importances"] = plot_param_importances(recent)
        except (RuntimeError, ValueError) as exc:  # e.g. every value equal: nothing to attribute
            notes.append(f"parameter importances unavailable: {exc}")
        if len(complete) > PLOT_IMPORTANCE_TRIALS:
            notes.append(f"importances use the last {PLOT_IMPORTANCE_TRIALS} completed trials")
        top = sorted(complete, key=lambda tr: tr.value, reverse=True)[:PLOT_PARALLEL_TRIALS]
        figures["parallel"] = plot_parallel_coordinate(_view_study(st, top))
        if len(complete) > PLOT_PARALLEL_TRIALS:
            notes.append(f"parallel coordinates show the {PLOT_PARALLEL_TRIALS} best completed trials")
    elif not complete:
        notes.append("no completed trial yet")
    rec = next((s for s in list_studies(ws) if s["name"] == name), None)
    return StudyReport(
        name=name, storage=describe_url(url), status=rec["status"] if rec else "external",
        objective=attrs["config"]["objective"], metric=attrs.get("metric", ""),
        template={k: attrs["template"][k] for k in ("name", "version", "ref")}, data=attrs["data"],
        split=attrs.get("split", {}), counts=counts, best=_finite(best), baseline=attrs.get("baseline"),
        weights=_finite(weights), params=_finite(params), constraints=constraint_rows, trials=_finite(table),
        runs=runs, figures=figures, notes=notes,
        held_out_series=_finite({"trial": [tr.number for tr in complete], "objective": [tr.value for tr in complete],
                                 "held-out AUC": [tr.user_attrs.get("held_out_auc") for tr in complete]}))


def _status(constraint: float | None) -> str:
    return "-" if constraint is None else ("satisfied" if constraint <= 0 else "violated")


def _view_study(study: optuna.Study, trials: Sequence[optuna.trial.FrozenTrial]) -> optuna.Study:
    """An in-memory study holding ``trials`` (to plot a subset of a large study)."""
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # no "study created" line per redraw
    try:
        view = optuna.create_study(direction=study.direction, study_name=study.study_name)
    finally:
        optuna.logging.set_verbosity(verbosity)
    view.add_trials(trials)
    return view


__all__ = [
    "COMFORTABLE_LABELLED", "COMFORTABLE_PER_CLASS", "COMFORTABLE_TASKS", "CV_FOLDS", "MIN_LABELLED",
    "MIN_PER_CLASS", "MIN_TASKS", "OutcomeDataCheck", "SMALL_DATA_PENALTY", "check_outcome_data",
    "load_episodes_and_frame", "task_groups", "trial_row",
    "CONFIG_ATTR", "LABELS", "METRICS", "OBJECTIVES", "OUTCOME_COMPONENTS", "SPLIT_FIELDS", "Combined",
    "ExpectationConstraints", "Labels", "NoFeasibleTrial", "OutcomeObjective", "ParamRange", "PolicyObjective",
    "PreferenceObjective", "ReturnModel", "SearchSpace", "StudyReport", "TemplateRef", "TuneConfig",
    "TuneResult", "TuningObjective", "TuningProblem", "add_preference", "apply_study", "auc",
    "default_study_name", "get_study", "kendall_tau", "outcome_pairs", "soft_auc", "launch_tuning", "list_applications", "list_preferences",
    "list_studies", "load_data", "load_study", "make_sampler", "outcome_labels", "pair_agreement", "parse_bounds",
    "preference_pairs", "resolve_template_ref", "space_rows", "split_episodes", "split_keys", "stop_tuning",
    "storage_for",
    "study_fingerprint", "study_report", "study_runs", "tune", "tuning_log", "withhold_outcomes",
]


def space_rows(ws: "Workspace | None", template: Template | str | Path, *, withhold: bool = True
               ) -> list[dict[str, Any]]:
    """The default search space of a template as editable rows (the page's bounds table):
    component, level, weight, low, high, tune (False for components held at their weight —
    the outcome readers while the outcome is withheld)."""
    t = resolve_template_ref(ws, template).template
    readers = [c.name for c in t.all_components if c.component in OUTCOME_COMPONENTS]
    space = SearchSpace.for_template(t, exclude=readers if withhold else ())
    return [{"component": c.name, "level": c.group, "weight": c.weight,
             "low": space.weights.get(c.name, (0.0, max(1.0, 2 * c.weight)))[0],
             "high": space.weights.get(c.name, (0.0, max(1.0, 2 * c.weight)))[1],
             "tune": c.name in space.weights, "reads_outcome": c.name in readers}
            for c in t.all_components]
