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
    unlabelled = [e.model_copy(update={"outcome": e.outcome.model_copy(update={"final_reward": None})})
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
                 "--group-key", "no.such.key"]) != 0
    assert "no value at group key" in capsys.readouterr().err
