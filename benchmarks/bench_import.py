"""Import throughput (steps/s) of a generated 100k-step file, beside a naive reference.

Usage::

    .venv/bin/python benchmarks/bench_import.py                 # 100k steps, rwb + openai
    .venv/bin/python benchmarks/bench_import.py --steps 20000 --format rwb

The file is generated with ``core.datasets.generate`` (finance domain) when that module is
there, else with the small synthetic generator below; it is written both as the
workbench's own JSON Lines (``rwb``) and as OpenAI chat-completions logs (``openai``).

The fast path is :func:`core.importers.import_file` (big rwb files validated by all
cores, one ``model_dump`` per episode for both the canonical body and its hash, batched
``executemany`` in one transaction; it also counts INVALID calls with the action catalog).
The naive reference does what a first attempt would: per line ``json.loads`` + pydantic,
then sqlite-utils inserts of each row, each its own commit.  Target: ≥ 20,000 steps/s on
2 cores.  Rates are printed per wall-clock second and per CPU-second (this process plus
its import workers): on a shared machine only the latter is comparable between runs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.episodes import Episode, ToolSchema  # noqa: E402
from core.importers import import_file  # noqa: E402
from core.importers.rwb import header_line  # noqa: E402
from core.store import Workspace  # noqa: E402

TARGET_STEPS_PER_S = 20_000


# --------------------------------------------------------------------------- data
def synthetic_episodes(n_steps: int, seed: int = 0) -> tuple[list[Episode], list[ToolSchema]]:
    """Finance-like episodes (used only when core.datasets is not available)."""
    rng = random.Random(seed)
    tools = [ToolSchema(name=name, parameters={"type": "object", "properties": {
        "symbol": {"type": "string"}, "period": {"type": "string", "enum": ["q1", "q2", "q3", "q4"]},
        "amount": {"type": "number", "minimum": 0}}, "required": ["symbol"]})
        for name in ("get_stock_data", "get_news", "get_report", "risk_check", "place_order")]
    episodes, total, i = [], 0, 0
    while total < n_steps:
        n = rng.randint(4, 14)
        steps = []
        for t in range(n):
            state = {"hour": rng.randint(9, 15), "volatility": round(rng.random() * 0.5, 4),
                     "position": round(rng.uniform(-1, 1), 4)}
            if t == n - 1:
                steps.append({"t": t, "observation": {"state": state},
                              "action": {"kind": "final_answer"}, "output_text": "Conclusion: hold."})
                continue
            tool = rng.choice(tools).name
            params = {"symbol": rng.choice(["600519", "000001", "AAPL", "TSLA"]),
                      "period": rng.choice(["q1", "q2", "q3", "q4"])}
            steps.append({"t": t, "observation": {"state": state,
                                                  "messages": [{"role": "user", "content": "analyse"}]
                                                  if t == 0 else []},
                          "action": {"kind": "tool_call", "tool": tool, "params": params},
                          "tool_result": {"price": round(rng.uniform(10, 2000), 2), "ok": True},
                          "latency_ms": round(rng.uniform(20, 900), 1)})
        episodes.append(Episode.model_validate({
            "episode_id": f"syn-{i}", "domain": "finance",
            "task": {"query": "Analyse Moutai Q3", "task_type": "analysis"}, "steps": steps,
            "outcome": {"resolved": rng.random() < 0.6, "final_reward": round(rng.random(), 4)},
            "behaviour": rng.choice(["expert", "noisy", "hacker"])}))
        total += n
        i += 1
    return episodes, tools


def generated_episodes(n_steps: int, seed: int = 0) -> tuple[list[Episode], list[ToolSchema], str]:
    """Episodes with at least ``n_steps`` steps, from core.datasets when available."""
    try:
        from core.datasets import generate
    except ImportError:
        eps, tools = synthetic_episodes(n_steps, seed)
        return eps, tools, "synthetic (core.datasets not available)"
    probe = generate("finance", 50, seed)
    per_episode = max(1.0, sum(e.n_steps for e in probe.episodes) / len(probe.episodes))
    n_eps = int(n_steps / per_episode * 1.05) + 1
    ds = generate("finance", n_eps, seed)
    episodes, total = [], 0
    for ep in ds.episodes:
        if total >= n_steps:
            break
        episodes.append(ep)
        total += ep.n_steps
    return episodes, list(ds.tools), "core.datasets.generate('finance')"


def write_rwb(episodes: list[Episode], tools: list[ToolSchema], out: Path) -> Path:
    with open(out, "w", encoding="utf-8") as f:
        f.write(json.dumps(header_line("finance", tools), ensure_ascii=False, sort_keys=True,
                           separators=(",", ":")) + "\n")
        for ep in episodes:
            f.write(ep.to_json() + "\n")
    return out


def to_openai_record(ep: Episode, tools: list[ToolSchema]) -> dict:
    """One episode as an OpenAI chat-completions log record."""
    messages: list[dict] = [{"role": "user", "content": ep.task.query}]
    for s in ep.steps:
        a = s.action
        if a.kind == "tool_call":
            cid = f"call_{s.t}"
            messages.append({"role": "assistant", "content": s.output_text, "tool_calls": [
                {"id": cid, "type": "function",
                 "function": {"name": a.tool, "arguments": json.dumps(a.params)}}]})
            result = s.tool_error if s.tool_error else json.dumps(s.tool_result)
            messages.append({"role": "tool", "tool_call_id": cid, "content": result})
        else:
            messages.append({"role": "assistant", "content": s.output_text or a.kind})
    record = {"id": ep.episode_id, "messages": messages,
              "tools": [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                          "parameters": t.parameters}} for t in tools]}
    if ep.outcome.final_reward is not None:
        record["reward"] = ep.outcome.final_reward
    if ep.outcome.resolved is not None:
        record["success"] = ep.outcome.resolved
    return record


def write_openai(episodes: list[Episode], tools: list[ToolSchema], out: Path) -> Path:
    """OpenAI logs; the tool list rides on the first record only (the importer merges them)."""
    with open(out, "w", encoding="utf-8") as f:
        for i, ep in enumerate(episodes):
            f.write(json.dumps(to_openai_record(ep, tools if i == 0 else []), ensure_ascii=False) + "\n")
    return out


# --------------------------------------------------------------------------- measurements
def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def fast_import(path: Path, fmt: str, root: Path) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds of this process and its import workers, steps) of one
    import_file call."""
    ws = Workspace.open(root)
    t0, c0, k0 = time.perf_counter(), time.process_time(), _children_cpu()
    result = import_file(ws, path, format=fmt, dataset="bench", id_key="id" if fmt == "openai" else None)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0 + _children_cpu() - k0
    ws.close()
    return dt, cpu, result.steps


