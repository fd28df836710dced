"""Masked PPO with an adaptive KL penalty and curriculum exploration (docs/design.md §8, S000 §3.3).

Reads top to bottom like CleanRL's ``ppo.py``: :class:`PPOConfig` (a docstring per
field), the policy (:class:`Agent`: the state encoder of docs/design.md §6, a 2×256 actor over
the action catalog whose masked logits are −inf, an ensemble of critic heads), then
:func:`train` in paper order — rollout over the batched simulator, GAE, the clipped
objective plus an adaptive KL penalty, gradient clipping, metrics.  The pure helpers
(GAE, the masked categorical, the KL controller) live in :mod:`core.rl.common`; the
minibatch optimisation is :func:`ppo_update` so a test can run it on a fixed batch.

The loss of one minibatch::

    loss = policy (clipped surrogate) + vf_coef · value + β · KL(π_old ‖ π) − ent_coef · entropy

and after every update the KL controller moves β: KL > 1.5·target → β·1.5, KL <
0.5·target → β·0.5 (target 0.01, β₀ = 1.0; ``adaptive_kl=False`` keeps β fixed).

Curriculum exploration (levels unlock on measured progress; the level is a metric):

* **L0 exploit** — behaviour cloning on the best logged behaviour (highest mean logged
  return on the training episodes) plus reviewer-approved "reasonable exploration"
  steps, then greedy rollouts that fit only the critic.  Unlocks L1 when the critic
  explains ≥ ``l0_explained_variance`` of the return variance (after at least
  ``l0_min_updates``), or after ``l0_max_updates`` updates — a critic that cannot fit a
  fixed greedy policy will not get better by waiting.
* **L1 ε-exploration** — PPO on actions sampled from the mixture μ = (1 − ε)·π + ε·uniform
  over the unmasked, non-high-risk actions (ε = 0.1).  The surrogate's ratio is
  π_θ(a)/μ(a), the importance weight of the behaviour that really acted: an ε-action with
  a positive advantage still pulls π towards it (through the unclipped branch, weighted by
  π/μ), one with a negative advantage is clipped.  (Treating ε-actions as if π had chosen
  them — ratio 1 — was measured to make the greedy policy worse update after update on
  the finance data: every random action's advantage pushed π as hard as its own.)
  Unlocks L2 when the greedy policy's return on training episodes (measured every
  ``eval_every`` updates) reaches ``l2_progress`` of the way from random-in-mask to the
  best logged behaviour, ``unlock_patience`` measurements in a row.
* **L2 UCB** — adds an optimism bonus ``ucb_coef · std_k V_k(s')`` to each reward: the
  disagreement of the critic heads (trained on bootstrap masks) is high in states the
  policy has rarely reached.  Unlocks L3 at ``l3_progress`` (1.0 = as good as the best
  logged behaviour) for ``unlock_patience`` updates.
* **L3 high-risk review** — ε-exploration may now pick high-risk actions too; whenever an
  environment takes the same high-risk action ``high_risk_repeat`` (3) times in a row,
  the step goes to the human review queue (origin ``training``).

Example::

    >>> data = load_training_data(ws, "finance_risk", dataset="finance", config=cfg)  # doctest: +SKIP
    >>> result = train(PPOConfig(total_steps=100_000), data)                         # doctest: +SKIP
    >>> result.final_metrics["return_mean"]                                          # doctest: +SKIP
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from torch import nn

from core.base.errors import InputError
from core.rl.common import AdaptiveKL, MaskedCategorical, gae
from core.state.features import StateEncoder, StateEncoderConfig, load_encoder, save_encoder

if TYPE_CHECKING:  # pragma: no cover
    from core.guard.review import ReviewRequest
    from core.rl.sim import SimTables
    from core.records.store import Workspace

CHECKPOINT_VERSION = 1


# =========================================================================== config
#: The state encoder a run trains unless its ``encoder`` setting says otherwise: equal
#: weights for intent, tool context and trace (the gated fusion is ``{"gating": "on"}``).
#: Measured on 3,000 generated finance episodes, 1M steps, two seeds each: held-out
#: return on the expert's requests +0.022 / +0.028 over the logged expert with gating off,
#: −0.013 / −0.020 with gating on (the gates fit the training requests, not new ones).
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

    def sim_config(self) -> Any:
        from core.rl.sim import SimConfig

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


# =========================================================================== policy
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
        return self.encoder(obs)

    def heads(self, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.actor(state), self.critic_heads(self.critic(state))

    def architecture(self) -> dict[str, Any]:
        return {"n_actions": self.n_actions, "hidden": self.hidden, "n_critics": self.n_critics,
                "encoder": self.encoder.config_dict()}


def layer_names(agent: nn.Module) -> list[str]:
    """Modules that own parameters directly: the "layers" of the per-layer gradient norms."""
    return [name for name, m in agent.named_modules() if any(True for _ in m.parameters(recurse=False))]


# =========================================================================== data
@dataclass
class TrainingData:
    """What a run trains on: simulator tables, the split, baselines and review feedback."""

    tables: "SimTables"
    train_episodes: torch.Tensor
    heldout_episodes: torch.Tensor
    #: Mean logged template return per behaviour, on the training episodes.
    logged_returns: dict[str, float]
    #: Reviewer-approved steps (core.guard.review.approved_examples) to imitate at L0.
    approved: list[dict[str, Any]] = field(default_factory=list)
    dataset: str | None = None
    source: str = ""

    @property
    def best_behaviour(self) -> str:
        return max(self.logged_returns, key=lambda b: self.logged_returns[b])


def masks_for_domain(domain: str | None) -> Path | None:
    """The committed mask rules of a domain (``datasets/<domain>/masks.yaml``), if any."""
    from core.data.datasets import datasets_dir

    if not domain:
        return None
    path = datasets_dir() / str(domain) / "masks.yaml"
    return path if path.is_file() else None


def domain_masks(ws: "Workspace", dataset: str) -> Path | None:
    """The committed mask rules of a dataset's domain (``datasets/<domain>/masks.yaml``), if any."""
    row = ws.conn.execute("SELECT domain FROM datasets WHERE name=?", (dataset,)).fetchone()
    return masks_for_domain(row[0] if row else None)


