"""``rwb demo`` (core.sample.demo.run_demo) runs the whole loop on small sizes, and its command.

The demo's report is checked against the workspace it leaves behind — the figures it
prints must be what is really there: users and roles, the imported episodes, a finished
run with no mask violation, decided review items, a tuned template version, a verified
bundle approved by someone other than its trainer and promoted into the workspace's own
policies folder (never the source tree), and one audit record per served decision.
"""

from __future__ import annotations

import io
import json
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pandas as pd
import pytest

from core.cli import main as rwb
from core.base.errors import InputError
from core.records.store import Workspace

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """``rwb demo --small --json`` on a fresh folder: the report (progress lines went to stderr)."""
    root = tmp_path_factory.mktemp("demo") / "ws"
    out, err = io.StringIO(), io.StringIO()
    t0 = time.perf_counter()
    with redirect_stdout(out), redirect_stderr(err):
        code = rwb(["demo", "--dir", str(root), "--small", "--json"])
    print(f"\nrwb demo --small: {time.perf_counter() - t0:.0f} s")
    assert code == 0, err.getvalue()[-3000:]
    report = json.loads(out.getvalue())
    ws = Workspace.open(root)
    yield ws, report, err.getvalue()
    ws.close()


def _step(report: dict, name: str) -> dict:
    return next(s for s in report["steps"] if s["name"] == name)


def test_every_step_ran_and_says_where_to_look(demo):
    _, report, log = demo
    assert [s["name"] for s in report["steps"]] == ["users", "episodes", "reward", "state_map", "training",
                                                    "review", "tuning", "bundle", "registry", "serving"]
    for step in report["steps"]:
        assert step["where"], step["name"]
        assert step["title"] in log and step["where"] in log
    assert report["app"] in log and "rwb --workspace" in report["app"]
    assert report["seconds"] > 0


def test_figures_match_the_workspace(demo):
    from core.access import audit
    from core.govern import registry
    from core.guard import review
    from core.rewards.versions import list_versions
    from core.rl.runs import get_run
    from core.access.users import list_users

    ws, report, _ = demo
    users = {u.name: u.role for u in list_users(ws, report_actor(ws, "ada"))}
    assert users == {"ada": "admin", "ana": "analyst", "rae": "reviewer", "bob": "approver"}

    from core.sample.demo import AGENT_BEHAVIOUR, AGENT_DATASET

    episodes = _step(report, "episodes")["figures"]
    agent = episodes["agent_logs"]
    assert episodes["episodes"] + agent["episodes"] == sum(d.n_episodes for d in ws.datasets())
    assert set(agent["behaviours"]) == {AGENT_BEHAVIOUR} and agent["episodes"] >= 1
    assert {"expert", "noisy", "hacker"} <= set(episodes["behaviours"])
    assert _step(report, "reward")["figures"]["expectations_passed"].startswith("5 / 5")

    fid = _step(report, "state_map")["figures"]
    assert fid["silhouette_by_task_type"] > fid["silhouette_shuffled"]
    points = pd.read_csv(fid["map"])                  # the map's points as data: the app draws them
    assert len(points) == fid["points"] and {"step", "x", "y", "task_type", "reward_total"} <= set(points.columns)

    training = _step(report, "training")["figures"]
    run = get_run(ws, training["run"])
    assert run.status == "finished" and run.created_by == "ana"
    assert run.dataset == AGENT_DATASET                       # trained on the agent's own logs
    assert training["mask_violations"] == 0
    assert training["curriculum_level"] == 3

    reviewed = review.list_items(ws, status="decided", origin="training")
    assert len(reviewed) == len(_step(report, "review")["figures"]["decided"]) >= 1
    assert {i.decided_by for i in reviewed} == {"rae"}

    tuning_step = _step(report, "tuning")
    tuned = tuning_step["figures"]
    assert tuned["trials"] >= 1
    # applied as a new version, or refused by the apply guard with both figures in its note
    applied = any(not v.shipped for v in list_versions(ws, "finance_risk"))
    assert applied == ("applied_as" in tuned)
    assert any(n.startswith("applied: " if applied else "not applied: ") for n in tuning_step["notes"])

    bundle = _step(report, "bundle")["figures"]
    assert bundle["verified"] and Path(bundle["bundle"]).is_file()

    reg = _step(report, "registry")["figures"]
    version = registry.get_version(ws, reg["policy"], reg["version"])
    gate = registry.promotion_gate(ws, reg["policy"], reg["version"])
    assert gate.passed == reg["gate_passed"] and gate.reason == reg["gate"]
    policies = Path(report["policies_dir"])
    assert policies == Path(report["workspace"]) / "policies"
    assert not (ROOT / "core" / "policies" / reg["policy"] / reg["version"]).exists()
    if reg["gate_passed"]:
        assert version.stage == "production"
        assert [a.by for a in version.approvals] == ["bob"]       # not ana, who trained it
        index = json.loads((policies / "index.json").read_text())
        assert index["policies"][reg["policy"]]["active"] == reg["version"]
    else:
        # the gate held for the approver too: nothing approved, nothing promoted
        assert version.stage == "candidate" and version.approvals == []
        assert "does not beat" in reg["gate"]
        assert not (policies / "index.json").exists() or reg["policy"] not in json.loads(
            (policies / "index.json").read_text()).get("policies", {})
        assert reg["served_from"] == _step(report, "bundle")["figures"]["bundle"]

    served = _step(report, "serving")["figures"]
    assert served["decisions"] >= 1
    assert served["audit_records_written"] == served["decisions"] == audit.stats(ws).records


def report_actor(ws, name):
    from core.sample.demo import DEMO_USERS
    from core.access.users import authenticate

    return authenticate(ws, name, DEMO_USERS[name][1])


def test_demo_refuses_a_workspace_that_is_not_fresh(demo):
    from core.sample.demo import run_demo

    ws, _, _ = demo
    with pytest.raises(InputError, match="fresh workspace"):
        run_demo(ws, small=True, log=lambda _line: None)
    assert rwb(["demo", "--dir", str(ws.root), "--small"]) == 2          # the command says so too


def test_command_refuses_to_replace_a_folder_it_did_not_create(tmp_path, capsys):
    other = tmp_path / "mine"
    other.mkdir()
    (other / "precious.txt").write_text("keep me")
    assert rwb(["demo", "--dir", str(other), "--replace", "--small"]) == 2
    assert "not created by `rwb demo`" in capsys.readouterr().err
    assert (other / "precious.txt").read_text() == "keep me"


def test_requests_from_episode_carry_state_and_the_previous_result():
    from core.data import datasets
    from core.sample.demo import requests_from_episode
    from core.serve.serving import parse_request

    episode = datasets.generate("finance", 4, 3).episodes[0]
    requests = requests_from_episode(episode)
    assert len(requests) == len(episode.steps)
    assert {r["episode_id"] for r in requests} == {f"replay-{episode.episode_id}"}
    for request, step in zip(requests, episode.steps):
        parse_request(request)                          # valid DecisionRequests
        assert request["query"] == episode.task.query
        assert request["state"] == {k: v for k, v in (step.observation or {}).get("state", {}).items()
                                    if isinstance(v, (str, int, float, bool))}
    previous = episode.steps[0]
    if previous.action.kind == "tool_call":
        assert requests[1]["last_result"]["tool"] == previous.action.tool
