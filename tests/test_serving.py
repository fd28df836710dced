"""The decision engine (core.serve.serving) on a real tiny trained bundle.

Arbitration is tested on hand-built cases: a one-leaf RDE tree fixes the baseline's action
and confidence, and a fixed proposal stands in for the policy; the rest runs the real
policy, masks, review queue, audit trail and metrics.  The request features the policy sees
are checked against core.state.features.extract_features (the slow reference), and a separate
Python process serves the promoted policy the way production does.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
import yaml

# module_hash_embedder is autouse: every test here embeds with the hash embedder
from _bundle_fixtures import module_hash_embedder, promote_svc, trained  # noqa: F401
from _state_fixtures import HashEmbedder
from core.access import audit
from core.govern import registry
from core.guard import review
from core.serve import serving
from core.govern.bundle import load_bundle
from core.base.errors import ConflictError, InputError
from core.serve.serving import DecisionEngine, ServingConfig, _Boost, alert_rules
from core.state.features import result_context, step_context, trace_arrays
from core.records.store import Workspace
from core.access.users import LOCAL_ADMIN

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return trained(tmp_path_factory)


@pytest.fixture(scope="module")
def bundle(run):
    return load_bundle(run.bundle)


@pytest.fixture()
def ws(tmp_path):
    w = Workspace.open(tmp_path / "serving-ws")
    yield w
    w.close()


def trust_run_key(target: Workspace, run) -> None:
    """Let ``target`` trust the shared run's workspace key (what a deployment does once with
    ``rwb keys trust``), so the bundles and promoted copies that workspace signed load here."""
    from core.access import keys

    source = run.workspace()
    pem = Path(target.root) / "run-signing-key.pem"
    pem.write_text(keys.show(source).public_key_pem)
    source.close()
    keys.trust(target, LOCAL_ADMIN, pem)


class Clock:
    """An injectable clock (seconds)."""

    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def _engine(ws, bundle, *, clock=time.monotonic, **config) -> DecisionEngine:
    """An engine whose RL-Boosts wait for their query's embedding (the arbitration under
    test sees the policy on every boosted request; deferral has its own tests)."""
    config.setdefault("wait_for_intent", True)
    return DecisionEngine(ws, bundle, config=ServingConfig(**config), embedder=HashEmbedder(), clock=clock)


def _leaf_rde(rde, weights: dict[int, float]):
    """The bundle's tree replaced by one leaf: the baseline proposes the allowed token with
    the highest weight, with confidence = its share."""
    classes = np.array(sorted(weights), dtype=np.int64)
    return dataclasses.replace(rde, children_left=np.array([-1]), children_right=np.array([-1]),
                               feature=np.array([-2]), threshold=np.array([-2.0]),
                               value=np.array([[weights[int(c)] for c in classes]], dtype=np.float64),
                               classes=classes)


def _with_rde(bundle, weights):
    return dataclasses.replace(bundle, rde=_leaf_rde(bundle.rde, weights))


def _fixed(top, prob, est, rde_est, state_value=0.0):
    """A hand-built proposal of the policy for one row."""
    k = len(top)
    return lambda rt, rows, mask, rde_tok: _Boost(
        top=np.array([top], dtype=np.int64), prob=np.array([prob], dtype=np.float64).reshape(1, k),
        est=np.array([est], dtype=np.float64).reshape(1, k), rde_est=np.array([rde_est], dtype=np.float64),
        state_value=np.array([state_value], dtype=np.float64))


STATE = {"hour": 10, "minute": 30, "market_open": 1, "volatility": 0.12, "position": 20000,
         "position_weight": 0.2, "cash": 900000.0, "portfolio_value": 4000000.0, "leverage": 1.1,
         "trades_today": 0}


def _request(episode="e1", task_type="analysis", state=None, **extra) -> dict:
    return {"episode_id": episode, "query": "Analyse the Q3 report of Kweichow Moutai 600519 for me",
            "task_type": task_type, "state": dict(STATE if state is None else state), **extra}


#: After hours, three trades done: the masks block live quotes and trading.
LATE = dict(STATE, hour=20, trades_today=3)


def _tokens(bundle):
    """Low-risk tool calls allowed in STATE and LATE, a high-risk token allowed in STATE, and
    a token the masks block in LATE."""
    day, late = bundle.mask_for([STATE, LATE], ["analysis", "analysis"])
    low = [t.id for t in bundle.catalog.tokens if t.kind == "tool_call" and t.risk == "low"
           and day[t.id] and late[t.id]]
    high = [t.id for t in bundle.catalog.tokens if t.risk == "high" and day[t.id]]
    blocked = [t.id for t in bundle.catalog.tokens if not late[t.id]]
    assert len(low) >= 3 and high and blocked
    return low, high[0], blocked[0]


def _metric(engine, name: str, **labels) -> float:
    value = engine.metrics.registry.get_sample_value(name, labels or None)
    return 0.0 if value is None else value


# --------------------------------------------------------------------------- the request
@pytest.mark.parametrize("change, field", [
    ({"colour": "red"}, "colour"),
    ({"state": {"hour": [9, 10]}}, "state.hour"),
    ({"state": {"volatility": float("nan")}}, "state"),
    ({"query": ""}, "query"),
    ({"last_result": {"tool": "x", "latency_ms": -1}}, "last_result.latency_ms"),
])
def test_invalid_requests_are_refused_at_the_edge(bundle, ws, change, field):
    engine = _engine(ws, bundle)
    with pytest.raises(InputError) as exc:
        engine.decide({**_request(), **change})
    assert exc.value.field is not None and exc.value.field.startswith(field)
    with pytest.raises(InputError, match="query"):
        engine.decide({"episode_id": "x"})
    with pytest.raises(InputError, match="appears twice"):
        engine.decide_batch([_request("same"), _request("same")])
    engine.close()
    assert audit.stats(ws).records == 0  # nothing was served


def test_request_features_match_extract_features(run, bundle):
    """The context and trace the engine builds for one request equal the rows the trainer's
    feature extraction builds for the same logged step (the slow reference)."""
    from core.state.features import extract_features

    w = run.workspace()
    episodes = w.load_episodes("finance")[:25]
    w.close()
    stats, cat = bundle.feature_stats, bundle.catalog
    ref = extract_features(episodes, cat, HashEmbedder(), stats=stats)
    row = 0
    checked = 0
    for ep in episodes:
        clock = [datetime.fromisoformat(s.timestamp).timestamp() for s in ep.steps]
        tokens = np.asarray(cat.normalize_many([s.action for s in ep.steps]).token_ids)
        last, last_t = None, -1
        for t, step in enumerate(ep.steps):
            state = (step.observation or {}).get("state")
            res = None if last is None else result_context(last.action.tool or last.action.kind,
                                                           last.tool_result, last.tool_error, stats,
                                                           replayed=last.result_replayed)
            ctx = step_context(res, t - last_t, t, state, stats)
            act, rew, dt = trace_arrays(list(tokens[:t]), clock[:t], [0.0] * t, clock[t])
            np.testing.assert_allclose(ctx, ref.context[row], rtol=0, atol=1e-6)
            np.testing.assert_array_equal(act, ref.trace_action[row])
            np.testing.assert_allclose(dt, ref.trace_dt[row], rtol=1e-6, atol=1e-6)
            if step.tool_result is not None or step.tool_error is not None:
                last, last_t = step, t
            row += 1
            checked += 1
    assert row == ref.n_steps and checked > 50


# --------------------------------------------------------------------------- arbitration
def test_arbitration_rules_on_hand_built_cases(bundle, ws):
    low, _, blocked = _tokens(bundle)
    l1, l2, l3 = low[:3]
    b = _with_rde(bundle, {l1: 0.6, l2: 0.4})       # baseline l1 with confidence 0.6 < 0.7
    engine = _engine(ws, b)
    v = engine.policy_version

    def case(top, est, rde_est, episode, state=None):
        engine._propose = _fixed(top, [0.5, 0.3, 0.2], est, rde_est, state_value=0.2)
        return engine.decide(_request(episode, state=state))

    d = case([l2, l3, l1], [0.9, 0.5, 0.1], 0.75, "beats")               # +0.15: adopted
    assert (d.final_action, d.source, d.adopted, d.rl_boost_reasons) == (l2, "policy", True, ("low_confidence",))
    assert d.confidence == 0.5 and d.rde_action == l1 and d.rde_reward_est == 0.75
    assert d.reward_components == ({"name": "state_value", "value": 0.2},
                                   {"name": "action_advantage", "value": pytest.approx(0.7)})
    d = case([l2, l3, l1], [0.8, 0.5, 0.1], 0.75, "close")               # +0.05: the baseline stays
    assert (d.final_action, d.source, d.adopted) == (l1, "rde", False)
    assert "does not beat" in d.explanation
    d = case([l2, l3, l1], [1.0, 0.5, 0.1], 0.9, "equal")                # +0.1 is not *more* than 0.1
    assert d.final_action == l1
    d = case([blocked, l3, l1], [5.0, 0.5, 0.1], 0.1, "masked", LATE)    # the mask does not allow it
    assert d.final_action == l1 and not d.adopted
    assert [c.id for c in d.rl_candidates] == [blocked, l3, l1]
    assert _metric(engine, "rwb_rl_boost_adoptions_total", policy_version=v) == 1
    assert _metric(engine, "rwb_decisions_total", policy_version=v, source="rde") == 3

    override = _engine(ws, b, force_rde_override=True)
    override._propose = _fixed([l2, l3, l1], [0.5, 0.3, 0.2], [0.9, 0.5, 0.1], 0.75)
    d = override.decide(_request("override"))
    assert (d.final_action, d.source, d.adopted, d.overridden) == (l1, "rde", False, True)
    assert [c.id for c in d.rl_candidates] == [l2, l3, l1]          # still proposed and audited
    assert _metric(override, "rwb_rde_overrides_total", policy_version=v) == 1

    # the tree has no allowed action: the policy's pick is the only proposal …
    none = _engine(ws, _with_rde(bundle, {blocked: 1.0}))
    none._propose = _fixed([l3, l2, l1], [0.5, 0.3, 0.2], [0.1, 0.0, 0.0], float("nan"))
    d = none.decide(_request("no-rde", state=LATE))
    assert (d.final_action, d.source, d.rde_action, d.rl_boost_reasons) == (l3, "policy", None, ("no_rde_action",))
    # … and without any proposal the engine escalates to a human
    none._propose = _fixed([-1, -1, -1], [0, 0, 0], [np.nan] * 3, float("nan"))
    d = none.decide(_request("nothing", state=LATE))
    assert (d.final_action, d.source) == (bundle.catalog.escalate_id, "fallback")
    # force_rde_override never serves the policy, not even without a baseline action
    strict = _engine(ws, _with_rde(bundle, {blocked: 1.0}), force_rde_override=True)
    strict._propose = _fixed([l3, l2, l1], [0.5, 0.3, 0.2], [0.1, 0.0, 0.0], float("nan"))
    d = strict.decide(_request("no-rde-override", state=LATE))
    assert (d.final_action, d.source, d.overridden) == (bundle.catalog.escalate_id, "fallback", True)
    for e in (engine, override, none, strict):
        e.close()
    records = audit.tail(ws, 100)
    assert len(records) == 8


def test_real_rl_boost_proposes_three_unmasked_candidates(bundle, ws):
    l1, l2 = _tokens(bundle)[0][:2]
    engine = _engine(ws, _with_rde(bundle, {l1: 0.5, l2: 0.5}))
    d = engine.decide(_request("boost"))
    mask = engine.runtime.mask([STATE], ["analysis"], np.zeros((1, bundle.n_actions), np.int64))[0]
    assert d.rl_boost and len(d.rl_candidates) == 3
    probs = [c.prob for c in d.rl_candidates]
    assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1 + 1e-6
    assert all(mask[c.id] and np.isfinite(c.reward_est) for c in d.rl_candidates)
    assert d.rde_reward_est is not None and np.isfinite(d.rde_reward_est)
    # the numpy policy (the fast path) and the TorchScript trace (the module's path) equal
    # the eager module on recorded states
    import torch

    from core.serve.serving import _compile_policy

    assert engine.runtime.fast is not None and engine.runtime.forward is None
    obs = {k: v[:5] for k, v in bundle.smoke_obs().items()}
    traced, compiled = _compile_policy(bundle)
    assert compiled
    with torch.inference_mode():
        slow = bundle.policy.heads(bundle.policy.state(obs))
        for fast in (traced(obs), engine.runtime.fast.full({k: v.numpy() for k, v in obs.items()})):
            for f, s in zip(fast, slow):
                torch.testing.assert_close(torch.as_tensor(f), s, atol=1e-4, rtol=1e-4)
    engine.close()
    rec = audit.tail(ws, 1)[0]
    assert [(c.id, c.prob, c.reward_est) for c in rec.rl_candidates] == [(c.id, c.prob, c.reward_est)
                                                                         for c in d.rl_candidates]


class SlowPolicy:
    """The bundle's policy, made to take ``delay`` seconds per forward pass."""

    def __init__(self, agent, delay: float):
        self.agent, self.delay = agent, delay
        self.finished = threading.Event()  # set when a forward pass has come back from its delay

    def state(self, obs):
        time.sleep(self.delay)
        self.finished.set()
        return self.agent.state(obs)

    def heads(self, state):
        return self.agent.heads(state)


