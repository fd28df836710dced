"""Latency and throughput of the decision engine's decide() (core.serve.serving), audit write included.

    python benchmarks/bench_decide.py [--size small|production | --bundle FILE.zip] [--episodes 100]
                                      [--rate 10] [--max-gap 1.0] [--batch 64] [--hash-embedder] [--torch-threads 1]
                                      [--switch-interval-ms 0.5] [--rounds 5]
                                      [--serve-precision float16|bfloat16|int8|distilled ...]
                                      [--workspace DIR] [--json]

Without ``--bundle`` it builds one the way the workbench does: the finance sample imported
into a temporary workspace, a short PPO run, ``export_bundle`` — of a small policy (64-d
encoded state, 64-wide heads; about a minute) or, with ``--size production``, of the
network ``rwb demo`` trains (512-d state, 256-wide heads, 1.7M weights; a few minutes).
``--bundle`` serves another, e.g. ``demo-workspace/artifacts/bundles/finance_risk-0.1.0.zip``.  The
recorded episodes after the training ones (about six steps each) become request
sequences: state, query, task type and the last tool result of every step.  The sentence
model is the real offline MiniLM (``core.base.embed``) unless ``--hash-embedder`` is given.

1. **Realistic replay** (the headline): episodes start ``--rate`` per second, and each
   episode's next request comes after its recorded gap (capped at ``--max-gap`` seconds),
   so episodes overlap and a new episode's query is embedded while other episodes are
   served.  One client calls decide() at the due times; the figure is decide()'s wall
   time.  Requests are reported apart: an ongoing episode's (its query embedded already),
   a new episode's first request answered without the embedding, requests that had to
   wait for a new query's embedding (RL-Boost on a query nobody embedded yet), and the mix.
   The default engine defers an RL-Boost whose query is not embedded yet (the baseline
   answers; ``ServingConfig.wait_for_intent``) and runs the sentence model in a child
   process (``ServingConfig.model_process``); the same engine with the model in the
   serving process, and one that waits for the embeddings, replay the same episodes for
   comparison.  **The machine's own floor** is the reference for the replay's tail: a fixed
   pure-Python computation as long as decide()'s p50 in the replay, run at the same due
   times with no engine about; its p99 is what the machine's scheduling (and a
   hypervisor's steal, read from /proc/stat and printed) does to work of that length.
   Section 3 has the same reference for its requests, one after the other.  The machine's
   cold penalty is measured too: the policy's forward on one fixed state, one call after
   the other and at the replay's due times.
2. **Where the time goes**: the same episodes one request after the other on a fresh
   engine without prefetching, each stage of decide() timed: episode state, masks (with
   the review-rule check), tree, policy (RL-Boost without its embedding), sentence
   embedding, audit write, and the rest (validation, arbitration, metrics, the hand-off to
   the policy's thread).
3. **A naive reference** (nothing cached in the engine — its embedder is the workspace's
   storing one, whose text-hash cache still answers a query it embedded before —, one
   synchronous audit commit per decision, the review rules read and the masks re-compiled
   and evaluated every time) replays the episodes one after the other: both engines must
   serve the same actions (decisions where either ran out of its time budget aside).
4. **decide_batch** throughput: ``--batch`` episodes advance one step per call, first on
   new queries (their embeddings included), then again on queries already embedded.

5. **The tail ratio** (the figure that counts on a shared machine, printed first in the
   verdict): decide()'s p99 over **the machine's floor**'s p99.  The floor is a fixed
   pure-Python computation (:func:`_spin`: no allocation, I/O, lock or other thread)
   scaled to last as long as decide()'s p50, run as many times as there were requests
   with no engine about, right after them: *paced* at the replay's due times (section 1)
   and *back to back* (the default engine, every request one after the other on new
   episode ids whose queries it embedded already).  Its p99 is what this machine's
   scheduling does to work of decide()'s typical length, so a ratio of 1 means decide()'s
   tail is the machine's; above it is the engine's own (its slower requests, its
   threads, its collections, its memory traffic after an idle gap).  Goal ≤ 1.25× both.
   A p99 of one replay is its sixth-slowest request, and one stall of the machine moves
   it, so ``--rounds`` (default 5) repeats the round (replay and floor) on fresh engines
   and the ratio is taken over all of them pooled; each round's own ratio is printed too.

**The full policy and its served copy side by side** (``--serve-precision``, one or more of
float16, bfloat16, int8, distilled): the run is exported once per precision as well
(``export_bundle(serve_precision=)``; a copy export refuses is reported with its reason), or
the bundles given by ``--bundle`` twice or more are compared.  Only section 5 runs then, for
every bundle, its rounds interleaved (round k of each bundle, then round k + 1), so a slower
spell of the machine reaches them alike; each copy's agreement with the trained policy on
held-out states (from its manifest) is printed beside its tail ratios.

The engine's clock runs on the recorded step times (each episode shifted to its start in
the replay), so every engine sees the same trace inputs.  Target: p99 ≤ 2 ms per request.
The machine's load average is printed: on a shared machine wall-clock percentiles grow with it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from core.access import audit  # noqa: E402
from core.base.embed import HashEmbedder  # noqa: E402
from core.serve.serving import DecisionEngine, ServingConfig  # noqa: E402
from core.records.store import Workspace  # noqa: E402
from core.access.users import LOCAL_ADMIN  # noqa: E402

TARGET_MS = 2.0
#: Goal of the tail ratio: decide()'s p99 over the machine floor's p99 (section 5).
TAIL_RATIO_GOAL = 1.25


class TimedEmbedder:
    """Wraps the engine's embedder and records every encode call: its texts, start and end
    (perf_counter) — so a request can be told to have waited for its query's embedding."""

    def __init__(self, inner: Any):
        self.inner = inner
        #: [texts, start, end] of every call; end is inf while the call runs
        self.calls: list[list] = []
        self._lock = threading.Lock()

    def warm_up(self) -> None:
        """The engine loads the sentence model at start (not timed as an embedding)."""
        getattr(self.inner, "warm_up", lambda: None)()

    def encode(self, texts):
        call = [frozenset(texts), time.perf_counter(), float("inf")]
        with self._lock:
            self.calls.append(call)
        try:
            return self.inner.encode(texts)
        finally:
            call[2] = time.perf_counter()

    def embedded_during(self, query: str, t0: float, t1: float) -> bool:
        """Whether an embedding of ``query`` ran (partly) between t0 and t1."""
        with self._lock:
            return any(query in texts and s < t1 and e > t0 for texts, s, e in self.calls)

    def per_text_ms(self) -> np.ndarray:
        """Milliseconds per text of every finished call."""
        with self._lock:
            return np.array([(e - s) * 1e3 / len(texts) for texts, s, e in self.calls if e < float("inf")])


