"""What keeps decide() fast (core.serve.serving; measured by benchmarks/bench_decide.py), tested for
not changing what it computes: the sentence embedding stays off the baseline's path and is
computed once per episode, the tool-result part of the policy's context is built once per
result, the one-row tree walk agrees with the batched one, and the buffered audit trail
loses no record, not even through a failed background commit.
"""

from __future__ import annotations

import hashlib
import sqlite3
import threading
import time

import numpy as np
import pytest

# module_hash_embedder is autouse: every test here embeds with the hash embedder
from _bundle_fixtures import module_hash_embedder, trained  # noqa: F401
from _state_fixtures import HashEmbedder
from core.access import audit
from core.serve import serving
from core.govern.bundle import load_bundle
from core.base.errors import InputError
from core.serve.serving import DecisionEngine, ServingConfig
from core.state.features import result_context, step_context
from core.records.store import Workspace
from test_serving import LATE, STATE, _leaf_rde, _request, _tokens, _with_rde


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return load_bundle(trained(tmp_path_factory).bundle)


@pytest.fixture()
def ws(tmp_path):
    w = Workspace.open(tmp_path / "serving-ws")
    yield w
    w.close()


class CountingEmbedder(HashEmbedder):
    """The hash embedder, keeping every text it was asked to embed; a call with a text in
    ``hold`` waits until ``gate`` is opened, ``started`` tells that such a call began and
    ``done`` that it returned."""

    def __init__(self, hold: tuple[str, ...] = ()):
        super().__init__()
        self.texts: list[str] = []
        self.hold = frozenset(hold)
        self.started = threading.Event()
        self.gate = threading.Event()
        self.done = threading.Event()

    def encode(self, texts):
        self.texts.extend(texts)
        if self.hold & set(texts):
            self.started.set()
            assert self.gate.wait(10), "the embedding was never released"
            self.done.set()
        return super().encode(texts)


def _boosting(bundle):
    """The bundle with a baseline at confidence 0.5: every request runs RL-Boost."""
    l1, l2 = _tokens(bundle)[0][:2]
    return _with_rde(bundle, {l1: 0.5, l2: 0.5})


def _confident(bundle):
    """The bundle with a baseline at confidence 1: no in-distribution request runs RL-Boost."""
    return _with_rde(bundle, {_tokens(bundle)[0][0]: 1.0})


# --------------------------------------------------------------------------- the sentence embedding
def test_an_ongoing_episode_never_embeds_its_query_again(bundle, ws, monkeypatch):
    monkeypatch.setattr(serving, "INTENT_CACHE_SIZE", 1)  # the engine's own cache forgets at once
    emb = CountingEmbedder()
    engine = DecisionEngine(ws, _boosting(bundle), embedder=emb,
                            config=ServingConfig(prefetch_intent=False, wait_for_intent=True))
    a = _request("a")
    b = {**_request("b"), "query": "Rebalance my portfolio away from the banks"}
    for _ in range(3):  # interleaved: each query pushes the other out of the engine's cache
        for req in (a, b):
            assert engine.decide(req).rl_boost
    assert emb.texts == [a["query"], b["query"]]
    # a new query in a running episode is embedded once, then kept in its place
    c = {**a, "query": "Now sell half of it"}
    engine.decide(c)
    engine.decide(c)
    assert emb.texts == [a["query"], b["query"], c["query"]]
    engine.close()


def test_the_baseline_answers_without_the_embedding(bundle, ws):
    emb = CountingEmbedder()
    engine = DecisionEngine(ws, _confident(bundle), embedder=emb, config=ServingConfig(prefetch_intent=False))
    decisions = [engine.decide(_request(f"e{i}")) for i in range(3)]
    engine.close()
    assert not any(d.rl_boost for d in decisions) and emb.texts == []


def test_a_new_episode_is_embedded_in_the_background_after_its_first_decision(bundle, ws):
    emb = CountingEmbedder(hold=(_request()["query"],))   # an embedding that waits to be released
    engine = DecisionEngine(ws, _confident(bundle), embedder=emb)
    first = engine.decide(_request("new"))
    assert not emb.done.is_set()             # the decision did not wait for the held embedding
    assert not first.rl_boost
    assert emb.started.wait(5) and emb.texts == [_request()["query"]]   # … which started meanwhile
    emb.gate.set()
    # an out-of-distribution request runs RL-Boost: it uses the prefetched embedding
    far = engine.decide(_request("new", state=dict(STATE, volatility=1e6)))
    assert far.rl_boost and "out_of_distribution" in far.rl_boost_reasons
    assert emb.texts == [_request()["query"]]
    engine.close()