def test_candidates_over_the_time_budget_leave_the_baseline_alone(bundle, ws):
    l1, l2 = _tokens(bundle)[0][:2]
    policy = SlowPolicy(bundle.policy, 2.0)
    slow = dataclasses.replace(_with_rde(bundle, {l1: 0.55, l2: 0.45}), policy=policy)
    engine = _engine(ws, slow, time_budget_ms=50)
    d = engine.decide(_request("slow"))
    assert not policy.finished.is_set()                         # answered without waiting for the policy
    assert (d.final_action, d.source, d.timed_out, d.rl_candidates) == (l1, "rde", True, ())
    assert "budget" in d.explanation
    assert _metric(engine, "rwb_rl_boost_timeouts_total", policy_version=engine.policy_version) == 1
    engine.close()
    assert audit.tail(ws, 1)[0].rl_candidates == []


def test_a_fast_policy_runs_inline_and_a_stall_past_the_budget_is_discarded(bundle, ws, monkeypatch):
    l1, l2 = _tokens(bundle)[0][:2]
    policy = SlowPolicy(bundle.policy, 0.0)
    # A generous budget: "fast" is a tenth of it (100 ms), so a loaded machine does not keep
    # restarting the count, and the stall below is ten times what any real forward takes here.
    engine = _engine(ws, dataclasses.replace(_with_rde(bundle, {l1: 0.55, l2: 0.45}), policy=policy),
                     time_budget_ms=1000)
    threads = []
    forward = engine.runtime.forward
    engine.runtime.forward = lambda obs: threads.append(threading.current_thread()) or forward(obs)
    # The first runs go to the worker and are timed; once INLINE_WINDOW runs in a row were
    # fast, the policy runs inline (a run slowed by the machine only restarts the count).
    for t in range(3 * serving.INLINE_WINDOW):
        d = engine.decide(_request("fast"))
        assert d.rl_candidates and not d.timed_out
        if threads[-1] is threading.main_thread():
            break
    assert threads[0] is not threading.main_thread() and threads[-1] is threading.main_thread()
    assert t >= serving.INLINE_WINDOW
    policy.delay = 1.5                               # a stall inline: waited for, then discarded
    d = engine.decide(_request("fast"))
    assert (d.final_action, d.source, d.timed_out, d.rl_candidates) == (l1, "rde", True, ())
    assert threads[-1] is threading.main_thread()
    d = engine.decide(_request("fast"))              # … and the next run goes back to the worker
    assert threads[-1] is not threading.main_thread() and d.timed_out and d.source == "rde"
    engine.close()