# =========================================================================== inputs
#: The policies the bench trains (``--size``): the network of the bench's own small policy,
#: and the production-size one ``rwb demo`` trains (core.sample.demo.FULL: PPOConfig's default
#: 512-d encoder and 2×256 heads, three critics) — trained briefly, which changes its
#: weights but not the arithmetic a decision costs.
SIZES = {"small": {"hidden": 64, "n_critics": 2, "encoder": {"dim": 64}},
         "production": {"hidden": 256, "n_critics": 3, "encoder": {}}}


def build_bundle(work: Path, n_train: int, size: str = "small", precisions: tuple[str, ...] = ()
                 ) -> Path | dict[str, Path | str]:
    """Import the finance sample, train a policy of ``size`` (:data:`SIZES`), export its bundle;
    with ``precisions``, export the run once more per served copy and return ``{"full": path,
    precision: path, or the reason export refused that copy}``."""
    from core.govern.bundle import export_bundle
    from core.data.importers import import_file
    from core.rl.ppo import PPOConfig
    from core.rl.runs import train

    sample = ROOT / "datasets" / "finance" / "sample.jsonl"
    lines = sample.read_text(encoding="utf-8").splitlines()
    subset = work / "train.jsonl"
    subset.write_text("\n".join(lines[:n_train + 1]) + "\n", encoding="utf-8")
    ws = Workspace.open(work / "train-ws")
    import_file(ws, subset, dataset="finance")
    cfg = PPOConfig(total_steps=4096, n_envs=64, rollout_len=16, update_epochs=2, n_minibatches=2, bc_epochs=10,
                    device="cpu", checkpoint_every=100, seed=0, **SIZES[size])
    print(f"training a {size} policy on {n_train} episodes …", flush=True)
    result = train(ws, LOCAL_ADMIN, template="finance_risk", dataset="finance", config=cfg)
    path = export_bundle(ws, LOCAL_ADMIN, result.run_id, work / "finance_risk-bench.zip")
    if not precisions:
        ws.close()
        return path
    out: dict[str, Path | str] = {"full": path}
    for k, precision in enumerate(precisions):
        print(f"exporting its served {precision} copy …", flush=True)
        out[precision] = export_copy(ws, result.run_id, work / f"finance_risk-bench-{precision}.zip", precision,
                                     version=f"0.{k + 2}.0")
    ws.close()
    return out


def export_copy(ws: Workspace, run_id: str, path: Path, precision: str, *, version: str) -> Path | str:
    """The run's bundle with a served copy of ``precision``, or why export refused that copy."""
    from core.base.errors import InputError
    from core.govern.bundle import export_bundle

    try:
        return export_bundle(ws, LOCAL_ADMIN, run_id, path, version=version, serve_precision=precision)
    except InputError as exc:
        return exc.reason


@dataclass(frozen=True)
class Step:
    """One request of a recorded episode: the request, its recorded time (seconds, from
    the episode's start) and the recorded gap before it."""

    request: dict
    t: float
    gap: float


def episodes_of(first: int, n: int) -> list[list[Step]]:
    """Recorded episodes of the finance sample (after the training ones) as request sequences."""
    from datetime import datetime

    from core.data.importers import read_file

    out = []
    for ep in read_file(ROOT / "datasets" / "finance" / "sample.jsonl").episodes[first:first + n]:
        steps, prev, start, last = [], None, None, None
        for k, step in enumerate(ep.steps):
            when = datetime.fromisoformat(step.timestamp).timestamp() if step.timestamp else float(k)
            start = when if start is None else start
            req = {"episode_id": ep.episode_id, "query": ep.task.query, "task_type": ep.task.task_type,
                   "state": (step.observation or {}).get("state") or {}}
            if prev is not None and (prev.tool_result is not None or prev.tool_error is not None):
                req["last_result"] = {"tool": prev.action.tool or prev.action.kind, "result": prev.tool_result,
                                      "error": prev.tool_error, "latency_ms": prev.latency_ms}
            steps.append(Step(req, when - start, 0.0 if last is None else when - last))
            prev, last = step, when
        out.append(steps)
    return out


class ReplayClock:
    """The engines' clock: the recorded time of the step being decided (shifted to its
    episode's start in the replay), so the trace's Δt is the logged one everywhere."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def renamed(request: dict, suffix: str) -> dict:
    """The request under another episode id (a new episode for an engine that saw it)."""
    return {**request, "episode_id": request["episode_id"] + suffix}


def percentiles(ms: list[float]) -> dict:
    """n, p50 and p99 of wall times in milliseconds (None when empty)."""
    a = np.asarray(ms, dtype=np.float64)
    if not a.size:
        return {"n": 0, "p50": None, "p99": None}
    return {"n": int(a.size), "p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99))}


# =========================================================================== 1. the realistic replay
def schedule(episodes: list[list[Step]], rate: float, max_gap: float) -> list[tuple[float, int, int]]:
    """``(due second, episode, step)`` of every request, in due order: episode i starts at
    i / rate, its steps follow their recorded gaps, each capped at ``max_gap``."""
    due = []
    for i, steps in enumerate(episodes):
        t = i / rate
        for k, step in enumerate(steps):
            t += min(step.gap, max_gap)
            due.append((t, i, k))
    return sorted(due)


def replay(engine: DecisionEngine, clock: ReplayClock, embedder: TimedEmbedder, episodes: list[list[Step]],
           rate: float, max_gap: float) -> dict:
    """Serve the episodes on their schedule (one client, decide() at each due time) and
    sort every request's wall time into its category."""
    cats: dict[str, list[float]] = {"ongoing": [], "first_ready": [], "deferred": [], "waited_embedding": [],
                                    "all": []}
    finals, late, boosted = {}, [], []
    start, cpu0, steal0 = time.perf_counter(), time.process_time(), cpu_ticks()
    for due, i, k in schedule(episodes, rate, max_gap):
        wait = start + due - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        step = episodes[i][k]
        clock.t = i / rate + step.t
        t0 = time.perf_counter()
        d = engine.decide(step.request)
        t1 = time.perf_counter()
        ms = (t1 - t0) * 1e3
        waited = d.rl_boost and not d.intent_pending and embedder.embedded_during(step.request["query"], t0, t1)
        cats["waited_embedding" if waited else "deferred" if d.intent_pending else "first_ready" if k == 0
             else "ongoing"].append(ms)
        cats["all"].append(ms)
        if d.rl_boost and not d.intent_pending:
            boosted.append(ms)
        finals[(i, k)] = (d.final_action, d.timed_out or d.intent_pending)
        late.append(max(-wait, 0.0) * 1e3)
    engine.flush()
    n = len(cats["all"])
    return {**{c: percentiles(v) for c, v in cats.items()},
            "first_requests": sum(1 for eps in episodes if eps), "rl_boost": percentiles(boosted),
            "all_ms": cats["all"], "rl_boost_ms": boosted,
            "cpu_ms_per_decision": 1e3 * (time.process_time() - cpu0) / n,
            "client_late_ms_p99": float(np.percentile(late, 99)), "steal": steal_share(steal0, cpu_ticks()),
            "finals": finals}


