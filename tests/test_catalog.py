"""Action catalog: tokens, preset rules, normalizer reasons, memoisation, JSON round trip, CLI."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.records.catalog import (OTHER, UNSET, Catalog, CatalogOptions, build_catalog, catalog_for_dataset,
                                  load_tools_file, show_catalog)
from core.records.episodes import Action, Episode, Step, Task, ToolSchema
from core.base.errors import InputError

REPO = Path(__file__).resolve().parents[1]


def schema(name: str, props: dict, required: list[str] | None = None, risk: str = "low",
           closed: bool = False, meta: dict | None = None) -> ToolSchema:
    params = {"type": "object", "properties": props, "required": required or []}
    if closed:
        params["additionalProperties"] = False
    return ToolSchema(name=name, parameters=params, risk=risk, meta=meta or {})


def call(tool: str, **params) -> Action:
    return Action(kind="tool_call", tool=tool, params=params)


@pytest.fixture
def trading_tools() -> list[ToolSchema]:
    return [
        schema("get_stock_data", {"symbol": {"type": "string"},
                                  "period": {"type": "string", "enum": ["annual", "q1", "q2", "q3", "q4"]}},
               ["symbol", "period"]),
        schema("place_order", {"symbol": {"type": "string"},
                               "side": {"type": "string", "enum": ["buy", "sell"]},
                               "quantity": {"type": "integer", "minimum": 100, "maximum": 900},
                               "urgent": {"type": "boolean", "default": False},
                               "note": {"type": "string"}},
               ["symbol", "side", "quantity"], risk="high", closed=True),
        schema("get_portfolio", {}),
    ]


# --------------------------------------------------------------------------- tokens
def test_tokens_hand_computed(trading_tools):
    cat = build_catalog(trading_tools)
    # Tools are numbered by name: get_portfolio=0, get_stock_data=1, place_order=2.
    assert [t.name for t in cat.tokens[:9]] == ["R0", "F0", "E0", "A0T0", "A1T0", "A1T1", "A1T2", "A1T3",
                                                "A1T4"]
    assert (cat.reply_id, cat.final_id, cat.escalate_id) == (0, 1, 2)
    assert [cat.tokens[i].kind for i in range(3)] == ["reply", "final_answer", "escalate"]
    q3 = cat.token("A1T3")
    assert q3.tool == "get_stock_data" and q3.preset == {"period": "q3"} and q3.risk == "low"
    assert q3.label == "get_stock_data(period=q3, …)"
    # place_order: side (enum 2) × urgent (boolean 2; absent = default False) × quantity (4 buckets)
    orders = [cat.tokens[i] for i in cat.tool_tokens("place_order")]
    assert len(orders) == 16 and all(t.risk == "high" for t in orders)
    assert orders[0].preset == {"side": "buy", "urgent": True, "quantity": "bucket0"}
    assert orders[0].label == "place_order(side=buy, urgent=true, quantity=<300, …)"
    assert orders[-1].preset == {"side": "sell", "urgent": False, "quantity": "bucket3"}
    assert orders[-1].label == "place_order(side=sell, urgent=false, quantity=≥700, …)"
    assert [d.edges for d in cat.dims("place_order") if d.param == "quantity"] == [(300.0, 500.0, 700.0)]
    assert len(cat) == 3 + 1 + 5 + 16
    assert [t.id for t in cat.tokens] == list(range(len(cat)))


def test_ids_are_stable_under_tool_order_and_change_with_schema(trading_tools):
    a = build_catalog(trading_tools)
    b = build_catalog(list(reversed(trading_tools)))
    assert a.version == b.version and [t.to_dict() for t in a.tokens] == [t.to_dict() for t in b.tokens]
    changed = [t.model_copy(update={"risk": "medium"}) if t.name == "get_portfolio" else t
               for t in trading_tools]
    assert build_catalog(changed).version != a.version


def test_finance_tools_give_the_articles_A12T3():
    cat = build_catalog(load_tools_file(REPO / "datasets" / "finance" / "tools.json"))
    assert len(cat.tools) == 17
    assert cat.token("A12T3").label.startswith("get_stock_data(period=q3")


# --------------------------------------------------------------------------- preset rules
def test_numeric_presets_range_geometric_small_int_and_quantiles():
    tools = [schema("t", {"level": {"type": "integer", "minimum": 1, "maximum": 3},
                          "price": {"type": "number", "minimum": 1, "maximum": 10000},
                          "n": {"type": "integer"}}, ["level", "price", "n"])]
    cat = build_catalog(tools)
    dims = {d.param: d for d in cat.dims("t")}
    assert dims["level"].kind == "values" and dims["level"].values == (1, 2, 3)
    assert dims["price"].source == "range" and dims["price"].edges == (10.0, 100.0, 1000.0)  # geometric
    assert "n" not in dims  # no range and no logged values: free
    # With enough logged values, buckets sit at their quantiles, and every bucket is populated.
    values = [1] * 30 + [5] * 30 + [9] * 40
    logged = build_catalog(tools, calls=[("t", {"level": 1, "price": 5.0, "n": v}) for v in values])
    n_dim = {d.param: d for d in logged.dims("t")}["n"]
    assert n_dim.source == "quantiles" and n_dim.edges == (5.0, 9.0)
    ids = logged.normalize_many([call("t", level=1, price=5.0, n=v) for v in (1, 4, 5, 9, 100)]).token_ids
    presets = [logged.tokens[i].preset["n"] for i in ids]
    assert presets == ["bucket0", "bucket0", "bucket1", "bucket2", "bucket2"]


def test_learned_string_presets_and_free_text():
    tools = [schema("search", {"market": {"type": "string"}, "query": {"type": "string"},
                               "order_id": {"type": "string"}}, ["market"])]
    calls = [("search", {"market": m, "query": f"q{i}", "order_id": f"#{i}"})
             for i, m in enumerate(["SH"] * 30 + ["SZ"] * 15 + ["HK"] * 4 + ["NY"])]
    cat = build_catalog(tools, calls=calls, options=CatalogOptions(max_learned_values=2))
    (market,) = cat.dims("search")  # query is free text by name, order_id never repeats
    assert market.source == "logged" and market.values == ("SH", "SZ") and market.other
    names = [cat.tokens[i].preset["market"] for i in cat.tool_tokens("search")]
    assert names == ["SH", "SZ", OTHER]
    got = cat.normalize(call("search", market="HK", query="x"))
    assert cat.tokens[got.token_id].preset == {"market": OTHER}
    # Too few logged values: nothing learned.
    assert build_catalog(tools, calls=calls[:5]).dims("search") == ()


def test_optional_params_without_default_get_unset_preset():
    cat = build_catalog([schema("k", {"interval": {"type": "string", "enum": ["1d", "1w"]}})])
    assert [cat.tokens[i].preset["interval"] for i in cat.tool_tokens("k")] == ["1d", "1w", UNSET]
    assert cat.tokens[cat.normalize(call("k")).token_id].preset == {"interval": UNSET}


def test_declared_presets_override_schema():
    tools = [schema("quote", {"symbol": {"type": "string"}, "days": {"type": "integer"}}, ["symbol", "days"],
                    meta={"presets": {"symbol": ["600519", "000001"], "days": {"buckets": [5, 20]}}})]
    cat = build_catalog(tools)
    assert len(cat.tool_tokens("quote")) == 3 * 3
    tok = cat.tokens[cat.normalize(call("quote", symbol="000001", days=7)).token_id]
    assert tok.preset == {"symbol": "000001", "days": "bucket1"}
    with pytest.raises(InputError, match="meta.presets"):
        build_catalog([schema("bad", {"a": {"type": "string"}}, meta={"presets": {"a": "x"}})])


def test_cap_shrinks_then_drops_dimensions():
    props = {f"e{i}": {"type": "string", "enum": [f"v{j}" for j in range(6)]} for i in range(4)}
    tool = schema("big", props, list(props))
    calls = [("big", {"e0": "v0", "e1": "v1", "e2": "v5", "e3": "v0"})] * 3
    cat = build_catalog([tool], calls=calls, options=CatalogOptions(max_presets_per_tool=32))
    dims = cat.dims("big")
    assert len(cat.tool_tokens("big")) <= 32
    assert [d.size() for d in dims] == [6, 5]  # e0 whole; e1 shrunk to 4 values + <other>; e2, e3 free
    assert "v1" in dims[1].values and dims[1].other  # the most frequent logged value survives the cut


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_property_every_valid_call_maps_to_a_matching_token(data):
    """Random schemas and random valid calls: the token is the call's tool, its preset describes
    the call's values, and no tool exceeds the cap."""
    n_params = data.draw(st.integers(0, 5))
    props: dict = {}
    for i in range(n_params):
        kind = data.draw(st.sampled_from(["enum", "bool", "int", "num", "str"]))
        if kind == "enum":
            props[f"p{i}"] = {"type": "string", "enum": [f"v{j}" for j in range(data.draw(st.integers(1, 20)))]}
        elif kind == "bool":
            props[f"p{i}"] = {"type": "boolean"}
        elif kind == "int":
            lo = data.draw(st.integers(-50, 50))
            props[f"p{i}"] = {"type": "integer", "minimum": lo, "maximum": lo + data.draw(st.integers(0, 500))}
        elif kind == "num":
            props[f"p{i}"] = {"type": "number", "minimum": 0.5, "maximum": data.draw(st.floats(1, 1e6))}
        else:
            props[f"p{i}"] = {"type": "string"}
    required = [p for p in props if data.draw(st.booleans())]
    cap = data.draw(st.integers(1, 40))
    cat = build_catalog([schema("tool", props, required)], options=CatalogOptions(max_presets_per_tool=cap))
    assert 1 <= len(cat.tool_tokens("tool")) <= max(cap, 1)
    for _ in range(5):
        params = {}
        for p, spec in props.items():
            if p not in required and data.draw(st.booleans()):
                continue
            if "enum" in spec:
                params[p] = data.draw(st.sampled_from(spec["enum"]))
            elif spec["type"] == "boolean":
                params[p] = data.draw(st.booleans())
            elif spec["type"] == "integer":
                params[p] = data.draw(st.integers(spec["minimum"], spec["maximum"]))
            elif spec["type"] == "number":
                params[p] = data.draw(st.floats(spec["minimum"], spec["maximum"]))
            else:
                params[p] = data.draw(st.text(max_size=5))
        r = cat.normalize(call("tool", **params))
        assert r.valid, r.reason
        token = cat.tokens[r.token_id]
        assert token.tool == "tool"
        for dim in cat.dims("tool"):
            shown = token.preset[dim.param]
            if dim.param not in params:
                assert shown == UNSET
            elif dim.kind == "values":
                assert shown == params[dim.param] or (shown == OTHER and params[dim.param] not in dim.values)
            else:
                i = int(shown.removeprefix("bucket"))
                edges = (-np.inf, *dim.edges, np.inf)
                assert edges[i] <= params[dim.param] < edges[i + 1]


