"""The served policy's forward pass in numpy, split where serving can share work.

:class:`NumpyPolicy` computes the branches RL-Boost's rows share once (the intent branch once
per episode, the next context once per request) and runs only the trace branch and the critic
per candidate, with the trace and context branches' first layers folded (:class:`_TraceBranch`,
``_Branch.sparse``).  :func:`numpy_policy` builds it only for the architecture it knows and
returns it only when it reproduces the module on the bundle's smoke states; otherwise serving
runs the module itself.

Details: docs/serving.md (## The numpy policy).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from scipy.special import erf

from core.state.features import O_FLAGS, PAD_TOKEN, TRACE_LEN, URGENCY_HIGH_INDEX, URGENCY_INDEX, Z_CLIP
from core.rl.agent import Agent

#: Agreement with the torch module required on the smoke states (float32 sums in another order).
TOLERANCE = 1e-4
_SQRT_HALF = np.float32(1.0 / math.sqrt(2.0))


class _Branch:
    """Linear → GELU (exact) → Linear → LayerNorm, as :func:`core.state.features._branch`."""

    def __init__(self, module: Any):
        lin1, _, lin2, norm = module
        self.w1, self.b1 = _linear(lin1)
        self.w2, self.b2 = _linear(lin2)
        self.gamma, self.beta = _array(norm.weight), _array(norm.bias)
        self.eps = np.float32(norm.eps)
        self.inv_dim = np.float32(1.0 / len(self.gamma))

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.rest(x @ self.w1 + self.b1)

    def sparse(self, x: np.ndarray) -> np.ndarray:
        """The branch on rows that are mostly zeros: the first layer reads only the weight
        rows of the columns some row sets (a zero column adds nothing to the product)."""
        cols = np.flatnonzero(np.logical_or.reduce(x != 0, axis=0))
        return self.rest(x[:, cols] @ self.w1[cols] + self.b1)

    def rest(self, h: np.ndarray) -> np.ndarray:
        """GELU → second layer → LayerNorm of the first layer's output ``h``."""
        # ufuncs and their reductions directly: serving runs this on a row or a few, where
        # the Python wrappers of mean/clip would cost more than the arithmetic
        h = (0.5 * h * (1.0 + erf(h * _SQRT_HALF))) @ self.w2 + self.b2
        h -= np.add.reduce(h, axis=-1, keepdims=True) * self.inv_dim
        var = np.add.reduce(h * h, axis=-1, keepdims=True) * self.inv_dim
        return h / np.sqrt(var + self.eps) * self.gamma + self.beta


class _TraceBranch(_Branch):
    """The trace branch, its first layer folded with the action embedding.

    The module's input per step ``l`` is ``[embed(token_l), clip(reward_l), dt_l]``, laid
    out step after step; its first layer is therefore the sum over steps of
    ``embed(token_l) @ W_l`` (a table ``[L, tokens, dim]`` computed once here) plus the two
    numbers times their weight rows ``[L, dim]`` each."""

    def __init__(self, module: Any, action_embed: np.ndarray, trace_len: int):
        super().__init__(module)
        width = action_embed.shape[1]
        w = self.w1.reshape(trace_len, width + 2, -1)
        self.table = np.ascontiguousarray(np.einsum("te,led->ltd", action_embed, w[:, :width]), dtype=np.float32)
        self.w_reward = np.ascontiguousarray(w[:, width])
        self.w_dt = np.ascontiguousarray(w[:, width + 1])
        self.steps = np.arange(trace_len)

    def trace(self, tokens: np.ndarray, reward: np.ndarray, dt: np.ndarray) -> np.ndarray:
        """``[N, dim]`` of ``tokens`` (embedding rows, already shifted and clipped),
        ``reward`` (clipped) and ``dt``, each ``[N, L]``."""
        h = np.add.reduce(self.table[self.steps, tokens], axis=1)
        h += reward @ self.w_reward
        h += dt @ self.w_dt
        h += self.b1
        return self.rest(h)


def _array(t: Any) -> np.ndarray:
    return np.ascontiguousarray(t.detach().cpu().numpy(), dtype=np.float32)


def _linear(layer: Any) -> tuple[np.ndarray, np.ndarray]:
    return np.ascontiguousarray(_array(layer.weight).T), _array(layer.bias)


