"""Archiving and deleting a dataset in a real browser (issue 30): Playwright driving Debian's
Chromium against ``rwb app`` on a tiny single-user workspace (two datasets of 30 generated
finance episodes, a run record training on the first).

1. On the Episodes page, deleting the dataset a run trains on is refused, and the page says
   so naming the run; nothing is deleted, and the refusal is recorded.
2. Archiving the other dataset takes it out of the picker.

Screenshots go to ``test-output/screens/datasets-*.png``.  The helpers and the waits are those
of tests/test_browser.py (waits are for text, never fixed sleeps).
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest

from test_browser import CHROMIUM, WAIT_MS, _fill, _idle, _main, _open, _select, _see
from test_browser import _shot as page_shot

from _browser import browser_tab, running_app

playwright = pytest.importorskip("playwright.sync_api")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")

IN_USE, SPARE = "fin-trained", "fin-spare"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> dict:
    from core.access.users import LOCAL_ADMIN
    from core.data import datasets
    from core.data.importers import import_file
    from core.records.store import Workspace
    from core.rewards import load_template
    from core.rl.ppo import PPOConfig
    from core.rl.runs import create_run

    base = tmp_path_factory.mktemp("browser-datasets")
    ws = Workspace.open(base / "ws")
    data = datasets.generate_file("finance", 30, 11, base / "fin.jsonl")
    for name in (IN_USE, SPARE):
        import_file(ws, data.out, dataset=name)
    run_id = create_run(ws, LOCAL_ADMIN, template=load_template("finance_risk"), config=PPOConfig(), dataset=IN_USE)
    ws.close()
    return {"root": base / "ws", "run_id": run_id}


@pytest.fixture(scope="module")
def page(workspace):
    root = workspace["root"]
    with running_app(root, root.parent / "app.log") as url:
        with browser_tab(url, viewport={"width": 1400, "height": 1000}, timeout_ms=WAIT_MS) as pg:
            yield pg


def _events(root: Path) -> list[tuple[str, str]]:
    with sqlite3.connect(root / "workbench.db") as conn:
        return [tuple(r) for r in conn.execute("SELECT dataset, event FROM dataset_events ORDER BY id")]


def _manage(pg) -> None:
    """Open the "Archive or delete this dataset" expander (once)."""
    summary = _main(pg).locator('[data-testid="stExpander"] summary').filter(has_text="Archive or delete this dataset")
    if summary.locator("xpath=..").get_attribute("open") is None:
        summary.click()
    _idle(pg)


def test_delete_is_refused_while_a_run_trains_on_the_dataset(page, workspace):
    pg, run_id = page, workspace["run_id"]
    _open(pg, "Episodes")
    _select(pg, "Dataset", IN_USE)
    _idle(pg)
    _manage(pg)
    _see(pg, f"run {run_id} is training on it")                  # said before the click
    _fill(pg, "Type the dataset's name to delete it", IN_USE)
    _idle(pg)
    _main(pg).get_by_role("button", name="Delete…", exact=True).click()
    refusal = _main(pg).locator('[data-testid="stAlertContentError"]').filter(
        has_text=f"dataset '{IN_USE}' cannot be deleted: run {run_id} is training on it")
    refusal.first.wait_for(state="visible", timeout=WAIT_MS)
    page_shot(pg, "datasets-delete-refused")
    assert _events(workspace["root"]) == [(IN_USE, "delete_refused")]
    with sqlite3.connect(workspace["root"] / "workbench.db") as conn:
        assert conn.execute("SELECT COUNT(*) FROM episodes WHERE dataset=?", (IN_USE,)).fetchone()[0] == 30


def test_archiving_takes_a_dataset_out_of_the_picker(page, workspace):
    pg = page
    _select(pg, "Dataset", SPARE)
    _idle(pg)
    _manage(pg)
    archive = _main(pg).get_by_role("button", name="Archive", exact=True)
    archive.click()
    # the recorded event is the truth; a click that landed during a rerun is made again
    for attempt in range(2):
        deadline = time.monotonic() + WAIT_MS / 2000
        while time.monotonic() < deadline and (_events(workspace["root"]) or [None])[-1] != (SPARE, "archived"):
            time.sleep(0.5)
        if (_events(workspace["root"]) or [None])[-1] == (SPARE, "archived") or attempt:
            break
        _idle(pg)
        archive.click()
    assert (_events(workspace["root"]) or [None])[-1] == (SPARE, "archived")
    _idle(pg)
    combo = _main(pg).get_by_role("combobox", name="Dataset", exact=True).first
    assert IN_USE in combo.input_value()
    combo.click()
    options = pg.get_by_role("option")
    options.first.wait_for(state="visible", timeout=WAIT_MS)
    assert [o for o in options.all_inner_texts() if SPARE in o] == []
    pg.keyboard.press("Escape")
    page_shot(pg, "datasets-archived")
    assert _events(workspace["root"])[-1] == (SPARE, "archived")