def cpu_ticks() -> tuple[int, int] | None:
    """``(steal, total)`` ticks of all CPUs since boot (/proc/stat; None where there is none):
    steal is the time the hypervisor ran something else while a CPU of this machine had work."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (ticks[7], sum(ticks[:8])) if len(ticks) >= 8 else None


def steal_share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The share of CPU time stolen by the hypervisor between two :func:`cpu_ticks`."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


# =========================================================================== 1b. the machine's floor and cold penalty
def _spin(n: int) -> int:
    """Fixed pure-Python work, the same cost per iteration however many (the numbers stay
    small): no allocation to speak of, no I/O, no lock, no other thread."""
    x = 1
    for _ in range(n):
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF
    return x


def spin_iterations(chunk_ms: float) -> int:
    """How many :func:`_spin` iterations take ``chunk_ms`` on this machine now: the median of
    a few hot runs (the machine's speed drifts, so the floor's own p50 is reported beside
    its p99)."""
    n = 20_000
    for _ in range(4):
        runs = []
        for _ in range(21):
            t0 = time.perf_counter()
            _spin(n)
            runs.append(time.perf_counter() - t0)
        n = max(int(n * chunk_ms / 1e3 / float(np.median(runs))), 1)
    return n


def machine_floor(due: list[float] | None, count: int, chunk_ms: float) -> dict:
    """The reference for decide()'s wall-clock tail: a fixed pure-Python computation that
    takes about ``chunk_ms`` (decide()'s p50), run ``count`` times — at the due seconds ``due``
    (the replay's schedule) or one after the other (None) — with no engine, thread, file or
    sentence model about.  Its p99 is what this machine's scheduling (and a hypervisor's
    steal) does to work of that length; none of it is the engine's.  Nothing to compare
    with (no request, or no p50): empty percentiles."""
    if not count or not chunk_ms:
        return {**percentiles([]), "chunk_ms": chunk_ms, "steal": None, "wall_ms": []}
    n = spin_iterations(chunk_ms)
    wall, start, steal0 = [], time.perf_counter(), cpu_ticks()
    for k in range(count):
        wait = 0.0 if due is None else start + due[k] - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        t0 = time.perf_counter()
        _spin(n)
        wall.append((time.perf_counter() - t0) * 1e3)
    return {**percentiles(wall), "chunk_ms": chunk_ms, "steal": steal_share(steal0, cpu_ticks()), "wall_ms": wall}


def policy_forward(bundle: Any) -> Callable[[], Any] | None:
    """A call of the served policy's numpy forward on one fixed smoke state (None when the
    policy serves through torch): fixed numpy work of the engine's own kind."""
    from core.serve.serving import PolicyRuntime

    fast = PolicyRuntime(bundle).fast
    if fast is None:
        return None
    obs = {k: v[:1].numpy() for k, v in bundle.smoke_obs().items()}
    return lambda: fast.full(obs)


def cold_penalty(work: Callable[[], Any], due: list[float]) -> dict:
    """The same fixed ``work`` one call after the other and at the due seconds ``due``: the
    p50 of each (µs) and their ratio — what the machine does to that work after an idle gap
    (caches and predictors gone cold), independent of the engine."""
    def timed() -> float:
        t0 = time.perf_counter()
        work()
        return (time.perf_counter() - t0) * 1e6

    for _ in range(50):
        timed()
    hot = [timed() for _ in range(len(due))]
    paced, start = [], time.perf_counter()
    for t in due:
        wait = start + t - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        paced.append(timed())
    out = {"back_to_back_us": float(np.median(hot)), "paced_us": float(np.median(paced))}
    return {**out, "ratio": out["paced_us"] / out["back_to_back_us"]}


# =========================================================================== 2. where the time goes
class Stages:
    """Times named stages of the requests of a sequential replay by wrapping the engine's
    callables (instance attributes, restored afterwards)."""

    def __init__(self) -> None:
        self.now: dict[str, float] = {}
        self.rows: list[dict[str, float]] = []

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.now[name] = self.now.get(name, 0.0) + (time.perf_counter() - t0) * 1e3
        return timed

    @contextlib.contextmanager
    def patched(self, targets: list[tuple[Any, str, str]]) -> Iterator[None]:
        """Wrap ``getattr(obj, attr)`` as stage ``name`` for each ``(obj, attr, name)``."""
        for obj, attr, name in targets:
            setattr(obj, attr, self.wrap(name, getattr(obj, attr)))
        try:
            yield
        finally:
            for obj, attr, _ in targets:
                delattr(obj, attr)


def stage_breakdown(engine: DecisionEngine, clock: ReplayClock, embedder: TimedEmbedder,
                    episodes: list[list[Step]], rate: float) -> tuple[dict, dict]:
    """Each stage's mean per request and p50/p99 per call, and the requests' wall-time
    percentiles without and with a sentence embedding on their path (sequential requests,
    no prefetching: a new query is embedded by the RL-Boost that needs it)."""
    rt, st = engine.runtime, Stages()
    targets = [(engine, "_prepare", "episode state"), (rt, "refresh_masks", "masks"), (rt, "mask", "masks"),
               (rt.bundle.rde, "featurize", "RDE tree"), (rt.bundle.rde, "predict", "RDE tree"),
               (engine, "_propose", "RL-Boost"), (embedder, "encode", "embedding"),
               (engine.audit, "write_batch", "audit write")]
    with st.patched(targets):
        for i, steps in enumerate(episodes):
            for step in steps:
                clock.t = i / rate + step.t
                st.now = {}
                t0 = time.perf_counter()
                engine.decide(renamed(step.request, "-stages"))
                total = (time.perf_counter() - t0) * 1e3
                if "RL-Boost" in st.now:  # the policy's share: its wall time less the embedding in it
                    st.now["RL-Boost"] -= st.now.get("embedding", 0.0)
                st.now["other"] = total - sum(st.now.values())
                st.now["total"] = total
                st.rows.append(st.now)
    engine.flush()
    names = ["episode state", "masks", "RDE tree", "RL-Boost", "embedding", "audit write", "other", "total"]
    stages = {}
    for name in names:
        ran = [r[name] for r in st.rows if name in r]
        stages[name] = {"mean": float(np.mean([r.get(name, 0.0) for r in st.rows])), "calls": len(ran),
                        "p50_per_call": float(np.percentile(ran, 50)) if ran else None,
                        "p99_per_call": float(np.percentile(ran, 99)) if ran else None}
    requests = {"without_embedding": percentiles([r["total"] for r in st.rows if "embedding" not in r]),
                "with_embedding": percentiles([r["total"] for r in st.rows if "embedding" in r])}
    return stages, requests


# =========================================================================== 3. the naive reference
class NaiveEngine(DecisionEngine):
    """The reference: nothing cached in the engine (no intents nor their policy branch, no
    result rows, the review rules read and the masks re-compiled and evaluated every time)
    and one synchronous audit commit per decision (set in its config)."""

    def _prefetch_intents(self, queries):
        pass  # no embedding ahead of time …

    def _intents_of(self, rows):
        for r in rows:  # … none kept by the episode or the engine: embedded on every RL-Boost
            r.intent = None
        with self._intent_lock:
            self._intents.clear()
            self._intent_branches.clear()
        return super()._intents_of(rows)

    def _decide_group(self, rt, rows, now, t0):
        rt._rules_added = -1         # read the review rules …
        rt._review_signature = None  # … and re-compile the masks with them (no mask rows kept), every time
        for r in rows:
            r.result_row = r.intent_state = None
        return super()._decide_group(rt, rows, now, t0)


