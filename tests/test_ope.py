"""The off-policy estimate (core.rl.ope): per-decision WIS against a slow reference and a
tabular MDP whose answer is known by enumeration, behaviour cloning that recovers the
logger, the bootstrap over tasks, the verdict on thin support, and the report of a run's
tables and agent (its logged states checked against a replay in the simulator)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from _state_fixtures import HashEmbedder
from core.rl import ope
from core.base.errors import InputError
from core.base.results import to_jsonable

GAMMA = 0.9
# A two-step tabular MDP: s0 ∈ {0,1,2} uniform; action 2 at step 0 ends the episode (success
# with P_END[s0]); otherwise s1 = (s0 + a0) % 2 and a second action ends it (success with
# P1[s1, a1]).  Rewards R0[s0, a0] and R1[s1, a1].
R0 = np.array([[0.0, 1.0, 0.5], [1.0, 0.0, 0.2], [0.3, 0.6, 0.0]])
R1 = np.array([[1.0, 0.0, 2.0], [0.0, 1.5, 0.5]])
P_END = np.array([0.2, 0.7, 0.1])
P1 = np.array([[0.9, 0.1, 0.4], [0.2, 0.8, 0.5]])
MU0 = np.array([[0.5, 0.3, 0.2], [0.2, 0.5, 0.3], [0.3, 0.3, 0.4]])
MU1 = np.array([[0.4, 0.4, 0.2], [0.3, 0.3, 0.4]])
PI0 = np.array([[0.8, 0.1, 0.1], [0.1, 0.2, 0.7], [0.2, 0.6, 0.2]])
PI1 = np.array([[0.7, 0.1, 0.2], [0.1, 0.8, 0.1]])


def true_values(pi0: np.ndarray, pi1: np.ndarray) -> tuple[float, float]:
    """Expected success and discounted return of the policy (pi0, pi1), by enumeration."""
    success = ret = 0.0
    for s0 in range(3):
        for a0 in range(3):
            p = pi0[s0, a0] / 3.0
            if a0 == 2:
                success += p * P_END[s0]
                ret += p * R0[s0, a0]
                continue
            s1 = (s0 + a0) % 2
            success += p * float(pi1[s1] @ P1[s1])
            ret += p * (R0[s0, a0] + GAMMA * float(pi1[s1] @ R1[s1]))
    return success, ret


def _draw(rng: np.random.Generator, probs: np.ndarray) -> np.ndarray:
    """One action per row of ``probs`` (inverse cdf)."""
    return (rng.random(probs.shape[0])[:, None] > np.cumsum(probs, axis=1)).sum(axis=1).clip(0, probs.shape[1] - 1)


def sample_logs(n: int, seed: int = 0, mu0: np.ndarray = MU0, mu1: np.ndarray = MU1) -> dict[str, np.ndarray]:
    """``n`` episodes of the behaviour policy as flat step arrays.  ``state`` numbers the
    five states (0-2 at step 0, 3-4 at step 1)."""
    rng = np.random.default_rng(seed)
    s0 = rng.integers(0, 3, n)
    a0 = _draw(rng, mu0[s0])
    go_on = a0 != 2
    s1 = (s0 + a0) % 2
    a1 = _draw(rng, mu1[s1])
    u = rng.random(n)
    success = np.where(go_on, u < P1[s1, a1], u < P_END[s0]).astype(np.float64)
    idx = np.arange(n)
    episode = np.concatenate([idx, idx[go_on]])
    t = np.concatenate([np.zeros(n, int), np.ones(int(go_on.sum()), int)])
    state = np.concatenate([s0, 3 + s1[go_on]])
    action = np.concatenate([a0, a1[go_on]])
    reward = np.concatenate([R0[s0, a0], R1[s1[go_on], a1[go_on]]])
    order = np.lexsort((t, episode))
    return {"episode": episode[order], "t": t[order], "state": state[order], "action": action[order],
            "reward": reward[order], "success": success}


def table_probs(policy0: np.ndarray, policy1: np.ndarray, state: np.ndarray, action: np.ndarray) -> np.ndarray:
    """Probability of ``action`` in ``state`` under a tabular policy (states as in sample_logs)."""
    table = np.concatenate([policy0, policy1])
    return table[state, action]


def slow_pdwis(pi, mu, rewards, episode, t, gamma, multiplicity=None, floor=ope.PROPENSITY_FLOOR) -> float:
    """PDWIS by loops: per step t, Σ_i m_i·w_it·γ^t·r_it / Σ_i m_i·w_it over every episode,
    a finished one keeping its final weight."""
    eps = sorted(set(episode.tolist()))
    m = {e: 1.0 for e in eps} if multiplicity is None else dict(zip(eps, multiplicity))
    steps = {e: {} for e in eps}
    for p, q, r, e, k in zip(pi, mu, rewards, episode, t):
        steps[e][int(k)] = (p / max(q, floor), r)
    horizon = max(len(s) for s in steps.values())
    weight = {e: 1.0 for e in eps}
    total = 0.0
    for k in range(horizon):
        num = den = 0.0
        for e in eps:
            if k in steps[e]:
                ratio, r = steps[e][k]
                weight[e] *= ratio
                num += m[e] * weight[e] * gamma ** k * r
            den += m[e] * weight[e]
        total += num / den
    return total


def random_case(seed: int, n_episodes: int = 7) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 5, n_episodes)
    episode = np.repeat(np.arange(n_episodes) * 3 + 5, lengths)          # labels need not be 0..E-1
    t = np.concatenate([np.arange(n) for n in lengths])
    pi = rng.uniform(0.0, 1.0, t.size)
    pi[2] = 0.0                                                          # the policy never does this
    mu = rng.uniform(0.05, 1.0, t.size)
    rewards = rng.normal(0, 1, t.size)
    perm = rng.permutation(t.size)                                       # order is free
    return {"pi": pi[perm], "mu": mu[perm], "rewards": rewards[perm], "episode": episode[perm], "t": t[perm]}


# --------------------------------------------------------------------------- the estimator
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_pdwis_matches_a_slow_reference(seed):
    c = random_case(seed)
    terms = ope.pdwis(c["pi"], c["mu"], c["rewards"], c["episode"], c["t"], GAMMA)
    want = slow_pdwis(c["pi"], c["mu"], c["rewards"], c["episode"], c["t"], GAMMA)
    assert terms.value == pytest.approx(want, abs=1e-9)
    # a resample (multiplicities) is a matrix product; a [B, E] batch gives every row's value
    m = np.random.default_rng(seed).integers(0, 3, terms.episodes.size).astype(float)
    m[0] = 1.0
    assert terms.estimate(m) == pytest.approx(slow_pdwis(c["pi"], c["mu"], c["rewards"], c["episode"], c["t"],
                                                         GAMMA, multiplicity=m), abs=1e-9)
    batch = terms.estimate(np.stack([m, np.ones_like(m)]))
    np.testing.assert_allclose(batch, [terms.estimate(m), want], atol=1e-9)


def test_pdwis_clips_the_propensities_at_the_floor():
    c = random_case(5)
    c["mu"][:3] = 1e-6
    terms = ope.pdwis(c["pi"], c["mu"], c["rewards"], c["episode"], c["t"], GAMMA, floor=0.01)
    assert terms.value == pytest.approx(slow_pdwis(c["pi"], c["mu"], c["rewards"], c["episode"], c["t"], GAMMA,
                                                   floor=0.01), abs=1e-9)


def test_on_policy_gives_exactly_the_logged_mean():
    c = random_case(4, n_episodes=50)
    terms = ope.pdwis(c["mu"], c["mu"], c["rewards"], c["episode"], c["t"], GAMMA)
    episodes, row = np.unique(c["episode"], return_inverse=True)
    returns = np.bincount(row, weights=c["rewards"] * GAMMA ** c["t"])
    assert terms.value == pytest.approx(returns.mean(), abs=1e-12)
    success = (np.arange(episodes.size) % 3 == 0).astype(float)
    outcome = ope.pdwis(c["mu"], c["mu"], ope.terminal_rewards(success, c["episode"], c["t"]), c["episode"], c["t"])
    assert outcome.value == pytest.approx(success.mean(), abs=1e-12)


def test_long_products_stay_finite():
    """200 steps of ratio 1000 overflow a plain product (1e600); the per-column scaling does not."""
    n = 200
    episode = np.repeat([0, 1], n)
    t = np.tile(np.arange(n), 2)
    pi = np.where(episode == 0, 1.0, 0.5)
    mu = np.full(2 * n, 1e-3)
    rewards = np.where((episode == 0) & (t == n - 1), 1.0, 0.0)
    terms = ope.pdwis(pi, mu, rewards, episode, t)
    assert np.isfinite(terms.weights).all()
    assert terms.value == pytest.approx(1.0 / (1.0 + 0.5 ** n), abs=1e-12)


def test_the_estimate_refuses_bad_steps():
    c = random_case(0)
    with pytest.raises(InputError, match="step_index"):
        ope.pdwis(c["pi"], c["mu"], c["rewards"], c["episode"], c["t"] + 1)
    with pytest.raises(InputError, match="pi_prob"):
        ope.pdwis(c["pi"] * 3, c["mu"], c["rewards"], c["episode"], c["t"])
    with pytest.raises(InputError, match="one entry per step"):
        ope.pdwis(c["pi"][:-1], c["mu"], c["rewards"], c["episode"], c["t"])


@pytest.fixture(scope="module")
def logs():
    return sample_logs(20000, seed=7)


def test_known_answer_of_a_tabular_mdp(logs):
    want_success, want_return = true_values(PI0, PI1)
    pi = table_probs(PI0, PI1, logs["state"], logs["action"])
    mu = table_probs(MU0, MU1, logs["state"], logs["action"])
    success = ope.pdwis(pi, mu, ope.terminal_rewards(logs["success"], logs["episode"], logs["t"]),
                        logs["episode"], logs["t"])
    ret = ope.pdwis(pi, mu, logs["reward"], logs["episode"], logs["t"], GAMMA)
    assert success.value == pytest.approx(want_success, abs=0.02)
    assert ret.value == pytest.approx(want_return, abs=0.03)
    # the test can fail: the logged means are far from the target policy's values
    logged_success, logged_return = true_values(MU0, MU1)
    assert abs(logged_success - want_success) > 0.08 and abs(logged_return - want_return) > 0.15
    assert logs["success"].mean() == pytest.approx(logged_success, abs=0.02)


# --------------------------------------------------------------------------- behaviour cloning
def _state_features(state: np.ndarray, seed: int = 0) -> np.ndarray:
    """One-hot state plus a column of noise the logger does not look at."""
    noise = np.random.default_rng(seed).normal(size=(state.size, 1))
    return np.concatenate([np.eye(5)[state], noise], axis=1)


def test_behaviour_cloning_recovers_the_logger_and_the_answer(logs):
    n = 6000
    keep = logs["episode"] < n
    sub = {k: v[keep] for k, v in logs.items() if k != "success"}
    tasks = sub["episode"] // 50
    est = ope.behaviour_propensities(_state_features(sub["state"]), sub["action"], tasks, n_folds=5)
    true_mu = table_probs(MU0, MU1, sub["state"], sub["action"])
    assert est.folds == 5
    # 4 standard errors of a proportion fitted on the training folds of the rarest state
    rarest = 0.8 * np.bincount(sub["state"]).min()
    assert np.abs(est.logged - true_mu).max() < 4 * math.sqrt(0.25 / rarest)
    assert np.abs(est.logged - true_mu).mean() < 0.015
    np.testing.assert_allclose(est.probs.sum(axis=1), 1.0, atol=1e-9)
    # the estimate with the cloned propensities is close to the true value as well
    pi = table_probs(PI0, PI1, sub["state"], sub["action"])
    success = ope.pdwis(pi, est.logged, ope.terminal_rewards(logs["success"][:n], sub["episode"], sub["t"]),
                        sub["episode"], sub["t"])
    assert success.value == pytest.approx(true_values(PI0, PI1)[0], abs=0.035)


def test_cross_fitting_never_sees_the_own_task():
    """A logger that acts by task alone (every task has its own action): a model fitted on
    the other tasks cannot know it, so the held-out propensity of the logged action is low —
    an in-sample fit would have memorised it."""
    tasks = np.repeat(np.arange(6), 40)
    actions = tasks % 6
    features = np.eye(6)[tasks]
    est = ope.behaviour_propensities(features, actions, tasks, n_folds=3)
    assert est.logged.max() < 0.05
    assert est.accuracy == 0.0


def test_softmax_regression_matches_scikit_learn():
    from sklearn.linear_model import LogisticRegression

    rng = np.random.default_rng(3)
    X = rng.normal(size=(300, 4))
    y = (X @ rng.normal(size=(4, 3)) + rng.normal(size=(300, 3))).argmax(axis=1)
    for C in (0.1, 1.0):
        ours = ope._softmax_regression(X, y, 3, C, X[:50], max_iter=5000)
        ref = LogisticRegression(C=C, tol=1e-10, max_iter=5000).fit(X, y).predict_proba(X[:50])
        np.testing.assert_allclose(ours, ref, atol=1e-5)


# --------------------------------------------------------------------------- the report
def _report(logs: dict, n: int, tasks_of: int | None, pi0=PI0, pi1=PI1, mu0=MU0, mu1=MU1, **kw) -> dict:
    keep = logs["episode"] < n
    sub = {k: v[keep] for k, v in logs.items() if k != "success"}
    pi = table_probs(pi0, pi1, sub["state"], sub["action"])
    mu = table_probs(mu0, mu1, sub["state"], sub["action"])
    supported = np.concatenate([mu0, mu1])[sub["state"]] > 0
    pi_all = np.concatenate([pi0, pi1])[sub["state"]]
    groups = None if tasks_of is None else np.arange(n) // tasks_of
    return ope.off_policy_estimate(pi, mu, sub["episode"], sub["t"], sub["reward"], GAMMA, logs["success"][:n],
                                   support=ope.support_mass(pi_all, supported), groups=groups, n_boot=400, **kw)


#: The ``ope`` report's keys in ``rwb evaluate --json``, in order
KEYS = ["method", "policy_success", "logged_success", "policy_success_ci90", "policy_return", "logged_return",
        "policy_return_ci90", "support", "episodes", "steps", "tasks", "effective_sample_size", "propensity_floor",
        "reliable", "verdict", "note", "greedy"]
#: The keys of the greedy policy's estimate in it, in order
GREEDY_KEYS = ["policy_success", "policy_return", "support", "effective_sample_size", "reliable", "verdict", "note"]


def test_report_of_a_well_supported_policy(logs):
    rep = _report(logs, 4000, tasks_of=20)
    assert list(to_jsonable(rep)) == KEYS
    assert rep.reliable is True and rep.verdict == "reliable"
    assert rep.episodes == 4000 and rep.tasks == 200
    assert rep.support == pytest.approx(1.0)
    lo, hi = rep.policy_success_ci90
    assert lo <= rep.policy_success <= hi
    assert lo <= true_values(PI0, PI1)[0] <= hi
    assert rep.logged_success == pytest.approx(logs["success"][:4000].mean(), abs=1e-12)
    keep = logs["episode"] < 4000
    returns = np.bincount(logs["episode"][keep], weights=logs["reward"][keep] * GAMMA ** logs["t"][keep])
    assert rep.logged_return == pytest.approx(returns.mean(), abs=1e-12)
    assert 0 < rep.effective_sample_size < 4000


def test_interval_is_over_tasks_not_episodes():
    """Outcomes shared within a task: resampling 8 tasks gives a far wider interval than
    resampling the 800 episodes as if they were independent."""
    rng = np.random.default_rng(1)
    n, per = 800, 100
    task_success = rng.random(n // per) < 0.5
    success = np.repeat(task_success, per).astype(float)
    episode, t = np.arange(n), np.zeros(n, int)
    p = np.full(n, 0.5)
    common = dict(support=np.ones(n), n_boot=400)
    by_task = ope.off_policy_estimate(p, p, episode, t, np.zeros(n), 1.0, success,
                                      groups=np.arange(n) // per, **common)
    by_episode = ope.off_policy_estimate(p, p, episode, t, np.zeros(n), 1.0, success, **common)
    width = lambda r: r.policy_success_ci90[1] - r.policy_success_ci90[0]  # noqa: E731
    assert by_task.policy_success == by_episode.policy_success == pytest.approx(success.mean())
    assert width(by_task) > 4 * width(by_episode)
    assert by_task.tasks == 8 and by_episode.tasks == n


def test_success_is_a_weighted_mean_of_outcomes_for_episodes_of_any_length():
    """Outcomes on the last step of episodes of different lengths: the success estimate is
    the whole-trajectory weighted mean (checked against a loop), inside [0, 1] for every
    resample of the interval."""
    rng = np.random.default_rng(5)
    lengths = rng.integers(1, 9, size=60)
    episode = np.repeat(np.arange(60), lengths)
    t = np.concatenate([np.arange(n) for n in lengths])
    pi, mu = rng.uniform(0.05, 1.0, episode.size), rng.uniform(0.05, 1.0, episode.size)
    success = (rng.random(60) < 0.4).astype(float)
    rep = ope.off_policy_estimate(pi, mu, episode, t, np.zeros(episode.size), 1.0, success,
                                  support=np.ones(episode.size), groups=np.arange(60) // 3, n_boot=300)
    weight = np.array([np.prod(pi[episode == e] / mu[episode == e]) for e in range(60)])
    assert rep.policy_success == pytest.approx((weight * success).sum() / weight.sum(), rel=1e-9)
    low, high = rep.policy_success_ci90
    assert 0.0 <= low <= rep.policy_success <= high <= 1.0


def test_one_task_gives_a_degenerate_interval_and_says_so(logs):
    rep = _report(logs, 2000, tasks_of=10 ** 9)
    assert rep.tasks == 1
    lo, hi = rep.policy_success_ci90
    assert lo == hi == pytest.approx(rep.policy_success)
    assert rep.reliable is False and rep.verdict == "one task"
    assert "one task" in rep.note


def test_thin_support_is_never_a_confident_number():
    """The logger never takes action 2 at step 0; the target puts 90% of its mass there."""
    mu0 = np.array([[0.6, 0.4, 0.0], [0.5, 0.5, 0.0], [0.3, 0.7, 0.0]])
    pi0 = np.array([[0.05, 0.05, 0.9], [0.05, 0.05, 0.9], [0.05, 0.05, 0.9]])
    logs = sample_logs(3000, seed=2, mu0=mu0)
    rep = _report(logs, 3000, tasks_of=10, pi0=pi0, mu0=mu0, pi1=MU1)
    assert rep.support < 0.6
    assert rep.reliable is False
    assert rep.verdict == "thin support"
    assert "support" in rep.note and "Not reliable" in rep.note
    # ... and the number it would have given is wrong: it never sees the policy's main path
    assert abs(rep.policy_success - true_values(pi0, MU1)[0]) > 0.1


def test_a_policy_off_every_logged_path_gets_no_number():
    mu0 = np.array([[0.6, 0.4, 0.0], [0.5, 0.5, 0.0], [0.3, 0.7, 0.0]])
    pi0 = np.array([[0.0, 0.0, 1.0]] * 3)
    logs = sample_logs(500, seed=3, mu0=mu0)
    rep = _report(logs, 500, tasks_of=10, pi0=pi0, mu0=mu0)
    assert rep.policy_success is None and rep.policy_return is None
    assert rep.effective_sample_size == 0.0
    assert rep.reliable is False and rep.verdict == "no overlap"


def test_few_effective_episodes_are_flagged(logs):
    rep = _report(logs, 300, tasks_of=10, min_ess=10 ** 4)
    assert rep.reliable is False and rep.verdict == "low effective sample size"
    assert "effective episodes" in rep.note


# --------------------------------------------------------------------------- from a run
@pytest.fixture(scope="module")
def run_tables():
    from core.data.datasets import datasets_dir, generate
    from core.rewards.outcomes import episode_groups
    from core.rl.sim import SimConfig, build_sim_tables_from, split_episodes

    ds = generate("finance", 60, seed=11)
    tables = build_sim_tables_from(ds.episodes, ds.tools, "finance_risk",
                                   masks=datasets_dir() / "finance" / "masks.yaml",
                                   config=SimConfig(n_clusters=4, step_cap=12), embedder=HashEmbedder())
    _, held = split_episodes(tables, 0.5, seed=0)
    return tables, held, episode_groups(ds.episodes)


@pytest.fixture(scope="module")
def agent(run_tables):
    from core.rl import ppo
    from core.rl.agent import Agent

    tables = run_tables[0]
    cfg = ppo.PPOConfig(hidden=64, n_critics=3, encoder={"dim": 64})
    return Agent(tables.n_actions, cfg.encoder_config(), hidden=64, n_critics=3, seed=0)


def test_logged_states_are_what_the_simulator_shows_on_the_log(run_tables):
    """Slow reference: replay the episodes in the simulator, following their logs."""
    from core.rl.sim import BatchedSim

    tables, held, _ = run_tables
    states = ope.logged_states(tables, held)
    eps = held.tolist()
    sim = BatchedSim(tables, len(eps), seed=0)
    obs, mask = sim.reset(start_episodes=eps)
    live = np.ones(len(eps), dtype=bool)
    checked = 0
    for t in range(int(tables.ep_len.max())):
        for b in np.flatnonzero(live):
            row = int(np.flatnonzero((states.episode == eps[b]) & (states.t == t))[0])
            assert states.steps[row] == int(sim.pointer[b])
            for k in obs:
                np.testing.assert_allclose(states.obs[k][row].numpy(), obs[k][b].numpy(), atol=1e-5, err_msg=k)
            assert torch.equal(states.mask[row], mask[b])
            checked += 1
        out = sim.step(sim.logged_actions())
        live &= ~(out.terminated | out.truncated).numpy()
        obs, mask = out.obs, out.mask
        if not live.any():
            break
    assert checked == states.steps.size


def test_report_of_a_run(run_tables, agent):
    tables, held, groups = run_tables
    rep = ope.off_policy_report(tables, agent, held, groups=groups, n_boot=200)
    body = to_jsonable(rep)
    assert list(body) == [*KEYS, "behaviour_model", "greedy_support", "episodes_without_steps"]
    assert list(body["greedy"]) == GREEDY_KEYS
    assert list(body["behaviour_model"]) == ["model", "folds", "held_out_by", "accuracy", "log_loss"]
    assert rep.method == ope.METHOD
    idx = held.numpy()
    assert rep.episodes == idx.size
    assert rep.steps == int(tables.ep_len[held].sum())
    assert rep.tasks == np.unique(groups[idx]).size
    assert rep.logged_success == pytest.approx(float(tables.success[held].double().mean()), abs=1e-12)
    # the per-step rewards rebuild the template's return of every logged episode
    assert rep.logged_return == pytest.approx(float(tables.episode_return[held].mean()), abs=1e-9)
    for key in ("policy_success", "logged_success"):
        assert getattr(rep, key) is None or 0.0 <= getattr(rep, key) <= 1.0
    lo, hi = rep.policy_success_ci90
    if rep.policy_success is not None:
        assert math.isfinite(rep.policy_return) and lo <= rep.policy_success <= hi
    assert 0.0 <= rep.support <= 1.0 and 0.0 <= rep.greedy_support <= 1.0
    assert rep.behaviour_model.held_out_by == "task"
    # an untrained policy is spread over ~200 tokens: the logs cannot vouch for it
    assert rep.reliable is False and rep.note.startswith("Not reliable")
    assert rep.greedy is not None and 0.0 <= rep.greedy.support <= 1.0


def test_policy_probabilities_are_the_agents_masked_softmax(run_tables, agent):
    from core.rl.common import MaskedCategorical

    tables, held, _ = run_tables
    states = ope.logged_states(tables, held[:5])
    probs = ope.policy_probs(agent, states.obs, states.mask, batch=3)        # several batches
    with torch.no_grad():
        logits, _ = agent.heads(agent.state(states.obs))
        want = MaskedCategorical(logits, states.mask).probs.double().numpy()
    np.testing.assert_allclose(probs, want, atol=1e-6)
    assert (probs[~states.mask.numpy()] == 0).all()


def test_groups_are_per_tables_episode_or_per_evaluated_episode(run_tables, agent):
    tables, held, groups = run_tables
    with pytest.raises(InputError, match="groups"):
        ope.off_policy_report(tables, agent, held, groups=groups[:3], n_boot=10)


def test_support_is_the_policy_mass_on_tokens_logged_in_the_same_cluster(run_tables, agent):
    """Slow reference: the set of (task type, cluster, token) the held-out logs took, by a loop."""
    tables, held, groups = run_tables
    rep = ope.off_policy_report(tables, agent, held, groups=groups, n_boot=10)
    states = ope.logged_states(tables, np.sort(held.numpy()))
    probs = ope.policy_probs(agent, states.obs, states.mask)
    key = lambda n: (int(tables.task_code[states.episode[n]]), int(tables.cluster[states.steps[n]]))  # noqa: E731
    taken = {(*key(n), int(states.token[n])) for n in range(states.steps.size) if states.token[n] >= 0}
    mass = [sum(probs[n, a] for a in range(tables.n_actions) if (*key(n), a) in taken)
            for n in range(states.steps.size)]
    greedy = [float((*key(n), int(probs[n].argmax())) in taken) for n in range(states.steps.size)]
    assert rep.support == pytest.approx(float(np.mean(mass)), abs=1e-9)
    assert rep.greedy_support == pytest.approx(float(np.mean(greedy)), abs=1e-12)


def test_the_same_fit_is_computed_once_per_process_and_shared_read_only(monkeypatch):
    """Exporting a bundle and registering it evaluate the same logs: the behaviour model is
    fitted once for identical inputs, and again for any input that differs."""
    rng = np.random.default_rng(3)
    features = rng.normal(size=(120, 6))
    actions = rng.integers(0, 3, size=120)
    tasks = np.repeat(np.array(["a", "b", "c", "d"], dtype=object), 30)
    fits = []
    fit = ope._fit_propensities
    monkeypatch.setattr(ope, "_fit_propensities", lambda *a, **kw: fits.append(1) or fit(*a, **kw))
    first = ope.behaviour_propensities(features, actions, tasks, n_folds=3, seed=11)
    again = ope.behaviour_propensities(features.copy(), actions.copy(), tasks.copy(), n_folds=3, seed=11)
    assert again is first and len(fits) == 1
    with pytest.raises(ValueError):
        first.probs[0, 0] = 1.0                         # shared: nobody may change it
    changed = features.copy()
    changed[7, 2] += 1e-9
    for args, kwargs in [((changed, actions, tasks), {"seed": 11}), ((features, actions, tasks), {"seed": 12}),
                         ((features, actions, None), {"seed": 11}),
                         ((features, actions, tasks), {"seed": 11, "C": 0.1})]:
        ope.behaviour_propensities(*args, n_folds=3, **kwargs)
    assert len(fits) == 5
    assert np.array_equal(ope._fit_propensities(features, actions, tasks, n_folds=3, C=0.03, n_components=64,
                                                seed=11, max_iter=150, floor=ope.PROPENSITY_FLOOR).probs,
                          first.probs)