# --------------------------------------------------------------------------- normalizer
@pytest.mark.parametrize("action, reason", [
    (call("sell_everything"), "unknown tool 'sell_everything'"),
    (Action(kind="tool_call", tool="place_order", raw_arguments='{"symbol": "600519", "side": '),
     "unparsable arguments"),
    (Action(kind="tool_call", tool="place_order", raw_arguments='["600519"]'),
     "unparsable arguments: expected a JSON object, got array"),
    (call("place_order", symbol="600519", side="buy", quantity="200"),
     "type mismatch: param 'quantity' expects integer, got string"),
    (call("place_order", symbol="600519", side="buy", quantity=True),
     "type mismatch: param 'quantity' expects integer, got boolean"),
    (call("place_order", symbol="600519", side="buy", quantity=2.5),
     "type mismatch: param 'quantity' expects integer, got number"),
    (call("place_order", symbol="600519", side="buy", quantity=200, urgent=1),
     "type mismatch: param 'urgent' expects boolean, got integer"),
    (call("place_order", symbol="600519", side="buy", quantity=50),
     "out-of-range value: param 'quantity' = 50 < minimum 100"),
    (call("place_order", symbol="600519", side="buy", quantity=1000),
     "out-of-range value: param 'quantity' = 1000 > maximum 900"),
    (call("place_order", symbol="600519", side="hold", quantity=200),
     "out-of-range value: param 'side' = \"hold\" is not one of"),
    (call("place_order", symbol="600519", quantity=200), "missing required param 'side'"),
    (call("place_order", symbol="600519", side="buy", quantity=200, leverage=3),
     "unknown param 'leverage'"),
])
def test_normalizer_reasons(trading_tools, action, reason):
    r = build_catalog(trading_tools).normalize(action)
    assert r.token_id == -1 and not r.valid and reason in r.reason
    assert r.tool_known == (not reason.startswith("unknown tool"))
    assert not r.args_ok


