"""Ready-to-render views of a reward pyramid: what the Reward Pyramid page shows.

The page reads its inputs, calls one function here and renders the result; the data shaping
happens here so that it is tested and shared.  Entry points: :func:`template_options`,
:func:`pyramid_editor`, :func:`apply_edits` / :func:`apply_params`, :func:`rescore` (no
component computed), :func:`pyramid_report` and :func:`explain_episode`.

Details: docs/rewards.md (## The Reward Pyramid page's views).
"""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import pandas as pd

from core.base import safe_yaml
from core.base.errors import InputError
from core.rewards.components import COMPONENTS
from core.rewards.expectations import CheckReport, evaluate_expectations
from core.rewards.pyramid import ScoreResult, StepContribution
from core.rewards.template import ComponentSpec, Template, TemplateError, parse_template
from core.rewards.versions import TemplateChange, TemplateVersion, get_template, list_versions, parse_spec, template_names

if TYPE_CHECKING:  # pragma: no cover
    from core.records.store import Workspace

ParamKind = Literal["number", "integer", "choice", "flag", "text", "yaml"]

#: Bins of the reward and return histograms.
HIST_BINS = 40


# --------------------------------------------------------------------------- template choice
@dataclass(frozen=True)
class TemplateOption:
    """One template version a picker offers."""

    spec: str           # "finance_risk@3": what get_template / --template accept
    name: str
    version: int
    latest: bool
    label: str          # "finance_risk@3 · latest · bob, 2026-05-01T10:00:00Z · more L1"


def template_options(ws: "Workspace") -> list[TemplateOption]:
    """Every version of every template (shipped seeds as ``@0``), newest first per name."""
    out: list[TemplateOption] = []
    for name in template_names(ws):
        versions = list_versions(ws, name)
        latest = versions[-1].version
        for v in reversed(versions):
            who = "shipped" if v.shipped else f"{v.saved_by}, {v.saved_at}"
            parts = [v.label, *(["latest"] if v.version == latest else []), who]
            if v.message and not v.shipped:
                parts.append(v.message if len(v.message) <= 60 else v.message[:57] + "…")
            out.append(TemplateOption(v.label, name, v.version, v.version == latest, " · ".join(parts)))
    return out


def open_template(ws: "Workspace", spec: str) -> TemplateVersion:
    """The version a picker's ``spec`` names (``name@N`` or a bare name for the latest)."""
    name, version = parse_spec(spec)
    return get_template(ws, name, version)


# --------------------------------------------------------------------------- the editor
@dataclass(frozen=True)
class ParamField:
    """One component parameter as a form field."""

    name: str
    #: number / integer / choice / flag / text, or yaml for lists and mappings (edited as text)
    kind: ParamKind
    #: Initial widget value (the YAML text for kind yaml; None for an unset optional).
    value: Any
    options: tuple[Any, ...] = ()
    optional: bool = False
    help: str = ""


@dataclass(frozen=True)
class ComponentEditor:
    """One component: its weight (with a slider range) and its parameters."""

    name: str
    component: str
    group: str
    weight: float
    weight_max: float
    description: str
    params: tuple[ParamField, ...]


@dataclass(frozen=True)
class LevelEditor:
    key: str
    title: str
    gate: float | None
    components: tuple[ComponentEditor, ...]


@dataclass(frozen=True)
class PyramidEditor:
    """The editable parts of a template, laid out as the page shows them."""

    name: str
    description: str
    levels: tuple[LevelEditor, ...]
    penalties: tuple[ComponentEditor, ...]
    episode_terms: tuple[ComponentEditor, ...]
    gating: bool
    a: float
    b: float
    gamma: float

    @property
    def components(self) -> tuple[ComponentEditor, ...]:
        return tuple(c for lv in self.levels for c in lv.components) + self.penalties + self.episode_terms