def test_an_rl_boost_takes_over_a_queued_embedding_instead_of_waiting_behind_others(bundle, ws):
    stuck, mine = "Explain the Q3 report of CATL", "Cut my BYD position by a third"
    emb = CountingEmbedder(hold=(stuck,))
    engine = DecisionEngine(ws, _confident(bundle), embedder=emb, config=ServingConfig(wait_for_intent=True))
    engine.decide({**_request("a"), "query": stuck})      # its prefetch holds the intent thread …
    assert emb.started.wait(5)
    engine.decide({**_request("b"), "query": mine})       # … and this one's waits in the queue
    far = engine.decide({**_request("b", state=dict(STATE, volatility=1e6)), "query": mine})
    assert far.rl_boost and not far.timed_out and far.rl_candidates   # embedded here, in time
    emb.gate.set()
    engine.close()
    assert sorted(emb.texts) == sorted([stuck, mine])     # the queued job never ran: once each


class Failing(HashEmbedder):
    def encode(self, texts):
        raise RuntimeError("the sentence model is gone")


def test_an_embedder_error_reaches_the_request_that_waits_for_it(bundle, ws):
    engine = DecisionEngine(ws, _boosting(bundle), embedder=Failing(), config=ServingConfig(wait_for_intent=True))
    with pytest.raises(RuntimeError, match="sentence model is gone"):
        engine.decide(_request("x"))
    engine.close()
    assert audit.stats(ws).records == 0   # nothing was served


def test_a_background_embedder_error_is_counted_and_named_while_the_baseline_serves(bundle, ws):
    engine = DecisionEngine(ws, _boosting(bundle), embedder=Failing())
    first = engine.decide(_request("x"))      # deferred; the background embedding fails
    assert first.intent_pending and first.source == "rde"
    deadline = time.monotonic() + 10
    while "rwb_intent_embedding_failures_total 1.0" not in engine.metrics_text():
        assert time.monotonic() < deadline, "the failed background embedding was never counted"
        time.sleep(0.01)
    again = engine.decide(_request("x"))     # still served, and the failure is named
    assert again.intent_pending and again.source == "rde"
    assert "sentence model is gone" in again.explanation
    engine.close()
    assert audit.stats(ws).records == 2


def _wait_embedded(engine, query: str) -> None:
    assert engine.ready(timeout=10), "the background embedding never finished"
    assert query in engine._intents


def test_an_rl_boost_on_a_query_not_embedded_yet_is_deferred_not_waited_for(bundle, ws):
    query = _request()["query"]
    emb = CountingEmbedder(hold=(query,))     # the embedding waits until released
    engine = DecisionEngine(ws, _boosting(bundle), embedder=emb, config=ServingConfig(prefetch_intent=False))
    first = engine.decide(_request("d"))
    assert not emb.done.is_set()              # it did not wait for the held embedding
    assert first.rl_boost and first.intent_pending and first.source == "rde" and not first.rl_candidates
    assert "deferred" in first.explanation and not first.timed_out
    assert emb.started.wait(5)                # … which the deferral started (no prefetch here)
    also = engine.decide(_request("d2"))      # same query, still under way: deferred, not embedded twice
    assert also.intent_pending
    emb.gate.set()
    _wait_embedded(engine, query)
    second = engine.decide(_request("d"))
    assert second.rl_boost and not second.intent_pending and second.rl_candidates
    engine.close()
    assert emb.texts == [query]
    assert "rwb_rl_boost_deferred_total" in engine.metrics_text()
    deferred = [line for line in engine.metrics_text().splitlines()
                if line.startswith("rwb_rl_boost_deferred_total{")]
    assert deferred and float(deferred[0].rsplit(" ", 1)[1]) == 2.0


def test_a_request_whose_tree_has_no_allowed_action_waits_for_the_policy(bundle, ws):
    _, _, blocked = _tokens(bundle)
    emb = CountingEmbedder()
    engine = DecisionEngine(ws, _with_rde(bundle, {blocked: 1.0}), embedder=emb)
    d = engine.decide(_request("none", state=LATE))
    engine.close()
    assert d.rl_boost_reasons == ("no_rde_action",) and not d.intent_pending and d.rl_candidates
    assert d.source == "policy" and emb.texts == [_request()["query"]]


