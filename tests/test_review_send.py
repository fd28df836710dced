"""Sending a step of a recorded episode to the review queue: core.guard.review.send_step, the
``rwb review send`` command and the Episodes page's "Send to review" control."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest
from typer.testing import CliRunner

from core.guard import review
from core.records.catalog import catalog_for_dataset
from core.cli import main, root
from core.base.errors import ConflictError, InputError, PermissionDenied
from core.data.importers import import_file
from core.records.store import Workspace
from core.access.users import LOCAL_ADMIN, Actor, add_user

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "datasets" / "finance" / "sample.jsonl"
PAGE = str(ROOT / "pages" / "episodes.py")
DATASET = "fin"


@pytest.fixture(scope="module")
def sample_ws(tmp_path_factory) -> Path:
    """A workspace holding the finance sample as dataset ``fin`` (copied per test)."""
    path = tmp_path_factory.mktemp("send") / "ws"
    ws = Workspace.open(path)
    import_file(ws, SAMPLE, dataset=DATASET)
    ws.close()
    return path


@pytest.fixture
def ws(sample_ws, tmp_path):
    import shutil

    copy = tmp_path / "ws"
    shutil.copytree(sample_ws, copy)
    w = Workspace.open(copy)
    yield w
    w.close()


def _recorded(path: Path, t: int | None = None) -> tuple[str, dict]:
    """An episode id and one of its steps as written in the sample file: the first episode
    whose step ``t`` (default: its first step) is a recorded tool call."""
    for line in SAMPLE.read_text(encoding="utf-8").splitlines()[1:]:
        episode = json.loads(line)
        steps = episode["steps"] if t is None else [s for s in episode["steps"] if s["t"] == t]
        if steps and steps[0]["action"]["kind"] == "tool_call":
            return episode["episode_id"], steps[0]
    raise AssertionError("the sample holds no tool call")


def _invalid_step(ws: Workspace) -> tuple[str, int]:
    """An episode and a step of it whose action maps to no catalog token (INVALID)."""
    catalog = catalog_for_dataset(ws, DATASET)
    for episode in ws.load_episodes(DATASET):
        tokens = catalog.normalize_many([s.action for s in episode.steps]).token_ids.tolist()
        for step, token in zip(episode.steps, tokens):
            if token < 0:
                return episode.episode_id, step.t
    raise AssertionError("the sample holds no INVALID step")


# --------------------------------------------------------------------------- core
def test_a_sent_step_carries_what_was_recorded(ws):
    episode_id, recorded = _recorded(SAMPLE)
    ana = Actor("ana", "analyst")
    item = review.send_step(ws, ana, DATASET, episode_id, recorded["t"], "  market order in a spike  ")
    assert item.status == "pending" and item.origin == "training" and item.run_id is None
    assert (item.dataset, item.episode_id, item.step_t) == (DATASET, episode_id, recorded["t"])
    assert item.state == recorded["observation"]["state"]          # as written in the file
    assert item.tool == recorded["action"]["tool"]
    assert item.reason == "market order in a spike"
    assert item.created_by == "ana" and item.meta == {"source": "recorded episode", "sent_by": "ana"}
    token = catalog_for_dataset(ws, DATASET).tokens[item.token_id]
    assert (item.token_name, item.action_label, item.risk) == (token.name, token.label, token.risk)
    events = review.item_events(ws, item.id)
    assert [(e.event, e.actor) for e in events] == [("enqueued", "ana")]
    assert events[0].detail == {"origin": "training", "source": "recorded episode", "dataset": DATASET}
    # without a reason the reviewer reads who sent it
    other_id, other = _recorded(SAMPLE, t=1)
    assert review.send_step(ws, ana, DATASET, other_id, other["t"]).reason == "sent to review by ana"


def test_a_step_already_on_the_queue_is_refused(ws):
    episode_id, recorded = _recorded(SAMPLE)
    first = review.send_step(ws, LOCAL_ADMIN, DATASET, episode_id, recorded["t"])
    with pytest.raises(ConflictError, match=rf"already on the review queue as item #{first.id}, pending"):
        review.send_step(ws, LOCAL_ADMIN, DATASET, episode_id, recorded["t"], "again")
    rae = Actor("rae", "reviewer")
    review.claim(ws, rae, first.id)
    review.decide(ws, rae, first.id, "approve", "fine")
    with pytest.raises(ConflictError, match=r"decided \(approve by rae\): a decision is final"):
        review.send_step(ws, LOCAL_ADMIN, DATASET, episode_id, recorded["t"])
    assert review.stats(ws).pending == 0 and len(review.list_items(ws)) == 1


def test_the_same_episode_in_another_dataset_is_another_step(ws):
    import_file(ws, SAMPLE, dataset="fin-copy")
    episode_id, recorded = _recorded(SAMPLE)
    a = review.send_step(ws, LOCAL_ADMIN, DATASET, episode_id, recorded["t"])
    b = review.send_step(ws, LOCAL_ADMIN, "fin-copy", episode_id, recorded["t"])
    assert a.id != b.id and b.dataset == "fin-copy"


def test_bad_sends_name_the_field_and_write_nothing(ws):
    episode_id, recorded = _recorded(SAMPLE)
    invalid_episode, invalid_t = _invalid_step(ws)
    cases = [
        (dict(episode_id=episode_id, step_t=recorded["t"], reason="x" * (review.MAX_REASON_CHARS + 1)),
         "reason", "keep it to 500"),
        (dict(episode_id="no-such-episode", step_t=0), "episode", "no episode 'no-such-episode'"),
        (dict(episode_id=episode_id, step_t=999), "step", "has no step 999"),
        (dict(episode_id=episode_id, step_t=-1), "step", "step number ≥ 0"),
        (dict(episode_id=invalid_episode, step_t=invalid_t), "step", "INVALID"),
    ]
    for kwargs, field, words in cases:
        with pytest.raises(InputError, match=words) as info:
            review.send_step(ws, LOCAL_ADMIN, DATASET, **kwargs)
        assert info.value.field == field
    # the longest allowed reason goes through
    long = "y" * review.MAX_REASON_CHARS
    assert review.send_step(ws, LOCAL_ADMIN, DATASET, episode_id, recorded["t"], long).reason == long
    assert len(review.list_items(ws)) == 1


def test_a_reviewer_may_not_send_and_nothing_is_written(ws):
    admin = add_user(ws, LOCAL_ADMIN, "ada", "admin", password="ada-password").actor()
    add_user(ws, admin, "rae", "reviewer", password="rae-password")
    episode_id, recorded = _recorded(SAMPLE)
    with pytest.raises(PermissionDenied, match="may not put items on the review queue"):
        review.send_step(ws, Actor("rae", "reviewer"), DATASET, episode_id, recorded["t"])
    assert review.list_items(ws) == []


# --------------------------------------------------------------------------- CLI
def test_cli_send(ws, capsys):
    episode_id, recorded = _recorded(SAMPLE)
    args = ["-w", str(ws.root), "review", "send", DATASET, episode_id, str(recorded["t"])]
    r = CliRunner().invoke(root, [*args, "--reason", "look at the size", "--json"])
    assert r.exit_code == 0, r.output
    item = json.loads(r.output)
    assert (item["episode_id"], item["step_t"], item["reason"]) == (episode_id, recorded["t"], "look at the size")
    assert main([*args, "--json"]) == ConflictError.exit_code
    out = capsys.readouterr()
    assert f"item #{item['id']}" in json.loads(out.out or out.err)["error"]["message"]
    assert main(["-w", str(ws.root), "review", "send", DATASET, episode_id, "first"]) == 2
    assert "Traceback" not in capsys.readouterr().err


# --------------------------------------------------------------------------- the Episodes page
def _open_episode(path: Path, monkeypatch, episode_id: str) -> AppTest:
    monkeypatch.setenv("RWB_WORKSPACE", str(path))
    at = AppTest.from_file(PAGE, default_timeout=120).run()
    assert not at.exception, at.exception
    at.selectbox(key="episodes_dataset").set_value(DATASET).run()
    at.selectbox(key="episodes_open").set_value(episode_id).run()
    assert not at.exception, at.exception
    return at


def _send_button(at: AppTest):
    return next(b for b in at.button if b.label == "Send to review")


def test_the_episodes_page_sends_the_chosen_step(ws, monkeypatch):
    episode_id, recorded = _recorded(SAMPLE)
    at = _open_episode(Path(ws.root), monkeypatch, episode_id)
    assert not _send_button(at).disabled
    at.selectbox(key="episodes_review_step").set_value(recorded["t"])
    at.text_input(key="episodes_review_reason").input("odd quantity")
    _send_button(at).click().run()
    assert not at.exception, at.exception
    (item,) = review.list_items(ws)
    assert (item.episode_id, item.step_t, item.reason) == (episode_id, recorded["t"], "odd quantity")
    assert any(f"item #{item.id}" in s.value for s in at.success)
    # the same step again: refused in the page's words, nothing added
    _send_button(at).click().run()
    assert any("already on the review queue" in e.value for e in at.error)
    assert len(review.list_items(ws)) == 1


def test_the_send_control_is_disabled_with_a_reason_for_a_reviewer(ws, monkeypatch):
    from core.access.users import sign_in

    admin = add_user(ws, LOCAL_ADMIN, "ada", "admin", password="ada-password").actor()
    add_user(ws, admin, "rae", "reviewer", password="rae-password")
    session = sign_in(ws, "rae", "rae-password")
    episode_id, _ = _recorded(SAMPLE)
    monkeypatch.setenv("RWB_WORKSPACE", str(ws.root))
    at = AppTest.from_file(PAGE, default_timeout=120)
    at.session_state["actor"] = session.actor
    at.session_state["session_token"] = session.token
    at.run()
    at.selectbox(key="episodes_dataset").set_value(DATASET).run()
    at.selectbox(key="episodes_open").set_value(episode_id).run()
    assert not at.exception, at.exception
    button = _send_button(at)
    assert button.disabled
    assert any("only analysts and admins send steps to review" in c.value for c in at.caption)
