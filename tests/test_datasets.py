"""Synthetic episode generators (core.data.datasets, core.data.datagen) and `rwb datasets`."""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from core.data import datasets
from core.cli import main as rwb
from core.data.datagen import common, ecommerce, finance
from core.records.episodes import ToolSchema
from core.base.errors import InputError

N = 500


@pytest.fixture(scope="module")
def fin() -> datasets.GeneratedDataset:
    return datasets.generate("finance", N, seed=123)


@pytest.fixture(scope="module")
def ecom() -> datasets.GeneratedDataset:
    return datasets.generate("ecommerce", N, seed=123)


def _welch_t(a: list[float], b: list[float]) -> float:
    a_, b_ = np.asarray(a), np.asarray(b)
    return float((a_.mean() - b_.mean()) / math.sqrt(a_.var(ddof=1) / len(a_) + b_.var(ddof=1) / len(b_)))


def _by(ds: datasets.GeneratedDataset, behaviour: str) -> list[dict]:
    return [r for r in ds.records if r["behaviour"] == behaviour]


def _calls(record: dict) -> list[dict]:
    return [s for s in record["steps"] if s["action"]["kind"] == "tool_call"]


# --------------------------------------------------------------------------- schemas

def test_finance_tool_schemas():
    tools = datasets.load_tools("finance")
    assert len(tools) == 17
    by_name = {t.name: t for t in tools}
    assert [t.name for t in tools][12] == "get_stock_data"  # A12T3 = get_stock_data(period=q3)
    assert by_name["get_stock_data"].parameters["properties"]["period"]["enum"][3] == "q3"
    assert by_name["place_order"].risk == "high" and by_name["margin_trade"].risk == "high"
    assert by_name["get_realtime_quote"].risk == "low"
    qty = by_name["place_order"].parameters["properties"]["quantity"]
    assert qty["type"] == "integer" and qty["minimum"] == 100 and qty["maximum"] == 1_000_000
    assert by_name["place_order"].parameters["properties"]["side"]["enum"] == ["buy", "sell"]
    for t in tools:  # OpenAI function schema, readable back through the importer entry point
        assert ToolSchema.from_openai({"type": "function", "function": t.model_dump()}) == t
        assert t.parameters["type"] == "object" and t.description


def test_ecommerce_tools_are_the_tau2_retail_tools():
    tools = datasets.load_tools("ecommerce")
    assert [t.name for t in tools] == [
        "authenticate_user", "get_user_profile", "get_user_orders", "get_order_details", "search_products",
        "get_product_details", "cancel_order", "modify_order", "return_order", "exchange_order",
        "update_user_address", "transfer_to_human_agents", "track_shipment", "get_return_policy"]
    # the last two are the workbench's own read tools, marked so in their meta
    assert [t.name for t in tools if t.meta.get("source") == "workbench"] == ["track_shipment", "get_return_policy"]
    folder = datasets.datasets_dir() / "ecommerce"
    assert "MIT License" in (folder / "LICENSE").read_text()
    assert "tau2-bench" in (folder / "SOURCE.md").read_text()
    by_name = {t.name: t for t in tools}
    assert by_name["exchange_order"].meta["opposite_tools"]
    assert by_name["cancel_order"].parameters["properties"]["reason"]["enum"]


def test_generators_never_read_the_shared_folder():
    root = Path(datasets.__file__).parent
    for path in [root / "datasets.py", *sorted((root / "datagen").glob("*.py"))]:
        assert "../shared" not in path.read_text() and "/work/shared" not in path.read_text(), path


# --------------------------------------------------------------------------- random numbers and helpers

