"""The app's figures drawn from core's data.  Run curves (app.charts.curve_figure over
core.rl.runs.run_curves): whole-number step axes, markers on short runs, and every compared run
kept, a run of one update included.  The Reward Pyramid's figures (app.plots.rewards) and the
State Explorer's (app.plots.states) drawn from their reports."""

from __future__ import annotations

from pathlib import Path

import pytest

from _state_fixtures import HashEmbedder
from rwb_app import charts
from core.rl import runs
from core.rl.ppo import PPOConfig
from core.records.store import Workspace
from core.access.users import LOCAL_ADMIN

SAMPLE = Path(__file__).resolve().parents[1] / "datasets" / "finance" / "sample.jsonl"
LONG_UPDATES = charts.MARKERS_BELOW + 5
STEPS_PER_UPDATE = 2048


def _metrics(update: int) -> dict:
    return {"return_mean": 0.1 * update, "mask_violations": 0,
            "entropy_per_tool": {"lookup": 1.0 + update, "transfer": 2.0 * update}}


@pytest.fixture
def two_runs(tmp_path, monkeypatch):
    """A workspace with a run of :data:`LONG_UPDATES` updates and a newer run stopped after one."""
    monkeypatch.setattr("core.base.embed.workspace_embedder", lambda _ws: HashEmbedder())
    from core.data.importers import import_file

    lines = SAMPLE.read_text(encoding="utf-8").splitlines()
    subset = tmp_path / "finance.jsonl"
    subset.write_text("\n".join(lines[:11]) + "\n", encoding="utf-8")
    ws = Workspace.open(tmp_path / "ws")
    import_file(ws, subset, dataset="finance")
    template, _ = runs.resolve_run_template(ws, "finance_risk")
    ids = []
    for updates, status in ((LONG_UPDATES, "finished"), (1, "stopped")):
        run_id = runs.create_run(ws, LOCAL_ADMIN, template=template, config=PPOConfig(device="cpu"),
                                 dataset="finance")
        for u in range(1, updates + 1):
            runs.record_update(ws, run_id, u, u * STEPS_PER_UPDATE, _metrics(u))
        runs.finish_run(ws, run_id, status)
        ids.append(run_id)
    yield ws, ids[0], ids[1]
    ws.close()


def test_one_update_run_shows_a_point_on_a_whole_number_axis(two_runs):
    ws, _, short = two_runs
    curves = runs.run_curves(ws, [short])
    fig = charts.curve_figure(curves["return_mean"], "Episode return")
    (trace,) = fig.data
    assert trace.mode == "lines+markers"
    assert list(trace.x) == [STEPS_PER_UPDATE] and list(trace.y) == pytest.approx([0.1])
    assert fig.layout.xaxis.tickformat == ",d"
    assert list(fig.layout.xaxis.tickvals) == [STEPS_PER_UPDATE]       # one tick at 2,048, none fractional
    # a grouped metric of the same run: one marked trace per key
    grouped = charts.curve_figure(curves["entropy_per_tool"])
    assert {t.name for t in grouped.data} == {"lookup", "transfer"}
    assert all(t.mode == "lines+markers" and len(t.x) == 1 for t in grouped.data)


def test_compare_keeps_a_one_update_run_beside_a_long_one(two_runs):
    ws, long, short = two_runs
    table = runs.compare_runs(ws, [long, short])
    assert [(r["run"], r["updates"]) for r in table] == [(long, LONG_UPDATES), (short, 1)]
    fig = charts.curve_figure(runs.run_curves(ws, [long, short])["return_mean"])
    by_run = {t.name: t for t in fig.data}
    assert set(by_run) == {long, short}
    assert list(by_run[short].x) == [STEPS_PER_UPDATE] and by_run[short].mode == "lines+markers"
    assert list(by_run[long].x) == [u * STEPS_PER_UPDATE for u in range(1, LONG_UPDATES + 1)]
    assert list(by_run[long].y) == pytest.approx([0.1 * u for u in range(1, LONG_UPDATES + 1)])
    assert by_run[long].mode == "lines"                                  # long enough to read without markers
    assert fig.layout.xaxis.tickformat == ",d" and fig.layout.xaxis.tickvals is None
    assert fig.layout.showlegend is True


