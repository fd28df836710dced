"""Pure helpers of the PPO trainer: GAE, the masked categorical, the adaptive KL controller.

Each is small, has no state beyond its arguments (the KL controller keeps β), and
is tested against a naive reference and a hand-computed case (tests/test_rl_common.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEG_INF = float("-inf")


# --------------------------------------------------------------------------- GAE
def gae(rewards: torch.Tensor, values: torch.Tensor, dones: torch.Tensor, next_value: torch.Tensor,
        next_done: torch.Tensor, gamma: float, gae_lambda: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation over a rollout of shape [T, B].

    ``dones[t]`` is 1 when the observation at step t started a new episode (CleanRL's
    convention), so the bootstrap from t+1 is cut by ``1 - dones[t+1]``.
    Returns ``(advantages, returns)``, both [T, B].

    The recursion runs backwards over T (the rollout length, e.g. 128) with every
    operation vectorised over the B environments; T is small and fixed, B is large.
    """
    T = rewards.shape[0]
    advantages = torch.zeros_like(rewards)
    last = torch.zeros_like(next_value)
    for t in reversed(range(T)):
        if t == T - 1:
            not_done = 1.0 - next_done.float()
            nv = next_value
        else:
            not_done = 1.0 - dones[t + 1].float()
            nv = values[t + 1]
        delta = rewards[t] + gamma * nv * not_done - values[t]
        last = delta + gamma * gae_lambda * not_done * last
        advantages[t] = last
    return advantages, advantages + values


def gae_naive(rewards, values, dones, next_value, next_done, gamma, gae_lambda):
    """Slow per-element reference of :func:`gae` (tests only): sums the discounted TD errors."""
    T, B = rewards.shape
    adv = torch.zeros(T, B, dtype=rewards.dtype)
    for b in range(B):
        for t in range(T):
            total, discount = 0.0, 1.0
            for k in range(t, T):
                if k == T - 1:
                    nd, nv = 1.0 - float(next_done[b]), float(next_value[b])
                else:
                    nd, nv = 1.0 - float(dones[k + 1, b]), float(values[k + 1, b])
                delta = float(rewards[k, b]) + gamma * nv * nd - float(values[k, b])
                total += discount * delta
                discount *= gamma * gae_lambda * nd
                if nd == 0.0:
                    break
            adv[t, b] = total
    return adv, adv + values


# --------------------------------------------------------------------------- masked categorical
class MaskedCategorical:
    """Categorical over the action catalog with forbidden actions at −inf.

    The policy can never sample a masked action: its probability is exactly 0.
    Rows whose mask forbids everything are a caller error (masks keep terminate
    and escalate allowed) and raise."""

    def __init__(self, logits: torch.Tensor, mask: torch.Tensor):
        if mask.dtype != torch.bool:
            mask = mask.bool()
        if not bool(mask.any(dim=-1).all()):
            raise ValueError("a mask row allows no action; masks must keep terminate/escalate")
        self.mask = mask
        self.logits = logits.masked_fill(~mask, NEG_INF)
        self.log_probs_all = torch.log_softmax(self.logits, dim=-1)
        self.probs = self.log_probs_all.exp()

    def sample(self, generator: torch.Generator | None = None) -> torch.Tensor:
        return torch.multinomial(self.probs, 1, generator=generator).squeeze(-1)

    def log_prob(self, actions: torch.Tensor) -> torch.Tensor:
        return self.log_probs_all.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)

    def entropy(self) -> torch.Tensor:
        # 0·(−inf) is NaN: only allowed actions contribute.  The −inf is replaced *before*
        # the product, so the backward pass is finite too (a where() after the product
        # would send 0·(−inf) = NaN gradients into the masked entries).
        logp = torch.where(self.mask, self.log_probs_all, torch.zeros_like(self.log_probs_all))
        return -(self.probs * logp).sum(-1)

    def kl_from(self, old_log_probs_all: torch.Tensor) -> torch.Tensor:
        """KL(old ‖ new) per row, summed over allowed actions (finite gradients, as in
        :meth:`entropy`)."""
        zeros = torch.zeros_like(self.log_probs_all)
        old_logp = torch.where(self.mask, old_log_probs_all, zeros)
        new_logp = torch.where(self.mask, self.log_probs_all, zeros)
        return (old_logp.exp() * self.mask * (old_logp - new_logp)).sum(-1)

    def greedy(self) -> torch.Tensor:
        return self.logits.argmax(-1)


# --------------------------------------------------------------------------- adaptive KL
@dataclass
class AdaptiveKL:
    """β controller of the KL penalty (S000 §3.3).

    After each update with measured KL: KL > 1.5·target → β ×1.5; KL < 0.5·target →
    β ×0.5; otherwise β stays.  ``adaptive=False`` keeps β fixed (the ablation)."""

    target: float = 0.01
    beta: float = 1.0
    up: float = 1.5
    down: float = 0.5
    adaptive: bool = True
    beta_min: float = 1e-4
    beta_max: float = 1e4

    def update(self, kl: float) -> float:
        if self.adaptive:
            if kl > 1.5 * self.target:
                self.beta = min(self.beta * self.up, self.beta_max)
            elif kl < 0.5 * self.target:
                self.beta = max(self.beta * self.down, self.beta_min)
        return self.beta
