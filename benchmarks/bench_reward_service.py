"""Trajectories scored per second: in-process, over HTTP (``rwb reward serve``), and by calling
``rwb reward score`` once per trajectory.

    python benchmarks/bench_reward_service.py [--trajectories 384] [--template tool_agent]
                                              [--cli-calls 3] [--rounds 3] [--hash-embedder] [--json]

In one run, on the same trajectories — recorded AgentDojo runs (datasets/real/agentdojo), as chat
messages through :func:`core.rewards.trajectory.episode_messages` — and the same template:

1. **in-process**: ``TrajectoryScorer.score_batch`` over batches of 1 and of 64;
2. **HTTP**: ``rwb reward serve`` in its own process (real uvicorn on a free port, one worker) and
   a load generator (httpx, asyncio) posting ``/v1/score`` batches of 1 and of 64 over 1 and 8
   concurrent connections;
3. **CLI**: ``rwb reward score --template T --episodes ONE.jsonl --json``, a new process per
   trajectory; ``--cli-calls`` calls are timed and the time per trajectory is extrapolated from them.

The embedding caches are warmed the same way on both scoring paths: with the sentence model loaded,
the in-process scorer and the service each score every trajectory once (batches of 64), so every
text is in their in-memory caches; that first pass is reported apart (every text new: embedding
included).  The table is of the passes after it, in interleaved rounds (the best of each).  The
CLI's workspace cache is warmed by one untimed call on each timed file.  The HTTP answers are
checked against the in-process scores.  Goals (printed met / NOT met): HTTP with batches of 64
within 1.5× of in-process per trajectory; the in-process scorer at least 100× faster than one CLI
call per trajectory.  The load generator shares the machine with the service: on a 2-core machine
the 8-connection figures include its CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DATA = ROOT / "datasets" / "real" / "agentdojo" / "episodes.jsonl"
#: `rwb ARGS` with the hash embedder in place of the sentence model (--hash-embedder).
HASHED_RWB = ("import sys, core.base.embed as e; e.Embedder.reader = lambda self, **kw: e.HashEmbedder(); "
              "e.workspace_embedder = lambda _ws: e.HashEmbedder(); "
              "from core.cli import main; sys.exit(main(sys.argv[1:]))")
HTTP_GOAL = 1.5
CLI_GOAL = 100.0


# =========================================================================== the trajectories
def trajectories(n: int, work: Path) -> tuple[list[dict], list[str]]:
    """The first ``n`` recorded runs as trajectories, and their source lines (the CLI's input)."""
    from core.data.importers.api import read_file
    from core.rewards.trajectory import episode_messages

    lines = DATA.read_text(encoding="utf-8").splitlines()[:n]
    path = work / "episodes.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    parsed = read_file(path, reward_key="success", id_key="eid")
    return [{"messages": episode_messages(ep), "id": ep.episode_id} for ep in parsed.episodes], lines


def batches(items: list[dict], size: int) -> list[list[dict]]:
    return [items[i:i + size] for i in range(0, len(items), size)]


# =========================================================================== in process
def in_process_pass(scorer: Any, items: list[dict], size: int) -> tuple[float, list[dict]]:
    """Seconds per trajectory of one ``score_batch`` pass over batches of ``size``, and the scores."""
    scores: list[dict] = []
    t0 = time.perf_counter()
    for b in batches(items, size):
        scores.extend(s.to_dict() for s in scorer.score_batch(b))
    return (time.perf_counter() - t0) / len(items), scores


# =========================================================================== the service
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_service(template: str, port: int, hashed: bool, work: Path) -> subprocess.Popen:
    """``rwb reward serve`` on ``port``, once ``/readyz`` answers 200."""
    import httpx

    cmd = [sys.executable, "-c", HASHED_RWB] if hashed else [sys.executable, "-m", "core.cli"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RWB_WORKSPACE": str(work / "service-ws")}
    env.pop("RWB_REWARD_TOKEN", None)
    log = work / "service.log"
    proc = subprocess.Popen([*cmd, "reward", "serve", "--template", template, "--port", str(port), "--json"],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log.open("w"))
    deadline = time.monotonic() + 600
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"the service did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


async def post_all(url: str, groups: list[list[dict]], connections: int) -> tuple[float, list[dict], int]:
    """Post every batch to ``/v1/score`` over ``connections`` concurrent connections (one: a plain
    client, request after request): the wall time, the scores in order, and how many failed."""
    import httpx

    if connections == 1:  # one caller posting batch after batch, as a trainer's reward call does
        answers1: list[dict] = []
        failed1 = 0
        with httpx.Client(base_url=url, timeout=300.0) as sync:
            t0 = time.perf_counter()
            for g in groups:
                resp = sync.post("/v1/score", json={"trajectories": g})
                if resp.status_code == 200:
                    answers1.extend(resp.json()["scores"])
                else:
                    failed1 += 1
            return time.perf_counter() - t0, answers1, failed1
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(groups)):
        queue.put_nowait(i)
    answers: dict[int, list[dict]] = {}
    failed = 0
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=300.0) as client:
        async def worker() -> None:
            nonlocal failed
            while not queue.empty():
                i = queue.get_nowait()
                resp = await client.post("/v1/score", json={"trajectories": groups[i]})
                if resp.status_code == 200:
                    answers[i] = resp.json()["scores"]
                else:
                    failed += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(connections)))
        wall = time.perf_counter() - t0
    return wall, [s for i in sorted(answers) for s in answers[i]], failed