def _splitmix_py(x: int) -> int:
    m = (1 << 64) - 1
    z = (x + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def test_vectorised_uniforms_match_a_pure_python_reference():
    keys = common.stream_keys(42, "test", 5)
    fast = common.uniforms(keys, 7, offset=3)
    for i, key in enumerate(keys.tolist()):
        base = _splitmix_py(key)
        for j in range(7):
            bits = _splitmix_py(base ^ (((3 + j) * 0x9E3779B97F4A7C15) & ((1 << 64) - 1)))
            assert fast[i, j] == (bits >> 11) * 2.0 ** -53
    assert 0.0 <= fast.min() and fast.max() < 1.0
    # a Draws stream that runs past its first block continues the same counter sequence
    d = common.Draws(int(keys[0]), common.uniforms(keys[:1], 2)[0].tolist())
    got = [d.u() for _ in range(5)]
    assert got == common.uniforms(keys[:1], 5)[0].tolist()


def test_check_args_reasons():
    schema = datasets.load_tools("finance")[14].parameters  # place_order
    ok = {"symbol": "600519", "side": "sell", "quantity": 500, "order_type": "market"}
    assert common.check_args(schema, ok) is None
    assert "type mismatch" in common.check_args(schema, {**ok, "quantity": "500"})
    assert "type mismatch" in common.check_args(schema, {**ok, "quantity": True})
    assert "out-of-range" in common.check_args(schema, {**ok, "quantity": 5_000_000})
    assert "out-of-range" in common.check_args(schema, {**ok, "side": "hold"})
    assert "missing required" in common.check_args(schema, {"symbol": "600519"})
    assert "unexpected" in common.check_args(schema, {**ok, "leverage": 2})
    returns = datasets.load_tools("ecommerce")[8].parameters  # return_order: nested items
    good = {"order_id": "#W1", "items": [{"item_id": "1", "quantity": 1}], "reason": "x"}
    assert common.check_args(returns, good) is None
    assert "items[0].quantity" in common.check_args(returns, {**good, "items": [{"item_id": "1", "quantity": 0}]})


@pytest.mark.parametrize("n", [1, 2, 3, 7, 100])
def test_plans_have_exact_counts_and_valid_twins(n):
    plans = common.plan_episodes(n, finance.SHARES, finance.PAIRS, seed=3)
    assert [p.position for p in plans] == list(range(n))
    counts = Counter(p.behaviour for p in plans)
    assert sum(counts.values()) == n
    for p in plans:
        if p.behaviour == "hacker":
            twin = plans[p.twin]
            assert twin.behaviour == "expert" and twin.task == p.task
        else:
            assert p.twin is None
    tasks = Counter(p.task for p in plans)
    assert all(c == 1 or c == 2 for c in tasks.values())


# --------------------------------------------------------------------------- determinism and format

@pytest.mark.parametrize("domain", datasets.DOMAINS)
def test_same_seed_gives_identical_bytes(domain, tmp_path):
    a = datasets.write_jsonl(datasets.generate(domain, 60, seed=9), tmp_path / "a.jsonl")
    b = datasets.write_jsonl(datasets.generate(domain, 60, seed=9), tmp_path / "b.jsonl")
    c = datasets.write_jsonl(datasets.generate(domain, 60, seed=10), tmp_path / "c.jsonl")
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()
    assert not list(tmp_path.glob(".*tmp"))  # temp files renamed away


@pytest.mark.parametrize("domain", datasets.DOMAINS)
def test_streamed_file_equals_the_in_memory_one(domain, tmp_path, monkeypatch):
    """generate_file builds and writes chunk by chunk; chunking must not change a byte."""
    whole = datasets.write_jsonl(datasets.generate(domain, 45, seed=2), tmp_path / "whole.jsonl")
    monkeypatch.setattr(datasets, "CHUNK_EPISODES", 7)
    seen = []
    summary = datasets.generate_file(domain, 45, 2, tmp_path / "streamed.jsonl",
                                     progress=lambda done, total: seen.append((done, total)))
    assert (tmp_path / "streamed.jsonl").read_bytes() == whole.read_bytes()
    assert seen[-1] == (45, 45) and len(seen) == 7
    in_memory = datasets.summarize(datasets.generate(domain, 45, seed=2))
    figures = [f.name for f in dataclasses.fields(datasets.DatasetSummary) if f.name != "seconds"]
    assert [getattr(summary, k) for k in figures] == [getattr(in_memory, k) for k in figures]


@pytest.mark.parametrize("spec", datasets.SAMPLES, ids=lambda s: s.domain)
def test_committed_samples_regenerate_byte_for_byte(spec):
    assert spec.path.is_file(), f"missing {spec.path}; run core.data.datasets.write_samples()"
    data = spec.path.read_bytes()
    assert len(data) < 3_000_000
    regenerated = "".join(line + "\n" for line in datasets.generate(spec.domain, spec.episodes, spec.seed).lines())
    assert regenerated.encode("utf-8") == data
    assert datasets.sample_files()[[s.domain for s in datasets.SAMPLES].index(spec.domain)] == spec.path


def test_file_layout_header_and_episodes(fin):
    lines = list(fin.lines())
    header = json.loads(lines[0])["rwb_header"]
    assert header["version"] == 1 and header["domain"] == "finance"
    assert [ToolSchema.model_validate(t) for t in header["tools"]] == fin.tools
    assert len(lines) == N + 1
    assert len({json.loads(x)["episode_id"] for x in lines[1:]}) == N


@pytest.mark.parametrize("which", ["fin", "ecom"])
def test_fast_records_equal_the_pydantic_round_trip(which, request):
    """The records are written without pydantic; the slow path must give the same line."""
    ds = request.getfixturevalue(which)
    for record, episode in zip(ds.records, ds.episodes):
        assert episode.to_json() == common.dumps(record)
        assert episode.n_steps == len(record["steps"])
        assert [s.t for s in episode.steps] == list(range(episode.n_steps))


@pytest.mark.parametrize("which,module", [("fin", finance), ("ecom", ecommerce)])
def test_state_features_are_scalar_and_in_range(which, module, request):
    ds = request.getfixturevalue(which)
    for ep in ds.episodes:
        assert ep.task.task_type in module.TASK_TYPES and ep.task.query and ep.task.intents
        assert ep.steps, ep.episode_id
        assert len({id(s.observation["state"]) for s in ep.steps}) == ep.n_steps  # never shared
        assert ep.steps[0].observation["messages"][0] == {"role": "user", "content": ep.task.query}
        for s in ep.steps:
            state = s.observation["state"]
            assert tuple(sorted(state)) == tuple(sorted(module.STATE_FEATURES))
            assert all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in state.values())
            assert 0 <= state["hour"] <= 23
            assert s.latency_ms is not None and s.latency_ms > 0 and s.timestamp
            if s.action.kind == "tool_call":
                assert (s.tool_result is None) != (s.tool_error is None)
            if s.action.kind in ("tool_call", "final_answer", "reply", "escalate"):
                assert s.output_text
        o = ep.outcome
        assert o.resolved is not None and 0.0 <= o.business_metric <= 1.0 and -1.0 <= o.sentiment <= 1.0
        assert o.final_reward is not None
    if which == "fin":
        vols = [ep.steps[0].observation["state"]["volatility"] for ep in ds.episodes]
        assert 0.0 < min(vols) and max(vols) <= 1.0
        assert 0.1 < np.mean(np.array(vols) > finance.MARGIN_VOL_LIMIT) < 0.5  # the risk rule has work
        hours = {ep.steps[0].observation["state"]["hour"] for ep in ds.episodes}
        assert hours & {0, 20, 23} and hours & {9, 10, 14}  # both sides of the live-quote window


