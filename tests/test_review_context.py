"""What a reviewer reads about a review item (core.govern.review_context): the request, the
call with its arguments, the steps before it, the tool's result, the reward components scored
with the dataset's template, the rule that flagged it and why, and how similar items were
decided; everything bounded; and ``rwb review show``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from core import rewards
from core.access.choices import remember_choice
from core.access.users import LOCAL_ADMIN, Actor
from core.cli import root
from core.data.importers import import_file
from core.govern.review_context import MAX_TEXT, clip, review_context
from core.guard import review
from core.records.catalog import catalog_for_dataset
from core.records.store import Workspace

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "datasets" / "finance" / "sample.jsonl"
DATASET = "fin"
EPISODES = 60
ANA, RAE = Actor("ana", "analyst"), Actor("rae", "reviewer")
#: The long request and tool errors of the first episode (the context must cut them; an error,
#: unlike a result, is no text the reward embeds: the fixture needs no sentence model).
LONG_REQUEST = "Please rebalance my portfolio. " * 120
LONG_ERROR = "upstream quote service timed out; " * 100


@pytest.fixture(scope="module")
def data_ws(tmp_path_factory) -> Path:
    """The first episodes of the finance sample as dataset ``fin``, the first one's request and
    tool errors made very long (copied per test)."""
    base = tmp_path_factory.mktemp("context")
    lines = SAMPLE.read_text(encoding="utf-8").splitlines()
    first = json.loads(lines[1])
    first["task"]["query"] = LONG_REQUEST
    first["steps"][0]["observation"] = {"messages": [{"role": "user", "content": LONG_REQUEST}]}
    for step in first["steps"]:
        if step["action"]["kind"] == "tool_call":
            step["tool_result"], step["tool_error"] = None, LONG_ERROR
    path = base / "fin.jsonl"
    path.write_text("\n".join([lines[0], json.dumps(first), *lines[2:EPISODES + 1]]) + "\n", encoding="utf-8")
    ws = Workspace.open(base / "ws")
    import_file(ws, path, dataset=DATASET)
    rewards.score(ws, "finance_risk", dataset=DATASET)   # the component cache a reviewer's visit finds
    ws.close()
    return base / "ws"


@pytest.fixture
def ws(data_ws, tmp_path):
    copy = tmp_path / "ws"
    shutil.copytree(data_ws, copy)
    w = Workspace.open(copy)
    yield w
    w.close()


def _tool_steps(ws: Workspace, tool: str | None = None) -> list[review.RecordedStep]:
    """Recorded tool-call steps (of ``tool``) past each episode's first step, one per episode."""
    catalog = catalog_for_dataset(ws, DATASET)
    out = []
    for episode in ws.load_episodes(DATASET):
        steps = [s for s in review.recorded_steps(episode, DATASET, catalog)
                 if s.step_t > 0 and s.token.tool and (tool is None or s.token.tool == tool)]
        out.extend(steps[:1])
    return out


def _send(ws: Workspace, step: review.RecordedStep, reason: str = "check this order") -> int:
    return review.send_step(ws, ANA, DATASET, step.episode_id, step.step_t, reason).id


def _decide(ws: Workspace, item_id: int, decision: str, note: str) -> None:
    review.claim(ws, RAE, item_id)
    review.decide(ws, RAE, item_id, decision, note)


