"""Reward components: one contract test over every registered component, each fast component
against its slow per-step reference, and a hand-computed case per component."""

from __future__ import annotations

import numpy as np
import pytest

from core.records.catalog import build_catalog
from core.records.episodes import Action, Episode, Outcome, Step, Task
from core.base.results import to_jsonable
from core.rewards import COMPONENTS, LEVELS, ScoringContext, available_components, build_frame
from core.rewards.reference import REFERENCES
from core.rewards.learned import SIGNAL_FEATURES, STAT_FEATURES
from _rewards_fixtures import TOOLS, FakeEmbedder, make_episodes, make_frame

ALL = sorted(COMPONENTS)


def run(name: str, frame, **params) -> np.ndarray:
    return COMPONENTS[name](**params)(frame, ScoringContext(embedder=FakeEmbedder()))


def reference(name: str, frame, **params) -> np.ndarray:
    comp = COMPONENTS[name](**params)
    if comp.uses_embeddings:
        return REFERENCES[name](frame, comp, FakeEmbedder())
    return REFERENCES[name](frame, comp)


def frame_of(*episodes: Episode):
    return build_frame(list(episodes), build_catalog(TOOLS, list(episodes)))


def episode(steps: list[Step], eid: str = "e", **kw) -> Episode:
    return Episode(episode_id=eid, task=Task(query="q"), steps=steps, **kw)


def call(t: int, tool: str, params: dict | None = None, **kw) -> Step:
    return Step(t=t, action=Action(kind="tool_call", tool=tool, params=params or {}), **kw)


def answer(t: int, text: str | None, kind: str = "final_answer") -> Step:
    return Step(t=t, action=Action(kind=kind), output_text=text)


@pytest.fixture(scope="module")
def frame():
    return make_frame(seed=1, n=16)


# --------------------------------------------------------------------------- contract
@pytest.mark.parametrize("name", ALL)
def test_component_contract(name, frame):
    cls = COMPONENTS[name]
    assert cls.description() and "\n" not in cls.description()
    assert cls.level in (*LEVELS, "penalty", "episode")
    for param, (annotation, default) in cls.param_specs().items():
        assert default is not cls.param_specs  # every parameter has a default (templates may omit it)
    described = {d.name: d for d in available_components()}[name]
    assert (described.level, described.scope, described.description) == (cls.level, cls.scope, cls.description())
    assert list(to_jsonable(described)) == ["name", "level", "scope", "description", "params"]
    values = run(name, frame)
    size = frame.n_episodes if cls.scope == "episode" else frame.n_steps
    assert values.shape == (size,) and values.dtype == np.float64
    assert np.isfinite(values).all()
    if cls.level == "penalty":
        assert (values <= 0).all()

    # batch splitting by episodes never changes a value: score shuffled episode batches and
    # put the values back in place
    perm = np.random.default_rng(7).permutation(frame.n_episodes)
    if cls.episode_local:
        batches = np.array_split(perm, 3)
    else:  # history-dependent: one shuffled batch (the frame keeps the data's time order)
        batches = [perm]
    rebuilt = np.full(size, np.nan)
    for batch in batches:
        sub = frame.take_episodes(batch)
        part = run(name, sub)
        if cls.scope == "episode":
            rebuilt[batch] = part
        else:
            rows = np.concatenate([np.arange(frame.ep_start[e], frame.ep_start[e] + frame.ep_len[e])
                                   for e in batch])
            rebuilt[rows] = part
    np.testing.assert_allclose(rebuilt, values, rtol=0, atol=1e-12)

    # and an empty frame gives an empty column
    empty = frame.take_episodes([])
    assert run(name, empty).shape == (0,)


