"""Outcome calibration of a template on labelled real runs (core.rewards.calibration)."""

from __future__ import annotations


import numpy as np
import pytest

from _real_logs import REAL, rwb_import_labelled
from core.base.errors import InputError
from core.data.importers import read_file
from core.rewards.api import frame_from_episodes, score
from core.rewards.calibration import calibrate_result, outcome_columns
from core.rewards.outcomes import auc, episode_labels
from core.rewards.template import load_template


TEMPLATE = """\
version: 1
name: calib_probe
return: {a: 0.5, b: 0.5, gamma: 1.0}
levels:
  L1:
    components:
      tool_validity: {weight: 1.0}
episode_terms:
  calls:
    component: length_penalty
    weight: 1.0
    params: {per: 1.0, count: tool_calls, free: 0}
"""


@pytest.fixture(scope="module")
def whissle(tmp_path_factory):
    parsed = read_file(REAL / "tau2_whissle" / "episodes.jsonl", reward_key="outcome", id_key="id")
    path = tmp_path_factory.mktemp("calib") / "calib_probe.yaml"
    path.write_text(TEMPLATE)
    result = score(None, load_template(path), frame=frame_from_episodes(parsed.episodes, parsed.tools))
    return parsed.episodes, result


def test_component_power_is_the_auc_of_its_episode_values(whissle):
    episodes, result = whissle
    report = calibrate_result(result, *outcome_columns(episodes), n_boot=50)
    assert report.n_labelled == 50 and report.n_tasks == 50 and report.binary
    assert report.success_rate == pytest.approx(0.56)
    calls = next(c for c in report.components if c.name == "calls")
    n_calls = np.array([sum(s.action.kind == "tool_call" for s in e.steps) for e in episodes])
    assert calls.value == pytest.approx(auc(-n_calls, episode_labels(episodes)))
    assert calls.ci90[0] <= calls.value <= calls.ci90[1]
    assert report.return_power.value == pytest.approx(auc(result.returns, episode_labels(episodes)))
    roc = report.roc
    assert roc["fpr"][0] == 0.0 and roc["tpr"][-1] == 1.0 and len(roc["fpr"]) == len(roc["tpr"])
    assert sum(b["episodes"] for b in report.bins) == 50
    assert report.folds == 5 and 0.0 <= report.heldout_auc <= 1.0 and 0.0 <= report.heldout_brier <= 1.0
    assert report.to_json()["return_power"]["metric"] == "auc"


def test_too_few_labels_are_refused_with_the_counts(whissle):
    episodes, result = whissle
    unlabelled = [e.model_copy(update={"outcome": e.outcome.model_copy(update={"final_reward": None, "resolved": None})})
                  for e in episodes]
    with pytest.raises(InputError, match="0 labelled"):
        calibrate_result(result, *outcome_columns(unlabelled))