# --------------------------------------------------------------------------- the step
def test_a_sent_step_shows_request_call_result_steps_rule_and_components(ws):
    step = _tool_steps(ws, "place_order")[0]
    item_id = _send(ws, step, "a market order this large needs a second look")
    episode = ws.get_episode(DATASET, step.episode_id)
    recorded = next(s for s in episode.steps if s.t == step.step_t)

    c = review_context(ws, item_id)
    first = episode.steps[0].observation["messages"][0]["content"]
    assert c.request == first and c.request_source == "the first user message"
    assert c.call.startswith("place_order(") and all(f"{k}=" in c.call for k in recorded.action.params)
    assert json.loads(c.arguments) == recorded.action.params and c.arguments_note is None
    if recorded.tool_error:
        assert c.result == f"error: {recorded.tool_error}"
    else:
        assert json.loads(c.result) == recorded.tool_result

    earlier = [s for s in episode.steps if s.t < step.step_t]
    agent = [s for s in c.steps_before if s.who == "agent"]
    assert [s.t for s in agent] == [s.t for s in earlier]
    assert [s.tool for s in agent] == [s.action.tool for s in earlier]
    assert all(s.reward is not None for s in agent)
    assert c.steps_before_total == len(c.steps_before)

    assert c.rule.name == "sent_by_person" and "ana" in c.rule.title
    assert "a market order this large needs a second look" in c.rule.why

    # the components are the Reward Pyramid's: the dataset's template over the whole dataset
    assert c.template is not None and c.template.label == "finance_risk@0"
    assert "finance" in c.template.why and "finance_risk@0" in c.components_note
    scored = rewards.score(ws, "finance_risk", dataset=DATASET)
    position = [s.t for s in episode.steps].index(step.step_t)
    expected = {x.name: x.value for x in scored.explain(step.episode_id, position)}
    assert {x.name: x.value for x in c.components} == pytest.approx(expected)
    assert len(c.components) >= 5 and all(x.label and x.description for x in c.components)
    assert c.step_reward == pytest.approx(
        float(scored.step_reward[int(scored.frame.ep_start[scored.frame.episode_index()[step.episode_id]]) + position]))
    assert "place_order" in c.reject_blocks and "task type is" in c.reject_blocks


def test_every_text_is_bounded(ws):
    first = ws.load_episodes(DATASET, limit=1)[0]
    catalog = catalog_for_dataset(ws, DATASET)
    step = next(s for s in review.recorded_steps(first, DATASET, catalog) if s.step_t > 1 and s.token.tool)
    c = review_context(ws, _send(ws, step))
    assert len(LONG_REQUEST) > MAX_TEXT
    assert c.request == clip(LONG_REQUEST) and c.request.endswith(f"…({len(LONG_REQUEST) - MAX_TEXT:,} more characters)")
    assert len(c.result) < MAX_TEXT + 40 and "more characters)" in c.result
    assert all(len(s.text) < 200 and (s.result is None or len(s.result) < 200) for s in c.steps_before)
    assert any(s.result and "more characters)" in s.result for s in c.steps_before)
    # the request is shown once, not again as the first message before the step
    assert not any(s.who == "user" and s.text.startswith("Please rebalance") for s in c.steps_before)


def test_clip_says_how_much_it_left_out():
    assert clip("abc", 5) == "abc"
    assert clip("a" * 1234, 4) == "aaaa…(1,230 more characters)"


# --------------------------------------------------------------------------- similar decisions
def test_similar_items_are_counted_with_their_last_notes(ws):
    steps = _tool_steps(ws, "place_order")
    assert len(steps) >= 4, "the sample has fewer place_order steps than the test needs"
    ids = [_send(ws, s) for s in steps[:4]]
    _decide(ws, ids[0], "approve", "fine: the client asked for it")
    _decide(ws, ids[1], "reject", "no market orders that size")
    _decide(ws, ids[2], "reject", "never without a risk check")
    other = next(s for s in _tool_steps(ws) if s.token.tool != "place_order")
    _decide(ws, _send(ws, other), "approve", "a read, harmless")

    by = {g.by: g for g in review_context(ws, ids[3]).similar}
    tool, rule = by["tool"], by["rule"]
    assert (tool.approved, tool.rejected) == (1, 2) and tool.basis == "the tool place_order"
    assert [d.comment for d in tool.last] == ["never without a risk check", "no market orders that size",
                                              "fine: the client asked for it"]
    assert [d.decision for d in tool.last] == ["reject", "reject", "approve"]
    assert (rule.approved, rule.rejected) == (2, 2)        # every item here was sent by a person
    assert all(d.item_id != ids[3] for g in by.values() for d in g.last)