def side_by_side(items: list[dict], template: str, hashed: bool, rounds: int, work: Path) -> dict[str, Any]:
    """In-process and HTTP passes, interleaved in ``rounds`` rounds after one warm-up pass on each
    path (timed: the first pass); the best round of each setting, and the two paths' scores of the
    last round."""
    from core.base.embed import HashEmbedder
    from core.rewards.trajectory import TrajectoryScorer

    from core.serve.reward_service import EmbeddingLRU

    # the scorer's own in-memory cache; the hash embedder has none, so it gets the service's
    scorer = TrajectoryScorer(template, embedder=EmbeddingLRU(HashEmbedder()) if hashed else None)
    port = free_port()
    proc = start_service(template, port, hashed, work)
    url = f"http://127.0.0.1:{port}"
    try:
        # warm-up, timed as the first pass: every text new to the caches; the model is loaded on both
        # sides before it (the service loads it before /readyz answers 200)
        getattr(scorer.embedder, "warm_up", lambda: None)()
        first_local, _ = in_process_pass(scorer, items, 64)
        first_wall, _, _ = asyncio.run(post_all(url, batches(items, 64), 1))
        gc.collect()
        gc.freeze()  # as the service does after its warm-up: full collections skip what is loaded
        local: dict[str, list[float]] = {"1": [], "64": []}
        http: dict[str, list[float]] = {f"{b}x{c}": [] for b in (1, 64) for c in (1, 8)}
        failed = dict.fromkeys(http, 0)
        local_scores: list[dict] = []
        http_scores: list[dict] = []
        for r in range(rounds):
            print(f"round {r + 1} of {rounds} …", flush=True)
            for size in (1, 64):
                seconds, local_scores = in_process_pass(scorer, items, size)
                local[str(size)].append(seconds)
                for connections in (1, 8):
                    key = f"{size}x{connections}"
                    wall, got, bad = asyncio.run(post_all(url, batches(items, size), connections))
                    http[key].append(wall / len(items))
                    failed[key] += bad
                    if key == "64x1":
                        http_scores = got
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    worst = max((abs(a["score"] - b["score"]) for a, b in zip(local_scores, http_scores)), default=float("nan"))
    return {"first_pass": {"in_process": first_local, "http": first_wall / len(items)},
            "in_process": {k: min(v) for k, v in local.items()},
            "http": {k: {"per_trajectory_s": min(v), "failed": failed[k]} for k, v in http.items()},
            "rounds": rounds, "largest_score_difference": worst,
            "http_equals_in_process": len(http_scores) == len(local_scores) == len(items) and worst <= 1e-6}