#: ``masks=DOMAIN_MASKS``: the committed rules of the data's domain (the default).
DOMAIN_MASKS = "domain"


def load_training_data(ws: "Workspace", template: Any, *, dataset: str | None = None,
                       episodes_file: str | Path | None = None, masks: Any = DOMAIN_MASKS,
                       config: PPOConfig | None = None) -> TrainingData:
    """Simulator tables of a dataset (or episodes file) under ``template`` and ``masks``
    (rules, a YAML file or text, None for no rules, or by default the committed rules of the
    data's domain, ``datasets/<domain>/masks.yaml``), always joined by the workspace's review
    rules; the train / held-out split; logged returns; approved review examples."""
    from core.guard.masking import MaskRules
    from core.guard.review import approved_examples, with_review_rules
    from core.rl.sim import build_sim_tables, build_sim_tables_from, logged_returns, split_episodes

    cfg = config or PPOConfig()
    if (dataset is None) == (episodes_file is None):
        raise InputError("give exactly one of a dataset (--dataset NAME) or an episodes file (--episodes FILE)")
    parsed = None
    if episodes_file is not None:
        from core.data.importers import read_file

        parsed = read_file(episodes_file)
        if not parsed.episodes:
            raise InputError("the episodes file holds no episodes", file=str(episodes_file))
    if isinstance(masks, str) and masks == DOMAIN_MASKS:
        masks = (domain_masks(ws, dataset) if dataset is not None
                 else masks_for_domain(parsed.episodes[0].domain))  # type: ignore[union-attr]
    rules = masks if isinstance(masks, MaskRules) or masks is None else MaskRules.from_yaml(masks)
    if dataset is not None:
        tables = build_sim_tables(ws, dataset, template, masks=rules, config=cfg.sim_config())
        source = f"dataset {dataset}"
    else:
        from core.base.embed import workspace_embedder

        rules = with_review_rules(rules or MaskRules(), ws, None)
        tables = build_sim_tables_from(parsed.episodes, parsed.tools, template, masks=rules,
                                       config=cfg.sim_config(), embedder=workspace_embedder(ws))
        source = f"file {episodes_file}"
    train_idx, held_idx = split_episodes(tables, cfg.heldout_fraction, cfg.seed, by=cfg.heldout_by)
    return TrainingData(tables=tables, train_episodes=train_idx, heldout_episodes=held_idx,
                        logged_returns=logged_returns(tables, train_idx),
                        approved=approved_examples(ws, dataset), dataset=dataset, source=source)


# =========================================================================== helpers
def explained_variance(y_pred: torch.Tensor, y_true: torch.Tensor) -> float:
    """1 − Var(y − ŷ)/Var(y) (NaN when y is constant)."""
    var_y = float(y_true.var())
    return float("nan") if var_y == 0 else 1.0 - float((y_true - y_pred).var()) / var_y


def token_groups(tables: "SimTables") -> tuple[list[str], torch.Tensor]:
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


def act(agent: Agent, obs: Mapping[str, torch.Tensor], mask: torch.Tensor, *, greedy: bool = True,
        generator: torch.Generator | None = None) -> torch.Tensor:
    """Actions of the policy for a batch of states (greedy or sampled), never a masked one."""
    with torch.no_grad():
        logits, _ = agent.heads(agent.state(obs))
        dist = MaskedCategorical(logits, mask)
        return dist.greedy() if greedy else dist.sample(generator)