def test_timestamps_increase_within_an_episode(fin):
    for r in fin.records[:100]:
        stamps = [s["timestamp"] for s in r["steps"]]
        assert stamps == sorted(stamps)


# --------------------------------------------------------------------------- behaviours (finance)

def test_behaviour_and_task_mix(fin, ecom):
    assert Counter(r["behaviour"] for r in fin.records) == {"expert": 200, "noisy": 200, "hacker": 100}
    assert Counter(r["behaviour"] for r in ecom.records) == {"resolve": 200, "upsell": 125, "escalate": 100,
                                                              "oscillate": 75}
    assert set(r["task"]["task_type"] for r in fin.records) == set(finance.TASK_TYPES)
    assert set(r["task"]["task_type"] for r in ecom.records) == set(ecommerce.TASK_TYPES)
    queries = [r["task"]["query"] for r in fin.records]
    assert len(set(queries)) > 0.6 * len(queries)  # templates × companies × phrasing


def test_same_task_seed_means_same_task(fin):
    by_seed: dict[int, set] = {}
    for r in fin.records:
        key = (r["task"]["query"], r["task"]["task_type"], json.dumps(r["steps"][0]["observation"]["state"]))
        by_seed.setdefault(r["meta"]["task_seed"], set()).add(key)
    assert all(len(v) == 1 for v in by_seed.values())
    seeds = [17, 23, 99]
    u = common.uniforms(np.array(seeds, dtype=np.uint64), 48)
    again = finance.build_tasks(seeds, u)
    assert [t.query for t in again] == [t.query for t in finance.build_tasks(seeds, u)]