# =========================================================================== the CLI
def cli_calls(lines: list[str], template: str, calls: int, hashed: bool, work: Path) -> dict[str, Any]:
    """Seconds of ``rwb reward score`` on one trajectory, a new process per call (``calls`` timed
    on the first ``calls`` trajectories, each after one untimed call that warms the workspace's
    embedding cache)."""
    cmd = [sys.executable, "-c", HASHED_RWB] if hashed else [sys.executable, "-m", "core.cli"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RWB_WORKSPACE": str(work / "cli-ws")}
    times = []
    for i, line in enumerate(lines[:calls]):
        one = work / f"one-{i}.jsonl"
        one.write_text(line + "\n", encoding="utf-8")
        argv = [*cmd, "reward", "score", "--template", template, "--episodes", str(one), "--json"]
        subprocess.run(argv, cwd=ROOT, env=env, check=True, capture_output=True)  # warm-up
        t0 = time.perf_counter()
        subprocess.run(argv, cwd=ROOT, env=env, check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
    return {"calls": len(times), "per_trajectory_s": sum(times) / len(times), "each_s": times}


# =========================================================================== the run
def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    items, lines = trajectories(args.trajectories, work)
    print(f"{len(items)} AgentDojo trajectories, template {args.template}, "
          f"{'hash' if args.hash_embedder else 'MiniLM (core.base.embed)'} embedder …", flush=True)
    paths = side_by_side(items, args.template, args.hash_embedder, args.rounds, work)
    cli = cli_calls(lines, args.template, args.cli_calls, args.hash_embedder, work)
    return {"trajectories": len(items), "template": args.template,
            "embedder": "hash" if args.hash_embedder else "MiniLM (core.base.embed)", **paths, "cli": cli,
            "cpus": os.cpu_count(), "load_average": os.getloadavg()[0]}


def report(out: dict[str, Any]) -> list[str]:
    """The table and the goals, as lines."""
    base = out["in_process"]["64"]
    lines = [f"{out['trajectories']} AgentDojo trajectories, {out['template']}, {out['embedder']} embedder, "
             f"{out['cpus']} CPUs, load average {out['load_average']:.1f}; caches warmed by a first pass; "
             f"best of {out['rounds']} interleaved rounds",
             f"{'path':<34}{'traj/s':>10}{'per traj ms':>13}{'× in-process b64':>18}"]

    def row(label: str, seconds: float) -> None:
        lines.append(f"{label:<34}{1.0 / seconds:>10.1f}{seconds * 1000:>13.2f}{seconds / base:>18.2f}")

    for size in ("1", "64"):
        row(f"in-process, batch {size}", out["in_process"][size])
    for key, r in out["http"].items():
        size, conns = key.split("x")
        row(f"HTTP, batch {size}, {conns} conn{'s' if conns != '1' else ''}"
            + (f" ({r['failed']} failed)" if r["failed"] else ""), r["per_trajectory_s"])
    cli = out["cli"]
    row(f"CLI, a process per trajectory ({cli['calls']} timed)", cli["per_trajectory_s"])
    http64 = out["http"]["64x1"]["per_trajectory_s"] / base
    http64_8 = out["http"]["64x8"]["per_trajectory_s"] / base
    cli_ratio = cli["per_trajectory_s"] / base
    first = out["first_pass"]
    lines.append(f"first pass (every text new to the embedding caches), batch 64, 1 connection: in-process "
                 f"{first['in_process'] * 1000:.2f} ms, HTTP {first['http'] * 1000:.2f} ms per trajectory "
                 f"({first['http'] / first['in_process']:.2f}x)")
    lines.append(f"HTTP answers equal the in-process scores: {out['http_equals_in_process']} "
                 f"(largest difference {out['largest_score_difference']:.3g})")
    lines.append(f"goal HTTP batch 64 within {HTTP_GOAL:g}x of in-process per trajectory: "
                 f"{'met' if http64 <= HTTP_GOAL else 'NOT met'} ({http64:.2f}x at 1 connection, {http64_8:.2f}x at 8)")
    lines.append(f"goal in-process >= {CLI_GOAL:g}x faster than one CLI call per trajectory: "
                 f"{'met' if cli_ratio >= CLI_GOAL else 'NOT met'} ({cli_ratio:,.0f}x; the CLI figure is "
                 f"extrapolated from {cli['calls']} calls)")
    return lines


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trajectories", type=int, default=384, help="Recorded runs scored (at most 582).")
    p.add_argument("--template", default="tool_agent", help="Template served and scored.")
    p.add_argument("--cli-calls", type=int, default=3, help="rwb reward score calls timed.")
    p.add_argument("--rounds", type=int, default=3, help="Interleaved rounds of the in-process and HTTP passes.")
    p.add_argument("--hash-embedder", action="store_true", help="A hash embedder instead of the sentence model.")
    p.add_argument("--json", action="store_true", help="Print one JSON object.")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    work = Path(tempfile.mkdtemp(prefix="rwb-bench-reward-service-"))
    try:
        out = measure(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(out))
    else:
        print("\n".join(report(out)))
    return 0 if out["http_equals_in_process"] else 1


if __name__ == "__main__":
    sys.exit(main())
