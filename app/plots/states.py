"""The State Explorer's figures, drawn from a :class:`core.state.statemap.StateMapReport`.

The report holds the data (map coordinates, the fields per point, the entropy report);
the functions here draw the map coloured by one field and the entropy bars.  ``core.state``
is imported for type checking only: it loads torch, which the server does not preload.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import plotly.graph_objects as go

from core.base.errors import InputError

if TYPE_CHECKING:  # pragma: no cover
    from core.state.statemap import EntropyReport, StateMapReport

#: A categorical colouring shows at most this many legend entries: the most frequent values,
#: then "(other)".
MAX_LEGEND = 24


def _html_escape(text: str) -> str:
    """Hover text is user data (episode ids, tool names): plotly renders it as HTML."""
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def hover_text(report: StateMapReport) -> list[str]:
    """What hovering each point shows: episode and step, action, task and behaviour, and the
    rewards (total and per component) when the steps were scored."""
    cols = report.columns
    components = [c for c in cols if c.startswith("reward:")]
    out = []
    for i in range(len(report.index)):
        parts = [f"episode {cols['episode_id'][i]} · t={cols['t'][i]}", f"action {cols['action'][i]}",
                 f"task {cols['task_type'][i] or '–'} · {cols['behaviour'][i] or '–'}"]
        if "reward_total" in cols:
            parts.append(f"reward {cols['reward_total'][i]:.3f}")
        parts += [f"  {c.removeprefix('reward:')} = {cols[c][i]:.3f}" for c in components]
        out.append("<br>".join(_html_escape(p) for p in parts))
    return out


def map_figure(report: StateMapReport, color: str = "task_type") -> go.Figure:
    """The scatter of the map coloured by ``color`` (one of :meth:`StateMapReport.color_fields`):
    a colour scale for a numeric field, a legend entry per value otherwise; hover shows the step."""
    report.check_color(color)
    values = report.columns[color]
    hover = hover_text(report)
    x, y = report.coords[:, 0], report.coords[:, 1]
    fig = go.Figure()
    if report.color_is_numeric(color):
        numbers = np.array([np.nan if v is None else float(v) for v in values])
        fig.add_trace(go.Scattergl(
            x=x, y=y, mode="markers", text=hover, hovertemplate="%{text}<extra></extra>",
            marker={"size": 4, "color": numbers, "colorscale": "Viridis", "showscale": True,
                    "colorbar": {"title": {"text": color}}}))
    else:
        labels = np.array(["(none)" if v is None else str(v) for v in values], dtype=object)
        kinds, counts = np.unique(labels, return_counts=True)
        if len(kinds) > MAX_LEGEND:
            keep = set(kinds[np.argsort(-counts, kind="stable")[:MAX_LEGEND - 1]].tolist())
            labels = np.array([v if v in keep else "(other)" for v in labels], dtype=object)
        for value in sorted(set(labels.tolist()), key=str):
            sel = np.flatnonzero(labels == value)
            fig.add_trace(go.Scattergl(
                x=x[sel], y=y[sel], mode="markers", name=str(value), text=[hover[i] for i in sel],
                hovertemplate="%{text}<extra></extra>", marker={"size": 4}))
    fig.update_layout(
        title=f"State map of {report.source} ({len(report.index)} of {report.n_steps} steps, "
              f"{report.space} states) coloured by {color}",
        xaxis={"showticklabels": False, "title": ""}, yaxis={"showticklabels": False, "title": ""},
        legend={"title": {"text": color}, "itemsizing": "constant"}, height=650,
        margin={"l": 10, "r": 10, "t": 50, "b": 10})
    return fig


def entropy_figure(entropy: EntropyReport, by: str = "tool") -> go.Figure:
    """Bars of the action entropy per tool or per state cluster (nats), each with the entropy of
    a uniform choice among its actions and the line below which exploration is too narrow."""
    from core.state.statemap import LOW_ENTROPY  # loads torch: only once a map is drawn

    groups = {"tool": entropy.per_tool, "cluster": entropy.per_cluster}.get(by)
    if groups is None:
        raise InputError(f"entropy is broken down by 'tool' or 'cluster', not {by!r}", field="by")
    names = [g.group for g in groups]
    fig = go.Figure()
    where = {"tool": "tool", "cluster": "group of similar states"}[by]
    fig.add_trace(go.Bar(x=names, y=[g.entropy for g in groups], name="variety (entropy)",
                         customdata=[[g.n, g.top_action] for g in groups],
                         hovertemplate="%{x}: variety %{y:.2f} (entropy, nats)<br>%{customdata[0]:.0f} "
                                       "actions, mostly %{customdata[1]}<extra></extra>"))
    fig.add_trace(go.Scatter(x=names, y=[g.max_entropy for g in groups], mode="markers",
                             name="every action equally often", marker={"symbol": "line-ew-open", "size": 18}))
    fig.add_hline(y=LOW_ENTROPY, line_dash="dot", annotation_text=f"healthy from {LOW_ENTROPY:g}")
    fig.update_layout(title=f"Variety of actions per {where} (overall {entropy.overall:.2f})",
                      yaxis_title="variety (entropy)", height=360, margin={"l": 10, "r": 10, "t": 50, "b": 10})
    return fig
