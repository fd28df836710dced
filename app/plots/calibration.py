"""The Calibration tab's figures: the learning curve of a :class:`core.rewards.outcome_model.LearningCurve`."""

from __future__ import annotations

import plotly.graph_objects as go

from core.rewards.outcome_model import LearningCurve

#: Colours of the two figures: AUC over all pairs, and within each task (the primary one).
SERIES_COLOURS = {"all pairs": "#4C78A8", "within task": "#E45756"}


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


def learning_curve_figure(curve: LearningCurve) -> go.Figure:
    """Held-out AUC against the number of labelled episodes: one line per figure (all pairs,
    within task), each with the band its seeds span, and the chance line at 0.5.  A point whose
    figure is unknown (no held-out task with both outcomes) is left out of its line."""
    fig = go.Figure()
    for name, mean_of, range_of in (("all pairs", "all_pairs", "all_pairs_range"),
                                    ("within task", "within_task", "within_task_range")):
        points = [p for p in curve.points if _finite(getattr(p, mean_of))]
        if not points:
            continue
        x = [p.labelled for p in points]
        low = [getattr(p, range_of)[0] for p in points]
        high = [getattr(p, range_of)[1] for p in points]
        colour = SERIES_COLOURS[name]
        fig.add_trace(go.Scatter(x=x + x[::-1], y=high + low[::-1], fill="toself", line={"width": 0},
                                 fillcolor=colour, opacity=0.15, hoverinfo="skip", showlegend=False,
                                 name=f"{name} range"))
        fig.add_trace(go.Scatter(x=x, y=[getattr(p, mean_of) for p in points], mode="lines+markers",
                                 name=f"{name} AUC", line={"color": colour}))
    if curve.points:
        xs = [p.labelled for p in curve.points]
        fig.add_trace(go.Scatter(x=[min(xs), max(xs)], y=[0.5, 0.5], mode="lines", name="chance",
                                 line={"dash": "dot", "color": "grey"}))
    fig.update_layout(title="Held-out AUC against labelled episodes", xaxis_title="labelled episodes",
                      yaxis_title="AUC on held-out tasks", yaxis_range=[0, 1], height=360,
                      xaxis={"tickformat": ",d"}, hovermode="x unified")
    return fig
