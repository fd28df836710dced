"""Rollouts of a policy in the simulator, for evaluation: :func:`episode_stats` runs a
policy (greedy or sampled) or random-in-mask from given start episodes and summarises the
finished episodes; :func:`mean_return` is its mean template return.

The trainer's progress measurement, held-out evaluation (:mod:`core.rl.evaluation`), the
training doctor and the registry's re-evaluation all read these numbers.

Example::

    >>> stats = episode_stats(data.tables, agent, data.heldout_episodes, every_episode=True)  # doctest: +SKIP
    >>> stats.return_mean, stats.mask_violations                                               # doctest: +SKIP
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from core.rl.agent import Agent
from core.rl.common import MaskedCategorical
from core.rl.sim import BatchedSim, SimTables, random_masked_actions


def mean_return(tables: SimTables, agent: Agent | None, episodes: torch.Tensor, *, n_envs: int = 256,
                device: str | torch.device = "cpu", seed: int = 0, min_episodes: int = 256,
                greedy: bool = True, max_steps: int | None = None, support_episodes: Any = "all") -> float:
    """Mean template return of episodes started from ``episodes``: by ``agent`` (greedy or
    sampled) or, with ``agent=None``, uniformly at random among the unmasked actions."""
    stats = episode_stats(tables, agent, episodes, n_envs=n_envs, device=device, seed=seed,
                          min_episodes=min_episodes, greedy=greedy, max_steps=max_steps,
                          support_episodes=support_episodes)
    return float(stats.return_mean)


@dataclass(frozen=True)
class RolloutStats:
    """What a rollout of a policy (or random-in-mask) did in the simulator (:func:`episode_stats`)."""

    #: Mean and standard deviation of the finished episodes' template returns (NaN when
    #: none finished; the deviation needs two)
    return_mean: float
    return_std: float
    #: Share of finished episodes that succeeded (NaN when none finished)
    success_rate: float
    #: Share of steps whose action no logged step took in a similar state (NaN without steps)
    off_support_rate: float
    #: Actions taken that the masks forbid
    mask_violations: int
    #: Episodes finished
    episodes: int
    #: Steps taken
    steps: int
    #: [steps] the reward of every step taken
    rewards: np.ndarray
    #: [steps, actions] the policy's action probabilities in the visited states (None for random-in-mask)
    probs: np.ndarray | None


def episode_stats(tables: SimTables, agent: Agent | None, episodes: torch.Tensor, *, n_envs: int = 256,
                  device: str | torch.device = "cpu", seed: int = 0, min_episodes: int = 256,
                  greedy: bool = True, max_steps: int | None = None, every_episode: bool = False,
                  support_episodes: Any = "all") -> RolloutStats:
    """Run a policy (or random-in-mask) in the simulator and summarise finished episodes
    (:class:`RolloutStats`: return, success and off-support rates, mask violations, and the
    step rewards and action probabilities of the visited states).

    ``support_episodes``: where counterfactual outcomes are drawn from — by default every
    recorded step of the tables (the simulator's whole world: a held-out evaluation holds
    out the *tasks* it starts from, not the recorded outcomes); the episodes to start from
    (``None``) or other indices as in :class:`core.rl.sim.BatchedSim`.

    ``every_episode=True`` starts one environment on each of ``episodes`` and counts each
    one's first episode exactly once (a full pass over a held-out set)."""
    episodes = torch.as_tensor(episodes, dtype=torch.int64).reshape(-1)
    if every_episode:
        n_envs = int(episodes.numel())
    sim = BatchedSim(tables, n_envs, device=device, seed=seed, episodes=episodes, support_episodes=support_episodes)
    obs, mask = sim.reset(start_episodes=episodes.tolist() if every_episode else None)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    dev = sim.device
    cap = int(tables.config.step_cap)
    max_steps = max_steps or (cap + 1 if every_episode else max(cap + 1, math.ceil(min_episodes / n_envs) * cap * 2))
    returns, successes, rewards_all, probs_all = [], [], [], []
    off, viol, steps = 0, 0, 0
    first = torch.ones(n_envs, dtype=torch.bool, device=dev)
    n_done = 0
    for _ in range(max_steps):
        if agent is None:
            action = random_masked_actions(mask, sim.generator)
        else:
            with torch.no_grad():
                logits, _ = agent.heads(agent.state(obs))
                dist = MaskedCategorical(logits, mask)
                action = dist.greedy() if greedy else dist.sample(gen if dev.type == "cpu" else None)
                probs_all.append(dist.probs[first] if every_episode else dist.probs)
        live = first if every_episode else torch.ones_like(first)
        out = sim.step(action)
        done = out.terminated | out.truncated
        fin = done & live
        returns.append(out.info["episode_return"][fin])
        successes.append(out.info["success"][fin])
        rewards_all.append(out.reward[live])
        off += int(out.info["off_support"][live].sum())
        viol += int((out.info["mask_violation"] | ~mask.gather(1, action[:, None]).squeeze(1))[live].sum())
        steps += int(live.sum())
        n_done += int(fin.sum())
        if every_episode:
            first = first & ~done
            if not bool(first.any()):
                break
        elif n_done >= min_episodes:
            break
        obs, mask = out.obs, out.mask
    r = torch.cat(returns).double().cpu() if returns else torch.zeros(0)
    s = torch.cat(successes).double().cpu() if successes else torch.zeros(0)
    return RolloutStats(
        return_mean=float(r.mean()) if r.numel() else float("nan"),
        return_std=float(r.std()) if r.numel() > 1 else float("nan"),
        success_rate=float(s.mean()) if s.numel() else float("nan"),
        off_support_rate=off / steps if steps else float("nan"),
        mask_violations=viol, episodes=int(r.numel()), steps=steps,
        rewards=torch.cat(rewards_all).cpu().numpy() if rewards_all else np.zeros(0),
        probs=torch.cat(probs_all).cpu().numpy() if probs_all else None,
    )


__all__ = ["RolloutStats", "episode_stats", "mean_return"]
