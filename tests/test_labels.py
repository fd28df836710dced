"""People's outcome labels (core.rewards.labels), the labelling queue (core.rewards.label_queue),
``rwb labels``, the Review Queue page's "Label outcomes" section, and ``--reward-key`` 0/1
values setting the outcome (core.data.importers.openai)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest

from _real_logs import REAL
from core.access.users import LOCAL_ADMIN, Actor, add_user
from core.base.embed import HashEmbedder
from core.base.errors import InputError, PermissionDenied
from core.cli import main
from core.data.importers import import_file, read_file
from core.records.store import Workspace, WorkspaceError
from core.rewards.label_queue import propose_next
from core.rewards.labels import (add_label, current_labels, dataset_outcomes, label_events, label_history,
                                 labels_version, parse_outcome)

ROOT = Path(__file__).resolve().parents[1]
PAGE = str(ROOT / "pages" / "review_queue.py")
#: Tasks of the tau2 grok runs with several runs each, some of them with both outcomes.
TASKS_WANTED = 8
RUNS_PER_TASK = 6


def _grok_subset(path: Path, *, keep_outcome: bool = True) -> Path:
    """Up to ``RUNS_PER_TASK`` runs of each of the first ``TASKS_WANTED`` tasks with that many
    runs, as a JSON Lines file (without the outcome key when ``keep_outcome`` is False)."""
    rows = [json.loads(line) for line in (REAL / "tau2_grok" / "episodes.jsonl").read_text().splitlines()]
    counts = Counter(r["task_id"] for r in rows)
    tasks = [t for t, n in counts.items() if n >= RUNS_PER_TASK][:TASKS_WANTED]
    taken: Counter = Counter()
    out = []
    for r in rows:
        if r["task_id"] in tasks and taken[r["task_id"]] < RUNS_PER_TASK:
            taken[r["task_id"]] += 1
            if not keep_outcome:
                r = {k: v for k, v in r.items() if k not in ("outcome", "reward")}
            out.append(r)
    path.write_text("".join(json.dumps(r) + "\n" for r in out), encoding="utf-8")
    return path


@pytest.fixture(autouse=True)
def hash_embedder(monkeypatch):
    """The hash embedder stands in for the sentence model (the ranking needs no real one)."""
    monkeypatch.setattr("core.base.embed.workspace_embedder", lambda _ws: HashEmbedder())


@pytest.fixture
def unlabelled(tmp_path):
    """A workspace whose dataset ``runs`` has no recorded outcome: people's labels are all there is."""
    ws = Workspace.open(tmp_path / "ws")
    import_file(ws, _grok_subset(tmp_path / "runs.jsonl", keep_outcome=False), dataset="runs", id_key="id")
    yield ws
    ws.close()


@pytest.fixture
def labelled(tmp_path):
    """A workspace whose dataset ``runs`` carries the recorded outcomes (0/1 at ``outcome``)."""
    ws = Workspace.open(tmp_path / "ws")
    import_file(ws, _grok_subset(tmp_path / "runs.jsonl"), dataset="runs", reward_key="outcome", id_key="id")
    yield ws
    ws.close()


def _ids(ws: Workspace) -> list[str]:
    return [e.episode_id for e in ws.load_episodes("runs")]


# --------------------------------------------------------------------------- labels
def test_add_withdraw_history_and_version(labelled):
    ws = labelled
    first, second = _ids(ws)[:2]
    recorded, groups = dataset_outcomes(ws, "runs")
    assert labels_version(ws, "runs") == 0 and current_labels(ws, "runs") == {}
    flipped = 1 - int(recorded[0])
    e1 = add_label(ws, LOCAL_ADMIN, "runs", first, flipped, note="  the refund was never issued ")
    assert (e1.outcome, e1.note, e1.created_by) == (flipped, "the refund was never issued", "local")
    e2 = add_label(ws, LOCAL_ADMIN, "runs", second, 1)
    assert labels_version(ws, "runs") == e2.id > e1.id
    overlaid, same_groups = dataset_outcomes(ws, "runs")
    assert overlaid[0] == flipped and overlaid[1] == 1.0
    assert np.array_equal(overlaid[2:], recorded[2:]) and list(same_groups) == list(groups)

    e3 = add_label(ws, LOCAL_ADMIN, "runs", first, None)          # withdrawn: the recorded outcome is back
    assert dataset_outcomes(ws, "runs")[0][0] == recorded[0]
    assert [e.outcome for e in label_history(ws, "runs", first)] == [flipped, None]
    assert [e.id for e in label_history(ws, "runs")] == [e1.id, e2.id, e3.id]
    assert labels_version(ws, "runs") == e3.id
    assert current_labels(ws, "runs") == {first: None, second: 1}
    assert [e.episode_id for e in label_events(ws, "runs")] == [second]
    assert {e.episode_id for e in label_events(ws, "runs", withdrawn=True)} == {first, second}


