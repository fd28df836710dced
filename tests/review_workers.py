"""Worker processes for tests/test_review.py, kept in a module that imports only what they
use: spawned children import this module, not the test module (which pulls in the CLI)."""

from __future__ import annotations

import os
import random
import time
from typing import Any

from core.guard import review
from core.base.errors import ConflictError
from core.records.store import Workspace
from core.access.users import Actor


def reviewer_process(root: str, name: str, seed: int, start: Any, results: Any) -> None:
    """Work the queue until it is empty; sometimes walk away from a claim (its lease
    expires) and sometimes try to decide someone else's item.  All workers wait for
    ``start`` so that they really race; the outcome goes to the ``results`` queue."""
    ws = Workspace.open(root)
    me = Actor(name, "reviewer")
    rng = random.Random(seed)
    decided, abandoned, refused = [], [], 0
    start.wait(60)
    while True:
        item = review.claim(ws, me, lease_seconds=0.5)
        if item is None:
            if review.stats(ws).open == 0:
                break
            time.sleep(0.02)
            continue
        roll = rng.random()
        if roll < 0.05:
            abandoned.append(item.id)
            continue
        other = rng.randint(1, 200)
        if roll < 0.15 and review.get_item(ws, other).claimed_by != name:
            try:  # racing for an item this process does not hold
                review.decide(ws, me, other, "approve")
                raise AssertionError("decided an item without holding its claim")
            except ConflictError:
                refused += 1
        decision = "reject" if item.id % 3 == 0 else "approve"
        try:
            review.decide(ws, me, item.id, decision, f"{name} says {decision}")
            decided.append(item.id)
        except ConflictError:  # lease ran out under us: someone else may have it now
            refused += 1
    ws.close()
    results.put({"name": name, "decided": decided, "abandoned": abandoned, "refused": refused})


def die_mid_decision(root: str, item_id: int) -> None:
    """Claim, then die inside decide() after the item row and event were written but
    before the mask rule and the commit."""
    ws = Workspace.open(root)
    me = Actor("dora", "reviewer")
    review.claim(ws, me, item_id, lease_seconds=0.3)

    def trace(sql: str) -> None:
        if sql.lstrip().startswith("INSERT INTO mask_rules_from_reviews"):
            os._exit(3)

    ws.conn.set_trace_callback(trace)
    review.decide(ws, me, item_id, "reject", "dying")
    os._exit(0)  # not reached when the trace fires
