"""Small in-memory episodes for the reward tests (random but seeded, so failures replay).

``make_episodes(seed)`` covers what components look at: known and unknown tools,
numeric and categorical parameters (with outliers), type mismatches, tool errors,
repeated failures, buy/sell flip-flops, latencies (some unknown), timestamps,
answers that quote tool data, outcomes with missing fields, and hacker episodes
linked to their expert twins.
"""

from __future__ import annotations

import datetime as dt
import hashlib

import numpy as np

from core.records.catalog import build_catalog
from core.records.episodes import Action, Episode, Outcome, Step, Task, ToolSchema
from core.rewards.frame import StepsFrame, build_frame

TOOLS = [
    ToolSchema(name="quote", parameters={"type": "object", "properties": {
        "symbol": {"type": "string", "enum": ["600519", "000001", "00700"]},
        "period": {"type": "string", "enum": ["day", "week", "q3"]}}, "required": ["symbol"]}),
    ToolSchema(name="order", parameters={"type": "object", "properties": {
        "side": {"type": "string", "enum": ["buy", "sell"]}, "quantity": {"type": "integer"},
        "price": {"type": "number"}}, "required": ["side", "quantity"]}, risk="high"),
    ToolSchema(name="news", parameters={"type": "object", "properties": {
        "source": {"type": "string"}, "days": {"type": "integer"}}}),
    ToolSchema(name="search", parameters={"type": "object", "properties": {"query": {"type": "string"}}}),
]

WORDS = ["Moutai", "revenue", "grew", "profit", "fell", "price", "1700", "quarter", "buy", "sell",
         "hold", "risk", "volatility", "news", "bank", "rate"]


def _text(rng: np.random.Generator, n: int) -> str:
    return " ".join(rng.choice(WORDS, size=n).tolist())


def make_episodes(seed: int = 0, n: int = 12, *, timestamps: bool = True) -> list[Episode]:
    """``n`` episodes (plus one hacker twin per 4) with every feature the components use."""
    rng = np.random.default_rng(seed)
    base = dt.datetime(2024, 5, 1, 9, 30)
    episodes: list[Episode] = []
    clock = 0
    for e in range(n):
        steps: list[Step] = []
        n_steps = int(rng.integers(1, 8))
        for t in range(n_steps):
            clock += 1
            stamp = (base + dt.timedelta(seconds=37 * clock)).isoformat() + "+08:00" if timestamps else None
            latency = None if rng.random() < 0.2 else float(np.round(rng.gamma(2.0, 300.0), 1))
            r = rng.random()
            if t == n_steps - 1 and rng.random() < 0.8:
                kind = "final_answer" if rng.random() < 0.7 else rng.choice(["terminate", "escalate"])
                out = _text(rng, 6) if kind == "final_answer" or rng.random() < 0.3 else None
                steps.append(Step(t=t, action=Action(kind=str(kind)), output_text=out,
                                  latency_ms=latency, timestamp=stamp))
                continue
            if r < 0.1:
                steps.append(Step(t=t, action=Action(kind="reply"), output_text=_text(rng, 4),
                                  latency_ms=latency, timestamp=stamp))
                continue
            tool = str(rng.choice(["quote", "order", "news", "search", "ghost"], p=[.3, .3, .2, .15, .05]))
            if tool == "quote":
                params = {"symbol": str(rng.choice(["600519", "000001", "00700"], p=[.7, .25, .05])),
                          "period": str(rng.choice(["day", "week", "q3"]))}
            elif tool == "order":
                qty = int(rng.normal(1000, 100)) if rng.random() > 0.1 else int(rng.normal(1000, 100)) * 10
                params = {"side": str(rng.choice(["buy", "sell"])),
                          "quantity": qty if rng.random() > 0.05 else "many",
                          "price": float(np.round(rng.normal(1700, 20), 2))}
            elif tool == "news":
                params = {"source": str(rng.choice(["wire", "social_media"], p=[.8, .2])),
                          "days": int(rng.integers(1, 8))}
            elif tool == "search":
                params = {"query": _text(rng, 2)}
            else:
                params = {"x": 1}
            error = "upstream timeout" if rng.random() < 0.12 else None
            if tool == "news":
                verified = params["source"] != "social_media"
                result = {"items": [{"headline": _text(rng, 5), "verified": verified}]}
            else:
                result = {"value": _text(rng, 5), "n": int(rng.integers(0, 100))}
            steps.append(Step(t=t, action=Action(kind="tool_call", tool=tool, params=params),
                              tool_result=None if error else result, tool_error=error,
                              output_text=_text(rng, 3) if rng.random() < 0.5 else None,
                              latency_ms=latency, timestamp=stamp))
        outcome = Outcome(
            resolved=None if rng.random() < 0.15 else bool(rng.random() < 0.5),
            final_reward=None if rng.random() < 0.2 else float(np.round(rng.uniform(-1, 1), 3)),
            business_metric=None if rng.random() < 0.2 else float(np.round(rng.uniform(0, 1), 3)),
            sentiment=None if rng.random() < 0.3 else float(np.round(rng.uniform(0, 1), 3)))
        ep_id = f"ep{seed}-{e:03d}"
        episodes.append(Episode(episode_id=ep_id, domain="test", task=Task(query=_text(rng, 4),
                                task_type=str(rng.choice(["analysis", "trade"]))),
                                steps=steps, outcome=outcome, behaviour="expert"))
        if e % 4 == 0:  # a hacker twin of this episode
            clock += 2
            stamps = [(base + dt.timedelta(seconds=37 * clock + k)).isoformat() + "+08:00"
                      if timestamps else None for k in range(2)]
            twin_steps = [Step(t=0, action=Action(kind="tool_call", tool="news",
                                                  params={"source": "social_media", "days": 3}),
                               tool_result={"items": [{"headline": "Moutai triples profit", "verified": False}]},
                               timestamp=stamps[0]),
                          Step(t=1, action=Action(kind="final_answer"), output_text="Moutai triples profit: buy",
                               timestamp=stamps[1])]
            episodes.append(Episode(episode_id=f"{ep_id}-hack", domain="test", task=Task(query="x"),
                                    steps=twin_steps, behaviour="hacker", meta={"twin_of": ep_id},
                                    outcome=Outcome(resolved=False, business_metric=0.1)))
    return episodes


def make_frame(seed: int = 0, n: int = 12, *, timestamps: bool = True) -> StepsFrame:
    eps = make_episodes(seed, n, timestamps=timestamps)
    return build_frame(eps, build_catalog(TOOLS, eps))


class FakeEmbedder:
    """Deterministic unit vectors from a text hash: the Embedder interface without the model."""

    def __init__(self, dim: int = 16):
        self.dim = dim
        self.stats = {"hits": 0, "encoded": 0}

    def encode(self, texts):
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        for i, t in enumerate(texts):
            g = np.random.default_rng(int(hashlib.sha256(t.encode()).hexdigest()[:8], 16))
            v = g.normal(size=self.dim)
            out[i] = v / np.linalg.norm(v)
        self.stats["encoded"] += len(texts)
        return out
