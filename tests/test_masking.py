"""Mask rules: hand-computed masks, fallback, parse errors with lines, torch = numpy = slow
reference on 5,000 tokens, review rules, and the shipped finance/e-commerce rule files."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from core.records.catalog import CatalogOptions, build_catalog, load_tools_file
from core.records.episodes import Episode, ToolSchema
from core.base.errors import InputError
from core.guard.masking import (MaskRules, check_masks, counts_from_prior, logged_inputs, logged_mask_report,
                                state_features, state_pattern)

REPO = Path(__file__).resolve().parents[1]


def schema(name: str, props: dict, risk: str = "low") -> ToolSchema:
    return ToolSchema(name=name, risk=risk,
                      parameters={"type": "object", "properties": props, "required": list(props)})


@pytest.fixture(scope="module")
def catalog():
    """R0 F0 E0 | get_news(source) | get_realtime_quote | margin_trade(side) | place_order(side, symbol)."""
    return build_catalog([
        schema("get_news", {"source": {"type": "string", "enum": ["wire", "social"]}}),
        schema("get_realtime_quote", {"symbol": {"type": "string"}}),
        schema("margin_trade", {"side": {"type": "string", "enum": ["buy", "short"]}}, risk="high"),
        schema("place_order", {"side": {"type": "string", "enum": ["buy", "sell"]},
                               "symbol": {"type": "string", "enum": ["600519", "000001", "00700"]}},
               risk="high"),
    ])


RULES = """\
version: 1
rules:
  - name: quotes_in_market_hours
    kind: availability
    targets: {tools: [get_realtime_quote]}
    unless: {hour: {between: ["9:30", "15:00"]}}
  - name: three_orders_per_symbol
    kind: business
    targets: {tools: [place_order]}
    limit: {max: 3, per: symbol}
  - name: no_high_risk_when_volatile
    kind: risk
    targets: {risk: [high]}
    when: {volatility: {gt: 0.30}}
  - name: no_social_news_when_urgent
    kind: review
    targets: {tools: [get_news], preset: {source: social}}
    when: {task_type: {in: [urgent_reduce]}}
"""


def names(catalog, mask_row) -> set[str]:
    return {catalog.tokens[i].name for i in np.flatnonzero(~mask_row)}


def test_hand_computed_masks(catalog):
    assert [t.name for t in catalog.tokens] == ["R0", "F0", "E0", "A0T0", "A0T1", "A1T0", "A2T0", "A2T1",
                                                "A3T0", "A3T1", "A3T2", "A3T3", "A3T4", "A3T5"]
    order = {catalog.tokens[i].name: catalog.tokens[i].preset for i in catalog.tool_tokens("place_order")}
    assert order["A3T0"] == {"side": "buy", "symbol": "600519"} and order["A3T3"] == {"side": "sell",
                                                                                       "symbol": "600519"}
    compiled = MaskRules.from_yaml(RULES).compile(catalog)
    assert compiled.required_features == ["hour", "task_type", "volatility"]
    features = {
        "hour": np.array([10.0, 20.0, 10.0, 10.0, 9.0, np.nan]),
        "volatility": np.array([0.1, 0.1, 0.5, 0.1, np.nan, 0.31]),
        "task_type": np.array(["analysis", "analysis", "analysis", "urgent_reduce", None, "x"], dtype=object),
    }
    counts = np.zeros((6, len(catalog)), np.int64)
    counts[3, catalog.token("A3T0").id] = 2     # buy 600519 twice
    counts[3, catalog.token("A3T3").id] = 1     # sell 600519 once → 3 orders of 600519
    counts[3, catalog.token("A3T1").id] = 2     # 000001 only twice
    counts[0, catalog.token("A3T2").id] = 5     # row 0: 00700 five times
    result = compiled.evaluate(features, counts)
    assert names(catalog, result.mask[0]) == {"A3T2", "A3T5"}                      # 00700 over its limit
    assert names(catalog, result.mask[1]) == {"A1T0"}                              # market closed
    assert names(catalog, result.mask[2]) == {"A2T0", "A2T1", "A3T0", "A3T1", "A3T2", "A3T3", "A3T4",
                                              "A3T5"}                              # volatile: high risk off
    assert names(catalog, result.mask[3]) == {"A0T1", "A3T0", "A3T3"}              # social news, 600519
    assert names(catalog, result.mask[4]) == {"A1T0"}                              # 9:00 < 9:30; vol unknown
    assert names(catalog, result.mask[5]) == {"A2T0", "A2T1", "A3T0", "A3T1", "A3T2", "A3T3", "A3T4",
                                              "A3T5"}                              # hour unknown → allowed
    assert not result.fallback.any() and result.messages == []
    assert result.mask.shape == (6, len(catalog)) and result.mask.dtype == bool
    why = compiled.explain({"hour": 20, "volatility": 0.5, "task_type": "analysis"}, counts[0])
    assert why["A1T0"] == ["quotes_in_market_hours"]
    assert why["A3T2"] == ["three_orders_per_symbol", "no_high_risk_when_volatile"]
    assert why["R0"] == []


def test_fallback_keeps_final_and_escalate(catalog):
    rules = MaskRules.from_yaml("""