@pytest.mark.parametrize("name", ALL)
def test_component_does_not_depend_on_listing_order(name):
    """With timestamps, the order in which episodes are listed does not matter."""
    eps = make_episodes(seed=3, n=12)
    shuffled = [eps[i] for i in np.random.default_rng(0).permutation(len(eps))]
    f1, f2 = frame_of(*eps), frame_of(*shuffled)
    v1, v2 = run(name, f1), run(name, f2)
    if COMPONENTS[name].scope == "episode":
        key1, key2 = list(f1.episode_ids), list(f2.episode_ids)
    else:
        key1 = list(zip(f1.episode_ids[f1.episode], f1.t.tolist()))
        key2 = list(zip(f2.episode_ids[f2.episode], f2.t.tolist()))
    assert dict(zip(key1, v1.tolist())) == pytest.approx(dict(zip(key2, v2.tolist())))


def test_every_component_has_a_reference():
    assert set(COMPONENTS) <= set(REFERENCES)


# --------------------------------------------------------------------------- fast == slow
VARIANTS = [
    ("tool_validity", {}), ("tool_validity", {"tool_part": 0.3, "args_part": 0.7, "error_value": -1.0}),
    ("param_reasonableness", {}),
    ("param_reasonableness", {"window": 4, "min_history": 2, "categorical": "all", "min_freq": 0.3}),
    ("param_reasonableness", {"window": 3, "min_history": 1, "z_ok": 1.0, "z_zero": 2.0,
                              "ignore": ["price"], "rel_std": 0.0}),
    ("output_consistency", {}),
    ("output_consistency", {"curve": "linear", "aggregate": "mean", "context_calls": 2,
                            "threshold": 0.2, "ramp_from": -0.5, "apply_to": ["final_answer", "tool_call"]}),
    ("evidence_reliability", {}),
    ("evidence_reliability", {"any_flag": False, "context_calls": 1, "markers": ['"n":1', "risk"]}),
    ("business_impact", {}), ("business_impact", {"field": "final_reward", "fallback_field": "business_metric",
                                                  "on": "last", "scale": 2.0, "offset": -0.5}),
    ("latency_penalty", {}), ("latency_penalty", {"unit_ms": 100.0, "cap_units": 3.0}),
    ("action_smoothing", {}), ("action_smoothing", {"opposites": [["order:buy", "order:sell"]],
                                                    "key_param": "side", "per": 0.3}),
    ("step_cost", {}), ("step_cost", {"per": 0.7, "kinds": ["tool_call", "reply"]}),
    ("repeated_failures", {}), ("repeated_failures", {"match": "tool", "cap": 2, "count_invalid": False}),
    ("duplicate_calls", {}), ("duplicate_calls", {"per": 1.0, "cap": 1}),
    ("duplicate_calls", {"match": "tool", "exempt": ["order"], "cap": 2}),
    ("resolved_bonus", {}), ("sentiment_bonus", {"per": 0.7, "missing_value": -0.1}),
    ("length_penalty", {}), ("length_penalty", {"count": "tool_calls", "free": 2}),
    ("terminal_outcome", {}), ("terminal_outcome", {"field": "business_metric", "low": 0.2}),
    ("ends_with_answer", {}), ("ends_with_answer", {"min_chars": 20}),
    ("learned_outcome", {}),
    ("write_actions", {}), ("write_actions", {"per": 0.3, "free": 1, "read_verbs": ["quote", "search"]}),
    ("unrecovered_errors", {}), ("unrecovered_errors", {"per": 0.5, "cap": 1, "count_invalid": False}),
    ("answer_consistency", {}),
    ("gives_up", {}), ("gives_up", {"value": -0.5, "give_up_words": ["risk", "sel"], "done_words": ["profit"]}),
    ("expected_calls", {}), ("unexpected_writes", {}), ("communicated_info", {}), ("call_budget", {}),
    ("answer_consistency", {"context_calls": 1, "threshold": 0.3, "ramp_from": -0.5, "low": -1.0,
                            "no_evidence_value": 0.0, "max_chars": 20}),
    ("learned_outcome", {"embed": "none", "features": [*STAT_FEATURES, *SIGNAL_FEATURES], "mean": [1.0] * 12,
                         "scale": [2.0] * 12,
                         "coef": [0.3, -0.2, -0.5, -0.4, 0.1, -0.3, 0.05, 0.6, -1.0, -0.7, -0.25, -0.8],
                         "intercept": 0.2, "low": -1.0, "high": 1.0}),
]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name,params", VARIANTS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(VARIANTS)])
def test_fast_matches_per_step_reference(name, params, seed):
    frame = make_frame(seed=seed, n=14, timestamps=seed != 2)
    np.testing.assert_allclose(run(name, frame, **params), reference(name, frame, **params),
                               rtol=1e-9, atol=1e-9)


