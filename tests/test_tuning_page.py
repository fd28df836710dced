"""The Tuning page (AppTest): empty state, a study's live report (figures, constraint
status, best vs template weights, held-out figures beside the template's), applying it as a
new version and the apply guard, preference labels, and starting a study as a background
worker that outlives the page run."""

from __future__ import annotations

import time
from pathlib import Path

import optuna
import pytest
from streamlit.testing.v1 import AppTest

from core import tuning
from core.rewards.versions import list_versions, save_template
from core.access.users import current_user
from _tuning_fixtures import FIN_FAST, finance_workspace

ROOT = Path(__file__).resolve().parents[1]
PAGE = str(ROOT / "pages" / "tuning.py")

optuna.logging.set_verbosity(optuna.logging.WARNING)


@pytest.fixture
def ws(tmp_path, monkeypatch):
    ws = finance_workspace(tmp_path / "ws", n_episodes=60, seed=2)
    monkeypatch.setenv("RWB_WORKSPACE", str(ws.root))
    save_template(ws, current_user(ws), "fin_fast", FIN_FAST, None, "for the tuning page")
    return ws


def open_page(**state) -> AppTest:
    at = AppTest.from_file(PAGE, default_timeout=120)
    for k, v in state.items():
        at.session_state[k] = v
    return at.run()


def test_empty_workspace_says_what_to_do(ws):
    at = open_page()
    assert not at.exception
    assert any("No study yet" in i.value for i in at.info)


def test_report_figures_constraints_and_apply(ws):
    # all pairs: within each task these few generated runs rank perfectly under the template already
    res = tuning.tune(ws, current_user(ws), "fin_fast", dataset="fin", trials=30, study="page-study",
                      config=tuning.TuneConfig(metric="all_pairs"))
    at = open_page(tune_name="page-study")
    assert not at.exception, at.exception
    labels = [m.label for m in at.metric]
    assert f"Best {res.metric} (training split)" in labels
    best = next(m for m in at.metric if m.label.startswith("Best"))
    assert best.value == f"{res.best['value']:.4f}"
    charts = {c.key for c in at.get("plotly_chart")}
    # held-out AUC per trial, history, importances, parallel coordinates
    assert charts == {f"tune_{k}_page-study" for k in ("held_out", "fig_history", "fig_importances", "fig_parallel")}
    tables = [d.value for d in at.dataframe]
    weights = next(t for t in tables if "component" in t.columns and "best" in t.columns)
    assert set(weights["component"]) == {c for c in res.baseline["weights"]}
    cons = next(t for t in tables if "expectation" in t.columns)
    assert set(cons["expectation"]) == {"hacks rank below their honest twins", "failed calls earn nothing above L1"}
    assert int(cons["satisfied"].sum() + cons["violated"].sum()) == 2 * 30
    # apply as a new version (the workspace has fin_fast@1; the study tuned it)
    at.text_input(key="tune_apply_msg_page-study").input("tuned on the page")
    # weights below the template on the held-out tasks need the confirm box (the guard's own test below)
    worse = tuning.apply_check(ws, "page-study").worse
    if worse:
        at.checkbox(key="tune_apply_confirm_page-study").check()
    at.button[[b.label for b in at.button].index("Apply the best weights as a new template version")].click()
    at = at.run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert any("Saved fin_fast@2" in s.value for s in at.success)
    versions = list_versions(ws, "fin_fast")
    assert versions[-1].version == 2 and versions[-1].message == "tuned on the page"
    assert versions[-1].meta["tuning"]["study"] == "page-study"
    assert versions[-1].meta["tuning"]["guard"]["confirmed"] is worse