def sequential(engine: DecisionEngine, clock: ReplayClock, episodes: list[list[Step]], rate: float) -> dict:
    """Every episode, one request after the other: wall-time percentiles and the actions."""
    wall, finals = [], {}
    for i, steps in enumerate(episodes):
        for k, step in enumerate(steps):
            clock.t = i / rate + step.t
            t0 = time.perf_counter()
            d = engine.decide(step.request)
            wall.append((time.perf_counter() - t0) * 1e3)
            finals[(i, k)] = (d.final_action, d.timed_out or d.intent_pending)
    engine.flush()
    return {"all": percentiles(wall), "finals": finals}


def back_to_back(engine: DecisionEngine, clock: ReplayClock, episodes: list[list[Step]], rate: float,
                 suffix: str, after_each: Callable[[], Any] | None = None) -> dict:
    """Every episode again under a new id (``suffix``), one request after the other, with
    nothing in between but ``after_each()`` (timed apart, as ``after_ms``): decide()'s
    wall-time percentiles (ms), its RL-Boost requests' apart."""
    wall, boosted, after = [], [], []
    for i, steps in enumerate(episodes):
        for step in steps:
            clock.t = i / rate + step.t
            t0 = time.perf_counter()
            d = engine.decide(renamed(step.request, suffix))
            t1 = time.perf_counter()
            if after_each is not None:
                after_each()
                after.append((time.perf_counter() - t1) * 1e3)
            wall.append((t1 - t0) * 1e3)
            if d.rl_boost and not d.intent_pending:
                boosted.append(wall[-1])
    engine.flush()
    return {"all": percentiles(wall), "rl_boost": percentiles(boosted), "all_ms": wall, "rl_boost_ms": boosted,
            "after_ms": after}


def paired_back_to_back(engine: DecisionEngine, clock: ReplayClock, episodes: list[list[Step]], rate: float,
                        suffix: str, chunk_ms: float) -> tuple[dict, dict]:
    """Every episode again under a new id (``suffix``), one request after the other, each
    request followed by one run of the floor's fixed computation scaled to ``chunk_ms``:
    decide()'s and the floor's wall-time percentiles (ms) from the same stretch of time, so
    a slower spell of the machine reaches both alike."""
    n, steal0 = spin_iterations(chunk_ms), cpu_ticks()
    decide = back_to_back(engine, clock, episodes, rate, suffix, after_each=lambda: _spin(n))
    floor = decide.pop("after_ms")
    return decide, {**percentiles(floor), "chunk_ms": chunk_ms, "steal": steal_share(steal0, cpu_ticks()),
                    "wall_ms": floor}


def tail_round(engine: DecisionEngine, clock: ReplayClock, embedder: TimedEmbedder, episodes: list[list[Step]],
               args: argparse.Namespace, paced: dict | None = None) -> dict:
    """One round of section 5 on ``engine`` (warmed up, its queries not embedded yet): the
    paced replay (``paced`` when it ran already) and its floor at the same due times; then
    every episode again back to back (its queries embedded in the replay), which sets the
    floor's length, and once more with the floor's run after each request."""
    if paced is None:
        paced = replay(engine, clock, embedder, episodes, args.rate, args.max_gap)
        paced.pop("finals")
    due = [t for t, _, _ in schedule(episodes, args.rate, args.max_gap)]
    floor = machine_floor(due, len(due), paced["all"]["p50"])
    unpaced = back_to_back(engine, clock, episodes, args.rate, "-b2b")
    paired, paired_floor = paired_back_to_back(engine, clock, episodes, args.rate, "-pair", unpaced["all"]["p50"])
    return {"paced": paced, "paced_floor": floor, "back_to_back": paired, "back_to_back_floor": paired_floor}


def _ratio(decide: dict, floor: dict) -> float | None:
    return None if decide["p99"] is None or not floor["p99"] else decide["p99"] / floor["p99"]


def pooled_tail(rounds: list[dict]) -> dict:
    """Every round's requests and floor runs pooled (the percentiles of all of them: a p99
    over ``rounds`` times as many requests), each round's own ratios beside them; the raw
    wall times are dropped from the rounds."""
    pooled: dict[str, Any] = {"rounds": len(rounds)}
    for key in ("paced", "back_to_back"):
        decide = {"all": percentiles([x for r in rounds for x in r[key]["all_ms"]]),
                  "rl_boost": percentiles([x for r in rounds for x in r[key]["rl_boost_ms"]])}
        floor = percentiles([x for r in rounds for x in r[f"{key}_floor"]["wall_ms"]])
        pooled[key] = decide
        pooled[f"{key}_floor"] = floor
        pooled[f"{key}_per_round"] = [_ratio(r[key]["all"], r[f"{key}_floor"]) for r in rounds]
    for r in rounds:
        for part in r.values():
            for raw in ("all_ms", "rl_boost_ms", "wall_ms"):
                part.pop(raw, None)
    return pooled


def tail_ratios(out: dict) -> dict:
    """decide()'s p99 over its floor's p99 over the pooled rounds, paced (the replay) and
    back to back (None where either is missing), each round's own, and the goal."""
    t = out["tail"]
    return {"paced": _ratio(t["paced"]["all"], t["paced_floor"]),
            "back_to_back": _ratio(t["back_to_back"]["all"], t["back_to_back_floor"]),
            "paced_per_round": t["paced_per_round"], "back_to_back_per_round": t["back_to_back_per_round"],
            "rounds": t["rounds"], "goal": TAIL_RATIO_GOAL}


def same_actions(a: dict, b: dict) -> tuple[bool, int]:
    """Whether two replays served the same actions in every episode where neither ran out
    of its time budget nor deferred an RL-Boost (the baseline's action served then changes
    the rest of the episode)."""
    late = {i for (i, _), (_, out) in [*a.items(), *b.items()] if out}
    keys = [key for key in a if key[0] not in late]
    return all(a[key][0] == b[key][0] for key in keys), len(keys)


# =========================================================================== 4. batched throughput
def batched(engine: DecisionEngine, clock: ReplayClock, episodes: list[list[Step]], batch: int, suffix: str) -> float:
    """Decisions per second with decide_batch: ``batch`` episodes advance one step per call."""
    n, t0 = 0, time.perf_counter()
    for start in range(0, len(episodes), batch):
        group = episodes[start:start + batch]
        for k in range(max(len(s) for s in group)):
            reqs = [renamed(s[k].request, suffix) for s in group if k < len(s)]
            clock.t += 1.0
            engine.decide_batch(reqs)
            n += len(reqs)
    engine.flush()
    return n / (time.perf_counter() - t0)