# --------------------------------------------------------------------------- the policy's context
def test_the_policy_sees_fresh_context_rows_when_results_are_reused_or_replaced(bundle, ws, monkeypatch):
    stats = bundle.feature_stats
    numeric = {t: [f for f in fields if f"{t}:{f}" in stats.numeric] for t, fields in stats.key_fields.items()}
    tool, fields = next((t, f) for t, f in numeric.items() if f)  # fields the context normalises
    result_a = {path: 1.5 for path in fields}
    result_b = {path: -3.0 for path in fields}
    engine = DecisionEngine(ws, _boosting(bundle), embedder=HashEmbedder(), config=ServingConfig(wait_for_intent=True))
    calls, context = [], engine.runtime.fast.context

    def spy(rows):
        calls.append(rows.copy())  # one pass per RL-Boost: the current state's row, then the next state's
        return context(rows)

    monkeypatch.setattr(engine.runtime.fast, "context", spy)
    # (last_result sent with the request, the result in force, steps since it came)
    plan = [(None, None, 0), (result_a, result_a, 1), (None, result_a, 2), (result_b, result_b, 1),
            (None, result_b, 2)]
    for t, (sent, _, _) in enumerate(plan):
        extra = {} if sent is None else {"last_result": {"tool": tool, "result": sent}}
        assert engine.decide(_request("ctx", **extra)).rl_boost
    engine.close()
    assert len(calls) == len(plan) and all(len(rows) == 2 for rows in calls)
    seen = [rows[0] for rows in calls]
    for t, (_, in_force, since) in enumerate(plan):
        row = None if in_force is None else result_context(tool, in_force, None, stats)
        np.testing.assert_array_equal(seen[t], step_context(row, since, t, STATE, stats))
        # the state after the action: the same result one step older, one step later
        np.testing.assert_allclose(calls[t][1], step_context(row, since + 1, t + 1, STATE, stats), atol=1e-7)
    assert not np.array_equal(seen[2], seen[4])   # the replaced result shows


# --------------------------------------------------------------------------- the RDE tree
def test_the_one_row_tree_walk_agrees_with_the_batched_walk(bundle):
    rde = bundle.rde
    smoke = bundle.smoke
    X = rde.featurize(smoke["states"], smoke["task_types"], np.zeros(len(smoke["states"]), np.int64),
                      np.full(len(smoke["states"]), -2))
    rng = np.random.default_rng(0)
    # rows mixing the columns of different states reach other leaves too
    mixed = np.stack([X[rng.integers(len(X), size=X.shape[1]), np.arange(X.shape[1])] for _ in range(200)])
    rows = np.concatenate([X, mixed])
    batch = rde.leaves(rows)
    assert [int(rde.leaves(rows[i:i + 1])[0]) for i in range(len(rows))] == batch.tolist()
    assert len(set(batch.tolist())) > 3
    # a tree whose arrays are swapped after a walk (as fit_rde does) is walked anew
    one_leaf = _leaf_rde(rde, {0: 1.0})
    assert one_leaf.leaves(rows[:1]).tolist() == [0] != rde.leaves(rows[:1]).tolist()
    for name in ("children_left", "children_right", "feature", "threshold", "value", "classes"):
        setattr(one_leaf, name, getattr(rde, name))
    assert one_leaf.leaves(rows[:1]).tolist() == rde.leaves(rows[:1]).tolist()


def test_the_one_row_features_agree_with_the_batched_features(bundle):
    rde = bundle.rde
    smoke = bundle.smoke
    n_tokens = len(rde.token_prev)
    states = [*smoke["states"], {}, None, dict(smoke["states"][0], hour="late", volatility=None)]
    task_types = [*smoke["task_types"], None, "never-seen", rde.task_types[-1]]
    rng = np.random.default_rng(1)
    step_t = rng.integers(0, 9, size=len(states))
    prev = rng.integers(-2, n_tokens, size=len(states))
    batch = rde.featurize(states, task_types, step_t, prev)
    for i in range(len(states)):
        np.testing.assert_array_equal(rde.featurize(states[i:i + 1], task_types[i:i + 1], step_t[i:i + 1],
                                                    prev[i:i + 1]), batch[i:i + 1])
    with pytest.raises(InputError, match="previous token ids"):
        rde.featurize(states[:1], task_types[:1], [0], [n_tokens])