# --------------------------------------------------------------------------- episodes
def test_episode_state_lives_with_a_ttl(bundle, ws):
    clock = Clock()
    engine = _engine(ws, bundle, clock=clock, episode_ttl_s=900)
    assert engine.decide(_request("ttl")).step_t == 0
    clock.t += 600
    d1 = engine.decide(_request("ttl", last_result={"result": {"price": 10.0}}))
    assert d1.step_t == 1 and engine.episode("ttl").step_t == 2
    assert engine.episode("ttl").trace_tokens[-1] == d1.final_action
    clock.t += 901                                               # idle past the TTL: dropped
    assert engine.episode("ttl") is None and engine.active_episodes == 0
    assert engine.decide(_request("ttl")).step_t == 0            # a new episode starts
    assert engine.report_outcome(d1.decision_id, ok=False) is False   # its episode is gone
    assert _metric(engine, "rwb_action_failures_total", policy_version=engine.policy_version) == 1
    engine.close()


def test_report_outcome_feeds_the_trace_and_the_failure_metrics(bundle, ws):
    engine = _engine(ws, bundle)
    d = engine.decide(_request("outcome"))
    assert engine.report_outcome(d.decision_id, ok=True, reward=0.42) is True
    assert engine.episode("outcome").trace_rewards == [pytest.approx(0.42)]
    for ok in (True, False, False):
        engine.report_outcome(d.decision_id, ok=ok)
    v = engine.policy_version
    assert _metric(engine, "rwb_action_outcomes_total", policy_version=v, result="failed") == 2
    assert _metric(engine, "rwb_action_outcomes_total", policy_version=v, result="ok") == 2
    text = engine.metrics_text()
    for name in ("rwb_decisions_total", "rwb_rl_boost_activations_total", "rwb_rl_boost_adoptions_total",
                 "rwb_rde_overrides_total", "rwb_review_queue_pushes_total", "rwb_action_failures_total",
                 "rwb_decision_latency_seconds_bucket", "rwb_episodes_active"):
        assert name in text
    rules = yaml.safe_load(alert_rules())["groups"][0]["rules"]
    failure = next(r for r in rules if r["alert"] == "RwbActionFailureRateHigh")
    assert "rwb_action_outcomes_total" in failure["expr"] and "[5m]" in failure["expr"]
    assert "> 0.1" in failure["expr"]
    with pytest.raises(InputError):
        engine.report_outcome(d.decision_id, ok=True, reward=float("inf"))
    engine.close()


