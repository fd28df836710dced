"""Tuning towards real outcomes (core.tuning, outcome objective): held-out tasks that Optuna
never sees, task-grouped cross-validation of the others, the held-out AUC of every trial
recomputed from its weights through the pyramid, the small-data refusal and warning, and
the --group-key option, on the labelled tau2 runs (Whissle: 50 runs of 50 tasks; Grok: 586
runs of 81 tasks, a task being a task id within one of 5 domains)."""

from __future__ import annotations

import json

import numpy as np
import optuna
import pytest

from _real_logs import REAL, rwb_import_labelled
from core import tuning
from core.cli import main
from core.base.errors import InputError
from core.rewards import ScoreResult
from core.rewards.api import load_frame
from core.rewards.outcomes import (auc, episode_groups, episode_labels, fidelity, tasks_with_both,
                                   within_task_auc)
from core.rewards.pyramid import Pyramid
from core.rewards.template import parse_template
from core.records.store import Workspace

optuna.logging.set_verbosity(optuna.logging.WARNING)

#: no sentence-embedding component: scoring 586 runs takes a second
PROBE = """\
version: 1
name: cv_probe
return: {a: 0.5, b: 0.5, gamma: 1.0}
levels:
  L1:
    components:
      tool_validity: {weight: 1.0}
penalties:
  repeated_failures: {weight: 1.0, params: {per: 0.2, cap: 5}}
episode_terms:
  calls:
    component: length_penalty
    weight: 1.0
    params: {per: 1.0, count: tool_calls, free: 0}
"""


@pytest.fixture(scope="module")
def ws_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("tune_cv")
    ws = str(root / "ws")
    rwb_import_labelled(ws, "tau2_whissle", "whissle")
    rwb_import_labelled(ws, "tau2_grok", "grok")
    (root / "probe.yaml").write_text(PROBE)
    return root


def rwb(capsys, root, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["--workspace", str(root / "ws"), *argv])
    out, err = capsys.readouterr()
    return code, out, err


def tune_json(capsys, root, dataset: str, study: str, *extra: str) -> dict:
    """``rwb tune --objective outcome … --trials 8 --json`` as a new study (its trial 0 is the template)."""
    code, out, err = rwb(capsys, root, "tune", "--objective", "outcome", "-t", str(root / "probe.yaml"),
                         "--dataset", dataset, "--trials", "8", "--study", study, "--json", *extra)
    assert code == 0, err
    return json.loads(out)


def recomputed(root, dataset: str, body: dict, group_key: str | None = None):
    """Per trial (held-out AUC, mean fold AUC) from its weights through ScoreResult, on the
    episodes whose task the result lists on each side."""
    ws = Workspace.open(root / "ws")
    episodes = ws.load_episodes(dataset)
    frame = tuning.withhold_outcomes(load_frame(ws, dataset))
    assert frame.episode_ids.tolist() == [e.episode_id for e in episodes]
    groups, labels = episode_groups(episodes, group_key), episode_labels(episodes)
    template = parse_template(PROBE)
    matrix = Pyramid(template).compute_matrix(frame)
    split = body["split"]
    held = np.isin(groups, split["held_out_groups"]) & ~np.isnan(labels)
    folds = [np.isin(groups, names) & ~np.isnan(labels) for names in split["design_folds"]]
    out = []
    for row in body["trials"]:
        returns = ScoreResult(template, frame, matrix, {**template.weights(), **row["params"]}).returns
        out.append((auc(returns[held], labels[held]),
                    float(np.mean([auc(returns[f], labels[f]) for f in folds]))))
    return out, groups, held, folds


