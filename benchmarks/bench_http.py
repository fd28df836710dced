"""What the HTTP decision service (``rwb serve http``, core.serve.serve_http) adds to decide().

    python benchmarks/bench_http.py [--bundle FILE.zip --signer-workspace DIR] [--size production]
                                    [--episodes 80] [--connections 1,8,32] [--hash-embedder]
                                    [--workspace DIR] [--json]

Without ``--bundle`` a policy of ``--size`` is trained and exported the way
``benchmarks/bench_decide.py`` does it (``production``: the 512-d state, 2×256 heads that
``rwb demo`` trains; a few minutes).  The finance sample's episodes after the training ones
become request sequences (state, query, task type, the last tool result of every step).

In one run, on the same requests and the same engine settings (the service's:
:func:`core.serve.serve_http.service_config`):

1. **in-process**: a fresh engine, one ``decide()`` after the other (audit write included);
2. **HTTP**: ``rwb serve http`` in its own process (real uvicorn on a free port) and a
   load generator (httpx, asyncio) holding 1, 8 and 32 connections; each connection sends
   whole episodes, one step after the other (an episode's steps depend on each other), and
   the figure is the round trip of each request.

Both first serve every query once (warm-up, other episode ids), so the sentence model is
off the measured path in both.  Reported: p50/p99 latency, decisions per second, and the
service's overhead per request: the HTTP p50 minus the in-process p50 (at one connection,
and at each level).  The load generator shares the machine with the service: on a 2-core
machine the figures at 8 and 32 connections include its CPU.
"""

from __future__ import annotations

import argparse
import asyncio
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
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_decide import build_bundle, episodes_of, percentiles  # noqa: E402
from core.records.store import Workspace  # noqa: E402
from core.access.users import LOCAL_ADMIN  # noqa: E402

#: `rwb ARGS` with the hash embedder in place of the sentence model (--hash-embedder).
HASHED_RWB = ("import sys, core.base.embed; core.base.embed.workspace_embedder = lambda _ws: core.base.embed.HashEmbedder(); "
              "from core.cli import main; sys.exit(main(sys.argv[1:]))")


# =========================================================================== the requests
def request_episodes(first: int, n: int) -> list[list[dict]]:
    """Request sequences of ``n`` recorded episodes of the finance sample after ``first``."""
    return [[step.request for step in steps] for steps in episodes_of(first, n)]


def renamed(episodes: list[list[dict]], suffix: str) -> list[list[dict]]:
    """The same episodes under new ids (new episodes for an engine that served them)."""
    return [[{**r, "episode_id": r["episode_id"] + suffix} for r in steps] for steps in episodes]


# =========================================================================== in process
def in_process(ws_path: Path, bundle_path: Path, episodes: list[list[dict]], config: Any, embedder: Any) -> dict:
    """decide() one request after the other on a fresh engine (warm-up first)."""
    from core.serve.serving import load

    ws = Workspace.open(ws_path)
    options = {"embedder": embedder} if embedder is not None else {}
    engine = load(str(bundle_path), ws=ws, config=config, **options)
    try:
        engine.ready(timeout=120)
        for steps in renamed(episodes, "-warm"):
            for r in steps:
                engine.decide(r)
        engine.ready(timeout=120)  # the warm-up's query embeddings are done
        ms: list[float] = []
        t_start = time.perf_counter()
        for steps in renamed(episodes, "-inproc"):
            for r in steps:
                t0 = time.perf_counter()
                engine.decide(r)
                ms.append((time.perf_counter() - t0) * 1000.0)
        wall = time.perf_counter() - t_start
    finally:
        engine.close()
        ws.close()
    return {**percentiles(ms), "per_s": len(ms) / wall}


# =========================================================================== the service
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_service(ws_path: Path, bundle_path: Path, port: int, hashed: bool, log: Path) -> subprocess.Popen:
    """``rwb serve http`` on ``port``, once it is ready."""
    import httpx

    cmd = [sys.executable, "-c", HASHED_RWB] if hashed else [sys.executable, "-m", "core.cli"]
    env = {**os.environ, "RWB_WORKSPACE": str(ws_path), "HF_HUB_OFFLINE": "1"}
    env.pop("RWB_SERVE_TOKEN", None)
    proc = subprocess.Popen([*cmd, "serve", "http", "--policy", str(bundle_path), "--port", str(port), "--json"],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log.open("w"))
    deadline = time.monotonic() + 300
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


async def load(url: str, episodes: list[list[dict]], connections: int) -> dict:
    """Send every episode's steps in order over ``connections`` concurrent connections;
    round-trip ms of each request and decisions per second."""
    import httpx

    queue: asyncio.Queue[list[dict]] = asyncio.Queue()
    for steps in episodes:
        queue.put_nowait(steps)
    ms: list[float] = []
    failed = 0
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60.0) as client:
        async def worker() -> None:
            nonlocal failed
            while not queue.empty():
                for r in queue.get_nowait():
                    t0 = time.perf_counter()
                    resp = await client.post("/v1/decide", json=r)
                    ms.append((time.perf_counter() - t0) * 1000.0)
                    failed += resp.status_code != 200

        t_start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(connections)))
        wall = time.perf_counter() - t_start
    return {**percentiles(ms), "per_s": len(ms) / wall, "failed": failed}