def naive_import(path: Path, root: Path, max_steps: int) -> tuple[float, float, int]:
    """Reference: what a first attempt does — per line ``json.loads`` + pydantic, then
    sqlite-utils ``insert`` of the episode row and of each step row, each call its own
    transaction (commit)."""
    import sqlite_utils

    root.mkdir(parents=True, exist_ok=True)
    db = sqlite_utils.Database(root / "naive.db")
    db.conn.execute("PRAGMA journal_mode=WAL")
    db.conn.execute("PRAGMA synchronous=NORMAL")
    steps = 0
    t0, c0 = time.perf_counter(), time.process_time()
    with open(path, encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            if "rwb_header" in record:
                continue
            ep = Episode.model_validate(record)
            o = ep.outcome
            uid = db["episodes"].insert({
                "episode_id": ep.episode_id, "domain": ep.domain, "task_type": ep.task.task_type,
                "n_steps": ep.n_steps, "resolved": o.resolved, "final_reward": o.final_reward,
                "content_hash": ep.content_hash(), "body": ep.to_json()}).last_pk
            for s in ep.steps:
                db["steps"].insert({"episode_uid": uid, "t": s.t, "kind": s.action.kind,
                                    "tool": s.action.tool, "params": json.dumps(s.action.params),
                                    "tool_error": s.tool_error, "output_text": s.output_text,
                                    "latency_ms": s.latency_ms})
            steps += ep.n_steps
            if steps >= max_steps:
                break
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    db.close()
    return dt, cpu, steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=100_000, help="steps in the generated file")
    ap.add_argument("--format", choices=["rwb", "openai", "both"], default="both")
    ap.add_argument("--naive-steps", type=int, default=20_000,
                    help="steps the naive reference imports (it is slow; its rate is per step)")
    ap.add_argument("--workers", type=int, default=None,
                    help="processes that read big rwb files (default: $RWB_IMPORT_WORKERS or the CPU count)")
    args = ap.parse_args(argv)
    if args.workers is not None:
        os.environ["RWB_IMPORT_WORKERS"] = str(args.workers)
    from core.importers.parallel import import_workers

    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; "
          f"import workers: {import_workers()}")
    # Wall-clock rates depend on what else the machine runs; CPU-seconds rates less so.

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        episodes, tools, origin = generated_episodes(args.steps)
        n_steps = sum(e.n_steps for e in episodes)
        print(f"data: {len(episodes):,} episodes, {n_steps:,} steps from {origin} "
              f"({time.perf_counter() - t0:.1f}s to generate)")
        rwb = write_rwb(episodes, tools, root / "bench.jsonl")
        formats = ["rwb", "openai"] if args.format == "both" else [args.format]
        rates = {}
        for fmt in formats:
            path = rwb if fmt == "rwb" else write_openai(episodes, tools, root / "bench_openai.jsonl")
            dt, cpu, steps = fast_import(path, fmt, root / f"ws_{fmt}")
            rates[fmt] = steps / dt
            size = path.stat().st_size / 1e6
            print(f"import_file [{fmt:6}] {steps:,} steps ({size:.0f} MB) in {dt:.2f}s = "
                  f"{rates[fmt]:,.0f} steps/s  (CPU {cpu:.2f}s = {steps / cpu:,.0f} steps/CPU-s)")
        dt, cpu, steps = naive_import(rwb, root / "ws_naive", args.naive_steps)
        naive = steps / dt
        print(f"naive reference [rwb]  {steps:,} steps in {dt:.2f}s = {naive:,.0f} steps/s  "
              f"(CPU {cpu:.2f}s = {steps / cpu:,.0f} steps/CPU-s; json.loads + pydantic per line, "
              f"sqlite-utils insert + commit per row)")
        if "rwb" in rates:
            print(f"speed-up over the naive reference: {rates['rwb'] / naive:.1f}x")
        worst = min(rates.values())
        verdict = "meets" if worst >= TARGET_STEPS_PER_S else "BELOW"
        print(f"target {TARGET_STEPS_PER_S:,} steps/s: {verdict} (slowest format {worst:,.0f} steps/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