def test_hackers_have_honest_twins_that_score_higher(fin):
    by_id = {r["episode_id"]: r for r in fin.records}
    hackers = _by(fin, "hacker")
    assert hackers
    for h in hackers:
        twin = by_id[h["meta"]["twin_of"]]
        assert twin["behaviour"] == "expert" and "twin_of" not in twin["meta"]
        assert twin["meta"]["task_seed"] == h["meta"]["task_seed"]
        assert twin["task"] == h["task"]
        assert twin["steps"][0]["observation"] == h["steps"][0]["observation"]
        assert twin["outcome"]["final_reward"] > h["outcome"]["final_reward"]
    assert all("twin_of" not in r["meta"] for r in fin.records if r["behaviour"] != "hacker")


def test_hacker_uses_the_fabricated_item_and_always_says_buy(fin):
    for h in _by(fin, "hacker"):
        calls = _calls(h)
        news = [s for s in calls if s["action"]["tool"] == "get_news"]
        assert news and news[0]["action"]["params"]["source"] == "social_media"
        fabricated = [i for i in news[0]["tool_result"]["items"] if not i["verified"]]
        assert fabricated and fabricated[0]["credibility"] < 0.1 and fabricated[0]["sentiment"] > 0.9
        note = [s for s in calls if s["action"]["tool"] == "generate_research_note"]
        assert note and note[0]["action"]["params"]["sources"] == [fabricated[0]["id"]]
        final = h["steps"][-1]
        assert final["action"]["kind"] == "final_answer"
        assert final["output_text"].endswith("Recommendation: BUY.")
        assert fabricated[0]["headline"] in final["output_text"]
        assert not any(s["action"]["params"].get("side") == "sell" for s in calls)
    for r in fin.records:  # nobody else touches the rumour mill
        if r["behaviour"] != "hacker":
            assert not any(s["action"]["params"].get("source") == "social_media" for s in _calls(r))
            assert not any(s["action"]["tool"] == "generate_research_note" for s in _calls(r))


def test_expert_and_hacker_calls_fit_the_schemas_and_noisy_ones_often_do_not(fin):
    schemas = {t.name: t.parameters for t in fin.tools}
    bad = Counter()
    total = Counter()
    for r in fin.records:
        for s in _calls(r):
            tool, params = s["action"]["tool"], s["action"]["params"]
            problem = "unknown" if tool not in schemas else common.check_args(schemas[tool], params)
            total[r["behaviour"]] += 1
            if problem:
                bad[r["behaviour"]] += 1
                assert s["tool_error"], (r["episode_id"], s["t"])  # a malformed call always fails
    assert bad["expert"] == 0 and bad["hacker"] == 0
    assert 0.03 < bad["noisy"] / total["noisy"] < 0.3
    unknown = sum(s["action"]["tool"] not in schemas for r in _by(fin, "noisy") for s in _calls(r))
    assert unknown > 0


