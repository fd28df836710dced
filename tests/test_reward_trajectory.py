"""The trajectory scorer (core.rewards.trajectory): parity with ``rwb reward score --each`` on
every dataset shipped in the repository, the decomposition into components and levels, task
criteria, pinned templates, unreadable calls, and errors that name the field."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.base.errors import InputError
from core.cli import main
from core.data.importers import read_file
from core.records.store import Workspace
from core.rewards.criteria import episodes_criteria
from core.rewards.trajectory import (INVALID_CALL_TOOL, TrajectoryScorer, episode_messages, pin_template,
                                     score_trajectory, trajectory_episode)
from tests._real_logs import REAL, rwb_import_labelled

ROOT = Path(__file__).resolve().parents[1]
DATASETS = ROOT / "datasets"

#: Every episode file shipped in datasets/, with the templates it is checked under (the
#: generated domains also under their own template, whose outcome terms read ``outcome``).
PARITY_FILES: dict[str, tuple[str, ...]] = {
    "finance/sample.jsonl": ("tool_agent", "finance_risk"),
    "ecommerce/sample.jsonl": ("tool_agent", "ecommerce_returns"),
    "real/agentdojo/episodes.jsonl": ("tool_agent",),
    "real/tau2_grok/episodes.jsonl": ("tool_agent",),
    "real/tau2_whissle/episodes.jsonl": ("tool_agent",),
    "real/tau2/retail/tasks.json": ("tool_agent",),
    "real/tau2/airline/tasks.json": ("tool_agent",),
    "real/bfcl/BFCL_v4_multi_turn_base.json": ("tool_agent",),
    **{str(p.relative_to(DATASETS)): ("tool_agent",)
       for folder in ("real/toolbench", "real/toolbench_eval") for p in sorted((DATASETS / folder).glob("G*/*.json"))},
}
#: ToolBench answer files that keep no trajectory (valid_data=False): nothing to score, and both
#: the importer and ``rwb reward score`` say so.
NO_TRAJECTORY = ("real/toolbench/G1_answer/69_ChatGPT_DFS_woFilter_w2.json",
                 "real/toolbench_eval/G3_answer/8_ChatGPT_DFS_woFilter_w2.json")
for _name in NO_TRAJECTORY:
    PARITY_FILES[_name] = ()


def test_parity_files_cover_every_shipped_dataset():
    """A dataset added to datasets/ without a parity check fails here."""
    folders = {p.parent for p in DATASETS.rglob("*.json*") if "embeddings" not in p.parts}
    covered = {(DATASETS / f).parent for f in PARITY_FILES}
    side_files = {DATASETS / "real" / "tau2", DATASETS / "real" / "bfcl" / "multi_turn_func_doc",
                  DATASETS / "real" / "bfcl" / "possible_answer", DATASETS / "finance", DATASETS / "ecommerce"}
    assert folders - covered - side_files == set()
    assert all((DATASETS / f).is_file() for f in PARITY_FILES)


@contextlib.contextmanager
def _workspace(path: Path) -> Iterator[Workspace]:
    ws = Workspace.open(path)
    try:
        yield ws
    finally:
        ws.close()


def _cli_returns(ws_dir: Path, capsys, *args: str) -> dict[str, float]:
    capsys.readouterr()
    assert main(["--workspace", str(ws_dir), "reward", "score", "--each", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)["episode_returns"]


def _trajectories(path: Path) -> tuple[list[str], list[dict]]:
    parsed = read_file(path)
    tools = [t.model_dump() for t in parsed.tools]
    ids = [ep.episode_id for ep in parsed.episodes]
    return ids, [{"messages": episode_messages(ep), "tools": tools, "id": ep.episode_id,
                  "outcome": ep.outcome.model_dump(exclude={"extra"})} for ep in parsed.episodes]


def _assert_decomposes(s) -> None:
    applied = sum(s.weights[k] * v for k, v in s.components.items() if v is not None)
    assert applied + s.constant == pytest.approx(s.score, abs=1e-9)
    assert sum(s.levels.values()) == pytest.approx(s.score, abs=1e-9)


@pytest.mark.parametrize("name", sorted(PARITY_FILES))
def test_score_trajectory_equals_rwb_reward_score(name, tmp_path, capsys):
    """Each episode, given to the scorer as chat messages (with the file's tools and its
    outcome), scores exactly what ``rwb reward score --each`` gives it from the file."""
    path = DATASETS / name
    if name in NO_TRAJECTORY:
        with pytest.raises(InputError, match="nothing to import"):
            read_file(path)
        assert main(["--workspace", str(tmp_path / "ws"), "reward", "score", "--each", "-t", "tool_agent",
                     "--episodes", str(path)]) == 2
        return
    ids, trajectories = _trajectories(path)
    assert trajectories, f"{name} holds no episode"
    ws_dir = tmp_path / "ws"
    for template in PARITY_FILES[name]:
        expected = _cli_returns(ws_dir, capsys, "--template", template, "--episodes", str(path))
        with _workspace(ws_dir) as ws:  # the workspace's embedding cache: each text embedded once
            scores = TrajectoryScorer(template, ws=ws).score_batch(trajectories)
        assert [s.id for s in scores] == ids
        for episode_id, s in zip(ids, scores):
            assert s.score == pytest.approx(expected[episode_id], abs=1e-9), (template, episode_id)
            _assert_decomposes(s)


def test_task_criteria_match_the_dataset_criteria(tmp_path, capsys):
    """With the task's criteria given per trajectory, the criteria template scores what
    ``rwb reward score --dataset --each`` gives the dataset whose criteria were imported."""
    ws_dir = tmp_path / "ws"
    rwb_import_labelled(str(ws_dir), "tau2_whissle", "whissle")
    assert main(["--workspace", str(ws_dir), "tasks", "import", str(REAL / "tau2" / "airline" / "tasks.json"),
                 "--dataset", "whissle", "--json"]) == 0
    expected = _cli_returns(ws_dir, capsys, "--template", "tool_agent_criteria", "--dataset", "whissle")
    with _workspace(ws_dir) as ws:
        episodes = ws.load_episodes("whissle")
        crit = episodes_criteria(ws, "whissle", episodes)
        assert crit is not None and len(crit.by_episode) > len(episodes) // 2
        tools = [t.model_dump() for t in ws.tools("whissle")]
        trajectories = []
        for ep in episodes:
            c = crit.by_episode.get(ep.episode_id)
            task = None if c is None else {"expected_calls": c["expected_calls"], "communicate": c["communicate"]}
            trajectories.append({"messages": episode_messages(ep), "tools": tools, "task": task,
                                 "id": ep.episode_id})
        scores = TrajectoryScorer("tool_agent_criteria", ws=ws).score_batch(trajectories)
    for ep, s in zip(episodes, scores):
        assert s.score == pytest.approx(expected[ep.episode_id], abs=1e-9)
        _assert_decomposes(s)
        has = ep.episode_id in crit.by_episode
        assert (s.components["expected_calls"] is not None) == has
        assert (s.constant != 0.0) == (not has)   # the neutral criteria terms of a task without criteria


def _call(name: str, args, call_id: str = "c1") -> dict:
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}]}


WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                              "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                             "required": ["city"]}}}]


def test_a_trajectory_is_scored_on_its_own():
    """A trajectory's score does not depend on the batch it comes in: alone, first, or last."""
    a = [{"role": "user", "content": "Weather in Paris?"}, _call("get_weather", {"city": "Paris"}),
         {"role": "tool", "tool_call_id": "c1", "content": "Paris: 21 C and sunny"},
         {"role": "assistant", "content": "It is 21 C and sunny in Paris."}]
    b = [{"role": "user", "content": "Weather in Rome?"}, _call("get_weather", '{"city": "Rome"}'),
         {"role": "tool", "tool_call_id": "c1", "content": "Error: service down"},
         {"role": "assistant", "content": "I could not get it."}]
    scorer = TrajectoryScorer()
    alone = scorer.score(a, tools=WEATHER)
    together = scorer.score_batch([{"messages": b, "tools": WEATHER}, {"messages": a, "tools": WEATHER}] * 3)
    assert together[1].score == pytest.approx(alone.score, abs=1e-12)
    assert together[5].components == pytest.approx(alone.components)
    assert together[0].score < alone.score   # a failed call left unrecovered
    assert alone.template == "tool_agent@0" and len(alone.template_sha256) == 64
    assert [s.kind for s in alone.steps] == ["tool_call", "final_answer"] and alone.steps[0].valid
    _assert_decomposes(alone)