class NumpyPolicy:
    """:class:`core.rl.agent.Agent`'s forward in numpy (docs/serving.md, ## The numpy policy).

    ``intent(emb, rules)`` is the intent branch (``[B, dim]``, reusable for an episode);
    ``state(...)`` the fused state; ``forward(...)`` the actor logits and critic values of
    the current state; ``logits(...)`` and ``values(...)`` the actor and the critic alone."""

    def __init__(self, agent: Any):
        enc = agent.encoder
        c = enc.config
        self.intent_on = c.intent == "on"
        self.gating_on = c.gating == "on"
        self.floor = np.float32(c.gate_floor)
        self.n_actions = int(enc.n_actions)
        self.intent_net = _Branch(enc.intent_net)
        self.context_net = _Branch(enc.context_net)
        self.action_embed = _array(enc.action_embed.weight)
        self.trace_net = _TraceBranch(enc.trace_net, self.action_embed, TRACE_LEN)
        self.gate_prior = _linear(enc.gate_prior)
        self.gate_state = _linear(enc.gate_state)
        self.actor = [_linear(agent.actor[i]) for i in (0, 2, 4)]
        self.critic = [_linear(agent.critic[i]) for i in (0, 2)] + [_linear(agent.critic_heads)]
        self.dim = int(c.dim)

    # ------------------------------------------------------------------ branches
    def intent(self, emb: np.ndarray, rules: np.ndarray) -> np.ndarray:
        """``[B, dim]`` intent branch (zeros when the encoder runs without it)."""
        if not self.intent_on:
            return np.zeros((len(emb), self.dim), dtype=np.float32)
        return self.intent_net(np.concatenate([emb, rules], axis=1).astype(np.float32, copy=False))

    def context(self, context: np.ndarray) -> np.ndarray:
        """``[B, dim]`` context branch (the row is hashed features, mostly zeros)."""
        return self.context_net.sparse(context.astype(np.float32, copy=False))

    def state(self, e_intent: np.ndarray, rules: np.ndarray, context: np.ndarray, e_context: np.ndarray,
              trace_action: np.ndarray, trace_reward: np.ndarray, trace_dt: np.ndarray) -> np.ndarray:
        """``[N, dim]`` fused state; every argument has N rows (``e_context`` is the context
        branch of ``context``)."""
        n = len(trace_action)
        tokens = np.minimum(np.maximum(trace_action + 2, 0), self.n_actions + 1)
        reward = np.minimum(np.maximum(trace_reward, -Z_CLIP), Z_CLIP).astype(np.float32, copy=False)
        e_trace = self.trace_net.trace(tokens, reward, trace_dt.astype(np.float32, copy=False))
        if not self.gating_on:
            return (e_intent + e_context + e_trace) / np.float32(3.0)
        high = rules[:, URGENCY_HIGH_INDEX] if self.intent_on else np.zeros(n, np.float32)
        urgency = rules[:, URGENCY_INDEX] if self.intent_on else np.zeros(n, np.float32)
        feats = np.empty((n, 5), dtype=np.float32)
        feats[:, 0], feats[:, 1] = urgency, high
        feats[:, 2:4] = context[:, O_FLAGS:O_FLAGS + 2]
        feats[:, 4] = np.add.reduce(trace_action != PAD_TOKEN, axis=1) / trace_action.shape[1]
        (wp, bp), (ws, bs) = self.gate_prior, self.gate_state
        logits = feats @ wp + bp + np.concatenate([e_intent, e_context, e_trace], axis=1) @ ws + bs
        floor = np.full(3, self.floor, dtype=np.float32)
        if not self.intent_on:
            logits[:, 0] = -np.inf
            floor[0] = 0.0
        e = np.exp(logits - logits.max(axis=1, keepdims=True))
        g = floor + (1.0 - floor.sum()) * (e / e.sum(axis=1, keepdims=True))
        return g[:, 0:1] * e_intent + g[:, 1:2] * e_context + g[:, 2:3] * e_trace

    # ------------------------------------------------------------------ heads
    @staticmethod
    def _mlp(layers: list[tuple[np.ndarray, np.ndarray]], x: np.ndarray) -> np.ndarray:
        for w, b in layers[:-1]:
            x = np.tanh(x @ w + b)
        w, b = layers[-1]
        return x @ w + b

    def values(self, state: np.ndarray) -> np.ndarray:
        """``[N, K]`` critic ensemble."""
        return self._mlp(self.critic, state)

    def logits(self, state: np.ndarray) -> np.ndarray:
        """``[N, A]`` actor logits."""
        return self._mlp(self.actor, state)

    def forward(self, state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(logits [N, A], values [N, K])``."""
        return self.logits(state), self.values(state)

    def full(self, obs: Mapping[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """The whole pass from the encoder inputs (what the torch module computes)."""
        rules, context = obs["intent_rules"], obs["context"]
        s = self.state(self.intent(obs["intent_emb"], rules), rules, context, self.context(context),
                       obs["trace_action"], obs["trace_reward"], obs["trace_dt"])
        return self.forward(s)


def numpy_policy(agent: Any, smoke: Mapping[str, Any]) -> NumpyPolicy | None:
    """A :class:`NumpyPolicy` of ``agent`` when it is the known architecture and reproduces
    the module's logits and values on ``smoke`` (torch tensors, one row and all rows) to
    :data:`TOLERANCE`; None otherwise."""
    import torch


    if type(agent) is not Agent:
        return None
    try:
        fast = NumpyPolicy(agent)
    except (AttributeError, TypeError, ValueError):
        return None
    with torch.inference_mode():
        for n in (1, len(smoke["context"])):
            probe = {k: v[:n] for k, v in smoke.items()}
            want = agent.heads(agent.state(probe))
            got = fast.full({k: v.cpu().numpy() for k, v in probe.items()})
            if not all(g.shape == tuple(w.shape) and np.allclose(g, w.cpu().numpy(), atol=TOLERANCE, rtol=TOLERANCE)
                       for g, w in zip(got, want)):
                return None
    return fast


__all__ = ["NumpyPolicy", "TOLERANCE", "numpy_policy"]
