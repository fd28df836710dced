"""Speed of the action catalog's normalizer and of batched mask evaluation.

    python benchmarks/bench_catalog_masks.py [--states 4096] [--tools 50]

Prints normalize_many throughput on a synthetic 5,000-token catalog and the time of one
mask evaluation for B states × A tokens with numpy, torch on the CPU, and torch on CUDA
when there is one.  Wall and CPU time are both shown (CPU time is what a shared machine
cannot inflate)."""

from __future__ import annotations

import argparse
import random
import time

import numpy as np
import torch

from core.records.catalog import CatalogOptions, build_catalog
from core.records.episodes import Action, ToolSchema
from core.guard.masking import MaskRules


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


def main() -> None:
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
    print(f"normalize_many  {len(catalog):>6} tokens: {len(calls) / wall:>12,.0f} calls/s wall "
          f"({len(calls) / cpu:,.0f} per CPU-second)")

    compiled = _rules(args.tools).compile(catalog)
    B = args.states
    g = np.random.default_rng(0)
    features = {"volatility": g.random(B), "hour": g.random(B) * 24,
                "task_type": np.array([f"t{i % 4}" for i in range(B)], dtype=object)}
    counts = g.poisson(0.05, (B, len(catalog))).astype(np.int32)
    wall, cpu = _timed(lambda: compiled.evaluate(features, counts))
    print(f"masks numpy     B={B} A={len(catalog)}: {wall * 1e3:8.2f} ms wall ({cpu * 1e3:.2f} ms CPU)")
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


if __name__ == "__main__":
    main()
