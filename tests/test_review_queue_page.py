"""The Review Queue page (AppTest): statistics, claim the next item, see its state, action,
reward components and reason, reject it (a mask rule) or approve it; buttons only for
reviewers and admins."""

from __future__ import annotations

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from core.guard import review
from core.records.store import Workspace
from core.access.users import LOCAL_ADMIN, Actor, add_user

ROOT = Path(__file__).resolve().parents[1]
PAGE = str(ROOT / "pages" / "review_queue.py")


def _item(i: int, **kw) -> review.ReviewRequest:
    base = dict(origin="serving", reason=f"high-risk action served with confidence 0.4{i} (below 0.7)",
                state={"hour": 10 + i, "volatility": 0.3, "session": "open"}, task_type="urgent_reduce",
                token_id=181 + i, token_name=f"A13T{i}", action_label=f"margin_trade(side=buy, lot={i})",
                tool="margin_trade", risk="high", reward_components={"state_value": 0.5, "action_advantage": -0.1},
                confidence=0.4, episode_id=f"sess-{i}", step_t=2, decision_id=f"d-{i}", dataset="finance")
    base.update(kw)
    return review.ReviewRequest(**base)


@pytest.fixture
def queue_ws(tmp_path, monkeypatch):
    path = tmp_path / "ws"
    ws = Workspace.open(path)
    review.enqueue_many(ws, Actor.service(), [_item(0), _item(1)])
    monkeypatch.setenv("RWB_WORKSPACE", str(path))
    yield ws
    ws.close()


def _button(at: AppTest, label: str):
    return next(b for b in at.button if b.label == label)


def test_claim_and_reject_an_item(queue_ws):
    at = AppTest.from_file(PAGE, default_timeout=60).run()
    assert not at.exception, at.exception
    assert at.title[0].value == "Review Queue"
    assert {m.label: m.value for m in at.metric}["Waiting"] == "2"
    _button(at, "Claim next item").click()
    at.run()
    assert not at.exception, at.exception
    assert at.subheader[0].value == "#1: margin_trade"
    assert [c.value for c in at.code][0] == "margin_trade(side=buy, lot=0)"      # the call, as recorded
    text = " ".join(m.value for m in at.markdown)
    assert "**Risky action served with low confidence.**" in text and "40% confidence" in text
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["The policy's confidence in its choice"] == "40%" and metrics["Threshold"] == "70%"
    assert metrics["Risk level of the action"] == "high" and metrics["Being reviewed"] == "1"
    [components] = [t.value for t in at.table]
    assert list(components["Part of the reward"]) == ["State value", "Action advantage"]
    assert list(components["Value"]) == ["+0.5", "−0.1"]
    assert any("volatility" in str(df.value) for df in at.dataframe)       # the state, under Technical details

    _button(at, "Reject: never in this state").click()          # no comment: refused, shown
    at.run()
    assert not at.exception and "say why" in at.error[0].value
    at.text_area(key="review_comment").set_value("no margin while the market is this volatile")
    _button(at, "Reject: never in this state").click()
    at.run()
    assert not at.exception, at.exception
    assert "rejected: the action is now blocked in states like this one" in at.success[0].value
    assert review.stats(queue_ws).rejected == 1
    [rule] = review.review_mask_rules(queue_ws)
    assert rule.targets == {"tokens": ["A13T0"]}

    _button(at, "Claim next item").click()
    at.run()
    _button(at, "Approve: reasonable exploration").click()
    at.run()
    assert not at.exception, at.exception
    assert review.stats(queue_ws).approved == 1
    assert "Item #2 approved" in at.success[0].value
    assert [e.token_name for e in review.approved_examples(queue_ws)] == ["A13T1"]
    _button(at, "Claim next item").click()
    at.run()
    assert "Nothing to claim" in at.info[0].value


def test_buttons_only_for_reviewers_and_admins(queue_ws):
    add_user(queue_ws, LOCAL_ADMIN, "ada", "admin", password="ada-password")
    ada = Actor("ada", "admin")
    add_user(queue_ws, ada, "ana", "analyst", password="ana-password")
    add_user(queue_ws, ada, "rae", "reviewer", password="rae-password")
    for name, role, allowed in (("ana", "analyst", False), ("rae", "reviewer", True), (None, None, False)):
        at = AppTest.from_file(PAGE, default_timeout=60)
        if name is not None:
            at.session_state["actor"] = Actor(name, role)
        at.run()
        assert not at.exception, at.exception
        labels = [b.label for b in at.button]
        assert ("Claim next item" in labels) is allowed
        assert any("Queue" == s.value for s in at.subheader)      # everyone can read the queue


def test_empty_queue_says_where_items_come_from(tmp_path, monkeypatch):
    monkeypatch.setenv("RWB_WORKSPACE", str(tmp_path / "empty"))
    at = AppTest.from_file(PAGE, default_timeout=60).run()
    assert not at.exception, at.exception
    assert any("Items arrive from training runs" in i.value for i in at.info)