def test_normalizer_valid_calls_and_special_kinds(trading_tools):
    cat = build_catalog(trading_tools)
    assert cat.normalize(Action(kind="reply")).token_id == cat.reply_id
    assert cat.normalize(Action(kind="final_answer")).token_id == cat.final_id
    assert cat.normalize(Action(kind="terminate")).token_id == cat.final_id
    assert cat.normalize(Action(kind="escalate")).token_id == cat.escalate_id
    a = cat.normalize(call("place_order", symbol="600519", side="sell", quantity=800.0, note="take profit"))
    assert a.valid and cat.tokens[a.token_id].preset == {"side": "sell", "urgent": False, "quantity": "bucket3"}
    raw = cat.normalize(Action(kind="tool_call", tool="get_stock_data",
                               raw_arguments='{"symbol": "600519", "period": "q3"}'))
    assert cat.tokens[raw.token_id].name == "A1T3"
    # The memo keys on value types: a cached valid call never hides a type mismatch.
    assert cat.normalize(call("place_order", symbol="1", side="buy", quantity=200, urgent=True)).valid
    assert not cat.normalize(call("place_order", symbol="1", side="buy", quantity=200, urgent=1)).valid
    # Unhashable values (lists) are fine.
    lists = schema("notes", {"sources": {"type": "array"}}, ["sources"])
    cat2 = build_catalog([lists])
    assert cat2.normalize(call("notes", sources=["n1", "n2"])).valid
    assert "expects array" in cat2.normalize(call("notes", sources="n1")).reason


