"""`rwb tune`: a study with --json, `apply` as a new template version (never an overwrite),
preference labels, list/show, stopping a running study, and the errors an analyst sees."""

from __future__ import annotations

import json

import optuna
import pytest

from core import tuning
from core.cli import main
from core.base.errors import PermissionDenied
from core.rewards.versions import get_template, list_versions, save_template
from core.access.users import Actor, current_user
from _tuning_fixtures import FIN_FAST, finance_file, finance_workspace

optuna.logging.set_verbosity(optuna.logging.WARNING)


@pytest.fixture
def ws(tmp_path, monkeypatch):
    ws = finance_workspace(tmp_path / "ws", n_episodes=80, seed=6)
    monkeypatch.setenv("RWB_WORKSPACE", str(ws.root))
    monkeypatch.delenv("RWB_TUNE_STORAGE", raising=False)
    save_template(ws, current_user(ws), "fin_fast", FIN_FAST, None, "seed")
    return ws


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_tune_json_then_apply_as_new_version(ws, capsys):
    code, out, err = run(capsys, "tune", "--template", "fin_fast", "--dataset", "fin", "--trials", "25",
                         "--split-by", "task", "--metric", "all_pairs", "--json")
    assert code == 0, err
    body = json.loads(out)
    assert body["trials_run"] == 25 and body["metric"] == "soft_auc" and body["primary"] == "all_pairs"
    assert tuning.load_study(ws, body["study"]).user_attrs["rwb"]["config"]["metric"] == "all_pairs"
    assert set(body["best_weights"]) == {c for c in get_template(ws, "fin_fast").template().weights()}
    for side in ("train", "held_out"):
        assert set(body["best"]["figures"][side]) >= {"auc", "soft_auc", "kendall_tau"}
        assert set(body["baseline"]["figures"][side]) >= {"auc", "kendall_tau"}
    assert body["best_value"] >= body["baseline"]["figures"]["train"]["soft_auc"]   # the baseline is trial 0
    assert list(body["trials"][0]) == ["trial", "state", "value", "held_out", "held_out_auc", "cv_auc", "penalty",
                                       "params", "feasible", "baseline", "held_out_within", "cv_within"]
    assert list(body)[-4:] == ["primary", "held_out_report", "best_value", "best_weights"]
    report = body["held_out_report"]
    assert list(report) == ["metric", "tasks", "tasks_with_both", "episodes", "best_trial", "best", "template"]
    assert report["best_trial"] == body["best"]["trial"] and report["metric"] == "all_pairs"
    for who in ("best", "template"):
        assert list(report[who]) == ["all_pairs", "within_task"]
        assert list(report[who]["all_pairs"]) == ["value", "ci90", "n_tasks", "n_pairs"]
    assert report["best"]["all_pairs"]["value"] == pytest.approx(body["best"]["held_out_auc"])
    assert report["template"]["all_pairs"]["value"] == pytest.approx(body["baseline"]["figures"]["held_out"]["auc"])
    assert list(body["split"]) == ["by", "group_key", "groups", "train_episodes", "held_out_episodes",
                                   "held_out_groups", "design_folds", "folds_used", "unused_folds",
                                   "labelled_design_episodes", "labelled_held_out_episodes"]
    study = body["study"]
    assert study.startswith("fin_fast-outcome-fin-")

    code, out, err = run(capsys, "tune", "apply", study, "--json")
    assert code == 0, err
    applied = json.loads(out)
    assert applied["label"] == "fin_fast@2" and applied["base_version"] == 1
    assert list(applied) == ["study", "trial", "template", "base_version", "version", "label", "diff", "figures",
                             "message"]
    guard = applied["figures"]["guard"]
    assert guard["metric"] == "all_pairs" and guard["trial"] == pytest.approx(body["best"]["held_out_auc"])
    assert guard["template"] == pytest.approx(body["baseline"]["figures"]["held_out"]["auc"])
    assert guard["worse"] is (guard["trial"] < guard["template"]) and guard["confirmed"] is False
    weights = {c["key"]: c["b"] for c in applied["diff"] if c["section"] == "weight"}
    new = get_template(ws, "fin_fast", 2)
    assert weights and all(new.template().weights()[k] == pytest.approx(v) for k, v in weights.items())
    assert new.meta["tuning"]["train"] == pytest.approx(body["best_value"])
    assert new.meta["tuning"]["held_out"] == pytest.approx(body["best"]["held_out_value"])
    assert get_template(ws, "fin_fast", 1).yaml == FIN_FAST                # the old version is untouched
    assert tuning.list_applications(ws, study)[0].version == 2

    # the study tuned version 1; version 2 now exists, so a second apply is a stale-base conflict
    code, out, err = run(capsys, "tune", "apply", study)
    assert code == 4 and "version 2" in err
    assert [v.version for v in list_versions(ws, "fin_fast")] == [1, 2]

    code, out, err = run(capsys, "tune", "list", "--json")
    assert code == 0 and json.loads(out)["studies"][0]["name"] == study
    listed = json.loads(out)["studies"][0]
    assert list(listed) == ["name", "storage", "objective", "template_name", "template_version", "dataset",
                            "episodes_file", "created_by", "created_at", "runs", "latest_run", "status", "cause"]
    run_keys = ["id", "study", "status"]
    assert list(listed["latest_run"])[:3] == run_keys and listed["latest_run"]["process_alive"] is False
    code, out, err = run(capsys, "tune", "show", study, "--json")
    shown = json.loads(out)
    assert code == 0 and shown["counts"]["complete"] == 25 and shown["best"]["trial"] == applied["trial"]
    code, out, err = run(capsys, "tune", "show", study)
    assert code == 0 and "best trial" in out


