"""Latency and throughput of the decision engine's decide() (core.serving), audit write included.

    python benchmarks/bench_decide.py [--bundle FILE.zip] [--episodes 120] [--batch 64]
                                      [--hash-embedder] [--torch-threads 1] [--workspace DIR]

Without ``--bundle`` it builds one the way the workbench does: the finance sample imported
into a temporary workspace, a short PPO run, ``export_bundle`` (about a minute).  Recorded
episodes are then replayed as requests, step by step (state, query, task type, the last
tool result), against:

* the engine: batched audit commits, masks re-compiled only when a review changes them,
  the query's intent computed once per query;
* a naive reference: the same decisions with a synchronous audit commit per decision
  (``synchronous=True``), the masks re-compiled with the review rules on every decision and
  the query embedded again on every RL-Boost.

Single requests report p50/p99 of the wall-clock time per decide() call for every
decision, for baseline-only decisions and for RL-Boost ones, and the process CPU time per
decision (all threads: background audit commits and embeddings included);
``decide_batch`` reports decisions per second.  The engines' clock replays the recorded
step times, so both see the same inputs and must serve the same actions (decisions where
either ran out of its time budget aside).  Target: p99 ≤ 2 ms.  The load average is
printed: on a shared machine wall-clock percentiles grow with it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from core import audit  # noqa: E402
from core.serving import DecisionEngine, ServingConfig  # noqa: E402
from core.store import Workspace  # noqa: E402
from core.users import LOCAL_ADMIN  # noqa: E402


class HashEmbedder:
    """Deterministic stand-in for the sentence model (``--hash-embedder``)."""

    def encode(self, texts):
        import hashlib

        out = np.zeros((len(texts), 384), dtype=np.float32)
        for i, t in enumerate(texts):
            for w in str(t).lower().split():
                seed = int.from_bytes(hashlib.sha256(w.encode()).digest()[:4], "little")
                out[i] += np.random.default_rng(seed).standard_normal(384).astype(np.float32)
            out[i] /= max(float(np.linalg.norm(out[i])), 1e-12)
        return out


def build_bundle(work: Path, n_train: int) -> Path:
    """Import the finance sample, train a small policy, export its bundle."""
    from core.bundle import export_bundle
    from core.importers import import_file
    from core.ppo import PPOConfig
    from core.runs import train

    sample = ROOT / "datasets" / "finance" / "sample.jsonl"
    lines = sample.read_text(encoding="utf-8").splitlines()
    subset = work / "train.jsonl"
    subset.write_text("\n".join(lines[:n_train + 1]) + "\n", encoding="utf-8")
    ws = Workspace.open(work / "train-ws")
    import_file(ws, subset, dataset="finance")
    cfg = PPOConfig(total_steps=4096, n_envs=64, rollout_len=16, update_epochs=2, n_minibatches=2, bc_epochs=10,
                    hidden=64, n_critics=2, encoder={"dim": 64}, device="cpu", checkpoint_every=100, seed=0)
    print(f"training a small policy on {n_train} episodes …", flush=True)
    result = train(ws, LOCAL_ADMIN, template="finance_risk", dataset="finance", config=cfg)
    path = export_bundle(ws, LOCAL_ADMIN, result["run_id"], work / "finance_risk-bench.zip")
    ws.close()
    return path


class ReplayClock:
    """The engine's clock during a replay: the recorded time of the step being decided, so
    the trace's Δt is the logged one (and both engines see the same inputs)."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def requests_of(first: int, n: int) -> list[list[tuple[dict, float]]]:
    """Recorded episodes of the finance sample (after the training ones) as sequences of
    (request, recorded time of the step)."""
    from datetime import datetime

    from core.importers import read_file

    episodes = read_file(ROOT / "datasets" / "finance" / "sample.jsonl").episodes[first:first + n]
    out = []
    for ep in episodes:
        reqs, prev = [], None
        for step in ep.steps:
            when = datetime.fromisoformat(step.timestamp).timestamp() if step.timestamp else float(step.t)
            req = {"episode_id": ep.episode_id, "query": ep.task.query, "task_type": ep.task.task_type,
                   "state": (step.observation or {}).get("state") or {}}
            if prev is not None and (prev.tool_result is not None or prev.tool_error is not None):
                req["last_result"] = {"tool": prev.action.tool or prev.action.kind, "result": prev.tool_result,
                                      "error": prev.tool_error, "latency_ms": prev.latency_ms}
            reqs.append((req, when))
            prev = step
        out.append(reqs)
    return out


