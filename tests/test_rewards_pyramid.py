"""The pyramid: template validation (messages name key and line), gating, returns,
explanations, the component cache, re-weighting without recomputation, expectations."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import yaml

from core.records.catalog import build_catalog
from core.base.errors import InputError
from core.base.results import dumps, to_jsonable
from core.records.episodes import Action, Episode, Outcome, Step, Task
from core.rewards import (COMPONENTS, ComponentCache, Pyramid, ScoringContext, TemplateError,
                          build_frame, evaluate_expectations, parse_template)
from _rewards_fixtures import TOOLS, FakeEmbedder, make_frame

BASE = """\
version: 1
name: test
return: {a: 0.7, b: 0.3, gamma: 0.95}
gating: {enabled: true}
levels:
  L1:
    gate: 0.5
    components:
      tool_validity: {weight: 0.3}
  L2:
    components:
      param_reasonableness: {weight: 0.4}
  L4:
    components:
      business_impact: {weight: 0.1}
penalties:
  latency: {component: latency_penalty, weight: 1.0, params: {per: 0.05, unit_ms: 1000}}
episode_terms:
  resolved_bonus: {weight: 1.0}
  length_penalty: {weight: 1.0}
"""


def score(frame, text: str = BASE, **kw):
    return Pyramid(parse_template(text)).score(frame, ctx=ScoringContext(embedder=FakeEmbedder()), **kw)


# --------------------------------------------------------------------------- validation messages
@pytest.mark.parametrize("old,new,message", [
    ("tool_validity: {weight: 0.3}", "tool_valdity: {weight: 0.3}",
     "unknown component 'tool_valdity' at line 9 (did you mean 'tool_validity'?); known: tool_validity,"),
    ("{weight: 0.4}", "{weight: .nan}", "weight of 'param_reasonableness' at line 12 is NaN"),
    ("{weight: 0.4}", "{weight: -0.4}", "weight of 'param_reasonableness' at line 12 is negative"),
    ("{weight: 0.4}", "{weight: high}", "weight of 'param_reasonableness' at line 12 must be a number"),
    ("{weight: 0.4}", "{}", "component 'param_reasonableness' at line 12 needs a weight"),
    ("{weight: 0.4}", "{weight: 0.4, params: {windw: 5}}",
     "unknown parameter 'windw' of component 'param_reasonableness' at line 12 (did you mean 'window'?)"),
    ("{weight: 0.4}", "{weight: 0.4, params: {window: ten}}",
     "parameter 'window' of 'param_reasonableness' at line 12 must be int, got 'ten'"),
    ("{weight: 0.4}", "{weight: 0.4, params: {z_ok: 4.0}}", "parameters of 'param_reasonableness' at line 12: need"),
    ("gamma: 0.95", "gamma: 1.5", "return.gamma at line 3 must be a finite number in (0, 1]"),
    ("version: 1", "version: 7", "template format version 7 at line 1 is newer"),
    ("  L2:", "  L5:", "unknown level 'L5' at line 10; levels are L1, L2, L3, L4"),
    ("    gate: 0.5", "    gaet: 0.5", "unknown key 'gaet' at line 7 (did you mean 'gate'?)"),
    ("  resolved_bonus: {weight: 1.0}", "  latency_penalty: {weight: 1.0}",
     "component 'latency_penalty' at line 19 belongs in penalties, not episode_terms"),
    ("      business_impact: {weight: 0.1}", "      resolved_bonus: {weight: 0.1}",
     "component 'resolved_bonus' at line 15 belongs in episode_terms, not level L4"),
    ("  length_penalty: {weight: 1.0}", "  resolved_bonus: {weight: 2.0}",
     "duplicate key 'resolved_bonus' at line 20 (first at line 19)"),
    ("name: test", "nme: test", "unknown key 'nme' at line 2 (did you mean 'name'?)"),
])
def test_validation_errors_name_key_and_line(old, new, message):
    assert old in BASE
    with pytest.raises(TemplateError) as info:
        parse_template(BASE.replace(old, new, 1), file="t.yaml")
    assert message in str(info.value)
    assert str(info.value).startswith("t.yaml: ")
    assert info.value.to_dict()["line"] is not None


def test_validation_of_yaml_syntax_and_shape():
    with pytest.raises(TemplateError, match="not valid YAML at line 3: expected"):
        parse_template("version: 1\nname: [unclosed\n")
    with pytest.raises(TemplateError, match="needs a 'version'"):
        parse_template("name: x\nlevels: {L1: {components: {tool_validity: {weight: 1}}}}")
    with pytest.raises(TemplateError, match="no components"):
        parse_template("version: 1\nname: x\nlevels: {}")
    with pytest.raises(TemplateError, match="schedule for unknown component 'nope'"):
        parse_template(BASE + "schedules:\n  nope: [[0, 1.0]]\n")
    with pytest.raises(TemplateError, match="schedule steps at line 24 must increase"):
        parse_template(BASE + "schedules:\n  tool_validity:\n    - [10, 1.0]\n    - [5, 1.0]\n")


def test_expectation_validation():
    def exp(body: str) -> str:
        return BASE + "expectations:\n" + body
    with pytest.raises(TemplateError, match="unknown expectation kind 'rank' at line 22"):
        parse_template(exp("  - {name: a, kind: rank}\n"))
    with pytest.raises(TemplateError, match="names component 'nope', which is not in this template"):
        parse_template(exp("  - {name: a, kind: component_range, component: nope, max: 1}\n"))
    with pytest.raises(TemplateError, match="unknown filter key 'behavior' at line 22"):
        parse_template(exp("  - {name: a, kind: episode_score, episodes: {behavior: x}, below: 1}\n"))
    with pytest.raises(TemplateError, match="needs 'below' and/or 'above'"):
        parse_template(exp("  - {name: a, kind: episode_score, episodes: {behaviour: x}}\n"))
    with pytest.raises(TemplateError, match="duplicate expectation name 'a'"):
        parse_template(exp("  - {name: a, kind: twins_rank}\n  - {name: a, kind: twins_rank}\n"))


def test_template_round_trips_through_yaml():
    t = parse_template(BASE + "schedules:\n  tool_validity: [[0, 0.5], [100, 0.3]]\n"
                       "expectations:\n  - {name: hk, kind: twins_rank, margin: 0.1}\n")
    again = parse_template(t.to_yaml())
    assert again == t
    assert yaml.safe_load(t.to_yaml())["levels"]["L1"]["gate"] == 0.5


def test_weight_schedules_interpolate():
    t = parse_template(BASE + "schedules:\n  tool_validity: [[100, 0.5], [300, 0.1]]\n")
    assert t.weights_at(0)["tool_validity"] == 0.5
    assert t.weights_at(200)["tool_validity"] == pytest.approx(0.3)
    assert t.weights_at(10_000)["tool_validity"] == pytest.approx(0.1)
    assert t.weights_at(200)["param_reasonableness"] == 0.4


def test_edits_are_validated():
    t = parse_template(BASE)
    with pytest.raises(TemplateError, match="NaN"):
        t.with_weights({"tool_validity": math.nan})
    with pytest.raises(TemplateError, match="no component named 'x'"):
        t.with_weights({"x": 1.0})
    with pytest.raises(TemplateError, match="unknown parameter 'wnd'"):
        t.with_params("param_reasonableness", {"wnd": 3})
    assert t.with_params("param_reasonableness", {"window": 3}).component(
        "param_reasonableness").params == {"window": 3}
    assert t.with_gating(enabled=False).gating is False
    assert t.with_gating(gates={"L1": 1.0}).levels[0].gate == 1.0
    with pytest.raises(TemplateError, match="gamma"):
        t.with_return(gamma=0.0)


# --------------------------------------------------------------------------- scoring maths
def _one_episode_frame():
    steps = [
        Step(t=0, action=Action(kind="tool_call", tool="quote", params={"symbol": "600519"}),
             latency_ms=2000.0),
        Step(t=1, action=Action(kind="tool_call", tool="ghost")),           # fails L1
        Step(t=2, action=Action(kind="final_answer"), output_text="done"),
    ]
    ep = Episode(episode_id="h", task=Task(query="q"), steps=steps,
                 outcome=Outcome(resolved=True, business_metric=0.5))
    return build_frame([ep], build_catalog(TOOLS, [ep]))


def test_gating_and_return_hand_computed():
    f = _one_episode_frame()
    r = score(f)
    # step 0: L1 0.3·1 + L2 0.4·0.8 + L4 0.1·0.5 − 0.05·2 = 0.3 + 0.32 + 0.05 − 0.1 = 0.57
    # step 1: unknown tool: L1 = 0 < gate 0.5, so L2 and L4 earn nothing: 0
    # step 2: 0.3 + 0.32 + 0.05 = 0.67
    assert r.step_reward.tolist() == pytest.approx([0.57, 0.0, 0.67])
    # R_final = resolved 1.0 − 0.1·3 steps = 0.7; return = 0.7·(0.57 + 0.95²·0.67) + 0.3·0.7
    assert r.final.tolist() == pytest.approx([0.7])
    assert r.returns[0] == pytest.approx(0.7 * (0.57 + 0.95 ** 2 * 0.67) + 0.3 * 0.7)
    assert r.passed[:, 0].tolist() == [True, False, True]
    # without gating the failing step keeps its L2 and L4 parts
    off = Pyramid(parse_template(BASE).with_gating(enabled=False)).score(f)
    assert off.step_reward.tolist() == pytest.approx([0.57, 0.37, 0.67])


def test_explain_is_the_audit_schema_and_sums_to_the_reward():
    f = _one_episode_frame()
    r = score(f)
    parts = r.explain("h", 1)
    assert [p.name for p in parts] == ["tool_validity", "param_reasonableness", "business_impact", "latency"]
    assert sum(p.value for p in parts) == pytest.approx(r.step_reward[1])
    last = r.explain("h", 2)
    assert [p.name for p in last][-2:] == ["resolved_bonus", "length_penalty"]
    assert sum(p.value for p in last[:-2]) == pytest.approx(r.step_reward[2])
    assert sum(p.value for p in last[-2:]) == pytest.approx(r.final[0])
    assert [list(p) for p in json.loads(dumps(parts))] == [["name", "value"]] * len(parts)  # the audit schema's
    with pytest.raises(InputError, match="no step 9"):
        r.explain("h", 9)


def test_tables_and_summary():
    f = make_frame(seed=4, n=10)
    r = score(f)
    steps = r.steps_table()
    assert list(steps.columns[:3]) == ["episode_id", "t", "action"]
    assert {"tool_validity", "param_reasonableness", "business_impact", "latency", "L1", "L2", "L4",
            "penalties", "total"} <= set(steps.columns)
    assert len(steps) == f.n_steps and steps["total"].to_numpy() == pytest.approx(r.step_reward)
    eps = r.episodes_table()
    assert eps["return"].tolist() == pytest.approx(list(r.episode_returns.values()))
    s = r.summary()
    v = r.matrix.step_values[0]
    assert s.components["tool_validity"].mean == pytest.approx(v.mean())
    assert s.components["resolved_bonus"].level == "episode"
    json.dumps(to_jsonable(s))
    drill = r.episode_steps(f.episode_ids[0])
    assert len(drill) == f.ep_len[0] and "tool_validity (weighted)" in drill.columns


def test_returns_match_naive_loop():
    f = make_frame(seed=5, n=20)
    r = score(f)
    t = r.template
    for e in range(f.n_episodes):
        rs = r.step_reward[f.ep_start[e]:f.ep_start[e] + f.ep_len[e]]
        naive = t.a * sum(x * t.gamma ** i for i, x in enumerate(rs)) + t.b * r.final[e]
        assert r.returns[e] == pytest.approx(naive)


# --------------------------------------------------------------------------- re-weighting & cache
class Counting:
    """Counts calls of every registered component class."""

    def __init__(self, monkeypatch):
        self.calls: list[str] = []
        for name, cls in COMPONENTS.items():
            original = cls.__call__

            def wrapped(comp, frame, ctx, _orig=original, _name=name):
                self.calls.append(_name)
                return _orig(comp, frame, ctx)
            monkeypatch.setattr(cls, "__call__", wrapped)


def test_reweight_calls_no_component_and_equals_fresh_scoring(monkeypatch):
    f = make_frame(seed=6, n=12)
    first = score(f)
    counting = Counting(monkeypatch)
    new = {"tool_validity": 0.9, "latency": 0.0, "resolved_bonus": 0.5}
    again = first.reweight(new)
    assert counting.calls == []
    fresh = Pyramid(parse_template(BASE).with_weights(new)).score(f)
    assert again.returns == pytest.approx(fresh.returns)
    assert again.step_reward == pytest.approx(fresh.step_reward)
    assert not np.allclose(again.returns, first.returns)


def test_component_cache_reuses_columns(tmp_path, monkeypatch):
    f = make_frame(seed=7, n=12)
    cache = ComponentCache(tmp_path)
    first = score(f, cache=cache)
    assert set(first.matrix.computed) == {c.name for c in first.template.all_components}
    counting = Counting(monkeypatch)
    # a weight edit, scored from scratch: every column comes from the cache
    edited = parse_template(BASE).with_weights({"tool_validity": 0.8})
    second = Pyramid(edited).score(f, cache=ComponentCache(tmp_path))
    assert counting.calls == [] and second.matrix.computed == []
    assert second.returns == pytest.approx(first.reweight({"tool_validity": 0.8}).returns)
    # a parameter edit recomputes that one component only
    third = Pyramid(edited.with_params("latency", {"per": 0.1})).score(f, cache=ComponentCache(tmp_path))
    assert counting.calls == ["latency_penalty"] and third.matrix.computed == ["latency"]
    # explicit defaults share the entry of omitted ones
    counting.calls.clear()
    Pyramid(edited.with_params("param_reasonableness", {"window": 1000})).score(f, cache=ComponentCache(tmp_path))
    assert counting.calls == []
    # other data: other entries
    Pyramid(edited).score(make_frame(seed=8, n=12), cache=ComponentCache(tmp_path))
    assert "tool_validity" in counting.calls
    # files are .npy + .json (no pickle)
    suffixes = {p.suffix for p in tmp_path.rglob("*") if p.is_file()}
    assert suffixes == {".npy", ".json"}


def test_with_template_refuses_changed_parameters():
    f = make_frame(seed=9, n=6)
    r = score(f)
    t = parse_template(BASE)
    assert r.with_template(t.with_gating(enabled=False)).template.gating is False
    with pytest.raises(TemplateError, match="score again"):
        r.with_template(t.with_params("latency", {"per": 0.5}))


def test_write_csv_and_parquet(tmp_path):
    r = score(make_frame(seed=10, n=5))
    csv = pd.read_csv(r.write(tmp_path / "s.csv"))
    pq = pd.read_parquet(r.write(tmp_path / "s.parquet"))
    assert len(csv) == len(pq) == r.frame.n_steps
    assert csv["total"].to_numpy() == pytest.approx(r.step_reward)
    assert "episode_return" in pq.columns
    with pytest.raises(InputError, match=r"\.csv or \.parquet"):
        r.write(tmp_path / "s.xlsx")


# --------------------------------------------------------------------------- expectations
def _twins_frame():
    """Three experts that check a quote, three hackers that cite unverified news."""
    eps = []
    for i in range(3):
        eps.append(Episode(episode_id=f"x{i}", task=Task(query="q"), behaviour="expert",
                           outcome=Outcome(resolved=i != 2, business_metric=0.6), steps=[
                               Step(t=0, action=Action(kind="tool_call", tool="quote", params={"symbol": "600519"}),
                                    tool_result={"price": 1700 + i}),
                               Step(t=1, action=Action(kind="final_answer"), output_text="hold at 1700")]))
        eps.append(Episode(episode_id=f"h{i}", task=Task(query="q"), behaviour="hacker", meta={"twin_of": f"x{i}"},
                           outcome=Outcome(resolved=False, business_metric=0.2), steps=[
                               Step(t=0, action=Action(kind="tool_call", tool="news", params={"source": "social_media"}),
                                    tool_result={"items": [{"headline": "rumour", "verified": False}]}),
                               Step(t=1, action=Action(kind="final_answer"), output_text="rumour: buy")]))
        eps.append(Episode(episode_id=f"g{i}", task=Task(query="q"), behaviour="noisy",
                           outcome=Outcome(resolved=False, business_metric=0.3), steps=[
                               Step(t=0, action=Action(kind="tool_call", tool="ghost"))]))
    return build_frame(eps, build_catalog(TOOLS, eps))


PROBE = BASE.replace("  L4:\n", "  L3:\n    components:\n      evidence_reliability: {weight: 0.2}\n  L4:\n")


def test_expectations_pass_and_fail_with_numbers():
    f = _twins_frame()
    text = PROBE + "expectations:\n" + """\
  - {name: hackers below twins, kind: twins_rank, episodes: {behaviour: hacker}}
  - {name: hackers below 0.8, kind: episode_score, episodes: {behaviour: hacker}, below: 0.8}
  - {name: impossible, kind: episode_score, episodes: {behaviour: expert}, below: -100}
  - {name: unknown tool earns nothing, kind: component_range, component: tool_validity, max: 0,
     steps: {tool: ghost}}
  - {name: validity never above 1, kind: component_range, component: tool_validity, max: 1}
  - {name: resolved above unresolved, kind: rank_auc, higher: {resolved: true},
     lower: {resolved: false}, min: 0.5}
  - {name: nothing matches, kind: episode_score, episodes: {behaviour: robot}, below: 1}
  - {name: unverified answers earn no reliability, kind: component_range, component: evidence_reliability,
     max: 0, steps: {kind: final_answer, behaviour: hacker}}