# =========================================================================== report
ROWS = (("ongoing", "ongoing episode (query embedded already)"),
        ("first_ready", "first request, answered without waiting for an embedding"),
        ("deferred", "RL-Boost deferred: query not embedded yet, baseline answered"),
        ("waited_embedding", "waited for a new query's sentence embedding (RL-Boost)"),
        ("all", "overall mix (realistic replay)"))


def tail_ratio_lines(out: dict) -> list[str]:
    """The tail ratios (section 5) with the absolute percentiles they divide."""
    t, lines, tail = out.get("tail_ratio") or tail_ratios(out), [], out["tail"]
    for key, label in (("paced", "paced (the replay's due times)"),
                       ("back_to_back", "back to back (one request after the other)")):
        if t[key] is None:
            continue
        d, f = tail[key]["all"], tail[f"{key}_floor"]
        boost = tail[key]["rl_boost"]
        rounds = ", ".join("–" if x is None else f"{x:.2f}×" for x in t[f"{key}_per_round"])
        lines.append(f"tail ratio {label}: {t[key]:.2f}× ({'within' if t[key] <= t['goal'] else 'over'} the goal "
                     f"≤ {t['goal']:g}×; {t['rounds']} round{'s' if t['rounds'] != 1 else ''} pooled, each: {rounds}) — decide() p50 "
                     f"{d['p50']:.3f} / p99 {d['p99']:.3f} ms (n={d['n']}; its RL-Boost requests {boost['n']}: "
                     f"p50 {boost['p50'] or 0:.3f} / p99 {boost['p99'] or 0:.3f} ms) over the floor's p50 "
                     f"{f['p50']:.3f} / p99 {f['p99']:.3f} ms")
        if boost["n"] and boost["p50"] and f["p99"] and boost["n"] >= 0.02 * d["n"]:
            # over 2% of the requests, half of them slower than their p50: the mix's p99 is at least that
            lines.append(f"   its RL-Boost requests are {boost['n'] / d['n']:.0%} of them, so the mix's p99 is at "
                         f"least their p50: the ratio cannot come under {boost['p50'] / f['p99']:.2f}× (their p50 "
                         f"over the floor's p99) while a request that runs the policy costs what it does")
    if lines:
        lines.insert(0, f"{out['policy_size']}; load average {out['load_before']:.1f} before, "
                        f"{out['load_after']:.1f} after, on {os.cpu_count()} CPUs.  The floor: a fixed pure-Python "
                        "computation as long as decide()'s p50, run as often and at the same times with no engine "
                        "about; the tail ratio is decide()'s p99 over the floor's p99")
    return lines


def verdict(out: dict, embed_ms: np.ndarray) -> list[str]:
    """Plain words on the 2 ms target: the default engine per category, how many RL-Boosts
    it deferred for that, what waiting for the embeddings costs instead, and what the same
    requests cost one after the other (against the machine's load)."""
    r, w, lines = out["replay"], out["replay_waiting"], tail_ratio_lines(out)
    for key, label in (("ongoing", "ongoing-episode requests"), ("all", "the overall mix")):
        p99 = r[key]["p99"]
        if p99 is not None:
            lines.append(f"target p99 ≤ {TARGET_MS:g} ms for {label}: {'met' if p99 <= TARGET_MS else 'NOT met'} "
                         f"({p99:.3f} ms, {p99 / TARGET_MS:.2f}× the target)")
    f = out["machine_floor"]
    if f["p99"] is not None and r["all"]["p99"] is not None:
        lines.append(f"the machine's own floor: a fixed pure-Python computation as long as decide()'s mix p50 "
                     f"({f['chunk_ms']:.3f} ms), run at the same due times without the engine: p50 {f['p50']:.3f} "
                     f"/ p99 {f['p99']:.3f} ms ({'within' if f['p99'] <= TARGET_MS else 'itself over'} the target), "
                     f"a tail (p99/p50) of {f['p99'] / f['p50']:.2f}×; decide()'s: "
                     f"{r['all']['p99'] / r['all']['p50']:.2f}×"
                     + "".join(f"; hypervisor steal {x:.1%} of CPU time {during}"
                               for x, during in ((r.get("steal"), "during the replay"),
                                                 (f.get("steal"), "during the floor"))
                               if x is not None))
        b = r["rl_boost"]
        if b["n"]:
            lines.append(f"the mix's tail is its RL-Boost requests' ({b['n']} of {r['all']['n']}, the policy run on "
                         f"their path): p50 {b['p50']:.3f} / p99 {b['p99']:.3f} ms; their p50 times the floor's "
                         f"tail is {b['p50'] * f['p99'] / f['p50']:.3f} ms")
    c = out.get("cold_penalty")
    if c and out["sequential"]["without_embedding"]["p50"]:
        lines.append(f"after an idle gap this machine runs numpy work slower: the policy's forward on one fixed "
                     f"state takes {c['back_to_back_us']:.0f} µs one call after the other and "
                     f"{c['paced_us']:.0f} µs at the replay's due times (p50s, {c['ratio']:.2f}×); decide() in the "
                     f"replay against one request after the other: "
                     f"{r['all']['p50'] / out['sequential']['without_embedding']['p50']:.2f}×")
    n = r["all"]["n"]
    d = r["deferred"]["n"]
    lines.append(f"the default engine deferred {d} of {n} requests' RL-Boost ({d / n:.1%}: their query's "
                 "embedding was not ready; the baseline answered at once)")
    t = out.get("replay_model_in_process")
    if t and t["all"]["p99"] is not None and r["all"]["p99"] is not None:
        lines.append(f"the sentence model in the serving process instead (model_process=False): mix p99 "
                     f"{t['all']['p99']:.3f} ms, ongoing p99 {t['ongoing']['p99']:.3f} ms (in a child process: "
                     f"{r['all']['p99']:.3f} and {r['ongoing']['p99']:.3f} ms); CPU per decision in the serving "
                     f"process {t['cpu_ms_per_decision']:.2f} ms (in a child process: "
                     f"{r['cpu_ms_per_decision']:.2f} ms)")
    if embed_ms.size and w["all"]["p99"] is not None:
        waited = w["waited_embedding"]["n"]
        lines.append(f"waiting for the embeddings instead (wait_for_intent=True): mix p99 {w['all']['p99']:.3f} ms; "
                     f"{waited} of {w['all']['n']} requests waited ({waited / max(w['all']['n'], 1):.1%}), one "
                     f"embedding taking {np.percentile(embed_ms, 50):.1f} ms (p50 per text; p99 "
                     f"{np.percentile(embed_ms, 99):.1f} ms)")
    seq = out["sequential"]["without_embedding"]
    f = out["sequential_floor"]
    if seq["p50"] is not None and f["p99"] is not None:
        lines.append(f"the same engine one request after the other, requests without an embedding: p50 "
                     f"{seq['p50']:.3f} ms, p99 {seq['p99']:.3f} ms; the machine's own floor for "
                     f"{f['chunk_ms']:.3f} ms of pure Python one after the other: p50 {f['p50']:.3f} / p99 "
                     f"{f['p99']:.3f} ms, a tail of {f['p99'] / f['p50']:.2f}× (decide()'s: "
                     f"{seq['p99'] / seq['p50']:.2f}×; load average {out['load_after']:.1f} on {os.cpu_count()} CPUs)")
    return lines