def test_normalize_many_matches_normalize(trading_tools):
    cat = build_catalog(trading_tools)
    rng = random.Random(3)
    actions = []
    for _ in range(500):
        actions.append(rng.choice([
            call("place_order", symbol=rng.choice(["1", "2"]), side=rng.choice(["buy", "sell", "x"]),
                 quantity=rng.choice([100, 450, 950, "3"])),
            call("get_stock_data", symbol="1", period=rng.choice(["q1", "q3", "q9"])),
            Action(kind=rng.choice(["reply", "final_answer", "escalate", "terminate"])),
            call("nope", a=1),
            Action(kind="tool_call", tool="get_portfolio", raw_arguments=rng.choice(["{}", "{", "null"])),
        ]))
    batch = cat.normalize_many(actions)
    fresh = Catalog.from_json(cat.to_json())  # a cold memo
    one_by_one = [fresh.normalize(a) for a in actions]
    assert batch.token_ids.tolist() == [r.token_id for r in one_by_one]
    assert batch.tool_known.tolist() == [r.tool_known for r in one_by_one]
    assert batch.args_ok.tolist() == [r.args_ok for r in one_by_one]
    assert batch.reasons == [r.reason for r in one_by_one]
    assert batch.tool_ids.tolist() == [r.tool_id for r in one_by_one]
    assert batch.n_invalid == int((~batch.valid).sum()) > 0


def synthetic_tools(n_tools: int = 50, n_a: int = 10, n_b: int = 10) -> list[ToolSchema]:
    """50 tools × 10 × 10 enum presets = 5,000 tool tokens."""
    return [schema(f"tool_{i:02d}", {"a": {"type": "string", "enum": [f"a{j}" for j in range(n_a)]},
                                     "b": {"type": "integer", "enum": list(range(n_b))},
                                     "note": {"type": "string"}},
                   ["a", "b"], risk=("low", "medium", "high")[i % 3]) for i in range(n_tools)]


def test_normalize_many_on_5000_token_catalog_works_once_per_distinct_call(monkeypatch):
    """100k logged calls on a 5,003-token catalog: each distinct call is normalized once (the
    memo answers the repeats; no scan over tokens), and the tokens equal one-by-one normalize.
    Its throughput is measured by benchmarks/bench_catalog_masks.py."""
    cat = build_catalog(synthetic_tools(), options=CatalogOptions(max_presets_per_tool=100))
    assert len(cat) == 5003
    rng = random.Random(0)
    # 100k logged calls, ~5k distinct (tool, params) pairs, plus some invalid ones.
    pool = [call(f"tool_{rng.randrange(50):02d}", a=f"a{rng.randrange(10)}", b=rng.randrange(12),
                 note=rng.choice(["", "hedge"])) for _ in range(5000)]
    actions = [rng.choice(pool) for _ in range(100_000)]
    distinct = {(a.tool, tuple(a.params.items())) for a in actions}
    cat = Catalog.from_json(cat.to_json())  # cold memos
    computed: list[tuple] = []
    real = cat._normalize_call

    def counted(*args):
        computed.append(args)
        return real(*args)

    monkeypatch.setattr(cat, "_normalize_call", counted)
    batch = cat.normalize_many(actions)
    assert len(computed) == len(distinct)
    assert len(batch.token_ids) == len(actions)
    assert 0 < batch.n_invalid < len(actions)  # b in 10..11 is out of the enum
    fresh = Catalog.from_json(cat.to_json())
    for i in range(0, len(actions), 997):
        one = fresh.normalize(actions[i])
        assert (batch.token_ids[i], batch.reasons[i]) == (one.token_id, one.reason)


