"""core.serve.fast_policy: the numpy forward serving runs reproduces the torch module."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from core.serve.fast_policy import TOLERANCE, NumpyPolicy, numpy_policy
from core.rl.agent import Agent
from core.state.features import CONTEXT_DIM, INTENT_RULE_DIM, PAD_TOKEN, TEXT_DIM, TRACE_LEN, StateEncoderConfig

N_ACTIONS = 17


def _obs(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    emb = torch.nn.functional.normalize(torch.randn(n, TEXT_DIM, generator=g), dim=1)
    trace = torch.randint(-2, N_ACTIONS, (n, TRACE_LEN), generator=g)
    trace[0] = PAD_TOKEN  # an episode's first step
    return {"intent_emb": emb, "intent_rules": torch.rand(n, INTENT_RULE_DIM, generator=g),
            "context": torch.randn(n, CONTEXT_DIM, generator=g),
            "trace_action": trace, "trace_reward": torch.randn(n, TRACE_LEN, generator=g) * 4,
            "trace_dt": torch.rand(n, TRACE_LEN, generator=g) * 3}


def _trained_like(agent: Agent) -> Agent:
    """Non-zero gate weights, as training leaves them (they start at zero)."""
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in (agent.encoder.gate_state.weight, agent.encoder.gate_prior.weight, agent.encoder.gate_prior.bias):
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return agent.eval()


@pytest.mark.parametrize("gating,intent", [("on", "on"), ("off", "on"), ("on", "off"), ("off", "off")])
def test_the_numpy_forward_reproduces_the_module(gating, intent):
    agent = _trained_like(Agent(N_ACTIONS, StateEncoderConfig(dim=32, gating=gating, intent=intent), hidden=24,
                                n_critics=3))
    obs = _obs(9)
    fast = numpy_policy(agent, obs)
    assert isinstance(fast, NumpyPolicy)
    with torch.inference_mode():
        want = agent.heads(agent.state(obs))
    got = fast.full({k: v.numpy() for k, v in obs.items()})
    for g, w in zip(got, want):
        assert g.shape == tuple(w.shape)
        np.testing.assert_allclose(g, w.numpy(), atol=TOLERANCE, rtol=TOLERANCE)


def test_shared_branches_give_the_same_state_as_the_whole_pass():
    """What RL-Boost does: the intent branch of one row reused, the context branch of one
    row repeated for several traces — equal to computing every row in full."""
    agent = _trained_like(Agent(N_ACTIONS, StateEncoderConfig(dim=32), hidden=24, n_critics=2))
    fast = NumpyPolicy(agent)
    obs = {k: v.numpy() for k, v in _obs(4, seed=3).items()}
    for k in ("intent_emb", "intent_rules", "context"):
        obs[k] = np.repeat(obs[k][:1], 4, axis=0)   # one request, four candidate traces
    whole = fast.full(obs)[1]
    e_int, e_ctx = fast.intent(obs["intent_emb"][:1], obs["intent_rules"][:1]), fast.context(obs["context"][:1])
    idx = np.zeros(4, dtype=np.int64)
    shared = fast.values(fast.state(e_int[idx], obs["intent_rules"], obs["context"], e_ctx[idx],
                                    obs["trace_action"], obs["trace_reward"], obs["trace_dt"]))
    np.testing.assert_allclose(shared, whole, atol=1e-6)


def test_a_module_it_does_not_reproduce_is_left_to_torch():
    agent = _trained_like(Agent(N_ACTIONS, StateEncoderConfig(dim=32), hidden=24, n_critics=2))
    obs = _obs(5)
    assert numpy_policy(agent, obs) is not None
    agent.actor[1] = torch.nn.ReLU()   # an architecture the numpy forward does not know
    assert numpy_policy(agent, obs) is None

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.agent = agent

    assert numpy_policy(Wrapped(), obs) is None


def test_the_folded_first_layers_equal_the_dense_ones():
    """The trace branch's table (embedding folded into its first layer) and the context
    branch's sparse first layer compute what the dense layer computes on the module's input."""
    agent = _trained_like(Agent(N_ACTIONS, StateEncoderConfig(dim=32), hidden=24, n_critics=2))
    fast = NumpyPolicy(agent)
    obs = {k: v.numpy() for k, v in _obs(12, seed=5).items()}
    # the trace: the dense branch on the module's flattened input [embedding, reward, dt] per step
    tokens = np.minimum(np.maximum(obs["trace_action"] + 2, 0), N_ACTIONS + 1)
    reward = np.clip(obs["trace_reward"], -5.0, 5.0).astype(np.float32)   # core.state.features.Z_CLIP
    x = np.concatenate([fast.action_embed[tokens], reward[..., None], obs["trace_dt"][..., None]], axis=2)
    np.testing.assert_allclose(fast.trace_net.trace(tokens, reward, obs["trace_dt"]),
                               fast.trace_net(x.reshape(len(x), -1)), atol=1e-5)
    # the context: rows with a few non-zero columns, one all zeros, and a dense one
    rng = np.random.default_rng(2)
    ctx = np.zeros((4, obs["context"].shape[1]), np.float32)
    for row, n in zip(ctx, (3, 7, 0)):
        row[rng.choice(len(row), n, replace=False)] = rng.normal(size=n)
    ctx[3] = obs["context"][0]
    np.testing.assert_allclose(fast.context_net.sparse(ctx), fast.context_net(ctx), atol=1e-5)
    np.testing.assert_allclose(fast.context_net.sparse(ctx[2:3]), fast.context_net(ctx[2:3]), atol=1e-5)