def print_replay(out: dict) -> None:
    """Section 1: each category's n, p50, p99 and p99 against the target, for the default
    engine (RL-Boosts on queries not embedded yet deferred) and one that waits for them."""
    print(f"\n1. realistic replay: {out['episodes']} episodes starting {out['rate']:g}/s, recorded gaps "
          f"(≤ {out['max_gap']:g} s) between an episode's requests, {out['embedder']} embedder; decide() wall ms")
    for key, title in (("replay", "default engine (wait_for_intent=False; the sentence model in a child process)"),
                       ("replay_model_in_process", "the same with the sentence model in the serving process "
                                                   "(model_process=False)"),
                       ("replay_waiting", "an engine that waits for embeddings (wait_for_intent=True)")):
        print(f"\n   {title}")
        _print_categories(out[key])
        if key == "replay":
            f = out["machine_floor"]
            print(f"   the machine's own floor, a fixed {f['chunk_ms']:.3f} ms of pure Python at the same due times "
                  f"(n={f['n']}): p50 {f['p50']:.3f} / p99 {f['p99']:.3f}"
                  + ("" if f["steal"] is None else f"; hypervisor steal {f['steal']:.1%} of CPU time"))


def _print_categories(r: dict) -> None:
    print(f"   {'':62} {'n':>5} {'p50':>8} {'p99':>8} {'p99/2ms':>8}")
    for key, label in ROWS:
        c = r[key]
        if c["n"]:
            print(f"   {label:62} {c['n']:5d} {c['p50']:8.3f} {c['p99']:8.3f} {c['p99'] / TARGET_MS:7.2f}×")
    print(f"   ({r['first_requests']} first requests; CPU per decision in the serving process, all its threads "
          f"incl. background embeddings and audit commits: {r['cpu_ms_per_decision']:.3f} ms; client late p99 "
          f"{r['client_late_ms_p99']:.1f} ms)")


def print_stages(out: dict) -> None:
    """Sections 2 and 3: the stages of a request, and the sequential engine against the naive one."""
    print("\n2. where a request's time goes (sequential, no prefetch; ms)")
    print(f"   {'stage':16} {'mean/request':>13} {'calls':>6} {'p50/call':>9} {'p99/call':>9}")
    for name, s in out["stages"].items():
        if s["calls"]:
            print(f"   {name:16} {s['mean']:13.3f} {s['calls']:6d} {s['p50_per_call']:9.3f} {s['p99_per_call']:9.3f}")
    n, a, b = out["naive"], out["sequential"]["without_embedding"], out["sequential"]["with_embedding"]
    print(f"\n3. one request after the other (pass 2), ms: engine p50 {a['p50']:.3f} / p99 {a['p99']:.3f} without an "
          f"embedding on the path (n={a['n']}), p50 {b['p50']:.3f} / p99 {b['p99']:.3f} with one (n={b['n']}); "
          f"naive reference p50 {n['p50']:.3f} / p99 {n['p99']:.3f} (all); same actions as the naive reference: "
          f"{out['same_actions']} ({out['compared']} decisions compared)")
    f = out["sequential_floor"]
    if f["p99"] is not None:
        print(f"   the machine's own floor, a fixed {f['chunk_ms']:.3f} ms of pure Python one after the other "
              f"(n={f['n']}): p50 {f['p50']:.3f} / p99 {f['p99']:.3f}"
              + ("" if f["steal"] is None else f"; hypervisor steal {f['steal']:.1%} of CPU time"))


def print_report(out: dict) -> None:
    """The human-readable report (``--json`` prints ``out`` instead)."""
    print_replay(out)
    print_stages(out)
    b = out["batched_decisions_per_s"]
    print(f"\n4. decide_batch({b['batch']}): {b['new_queries']:,.0f} decisions/s on new queries (embeddings included), "
          f"{b['embedded_queries']:,.0f} decisions/s on embedded ones; the naive reference on embedded ones: "
          f"{b['naive']:,.0f} decisions/s ({b['embedded_queries'] / b['naive']:.1f}×)")
    print("\n5. the tail ratio, and the verdict")
    for line in out["verdict"]:
        print(line)
    print(f"{out['audit_records']} audit records for the {out['decisions']} decisions of the replayed engine "
          "(warm-up, replay, back to back twice: alone and paired with the floor); "
          f"load average {out['load_before']:.1f} before, "
          f"{out['load_after']:.1f} after, on {os.cpu_count()} CPUs")


# =========================================================================== 5'. the policy and its copies side by side
def interleaved_rounds(labels: list[str], rounds: int, run_round: Callable[[str, int], dict]) -> dict[str, list[dict]]:
    """``run_round(label, k)`` for every round k and label: round k of every label before
    round k + 1 of any, so a slower spell of the machine reaches every label alike."""
    out: dict[str, list[dict]] = {label: [] for label in labels}
    for k in range(rounds):
        for label in labels:
            out[label].append(run_round(label, k))
    return out


def served_figures(bundle: Any) -> dict:
    """What a bundle serves: ``full`` or its copy's precision, the served network's weights,
    and a copy's agreement with the trained policy on held-out states (its manifest's)."""
    agent = bundle.served_policy
    recorded = bundle.manifest.served
    return {"precision": bundle.serve_precision, "weights": int(sum(p.numel() for p in agent.parameters())),
            "heldout": None if recorded is None else recorded.heldout.model_dump()}


def compare_tails(work: Path, bundles: dict[str, Any], embedder: Any, args: argparse.Namespace) -> dict:
    """Section 5 (:func:`tail_round`, ``args.rounds`` rounds pooled) for every bundle, rounds
    interleaved (:func:`interleaved_rounds`), each round on a fresh engine."""
    episodes = episodes_of(args.train, args.episodes)
    warm_up = episodes_of(0, 3)
    load_before = os.getloadavg()[0]
    print(f"section 5 for {', '.join(bundles)}: {sum(map(len, episodes))} requests from {len(episodes)} recorded "
          f"episodes per round, {args.rounds} rounds each; load average {load_before:.1f} on {os.cpu_count()} CPUs",
          flush=True)
    factories = {}
    for label, bundle in bundles.items():
        (work / label).mkdir(parents=True, exist_ok=True)
        factories[label] = engines(work / label, bundle, embedder, args)

    def run_round(label: str, k: int) -> dict:
        engine, clock, timed = factories[label][0](f"tail-{k}")
        sequential(engine, clock, warm_up, args.rate)
        engine.ready()
        timed.calls.clear()
        try:
            return tail_round(engine, clock, timed, episodes, args)
        finally:
            engine.close()
            engine.ws.close()

    rounds = interleaved_rounds(list(bundles), args.rounds, run_round)
    for _, _, processes in factories.values():
        for process in processes:
            process.close()
    out = {}
    for label, bundle in bundles.items():
        tail = pooled_tail(rounds[label])
        out[label] = {**served_figures(bundle), "policy_size": policy_size(bundle), "tail": tail,
                      "tail_ratio": tail_ratios({"tail": tail})}
    return {"bundles": out, "rounds": args.rounds, "episodes": len(episodes), "load_before": load_before,
            "load_after": os.getloadavg()[0]}