class Curriculum:
    """Level and unlock bookkeeping of the curriculum (the rules in the module docstring)."""

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
def warm_start_set(data: TrainingData, *, device: str | torch.device, seed: int, gamma: float
                   ) -> dict[str, Any]:
    """The behaviour-cloning set: every step of the best behaviour's training episodes and
    every approved review step, as the simulator shows them when it follows the log.

    One environment per episode (or approved step) starts on it and replays its logged
    tokens — batched over environments, one loop over the (≤ step cap) steps.  A step
    whose logged call is INVALID, or masked in that state, cannot be imitated: its
    environment stops collecting there.  Monte-Carlo returns of the followed logs seed the
    critic.  Returns ``obs`` (dict of [N, …]), ``mask`` [N, A], ``action`` [N], ``returns``
    [N], ``n_logged``, ``n_approved``, ``approved_skipped``."""
    from core.rl.sim import BatchedSim

    tb = data.tables
    best = data.best_behaviour
    train = data.train_episodes.cpu().tolist()
    starts = [e for e in train if (tb.behaviours[e] or "unknown") == best]
    index = {eid: i for i, eid in enumerate(tb.episode_ids)}
    ex_eps, ex_t, ex_token, skipped = [], [], [], 0
    for ex in data.approved:
        e = index.get(str(ex.get("episode_id")))
        if e is None or ex.get("step_t") is None or not 0 <= int(ex["token_id"]) < tb.n_actions:
            skipped += 1
            continue
        ex_eps.append(e)
        ex_t.append(int(ex["step_t"]))
        ex_token.append(int(ex["token_id"]))
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
    return {
        "obs": {k: cat([s["obs"][k] for s in steps]) for k in steps[0]["obs"]},
        "mask": cat([s["mask"] for s in steps]), "action": cat([s["label"] for s in steps]),
        "returns": cat(returns), "n_logged": int(rec[:, :n_log].sum()), "n_approved": int(rec[:, n_log:].sum()),
        "approved_skipped": skipped + (len(ex_eps) - int(rec[:, n_log:].sum())), "behaviour": best,
        "episodes": n_log,
    }


