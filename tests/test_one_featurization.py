"""One featurization: the state features the decision engine gives its policy for a request
equal the ones core.state.features.extract_features computes for the same logged step —
the rows the trainer's simulator and the evaluator gather with ``RawStateFeatures.step_batch``.

Episodes are replayed through ``DecisionEngine.decide`` one request per step, with a
scripted baseline that proposes the logged action at a confidence under the RL-Boost
threshold and ``force_rde_override``: every request runs the policy, and the engine
serves (and so remembers in its trace) what the log did.  The policy's inputs are read
where the policy receives them, on the torch module's path and on the numpy one.
"""

from __future__ import annotations

import dataclasses
import inspect
from datetime import datetime, timedelta, timezone

import numpy as np
import pytest

# module_hash_embedder is autouse: every test here embeds with the hash embedder
from _bundle_fixtures import module_hash_embedder, trained  # noqa: F401
from _state_fixtures import HashEmbedder
from core.govern.bundle import load_bundle
from core.records.episodes import Action, Episode, Step, Task
from core.records.store import Workspace
from core.serve import serving
from core.serve.serving import DecisionEngine, ServingConfig
from core.state import features
from core.state.features import INVALID_TOKEN, PAD_TOKEN, extract_features

START = datetime(2024, 5, 6, 9, 30, tzinfo=timezone.utc)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return trained(tmp_path_factory)


@pytest.fixture(scope="module")
def bundle(run):
    return load_bundle(run.bundle)


@pytest.fixture(scope="module")
def logged(run):
    w = run.workspace()
    episodes = w.load_episodes("finance")[:12]
    w.close()
    return episodes


class ScriptedTree:
    """A baseline that proposes ``token`` for every request with confidence 0.5 (below the
    0.7 RL-Boost threshold): the policy runs on every request, and with
    ``force_rde_override`` the engine serves ``token``."""

    def __init__(self, task_types):
        self.task_types = task_types
        self.token = 0

    def featurize(self, states, task_types, step_t, prev):
        return np.zeros((len(states), 1))

    def predict(self, X, mask):
        return np.full(len(X), self.token, dtype=np.int64), np.full(len(X), 0.5)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


# --------------------------------------------------------------------------- episodes
def _stamp(seconds: float) -> str:
    return (START + timedelta(seconds=seconds)).isoformat().replace("+00:00", "Z")


def _timed(steps: list[Step], gaps: list[float]) -> list[Step]:
    """``steps`` renumbered, with timestamps ``gaps`` seconds apart."""
    at = np.concatenate([[0.0], np.cumsum(gaps)])
    return [s.model_copy(update={"t": t, "timestamp": _stamp(float(at[t]))}) for t, s in enumerate(steps)]


def _numeric_tool(bundle) -> tuple[str, list[str]]:
    """A tool whose key result fields the training statistics normalise, and those fields."""
    stats = bundle.feature_stats
    return next((t, [f for f in fields if f"{t}:{f}" in stats.numeric])
                for t, fields in sorted(stats.key_fields.items())
                if any(f"{t}:{f}" in stats.numeric for f in fields))


def _full_state(bundle) -> dict:
    """Every numeric state feature the policy was trained on, at its training centre + 1 scale."""
    num = bundle.feature_stats.numeric
    return {k.removeprefix("state:"): round(c + s, 3) for k, (c, s) in sorted(num.items())
            if k.startswith("state:") and not k.endswith(features.LOG_SUFFIX)}


def _logged_call(logged, tool: str) -> Step:
    """A logged step that called ``tool`` (its action is one the catalog knows)."""
    return next(s for ep in logged for s in ep.steps if s.action.kind == "tool_call" and s.action.tool == tool)


