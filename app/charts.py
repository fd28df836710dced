"""Figures and tables the pages draw from core's typed results (core returns data, not plots)."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from core.rewards.calibration import CalibrationReport

#: A series with fewer points than this is drawn with markers too: a run of one update shows a dot.
MARKERS_BELOW = 20


def curve_figure(curves: pd.DataFrame, title: str = "", *, height: int = 300,
                 references: dict[str, float] | None = None, y_title: str | None = None) -> go.Figure:
    """One line per column of a wide frame indexed by env steps (a value of
    :func:`core.rl.runs.run_curves`): each run, or each key of a grouped metric.

    Every column gets a trace, even one with a single recorded update (its own missing
    values are dropped, so runs recorded at different steps each keep their points); a
    series shorter than :data:`MARKERS_BELOW` points gets markers; the step axis shows
    whole numbers (``2,048``, never ``2,048.000000``).  ``references``: dashed horizontal
    lines, by label (what good looks like: the best logged behaviour's reward, a floor)."""
    fig = go.Figure()
    steps: set[int] = set()
    for column in curves.columns:
        series = pd.to_numeric(curves[column], errors="coerce").dropna()
        steps.update(int(x) for x in series.index)
        fig.add_trace(go.Scatter(x=[int(x) for x in series.index], y=series.to_list(), name=str(column),
                                 mode="lines+markers" if len(series) < MARKERS_BELOW else "lines"))
    xaxis: dict = {"title": "env steps", "tickformat": ",d"}
    if len(steps) == 1:  # one step: a tick exactly there, not fractional ticks around it
        xaxis.update(tickmode="array", tickvals=sorted(steps))
    for label, value in (references or {}).items():
        if value is not None and value == value:  # a missing reference (None, NaN) draws no line
            fig.add_hline(y=float(value), line_dash="dash", line_color="grey", annotation_text=label,
                          annotation_position="top left")
    fig.update_layout(title=title or None, xaxis=xaxis, yaxis={"title": y_title} if y_title else {},
                      height=height, hovermode="x unified",
                      margin={"l": 10, "r": 10, "t": 40 if title else 10, "b": 10},
                      showlegend=len(curves.columns) > 1)
    return fig


def trial_series_figure(series: dict[str, list], *, height: int = 300) -> go.Figure:
    """One line per series of a study's per-trial figures (``{"trial": [...], name: [...]}``,
    a :class:`core.tuning.report.StudyReport`'s ``held_out_series``) over the trial number: trials
    missing a value are skipped, a series shorter than :data:`MARKERS_BELOW` points gets
    markers (one trial shows a dot), and the trial axis shows whole numbers."""
    trials = list(series.get("trial") or [])
    fig = go.Figure()
    for name, values in series.items():
        if name == "trial":
            continue
        points = [(int(t), float(v)) for t, v in zip(trials, values) if v is not None and v == v]
        fig.add_trace(go.Scatter(x=[t for t, _ in points], y=[v for _, v in points], name=name,
                                 mode="lines+markers" if len(points) < MARKERS_BELOW else "lines"))
    fig.update_layout(xaxis={"title": "trial", "tickformat": ",d"}, height=height, hovermode="x unified",
                      margin={"l": 10, "r": 10, "t": 10, "b": 10})
    return fig


def calibration_table(cal: CalibrationReport) -> pd.DataFrame:
    """One row per score (the return first, then each component): power and its interval;
    for 0/1 outcomes the within-task AUC beside it, its interval and the tasks with both outcomes."""
    rows = []
    for p in [cal.return_power, *cal.components]:
        row = {"score": p.name, "level": p.level, cal.metric: round(p.value, 3),
               "90% low": round(p.ci90[0], 3), "90% high": round(p.ci90[1], 3)}
        if p.within_task is not None:
            w = p.within_task
            row.update({"within-task AUC": round(w.value, 3), "within 90% low": round(w.ci90[0], 3),
                        "within 90% high": round(w.ci90[1], 3), "tasks with both": w.n_tasks})
        rows.append(row)
    return pd.DataFrame(rows)


def roc_figure(cal: CalibrationReport) -> go.Figure:
    """ROC curve of the episode return against the recorded successes, with the chance line."""
    fig = go.Figure(go.Scatter(x=cal.roc["fpr"], y=cal.roc["tpr"], mode="lines+markers",
                               name="episode return"))
    fig.add_trace(go.Scatter(x=[0, 1], y=[0, 1], mode="lines", name="chance",
                             line={"dash": "dot", "color": "grey"}))
    fig.update_layout(title="ROC of the episode return", xaxis_title="false-positive rate",
                      yaxis_title="true-positive rate", height=360)
    return fig


def deciles_figure(cal: CalibrationReport) -> go.Figure:
    """Observed success rate per decile of the episode return (calibration of the return)."""
    fig = go.Figure(go.Scatter(x=[b["return_mean"] for b in cal.bins],
                               y=[b["success_rate"] for b in cal.bins], mode="lines+markers",
                               text=[f"{b['episodes']} episodes" for b in cal.bins]))
    fig.update_layout(title="Success rate per return decile", xaxis_title="mean episode return",
                      yaxis_title="success rate", yaxis_range=[0, 1], height=360)
    return fig