def test_page_is_in_the_app_menu(queue_ws):
    at = AppTest.from_file(str(ROOT / "app" / "main.py"), default_timeout=120).run()
    assert not at.exception, at.exception
    at.switch_page("../pages/review_queue.py").run()
    assert not at.exception, at.exception
    assert [t.value for t in at.title] == ["Review Queue"]


def test_a_sent_recorded_step_shows_where_it_comes_from(tmp_path, monkeypatch):
    """A step sent from the Episodes page is listed as a recorded episode and, claimed, names
    its dataset, episode, step and sender."""
    path = tmp_path / "ws"
    ws = Workspace.open(path)
    review.enqueue(ws, Actor("ana", "analyst"), _item(
        0, origin="training", decision_id=None, run_id=None, episode_id="fin-7", step_t=3,
        reason="sent to review by ana", meta={"source": "recorded episode", "sent_by": "ana"}))
    monkeypatch.setenv("RWB_WORKSPACE", str(path))
    at = AppTest.from_file(PAGE, default_timeout=60).run()
    assert not at.exception, at.exception
    [queue] = [df.value for df in at.dataframe]
    assert list(queue["origin"]) == ["recorded episode"]
    _button(at, "Claim next item").click()
    at.run()
    assert not at.exception, at.exception
    assert any("dataset `finance`, recorded episode `fin-7`, step 3 (sent by ana)" in c.value
               for c in at.caption)
    ws.close()


def test_a_claimed_step_shows_request_arguments_rule_components_and_similar_decisions(tmp_path, monkeypatch):
    """A recorded step, claimed: the user's request, the call with its arguments, the rule and why,
    the reward components (plain names, rounded), the steps before it, and the decisions on
    items with the same tool, in that order, before the decision buttons."""
    import json

    from core.data.importers import import_file
    from core.records.catalog import catalog_for_dataset

    sample = ROOT / "datasets" / "finance" / "sample.jsonl"
    lines = sample.read_text(encoding="utf-8").splitlines()
    (tmp_path / "fin.jsonl").write_text("\n".join(lines[:41]) + "\n", encoding="utf-8")
    ws = Workspace.open(tmp_path / "ws")
    import_file(ws, tmp_path / "fin.jsonl", dataset="fin")
    catalog = catalog_for_dataset(ws, "fin")
    steps = [s for e in ws.load_episodes("fin") for s in review.recorded_steps(e, "fin", catalog)
             if s.token.tool == "place_order" and s.step_t > 0]
    ana, rae = Actor("ana", "analyst"), Actor("rae", "reviewer")
    first = review.send_step(ws, ana, "fin", steps[0].episode_id, steps[0].step_t, "size looks wrong")
    review.claim(ws, rae, first.id)
    review.decide(ws, rae, first.id, "reject", "no market order of that size")
    item = review.send_step(ws, ana, "fin", steps[1].episode_id, steps[1].step_t, "check the size")
    monkeypatch.setenv("RWB_WORKSPACE", str(tmp_path / "ws"))

    at = AppTest.from_file(PAGE, default_timeout=120).run()
    _button(at, "Claim next item").click()
    at.run()
    assert not at.exception, at.exception
    assert at.subheader[0].value == f"#{item.id}: place_order"
    episode = ws.get_episode("fin", item.episode_id)
    request = episode.steps[0].observation["messages"][0]["content"]
    recorded = next(s for s in episode.steps if s.t == item.step_t)
    markdown = [m.value for m in at.markdown]
    headings = [m for m in markdown if m.startswith("#### ")]
    assert headings == ["#### What the user asked", "#### What the agent wants to do", "#### Why it is here",
                        "#### What the reward says about this step", "#### What the tool returned",
                        "#### How similar items were decided", "#### Your decision"]
    assert f"> {request}" in markdown
    call, arguments = at.code[0].value, at.code[1].value
    assert call.startswith("place_order(") and json.loads(arguments) == recorded.action.params
    assert any("**Sent to review by ana.**" in m and "check the size" in m for m in markdown)
    components, before, same_tool, same_rule = (t.value for t in at.table)
    assert "Tool validity" in list(components["Part of the reward"])
    assert all(len(v.lstrip("+−-").replace(".", "").lstrip("0")) <= 4 for v in components["Value"])
    assert any("Scored with finance_risk@0" in c.value for c in at.caption)
    assert [t for t, who in zip(before["Step"], before["Who"]) if who == "agent"] == \
        [s.t for s in episode.steps if s.t < item.step_t]
    assert any("Items with the tool place_order: **0 approved**, **1 rejected**." == m for m in markdown)
    assert list(same_tool["Note"]) == list(same_rule["Note"]) == ["no market order of that size"]
    assert not any("rejectd" in m for m in markdown)
    ws.close()