def test_bad_input_is_refused_naming_the_field(labelled):
    ws = labelled
    first = _ids(ws)[0]
    with pytest.raises(InputError, match="1 .success., 0 .failure. or none; got 2") as err:
        add_label(ws, LOCAL_ADMIN, "runs", first, 2)
    assert err.value.field == "outcome"
    with pytest.raises(InputError, match="no episode 'nope' in dataset 'runs'"):
        add_label(ws, LOCAL_ADMIN, "runs", "nope", 1)
    with pytest.raises(InputError, match="at most 2,000 characters"):
        add_label(ws, LOCAL_ADMIN, "runs", first, 1, note="x" * 2001)
    with pytest.raises(WorkspaceError, match="no dataset named 'other'"):
        add_label(ws, LOCAL_ADMIN, "other", first, 1)
    with pytest.raises(WorkspaceError, match="no dataset named 'other'"):
        label_events(ws, "other")
    assert [parse_outcome(w) for w in ("success", " FAILURE", "none")] == [1, 0, None]
    with pytest.raises(InputError, match="success, failure or none; got 'maybe'"):
        parse_outcome("maybe")
    assert labels_version(ws, "runs") == 0                     # nothing was written


@pytest.mark.parametrize("role, allowed", [("analyst", True), ("reviewer", True), ("admin", True),
                                           ("approver", False)])
def test_labelling_needs_the_label_permission(labelled, role, allowed):
    ws = labelled
    add_user(ws, LOCAL_ADMIN, "ada", "admin", password="ada-password")
    if role != "admin":
        add_user(ws, Actor("ada", "admin"), "pat", role, password="pat-password")
    who = Actor("ada" if role == "admin" else "pat", role)
    first = _ids(ws)[0]
    if allowed:
        assert add_label(ws, who, "runs", first, 0).created_by == who.name
    else:
        with pytest.raises(PermissionDenied, match="may not label episode outcomes"):
            add_label(ws, who, "runs", first, 0)
        assert labels_version(ws, "runs") == 0


# --------------------------------------------------------------------------- the queue
def test_proposals_spread_over_tasks_fewest_labels_first_and_never_repeat(unlabelled):
    ws = unlabelled
    groups = dataset_outcomes(ws, "runs")[1]
    ids = _ids(ws)
    n_tasks = len(set(groups))           # a task id of two domains is two tasks
    assert n_tasks >= TASKS_WANTED
    # Two labels on the first task: it comes last in the next round over the tasks.
    busy = groups[0]
    for i in np.flatnonzero(groups == busy)[:2]:
        add_label(ws, LOCAL_ADMIN, "runs", ids[i], int(i % 2))
    p = propose_next(ws, "runs", n=n_tasks)
    assert p.model == "return_rank" and "no model yet" in p.model_note       # 2 labels: no model
    assert [i.probability for i in p.items] == [None] * n_tasks
    assert p.n_labelled == 2 and p.n_known == 2 and p.labels_version == labels_version(ws, "runs")
    tasks = [i.task for i in p.items]
    assert sorted(tasks) == sorted(set(groups)) and tasks[-1] == busy       # one per task, busy last
    assert all(i.request and i.steps for i in p.items)
    # Label everything proposed, round after round: nothing labelled is ever proposed again.
    seen: set[str] = set()
    while True:
        p = propose_next(ws, "runs", n=5)
        if not p.items:
            break
        got = [i.episode_id for i in p.items]
        assert not set(got) & seen and len(set(got)) == len(got)
        assert not set(got) & {eid for eid, v in current_labels(ws, "runs").items() if v is not None}
        for k, eid in enumerate(got):
            add_label(ws, LOCAL_ADMIN, "runs", eid, k % 2)
        seen.update(got)
    assert p.n_labelled == len(ids) and len(seen) == len(ids) - 2


