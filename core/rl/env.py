"""The contract between the PPO trainer and the environments it learns in: a batch of B
environments stepped together, as tensors on one device (the vectorised env of
Stable-Baselines3, with Gymnasium's masks and per-term rewards).

:class:`BatchedEnv` is everything :func:`core.rl.ppo.train` reads from an environment;
:class:`core.rl.sim.BatchedSim` (the recorded-episode simulator) is one, and so is any
batch of environments that keeps this contract.  Observations are a dict of tensors, one
row per environment, laid out by :meth:`BatchedEnv.observation_spec`; actions are
``Long[B]`` indices below ``n_actions``; masks are ``Bool[B, n_actions]`` (True = allowed).

Example::

    >>> env: BatchedEnv = BatchedSim(tables, 64)                      # doctest: +SKIP
    >>> obs, mask = env.reset(seed=0)                                 # doctest: +SKIP
    >>> out = env.step(random_masked_actions(env.action_masks()))     # doctest: +SKIP
    >>> out.reward.shape, out.done.shape, sorted(out.info)            # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

#: One batch of observations: name → tensor ``[B, *spec.shape]``.
Observation = Mapping[str, torch.Tensor]

#: Keys every step's ``info`` carries (each ``[B]`` unless said otherwise):
#:
#: * ``episode_return`` Float — the finished episode's return (NaN where it goes on);
#: * ``success`` Float — 1 when the finished episode reached its goal, else 0 (NaN where it goes on);
#: * ``components`` Float[B, C] — the step's reward terms, in the order of ``component_names``;
#: * ``off_support`` Bool — the step's outcome had no support in the environment's data
#:   (always False for an environment that simulates every action);
#: * ``mask_violation`` Bool — the action was outside the mask given with the state.
STEP_INFO_KEYS: tuple[str, ...] = ("episode_return", "success", "components", "off_support", "mask_violation")


@dataclass(frozen=True)
class TensorSpec:
    """Shape (of one environment's row) and dtype of one observation tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@runtime_checkable
class EnvStep(Protocol):
    """What :meth:`BatchedEnv.step` returns: the next observations (for a finished
    environment, the first of its new episode), the rewards ``Float[B]``, ``done``
    ``Bool[B]`` (the episode ended: terminated or truncated) and ``info`` (at least
    :data:`STEP_INFO_KEYS`)."""

    @property
    def obs(self) -> Observation: ...
    @property
    def reward(self) -> torch.Tensor: ...
    @property
    def done(self) -> torch.Tensor: ...
    @property
    def info(self) -> Mapping[str, torch.Tensor]: ...


@runtime_checkable
class BatchedEnv(Protocol):
    """B environments stepped together; a finished environment starts its next episode by itself.

    * ``n_envs`` B, ``n_actions`` A: the batch and the action catalog's size;
    * ``gamma``: the discount under which an episode's rewards sum to its return (the
      trainer's γ unless its config sets one);
    * ``component_names``: the reward terms of ``info["components"]``;
    * ``observation_spec()``: name → :class:`TensorSpec` of the observation tensors;
    * ``reset(seed)``: start every environment afresh (reseeded when ``seed`` is given) →
      ``(obs, masks)``;
    * ``step(actions)``: one action per environment → :class:`EnvStep`;
    * ``action_masks()``: ``Bool[B, A]``, the actions allowed in the current states.
    """

    @property
    def n_envs(self) -> int: ...
    @property
    def n_actions(self) -> int: ...
    @property
    def gamma(self) -> float: ...
    @property
    def component_names(self) -> Sequence[str]: ...

    def observation_spec(self) -> dict[str, TensorSpec]: ...
    def reset(self, seed: int | None = None) -> tuple[Observation, torch.Tensor]: ...
    def step(self, actions: torch.Tensor) -> EnvStep: ...
    def action_masks(self) -> torch.Tensor: ...


__all__ = ["BatchedEnv", "EnvStep", "Observation", "STEP_INFO_KEYS", "TensorSpec"]
