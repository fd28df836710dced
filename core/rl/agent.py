"""The policy network PPO trains (docs/design.md §6): the state encoder, a 2×256 actor over
the action catalog and an ensemble of critic heads, with CleanRL's initialisation.

The trainer (:mod:`core.rl.ppo`), checkpoints (:mod:`core.rl.checkpoints`), evaluation
rollouts (:mod:`core.rl.rollouts`), bundles and serving all build or read this module.

Example::

    >>> agent = Agent(n_actions=40, encoder_config=StateEncoderConfig(dim=64), hidden=64)   # doctest: +SKIP
    >>> actions = act(agent, obs, mask, greedy=True)                                       # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from core.rl.common import MaskedCategorical
from core.state.features import StateEncoder, StateEncoderConfig


def layer_init(layer: nn.Linear, std: float = math.sqrt(2), bias: float = 0.0) -> nn.Linear:
    """Orthogonal weights, constant bias (CleanRL's initialisation)."""
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias)
    return layer


class Agent(nn.Module):
    """State encoder → actor logits over the catalog and K critic heads.

    ``state(obs)`` is the 512-d encoded state; ``heads(state)`` returns ``(logits [B, A],
    values [B, K])``.  The caller masks the logits (:class:`MaskedCategorical`)."""

    def __init__(self, n_actions: int, encoder_config: StateEncoderConfig, *, hidden: int = 256,
                 n_critics: int = 5, seed: int = 0):
        super().__init__()
        self.n_actions, self.hidden, self.n_critics = int(n_actions), int(hidden), int(n_critics)
        self.encoder = StateEncoder(encoder_config, n_actions=n_actions)
        d = encoder_config.dim
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.actor = nn.Sequential(
                layer_init(nn.Linear(d, hidden)), nn.Tanh(),
                layer_init(nn.Linear(hidden, hidden)), nn.Tanh(),
                layer_init(nn.Linear(hidden, n_actions), std=0.01))
            self.critic = nn.Sequential(
                layer_init(nn.Linear(d, hidden)), nn.Tanh(),
                layer_init(nn.Linear(hidden, hidden)), nn.Tanh())
            # K heads as one matrix: column k is head k (different random init per head).
            self.critic_heads = layer_init(nn.Linear(hidden, n_critics), std=1.0)

    def state(self, obs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        encoded: torch.Tensor = self.encoder(obs)
        return encoded

    def heads(self, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.actor(state), self.critic_heads(self.critic(state))

    def architecture(self) -> dict[str, Any]:
        return {"n_actions": self.n_actions, "hidden": self.hidden, "n_critics": self.n_critics,
                "encoder": self.encoder.config_dict()}


def layer_names(agent: nn.Module) -> list[str]:
    """Modules that own parameters directly: the "layers" of the per-layer gradient norms."""
    return [name for name, m in agent.named_modules() if any(True for _ in m.parameters(recurse=False))]



def act(agent: Agent, obs: Mapping[str, torch.Tensor], mask: torch.Tensor, *, greedy: bool = True,
        generator: torch.Generator | None = None) -> torch.Tensor:
    """Actions of the policy for a batch of states (greedy or sampled), never a masked one."""
    with torch.no_grad():
        logits, _ = agent.heads(agent.state(obs))
        dist = MaskedCategorical(logits, mask)
        return dist.greedy() if greedy else dist.sample(generator)



__all__ = ["Agent", "act", "layer_init", "layer_names"]