def test_apply_refuses_weights_worse_than_the_template_unless_confirmed(ws, capsys):
    code, out, err = run(capsys, "tune", "--template", "fin_fast", "--dataset", "fin", "--trials", "25",
                         "--metric", "all_pairs", "--study", "guarded", "--json")
    assert code == 0, err
    body = json.loads(out)
    template = body["baseline"]["figures"]["held_out"]["auc"]
    worse = [r for r in body["trials"] if r["feasible"] and r["held_out_auc"] < template]
    better = [r for r in body["trials"] if r["feasible"] and r["held_out_auc"] > template]
    assert worse and better, "the study has trials on both sides of the template's held-out AUC"
    low, high = min(worse, key=lambda r: r["held_out_auc"]), max(better, key=lambda r: r["held_out_auc"])

    check = tuning.apply_check(ws, "guarded", trial=low["trial"])
    assert check.worse and check.metric == "all_pairs"
    assert (check.figure, check.template) == (pytest.approx(low["held_out_auc"]), pytest.approx(template))
    code, out, err = run(capsys, "tune", "apply", "guarded", "--trial", str(low["trial"]))
    assert code == 4 and out == ""
    # the refusal names the drop, both figures and the version it would write
    assert (f"score {low['held_out_auc']:.3f} on held-out episodes (held-out all-pairs AUC), "
            f"{template - low['held_out_auc']:.3f} below fin_fast@1's {template:.3f}") in err
    assert "fin_fast@2" in err and "--force" in err
    assert list_versions(ws, "fin_fast")[-1].version == 1 and tuning.list_applications(ws, "guarded") == []

    code, out, err = run(capsys, "tune", "apply", "guarded", "--trial", str(low["trial"]), "--force", "--json")
    assert code == 0, err
    guard = json.loads(out)["figures"]["guard"]
    assert guard["worse"] is True and guard["confirmed"] is True and "confirmed" in guard["decision"]
    recorded = tuning.list_applications(ws, "guarded")[0].figures["guard"]
    assert recorded == guard and recorded["trial"] == pytest.approx(low["held_out_auc"])

    # a trial above the template goes through without confirmation (on top of the new version: a new study)
    assert not tuning.apply_check(ws, "guarded", trial=high["trial"]).worse
    code, out, err = run(capsys, "tune", "apply", "guarded", "--trial", str(high["trial"]))
    assert code == 4 and "version 2" in err          # refused for the stale base, not for its figure
    with pytest.raises(tuning.WorseThanTemplate, match="below fin_fast@1's"):
        tuning.apply_study(ws, current_user(ws), "guarded", trial=low["trial"])