def comparison_lines(out: dict) -> list[str]:
    """Section 5 for every bundle side by side: its tail ratios (paced, back to back) with the
    percentiles they divide, its served network's size and a copy's held-out agreement."""
    def ratio(x: float | None) -> str:
        return "–" if x is None else f"{x:.2f}×"

    lines = [f"5. the tail ratio, the trained policy and its served copies side by side: decide()'s p99 over "
             f"the machine floor's p99, {out['rounds']} rounds each (interleaved) of {out['episodes']} episodes; "
             f"load average {out['load_before']:.1f} before, {out['load_after']:.1f} after, on {os.cpu_count()} "
             f"CPUs; goal ≤ {TAIL_RATIO_GOAL:g}×"]
    for label, b in out["bundles"].items():
        t, tail = b["tail_ratio"], b["tail"]
        h = b["heldout"]
        agreement = "the trained policy itself" if h is None else (
            f"same first choice on {h['top1']:.2%} of {h['states']} held-out states, |Δp| mean "
            f"{h['prob_gap_mean']:.4f} / max {h['prob_gap_max']:.4f}")
        lines.append(f"   {label:10} {b['weights']:>10,} weights; tail ratio paced {ratio(t['paced'])}, back to back "
                     f"{ratio(t['back_to_back'])}; {agreement}")
        for key, name in (("paced", "paced"), ("back_to_back", "back to back")):
            d, f, boost = tail[key]["all"], tail[f"{key}_floor"], tail[key]["rl_boost"]
            if d["n"] and f["n"]:
                lines.append(f"   {'':10} {name}: decide() p50 {d['p50']:.3f} / p99 {d['p99']:.3f} ms (n={d['n']}; "
                             f"RL-Boost n={boost['n']}, p50 {boost['p50'] or 0:.3f} / p99 {boost['p99'] or 0:.3f} ms) "
                             f"over the floor's p50 {f['p50']:.3f} / p99 {f['p99']:.3f} ms; rounds: "
                             + ", ".join(ratio(x) for x in t[f"{key}_per_round"]))
    for label, reason in out.get("refused", {}).items():
        lines.append(f"   {label:10} not exported: {reason}")
    return lines


def compare_main(args: argparse.Namespace, work: Path, embedder: Any) -> None:
    """The side-by-side mode: the bundles given, or the run exported in full and as each copy."""
    from core.govern.bundle import load_bundle

    refused: dict[str, str] = {}
    if args.bundle:
        paths: dict[str, Path | str] = {}
        for i, path in enumerate(args.bundle):
            label = load_bundle(path).serve_precision
            paths[label if label not in paths else f"{label}-{i + 1}"] = path
    else:
        built = build_bundle(work, args.train, args.size, tuple(args.serve_precision))
        assert isinstance(built, dict), "exports per precision when asked for copies"
        paths = {k: v for k, v in built.items() if isinstance(v, Path)}
        refused = {k: v for k, v in built.items() if isinstance(v, str)}
    out = compare_tails(work, {label: load_bundle(p) for label, p in paths.items()}, embedder, args)
    out["refused"] = refused
    if args.json:
        print(json.dumps(out))
    else:
        print()
        for line in comparison_lines(out):
            print(line)


# =========================================================================== main
def engines(work: Path, bundle: Any, embedder: Any, args: argparse.Namespace
            ) -> tuple[Callable[..., tuple[DecisionEngine, ReplayClock, TimedEmbedder]], list[DecisionEngine],
                       list[Any]]:
    """A factory of fresh engines (own workspace, clock and timed embedder), the list of
    engines it made and the list of sentence-model processes they share (to close)."""
    import core.base.embed

    made: list[DecisionEngine] = []
    processes: list[core.base.embed.ModelProcess] = []

    def make(name: str, cls: type = DecisionEngine, *, model: str = "process", **config: Any):
        """``model``: "process" — the engine's default (the workspace cache read-only, the
        sentence model in a child process, one shared by the engines); "thread" — the same
        with the model in this process; "storing" — the workspace's storing embedder."""
        ws = Workspace.open(work / name)
        base = core.base.embed.workspace_embedder(ws)
        if embedder is not None:
            inner = embedder
        elif model == "process":
            if not processes:
                processes.append(core.base.embed.ModelProcess())
            inner = core.base.embed.CacheReader(base, processes[0])
        else:
            inner = base if model == "storing" else base.reader()
        timed = TimedEmbedder(inner)
        clock = ReplayClock()
        engine = cls(ws, bundle, embedder=timed, clock=clock,
                     config=ServingConfig(torch_threads=args.torch_threads, model_process=model == "process",
                                          switch_interval_ms=args.switch_interval_ms or None, freeze_gc=True,
                                          idle_gc=True,
                                          **config))
        made.append(engine)
        return engine, clock, timed
    return make, made, processes


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, action="append",
                        help="A bundle zip (default: train and export one of --size); twice or more: section 5 "
                             "for each, side by side.")
    parser.add_argument("--size", choices=sorted(SIZES), default="small",
                        help="The policy to train without --bundle: the bench's small one, or the production-size "
                             "network rwb demo trains.")
    parser.add_argument("--train", type=int, default=150, help="Sample episodes to train on (no --bundle).")
    parser.add_argument("--episodes", type=int, default=100, help="Recorded episodes replayed as requests.")
    parser.add_argument("--rate", type=float, default=10.0, help="New episodes per second in the realistic replay.")
    parser.add_argument("--max-gap", type=float, default=1.0,
                        help="Longest wait (s) between an episode's requests in the realistic replay.")
    parser.add_argument("--batch", type=int, default=64, help="Episodes per decide_batch call.")
    parser.add_argument("--hash-embedder", action="store_true",
                        help="A hash embedder instead of the sentence model (training and serving).")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="torch intra-op threads of the serving process (ServingConfig.torch_threads).")
    parser.add_argument("--switch-interval-ms", type=float, default=0.5,
                        help="the interpreter's thread switch interval (ServingConfig.switch_interval_ms; "
                             "0: Python's default 5 ms).")
    parser.add_argument("--workspace", type=Path, help="Folder for the temporary workspaces (kept).")
    parser.add_argument("--rounds", type=int, default=5,
                        help="Rounds of the tail ratio (section 5), each on a fresh engine; the ratio pools them.")
    parser.add_argument("--serve-precision", action="append", default=[],
                        choices=["float16", "bfloat16", "int8", "distilled"],
                        help="Export the trained run with this served copy too and run section 5 for the full "
                             "policy and each copy side by side (repeatable).")
    parser.add_argument("--json", action="store_true", help="Print one JSON object.")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, not {args.rounds}")
    if args.serve_precision and args.bundle:
        parser.error("--serve-precision exports copies of a run it trains: leave out --bundle (or give the full "
                     "bundle and its copies as --bundle each)")
    return args