def behaviour_cloning(agent: Agent, bc: Mapping[str, Any], cfg: PPOConfig, generator: torch.Generator
                      ) -> dict[str, float]:
    """Fit the actor to the warm-start labels (masked cross-entropy) and the critic to the
    logged Monte-Carlo returns; returns the final accuracy and losses."""
    n = int(bc["action"].shape[0])
    if n == 0:
        return {"bc_samples": 0.0, "bc_accuracy": float("nan"), "bc_loss": float("nan")}
    opt = torch.optim.Adam([p for p in agent.parameters() if p.requires_grad], lr=cfg.bc_lr)
    # at least ~8 steps per pass, so a small warm-start set is not fitted in a handful of steps
    mb = max(1, min(256, max(32, n // 8), n))
    epochs = max(int(cfg.bc_epochs), math.ceil(int(cfg.bc_min_steps) / math.ceil(n / mb)))
    # The critic regresses the logged returns through the shared encoder: on the finance
    # data that extra signal shapes the state faster than imitation alone (measured:
    # 0.99 vs 0.69 training accuracy after 40 passes).
    for _ in range(epochs):
        perm = torch.randperm(n, generator=generator).to(bc["action"].device)
        for start in range(0, n, mb):
            idx = perm[start:start + mb]
            logits, values = agent.heads(agent.state({k: v[idx] for k, v in bc["obs"].items()}))
            dist = MaskedCategorical(logits, bc["mask"][idx])
            ce = -dist.log_prob(bc["action"][idx]).mean()
            v_loss = 0.5 * ((values - bc["returns"][idx, None]) ** 2).mean()
            opt.zero_grad()
            (ce + cfg.vf_coef * v_loss).backward()
            nn.utils.clip_grad_norm_(agent.parameters(), 1.0)
            opt.step()
    with torch.no_grad():
        logits, values = agent.heads(agent.state(bc["obs"]))
        dist = MaskedCategorical(logits, bc["mask"])
        acc = float((dist.greedy() == bc["action"]).float().mean())
        loss = float(-dist.log_prob(bc["action"]).mean())
    return {"bc_samples": float(n), "bc_accuracy": acc, "bc_loss": loss}


# =========================================================================== the update
def ppo_update(agent: Agent, optimizer: torch.optim.Optimizer, batch: Mapping[str, Any], cfg: PPOConfig,
               beta: float, *, train_policy: bool = True, generator: torch.Generator | None = None,
               layers: Sequence[str] | None = None) -> dict[str, Any]:
    """Optimise the clipped surrogate + value + β·KL − entropy loss over one batch.

    ``batch``: ``obs`` (dict of [N, …]) or ``state`` [N, D] (a fixed encoder), ``mask``
    [N, A], ``actions``, ``logprobs`` (of the behaviour that chose them), ``old_logp_all``
    [N, A] (π_old, for the KL), ``advantages``, ``returns``, ``boot`` [N, K] (critic
    bootstrap masks).  ``train_policy=False`` (L0) fits only the critic heads.
    Returns the mean KL of the last epoch (what the β controller reads), clip fraction,
    losses, entropy and per-layer gradient norms (mean over minibatches)."""
    N = int(batch["actions"].shape[0])
    mb_size = N // cfg.n_minibatches
    device = batch["actions"].device
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
            if "state" in batch:
                state = batch["state"][mb]
            elif train_policy:
                state = agent.state({k: v[mb] for k, v in batch["obs"].items()})
            else:  # L0: the encoder (and the actor reading it) stay as behaviour cloning left them
                with torch.no_grad():
                    state = agent.state({k: v[mb] for k, v in batch["obs"].items()})
            logits, values = agent.heads(state)
            dist = MaskedCategorical(logits, batch["mask"][mb])
            newlogprob = dist.log_prob(batch["actions"][mb])
            logratio = newlogprob - batch["logprobs"][mb]
            ratio = logratio.exp()
            kl = dist.kl_from(batch["old_logp_all"][mb]).mean()
            clipfrac = ((ratio - 1.0).abs() > cfg.clip_coef).float().mean()

            mb_adv = batch["advantages"][mb]
            if cfg.norm_adv:
                mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std() + 1e-8)
            # Policy loss: the clipped surrogate
            pg_loss = torch.max(-mb_adv * ratio,
                                -mb_adv * torch.clamp(ratio, 1 - cfg.clip_coef, 1 + cfg.clip_coef)).mean()
            # Value loss: every critic head on its bootstrap share of the minibatch
            boot = batch["boot"][mb]
            v_loss = 0.5 * (((values - batch["returns"][mb, None]) ** 2) * boot).sum() / boot.sum().clamp_min(1.0)
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
    out = {k: float(v) / n_steps for k, v in stats.items()}
    out["kl_last_epoch"] = float(last_kl) / per_mb
    # Layers that took part in this update (L0 leaves the encoder and the actor out); a
    # trained layer whose norm is ~0 is what the gradient-flow diagnosis looks for.
    norms = (grad_sq / n_steps).sqrt().cpu().tolist()
    took_part = touched.cpu().tolist()
    out["grad_norms"] = {n: g for n, g, t in zip(names, norms, took_part) if t}
    return out


# =========================================================================== checkpoints
def save_checkpoint(folder: Path, agent: Agent, optimizer: torch.optim.Optimizer, trainer: Mapping[str, Any],
                    generators: Mapping[str, torch.Generator]) -> Path:
    """Write a checkpoint folder atomically: ``agent.safetensors`` + ``agent.json`` (actor and
    critics), ``encoder.safetensors`` + ``encoder.json``, ``optimizer.safetensors`` +
    ``optimizer.json`` (Adam moments as tensors, the rest as JSON), ``trainer.json``
    (update, env steps, β, curriculum …) and ``rng.safetensors``.  No pickle."""
    from safetensors.torch import save_file

    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    policy = {k: v.detach().cpu().contiguous() for k, v in agent.state_dict().items()
              if not k.startswith("encoder.")}
    save_file(policy, str(tmp / "agent.safetensors"))
    (tmp / "agent.json").write_text(json.dumps({"version": CHECKPOINT_VERSION, **agent.architecture()}, indent=2))
    save_encoder(agent.encoder, tmp, "encoder")
    opt_state = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for pid, st in opt_state["state"].items():
        for key, val in st.items():
            if isinstance(val, torch.Tensor):
                tensors[f"{pid}.{key}"] = val.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(pid), {})[key] = val
    save_file(tensors, str(tmp / "optimizer.safetensors"))
    (tmp / "optimizer.json").write_text(json.dumps({"param_groups": opt_state["param_groups"],
                                                    "scalars": scalars}, indent=2))
    save_file({**{k: g.get_state().cpu() for k, g in generators.items()}, "torch_cpu": torch.get_rng_state()},
              str(tmp / "rng.safetensors"))
    (tmp / "trainer.json").write_text(json.dumps(dict(trainer), indent=2, default=float))
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)
    return folder


def load_agent(folder: str | Path, device: str | torch.device = "cpu") -> Agent:
    """The agent (encoder, actor, critics) of a checkpoint folder."""
    from safetensors.torch import load_file

    folder = Path(folder)
    meta_path = folder / "agent.json"
    if not meta_path.is_file():
        raise InputError(f"no checkpoint in {folder} (agent.json missing)", file=str(folder))
    meta = json.loads(meta_path.read_text())
    encoder = load_encoder(folder, "encoder", device="cpu")
    agent = Agent(int(meta["n_actions"]), encoder.config, hidden=int(meta["hidden"]),
                  n_critics=int(meta["n_critics"]))
    agent.encoder.load_state_dict(encoder.state_dict())
    missing, unexpected = agent.load_state_dict(load_file(str(folder / "agent.safetensors")), strict=False)
    missing = [k for k in missing if not k.startswith("encoder.")]
    if missing or unexpected:
        raise InputError(f"checkpoint {folder} does not fit the policy (missing {missing}, unexpected "
                         f"{unexpected})", file=str(folder))
    return agent.to(device)


