"""The recorded-episode simulator (core/rl/sim.py): follow-the-log exactness, counterfactual
buckets, off-support, masks every step, the batched simulator against a slow one-env-at-a-
time reference, the Gymnasium wrapper (check_env, MaskablePPO) and devices."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
import torch

from core.data.datasets import datasets_dir, generate
from core.base.errors import InputError
from core.guard.masking import MaskRules
from core.rewards import Pyramid, ScoringContext, as_template, build_frame
from core.rl.sim import (
    OBS_KEYS,
    RANDOM_HIGH,
    BatchedSim,
    RecordedEpisodeEnv,
    SimConfig,
    build_sim_tables,
    build_sim_tables_from,
    flatten_obs,
    logged_returns,
    obs_dim,
    random_masked_actions,
    split_episodes,
)
from core.state.features import PAD_TOKEN, TRACE_LEN
from _state_fixtures import HashEmbedder

MASKS = datasets_dir() / "finance" / "masks.yaml"
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module")
def data():
    ds = generate("finance", 60, seed=11)
    return ds.episodes, ds.tools


@pytest.fixture(scope="module")
def tables(data):
    episodes, tools = data
    return build_sim_tables_from(episodes, tools, "finance_risk", masks=MASKS,
                                 config=SimConfig(n_clusters=4, step_cap=12), embedder=HashEmbedder())


@pytest.fixture(scope="module")
def scored(data, tables):
    """The pyramid's own scores of the same episodes, computed independently of the simulator."""
    episodes, _ = data
    frame = build_frame(episodes, tables.catalog)
    return Pyramid(as_template("finance_risk")).score(frame, ctx=ScoringContext(embedder=HashEmbedder()))


def np_(x: torch.Tensor) -> np.ndarray:
    return x.detach().cpu().numpy()