# --------------------------------------------------------------------------- the template
def test_the_template_follows_the_choice_the_user_made_and_can_be_named(ws):
    item_id = _send(ws, _tool_steps(ws, "place_order")[0])
    remember_choice(ws, RAE, "template", "tool_agent@0", scope="finance")
    mine = review_context(ws, item_id, actor=RAE)
    assert mine.template.label == "tool_agent@0" and "you used last" in mine.template.why
    assert review_context(ws, item_id, actor=ANA).template.label == "finance_risk@0"
    named = review_context(ws, item_id, template="finance_risk@0", actor=RAE)
    assert named.template.label == "finance_risk@0" and named.template.why == "the template you chose"
    assert {c.name for c in named.components} != {c.name for c in mine.components}


# --------------------------------------------------------------------------- other origins
def test_a_served_item_shows_what_was_recorded_and_why_its_rule_fired(ws):
    item_id = review.enqueue(ws, Actor.service(), review.ReviewRequest(
        origin="serving", reason="high-risk action served with confidence 0.41 (below 0.7) by the policy",
        state={"hour": 14, "volatility": 0.83}, task_type="urgent_reduce", token_id=12, token_name="A3T1",
        action_label="sell(amount=…)", tool="sell", risk="high",
        reward_components={"state_value": 0.5, "action_advantage": -0.1}, confidence=0.41, dataset=DATASET,
        episode_id="live-1", step_t=2, decision_id="d-1", meta={"query": "Sell everything now!"}))
    c = review_context(ws, item_id)
    assert c.request == "Sell everything now!" and c.request_source == "the served request"
    assert c.call == "sell(amount=…)" and c.arguments == "" and "not recorded" in c.arguments_note
    assert [(x.name, x.value) for x in c.components] == [("state_value", 0.5), ("action_advantage", -0.1)]
    assert c.template is None and "recorded" in c.components_note
    assert c.rule.name == "low_confidence_high_risk"
    assert (c.rule.value, c.rule.threshold, c.rule.risk) == (0.41, 0.7, "high")
    assert "41%" in c.rule.why and "below 70%" in c.rule.why
    assert c.steps_before == [] and c.result is None


def test_a_served_item_reads_its_call_and_the_steps_before_from_the_audit_trail(ws):
    from core.access.audit import write_record

    engine = Actor.service()
    calls = [("d-1", {"kind": "tool_call", "tool": "get_portfolio", "params": {}}),
             ("d-2", {"kind": "tool_call", "tool": "place_order",
                      "params": {"symbol": "600519", "side": "sell", "quantity": 900}})]
    for k, (decision, action) in enumerate(calls):
        write_record(ws, engine, {"timestamp": f"2025-06-02T10:00:0{k}Z", "final_action": k,
                                  "episode_id": "live-7", "decision_id": decision},
                     request={"query": "Sell my Moutai", "state": {"hour": 10}}, action=action)
    item_id = review.enqueue(ws, engine, review.ReviewRequest(
        origin="serving", reason="high-risk action served with confidence 0.55 (below 0.7) by the policy",
        state={"hour": 10}, token_id=3, token_name="A14T2", action_label="place_order(side=sell, …)",
        tool="place_order", risk="high", confidence=0.55, dataset=DATASET, episode_id="live-7", step_t=1,
        decision_id="d-2"))
    c = review_context(ws, item_id)
    assert c.request == "Sell my Moutai" and c.request_source == "the served request"
    assert c.call == 'place_order(symbol="600519", side="sell", quantity=900)' and c.arguments_note is None
    assert json.loads(c.arguments) == calls[1][1]["params"]
    assert [(s.who, s.tool) for s in c.steps_before] == [("agent", "get_portfolio")]
    assert c.components == [] and "no reward components" in c.components_note