# --------------------------------------------------------------------------- the audit trail
def test_buffered_audit_records_survive_background_commits_and_a_failed_one(bundle, ws, monkeypatch):
    insert, failures = audit._insert_rows, []

    def locked_once(conn, rows):
        if not failures:
            failures.append(len(rows))
            raise sqlite3.OperationalError("database is locked")
        return insert(conn, rows)

    monkeypatch.setattr(audit, "_insert_rows", locked_once)
    engine = DecisionEngine(ws, bundle, embedder=HashEmbedder(),
                            config=ServingConfig(audit_batch_size=4, audit_flush_interval_s=0.02))
    decisions = []
    for step in range(5):
        for e in range(6):
            extra = {"last_result": {"tool": "get_kline", "result": {"close": 10.0 + step}}} if step else {}
            decisions.append(engine.decide(_request(f"ep{e}", **extra)))
        time.sleep(0.05)  # let the background commits run (the first one fails)
    engine.close()
    assert failures, "no background commit ran"
    rows = ws.conn.execute("SELECT decision_id, input_hash, request FROM audit").fetchall()
    assert sorted(r[0] for r in rows) == sorted(d.decision_id for d in decisions)
    # the request kept beside each record is the very text its input_hash hashes
    assert all(hashlib.sha256(req.encode()).hexdigest() == h for _, h, req in rows)


def test_the_engine_warms_the_sentence_model_up_at_start(bundle, ws):
    class Warming(CountingEmbedder):
        def warm_up(self):
            self.started.set()
            assert self.gate.wait(10)

    emb = Warming()
    engine = DecisionEngine(ws, _confident(bundle), embedder=emb)
    assert emb.started.wait(5)                      # started by the constructor, in the background
    assert not engine.ready(timeout=0.05)           # … and the readiness probe tells it is still loading
    assert not engine.decide(_request("w")).rl_boost   # decisions are served meanwhile
    emb.gate.set()
    assert engine.ready(timeout=10)
    engine.close()
    assert emb.texts == [_request()["query"]]       # the warm-up embedded nothing; the prefetch did


def test_the_sentence_models_warm_up_embeds_and_caches_nothing(tmp_path):
    from core.base.embed import Embedder

    emb = Embedder(cache_dir=tmp_path / "cache", shared=None)   # counts what the model itself embeds
    emb.warm_up()
    assert emb.stats == {"hits": 0, "encoded": 0} and not (tmp_path / "cache" / "index.json").exists()
    assert emb.encode(["warm up"]).shape == (1, 384) and emb.stats["encoded"] == 1


def test_the_engine_sets_the_interpreters_switch_interval_when_asked(bundle, ws):
    import sys

    before = sys.getswitchinterval()
    try:
        engine = DecisionEngine(ws, _confident(bundle), embedder=HashEmbedder(),
                                config=ServingConfig(switch_interval_ms=0.5))
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        engine.close()
    finally:
        sys.setswitchinterval(before)
    with pytest.raises(InputError, match="switch_interval_ms"):
        ServingConfig(switch_interval_ms=0)