def _unwrap_optional(annotation: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(args) < len(typing.get_args(annotation))
        return (args[0] if len(args) == 1 else annotation), optional
    return annotation, False


def _yaml_text(value: Any) -> str:
    return safe_yaml.dump(value, default_flow_style=True, allow_unicode=True, width=10_000).strip()


def _param_field(name: str, annotation: Any, value: Any) -> ParamField:
    inner, optional = _unwrap_optional(annotation)
    if typing.get_origin(inner) is Literal:
        return ParamField(name, "choice", value, tuple(typing.get_args(inner)), optional)
    if inner is bool:
        return ParamField(name, "flag", bool(value), (), optional)
    if inner is int:
        return ParamField(name, "integer", value, (), optional)
    if inner is float:
        return ParamField(name, "number", None if value is None else float(value), (), optional)
    if inner is str:
        return ParamField(name, "text", value, (), optional,
                          "leave empty for none" if optional else "")
    return ParamField(name, "yaml", _yaml_text(value), (), optional,
                      "YAML, e.g. [a, b] or {key: value}" + ("; null for none" if optional else ""))


def _nice_max(weight: float) -> float:
    # sliders reach twice the current weight (at least 1.0), rounded up to a tenth
    return max(1.0, math.ceil(2 * weight * 10) / 10)


def _component_editor(spec: ComponentSpec) -> ComponentEditor:
    cls = COMPONENTS[spec.component]
    values = spec.params_with_defaults()
    fields = tuple(_param_field(p, ann, values.get(p, default))
                   for p, (ann, default) in cls.param_specs().items())
    return ComponentEditor(spec.name, spec.component, spec.group, spec.weight, _nice_max(spec.weight),
                           spec.description or cls.description(), fields)


def pyramid_editor(template: Template) -> PyramidEditor:
    """The editor layout of ``template``: levels bottom-up with their components, penalties,
    episode terms, gating and the return coefficients."""
    return PyramidEditor(
        name=template.name, description=template.description,
        levels=tuple(LevelEditor(lv.key, lv.title, lv.gate,
                                 tuple(_component_editor(c) for c in lv.components))
                     for lv in template.levels),
        penalties=tuple(_component_editor(c) for c in template.penalties),
        episode_terms=tuple(_component_editor(c) for c in template.episode_terms),
        gating=template.gating, a=template.a, b=template.b, gamma=template.gamma)


@dataclass
class PyramidEdits:
    """What the analyst changed in the browser (unset fields keep the template's values)."""

    weights: dict[str, float] = field(default_factory=dict)
    gating: bool | None = None
    #: level key -> gate threshold (None: the level has no gate)
    gates: dict[str, float | None] = field(default_factory=dict)
    a: float | None = None
    b: float | None = None
    gamma: float | None = None


def apply_edits(template: Template, edits: PyramidEdits) -> Template:
    """``template`` with the edited weights, gating, gates and return coefficients
    (invalid values raise :class:`TemplateError`)."""
    out = template.with_weights(edits.weights) if edits.weights else template
    if edits.gating is not None or edits.gates:
        out = out.with_gating(edits.gating, edits.gates)
    if edits.a is not None or edits.b is not None or edits.gamma is not None:
        out = out.with_return(a=edits.a, b=edits.b, gamma=edits.gamma)
    return out


def _parse_field(f: ParamField, raw: Any, component: str) -> Any:
    where = f"parameter '{f.name}' of '{component}'"
    if f.kind == "yaml":
        try:
            return safe_yaml.safe_load(str(raw)) if str(raw).strip() else None
        except InputError as exc:
            problem = exc.reason.removeprefix("not valid YAML: ")
            at = f" (line {exc.line}{f', key {exc.field}' if exc.field else ''})" if exc.line else ""
            raise TemplateError(f"{where} is not valid YAML: {problem}{at}",
                                field=f"{component}.{f.name}") from None
    if f.kind == "text":
        return None if (raw is None or (f.optional and str(raw) == "")) else str(raw)
    if raw is None:
        if not f.optional:
            raise TemplateError(f"{where} needs a value", field=f"{component}.{f.name}")
        return None
    if f.kind == "integer":
        if isinstance(raw, float) and not raw.is_integer():
            raise TemplateError(f"{where} must be a whole number, got {raw}", field=f"{component}.{f.name}")
        return int(raw)
    if f.kind == "number":
        return float(raw)
    if f.kind == "flag":
        return bool(raw)
    return raw


def apply_params(template: Template, values: Mapping[str, Mapping[str, Any]]) -> Template:
    """``template`` with component parameters taken from form values
    (``{component name: {param: widget value}}``; YAML fields as text).

    Only parameters that differ from the current ones are written, so an untouched
    form changes nothing (and the cached component columns stay valid)."""
    out = template
    for name, raw in values.items():
        spec = out.component(name)
        editor = _component_editor(spec)
        current = spec.params_with_defaults()
        params = dict(spec.params)
        changed = False
        for f in editor.params:
            if f.name not in raw:
                continue
            value = _parse_field(f, raw[f.name], name)
            if value != current.get(f.name):
                params[f.name] = value
                changed = True
        if changed:
            out = out.with_params(name, params)
    return out


def apply_yaml(text: str, *, name: str | None = None) -> Template:
    """A template from YAML typed in the browser (errors name the key and line)."""
    if not isinstance(text, str) or not text.strip():
        raise InputError("the template text is empty", field="yaml")
    return parse_template(text, file=f"template {name!r}" if name else "edited template")


# --------------------------------------------------------------------------- scoring views
def rescore(base: ScoreResult, template: Template) -> ScoreResult:
    """``base``'s component matrix under ``template``: weight edits go through
    :meth:`ScoreResult.reweight`; gating/return/expectation edits through
    :meth:`ScoreResult.with_template`.  Never computes a component (a template whose
    components or parameters differ is refused with :class:`TemplateError`)."""
    if template == base.template:
        return base
    same_names = [c.name for c in template.all_components] == [c.name for c in base.template.all_components]
    if same_names and base.template.with_weights(template.weights()) == template:
        return base.reweight(template.weights())
    return base.with_template(template)


@dataclass(frozen=True)
class Metric:
    """One headline figure of the page: a plain label, the figure (a number the page rounds for
    reading, or a text such as "3 / 4"; None: no figure), its unit, and the technical meaning and
    what good looks like for the tooltip."""

    label: str
    value: float | str | None
    help: str = ""
    #: "share" for a fraction shown as a percentage; None for a plain number
    unit: str | None = None


@dataclass
class PyramidReport:
    """Everything the page shows about one scoring."""

    result: ScoreResult
    check: CheckReport
    metrics: list[Metric]
    #: the pyramid's levels, bottom-up, each split among its components
    pyramid: list[PyramidLevel]
    #: penalties and episode terms with their weights (the parts outside the levels)
    pyramid_note: str
    #: each component's contribution: quartiles, extremes and mean (:func:`contribution_stats`)
    contributions: pd.DataFrame
    #: each level's gated reward, the penalties and the step reward, binned (:func:`level_histogram`)
    level_histogram: pd.DataFrame
    #: episode returns per behaviour label, binned (:func:`return_histogram`)
    return_histogram: pd.DataFrame
    #: one row per episode: id, labels, outcome, Σγᵗr, R_final, return, rank
    episodes: pd.DataFrame
    #: one row per expectation: result, name, kind, message
    expectations: pd.DataFrame
    #: which components were computed in the scoring behind this report, which came from the cache
    computed: list[str]
    cached: list[str]

    @property
    def episode_ids(self) -> list[str]:
        return self.result.frame.episode_ids.tolist()


def _sig(x: float) -> str:
    """One figure at :data:`TABLE_DIGITS` significant digits, as text."""
    return f"{float(round_figures(np.array([x]))[0]):g}"


#: Significant digits of the figures in the page's tables (episode returns, per-step contributions).
TABLE_DIGITS = 3


def round_figures(values: np.ndarray, digits: int = TABLE_DIGITS) -> np.ndarray:
    """``values`` rounded to ``digits`` significant digits each (zeros and non-finite values kept):
    a table shows 0.32, not 0.32000000000000006, and 2.45, not 2.4471."""
    x = np.asarray(values, dtype=float)
    finite = np.isfinite(x) & (x != 0)
    scale = np.zeros_like(x)
    scale[finite] = np.floor(np.log10(np.abs(x[finite])))
    decimals = (digits - 1 - scale).astype(int)
    out = x.copy()
    for d in np.unique(decimals[finite]):
        mask = finite & (decimals == d)
        out[mask] = np.round(x[mask], int(d))
    return out


@dataclass(frozen=True)
class ComponentShare:
    """One component's part of its level: its weight and its share of the level's total weight."""

    name: str
    component: str
    weight: float
    #: weight / the level's total weight (equal parts when every weight of the level is zero)
    share: float


@dataclass(frozen=True)
class PyramidLevel:
    """One level of the pyramid with how often its gate passes and how often it earns."""

    key: str
    title: str
    #: the sum of its components' absolute weights
    total_weight: float
    #: its block's width: :attr:`total_weight` as a share of the heaviest level's (0–1; 0 when
    #: every level weighs nothing), so block areas are in proportion to the levels' weights
    width: float
    gate: float | None
    #: share of steps that pass the level's gate (None: the level has no gate)
    gate_passed: float | None
    #: share of steps on which the level earns (every gate below passed)
    earns: float
    components: tuple[ComponentShare, ...]


def pyramid_levels(result: ScoreResult) -> list[PyramidLevel]:
    """The pyramid's levels bottom-up (L1 first), each as wide as its share of the heaviest
    level's weight and split among its components in proportion to their absolute weights, with
    the gate pass and earn rates over the scored steps (0 when there are no steps)."""
    steps = result.frame.n_steps
    totals = [sum(abs(c.weight) for c in lv.components) for lv in result.template.levels]
    heaviest = max(totals, default=0.0)
    levels = []
    for i, (lv, total) in enumerate(zip(result.template.levels, totals)):
        n = len(lv.components)
        shares = [abs(c.weight) / total if total > 0 else 1.0 / n for c in lv.components]
        gate_passed = None
        if lv.gate is not None:
            gate_passed = float(result.passed[:, i].mean()) if steps else 0.0
        levels.append(PyramidLevel(
            key=lv.key, title=lv.title, total_weight=total, width=total / heaviest if heaviest > 0 else 0.0,
            gate=lv.gate, gate_passed=gate_passed, earns=float(result.earn[:, i].mean()) if steps else 0.0,
            components=tuple(ComponentShare(c.name, c.component, c.weight, share)
                             for c, share in zip(lv.components, shares))))
    return levels


def pyramid_note(template: Template) -> str:
    """How the episode return is made and the parts of the pyramid outside the levels, in one
    line: the return's coefficients, the penalties and the end-of-episode (R_final) terms."""
    parts = [f"Episode return = {template.a:g} × discounted step rewards + {template.b:g} × end-of-episode terms "
             f"(discount {template.gamma:g} per step)"]
    if template.penalties:
        parts.append("Penalties (never gated): " + ", ".join(f"{c.name} {c.weight:.2f}" for c in template.penalties))
    if template.episode_terms:
        parts.append("End-of-episode terms (R_final): " + ", ".join(f"{c.name} {c.weight:.2f}"
                                                                     for c in template.episode_terms))
    return " · ".join(parts)


#: The columns of :func:`contribution_stats`.
STAT_COLUMNS = ("min", "q1", "median", "q3", "max", "mean")


def _stats_rows(scope: str, names: Sequence[str], values: np.ndarray) -> list[dict[str, Any]]:
    """Per column of ``values`` (one per name): its :data:`STAT_COLUMNS` (zeros without rows)."""
    if values.shape[0] == 0:
        return [{"scope": scope, "component": name, **dict.fromkeys(STAT_COLUMNS, 0.0)} for name in names]
    stats = np.vstack([values.min(axis=0), *np.percentile(values, [25, 50, 75], axis=0),
                       values.max(axis=0), values.mean(axis=0)])
    return [{"scope": scope, "component": name, **dict(zip(STAT_COLUMNS, stats[:, j].tolist()))}
            for j, name in enumerate(names)]


def contribution_stats(result: ScoreResult) -> pd.DataFrame:
    """Per component, the distribution of its weighted, gated contribution: one row per
    component with min, quartiles, max and mean.  ``scope`` is ``step`` for the step
    components (over steps) and ``episode`` for the R_final terms (over episodes, when the
    template has any).  Summaries, so a box plot of a million steps stays small."""
    t = result.template
    rows = _stats_rows("step", list(result.matrix.step_names), result.contributions())
    if t.episode_terms and result.frame.n_episodes:
        weights = np.array([c.weight for c in t.episode_terms])
        rows += _stats_rows("episode", list(result.matrix.episode_names), result.matrix.episode_values * weights)
    return pd.DataFrame(rows, columns=["scope", "component", *STAT_COLUMNS])


#: The columns of a binned histogram (:func:`histogram`).
HISTOGRAM_COLUMNS = ("series", "key", "bin_centre", "bin_width", "count")


def histogram(groups: Sequence[tuple[str, str, np.ndarray]]) -> pd.DataFrame:
    """Several value sets counted on :data:`HIST_BINS` common bins spanning all of them.

    ``groups`` holds ``(series, key, values)``: the series' name, what it is (a level key,
    ``penalty``, ``step`` or a behaviour label) and its values.  One row per series and bin,
    series in the order given; no rows when every set is empty."""
    data = [values for _, _, values in groups if values.size]
    if not data:
        return pd.DataFrame(columns=list(HISTOGRAM_COLUMNS))
    lo = float(min(v.min() for v in data))
    hi = float(max(v.max() for v in data))
    if hi <= lo:
        hi = lo + 1e-6
    edges = np.linspace(lo, hi, HIST_BINS + 1)
    centres = (edges[:-1] + edges[1:]) / 2
    width = float(edges[1] - edges[0])
    frames = [pd.DataFrame({"series": name, "key": key, "bin_centre": centres, "bin_width": width,
                            "count": np.histogram(values, bins=edges)[0]})
              for name, key, values in groups]
    return pd.concat(frames, ignore_index=True)


def level_histogram(result: ScoreResult) -> pd.DataFrame:
    """Each level's gated reward per step (key: the level key), the penalties (``penalty``,
    when the template has any) and the step reward (``step``), on common bins."""
    t = result.template
    groups = [(f"{lv.key} {lv.title}", lv.key, result.level_totals[:, i]) for i, lv in enumerate(t.levels)]
    if t.penalties:
        groups.append(("penalties", "penalty", result.penalties))
    groups.append(("step reward", "step", result.step_reward))
    return histogram(groups)


def return_histogram(result: ScoreResult) -> pd.DataFrame:
    """Episode returns on common bins: one series per behaviour label (then ``(no label)``
    for unlabelled episodes), or ``all episodes`` when the data has no labels."""
    behaviour = result.frame.behaviour.astype(object)
    labels = sorted({str(b) for b in behaviour if b not in (None, "")})
    if labels:
        groups = [(b, b, result.returns[behaviour == b]) for b in labels]
        missing = np.array([b in (None, "") for b in behaviour], dtype=bool)
        if missing.any():
            groups.append(("(no label)", "(no label)", result.returns[missing]))
    else:
        groups = [("all episodes", "all episodes", result.returns)]
    return histogram(groups)


#: Plain names of the two parts of an episode's return (a·Σγᵗr + b·R_final) in the page's tables.
STEP_REWARDS = "step rewards (discounted sum)"
FINAL_TERMS = "end-of-episode terms"
#: What each part is, for a tooltip: the technical term and the formula.
RETURN_PARTS = {STEP_REWARDS: "Σγᵗr: the step rewards summed with the discount γ per step.",
                FINAL_TERMS: "R_final: the weighted end-of-episode terms (the outcome and the like).",
                "return": "The episode's return, a·Σγᵗr + b·R_final: higher ranks the episode higher."}


def episodes_table(result: ScoreResult) -> pd.DataFrame:
    """One row per episode, in data order: labels, outcome, the discounted step rewards (Σγᵗr),
    the end-of-episode terms (R_final), return and rank (1 = highest return), figures rounded to
    :data:`TABLE_DIGITS` significant digits."""
    f = result.frame
    resolved = (f.resolved == 1.0).astype(object)
    resolved[np.isnan(f.resolved)] = None  # no outcome recorded
    rank = np.empty(f.n_episodes, dtype=np.int64)
    rank[np.argsort(-result.returns, kind="stable")] = np.arange(1, f.n_episodes + 1)
    return pd.DataFrame({
        "episode_id": f.episode_ids, "behaviour": f.behaviour, "task_type": f.task_type,
        "resolved": resolved, "steps": f.ep_len, STEP_REWARDS: round_figures(result.discounted),
        FINAL_TERMS: round_figures(result.final), "return": round_figures(result.returns), "rank": rank})


def expectations_table(report: CheckReport) -> pd.DataFrame:
    """One row per expectation: PASS/FAIL, name, kind and the message with the numbers."""
    return pd.DataFrame({
        "result": ["PASS" if r.passed else "FAIL" for r in report.results],
        "expectation": [r.name for r in report.results],
        "kind": [r.kind for r in report.results],
        "numbers": [r.message for r in report.results],
    })


def pyramid_report(base: ScoreResult, template: Template) -> PyramidReport:
    """The page's whole view of ``template`` on the data scored in ``base`` (no component
    is computed: see :func:`rescore`)."""
    result = rescore(base, template)
    check = evaluate_expectations(result)
    n_pass = sum(r.passed for r in check.results)
    f = result.frame
    all_levels = (result.earn[:, -1] & result.passed[:, -1]) if result.template.levels and f.n_steps \
        else np.zeros(0, dtype=bool)
    metrics = [
        Metric("Mean episode return", float(result.returns.mean()) if f.n_episodes else None,
               f"The episode return a·Σγᵗr + b·R_final (discounted step rewards plus end-of-episode terms), "
               f"averaged over {f.n_episodes} episodes. Compare it before and after an edit; on its own it has "
               "no good or bad value."),
        Metric("Mean step reward", float(result.step_reward.mean()) if f.n_steps else None,
               f"The gated level rewards plus the penalties, averaged over {f.n_steps} steps."),
        Metric("Steps earning every level", float(all_levels.mean()) if all_levels.size else None,
               "Steps whose every level counts (the gates below passed) and whose top level passes its gate; "
               "honest, successful work should reach it often.", unit="share"),
        Metric("Expectations passing", f"{n_pass} / {len(check.results)}" if check.results else "none",
               "the template's reward unit tests and hacking probes"),
    ]
    return PyramidReport(
        result=result, check=check, metrics=metrics, pyramid=pyramid_levels(result),
        pyramid_note=pyramid_note(result.template), contributions=contribution_stats(result),
        level_histogram=level_histogram(result), return_histogram=return_histogram(result),
        episodes=episodes_table(result),
        expectations=expectations_table(check), computed=list(base.matrix.computed),
        cached=list(base.matrix.cached))


# --------------------------------------------------------------------------- one episode
@dataclass
class EpisodeExplanation:
    """Why one episode scored what it did."""

    episode_id: str
    #: "return = a × Σγᵗr + b × R_final = …" with the numbers
    formula: str
    #: one row per step: t, action, levels earned, gate failed, each component's weighted
    #: contribution, penalties, step reward
    steps: pd.DataFrame
    #: per step, the audit schema's ``reward_components: [{name, value}]`` (episode terms on
    #: the last step)
    reward_components: list[list[StepContribution]]
    #: the episode terms (weighted) that make up R_final
    episode_terms: list[StepContribution]


def explain_episode(result: ScoreResult, episode_id: str) -> EpisodeExplanation:
    """The per-step explanation of one scored episode."""
    f, t = result.frame, result.template
    e = f.episode_index().get(episode_id)
    if e is None:
        raise InputError(f"no episode {episode_id!r} in the scored data", field="episode_id")
    start, n = int(f.ep_start[e]), int(f.ep_len[e])
    rows = slice(start, start + n)
    keys = [lv.key for lv in t.levels]
    earn, passed = result.earn[rows], result.passed[rows]
    earned = [", ".join(k for k, ok in zip(keys, r) if ok) for r in earn]
    failed = [", ".join(k for k, e_ok, p_ok in zip(keys, er, pr) if e_ok and not p_ok)
              for er, pr in zip(earn, passed)]
    output = f.output_text[rows]
    table: dict[str, Any] = {
        "t": f.t[rows], "action": f.action_labels()[rows],
        "output": [("" if o is None else (str(o) if len(str(o)) <= 80 else str(o)[:77] + "…")) for o in output],
        "levels earned": earned, "gate failed": failed}
    contrib = result.contributions()[rows]
    for j, name in enumerate(result.matrix.step_names):
        table[name] = round_figures(contrib[:, j])
    table["step reward"] = round_figures(result.step_reward[rows])
    components = [result.explain(episode_id, i) for i in range(n)]
    terms = result.episode_term_contributions(e)
    formula = (f"return = {t.a:g} × discounted step rewards ({_sig(result.discounted[e])}) + {t.b:g} × "
               f"end-of-episode terms ({_sig(result.final[e])}) = {_sig(result.returns[e])}")
    return EpisodeExplanation(episode_id, formula, pd.DataFrame(table), components, terms)


def contributions_table(contributions: Sequence[StepContribution]) -> pd.DataFrame:
    """One step's ``reward_components`` (the audit schema's name/value entries) as a table, the
    values rounded to :data:`TABLE_DIGITS` significant digits."""
    return pd.DataFrame({"component": [c.name for c in contributions],
                         "contribution": round_figures(np.array([c.value for c in contributions], dtype=float))})


# --------------------------------------------------------------------------- versions
def versions_table(ws: "Workspace", name: str) -> pd.DataFrame:
    """The versions of a template, newest first: version, saved by/at, base, sha256, message."""
    rows = list(reversed(list_versions(ws, name)))
    return pd.DataFrame({
        "version": [v.version for v in rows],
        "saved by": [v.saved_by for v in rows],
        "saved at": [v.saved_at or "shipped" for v in rows],
        "base": [("" if v.base_version is None else str(v.base_version)) for v in rows],
        "sha256": [v.sha256[:12] for v in rows],
        "message": [v.message for v in rows],
    })


def changes_table(changes: Sequence[TemplateChange]) -> pd.DataFrame:
    """Structured template changes (:func:`core.rewards.versions.diff_templates`) as a table."""
    def show(v: Any) -> str:
        return "—" if v is None else (_yaml_text(v) if isinstance(v, (dict, list)) else str(v))

    return pd.DataFrame({"section": [c.section for c in changes], "key": [c.key for c in changes],
                         "before": [show(c.a) for c in changes], "after": [show(c.b) for c in changes]})


__all__ = ["FINAL_TERMS", "RETURN_PARTS", "STEP_REWARDS", "TABLE_DIGITS", "contributions_table", "round_figures",
           "ComponentEditor", "ComponentShare", "EpisodeExplanation", "LevelEditor", "Metric", "ParamField",
           "PyramidEdits", "PyramidEditor", "PyramidLevel", "PyramidReport", "TemplateOption", "apply_edits",
           "apply_params", "apply_yaml", "changes_table", "contribution_stats", "episodes_table",
           "expectations_table", "explain_episode", "histogram", "level_histogram", "open_template",
           "pyramid_editor", "pyramid_levels", "pyramid_note", "pyramid_report", "rescore", "return_histogram",
           "template_options", "versions_table"]
