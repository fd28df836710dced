"""Small in-memory episodes for the state encoder and state map tests (tests/test_state*.py).

Three task types with their own requests and tool sequences, JSON tool results with
numeric, categorical and free-text fields, scalar observation state, timestamps on
some episodes and latencies on all steps, one failed call and one invalid call.
"""

from __future__ import annotations

import numpy as np

from core.base.embed import HashEmbedder  # noqa: F401 (the tests import it from here)
from core.records.episodes import Action, Episode, Outcome, Step, Task, ToolSchema

TOOLS = [
    ToolSchema(name="get_quote", parameters={
        "type": "object", "properties": {"symbol": {"type": "string"}}, "required": ["symbol"]}),
    ToolSchema(name="get_report", parameters={
        "type": "object", "properties": {"symbol": {"type": "string"},
                                         "period": {"type": "string", "enum": ["annual", "q1", "q2", "q3"]}},
        "required": ["symbol", "period"]}),
    ToolSchema(name="place_order", risk="high", parameters={
        "type": "object", "properties": {"symbol": {"type": "string"},
                                         "side": {"type": "string", "enum": ["buy", "sell"]},
                                         "qty": {"type": "integer", "minimum": 1, "maximum": 10000}},
        "required": ["symbol", "side", "qty"]}),
]

QUERIES = {
    "urgent_reduce": ["Urgently reduce my position in {s} by {p}%", "Cut my {s} exposure immediately, {p}% off",
                      "紧急减持 {s}，减少 {p}%"],
    "analysis": ["Analyse the Q3 report of {s} for me", "Please review {s}'s latest results, no rush",
                 "Assess how {s} did this quarter"],
    "rebalance": ["Rebalance my portfolio towards {s}", "Reallocate {p}% of the book into {s}",
                  "Rebalance holdings, add {s} today"],
}
SYMBOLS = ["600519", "000858", "601318", "600036", "02318"]


def make_episodes(n: int = 60, seed: int = 0) -> list[Episode]:
    """``n`` episodes cycling over the three task types."""
    rng = np.random.default_rng(seed)
    types = list(QUERIES)
    out = []
    for i in range(n):
        tt = types[i % 3]
        sym = SYMBOLS[int(rng.integers(len(SYMBOLS)))]
        q = QUERIES[tt][int(rng.integers(3))].format(s=sym, p=int(rng.integers(5, 50)))
        state = {"hour": int(rng.integers(9, 16)), "volatility": float(rng.uniform(0.05, 0.5)),
                 "session": "open" if rng.random() < 0.8 else "closed"}
        steps: list[Step] = []

        def add(action: Action, result=None, error=None, replayed=True):
            t = len(steps)
            steps.append(Step(
                t=t, observation={"state": state}, action=action, tool_result=result, tool_error=error,
                result_replayed=replayed, latency_ms=float(rng.uniform(50, 500)),
                timestamp=f"2024-03-0{1 + i % 9}T09:{30 + t:02d}:{int(rng.integers(60)):02d}Z" if i % 2 else None))

        add(Action(kind="tool_call", tool="get_quote", params={"symbol": sym}),
            {"symbol": sym, "price": float(rng.normal(100, 20)), "change_pct": f"{rng.normal(0, 2):.2f}%",
             "status": "ok", "closes": [float(x) for x in rng.normal(100, 5, 5)]})
        if tt == "analysis":
            add(Action(kind="tool_call", tool="get_report", params={"symbol": sym, "period": "q3"}),
                {"revenue": float(rng.lognormal(10, 1)), "net_profit": float(rng.lognormal(8, 1)),
                 "growth": float(rng.normal(0.1, 0.05)), "rating": ["buy", "hold", "sell"][int(rng.integers(3))],
                 "summary": "A long free-text paragraph about the quarter that is not a category at all."})
            add(Action(kind="reply"))
        else:
            side = "sell" if tt == "urgent_reduce" else "buy"
            if i % 7 == 3:   # a failed call
                add(Action(kind="tool_call", tool="place_order", params={"symbol": sym, "side": side, "qty": 100}),
                    None, error="exchange closed")
            if i % 11 == 5:  # an invalid call (unknown tool)
                add(Action(kind="tool_call", tool="teleport", params={}), None, error="unknown tool")
            add(Action(kind="tool_call", tool="place_order",
                       params={"symbol": sym, "side": side, "qty": int(rng.integers(1, 50)) * 100}),
                {"order_id": f"o{i}", "filled": bool(rng.random() < 0.9), "qty": int(rng.integers(1, 50)) * 100},
                replayed=bool(i % 5))
        add(Action(kind="final_answer"))
        out.append(Episode(episode_id=f"ep{i:03d}", domain="finance",
                           task=Task(query=q, task_type=tt, intents=[tt.split("_")[-1]]), steps=steps,
                           outcome=Outcome(resolved=bool(rng.random() < 0.7), final_reward=float(rng.uniform())),
                           behaviour=["expert", "noisy"][i % 2]))
    return out


def dataset_workspace(path, episodes=None, name: str = "fx"):
    """A workspace at ``path`` holding ``episodes`` (default :func:`make_episodes`) as dataset ``name``."""
    from core.records.store import Workspace

    ws = Workspace.open(path)
    eps = make_episodes() if episodes is None else episodes
    with ws.transaction() as conn:
        ws.ensure_dataset(conn, name, "finance")
        ws.insert_episodes(conn, name, eps)
        ws.upsert_tools(conn, name, TOOLS)
    return ws
