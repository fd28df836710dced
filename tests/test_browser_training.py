"""The run's one verdict and Resume in a real browser (issue 30): Playwright driving Debian's
Chromium against ``rwb app`` on a copy of the suite's tiny trained run (multi-user; ana signs in).

1. Training opens the losing tiny run on its verdict — not ready, not better than the logs,
   with the figures — and the engineering charts under Details;
2. Diagnostics shows the very same verdict, with the four health checks below it;
3. a stopped run has a Resume button: pressed, the run trains again in the background (its
   trainer is ended by the test once the page says so).

The verdict is computed once in the fixture (in this process, with the hash embedder the run
was trained with) and kept, as the button would keep it: the pages only read it.
Screenshots go to ``test-output/screens/training-*.png``; the helpers and waits are those of
tests/test_browser.py.
"""

from __future__ import annotations

import re
import shutil
import sqlite3
from pathlib import Path

import pytest

from _browser import browser_tab, running_app
from _bundle_fixtures import PASSWORDS, hash_embedder, tiny_config, trained_copy
from test_browser import CHROMIUM, WAIT_MS, _idle, _main, _open, _see, _select, \
    _stop_background_runs
from test_browser import _shot as page_shot

playwright = pytest.importorskip("playwright.sync_api")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> dict:
    """The tiny run (losing: two warm-start updates, far below the expert) with its verdict
    kept, and a stopped run with a checkpoint to resume."""
    import dataclasses

    from core.rl import runs, verdict

    with pytest.MonkeyPatch.context() as mp:
        hash_embedder(mp)
        trained = trained_copy(tmp_path_factory)
        ws = trained.workspace()
        judged = verdict.run_verdict(ws, trained.run_id)
        ana = trained.actor("ana")
        stopped = runs.create_run(ws, ana, template=runs.run_template(ws, trained.run_id),
                                  config=dataclasses.replace(tiny_config(), total_steps=8192), dataset="finance")
        ckpt = runs.latest_checkpoint(ws, trained.run_id)
        folder = runs.run_dir(ws, stopped) / "checkpoints" / f"{ckpt.update_idx:06d}"
        shutil.copytree(ckpt.path, folder)
        for m in runs.run_metrics(ws, trained.run_id):
            runs.record_update(ws, stopped, m["update"], m["env_steps"], m)
        runs.record_checkpoint(ws, stopped, ckpt.update_idx, ckpt.env_steps, folder)
        runs.finish_run(ws, stopped, "stopped", error="stopped on request")
        ws.close()
    return {"root": trained.root, "run_id": trained.run_id, "stopped": stopped, "verdict": judged}


@pytest.fixture(scope="module")
def page(workspace):
    root = workspace["root"]
    with running_app(root, root.parent / "app-training.log") as url:
        try:
            with browser_tab(url, viewport={"width": 1500, "height": 1100}, timeout_ms=WAIT_MS) as pg:
                _sign_in(pg, "ana")
                yield pg
        finally:
            _stop_background_runs(root)


def _sign_in(pg, name: str) -> None:
    """A workspace with users opens on the sign-in form."""
    _main(pg).get_by_label("User name").wait_for()
    _main(pg).get_by_label("User name").fill(name)
    _main(pg).get_by_role("textbox", name="Password").fill(PASSWORDS[name])
    _main(pg).get_by_role("button", name="Sign in").click()
    pg.locator('[data-testid="stSidebar"]').get_by_text(f"Acting as {name}").wait_for()


def _shot(pg, name: str) -> None:
    page_shot(pg, f"training-{name}")


def _status(root: Path, run_id: str) -> tuple[str, int | None]:
    with sqlite3.connect(root / "workbench.db") as conn:
        return tuple(conn.execute("SELECT status, pid FROM runs WHERE id=?", (run_id,)).fetchone())


def test_the_losing_run_says_so_alike_on_training_and_diagnostics(page, workspace):
    pg, v = page, workspace["verdict"]
    assert v.better_than_logs.answer == "no" and v.overall == "fail"      # the fixture's run loses
    _open(pg, "Training")
    _select(pg, "Run", workspace["run_id"])
    _see(pg, v.headline)
    text = _main(pg).inner_text()
    assert "Not ready" in text and "All clear" not in text
    for line in (v.learning, v.better_than_logs, v.how_sure):
        assert line.sentence in text
    assert re.search(r"Better than the logs: no — [\d.]+ vs [\d.]+ for \w+", text)
    assert "Average reward per episode" in text and "Details: every training curve" in text
    assert "KL(old" not in text                                            # the jargon stays in Details' tooltips
    _shot(pg, "verdict")
    _open(pg, "Diagnostics")
    _select(pg, "Run", workspace["run_id"])
    _see(pg, v.headline)
    text = _main(pg).inner_text()
    assert "Not ready" in text and v.better_than_logs.sentence in text
    assert "Nothing to fix here" not in text and "Overall: passes" not in text
    _see(pg, "1. The rewards are sane")
    _main(pg).locator('[data-testid="stMetricValue"]').last.wait_for(state="visible")
    _shot(pg, "diagnostics-verdict")


def test_resume_a_stopped_run_from_the_browser(page, workspace):
    pg, stopped, root = page, workspace["stopped"], workspace["root"]
    _open(pg, "Training")
    _select(pg, "Run", stopped)
    _see(pg, re.compile(rf"{stopped} · stopped · "))
    resume = _main(pg).get_by_role("button", name="Resume", exact=True)
    resume.wait_for()
    _shot(pg, "stopped")
    resume.click()
    _see(pg, re.compile(rf"Resumed {stopped} from its last checkpoint \(process \d+\)"))
    status, pid = _status(root, stopped)
    assert status == "running" and pid is not None
    _see(pg, re.compile(rf"{stopped} · running · "))
    _idle(pg)                             # the rerun the resume started has replaced the buttons
    # running (Stop) or, on a fast machine, already finished: either way no longer resumable
    assert _main(pg).get_by_role("button", name="Resume", exact=True).count() == 0
    _shot(pg, "resumed")
    _stop_background_runs(root)           # the real trainer is not what this test waits for