def test_rwb_reward_calibrate_json_and_refusal(tmp_path, capsys):
    import json

    from core.cli import main

    ws = str(tmp_path / "ws")
    template = tmp_path / "calib_probe.yaml"
    template.write_text(TEMPLATE)
    rwb_import_labelled(ws, "tau2_whissle", "whissle")
    capsys.readouterr()
    assert main(["--workspace", ws, "reward", "calibrate", "-t", str(template), "--dataset", "whissle",
                 "--boot", "20", "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["n_labelled"] == 50 and body["metric"] == "auc"
    assert [c["name"] for c in body["components"]] == ["tool_validity", "calls"]
    assert main(["--workspace", ws, "reward", "calibrate", "-t", str(template), "--dataset", "whissle",
                 "--boot", "20", "--learning-curve"]) == 0
    table = capsys.readouterr().out.split("learning curve: held-out tasks")[1].splitlines()
    assert table[1].split()[:2] == ["labelled", "all"] and [r.split()[0] for r in table[2:-1]] == ["10", "20", "40"]
    assert "not measured: 80, 160 labelled" in table[-1]                # 50 episodes: a fold holds 40
    assert main(["--workspace", ws, "reward", "calibrate", "-t", str(template), "--dataset", "whissle",
                 "--group-key", "no.such.key"]) != 0
    assert "no value at group key" in capsys.readouterr().err


@pytest.fixture(scope="module")
def grok():
    """The tau2 grok runs: several runs per task, some tasks with both outcomes."""
    from core.rewards.template import parse_template

    parsed = read_file(REAL / "tau2_grok" / "episodes.jsonl", reward_key="outcome", id_key="id")
    result = score(None, parse_template(TEMPLATE), frame=frame_from_episodes(parsed.episodes, parsed.tools))
    return parsed.episodes, result


def _hand_within(scores, labels, groups):
    """Within-task AUC, pair by pair: for every task, every (success, failure) pair of its
    runs, 1 when the success scores higher, ½ on a tie."""
    right = pairs = 0.0
    tasks = set()
    for g in set(groups):
        rows = [i for i in range(len(groups)) if groups[i] == g]
        for i in rows:
            for j in rows:
                if labels[i] == 1 and labels[j] == 0:
                    pairs += 1
                    right += 1.0 if scores[i] > scores[j] else 0.5 if scores[i] == scores[j] else 0.0
                    tasks.add(g)
    return right / pairs, len(tasks), int(pairs)


def test_within_task_auc_beside_all_pairs_matches_a_hand_computation(grok):
    episodes, result = grok
    labels, groups = outcome_columns(episodes)
    report = calibrate_result(result, labels, groups, n_boot=50)
    value, n_tasks, n_pairs = _hand_within(result.returns, labels, list(groups))
    w = report.return_power.within_task
    assert w.value == pytest.approx(value) and (w.n_tasks, w.n_pairs) == (n_tasks, n_pairs)
    assert report.tasks_with_both == n_tasks and 10 <= n_tasks < report.n_tasks
    assert w.ci90[0] <= w.value <= w.ci90[1]
    assert report.return_power.value == pytest.approx(auc(result.returns, labels))   # all pairs unchanged
    calls = next(c for c in report.components if c.name == "calls")
    n_calls = np.array([sum(s.action.kind == "tool_call" for s in e.steps) for e in episodes])
    assert calls.within_task.value == pytest.approx(_hand_within(-n_calls, labels, list(groups))[0])
    body = report.to_json()
    assert body["return_power"]["within_task"]["n_tasks"] == n_tasks
    assert list(body)[-1] == "tasks_with_both"


def test_graded_outcomes_have_no_within_task_figure(whissle):
    episodes, result = whissle
    graded = np.linspace(0.0, 1.0, len(episodes))
    report = calibrate_result(result, graded, outcome_columns(episodes)[1], n_boot=20)
    assert report.metric == "spearman" and report.return_power.within_task is None
    assert report.tasks_with_both is None


def test_rwb_reward_calibrate_json_adds_within_task_and_the_learning_curve(tmp_path, capsys, monkeypatch):
    import json

    from core.access.users import LOCAL_ADMIN
    from core.base.embed import HashEmbedder
    from core.cli import main
    from core.records.store import Workspace
    from core.rewards.labels import add_label, dataset_outcomes
    from core.rewards.outcomes import tasks_with_both

    monkeypatch.setattr("core.base.embed.workspace_embedder", lambda _ws: HashEmbedder())
    ws = str(tmp_path / "ws")
    template = tmp_path / "calib_probe.yaml"
    template.write_text(TEMPLATE)
    rwb_import_labelled(ws, "tau2_grok", "grok")
    capsys.readouterr()
    args = ["--workspace", ws, "reward", "calibrate", "-t", str(template), "--dataset", "grok", "--boot", "20"]
    assert main([*args, "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert list(body)[:8] == ["template", "n_episodes", "n_labelled", "n_tasks", "binary", "success_rate",
                              "metric", "return_power"]
    assert list(body)[-2:] == ["tasks_with_both", "learning_curve"]
    assert list(body["return_power"]) == ["name", "level", "metric", "value", "ci90", "within_task"]
    assert list(body["return_power"]["within_task"]) == ["value", "ci90", "n_tasks", "n_pairs"]
    curve = body["learning_curve"]
    # every size is measured or named as more than a training fold's tasks can give
    assert [p["labelled"] for p in curve["points"]] + curve["skipped"] == [10, 20, 40, 80, 160]
    assert len(curve["points"]) >= 3
    assert all(0.0 <= p["all_pairs"] <= 1.0 for p in curve["points"])
    # A person's label over a recorded outcome moves the figures calibrate reports.
    store = Workspace.open(ws)
    first = store.load_episodes("grok")[0]
    add_label(store, LOCAL_ADMIN, "grok", first.episode_id, 1 - int(first.outcome.resolved))
    both_now = tasks_with_both(*dataset_outcomes(store, "grok"))
    store.close()
    assert both_now != body["tasks_with_both"]           # this label gives its task a second outcome
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "within-task" in out and "learning curve" not in out           # the text leaves the curve out
    assert f"({both_now} with both outcomes)" in out
