"""Run curves as figures (app.charts.curve_figure over core.rl.runs.run_curves): whole-number
step axes, markers on short runs, and every compared run kept, a run of one update included."""

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
