"""The domain-free agent signals (core.rewards.agent_signals): hand-computed cases with tool
names from real logs, and the real sentence model on a known answer."""

from __future__ import annotations

import numpy as np
import pytest

from core.records.catalog import build_catalog
from core.records.episodes import Action, Episode, Step, Task
from core.rewards import COMPONENTS, ScoringContext, build_frame
from core.rewards.agent_signals import is_write_tool
from _rewards_fixtures import FakeEmbedder


def frame_of(*episodes: Episode):
    return build_frame(list(episodes), build_catalog([], list(episodes)))


def call(t: int, tool: str, result: str | None = None, error: str | None = None) -> Step:
    return Step(t=t, action=Action(kind="tool_call", tool=tool, params={}), tool_result=result, tool_error=error)


def say(t: int, text: str) -> Step:
    return Step(t=t, action=Action(kind="reply"), output_text=text)


def run(name: str, frame, embedder=None, **params) -> np.ndarray:
    return COMPONENTS[name](**params)(frame, ScoringContext(embedder=embedder or FakeEmbedder()))


@pytest.mark.parametrize("name,writes", [
    ("get_user_details", False), ("search_direct_flight", False), ("listFiles", False),
    ("GetReservation", False), ("calculate", False), ("think", False),
    ("cancel_reservation", True), ("update_reservation_flights", True), ("book_reservation", True),
    ("exchange_delivered_order_items", True), ("sendMessage", True), ("rm", True),
    ("transfer_to_human_agents", False), ("escalate_ticket", False),
])
def test_write_tools_by_name(name, writes):
    assert is_write_tool(name) is writes


def test_write_actions_hand_computed():
    f = frame_of(Episode(episode_id="e", task=Task(query="q"), steps=[
        call(0, "get_user_details"), call(1, "cancel_reservation"), say(2, "done?"),
        call(3, "book_reservation"), call(4, "transfer_to_human_agents")]))
    assert run("write_actions", f).tolist() == [0.0, -0.1, 0.0, -0.1, 0.0]
    assert run("write_actions", f, per=0.5, free=1).tolist() == [0.0, 0.0, 0.0, -0.5, 0.0]


def test_unrecovered_errors_hand_computed():
    f = frame_of(
        Episode(episode_id="recovered", task=Task(query="q"), steps=[
            call(0, "get_order", error="not found"), call(1, "get_order", result="{}"), say(2, "ok")]),
        Episode(episode_id="not", task=Task(query="q"), steps=[
            call(0, "get_order", result="{}"), call(1, "cancel_order", error="denied"),
            call(2, "cancel_order", error="denied"), call(3, "get_order", error="timeout"), say(4, "sorry")]))
    # 'not': both cancel_order failures never made good, and get_order's last call failed
    assert run("unrecovered_errors", f).tolist() == [0.0, pytest.approx(-0.6)]
    assert run("unrecovered_errors", f, cap=2).tolist() == [0.0, pytest.approx(-0.4)]


def test_answer_consistency_with_the_real_model():
    """An answer that repeats what the tools said scores above one that does not."""
    from core.base.embed import Embedder

    result = '{"reservation_id": "EHGLP3", "status": "cancelled", "refund": 350, "currency": "USD"}'
    episodes = [
        Episode(episode_id="agrees", task=Task(query="cancel"), steps=[
            call(0, "cancel_reservation", result=result),
            say(1, "Reservation EHGLP3 is cancelled and 350 USD will be refunded.")]),
        Episode(episode_id="unrelated", task=Task(query="cancel"), steps=[
            call(0, "cancel_reservation", result=result),
            say(1, "The weather in Paris is sunny today, enjoy your holiday!")]),
        Episode(episode_id="no tools", task=Task(query="hi"), steps=[say(0, "Hello!")]),
    ]
    values = run("answer_consistency", frame_of(*episodes), embedder=Embedder(cache_dir=None))
    assert values[0] > values[1] + 0.2
    assert values[2] == 0.5          # no tool result before the last words: no evidence value