class NaiveEngine(DecisionEngine):
    """The reference: nothing cached and one synchronous audit commit per decision."""

    def _prefetch_intents(self, queries):
        pass  # no embedding ahead of time …

    def _intent(self, queries):
        self._intents.clear()  # … and again on every RL-Boost
        return super()._intent(queries)

    def _decide_group(self, rt, rows, now, t0):
        rt._review_signature = None  # re-compile the masks with the review rules, every time
        return super()._decide_group(rt, rows, now, t0)


def single(engine: DecisionEngine, clock: ReplayClock, sequences: list[list[tuple[dict, float]]],
           suffix: str) -> dict:
    """Replay the sequences one request at a time: wall time per decide() call."""
    wall, boost, finals = [], [], []  # finals: (episode, action, RL-Boost ran out of time)
    start, cpu0 = time.perf_counter(), time.process_time()
    for seq in sequences:
        for req, when in seq:
            req = {**req, "episode_id": req["episode_id"] + suffix}
            clock.t = when
            t0 = time.perf_counter()
            d = engine.decide(req)
            wall.append(time.perf_counter() - t0)
            boost.append(d.rl_boost)
            finals.append((req["episode_id"], d.final_action, d.timed_out))
    engine.flush()
    total, cpu = time.perf_counter() - start, time.process_time() - cpu0
    wall_a, boost_a = np.array(wall) * 1e3, np.array(boost)

    def pct(a: np.ndarray) -> dict:
        return {"n": int(a.size), "p50": float(np.percentile(a, 50)) if a.size else None,
                "p99": float(np.percentile(a, 99)) if a.size else None}

    return {"all": pct(wall_a), "rde": pct(wall_a[~boost_a]), "rl_boost": pct(wall_a[boost_a]),
            "boost_share": float(boost_a.mean()), "per_s": len(wall) / total,
            # every thread of the process (background audit commits and embeddings included)
            "cpu_ms_per_decision": 1e3 * cpu / len(wall), "finals": finals}