# --------------------------------------------------------------------------- the slow reference
class ReferenceSim:
    """One environment at a time, in plain Python: the obvious reading of docs/design.md §7.

    It draws the same ``[B, 2]`` random integers per reset/step from its own generator
    seeded like the simulator's, so both take the same counterfactual picks and start
    episodes."""

    def __init__(self, tables, episodes, n_envs: int, seed: int, starts=None):
        self.tb, self.B = tables, n_envs
        g = lambda name: np_(getattr(tables, name))  # noqa: E731
        self.token, self.r64, self.comps = g("token"), g("step_reward64"), g("components")
        self.dt, self.cluster, self.step_ep = g("step_dt"), g("cluster"), g("step_episode")
        self.ep_start, self.ep_len, self.final = g("ep_start"), g("ep_len"), g("final")
        self.success, self.task = g("success"), g("task_code")
        self.intent_emb, self.intent_rules, self.context = g("intent_emb"), g("intent_rules"), g("context")
        self.A = tables.n_actions
        self.unanswered = float(g("unanswered").reshape(()))
        self.is_call = g("call_token")
        self.history = list(zip(g("history_cols").tolist(), g("history_coef").tolist(), g("history_cap").tolist()))
        self.history_class = g("history_class")
        self.starts = list(range(tables.n_episodes)) if starts is None else list(starts)
        self.buckets: dict[tuple, list[int]] = {}
        # history-matched draws: the bucket plus the log's last k actions (newest first)
        log_trace, self.match = tables.raw.trace_action, tables.config.history_match
        for j in range(len(self.token)):
            if self.token[j] >= 0:
                key = (self.task[self.step_ep[j]], self.cluster[j], self.token[j])
                self.buckets.setdefault(key, []).append(j)
                for k in range(1, self.match + 1):
                    self.buckets.setdefault((*key, tuple(int(x) for x in log_trace[j, :k])), []).append(j)
        # every recorded step's scalar state, read straight from the episodes
        self.states = []
        for ep in episodes:
            for s in ep.steps:
                state = dict((s.observation or {}).get("state") or {})
                state["task_type"] = ep.task.task_type
                self.states.append(state)
        self.compiled = tables.compiled_masks
        self.gen = torch.Generator().manual_seed(seed)
        self.cfg = tables.config

    def draw(self) -> np.ndarray:
        return torch.randint(0, RANDOM_HIGH, (self.B, 2), generator=self.gen).numpy()

    def new_episode(self, b: int, ep: int) -> None:
        self.ep[b], self.ptr[b], self.t[b] = ep, int(self.ep_start[ep]), 0
        self.own_log[b] = True
        self.counts[b] = 0
        self.trace[b] = [(PAD_TOKEN, 0.0, np.float32(0.0))] * TRACE_LEN
        self.disc_sum[b], self.disc[b] = 0.0, 1.0

    def reset(self, start_episodes=None):
        r = self.draw()
        self.ep, self.ptr, self.t = [0] * self.B, [0] * self.B, [0] * self.B
        self.own_log = [True] * self.B
        self.counts = np.zeros((self.B, self.A), np.int64)
        self.trace = [None] * self.B
        self.disc_sum, self.disc = [0.0] * self.B, [1.0] * self.B
        for b in range(self.B):
            ep = start_episodes[b] if start_episodes is not None else self.starts[r[b, 1] % len(self.starts)]
            self.new_episode(b, int(ep))
        self.mask = self.masks()
        return self.obs(), self.mask

    def masks(self) -> np.ndarray:
        feats = {f: [self.states[self.ptr[b]].get(f) for b in range(self.B)]
                 for f in self.compiled.required_features}
        return self.compiled.evaluate_reference(feats, self.counts).mask

    def obs(self) -> dict[str, np.ndarray]:
        out = {k: [] for k in ("intent_emb", "intent_rules", "context", "trace_action", "trace_reward",
                               "trace_dt")}
        for b in range(self.B):
            out["intent_emb"].append(self.intent_emb[self.ep[b]])
            out["intent_rules"].append(self.intent_rules[self.ep[b]])
            out["context"].append(self.context[self.ptr[b]])
            out["trace_action"].append([a for a, _, _ in self.trace[b]])
            out["trace_reward"].append([r for _, r, _ in self.trace[b]])
            out["trace_dt"].append([math.log1p(max(float(e), 0.0)) if a != PAD_TOKEN else 0.0
                                    for a, _, e in self.trace[b]])
        return {k: np.array(v) for k, v in out.items()}

    def step(self, actions) -> dict[str, list]:
        r = self.draw()
        tb, cfg = self.tb, self.cfg
        rec: dict[str, list] = {k: [] for k in ("reward", "terminated", "truncated", "off_support", "followed",
                                                "source", "components", "episode_return", "success",
                                                "violation", "start_episode", "final")}
        for b in range(self.B):
            a, p = int(actions[b]), self.ptr[b]
            violation = a >= 0 and not self.mask[b, a]
            followed = a == self.token[p]
            key = (self.task[self.step_ep[p]], self.cluster[p], a)
            members = self.buckets.get(key, [])
            # the longest history of the environment's own last actions that a member shares
            own = [x for x, _, _ in self.trace[b]]
            for k in range(self.match, 0, -1):
                matched = self.buckets.get((*key, tuple(own[:k])), [])
                if matched:
                    break
            else:
                matched = members
            if followed:
                used, recorded = p, True
            elif members:
                used, recorded = matched[r[b, 0] % len(matched)], True
            else:
                used, recorded = p, False
            r_step = float(self.r64[used]) if recorded else cfg.off_support_penalty
            e_used = int(self.step_ep[used])
            end_of_log = used + 1 == self.ep_start[e_used] + self.ep_len[e_used]
            final_action = a == tb.catalog.final_id and not (followed and not end_of_log)
            terminated = final_action or (end_of_log and recorded)
            truncated = not terminated and (self.t[b] + 1 >= cfg.step_cap or (end_of_log and not recorded))
            done = terminated or truncated
            final = (float(self.final[e_used]) if terminated and recorded
                     else self.unanswered if truncated else 0.0)
            comps = self.comps[used].astype(np.float64) if recorded else np.zeros(self.comps.shape[1])
            if not (followed and self.own_log[b]) and a >= 0:
                for h, (col, coef, cap) in enumerate(self.history):   # the environment's own repeats
                    same = self.history_class[h] == self.history_class[h, a]   # tokens that repeat a
                    own = -coef * min(int(self.counts[b, same].sum()), cap) if self.is_call[a] else 0.0
                    r_step += own - comps[col]
                    comps[col] = own
            self.disc_sum[b] += self.disc[b] * r_step
            rec["reward"].append(tb.a * r_step + tb.b * final / self.disc[b])
            rec["terminated"].append(terminated)
            rec["truncated"].append(truncated)
            rec["off_support"].append(not recorded)
            rec["followed"].append(followed)
            rec["source"].append(used if recorded else -1)
            rec["components"].append(comps)
            rec["episode_return"].append(tb.a * self.disc_sum[b] + tb.b * final if done else math.nan)
            rec["success"].append((float(self.success[e_used]) if terminated and recorded else 0.0)
                                  if done else math.nan)
            rec["violation"].append(violation)
            rec["start_episode"].append(self.ep[b])
            rec["final"].append(final)
            if a >= 0:
                self.counts[b, a] += 1
            old = self.trace[b]
            elapsed = [np.float32(0.0)] + [e for _, _, e in old[:-1]]
            self.trace[b] = [(x, y, np.float32(e + np.float32(self.dt[used]))) for (x, y), e in
                             zip([(a, np.float32(r_step))] + [(x, y) for x, y, _ in old[:-1]], elapsed)]
            self.disc[b] *= tb.gamma
            self.t[b] += 1
            self.own_log[b] = self.own_log[b] and followed
            self.ptr[b] = used if end_of_log else used + 1
            if done:
                self.new_episode(b, self.starts[r[b, 1] % len(self.starts)])
        self.mask = self.masks()
        return rec