def test_expert_obeys_the_mask_rules_and_noisy_breaks_them(fin):
    """Live quotes only 09:00-15:00, no margin when volatility > 0.30, ≤ 3 trades per symbol per day."""
    def violations(r: dict) -> int:
        n = 0
        for s in _calls(r):
            state, tool = s["observation"]["state"], s["action"]["tool"]
            if tool == "get_realtime_quote" and not 9 <= state["hour"] < 15:
                n += 1
            if tool == "margin_trade" and state["volatility"] > finance.MARGIN_VOL_LIMIT:
                n += 1
            if tool in ("place_order", "margin_trade") and state["trades_today"] >= 3:
                n += 1
        return n

    assert sum(violations(r) for r in _by(fin, "expert")) == 0
    assert sum(violations(r) for r in _by(fin, "noisy")) > 0
    escalations = [r for r in _by(fin, "expert") if r["steps"][-1]["action"]["kind"] == "escalate"]
    assert escalations and all(r["steps"][0]["observation"]["state"]["trades_today"] >= 3 for r in escalations)


def test_expert_answers_quote_the_data_they_fetched(fin):
    """Signal for the L3 consistency check: expert numbers come from the tool results."""
    checked = 0
    for r in _by(fin, "expert"):
        if r["task"]["task_type"] != "analysis":
            continue
        report = [s["tool_result"] for s in _calls(r) if s["action"]["tool"] == "get_financial_report"][0]
        text = r["steps"][-1]["output_text"]
        assert f"net profit {report['net_profit_growth_pct']:+.1f}% YoY" in text
        assert f"revenue {report['revenue_growth_pct']:+.1f}% YoY" in text
        checked += 1
    assert checked > 10


def test_finance_outcomes_order_expert_noisy_hacker(fin):
    fr = {b: [r["outcome"]["final_reward"] for r in _by(fin, b)] for b in finance.BEHAVIOURS}
    bm = {b: [r["outcome"]["business_metric"] for r in _by(fin, b)] for b in finance.BEHAVIOURS}
    assert np.mean(fr["expert"]) > np.mean(fr["noisy"]) > np.mean(fr["hacker"])
    assert _welch_t(fr["expert"], fr["noisy"]) > 4
    assert _welch_t(fr["noisy"], fr["hacker"]) > 8
    assert _welch_t(bm["expert"], bm["noisy"]) > 4
    resolved = {b: np.mean([r["outcome"]["resolved"] for r in _by(fin, b)]) for b in finance.BEHAVIOURS}
    assert resolved["expert"] > resolved["noisy"] > resolved["hacker"]


def test_outcomes_depend_on_the_actions_taken(fin):
    """Within one behaviour, episodes with failing calls end worse."""
    noisy = _by(fin, "noisy")
    clean = [r["outcome"]["final_reward"] for r in noisy if not any(s["tool_error"] for s in r["steps"])]
    failing = [r["outcome"]["final_reward"] for r in noisy if sum(bool(s["tool_error"]) for s in r["steps"]) >= 2]
    assert len(clean) > 30 and len(failing) > 10
    assert np.mean(clean) > np.mean(failing) + 0.1
    # the hacker's BUY pays off only when the stock actually rises
    hackers = _by(fin, "hacker")
    up = [r["outcome"]["business_metric"] for r in hackers if r["outcome"]["extra"]["realised_return_pct"] > 3]
    down = [r["outcome"]["business_metric"] for r in hackers if r["outcome"]["extra"]["realised_return_pct"] < -3]
    assert up and down and np.mean(up) > np.mean(down)


# --------------------------------------------------------------------------- behaviours (ecommerce)

def test_ecommerce_outcomes_order(ecom):
    fr = {b: [r["outcome"]["final_reward"] for r in _by(ecom, b)] for b in ecommerce.BEHAVIOURS}
    assert _welch_t(fr["resolve"], fr["upsell"]) > 4
    assert _welch_t(fr["upsell"], fr["oscillate"]) > 4
    assert _welch_t(fr["resolve"], fr["escalate"]) > 8
    sentiment = {b: np.mean([r["outcome"]["sentiment"] for r in _by(ecom, b)]) for b in ecommerce.BEHAVIOURS}
    assert sentiment["resolve"] > sentiment["upsell"] > sentiment["oscillate"]
    resolved = {b: np.mean([r["outcome"]["resolved"] for r in _by(ecom, b)]) for b in ecommerce.BEHAVIOURS}
    assert resolved["resolve"] == 1.0 and resolved["escalate"] < 0.3


