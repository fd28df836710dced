"""What a study varies and how it measures a trial: the search space (:class:`SearchSpace`,
:class:`ParamRange`), the study's settings (:class:`TuneConfig`), and the choices they take.

Optuna parameter names are the component names for weights and ``component.param`` for
component parameters, so a study reads like the template it tunes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import optuna

from core.base.errors import InputError
from core.rewards.components import COMPONENTS
from core.rewards.template import ComponentSpec, Template, TemplateError

OBJECTIVES: tuple[str, ...] = ("outcome", "preferences", "policy")
#: What "successful" means: ``success`` is resolved where known, else final_reward > threshold.
LABELS: tuple[str, ...] = ("success", "resolved", "final_reward", "business_metric", "sentiment")
#: Outcome objective's statistic: ``within_task`` (the default: smooth AUC over pairs of a success and a
#: failure of the same task), ``all_pairs`` (smooth AUC over every pair; ``soft_auc`` is its older name),
#: ``auc`` (the exact all-pairs AUC) or ``kendall`` (τ-b against the label).
METRICS: tuple[str, ...] = ("within_task", "all_pairs", "soft_auc", "auc", "kendall")
#: Fewest design tasks with both outcomes the within-task objective tunes on; below it the study falls
#: back to all pairs and says so in its warnings (a handful of tasks' pairs is ranked perfectly by chance).
MIN_TASKS_WITH_BOTH = 5
SPLIT_FIELDS: tuple[str, ...] = ("task", "episode", "task_type", "domain", "behaviour")
SAMPLERS: tuple[str, ...] = ("tpe", "random")
#: Task-grouped folds of the design tasks (outcome objective) unless the study says otherwise.
CV_FOLDS = 5
#: Registered components that read the recorded outcome (their columns carry the label).
OUTCOME_COMPONENTS = frozenset({"business_impact", "terminal_outcome", "resolved_bonus", "sentiment_bonus"})
#: PPO settings of one policy trial unless the study overrides them (a short run).
POLICY_DEFAULTS: dict[str, Any] = {"total_steps": 16_384, "n_envs": 64, "rollout_len": 32,
                                   "checkpoint_every": 1_000_000, "bc_epochs": 5, "heldout_fraction": 0.5}


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
        low, high = self.low, self.high
        assert low is not None and high is not None, "a range without choices has both bounds"
        if self.integer:
            return trial.suggest_int(name, int(low), int(high))
        return trial.suggest_float(name, float(low), float(high))

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
    metric: str = "within_task"
    """outcome objective: within_task (the default: smooth AUC over pairs of a success and a failure of the
    same task, see :func:`~core.tuning.statistics.soft_auc`; all pairs when fewer than
    :data:`MIN_TASKS_WITH_BOTH` design tasks have both outcomes), all_pairs (smooth AUC over every pair;
    soft_auc is its older name), auc (exact, all pairs) or kendall (τ-b between returns and the label)"""
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


def outcome_readers(template: Template) -> list[str]:
    """The template's components that read the recorded outcome (:data:`OUTCOME_COMPONENTS`):
    held at their weight while the outcome is withheld from the components."""
    return [c.name for c in template.all_components if c.component in OUTCOME_COMPONENTS]