def test_proposals_use_a_model_once_the_labels_allow_one(labelled):
    ws = labelled
    p = propose_next(ws, "runs", n=6)
    assert p.model == "fitted_on_labels" and p.n_known == len(_ids(ws))
    probs = np.array([i.probability for i in p.items])
    assert ((probs > 0) & (probs < 1)).all()
    assert np.allclose([i.uncertainty for i in p.items], 1 - 2 * np.abs(probs - 0.5))
    assert len({i.task for i in p.items}) == 6                       # one per task first
    assert all("the log recorded" in i.why for i in p.items)
    with pytest.raises(InputError, match="between 1 and 200"):
        propose_next(ws, "runs", n=0)


def test_proposals_use_the_templates_fitted_term(labelled):
    """A template with a fitted learned_outcome term ranks by its probability: here one that
    only reads the number of tool calls, so the proposal's probability is checkable by hand."""
    from core.rewards.api import load_frame
    from core.rewards.components import ScoringContext
    from core.base import safe_yaml
    from core.rewards.outcome_model import feature_table
    from core.rewards.template import load_template, parse_template

    ws = labelled
    frame = load_frame(ws, "runs")
    groups = dataset_outcomes(ws, "runs")[1].astype(str)
    table = feature_table(frame, ScoringContext(embedder=HashEmbedder()), groups, ("stats",))
    calls = table.names.index("tool_calls")
    coef = [0.0] * len(table.names)
    coef[calls] = 0.5
    params = {"embed": "none", "blocks": ["stats"], "features": table.names, "mean": [0.0] * len(coef),
              "scale": [1.0] * len(coef), "coef": coef, "intercept": -4.0, "trained_on": 99}
    data = load_template(ROOT / "reward_templates" / "tool_agent.yaml").to_dict()
    data.setdefault("episode_terms", {})["learned_outcome"] = {"weight": 1.0, "params": params}
    template = parse_template(safe_yaml.dump(data, sort_keys=False))
    p = propose_next(ws, "runs", n=4, template=template)
    assert p.model == "template_term" and "fitted on 99 episodes" in p.model_note
    n_calls = table.matrix[:, calls]
    by_id = dict(zip(_ids(ws), 1 / (1 + np.exp(-(0.5 * n_calls - 4.0)))))
    for item in p.items:
        assert item.probability == pytest.approx(by_id[item.episode_id])
    # one per task, each its task's most uncertain episode
    assert len({i.task for i in p.items}) == 4
    for item in p.items:
        mine = [q for eid, q, g in zip(_ids(ws), by_id.values(), groups) if g == item.task]
        assert abs(item.probability - 0.5) == pytest.approx(min(abs(q - 0.5) for q in mine))


# --------------------------------------------------------------------------- --reward-key 0/1
def test_reward_key_with_0_1_values_sets_the_outcome(tmp_path):
    def records(values):
        return [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}],
                 "eval": {"score": v}} for i, v in enumerate(values)]

    def outcomes(values):
        path = tmp_path / "runs.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records(values)), encoding="utf-8")
        return [(e.outcome.resolved, e.outcome.final_reward)
                for e in read_file(path, reward_key="eval.score").episodes]

    assert outcomes([1, 0, 1]) == [(True, 1.0), (False, 0.0), (True, 1.0)]
    assert outcomes([1.0, 0.0, None]) == [(True, 1.0), (False, 0.0), (None, None)]
    assert outcomes([1, 0.5, 0]) == [(None, 1.0), (None, 0.5), (None, 0.0)]       # graded: final_reward only
    assert outcomes([1, 2, 0]) == [(None, 1.0), (None, 2.0), (None, 0.0)]
    assert outcomes([True, 0, 1]) == [(True, None), (False, 0.0), (True, 1.0)]
    episodes = read_file(REAL / "tau2_whissle" / "episodes.jsonl", reward_key="outcome", id_key="id").episodes
    assert Counter(e.outcome.resolved for e in episodes) == {True: 28, False: 22}