def test_apply_guard_refuses_weights_worse_on_held_out_tasks_until_confirmed(ws):
    actor = current_user(ws)
    res = tuning.tune(ws, actor, "fin_fast", dataset="fin", trials=30, study="guard-page",
                      config=tuning.TuneConfig(metric="all_pairs"))
    template_auc = res.baseline["figures"]["held_out"]["auc"]
    # the over-fitting case: a trial that does worse than the template on the held-out tasks is the
    # best by the design folds (a real trial of the study, its objective value raised)
    study = tuning.load_study(ws, "guard-page")
    worse = [t for t in study.trials if t.state.is_finished() and t.user_attrs.get("held_out_auc") is not None
             and t.user_attrs["held_out_auc"] < template_auc and all(v <= 0 for v in t.constraints.values())]
    assert worse, "some trial of the study does worse than the template on the held-out tasks"
    donor = min(worse, key=lambda t: t.user_attrs["held_out_auc"])
    study.add_trial(optuna.trial.create_trial(value=res.best["value"] + 1.0, params=donor.params,
                                              distributions=donor.distributions, user_attrs=donor.user_attrs,
                                              constraints=dict(donor.constraints)))
    figure = donor.user_attrs["held_out_auc"]

    at = open_page(tune_name="guard-page")
    assert not at.exception, at.exception
    shown = {m.label: m for m in at.metric}
    all_pairs = shown["Held-out all-pairs AUC: best trial vs template"]
    assert all_pairs.value == f"{figure:.4f}" and all_pairs.delta.startswith("-")
    assert "Held-out within-task AUC: best trial vs template" in shown
    held = next(d.value for d in at.dataframe if "figure" in d.value.columns)
    row = held[held["figure"] == "all-pairs AUC"].iloc[0]
    assert row["change"].startswith("↓") and row["template"] == pytest.approx(template_auc)
    assert any("do worse than the template" in w.value and f"{figure:.3f}" in w.value for w in at.warning)

    apply_label = "Apply the best weights as a new template version"
    at.button[[b.label for b in at.button].index(apply_label)].click()
    at = at.run()
    assert any("Not applied" in e.value and f"{figure:.3f} is below the template's own {template_auc:.3f}" in e.value
               for e in at.error), [e.value for e in at.error]
    assert [v.version for v in list_versions(ws, "fin_fast")] == [1]

    at.checkbox(key="tune_apply_confirm_guard-page").check()
    at.button[[b.label for b in at.button].index(apply_label)].click()
    at = at.run()
    assert not at.exception and any("Saved fin_fast@2" in s.value for s in at.success), [e.value for e in at.error]
    guard = tuning.list_applications(ws, "guard-page")[0].figures["guard"]
    assert guard["confirmed"] is True and guard["worse"] is True and guard["trial"] == pytest.approx(figure)


def test_preference_label_from_the_page(ws):
    ids = [e.episode_id for e in ws.episode_summaries("fin")]
    at = open_page(tune_pref_dataset="fin")
    at.selectbox(key="tune_pref_better").select(ids[3])
    at.selectbox(key="tune_pref_worse").select(ids[5])
    at.text_input(key="tune_pref_comment").input("clearer answer")
    at.button[[b.label for b in at.button].index("Add label")].click()
    at = at.run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    prefs = tuning.list_preferences(ws, "fin")
    assert [(p.better, p.worse, p.comment) for p in prefs] == [(ids[3], ids[5], "clearer answer")]


def test_start_runs_a_background_worker(ws):
    at = open_page(tune_template="fin_fast@1", tune_dataset="fin", tune_trials=15, tune_study="bg")
    at.button(key="tune_start").click()
    at = at.run()
    assert not at.exception
    assert any("Started study bg" in s.value for s in at.success), [e.value for e in at.error]
    deadline = time.time() + 180
    while time.time() < deadline:
        runs = tuning.study_runs(ws, "bg")
        if runs and runs[-1].status in ("finished", "failed"):
            break
        time.sleep(1)
    run = tuning.study_runs(ws, "bg")[-1]
    assert run.status == "finished", tuning.tuning_log(ws, "bg")
    assert run.trials_done == 15 and len(tuning.load_study(ws, "bg").trials) == 15
    at = open_page(tune_name="bg")
    assert not at.exception and any(m.label.startswith("Best") for m in at.metric)