def test_unknown_tools_and_unreadable_calls_are_invalid_with_their_reason():
    msgs = [{"role": "user", "content": "hi"}, _call("send_rocket", {"to": "moon"}),
            _call(INVALID_CALL_TOOL, {"raw": "<tool_call>{oops", "error": "the JSON of the call does not parse"}, "c2"),
            {"role": "assistant", "content": "done"}]
    s = score_trajectory(msgs, tools=WEATHER)
    assert [st.valid for st in s.steps] == [False, False, True]
    assert "send_rocket" in s.steps[0].invalid_reason
    assert s.steps[1].invalid_reason == "unreadable tool call: the JSON of the call does not parse"
    # without a tools schema the catalog is inferred from the calls; an unreadable call stays invalid
    s2 = score_trajectory(msgs)
    assert s2.steps[0].valid and not s2.steps[1].valid


def test_pinned_templates(tmp_path):
    pinned = pin_template("tool_agent")
    assert pinned.label == "tool_agent@0"
    assert pin_template("tool_agent@0", sha256=pinned.sha256).sha256 == pinned.sha256
    with pytest.raises(InputError, match="changed since it was pinned"):
        pin_template("tool_agent", sha256="0" * 64)
    with pytest.raises(InputError, match="needs the workspace|names a workspace version"):
        pin_template("tool_agent@3")
    from core.access.users import current_user
    from core.rewards.versions import get_template, save_template

    with _workspace(tmp_path / "ws") as ws:
        seed = get_template(ws, "tool_agent", 0)
        saved = save_template(ws, current_user(ws), "tool_agent",
                              seed.yaml.replace("weight: 0.3", "weight: 0.5", 1), 0, "heavier validity")
        scorer = TrajectoryScorer("tool_agent@1", ws=ws, sha256=saved.sha256)
        assert scorer.label == "tool_agent@1" and scorer.weights_at()["tool_validity"] == 0.5
        assert TrajectoryScorer("tool_agent", ws=ws).label == "tool_agent@1"   # the latest saved version