def test_compare_keeps_runs_recorded_at_different_steps(two_runs):
    """The wide frame has gaps where one run has no update: each trace drops only its own gaps."""
    ws, long, short = two_runs
    runs.record_update(ws, short, 2, 3 * STEPS_PER_UPDATE // 2, _metrics(2))    # a step the long run never had
    frame = runs.run_curves(ws, [long, short])["return_mean"]
    assert frame[long].isna().sum() == 1
    by_run = {t.name: t for t in charts.curve_figure(frame).data}
    assert list(by_run[short].x) == [STEPS_PER_UPDATE, 3 * STEPS_PER_UPDATE // 2]
    assert len(by_run[long].x) == LONG_UPDATES


def test_trial_series_skip_missing_values_and_mark_a_single_trial():
    """A study's per-trial figures: a trial without a held-out AUC is skipped (not drawn at
    0), one trial shows a dot, and the trial axis is whole numbers."""
    fig = charts.trial_series_figure({"trial": [0, 1, 2], "objective": [0.5, 0.6, 0.7],
                                      "held-out AUC": [None, 0.55, float("nan")]})
    by_name = {t.name: t for t in fig.data}
    assert list(by_name["objective"].x) == [0, 1, 2] and list(by_name["objective"].y) == pytest.approx([0.5, 0.6, 0.7])
    assert list(by_name["held-out AUC"].x) == [1] and list(by_name["held-out AUC"].y) == pytest.approx([0.55])
    assert by_name["held-out AUC"].mode == "lines+markers"
    assert fig.layout.xaxis.tickformat == ",d" and fig.layout.xaxis.title.text == "trial"
    many = charts.trial_series_figure({"trial": list(range(charts.MARKERS_BELOW)),
                                       "objective": [0.1] * charts.MARKERS_BELOW})
    assert many.data[0].mode == "lines"


# --------------------------------------------------------------------------- reward pyramid figures
PYRAMID = """\
version: 1
name: drawn
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
  L4:
    components:
      business_impact: {weight: 0.1}
penalties:
  latency: {component: latency_penalty, weight: 1.0, params: {per: 0.05, unit_ms: 1000}}
episode_terms:
  resolved_bonus: {weight: 2.0}
"""


@pytest.fixture(scope="module")
def pyramid_report():
    """The Reward Pyramid page's report of a small scoring (expert and hacker episodes)."""
    from _rewards_fixtures import FakeEmbedder, make_frame
    from core.rewards import Pyramid, ScoringContext, parse_template
    from core.rewards.views import pyramid_report

    result = Pyramid(parse_template(PYRAMID)).score(make_frame(seed=3, n=16),
                                                    ctx=ScoringContext(embedder=FakeEmbedder()))
    return pyramid_report(result, result.template)


def test_pyramid_figure_sizes_each_level_by_its_weight(pyramid_report):
    from rwb_app.plots import rewards as reward_plots

    fig = reward_plots.pyramid_figure(pyramid_report)
    bars = {t.name: t for t in fig.data if t.name}
    assert list(bars) == ["tool_validity", "validity_again", "business_impact"]
    widths = {level.key: level.width for level in pyramid_report.pyramid}
    # the heaviest level spans the whole width; each block is its level's share of that weight,
    # split among its components 3:1 by their weights
    assert max(widths.values()) == pytest.approx(1.0)
    l1 = widths["L1"]
    assert bars["tool_validity"].x[0] == pytest.approx(0.75 * l1) and bars["tool_validity"].base[0] == pytest.approx(-l1 / 2)
    assert bars["validity_again"].x[0] == pytest.approx(0.25 * l1)
    assert bars["business_impact"].x[0] == pytest.approx(widths["L4"])
    # a level that weighs nothing keeps its row as an empty outline
    empty = [t for t in fig.data if not t.name]
    assert widths["L2"] == 0 and len(empty) == 1 and "weighs nothing" in empty[0].hovertext[0]
    assert bars["tool_validity"].marker.color == reward_plots.LEVEL_COLOURS["L1"]
    label = bars["tool_validity"].y[0]
    assert label.startswith("L1 ")
    assert fig.layout.title.text.startswith("drawn: block widths follow the weights")


def test_contributions_figure_draws_the_reports_summaries(pyramid_report):
    from rwb_app.plots import rewards as reward_plots

    fig = reward_plots.contributions_figure(pyramid_report)
    per_step, per_episode = fig.data
    assert (per_step.name, per_episode.name) == ("per step", "per episode (end-of-episode terms)")
    steps = pyramid_report.contributions.query("scope == 'step'")
    assert list(per_step.x) == steps["component"].tolist()
    assert list(per_step.q1) == pytest.approx(steps["q1"].tolist())
    assert list(per_step.upperfence) == pytest.approx(steps["max"].tolist())
    assert list(per_episode.x) == ["resolved_bonus"]


def test_reward_histograms_are_coloured_by_level_and_by_behaviour(pyramid_report):
    from rwb_app.plots import rewards as reward_plots

    levels = reward_plots.levels_figure(pyramid_report)
    colours = {t.name: t.marker.color for t in levels.data}
    assert colours["L1 " + pyramid_report.pyramid[0].title] == reward_plots.LEVEL_COLOURS["L1"]
    assert colours["penalties"] == reward_plots.LEVEL_COLOURS["penalty"]
    assert colours["step reward"] == reward_plots.STEP_REWARD_COLOUR
    n_steps = pyramid_report.result.frame.n_steps
    assert all(sum(t.y) == n_steps for t in levels.data)
    returns = reward_plots.returns_figure(pyramid_report)
    behaviour = pyramid_report.result.frame.behaviour.astype(str)
    assert {t.name: sum(t.y) for t in returns.data} == {b: int((behaviour == b).sum()) for b in set(behaviour)}
    assert returns.data[0].width == pytest.approx(pyramid_report.return_histogram["bin_width"].iloc[0])


# --------------------------------------------------------------------------- state map figures
def _state_map_report(n: int = 60):
    """A map report built by hand: ``n`` points, 30 distinct actions, one hostile episode id."""
    import numpy as np

    from core.state.statemap import EntropyReport, Fidelity, GroupEntropy, StateMapReport

    groups = [GroupEntropy("lookup", 40.0, 1.2, 2.0, "lookup(a)"), GroupEntropy("transfer", 20.0, 0.3, 1.1)]
    entropy = EntropyReport(source="logged", n=60.0, overall=1.5, max_overall=3.0, per_tool=groups,
                            per_cluster=groups[:1], conditional=1.1)
    fidelity = Fidelity(label="task_type", n_points=n, n_labels=2, silhouette=0.2, silhouette_shuffled=0.0,
                        knn_agreement=0.9, knn_chance=0.5, k=10)
    columns = {"episode_id": ["<b>ep0</b>"] + [f"ep{i // 5}" for i in range(1, n)], "t": [i % 5 for i in range(n)],
               "action": [f"a{i % 30}" for i in range(n)], "task_type": ["buy", "sell"] * (n // 2),
               "behaviour": [None] * n, "reward_total": [0.1 * i for i in range(n)],
               "reward:L1": [1.0] * n}
    coords = np.column_stack([np.arange(n, dtype=float), -np.arange(n, dtype=float)])
    return StateMapReport(source="fx", space="encoded", n_steps=2 * n, index=np.arange(n) * 2, coords=coords,
                          columns=columns, fidelity=fidelity, entropy=entropy, timings={}, settings={})


def test_map_figure_colours_by_label_or_on_a_scale():
    from core.base.errors import InputError
    from rwb_app.plots import states as state_plots

    report = _state_map_report()
    by_task = state_plots.map_figure(report, "task_type")
    assert [t.name for t in by_task.data] == ["buy", "sell"]
    assert list(by_task.data[0].x) == [float(i) for i in range(0, 60, 2)]
    assert "coloured by task_type" in by_task.layout.title.text and "60 of 120 steps" in by_task.layout.title.text
    # 30 actions: the 23 most frequent keep their entry, the rest share "(other)"
    names = [t.name for t in state_plots.map_figure(report, "action").data]
    assert len(names) == state_plots.MAX_LEGEND and "(other)" in names
    (scale,) = state_plots.map_figure(report, "reward_total").data
    assert scale.marker.showscale is True and list(scale.marker.color)[:2] == pytest.approx([0.0, 0.1])
    with pytest.raises(InputError, match="cannot colour by 'colour'"):
        state_plots.map_figure(report, "colour")


def test_map_hover_text_names_the_step_and_escapes_user_data():
    from rwb_app.plots import states as state_plots

    hover = state_plots.hover_text(_state_map_report())
    assert hover[0].startswith("episode &lt;b&gt;ep0&lt;/b&gt; · t=0<br>action a0<br>task buy · –")
    assert "reward 0.000" in hover[0] and "L1 = 1.000" in hover[0]


def test_entropy_figure_draws_each_group_against_its_uniform_maximum():
    from core.base.errors import InputError
    from core.state.statemap import LOW_ENTROPY
    from rwb_app.plots import states as state_plots

    entropy = _state_map_report().entropy
    fig = state_plots.entropy_figure(entropy, "tool")
    bars, uniform = fig.data
    assert list(bars.x) == ["lookup", "transfer"] and list(bars.y) == pytest.approx([1.2, 0.3])
    assert list(uniform.y) == pytest.approx([2.0, 1.1])
    assert fig.layout.shapes[0].y0 == LOW_ENTROPY and "overall 1.50" in fig.layout.title.text
    assert list(state_plots.entropy_figure(entropy, "cluster").data[0].x) == ["lookup"]
    with pytest.raises(InputError, match="'tool' or 'cluster'"):
        state_plots.entropy_figure(entropy, "episode")
