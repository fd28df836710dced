"""The Tuning page's figures of a study, drawn from a :class:`core.tuning.report.StudyCharts`.

The report holds the data (each completed trial's value, the parameters' importances, the best
trials' parameters); each function here turns one part of it into a plotly figure, in the
manner of Optuna's own plots (:mod:`optuna.visualization`).
"""

from __future__ import annotations

from collections.abc import Mapping

import pandas as pd
import plotly.graph_objects as go

from core.tuning import StudyCharts

#: The page's figures of a study, in the order it shows them: key → title.
TITLES = {"history": "The objective of each trial, and the best so far (optimisation history)",
          "importances": "Which weights move the objective most (parameter importances)",
          "parallel": "The weights of the best trials, one line per trial (parallel coordinates)"}
#: Axis numbers as an analyst reads them: three significant digits (plotly's own shows five).
TICKS = ".3~g"
#: Names of the traces and axes: the objective's value, trials that break an expectation, the best so far.
OBJECTIVE, INFEASIBLE, BEST = "Objective", "Breaks an expectation", "Best so far"
#: Colour of trials that break an expectation (Optuna's plots draw them grey too).
INFEASIBLE_COLOUR = "#cccccc"


def history_figure(history: pd.DataFrame) -> go.Figure:
    """Each completed trial's value over its number (trials that break an expectation in grey),
    with the best feasible value so far as a line."""
    feasible = history[history["feasible"]]
    infeasible = history[~history["feasible"]]
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=feasible["trial"], y=feasible["value"], mode="markers", name=OBJECTIVE,
                             hovertemplate="trial %{x}: %{y:.3~g}<extra></extra>"))
    if len(infeasible):
        fig.add_trace(go.Scatter(x=infeasible["trial"], y=infeasible["value"], mode="markers",
                                 name=INFEASIBLE, marker={"color": INFEASIBLE_COLOUR},
                                 hovertemplate="trial %{x}: %{y:.3~g}<extra></extra>"))
    best = history.dropna(subset=["best"])
    fig.add_trace(go.Scatter(x=best["trial"], y=best["best"], mode="lines", name=BEST,
                             hovertemplate="best by trial %{x}: %{y:.3~g}<extra></extra>"))
    fig.update_layout(title="Objective per trial", xaxis={"title": "Trial", "tickformat": ",d"},
                      yaxis={"title": OBJECTIVE, "tickformat": TICKS})
    return fig


def importances_figure(importances: Mapping[str, float]) -> go.Figure:
    """One horizontal bar per tuned parameter, the most important at the top."""
    ordered = sorted(importances.items(), key=lambda kv: kv[1])
    fig = go.Figure(go.Bar(x=[v for _, v in ordered], y=[k for k, _ in ordered], orientation="h",
                           text=[f"{v:.2f}" if v >= 0.01 else "<0.01" for _, v in ordered],
                           textposition="outside", hovertemplate="%{y}: %{x:.3f}<extra></extra>"))
    fig.update_layout(title="Which weights move the objective most",
                      xaxis={"title": "Share of the objective's variation (importance)", "tickformat": TICKS},
                      yaxis={"title": "Weight or parameter"})
    return fig


def parallel_figure(parallel: pd.DataFrame) -> go.Figure:
    """One axis for the value and one per parameter, a line per trial coloured by its value;
    a parameter with text choices gets an axis of its choices."""
    dimensions = [{"label": OBJECTIVE, "values": parallel["value"].tolist(), "tickformat": TICKS}]
    for name in parallel.columns:
        if name in ("trial", "value"):
            continue
        column = parallel[name]
        numeric = pd.to_numeric(column, errors="coerce")
        if numeric.notna().all() and column.map(lambda v: not isinstance(v, (str, bool))).all():
            dimensions.append({"label": name, "values": numeric.tolist(), "tickformat": TICKS})
        else:
            choices = sorted({str(v) for v in column})
            codes = [choices.index(str(v)) for v in column]
            dimensions.append({"label": name, "values": codes, "tickvals": list(range(len(choices))),
                               "ticktext": choices})
    fig = go.Figure(go.Parcoords(dimensions=dimensions,
                                 line={"color": parallel["value"].tolist(), "colorscale": "Blues",
                                       "showscale": True, "colorbar": {"title": {"text": OBJECTIVE},
                                                                       "tickformat": TICKS}}))
    fig.update_layout(title="Weights of the best trials")
    return fig


def study_figures(charts: StudyCharts) -> dict[str, go.Figure]:
    """The figures the study's data allows, keyed and ordered as :data:`TITLES` (none before a
    completed trial; the importances only where they could be measured)."""
    figures: dict[str, go.Figure] = {}
    if charts.history is not None and len(charts.history):
        figures["history"] = history_figure(charts.history)
    if charts.importances:
        figures["importances"] = importances_figure(charts.importances)
    if charts.parallel is not None and len(charts.parallel):
        figures["parallel"] = parallel_figure(charts.parallel)
    return figures