def batched(engine: DecisionEngine, clock: ReplayClock, sequences: list[list[tuple[dict, float]]], batch: int,
            suffix: str) -> float:
    """Decisions per second with decide_batch: ``batch`` episodes advance one step per call."""
    n, t0 = 0, time.perf_counter()
    for start in range(0, len(sequences), batch):
        group = sequences[start:start + batch]
        for t in range(max(len(s) for s in group)):
            reqs = [{**s[t][0], "episode_id": s[t][0]["episode_id"] + suffix} for s in group if t < len(s)]
            clock.t += 1.0
            engine.decide_batch(reqs)
            n += len(reqs)
    engine.flush()
    return n / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, help="A bundle zip (default: train and export one).")
    parser.add_argument("--train", type=int, default=150, help="Sample episodes to train on (no --bundle).")
    parser.add_argument("--episodes", type=int, default=120, help="Recorded episodes replayed as requests.")
    parser.add_argument("--batch", type=int, default=64, help="Episodes per decide_batch call.")
    parser.add_argument("--hash-embedder", action="store_true",
                        help="A hash embedder instead of the sentence model (training and serving).")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="torch intra-op threads of the serving process (ServingConfig.torch_threads).")
    parser.add_argument("--workspace", type=Path, help="Folder for the temporary workspaces.")
    parser.add_argument("--json", action="store_true", help="Print one JSON object.")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="rwb-bench-decide-", dir=args.workspace))
    embedder = None
    if args.hash_embedder:
        import core.embed

        embedder = HashEmbedder()
        core.embed.workspace_embedder = lambda _ws: embedder  # training uses it too
    bundle_path = args.bundle or build_bundle(work, args.train)
    from core.bundle import load_bundle

    bundle = load_bundle(bundle_path)
    sequences = requests_of(args.train, args.episodes)
    n_requests = sum(len(s) for s in sequences)
    print(f"{bundle.policy_version}: {n_requests} requests from {len(sequences)} recorded episodes; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)

    ws = Workspace.open(work / "serve-ws")
    fast_clock, naive_clock = ReplayClock(), ReplayClock()
    fast = DecisionEngine(ws, bundle, embedder=embedder, clock=fast_clock,
                          config=ServingConfig(torch_threads=args.torch_threads))
    naive = NaiveEngine(Workspace.open(work / "naive-ws"), bundle, embedder=embedder, clock=naive_clock,
                        config=ServingConfig(audit_synchronous=True, torch_threads=args.torch_threads))
    # warm-up: the first calls load the sentence model, allocate torch buffers, …
    single(fast, fast_clock, sequences[:3], "-warm")
    single(naive, naive_clock, sequences[:3], "-warm")
    f = single(fast, fast_clock, sequences, "")
    r = single(naive, naive_clock, sequences, "")
    # an action served after a time-out changes the rest of that episode: compare the others
    ff, rf = f.pop("finals"), r.pop("finals")
    late = {e for e, _, out in ff + rf if out}
    pairs = [(a, b) for (e, a, _), (_, b, _) in zip(ff, rf) if e not in late]
    same = all(a == b for a, b in pairs)
    thr_fast = batched(fast, fast_clock, sequences, args.batch, "-batch")
    thr_naive = batched(naive, naive_clock, sequences, args.batch, "-batch")
    fast.close()
    naive.close()
    records = audit.stats(ws)["records"]
    ws.close()
    if args.workspace is None:
        shutil.rmtree(work, ignore_errors=True)

    out = {"policy": bundle.policy_version, "requests": n_requests, "rl_boost_share": f["boost_share"],
           "engine": f, "naive": r, "same_actions": same, "compared": len(pairs),
           "batched_decisions_per_s": {"engine": thr_fast, "naive": thr_naive, "batch": args.batch},
           "audit_records": records,
           "load_average": os.getloadavg()[0]}
    if args.json:
        print(json.dumps(out))
        return
    print(f"RL-Boost ran on {f['boost_share']:.0%} of decisions; both engines served the same actions: {same} "
          f"({len(pairs)} decisions compared: the episodes where neither ran out of its time budget)")
    print(f"{'decide() wall ms per request':34} {'engine p50':>11} {'p99':>8} {'naive p50':>11} {'p99':>8} "
          f"{'p99 ratio':>10}")
    for part in ("all", "rde", "rl_boost"):
        a, b = f[part], r[part]
        if a["n"]:
            print(f"{part + ' (n=' + str(a['n']) + ')':34} {a['p50']:11.3f} {a['p99']:8.3f} {b['p50']:11.3f} "
                  f"{b['p99']:8.3f} {b['p99'] / a['p99']:9.1f}×")
    print(f"CPU per decision, all threads: engine {f['cpu_ms_per_decision']:.3f} ms, naive "
          f"{r['cpu_ms_per_decision']:.3f} ms")
    print(f"decide_batch({args.batch}): engine {thr_fast:,.0f} decisions/s, naive {thr_naive:,.0f} decisions/s "
          f"({thr_fast / thr_naive:.1f}×); one at a time: engine {f['per_s']:,.0f}/s, naive {r['per_s']:,.0f}/s")
    target = f["all"]["p99"]
    print(f"target p99 ≤ 2 ms: {'met' if target <= 2.0 else 'NOT met'} ({target:.3f} ms; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs); {records} audit records written")


if __name__ == "__main__":
    main()
