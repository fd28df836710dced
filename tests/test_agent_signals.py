"""The domain-free agent signals (core.rewards.agent_signals): hand-computed cases with tool
names from real logs, the real sentence model on a known answer, and the shipped
``tool_agent`` on the three labelled real sets in datasets/real."""

from __future__ import annotations

import numpy as np
import pytest

from core.records.catalog import build_catalog
from core.records.episodes import Action, Episode, Step, Task
from core.rewards import COMPONENTS, ScoringContext, build_frame
from core.rewards.agent_signals import is_write_tool, last_words_rows
from _rewards_fixtures import FakeEmbedder


def frame_of(*episodes: Episode):
    return build_frame(list(episodes), build_catalog([], list(episodes)))


def call(t: int, tool: str, result: str | None = None, error: str | None = None) -> Step:
    return Step(t=t, action=Action(kind="tool_call", tool=tool, params={}), tool_result=result, tool_error=error)


def say(t: int, text: str) -> Step:
    return Step(t=t, action=Action(kind="reply"), output_text=text)


def answer(t: int, text: str) -> Step:
    return Step(t=t, action=Action(kind="final_answer"), output_text=text)


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


def test_last_words_are_the_last_reply_or_answer_with_text():
    f = frame_of(
        Episode(episode_id="a", task=Task(query="q"), steps=[say(0, "first"), call(1, "get_x", result="{}"),
                                                            answer(2, "last")]),
        Episode(episode_id="b", task=Task(query="q"), steps=[say(0, "only words"), call(1, "get_x", result="{}")]),
        Episode(episode_id="c", task=Task(query="q"), steps=[call(0, "get_x", result="{}")]))
    assert last_words_rows(f).tolist() == [2, 3, -1]


def test_gives_up_hand_computed():
    f = frame_of(
        Episode(episode_id="sorry", task=Task(query="q"), steps=[
            call(0, "get_x", error="not found"), say(1, "I'm sorry, I cannot find that file.")]),
        Episode(episode_id="done anyway", task=Task(query="q"), steps=[
            call(0, "send_money", result="{}"), say(1, "Sorry for the wait: the payment has been sent.")]),
        Episode(episode_id="curly", task=Task(query="q"), steps=[say(0, "I can\u2019t do this.")]),
        Episode(episode_id="then a call", task=Task(query="q"), steps=[
            say(0, "Unfortunately that is not possible."), call(1, "get_x", result="{}")]),
        Episode(episode_id="silent", task=Task(query="q"), steps=[call(0, "get_x", result="{}")]),
        Episode(episode_id="answered", task=Task(query="q"), steps=[answer(0, "Here are the 3 events.")]),
        Episode(episode_id="inside a word", task=Task(query="q"), steps=[say(0, "Scannot is a word.")]))
    # the last words decide: a later call does not undo them, a report of something done does
    assert run("gives_up", f).tolist() == [-1.0, 0.0, -1.0, -1.0, 0.0, 0.0, 0.0]
    assert run("gives_up", f, value=-0.5, give_up_words=["here are"], done_words=[]).tolist() == \
        [0.0, 0.0, 0.0, 0.0, 0.0, -0.5, 0.0]
    with pytest.raises(ValueError, match="give_up_words"):
        COMPONENTS["gives_up"](give_up_words=[])


def test_an_answer_that_rests_on_no_tool_result_earns_the_no_evidence_value():
    f = frame_of(
        Episode(episode_id="no tools", task=Task(query="q"), steps=[say(0, "The answer is 42.")]),
        Episode(episode_id="tools after", task=Task(query="q"), steps=[
            say(0, "Let me look."), call(1, "get_x", result="{}")]),
        Episode(episode_id="with tools", task=Task(query="q"), steps=[
            call(0, "get_x", result='{"a": 1}'), say(1, "a is 1")]))
    values = run("answer_consistency", f, no_evidence_value=0.0)
    assert values[:2].tolist() == [0.0, 0.0]
    assert run("answer_consistency", f, no_evidence_value=0.5)[:2].tolist() == [0.5, 0.5]
    assert 0.0 <= values[2] <= 1.0


# --------------------------------------------------------------------------- the three labelled real sets
#: folder -> (import options as datasets/real/README.md says, every how many tasks, runs per task
#: at most): a subsample that every task-size bucket reaches, so the test takes seconds
REAL_SETS = {"tau2_whissle": ({"reward_key": "outcome", "id_key": "id"}, 1, 1),
             "tau2_grok": ({"reward_key": "outcome", "id_key": "id"}, 1, 4),
             "agentdojo": ({"reward_key": "success", "id_key": "eid"}, 3, 6)}


def real_subsample(name: str, every: int, runs: int, out) -> int:
    """Write every ``every``-th task (sorted by domain and task id) of a labelled real set, its
    first ``runs`` runs, to ``out``; returns how many episodes."""
    import json
    from collections import defaultdict
    from pathlib import Path

    lines = (Path(__file__).resolve().parents[1] / "datasets" / "real" / name / "episodes.jsonl"
             ).read_text().splitlines()
    keys = [f"{r.get('domain')}:{r['task_id']}" for r in map(json.loads, lines)]
    chosen, taken, kept = set(sorted(set(keys))[::every]), defaultdict(int), []
    for line, key in zip(lines, keys):
        if key in chosen and taken[key] < runs:
            taken[key] += 1
            kept.append(line)
    out.write_text("\n".join(kept) + "\n")
    return len(kept)


@pytest.mark.parametrize("name", sorted(REAL_SETS))
def test_shipped_tool_agent_ranks_successes_first_on_every_labelled_real_set(name, tmp_path):
    """The generic pyramid does no harm on the labelled real sets (the outcome read only to
    measure): AUC above 0.5 over all pairs and within task (where tasks have both outcomes)
    on a subsample of each; the full sets' figures come from benchmarks/design_tool_agent.py."""
    from core.data.importers import import_file
    from core.records.store import Workspace
    from core.rewards import score
    from core.rewards.labels import dataset_outcomes
    from core.rewards.outcomes import fidelity

    options, every, runs = REAL_SETS[name]
    path = tmp_path / "episodes.jsonl"
    n = real_subsample(name, every, runs, path)
    ws = Workspace.open(tmp_path / "ws")
    assert import_file(ws, path, dataset=name, **options).episodes == n
    result = score(ws, "tool_agent", dataset=name)
    labels, groups = dataset_outcomes(ws, name)
    assert 0 < np.nansum(labels) < np.isfinite(labels).sum()
    fid = fidelity(result.returns, labels, groups, n_boot=20)
    assert fid.all_pairs.value > 0.5, f"{name}: all pairs {fid.all_pairs.value:.3f}"
    if runs > 1:
        assert fid.within_task.n_tasks >= 10
        assert fid.within_task.value > 0.5, f"{name}: within task {fid.within_task.value:.3f}"