@pytest.mark.parametrize("bad, field", [
    ([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}], "messages[0].tool_calls[0].function.name"),
    ([{"content": "no role"}], "messages[0].role"),
    ("not a list", "messages"),
    ([{"role": "assistant", "content": "x", "latency_ms": -1}], "messages[0].latency_ms"),
    ([{"role": "assistant", "content": "x", "rwb_kind": "dance"}], "messages[0].rwb_kind"),
])
def test_bad_messages_name_the_field(bad, field):
    with pytest.raises(InputError) as err:
        trajectory_episode(bad)
    assert err.value.field == field


def test_bad_batches_name_the_trajectory_and_field():
    scorer = TrajectoryScorer()
    with pytest.raises(InputError) as err:
        scorer.score_batch([{"messages": []}, {"messages": [], "tools": [{"function": {"parameters": []}}]}])
    assert err.value.field == "trajectories[1].tools[0]"
    with pytest.raises(InputError) as err:
        scorer.score_batch([{"messages": [], "task": {"expected_calls": [{"arguments": {}}]}}])
    assert "trajectories[0].task" in str(err.value)
    with pytest.raises(InputError) as err:
        scorer.score_batch([{"messages": [], "reward": 1}])
    assert err.value.field == "trajectories[0].reward"
    with pytest.raises(InputError, match="at most"):
        scorer.score([{"role": "user", "content": "x"}] * 2_001)


def test_schedules_reweight_at_a_training_step(tmp_path):
    text = (ROOT / "reward_templates" / "tool_agent.yaml").read_text()
    path = tmp_path / "scheduled.yaml"
    path.write_text(text.replace("name: tool_agent", "name: scheduled")
                    + "schedules:\n  step_cost: [[0, 0.0], [100, 1.0]]\n")
    scorer = TrajectoryScorer(path)
    msgs = [{"role": "user", "content": "Weather in Paris?"}, _call("get_weather", {"city": "Paris"}),
            {"role": "tool", "tool_call_id": "c1", "content": "Paris: 21 C"}, {"role": "assistant", "content": "21 C."}]
    early, late = scorer.score(msgs, step=0), scorer.score(msgs, step=100)
    assert early.weights["step_cost"] == 0.0 and late.weights["step_cost"] == 1.0
    assert late.score < early.score
    assert late.components["step_cost"] == pytest.approx(early.components["step_cost"])
    _assert_decomposes(early)
    _assert_decomposes(late)


@pytest.mark.parametrize("step", [-1, 2.5, "10", True])
def test_a_bad_training_step_is_refused_by_name(step):
    with pytest.raises(InputError) as err:
        TrajectoryScorer().score([{"role": "user", "content": "hi"}], step=step)
    assert err.value.field == "step"


def test_each_refuses_an_unknown_dataset_by_name(ws):
    from core.rewards import score

    with pytest.raises(InputError, match="no dataset named 'nope'") as err:
        score(ws, "tool_agent", dataset="nope", each=True)
    assert err.value.field == "dataset"
