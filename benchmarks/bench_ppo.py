"""Our PPO trainer vs sb3-contrib's MaskablePPO, side by side in one run.

Same simulator (the recorded-episode simulator over a generated finance dataset scored
by ``finance_risk``, finance mask rules), same network — a 2×256 tanh MLP actor and a
2×256 tanh MLP critic over the 512-d encoded state of one fixed, seeded
:class:`core.state.features.StateEncoder` — and the same PPO settings (rollout length, epochs,
minibatch count, learning rate, γ, λ, clip, entropy and value coefficients, gradient
clip).  Differences that belong to the trainers themselves stay: ours steps all its
environments as tensors (:class:`core.rl.sim.BatchedSim`) and adds the adaptive KL penalty;
SB3 steps the Gymnasium wrapper (:class:`core.rl.sim.RecordedEpisodeEnv`, wrapped to emit
the same 512-d state) one environment at a time through ``DummyVecEnv`` — with 1 and
with 8 environments, the better one counts.  No curriculum on either side.

Reported: env-steps/s of training (wall and CPU time; the machine may be shared), and the
return reached at equal steps — the greedy policy's mean template return over every
episode of the dataset, evaluated by the same batched simulator for both — plus the return
ours reaches in the wall time SB3's best run took (at equal steps ours, with batches of
n_envs × rollout, makes far fewer updates than SB3 with 1 or 8 environments).  Target:
ours ≥ 5× SB3's env-steps/s.  Run::

    .venv/bin/python benchmarks/bench_ppo.py [--episodes 300] [--steps 32768] [--envs 256]
        [--rollout 16] [--epochs 4] [--threads 1] [--device auto] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see benchmarks/bench_sim.py

import gymnasium  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from bench_sim import bench_tables  # noqa: E402
from core.rl import ppo  # noqa: E402
from core.rl.rollouts import episode_stats  # noqa: E402
from core.rl.sim import RecordedEpisodeEnv, SimTables  # noqa: E402
from core.state.features import INTENT_RULE_DIM, TRACE_LEN, StateEncoder  # noqa: E402


# --------------------------------------------------------------------------- the shared 512-d state
def unflatten(flat: torch.Tensor, n_actions: int, text_dim: int, context_dim: int) -> dict[str, torch.Tensor]:
    """The encoder input of :func:`core.rl.sim.flatten_obs` rows (the Gymnasium observation)."""
    o = 0
    parts = {}
    for key, width in (("intent_emb", text_dim), ("intent_rules", INTENT_RULE_DIM), ("context", context_dim)):
        parts[key] = flat[:, o:o + width]
        o += width
    onehot = flat[:, o:o + TRACE_LEN * (n_actions + 2)].reshape(-1, TRACE_LEN, n_actions + 2)
    o += TRACE_LEN * (n_actions + 2)
    parts["trace_action"] = onehot.argmax(-1) - 2
    parts["trace_reward"] = flat[:, o:o + TRACE_LEN]
    parts["trace_dt"] = flat[:, o + TRACE_LEN:o + 2 * TRACE_LEN]
    return parts


class EncodedState(gymnasium.ObservationWrapper):
    """RecordedEpisodeEnv with the fixed encoder's 512-d state as its observation."""

    def __init__(self, env: RecordedEpisodeEnv, encoder: StateEncoder, tables: SimTables):
        super().__init__(env)
        self.encoder = encoder
        self.dims = (tables.n_actions, int(tables.intent_emb.shape[1]), int(tables.context.shape[1]))
        self.observation_space = gymnasium.spaces.Box(-np.inf, np.inf, shape=(encoder.config.dim,),
                                                      dtype=np.float32)

    def observation(self, observation: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            x = torch.as_tensor(observation, dtype=torch.float32)[None]
            return self.encoder(unflatten(x, *self.dims))[0].numpy()

    def action_masks(self) -> np.ndarray:
        return self.env.action_masks()


class SB3Agent:
    """An SB3 MaskablePPO policy seen through core.rl.ppo's agent interface (for evaluation)."""

    def __init__(self, model: Any, encoder: StateEncoder):
        self.policy, self.encoder = model.policy, encoder

    def state(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.encoder(obs)

    def heads(self, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.policy
        state = state.to(p.device)
        features = p.extract_features(state, p.pi_features_extractor)
        latent_pi, latent_vf = p.mlp_extractor(features)
        return p.action_net(latent_pi).cpu(), p.value_net(latent_vf).cpu()


# --------------------------------------------------------------------------- the two trainers
def run_ours(tables: SimTables, cfg: ppo.PPOConfig) -> dict[str, Any]:
    idx = torch.arange(tables.n_episodes)
    data = ppo.TrainingData(tables=tables, train_episodes=idx, heldout_episodes=idx,
                            logged_returns={"all": 0.0})
    c0, t0 = time.process_time(), time.perf_counter()
    res = ppo.train(cfg, data)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    steps = res.history[-1]["env_steps"]
    return {"agent": res.agent, "env_steps": steps, "wall_s": wall, "cpu_s": cpu,
            "steps_per_s": steps / wall, "steps_per_cpu_s": steps / cpu,
            "update_steps_per_s_last": res.history[-1]["env_steps_per_s"],
            "kl_std": res.final_metrics.get("kl_std")}


def run_sb3(tables: SimTables, cfg: ppo.PPOConfig, n_envs: int, encoder: StateEncoder) -> dict[str, Any]:
    from sb3_contrib import MaskablePPO
    from stable_baselines3.common.vec_env import DummyVecEnv

    def make(i: int):
        return lambda: EncodedState(RecordedEpisodeEnv(tables, seed=cfg.seed + i), encoder, tables)

    env = DummyVecEnv([make(i) for i in range(n_envs)])
    batch = n_envs * cfg.rollout_len
    model = MaskablePPO(
        "MlpPolicy", env, learning_rate=lambda frac: cfg.lr * frac if cfg.anneal_lr else cfg.lr,
        n_steps=cfg.rollout_len, batch_size=batch // cfg.n_minibatches, n_epochs=cfg.update_epochs,
        gamma=float(cfg.gamma if cfg.gamma is not None else tables.gamma), gae_lambda=cfg.gae_lambda,
        clip_range=cfg.clip_coef, ent_coef=cfg.ent_coef, vf_coef=cfg.vf_coef, max_grad_norm=cfg.max_grad_norm,
        policy_kwargs={"net_arch": {"pi": [cfg.hidden, cfg.hidden], "vf": [cfg.hidden, cfg.hidden]},
                       "activation_fn": torch.nn.Tanh},
        seed=cfg.seed, device="cpu", verbose=0)
    total = (cfg.total_steps // batch) * batch
    c0, t0 = time.process_time(), time.perf_counter()
    model.learn(total_timesteps=total)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"model": model, "n_envs": n_envs, "env_steps": int(model.num_timesteps), "wall_s": wall, "cpu_s": cpu,
            "steps_per_s": model.num_timesteps / wall, "steps_per_cpu_s": model.num_timesteps / cpu}


def greedy_return(tables: SimTables, agent: Any, seed: int = 0) -> dict[str, float]:
    idx = torch.arange(tables.n_episodes)
    s = episode_stats(tables, agent, idx, every_episode=True, seed=seed)
    return {k: getattr(s, k) for k in ("return_mean", "success_rate", "off_support_rate", "mask_violations")}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=300, help="generated finance episodes")
    ap.add_argument("--steps", type=int, default=32768, help="env steps each trainer trains for")
    ap.add_argument("--envs", type=int, default=256, help="our trainer's parallel environments")
    ap.add_argument("--rollout", type=int, default=16, help="rollout length (both)")
    ap.add_argument("--epochs", type=int, default=4, help="update epochs (both)")
    ap.add_argument("--minibatches", type=int, default=4, help="minibatches per epoch (both)")
    ap.add_argument("--sb3-envs", default="1,8", help="DummyVecEnv sizes tried for SB3 (best counts)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is fastest on a busy machine)")
    ap.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"], help="device of our trainer")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    say = (lambda *a: None) if args.json else print
    device = ppo.resolve_device(args.device)

    t0 = time.perf_counter()
    tables = bench_tables(args.episodes)
    say(f"tables: {tables.n_episodes} episodes, {tables.n_steps} recorded steps, {tables.n_actions} tokens "
        f"({time.perf_counter() - t0:.1f}s); load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    cfg = ppo.PPOConfig(total_steps=args.steps, n_envs=args.envs, rollout_len=args.rollout,
                        update_epochs=args.epochs, n_minibatches=args.minibatches, hidden=256, n_critics=1,
                        curriculum=False, train_encoder=False, device=device, threads=args.threads,
                        eval_every=10**9, checkpoint_every=10**9, seed=0)
    # the fixed encoder both trainers read the 512-d state from (ours builds the same one from cfg)
    encoder = StateEncoder(cfg.encoder_config(), n_actions=tables.n_actions).eval().requires_grad_(False)

    ours = run_ours(tables, cfg)
    ours["eval"] = greedy_return(tables, ours.pop("agent"))
    say(f"ours  ({args.envs} batched envs, {device}): {ours['env_steps']:,} env steps in {ours['wall_s']:.1f}s = "
        f"{ours['steps_per_s']:,.0f} env-steps/s (CPU time {ours['steps_per_cpu_s']:,.0f}/s); greedy return "
        f"{ours['eval']['return_mean']:.3f}")
    sb3_runs = []
    for n in [int(x) for x in args.sb3_envs.split(",")]:
        r = run_sb3(tables, cfg, n, encoder)
        r["eval"] = greedy_return(tables, SB3Agent(r.pop("model"), encoder))
        sb3_runs.append(r)
        say(f"SB3 MaskablePPO (DummyVecEnv {n}): {r['env_steps']:,} env steps in {r['wall_s']:.1f}s = "
            f"{r['steps_per_s']:,.0f} env-steps/s (CPU time {r['steps_per_cpu_s']:,.0f}/s); greedy return "
            f"{r['eval']['return_mean']:.3f}")
    best = max(sb3_runs, key=lambda r: r["steps_per_s"])
    ratio = ours["steps_per_s"] / best["steps_per_s"]
    # At equal steps ours makes far fewer updates (batches of n_envs × rollout); also show
    # what it reaches in the wall time SB3's best needed for its steps.
    eq_steps = int(ours["steps_per_s"] * best["wall_s"])
    eq_cfg = ppo.PPOConfig(**{**cfg.__dict__, "total_steps": max(eq_steps, cfg.n_envs * cfg.rollout_len)})
    equal_time = run_ours(tables, eq_cfg)
    equal_time["eval"] = greedy_return(tables, equal_time.pop("agent"))
    say(f"ours in SB3's wall time ({best['wall_s']:.0f}s): {equal_time['env_steps']:,} env steps, greedy return "
        f"{equal_time['eval']['return_mean']:.3f}")
    ratio_cpu = ours["steps_per_cpu_s"] / max(r["steps_per_cpu_s"] for r in sb3_runs)
    random = greedy_return(tables, None)
    say(f"random-in-mask return {random['return_mean']:.3f}")
    say(f"ratio ours / SB3 best: {ratio:.1f}x env-steps/s wall ({ratio_cpu:.1f}x per CPU-second); target 5x: "
        f"{'met' if ratio >= 5 else 'NOT met'}.  Return at {ours['env_steps']:,} steps: ours "
        f"{ours['eval']['return_mean']:.3f} vs SB3 {best['eval']['return_mean']:.3f}")
    result = {"load_average": os.getloadavg()[0], "cpu_count": os.cpu_count(), "threads": args.threads,
              "config": {"steps": args.steps, "envs": args.envs, "rollout": args.rollout, "epochs": args.epochs,
                         "minibatches": args.minibatches},
              "ours": ours, "sb3": sb3_runs, "ours_equal_time": equal_time, "random_in_mask": random,
              "ratio": ratio, "ratio_cpu": ratio_cpu}
    if args.json:
        print(json.dumps(result, default=float))
    return result


if __name__ == "__main__":
    main()
