"""Shipped reward templates: validation, golden tables, `rwb reward` commands, the finance
hacking probes, the generic template on real ToolBench logs, and the embedding cache.

One module-scoped workspace holds the embedding cache, so every text is embedded once for
the whole module (the sentence model is the slow part).  Regenerate the golden tables after
an intended change with ``RWB_REGEN_GOLDEN=1 pytest tests/test_rewards_templates.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from core import rewards
from core.cli import main
from core.data.datasets import generate, write_jsonl
from core.base.embed import workspace_embedder
from core.base.errors import InputError
from core.records.episodes import Action, Episode, Step, Task
from core.data.importers import import_file, read_file
from core.rewards.expectations import auc
from core.records.store import Workspace

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden"
TOOLBENCH = [ROOT / "datasets" / "real" / "toolbench", ROOT / "datasets" / "real" / "toolbench_eval"]

#: template -> (domain, episodes, seed) of the fixed generated dataset it is scored on
GOLDEN_DATA = {
    "finance_risk": ("finance", 16, 11),
    "ecommerce_returns": ("ecommerce", 12, 12),
    "tool_agent": ("ecommerce", 12, 12),
}


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    return Workspace.open(tmp_path_factory.mktemp("rwb-rewards"))


@pytest.fixture(scope="module")
def finance_file(tmp_path_factory) -> Path:
    domain, n, seed = GOLDEN_DATA["finance_risk"]
    return write_jsonl(generate(domain, n, seed=seed), tmp_path_factory.mktemp("data") / "fin.jsonl")


def _frame(domain: str, n: int, seed: int):
    ds = generate(domain, n, seed=seed)
    return rewards.frame_from_episodes(ds.episodes, ds.tools)


# --------------------------------------------------------------------------- shipped templates
def test_shipped_templates_validate_and_round_trip(capsys):
    names = {t["name"] for t in rewards.list_templates()}
    assert names == {"finance_risk", "ecommerce_returns", "tool_agent", "tool_agent_criteria"}
    for name in sorted(names):
        assert main(["reward", "validate", name, "--json"]) == 0
        info = json.loads(capsys.readouterr().out)
        assert info["ok"] and info["name"] == name and info["version"] == 1
        assert list(info) == ["ok", "name", "version", "source", "gating", "return", "levels", "penalties",
                              "episode_terms", "schedules", "expectations"]
        assert list(info["return"]) == ["a", "b", "gamma"]
        assert list(info["levels"][0]) == ["key", "title", "gate", "components"]
        t = rewards.load_template(name)
        assert rewards.parse_template(t.to_yaml()) == t
        assert main(["reward", "validate", str(rewards.templates_dir() / f"{name}.yaml")]) == 0
        assert capsys.readouterr().out.startswith(f"ok: template '{name}'")


def test_validate_reports_key_and_line(tmp_path, capsys):
    text = (rewards.templates_dir() / "finance_risk.yaml").read_text()
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace("      tool_validity:\n", "      tool_valdity:\n", 1))
    line = next(i for i, s in enumerate(bad.read_text().splitlines(), 1) if "tool_valdity" in s)
    assert main(["reward", "validate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"unknown component 'tool_valdity' at line {line}" in err and "known: tool_validity" in err
    assert main(["reward", "validate", "no_such_template"]) == 2
    assert "known: ecommerce_returns, finance_risk, tool_agent" in capsys.readouterr().err


def test_tool_agent_uses_no_outcome_and_no_domain_knowledge():
    t = rewards.load_template("tool_agent")
    outcome_based = {"business_impact", "resolved_bonus", "sentiment_bonus", "terminal_outcome"}
    assert not {c.component for c in t.all_components} & outcome_based
    text = (rewards.templates_dir() / "tool_agent.yaml").read_text()
    for domain_word in ("verified", "order", "buy", "sell", "stock"):
        assert domain_word not in text.split("expectations:")[0].lower().replace("ordered", "")


# --------------------------------------------------------------------------- golden tables
def _table(result: rewards.ScoreResult) -> pd.DataFrame:
    table = result.steps_table()
    table["episode_return"] = result.returns[result.frame.episode]
    return table


@pytest.mark.parametrize("name", sorted(GOLDEN_DATA))
def test_golden_table(name, ws):
    result = rewards.score(ws, name, frame=_frame(*GOLDEN_DATA[name]))
    table = _table(result)
    path = GOLDEN / f"rewards_{name}.csv"
    if os.environ.get("RWB_REGEN_GOLDEN"):
        path.parent.mkdir(exist_ok=True)
        table.to_csv(path, index=False, float_format="%.9g")
    expected = pd.read_csv(path, keep_default_na=False)
    assert list(table.columns) == list(expected.columns)
    assert table["episode_id"].tolist() == expected["episode_id"].tolist()
    assert table["action"].tolist() == expected["action"].tolist()
    for col in table.columns[3:]:
        # sentence embeddings may differ in the last float bits between CPU kernels
        np.testing.assert_allclose(table[col].to_numpy(float), expected[col].to_numpy(float),
                                   rtol=0, atol=2e-5,
                                   err_msg=f"{name}: column {col} (after an intended change to the "
                                           f"template, components or generator: RWB_REGEN_GOLDEN=1)")


# --------------------------------------------------------------------------- rwb reward check / score
def test_finance_hacks_rank_below_their_twins_via_cli(ws, finance_file, capsys):
    code = main(["--workspace", str(ws.root), "reward", "check", "--template", "finance_risk",
                 "--episodes", str(finance_file), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["passed"], report
    by = {r["name"]: r for r in report["results"]}
    twins = by["hacks rank below their honest twins"]
    n_hackers = sum(e.behaviour == "hacker" for e in read_file(finance_file).episodes)
    assert twins["passed"] and twins["details"]["pairs"] == n_hackers >= 3
    assert twins["details"]["min_gap"] > 0
    # the plain-text report names every expectation
    assert main(["--workspace", str(ws.root), "reward", "check", "--template", "finance_risk",
                 "--episodes", str(finance_file)]) == 0
    out = capsys.readouterr().out
    assert "PASS  hacks rank below their honest twins: all" in out and "expectations pass" in out


def test_check_exits_1_when_an_expectation_fails(ws, finance_file, tmp_path, capsys):
    text = (rewards.templates_dir() / "finance_risk.yaml").read_text()
    strict = tmp_path / "strict.yaml"
    strict.write_text(text + "  - {name: hacks below -100, kind: episode_score, "
                             "episodes: {behaviour: hacker}, below: -100}\n")
    code = main(["--workspace", str(ws.root), "reward", "check", "--template", str(strict),
                 "--episodes", str(finance_file)])
    captured = capsys.readouterr()
    assert code == 1
    assert "FAIL  hacks below -100:" in captured.out and "not return < -100" in captured.out
    assert "1 of 6 expectations failed: hacks below -100" in captured.err


def test_score_command_outputs(ws, finance_file, tmp_path, capsys):
    out_file = tmp_path / "steps.parquet"
    assert main(["--workspace", str(ws.root), "reward", "score", "--template", "finance_risk",
                 "--episodes", str(finance_file), "--out", str(out_file), "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    eps = read_file(finance_file).episodes
    assert set(body["episode_returns"]) == {e.episode_id for e in eps}
    for stats in body["components"].values():
        assert set(stats) >= {"mean", "std", "min", "max", "weight", "level"}
    assert list(body) == ["template", "n_episodes", "n_steps", "components", "levels", "penalties", "step_reward",
                          "returns", "return_formula", "episode_returns", "out"]
    assert list(body["components"]["tool_validity"]) == ["level", "component", "weight", "mean", "std", "min", "max"]
    assert list(body["levels"]["L1"]) == ["title", "gate", "pass_rate", "mean", "std", "min", "max"]
    assert list(body["returns"]) == ["mean", "std", "min", "max"]
    table = pd.read_parquet(out_file)
    assert len(table) == sum(len(e.steps) for e in eps)
    assert {"tool_validity", "evidence_reliability", "L1", "L3", "total", "episode_return"} <= set(table.columns)
    # the same data imported as a dataset scores the same
    import_file(ws, finance_file, dataset="fin-golden")
    csv = tmp_path / "steps.csv"
    assert main(["--workspace", str(ws.root), "reward", "score", "--template", "finance_risk",
                 "--dataset", "fin-golden", "--out", str(csv), "--json"]) == 0
    by_dataset = json.loads(capsys.readouterr().out)["episode_returns"]
    assert by_dataset == pytest.approx(body["episode_returns"])
    assert len(pd.read_csv(csv)) == len(table)
    # plain output: one line per component
    assert main(["--workspace", str(ws.root), "reward", "score", "--template", "finance_risk",
                 "--dataset", "fin-golden"]) == 0
    assert "evidence_reliability" in capsys.readouterr().out


def test_score_command_errors(ws, finance_file, capsys):
    assert main(["--workspace", str(ws.root), "reward", "score", "--template", "finance_risk"]) == 2
    assert "give exactly one of a dataset" in capsys.readouterr().err
    assert main(["--workspace", str(ws.root), "reward", "score", "--template", "finance_risk",
                 "--episodes", str(finance_file), "--out", "x.xlsx"]) == 2
    assert ".csv or .parquet" in capsys.readouterr().err


# --------------------------------------------------------------------------- generic template, real logs
def toolbench_withheld() -> tuple[list, list, np.ndarray]:
    """The 13 importable ToolBench runs with their outcome removed, and the win labels."""
    episodes, tools, wins = [], {}, []
    for folder in TOOLBENCH:
        for path in sorted(folder.glob("G*_answer/*.json")):
            try:
                parsed = read_file(path)
            except InputError:  # the two runs without a trajectory
                continue
            for ep in parsed.episodes:
                wins.append(bool(ep.outcome.resolved))
                episodes.append(ep.model_copy(update={
                    "episode_id": f"{path.parent.name[:2]}/{ep.episode_id}",
                    "outcome": type(ep.outcome)()}))  # outcome withheld
            tools.update({t.name: t for t in parsed.tools})
    return episodes, list(tools.values()), np.array(wins)


def test_tool_agent_ranks_successful_toolbench_runs_first(ws):
    episodes, tools, wins = toolbench_withheld()
    assert len(episodes) == 13 and wins.sum() == 9
    assert all(e.outcome.resolved is None for e in episodes)
    result = rewards.score(ws, "tool_agent", frame=rewards.frame_from_episodes(episodes, tools))
    value = auc(result.returns[wins], result.returns[~wins])
    assert value >= 0.60, f"tool_agent AUC on ToolBench is {value:.3f}"


# --------------------------------------------------------------------------- sentence model & embedding cache
def test_output_consistency_with_the_real_model(ws):
    data = {"symbol": "600519", "revenue_growth_pct": 12.5, "net_profit_bn": 21.3}
    def ep(eid, answer):
        return Episode(episode_id=eid, task=Task(query="q"), steps=[
            Step(t=0, action=Action(kind="tool_call", tool="get_report", params={"symbol": "600519"}),
                 tool_result=data),
            Step(t=1, action=Action(kind="final_answer"), output_text=answer)])
    frame = rewards.frame_from_episodes([
        ep("faithful", "symbol: 600519; revenue growth pct: 12.5; net profit bn: 21.3"),
        ep("unrelated", "The weather in Paris will be sunny with light winds tomorrow.")])
    ctx = rewards.ScoringContext(embedder=workspace_embedder(ws))
    v = rewards.COMPONENTS["output_consistency"]()(frame, ctx)
    assert v.tolist() == [0.0, 0.6, 0.0, 0.0]


def test_second_scoring_embeds_nothing(ws):
    frame = _frame(*GOLDEN_DATA["ecommerce_returns"])
    rewards.score(ws, "ecommerce_returns", frame=frame, use_cache=False)  # warm (or already warm)
    again = rewards.score(ws, "ecommerce_returns", frame=frame, use_cache=False)
    assert "output_consistency" in again.matrix.computed
    assert again.matrix.embed_stats["encoded"] == 0
    cached = rewards.score(ws, "ecommerce_returns", frame=frame)  # component cache: nothing computed
    assert cached.matrix.computed == [] and cached.returns == pytest.approx(again.returns)
