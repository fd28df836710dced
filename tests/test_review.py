"""The review queue (core.guard.review): atomic claims, exactly-once decisions, consequences."""

from __future__ import annotations

import json
import multiprocessing
import sqlite3
import time
from collections import Counter

import pytest
from typer.testing import CliRunner

from core.guard import review
from core.cli import root
from core.base.errors import ConflictError, InputError
from core.guard.review import ReviewRequest
from core.records.store import Workspace
from core.access.users import LOCAL_ADMIN, Actor
from review_workers import die_mid_decision, reviewer_process

# fork starts workers in milliseconds (spawn re-imports everything: seconds per process on a
# busy CI machine); the workers open their own workspace connections either way.
_MP = multiprocessing.get_context(
    "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
RITA, ROB = Actor("rita", "reviewer"), Actor("rob", "reviewer")
ENGINE = Actor.service()


def _req(i: int = 0, **kw) -> ReviewRequest:
    base = dict(
        origin="serving", reason="high-risk final action, confidence 0.41",
        state={"hour": 14, "volatility": 0.83, "regime": "spike", "holding": True},
        task_type="urgent_reduce", token_id=12, token_name="A3T1",
        action_label="sell(amount=all)", tool="sell", risk="high",
        reward_components={"accuracy": 0.5, "risk": -0.75}, confidence=0.41,
        dataset="finance", decision_id=f"d-{i}")
    base.update(kw)
    return ReviewRequest(**base)


# --------------------------------------------------------------------------- enqueue
def test_enqueue_keeps_everything_a_reviewer_needs(ws):
    item_id = review.enqueue(ws, ENGINE, _req(meta={"policy_version": "p@1"}))
    item = review.get_item(ws, item_id)
    assert item.status == "pending" and item.origin == "serving"
    assert item.state == {"hour": 14, "volatility": 0.83, "regime": "spike", "holding": True}
    assert item.meta == {"policy_version": "p@1"}
    assert item.reward_components == [{"name": "accuracy", "value": 0.5},
                                      {"name": "risk", "value": -0.75}]
    assert (item.token_id, item.token_name, item.action_label, item.tool) == (
        12, "A3T1", "sell(amount=all)", "sell")
    assert item.decision_id == "d-0" and item.created_by == ENGINE.name
    assert [e.event for e in item.events] == ["enqueued"]


def test_enqueue_is_idempotent_per_source_step(ws):
    training = dict(origin="training", reason="L3: same high-risk action 3x in a row",
                    run_id="run-7", episode_id="e-3", step_t=5, decision_id=None)
    ids = review.enqueue_many(ws, LOCAL_ADMIN, [_req(**training), _req(**training),
                                                _req(**{**training, "step_t": 6})])
    assert ids[0] == ids[1] != ids[2]
    assert review.stats(ws).pending == 2


@pytest.mark.parametrize("bad, field", [
    (dict(origin="prod"), "origin"),
    (dict(reason=" "), "reason"),
    (dict(state={"nested": {"a": 1}}), "state.nested"),
    (dict(state={"v": float("nan")}), "state.v"),
    (dict(token_id=-1), "token_id"),
    (dict(reward_components={"r": float("inf")}), "reward_components"),
    (dict(key_features=["missing"]), "key_features"),
])
def test_enqueue_refuses_bad_requests(ws, bad, field):
    with pytest.raises(InputError) as err:
        review.enqueue(ws, ENGINE, _req(**bad))
    assert err.value.field == field
    assert review.stats(ws).pending == 0


# --------------------------------------------------------------------------- claim / decide
def test_claim_is_exclusive_and_oldest_first(ws):
    a, b = review.enqueue_many(ws, ENGINE, [_req(1), _req(2)])
    assert review.claim(ws, RITA).id == a
    assert review.claim(ws, ROB).id == b
    assert review.claim(ws, ROB) is None
    with pytest.raises(ConflictError, match="claimed by rita"):
        review.claim(ws, ROB, a)
    renewed = review.claim(ws, RITA, a, lease_seconds=600)  # own claim: renewed
    assert renewed.claimed_by == "rita"
    s = review.stats(ws)
    assert (s.pending, s.claimed, s.decided) == (0, 2, 0)


def test_decide_exactly_once_and_only_by_the_holder(ws):
    a, b = review.enqueue_many(ws, ENGINE, [_req(1), _req(2)])
    with pytest.raises(ConflictError, match="not claimed"):
        review.decide(ws, RITA, a, "approve")
    review.claim(ws, RITA, a)
    with pytest.raises(ConflictError, match="claimed by rita"):
        review.decide(ws, ROB, a, "approve")
    with pytest.raises(InputError, match="approve or reject"):
        review.decide(ws, RITA, a, "maybe")
    with pytest.raises(InputError, match="comment"):
        review.decide(ws, RITA, a, "reject", "  ")
    item = review.decide(ws, RITA, a, "approve", "fine: hedging in a spike")
    assert (item.status, item.decision, item.decided_by) == ("decided", "approve", "rita")
    with pytest.raises(ConflictError, match="already decided: approve by rita"):
        review.decide(ws, RITA, a, "reject", "changed my mind")
    with pytest.raises(ConflictError, match="already decided"):
        review.claim(ws, ROB, a)
    # the database itself refuses to change a decision or delete an item / event
    for sql in ("UPDATE review_items SET decision='reject' WHERE id=1",
                "DELETE FROM review_items WHERE id=2",
                "UPDATE review_events SET actor='x'", "DELETE FROM review_events"):
        with pytest.raises(sqlite3.DatabaseError, match="final|never|append-only"):
            ws.conn.execute(sql)
    assert review.get_item(ws, a).decision == "approve"
    events = [(e.event, e.actor) for e in review.get_item(ws, a).events]
    assert events == [("enqueued", ENGINE.name), ("claimed", "rita"), ("decided", "rita")]


def test_release_puts_the_item_back(ws):
    a = review.enqueue(ws, ENGINE, _req())
    review.claim(ws, RITA)
    with pytest.raises(ConflictError, match="not by you"):
        review.release(ws, ROB, a)
    assert review.release(ws, RITA, a).status == "pending"
    assert review.claim(ws, ROB).id == a


def test_claim_expires_and_another_reviewer_decides(ws):
    a, b = review.enqueue_many(ws, ENGINE, [_req(1), _req(2)])
    review.claim(ws, RITA, a, lease_seconds=0.2)
    review.claim(ws, RITA, b, lease_seconds=0.2)
    time.sleep(0.3)
    s = review.stats(ws)
    assert (s.claimed, s.expired_claims) == (0, 2)
    assert [i.id for i in review.list_items(ws, status="open")] == [a, b]
    # rita's own expired claim: she must claim again
    with pytest.raises(ConflictError, match="expired.*claim it again"):
        review.decide(ws, RITA, b, "approve")
    # rob takes over a: rita can no longer decide it, rob can
    took = review.claim(ws, ROB)
    assert took.id == a
    assert review.item_events(ws, a)[-1].detail["expired_claim_of"] == "rita"
    with pytest.raises(ConflictError, match="claimed by rob"):
        review.decide(ws, RITA, a, "approve")
    assert review.decide(ws, ROB, a, "reject", "too risky").decided_by == "rob"
    # rita re-claims b and decides it
    review.claim(ws, RITA, b)
    assert review.decide(ws, RITA, b, "approve").decision == "approve"


def test_stats_and_list(ws):
    ids = review.enqueue_many(ws, ENGINE, [_req(i) for i in range(5)])
    time.sleep(0.05)
    for decision in ("approve", "approve", "reject"):
        item = review.claim(ws, RITA)
        review.decide(ws, RITA, item.id, decision, "because")
    review.claim(ws, ROB)
    s = review.stats(ws)
    assert (s.pending, s.claimed, s.decided, s.approved, s.rejected) == (1, 1, 3, 2, 1)
    assert s.approve_rate == pytest.approx(2 / 3) and s.open == 2
    assert s.oldest_pending_age_s is not None and s.oldest_pending_age_s >= 0.05
    assert [i.id for i in review.list_items(ws, status="decided")] == ids[:3]
    assert [i.id for i in review.list_items(ws, decision="reject")] == [ids[2]]
    assert [i.id for i in review.list_items(ws, status="claimed", claimed_by="rob")] == [ids[3]]
    assert review.stats(ws, "other-dataset").pending == 0
    with pytest.raises(InputError):
        review.list_items(ws, status="lost")


# --------------------------------------------------------------------------- consequences
def test_approve_becomes_labelled_training_data(ws):
    a, b = review.enqueue_many(ws, ENGINE, [
        _req(1, origin="training", run_id="r1", episode_id="e1", step_t=4),
        _req(2, dataset="ecommerce")])
    for item_id in (a, b):
        review.claim(ws, RITA, item_id)
        review.decide(ws, RITA, item_id, "approve", "reasonable")
    rows = review.approved_examples(ws, "finance")
    assert len(rows) == 1
    row = rows[0]
    assert row.label == review.EXPLORATION_LABEL
    assert (row.token_id, row.task_type, row.episode_id, row.step_t) == (
        12, "urgent_reduce", "e1", 4)
    assert row.state["volatility"] == 0.83
    assert len(review.approved_examples(ws)) == 2
    assert review.review_mask_rules(ws) == []


def test_reject_becomes_a_mask_rule(ws):
    a, b = review.enqueue_many(ws, ENGINE, [
        _req(1), _req(2, key_features=["hour", "regime"], token_name=None, token_id=4)])
    review.claim(ws, RITA, a)
    review.decide(ws, RITA, a, "reject", "never sell everything in a spike")
    review.claim(ws, RITA, b)
    review.decide(ws, RITA, b, "reject", "not at this hour")
    rules = review.review_mask_rules(ws, "finance")
    # default pattern: task type, text/booleans equal, numbers within ±10 %
    assert rules[0].when == {
        "task_type": {"eq": "urgent_reduce"}, "hour": {"between": [12.6, 15.4]},
        "volatility": {"between": [0.747, 0.913]}, "regime": {"eq": "spike"},
        "holding": {"eq": True}}
    assert rules[0].targets == {"tokens": ["A3T1"]} and rules[0].kind == "review"
    assert "never sell everything" in rules[0].message
    assert rules[0].meta["reviewer"] == "rita"
    # key features given at enqueue time narrow the pattern; no token name: the token id
    assert rules[1].when == {"task_type": {"eq": "urgent_reduce"},
                             "hour": {"between": [12.6, 15.4]}, "regime": {"eq": "spike"}}
    assert rules[1].targets == {"tokens": [4]}
    stored = ws.conn.execute("SELECT item_id, token_id, comment, created_by "
                             "FROM mask_rules_from_reviews ORDER BY id").fetchall()
    assert stored == [(a, 12, "never sell everything in a spike", "rita"),
                      (b, 4, "not at this hour", "rita")]
    assert review.approved_examples(ws) == []
    assert review.review_mask_rules(ws, "ecommerce") == []


def test_a_reviewer_may_give_the_pattern(ws):
    a, b = review.enqueue_many(ws, ENGINE, [_req(1), _req(2)])
    review.claim(ws, RITA, a)
    review.decide(ws, RITA, a, "reject", "never in a spike", pattern={"regime": "spike"})
    assert review.review_mask_rules(ws)[0].when == {"regime": "spike"}
    review.claim(ws, RITA, b)
    with pytest.raises(InputError, match="unknown test"):
        review.decide(ws, RITA, b, "reject", "bad pattern", pattern={"hour": {"gtt": 3}})
    assert review.get_item(ws, b).status == "claimed"  # refused whole: still undecided


def _sell_catalog():
    from core.records.catalog import build_catalog
    from core.records.episodes import ToolSchema

    sell = ToolSchema(name="sell", risk="high", parameters={
        "type": "object", "properties": {"amount": {"type": "string", "enum": ["half", "all"]}},
        "required": ["amount"]})
    quote = ToolSchema(name="get_quote", parameters={"type": "object", "properties": {}})
    return build_catalog([sell, quote])


def test_rejections_are_honoured_by_the_masks(ws):
    from core.guard.masking import MaskRules, state_features

    catalog = _sell_catalog()
    sell_all = next(t for t in catalog.tokens if t.tool == "sell" and t.preset["amount"] == "all")
    item_id = review.enqueue(ws, ENGINE, _req(token_id=sell_all.id, token_name=sell_all.name))
    review.claim(ws, RITA, item_id)
    review.decide(ws, RITA, item_id, "reject", "never sell everything in a spike")
    base = MaskRules.from_yaml("version: 1\nrules: []\n")
    rules = review.with_review_rules(base, ws, "finance")
    assert len(base) == 0 and len(rules) == 1
    assert len(review.with_review_rules(rules, ws, "finance")) == 1  # not added twice
    spike = {"hour": 14, "volatility": 0.83, "regime": "spike", "holding": True}
    states = [spike, {**spike, "volatility": 0.2}, {**spike, "hour": 14.5}, spike]
    features = state_features(states, ["urgent_reduce", "urgent_reduce", "urgent_reduce",
                                       "analysis"])
    result = rules.compile(catalog).evaluate(features)
    assert result.mask[:, sell_all.id].tolist() == [False, True, False, True]
    others = [t.id for t in catalog.tokens if t.id != sell_all.id]
    assert result.mask[:, others].all()


# --------------------------------------------------------------------------- concurrency
def test_exactly_once_with_four_processes(ws):
    ids = review.enqueue_many(ws, ENGINE, [_req(i) for i in range(200)])
    assert ids == list(range(1, 201))
    names = ["p1", "p2", "p3", "p4"]
    start, queue = _MP.Event(), _MP.Queue()
    procs = [_MP.Process(target=reviewer_process, args=(str(ws.root), n, i, start, queue))
             for i, n in enumerate(names)]
    for p in procs:
        p.start()
    start.set()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    reported = Counter(i for r in results for i in r["decided"])
    assert sorted(reported) == ids and set(reported.values()) == {1}  # each decided once
    assert sum(1 for r in results if r["decided"]) >= 2, results  # they really raced
    assert sum(r["refused"] for r in results) > 0  # and some decides were refused
    who = {i: r["name"] for r in results for i in r["decided"]}
    s = review.stats(ws)
    assert (s.pending, s.claimed, s.expired_claims, s.decided) == (0, 0, 0, 200)
    rows = ws.conn.execute("SELECT id, decision, decided_by FROM review_items").fetchall()
    assert all(by == who[i] for i, _, by in rows)
    decided_events = ws.conn.execute(
        "SELECT item_id, actor, COUNT(*) FROM review_events WHERE event='decided' "
        "GROUP BY item_id").fetchall()
    assert len(decided_events) == 200
    assert all(n == 1 and actor == who[i] for i, actor, n in decided_events)
    # every decision was made under a claim by the same actor, the last claim before it
    for i in ids:
        events = review.item_events(ws, i)
        last_claim = [e for e in events if e.event == "claimed"][-1]
        assert events[-1].event == "decided" and last_claim.actor == events[-1].actor
    rejected = {i for i, d, _ in rows if d == "reject"}
    assert rejected == {i for i in ids if i % 3 == 0}
    assert {r.name for r in review.review_mask_rules(ws)} == {f"review_{i}" for i in rejected}
    assert {r.item_id for r in review.approved_examples(ws)} == set(ids) - rejected


def test_a_process_dying_mid_decision_loses_nothing(ws):
    item_id = review.enqueue(ws, ENGINE, _req())
    proc = _MP.Process(target=die_mid_decision,
                                                         args=(str(ws.root), item_id))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 3
    item = review.get_item(ws, item_id)
    assert (item.status, item.claimed_by, item.decision) == ("claimed", "dora", None)
    assert [e.event for e in item.events] == ["enqueued", "claimed"]
    assert review.review_mask_rules(ws) == []
    time.sleep(0.35)
    review.claim(ws, ROB, item_id)
    review.decide(ws, ROB, item_id, "reject", "rob finishes it")
    assert len(review.review_mask_rules(ws)) == 1


# --------------------------------------------------------------------------- CLI
def test_cli_claim_decide_stats(tmp_path):
    wsdir = tmp_path / "cli"
    w = Workspace.open(wsdir)
    review.enqueue_many(w, ENGINE, [_req(1), _req(2)])
    w.close()
    runner = CliRunner()

    def rwb(*args: str) -> dict:
        r = runner.invoke(root, ["-w", str(wsdir), "review", *args, "--json"])
        assert r.exit_code == 0, r.output
        return json.loads(r.output)

    item = rwb("claim")["item"]
    assert item["claimed_by"] == "local"
    assert rwb("decide", str(item["id"]), "reject", "-m", "no",
               "--pattern", '{"regime": "spike"}')["decision"] == "reject"
    assert review.review_mask_rules(Workspace.open(wsdir))[0].when == {"regime": "spike"}
    assert rwb("stats")["rejected"] == 1
    assert [i["id"] for i in rwb("list", "--status", "pending")["items"]] == [2]
    context = rwb("show", "1")
    # the --json shape: what a reviewer reads (core.govern.review_context), the item first
    assert list(context) == [
        "item", "request", "request_source", "call", "arguments", "arguments_note", "result",
        "steps_before", "steps_before_total", "components", "step_reward", "template",
        "components_note", "rule", "similar", "reject_blocks", "proposed_by_policy"]
    shown = context["item"]
    assert shown["events"][-1]["event"] == "decided"
    # the item's fields in this order, then its events
    assert list(shown) == [
        "id", "origin", "reason", "dataset", "task_type", "state", "key_features", "token_id",
        "token_name", "action_label", "tool", "risk", "reward_components", "confidence", "run_id",
        "episode_id", "step_t", "decision_id", "status", "created_at", "created_by", "claimed_by",
        "claimed_at", "claim_expires", "decision", "decided_by", "decided_at", "comment", "meta",
        "claim_expired", "age_s", "events"]
    assert list(shown["events"][0]) == ["id", "event", "actor", "at", "detail"]
    assert list(rwb("list")["items"][0]) == list(shown)[:-1]
    assert context["rule"]["name"] == "low_confidence_high_risk"
    assert [c["name"] for c in context["components"]] == ["accuracy", "risk"]
    assert [g["by"] for g in context["similar"]] == ["tool", "rule"]
    r = runner.invoke(root, ["-w", str(wsdir), "review", "decide", "1", "approve"])
    assert isinstance(r.exception, ConflictError)
