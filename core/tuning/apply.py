"""Applying a study's result: its best feasible weights (or a chosen trial's) saved as a new
version of the template it tuned (:func:`apply_study`), and the record of every such
version (:func:`list_applications`).

The guard (:func:`apply_check`): weights with a held-out figure (the study's primary figure, or
the optimised figure, on the tasks it never tuned on) below the template's own on the same
tasks are refused (:class:`WorseThanTemplate`, naming the drop) unless the caller confirms
(``force``); the comparison and the decision are recorded with the version.  The new version is
written onto the tuned version's text, so its comments and key order stay."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, cast

import optuna

from core.access.users import Actor, authorize
from core.base.errors import ConflictError, InputError, RwbError
from core.base.results import to_jsonable
from core.rewards.template import parse_template
from core.rewards.template_text import edited_text
from core.rewards.versions import diff_templates, list_versions, save_template
from core.tuning.config import SearchSpace
from core.tuning.heldout import primary_figures
from core.tuning.records import finite, load_study, now_iso, storage_for, study_attrs
from core.tuning.storage import describe_url

if TYPE_CHECKING:  # pragma: no cover
    from core.records.store import Workspace


class NoFeasibleTrial(RwbError):
    """The study has no completed trial that satisfies every expectation."""


class WorseThanTemplate(ConflictError):
    """A held-out figure of the weights is below the template's own on the same held-out episodes
    and the caller did not confirm saving them anyway; ``check`` holds the comparison (its
    :attr:`~ApplyCheck.question` is what to ask the person)."""

    def __init__(self, message: str, *, check: "ApplyCheck"):
        super().__init__(message)
        self.check = check


#: Plain names of the held-out figures the guard compares (the technical name goes beside it).
PLAIN_FIGURES: dict[str, str] = {
    "within_task": "how well it ranks each held-out task's successful runs above its failed ones",
    "all_pairs": "how well it ranks successful held-out runs above failed ones",
    "soft_within_task": "how well it ranks each held-out task's successful runs above its failed ones (smooth)",
    "soft_auc": "how well it ranks successful held-out runs above failed ones (smooth)",
    "auc": "how well it ranks successful held-out runs above failed ones",
    "kendall_tau": "how well its order of the held-out runs follows their outcome",
    "agreement": "how often it agrees with your preference labels on held-out pairs",
    "success_rate": "how often a policy trained on it succeeds on held-out tasks",
}


@dataclass(frozen=True)
class HeldOutFigure:
    """One held-out figure of the trial ``apply`` would save, beside the template's own on the
    same held-out episodes."""

    #: The figure's key (within_task, all_pairs, soft_within_task, agreement, …)
    key: str
    #: Its technical name, as in messages ("held-out within-task AUC")
    label: str
    #: The trial's value and the template's (None: not measured)
    trial: float | None
    template: float | None

    @property
    def change(self) -> float | None:
        """The trial's value less the template's (None when either is missing)."""
        return None if self.trial is None or self.template is None else self.trial - self.template


@dataclass(frozen=True)
class ApplyCheck:
    """How the held-out figures of the trial ``apply`` would save compare with the template's own
    on the same held-out episodes (the tasks the study never tuned on)."""

    #: The study and the trial that would be applied
    study: str
    trial: int
    #: The figure named in messages: the first of :attr:`figures` that drops, else the first measured
    #: (the study's primary held-out figure: within_task or all_pairs for outcome studies, agreement,
    #: success_rate)
    metric: str
    #: What the figure is called in messages
    label: str
    #: The trial's value of that figure and the template's own on the same held-out episodes (None: not measured)
    figure: float | None
    template: float | None
    #: Held-out tasks with both outcomes (outcome studies; None elsewhere)
    tasks_with_both: int | None
    #: Some compared figure of the trial is below the template's
    worse: bool
    #: Every figure compared (the primary one first; outcome studies also compare the held-out
    #: value of the objective the study optimised, the figure its page shows beside the best value)
    figures: tuple[HeldOutFigure, ...] = ()
    #: The version the study tuned ("finance_risk@1") and the one apply would write ("finance_risk@2")
    template_label: str = "the template"
    new_label: str = "a new version"

    @property
    def drop(self) -> float | None:
        """How far the named figure is below the template's (None when it is not below)."""
        change = None if self.figure is None or self.template is None else self.figure - self.template
        return -change if change is not None and change < 0 else None

    @property
    def plain(self) -> str:
        """One sentence in plain words: better or worse than the current template on the episodes
        the study was not tuned on, with both figures rounded."""
        what = PLAIN_FIGURES.get(self.metric, self.label)
        if self.figure is None or self.template is None:
            return (f"The tuned weights cannot be compared with {self.template_label} on the episodes they were "
                    f"not tuned on ({what}: not measured)")
        if self.worse:
            return (f"Worse than the current template on episodes it was not tuned on: {what} is "
                    f"{self.figure:.3f}, {self.template - self.figure:.3f} below {self.template_label}'s "
                    f"{self.template:.3f}")
        relation = "Better than" if self.figure > self.template else "As good as"
        return (f"{relation} the current template on episodes it was not tuned on: {what} is {self.figure:.3f} "
                f"against {self.template_label}'s {self.template:.3f}")

    @property
    def drop_sentence(self) -> str:
        """The drop in one sentence: both figures and the difference, rounded."""
        drop = self.drop if self.drop is not None else 0.0
        return (f"The tuned weights score {_text(self.figure)} on held-out episodes ({self.label}), "
                f"{drop:.3f} below {self.template_label}'s {_text(self.template)}.")

    @property
    def question(self) -> str:
        """The confirmation a caller asks for before saving worse weights (names the drop)."""
        return f"{self.drop_sentence} Save them anyway as {self.new_label}?"

    @property
    def message(self) -> str:
        """One sentence giving both figures."""
        if self.figure is None or self.template is None:
            return (f"trial {self.trial}'s {self.label} cannot be compared with the template's (not measured: "
                    f"trial {_text(self.figure)}, template {_text(self.template)})")
        where = "" if self.tasks_with_both is None else \
            f" ({self.tasks_with_both} held-out tasks with both outcomes)"
        relation = "below" if self.worse else "at or above"
        return (f"trial {self.trial}'s {self.label} {self.figure:.3f} is {relation} the template's own "
                f"{self.template:.3f} on the same held-out tasks{where}")