def choose_actions(rng: np.random.Generator, logged: np.ndarray, mask: np.ndarray, follow_p: float) -> np.ndarray:
    """Logged actions with probability ``follow_p`` (where valid and allowed), else uniform in the mask."""
    out = np.empty(len(logged), np.int64)
    for b in range(len(logged)):
        if logged[b] >= 0 and mask[b, logged[b]] and rng.random() < follow_p:
            out[b] = logged[b]
        else:
            out[b] = rng.choice(np.flatnonzero(mask[b]))
    return out


# --------------------------------------------------------------------------- follow the log
@pytest.mark.parametrize("device", DEVICES)
def test_following_the_log_reproduces_the_pyramid(tables, scored, device):
    E = tables.n_episodes
    sim = BatchedSim(tables, E, device=device, seed=0)
    sim.reset(start_episodes=torch.arange(E))
    raw_rewards = scored.step_reward.astype(np.float32)
    returns = np.full(E, np.nan)
    finished = np.zeros(E, bool)
    for _ in range(int(tables.ep_len.max())):
        ptr = np_(sim.pointer)
        # the env's own trace equals the log's when it has followed the log so far
        batch = tables.logged_batch(ptr)
        obs = sim._observe()
        live = ~finished
        for k in ("trace_action", "trace_reward", "trace_dt", "context", "intent_emb", "intent_rules"):
            want = np_(batch[k])[live] if k != "trace_reward" else tables.raw.trace_rewards(raw_rewards, ptr)[live]
            np.testing.assert_allclose(np_(obs[k])[live], want, rtol=1e-5, atol=1e-5, err_msg=k)
        out = sim.step(sim.logged_actions())
        assert bool(out.info["followed_log"][torch.as_tensor(live, device=sim.device)].all())
        assert not bool(out.info["off_support"][torch.as_tensor(live, device=sim.device)].any())
        np.testing.assert_allclose(np_(out.info["step_reward"])[live], scored.step_reward[ptr][live], rtol=1e-6)
        done = np_(out.terminated | out.truncated) & live
        assert not np_(out.truncated)[live].any()
        returns[done] = np_(out.info["episode_return"])[done]
        finished |= done
    assert finished.all()
    # per episode, the template's return a·Σγ^i r_i + b·R_final
    np.testing.assert_allclose(returns, scored.returns, rtol=1e-6, atol=1e-6)


def test_rewards_sum_to_the_episode_return(tables, scored):
    """The RL rewards discounted with the template's γ add up to the episode return."""
    sim = BatchedSim(tables, 5, seed=1)
    sim.reset(start_episodes=[0, 1, 2, 3, 4])
    acc, disc = np.zeros(5), np.ones(5)
    for _ in range(int(tables.ep_len[:5].max())):
        out = sim.step(sim.logged_actions())
        acc += disc * np_(out.reward)
        disc *= tables.gamma
        done = np_(out.terminated)
        if done.any():
            np.testing.assert_allclose(acc[done], np_(out.info["episode_return"])[done], rtol=1e-5)
            acc[done], disc[done] = 0.0, 1.0