def edge_episodes(bundle, logged) -> list[Episode]:
    """Hand-made episodes over the bundle's catalog: a first step with no history, a tool
    error, an unknown tool, a result logged as a JSON string, a call that returned
    nothing, missing and never-seen state keys, and unicode in the request, the result
    and the state."""
    tool, fields = _numeric_tool(bundle)
    call = _logged_call(logged, tool)
    full = _full_state(bundle)
    partial = dict(list(full.items())[: len(full) // 2])      # the other numeric keys are missing
    result = {**{f: 1.5 + i for i, f in enumerate(fields)}, "備註": "成交 ✓", "status": "Ünïcode-OK"}

    def step(action: Action, state: dict, **extra) -> Step:
        return Step(t=0, observation={"state": state}, action=action, **extra)

    unicode_episode = Episode(
        episode_id="unicode-edges", domain="finance",
        task=Task(query="紧急减持 600519 仓位 20% 🚀 — réduire maintenant", task_type="urgent_reduce"),
        steps=_timed([
            step(call.action, full, tool_result=result),                               # first step
            step(call.action, partial, tool_error="超时: upstream timed out ⏱"),         # a tool error
            step(Action(kind="tool_call", tool="mystery_tool", params={"q": "x"}),     # an unknown tool
                 {**partial, "λ_new": 3.0, "session": "开盘"}, tool_result={"価格": 12.5, "note": "ok"}),
            step(call.action, {}, tool_result='{"%s": -2.25, "status": "halted"}' % fields[0]),  # JSON text
            step(call.action, {"session": "CLOSED", "flag": True}),                    # returned nothing
            step(Action(kind="final_answer"), full),
        ], gaps=[2.0, 0.5, 31.0, 7.25, 120.0]))
    quiet_episode = Episode(
        episode_id="no-state", domain="finance",
        task=Task(query="Analyse the Q3 report of 600036", task_type="analysis"),
        steps=_timed([step(call.action, {}, tool_result=result), step(Action(kind="final_answer"), {})], gaps=[3.0]))
    return [unicode_episode, quiet_episode]


def replayed_episodes(logged) -> list[Episode]:
    """Logged finance episodes with timestamps on every step (the engine's clock follows them)."""
    rng = np.random.default_rng(0)
    return [ep.model_copy(update={"steps": _timed(list(ep.steps), list(rng.uniform(0.2, 90.0, ep.n_steps - 1)))})
            for ep in logged[:8]]


def requests_of(ep: Episode) -> list[dict]:
    """One request per step, as a served agent sends them: the step's state and the result of
    the previous step's tool call."""
    out = []
    for t, s in enumerate(ep.steps):
        req = {"episode_id": ep.episode_id, "query": ep.task.query, "task_type": ep.task.task_type,
               "state": dict((s.observation or {}).get("state") or {})}
        prev = ep.steps[t - 1] if t else None
        if prev is not None and prev.action.kind == "tool_call":
            req["last_result"] = {"tool": prev.action.tool, "result": prev.tool_result, "error": prev.tool_error}
        out.append(req)
    return out


# --------------------------------------------------------------------------- serving, observed
def _observe(engine: DecisionEngine, path: str, monkeypatch) -> list[dict[str, np.ndarray]]:
    """The policy's inputs of every RL-Boost from now on (the current state's; the states
    after each candidate are left out), keyed like ``RawStateFeatures.step_batch``."""
    rt = engine.runtime
    seen: list[dict[str, np.ndarray]] = []
    if path == "torch":
        forward, _ = serving._compile_policy(rt.bundle)
        calls: list[dict[str, np.ndarray]] = []

        def spy_forward(obs):
            calls.append({k: v.numpy().copy() for k, v in obs.items()})
            return forward(obs)

        real_propose = engine._propose

        def propose(*args):
            first = len(calls)
            boost = real_propose(*args)
            seen.append(calls[first])
            return boost

        monkeypatch.setattr(rt, "fast", None)
        monkeypatch.setattr(rt, "forward", spy_forward)
        monkeypatch.setattr(engine, "_propose", propose)
        return seen
    fast = rt.fast
    assert fast is not None, "the numpy policy reproduces the module on this bundle"
    real_state, real_intents = fast.state, engine._intents_of
    intents: list[tuple[np.ndarray, np.ndarray]] = []

    def intents_of(rows):
        got = real_intents(rows)
        intents.append(got)
        return got

    def spy_state(e_intent, rules, context, e_context, trace_action, trace_reward, trace_dt):
        if len(seen) < len(intents):   # the first call of a run: the current state
            emb, rules_given = intents[len(seen)]
            seen.append({"intent_emb": emb.copy(), "intent_rules": rules_given.copy(), "context": context.copy(),
                         "trace_action": trace_action.copy(), "trace_reward": trace_reward.copy(),
                         "trace_dt": trace_dt.copy()})
            np.testing.assert_array_equal(rules, rules_given)
        return real_state(e_intent, rules, context, e_context, trace_action, trace_reward, trace_dt)

    monkeypatch.setattr(fast, "state", spy_state)
    monkeypatch.setattr(engine, "_intents_of", intents_of)
    return seen


def serve(bundle, ws, episodes, rewards, path, monkeypatch):
    """Replay ``episodes`` through ``decide`` (reporting each step's reward); return the
    policy's inputs per step and the token served at each step."""
    tree = ScriptedTree(bundle.rde.task_types)
    clock = Clock()
    config = ServingConfig(wait_for_intent=True, force_rde_override=True, prefetch_intent=False,
                           model_process=False, review_risks=())
    engine = DecisionEngine(ws, dataclasses.replace(bundle, rde=tree), config=config, embedder=HashEmbedder(),
                            clock=clock)
    seen = _observe(engine, path, monkeypatch)
    catalog = bundle.catalog
    served: list[int] = []
    i = 0
    for ep in episodes:
        tokens = catalog.normalize_many([s.action for s in ep.steps]).token_ids
        for step, req, token in zip(ep.steps, requests_of(ep), tokens):
            # an invalid call cannot be served: the final answer stands in for it
            tree.token = int(token) if token >= 0 else catalog.final_id
            clock.t = datetime.fromisoformat(step.timestamp.replace("Z", "+00:00")).timestamp()
            d = engine.decide(req)
            assert d.rl_boost and d.final_action == tree.token and d.rl_candidates
            assert engine.report_outcome(d.decision_id, True, reward=float(rewards[i]))
            served.append(tree.token)
            i += 1
    engine.close()
    assert len(seen) == i
    return seen, np.array(served)


# --------------------------------------------------------------------------- the tests
@pytest.mark.parametrize("path", ["torch", "numpy"])
def test_serving_gives_the_policy_the_features_extract_features_computes(bundle, logged, tmp_path, path,
                                                                        monkeypatch):
    episodes = edge_episodes(bundle, logged) + replayed_episodes(logged)
    ref = extract_features(episodes, bundle.catalog, HashEmbedder(), stats=bundle.feature_stats)
    rewards = np.round(np.sin(np.arange(ref.n_steps)) * 2.0, 3)
    ws = Workspace.open(tmp_path / "ws")
    seen, served = serve(bundle, ws, episodes, rewards, path, monkeypatch)
    ws.close()

    # the edge cases are what they claim to be
    first = ref.step_episode == 0
    assert (ref.trace_action[0] == PAD_TOKEN).all()                                  # no history
    assert INVALID_TOKEN in ref.action_token[first]                                    # the unknown tool
    assert "mystery_tool" not in bundle.feature_stats.key_fields
    assert ref.context[first].any(axis=1).all()

    # what an invalid logged call left in the trace, serving's stand-in left there
    expected_trace = np.where(ref.trace_action == INVALID_TOKEN, np.where(ref.trace_step >= 0,
                              served[np.maximum(ref.trace_step, 0)], PAD_TOKEN), ref.trace_action)
    for i, obs in enumerate(seen):
        want = ref.step_batch(np.array([i]), rewards)
        where = f"step {ref.step_t[i]} of {ref.episode_ids[ref.step_episode[i]]}"
        np.testing.assert_array_equal(obs["intent_emb"], want["intent_emb"].numpy(), err_msg=where)
        np.testing.assert_array_equal(obs["intent_rules"], want["intent_rules"].numpy(), err_msg=where)
        np.testing.assert_array_equal(obs["context"], want["context"].numpy(), err_msg=where)
        np.testing.assert_array_equal(obs["trace_action"], expected_trace[i:i + 1], err_msg=where)
        np.testing.assert_allclose(obs["trace_reward"], want["trace_reward"].numpy(), rtol=0, atol=1e-6,
                                   err_msg=where)
        np.testing.assert_allclose(obs["trace_dt"], want["trace_dt"].numpy(), rtol=1e-6, atol=1e-6,
                                   err_msg=where)


def test_a_call_that_returned_nothing_leaves_the_earlier_result_in_force(bundle, logged):
    """The last step of the unicode episode follows a call with neither result nor error: its
    context keeps the JSON-text result of the step before that, two steps old (serving's
    request for it carries that empty ``last_result``; the test above holds it to this row)."""
    ep = edge_episodes(bundle, logged)[0]
    ref = extract_features([ep], bundle.catalog, HashEmbedder(), stats=bundle.feature_stats)
    stats = bundle.feature_stats
    tool = ep.steps[3].action.tool
    row = features.result_context(tool, ep.steps[3].tool_result, None, stats)
    expected = features.step_context(row, 2, 5, ep.steps[5].observation["state"], stats)
    np.testing.assert_array_equal(ref.context[5], expected)
    assert ref.context[5, features.O_FLAGS] == 1.0


def test_serving_keeps_no_featurization_of_its_own():
    """The engine builds the policy's inputs with core.state.features' functions only."""
    for gone in ("_slot", "_hash_slot", "_memo_slot", "_scatter_row", "SLOT_MEMO_KEY_CHARS", "result_context",
                 "step_context", "trace_arrays"):
        assert not hasattr(serving, gone), gone
    source = inspect.getsource(serving)
    for used in ("result_context", "step_context", "trace_arrays", "intent_features", "set_progress", "trace_after"):
        assert used in source, used
    assert "from core.state.features import" in source
    for primitive in ("hash_slots", "log1p(12)", "flatten_result", "intent_rule_vector", "LOG_SUFFIX"):
        assert primitive not in source, primitive