def _text(x: float | None) -> str:
    return "none" if x is None else f"{x:.3f}"


def _chosen_trial(st: optuna.Study, name: str, trial: int | None) -> optuna.trial.FrozenTrial:
    """The best feasible trial, or trial ``trial`` (completed and feasible)."""
    if trial is None:
        try:
            return st.best_trial
        except ValueError:
            raise NoFeasibleTrial(f"study {name!r} has no completed trial that satisfies every expectation; "
                                  "run more trials or widen the bounds") from None
    matches = [tr for tr in st.get_trials(deepcopy=False) if tr.number == trial]
    if not matches or matches[0].state != optuna.trial.TrialState.COMPLETE:
        raise InputError(f"study {name!r} has no completed trial {trial}", field="trial")
    chosen = matches[0]
    if any(v > 0 for v in chosen.constraints.values()):
        bad = ", ".join(k for k, v in chosen.constraints.items() if v > 0)
        raise InputError(f"trial {trial} breaks expectations ({bad}); choose a feasible trial", field="trial")
    return chosen


def _number(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and x == x else None


def _labels(ws: "Workspace", tinfo: dict[str, Any]) -> tuple[str, str]:
    """("name@base", "name@next") of the template a study tuned and of the version apply would write."""
    name, base = tinfo["name"], tinfo.get("version")
    try:
        latest = list_versions(ws, name)[-1].version
    except InputError:  # a template file outside the workspace: its first saved version
        latest = 0
    return (f"{name}@{base}" if base is not None else name), f"{name}@{latest + 1}"


def _compare(ws: "Workspace", st: optuna.Study, attrs: dict[str, Any], chosen: optuna.trial.FrozenTrial
             ) -> ApplyCheck:
    objective = attrs["config"]["objective"]
    tasks = None
    metric = attrs.get("metric", "value")
    base_held = (((attrs.get("baseline") or {}).get("figures") or {}).get("held_out") or {})
    figures: list[HeldOutFigure] = []
    if objective == "outcome":
        primary, label, figure, template = primary_figures(attrs, chosen.user_attrs)
        tasks = ((attrs.get("held_out") or {}).get("tasks_with_both"))
        figures.append(HeldOutFigure(primary, label, figure, template))
        # the optimised figure on the held-out episodes (what the page shows beside the best value)
        figures.append(HeldOutFigure(metric, f"held-out {metric.replace('_', ' ')}",
                                     _number(chosen.user_attrs.get("held_out")), _number(base_held.get(metric))))
    else:
        template = _number(base_held.get(metric))
        if template is None:  # the policy objective measures the template as its first trial
            base = [tr for tr in st.get_trials(deepcopy=False) if tr.user_attrs.get("baseline")
                    and tr.state == optuna.trial.TrialState.COMPLETE]
            template = _number(base[0].user_attrs.get("held_out")) if base else None
        figures.append(HeldOutFigure(metric, f"held-out {metric.replace('_', ' ')}",
                                     _number(chosen.user_attrs.get("held_out")), template))
    drops = [f for f in figures if f.change is not None and f.change < 0]
    # named: the first figure that drops (the primary one before the optimised one), else the first measured
    named = drops[0] if drops else next((f for f in figures if f.change is not None), figures[0])
    template_label, new_label = _labels(ws, attrs["template"])
    return ApplyCheck(study=st.study_name, trial=chosen.number, metric=named.key, label=named.label,
                      figure=named.trial, template=named.template, tasks_with_both=tasks, worse=bool(drops),
                      figures=tuple(figures), template_label=template_label, new_label=new_label)


def apply_check(ws: "Workspace", name: str, *, storage: str | None = None, trial: int | None = None
                ) -> ApplyCheck:
    """How the held-out figures of the trial :func:`apply_study` would save (the best feasible
    one, or ``trial``) compare with the template's own on the same held-out episodes."""
    url = storage_for(ws, name, storage)
    st = load_study(ws, name, url)
    return _compare(ws, st, study_attrs(st), _chosen_trial(st, name, trial))


@dataclass(frozen=True)
class AppliedStudy:
    """The template version :func:`apply_study` wrote from a study's weights."""

    #: The study and its trial whose weights were applied
    study: str
    trial: int
    #: The template, the version the study started from and the version written
    template: str
    base_version: int | None
    version: int
    #: The new version as "name@version"
    label: str
    #: What changed from the base version (one entry per changed weight or parameter)
    diff: list[dict[str, Any]]
    #: The objective's figures of the trial, as recorded with the new version
    figures: dict[str, Any]
    #: The version's message: the one given, or one that names the study, trial and figures
    message: str


def apply_study(ws: "Workspace", actor: Actor, name: str, *, storage: str | None = None,
                trial: int | None = None, message: str | None = None, force: bool = False) -> AppliedStudy:
    """Write a study's best feasible weights (or trial ``trial``'s) as a **new version** of
    the template it tuned, with the diff and the objective's figures recorded.

    Weights with a held-out figure below the template's own on the same held-out episodes
    (:func:`apply_check`) are refused with :class:`WorseThanTemplate`, whose message names the
    drop, unless ``force`` (the caller asked the person and they confirmed); the comparison
    and the decision are recorded in the figures (``guard``).

    The save names the version the study started from, so it is refused
    (:class:`~core.rewards.versions.TemplateConflict`) when someone saved a newer version
    since; nothing is overwritten.  Needs ``edit_template``."""
    authorize(ws, actor, "edit_template")
    url = storage_for(ws, name, storage)
    st = load_study(ws, name, url)
    attrs = study_attrs(st)
    chosen = _chosen_trial(st, name, trial)
    check = _compare(ws, st, attrs, chosen)
    if check.worse and not force:
        raise WorseThanTemplate(f"Not saved: {check.drop_sentence} Confirm to save them anyway as "
                                f"{check.new_label} (rwb tune apply {name} --force).", check=check)
    if check.figure is None or check.template is None:
        decision = "applied without a comparison (a held-out figure was not measured)"
    elif check.worse:
        decision = "applied although worse than the template on the held-out tasks (confirmed)"
    else:
        decision = "applied: at or above the template on the held-out tasks"
    space = SearchSpace.from_dict(attrs["space"])
    weights, params = space.decode(chosen.params)
    tinfo = attrs["template"]
    base = parse_template(tinfo["yaml"], file=f"study {name}")
    new = base.with_weights(weights)
    for comp, p in params.items():
        new = new.with_params(comp, {**dict(new.component(comp).params), **dict(p)})
    diff = to_jsonable(diff_templates(base, new))  # stored in the version's meta and the applications table
    if not diff:
        raise InputError(f"trial {chosen.number} of study {name!r} keeps the template's own weights; there is "
                         "nothing to apply", field="study")
    metric = attrs.get("metric", "value")
    figures = finite({
        "study": name, "trial": chosen.number, "storage": describe_url(url), "objective": attrs["config"]["objective"],
        "metric": metric, "train": chosen.value, "held_out": chosen.user_attrs.get("held_out"),
        "held_out_auc": chosen.user_attrs.get("held_out_auc"),
        "held_out_within": chosen.user_attrs.get("held_out_within"),
        "guard": {"metric": check.metric, "label": check.label, "trial": check.figure, "template": check.template,
                  "tasks_with_both": check.tasks_with_both, "worse": check.worse,
                  "confirmed": bool(force and check.worse), "decision": decision,
                  "figures": [asdict(f) for f in check.figures]},
        "constraints": dict(chosen.constraints), "baseline": attrs.get("baseline"),
        "split": attrs.get("split"), "data": {k: v for k, v in attrs["data"].items()},
        "base": {"name": tinfo["name"], "version": tinfo["version"], "sha256": tinfo["sha256"]}})
    held = figures["held_out"]
    text = message or (f"tuned by study {name} (trial {chosen.number}): {metric} {chosen.value:.3f} on the "
                       f"training split" + (f", {held:.3f} held out" if isinstance(held, (int, float)) else ""))
    # written onto the tuned version's text: its comments and key order stay
    saved = save_template(ws, actor, tinfo["name"], edited_text(tinfo["yaml"], new), tinfo["version"], text,
                          meta={"tuning": figures, "diff": diff})
    with ws.transaction() as conn:
        conn.execute("INSERT INTO tuning_applications(study, trial_number, template_name, base_version, version, "
                     "figures, diff, applied_by, applied_at) VALUES (?,?,?,?,?,?,?,?,?)",
                     (name, chosen.number, tinfo["name"], tinfo["version"], saved.version,
                      json.dumps(figures, sort_keys=True), json.dumps(diff, sort_keys=True), actor.name, now_iso()))
    return AppliedStudy(study=name, trial=chosen.number, template=tinfo["name"], base_version=tinfo["version"],
                        version=saved.version, label=saved.label, diff=cast("list[dict[str, Any]]", diff),
                        figures=figures, message=saved.message)


@dataclass(frozen=True)
class WeightApplication:
    """A template version written from a study's weights (:func:`list_applications`)."""

    id: int
    #: The study and its trial whose weights were applied
    study: str
    trial: int
    #: The template, the version the study started from and the version written
    template: str
    base_version: int | None
    version: int
    #: The objective's figures of the trial, as recorded with the new version
    figures: dict[str, Any]
    #: What changed from the base version (one entry per changed weight or parameter)
    diff: list[dict[str, Any]]
    applied_by: str
    applied_at: str


def list_applications(ws: "Workspace", name: str | None = None) -> list[WeightApplication]:
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
        out.append(WeightApplication(**{**d, "figures": json.loads(d["figures"]), "diff": json.loads(d["diff"])}))
    return out