@pytest.mark.parametrize("dataset", ["whissle", "grok"])
def test_each_trial_reports_the_held_out_auc_of_its_weights(ws_root, capsys, dataset):
    body = tune_json(capsys, ws_root, dataset, f"reported-{dataset}")
    assert len(body["trials"]) == 8 and body["trials"][0]["baseline"]
    figures, groups, held, folds = recomputed(ws_root, dataset, body)
    for row, (held_auc, cv_auc) in zip(body["trials"], figures):
        assert row["held_out_auc"] == pytest.approx(held_auc, abs=1e-12), row
        assert row["cv_auc"] == pytest.approx(cv_auc, abs=1e-12), row

    # no task on both sides, every labelled task on one of them, folds disjoint
    split = body["split"]
    fold_tasks = [set(f) for f in split["design_folds"]]
    assert not set(split["held_out_groups"]) & set().union(*fold_tasks)
    assert sum(len(f) for f in fold_tasks) == len(set().union(*fold_tasks))
    assert set(split["held_out_groups"]) | set().union(*fold_tasks) == set(groups.tolist())
    assert split["folds_used"] == len(fold_tasks) >= 2 and split["unused_folds"] == []
    raw = {json.loads(line)["id"]: json.loads(line)["task_id"]
           for line in (REAL / f"tau2_{dataset}" / "episodes.jsonl").read_text().splitlines()}
    ids = np.array(Workspace.open(ws_root / "ws").episode_ids(dataset))
    domains = np.array([g.split(":", 1)[0] for g in groups.tolist()])
    held_tasks = {(d, raw[e]) for d, e in zip(domains[held], ids[held])}
    design_tasks = {(d, raw[e]) for d, e in zip(domains[~held], ids[~held])}
    assert held_tasks and design_tasks and not held_tasks & design_tasks
    assert split["labelled_held_out_episodes"] == int(held.sum())

    # the best trial is chosen by its value (CV less the penalty), never by its held-out AUC;
    # the result's held-out AUC is that trial's
    feasible = [r for r in body["trials"] if r["feasible"]]
    best = max(feasible, key=lambda r: r["value"])
    assert body["best"]["trial"] == best["trial"]
    assert body["best"]["held_out_auc"] == best["held_out_auc"] == body["best"]["figures"]["held_out"]["auc"]
    print(f"{dataset}: held-out AUC of the tuned probe {best['held_out_auc']:.3f} (template "
          f"{body['trials'][0]['held_out_auc']:.3f}), CV AUC {best['cv_auc']:.3f}, 8 trials")


def test_small_labelled_set_warns_and_pulls_weights_to_the_template(ws_root, capsys):
    body = tune_json(capsys, ws_root, "whissle", "small")
    assert len(body["warnings"]) == 2 and "50 labelled episodes from 50 tasks" in body["warnings"][0]
    assert "ranks all pairs instead" in body["warnings"][1]    # 50 tasks of one run each: none has both
    for row in body["trials"]:
        # every weight of the probe is 1 with bounds [0, 2]
        w = np.array([row["params"][k] for k in ("tool_validity", "repeated_failures", "calls")])
        assert row["penalty"] == pytest.approx(tuning.SMALL_DATA_PENALTY * np.mean(((w - 1.0) / 2.0) ** 2))
    assert body["trials"][0]["penalty"] == 0.0
    grok = tune_json(capsys, ws_root, "grok", "comfortable")
    assert grok["warnings"] == [] and all(r["penalty"] == 0.0 for r in grok["trials"])


def test_too_few_labelled_episodes_are_refused_with_the_counts(ws_root, tmp_path, capsys):
    lines = (REAL / "tau2_whissle" / "episodes.jsonl").read_text().splitlines()
    small = tmp_path / "small.jsonl"
    small.write_text("\n".join(lines[:30]) + "\n")
    code, _, err = rwb(capsys, ws_root, "episodes", "import", str(small), "--reward-key", "outcome", "--id-key",
                       "id", "--dataset", "whissle30")
    assert code == 0, err
    code, out, err = rwb(capsys, ws_root, "tune", "-t", str(ws_root / "probe.yaml"), "--dataset", "whissle30",
                         "--trials", "2")
    n_ok = sum(json.loads(line)["outcome"] == 1 for line in lines[:30])
    assert code == 2 and out == ""
    assert f"30 labelled episodes from 30 tasks ({n_ok} successful, {30 - n_ok} failed)" in err
    assert "at least 40 labelled episodes from at least 8 tasks" in err and "at least 10 successful" in err
    # grouped by a key every Whissle run shares, the 50 runs are one task
    code, _, err = rwb(capsys, ws_root, "tune", "-t", str(ws_root / "probe.yaml"), "--dataset", "whissle",
                       "--group-key", "run", "--trials", "2")
    assert code == 2 and "50 labelled episodes from 1 tasks (28 successful, 22 failed)" in err


def test_check_outcome_data_boundaries():
    """Known answers at the limits: 40 labelled from 8 tasks with 10 of each outcome pass."""
    def labels(pos, neg):
        y = np.array([1.0] * pos + [0.0] * neg)
        return tuning.Labels(success=y, value=y)

    groups = np.array([f"t{i % 8}" for i in range(40)], dtype=object)
    ok = tuning.check_outcome_data(labels(30, 10), groups)
    assert (ok.labelled, ok.successes, ok.failures, ok.groups) == (40, 30, 10, 8) and ok.penalty > 0
    for lab, grp, found in ((labels(31, 9), groups, "(31 successful, 9 failed)"),
                            (labels(30, 10), np.array([f"t{i % 7}" for i in range(40)], dtype=object),
                             "from 7 tasks"),
                            (labels(29, 10), groups[:39], "39 labelled")):
        with pytest.raises(InputError, match=found.replace("(", r"\(").replace(")", r"\)")):
            tuning.check_outcome_data(lab, grp)
    big = np.array([f"t{i % 40}" for i in range(200)], dtype=object)
    comfortable = tuning.check_outcome_data(labels(100, 100), big)
    assert comfortable.warnings == () and comfortable.penalty == 0.0


