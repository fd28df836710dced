"""Masked PPO with an adaptive KL penalty and curriculum exploration (docs/design.md §8, S000 §3.3).

Reads top to bottom like CleanRL's ``ppo.py``: :class:`PPOConfig` (a docstring per field), the
data a run trains on (:class:`TrainingData`), the curriculum (:class:`Curriculum`, levels L0
exploit, L1 ε-exploration, L2 UCB, L3 high-risk review) and its warm start, the minibatch
optimisation (:func:`ppo_update`), then :func:`train` in paper order: rollout
(:func:`collect_rollout`), advantages (:func:`compute_advantages`), update, metrics.  The
policy is :class:`core.rl.agent.Agent`; the pure helpers live in :mod:`core.rl.common`.

Details: docs/training.md (## PPO: how the module reads, ## PPO loss and the KL controller,
## Curriculum exploration).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from torch import nn

from core.base.errors import InputError
from core.rl.agent import Agent, layer_names
from core.rl.checkpoints import (CHECKPOINT_VERSION, load_agent, load_optimizer_state, load_rng_state,
                                 load_trainer_state, save_checkpoint)
from core.rl.common import AdaptiveKL, MaskedCategorical, gae
from core.rl.env import BatchedEnv
from core.rl.rollouts import RolloutStats, episode_stats, mean_return
from core.rl.sim import BatchedSim, SimConfig, SimTables, random_masked_actions
from core.state.features import StateEncoderConfig
from core.guard.review import ApprovedExample, ReviewRequest

if TYPE_CHECKING:  # pragma: no cover
    from core.guard.review import ReviewRequest


# =========================================================================== config
#: The state encoder a run trains unless its ``encoder`` setting says otherwise: equal
#: weights for intent, tool context and trace (the gated fusion is ``{"gating": "on"}``).
#: Equal weights because the gates fit the training requests, not new ones: on held-out
#: requests the equal-weight encoder returns more (docs/training.md, ## The default encoder).
TRAINING_ENCODER_DEFAULTS: dict[str, Any] = {"gating": "off"}


@dataclass
class PPOConfig:
    """Everything a training run is configured by (stored with the run)."""

    total_steps: int = 300_000
    """environment steps to train for, all environments together"""
    n_envs: int = 128
    """environments of the batched simulator stepped together"""
    rollout_len: int = 16
    """steps per environment per rollout (the T of GAE); a batch is n_envs × rollout_len"""
    update_epochs: int = 4
    """passes over each batch"""
    n_minibatches: int = 4
    """minibatches per pass"""
    lr: float = 3e-4
    """Adam learning rate (of the heads; the encoder, when PPO trains it, too)"""
    anneal_lr: bool = True
    """decay the learning rate linearly to 0 over the run"""
    gamma: float | None = None
    """discount; None takes the reward template's γ, so PPO optimises the template's return"""
    gae_lambda: float = 0.95
    """λ of generalised advantage estimation"""
    clip_coef: float = 0.2
    """surrogate clipping ε of PPO"""
    norm_adv: bool = True
    """normalise advantages per minibatch"""
    ent_coef: float = 0.02
    """weight of the entropy bonus"""
    vf_coef: float = 0.5
    """weight of the value loss"""
    max_grad_norm: float = 0.5
    """global gradient-norm clip"""
    kl_target: float = 0.01
    """KL(π_old ‖ π) the adaptive penalty steers towards (S000: 0.01)"""
    beta0: float = 1.0
    """initial weight β of the KL penalty"""
    adaptive_kl: bool = True
    """move β after each update (KL > 1.5·target → ×1.5, < 0.5·target → ×0.5); False keeps β₀"""
    hidden: int = 256
    """width of the actor's and the critic's two hidden layers"""
    n_critics: int = 5
    """critic heads of the ensemble (their spread is the UCB uncertainty)"""
    critic_bootstrap: float = 0.8
    """share of the samples each critic head trains on (bootstrap masks keep heads diverse)"""
    curriculum: bool = True
    """curriculum exploration L0–L3; False is plain PPO sampling from π"""
    bc_epochs: int = 60
    """behaviour-cloning passes over the warm-start set at L0"""
    bc_lr: float = 2e-3
    """learning rate of behaviour cloning"""
    bc_min_steps: int = 400
    """optimiser steps of behaviour cloning at least: a small warm-start set gets more passes
    (60 passes over 170 steps of logs are ~300 steps, and left the clone right 47% of the time)"""
    epsilon: float = 0.1
    """share of actions drawn uniformly among the unmasked ones from L1 on"""
    ucb_coef: float = 0.05
    """weight of the critic-ensemble std bonus at L2 and L3 (reward units)"""
    l0_min_updates: int = 2
    """updates at L0 before it may unlock"""
    l0_max_updates: int = 8
    """updates after which L0 unlocks whatever the critic's fit"""
    l0_explained_variance: float = 0.3
    """critic explained variance that unlocks L1"""
    l2_progress: float = 0.9
    """progress (0 = random-in-mask, 1 = best logged behaviour) that unlocks L2"""
    l3_progress: float = 1.0
    """progress that unlocks L3"""
    unlock_patience: int = 2
    """consecutive progress measurements a threshold must hold"""
    eval_every: int = 5
    """updates between greedy evaluations on training episodes (the curriculum's progress)"""
    eval_episodes: int = 256
    """training episodes (a fixed random sample) each greedy evaluation starts from"""
    high_risk_repeat: int = 3
    """same high-risk action this many times in a row → a review item (L3)"""
    max_review_items: int = 50
    """review items one run may queue at most"""
    heldout_fraction: float = 0.2
    """episodes kept out of training for evaluation"""
    heldout_by: str = "episode"
    """"episode" (drawn within each task type and behaviour) or "task" (whole tasks held out,
    by the log's own task id: the honest split for real logs, where runs of one task look alike)"""
    train_encoder: bool = False
    """PPO trains the state encoder too; False (default) keeps it as behaviour cloning left it
    (seeded without a curriculum): the update then runs on stored states, 3-5× faster on a CPU"""
    encoder: dict[str, Any] = field(default_factory=dict)
    """state-encoder settings (core.state.features.StateEncoderConfig) over TRAINING_ENCODER_DEFAULTS,
    e.g. {"gating": "on"} for the gated fusion"""
    sim: dict[str, Any] = field(default_factory=dict)
    """simulator settings (core.rl.sim.SimConfig): step_cap, off_support_penalty, n_clusters"""
    checkpoint_every: int = 10
    """updates between checkpoints (one is always written at the end)"""
    device: str = "auto"
    """"auto" (CUDA when present), "cpu" or "cuda"; the simulator lives on it too"""
    threads: int = 0
    """CPU threads for torch (0 = torch's default; 1 is fastest on a busy shared machine)"""
    seed: int = 0
    """seed of weights, simulator and sampling"""

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "PPOConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise InputError(f"unknown training settings: {', '.join(unknown)}", field="config")
        return cls(**dict(d))

    def validate(self) -> "PPOConfig":
        """Refuse settings that cannot train (raises InputError naming the field)."""
        positive = ("total_steps", "n_envs", "rollout_len", "update_epochs", "n_minibatches", "hidden",
                    "n_critics", "checkpoint_every", "high_risk_repeat", "eval_every", "eval_episodes")
        for name in positive:
            if int(getattr(self, name)) < 1:
                raise InputError(f"{name} must be at least 1, not {getattr(self, name)}", field=name)
        for name in ("bc_epochs", "bc_min_steps"):
            if int(getattr(self, name)) < 0:
                raise InputError(f"{name} must not be negative, not {getattr(self, name)}", field=name)
        if (self.n_envs * self.rollout_len) % self.n_minibatches:
            raise InputError(f"n_envs × rollout_len ({self.n_envs * self.rollout_len}) must split into "
                             f"{self.n_minibatches} equal minibatches", field="n_minibatches")
        for name in ("lr", "bc_lr", "kl_target", "beta0"):
            if not float(getattr(self, name)) > 0:
                raise InputError(f"{name} must be positive", field=name)
        for name in ("epsilon", "critic_bootstrap", "heldout_fraction"):
            if not 0 <= float(getattr(self, name)) <= 1:
                raise InputError(f"{name} must lie in [0, 1]", field=name)
        if self.heldout_by not in ("episode", "task"):
            raise InputError(f"heldout_by must be episode or task, not {self.heldout_by!r}", field="heldout_by")
        if self.gamma is not None and not 0 < float(self.gamma) <= 1:
            raise InputError("gamma must lie in (0, 1]", field="gamma")
        if self.device not in ("auto", "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise InputError(f"device must be auto, cpu or cuda, not {self.device!r}", field="device")
        self.encoder_config()
        self.sim_config()
        return self

    def encoder_config(self) -> StateEncoderConfig:
        return StateEncoderConfig.from_dict({"seed": self.seed, **TRAINING_ENCODER_DEFAULTS, **self.encoder})

    def sim_config(self) -> SimConfig:
        known = {f.name for f in fields(SimConfig)}
        unknown = sorted(set(self.sim) - known)
        if unknown:
            raise InputError(f"unknown simulator settings: {', '.join(unknown)}", field="sim")
        return SimConfig(**{"seed": self.seed, **self.sim})


def resolve_device(device: str) -> str:
    """"auto" → "cuda" when a GPU is visible, else "cpu"; "cuda" without one is refused."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise InputError("--device cuda was asked for, but no CUDA device is visible to torch", field="device")
    return str(device)


# =========================================================================== data
@dataclass
class TrainingData:
    """What a run trains on: simulator tables, the split, baselines and review feedback."""

    tables: SimTables
    train_episodes: torch.Tensor
    heldout_episodes: torch.Tensor
    #: Mean logged template return per behaviour, on the training episodes.
    logged_returns: dict[str, float]
    #: Reviewer-approved steps (core.guard.review.approved_examples) to imitate at L0.
    approved: list[ApprovedExample] = field(default_factory=list)
    dataset: str | None = None
    source: str = ""

    @property
    def best_behaviour(self) -> str:
        return max(self.logged_returns, key=lambda b: self.logged_returns[b])

    def on(self, device: str | torch.device) -> "TrainingData":
        """This data with the simulator tables on ``device``."""
        return replace(self, tables=self.tables.to(device))

    def training_envs(self, n_envs: int, *, device: str | torch.device, seed: int) -> BatchedEnv:
        """The batched simulator over the training episodes: the environments PPO rolls out in."""
        return BatchedSim(self.tables, n_envs, device=device, seed=seed, episodes=self.train_episodes,
                          reuse_obs_buffers=True)    # the rollout copies what it keeps


# =========================================================================== helpers
def explained_variance(y_pred: torch.Tensor, y_true: torch.Tensor) -> float:
    """1 − Var(y − ŷ)/Var(y) (NaN when y is constant)."""
    var_y = float(y_true.var())
    return float("nan") if var_y == 0 else 1.0 - float((y_true - y_pred).var()) / var_y


def token_groups(tables: SimTables) -> tuple[list[str], torch.Tensor]:
    """Tool (or special kind) of every catalog token, as group names and a [A] index."""
    names = [t.tool if t.tool else f"({t.kind})" for t in tables.catalog.tokens]
    groups = sorted(set(names))
    return groups, torch.tensor([groups.index(n) for n in names], dtype=torch.int64)


def group_entropy(mass: torch.Tensor, group: torch.Tensor, n_groups: int) -> torch.Tensor:
    """[G] entropy (nats) of the probability mass ``mass`` [A] within each token group."""
    total = torch.zeros(n_groups, dtype=mass.dtype, device=mass.device).index_add_(0, group, mass)
    q = mass / total[group].clamp_min(1e-12)
    plogq = torch.where(q > 0, q * torch.log(q.clamp_min(1e-30)), torch.zeros_like(q))
    return -torch.zeros(n_groups, dtype=mass.dtype, device=mass.device).index_add_(0, group, plogq)


class Curriculum:
    """Level and unlock bookkeeping of the curriculum (the rules: docs/training.md, ## Curriculum exploration)."""

    def __init__(self, cfg: PPOConfig, level: int = 0, streak: int = 0, updates_at_level: int = 0):
        self.cfg, self.level, self.streak, self.updates_at_level = cfg, level, streak, updates_at_level

    def observe(self, explained_var: float, progress: float | None) -> str | None:
        """Count one update at the current level; returns why a level unlocked, or None."""
        c = self.cfg
        self.updates_at_level += 1
        reason = None
        if self.level == 0:
            if self.updates_at_level >= c.l0_min_updates and explained_var >= c.l0_explained_variance:
                reason = f"critic explains {explained_var:.2f} of the return variance"
            elif self.updates_at_level >= c.l0_max_updates:
                reason = f"{c.l0_max_updates} updates at L0 (critic explains {explained_var:.2f})"
        elif self.level in (1, 2) and progress is not None:
            need = c.l2_progress if self.level == 1 else c.l3_progress
            self.streak = self.streak + 1 if progress >= need else 0
            if self.streak >= c.unlock_patience:
                reason = f"progress {progress:.2f} ≥ {need} for {self.streak} updates"
        if reason is not None:
            self.level, self.streak, self.updates_at_level = self.level + 1, 0, 0
        return reason

    def state_dict(self) -> dict[str, int]:
        return {"level": self.level, "streak": self.streak, "updates_at_level": self.updates_at_level}



# =========================================================================== warm start (L0)
@dataclass(frozen=True)
class WarmStartSet:
    """The behaviour-cloning set of level L0 (:func:`warm_start_set`): N recorded steps,
    as the simulator shows them when it follows the log."""

    #: [N, …] the observation of each step, by input name
    obs: dict[str, torch.Tensor]
    #: [N, A] the actions allowed in each step's state
    mask: torch.Tensor
    #: [N] the label: the logged token, or the approved one
    action: torch.Tensor
    #: [N] Monte-Carlo returns of the followed logs (the critic's targets)
    returns: torch.Tensor
    #: Steps from the best behaviour's logs and from approved review items
    n_logged: int
    n_approved: int
    #: Approved review items that could not be used (unknown episode or step, masked or invalid token)
    approved_skipped: int
    #: The best logged behaviour, whose training episodes are imitated
    behaviour: str
    #: Its training episodes
    episodes: int


def warm_start_set(data: TrainingData, *, device: str | torch.device, seed: int, gamma: float
                   ) -> WarmStartSet:
    """The behaviour-cloning set: every step of the best behaviour's training episodes and
    every approved review step, as the simulator shows them when it follows the log.

    One environment per episode (or approved step) starts on it and replays its logged
    tokens — batched over environments, one loop over the (≤ step cap) steps.  A step
    whose logged call is INVALID, or masked in that state, cannot be imitated: its
    environment stops collecting there.  Monte-Carlo returns of the followed logs seed the
    critic."""
    tb = data.tables
    best = data.best_behaviour
    train = data.train_episodes.cpu().tolist()
    starts = [e for e in train if (tb.behaviours[e] or "unknown") == best]
    index = {eid: i for i, eid in enumerate(tb.episode_ids)}
    ex_eps, ex_t, ex_token, skipped = [], [], [], 0
    for ex in data.approved:
        e = index.get(str(ex.episode_id))
        if e is None or ex.step_t is None or not 0 <= ex.token_id < tb.n_actions:
            skipped += 1
            continue
        ex_eps.append(e)
        ex_t.append(ex.step_t)
        ex_token.append(ex.token_id)
    n_log = len(starts)
    all_starts = starts + ex_eps
    B = len(all_starts)
    sim = BatchedSim(tb, B, device=device, seed=seed, episodes=data.train_episodes, support_episodes="all")
    obs, mask = sim.reset(start_episodes=all_starts)
    dev = sim.device
    # Per environment: the step to record (-1 = every step) and the label to record there.
    target_t = torch.tensor([-1] * n_log + ex_t, dtype=torch.int64, device=dev)
    approved_token = torch.tensor([-1] * n_log + ex_token, dtype=torch.int64, device=dev)
    alive = torch.ones(B, dtype=torch.bool, device=dev)
    steps: list[dict[str, Any]] = []
    for t in range(int(tb.config.step_cap)):
        logged = sim.logged_actions()
        label = torch.where(target_t == t, approved_token, logged)
        can = alive & (label >= 0) & mask.gather(1, label.clamp_min(0)[:, None]).squeeze(1)
        record = can & ((target_t < 0) | (target_t == t))
        # approved envs walk the log up to their step; the label is taken there
        follow = torch.where(target_t == t, approved_token, logged)
        ok_follow = alive & (follow >= 0) & mask.gather(1, follow.clamp_min(0)[:, None]).squeeze(1)
        action = torch.where(ok_follow, follow, torch.full_like(follow, tb.catalog.final_id))
        out = sim.step(action)
        steps.append({"obs": obs, "mask": mask, "label": label, "record": record, "reward": out.reward,
                      "alive": alive & ok_follow})
        done = out.terminated | out.truncated
        alive = alive & ok_follow & ~done & ~((target_t >= 0) & (target_t <= t))
        obs, mask = out.obs, out.mask
        if not bool(alive.any()):
            break
    # Monte-Carlo returns of the replayed logs (backwards, cut where an env stopped).
    ret = torch.zeros(B, device=dev)
    returns = []
    for s in reversed(steps):
        ret = torch.where(s["alive"], s["reward"] + gamma * ret, torch.zeros_like(ret))
        returns.append(ret)
    returns.reverse()
    rec = torch.stack([s["record"] for s in steps])                     # [T, B]
    pick = rec.flatten().nonzero().squeeze(1)
    cat = lambda xs: torch.stack(xs).flatten(0, 1).index_select(0, pick)  # noqa: E731
    return WarmStartSet(
        obs={k: cat([s["obs"][k] for s in steps]) for k in steps[0]["obs"]},
        mask=cat([s["mask"] for s in steps]), action=cat([s["label"] for s in steps]),
        returns=cat(returns), n_logged=int(rec[:, :n_log].sum()), n_approved=int(rec[:, n_log:].sum()),
        approved_skipped=skipped + (len(ex_eps) - int(rec[:, n_log:].sum())), behaviour=best,
        episodes=n_log,
    )


def behaviour_cloning(agent: Agent, bc: WarmStartSet, cfg: PPOConfig, generator: torch.Generator
                      ) -> dict[str, float]:
    """Fit the actor to the warm-start labels (masked cross-entropy) and the critic to the
    logged Monte-Carlo returns; returns the final accuracy and losses."""
    n = int(bc.action.shape[0])
    if n == 0:
        return {"bc_samples": 0.0, "bc_accuracy": float("nan"), "bc_loss": float("nan")}
    opt = torch.optim.Adam([p for p in agent.parameters() if p.requires_grad], lr=cfg.bc_lr)
    # at least ~8 steps per pass, so a small warm-start set is not fitted in a handful of steps
    mb = max(1, min(256, max(32, n // 8), n))
    epochs = max(int(cfg.bc_epochs), math.ceil(int(cfg.bc_min_steps) / math.ceil(n / mb)))
    # The critic regresses the logged returns through the shared encoder: that extra signal
    # shapes the state faster than imitation alone (docs/training.md, ## Behaviour cloning warm start).
    for _ in range(epochs):
        perm = torch.randperm(n, generator=generator).to(bc.action.device)
        for start in range(0, n, mb):
            idx = perm[start:start + mb]
            logits, values = agent.heads(agent.state({k: v[idx] for k, v in bc.obs.items()}))
            dist = MaskedCategorical(logits, bc.mask[idx])
            ce = -dist.log_prob(bc.action[idx]).mean()
            v_loss = 0.5 * ((values - bc.returns[idx, None]) ** 2).mean()
            opt.zero_grad()
            (ce + cfg.vf_coef * v_loss).backward()
            nn.utils.clip_grad_norm_(agent.parameters(), 1.0)
            opt.step()
    with torch.no_grad():
        logits, values = agent.heads(agent.state(bc.obs))
        dist = MaskedCategorical(logits, bc.mask)
        acc = float((dist.greedy() == bc.action).float().mean())
        loss = float(-dist.log_prob(bc.action).mean())
    return {"bc_samples": float(n), "bc_accuracy": acc, "bc_loss": loss}



# =========================================================================== the update
def ppo_update(agent: Agent, optimizer: torch.optim.Optimizer, batch: PPOBatch, cfg: PPOConfig,
               beta: float, *, train_policy: bool = True, generator: torch.Generator | None = None,
               layers: Sequence[str] | None = None) -> dict[str, Any]:
    """Optimise the clipped surrogate + value + β·KL − entropy loss over one batch.

    ``batch``: the samples (:class:`PPOBatch`, from :func:`flatten_batch`).
    ``train_policy=False`` (L0) fits only the critic heads.
    Returns the mean KL of the last epoch (what the β controller reads), clip fraction,
    losses, entropy and per-layer gradient norms (mean over minibatches)."""
    N = int(batch.actions.shape[0])
    mb_size = N // cfg.n_minibatches
    device = batch.actions.device
    names = layers if layers is not None else layer_names(agent)
    modules = dict(agent.named_modules())
    params, layer_of = [], []
    for i, n in enumerate(names):
        for p in modules[n].parameters(recurse=False):
            if p.requires_grad:
                params.append(p)
                layer_of.append(i)
    layer_of_t = torch.tensor(layer_of, dtype=torch.int64, device=device)
    grad_sq = torch.zeros(len(names), device=device)
    touched = torch.zeros(len(names), dtype=torch.bool, device=device)
    stats = {k: torch.zeros((), device=device) for k in ("pg_loss", "v_loss", "entropy", "clipfrac", "kl",
                                                        "grad_norm")}
    last_kl = torch.zeros((), device=device)
    n_steps = 0
    for epoch in range(cfg.update_epochs):
        perm = torch.randperm(N, generator=generator).to(device)
        for start in range(0, N, mb_size):
            mb = perm[start:start + mb_size]
            if batch.state is not None:
                state = batch.state[mb]
            elif train_policy:
                state = agent.state({k: v[mb] for k, v in batch.observations().items()})
            else:  # L0: the encoder (and the actor reading it) stay as behaviour cloning left them
                with torch.no_grad():
                    state = agent.state({k: v[mb] for k, v in batch.observations().items()})
            logits, values = agent.heads(state)
            dist = MaskedCategorical(logits, batch.mask[mb])
            newlogprob = dist.log_prob(batch.actions[mb])
            logratio = newlogprob - batch.logprobs[mb]
            ratio = logratio.exp()
            kl = dist.kl_from(batch.old_logp_all[mb]).mean()
            clipfrac = ((ratio - 1.0).abs() > cfg.clip_coef).float().mean()

            mb_adv = batch.advantages[mb]
            if cfg.norm_adv:
                mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std() + 1e-8)
            # Policy loss: the clipped surrogate
            pg_loss = torch.max(-mb_adv * ratio,
                                -mb_adv * torch.clamp(ratio, 1 - cfg.clip_coef, 1 + cfg.clip_coef)).mean()
            # Value loss: every critic head on its bootstrap share of the minibatch
            boot = batch.boot[mb]
            v_loss = 0.5 * (((values - batch.returns[mb, None]) ** 2) * boot).sum() / boot.sum().clamp_min(1.0)
            entropy = dist.entropy().mean()
            if train_policy:
                loss = pg_loss + cfg.vf_coef * v_loss + beta * kl - cfg.ent_coef * entropy
            else:
                loss = cfg.vf_coef * v_loss

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            # per-layer gradient norms, before clipping (kept on the device: no sync per minibatch)
            with_grad = [j for j, p in enumerate(params) if p.grad is not None]
            if with_grad:
                norms = torch._foreach_norm([params[j].grad for j in with_grad])
                ids = layer_of_t[with_grad]
                grad_sq.index_add_(0, ids, torch.stack(norms).float() ** 2)
                touched[ids] = True
            total = nn.utils.clip_grad_norm_(agent.parameters(), cfg.max_grad_norm)
            optimizer.step()

            n_steps += 1
            stats["pg_loss"] += pg_loss.detach()
            stats["v_loss"] += v_loss.detach()
            stats["entropy"] += entropy.detach()
            stats["clipfrac"] += clipfrac
            stats["kl"] += kl.detach()
            stats["grad_norm"] += total.detach()
            if epoch == cfg.update_epochs - 1:
                last_kl += kl.detach()
    per_mb = cfg.n_minibatches
    out: dict[str, Any] = {k: float(v) / n_steps for k, v in stats.items()}
    out["kl_last_epoch"] = float(last_kl) / per_mb
    # Layers that took part in this update (L0 leaves the encoder and the actor out); a
    # trained layer whose norm is ~0 is what the gradient-flow diagnosis looks for.
    layer_norms = (grad_sq / n_steps).sqrt().cpu().tolist()
    took_part = touched.cpu().tolist()
    out["grad_norms"] = {n: g for n, g, t in zip(names, layer_norms, took_part) if t}
    return out


# =========================================================================== training
class Recorder(Protocol):
    """Where a run's updates, checkpoints and review items go (core.rl.runs implements it)."""

    run_id: str

    def on_update(self, update_idx: int, env_steps: int, metrics: Mapping[str, Any]) -> bool: ...
    def checkpoint_dir(self, update_idx: int) -> Path: ...
    def on_checkpoint(self, update_idx: int, env_steps: int, path: Path) -> None: ...
    def on_review(self, requests: Sequence["ReviewRequest"]) -> int: ...


@dataclass
class TrainResult:
    """What :func:`train` returns."""

    agent: Agent
    final_metrics: dict[str, Any]
    history: list[dict[str, Any]]
    stopped: bool
    device: str
    seconds: float


def _review_requests(data: TrainingData, flags: torch.Tensor, actions: torch.Tensor, pointers: torch.Tensor,
                     probs: torch.Tensor, components: torch.Tensor, run_id: str | None, update: int,
                     limit: int, repeat: int) -> list["ReviewRequest"]:
    """Review items for the flagged (step, env) cells of a rollout (few: host-side is fine)."""
    tb = data.tables
    cells = flags.nonzero().cpu().tolist()[:max(limit, 0)]
    out = []
    step_episode = tb.step_episode.cpu()
    step_t = tb.step_t.cpu()
    for t, b in cells:
        ptr = int(pointers[t, b])
        token = tb.catalog.tokens[int(actions[t, b])]
        e = int(step_episode[ptr])
        state = {}
        for name, col in tb.state_columns.items():
            if name == "task_type":
                continue
            v = col[ptr]
            if v is None or (isinstance(v, float) and not math.isfinite(v)):
                continue
            v = v.item() if hasattr(v, "item") else v
            if isinstance(v, float) and not math.isfinite(v):
                continue
            state[name] = v
        comps = dict(zip(tb.component_names, components[t, b].cpu().tolist()))
        out.append(ReviewRequest(
            origin="training", reason=(f"curriculum L3: the policy took the high-risk action {token.label} "
                                       + (f"{repeat} times in a row" if repeat > 1 else "while exploring")),
            state=state, token_id=token.id, token_name=token.name, action_label=token.label, tool=token.tool,
            risk=token.risk, reward_components=comps, task_type=tb.task_types[e], dataset=data.dataset,
            confidence=float(probs[t, b]), run_id=run_id, episode_id=tb.episode_ids[e],
            step_t=int(step_t[ptr]), meta={"update": update, "curriculum_level": 3}))
    return out




# --------------------------------------------------------------------------- setup
def seed_everything(cfg: PPOConfig) -> str:
    """The device the run trains on, with torch's and numpy's global generators seeded."""
    device = resolve_device(cfg.device)
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed % 2**32)
    return device


def training_envs(cfg: PPOConfig, data: TrainingData | None, env: BatchedEnv | None, device: str) -> BatchedEnv:
    """The environments PPO rolls out in: ``env``, else the batched simulator over the
    data's training episodes.  Without recorded episodes there is no curriculum."""
    if data is None and (env is None or cfg.curriculum):
        raise InputError("training needs recorded episodes (TrainingData): the curriculum clones and measures "
                         "against them; an environment alone trains with curriculum=False", field="curriculum")
    if env is not None:
        if env.n_envs != cfg.n_envs:
            raise InputError(f"the environment batches {env.n_envs} environments, the config's n_envs is "
                             f"{cfg.n_envs}", field="n_envs")
        return env
    if data is None:
        raise InputError("training needs recorded episodes (TrainingData) or an environment", field="data")
    return data.training_envs(cfg.n_envs, device=device, seed=cfg.seed)


@dataclass
class ActionKinds:
    """What the trainer knows of the actions beyond their number: the high-risk ones
    (ε-exploration reaches them only at L3) and the tool of each (per-tool entropy)."""

    high_risk: torch.Tensor
    """Bool[A]"""
    groups: list[str]
    """tool names (a special token's kind in parentheses)"""
    group_of: torch.Tensor
    """Long[A]: index into ``groups``"""


def action_kinds(data: TrainingData | None, n_actions: int, device: str) -> ActionKinds:
    """The catalog's risks and tools; an environment without a catalog has one group and no high risk."""
    if data is None:
        none = torch.zeros(n_actions, dtype=torch.int64, device=device)
        return ActionKinds(high_risk=none.bool(), groups=["actions"], group_of=none)
    tokens = data.tables.catalog.tokens
    groups, group_of = token_groups(data.tables)
    return ActionKinds(high_risk=torch.tensor([t.risk == "high" for t in tokens], dtype=torch.bool, device=device),
                       groups=groups, group_of=group_of.to(device))


@dataclass
class ProgressScale:
    """The curriculum's progress scale: 0 = random-in-mask, 1 = the best logged behaviour,
    measured by the greedy policy from a fixed sample of training episodes."""

    random_return: float
    best_logged: float
    eval_starts: torch.Tensor


def progress_scale(cfg: PPOConfig, data: TrainingData | None, device: str) -> ProgressScale | None:
    """Both ends of the progress scale on the training episodes (None without recorded episodes)."""
    if data is None:
        return None
    random_return = mean_return(data.tables, None, data.train_episodes, n_envs=min(512, 4 * cfg.n_envs),
                                device=device, seed=cfg.seed + 1, min_episodes=512, support_episodes=None)
    pick = torch.randperm(int(data.train_episodes.numel()), generator=torch.Generator().manual_seed(cfg.seed))
    return ProgressScale(random_return=random_return, best_logged=data.logged_returns[data.best_behaviour],
                         eval_starts=data.train_episodes.cpu()[pick[:cfg.eval_episodes]])


@dataclass
class TrainerState:
    """The counters a run carries from update to update, and through a checkpoint."""

    curriculum: Curriculum
    update: int = 0
    env_steps: int = 0
    review_items: int = 0
    warm_start: dict[str, Any] = field(default_factory=dict)


def resume(folder: Path, agent: Agent, cfg: PPOConfig, kl_ctl: AdaptiveKL,
           generators: Mapping[str, torch.Generator], device: str) -> TrainerState:
    """Load a checkpoint's agent, β, counters and random generators into this run."""
    agent.load_state_dict(load_agent(folder, device).state_dict())
    trainer = load_trainer_state(folder)
    kl_ctl.beta = float(trainer["beta"])
    rng = load_rng_state(folder)
    for name, gen in generators.items():
        gen.set_state(rng[name].to(gen.get_state().device))
    torch.set_rng_state(rng["torch_cpu"])
    return TrainerState(curriculum=Curriculum(cfg, **trainer["curriculum"]), update=int(trainer["update"]),
                        env_steps=int(trainer["env_steps"]), review_items=int(trainer.get("review_items", 0)),
                        warm_start=trainer.get("warm_start", {}))


def start_fresh(agent: Agent, data: TrainingData | None, cfg: PPOConfig, *, device: str, gamma: float,
                generator: torch.Generator) -> TrainerState:
    """A fresh run's state; with the curriculum, after L0's behaviour cloning of the best
    logged behaviour (and the approved steps), whose sizes and fit the state keeps."""
    state = TrainerState(curriculum=Curriculum(cfg, level=0 if cfg.curriculum else 1))
    if not cfg.curriculum or data is None:
        return state
    bc = warm_start_set(data, device=device, seed=cfg.seed, gamma=gamma)
    state.warm_start = {"behaviour": bc.behaviour, "episodes": bc.episodes, "bc_logged_steps": bc.n_logged,
                        "bc_approved_steps": bc.n_approved, "approved_skipped": bc.approved_skipped}
    state.warm_start.update(behaviour_cloning(agent, bc, cfg, generator))
    return state


def make_optimizer(agent: Agent, cfg: PPOConfig, resume_from: Path | None, device: str) -> torch.optim.Optimizer:
    """Adam over what PPO trains (the encoder only with ``train_encoder``), with a
    checkpoint's moments when resuming."""
    if not cfg.train_encoder:
        agent.encoder.requires_grad_(False)
    optimizer = torch.optim.Adam([p for p in agent.parameters() if p.requires_grad], lr=cfg.lr, eps=1e-5)
    if resume_from is not None:
        load_optimizer_state(Path(resume_from), optimizer, device)
    return optimizer


# --------------------------------------------------------------------------- rollout
@dataclass
class Rollout:
    """One rollout, T steps × B environments (reused from update to update), and where
    the next one starts: ``next_obs``/``next_mask``/``next_done``, and the L3 watch
    (``last_action``, ``streak``: the same high-risk action again and again)."""

    obs: dict[str, torch.Tensor]
    """[T, B, …] observations (kept only when PPO trains the encoder)"""
    state: torch.Tensor
    """[T, B, D] encoded states"""
    masks: torch.Tensor
    actions: torch.Tensor
    logprobs: torch.Tensor
    """log μ(a): the behaviour that acted (π, or its ε-mixture)"""
    old_logp_all: torch.Tensor
    """[T, B, A] log π_old, for the KL"""
    rewards: torch.Tensor
    dones: torch.Tensor
    """1 where the observation started a new episode (CleanRL's convention)"""
    values: torch.Tensor
    """[T, B, K] the critic heads"""
    state_steps: torch.Tensor
    """recorded step of each state (info["state_step"]; kept when the curriculum may queue reviews)"""
    flags: torch.Tensor
    """high-risk repeats (L3 review items)"""
    ep_return: torch.Tensor
    ep_success: torch.Tensor
    components: torch.Tensor
    off_support: torch.Tensor
    violations: torch.Tensor
    next_obs: Mapping[str, torch.Tensor]
    next_mask: torch.Tensor
    next_done: torch.Tensor
    last_action: torch.Tensor
    streak: torch.Tensor


def start_rollouts(env: BatchedEnv, cfg: PPOConfig, state_dim: int, device: str, *, seed: int) -> Rollout:
    """Reset the environments (reseeded) and allocate the rollout storage."""
    next_obs, next_mask = env.reset(seed=seed)
    T, B, A, K = cfg.rollout_len, env.n_envs, env.n_actions, cfg.n_critics
    zeros = lambda *shape, dtype=torch.float32: torch.zeros((T, B, *shape), dtype=dtype, device=device)  # noqa: E731
    nan = lambda: torch.full((T, B), float("nan"), device=device)  # noqa: E731
    obs = ({k: zeros(*spec.shape, dtype=spec.dtype) for k, spec in env.observation_spec().items()}
           if cfg.train_encoder else {})
    return Rollout(obs=obs, state=zeros(state_dim), masks=zeros(A, dtype=torch.bool),
                   actions=zeros(dtype=torch.int64), logprobs=zeros(), old_logp_all=zeros(A), rewards=zeros(),
                   dones=zeros(), values=zeros(K), state_steps=zeros(dtype=torch.int64),
                   flags=zeros(dtype=torch.bool), ep_return=nan(), ep_success=nan(),
                   components=zeros(len(env.component_names)), off_support=zeros(dtype=torch.bool),
                   violations=zeros(dtype=torch.bool), next_obs=next_obs, next_mask=next_mask,
                   next_done=torch.zeros(B, device=device),
                   last_action=torch.full((B,), -1, dtype=torch.int64, device=device),
                   streak=torch.zeros(B, dtype=torch.int64, device=device))


def behaviour_action(dist: MaskedCategorical, mask: torch.Tensor, *, greedy: bool, epsilon: float,
                     explorable: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(action, log μ(action))`` of the behaviour that acts: π greedy (L0), π sampled, or the
    mixture μ = (1 − ε)·π + ε·uniform over the explorable unmasked actions (from L1)."""
    if greedy:
        action = dist.greedy()
        return action, dist.log_prob(action)
    action = dist.sample(generator)
    if epsilon <= 0:
        return action, dist.log_prob(action)
    explore = mask & explorable
    explore = torch.where(explore.any(1, keepdim=True), explore, mask)
    rand_action = random_masked_actions(explore, generator)
    use_rand = torch.rand(mask.shape[0], device=mask.device, generator=generator) < epsilon
    action = torch.where(use_rand, rand_action, action)
    # μ(a) = (1 − ε)·π(a) + ε·[a explorable]/n_explorable: the behaviour's probability
    uniform = explore.gather(1, action[:, None]).squeeze(1) / explore.sum(1).clamp_min(1)
    return action, torch.log((1 - epsilon) * dist.log_prob(action).exp() + epsilon * uniform)


def collect_rollout(env: BatchedEnv, agent: Agent, ro: Rollout, cfg: PPOConfig, *, level: int, epsilon: float,
                    high_risk: torch.Tensor, generator: torch.Generator) -> None:
    """Step the environments ``cfg.rollout_len`` times with the behaviour of ``level``, filling ``ro``."""
    greedy = cfg.curriculum and level == 0
    explorable = high_risk.new_ones(high_risk.shape) if level >= 3 else ~high_risk   # high-risk only at L3
    for step in range(cfg.rollout_len):
        for k in ro.obs:
            ro.obs[k][step] = ro.next_obs[k]
        ro.masks[step] = ro.next_mask
        ro.dones[step] = ro.next_done
        with torch.no_grad():
            state = agent.state(ro.next_obs)
            logits, value = agent.heads(state)
            dist = MaskedCategorical(logits, ro.next_mask)
        ro.state[step], ro.values[step], ro.old_logp_all[step] = state, value, dist.log_probs_all
        action, ro.logprobs[step] = behaviour_action(dist, ro.next_mask, greedy=greedy, epsilon=epsilon,
                                                     explorable=explorable, generator=generator)
        ro.actions[step] = action
        # L3 watch: the same high-risk action again and again in one episode
        same = (action == ro.last_action) & high_risk[action]
        ro.streak = torch.where(same, ro.streak + 1, high_risk[action].long())
        ro.flags[step] = ro.streak == cfg.high_risk_repeat

        out = env.step(action)
        info = out.info
        ro.rewards[step] = out.reward
        ro.next_obs, ro.next_mask, ro.next_done = out.obs, env.action_masks(), out.done.float()
        ro.ep_return[step], ro.ep_success[step] = info["episode_return"], info["success"]
        ro.components[step], ro.off_support[step] = info["components"], info["off_support"]
        ro.violations[step] = info["mask_violation"] | ~ro.masks[step].gather(1, action[:, None]).squeeze(1)
        if cfg.curriculum:
            ro.state_steps[step] = info["state_step"]
        ro.last_action = torch.where(out.done, torch.full_like(action, -1), action)
        ro.streak = torch.where(out.done, torch.zeros_like(ro.streak), ro.streak)


# --------------------------------------------------------------------------- advantages
@dataclass
class Advantages:
    """GAE of one rollout ([T, B] each) and the L2 optimism bonus that went into its rewards."""

    advantages: torch.Tensor
    returns: torch.Tensor
    ucb_bonus: torch.Tensor
    critic_std: torch.Tensor
    """std of the critic heads at each state"""


def compute_advantages(agent: Agent, ro: Rollout, cfg: PPOConfig, *, level: int, gamma: float) -> Advantages:
    """GAE(γ, λ) on the rollout's rewards, plus ``ucb_coef · std_k V_k(s')`` at L2 and L3."""
    with torch.no_grad():
        next_value_heads = agent.heads(agent.state(ro.next_obs))[1]
    sigma = ro.values.std(dim=-1) if cfg.n_critics > 1 else torch.zeros_like(ro.rewards)
    bonus = torch.zeros_like(ro.rewards)
    if cfg.curriculum and level >= 2 and cfg.ucb_coef > 0:
        next_sigma = next_value_heads.std(dim=-1) if cfg.n_critics > 1 else torch.zeros_like(ro.next_done)
        sigma_next = torch.cat([sigma[1:], next_sigma[None]], dim=0)
        alive_next = 1.0 - torch.cat([ro.dones[1:], ro.next_done[None]], dim=0)
        bonus = cfg.ucb_coef * sigma_next * alive_next
    advantages, returns = gae(ro.rewards + bonus, ro.values.mean(-1), ro.dones, next_value_heads.mean(-1),
                              ro.next_done, gamma, cfg.gae_lambda)
    return Advantages(advantages=advantages, returns=returns, ucb_bonus=bonus, critic_std=sigma)


@dataclass(frozen=True)
class PPOBatch:
    """N samples of one PPO update (:func:`ppo_update`; :func:`flatten_batch` makes them
    from a rollout): each sample's input is its observation or, with a fixed encoder, its
    encoded state."""

    #: [N, A] the actions allowed in each sample's state
    mask: torch.Tensor
    #: [N] the actions taken, and their log-probabilities under the behaviour that chose them
    actions: torch.Tensor
    logprobs: torch.Tensor
    #: [N, A] log π_old of every action, for the KL
    old_logp_all: torch.Tensor
    #: [N] GAE advantages and the critic's return targets
    advantages: torch.Tensor
    returns: torch.Tensor
    #: [N, K] bootstrap masks of the K critic heads (1: the head learns from the sample)
    boot: torch.Tensor
    #: [N, …] observations by input name, when PPO trains the encoder (else None)
    obs: dict[str, torch.Tensor] | None = None
    #: [N, D] encoded states, when the encoder is fixed (else None)
    state: torch.Tensor | None = None

    def observations(self) -> dict[str, torch.Tensor]:
        """:attr:`obs`; refused for a batch of encoded states."""
        if self.obs is None:
            raise ValueError("this batch holds encoded states, not observations")
        return self.obs


def flatten_batch(ro: Rollout, adv: Advantages, cfg: PPOConfig, generator: torch.Generator) -> PPOBatch:
    """The rollout as one batch of T·B samples (what :func:`ppo_update` reads), with fresh
    bootstrap masks of the critic heads."""
    n, A = ro.actions.numel(), ro.masks.shape[-1]
    boot = (torch.rand((n, cfg.n_critics), generator=generator).to(ro.actions.device) < cfg.critic_bootstrap).float()
    return PPOBatch(
        mask=ro.masks.reshape(n, A), actions=ro.actions.reshape(-1), logprobs=ro.logprobs.reshape(-1),
        old_logp_all=ro.old_logp_all.reshape(n, A), advantages=adv.advantages.reshape(-1),
        returns=adv.returns.reshape(-1), boot=boot,
        obs={k: v.reshape(n, *v.shape[2:]) for k, v in ro.obs.items()} if cfg.train_encoder else None,
        state=None if cfg.train_encoder else ro.state.reshape(n, -1))


# --------------------------------------------------------------------------- metrics
def measure_progress(agent: Agent, data: TrainingData | None, scale: ProgressScale | None, *, seed: int,
                     device: str) -> tuple[RolloutStats | None, float | None]:
    """The greedy policy's rollouts from the fixed training starts, and where their return
    lies on the progress scale (rollout returns carry ε-noise; these do not)."""
    if data is None or scale is None:
        return None, None
    greedy = episode_stats(data.tables, agent, scale.eval_starts, every_episode=True, device=device, seed=seed,
                           support_episodes=data.train_episodes)
    if scale.best_logged - scale.random_return <= 1e-9:
        return greedy, None
    return greedy, (greedy.return_mean - scale.random_return) / (scale.best_logged - scale.random_return)


def log_update(ro: Rollout, adv: Advantages, stats: Mapping[str, Any], *, env: BatchedEnv, kinds: ActionKinds,
               cfg: PPOConfig, level: int, epsilon: float, beta: float, beta_next: float,
               greedy: RolloutStats | None, progress: float | None, scale: ProgressScale | None,
               lr: float, policy_trained: bool) -> dict[str, Any]:
    """The metrics of one update: the rollout's returns and reward terms, the update's
    losses, KL and gradient norms, entropies, the critic's fit and the curriculum's state."""
    n, A = ro.actions.numel(), ro.masks.shape[-1]
    with torch.no_grad():
        mass = ro.old_logp_all.exp().reshape(n, A).mean(0)
        per_tool = group_entropy(mass, kinds.group_of, len(kinds.groups))
        finished = ~torch.isnan(ro.ep_return)
        n_finished = int(finished.sum())
        comp_means = ro.components.reshape(n, -1).mean(0).cpu().tolist()
        y_pred = ro.values.mean(-1).reshape(-1)
    return {
        "return_mean": float(ro.ep_return[finished].mean()) if n_finished else float("nan"),
        "success_rate": float(ro.ep_success[finished].mean()) if n_finished else float("nan"),
        "episodes": n_finished,
        "reward_mean": float(ro.rewards.mean()),
        "reward_components": dict(zip(env.component_names, comp_means)),
        "kl": stats["kl_last_epoch"], "kl_mean": stats["kl"], "beta": beta, "beta_next": beta_next,
        "clip_fraction": stats["clipfrac"], "value_loss": stats["v_loss"], "policy_loss": stats["pg_loss"],
        "entropy": stats["entropy"], "entropy_marginal": float(-(mass * mass.clamp_min(1e-30).log()).sum()),
        "entropy_per_tool": dict(zip(kinds.groups, per_tool.cpu().tolist())),
        "grad_norm": stats["grad_norm"], "grad_norms": stats["grad_norms"],
        "explained_variance": explained_variance(y_pred, adv.returns.reshape(-1)),
        "off_support_rate": float(ro.off_support.float().mean()),
        "mask_violations": int(ro.violations.sum()),
        "curriculum_level": level if cfg.curriculum else None, "epsilon": epsilon,
        "ucb_bonus": float(adv.ucb_bonus.mean()), "critic_std": float(adv.critic_std.mean()),
        "eval_return": None if greedy is None else greedy.return_mean,
        "eval_success_rate": None if greedy is None else greedy.success_rate,
        "eval_off_support_rate": None if greedy is None else greedy.off_support_rate,
        "progress": progress, "random_return": None if scale is None else scale.random_return,
        "best_logged_return": None if scale is None else scale.best_logged,
        "high_risk_repeats": int(ro.flags.sum()),
        "lr": lr, "policy_trained": policy_trained,
    }


def queue_reviews(data: TrainingData | None, ro: Rollout, state: TrainerState, cfg: PPOConfig, *, level: int,
                  update: int, recorder: Recorder | None) -> int:
    """L3: the rollout's high-risk repeats go to the review queue (at most
    ``max_review_items`` a run); returns how many items the queue took."""
    if not (data is not None and cfg.curriculum and level >= 3 and bool(ro.flags.any())
            and state.review_items < cfg.max_review_items):
        return 0
    chosen = ro.old_logp_all.exp().gather(2, ro.actions[..., None]).squeeze(2)
    reqs = _review_requests(data, ro.flags, ro.actions, ro.state_steps, chosen, ro.components,
                            getattr(recorder, "run_id", None), update, cfg.max_review_items - state.review_items,
                            cfg.high_risk_repeat)
    state.review_items += len(reqs)
    return recorder.on_review(reqs) if recorder is not None else len(reqs)


def write_checkpoint(recorder: Recorder, agent: Agent, optimizer: torch.optim.Optimizer, state: TrainerState,
                     beta: float, num_updates: int, generators: Mapping[str, torch.Generator]) -> None:
    """Checkpoint the run after ``state.update`` and tell the recorder where it lies."""
    trainer = {"update": state.update, "env_steps": state.env_steps, "beta": beta,
               "curriculum": state.curriculum.state_dict(), "review_items": state.review_items,
               "warm_start": state.warm_start, "num_updates": num_updates, "version": CHECKPOINT_VERSION}
    path = save_checkpoint(recorder.checkpoint_dir(state.update), agent, optimizer, trainer, generators)
    recorder.on_checkpoint(state.update, state.env_steps, path)


def final_metrics(history: Sequence[Mapping[str, Any]], warm: dict[str, Any]) -> dict[str, Any]:
    """The last update's metrics, the warm start, and the spread of the policy updates' KL."""
    final = dict(history[-1]) if history else {}
    final["warm_start"] = warm
    kls = [h["kl"] for h in history if h.get("policy_trained")]
    final["kl_std"] = float(np.std(kls)) if len(kls) > 1 else None
    return final


# --------------------------------------------------------------------------- train
def train(cfg: PPOConfig, data: TrainingData | None = None, *, env: BatchedEnv | None = None,
          recorder: Recorder | None = None, resume_from: Path | None = None,
          progress: Callable[[dict[str, Any]], None] | None = None) -> TrainResult:
    """Train a masked PPO policy (the algorithm: docs/training.md).

    ``data``: the recorded episodes; the rollouts run in their batched simulator unless
    ``env`` (any :class:`core.rl.env.BatchedEnv`) is given.  Without ``data`` there is no
    curriculum (``curriculum=False``) and no progress measurement.  ``recorder`` receives
    each update's metrics (and may ask to stop), checkpoints and L3 review items;
    ``resume_from`` continues from a checkpoint folder."""
    cfg.validate()
    t_start = time.time()
    # ------------------------------------------------------------------ setup
    device = seed_everything(cfg)
    generator = torch.Generator(device="cpu").manual_seed(cfg.seed)       # minibatches, bootstrap masks
    data = None if data is None else data.on(device)
    env = training_envs(cfg, data, env, device)
    act_gen = torch.Generator(device=device).manual_seed(cfg.seed + 1)   # action sampling, on the device
    generators = {"generator": generator, "act_generator": act_gen}
    gamma = float(cfg.gamma if cfg.gamma is not None else env.gamma)
    kinds = action_kinds(data, env.n_actions, device)
    batch_size = env.n_envs * cfg.rollout_len
    num_updates = max(1, math.ceil(cfg.total_steps / batch_size))
    agent = Agent(env.n_actions, cfg.encoder_config(), hidden=cfg.hidden, n_critics=cfg.n_critics,
                  seed=cfg.seed).to(device)
    layers = layer_names(agent)
    scale = progress_scale(cfg, data, device)
    kl_ctl = AdaptiveKL(target=cfg.kl_target, beta=cfg.beta0, adaptive=cfg.adaptive_kl)
    state = (resume(Path(resume_from), agent, cfg, kl_ctl, generators, device) if resume_from is not None
             else start_fresh(agent, data, cfg, device=device, gamma=gamma, generator=generator))
    optimizer = make_optimizer(agent, cfg, resume_from, device)
    ro = start_rollouts(env, cfg, agent.encoder.config.dim, device, seed=cfg.seed + 7919 * state.update)
    history: list[dict[str, Any]] = []
    stopped = False

    first_update = state.update + 1
    for update in range(first_update, num_updates + 1):
        t_update = time.time()
        level = state.curriculum.level
        if cfg.anneal_lr:
            optimizer.param_groups[0]["lr"] = (1.0 - (update - 1.0) / num_updates) * cfg.lr
        eps = cfg.epsilon if (cfg.curriculum and level >= 1) else 0.0
        # -------------------------------------------------------------- rollout
        collect_rollout(env, agent, ro, cfg, level=level, epsilon=eps, high_risk=kinds.high_risk,
                        generator=act_gen)
        state.update, state.env_steps = update, state.env_steps + batch_size
        # -------------------------------------------------------------- advantages (GAE), with the L2 UCB bonus
        adv = compute_advantages(agent, ro, cfg, level=level, gamma=gamma)
        # -------------------------------------------------------------- update: policy and value, then β
        train_policy, beta = not (cfg.curriculum and level == 0), kl_ctl.beta
        stats = ppo_update(agent, optimizer, flatten_batch(ro, adv, cfg, generator), cfg, beta,
                           train_policy=train_policy, generator=generator, layers=layers)
        if train_policy:
            kl_ctl.update(stats["kl_last_epoch"])
        # -------------------------------------------------------------- log: metrics, curriculum, L3 review
        measured = update in (first_update, num_updates) or update % cfg.eval_every == 0
        greedy, progress_value = (measure_progress(agent, data, scale, seed=cfg.seed + update, device=device)
                                  if measured else (None, None))
        metrics = log_update(ro, adv, stats, env=env, kinds=kinds, cfg=cfg, level=level, epsilon=eps, beta=beta,
                             beta_next=kl_ctl.beta, greedy=greedy, progress=progress_value, scale=scale,
                             lr=optimizer.param_groups[0]["lr"], policy_trained=train_policy)
        if cfg.curriculum and (reason := state.curriculum.observe(metrics["explained_variance"], progress_value)):
            metrics["level_unlocked"] = f"L{state.curriculum.level}: {reason}"
        metrics["review_items"] = queue_reviews(data, ro, state, cfg, level=level, update=update, recorder=recorder)
        metrics["review_items_total"] = state.review_items
        metrics["seconds"] = seconds = time.time() - t_update
        metrics["env_steps_per_s"] = batch_size / seconds if seconds > 0 else float("nan")
        if update == 1 and state.warm_start:
            metrics["warm_start"] = state.warm_start
        history.append({**metrics, "update": update, "env_steps": state.env_steps})
        # -------------------------------------------------------------- record, checkpoint, stop
        stopped = bool(recorder.on_update(update, state.env_steps, metrics)) if recorder is not None else False
        if progress is not None:
            progress({**metrics, "update": update, "env_steps": state.env_steps, "total_updates": num_updates})
        if recorder is not None and (stopped or update == num_updates or update % cfg.checkpoint_every == 0):
            write_checkpoint(recorder, agent, optimizer, state, kl_ctl.beta, num_updates, generators)
        if stopped:
            break
    return TrainResult(agent=agent, final_metrics=final_metrics(history, state.warm_start), history=history,
                       stopped=stopped, device=device, seconds=time.time() - t_start)


__all__ = ["ActionKinds", "Advantages", "Curriculum", "PPOBatch", "PPOConfig", "ProgressScale", "Recorder",
           "Rollout", "TrainResult", "TrainerState", "TrainingData", "WarmStartSet", "behaviour_action",
           "behaviour_cloning", "collect_rollout", "compute_advantages", "flatten_batch", "log_update", "ppo_update",
           "resolve_device", "train", "warm_start_set"]