# --------------------------------------------------------------------------- review
def test_high_risk_low_confidence_goes_to_review_and_a_rejection_is_never_served_again(bundle, ws):
    low, high, _ = _tokens(bundle)
    l1 = low[0]
    b = _with_rde(bundle, {high: 0.6, l1: 0.4})
    engine = _engine(ws, b, force_rde_override=True)       # serve the baseline's pick
    d = engine.decide(_request("risky"))
    assert (d.final_action, d.risk, d.review_item) == (high, "high", d.review_item)
    assert d.review_item is not None
    assert _metric(engine, "rwb_review_queue_pushes_total", policy_version=engine.policy_version) == 1
    engine.flush()                                          # the item is written off the request's path
    [item] = review.list_items(ws, origin="serving")
    assert (item.id, item.token_id, item.decision_id, item.episode_id) == (d.review_item, high, d.decision_id, "risky")
    assert "high-risk" in item.reason and item.state["volatility"] == STATE["volatility"]
    assert item.task_type == "analysis" and item.confidence == pytest.approx(0.6)

    claimed = review.claim(ws, LOCAL_ADMIN)
    review.decide(ws, LOCAL_ADMIN, claimed.id, "reject", "no margin trades for an analysis request")
    for episode in ("risky", "fresh"):                      # the running episode and a new one
        d = engine.decide(_request(episode))
        assert d.final_action != high and d.final_action == l1
        assert high not in [c.id for c in d.rl_candidates]
    nudged = dict(STATE, volatility=STATE["volatility"] * 1.05)   # inside the pattern (±10%)
    assert engine.decide(_request("nudged", state=nudged)).final_action == l1
    other = engine.decide(_request("other-task", task_type="rebalance"))  # another state pattern
    assert other.final_action == high
    engine.close()


