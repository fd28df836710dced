"""The data behind the Reward Pyramid page's figures (core.rewards.views): the pyramid's levels
with their shares and rates, the contribution summaries and the binned rewards and returns,
checked against the scored arrays they summarise."""

from __future__ import annotations

import numpy as np
import pytest

from core.rewards import Pyramid, ScoringContext, parse_template
from core.rewards.views import (HIST_BINS, HISTOGRAM_COLUMNS, STAT_COLUMNS, contribution_stats, histogram,
                                level_histogram, pyramid_levels, pyramid_report, return_histogram)
from _rewards_fixtures import FakeEmbedder, make_frame

TEMPLATE = """\
version: 1
name: views
return: {a: 0.7, b: 0.3, gamma: 0.95}
gating: {enabled: true}
levels:
  L1:
    gate: 0.5
    components:
      tool_validity: {weight: 0.3}
      validity_again: {component: tool_validity, weight: 0.1}
  L2:
    components:
      param_reasonableness: {weight: 0.0}
      params_again: {component: param_reasonableness, weight: 0.0}
  L4:
    components:
      business_impact: {weight: 0.1}
penalties:
  latency: {component: latency_penalty, weight: 1.0, params: {per: 0.05, unit_ms: 1000}}
episode_terms:
  resolved_bonus: {weight: 2.0}
  length_penalty: {weight: 1.0}
"""


@pytest.fixture(scope="module")
def result():
    return Pyramid(parse_template(TEMPLATE)).score(make_frame(seed=3, n=16),
                                                   ctx=ScoringContext(embedder=FakeEmbedder()))


def test_pyramid_levels_split_each_band_by_weight(result):
    levels = pyramid_levels(result)
    assert [lv.key for lv in levels] == ["L1", "L2", "L4"]
    l1, l2, l4 = levels
    assert [(c.name, c.share) for c in l1.components] == [("tool_validity", pytest.approx(0.75)),
                                                          ("validity_again", pytest.approx(0.25))]
    assert l1.total_weight == pytest.approx(0.4)
    # a level whose weights are all zero is split equally
    assert [c.share for c in l2.components] == [0.5, 0.5] and l2.total_weight == 0.0
    assert l4.components[0].component == "business_impact" and l4.components[0].share == 1.0
    # rates over the scored steps: the gate's only where the level has one
    assert l1.gate == 0.5 and l1.gate_passed == pytest.approx(float(result.passed[:, 0].mean()))
    assert l2.gate is None and l2.gate_passed is None
    assert [lv.earns for lv in levels] == pytest.approx([float(result.earn[:, i].mean()) for i in range(3)])


def test_contribution_stats_summarise_each_component(result):
    stats = contribution_stats(result)
    assert list(stats.columns) == ["scope", "component", *STAT_COLUMNS]
    steps = stats[stats["scope"] == "step"]
    assert steps["component"].tolist() == list(result.matrix.step_names)
    contrib = result.contributions()
    j = list(result.matrix.step_names).index("business_impact")
    row = steps.set_index("component").loc["business_impact"]
    q1, median, q3 = np.percentile(contrib[:, j], [25, 50, 75])
    assert (row["min"], row["q1"], row["median"], row["q3"], row["max"], row["mean"]) == pytest.approx(
        (contrib[:, j].min(), q1, median, q3, contrib[:, j].max(), contrib[:, j].mean()))
    # the R_final terms are summarised over episodes, weighted
    episodes = stats[stats["scope"] == "episode"].set_index("component")
    assert episodes.index.tolist() == ["resolved_bonus", "length_penalty"]
    bonus = result.matrix.episode_values[:, 0] * 2.0
    assert episodes.loc["resolved_bonus", "max"] == pytest.approx(bonus.max())
    assert episodes.loc["resolved_bonus", "mean"] == pytest.approx(bonus.mean())


def test_histogram_counts_every_set_on_common_bins():
    hist = histogram([("a", "k1", np.array([0.0, 0.5, 1.0])), ("b", "k2", np.array([1.0, 1.0]))])
    assert list(hist.columns) == list(HISTOGRAM_COLUMNS)
    a, b = hist[hist["series"] == "a"], hist[hist["series"] == "b"]
    assert len(a) == len(b) == HIST_BINS and a["key"].unique().tolist() == ["k1"]
    np.testing.assert_allclose(a["bin_centre"].to_numpy(), b["bin_centre"].to_numpy())
    assert a["bin_width"].iloc[0] == pytest.approx(1.0 / HIST_BINS)
    assert a["bin_centre"].iloc[0] == pytest.approx(0.5 / HIST_BINS)
    assert a["count"].tolist()[0] == 1 and a["count"].tolist()[-1] == 1 and a["count"].sum() == 3
    assert b["count"].tolist()[-1] == 2 and b["count"].sum() == 2
    # one value: a bin of its own instead of a zero-width range
    single = histogram([("only", "only", np.array([2.0]))])
    assert single["count"].sum() == 1 and single["bin_width"].iloc[0] > 0
    empty = histogram([("none", "none", np.array([]))])
    assert empty.empty and list(empty.columns) == list(HISTOGRAM_COLUMNS)


def test_level_histogram_has_each_level_the_penalties_and_the_step_reward(result):
    hist = level_histogram(result)
    series = hist.drop_duplicates("series")
    assert series["series"].tolist() == [f"{lv.key} {lv.title}" for lv in result.template.levels] + [
        "penalties", "step reward"]
    assert series["key"].tolist() == ["L1", "L2", "L4", "penalty", "step"]
    assert (hist.groupby("series")["count"].sum() == result.frame.n_steps).all()
    step = hist[hist["key"] == "step"]
    low = step["bin_centre"].iloc[0] - step["bin_width"].iloc[0] / 2
    assert low == pytest.approx(min(float(result.level_totals.min()), float(result.penalties.min()),
                                    float(result.step_reward.min())))


def test_return_histogram_has_one_series_per_behaviour(result):
    hist = return_histogram(result)
    behaviour = result.frame.behaviour.astype(str)
    counts = hist.groupby("series")["count"].sum().to_dict()
    assert counts == {b: int((behaviour == b).sum()) for b in sorted(set(behaviour))}
    assert set(counts) == {"expert", "hacker"}


def test_the_report_carries_the_chart_data(result):
    report = pyramid_report(result, result.template)
    assert [lv.key for lv in report.pyramid] == ["L1", "L2", "L4"]
    assert report.contributions.equals(contribution_stats(result))
    assert report.level_histogram.equals(level_histogram(result))
    assert report.return_histogram.equals(return_histogram(result))
