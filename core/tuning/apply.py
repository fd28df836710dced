"""Applying a study's result: its best feasible weights (or a chosen trial's) saved as a new
version of the template it tuned (:func:`apply_study`), and the record of every such
version (:func:`list_applications`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import optuna

from core.access.users import Actor, authorize
from core.base.errors import InputError, RwbError
from core.base.results import to_jsonable
from core.rewards.template import parse_template
from core.rewards.versions import diff_templates, save_template
from core.tuning.config import SearchSpace
from core.tuning.records import finite, load_study, now_iso, storage_for, study_attrs
from core.tuning.storage import describe_url

if TYPE_CHECKING:  # pragma: no cover
    from core.records.store import Workspace


class NoFeasibleTrial(RwbError):
    """The study has no completed trial that satisfies every expectation."""


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
                trial: int | None = None, message: str | None = None) -> AppliedStudy:
    """Write a study's best feasible weights (or trial ``trial``'s) as a **new version** of
    the template it tuned, with the diff and the objective's figures recorded.

    The save names the version the study started from, so it is refused
    (:class:`~core.rewards.versions.TemplateConflict`) when someone saved a newer version
    since; nothing is overwritten.  Needs ``edit_template``."""
    authorize(ws, actor, "edit_template")
    url = storage_for(ws, name, storage)
    st = load_study(ws, name, url)
    attrs = study_attrs(st)
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
    diff = to_jsonable(diff_templates(base, new))  # stored in the version's meta and the applications table
    if not diff:
        raise InputError(f"trial {chosen.number} of study {name!r} keeps the template's own weights; there is "
                         "nothing to apply", field="study")
    metric = attrs.get("metric", "value")
    figures = finite({
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