"""
    r = score(f, text)
    report = evaluate_expectations(r)
    by = {x.name: x for x in report.results}
    assert by["hackers below twins"].passed, by["hackers below twins"].message
    assert by["hackers below twins"].details["pairs"] == 3
    assert by["hackers below 0.8"].passed
    assert not by["impossible"].passed and "not return < -100" in by["impossible"].message
    assert by["unknown tool earns nothing"].passed
    assert by["validity never above 1"].passed
    assert by["unverified answers earn no reliability"].passed
    assert by["resolved above unresolved"].passed and by["resolved above unresolved"].details["auc"] > 0.5
    assert not by["nothing matches"].passed and "cannot be verified" in by["nothing matches"].message
    assert not report.passed and len(report.failed) == 2
    json.dumps(report.to_dict())


def test_twins_rank_fails_when_a_hacker_outscores_its_twin():
    f = _twins_frame()
    r = score(f, PROBE + "expectations:\n  - {name: hk, kind: twins_rank}\n")
    assert evaluate_expectations(r).passed
    # make the hack pay: weights under which the hackers' answers win
    hacked = r.reweight({"evidence_reliability": 0.0, "resolved_bonus": 0.0, "business_impact": 0.0,
                         "tool_validity": 0.0, "param_reasonableness": 0.0, "latency": 5.0})
    res = evaluate_expectations(hacked).results[0]
    assert not res.passed and "do not score below their twin" in res.message
    assert res.details["worst"][0]["gap"] <= 0


def test_auc_helper():
    from core.rewards.expectations import auc
    assert auc(np.array([3.0, 4.0]), np.array([1.0, 2.0])) == 1.0
    assert auc(np.array([1.0]), np.array([1.0])) == 0.5
    assert auc(np.array([1.0, 3.0]), np.array([2.0])) == 0.5