def test_a_review_push_is_written_off_the_requests_path_under_the_id_the_decision_carries(bundle, ws, monkeypatch):
    low, high, _ = _tokens(bundle)
    engine = _engine(ws, _with_rde(bundle, {high: 0.6, low[0]: 0.4}), force_rde_override=True)
    writers, reservations, in_request = [], [], threading.local()
    enqueue, reserve, decide = review.enqueue_many, review.reserve_item_ids, engine.decide
    monkeypatch.setattr(review, "enqueue_many",   # whether a write ran inside a request, on its thread
                        lambda *a, **kw: writers.append(getattr(in_request, "on", False)) or enqueue(*a, **kw))
    monkeypatch.setattr(review, "reserve_item_ids", lambda *a: reservations.append(a[2]) or reserve(*a))

    def deciding(request):
        in_request.on = True
        try:
            return decide(request)
        finally:
            in_request.on = False

    engine.decide = deciding
    first = engine.decide(_request("push-1"))
    # another writer queues an item meanwhile: it is numbered after the engine's reserved block
    other = review.enqueue(ws, LOCAL_ADMIN, review.ReviewRequest(
        origin="serving", reason="queued by hand", state={}, token_id=high, episode_id="by-hand", step_t=0,
        decision_id="by-hand-1"))
    second = engine.decide(_request("push-2"))
    engine.flush()
    assert reservations == [serving.REVIEW_ID_BLOCK]                 # one block serves both pushes
    assert second.review_item == first.review_item + 1 and other > first.review_item + serving.REVIEW_ID_BLOCK - 1
    assert len(writers) == 3 and not any(writers)               # by hand, and the engine's two: none in a request
    items = {i.id: i for i in review.list_items(ws, origin="serving")}
    assert items[first.review_item].decision_id == first.decision_id
    assert items[second.review_item].decision_id == second.decision_id
    engine.close()