# --------------------------------------------------------------------------- batched vs reference
def test_batched_sim_matches_slow_reference(tables, data):
    episodes, _ = data
    B, seed = 24, 5
    sim = BatchedSim(tables, B, seed=seed)
    ref = ReferenceSim(tables, episodes, B, seed)
    obs, mask = sim.reset()
    robs, rmask = ref.reset()
    rng = np.random.default_rng(0)
    n_off = n_cf = 0
    for step in range(70):
        np.testing.assert_array_equal(np_(mask), rmask, err_msg=f"mask, step {step}")
        for k in robs:
            np.testing.assert_allclose(np_(obs[k]), robs[k], rtol=1e-5, atol=1e-6, err_msg=f"{k}, step {step}")
        actions = choose_actions(rng, np_(sim.logged_actions()), rmask, follow_p=0.5)
        out = sim.step(torch.as_tensor(actions))
        want = ref.step(actions)
        i = out.info
        np.testing.assert_allclose(np_(out.reward), want["reward"], rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(np_(out.terminated), want["terminated"])
        np.testing.assert_array_equal(np_(out.truncated), want["truncated"])
        np.testing.assert_array_equal(np_(i["off_support"]), want["off_support"])
        np.testing.assert_array_equal(np_(i["followed_log"]), want["followed"])
        np.testing.assert_array_equal(np_(i["source_step"]), want["source"])
        np.testing.assert_array_equal(np_(i["start_episode"]), want["start_episode"])
        np.testing.assert_array_equal(np_(i["mask_violation"]), want["violation"])
        np.testing.assert_allclose(np_(i["components"]), np.array(want["components"]), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(np_(i["episode_return"]), want["episode_return"], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np_(i["success"]), want["success"])
        np.testing.assert_allclose(np_(i["final"]), want["final"], rtol=1e-6)
        obs, mask = out.obs, out.mask
        robs, rmask = ref.obs(), ref.mask
        n_off += int(np_(i["off_support"]).sum())
        n_cf += int((~np_(i["followed_log"]) & ~np_(i["off_support"])).sum())
    # the run exercised all three outcomes and the masks (no masked action was chosen)
    assert n_off > 0 and n_cf > 0
    assert ref.compiled.required_features


def test_masks_every_step_follow_the_rules_and_counts(tables, data):
    """Business limit of the finance rules: a fourth order of one symbol is masked."""
    episodes, _ = data
    cat = tables.catalog
    orders = [t.id for t in cat.tokens if t.tool == "place_order"]
    rule = next(r for r in tables.mask_rules if r.name == "three_orders_per_symbol")
    assert rule.limit["max"] == 3
    sim = BatchedSim(tables, 1, seed=0, extra_mask_rules=None)
    day = next(e for e, ep in enumerate(episodes)
               if all((s.observation or {}).get("state", {}).get("trades_today", 0) < 3 for s in ep.steps)
               and ep.n_steps >= 5)
    _, mask = sim.reset(start_episodes=[day])
    token = orders[0]
    assert bool(mask[0, token])
    for k in range(3):
        out = sim.step(torch.tensor([token]))
        assert not bool(out.terminated[0] | out.truncated[0])
        assert int(sim.counts[0, token]) == k + 1
    assert not bool(out.mask[0, token])   # 3 orders of this symbol: blocked, by the limit rule
    p = int(sim.pointer[0])
    step = [s for ep in episodes for s in ep.steps][p]
    state = {**step.observation["state"], "task_type": tables.task_types[int(sim.episode[0])]}
    why = tables.compiled_masks.explain(state, np_(sim.counts[0]))
    assert "three_orders_per_symbol" in why[cat.tokens[token].name]


def test_extra_mask_rules_join_the_tables_rules(tables):
    extra = [{"name": "no_escalation", "kind": "review", "targets": {"tokens": ["E0"]},
              "when": {"hour": {"ge": 0}}}]
    sim = BatchedSim(tables, 8, seed=0, extra_mask_rules=extra)
    _, mask = sim.reset()
    assert not bool(mask[:, tables.catalog.escalate_id].any())
    assert len(sim.compiled_masks.rules) == len(tables.mask_rules) + 1
    assert len(tables.compiled_masks.rules) == len(tables.mask_rules)   # the tables are unchanged


# --------------------------------------------------------------------------- counterfactuals
def test_counterfactual_draws_only_from_its_bucket(tables):
    B = 512
    sim = BatchedSim(tables, B, seed=3)
    _, mask = sim.reset()
    gen = torch.Generator().manual_seed(0)
    token, cluster = np_(tables.token), np_(tables.cluster)
    task = np_(tables.task_code)[np_(tables.step_episode)]
    n_off = n_steps = 0
    for _ in range(20):
        ptr = np_(sim.pointer)
        actions = random_masked_actions(mask, gen)
        out = sim.step(actions)
        a, src = np_(actions), np_(out.info["source_step"])
        cf = ~np_(out.info["followed_log"]) & ~np_(out.info["off_support"])
        assert cf.any()
        assert (task[src[cf]] == task[ptr[cf]]).all()
        assert (cluster[src[cf]] == cluster[ptr[cf]]).all()
        assert (token[src[cf]] == a[cf]).all()
        # off-support exactly where no recorded step took that action in that state cluster
        support = {(task[j], cluster[j], token[j]) for j in range(len(token)) if token[j] >= 0}
        expect_off = np.array([(a[b] != token[ptr[b]]) and (task[ptr[b]], cluster[ptr[b]], a[b]) not in support
                               for b in range(B)])
        np.testing.assert_array_equal(np_(out.info["off_support"]), expect_off)
        off = np_(out.info["off_support"])
        # no component credit off support; only the environment's own repeats still cost
        own = [c for c, n in enumerate(tables.component_names) if n == "duplicate_calls"]
        comps = np_(out.info["components"])[off]
        np.testing.assert_allclose(np_(out.info["step_reward"])[off],
                                   tables.config.off_support_penalty + comps[:, own].sum(1), rtol=1e-6)
        assert np.abs(np.delete(comps, own, axis=1)).sum() == 0
        assert (comps[:, own] <= 0).all()
        n_off += int(off.sum())
        n_steps += B
        mask = out.mask
    rate = n_off / n_steps
    assert 0.0 < rate < 1.0          # counted, neither nothing nor everything


def test_counterfactual_draw_is_uniform_over_the_bucket(tables):
    """All envs at one start state take one non-logged action: the picks cover, evenly, the
    bucket's steps reached the same way (first steps of their episodes: an empty trace),
    or the whole bucket when it has none."""
    offsets, steps = np_(tables.bucket_offsets), np_(tables.bucket_steps)
    token, step_t = np_(tables.token), np_(tables.step_t)
    base = np_(tables.bucket(tables.task_code[tables.step_episode], tables.cluster,
                             torch.zeros_like(tables.cluster)))
    starts = np_(tables.ep_start)

    def expected(k: int) -> list[int]:
        members = steps[offsets[k]:offsets[k + 1]]
        first = members[step_t[members] == 0]
        return (first if len(first) else members).tolist()

    choice = None
    for e, p in enumerate(starts):
        for a in range(tables.n_actions):
            if a != token[p] and len(expected(base[p] + a)) >= 3:
                choice = (e, a, expected(base[p] + a))
                break
        if choice:
            break
    assert choice is not None, "the fixture data should have a start state with a shared bucket"
    e, a, members = choice
    size = len(members)
    B = 300 * size
    sim = BatchedSim(tables, B, seed=9)
    sim.reset(start_episodes=torch.full((B,), e))
    out = sim.step(torch.full((B,), a))
    picks = Counter(np_(out.info["source_step"]).tolist())
    assert set(picks) == set(members)
    counts = np.array(list(picks.values()))
    chi2 = (((counts - B / size) ** 2) / (B / size)).sum()
    assert chi2 < 30.0 + 3 * size   # far beyond the 0.999 quantile for these sizes


def test_counterfactual_draws_prefer_the_same_way_in(tables):
    """A draw lands on a recorded step whose logged last actions are the environment's own
    (the longest match up to ``history_match``) whenever its bucket has one."""
    assert tables.config.history_match == 2
    B = 512
    sim = BatchedSim(tables, B, seed=4)
    _, mask = sim.reset()
    gen = torch.Generator().manual_seed(1)
    log_trace = tables.raw.trace_action
    task = np_(tables.task_code)[np_(tables.step_episode)]
    cluster, token = np_(tables.cluster), np_(tables.token)
    groups: dict[tuple, list[int]] = {}
    for j in np.flatnonzero(token >= 0):
        for k in (1, 2):
            groups.setdefault((task[j], cluster[j], token[j], tuple(log_trace[j, :k])), []).append(j)
    matched = 0
    for _ in range(12):
        ptr, own = np_(sim.pointer), np_(sim.trace_action)
        actions = random_masked_actions(mask, gen)
        out = sim.step(actions)
        a, src = np_(actions), np_(out.info["source_step"])
        cf = np.flatnonzero(~np_(out.info["followed_log"]) & ~np_(out.info["off_support"]))
        for b in cf:
            for k in (2, 1):
                if (task[ptr[b]], cluster[ptr[b]], a[b], tuple(own[b, :k])) in groups:
                    assert tuple(log_trace[src[b], :k]) == tuple(own[b, :k])
                    matched += 1
                    break
        mask = out.mask
    assert matched > 0


def test_training_split_keeps_starts_and_support_inside(tables):
    train, held = split_episodes(tables, 0.25, seed=0)
    assert set(train.tolist()).isdisjoint(held.tolist())
    assert sorted(train.tolist() + held.tolist()) == list(range(tables.n_episodes))
    # every (task type, behaviour) group with at least 2 episodes lands in both halves
    groups = Counter(zip(tables.task_types, tables.behaviours))
    held_groups = Counter((tables.task_types[i], tables.behaviours[i]) for i in held.tolist())
    for g, n in groups.items():
        assert held_groups[g] == round(0.25 * n)
    sim = BatchedSim(tables, 256, seed=2, episodes=train)
    _, mask = sim.reset()
    gen = torch.Generator().manual_seed(1)
    step_ep = np_(tables.step_episode)
    allowed = set(train.tolist())
    assert len(sim.history_tables) == tables.config.history_match
    for keys, steps in sim.history_tables:        # history-matched draws: restricted too, still sorted
        assert {int(step_ep[s]) for s in np_(steps)} <= allowed
        assert (np.diff(np_(keys)) >= 0).all()
    for _ in range(15):
        out = sim.step(random_masked_actions(mask, gen))
        mask = out.mask
        assert set(np_(sim.episode).tolist()) <= allowed
        src = np_(out.info["source_step"])
        assert {int(step_ep[s]) for s in src[src >= 0]} <= allowed
    # outcomes drawn from every episode when asked (evaluation on held-out starts)
    full = BatchedSim(tables, 4, seed=2, episodes=held, support_episodes="all")
    assert torch.equal(full.bucket_steps, tables.bucket_steps)
    with pytest.raises(InputError):
        BatchedSim(tables, 4, episodes=held, support_episodes="some")
    with pytest.raises(InputError):
        split_episodes(tables, 1.0)


def test_split_by_task_never_puts_a_task_on_both_sides(tables):
    from dataclasses import replace as replace_field

    # four runs of each of 15 tasks (the shape of real logs: many runs per task)
    tasks = [f"task-{i % 15}" for i in range(tables.n_episodes)]
    by_task = replace_field(tables, task_ids=tasks)
    train, held = split_episodes(by_task, 0.25, seed=3, by="task")
    train_tasks = {tasks[i] for i in train.tolist()}
    held_tasks = {tasks[i] for i in held.tolist()}
    assert train_tasks.isdisjoint(held_tasks)
    assert sorted(train.tolist() + held.tolist()) == list(range(tables.n_episodes))
    assert len(held_tasks) == 4                        # whole tasks until a quarter of the episodes
    assert split_episodes(by_task, 0.25, seed=4, by="task")[1].tolist() != held.tolist()
    assert len(tables.task_ids) == tables.n_episodes   # the builder fills the task of every episode
    with pytest.raises(InputError, match="heldout_by"):
        split_episodes(tables, 0.25, by="tool")


def test_logged_returns_per_behaviour(tables, scored):
    idx = torch.arange(0, tables.n_episodes, 2)
    got = logged_returns(tables, idx)
    for b in set(tables.behaviours):
        sel = [i for i in idx.tolist() if tables.behaviours[i] == b]
        assert got[b] == pytest.approx(float(np.mean(scored.returns[sel])))


def test_step_cap_truncates_as_unanswered(tables):
    # the step cap does not change the tables: the same ones with another config
    t = replace(tables, config=replace(tables.config, step_cap=2))
    long_ep = next(e for e in range(t.n_episodes) if int(t.ep_len[e]) > 2)
    sim = BatchedSim(t, 1, seed=0)
    sim.reset(start_episodes=[long_ep])
    r = []
    for k in range(2):
        out = sim.step(sim.logged_actions())
        r.append(float(out.info["step_reward"][0]))
    assert bool(out.truncated[0]) and not bool(out.terminated[0])
    # the request was never answered: the worst recorded outcome, no success
    worst = float(t.final.min())
    assert float(t.unanswered) == worst < 0
    assert float(out.info["final"][0]) == worst and float(out.info["success"][0]) == 0.0
    assert float(out.info["episode_return"][0]) == pytest.approx(t.a * (r[0] + t.gamma * r[1]) + t.b * worst,
                                                                 rel=1e-5)


def test_bad_actions_are_refused(tables):
    sim = BatchedSim(tables, 2, seed=0)
    with pytest.raises(InputError, match="reset"):
        sim.step(torch.tensor([0, 0]))
    sim.reset()
    with pytest.raises(InputError, match="not a token"):
        sim.step(torch.tensor([0, tables.n_actions]))
    with pytest.raises(InputError, match="needs 2 actions"):
        sim.step(torch.tensor([0]))


def test_reused_observation_buffers_hold_the_same_values(tables):
    fresh = BatchedSim(tables, 64, seed=4)
    reuse = BatchedSim(tables, 64, seed=4, reuse_obs_buffers=True)
    (o1, m1), (o2, m2) = fresh.reset(), reuse.reset()
    gen = torch.Generator().manual_seed(2)
    kept = o1["context"]
    for _ in range(8):
        for k in o1:
            assert torch.equal(o1[k], o2[k]), k
        a = random_masked_actions(m1, gen)
        s1, s2 = fresh.step(a), reuse.step(a)
        o1, m1, o2 = s1.obs, s1.mask, s2.obs
        assert torch.equal(s1.reward, s2.reward)
    assert o2["context"].data_ptr() == reuse._context.data_ptr()      # one buffer, rewritten
    assert kept.data_ptr() != o1["context"].data_ptr()                 # fresh tensors by default


def test_batched_sim_keeps_the_environment_protocol(tables):
    """BatchedSim is a core.rl.env.BatchedEnv: its spec describes the observations it
    returns, ``action_masks()`` is the mask of the current states, ``done`` is terminated
    or truncated, and ``info`` carries every key the trainer reads (reward terms by name)."""
    from core.rl.env import STEP_INFO_KEYS, BatchedEnv, EnvStep

    sim = BatchedSim(tables, 16, seed=5)
    assert isinstance(sim, BatchedEnv)
    assert sim.gamma == tables.gamma and sim.component_names == tables.component_names
    obs, mask = sim.reset(seed=5)
    spec = sim.observation_spec()
    assert set(spec) == set(obs) == set(OBS_KEYS)
    gen = torch.Generator().manual_seed(5)
    saw_done = False
    for _ in range(2 * tables.config.step_cap):
        for k, s in spec.items():
            assert obs[k].shape == (16, *s.shape) and obs[k].dtype == s.dtype, k
        assert torch.equal(sim.action_masks(), mask)
        out = sim.step(random_masked_actions(mask, gen))
        assert isinstance(out, EnvStep)
        assert torch.equal(out.done, out.terminated | out.truncated)
        assert set(STEP_INFO_KEYS) <= set(out.info)
        assert out.info["components"].shape == (16, len(sim.component_names))
        # the episode return is reported exactly where an episode ended
        assert torch.equal(~torch.isnan(out.info["episode_return"]), out.done)
        saw_done |= bool(out.done.any())
        obs, mask = out.obs, sim.action_masks()
        assert torch.equal(mask, out.mask)
    assert saw_done


def test_random_masked_actions_stay_in_the_mask():
    gen = torch.Generator().manual_seed(0)
    mask = torch.zeros(2000, 50, dtype=torch.bool)
    mask[:, 7] = True                       # one allowed action: rejection always fails
    mask[1000:, :] = True
    a = random_masked_actions(mask, gen)
    assert bool(mask.gather(1, a[:, None]).all())
    assert (a[:1000] == 7).all()
    assert len(set(a[1000:].tolist())) > 40


# --------------------------------------------------------------------------- Gymnasium wrapper
# Features such as rewards and Δt have no finite bound: the Box says so honestly.
@pytest.mark.filterwarnings("ignore:.*Box observation space (minimum|maximum) value")
def test_gym_wrapper_passes_check_env(tables):
    from gymnasium.utils.env_checker import check_env

    env = RecordedEpisodeEnv(tables, seed=0)
    check_env(env, skip_render_check=True)
    obs, info = env.reset(seed=3, options={"episode": tables.episode_ids[4]})
    assert obs.shape == (obs_dim(tables),) and obs.dtype == np.float32
    assert info["episode"] == 4
    assert env.action_masks().dtype == bool and env.action_masks().shape == (tables.n_actions,)


def test_gym_wrapper_replays_an_episode_with_reward_terms(tables, scored):
    env = RecordedEpisodeEnv(tables, seed=0)
    token, starts, lens = np_(tables.token), np_(tables.ep_start), np_(tables.ep_len)
    # an episode of several steps without invalid logged calls (the Discrete space has no -1)
    e = next(e for e in range(tables.n_episodes)
             if lens[e] >= 4 and (token[starts[e]:starts[e] + lens[e]] >= 0).all())
    obs, _ = env.reset(options={"episode": e})
    start = int(starts[e])
    total, done, k = 0.0, False, 0
    while not done:
        obs, reward, term, trunc, info = env.step(int(token[start + k]))
        assert info["followed_log"] and not info["off_support"]
        assert sum(info["reward_terms"].values()) == pytest.approx(info["step_reward"], abs=1e-5)
        assert set(info["reward_terms"]) == set(tables.component_names)
        total += reward * tables.gamma ** k
        done, k = term or trunc, k + 1
    assert info["episode_return"] == pytest.approx(float(scored.returns[e]), abs=1e-5)
    assert total == pytest.approx(info["episode_return"], abs=1e-5)
    with pytest.raises(InputError, match="reset"):
        env.step(0)


def test_flat_observation_layout(tables):
    sim = BatchedSim(tables, 3, seed=0)
    obs, _ = sim.reset()
    flat = flatten_obs(obs, tables.n_actions)
    assert flat.shape == (3, obs_dim(tables))
    A2 = tables.n_actions + 2
    onehot = flat[:, -(TRACE_LEN * A2 + 2 * TRACE_LEN):-2 * TRACE_LEN].reshape(3, TRACE_LEN, A2)
    assert bool((onehot[:, :, 0] == 1).all())    # an empty trace is PAD everywhere


def test_maskable_ppo_trains_on_the_wrapper(tables):
    from sb3_contrib import MaskablePPO

    class Counting(RecordedEpisodeEnv):
        violations = 0
        steps = 0

        def step(self, action):
            out = super().step(action)
            Counting.violations += int(out[4]["mask_violation"])
            Counting.steps += 1
            return out

    env = Counting(tables, seed=0)
    model = MaskablePPO("MlpPolicy", env, n_steps=128, batch_size=64, n_epochs=2, seed=0, device="cpu",
                        policy_kwargs={"net_arch": [32]})
    model.learn(total_timesteps=256)
    assert Counting.steps >= 256
    assert Counting.violations == 0        # a masked policy never takes a masked action
    obs, _ = env.reset(seed=0)
    action, _ = model.predict(obs, action_masks=env.action_masks(), deterministic=True)
    assert env.action_masks()[int(action)]


# --------------------------------------------------------------------------- workspace and devices
def test_tables_from_a_workspace_match_in_memory(tmp_path, monkeypatch, data):
    from core.records.store import Workspace

    monkeypatch.setattr("core.base.embed.workspace_embedder", lambda _ws: HashEmbedder())
    episodes, tools = data
    ws = Workspace.open(tmp_path / "ws")
    with ws.transaction() as conn:
        ws.ensure_dataset(conn, "fin", "finance")
        ws.insert_episodes(conn, "fin", episodes)
        ws.upsert_tools(conn, "fin", tools)
    t = build_sim_tables(ws, "fin", "finance_risk", masks=MASKS, config=SimConfig(n_clusters=4))
    ref = build_sim_tables_from(episodes, tools, "finance_risk", masks=MASKS,
                                config=SimConfig(n_clusters=4), embedder=HashEmbedder())
    assert t.episode_ids == ref.episode_ids
    np.testing.assert_allclose(np_(t.episode_return), np_(ref.episode_return), rtol=1e-9)
    np.testing.assert_array_equal(np_(t.token), np_(ref.token))
    with pytest.raises(InputError, match="no dataset"):
        build_sim_tables(ws, "nope", "finance_risk")


def test_tables_move_between_devices(tables):
    same = tables.to("cpu")
    assert same is tables
    sim = BatchedSim(tables, 4, device=torch.device("cpu"), seed=0)
    assert sim.generator.device.type == "cpu" and sim.pointer.device.type == "cpu"
    if torch.cuda.is_available():
        g = BatchedSim(tables, 64, device="cuda", seed=0)
        obs, mask = g.reset()
        out = g.step(random_masked_actions(mask, g.generator))
        assert out.reward.device.type == "cuda" and all(v.device.type == "cuda" for v in out.obs.values())
        assert not bool(out.info["mask_violation"].any())


def test_masks_may_be_given_as_rules_or_none(data):
    episodes, tools = data
    t = build_sim_tables_from(episodes[:10], tools, "finance_risk", masks=None,
                              config=SimConfig(n_clusters=2), embedder=HashEmbedder())
    sim = BatchedSim(t, 4, seed=0)
    _, mask = sim.reset()
    assert bool(mask.all())
    rules = MaskRules.from_yaml(MASKS)
    t2 = build_sim_tables_from(episodes[:10], tools, "finance_risk", masks=rules,
                               config=SimConfig(n_clusters=2), embedder=HashEmbedder())
    assert [r.name for r in t2.mask_rules] == [r.name for r in rules]


def test_a_counterfactual_repeat_pays_the_duplicate_penalty(tables):
    """Off the log, ``duplicate_calls`` reads the environment's own calls: the same call
    again costs weight × per × (earlier copies), whatever the drawn step's episode did."""
    col = tables.component_names.index("duplicate_calls")
    calls = [t.id for t in tables.catalog.tokens if t.kind == "tool_call"]
    for start in range(tables.n_episodes):
        for a in calls:
            sim = BatchedSim(tables, 1, seed=0)
            _, mask = sim.reset(start_episodes=[start])
            values = []
            for _ in range(3):
                if not bool(mask[0, a]) or int(sim.logged_actions()[0]) == a:
                    break
                out = sim.step(torch.tensor([a]))
                values.append(float(out.info["components"][0, col]))
                if bool(out.terminated[0] | out.truncated[0]):
                    break
                mask = out.mask
            if len(values) == 3:
                assert values == pytest.approx([0.0, -1.0, -2.0])      # finance_risk: per 1.0, weight 1
                return
    pytest.fail("no start state allowed the same call three times off the log")


def test_a_counterfactual_call_of_the_same_tool_is_a_repeat(tables):
    """finance_risk matches whole tools (``match: tool``): another preset of a tool called
    before is a repeat too, while the legs of a trade (``exempt``) repeat only as the same call."""
    col = tables.component_names.index("duplicate_calls")
    tokens = tables.catalog.tokens
    by_tool: dict[str, list[int]] = {}
    for t in tokens:
        if t.kind == "tool_call":
            by_tool.setdefault(t.tool, []).append(t.id)
    classes = np_(tables.history_class)[0]
    assert len({classes[a] for a in by_tool["place_order"]}) == len(by_tool["place_order"])   # exempt
    for tool, ids in by_tool.items():
        if tool not in ("place_order", "margin_trade"):
            assert len({classes[a] for a in ids}) == 1
    pairs = [(a, b) for ids in by_tool.values() for a in ids for b in ids
             if a != b and tokens[a].tool not in ("place_order", "margin_trade")]
    for start in range(tables.n_episodes):
        for a, b in pairs:
            sim = BatchedSim(tables, 1, seed=0)
            _, mask = sim.reset(start_episodes=[start])
            if not bool(mask[0, a]) or int(sim.logged_actions()[0]) == a:
                continue
            out = sim.step(torch.tensor([a]))
            if bool(out.terminated[0] | out.truncated[0]) or not bool(out.mask[0, b]) \
                    or int(sim.logged_actions()[0]) == b:
                continue
            second = sim.step(torch.tensor([b]))
            assert float(out.info["components"][0, col]) == 0.0
            assert float(second.info["components"][0, col]) == pytest.approx(-1.0)
            return
    pytest.fail("no start state allowed two presets of one tool off the log")


def test_history_draws_are_the_same_row_subset_or_full_width(tables):
    """The CPU looks up only counterfactual rows, an accelerator every row: same picks."""
    sims = [BatchedSim(tables, 256, seed=6) for _ in range(2)]
    sims[1].subset_rows = False
    masks = [s.reset()[1] for s in sims]
    gen = torch.Generator().manual_seed(3)
    for _ in range(20):
        actions = random_masked_actions(masks[0], gen)
        outs = [s.step(actions) for s in sims]
        assert torch.equal(outs[0].info["source_step"], outs[1].info["source_step"])
        assert torch.equal(outs[0].reward, outs[1].reward)
        masks = [o.mask for o in outs]


def test_a_history_key_that_would_overflow_is_refused(data):
    """history_match packs the bucket and k trace tokens into one int64: too many for it is
    a clear error, not wrapped keys that draw from the wrong steps."""
    episodes, tools = data
    with pytest.raises(InputError, match="history_match .* overflow 64 bits"):
        build_sim_tables_from(episodes[:10], tools, "finance_risk",
                              config=SimConfig(n_clusters=2 ** 40, history_match=3), embedder=HashEmbedder())