def test_episodes_file_and_text_output(ws, tmp_path, capsys):
    path = finance_file(tmp_path / "eps.jsonl", n_episodes=50, seed=8)
    template = tmp_path / "t.yaml"
    template.write_text(FIN_FAST)
    code, out, err = run(capsys, "tune", "--template", str(template), "--episodes", str(path), "--trials", "10",
                         "--split-by", "episode", "--metric", "auc", "--bound", "tool_validity=0:0.5",
                         "--fix", "latency")
    assert code == 0, err
    assert "held_out" in out and "apply with: rwb tune apply fin_fast-outcome-eps-" in out
    study = tuning.list_studies(ws)[0]
    attrs = tuning.load_study(ws, study.name).user_attrs["rwb"]
    assert attrs["space"]["weights"]["tool_validity"] == [0.0, 0.5] and "latency" not in attrs["space"]["weights"]
    assert attrs["data"]["dataset"] is None and attrs["data"]["episodes_file"].endswith("eps.jsonl")


def test_preference_commands(ws, capsys):
    ids = ws.episode_ids("fin")
    code, out, err = run(capsys, "tune", "prefer", ids[0], ids[1], "--dataset", "fin", "--comment", "clearer")
    assert code == 0 and "preference #1" in out
    code, out, err = run(capsys, "tune", "prefer", ids[0], ids[1], "--dataset", "fin")
    assert code == 4                                          # the same label twice
    code, out, err = run(capsys, "tune", "preferences", "--dataset", "fin", "--json")
    assert [(p["better"], p["worse"]) for p in json.loads(out)["preferences"]] == [(ids[0], ids[1])]


def test_errors_an_analyst_sees(ws, capsys):
    code, out, err = run(capsys, "tune", "--dataset", "fin")
    assert code == 2 and "give a template" in err
    code, out, err = run(capsys, "tune", "--template", "fin_fast", "--dataset", "nope", "--trials", "1")
    assert code == 2 and "nope" in err
    code, out, err = run(capsys, "tune", "--template", "fin_fast", "--dataset", "fin", "--storage", "optuna.db")
    assert code == 2 and "SQLAlchemy URL" in err
    code, out, err = run(capsys, "tune", "--template", "fin_fast", "--dataset", "fin", "--objective", "vibes")
    assert code == 2 and "objective" in err
    code, out, err = run(capsys, "tune", "--template", "fin_fast", "--dataset", "fin", "--bound", "ghost=0:1")
    assert code == 2 and "ghost" in err
    code, out, err = run(capsys, "tune", "apply", "no-such-study")
    assert code == 2 and "no study" in err
    with pytest.raises(PermissionDenied):
        tuning.tune(ws, Actor("rita", "reviewer"), "fin_fast", dataset="fin", trials=1)


def test_stop_ends_a_running_study_after_its_current_trial(ws):
    actor = current_user(ws)
    asked = []

    def progress(p: dict) -> None:
        if not asked:
            asked.append(tuning.stop_tuning(ws, actor, p["study"]))

    res = tuning.tune(ws, actor, "fin_fast", dataset="fin", trials=100_000, study="stoppable",
                      flush_seconds=0.05, progress=progress)
    assert res.stopped and res.trials_run < 100_000
    run = tuning.study_runs(ws, "stoppable")[-1]
    assert run.status == "stopped" and run.trials_done == res.trials_run
    assert len(tuning.load_study(ws, "stoppable").trials) == res.trials_run   # every trial was written
    assert tuning.list_studies(ws)[0].status == "stopped"
    with pytest.raises(Exception, match="no running worker"):
        tuning.stop_tuning(ws, actor, "stoppable")