rules:
  - name: panic
    kind: risk
    targets: {risk: [low, high], tokens: [R0, F0, E0]}
    when: {volatility: {ge: 0.9}}
""")
    result = rules.compile(catalog).evaluate({"volatility": np.array([0.1, 0.95, 0.99])})
    assert result.fallback.tolist() == [False, True, True]
    assert result.mask[0].all()
    for row in (1, 2):
        assert np.flatnonzero(result.mask[row]).tolist() == [catalog.final_id, catalog.escalate_id]
    assert len(result.messages) == 1 and "2 of 3 states" in result.messages[0]
    assert "rows 1, 2" in result.messages[0] and "F0" in result.messages[0]
    torch_result = rules.compile(catalog).evaluate_torch({"volatility": torch.tensor([0.1, 0.95, 0.99])})
    assert torch.equal(torch_result.mask, torch.from_numpy(result.mask))
    assert torch_result.fallback.tolist() == [False, True, True] and torch_result.messages == result.messages


def test_unknown_features_and_if_unknown_block(catalog):
    rules = MaskRules.from_yaml("""
rules:
  - {name: a, kind: risk, targets: {tools: [margin_trade]}, when: {volatility: {gt: 0.3}}}
  - {name: b, kind: risk, targets: {tools: [place_order]}, when: {volatility: {gt: 0.3}}, if_unknown: block}
""")
    mask = rules.compile(catalog).evaluate({"volatility": [None, 0.1, 0.5]}).mask
    margin, orders = catalog.tool_tokens("margin_trade"), catalog.tool_tokens("place_order")
    assert mask[0, margin].all() and not mask[0, orders].any()       # unknown: a allows, b blocks
    assert mask[1, margin + orders].all()
    assert not mask[2, margin + orders].any()


def test_business_limit_per_keys_and_state_conditions(catalog):
    rules = MaskRules.from_yaml("""
rules:
  - {name: total, kind: business, targets: {tools: [margin_trade]}, limit: {max: 2}}
  - {name: by_tool, kind: business, targets: {tools: [get_news, get_realtime_quote]}, limit: {max: 1, per: tool}}
  - {name: day, kind: business, targets: {tools: [place_order]}, when: {trades_today: {ge: 3}}}
""")
    compiled = rules.compile(catalog)
    counts = np.zeros((3, len(catalog)), np.int64)
    counts[0, catalog.token("A2T0").id] = 1
    counts[1, catalog.token("A2T0").id] = 1
    counts[1, catalog.token("A2T1").id] = 1            # 2 margin trades in all → both margin tokens off
    counts[2, catalog.token("A0T1").id] = 1            # one news call → both news tokens off, quote still on
    result = compiled.evaluate({"trades_today": np.array([3, 0, 2])}, counts)
    assert names(catalog, result.mask[0]) == {t.name for t in catalog.tokens if t.tool == "place_order"}
    assert names(catalog, result.mask[1]) == {"A2T0", "A2T1"}
    assert names(catalog, result.mask[2]) == {"A0T0", "A0T1"}
    with pytest.raises(InputError, match="action_counts"):
        compiled.evaluate({"trades_today": np.array([3])})
    # per: [symbol, tool] — tokens without a symbol preset share their tool's counter.
    fallthrough = MaskRules.from_yaml("""