def over_http(ws_path: Path, bundle_path: Path, episodes: list[list[dict]], levels: list[int], hashed: bool,
              log: Path) -> dict[int, dict]:
    port = free_port()
    proc = start_service(ws_path, bundle_path, port, hashed, log)
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(load(url, renamed(episodes, "-warm"), 4))
        import httpx

        httpx.get(f"{url}/readyz", timeout=60)
        time.sleep(1.0)  # the warm-up's query embeddings finish in the service's background
        return {c: asyncio.run(load(url, renamed(episodes, f"-c{c}"), c)) for c in levels}
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


# =========================================================================== the run
def trusting(path: Path, signer: Path) -> Path:
    """A workspace at ``path`` that trusts the key of the workspace ``signer``."""
    from core.access import keys

    src = Workspace.open(signer, create=False)
    pem = path.parent / f"{path.name}-signer.pem"
    pem.write_text(keys.show(src).public_key_pem)
    src.close()
    ws = Workspace.open(path)
    keys.trust(ws, LOCAL_ADMIN, pem)
    ws.close()
    return path


def measure(work: Path, args: argparse.Namespace) -> dict:
    from core.govern.bundle import load_bundle
    from core.serve.serve_http import service_config

    embedder = None
    if args.hash_embedder:
        import core.base.embed

        embedder = core.base.embed.HashEmbedder()
        core.base.embed.workspace_embedder = lambda _ws: embedder  # training uses it too
    if args.bundle:
        bundle_path, signer = Path(args.bundle), Path(args.signer_workspace or Path(args.bundle).parents[2])
    else:
        bundle_path, signer = build_bundle(work, args.train, args.size), work / "train-ws"
    bundle = load_bundle(bundle_path)
    episodes = request_episodes(args.train, args.episodes)
    n = sum(len(s) for s in episodes)
    print(f"{bundle.policy_version}: {n} requests in {len(episodes)} episodes per level …", flush=True)
    config = service_config(model_process=not args.hash_embedder)
    local = in_process(trusting(work / "inproc-ws", signer), bundle_path, episodes, config, embedder)
    http = over_http(trusting(work / "http-ws", signer), bundle_path, episodes, args.connections,
                     args.hash_embedder, work / "service.log")
    return {"policy_version": bundle.policy_version, "requests": n, "episodes": len(episodes),
            "embedder": "hash" if args.hash_embedder else "MiniLM (core.base.embed)",
            "in_process": local, "http": {str(c): r for c, r in http.items()},
            "overhead_ms": {str(c): r["p50"] - local["p50"] for c, r in http.items()},
            "load_average": os.getloadavg()[0], "cpus": os.cpu_count()}


def print_report(out: dict) -> None:
    print(f"\n{out['policy_version']}, {out['embedder']} embedder, {out['requests']} requests per row, "
          f"{out['cpus']} CPUs, load average {out['load_average']:.1f}")
    print(f"{'mode':<12}{'connections':>12}{'p50 ms':>9}{'p99 ms':>9}{'decisions/s':>13}{'overhead p50 ms':>17}")
    r = out["in_process"]
    print(f"{'in-process':<12}{1:>12}{r['p50']:>9.2f}{r['p99']:>9.2f}{r['per_s']:>13.0f}{'':>17}")
    for c, r in out["http"].items():
        note = f"  ({r['failed']} failed)" if r["failed"] else ""
        print(f"{'HTTP':<12}{c:>12}{r['p50']:>9.2f}{r['p99']:>9.2f}{r['per_s']:>13.0f}"
              f"{out['overhead_ms'][c]:>17.2f}{note}")
    one = out["http"].get("1")
    best = max(out["http"].items(), key=lambda kv: kv[1]["per_s"])
    lead = (f"HTTP adds {out['overhead_ms']['1']:.2f} ms per request at p50 over one connection "
            f"({one['p50']:.2f} vs {out['in_process']['p50']:.2f} ms in-process); " if one else "")
    print(f"\nsummary: {lead}peak {best[1]['per_s']:.0f} decisions/s at {best[0]} connections "
          f"(in-process one after the other: {out['in_process']['per_s']:.0f}/s)")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", help="Serve this bundle instead of training one.")
    p.add_argument("--signer-workspace", help="The workspace that exported --bundle (its key is trusted); "
                                              "default: the bundle's <workspace>/artifacts/bundles/ parent.")
    p.add_argument("--size", choices=("small", "production"), default="production",
                   help="The policy trained without --bundle.")
    p.add_argument("--train", type=int, default=150, help="Episodes of the finance sample to train on.")
    p.add_argument("--episodes", type=int, default=80, help="Recorded episodes (after the training ones) served "
                                                            "per row.")
    p.add_argument("--connections", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32],
                   help="Concurrent connections of the load generator, comma-separated.")
    p.add_argument("--hash-embedder", action="store_true",
                   help="A hash embedder instead of the sentence model (training and serving).")
    p.add_argument("--workspace", help="Keep the work folder under this directory.")
    p.add_argument("--json", action="store_true", help="Print one JSON object.")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    work = Path(tempfile.mkdtemp(prefix="rwb-bench-http-", dir=args.workspace))
    try:
        out = measure(work, args)
    finally:
        if args.workspace is None:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(out))
    else:
        print_report(out)


if __name__ == "__main__":
    main()