def test_variants_cover_every_component():
    assert {n for n, _ in VARIANTS} == set(COMPONENTS)


# --------------------------------------------------------------------------- hand-computed cases
def test_tool_validity_hand_computed():
    f = frame_of(episode([
        call(0, "quote", {"symbol": "600519"}),               # known tool, arguments check
        call(1, "order", {"side": "buy", "quantity": "ten"}),  # known tool, type mismatch
        call(2, "ghost"),                                      # unknown tool (INVALID)
        call(3, "quote", {"symbol": "600519"}, tool_error="timeout"),
        answer(4, "done", kind="reply"),
    ]))
    assert run("tool_validity", f).tolist() == [1.0, 0.5, 0.0, 0.0, 1.0]


def _series_frame(history: list[float], probe: float, param: str = "quantity"):
    steps = [call(i, "order", {"side": "buy", param: v}) for i, v in enumerate(history + [probe])]
    return frame_of(episode(steps))


@pytest.mark.parametrize("probe,expected", [
    (100.0, 0.8),                        # z = 0
    (120.0, 0.8),                        # z = 2: still reasonable
    (132.0, 0.8 * (1 - 1.2 / 1.48)),     # z = 3.2: the seed's 0.15
    (150.0, 0.0),                        # z = 5: past the decay end
])
def test_param_reasonableness_hand_computed(probe, expected):
    history = [90.0, 110.0] * 5          # mean 100, (population) std 10
    f = _series_frame(history, probe, param="price")
    v = run("param_reasonableness", f, min_history=5)
    assert v[-1] == pytest.approx(expected)
    assert expected == pytest.approx(0.15, abs=0.002) or probe != 132.0
    assert v[:5].tolist() == [0.8] * 5   # fewer than min_history earlier values: no judgement


def test_param_reasonableness_uses_only_earlier_values():
    history = [90.0, 110.0] * 5
    base = run("param_reasonableness", _series_frame(history, 150.0, "price"), min_history=2)
    later = run("param_reasonableness", _series_frame(history, 10_000.0, "price"), min_history=2)
    assert base[:-1].tolist() == later[:-1].tolist()  # a later outlier changes no earlier score


def test_param_reasonableness_window_slides():
    # 20 values around 1000 then 10 around 100: with W = 10 the window has forgotten the 1000s
    history = [1000.0, 1010.0] * 10 + [100.0, 110.0] * 5
    v = run("param_reasonableness", _series_frame(history, 105.0, "price"), window=10, min_history=5)
    assert v[-1] == 0.8
    v_long = run("param_reasonableness", _series_frame(history, 105.0, "price"), window=1000, min_history=5)
    assert v_long[-1] == 0.8  # mean ~700, std ~430: z ~ 1.4, still fine
    spike = run("param_reasonableness", _series_frame(history, 2000.0, "price"), window=10, min_history=5)
    assert spike[-1] == 0.0