def test_the_next_block_of_review_ids_is_reserved_off_the_requests_path(bundle, ws, monkeypatch):
    low, high, _ = _tokens(bundle)
    monkeypatch.setattr(serving, "REVIEW_ID_BLOCK", 4)
    engine = _engine(ws, _with_rde(bundle, {high: 0.6, low[0]: 0.4}), force_rde_override=True)
    reservations, in_request, reserve, decide = [], threading.local(), review.reserve_item_ids, engine.decide
    monkeypatch.setattr(review, "reserve_item_ids",
                        lambda *a: reservations.append(getattr(in_request, "on", False)) or reserve(*a))

    def deciding(request):
        in_request.on = True
        try:
            return decide(request)
        finally:
            in_request.on = False

    engine.decide = deciding
    ids = []
    for k in range(10):
        ids.append(engine.decide(_request(f"burst-{k}")).review_item)
        engine.flush()                                       # each push written (and the ids topped up)
    assert reservations[0] is True and len(reservations) >= 3 and not any(reservations[1:])
    assert len(set(ids)) == 10
    assert {i.id for i in review.list_items(ws, origin="serving")} == set(ids)
    engine.close()


def test_a_review_write_that_fails_stays_pending_and_is_retried(bundle, ws, monkeypatch):
    low, high, _ = _tokens(bundle)
    engine = _engine(ws, _with_rde(bundle, {high: 0.6, low[0]: 0.4}), force_rde_override=True)
    enqueue = review.enqueue_many

    def locked(*a, **kw):
        raise sqlite3.OperationalError("database is locked")

    monkeypatch.setattr(review, "enqueue_many", locked)
    d = engine.decide(_request("locked"))                    # served all the same, with its item's id
    assert d.review_item is not None
    with pytest.raises(sqlite3.OperationalError):
        engine.flush()
    assert isinstance(engine.review_error, sqlite3.OperationalError)
    assert _metric(engine, "rwb_review_write_failures_total") >= 1
    assert review.list_items(ws, origin="serving") == []
    monkeypatch.setattr(review, "enqueue_many", enqueue)
    engine.flush()                                            # retried: nothing was lost
    [item] = review.list_items(ws, origin="serving")
    assert (item.id, item.decision_id) == (d.review_item, d.decision_id) and engine.review_error is None
    engine.close()


def test_reserved_review_ids_are_never_given_out_again(ws):
    first = review.reserve_item_ids(ws, LOCAL_ADMIN, 3)
    mine = review.enqueue(ws, LOCAL_ADMIN, review.ReviewRequest(origin="serving", reason="r", state={}, token_id=1,
                                                                 episode_id="e", step_t=0, decision_id="d-1"))
    again = review.reserve_item_ids(ws, LOCAL_ADMIN, 2)
    assert len(set(first) | {mine} | set(again)) == 6 and mine > max(first) and min(again) > mine
    req = review.ReviewRequest(origin="serving", reason="r", state={}, token_id=1, episode_id="e", step_t=1,
                               decision_id="d-2")
    assert review.enqueue_many(ws, LOCAL_ADMIN, [req], ids=[first[0]]) == [first[0]]
    with pytest.raises(ConflictError):                         # the same source step under another reserved id
        review.enqueue_many(ws, LOCAL_ADMIN, [req], ids=[first[1]])
    with pytest.raises(InputError):
        review.reserve_item_ids(ws, LOCAL_ADMIN, 0)


def test_a_rejection_decided_in_another_process_is_picked_up_by_the_next_check(bundle, ws, monkeypatch):
    """This process's own rejections count at the next decision (above); the workspace is
    checked for other processes' every MASK_RULES_CHECK_S seconds."""
    low, high, _ = _tokens(bundle)
    l1 = low[0]
    engine = _engine(ws, _with_rde(bundle, {high: 0.6, l1: 0.4}), force_rde_override=True)
    d = engine.decide(_request("elsewhere"))
    assert d.final_action == high and d.review_item is not None
    engine.flush()
    review.claim(ws, LOCAL_ADMIN)
    counter = review._rules_added
    review.decide(ws, LOCAL_ADMIN, d.review_item, "reject", "decided by a reviewer in the app")
    monkeypatch.setattr(review, "_rules_added", counter)       # as if another process had added it
    monkeypatch.setattr(serving, "MASK_RULES_CHECK_S", 3600.0)
    assert engine.decide(_request("elsewhere-2")).final_action == high   # not checked yet
    monkeypatch.setattr(serving, "MASK_RULES_CHECK_S", 0.0)
    assert engine.decide(_request("elsewhere-3")).final_action == l1     # the next check sees it
    engine.close()


