"""Speed of the action catalog's normalizer and of batched mask evaluation.

    python benchmarks/bench_catalog_masks.py [--states 4096] [--tools 50]

Prints normalize_many throughput on a synthetic 5,000-token catalog and the time of one
mask evaluation for B states × A tokens with numpy, torch on the CPU, and torch on CUDA
when there is one.  Wall and CPU time are both shown (CPU time is what a shared machine
cannot inflate).  The last lines compare the CPU figures with the targets
(:data:`NORMALIZE_TARGET_PER_CPU_S`, :data:`MASKS_TARGET_CPU_MS`); the exit status is 1
when one is missed."""

from __future__ import annotations

import argparse
import random
import time

import numpy as np
import torch

from core.records.catalog import CatalogOptions, build_catalog
from core.records.episodes import Action, ToolSchema
from core.guard.masking import MaskRules

#: Logged calls normalized per CPU-second on the 5,003-token catalog, at least.
NORMALIZE_TARGET_PER_CPU_S = 100_000
#: CPU milliseconds of one numpy mask evaluation of 4,096 states × 5,003 tokens, at most.
MASKS_TARGET_CPU_MS = 50.0


def _tools(n: int) -> list[ToolSchema]:
    return [ToolSchema(name=f"tool_{i:03d}", risk=("low", "medium", "high")[i % 3], parameters={
        "type": "object", "required": ["a", "b"],
        "properties": {"a": {"type": "string", "enum": [f"a{j}" for j in range(10)]},
                       "b": {"type": "integer", "enum": list(range(10))}, "note": {"type": "string"}}})
            for i in range(n)]


def _rules(n_tools: int) -> MaskRules:
    rules = [{"name": f"r{i}", "kind": "risk", "targets": {"tools": [f"tool_{i:03d}"]},
              "when": {"volatility": {"gt": round(0.05 * i, 2)}, "task_type": {"in": [f"t{i % 3}"]}}}
             for i in range(min(20, n_tools))]
    rules += [{"name": "hours", "kind": "availability", "targets": {"risk": ["high"]},
               "unless": {"hour": {"between": ["9:30", "15:00"]}}},
              {"name": "orders", "kind": "business", "targets": {"tools": ["tool_000", "tool_001"]},
               "limit": {"max": 3, "per": "a"}},
              {"name": "a7", "kind": "review", "targets": {"preset": {"a": "a7"}},
               "when": {"task_type": "t1", "hour": {"gt": 12}}}]
    return MaskRules.from_data({"rules": rules})


def _timed(fn, repeat: int = 5) -> tuple[float, float]:
    fn()
    wall, cpu = [], []
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return min(wall), min(cpu)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--states", type=int, default=4096)
    parser.add_argument("--tools", type=int, default=50)
    args = parser.parse_args()

    catalog = build_catalog(_tools(args.tools), options=CatalogOptions(max_presets_per_tool=100))
    rng = random.Random(0)
    pool = [Action(kind="tool_call", tool=f"tool_{rng.randrange(args.tools):03d}",
                   params={"a": f"a{rng.randrange(10)}", "b": rng.randrange(12), "note": rng.choice(["", "x"])})
            for _ in range(5000)]
    calls = [rng.choice(pool) for _ in range(200_000)]
    wall, cpu = _timed(lambda: (catalog._cache.clear(), catalog.normalize_many(calls)), repeat=3)
    normalize_per_cpu_s = len(calls) / cpu
    print(f"normalize_many  {len(catalog):>6} tokens: {len(calls) / wall:>12,.0f} calls/s wall "
          f"({normalize_per_cpu_s:,.0f} per CPU-second)")

    compiled = _rules(args.tools).compile(catalog)
    B = args.states
    g = np.random.default_rng(0)
    features = {"volatility": g.random(B), "hour": g.random(B) * 24,
                "task_type": np.array([f"t{i % 4}" for i in range(B)], dtype=object)}
    counts = g.poisson(0.05, (B, len(catalog))).astype(np.int32)
    wall, cpu = _timed(lambda: compiled.evaluate(features, counts))
    masks_cpu_ms = cpu * 1e3
    print(f"masks numpy     B={B} A={len(catalog)}: {wall * 1e3:8.2f} ms wall ({masks_cpu_ms:.2f} ms CPU)")
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        t_features = {"volatility": torch.from_numpy(features["volatility"]).to(device),
                      "hour": torch.from_numpy(features["hour"]).to(device),
                      "task_type": torch.from_numpy(compiled.codes("task_type", features["task_type"])).to(device)}
        t_counts = torch.from_numpy(counts).to(device)

        def run() -> None:
            compiled.evaluate_torch(t_features, t_counts, messages=False)
            if device == "cuda":
                torch.cuda.synchronize()

        wall, cpu = _timed(run)
        print(f"masks torch/{device:<4} B={B} A={len(catalog)}: {wall * 1e3:8.2f} ms wall "
              f"({B / wall:,.0f} states/s)")

    checks = [("normalize_many per CPU-second", normalize_per_cpu_s, ">=", NORMALIZE_TARGET_PER_CPU_S,
               normalize_per_cpu_s >= NORMALIZE_TARGET_PER_CPU_S),
              ("masks numpy CPU ms", masks_cpu_ms, "<=", MASKS_TARGET_CPU_MS, masks_cpu_ms <= MASKS_TARGET_CPU_MS)]
    if (args.states, args.tools) != (4096, 50):
        print("targets: for the default sizes only (--states 4096 --tools 50)")
        return 0
    for label, value, sense, target, met in checks:
        print(f"target {label}: {value:,.1f} {sense} {target:,.0f} ({value / target:.2f}× the target): "
              f"{'met' if met else 'MISSED'}")
    return 0 if all(met for *_, met in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