def test_param_reasonableness_categorical_rarity():
    steps = [call(i, "quote", {"symbol": "600519", "period": "day"}) for i in range(19)]
    steps.append(call(19, "quote", {"symbol": "600519", "period": "week"}))
    steps.append(call(20, "quote", {"symbol": "600519", "period": "week"}))  # seen 1 in 20 before
    steps.append(call(21, "quote", {"symbol": "600519", "period": "q3"}))    # never seen
    f = frame_of(episode(steps))
    v = run("param_reasonableness", f, categorical="all", min_freq=0.1)
    assert v[19] == 0.0                       # first "week": 0 of 19
    assert v[20] == pytest.approx(0.8 * (1 / 20) / 0.1)
    assert v[21] == 0.0
    assert v[18] == 0.8


def test_output_consistency_hand_computed():
    data = {"price": 1700, "symbol": "600519"}
    same = "price: 1700; symbol: 600519"          # the tool data as the sentence model reads it
    f = frame_of(
        episode([call(0, "quote", {"symbol": "600519"}, tool_result=data), answer(1, same)], "a"),
        episode([call(0, "quote", {"symbol": "600519"}, tool_result=data), answer(1, "unrelated words")], "b"),
        episode([answer(0, "no data at all")], "c"),
    )
    v = run("output_consistency", f)
    assert v.tolist() == [0.0, 0.6, 0.0, 0.0, 0.0]  # only the faithful answer earns 0.6
    assert run("output_consistency", f, readable=False)[1] == 0.0  # raw JSON is another text
    v = run("output_consistency", f, neutral=-1.0, no_evidence_value=0.25)
    assert v[[0, 2]].tolist() == [-1.0, -1.0] and v[4] == 0.25


def test_evidence_reliability_hand_computed():
    good = {"items": [{"headline": "profit up", "verified": True}]}
    bad = {"items": [{"headline": "rumour", "verified": False}]}
    f = frame_of(
        episode([call(0, "news", {"source": "wire"}, tool_result=good), answer(1, "buy")], "a"),
        episode([call(0, "news", {"source": "wire"}, tool_result=good),
                 call(1, "news", {"source": "social_media"}, tool_result=bad), answer(2, "buy")], "b"),
    )
    v = run("evidence_reliability", f)
    assert v.tolist() == [0.0, 1.0, 0.0, 0.0, 0.0]
    assert run("evidence_reliability", f, any_flag=False)[4] == 0.5


def test_business_impact_and_episode_terms_hand_computed():
    f = frame_of(
        episode([call(0, "quote"), answer(1, "x")], "a",
                outcome=Outcome(resolved=True, business_metric=0.05, final_reward=2 / 3, sentiment=0.8)),
        episode([call(0, "quote"), call(1, "quote"), answer(2, "")], "b",
                outcome=Outcome(resolved=False, business_metric=0.5)),
        episode([answer(0, "hi")], "c"),
    )
    assert run("business_impact", f).tolist() == [0.1, 0.1, 0.5, 0.5, 0.5, 0.1]
    assert run("business_impact", f, on="last").tolist() == [0, 0.1, 0, 0, 0.5, 0.1]
    assert run("resolved_bonus", f).tolist() == [1.0, -0.2, 0.0]
    assert run("sentiment_bonus", f).tolist() == pytest.approx([0.4, 0.0, 0.0])
    assert run("length_penalty", f).tolist() == pytest.approx([-0.2, -0.3, -0.1])
    assert run("terminal_outcome", f).tolist() == pytest.approx([2 / 3, 0.0, 0.0])
    assert run("terminal_outcome", f, scale=3.0).tolist() == pytest.approx([1.0, 0.0, 0.0])
    assert run("ends_with_answer", f).tolist() == [1.0, -0.5, 1.0]


def test_latency_penalty_hand_computed():
    f = frame_of(episode([call(0, "quote", latency_ms=2500.0), call(1, "quote"),
                          answer(2, "x")]))
    assert run("latency_penalty", f).tolist() == pytest.approx([-0.125, 0.0, 0.0])
    assert run("latency_penalty", f, unit_ms=100, cap_units=10).tolist() == pytest.approx([-0.5, 0, 0])


