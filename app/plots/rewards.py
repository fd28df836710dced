"""The Reward Pyramid page's figures, drawn from a :class:`core.rewards.views.PyramidReport`.

The report holds the data (the pyramid's levels, contribution summaries, binned rewards
and returns); each function here turns one part of it into a plotly figure.
"""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from rwb_app.fmt import number
from core.rewards.views import PyramidLevel, PyramidReport

#: Colours of the pyramid's rows (levels bottom-up), of the penalties and of the episode terms.
LEVEL_COLOURS = {"L1": "#4C78A8", "L2": "#72B7B2", "L3": "#54A24B", "L4": "#EECA3B",
                 "penalty": "#E45756", "episode": "#B279A2"}
#: Colour of the step reward's histogram (the sum of the levels and the penalties).
STEP_REWARD_COLOUR = "#333333"
#: Colour of a level without a colour of its own.
OTHER_COLOUR = "#888"
#: Names of the contribution summaries' scopes in the legend.
SCOPE_NAMES = {"step": "per step", "episode": "per episode (end-of-episode terms)"}
SCOPE_COLOURS = {"step": "#4C78A8", "episode": LEVEL_COLOURS["episode"]}


def _level_label(level: PyramidLevel) -> str:
    gate = ""
    if level.gate is not None:
        gate = f" · gate {number(level.gate)}, passed by {number(level.gate_passed, 'share', 2)}"
    return (f"{level.key} {level.title} · weight {number(level.total_weight)}{gate} · counts on "
            f"{number(level.earns, 'share', 2)} of steps")


def pyramid_figure(report: PyramidReport) -> go.Figure:
    """The pyramid: one block per level, L1 at the bottom, each as wide as its share of the heaviest
    level's weight (block areas are in proportion to the levels' weights, and change as the weights
    are edited).  A block is split among its components in proportion to their weights; its label
    gives the level's total weight, its gate, how often the gate passes and how often the level counts."""
    t = report.result.template
    fig = go.Figure()
    n = len(report.pyramid)
    labels = []
    for level in report.pyramid:
        band = level.width
        label = _level_label(level)
        labels.append(label)
        offset = -band / 2
        if band <= 0:   # a level that weighs nothing: an empty outline keeps its row visible
            fig.add_trace(go.Bar(x=[0.02], y=[label], base=[-0.01], orientation="h", showlegend=False,
                                 marker={"color": "rgba(0,0,0,0)", "line": {"color": OTHER_COLOUR, "width": 1}},
                                 hovertext=[f"{level.key} weighs nothing: it adds no reward"], hoverinfo="text"))
            continue
        for c in level.components:
            fig.add_trace(go.Bar(
                x=[band * c.share], y=[label], base=[offset], orientation="h", name=c.name,
                text=[f"{c.name}<br>{number(c.weight)}"], textposition="inside", textangle=0,
                insidetextanchor="middle",
                hovertext=[f"{c.name} ({c.component}): weight {number(c.weight)}, "
                           f"{number(c.share, 'share', 2)} of {level.key}"], hoverinfo="text",
                marker={"color": LEVEL_COLOURS.get(level.key, OTHER_COLOUR), "line": {"color": "white", "width": 2},
                        "opacity": 1.0 if c.weight > 0 else 0.35},
                showlegend=False))
            offset += band * c.share
    fig.update_layout(barmode="overlay", height=90 + 70 * max(n, 1), bargap=0.08,
                      margin={"l": 10, "r": 10, "t": 40, "b": 10}, uniformtext={"minsize": 9, "mode": "hide"},
                      title=f"{t.name}: block widths follow the weights · gating {'on' if t.gating else 'off'}",
                      xaxis={"visible": False, "range": [-0.52, 0.52]},
                      yaxis={"categoryorder": "array", "categoryarray": labels})
    return fig


def contributions_figure(report: PyramidReport) -> go.Figure:
    """Per component, the distribution of its weighted, gated contribution (box plots drawn
    from the report's summaries: per step, then the R_final terms per episode)."""
    fig = go.Figure()
    stats = report.contributions
    for scope, rows in stats.groupby("scope", sort=False):
        fig.add_trace(go.Box(x=rows["component"].tolist(), name=SCOPE_NAMES[str(scope)], boxmean=True,
                             marker={"color": SCOPE_COLOURS[str(scope)]},
                             q1=rows["q1"].tolist(), median=rows["median"].tolist(), q3=rows["q3"].tolist(),
                             lowerfence=rows["min"].tolist(), upperfence=rows["max"].tolist(),
                             mean=rows["mean"].tolist()))
    fig.update_layout(title="Each component's reward (weighted, gated): min · quartiles · max, dashed = mean",
                      height=400, margin={"l": 10, "r": 10, "t": 80, "b": 10}, showlegend=True,
                      # above the boxes: below, it covered the slanted component names
                      legend={"orientation": "h", "yanchor": "bottom", "y": 1.0, "x": 0},
                      xaxis={"automargin": True})
    return fig


def _histogram_traces(histogram: pd.DataFrame, colours: dict[str, str] | None = None) -> list[go.Bar]:
    """One overlaid bar series per series of a binned histogram, in its order."""
    traces = []
    for name, rows in histogram.groupby("series", sort=False):
        key = str(rows["key"].iloc[0])
        marker = {"color": colours.get(key, OTHER_COLOUR)} if colours is not None else {}
        traces.append(go.Bar(x=rows["bin_centre"].tolist(), y=rows["count"].tolist(),
                             width=float(rows["bin_width"].iloc[0]), name=str(name), opacity=0.6, marker=marker))
    return traces


def levels_figure(report: PyramidReport) -> go.Figure:
    """Distribution of each level's gated reward per step, of the penalties and of the step reward."""
    colours = {**LEVEL_COLOURS, "step": STEP_REWARD_COLOUR}
    fig = go.Figure(_histogram_traces(report.level_histogram, colours))
    fig.update_layout(barmode="overlay", title="Per-level reward per step (gated)", height=360,
                      xaxis_title="reward", yaxis_title="steps",
                      margin={"l": 10, "r": 10, "t": 50, "b": 10})
    return fig


def returns_figure(report: PyramidReport) -> go.Figure:
    """Distribution of episode returns, one colour per behaviour label (when the data has them)."""
    fig = go.Figure(_histogram_traces(report.return_histogram))
    fig.update_layout(barmode="overlay", title="Episode returns", height=360,
                      xaxis_title="return", yaxis_title="episodes",
                      margin={"l": 10, "r": 10, "t": 50, "b": 10})
    return fig