def test_oscillation_flips_between_opposite_actions(ecom):
    opposite = {t.name: set(t.meta.get("opposite_tools", [])) for t in ecom.tools}
    by_id = {r["episode_id"]: r for r in ecom.records}

    def flips(r: dict) -> int:
        writes = [s["action"] for s in _calls(r) if s["action"]["tool"] in
                  ("cancel_order", "modify_order", "return_order", "exchange_order", "update_user_address")]
        return sum(b["tool"] in opposite[a["tool"]] or (a["tool"] == b["tool"] and a["params"] != b["params"])
                   for a, b in zip(writes, writes[1:]))

    osc = _by(ecom, "oscillate")
    writing = [r for r in osc if r["task"]["task_type"] in ecommerce._INTENT_TOOL]
    assert writing and all(flips(r) >= 2 for r in writing)
    assert all(r["outcome"]["extra"]["action_flips"] == flips(r) for r in writing)
    assert all(r["outcome"]["extra"]["action_flips"] >= 1 for r in osc)
    assert all(flips(r) == 0 for r in _by(ecom, "resolve"))
    for r in osc:  # each has a resolving twin on the same task, which ends better
        twin = by_id[r["meta"]["twin_of"]]
        assert twin["behaviour"] == "resolve" and twin["task"] == r["task"]
        assert twin["outcome"]["final_reward"] > r["outcome"]["final_reward"]


def test_escalations_and_upsells_look_like_it(ecom):
    for r in _by(ecom, "escalate"):
        assert r["steps"][-1]["action"]["kind"] == "escalate"
        assert r["steps"][-2]["action"]["tool"] == "transfer_to_human_agents"
    pushes = [r for r in _by(ecom, "upsell") if any("Pro" in (s["output_text"] or "") and s["action"]["kind"] == "reply"
                                                      for s in r["steps"])]
    assert len(pushes) == len(_by(ecom, "upsell"))
    for r in _by(ecom, "resolve"):
        kinds = [s["action"]["kind"] for s in r["steps"]]
        assert kinds[-1] in ("final_answer", "escalate")
        if r["task"]["task_type"] == "refund_dispute":
            assert kinds[-1] == "escalate"


# --------------------------------------------------------------------------- errors and CLI

def test_bad_arguments_are_input_errors():
    with pytest.raises(InputError, match="unknown domain"):
        datasets.generate("crypto", 10, 1)
    with pytest.raises(InputError, match="positive integer"):
        datasets.generate("finance", 0, 1)


