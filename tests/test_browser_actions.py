"""Guarded launches and fresh state in a real browser (issue 18): Playwright driving Debian's
Chromium against ``rwb app`` on a tiny single-user workspace (60 generated finance episodes).

1. On the Training page, Enter in "Environment steps" commits the number and launches nothing.
2. Launch, then Launch again with the same settings: one run, and the second click is refused
   naming it; the run (two updates) then ends and the page says so by itself, with
   the table, the panel and the picker agreeing and nothing left greyed.
3. On the Policies page, exporting the finished run lists the bundle at once, selected, in the
   tab the person was in; registering it says so next to its button.

Screenshots go to ``test-output/screens/actions-*.png``.  The app, its helpers and the waits
are those of tests/test_browser.py (waits are for text, never fixed sleeps).
"""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

import pytest

from test_browser import (
    CHROMIUM,
    WAIT_MS,
    _fill,
    _idle,
    _main,
    _open,
    _see,
    _select,
    _stop_background_runs,
)
from test_browser import _shot as page_shot

from _browser import browser_tab, running_app

playwright = pytest.importorskip("playwright.sync_api")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")

DATASET = "fin-tiny"
#: Environment steps of the launched run: 2 updates of 32 environments × 16 steps, the
#: fewest that still draw a curve (two points) once the run has ended.
STEPS = 1024


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    from core.data import datasets
    from core.data.importers import import_file
    from core.records.store import Workspace

    base = tmp_path_factory.mktemp("browser-actions")
    ws = Workspace.open(base / "ws")
    data = datasets.generate_file("finance", 60, 7, base / f"{DATASET}.jsonl")
    import_file(ws, data.out, dataset=DATASET)
    ws.close()
    return base / "ws"


def _runs(root: Path) -> list[tuple[str, str, int]]:
    with sqlite3.connect(root / "workbench.db") as conn:
        return [tuple(r) for r in conn.execute("SELECT id, status, env_steps FROM runs ORDER BY created_at")]


@pytest.fixture(scope="module")
def page(workspace):
    with running_app(workspace, workspace.parent / "app.log",
                     env={"RWB_POLICIES_DIR": str(workspace.parent / "policies")}) as url:
        try:
            with browser_tab(url, viewport={"width": 1500, "height": 1100}, timeout_ms=WAIT_MS) as pg:
                yield pg
        finally:
            _stop_background_runs(workspace)


def _shot(pg, name: str) -> None:
    """The whole page (no exception on it) as ``test-output/screens/actions-NAME.png``."""
    page_shot(pg, f"actions-{name}")


def _launch_panel(pg) -> None:
    """Open Training with the launch settings of a short run filled in (nothing pressed yet)."""
    _open(pg, "Training")
    _select(pg, "Reward template", "finance_risk@0")
    _select(pg, "Dataset", DATASET)
    _main(pg).get_by_text("Settings", exact=True).first.click()
    _fill(pg, "Parallel environments", "32")
    _fill(pg, "CPU threads (0 = default)", "1")
    _idle(pg)


def test_enter_in_a_number_does_not_launch(page, workspace):
    pg = page
    _launch_panel(pg)
    steps = _main(pg).get_by_label("Environment steps", exact=True).first
    steps.fill(str(STEPS))
    steps.press("Enter")
    _idle(pg)
    _see(pg, f"for {STEPS:,} environment steps")            # the number was taken…
    assert _runs(workspace) == []                           # …and nothing was launched
    _see(pg, "No runs yet")
    _shot(pg, "training-enter")


def test_a_duplicate_launch_is_refused_and_the_run_ends_on_its_own(page, workspace):
    pg = page
    launch = _main(pg).get_by_role("button", name="Launch", exact=True)
    launch.click()
    _see(pg, re.compile(r"Started run run-"))
    run_id = re.search(r"Started run (run-[\w-]+)", _main(pg).inner_text()).group(1)
    launch.click()                                          # the second click a moment later
    _see(pg, re.compile(rf"Not launched: run {run_id} is already training"))
    assert [r[0] for r in _runs(workspace)] == [run_id]
    _shot(pg, "training-duplicate")
    # no reload from here on: the page follows the run until it ends
    _see(pg, re.compile(rf"{run_id} · finished · {STEPS:,} steps done \(planned {STEPS:,}\)"), timeout=4 * WAIT_MS)
    _idle(pg)                                               # nothing left greyed (stale)
    assert _runs(workspace) == [(run_id, "finished", STEPS)]
    assert _main(pg).get_by_role("button", name="Stop").count() == 0
    # the refusal, next to the button, survived the reruns the run's progress and end caused
    assert f"Not launched: run {run_id} is already training" in _main(pg).inner_text()
    _main(pg).locator('[data-testid="stPlotlyChart"]').first.wait_for()
    _shot(pg, "training-finished")


def test_export_lists_the_bundle_at_once(page, workspace):
    pg = page
    (run_id, _, _), = _runs(workspace)
    _open(pg, "Policies")
    _main(pg).get_by_role("tab", name="Runs & bundles").click()
    _see(pg, "None in this workspace yet.")
    _select(pg, "Run to export", run_id)
    _main(pg).get_by_role("button", name="Export bundle").click()
    _see(pg, re.compile(rf"Wrote (\S+\.zip) from {run_id}"))
    _idle(pg)  # the rerun has drawn the list below the message too (not the previous run's)
    file = re.search(rf"Wrote (\S+\.zip) from {run_id}", _main(pg).inner_text()).group(1)
    assert _main(pg).get_by_text("None in this workspace yet.").count() == 0
    bundle = _main(pg).get_by_role("combobox", name="Bundle", exact=True)
    assert bundle.input_value() == file
    _main(pg).get_by_role("button", name="Register as candidate").click()
    _see(pg, f"Registered {file}: it is a candidate in the Registry tab.")
    tab = _main(pg).get_by_role("tab", name="Runs & bundles")
    assert tab.get_attribute("aria-selected") == "true"     # the tab kept its place
    _shot(pg, "policies-export")