# --------------------------------------------------------------------------- inferred catalog
def test_catalog_inferred_from_logged_calls_when_no_schemas():
    calls = [("lookup", {"market": m, "n": i % 7}) for i, m in enumerate(["SH", "SZ"] * 15)]
    calls += [("ping", {})]
    cat = build_catalog(None, calls=calls)
    assert cat.inferred and sorted(cat.tools) == ["lookup", "ping"]
    assert cat.tools["lookup"].parameters["properties"] == {"market": {"type": "string"},
                                                            "n": {"type": "integer"}}
    assert {d.param for d in cat.dims("lookup")} == {"market", "n"}
    assert cat.normalize(call("lookup", market="SH", n=3)).valid
    assert "unknown tool" in cat.normalize(call("other")).reason
    assert "type mismatch" in cat.normalize(call("lookup", market="SH", n="3")).reason


# --------------------------------------------------------------------------- round trip
def test_json_round_trip_and_tamper_detection(trading_tools):
    cat = build_catalog(trading_tools, calls=[("place_order", {"symbol": "1", "side": "buy", "quantity": q})
                                              for q in range(100, 900, 20)])
    text = cat.to_json()
    back = Catalog.from_json(text)
    assert back.version == cat.version and back.to_json() == text
    assert [t.to_dict() for t in back.tokens] == [t.to_dict() for t in cat.tokens]
    assert back.normalize(call("place_order", symbol="9", side="buy", quantity=700)).token_id == \
        cat.normalize(call("place_order", symbol="9", side="buy", quantity=700)).token_id
    data = json.loads(text)
    data["tools"][2]["dims"][0]["values"] = ["sell", "buy"]
    with pytest.raises(InputError, match="version"):
        Catalog.from_json(json.dumps(data))
    with pytest.raises(InputError, match="not valid JSON"):
        Catalog.from_json(text[:-10])
    with pytest.raises(InputError, match="not a Reward Workbench catalog"):
        Catalog.from_json("{}")


# --------------------------------------------------------------------------- workspace, files, CLI
def _episode(i: int, tool: str, params: dict) -> Episode:
    return Episode(episode_id=f"e{i}", domain="finance", task=Task(query="q", task_type="analysis"),
                   steps=[Step(t=0, action=Action(kind="tool_call", tool=tool, params=params)),
                          Step(t=1, action=Action(kind="final_answer"))])


def test_catalog_for_dataset(tmp_path, trading_tools):
    from core.records.store import Workspace

    ws = Workspace.open(tmp_path / "ws")
    with ws.transaction() as conn:
        ws.ensure_dataset(conn, "with_tools", "finance")
        ws.upsert_tools(conn, "with_tools", trading_tools)
        ws.insert_episodes(conn, "with_tools", [_episode(i, "get_stock_data", {"symbol": "1", "period": "q3"})
                                                for i in range(3)])
        ws.ensure_dataset(conn, "logs_only", None)
        ws.insert_episodes(conn, "logs_only", [_episode(i, "lookup", {"market": "SH"}) for i in range(3)])
    cat = catalog_for_dataset(ws, "with_tools")
    assert not cat.inferred and cat.version == build_catalog(trading_tools).version
    inferred = catalog_for_dataset(ws, "logs_only")
    assert inferred.inferred and list(inferred.tools) == ["lookup"]
    with pytest.raises(InputError, match="no dataset named 'nope'.*with_tools"):
        catalog_for_dataset(ws, "nope")
    summary = show_catalog(ws, dataset="with_tools")
    assert summary.n_tokens == len(cat) and summary.version == cat.version and summary.source == "dataset with_tools"
    assert summary.tokens == cat.tokens and [t.name for t in summary.tools] == list(cat.tools)
    ws.close()