rules:
  - {name: orders, kind: business, targets: {tools: [place_order, margin_trade]}, limit: {max: 1, per: [symbol, tool]}}
""").compile(catalog)
    counts = np.zeros((1, len(catalog)), np.int64)
    counts[0, catalog.token("A3T1").id] = 1   # buy 000001
    counts[0, catalog.token("A2T1").id] = 1   # short (margin_trade has no symbol)
    assert names(catalog, fallthrough.evaluate({}, counts).mask[0]) == {"A3T1", "A3T4", "A2T0", "A2T1"}
    with pytest.raises(InputError, match=r"limit.per 'symbol' does not apply to margin_trade.*per: \[symbol, tool\]"):
        MaskRules.from_yaml("rules:\n  - {kind: business, targets: {tools: [margin_trade]}, "
                            "limit: {max: 1, per: symbol}}").compile(catalog)


# --------------------------------------------------------------------------- parse errors
@pytest.mark.parametrize("text, message, line", [
    ("rules:\n  - kind: avalability\n    targets: {tools: [x]}\n", "rule 0: kind must be one of", 2),
    ("rules:\n  - name: r\n    kind: risk\n    targets: {tools: [x]}\n    when: {volatility: {gtt: 0.3}}\n",
     "rule 0 'r': unknown test 'gtt' on feature 'volatility' (did you mean 'gt'?)", 5),
    ("rules:\n  - name: ok\n    kind: risk\n    targets: {tools: [x]}\n    when: {v: {gt: 1}}\n"
     "  - name: bad\n    kind: risk\n    targets: {tools: [x]}\n    when:\n      v: {outside: [3, 1]}\n",
     "rule 1 'bad': 'outside' on feature 'v' needs numbers low ≤ high", 10),
    ("rules:\n  - name: r\n    kind: business\n    targets: {tools: [x]}\n",
     "a business rule needs limit", 2),
    ("rules:\n  - name: r\n    kind: business\n    targets: {tools: [x]}\n    limit: {max: -1}\n",
     "limit.max must be a whole number", 5),
    ("rules:\n  - name: r\n    kind: risk\n    targets: {tools: [x]}\n    when: {v: {gt: high}}\n",
     "'gt' on feature 'v' needs a number", 5),
    ("rules:\n  - name: r\n    kind: risk\n    targets: {tools: [x]}\n", "needs when: and/or unless:", 2),
    ("rules:\n  - name: r\n    kind: risk\n    when: {v: {gt: 1}}\n", "needs targets", 2),
    ("rules:\n  - name: r\n    kind: risk\n    targets: {risk: [extreme]}\n    when: {v: {gt: 1}}\n",
     "unknown risk level 'extreme'", 4),
    ("rules:\n  - name: r\n    kind: risk\n    targets: {tools: [x]}\n    whn: {v: {gt: 1}}\n",
     "unknown key 'whn' (did you mean 'when'?)", 5),
    ("rules:\n  - {name: r, kind: risk, targets: {tools: [x]}, when: {v: {gt: 1}}}\n"
     "  - {name: r, kind: risk, targets: {tools: [x]}, when: {v: {gt: 2}}}\n", "rule name 'r' is used twice", 3),
    ("rules:\n  - name: r\n    kind: risk\n    kind: business\n", "key 'kind' appears twice (first on line 3)", 4),
    ("rules:\n  - name: r\n    kind: [risk\n", "not valid YAML", 4),
    ("version: 2\nrules: []\n", "unsupported mask rules version", 1),
    ("rulez: []\n", "unknown top-level key 'rulez'", 1),
    ("rules:\n  - name: r\n    kind: risk\n    targets: {tools: [x]}\n    limit: {max: 1}\n    when: {v: {gt: 1}}\n",
     "only business rules take a limit", 5),
])
def test_parse_errors_name_rule_and_line(tmp_path, text, message, line):
    path = tmp_path / "masks.yaml"
    path.write_text(text)
    with pytest.raises(InputError) as info:
        MaskRules.from_yaml(path)
    assert message in str(info.value)
    assert info.value.line == line and info.value.file == str(path)


@pytest.mark.parametrize("text, message, line", [
    ("rules:\n  - name: r\n    kind: risk\n    targets: {tools: [place_ordr]}\n    when: {v: {gt: 1}}\n",
     "rule 0 'r' (line 2): unknown tool 'place_ordr'", 2),
    ("rules:\n  - name: r\n    kind: risk\n    targets: {tokens: [A9T9]}\n    when: {v: {gt: 1}}\n",
     "unknown token 'A9T9'", 2),
    ("rules:\n  - name: r\n    kind: risk\n    targets: {tools: [get_news], preset: {source: tv}}\n"
     "    when: {v: {gt: 1}}\n", "its targets match no token", 2),
    ("rules:\n  - {name: a, kind: risk, targets: {tools: [get_news]}, when: {v: {gt: 1}}}\n"
     "  - {name: b, kind: risk, targets: {tools: [get_news]}, when: {v: {eq: calm}}}\n",
     "feature 'v' is text in rule 0 'a' (line 2) but a number here", 3),
    ("rules:\n  - {name: a, kind: risk, targets: {tools: [get_news]}, when: {task_type: {gt: 1}}}\n",
     "task_type is text", 2),
])
def test_compile_errors_name_rule_and_line(tmp_path, catalog, text, message, line):
    path = tmp_path / "masks.yaml"
    path.write_text(text)
    rules = MaskRules.from_yaml(path)
    with pytest.raises(InputError) as info:
        rules.compile(catalog)
    assert message in str(info.value) and info.value.line == line and info.value.file == str(path)


def test_yaml_round_trip_and_atomic_save(tmp_path, catalog):
    rules = MaskRules.from_yaml(RULES)
    again = MaskRules.from_yaml(rules.to_yaml())
    assert again.to_data() == rules.to_data()
    path = rules.save(tmp_path / "sub" / "masks.yaml")
    assert MaskRules.from_yaml(path).to_data() == rules.to_data()
    assert [p.name for p in path.parent.iterdir()] == ["masks.yaml"]  # no temp file left behind


# --------------------------------------------------------------------------- review rules
def test_review_rules_from_rejections(catalog):
    rules = MaskRules.from_yaml(RULES)
    state = {"task_type": "analysis", "volatility": 0.2, "hour": 10}
    rule = rules.add_review_rule(token="A3T0", state=state, review_id="17", reason="too aggressive")
    assert rule.kind == "review" and rule.name == "review_17" and rule.meta["review_id"] == "17"
    assert rule.when == {"hour": {"between": [9.0, 11.0]}, "task_type": {"eq": "analysis"},
                         "volatility": {"between": [0.18, 0.22]}}
    assert rules.add_review_rule(token="A3T0", state=state, review_id="17") is rule  # not added twice
    by_tool = rules.add_review_rule(tool="get_news", when={"task_type": "urgent_reduce"})
    compiled = rules.compile(catalog)
    f = {"hour": np.array([10.5, 10.5, 10.5]), "volatility": np.array([0.21, 0.5, 0.1]),
         "task_type": np.array(["analysis", "analysis", "urgent_reduce"], dtype=object)}
    counts = np.zeros((3, len(catalog)), np.int64)
    mask = compiled.evaluate(f, counts).mask
    assert not mask[0, catalog.token("A3T0").id] and mask[0, catalog.token("A3T1").id]
    assert not mask[2, catalog.tool_tokens("get_news")].any() and mask[0, catalog.tool_tokens("get_news")].all()
    assert MaskRules.from_yaml(rules.to_yaml()).to_data() == rules.to_data()
    assert by_tool.targets == {"tools": ["get_news"]}
    # The stored form of core.guard.review (targets beside kind; token ids allowed) loads too.
    added = rules.add_rules([{"name": "review-3", "kind": "review", "tokens": [catalog.token("A2T0").id],
                              "when": {"task_type": "analysis"}, "message": "rejected in review 3"}])
    assert added[0].targets == {"tokens": [6]}
    assert not rules.compile(catalog).evaluate(f, counts).mask[0, 6]
    with pytest.raises(InputError, match="exactly one token or one tool"):
        rules.add_review_rule(when={"a": 1})
    with pytest.raises(InputError, match="not a scalar"):
        state_pattern({"x": [1, 2]})


# --------------------------------------------------------------------------- fast = torch = reference
def _random_rules(rng: random.Random, catalog) -> str:
    feats_num = ["hour", "volatility", "trades"]
    ops = ["gt", "lt", "ge", "le", "eq", "ne"]

    def cond(depth: int = 0) -> dict:
        out: dict = {}
        for _ in range(rng.randint(1, 2)):
            kind = rng.random()
            if kind < 0.2 and depth < 2:
                out[rng.choice(["any", "all"])] = [cond(depth + 1) for _ in range(rng.randint(1, 3))]
            elif kind < 0.4:
                out["task_type"] = {rng.choice(["in", "not_in"]): rng.sample(["a", "b", "c", "zz"], 2)}
            elif kind < 0.55:
                lo = rng.randint(0, 20)
                out[rng.choice(feats_num)] = {rng.choice(["outside", "between"]): [lo, lo + rng.randint(0, 6)]}
            elif kind < 0.65:
                out["trades"] = {rng.choice(["in", "not_in"]): rng.sample([0, 1, 2, 3], 2)}
            else:
                f = rng.choice(feats_num)
                out[f] = {rng.choice(ops): float(rng.randint(0, 4)) if f == "trades" else round(rng.random() * 24, 1)}
        return out

    tools = list(catalog.tools)
    rules = []
    for i in range(rng.randint(1, 12)):
        rule: dict = {"name": f"r{i}", "kind": rng.choice(["availability", "risk", "review", "business"])}
        pick = rng.random()
        if pick < 0.5:
            rule["targets"] = {"tools": rng.sample(tools, rng.randint(1, 2))}
        elif pick < 0.7:
            rule["targets"] = {"risk": [rng.choice(["low", "high"])]}
        else:
            rule["targets"] = {"tokens": rng.sample([t.name for t in catalog.tokens], 3)}
        if rule["kind"] == "business" and rng.random() < 0.6:
            rule["targets"] = {"tools": ["place_order"]}
            rule["limit"] = {"max": rng.randint(0, 3), "per": rng.choice(["symbol", "side", "tool", "token",
                                                                          ["symbol", "tool"]])}
            if rng.random() < 0.5:
                rule["when"] = cond()
        else:
            rule["when" if rng.random() < 0.7 else "unless"] = cond()
            if rng.random() < 0.3:
                rule["unless"] = cond()
        if rng.random() < 0.3:
            rule["if_unknown"] = "block"
        rules.append(rule)
    return json.dumps({"rules": rules})  # JSON is YAML


def _random_inputs(rng: np.random.Generator, n: int, A: int) -> tuple[dict, np.ndarray]:
    hour = rng.integers(0, 24, n).astype(float)
    hour[rng.random(n) < 0.1] = np.nan
    vol = np.round(rng.random(n) * 24, 1)
    trades = rng.integers(0, 5, n).astype(float)
    task = np.array([rng.choice(["a", "b", "c", "d", None]) for _ in range(n)], dtype=object)
    counts = rng.poisson(0.7, (n, A))
    return {"hour": hour, "volatility": vol, "trades": trades, "task_type": task}, counts


@pytest.mark.parametrize("seed", range(12))
def test_fast_paths_match_slow_reference(catalog, seed):
    rng = random.Random(seed)
    rules = MaskRules.from_yaml(_random_rules(rng, catalog))
    compiled = rules.compile(catalog)
    features, counts = _random_inputs(np.random.default_rng(seed), 300, len(catalog))
    fast = compiled.evaluate(features, counts)
    slow = compiled.evaluate_reference(features, counts)
    np.testing.assert_array_equal(fast.mask, slow.mask)
    np.testing.assert_array_equal(fast.fallback, slow.fallback)
    assert fast.messages == slow.messages
    # torch: numeric tensors, categorical as int64 codes, counts as a tensor
    t_features = {k: (torch.from_numpy(compiled.codes(k, v)) if k == "task_type" else torch.from_numpy(v))
                  for k, v in features.items() if k in compiled.required_features}
    on_torch = compiled.evaluate_torch(t_features, torch.from_numpy(counts))
    assert on_torch.mask.shape == fast.mask.shape and on_torch.mask.dtype == torch.bool
    np.testing.assert_array_equal(on_torch.mask.numpy(), fast.mask)
    np.testing.assert_array_equal(on_torch.fallback.numpy(), fast.fallback)
    assert on_torch.messages == fast.messages
    # strings for categorical features are accepted too (encoded on the CPU)
    np.testing.assert_array_equal(compiled.evaluate_torch(features, torch.from_numpy(counts)).mask.numpy(),
                                  fast.mask)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_torch_on_gpu_matches_numpy(catalog):
    rules = MaskRules.from_yaml(_random_rules(random.Random(99), catalog))
    compiled = rules.compile(catalog)
    features, counts = _random_inputs(np.random.default_rng(99), 500, len(catalog))
    t_features = {k: (torch.from_numpy(compiled.codes(k, v)) if k == "task_type" else torch.from_numpy(v)).cuda()
                  for k, v in features.items() if k in compiled.required_features}
    out = compiled.evaluate_torch(t_features, torch.from_numpy(counts).cuda())
    assert out.mask.device.type == "cuda"
    np.testing.assert_array_equal(out.mask.cpu().numpy(), compiled.evaluate(features, counts).mask)


def test_torch_rejects_float_codes(catalog):
    compiled = MaskRules.from_yaml(RULES).compile(catalog)
    with pytest.raises(InputError, match="int64 codes"):
        compiled.evaluate_torch({"hour": torch.zeros(2), "volatility": torch.zeros(2),
                                 "task_type": torch.zeros(2)}, torch.zeros((2, len(catalog))))
    with pytest.raises(InputError, match="missing"):
        compiled.evaluate({"hour": np.zeros(2)}, np.zeros((2, len(catalog))))
    with pytest.raises(InputError, match=r"action_counts must be \[batch, 14\]"):
        compiled.evaluate({"hour": np.zeros(2), "volatility": np.zeros(2), "task_type": ["a", "b"]},
                          np.zeros((2, 3)))


def test_4096_states_on_5000_tokens_evaluate_by_token_class_as_the_reference():
    tools = [schema(f"tool_{i:02d}", {"a": {"type": "string", "enum": [f"a{j}" for j in range(10)]},
                                      "b": {"type": "integer", "enum": list(range(10))}},
                    risk=("low", "medium", "high")[i % 3]) for i in range(50)]
    catalog = build_catalog(tools, options=CatalogOptions(max_presets_per_tool=100))
    assert len(catalog) == 5003
    rules = [{"name": f"r{i}", "kind": "risk", "targets": {"tools": [f"tool_{i:02d}"]},
              "when": {"volatility": {"gt": round(0.05 * i, 2)}, "task_type": {"in": [f"t{i % 3}"]}}}
             for i in range(20)]
    rules += [{"name": "hours", "kind": "availability", "targets": {"risk": ["high"]},
               "unless": {"hour": {"between": ["9:30", "15:00"]}}},
              {"name": "orders", "kind": "business", "targets": {"tools": ["tool_30", "tool_31"]},
               "limit": {"max": 3, "per": "a"}},
              {"name": "a7", "kind": "review", "targets": {"preset": {"a": "a7"}},
               "when": {"task_type": "t1", "hour": {"gt": 12}}}]
    compiled = MaskRules.from_data({"rules": rules}).compile(catalog)
    rng = np.random.default_rng(0)
    B = 4096
    features = {"volatility": rng.random(B), "hour": rng.random(B) * 24,
                "task_type": np.array([f"t{i % 4}" for i in range(B)], dtype=object)}
    counts = rng.poisson(0.05, (B, len(catalog))).astype(np.int32)
    result = compiled.evaluate(features, counts)
    # The evaluation works per rule class of tokens, not per token: the 5,003 tokens fall
    # into a few dozen classes (benchmarks/bench_catalog_masks.py measures its speed).
    assert compiled._n_classes <= 64
    assert 0.3 < result.mask.mean() < 0.95
    sample = np.arange(0, B, 64)
    slow = compiled.evaluate_reference({k: v[sample] for k, v in features.items()}, counts[sample])
    np.testing.assert_array_equal(slow.mask, result.mask[sample])


# --------------------------------------------------------------------------- helpers and shipped files
def test_state_features_and_logged_inputs(catalog):
    feats = state_features([{"hour": 10, "mood": "calm"}, None, {"hour": True}], ["a", None, "b"])
    assert feats["hour"].tolist() == [10.0, pytest.approx(np.nan, nan_ok=True), 1.0]
    assert feats["mood"].tolist() == ["calm", None, None] and feats["task_type"].tolist() == ["a", None, "b"]
    prior = np.array([[1, 5], [2, 5], [2, 7]])
    counts = counts_from_prior(prior, np.array([2, 0]), len(catalog))
    assert counts[0, 5] == 1 and counts[0, 7] == 1 and counts[1].sum() == 0


def _sample(domain: str) -> list[Episode]:
    lines = (REPO / "datasets" / domain / "sample.jsonl").read_text().splitlines()
    return [Episode.model_validate_json(line) for line in lines if not line.startswith('{"rwb_header"')]


@pytest.mark.parametrize("domain, good, caught", [("finance", ["expert"], ["noisy"]),
                                                  ("ecommerce", ["resolve", "upsell", "escalate"], ["oscillate"])])
def test_shipped_masks_leave_good_behaviour_alone_and_catch_bad(domain, good, caught):
    episodes = _sample(domain)
    tools = load_tools_file(REPO / "datasets" / domain / "tools.json")
    rules = MaskRules.from_yaml(REPO / "datasets" / domain / "masks.yaml")
    assert {r.kind for r in rules} >= {"availability", "business", "risk"}
    build_catalog(tools).__len__()
    rules.compile(build_catalog(tools))                 # compiles on the schemas alone
    compiled = rules.compile(build_catalog(tools, episodes))  # and on the dataset's learned catalog
    report = logged_mask_report(compiled, episodes)
    assert report.fallback_states == 0
    for behaviour in good:
        assert report.by_behaviour[behaviour].blocked == 0, report
    for behaviour in caught:
        assert report.by_behaviour[behaviour].blocked > 0, report
    assert report.blocked == sum(b.blocked for b in report.by_behaviour.values())
    feats, _, tokens, _ = logged_inputs(episodes, compiled.catalog)
    assert set(compiled.required_features) <= set(feats)
    assert len(tokens) == sum(e.n_steps for e in episodes)


def test_finance_masks_by_hand():
    tools = load_tools_file(REPO / "datasets" / "finance" / "tools.json")
    catalog = build_catalog(tools)
    compiled = MaskRules.from_yaml(REPO / "datasets" / "finance" / "masks.yaml").compile(catalog)
    f = {"hour": np.array([10, 20, 10]), "volatility": np.array([0.2, 0.2, 0.35]),
         "trades_today": np.array([0, 0, 3]), "task_type": np.array(["analysis"] * 3, dtype=object)}
    mask = compiled.evaluate(f, np.zeros((3, len(catalog)), np.int64)).mask
    quote = catalog.tool_tokens("get_realtime_quote")
    margin, orders = catalog.tool_tokens("margin_trade"), catalog.tool_tokens("place_order")
    assert mask[0].all()
    assert not mask[1, quote].any() and mask[1, margin + orders].all()
    assert not mask[2, margin + orders].any() and mask[2, quote].all()


def test_cli_catalog_masks(capsys, tmp_path):
    from core.cli import main

    tools = REPO / "datasets" / "finance" / "tools.json"
    masks = REPO / "datasets" / "finance" / "masks.yaml"
    assert main(["catalog", "masks", str(masks), "--tools", str(tools), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rules"][0]["name"] == "live_quotes_in_trading_hours" and out["rules"][0]["line"] == 12
    assert out["rules"][0]["targets"] == ["A10T0"]
    assert list(out) == ["file", "catalog_version", "n_tokens", "required_features", "rules"]
    assert list(out["rules"][0]) == ["name", "kind", "line", "n_targets", "targets"]
    bad = tmp_path / "bad.yaml"
    bad.write_text("rules:\n  - name: x\n    kind: risk\n    targets: {tools: [nope]}\n    when: {v: 1}\n")
    assert main(["catalog", "masks", str(bad), "--tools", str(tools)]) == 2
    err = capsys.readouterr().err
    assert "line 2" in err and "unknown tool 'nope'" in err
    with pytest.raises(InputError, match="exactly one"):
        check_masks(masks)


def test_cli_catalog_masks_on_a_dataset(capsys, tmp_path, monkeypatch):
    """Against a dataset, the check also says what the rules would have blocked in its logs."""
    from _tuning_fixtures import finance_workspace
    from core.cli import main

    ws = finance_workspace(tmp_path / "ws", n_episodes=30, seed=3)
    monkeypatch.setenv("RWB_WORKSPACE", str(ws.root))
    masks = REPO / "datasets" / "finance" / "masks.yaml"
    assert main(["catalog", "masks", str(masks), "--dataset", "fin", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == ["file", "catalog_version", "n_tokens", "required_features", "rules", "logged"]
    logged = out["logged"]
    assert list(logged) == ["steps", "blocked", "fallback_states", "by_behaviour", "by_rule"]
    assert logged["steps"] == sum(len(e.steps) for e in ws.load_episodes("fin"))
    assert all(list(b) == ["steps", "valid_actions", "blocked"] for b in logged["by_behaviour"].values())
    assert main(["catalog", "masks", str(masks), "--dataset", "fin"]) == 0
    assert f"on the {logged['steps']} logged steps of fin" in capsys.readouterr().out
    ws.close()


_scalars = st.none() | st.booleans() | st.integers(-5, 30) | st.floats(-1, 30) | st.sampled_from(
    ["9:30", "a", "high", "place_order", "A3T0", "symbol", "tool", "risk", "gt", "between", "x"])
_values = st.recursive(_scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(
    st.sampled_from(["gt", "lt", "in", "outside", "between", "eq", "any", "all", "hour", "task_type", "max",
                     "per", "tools", "tokens", "risk", "preset", "symbol", "side"]), c, max_size=3), max_leaves=12)
_rule = st.fixed_dictionaries({"kind": st.sampled_from(["availability", "business", "risk", "review", "x"])},
                              optional={"name": st.text(max_size=4), "targets": _values, "when": _values,
                                        "unless": _values, "limit": _values, "if_unknown": _values,
                                        "tools": _values, "message": _values})


@settings(max_examples=200, deadline=None)
@given(st.lists(_rule, max_size=4))
def test_fuzz_rule_data_gives_rules_or_input_errors(catalog, rules_data):
    """Whatever the data, loading and compiling either works or raises an InputError; what
    compiles evaluates the same on the fast path and the slow reference."""
    try:
        compiled = MaskRules.from_data({"rules": rules_data}).compile(catalog)
    except InputError:
        return
    features, counts = _random_inputs(np.random.default_rng(0), 20, len(catalog))
    features["task_type"] = np.array(["a", "high", None, "x"] * 5, dtype=object)
    features = {f: features.get(f, np.linspace(0, 24, 20)) for f in compiled.required_features}
    fast = compiled.evaluate(features, counts)
    np.testing.assert_array_equal(fast.mask, compiled.evaluate_reference(features, counts).mask)


def test_numbers_compared_as_categories(catalog):
    rules = MaskRules.from_yaml("rules:\n  - {kind: availability, targets: {tools: [get_realtime_quote]}, "
                                "unless: {market_open: {in: ['1']}, flag: {eq: 'true'}}}\n")
    compiled = rules.compile(catalog)
    f = {"market_open": np.array([1.0, 0.0, 1.0], dtype=object), "flag": np.array([True, True, False], dtype=object)}
    quote = catalog.token("A1T0").id
    assert compiled.evaluate(f).mask[:, quote].tolist() == [True, False, False]
    np.testing.assert_array_equal(compiled.evaluate_reference(f).mask, compiled.evaluate(f).mask)
