"""Recorded-episode simulator speed, side by side, in one run.

(a) the batched simulator (:class:`core.rl.sim.BatchedSim`): B environments stepped as
    tensors, each step with uniformly random actions among the unmasked ones
    (:func:`core.rl.sim.random_masked_actions`, timed too) — masks evaluated, counterfactual
    draws, auto-resets, observations gathered; target ≥ 1M env-steps/s on 2 CPU cores;
(b) the Gymnasium wrapper (:class:`core.rl.sim.RecordedEpisodeEnv`) stepped one environment
    at a time, as Stable-Baselines3's DummyVecEnv does, with the same random policy;
(c) the ratio.

The data is a generated finance dataset (``core.data.datasets.generate``) scored with the
``finance_risk`` pyramid and the finance mask rules; intents are embedded by the offline
sentence model.  The machine may be shared: wall time then includes waiting for a core,
so the CPU time of the process is printed beside it.  Run::

    .venv/bin/python benchmarks/bench_sim.py [--episodes 300] [--envs 4096,16384]
        [--steps 40] [--threads 1,2] [--device auto|cpu|cuda] [--gym-steps 1500] [--json]

``measure_batched`` and ``measure_gym`` are importable (the PPO benchmark and the GPU
check reuse them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# On a shared machine, OpenMP workers that spin while waiting steal the very cores they
# wait for (2 threads then run ~10x slower than 1); passive waiting avoids that.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from core.data.datasets import datasets_dir, generate  # noqa: E402
from core.rl.sim import (BatchedSim, RecordedEpisodeEnv, SimTables, build_sim_tables_from,  # noqa: E402
                         random_masked_actions)


def bench_tables(episodes: int = 300, seed: int = 20240917, device: str = "cpu", embedder: Any = None) -> SimTables:
    """Simulator tables of a generated finance dataset (the benchmarks' common data)."""
    from core.base.embed import Embedder

    ds = generate("finance", episodes, seed=seed)
    if embedder is None:
        # The sentence model embeds requests, answers and tool data once; later runs read
        # the vectors back from this cache (nothing is downloaded either way).
        embedder = Embedder(cache_dir=Path(tempfile.gettempdir()) / "rwb-bench-embeddings")
    return build_sim_tables_from(ds.episodes, ds.tools, "finance_risk",
                                 masks=datasets_dir() / "finance" / "masks.yaml", embedder=embedder,
                                 device=device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_batched(tables: SimTables, n_envs: int, *, steps: int = 40, device: str = "cpu",
                    reuse_obs_buffers: bool = False, warmup: int = 5, repeats: int = 3, seed: int = 0
                    ) -> dict[str, Any]:
    """Env-steps/s of the batched simulator with random masked actions (best and median of
    ``repeats`` timed runs of ``steps`` steps), plus CPU-time steps/s and simulator metrics."""
    dev = torch.device(device)
    sim = BatchedSim(tables, n_envs, device=dev, seed=seed, reuse_obs_buffers=reuse_obs_buffers)
    _, mask = sim.reset()
    for _ in range(warmup):
        mask = sim.step(random_masked_actions(mask, sim.generator)).mask
    _sync(dev)
    walls, cpus = [], []
    off = viol = done = 0
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(steps):
            out = sim.step(random_masked_actions(mask, sim.generator))
            mask = out.mask
        _sync(dev)
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        off += int(out.info["off_support"].sum())
        viol += int(out.info["mask_violation"].sum())
        done += int((out.terminated | out.truncated).sum())
    n = n_envs * steps
    return {"n_envs": n_envs, "device": str(dev), "threads": torch.get_num_threads(),
            "reuse_obs_buffers": reuse_obs_buffers, "steps_per_s": n / min(walls),
            "steps_per_s_median": n / statistics.median(walls),
            "steps_per_s_cpu_time": n / statistics.median(cpus) if min(cpus) > 0 else None,
            "ms_per_step": 1000 * statistics.median(walls) / steps,
            "last_step_off_support_rate": off / (n_envs * repeats), "mask_violations_last_steps": viol}


def measure_gym(tables: SimTables, *, steps: int = 1500, seed: int = 0) -> dict[str, Any]:
    """Steps/s of the Gymnasium wrapper stepped one environment at a time, random masked actions."""
    env = RecordedEpisodeEnv(tables, seed=seed)
    rng = np.random.default_rng(seed)
    env.reset(seed=seed)
    for _ in range(20):  # warm-up
        _, _, term, trunc, _ = env.step(int(rng.choice(np.flatnonzero(env.action_masks()))))
        if term or trunc:
            env.reset()
    episodes = 0
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(steps):
        _, _, term, trunc, _ = env.step(int(rng.choice(np.flatnonzero(env.action_masks()))))
        if term or trunc:
            env.reset()
            episodes += 1
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"steps_per_s": steps / wall, "steps_per_s_cpu_time": steps / cpu if cpu > 0 else None,
            "ms_per_step": 1000 * wall / steps, "episodes": episodes}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=300)
    ap.add_argument("--envs", default="4096,16384", help="comma-separated batch sizes")
    ap.add_argument("--steps", type=int, default=40, help="timed steps per repeat")
    ap.add_argument("--threads", default="1,2", help="torch CPU threads to try (comma-separated)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--gym-steps", type=int, default=1500)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else \
        ("cpu" if args.device == "auto" else args.device)
    say = (lambda *a: None) if args.json else print

    t0 = time.perf_counter()
    tables = bench_tables(args.episodes, device=device)
    say(f"tables: {tables.n_episodes} episodes, {tables.n_steps} recorded steps, {tables.n_actions} tokens, "
        f"{len(tables.mask_rules)} mask rules, built in {time.perf_counter() - t0:.1f}s; device {device}; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")

    batched: list[dict[str, Any]] = []
    threads = [int(x) for x in args.threads.split(",")] if device == "cpu" else [torch.get_num_threads()]
    for th in threads:
        torch.set_num_threads(th)
        for B in [int(x) for x in args.envs.split(",")]:
            for reuse in (False, True):
                r = measure_batched(tables, B, steps=args.steps, device=device, reuse_obs_buffers=reuse)
                batched.append(r)
                say(f"batched  B={B:>6} threads={th} reuse_obs_buffers={str(reuse):5}: "
                    f"{r['steps_per_s']:>12,.0f} env-steps/s (median {r['steps_per_s_median']:,.0f}; "
                    f"CPU-time {r['steps_per_s_cpu_time'] or float('nan'):,.0f}/s) "
                    f"{r['ms_per_step']:.2f} ms/step, off-support {r['last_step_off_support_rate']:.2f}, "
                    f"mask violations {r['mask_violations_last_steps']}")
    torch.set_num_threads(max(threads))
    gym = measure_gym(tables, steps=args.gym_steps)
    say(f"gym wrapper, one env at a time: {gym['steps_per_s']:,.0f} steps/s "
        f"(CPU-time {gym['steps_per_s_cpu_time'] or float('nan'):,.0f}/s), {gym['ms_per_step']:.3f} ms/step")
    best = max(batched, key=lambda r: r["steps_per_s"])
    ratio = best["steps_per_s"] / gym["steps_per_s"]
    best_cpu = max((r["steps_per_s_cpu_time"] or 0.0) for r in batched)
    say(f"best batched: {best['steps_per_s']:,.0f} env-steps/s wall (B={best['n_envs']}, threads={best['threads']}, "
        f"reuse_obs_buffers={best['reuse_obs_buffers']}) = {ratio:,.0f}x the Gymnasium wrapper stepped one env "
        f"at a time; per CPU-second {best_cpu:,.0f} env-steps")
    say(f"target 1,000,000 env-steps/s on 2 CPU cores: {'met' if best['steps_per_s'] >= 1e6 else 'NOT met'} "
        f"in wall time (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores while measuring)")
    result = {"device": device, "load_average": os.getloadavg()[0], "cpu_count": os.cpu_count(),
              "n_steps_recorded": tables.n_steps, "n_actions": tables.n_actions,
              "batched": batched, "gym": gym, "best_batched_steps_per_s": best["steps_per_s"],
              "best_batched_steps_per_cpu_s": best_cpu, "ratio": ratio}
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
