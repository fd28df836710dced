"""The trainer sees environments only through core.rl.env.BatchedEnv: PPO trains on a
small environment written here that implements nothing but that protocol, and learns
its known best action.

The environment: one-step episodes whose request carries a sign in its first context
feature; the action matching the sign earns 1, the other allowed action 0, and a third
action that would earn 5 is always masked.  The best policy is known exactly: follow
the sign, never the masked action.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import pytest
import torch

from core.base.errors import InputError
from core.rl import ppo
from core.rl.agent import act
from core.rl.env import BatchedEnv, EnvStep, TensorSpec
from core.state.features import CONTEXT_DIM, INTENT_RULE_DIM, PAD_TOKEN, TEXT_DIM, TRACE_LEN

MASKED_PRIZE = 5.0


class Transition(NamedTuple):
    obs: dict[str, torch.Tensor]
    reward: torch.Tensor
    done: torch.Tensor
    info: dict[str, torch.Tensor]


class SignFollowing:
    """B one-step episodes: action 0 is right when ``context[:, 0]`` is +1, action 1 when
    it is −1; action 2 pays ``MASKED_PRIZE`` but is never allowed."""

    n_actions = 3
    gamma = 0.9
    component_names = ["right_action"]

    def __init__(self, n_envs: int, seed: int = 0):
        self.n_envs = n_envs
        self.generator = torch.Generator().manual_seed(seed)
        self.sign = torch.ones(n_envs)

    def observation_spec(self) -> dict[str, TensorSpec]:
        return {"intent_emb": TensorSpec((TEXT_DIM,), torch.float32),
                "intent_rules": TensorSpec((INTENT_RULE_DIM,), torch.float32),
                "context": TensorSpec((CONTEXT_DIM,), torch.float32),
                "trace_action": TensorSpec((TRACE_LEN,), torch.int64),
                "trace_reward": TensorSpec((TRACE_LEN,), torch.float32),
                "trace_dt": TensorSpec((TRACE_LEN,), torch.float32)}

    def _new_requests(self) -> dict[str, torch.Tensor]:
        self.sign = torch.where(torch.rand(self.n_envs, generator=self.generator) < 0.5, 1.0, -1.0)
        obs = {k: torch.zeros((self.n_envs, *s.shape), dtype=s.dtype) for k, s in self.observation_spec().items()}
        obs["context"][:, 0] = self.sign
        obs["trace_action"].fill_(PAD_TOKEN)
        return obs

    def best_actions(self) -> torch.Tensor:
        return torch.where(self.sign > 0, 0, 1)

    def action_masks(self) -> torch.Tensor:
        mask = torch.ones((self.n_envs, self.n_actions), dtype=torch.bool)
        mask[:, 2] = False
        return mask

    def reset(self, seed: int | None = None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        if seed is not None:
            self.generator.manual_seed(seed)
        return self._new_requests(), self.action_masks()

    def step(self, actions: torch.Tensor) -> Transition:
        right = (actions == self.best_actions()).float()
        reward = right + MASKED_PRIZE * (actions == 2).float()
        done = torch.ones(self.n_envs, dtype=torch.bool)
        info = {"episode_return": reward.clone(), "success": right, "components": right[:, None],
                "off_support": torch.zeros(self.n_envs, dtype=torch.bool),
                "mask_violation": ~self.action_masks().gather(1, actions[:, None]).squeeze(1)}
        return Transition(self._new_requests(), reward, done, info)


def config(**kw: Any) -> ppo.PPOConfig:
    base: dict[str, Any] = dict(total_steps=32 * 8 * 24, n_envs=32, rollout_len=8, update_epochs=4, n_minibatches=2, lr=3e-3,
                hidden=32, n_critics=2, encoder={"dim": 32}, curriculum=False, device="cpu", threads=1,
                checkpoint_every=1000, seed=0)
    base.update(kw)
    return ppo.PPOConfig(**base)


def test_the_test_environment_keeps_the_protocol():
    env = SignFollowing(4)
    assert isinstance(env, BatchedEnv)
    obs, mask = env.reset(seed=1)
    assert isinstance(env.step(torch.zeros(4, dtype=torch.int64)), EnvStep)
    assert not bool(mask[:, 2].any())


def test_ppo_learns_the_best_action_of_an_environment_it_knows_only_by_the_protocol():
    env = SignFollowing(32, seed=3)
    res = ppo.train(config(), env=env)
    assert all(h["mask_violations"] == 0 for h in res.history)
    # no recorded episodes: no progress scale, no greedy evaluation
    assert all(h["eval_return"] is None and h["progress"] is None for h in res.history)
    assert set(res.history[-1]["reward_components"]) == {"right_action"}
    first, last = res.history[0]["return_mean"], res.history[-1]["return_mean"]
    assert first == pytest.approx(0.5, abs=0.2)          # a fresh policy picks either allowed action
    assert last > 0.9, (first, last)
    # on fresh requests the greedy policy follows the sign and never takes the masked prize
    probe = SignFollowing(512, seed=99)
    obs, mask = probe.reset()
    greedy = act(res.agent, obs, mask, greedy=True)
    assert not bool((greedy == 2).any())
    assert float((greedy == probe.best_actions()).float().mean()) > 0.95


def test_an_environment_alone_trains_without_the_curriculum_only():
    with pytest.raises(InputError, match="curriculum"):
        ppo.train(config(curriculum=True), env=SignFollowing(32))
    with pytest.raises(InputError, match="n_envs"):
        ppo.train(config(), env=SignFollowing(16))
    with pytest.raises(InputError, match="TrainingData"):
        ppo.train(config())