def test_group_key_changes_the_grouping(ws_root, capsys):
    by_task = tune_json(capsys, ws_root, "grok", "by-task")
    by_run = tune_json(capsys, ws_root, "grok", "by-run", "--group-key", "run")
    assert by_task["split"]["group_key"] is None and by_run["split"]["group_key"] == "run"
    lines = [json.loads(line) for line in (REAL / "tau2_grok" / "episodes.jsonl").read_text().splitlines()]
    runs = {r["id"]: r["run"] for r in lines}
    tasks = {r["id"]: (r["domain"], r["task_id"]) for r in lines}
    assert by_run["split"]["groups"] == len(set(runs.values())) == 42
    assert by_task["split"]["groups"] == len(set(tasks.values()))
    ids = Workspace.open(ws_root / "ws").episode_ids("grok")
    held_runs = {g.split(":", 1)[1] for g in by_run["split"]["held_out_groups"]}
    held = [e for e in ids if runs[e] in held_runs]
    design = [e for e in ids if runs[e] not in held_runs]
    assert held and design and not {runs[e] for e in held} & {runs[e] for e in design}
    # grouped by run, one task's runs fall on both sides (grouped by task they never do)
    assert {tasks[e] for e in held} & {tasks[e] for e in design}
    figures, *_ = recomputed(ws_root, "grok", by_run, group_key="run")
    assert [r["held_out_auc"] for r in by_run["trials"]] == pytest.approx([f[0] for f in figures], abs=1e-12)


def test_progress_lines_and_text_report(ws_root, capsys):
    code, out, err = rwb(capsys, ws_root, "tune", "-t", str(ws_root / "probe.yaml"), "--dataset", "whissle",
                         "--trials", "3", "--study", "progress")
    assert code == 0, err
    lines = [line for line in err.splitlines() if line.startswith("trial ")]
    assert [line.split(" · ")[0] for line in lines] == ["trial 1/3", "trial 2/3", "trial 3/3"]
    assert all("held-out AUC" in line and "CV AUC" in line for line in lines)
    assert "warning: small labelled set" in out and "held-out AUC" in out
    code, out, err = rwb(capsys, ws_root, "tune", "-t", str(ws_root / "probe.yaml"), "--dataset", "whissle",
                         "--trials", "2", "--study", "progress", "--quiet")
    assert code == 0 and not [line for line in err.splitlines() if line.startswith("trial ")]


def test_tuning_page_shows_held_out_auc_beside_the_objective(ws_root, capsys, monkeypatch):
    from pathlib import Path

    from streamlit.testing.v1 import AppTest

    from rwb_app.fmt import number

    body = tune_json(capsys, ws_root, "whissle", "page-cv")
    monkeypatch.setenv("RWB_WORKSPACE", str(ws_root / "ws"))
    at = AppTest.from_file(str(Path(__file__).resolve().parents[1] / "pages" / "tuning.py"), default_timeout=120)
    at.session_state["tune_name"] = "page-cv"
    at.run()
    assert not at.exception, at.exception
    metric = next(m for m in at.metric if m.label == "Exact, on held-out tasks")
    assert metric.value == number(body["best"]["held_out_auc"]) and "AUC" in metric.help
    assert "tune_held_out_page-cv" in {c.key for c in at.get("plotly_chart")}  # held-out AUC per trial
    trials = next(d.value for d in at.dataframe if "held-out AUC" in d.value.columns)
    got = dict(zip(trials["trial"], trials["held-out AUC"]))             # rounded for reading
    assert got == {r["trial"]: number(r["held_out_auc"]) for r in body["trials"]}