def test_action_smoothing_hand_computed():
    f = frame_of(episode([call(0, "order", {"side": "buy", "quantity": 1}),
                          call(1, "order", {"side": "sell", "quantity": 1}),
                          call(2, "quote"),
                          call(3, "order", {"side": "buy", "quantity": 1}),
                          call(4, "order", {"side": "sell", "quantity": 1})]))
    opp = run("action_smoothing", f, opposites=[["order:buy", "order:sell"]], key_param="side")
    # sell reverses buy; the quote in between does not hide that buy (t=3) reverses the sell
    assert opp.tolist() == [0.0, -0.1, 0.0, -0.1, -0.1]
    flip = run("action_smoothing", f)  # A→B→A on tool names: order, order, quote, order → flip at t=3
    assert flip.tolist() == [0.0, 0.0, 0.0, -0.1, 0.0]


def test_step_cost_hand_computed():
    f = frame_of(episode([call(0, "quote"), answer(1, "hm", kind="reply"), answer(2, "x")]))
    assert run("step_cost", f).tolist() == [-0.1, -0.1, -0.1]
    assert run("step_cost", f, per=0.5, kinds=["tool_call"]).tolist() == [-0.5, 0.0, 0.0]


def test_repeated_failures_hand_computed():
    bad = {"side": "buy", "quantity": "ten"}
    f = frame_of(episode([call(0, "order", bad), call(1, "quote", tool_error="down"),
                          call(2, "order", bad), call(3, "order", bad), call(4, "order", bad),
                          call(5, "order", {"side": "buy", "quantity": 1})]))
    assert run("repeated_failures", f).tolist() == pytest.approx([0, 0, -0.2, -0.4, -0.6, 0])
    assert run("repeated_failures", f, cap=2).tolist() == pytest.approx([0, 0, -0.2, -0.4, -0.4, 0])


def test_duplicate_calls_hand_computed():
    f = frame_of(episode([call(0, "quote", {"symbol": "A"}), call(1, "quote", {"symbol": "B"}),
                          call(2, "quote", {"symbol": "A"}), call(3, "quote", {"symbol": "A"}),
                          call(4, "quote", {"symbol": "A"}, tool_error="down"),
                          call(5, "order", {"symbol": "A"})]))
    assert run("duplicate_calls", f).tolist() == pytest.approx([0, 0, -0.5, -1.0, -1.5, 0])
    assert run("duplicate_calls", f, per=1.0, cap=1).tolist() == pytest.approx([0, 0, -1, -1, -1, 0])
    # match: tool — any earlier quote counts, other arguments too
    assert run("duplicate_calls", f, match="tool").tolist() == pytest.approx([0, -0.5, -1.0, -1.5, -1.5, 0])


def test_duplicate_calls_by_tool_exempts_trade_legs():
    f = frame_of(episode([call(0, "quote", {"symbol": "A"}), call(1, "order", {"side": "sell"}),
                          call(2, "order", {"side": "buy"}), call(3, "quote", {"symbol": "B"}),
                          call(4, "order", {"side": "buy"})]))
    got = run("duplicate_calls", f, match="tool", exempt=["order"]).tolist()
    # the second leg of a trade is free; the same order again is still a repeat
    assert got == pytest.approx([0, 0, 0, -0.5, -0.5])


@pytest.mark.parametrize("name,params,message", [
    ("param_reasonableness", {"z_ok": 3.0, "z_zero": 2.0}, "z_ok < z_zero"),
    ("output_consistency", {"curve": "cubic"}, "curve"),
    ("output_consistency", {"apply_to": ["answer"]}, "unknown action kind"),
    ("business_impact", {"field": "revenue"}, "field"),
    ("action_smoothing", {"opposites": [["buy"]]}, "pairs"),
    ("latency_penalty", {"unit_ms": 0}, "unit_ms"),
])
def test_components_refuse_nonsense_parameters(name, params, message):
    with pytest.raises(ValueError, match=message):
        COMPONENTS[name](**params)