def policy_size(bundle: Any) -> str:
    """The served policy's size (the served copy's when the bundle has one) and the forward
    serving runs (numpy, or the torch module)."""
    from core.serve.serving import PolicyRuntime

    agent = bundle.served_policy
    n = sum(int(p.numel()) for p in agent.parameters()) if hasattr(agent, "parameters") else 0
    dim = getattr(getattr(getattr(agent, "encoder", None), "config", None), "dim", "?")
    forward = "numpy (core.serve.fast_policy)" if PolicyRuntime(bundle).fast is not None else "torch"
    copy = "" if bundle.serve_precision == "full" else f"the served {bundle.serve_precision} copy: "
    return (f"{copy}{dim}-d encoded state, {getattr(agent, 'hidden', '?')}-wide heads, {n:,} weights, "
            f"{forward} forward")


def measure(work: Path, bundle: Any, embedder: Any, args: argparse.Namespace) -> dict:
    """Run the measurements on fresh engines and gather their figures."""
    episodes = episodes_of(args.train, args.episodes)
    warm_up = episodes_of(0, 3)  # training episodes: their queries are not replayed
    load_before, size = os.getloadavg()[0], policy_size(bundle)
    print(f"{bundle.policy_version}: {sum(map(len, episodes))} requests from {len(episodes)} recorded episodes; "
          f"load average {load_before:.1f} on {os.cpu_count()} CPUs; policy: {size}", flush=True)
    make, made, processes = engines(work, bundle, embedder, args)

    def replayed(name: str, **options: Any) -> tuple[DecisionEngine, ReplayClock, TimedEmbedder, dict]:
        engine, clock, timed = make(name, **options)
        sequential(engine, clock, warm_up, args.rate)  # allocates torch buffers
        engine.ready()                                 # the sentence model loaded, warm-up queries embedded
        timed.calls.clear()
        return engine, clock, timed, replay(engine, clock, timed, episodes, args.rate, args.max_gap)

    fast, fast_clock, fast_emb, real = replayed("serve-ws")
    due = [t for t, _, _ in schedule(episodes, args.rate, args.max_gap)]
    rounds = [tail_round(fast, fast_clock, fast_emb, episodes, args, paced={k: v for k, v in real.items()
                                                                          if k != "finals"})]
    for k in range(1, args.rounds):  # more rounds of section 5, each on a fresh engine
        engine, clock, timed = make(f"tail-ws-{k}")
        sequential(engine, clock, warm_up, args.rate)
        engine.ready()
        timed.calls.clear()
        rounds.append(tail_round(engine, clock, timed, episodes, args))
    floor, unpaced, unpaced_floor = rounds[0]["paced_floor"], rounds[0]["back_to_back"], rounds[0]["back_to_back_floor"]
    tail = pooled_tail(rounds)
    for raw in ("all_ms", "rl_boost_ms"):
        real.pop(raw, None)
    forward = policy_forward(bundle)
    penalty = None if forward is None else cold_penalty(forward, due)
    real_thread = replayed("thread-ws", model="thread")[3]
    for raw in ("finals", "all_ms", "rl_boost_ms"):
        real_thread.pop(raw)
    real_wait = replayed("wait-ws", wait_for_intent=True)[3]
    for raw in ("finals", "all_ms", "rl_boost_ms"):
        real_wait.pop(raw)
    staged, staged_clock, staged_emb = make("stages-ws", prefetch_intent=False, wait_for_intent=True)
    sequential(staged, staged_clock, warm_up, args.rate)
    stages, seq = stage_breakdown(staged, staged_clock, staged_emb, episodes, args.rate)
    seq_floor = machine_floor(None, seq["without_embedding"]["n"], seq["without_embedding"]["p50"])
    seq_floor.pop("wall_ms")
    naive, naive_clock, _ = make("naive-ws", NaiveEngine, model="storing", audit_synchronous=True,
                                 wait_for_intent=True)
    ref = sequential(naive, naive_clock, episodes, args.rate)
    same, compared = same_actions(real.pop("finals"), ref["finals"])
    cold, cold_clock, _ = make("batch-ws", wait_for_intent=True)
    thr_new = batched(cold, cold_clock, episodes, args.batch, "")
    thr_warm = batched(cold, cold_clock, episodes, args.batch, "-again")
    thr_naive = batched(naive, naive_clock, episodes, args.batch, "-batch")
    for engine in made:
        engine.close()
    for process in processes:
        process.close()
    records = audit.stats(fast.ws).records
    for engine in made:
        engine.ws.close()
    return {"policy": bundle.policy_version, "policy_size": size, "episodes": len(episodes),
            "rate": args.rate, "max_gap": args.max_gap,
            "embedder": "hash" if args.hash_embedder else "MiniLM (core.base.embed)",
            "replay": real, "machine_floor": floor, "back_to_back": unpaced, "back_to_back_floor": unpaced_floor,
            "tail": tail,
            "cold_penalty": penalty, "replay_model_in_process": real_thread,
            "replay_waiting": real_wait,
            "stages": stages, "sequential": seq, "sequential_floor": seq_floor, "naive": ref["all"],
            "same_actions": same, "compared": compared,
            "batched_decisions_per_s": {"new_queries": thr_new, "embedded_queries": thr_warm, "naive": thr_naive,
                                        "batch": args.batch},
            "embedding_ms_per_text": percentiles(list(fast_emb.per_text_ms())),
            "embedding_ms": fast_emb.per_text_ms().tolist(),
            "audit_records": records, "decisions": sum(map(len, warm_up + episodes * 3)),
            "load_before": load_before, "load_after": os.getloadavg()[0]}


def main() -> None:
    args = parse_args()
    work = Path(tempfile.mkdtemp(prefix="rwb-bench-decide-", dir=args.workspace))
    embedder = None
    if args.hash_embedder:
        import core.base.embed

        embedder = HashEmbedder()
        core.base.embed.workspace_embedder = lambda _ws: embedder  # training uses it too
    from core.govern.bundle import load_bundle

    if args.serve_precision or len(args.bundle or []) > 1:
        compare_main(args, work, embedder)
        if args.workspace is None:
            shutil.rmtree(work, ignore_errors=True)
        return
    built = args.bundle[0] if args.bundle else build_bundle(work, args.train, args.size)
    assert isinstance(built, Path), "one bundle without copies"
    out = measure(work, load_bundle(built), embedder, args)
    out["tail_ratio"] = tail_ratios(out)
    out["verdict"] = verdict(out, np.array(out.pop("embedding_ms")))
    if args.workspace is None:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(out))
    else:
        print_report(out)


if __name__ == "__main__":
    main()