def test_load_tools_file_formats_and_errors(tmp_path, trading_tools):
    objs = [{"type": "function", "function": json.loads(t.model_dump_json())} for t in trading_tools]
    (tmp_path / "list.json").write_text(json.dumps(objs))
    (tmp_path / "obj.json").write_text(json.dumps({"tools": objs}))
    (tmp_path / "data.jsonl").write_text(json.dumps({"rwb_header": {"version": 1, "tools": objs}}) + "\n{}\n")
    for name in ("list.json", "obj.json", "data.jsonl"):
        assert [t.name for t in load_tools_file(tmp_path / name)] == [t.name for t in trading_tools]
    (tmp_path / "bad.json").write_text(json.dumps([{"function": {"name": ""}}]))
    with pytest.raises(InputError, match="record 0"):
        load_tools_file(tmp_path / "bad.json")
    with pytest.raises(InputError, match="cannot read"):
        load_tools_file(tmp_path / "missing.json")
    with pytest.raises(InputError, match="exactly one"):
        show_catalog(None)


def test_cli_catalog_show(capsys):
    from core.cli import main

    tools = REPO / "datasets" / "finance" / "tools.json"
    assert main(["catalog", "show", "--tools", str(tools), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["n_tools"] == 17 and out["n_tokens"] == len(out["tokens"])
    assert list(out) == ["source", "version", "n_tools", "n_tokens", "inferred_tools", "tools", "tokens"]
    assert list(out["tools"][0]) == ["tool_id", "name", "risk", "n_presets", "preset_params"]
    assert list(out["tokens"][5]) == ["id", "name", "kind", "tool", "tool_id", "preset", "label", "risk"]
    assert main(["catalog", "show", "--tools", str(tools)]) == 0
    text = capsys.readouterr().out
    assert "A12T3" in text and "get_stock_data(period=q3" in text and out["version"] in text
    assert main(["catalog", "show"]) == 2
    assert "exactly one" in capsys.readouterr().err


# --------------------------------------------------------------------------- robustness
_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=20)


@settings(max_examples=150, deadline=None)
@given(props=st.dictionaries(st.sampled_from(["a", "b", "query", "n"]),
                             st.dictionaries(st.sampled_from(["type", "enum", "minimum", "maximum", "default",
                                                              "exclusiveMinimum", "format"]), _json_values,
                                             max_size=4) | _json_values, max_size=3),
       required=_json_values, calls=st.lists(st.dictionaries(st.sampled_from(["a", "b", "query", "n", "zz"]),
                                                             _json_values, max_size=4), max_size=30))
def test_fuzz_odd_schemas_and_calls_never_crash(props, required, calls):
    """Any schema is either refused with an InputError or yields a catalog whose normalizer
    answers every call with a token or a reason."""
    tool = ToolSchema(name="t", parameters={"type": "object", "properties": props, "required": required})
    try:
        cat = build_catalog([tool], calls=[("t", c) for c in calls], options=CatalogOptions(min_support=3))
    except InputError:
        return
    batch = cat.normalize_many([call("t", **c) for c in calls] + [call("zz")])
    assert len(batch) == len(calls) + 1
    for token_id, reason in zip(batch.token_ids, batch.reasons):
        assert (token_id >= 0) == (reason is None)
        if token_id >= 0:
            assert cat.tokens[token_id].tool == "t"
    assert Catalog.from_json(cat.to_json()).version == cat.version


def test_schema_dialects():
    cat = build_catalog([schema("bfcl", {"x": {"type": "float"}, "d": {"type": "dict"}, "any": {"type": "any"}}),
                         schema("draft4", {"n": {"type": "integer", "minimum": 0, "exclusiveMinimum": True}})])
    assert "expects number" in cat.normalize(call("bfcl", x="1", d={}, any=1)).reason
    assert "expects object" in cat.normalize(call("bfcl", x=1.5, d=[], any=1)).reason
    assert cat.normalize(call("bfcl", x=1.5, d={}, any=[1])).valid
    assert "exclusive minimum 0" in cat.normalize(call("draft4", n=0)).reason
    assert cat.normalize(call("draft4", n=1)).valid
    with pytest.raises(InputError, match="tool 'bad': properties must be an object"):
        build_catalog([ToolSchema(name="bad", parameters={"type": "object", "properties": [1]})])
    with pytest.raises(InputError, match="enum of parameter 'p' must be a non-empty list"):
        build_catalog([schema("bad", {"p": {"enum": "abc"}})])
