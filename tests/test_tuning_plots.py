"""A study's charts: core reports their data (core.tuning.report.StudyCharts), the app draws
them (rwb_app.plots.tuning).  The data is checked against the study's own trials, the figures
against the data they were drawn from."""

from __future__ import annotations

import math

import numpy as np
import optuna
import pandas as pd
import pytest

from core import tuning
from core.access.users import current_user
from core.rewards.versions import save_template
from rwb_app.plots import tuning as study_plots
from _tuning_fixtures import FIN_FAST, finance_workspace

optuna.logging.set_verbosity(optuna.logging.WARNING)


@pytest.fixture(scope="module")
def studied(tmp_path_factory):
    """A workspace with a finished 25-trial outcome study, and its report."""
    ws = finance_workspace(tmp_path_factory.mktemp("charts") / "ws", n_episodes=60, seed=2)
    save_template(ws, current_user(ws), "fin_fast", FIN_FAST, None, "for the chart tests")
    tuning.tune(ws, current_user(ws), "fin_fast", dataset="fin", trials=25, study="charts")
    yield ws, tuning.study_report(ws, "charts")
    ws.close()


def test_history_is_every_completed_trial_with_the_best_feasible_value_so_far(studied):
    ws, report = studied
    complete = [tr for tr in tuning.load_study(ws, "charts").trials
                if tr.state == optuna.trial.TrialState.COMPLETE]
    history = report.charts.history
    assert list(history.columns) == ["trial", "value", "feasible", "best"]
    assert history["trial"].tolist() == [tr.number for tr in complete]
    assert history["value"].tolist() == pytest.approx([tr.value for tr in complete])
    running = -math.inf
    for (_, row), tr in zip(history.iterrows(), complete):
        feasible = all(v <= 0 for v in tr.constraints.values())
        assert bool(row["feasible"]) == feasible
        if feasible:
            running = max(running, tr.value)
        assert (math.isnan(row["best"]) if running == -math.inf else row["best"] == pytest.approx(running))
    assert report.best is not None and history["best"].iloc[-1] == pytest.approx(report.best["value"])


def test_importances_and_parallel_cover_the_tuned_weights(studied):
    _, report = studied
    tuned = {w["component"] for w in report.weights if w["tuned"]}
    importances = report.charts.importances
    assert importances and set(importances) <= tuned
    assert sum(importances.values()) == pytest.approx(1.0)
    parallel = report.charts.parallel
    assert list(parallel.columns[:2]) == ["trial", "value"] and set(parallel.columns[2:]) == tuned
    assert parallel["value"].is_monotonic_decreasing            # the best trials, best first
    assert parallel["value"].iloc[0] == pytest.approx(max(report.charts.history["value"]))


def test_the_page_figures_are_drawn_from_the_report_data(studied):
    _, report = studied
    figures = study_plots.study_figures(report.charts)
    assert list(figures) == ["history", "importances", "parallel"]
    bars = figures["importances"].data[0]
    assert list(bars.y)[-1] == max(report.charts.importances, key=report.charts.importances.get)  # top bar
    axes = figures["parallel"].data[0].dimensions
    assert [d.label for d in axes] == [study_plots.OBJECTIVE, *report.charts.parallel.columns[2:]]


def test_history_figure_greys_infeasible_trials_and_draws_the_best_line():
    history = pd.DataFrame({"trial": [0, 1, 2, 3], "value": [0.5, 0.9, 0.6, 0.7],
                            "feasible": [True, False, True, True], "best": [0.5, 0.5, 0.6, 0.7]})
    traces = {t.name: t for t in study_plots.history_figure(history).data}
    assert list(traces[study_plots.OBJECTIVE].x) == [0, 2, 3]
    assert list(traces[study_plots.INFEASIBLE].x) == [1]
    assert list(traces[study_plots.BEST].y) == [0.5, 0.5, 0.6, 0.7]
    no_feasible_yet = history.assign(best=[np.nan, np.nan, 0.6, 0.7])
    assert list(next(t for t in study_plots.history_figure(no_feasible_yet).data if t.name == study_plots.BEST).x) == [2, 3]


def test_parallel_figure_gives_text_choices_an_axis_of_their_own():
    parallel = pd.DataFrame({"trial": [4, 1, 7], "value": [0.9, 0.8, 0.7], "w": [0.1, 0.5, 1.5],
                             "comp.mode": ["max", "mean", "max"]})
    value_axis, weight_axis, choice_axis = study_plots.parallel_figure(parallel).data[0].dimensions
    assert list(value_axis["values"]) == [0.9, 0.8, 0.7]
    assert list(weight_axis["values"]) == [0.1, 0.5, 1.5]
    assert list(choice_axis["ticktext"]) == ["max", "mean"] and list(choice_axis["values"]) == [0, 1, 0]


def test_no_figure_before_a_completed_trial():
    assert study_plots.study_figures(tuning.StudyCharts()) == {}
    only_history = tuning.StudyCharts(history=pd.DataFrame({"trial": [0], "value": [0.5], "feasible": [True],
                                                            "best": [0.5]}))
    assert list(study_plots.study_figures(only_history)) == ["history"]