def load_optimizer_state(folder: Path, optimizer: torch.optim.Optimizer, device: str | torch.device) -> None:
    """Restore the optimizer state :func:`save_checkpoint` wrote."""
    from safetensors.torch import load_file

    meta = json.loads((folder / "optimizer.json").read_text())
    tensors = load_file(str(folder / "optimizer.safetensors"), device=str(device))
    state: dict[int, dict[str, Any]] = {}
    for key, val in tensors.items():
        pid, name = key.split(".", 1)
        # Adam keeps `step` on the CPU unless capturable/fused
        state.setdefault(int(pid), {})[name] = val.cpu() if name == "step" else val
    for pid, sc in meta["scalars"].items():
        state.setdefault(int(pid), {}).update(sc)
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


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
    from core.guard.review import ReviewRequest

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


def train(cfg: PPOConfig, data: TrainingData, *, recorder: Recorder | None = None,
          resume_from: Path | None = None, progress: Callable[[dict[str, Any]], None] | None = None
          ) -> TrainResult:
    """Train a masked PPO policy on ``data`` (see the module docstring for the algorithm).

    ``recorder`` receives each update's metrics (and may ask to stop), checkpoints and L3
    review items; ``resume_from`` continues from a checkpoint folder."""
    from core.rl.sim import BatchedSim, random_masked_actions

    cfg.validate()
    t_start = time.time()
    # ------------------------------------------------------------------ seeding & device
    device = resolve_device(cfg.device)
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed % 2**32)
    generator = torch.Generator(device="cpu").manual_seed(cfg.seed)       # minibatches, bootstrap masks
    tb = data.tables.to(device)
    data = TrainingData(**{**data.__dict__, "tables": tb})
    gamma = float(cfg.gamma if cfg.gamma is not None else tb.gamma)

    # ------------------------------------------------------------------ environment
    sim = BatchedSim(tb, cfg.n_envs, device=device, seed=cfg.seed, episodes=data.train_episodes,
                     reuse_obs_buffers=True)    # the rollout copies what it keeps
    act_gen = torch.Generator(device=device).manual_seed(cfg.seed + 1)   # action sampling, on the device
    A, B, T = tb.n_actions, cfg.n_envs, cfg.rollout_len
    high_risk = torch.tensor([t.risk == "high" for t in tb.catalog.tokens], dtype=torch.bool, device=device)
    groups, group_of = token_groups(tb)
    group_of = group_of.to(device)
    batch_size = B * T
    num_updates = max(1, math.ceil(cfg.total_steps / batch_size))

    # ------------------------------------------------------------------ agent & optimizer
    agent = Agent(A, cfg.encoder_config(), hidden=cfg.hidden, n_critics=cfg.n_critics, seed=cfg.seed).to(device)
    layers = layer_names(agent)

    # ------------------------------------------------------------------ baselines for progress
    # Random-in-mask return on the training episodes: progress 0; the best logged behaviour: 1.
    best_logged = data.logged_returns[data.best_behaviour]
    random_return = mean_return(tb, None, data.train_episodes, n_envs=min(512, 4 * B), device=device,
                                seed=cfg.seed + 1, min_episodes=512, support_episodes=None)
    pick = torch.randperm(int(data.train_episodes.numel()), generator=torch.Generator().manual_seed(cfg.seed))
    eval_starts = data.train_episodes.cpu()[pick[:cfg.eval_episodes]]

    kl_ctl = AdaptiveKL(target=cfg.kl_target, beta=cfg.beta0, adaptive=cfg.adaptive_kl)
    curriculum = Curriculum(cfg, level=0 if cfg.curriculum else 1)
    start_update, env_steps, review_count = 0, 0, 0
    warm: dict[str, Any] = {}
    history: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ resume, or warm start (L0)
    if resume_from is not None:
        loaded = load_agent(resume_from, device)
        agent.load_state_dict(loaded.state_dict())
        trainer = json.loads((Path(resume_from) / "trainer.json").read_text())
        start_update, env_steps = int(trainer["update"]), int(trainer["env_steps"])
        review_count = int(trainer.get("review_items", 0))
        kl_ctl.beta = float(trainer["beta"])
        curriculum = Curriculum(cfg, **trainer["curriculum"])
        warm = trainer.get("warm_start", {})
        from safetensors.torch import load_file

        rng = load_file(str(Path(resume_from) / "rng.safetensors"))
        generator.set_state(rng["generator"])
        act_gen.set_state(rng["act_generator"].to(act_gen.get_state().device))
        torch.set_rng_state(rng["torch_cpu"])
        sim.seed(cfg.seed + 7919 * start_update)
    elif cfg.curriculum:
        bc = warm_start_set(data, device=device, seed=cfg.seed, gamma=gamma)
        warm = {"behaviour": bc["behaviour"], "episodes": bc["episodes"], "bc_logged_steps": bc["n_logged"],
                "bc_approved_steps": bc["n_approved"], "approved_skipped": bc["approved_skipped"]}
        warm.update(behaviour_cloning(agent, bc, cfg, generator))
    if not cfg.train_encoder:
        agent.encoder.requires_grad_(False)
    optimizer = torch.optim.Adam([p for p in agent.parameters() if p.requires_grad], lr=cfg.lr, eps=1e-5)
    if resume_from is not None:
        load_optimizer_state(Path(resume_from), optimizer, device)

    # ------------------------------------------------------------------ rollout storage
    next_obs, next_mask = sim.reset()
    obs_buf = {k: torch.zeros((T, B, *v.shape[1:]), dtype=v.dtype, device=device)
               for k, v in next_obs.items()} if cfg.train_encoder else {}
    state_buf = torch.zeros((T, B, agent.encoder.config.dim), device=device)
    masks = torch.zeros((T, B, A), dtype=torch.bool, device=device)
    actions = torch.zeros((T, B), dtype=torch.int64, device=device)
    logprobs = torch.zeros((T, B), device=device)
    old_logp_all = torch.zeros((T, B, A), device=device)
    rewards = torch.zeros((T, B), device=device)
    dones = torch.zeros((T, B), device=device)
    values = torch.zeros((T, B, cfg.n_critics), device=device)
    pointers = torch.zeros((T, B), dtype=torch.int64, device=device)
    flags = torch.zeros((T, B), dtype=torch.bool, device=device)
    ep_return = torch.full((T, B), float("nan"), device=device)
    ep_success = torch.full((T, B), float("nan"), device=device)
    components = torch.zeros((T, B, tb.n_components), device=device)
    off_support = torch.zeros((T, B), dtype=torch.bool, device=device)
    violations = torch.zeros((T, B), dtype=torch.bool, device=device)
    next_done = torch.zeros(B, device=device)
    last_action = torch.full((B,), -1, dtype=torch.int64, device=device)
    streak = torch.zeros(B, dtype=torch.int64, device=device)
    stopped = False

    for update in range(start_update + 1, num_updates + 1):
        t_update = time.time()
        level = curriculum.level
        if cfg.anneal_lr:
            frac = 1.0 - (update - 1.0) / num_updates
            optimizer.param_groups[0]["lr"] = frac * cfg.lr
        eps = cfg.epsilon if (cfg.curriculum and level >= 1) else 0.0

        # -------------------------------------------------------------- rollout
        for step in range(T):
            if cfg.train_encoder:
                for k in obs_buf:
                    obs_buf[k][step] = next_obs[k]
            masks[step] = next_mask
            dones[step] = next_done
            pointers[step] = sim.pointer
            with torch.no_grad():
                state = agent.state(next_obs)
                logits, value = agent.heads(state)
                dist = MaskedCategorical(logits, next_mask)
            state_buf[step] = state
            values[step] = value
            old_logp_all[step] = dist.log_probs_all
            if cfg.curriculum and level == 0:
                action = dist.greedy()
                behaviour_logp = dist.log_prob(action)
            else:
                action = dist.sample(act_gen)
                if eps > 0:
                    # ε: uniform among the unmasked actions (high-risk ones only at L3)
                    explore = next_mask & ~high_risk if level < 3 else next_mask
                    explore = torch.where(explore.any(1, keepdim=True), explore, next_mask)
                    rand_action = random_masked_actions(explore, act_gen)
                    use_rand = torch.rand(B, device=device, generator=act_gen) < eps
                    action = torch.where(use_rand, rand_action, action)
                    # μ(a) = (1 − ε)·π(a) + ε·[a explorable]/n_explorable: the behaviour's probability
                    uniform = explore.gather(1, action[:, None]).squeeze(1) / explore.sum(1).clamp_min(1)
                    behaviour_logp = torch.log((1 - eps) * dist.log_prob(action).exp() + eps * uniform)
                else:
                    behaviour_logp = dist.log_prob(action)
            actions[step] = action
            logprobs[step] = behaviour_logp

            # L3 watch: the same high-risk action again and again in one episode
            same = (action == last_action) & high_risk[action]
            streak = torch.where(same, streak + 1, high_risk[action].long())
            flags[step] = streak == cfg.high_risk_repeat

            out = sim.step(action)
            rewards[step] = out.reward
            done = out.terminated | out.truncated
            next_obs, next_mask, next_done = out.obs, out.mask, done.float()
            ep_return[step] = out.info["episode_return"]
            ep_success[step] = out.info["success"]
            components[step] = out.info["components"]
            off_support[step] = out.info["off_support"]
            violations[step] = out.info["mask_violation"] | ~masks[step].gather(1, action[:, None]).squeeze(1)
            last_action = torch.where(done, torch.full_like(action, -1), action)
            streak = torch.where(done, torch.zeros_like(streak), streak)
        env_steps += batch_size

        # -------------------------------------------------------------- advantages (GAE), with the L2 UCB bonus
        with torch.no_grad():
            next_value_heads = agent.heads(agent.state(next_obs))[1]
        sigma = values.std(dim=-1) if cfg.n_critics > 1 else torch.zeros_like(rewards)
        bonus = torch.zeros_like(rewards)
        if cfg.curriculum and level >= 2 and cfg.ucb_coef > 0:
            next_sigma = next_value_heads.std(dim=-1) if cfg.n_critics > 1 else torch.zeros_like(next_done)
            sigma_next = torch.cat([sigma[1:], next_sigma[None]], dim=0)
            alive_next = 1.0 - torch.cat([dones[1:], next_done[None]], dim=0)
            bonus = cfg.ucb_coef * sigma_next * alive_next
        advantages, returns = gae(rewards + bonus, values.mean(-1), dones, next_value_heads.mean(-1), next_done,
                                  gamma, cfg.gae_lambda)

        # -------------------------------------------------------------- flatten the batch
        b = {
            "mask": masks.reshape(batch_size, A), "actions": actions.reshape(-1), "logprobs": logprobs.reshape(-1),
            "old_logp_all": old_logp_all.reshape(batch_size, A), "advantages": advantages.reshape(-1),
            "returns": returns.reshape(-1),
            "boot": (torch.rand((batch_size, cfg.n_critics), generator=generator).to(device)
                     < cfg.critic_bootstrap).float(),
        }
        if cfg.train_encoder:
            b["obs"] = {k: v.reshape(batch_size, *v.shape[2:]) for k, v in obs_buf.items()}
        else:
            b["state"] = state_buf.reshape(batch_size, -1)

        # -------------------------------------------------------------- optimise policy and value
        train_policy = not (cfg.curriculum and level == 0)
        beta_used = kl_ctl.beta
        stats = ppo_update(agent, optimizer, b, cfg, beta_used, train_policy=train_policy, generator=generator,
                           layers=layers)

        # -------------------------------------------------------------- KL controller: move β
        if train_policy:
            kl_ctl.update(stats["kl_last_epoch"])

        # -------------------------------------------------------------- metrics
        with torch.no_grad():
            probs = old_logp_all.exp()
            mass = probs.reshape(batch_size, A).mean(0)
            per_tool = group_entropy(mass, group_of, len(groups))
            finished = ~torch.isnan(ep_return)
            n_finished = int(finished.sum())
            comp_means = components.reshape(batch_size, -1).mean(0).cpu().tolist()
            y_pred = values.mean(-1).reshape(-1)
        ret_mean = float(ep_return[finished].mean()) if n_finished else float("nan")
        ev = explained_variance(y_pred, returns.reshape(-1))
        # Progress: the greedy policy on a fixed sample of training episodes, on the scale
        # 0 = random-in-mask, 1 = the best logged behaviour (rollout returns carry ε-noise).
        progress_value, greedy = None, None
        if update == start_update + 1 or update % cfg.eval_every == 0 or update == num_updates:
            greedy = episode_stats(tb, agent, eval_starts, every_episode=True, device=device,
                                   seed=cfg.seed + update, support_episodes=data.train_episodes)
            if best_logged - random_return > 1e-9:
                progress_value = (greedy["return_mean"] - random_return) / (best_logged - random_return)
        metrics: dict[str, Any] = {
            "return_mean": ret_mean,
            "success_rate": float(ep_success[finished].mean()) if n_finished else float("nan"),
            "episodes": n_finished,
            "reward_mean": float(rewards.mean()),
            "reward_components": dict(zip(tb.component_names, comp_means)),
            "kl": stats["kl_last_epoch"], "kl_mean": stats["kl"], "beta": beta_used, "beta_next": kl_ctl.beta,
            "clip_fraction": stats["clipfrac"], "value_loss": stats["v_loss"], "policy_loss": stats["pg_loss"],
            "entropy": stats["entropy"], "entropy_marginal": float(-(mass * mass.clamp_min(1e-30).log()).sum()),
            "entropy_per_tool": dict(zip(groups, per_tool.cpu().tolist())),
            "grad_norm": stats["grad_norm"], "grad_norms": stats["grad_norms"],
            "explained_variance": ev,
            "off_support_rate": float(off_support.float().mean()),
            "mask_violations": int(violations.sum()),
            "curriculum_level": level if cfg.curriculum else None, "epsilon": eps, "ucb_bonus": float(bonus.mean()),
            "critic_std": float(sigma.mean()),
            "eval_return": None if greedy is None else greedy["return_mean"],
            "eval_success_rate": None if greedy is None else greedy["success_rate"],
            "eval_off_support_rate": None if greedy is None else greedy["off_support_rate"],
            "progress": progress_value, "random_return": random_return, "best_logged_return": best_logged,
            "high_risk_repeats": int(flags.sum()),
            "lr": optimizer.param_groups[0]["lr"], "policy_trained": train_policy,
        }

        # -------------------------------------------------------------- curriculum: unlock on measured progress
        if cfg.curriculum:
            reason = curriculum.observe(ev, progress_value)
            if reason:
                metrics["level_unlocked"] = f"L{curriculum.level}: {reason}"

        # -------------------------------------------------------------- L3: high-risk repeats → review queue
        new_items = 0
        if cfg.curriculum and level >= 3 and bool(flags.any()) and review_count < cfg.max_review_items:
            reqs = _review_requests(data, flags, actions, pointers, probs.gather(2, actions[..., None]).squeeze(2),
                                    components, getattr(recorder, "run_id", None), update,
                                    cfg.max_review_items - review_count, cfg.high_risk_repeat)
            new_items = recorder.on_review(reqs) if recorder is not None else len(reqs)
            review_count += len(reqs)
        metrics["review_items"] = new_items
        metrics["review_items_total"] = review_count
        seconds = time.time() - t_update
        metrics["seconds"] = seconds
        metrics["env_steps_per_s"] = batch_size / seconds if seconds > 0 else float("nan")
        if update == 1 and warm:
            metrics["warm_start"] = warm
        history.append({**metrics, "update": update, "env_steps": env_steps})

        # -------------------------------------------------------------- record, checkpoint, stop
        stop = recorder.on_update(update, env_steps, metrics) if recorder is not None else False
        if progress is not None:
            progress({**metrics, "update": update, "env_steps": env_steps, "total_updates": num_updates})
        last = update == num_updates
        if recorder is not None and (stop or last or update % cfg.checkpoint_every == 0):
            trainer_state = {"update": update, "env_steps": env_steps, "beta": kl_ctl.beta,
                             "curriculum": curriculum.state_dict(), "review_items": review_count,
                             "warm_start": warm, "num_updates": num_updates, "version": CHECKPOINT_VERSION}
            path = save_checkpoint(recorder.checkpoint_dir(update), agent, optimizer, trainer_state,
                                   {"generator": generator, "act_generator": act_gen})
            recorder.on_checkpoint(update, env_steps, path)
        if stop:
            stopped = True
            break

    final = dict(history[-1]) if history else {}
    final["warm_start"] = warm
    kls = [h["kl"] for h in history if h.get("policy_trained")]
    final["kl_std"] = float(np.std(kls)) if len(kls) > 1 else None
    return TrainResult(agent=agent, final_metrics=final, history=history, stopped=stopped, device=device,
                       seconds=time.time() - t_start)