# --------------------------------------------------------------------------- audit
def test_every_decision_writes_one_audit_record_with_the_seed_schema(run, bundle, ws, tmp_path):
    engine = _engine(ws, bundle)
    w = run.workspace()
    episodes = w.load_episodes("finance")[:6]
    w.close()
    decisions = []
    for ep in episodes:
        prev = None
        for step in ep.steps[:4]:
            req = {"episode_id": ep.episode_id, "query": ep.task.query, "task_type": ep.task.task_type,
                   "state": step.observation["state"]}
            if prev is not None and (prev.tool_result is not None or prev.tool_error is not None):
                req["last_result"] = {"result": prev.tool_result, "error": prev.tool_error,
                                      "latency_ms": prev.latency_ms}
            decisions.append(engine.decide(req))
            prev = step
    engine.close()
    records = audit.list_records(ws, limit=1000, newest_first=False)
    assert len(records) == len(decisions)
    keys = ["timestamp", "input_hash", "rde_action", "rl_candidates", "final_action", "reward_components",
            "policy_version", "episode_id", "decision_id"]
    by_id = {r.decision_id: r for r in records}
    for d in decisions:
        r = by_id[d.decision_id]
        assert list(r.to_dict()) == keys
        assert (r.final_action, r.rde_action, r.episode_id) == (d.final_action, d.rde_action, d.episode_id)
        assert r.policy_version == bundle.policy_version
        assert all(set(c) == {"id", "prob", "reward_est"} for c in r.to_dict()["rl_candidates"])
        assert all(set(c) == {"name", "value"} for c in r.to_dict()["reward_components"])
    assert any(d.rl_boost for d in decisions) and any(not d.rl_boost for d in decisions)
    # the served traffic goes back into the workbench as episodes
    out = audit.export(ws, LOCAL_ADMIN, tmp_path / "served.jsonl", as_episodes=True)
    assert out.episodes == len(episodes) and out.records == len(decisions)
    first = json.loads((tmp_path / "served.jsonl").read_text().splitlines()[0])
    assert first["task"]["query"] == episodes[0].task.query


def test_decide_batch_matches_one_by_one(run, bundle, tmp_path):
    w = run.workspace()
    episodes = w.load_episodes("finance")[:12]
    w.close()
    reqs = [{"episode_id": ep.episode_id, "query": ep.task.query, "task_type": ep.task.task_type,
             "state": ep.steps[0].observation["state"]} for ep in episodes]
    one = _engine(Workspace.open(tmp_path / "one"), bundle)
    batch = _engine(Workspace.open(tmp_path / "batch"), bundle)
    singles = [one.decide(r) for r in reqs]
    together = batch.decide_batch(reqs)
    key = lambda d: (d.episode_id, d.final_action, d.rde_action, d.source,  # noqa: E731
                     [c.id for c in d.rl_candidates])
    assert [key(d) for d in together] == [key(d) for d in singles]
    # the same float32 arithmetic, summed in another order for another batch size
    for a, b in zip(together, singles):
        assert [c.reward_est for c in a.rl_candidates] == pytest.approx([c.reward_est for c in b.rl_candidates],
                                                                        rel=1e-4, abs=1e-4)
        assert [c.prob for c in a.rl_candidates] == pytest.approx([c.prob for c in b.rl_candidates], abs=1e-5)
    assert any(d.rl_boost for d in together)
    one.close()
    batch.close()
    assert audit.stats(batch.ws).records == len(reqs)


# --------------------------------------------------------------------------- promotion and production
@pytest.fixture(scope="module")
def promoted(run, tmp_path_factory):
    """A policies folder with ``svc`` 0.1.0 promoted and 0.2.0 approved, through the registry."""
    return promote_svc(run, tmp_path_factory.mktemp("policies"))


