"""Reward pyramid speed, side by side, in one run.

(a) re-weighting a cached component matrix of ≥ 1M steps (target ≤ 50 ms);
(b) every non-embedding component on the same ≥ 1M steps, vectorised, against the
    straightforward per-step Python implementations in ``core.rewards.reference``
    (run on a slice and extrapolated linearly — the loops cost the same per step, and
    running them on a million steps would take many minutes); target ≥ 50× and
    ≥ 500k steps/s;
(c) the embedding cache: scoring the same data a second time sends no text to the
    sentence model.

The million steps are a generated finance dataset (``core.data.datasets``) tiled with
``StepsFrame.tile`` (copies follow each other in time).  Run::

    .venv/bin/python benchmarks/bench_rewards.py [--steps 1000000] [--episodes 60]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from core import rewards  # noqa: E402
from core.data.datasets import generate  # noqa: E402
from core.base.embed import Embedder  # noqa: E402
from core.rewards import COMPONENTS, ComponentCache, Pyramid, ScoringContext  # noqa: E402
from core.rewards.reference import REFERENCES  # noqa: E402
from core.records.store import Workspace  # noqa: E402


CPU: dict[str, float] = {}  # label -> median process CPU seconds of the last timed() call


def timed(fn, repeat: int = 1, label: str = "") -> tuple[float, object]:
    """Median wall time of ``repeat`` calls, and the last result (CPU time kept in ``CPU``).

    The machine may be shared: wall time then includes waiting for a core, CPU time does not."""
    times, cpu, out = [], [], None
    for _ in range(repeat):
        c0, t0 = time.process_time(), time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    if label:
        CPU[label] = statistics.median(cpu)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1_000_000, help="at least this many steps for (a) and (b)")
    ap.add_argument("--episodes", type=int, default=60, help="generated finance episodes in the base data")
    ap.add_argument("--naive-steps", type=int, default=40_000,
                    help="steps the naive loops run on (enough for the W=1000 windows to fill)")
    args = ap.parse_args()

    ws = Workspace.open(tempfile.mkdtemp(prefix="rwb-bench-"))
    template = rewards.load_template("finance_risk")
    ds = generate("finance", args.episodes, seed=1)
    t_build, base = timed(lambda: rewards.frame_from_episodes(ds.episodes, ds.tools))
    print(f"base data: {base.n_episodes} generated finance episodes, {base.n_steps} steps; "
          f"steps frame built in {t_build:.2f} s ({1e6 * t_build / base.n_steps:.0f} µs/step, "
          f"the one pass over Python objects)")

    # ---------------------------------------------------------------- (c) embedding cache
    def embed_pass() -> tuple[float, dict]:
        ctx = ScoringContext(embedder=Embedder(ws.artifact_dir("embeddings")))  # fresh object, same disk cache
        t0 = time.perf_counter()
        Pyramid(template).compute_matrix(base, ctx=ctx)  # no component cache: L3 really runs
        return time.perf_counter() - t0, dict(ctx.stats)

    c1_total, c1 = embed_pass()
    c2_total, c2 = embed_pass()

    # ---------------------------------------------------------------- (b) components on ≥ 1M steps
    copies = math.ceil(args.steps / base.n_steps)
    big = base.tile(copies)
    n = big.n_steps
    ctx = ScoringContext()
    names = [name for name, cls in COMPONENTS.items() if not cls.uses_embeddings]
    params = {c.component: dict(c.params) for c in template.all_components}
    fast: dict[str, float] = {}
    for name in names:
        comp = COMPONENTS[name](**params.get(name, {}))
        fast[name], _ = timed(lambda: comp(big, ctx), label=f"fast:{name}")
    fast_total = sum(fast.values())

    slice_copies = max(1, args.naive_steps // base.n_steps)
    small = base.tile(slice_copies)
    naive: dict[str, float] = {}
    for name in names:
        comp = COMPONENTS[name](**params.get(name, {}))
        t, ref = timed(lambda: REFERENCES[name](small, comp), label=f"naive:{name}")
        got = comp(small, ctx)
        if not np.allclose(got, ref, atol=1e-9):
            raise SystemExit(f"{name}: vectorised and naive disagree on the slice")
        naive[name] = t * n / small.n_steps  # extrapolated to the big frame
    naive_total = sum(naive.values())

    # ---------------------------------------------------------------- (a) re-weighting ≥ 1M steps
    cache = ComponentCache.for_workspace(ws)
    ctx_big = ScoringContext(embedder=Embedder(ws.artifact_dir("embeddings")))
    t_matrix, result = timed(lambda: Pyramid(template).score(big, ctx=ctx_big, cache=cache))
    rng = np.random.default_rng(0)
    weights = [{k: float(v) for k, v in zip(template.weights(), rng.uniform(0, 1, len(template.weights())))}
               for _ in range(11)]
    it = iter(weights)
    t_reweight, re = timed(lambda: result.reweight(next(it)), repeat=11, label="reweight")
    t_cached, cached = timed(lambda: Pyramid(template).score(big, ctx=ctx_big, cache=cache))
    assert cached.matrix.computed == [], "second scoring must load every column from the cache"

    # ---------------------------------------------------------------- report
    import os

    load = os.getloadavg()[0]
    cores = os.cpu_count()
    fast_cpu = sum(CPU[f"fast:{k}"] for k in names)
    naive_cpu = sum(CPU[f"naive:{k}"] for k in names) * n / small.n_steps
    ok_a = t_reweight <= 0.05
    ok_b = naive_total / fast_total >= 50 and n / fast_total >= 5e5
    print()
    print(f"machine: {cores} cores, load average {load:.1f} (wall times include waiting for a core; "
          f"CPU times do not)")
    print(f"{'':46s}{'vectorised':>24s}{'naive per-step Python':>28s}{'ratio':>9s}")
    print(f"(a) re-weight {n:,} cached steps".ljust(46) + f"{1000 * t_reweight:>13.1f} ms wall"
          f"{'matrix product only,':>28s}" + " " * 9 + f"   target ≤ 50 ms: {'OK' if ok_a else 'MISSED'}")
    print(" " * 46 + f"{1000 * CPU['reweight']:>13.1f} ms CPU {'no component called':>27s}")
    print(f"(b) {len(names)} non-embedding components, {n:,} steps".ljust(46)
          + f"{fast_total:>8.2f} s wall {n / fast_total / 1e3:>5.0f}k st/s"
          + f"{naive_total:>14.0f} s wall (extrap.)" + f"{naive_total / fast_total:>7.0f}×"
          + f"   targets ≥ 50× and ≥ 500k steps/s: {'OK' if ok_b else 'MISSED'}")
    print(" " * 46 + f"{fast_cpu:>8.2f} s CPU  {n / fast_cpu / 1e3:>5.0f}k st/s"
          + f"{naive_cpu:>14.0f} s CPU  (extrap.)" + f"{naive_cpu / fast_cpu:>7.0f}×")
    for name in names:
        print(f"      {name:40s}{1000 * fast[name]:>12.1f} ms{naive[name]:>24.1f} s{naive[name] / fast[name]:>12.0f}×")
    print(f"    (naive loops ran on {small.n_steps:,} steps — enough for the W=1000 windows to fill — "
          f"and were scaled by {n / small.n_steps:.1f}; both agree on that slice)")
    print(f"(c) embedding cache, {base.n_steps} steps".ljust(46)
          + f"1st scoring: {c1['encoded']:,} texts embedded in {c1['embed_seconds']:.2f} s "
            f"(all components {c1_total:.2f} s)")
    print(" " * 46 + f"2nd scoring: {c2['encoded']:,} texts embedded in {c2['embed_seconds']:.2f} s "
          f"(all components {c2_total:.2f} s)   {'OK' if c2['encoded'] == 0 else 'MISSED'}")
    print(f"    scoring {n:,} steps with finance_risk: {t_matrix:.2f} s the first time (components "
          f"computed, texts from the embedding cache), {t_cached:.2f} s again (every column loaded "
          f"from the component cache, none computed)")


if __name__ == "__main__":
    main()
