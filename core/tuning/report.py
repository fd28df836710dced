"""Watching a study: what the Tuning page and ``rwb tune show`` read of it
(:func:`study_report`): counts, best vs template weights, the constraint status of each
recent trial, and the data of its charts (:class:`StudyCharts`: optimisation history,
parameter importances, parallel coordinates; the app draws them).  :func:`space_rows` gives
a template's default search space as the page's editable bounds table."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import optuna
import pandas as pd
from optuna.importance import get_param_importances
from optuna.trial import TrialState

from core.rewards.template import Template
from core.tuning.config import SearchSpace, outcome_readers
from core.tuning.data import resolve_template_ref
from core.tuning.heldout import PRIMARY
from core.tuning.records import (HELD_OUT_ATTR, StudyRun, finite, get_study, list_studies, storage_for, study_attrs,
                                 study_runs)
from core.tuning.storage import count_trials, describe_url, open_storage, study_id

if TYPE_CHECKING:  # pragma: no cover
    from core.records.store import Workspace

#: Plain names of a study's figures (the key as in ``TuneResult.metric`` and the figures), each with
#: the technical term and what good looks like, for a tooltip.
FIGURES: dict[str, tuple[str, str]] = {
    "soft_within_task": ("Ranks each task's successes above its failures",
                         "Smooth within-task AUC: the share of (successful, failed) run pairs of the same task "
                         "whose returns are in the right order, smoothed so the optimiser can follow it. "
                         "0.5 is chance, 1 is perfect."),
    "within_task": ("Ranks each task's successes above its failures",
                    "Within-task AUC: the share of (successful, failed) run pairs of the same task whose returns "
                    "are in the right order. 0.5 is chance, 1 is perfect."),
    "soft_auc": ("Ranks successful runs above failed ones",
                 "Smooth AUC over all pairs (soft_auc): the share of (successful, failed) run pairs whose returns "
                 "are in the right order, smoothed so the optimiser can follow it. 0.5 is chance, 1 is perfect."),
    "auc": ("Ranks successful runs above failed ones",
            "AUC over all pairs: the share of (successful, failed) run pairs whose returns are in the right "
            "order. 0.5 is chance, 1 is perfect."),
    "all_pairs": ("Ranks successful runs above failed ones",
                  "AUC over all pairs: the share of (successful, failed) run pairs whose returns are in the right "
                  "order. 0.5 is chance, 1 is perfect."),
    "kendall_tau": ("Order of returns follows the outcomes",
                    "Kendall's τ-b between the returns and the outcome: −1 reversed, 0 unrelated, 1 the same order."),
    "agreement": ("Agrees with your preference labels",
                  "Share of the labelled pairs whose returns put the preferred episode first. 0.5 is chance, "
                  "1 agrees with every label."),
    "success_rate": ("Success of a short trained policy",
                     "Share of held-out tasks that a short PPO run trained on these weights resolves. Higher is "
                     "better."),
}

#: The page's names of the outcome objective's metric choices (the setting's value in the tooltip).
METRIC_CHOICES: dict[str, str] = {
    "within_task": "Within each task (recommended)",
    "all_pairs": "Across all runs",
    "soft_auc": "Across all runs (older name)",
    "auc": "Across all runs, exact (not smooth)",
    "kendall": "Rank correlation with the outcome",
}


def figure_name(key: str | None) -> tuple[str, str]:
    """(plain label, technical term with what good looks like) of a figure key; the key itself
    when it has no plain name."""
    if not key:
        return "Objective", "The study's objective value."
    return FIGURES.get(key, (key.replace("_", " ").capitalize(), key))


#: Trials whose parameter importances are computed (the most recent completed ones; slow on many).
PLOT_IMPORTANCE_TRIALS = 300
#: Trials drawn in the parallel coordinates (the best completed ones).
PLOT_PARALLEL_TRIALS = 200
#: Trials listed in the report's table (the most recent).
REPORT_TRIALS = 200


@dataclass(frozen=True)
class StudyCharts:
    """The data of a study's charts (the app draws them; empty before a completed trial).

    ``history``: every completed trial in order, columns ``trial``, ``value``, ``feasible``
    (it satisfies every expectation) and ``best`` (the best feasible value so far, NaN
    before the first); ``importances``: tuned parameter → its share of the value's variance
    (fANOVA over the last :data:`PLOT_IMPORTANCE_TRIALS` completed trials), largest first;
    ``parallel``: the :data:`PLOT_PARALLEL_TRIALS` best completed trials, columns ``trial``,
    ``value`` and one per parameter (a trial lacking one is left out)."""

    history: pd.DataFrame | None = None
    importances: dict[str, float] | None = None
    parallel: pd.DataFrame | None = None


@dataclass
class StudyReport:
    """Everything the Tuning page shows about one study."""

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
    runs: list[StudyRun]
    charts: StudyCharts
    notes: list[str]
    #: per completed trial, in order: ``trial``, ``objective`` (the value) and ``held-out AUC``
    #: (outcome studies; None elsewhere) — the page's chart of the two side by side
    held_out_series: dict[str, list[Any]] = field(default_factory=dict)
    #: outcome studies: the best trial's held-out within-task and all-pairs AUC beside the template's own
    #: (:func:`held_out_comparison`); None elsewhere or before a feasible trial
    held_out: dict[str, Any] | None = None
    #: what the analyst should know about the study (small labelled set, a fallback to all pairs, …)
    warnings: list[str] = field(default_factory=list)
    #: why the study is not running although it did not finish (a failed run's cause, a worker
    #: that died); None while it runs, when new or finished (:attr:`StudyRecord.cause`)
    cause: str | None = None


def study_fingerprint(ws: "Workspace", name: str, storage: str | None = None) -> tuple[int, str]:
    """(number of trials, storage) of a study: changes whenever a trial is written (cheap; the
    page recomputes its report only then)."""
    url = storage_for(ws, name, storage)
    rdb = open_storage(url)
    sid = study_id(rdb, name)
    return (0 if sid is None else count_trials(rdb, sid), describe_url(url))


def study_report(ws: "Workspace", name: str, storage: str | None = None) -> StudyReport:
    """The state of a study for the Tuning page: counts, best vs template weights, the
    constraint status of each recent trial, and the data of its charts (optimisation
    history, parameter importances, parallel coordinates)."""
    url = storage_for(ws, name, storage)
    runs = study_runs(ws, name)
    rdb = open_storage(url)
    if study_id(rdb, name) is None:
        # launched, the worker has not created it yet
        rec = get_study(ws, name)
        waiting = ["the worker is preparing the study (scoring the data)"] if rec.status == "running" else \
            ["no trial was run"]
        return StudyReport(name=name, storage=describe_url(url), status=rec.status, objective=rec.objective,
                           metric="", template={"name": rec.template_name, "version": rec.template_version},
                           data={"dataset": rec.dataset, "episodes_file": rec.episodes_file}, split={},
                           counts={}, best=None, baseline=None, weights=[], params=[], constraints=[], trials=[],
                           runs=runs, charts=StudyCharts(), held_out_series={}, notes=waiting, cause=rec.cause)
    st = optuna.load_study(study_name=name, storage=rdb)
    attrs = study_attrs(st)
    trials = st.get_trials(deepcopy=False)
    counts = {s.name.lower(): 0 for s in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL,
                                          TrialState.RUNNING, TrialState.WAITING)}
    for tr in trials:
        counts[tr.state.name.lower()] = counts.get(tr.state.name.lower(), 0) + 1
    complete = [tr for tr in trials if tr.state == TrialState.COMPLETE]
    feasible = [tr for tr in complete if _feasible(tr)]
    counts["feasible"] = len(feasible)
    counts["infeasible"] = len(complete) - len(feasible)
    space = SearchSpace.from_dict(attrs["space"])
    current = dict(attrs["baseline"]["weights"])
    best: dict[str, Any] | None = None
    if feasible:
        bt = st.best_trial
        bw, bp = space.decode(bt.params)
        best = {"trial": bt.number, "value": bt.value, "held_out": bt.user_attrs.get("held_out"),
                "held_out_auc": bt.user_attrs.get("held_out_auc"), "cv_auc": bt.user_attrs.get("cv_auc"),
                "held_out_within": bt.user_attrs.get("held_out_within"), "cv_within": bt.user_attrs.get("cv_within"),
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
               "cv_auc": tr.user_attrs.get("cv_auc"), "held_out_within": tr.user_attrs.get("held_out_within"),
               "feasible": None if tr.state != TrialState.COMPLETE else _feasible(tr)}
        row.update({f"c: {k}": v for k, v in sorted(tr.constraints.items())})
        table.append(row)
    notes: list[str] = []
    history = importances = parallel = None
    if complete:
        history = _history(complete)
    tuned = [k for k in list(space.weights) + list(space.params)]
    if len(complete) >= 2 and tuned:
        recent = _view_study(st, complete[-PLOT_IMPORTANCE_TRIALS:])
        try:
            importances = {k: float(v) for k, v in get_param_importances(recent).items()}
        except (RuntimeError, ValueError) as exc:  # e.g. every value equal: nothing to attribute
            notes.append(f"parameter importances unavailable: {exc}")
        if len(complete) > PLOT_IMPORTANCE_TRIALS:
            notes.append(f"importances use the last {PLOT_IMPORTANCE_TRIALS} completed trials")
        top = sorted(complete, key=_value, reverse=True)[:PLOT_PARALLEL_TRIALS]
        parallel = _parallel(top)
        if len(complete) > PLOT_PARALLEL_TRIALS:
            notes.append(f"parallel coordinates show the {PLOT_PARALLEL_TRIALS} best completed trials")
    elif not complete:
        notes.append("no completed trial yet")
    listed = next((s for s in list_studies(ws) if s.name == name), None)
    return StudyReport(
        name=name, storage=describe_url(url), status=listed.status if listed else "external",
        objective=attrs["config"]["objective"], metric=attrs.get("metric", ""),
        template={k: attrs["template"][k] for k in ("name", "version", "ref")}, data=attrs["data"],
        split=attrs.get("split", {}), counts=counts, best=finite(best), baseline=attrs.get("baseline"),
        weights=finite(weights), params=finite(params), constraints=constraint_rows, trials=finite(table),
        runs=runs, charts=StudyCharts(history=history, importances=importances, parallel=parallel), notes=notes,
        held_out_series=finite({"trial": [tr.number for tr in complete], "objective": [tr.value for tr in complete],
                                "held-out AUC": [tr.user_attrs.get("held_out_auc") for tr in complete]}),
        held_out=finite(held_out_comparison(attrs, best, st.user_attrs.get(HELD_OUT_ATTR))),
        warnings=list(attrs.get("warnings") or []), cause=listed.cause if listed else None)


def held_out_comparison(attrs: dict[str, Any], best: dict[str, Any] | None, stored: dict[str, Any] | None
                        ) -> dict[str, Any] | None:
    """The best trial's held-out within-task and all-pairs AUC beside the template's own on the same
    held-out tasks, as rows (``figure``, ``best``, ``template``, ``change`` with ↑/↓, and the 90%
    intervals where the last run measured them for this trial), with the task counts and which
    figure the study answers to (``metric``).  None for other objectives or before a feasible trial."""
    report = attrs.get("held_out")
    if attrs["config"]["objective"] != "outcome" or not report or best is None:
        return None
    held = ((attrs.get("baseline") or {}).get("figures") or {}).get("held_out") or {}
    intervals = stored if stored and stored.get("best_trial") == best["trial"] else None
    rows = []
    for key in ("within_task", "all_pairs"):
        _, trial_key, figure_key = PRIMARY[key]
        value, before = best.get(trial_key), held.get(figure_key)
        change = None
        if value is not None and before is not None:
            arrow = "↑" if value > before else ("↓" if value < before else "=")
            change = f"{arrow} {value - before:+.3f}"
        rows.append({"figure": "within-task AUC" if key == "within_task" else "all-pairs AUC",
                     "best trial": value, "template": before, "change": change,
                     "best 90% interval": ((intervals or {}).get("best") or {}).get(key, {}).get("ci90"),
                     "template 90% interval": (report.get("template") or {}).get(key, {}).get("ci90"),
                     "pairs": (report.get("template") or {}).get(key, {}).get("n_pairs")})
    return {"metric": attrs.get("primary") or "all_pairs", "tasks": report.get("tasks"),
            "tasks_with_both": report.get("tasks_with_both"), "episodes": report.get("episodes"),
            "best_trial": best["trial"], "rows": rows}


def _status(constraint: float | None) -> str:
    return "-" if constraint is None else ("satisfied" if constraint <= 0 else "violated")


def _value(trial: optuna.trial.FrozenTrial) -> float:
    """The objective value of a completed trial (Optuna sets it when the trial completes)."""
    assert trial.value is not None, f"trial {trial.number} has no value: it did not complete"
    return float(trial.value)


def _feasible(trial: optuna.trial.FrozenTrial) -> bool:
    """Whether a completed trial satisfies every expectation (Optuna: every constraint ≤ 0)."""
    return all(v <= 0 for v in trial.constraints.values())


def _history(complete: Sequence[optuna.trial.FrozenTrial]) -> pd.DataFrame:
    """The optimisation history of the completed trials (see :class:`StudyCharts`)."""
    values = np.array([_value(tr) for tr in complete])
    feasible = np.array([_feasible(tr) for tr in complete], dtype=bool)
    best = np.maximum.accumulate(np.where(feasible, values, -np.inf))
    return pd.DataFrame({"trial": [tr.number for tr in complete], "value": values, "feasible": feasible,
                         "best": np.where(np.isfinite(best), best, np.nan)})


def _parallel(trials: Sequence[optuna.trial.FrozenTrial]) -> pd.DataFrame:
    """Value and parameters of ``trials`` (see :class:`StudyCharts`), parameters in name order."""
    names = sorted({k for tr in trials for k in tr.params})
    rows = [{"trial": tr.number, "value": _value(tr), **{k: tr.params[k] for k in names}}
            for tr in trials if all(k in tr.params for k in names)]
    return pd.DataFrame(rows, columns=["trial", "value", *names])


def _view_study(study: optuna.Study, trials: Sequence[optuna.trial.FrozenTrial]) -> optuna.Study:
    """An in-memory study holding ``trials`` (to measure a subset of a large study)."""
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # no "study created" line per redraw
    try:
        view = optuna.create_study(direction=study.direction, study_name=study.study_name)
    finally:
        optuna.logging.set_verbosity(verbosity)
    view.add_trials(trials)
    return view


def space_rows(ws: "Workspace | None", template: Template | str | Path, *, withhold: bool = True
               ) -> list[dict[str, Any]]:
    """The default search space of a template as editable rows (the page's bounds table):
    component, level, weight, low, high, tune (False for components held at their weight —
    the outcome readers while the outcome is withheld)."""
    t = resolve_template_ref(ws, template).template
    readers = outcome_readers(t)
    space = SearchSpace.for_template(t, exclude=readers if withhold else ())
    return [{"component": c.name, "level": c.group, "weight": c.weight,
             "low": space.weights.get(c.name, (0.0, max(1.0, 2 * c.weight)))[0],
             "high": space.weights.get(c.name, (0.0, max(1.0, 2 * c.weight)))[1],
             "tune": c.name in space.weights, "reads_outcome": c.name in readers}
            for c in t.all_components]