def test_a_new_promoted_version_is_served_from_the_next_episode_start(run, promoted, ws):
    trust_run_key(ws, run)
    engine = DecisionEngine.from_policy(ws, "svc", root=promoted, embedder=HashEmbedder())
    assert engine.decide(_request("old")).policy_version == "svc@0.1.0"
    w = run.workspace()
    registry.promote(w, run.actor("bob"), "svc", "0.2.0", root=promoted)
    w.close()
    # the running episode keeps its version; the next one starts on the new one (no restart)
    assert engine.decide(_request("old")).policy_version == "svc@0.1.0"
    assert engine.decide(_request("new")).policy_version == "svc@0.2.0"
    assert engine.decide(_request("old")).policy_version == "svc@0.1.0"
    assert engine.policy_version == "svc@0.2.0"
    assert _metric(engine, "rwb_policy_reloads_total", result="loaded") == 1
    engine.close()
    versions = {r.episode_id: r.policy_version for r in audit.list_records(ws, newest_first=False)}
    assert versions == {"old": "svc@0.1.0", "new": "svc@0.2.0"}


PRODUCTION = textwrap.dedent("""
    import json, sys
    from core.base.embed import HashEmbedder  # the sentence model the tiny test policy was trained with
    from core.serve.serving import load
    from core.records.store import Workspace
    from core.access import audit

    ws = Workspace.open()
    requests = [json.loads(line) for line in sys.stdin]
    with load("svc", ws=ws, embedder=HashEmbedder()) as engine:
        decisions = [engine.decide(r) for r in requests]
    print(json.dumps({"decisions": [[d.policy_version, d.final_action] for d in decisions],
                      "records": audit.stats(ws).records,
                      "streamlit": "streamlit" in sys.modules}))
""")


def test_a_production_process_serves_the_promoted_policy_with_audit_records(run, promoted, tmp_path):
    policies = tmp_path / "installed"
    shutil.copytree(promoted, policies)            # the package's core/policies, as installed
    reqs = [_request("p1"), _request("p2", task_type="urgent_reduce"),
            _request("p1", last_result={"result": {"price": 1712.3}})]
    env = {**__import__("os").environ, "RWB_POLICIES_DIR": str(policies), "RWB_WORKSPACE": str(tmp_path / "prod")}
    prod = Workspace.open(tmp_path / "prod")
    trust_run_key(prod, run)     # the deployment trusts the promoting workspace's key, once
    prod.close()
    proc = subprocess.run([sys.executable, "-c", PRODUCTION], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=env, input="\n".join(json.dumps(r) for r in reqs))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["streamlit"] is False and out["records"] == 3
    assert {v for v, _ in out["decisions"]} <= {"svc@0.1.0", "svc@0.2.0"} and len(out["decisions"]) == 3
    prod = Workspace.open(tmp_path / "prod")
    assert [r.episode_id for r in audit.list_records(prod, newest_first=False)] == ["p1", "p2", "p1"]
    prod.close()


# --------------------------------------------------------------------------- the CLI
def test_cli_decide_and_metrics(run, tmp_path, capsys):
    from core.cli import main

    w = ["--workspace", str(tmp_path / "cli-ws")]
    cli_ws = Workspace.open(tmp_path / "cli-ws")
    trust_run_key(cli_ws, run)
    cli_ws.close()
    reqs = tmp_path / "reqs.jsonl"
    reqs.write_text("\n".join(json.dumps(r) for r in [_request("c1"), _request("c2")]) + "\n")
    assert main([*w, "serve", "decide", "--policy", str(run.bundle), "--request", f"@{reqs}", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [d["episode_id"] for d in out["decisions"]] == ["c1", "c2"]
    assert all(d["policy_version"] == "finance_risk@0.1.0" for d in out["decisions"])
    cli_ws = Workspace.open(tmp_path / "cli-ws")
    assert audit.stats(cli_ws).records == 2
    cli_ws.close()
    assert main([*w, "serve", "decide", "--policy", str(run.bundle), "--request", '{"episode_id": 1}']) == 2
    assert "invalid decision request" in capsys.readouterr().err
    assert main([*w, "serve", "metrics", "--alert-rules"]) == 0
    assert "RwbActionFailureRateHigh" in capsys.readouterr().out
    assert main([*w, "serve", "metrics", "--policy", str(run.bundle), "--request", json.dumps(_request("m"))]) == 0
    text = capsys.readouterr().out
    assert 'rwb_decisions_total{policy_version="finance_risk@0.1.0"' in text
    assert "rwb_decision_latency_seconds_count 1.0" in text
