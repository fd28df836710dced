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
    assert {m.label: m.value for m in at.metric}["Pending"] == "2"
    _button(at, "Claim next item").click()
    at.run()
    assert not at.exception, at.exception
    assert "margin_trade(side=buy, lot=0)" in at.subheader[0].value
    text = " ".join(m.value for m in at.markdown)
    assert "high-risk action served with confidence 0.40" in text
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Action token"] == "A13T0" and metrics["Risk"] == "high" and metrics["Claimed"] == "1"
    frames = [df.value for df in at.dataframe]
    assert any("volatility" in str(f) for f in frames) and any("action_advantage" in str(f) for f in frames)

    _button(at, "Reject: never in this state").click()          # no comment: refused, shown
    at.run()
    assert not at.exception and "say why" in at.error[0].value
    at.text_area(key="review_comment").set_value("no margin while the market is this volatile")
    _button(at, "Reject: never in this state").click()
    at.run()
    assert not at.exception, at.exception
    assert "now a mask rule" in at.success[0].value
    assert review.stats(queue_ws).rejected == 1
    [rule] = review.review_mask_rules(queue_ws)
    assert rule.targets == {"tokens": ["A13T0"]}

    _button(at, "Claim next item").click()
    at.run()
    _button(at, "Approve: reasonable exploration").click()
    at.run()
    assert not at.exception, at.exception
    assert review.stats(queue_ws).approved == 1
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
