"""The sample workspace shows each feature working: its review queue holds pending items
picked by a real criterion (high-risk actions in failed episodes), queued once."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.guard import review
from core.records.catalog import catalog_for_dataset
from core.base.errors import ConflictError
from core.records.store import Workspace
from core.access.users import Actor
from core.sample.workspace_setup import (
    SAMPLE_DATASETS,
    SAMPLE_SETUP,
    ensure_samples,
    init_workspace,
    queue_sample_reviews,
)


@pytest.fixture(scope="module")
def sample_ws(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sample-ws") / "ws"
    ws = Workspace.open(path)
    init_workspace(ws)
    ws.close()
    return path


def _naive_candidates(ws: Workspace, dataset: str) -> list[tuple[int, float, str, int]]:
    """Every (repeats, final reward, episode, t) of a high-risk step in a failed episode, one
    action at a time: the slow obvious reading of the criterion."""
    catalog = catalog_for_dataset(ws, dataset)
    out = []
    for episode in ws.load_episodes(dataset):
        if episode.outcome.resolved is not False:
            continue
        last, repeats = None, 0
        for step in episode.steps:
            token_id = int(catalog.normalize_many([step.action]).token_ids[0])
            repeats = repeats + 1 if token_id == last else 1
            last = token_id
            if token_id >= 0 and catalog.tokens[token_id].risk == "high":
                out.append((repeats, episode.outcome.final_reward, episode.episode_id, step.t))
    return out


def test_a_fresh_sample_workspace_has_pending_review_items(sample_ws):
    ws = Workspace.open(sample_ws)
    items = review.list_items(ws, status="pending")
    assert len(items) == review.SAMPLE_ITEMS_PER_DATASET * len(SAMPLE_DATASETS)
    assert {i.dataset for i in items} == set(SAMPLE_DATASETS.values())
    for item in items:
        assert item.risk == "high" and item.run_id is None
        assert item.created_by == SAMPLE_SETUP.name
        assert "in an episode that failed" in item.reason
        episode = ws.get_episode(item.dataset, item.episode_id)
        assert episode.outcome.resolved is False
        assert item.state == next(s for s in episode.steps if s.t == item.step_t).observation["state"]
    ws.close()


@pytest.mark.parametrize("dataset", sorted(SAMPLE_DATASETS.values()))
def test_the_picked_steps_are_the_top_of_the_criterion(sample_ws, dataset):
    """No high-risk step of a failed episode ranks above a picked one: a longer run of the same
    high-risk action first, then the worse final reward (one step per episode)."""
    ws = Workspace.open(sample_ws)
    picked = review.sample_review_steps(ws, dataset)
    naive = _naive_candidates(ws, dataset)
    best: dict[str, tuple[int, float, str, int]] = {}
    for c in naive:   # the first step of the longest run in each episode
        if c[2] not in best or c[0] > best[c[2]][0]:
            best[c[2]] = c
    ranked = sorted(best.values(), key=lambda c: (-c[0], c[1], c[2]))
    assert [(s.repeats, s.episode_id, s.step_t) for s in picked] == [
        (c[0], c[2], c[3]) for c in ranked[:review.SAMPLE_ITEMS_PER_DATASET]]
    assert len(picked) == review.SAMPLE_ITEMS_PER_DATASET
    queued = {(i.episode_id, i.step_t) for i in review.list_items(ws, dataset=dataset)}
    assert queued == {(s.episode_id, s.step_t) for s in picked}
    ws.close()


def test_queueing_the_samples_again_adds_nothing(sample_ws, tmp_path):
    import shutil

    copy = tmp_path / "ws"
    shutil.copytree(sample_ws, copy)
    ws = Workspace.open(copy)
    before = review.list_items(ws)
    assert queue_sample_reviews(ws, list(SAMPLE_DATASETS.values())) == []
    assert ensure_samples(ws) == []
    init_workspace(ws)
    after = review.list_items(ws)
    assert [(i.id, i.status, i.episode_id, i.step_t) for i in after] == [
        (i.id, i.status, i.episode_id, i.step_t) for i in before]
    # an analyst sending a queued step is told it is there already
    item = before[0]
    with pytest.raises(ConflictError, match=f"item #{item.id}"):
        review.send_step(ws, Actor("ana", "analyst"), item.dataset, item.episode_id,
                         item.step_t)
    ws.close()