# --------------------------------------------------------------------------- within-task objective
def test_within_task_is_the_default_objective_and_each_trial_reports_both_figures(ws_root, capsys):
    body = tune_json(capsys, ws_root, "grok", "within-default")
    cfg = tuning.load_study(Workspace.open(ws_root / "ws"), "within-default").user_attrs["rwb"]["config"]
    assert cfg["metric"] == "within_task"
    assert body["primary"] == "within_task" and body["metric"] == "soft_within_task" and body["warnings"] == []
    ws = Workspace.open(ws_root / "ws")
    episodes = ws.load_episodes("grok")
    frame = tuning.withhold_outcomes(load_frame(ws, "grok"))
    groups, labels = episode_groups(episodes, None), episode_labels(episodes)
    template = parse_template(PROBE)
    matrix = Pyramid(template).compute_matrix(frame)
    split = body["split"]
    held = np.isin(groups, split["held_out_groups"]) & ~np.isnan(labels)
    folds = [np.isin(groups, names) & ~np.isnan(labels) for names in split["design_folds"]]
    paired = [f for f in folds if tasks_with_both(labels[f], groups[f]) > 0]
    assert split["folds_used"] == len(paired) >= 2
    for row in body["trials"]:
        returns = ScoreResult(template, frame, matrix, {**template.weights(), **row["params"]}).returns
        assert row["held_out_within"] == pytest.approx(within_task_auc(returns[held], labels[held], groups[held]),
                                                       abs=1e-12)
        assert row["cv_within"] == pytest.approx(
            np.mean([within_task_auc(returns[f], labels[f], groups[f]) for f in paired]), abs=1e-12)
    # the held-out report: both figures with intervals, for the best trial and the template's own weights
    report = body["held_out_report"]
    assert report["metric"] == "within_task" and report["best_trial"] == body["best"]["trial"]
    assert report["tasks_with_both"] == tasks_with_both(labels[held], groups[held]) > 0
    assert report["tasks"] == len(set(groups[held].tolist())) and report["episodes"] == int(held.sum())
    rows = {r["trial"]: r for r in body["trials"]}
    for who, trial in (("best", body["best"]["trial"]), ("template", 0)):
        returns = ScoreResult(template, frame, matrix, {**template.weights(), **rows[trial]["params"]}).returns
        expected = fidelity(returns[held], labels[held], groups[held])
        got = report[who]
        assert got["within_task"]["value"] == pytest.approx(expected.within_task.value, abs=1e-12)
        assert got["all_pairs"]["value"] == pytest.approx(expected.all_pairs.value, abs=1e-12)
        assert got["within_task"]["ci90"] == pytest.approx(list(expected.within_task.ci90), abs=1e-12)
        assert got["within_task"]["n_tasks"] == report["tasks_with_both"]
        lo, hi = got["within_task"]["ci90"]
        assert lo <= got["within_task"]["value"] <= hi
    assert body["best"]["held_out_within"] == pytest.approx(report["best"]["within_task"]["value"])
    # the text report prints both figures of the best trial and of the template
    code, out, err = rwb(capsys, ws_root, "tune", "--objective", "outcome", "-t", str(ws_root / "probe.yaml"),
                         "--dataset", "grok", "--trials", "1", "--study", "within-default", "--quiet")
    assert code == 0, err
    assert "the study answers to the within-task AUC" in out
    assert f"template {report['template']['within_task']['value']:.3f} [" in out


def test_all_pairs_by_option(ws_root, capsys):
    body = tune_json(capsys, ws_root, "grok", "all-pairs", "--metric", "all_pairs")
    ws = Workspace.open(ws_root / "ws")
    assert tuning.load_study(ws, "all-pairs").user_attrs["rwb"]["config"]["metric"] == "all_pairs"
    assert body["primary"] == "all_pairs" and body["metric"] == "soft_auc"
    assert body["held_out_report"]["metric"] == "all_pairs"
    # the objective is the smooth AUC over every pair of the design folds; the within-task study's is over
    # pairs of the same task (the template is trial 0 of both, on the same split)
    within = tune_json(capsys, ws_root, "grok", "within-default-2")
    assert body["trials"][0]["value"] == pytest.approx(body["baseline"]["figures"]["train"]["soft_auc"])
    assert within["trials"][0]["value"] == pytest.approx(within["baseline"]["figures"]["train"]["soft_within_task"])
    assert body["trials"][0]["value"] != pytest.approx(within["trials"][0]["value"])
    assert body["trials"][0]["held_out_auc"] == within["trials"][0]["held_out_auc"]


def test_too_few_tasks_with_both_outcomes_fall_back_to_all_pairs(ws_root, capsys):
    # Whissle: 50 runs of 50 distinct tasks, so no task has both a success and a failure
    body = tune_json(capsys, ws_root, "whissle", "fallback")
    assert body["primary"] == "all_pairs" and body["metric"] == "soft_auc"
    fallback = [w for w in body["warnings"] if "ranks all pairs instead" in w]
    assert len(fallback) == 1 and "only 0 of the" in fallback[0]
    assert f"needs {tuning.MIN_TASKS_WITH_BOTH}" in fallback[0]
    assert body["held_out_report"]["tasks_with_both"] == 0
    assert body["held_out_report"]["template"]["within_task"]["value"] is None
    assert all(r["held_out_within"] is None for r in body["trials"])
    # the config keeps what was asked for; the study records what it measured
    attrs = tuning.load_study(Workspace.open(ws_root / "ws"), "fallback").user_attrs["rwb"]
    assert attrs["config"]["metric"] == "within_task" and attrs["primary"] == "all_pairs"
    assert attrs["warnings"] == body["warnings"]
