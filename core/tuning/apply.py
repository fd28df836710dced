"""Applying a study's result: its best feasible weights (or a chosen trial's) saved as a new
version of the template it tuned (:func:`apply_study`), and the record of every such
version (:func:`list_applications`).

The guard (:func:`apply_check`): weights whose held-out figure (the study's primary figure on
the tasks it never tuned on) is below the template's own on the same tasks are refused
(:class:`WorseThanTemplate`) unless the caller confirms; the comparison and the decision are
recorded with the version."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import optuna

from core.access.users import Actor, authorize
from core.base.errors import ConflictError, InputError, RwbError
from core.base.results import to_jsonable
from core.rewards.template import parse_template
from core.rewards.versions import diff_templates, save_template
from core.tuning.config import SearchSpace
from core.tuning.heldout import primary_figures
from core.tuning.records import finite, load_study, now_iso, storage_for, study_attrs
from core.tuning.storage import describe_url

if TYPE_CHECKING:  # pragma: no cover
    from core.records.store import Workspace


class NoFeasibleTrial(RwbError):
    """The study has no completed trial that satisfies every expectation."""


class WorseThanTemplate(ConflictError):
    """The weights' held-out figure is below the template's own on the same held-out tasks (the
    caller did not confirm applying them anyway)."""


@dataclass(frozen=True)
class ApplyCheck:
    """How the held-out figure of the trial ``apply`` would save compares with the template's own."""

    #: The study and the trial that would be applied
    study: str
    trial: int
    #: The figure compared: within_task or all_pairs (outcome studies), agreement, success_rate
    metric: str
    #: What the figure is called in messages
    label: str
    #: The trial's held-out figure and the template's own on the same held-out tasks (None: not measured)
    figure: float | None
    template: float | None
    #: Held-out tasks with both outcomes (outcome studies; None elsewhere)
    tasks_with_both: int | None
    #: The trial's figure is below the template's
    worse: bool

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


def _compare(st: optuna.Study, attrs: dict[str, Any], chosen: optuna.trial.FrozenTrial) -> ApplyCheck:
    objective = attrs["config"]["objective"]
    tasks = None
    if objective == "outcome":
        metric, label, figure, template = primary_figures(attrs, chosen.user_attrs)
        tasks = ((attrs.get("held_out") or {}).get("tasks_with_both"))
    else:
        metric = attrs.get("metric", "value")
        label = f"held-out {metric}"
        figure = chosen.user_attrs.get("held_out")
        template = ((((attrs.get("baseline") or {}).get("figures") or {}).get("held_out") or {}).get(metric))
        if template is None:  # the policy objective measures the template as its first trial
            base = [tr for tr in st.get_trials(deepcopy=False) if tr.user_attrs.get("baseline")
                    and tr.state == optuna.trial.TrialState.COMPLETE]
            template = base[0].user_attrs.get("held_out") if base else None
    worse = figure is not None and template is not None and figure < template
    return ApplyCheck(study=st.study_name, trial=chosen.number, metric=metric, label=label, figure=figure,
                      template=template, tasks_with_both=tasks, worse=worse)


def apply_check(ws: "Workspace", name: str, *, storage: str | None = None, trial: int | None = None
                ) -> ApplyCheck:
    """How the held-out figure of the trial :func:`apply_study` would save (the best feasible
    one, or ``trial``) compares with the template's own on the same held-out tasks."""
    url = storage_for(ws, name, storage)
    st = load_study(ws, name, url)
    return _compare(st, study_attrs(st), _chosen_trial(st, name, trial))


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
                trial: int | None = None, message: str | None = None, confirm_worse: bool = False) -> AppliedStudy:
    """Write a study's best feasible weights (or trial ``trial``'s) as a **new version** of
    the template it tuned, with the diff and the objective's figures recorded.

    Weights whose held-out figure is below the template's own on the same held-out tasks
    (:func:`apply_check`) are refused with :class:`WorseThanTemplate` unless ``confirm_worse``;
    the comparison and the decision are recorded in the figures (``guard``).

    The save names the version the study started from, so it is refused
    (:class:`~core.rewards.versions.TemplateConflict`) when someone saved a newer version
    since; nothing is overwritten.  Needs ``edit_template``."""
    authorize(ws, actor, "edit_template")
    url = storage_for(ws, name, storage)
    st = load_study(ws, name, url)
    attrs = study_attrs(st)
    chosen = _chosen_trial(st, name, trial)
    check = _compare(st, attrs, chosen)
    if check.worse and not confirm_worse:
        raise WorseThanTemplate(f"not applied: {check.message}, so these weights rank the runs of tasks they "
                                "were not tuned on worse than the template does. Confirm to apply them anyway "
                                "(rwb tune apply --confirm-worse; on the Tuning page, tick the confirm box)")
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
                  "confirmed": bool(confirm_worse and check.worse), "decision": decision},
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