# =========================================================================== rollouts for evaluation
def mean_return(tables: "SimTables", agent: Agent | None, episodes: torch.Tensor, *, n_envs: int = 256,
                device: str | torch.device = "cpu", seed: int = 0, min_episodes: int = 256,
                greedy: bool = True, max_steps: int | None = None, support_episodes: Any = "all") -> float:
    """Mean template return of episodes started from ``episodes``: by ``agent`` (greedy or
    sampled) or, with ``agent=None``, uniformly at random among the unmasked actions."""
    stats = episode_stats(tables, agent, episodes, n_envs=n_envs, device=device, seed=seed,
                          min_episodes=min_episodes, greedy=greedy, max_steps=max_steps,
                          support_episodes=support_episodes)
    return stats["return_mean"]


def episode_stats(tables: "SimTables", agent: Agent | None, episodes: torch.Tensor, *, n_envs: int = 256,
                  device: str | torch.device = "cpu", seed: int = 0, min_episodes: int = 256,
                  greedy: bool = True, max_steps: int | None = None, every_episode: bool = False,
                  support_episodes: Any = "all") -> dict[str, Any]:
    """Run a policy (or random-in-mask) in the simulator and summarise finished episodes:
    ``return_mean``, ``success_rate``, ``off_support_rate``, ``mask_violations``,
    ``episodes``, ``steps``, the step ``rewards`` (numpy) and ``probs`` of the visited states.

    ``support_episodes``: where counterfactual outcomes are drawn from — by default every
    recorded step of the tables (the simulator's whole world: a held-out evaluation holds
    out the *tasks* it starts from, not the recorded outcomes); the episodes to start from
    (``None``) or other indices as in :class:`core.rl.sim.BatchedSim`.

    ``every_episode=True`` starts one environment on each of ``episodes`` and counts each
    one's first episode exactly once (a full pass over a held-out set)."""
    from core.rl.sim import BatchedSim, random_masked_actions

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
    return {
        "return_mean": float(r.mean()) if r.numel() else float("nan"),
        "return_std": float(r.std()) if r.numel() > 1 else float("nan"),
        "success_rate": float(s.mean()) if s.numel() else float("nan"),
        "off_support_rate": off / steps if steps else float("nan"),
        "mask_violations": viol, "episodes": int(r.numel()), "steps": steps,
        "rewards": torch.cat(rewards_all).cpu().numpy() if rewards_all else np.zeros(0),
        "probs": torch.cat(probs_all).cpu().numpy() if probs_all else None,
    }


__all__ = ["Agent", "Curriculum", "PPOConfig", "TrainResult", "TrainingData", "act", "behaviour_cloning",
           "episode_stats", "load_agent", "load_training_data", "mean_return", "ppo_update", "resolve_device",
           "save_checkpoint", "train", "warm_start_set"]
