import math

import pytest
import torch

from core.rl.common import AdaptiveKL, MaskedCategorical, gae, gae_naive


def test_gae_hand_computed():
    # One env, three steps, no episode boundary, gamma=0.5, lambda=1.
    rewards = torch.tensor([[1.0], [0.0], [2.0]])
    values = torch.tensor([[0.5], [1.0], [0.0]])
    dones = torch.zeros(3, 1)
    adv, ret = gae(rewards, values, dones, torch.tensor([4.0]), torch.tensor([0.0]), 0.5, 1.0)
    # Returns are discounted sums with bootstrap 4.0: G2 = 2 + .5*4 = 4; G1 = 0 + .5*4 = 2; G0 = 1 + .5*2 = 2
    assert ret.squeeze().tolist() == pytest.approx([2.0, 2.0, 4.0])
    assert adv.squeeze().tolist() == pytest.approx([1.5, 1.0, 4.0])


def test_gae_cuts_at_episode_start():
    rewards = torch.tensor([[1.0], [1.0]])
    values = torch.tensor([[0.0], [10.0]])
    dones = torch.tensor([[0.0], [1.0]])  # step 1 starts a new episode
    adv, _ = gae(rewards, values, dones, torch.tensor([0.0]), torch.tensor([0.0]), 0.9, 0.95)
    assert adv[0, 0].item() == pytest.approx(1.0)  # no bootstrap across the boundary


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gae_matches_naive_reference(seed):
    g = torch.Generator().manual_seed(seed)
    T, B = 9, 5
    rewards = torch.randn(T, B, generator=g)
    values = torch.randn(T, B, generator=g)
    dones = (torch.rand(T, B, generator=g) < 0.25).float()
    nv = torch.randn(B, generator=g)
    nd = (torch.rand(B, generator=g) < 0.3).float()
    a1, r1 = gae(rewards, values, dones, nv, nd, 0.95, 0.9)
    a2, r2 = gae_naive(rewards, values, dones, nv, nd, 0.95, 0.9)
    assert torch.allclose(a1, a2, atol=1e-5)
    assert torch.allclose(r1, r2, atol=1e-5)


def test_masked_categorical_never_samples_masked():
    logits = torch.tensor([[10.0, 0.0, 0.0, 5.0]]).repeat(500, 1)
    mask = torch.tensor([[False, True, True, False]]).repeat(500, 1)
    dist = MaskedCategorical(logits, mask)
    a = dist.sample(torch.Generator().manual_seed(0))
    assert set(a.tolist()) <= {1, 2}
    assert dist.probs[0].tolist() == pytest.approx([0.0, 0.5, 0.5, 0.0])
    assert dist.log_prob(torch.tensor([1] * 500))[0].item() == pytest.approx(math.log(0.5))


def test_masked_entropy_uniform_is_log_k():
    dist = MaskedCategorical(torch.zeros(2, 6), torch.tensor([[True] * 6, [True, True, True, False, False, False]]))
    assert dist.entropy().tolist() == pytest.approx([math.log(6), math.log(3)])
    assert not torch.isnan(dist.entropy()).any()


def test_masked_categorical_refuses_empty_row():
    with pytest.raises(ValueError, match="allows no action"):
        MaskedCategorical(torch.zeros(1, 3), torch.zeros(1, 3, dtype=torch.bool))


def test_kl_from_hand_computed():
    mask = torch.tensor([[True, True, False]])
    old = MaskedCategorical(torch.log(torch.tensor([[0.5, 0.5, 1.0]])), mask)
    new = MaskedCategorical(torch.log(torch.tensor([[0.25, 0.75, 1.0]])), mask)
    expected = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert new.kl_from(old.log_probs_all).item() == pytest.approx(expected, rel=1e-5)
    assert old.kl_from(old.log_probs_all).item() == pytest.approx(0.0, abs=1e-7)


def test_adaptive_kl_moves_beta_as_specified():
    c = AdaptiveKL(target=0.01, beta=1.0)
    assert c.update(0.02) == pytest.approx(1.5)      # > 1.5×target → ×1.5
    assert c.update(0.015) == pytest.approx(1.5)     # = 1.5×target → unchanged
    assert c.update(0.004) == pytest.approx(0.75)    # < 0.5×target → ×0.5
    assert c.update(0.01) == pytest.approx(0.75)     # in band → unchanged
    fixed = AdaptiveKL(target=0.01, beta=1.0, adaptive=False)
    assert fixed.update(1.0) == 1.0 and fixed.update(0.0) == 1.0
