"""The Home page in a real browser (issue 30): Playwright driving Debian's Chromium against
``rwb app`` on a fresh sample workspace (single user: the local admin acts).

1. The root address opens Home: the samples' state and the next step (import your own logs).
2. The analyst picks ecommerce data, then finance data again; then, outside the app, a reward
   version is saved, a run ends and a one-episode file is imported with the CLI.
3. After a reload Home shows the used workspace's state and its next step (register the
   finished run), and the pickers open on the finance data the analyst used last and the
   reward version saved for finance — not on the newer one-episode dataset; the next-step link
   opens the Policies page.
4. The Glossary page, opened from the menu, finds the terms a search names.

Screenshots go to ``test-output/screens/home-*.png``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from test_browser import CHROMIUM, WAIT_MS, _fill, _idle, _main, _metric, _open, _see, _select
from test_browser import _shot as page_shot

from _browser import browser_tab, running_app

playwright = pytest.importorskip("playwright.sync_api")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")

ONE_EPISODE = "one-episode"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    from core.records.store import Workspace
    from core.sample.workspace_setup import init_workspace

    root = tmp_path_factory.mktemp("browser-home") / "ws"
    ws = Workspace.open(root)
    init_workspace(ws)
    ws.close()
    return root


@pytest.fixture(scope="module")
def page(workspace):
    with running_app(workspace, workspace.parent / "app.log") as url:
        with browser_tab(url, viewport={"width": 1500, "height": 1100}, timeout_ms=WAIT_MS) as pg:
            yield pg


def _picked(pg, label: str) -> str:
    return _main(pg).get_by_role("combobox", name=label, exact=True).first.input_value()


def _use_the_workspace(root: Path, tmp: Path) -> str:
    """What happens outside the app: a reward version saved, a run ended, a one-episode file
    imported with the CLI.  Returns the run's id."""
    from core.access.users import LOCAL_ADMIN
    from core.data import datasets
    from core.records.store import Workspace
    from core.rewards.versions import get_template, save_template
    from core.rl.ppo import PPOConfig
    from core.rl.runs import create_run, finish_run

    ws = Workspace.open(root)
    saved = save_template(ws, LOCAL_ADMIN, "finance_risk", get_template(ws, "finance_risk").yaml, 0,
                          "checked against outcomes")
    run_id = create_run(ws, LOCAL_ADMIN, template=saved.template(), config=PPOConfig(), dataset="finance-sample")
    finish_run(ws, run_id, "finished")
    ws.close()
    one = datasets.generate_file("finance", 1, 11, tmp / f"{ONE_EPISODE}.jsonl")
    subprocess.run([str(Path(sys.executable).parent / "rwb"), "--workspace", str(root), "episodes", "import",
                    str(one.out), "--dataset", ONE_EPISODE], check=True, capture_output=True, timeout=120)
    return run_id


def test_home_state_next_step_and_defaults(page, workspace):
    pg = page
    # 1. fresh: the root address opens Home
    pg.locator("h1").filter(has_text="Home").first.wait_for()
    _idle(pg)
    assert pg.url.rstrip("/").endswith("/home")
    _see(pg, "Next step")
    link = _main(pg).get_by_role("link", name="Import your own agent logs")
    assert link.count() == 1
    assert (_metric(pg, "Datasets"), _metric(pg, "Reward versions saved"), _metric(pg, "Training runs")) == \
        ("2", "0", "0")
    assert _metric(pg, "Waiting for review") == "6"
    assert (_picked(pg, "Dataset"), _picked(pg, "Reward template")) == ("finance-sample", "finance_risk@0")
    page_shot(pg, "home-fresh")

    # 2. the analyst works on ecommerce, then on finance again (the pickers remember it)
    _select(pg, "Dataset", "ecommerce-sample")
    _idle(pg)
    assert _picked(pg, "Reward template") == "ecommerce_returns@0"
    _select(pg, "Dataset", "finance-sample")
    _idle(pg)
    run_id = _use_the_workspace(workspace, workspace.parent)

    # 3. used: a new session (reload) opens on the user's last dataset, not the newest
    pg.reload()
    pg.locator("h1").filter(has_text="Home").first.wait_for()
    _idle(pg)
    _see(pg, f"Export run {run_id} and register it for approval")
    assert (_metric(pg, "Datasets"), _metric(pg, "Reward versions saved"), _metric(pg, "Training runs")) == \
        ("3", "1", "1")
    fidelity = _metric(pg, "Reward agrees with outcomes")
    assert 0.5 <= float(fidelity) <= 1, fidelity
    assert (_picked(pg, "Dataset"), _picked(pg, "Reward template")) == ("finance-sample", "finance_risk@1")
    _see(pg, "Working on: finance-sample with finance_risk@1.")
    page_shot(pg, "home-used")
    _select(pg, "Dataset", ONE_EPISODE)
    _idle(pg)
    assert _picked(pg, "Reward template") == "finance_risk@1"  # the one episode is finance data too
    _main(pg).get_by_role("link", name=f"Export run {run_id} and register it for approval").click()
    pg.locator("h1").filter(has_text="Policies").first.wait_for()
    _idle(pg)
    page_shot(pg, "home-next-step-policies")

    # 4. the glossary, from the menu: the terms in plain words, searched
    _open(pg, "Glossary")
    _fill(pg, "Search the glossary", "nats")
    _see(pg, "Spread of the policy's choices")
    page_shot(pg, "home-glossary")