def test_the_engine_limits_torch_and_blas_threads_when_asked(bundle, ws):
    import torch
    from threadpoolctl import threadpool_info, threadpool_limits

    before = torch.get_num_threads()
    with threadpool_limits(limits=None):   # restores numpy's BLAS pools afterwards
        try:
            engine = DecisionEngine(ws, _confident(bundle), embedder=HashEmbedder(),
                                    config=ServingConfig(torch_threads=1))
            assert torch.get_num_threads() == 1
            blas = [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"]
            assert blas and all(n == 1 for n in blas)   # numpy's BLAS (the numpy policy's matmuls)
            engine.close()
        finally:
            torch.set_num_threads(before)


def test_the_engines_embedder_reads_the_workspace_cache_and_stores_nothing(tmp_path):
    from core.base.embed import CacheReader, Embedder

    emb = Embedder(cache_dir=tmp_path / "cache")
    stored = emb.encode(["buy Moutai"])
    index = (tmp_path / "cache" / "index.json").read_bytes()
    reader = emb.reader()
    got = reader.encode(["buy Moutai", "sell Moutai"])
    assert np.array_equal(got[0], stored[0])                        # from the cache
    assert np.allclose(got[1], emb.encode(["sell Moutai"])[0], atol=1e-5)   # embedded alike …
    assert reader.stats == {"hits": 1, "encoded": 1}
    assert (tmp_path / "cache" / "index.json").read_bytes() != index   # (that encode() stored it)
    before = (tmp_path / "cache" / "index.json").read_bytes()
    reader.encode(["hold Moutai"])                                   # … but the reader never stores
    assert (tmp_path / "cache" / "index.json").read_bytes() == before and len(emb._index) == 2
    assert isinstance(reader, CacheReader)


def test_a_closed_engine_says_so_when_asked_whether_it_is_ready(bundle, ws):
    from core.base.errors import RwbError

    engine = DecisionEngine(ws, _confident(bundle), embedder=HashEmbedder())
    assert engine.ready(timeout=10)
    engine.close()
    with pytest.raises(RwbError, match="closed"):
        engine.ready()


def test_mask_rows_are_remembered_by_the_values_the_rules_read_and_the_counts(bundle, monkeypatch):
    zero = np.zeros((1, bundle.n_actions), np.int64)
    limited = bundle.masks.counted_tokens            # the tokens the rules' limits count
    assert len(limited) and len(limited) < bundle.n_actions
    counted, uncounted = zero.copy(), zero.copy()
    counted[0, limited] = 5
    uncounted[0, np.setdiff1d(np.arange(bundle.n_actions), limited)] = 5
    want = {k: serving.PolicyRuntime(bundle).mask([s], [t], c)
            for k, (s, t, c) in {"day": (STATE, "analysis", zero), "late": (LATE, "analysis", zero),
                                 "counted": (STATE, "analysis", counted)}.items()}
    rt = serving.PolicyRuntime(bundle)
    rows = []
    evaluate = rt.masks.evaluate
    monkeypatch.setattr(rt.masks, "evaluate",
                        lambda feats, counts: rows.append(len(counts)) or evaluate(feats, counts))
    first = rt.mask([STATE, LATE], ["analysis", "analysis"], np.repeat(zero, 2, axis=0))
    assert rows == [2] and np.array_equal(first, np.concatenate([want["day"], want["late"]]))
    unread = dict(STATE, cash=1.0)                   # a value no rule reads: the same row
    again = rt.mask([LATE, unread], ["analysis", "analysis"], np.repeat(zero, 2, axis=0))
    assert rows == [2] and np.array_equal(again, first[::-1])
    assert np.array_equal(rt.mask([STATE], ["analysis"], uncounted), want["day"])
    assert rows == [2]                               # counts no limit reads: the same row
    assert np.array_equal(rt.mask([STATE], ["analysis"], counted), want["counted"])
    assert rows == [2, 1] and not np.array_equal(want["counted"], want["day"])   # counted ones: in the key
    rt.mask([STATE], ["rebalance"], zero)
    assert rows == [2, 1, 1]                         # and the task type


# --------------------------------------------------------------------------- the numpy policy on the path
def test_the_intent_branch_is_computed_with_the_embedding_not_on_a_request(bundle, ws, monkeypatch):
    engine = DecisionEngine(ws, _boosting(bundle), embedder=HashEmbedder())
    fast = engine.runtime.fast
    threads, intent = [], fast.intent
    monkeypatch.setattr(fast, "intent", lambda *a: threads.append(threading.current_thread().name) or intent(*a))
    assert engine.decide(_request("i1")).intent_pending      # deferred: the query is embedded meanwhile …
    assert engine.ready(timeout=10)
    assert len(threads) == 1 and threads[0].startswith("rwb-intent")   # … with its intent branch, there
    for episode in ("i1", "i2"):                              # its own episode and another with the query
        d = engine.decide(_request(episode))
        assert d.rl_boost and not d.intent_pending and d.rl_candidates
    assert len(threads) == 1                                  # no request computed it again
    engine.close()


def _varied_requests(bundle, n_episodes: int, seed: int) -> list[list[dict]]:
    """Episodes of requests whose state wanders (now and then far out of distribution) and
    whose tool results carry the fields the context normalises, a few queries shared."""
    rng = np.random.default_rng(seed)
    stats = bundle.feature_stats
    tools = [(t, [f for f in fields if f"{t}:{f}" in stats.numeric]) for t, fields in stats.key_fields.items()]
    tools = [(t, f) for t, f in tools if f]
    queries = ["Analyse the Q3 report of Kweichow Moutai 600519 for me", "Urgently cut my BYD position by a third",
               "Rebalance my portfolio away from the banks", "What moved CATL today?"]
    episodes = []
    for e in range(n_episodes):
        query, steps = queries[e % len(queries)], []
        for k in range(int(rng.integers(2, 8))):
            state = {key: (value * float(rng.lognormal(0, 0.3)) if isinstance(value, float) else value)
                     for key, value in STATE.items()}
            if rng.random() < 0.1:
                state["volatility"] = 1e6
            req = {"episode_id": f"v{seed}-{e}", "query": query, "task_type": ["analysis", "urgent_reduce"][e % 2],
                   "state": state}
            if k and rng.random() < 0.8:
                tool, fields = tools[int(rng.integers(len(tools)))]
                req["last_result"] = {"tool": tool, "result": {f: float(rng.normal(0, 3)) for f in fields}}
            steps.append(req)
        episodes.append(steps)
    return episodes


def test_the_numpy_path_serves_what_the_module_serves_on_many_requests(bundle, tmp_path):
    """The engine's fast path (numpy policy, folded first layers, intent branches kept per
    query) against the same engine running the torch module, request by request."""
    from core.serve.fast_policy import TOLERANCE

    episodes = _varied_requests(bundle, 60, seed=7)
    served = {}
    for name in ("numpy", "module"):
        ws = Workspace.open(tmp_path / name)
        clock = {"t": 0.0}
        engine = DecisionEngine(ws, _boosting(bundle), embedder=HashEmbedder(), clock=lambda: clock["t"],
                                config=ServingConfig(wait_for_intent=True))
        if name == "module":
            engine.runtime.fast = None
            engine.runtime.forward, engine.runtime.compiled = serving._compile_policy(engine.runtime.bundle)
        else:
            assert engine.runtime.fast is not None
        out = served[name] = []
        for k in range(max(map(len, episodes))):     # the episodes interleaved, as traffic comes
            for steps in episodes:
                if k < len(steps):
                    clock["t"] += 0.7
                    out.append(engine.decide(steps[k]))
        engine.close()
        ws.close()
    assert len(served["numpy"]) == sum(map(len, episodes)) > 200
    boosted = 0
    for a, b in zip(served["numpy"], served["module"]):
        assert (a.final_action, a.source, a.rde_action, a.rl_boost_reasons) == \
            (b.final_action, b.source, b.rde_action, b.rl_boost_reasons)
        assert [c.id for c in a.rl_candidates] == [c.id for c in b.rl_candidates]
        np.testing.assert_allclose([(c.prob, c.reward_est) for c in a.rl_candidates],
                                   [(c.prob, c.reward_est) for c in b.rl_candidates], atol=TOLERANCE, rtol=TOLERANCE)
        np.testing.assert_allclose([c["value"] for c in a.reward_components],
                                   [c["value"] for c in b.reward_components], atol=TOLERANCE, rtol=TOLERANCE)
        boosted += bool(a.rl_candidates)
    assert boosted == len(served["numpy"])               # every request ran the policy


def test_the_engine_freezes_the_collector_when_asked(bundle, ws):
    import gc

    assert gc.get_freeze_count() == 0
    try:
        engine = DecisionEngine(ws, _confident(bundle), embedder=HashEmbedder(), config=ServingConfig(freeze_gc=True))
        assert gc.get_freeze_count() > 0                     # the loaded engine is out of the collector's reach
        engine.close()
    finally:
        gc.unfreeze()
    engine = DecisionEngine(ws, _confident(bundle), embedder=HashEmbedder())
    assert gc.get_freeze_count() == 0                        # the default leaves the collector alone
    engine.close()


def test_the_engine_collects_between_requests_not_inside_them_when_asked(bundle, ws):
    import gc

    assert gc.isenabled()
    starts: list[str] = []

    def record(phase, info):
        if phase == "start":
            starts.append(threading.current_thread().name)

    engine = DecisionEngine(ws, _boosting(bundle), embedder=HashEmbedder(),
                            config=ServingConfig(idle_gc=True, wait_for_intent=True))
    gc.callbacks.append(record)
    try:
        assert not gc.isenabled()                             # no collection starts from a request's allocation
        for i in range(45):
            for _ in range(2 * gc.get_threshold()[0]):   # cyclic garbage: a collection due
                cycle: list = []
                cycle.append(cycle)
            before = sum(engine.collector.collections)
            assert engine.decide(_request(f"gc{i}")).rl_boost
            deadline = time.monotonic() + 10
            while sum(engine.collector.collections) == before and time.monotonic() < deadline:
                time.sleep(0.005)
            assert sum(engine.collector.collections) == before + 1   # run after the request, on its thread
        # the older generations are collected as often as CPython's own rule has them
        assert engine.collector.collections[1] >= 3
        assert starts and set(starts) == {"rwb-gc"}
    finally:
        gc.callbacks.remove(record)
        engine.close()
    assert gc.isenabled()                                     # switched back on with the last engine
    assert serving.ServingConfig().idle_gc is False           # the default leaves the collector alone
