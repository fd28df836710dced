"""A run's catalog is its contract: ``rwb evaluate RUN --episodes FILE | --dataset NAME``
maps other logs of the same domain onto the run's action catalog (never a catalog of their
own) and reports the calls it cannot express (``catalog_coverage``), checked against a
direct count with the run's normalizer — on generated finance data and on real tau2 runs."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from _real_logs import REAL, rwb_import_labelled
from _state_fixtures import HashEmbedder
from core.rl import runs
from core.records.catalog import (
    OFF_CATALOG_KINDS,
    Catalog,
    PresetDim,
    build_catalog,
    catalog_coverage,
    catalog_for_dataset,
)
from core.cli import main
from core.data.datasets import generate_file
from core.records.episodes import Action, Episode, Step, ToolSchema
from core.data.importers import import_file, read_file
from core.records.store import Workspace
from core.access.users import LOCAL_ADMIN


def tiny():
    from core.rl.ppo import PPOConfig

    return PPOConfig(total_steps=512, n_envs=16, rollout_len=16, update_epochs=1, n_minibatches=2, bc_epochs=1,
                     hidden=32, n_critics=2, encoder={"dim": 32}, device="cpu", threads=1, eval_every=1,
                     eval_episodes=16, checkpoint_every=1)


def evaluate_json(capsys: pytest.CaptureFixture, ws: Path, *args: str) -> dict:
    capsys.readouterr()
    assert main(["--workspace", str(ws), "evaluate", *args, "--repeats", "1", "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1, out
    return json.loads(out[0])


def direct_count(episodes: list[Episode], catalog: Catalog) -> dict:
    """The slow obvious reference: every step through ``Catalog.normalize`` one by one."""
    steps = calls = off = unknown = 0
    per_tool: Counter = Counter()
    for ep in episodes:
        for s in ep.steps:
            steps += 1
            calls += s.action.kind == "tool_call"
            if catalog.normalize(s.action).token_id < 0:
                off += 1
                unknown += s.action.tool not in catalog.tools
                per_tool[s.action.tool] += 1
    return {"steps": steps, "tool_calls": calls, "off_catalog": off, "unknown_tool": unknown, "per_tool": per_tool}


def assert_matches(cov: dict, ref: dict, n_episodes: int) -> None:
    assert cov["episodes"] == n_episodes
    for key in ("steps", "tool_calls", "off_catalog"):
        assert cov[key] == ref[key], key
    assert cov["by_kind"]["unknown_tool"] == ref["unknown_tool"]
    assert sum(cov["by_kind"].values()) == ref["off_catalog"]
    assert cov["share_of_steps"] == pytest.approx(ref["off_catalog"] / ref["steps"])
    assert cov["share_of_tool_calls"] == pytest.approx(ref["off_catalog"] / ref["tool_calls"])
    by_tool: Counter = Counter()
    for row in cov["top"]:
        by_tool[row["tool"]] += row["count"]
    for tool, n in by_tool.items():  # the listed pairs add up per tool (the list may be cut)
        assert n <= ref["per_tool"][tool]
    if len(cov["top"]) < 10:
        assert by_tool == ref["per_tool"]
    assert cov["own_invalid"] + cov["foreign_valid"] == ref["off_catalog"]


# --------------------------------------------------------------------------- known answers
def _episode(episode_id: str, actions: list[Action]) -> Episode:
    return Episode(episode_id=episode_id, steps=[Step(t=t, action=a) for t, a in enumerate(actions)])


def _call(tool: str, **params) -> Action:
    return Action(kind="tool_call", tool=tool, params=params)


def test_catalog_coverage_known_answer() -> None:
    """One call of each kind, against a hand-built catalog; the own catalog knows ``quote``."""
    trade = ToolSchema(name="trade", parameters={
        "type": "object", "properties": {"side": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
        "required": ["side"]})
    quote = ToolSchema(name="quote", parameters={"type": "object", "properties": {}})
    run_catalog = Catalog([trade], {"trade": [PresetDim("side", "values", "declared", values=("buy", "sell"))]})
    actions = [_call("trade", side="buy"), _call("trade", side="hold"), _call("trade", side="sell", qty=0),
               _call("quote"), _call("quote"), _call("teleport"), Action(kind="reply")]
    episodes = [_episode("e1", actions[:4]), _episode("e2", actions[4:])]
    own = build_catalog([trade, quote], episodes)
    cov = catalog_coverage(episodes, run_catalog, own_catalog=own)
    assert (cov.steps, cov.tool_calls, cov.off_catalog, cov.episodes) == (7, 6, 5, 2)
    assert cov.by_kind == {"unknown_tool": 3, "outside_presets": 1, "invalid_arguments": 1}
    assert list(cov.by_kind) == list(OFF_CATALOG_KINDS)
    # qty=0 breaks the schema and teleport exists nowhere: the log's own invalid calls; "hold"
    # is a valid string the run has no preset for, and quote a tool the run does not have.
    assert (cov.own_invalid, cov.foreign_valid) == (2, 3)
    assert [(t.tool, t.kind, t.count, t.own_invalid) for t in cov.top] == [
        ("quote", "unknown_tool", 2, 0), ("teleport", "unknown_tool", 1, 1),
        ("trade", "invalid_arguments", 1, 1), ("trade", "outside_presets", 1, 0)]
    assert cov.share_of_steps == pytest.approx(5 / 7) and cov.share_of_tool_calls == pytest.approx(5 / 6)
    assert catalog_coverage(episodes, run_catalog).own_invalid is None
    assert len(catalog_coverage(episodes, run_catalog, top=1).top) == 1


def test_sim_tables_on_a_given_catalog_use_it_as_is() -> None:
    """``build_sim_tables_from(..., catalog=)`` keeps the catalog and marks what it cannot express INVALID."""
    from core.data.datasets import generate
    from core.rl.sim import build_sim_tables_from

    first = generate("finance", 12, seed=3)
    second = generate("finance", 12, seed=4)
    eps_a = [Episode.model_validate(r) for r in first.records]
    eps_b = [Episode.model_validate(r) for r in second.records]
    cat = build_catalog(first.tools, eps_a)
    tables = build_sim_tables_from(eps_b, None, "finance_risk", catalog=cat, embedder=HashEmbedder())
    assert tables.catalog is cat and tables.n_actions == len(cat.tokens)
    want = [cat.normalize(s.action).token_id for ep in eps_b for s in ep.steps]
    assert tables.token.tolist() == want


# --------------------------------------------------------------------------- generated data
@pytest.fixture(scope="module")
def finance_ws(tmp_path_factory):
    """Two generated finance files of different seeds (datasets ``a`` and ``b``) and a tiny run on ``a``."""
    mp = pytest.MonkeyPatch()
    mp.setattr("core.base.embed.workspace_embedder", lambda _ws: HashEmbedder())
    root = tmp_path_factory.mktemp("evaluate-catalog")
    generate_file("finance", 60, seed=11, out=root / "a.jsonl")
    generate_file("finance", 40, seed=12, out=root / "b.jsonl")
    ws = Workspace.open(root / "ws")
    import_file(ws, root / "a.jsonl", dataset="a")
    import_file(ws, root / "b.jsonl", dataset="b")
    run_id = runs.train(ws, LOCAL_ADMIN, template="finance_risk", dataset="a", config=tiny()).run_id
    run_catalog = catalog_for_dataset(ws, "a")
    ws.close()
    yield root, run_id, run_catalog
    mp.undo()


def test_evaluate_other_file_and_dataset_on_the_runs_catalog(finance_ws, capsys, monkeypatch) -> None:
    monkeypatch.setattr("core.base.embed.workspace_embedder", lambda _ws: HashEmbedder())
    root, run_id, run_catalog = finance_ws
    other = read_file(root / "b.jsonl").episodes
    assert build_catalog(read_file(root / "b.jsonl").tools, other).version != run_catalog.version
    ref = direct_count(other, run_catalog)
    assert ref["off_catalog"] > 0  # the generator logs odd calls: some are off any catalog
    by_file = evaluate_json(capsys, root / "ws", run_id, "--episodes", str(root / "b.jsonl"))
    by_dataset = evaluate_json(capsys, root / "ws", run_id, "--dataset", "b")
    for report in (by_file, by_dataset):
        assert report["catalog_version"] == run_catalog.version
        assert report["catalog_coverage"]["catalog_version"] == run_catalog.version
        assert report["episodes"] == len(other)  # all of them are the evaluation set
        assert report["policy"]["episodes"] == len(other)
        assert_matches(report["catalog_coverage"], ref, len(other))
    assert by_file["catalog_coverage"] == by_dataset["catalog_coverage"]
    assert by_file["source"] == f"file {root / 'b.jsonl'}" and by_dataset["source"] == "dataset b"

    for report in (by_file, by_dataset):
        assert set(report["ope"]) >= {"method", "policy_success", "logged_success", "policy_success_ci90",
                                      "policy_return", "logged_return", "support", "reliable", "note"}

    # The human output says it in one line.
    capsys.readouterr()
    assert main(["--workspace", str(root / "ws"), "evaluate", run_id, "--dataset", "b", "--repeats", "1"]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if "off-catalog" in x]
    share = ref["off_catalog"] / ref["tool_calls"]
    assert len(lines) == 1 and f"{ref['off_catalog']} of {ref['tool_calls']} tool calls" in lines[0]
    assert f"{share:.1%}" in lines[0] and run_catalog.version in lines[0]


def test_both_sources_is_a_usage_error(finance_ws, capsys) -> None:
    root, run_id, _ = finance_ws
    capsys.readouterr()
    code = main(["--workspace", str(root / "ws"), "evaluate", run_id, "--episodes", str(root / "b.jsonl"),
                 "--dataset", "b"])
    err = capsys.readouterr().err
    assert code != 0 and "not both" in err and "Traceback" not in err
    code = main(["--workspace", str(root / "ws"), "evaluate", run_id, "--dataset", "b", "--reward-key", "outcome"])
    err = capsys.readouterr().err
    assert code != 0 and "--episodes FILE" in err and "Traceback" not in err


# --------------------------------------------------------------------------- real data
def test_real_run_evaluated_on_another_agents_logs(tmp_path, capsys, monkeypatch) -> None:
    """A run on the Whissle agent's 50 airline runs, evaluated on the 586 Grok runs (airline and
    telecom): the telecom tools are not in the run's catalog, and the report counts them."""
    monkeypatch.setattr("core.base.embed.workspace_embedder", lambda _ws: HashEmbedder())
    ws_path = tmp_path / "ws"
    rwb_import_labelled(str(ws_path), "tau2_whissle", "whissle")
    ws = Workspace.open(ws_path)
    run_id = runs.train(ws, LOCAL_ADMIN, template="tool_agent", dataset="whissle", config=tiny()).run_id
    run_catalog = catalog_for_dataset(ws, "whissle")
    ws.close()
    grok = REAL / "tau2_grok" / "episodes.jsonl"
    report = evaluate_json(capsys, ws_path, run_id, "--episodes", str(grok), "--reward-key", "outcome",
                           "--id-key", "id")
    other = read_file(grok, reward_key="outcome", id_key="id").episodes
    ref = direct_count(other, run_catalog)
    cov = report["catalog_coverage"]
    assert report["catalog_version"] == run_catalog.version and report["episodes"] == len(other)
    assert_matches(cov, ref, len(other))
    assert cov["share_of_tool_calls"] > 0 and cov["by_kind"]["unknown_tool"] > 0
    telecom = {s.action.tool for ep in other if ep.domain.startswith("telecom") for s in ep.steps
               if s.action.kind == "tool_call"} - set(run_catalog.tools)
    assert telecom and {row["tool"] for row in cov["top"]} & telecom
    # the off-policy estimate on the logged Grok runs: every key, intervals over the real tasks,
    # the logged figures are the logs' own, and a policy trained this briefly is not trusted
    ope = report["ope"]
    keys = {"method", "policy_success", "logged_success", "policy_success_ci90", "policy_return",
            "logged_return", "support", "reliable", "note", "effective_sample_size", "tasks"}
    assert keys <= set(ope)
    assert "importance sampling" in ope["method"] or "WIS" in ope["method"]
    outcomes = np.array([float(ep.outcome.final_reward) for ep in other])
    assert ope["logged_success"] == pytest.approx(outcomes.mean())
    assert ope["tasks"] == len({(ep.domain, ep.source.raw["task_id"]) for ep in other})
    low, high = ope["policy_success_ci90"]
    assert 0.0 <= low <= ope["policy_success"] <= high <= 1.0
    assert 0.0 <= ope["support"] <= 1.0
    assert ope["reliable"] is False and ope["note"]