# --------------------------------------------------------------------------- rwb labels
def test_rwb_labels_add_list_history_next(labelled, capsys):
    root = str(labelled.root)
    first = _ids(labelled)[0]

    def rwb(*args: str) -> tuple[int, str, str]:
        code = main(["--workspace", root, "labels", *args])
        out, err = capsys.readouterr()
        return code, out, err

    code, out, _ = rwb("add", first, "failure", "--dataset", "runs", "--note", "wrong seat", "--json")
    body = json.loads(out)
    assert code == 0 and body["event"]["outcome"] == 0 and body["labels_version"] == body["event"]["id"]
    code, out, _ = rwb("list", "--dataset", "runs", "--json")
    assert [(e["episode_id"], e["outcome"], e["note"]) for e in json.loads(out)["labels"]] == \
           [(first, 0, "wrong seat")]
    assert rwb("add", first, "none", "--dataset", "runs")[0] == 0
    code, out, _ = rwb("history", first, "--dataset", "runs")
    assert code == 0 and "failure" in out and "withdrawn" in out
    code, out, _ = rwb("next", "--dataset", "runs", "-n", "3", "--json")
    body = json.loads(out)
    assert code == 0 and len(body["items"]) == 3 and body["labels_version"] == 2
    assert list(body["items"][0]) == ["episode_id", "task", "request", "last_answer", "steps", "probability",
                                      "uncertainty", "recorded", "why"]
    for bad, says in ((("add", first, "maybe", "--dataset", "runs"), "success, failure or none"),
                      (("add", "nope", "success", "--dataset", "runs"), "no episode 'nope'"),
                      (("next", "--dataset", "runs", "-n", "0"), "between 1 and 200"),
                      (("list", "--dataset", "other"), "no dataset named 'other'")):
        code, out, err = rwb(*bad)
        assert code == 2 and out == "" and says in err
        assert err.count("\n") == 1 and "Traceback" not in err


# --------------------------------------------------------------------------- the page
def test_review_queue_page_labels_with_one_click_for_a_reviewer_only(labelled, monkeypatch):
    ws = labelled
    monkeypatch.setenv("RWB_WORKSPACE", str(ws.root))
    add_user(ws, LOCAL_ADMIN, "ada", "admin", password="ada-password")
    add_user(ws, Actor("ada", "admin"), "rae", "reviewer", password="rae-password")
    add_user(ws, Actor("ada", "admin"), "app", "approver", password="app-password")

    at = AppTest.from_file(PAGE, default_timeout=120)
    at.session_state["actor"] = Actor("rae", "reviewer")
    at.run()
    assert not at.exception, at.exception
    assert any(s.value == "Label outcomes" for s in at.subheader)
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Labelled by people"] == "0" and metrics["Label set version"] == "0"
    proposed = propose_next(ws, "runs", n=5).items[0]
    assert any(f"`{proposed.episode_id}`" in m.value for m in at.markdown)
    at.text_input(key="label_note").set_value("gave the wrong fare")
    next(b for b in at.button if b.label == "Failure").click()
    at.run()
    assert not at.exception, at.exception
    assert any(f"Episode {proposed.episode_id} labelled a failure" in s.value for s in at.success)
    [event] = label_history(ws, "runs")
    assert (event.episode_id, event.outcome, event.note, event.created_by) == \
           (proposed.episode_id, 0, "gave the wrong fare", "rae")
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Labelled by people"] == "1" and metrics["Label set version"] == str(event.id)
    assert not any(f"`{proposed.episode_id}`" in m.value for m in at.markdown if m.value.startswith("**Episode"))

    at = AppTest.from_file(PAGE, default_timeout=120)
    at.session_state["actor"] = Actor("app", "approver")
    at.run()
    assert not at.exception, at.exception
    assert not {"Success", "Failure"} & {b.label for b in at.button}
    assert any("only analysts, reviewers and admins label outcomes" in i.value for i in at.info)
    assert any(m.value.startswith("**Episode") for m in at.markdown)          # read-only, still shown
    assert len(label_history(ws, "runs")) == 1