def test_a_training_item_names_the_repeat_threshold():
    item = review.ReviewItem(
        id=1, origin="training", reason="curriculum L3: the policy took the high-risk action sell(…) 3 times in a row",
        dataset=None, task_type=None, state={}, key_features=None, token_id=1, token_name="A1T0",
        action_label="sell(…)", tool="sell", risk="high", reward_components=[], confidence=0.3, run_id="r-1",
        episode_id="e", step_t=4, decision_id=None, status="pending", created_at="", created_by="trainer",
        claimed_by=None, claimed_at=None, claim_expires=None, decision=None, decided_by=None, decided_at=None,
        comment=None, meta={"update": 7, "curriculum_level": 3}, claim_expired=False, age_s=0.0)
    rule = review.flag_rule(item, repeat_threshold=3)
    assert (rule.name, rule.value, rule.threshold) == ("repeated_high_risk", 3.0, 3.0)
    assert "update 7" in rule.why and "3 times in a row" in rule.why


def test_a_training_item_shows_the_policys_proposal_not_the_logged_call(ws):
    """A run's item is the policy's own action in the state of a recorded step: the call under
    review is that action, the logged call is named as what the agent did there instead, and
    the reward is the simulator's for the proposal."""
    step = _tool_steps(ws, "get_quote")[0] if _tool_steps(ws, "get_quote") else _tool_steps(ws)[0]
    episode = ws.get_episode(DATASET, step.episode_id)
    recorded = next(s for s in episode.steps if s.t == step.step_t)
    item_id = review.enqueue(ws, LOCAL_ADMIN, review.ReviewRequest(
        origin="training", reason="curriculum L3: the policy took the high-risk action while exploring",
        state={"hour": 10.0}, token_id=7, token_name="A7T1", action_label="place_order(side=sell, …)",
        tool="place_order", risk="high", reward_components={"risk": -0.5, "tool_validity": 1.0},
        dataset=DATASET, run_id="run-x", episode_id=step.episode_id, step_t=step.step_t,
        meta={"update": 5}))

    c = review_context(ws, item_id)
    assert c.call == "place_order(side=sell, …)" and c.arguments == "" and c.result is None
    assert c.proposed_by_policy
    assert "proposed action" in c.arguments_note and f"called {recorded.action.tool}(" in c.arguments_note
    assert {x.name: x.value for x in c.components} == {"risk": -0.5, "tool_validity": 1.0}
    assert "simulator's reward for the proposed action" in c.components_note
    assert c.rule.name == "repeated_high_risk" and "once" in c.rule.why


# --------------------------------------------------------------------------- the CLI
def test_cli_review_show_prints_the_context(ws):
    step = _tool_steps(ws, "place_order")[0]
    item_id = _send(ws, step, "look at the size")
    runner = CliRunner()
    r = runner.invoke(root, ["-w", str(ws.root), "review", "show", str(item_id)])
    assert r.exit_code == 0, r.output
    episode = ws.get_episode(DATASET, step.episode_id)
    for text in (episode.steps[0].observation["messages"][0]["content"][:40], "call:", "arguments:",
                 "why it is here: Sent to review by ana", "reward components:", "Tool validity",
                 "Scored with finance_risk@0", "before it (", "decided before, with the tool place_order",
                 "rejecting blocks: place_order", "events:"):
        assert text in r.output, text

    r = runner.invoke(root, ["-w", str(ws.root), "review", "show", str(item_id), "--json",
                             "--template", "tool_agent"])
    assert r.exit_code == 0, r.output
    shown = json.loads(r.output)
    assert shown["item"]["id"] == item_id and shown["template"]["label"] == "tool_agent@0"
    assert shown["components"] and shown["rule"]["name"] == "sent_by_person"

    review.claim(ws, LOCAL_ADMIN, item_id)
    r = runner.invoke(root, ["-w", str(ws.root), "review", "decide", str(item_id), "reject", "-m", "too big"])
    assert r.exit_code == 0 and f"#{item_id} rejected by local" in r.output and "rejectd" not in r.output
