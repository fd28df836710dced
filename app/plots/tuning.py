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
TITLES = {"history": "Optimisation history", "importances": "Parameter importances",
          "parallel": "Parallel coordinates"}
#: Colour of trials that break an expectation (Optuna's plots draw them grey too).
INFEASIBLE_COLOUR = "#cccccc"


def history_figure(history: pd.DataFrame) -> go.Figure:
    """Each completed trial's value over its number (trials that break an expectation in grey),
    with the best feasible value so far as a line."""
    feasible = history[history["feasible"]]
    infeasible = history[~history["feasible"]]
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=feasible["trial"], y=feasible["value"], mode="markers", name="Objective Value"))
    if len(infeasible):
        fig.add_trace(go.Scatter(x=infeasible["trial"], y=infeasible["value"], mode="markers",
                                 name="Infeasible Trial", marker={"color": INFEASIBLE_COLOUR}))
    best = history.dropna(subset=["best"])
    fig.add_trace(go.Scatter(x=best["trial"], y=best["best"], mode="lines", name="Best Value"))
    fig.update_layout(title="Optimization History Plot", xaxis={"title": "Trial", "tickformat": ",d"},
                      yaxis={"title": "Objective Value"})
    return fig


def importances_figure(importances: Mapping[str, float]) -> go.Figure:
    """One horizontal bar per tuned parameter, the most important at the top."""
    ordered = sorted(importances.items(), key=lambda kv: kv[1])
    fig = go.Figure(go.Bar(x=[v for _, v in ordered], y=[k for k, _ in ordered], orientation="h",
                           text=[f"{v:.2f}" if v >= 0.01 else "<0.01" for _, v in ordered],
                           textposition="outside", hovertemplate="%{y}: %{x:.3f}<extra></extra>"))
    fig.update_layout(title="Hyperparameter Importances", xaxis={"title": "Hyperparameter Importance"},
                      yaxis={"title": "Hyperparameter"})
    return fig


def parallel_figure(parallel: pd.DataFrame) -> go.Figure:
    """One axis for the value and one per parameter, a line per trial coloured by its value;
    a parameter with text choices gets an axis of its choices."""
    dimensions = [{"label": "Objective Value", "values": parallel["value"].tolist()}]
    for name in parallel.columns:
        if name in ("trial", "value"):
            continue
        column = parallel[name]
        numeric = pd.to_numeric(column, errors="coerce")
        if numeric.notna().all() and column.map(lambda v: not isinstance(v, (str, bool))).all():
            dimensions.append({"label": name, "values": numeric.tolist()})
        else:
            choices = sorted({str(v) for v in column})
            codes = [choices.index(str(v)) for v in column]
            dimensions.append({"label": name, "values": codes, "tickvals": list(range(len(choices))),
                               "ticktext": choices})
    fig = go.Figure(go.Parcoords(dimensions=dimensions,
                                 line={"color": parallel["value"].tolist(), "colorscale": "Blues",
                                       "showscale": True, "colorbar": {"title": {"text": "Objective Value"}}}))
    fig.update_layout(title="Parallel Coordinate Plot")
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