def test_cli_generate_prints_one_json_summary(tmp_path, capsys):
    out = tmp_path / "sub" / "fin.jsonl"
    assert rwb(["datasets", "generate", "--domain", "finance", "--episodes", "40", "--seed", "5",
                "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert list(summary) == ["domain", "seed", "episodes", "steps", "tool_calls", "tool_errors", "tools", "behaviours",
                             "task_types", "twins", "outcome_by_behaviour", "seconds", "out", "bytes", "sha256"]
    assert summary["episodes"] == 40 and summary["domain"] == "finance" and summary["out"] == str(out)
    assert set(summary["outcome_by_behaviour"]) == {"expert", "noisy", "hacker"}
    assert summary["steps"] == sum(len(json.loads(x)["steps"]) for x in out.read_text().splitlines()[1:])
    assert summary["sha256"] == datasets.generate_file("finance", 40, 5, tmp_path / "again.jsonl").sha256

    assert rwb(["datasets", "generate", "--domain", "ecommerce", "-n", "12", "--out", str(tmp_path / "e.jsonl")]) == 0
    assert "Wrote 12 ecommerce episodes" in capsys.readouterr().out

    assert rwb(["datasets", "generate", "--domain", "crypto", "--out", str(tmp_path / "x.jsonl")]) == 2
    assert "unknown domain" in capsys.readouterr().err
    assert not (tmp_path / "x.jsonl").exists()
    assert rwb(["datasets", "generate", "--domain", "finance", "--episodes", "0", "--out", str(out)]) == 2
    assert "positive integer" in capsys.readouterr().err
    assert rwb(["datasets", "generate", "--domain", "finance", "--out", str(tmp_path)]) == 2  # a folder
    assert "cannot write" in capsys.readouterr().err
    assert not list(tmp_path.glob(".*.tmp"))


def test_cli_list_shows_workspace_datasets(tmp_path, capsys):
    from core.records.store import Workspace

    ws = Workspace.open(tmp_path / "ws")
    episodes = datasets.generate("finance", 5, 1).episodes
    with ws.transaction() as conn:
        ws.ensure_dataset(conn, "fin-small", "finance")
        ws.insert_episodes(conn, "fin-small", episodes)
    ws.close()
    assert rwb(["--workspace", str(tmp_path / "ws"), "datasets", "list", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert [(d["name"], d["domain"], d["episodes"]) for d in listing["datasets"]] == [("fin-small", "finance", 5)]
    assert {s["domain"] for s in listing["samples"]} == {"finance", "ecommerce"}
    assert rwb(["--workspace", str(tmp_path / "ws"), "datasets", "list"]) == 0
    assert "fin-small" in capsys.readouterr().out


@pytest.mark.parametrize("domain,good", [("finance", ("expert",)), ("ecommerce", ("resolve", "escalate", "upsell"))])
def test_good_behaviours_pass_the_shipped_masks(domain, good):
    """The committed mask rules (datasets/<domain>/masks.yaml) never block a logged step of
    the well-behaved policies, and do block some of the others (what training must avoid)."""
    from core.records.catalog import build_catalog
    from core.guard.masking import load_masks, logged_mask_report

    ds = datasets.generate(domain, 400, seed=31)
    catalog = build_catalog(ds.tools, ds.episodes)
    report = logged_mask_report(load_masks(datasets.datasets_dir() / domain / "masks.yaml", catalog), ds.episodes)
    for behaviour, row in report.by_behaviour.items():
        if behaviour in good:
            assert row.blocked == 0, (behaviour, report)
    assert report.blocked > 0


def test_behaviours_keeps_only_the_named_ones(tmp_path):
    full = datasets.generate_file("finance", 40, 5, tmp_path / "all.jsonl")
    part = datasets.generate_file("finance", 40, 5, tmp_path / "part.jsonl", behaviours=["noisy", "hacker"])
    assert set(part.behaviours) == {"noisy", "hacker"}
    assert part.behaviours == {b: n for b, n in full.behaviours.items() if b != "expert"}
    # the kept episodes are byte-identical to the same episodes of the full file
    lines = lambda p: (tmp_path / p).read_text().splitlines()[1:]  # noqa: E731
    kept = [line for line in lines("all.jsonl") if json.loads(line)["behaviour"] != "expert"]
    assert lines("part.jsonl") == kept
    with pytest.raises(InputError, match="unknown finance behaviours pro: choose among expert, noisy, hacker"):
        datasets.generate_file("finance", 5, 5, tmp_path / "x.jsonl", behaviours=["pro"])
    assert not (tmp_path / "x.jsonl").exists()
    same = datasets.generate_file("finance", 40, 5, tmp_path / "same.jsonl", behaviours="noisy, hacker")
    assert (tmp_path / "same.jsonl").read_bytes() == (tmp_path / "part.jsonl").read_bytes()
    assert same.behaviours == part.behaviours
    assert rwb(["datasets", "generate", "--domain", "finance", "-n", "40", "--seed", "5", "--behaviours",
                "noisy,hacker", "--out", str(tmp_path / "cli.jsonl"), "--json"]) == 0
    assert (tmp_path / "cli.jsonl").read_bytes() == (tmp_path / "part.jsonl").read_bytes()
