"""The policy objective: a short PPO run (core.rl.ppo.train) per trial on the simulator under
the trial's rewards, reporting the rollout success rate after every update so a pruner
can stop it.  Tiny networks and few steps: this checks the wiring, not the policy."""

from __future__ import annotations

import numpy as np
import optuna
import pytest
import torch

from core import tuning
from core.access.users import current_user
from _state_fixtures import HashEmbedder
from _tuning_fixtures import fin_fast, finance_workspace

optuna.logging.set_verbosity(optuna.logging.WARNING)

TINY = {"total_steps": 512, "n_envs": 16, "rollout_len": 16, "n_minibatches": 2, "update_epochs": 1,
        "bc_epochs": 1, "hidden": 32, "n_critics": 2, "device": "cpu", "l0_max_updates": 1}


@pytest.fixture
def ws(tmp_path, monkeypatch):
    # the hash embedder stands in for the sentence model (intent embeddings of the state)
    monkeypatch.setattr("core.base.embed.workspace_embedder", lambda _ws: HashEmbedder())
    return finance_workspace(tmp_path / "ws", n_episodes=40, seed=2)


@pytest.mark.slow
def test_policy_trials_train_report_and_prune(ws):
    torch.set_num_threads(1)
    config = tuning.TuneConfig(objective="policy", policy=TINY)
    res = tuning.tune(ws, current_user(ws), fin_fast(), dataset="fin", trials=2, config=config, study="policy")
    assert res.metric == "success_rate" and res.trials_run == 2
    assert 0.0 <= res.best["value"] <= 1.0 and 0.0 <= res.best["held_out_value"] <= 1.0
    study = tuning.load_study(ws, "policy")
    for t in study.trials:                   # one intermediate value per PPO update (2 updates)
        assert sorted(t.intermediate_values) == [1, 2], t.intermediate_values

    # the reported values reach Optuna's pruner: a pruner that always prunes stops the run
    # after its first update, and the trial ends PRUNED
    problem_data = _policy_problem(ws, config)
    objective = tuning.PolicyObjective(*problem_data)
    pruning = optuna.create_study(direction="maximize", pruner=optuna.pruners.ThresholdPruner(lower=2.0))
    pruning.optimize(objective, n_trials=1)
    trial = pruning.trials[0]
    assert trial.state == optuna.trial.TrialState.PRUNED and sorted(trial.intermediate_values) == [1]


def _policy_problem(ws, config):
    from core.rl import ppo
    from core.rl.loading import load_training_data
    from core.rewards.api import load_frame
    from core.rewards.pyramid import Pyramid

    t = fin_fast()
    frame = load_frame(ws, "fin")
    labels = tuning.outcome_labels(frame)
    held = tuning.split_episodes(tuning.split_keys(frame, "task"), labels.success, 0.5, 0)
    problem = tuning.TuningProblem(t, frame, Pyramid(t).compute_matrix(frame),
                                   tuning.SearchSpace.for_template(t), held)
    cfg = ppo.PPOConfig.from_dict({**tuning.POLICY_DEFAULTS, **TINY}).validate()
    data = load_training_data(ws, t, dataset="fin", config=cfg)
    assert np.array_equal(data.tables.step_reward64.numpy(), problem.trial_state(t.weights(), {}).combined.step_reward)
    return problem, data, cfg
