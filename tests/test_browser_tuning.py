"""Tuning's guardrails in a real browser (issue 30): Playwright driving Debian's Chromium against
``rwb app`` on a small single-user workspace (60 generated finance episodes, a one-episode
dataset, ``fin_fast@1``).

1. A study whose worker failed on the one-episode dataset shows as failed, with its cause, in
   the Studies list and at the top of its panel, and has no Stop button.
2. Start on the one-episode dataset says at once that it cannot be tuned, and offers no Start.
3. A finished study whose tuned weights do worse than the template on held-out episodes says so
   in plain words; Save asks for a confirmation that names the drop, and only the yes saves
   ``fin_fast@2``.

The studies are made with core functions before the app starts (a failed worker run in this
process, a short study with an over-fitting trial made its best), so the module's wall time is
the app's start and a few page runs.  Screenshots go to ``test-output/screens/tuning-*.png``;
the visible text of each is checked for raw figures, flags and bare technical terms.
"""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

import pytest

from test_browser import CHROMIUM, WAIT_MS, _idle, _main, _open, _see, _select
from test_browser import _shot as page_shot
from _browser import browser_tab, wording_defects

from _browser import running_app

playwright = pytest.importorskip("playwright.sync_api")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")

ONE = "tuning needs at least two episodes"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> dict:
    """The workspace, a failed study and a study whose best weights do worse than the template."""
    import optuna

    from core import tuning
    from core.access.users import current_user
    from core.base.errors import InputError
    from core.rewards.versions import save_template
    from core.tuning.records import now_iso
    from _tuning_fixtures import FIN_FAST, finance_workspace

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    root = tmp_path_factory.mktemp("browser-tuning") / "ws"
    ws = finance_workspace(root, n_episodes=60, seed=2)
    finance_workspace(root, n_episodes=1, seed=3, dataset="one")
    actor = current_user(ws)
    save_template(ws, actor, "fin_fast", FIN_FAST, None, "for the browser")

    # 1. what launch_tuning records before its worker starts, then the worker failing on one episode
    with ws.transaction() as conn:
        conn.execute("INSERT INTO tuning_studies(name, storage, objective, template_name, template_version, "
                     "template_sha256, dataset, episodes_file, config, created_by, created_at) "
                     "VALUES ('one-study', NULL, 'outcome', 'fin_fast', 1, '', 'one', NULL, '{}', 'local', ?)",
                     (now_iso(),))
        run_id = conn.execute("INSERT INTO tuning_runs(study, status, trials_requested, started_by, started_at) "
                              "VALUES ('one-study', 'starting', 5, 'local', ?)", (now_iso(),)).lastrowid
    with pytest.raises(InputError, match=ONE):
        tuning.tune(ws, actor, "fin_fast@1", dataset="one", trials=5, study="one-study", run_id=run_id)

    # 3. a short study whose best trial (by the design folds) does worse on the held-out tasks: a real
    # trial below the template, its objective value raised (the over-fitting case)
    res = tuning.tune(ws, actor, "fin_fast@1", dataset="fin", trials=12, study="worse",
                      config=tuning.TuneConfig(metric="all_pairs"))
    template_auc = res.baseline["figures"]["held_out"]["auc"]
    st = tuning.load_study(ws, "worse")
    below = [t for t in st.trials if t.state.is_finished() and (t.user_attrs.get("held_out_auc") or 1) < template_auc
             and all(v <= 0 for v in t.constraints.values())]
    assert below, "some trial of the study does worse than the template on the held-out tasks"
    donor = min(below, key=lambda t: t.user_attrs["held_out_auc"])
    st.add_trial(optuna.trial.create_trial(value=res.best["value"] + 1.0, params=donor.params,
                                           distributions=donor.distributions, user_attrs=donor.user_attrs,
                                           constraints=dict(donor.constraints)))
    check = tuning.apply_check(ws, "worse")
    assert check.worse
    ws.close()
    return {"root": root, "question": check.question}


@pytest.fixture(scope="module")
def page(workspace):
    root = workspace["root"]
    with running_app(root, root.parent / "app.log") as url:
        with browser_tab(url, viewport={"width": 1500, "height": 1100}, timeout_ms=WAIT_MS) as pg:
            _open(pg, "Tuning")
            yield pg


def _shot(pg, name: str) -> None:
    """The whole page as ``test-output/screens/tuning-NAME.png``, its visible text checked."""
    page_shot(pg, f"tuning-{name}")
    assert wording_defects(_main(pg).inner_text()) == []


def _see_here(pg, text: str) -> None:
    """Wait for ``text`` in the open tab (an error in a hidden tab, the failed study's, is no failure)."""
    _main(pg).get_by_text(text).filter(visible=True).first.wait_for(state="visible", timeout=WAIT_MS)


def _versions(root: Path) -> list[int]:
    with sqlite3.connect(root / "workbench.db") as conn:
        return [r[0] for r in conn.execute("SELECT version FROM template_versions WHERE name='fin_fast' "
                                           "ORDER BY version")]


def test_a_failed_study_shows_as_failed_with_its_cause(page):
    pg = page
    _select(pg, "Study", "one-study")
    _see(pg, f"This study failed: {ONE}")
    assert _main(pg).get_by_role("button", name="Stop").count() == 0
    assert "preparing the study" not in _main(pg).inner_text()
    _shot(pg, "failed")


def test_start_on_one_episode_says_it_cannot_be_tuned_at_once(page):
    pg = page
    _main(pg).get_by_role("tab", name="Start a study").click()
    _idle(pg)
    _select(pg, "Dataset", "one")
    _see_here(pg, f"Cannot start: {ONE}")
    assert _main(pg).get_by_role("button", name="Start", exact=True).is_disabled()
    _shot(pg, "start-refused")
    _main(pg).get_by_role("tab", name="Studies").click()
    _idle(pg)


def test_saving_worse_weights_asks_first_naming_the_drop(page, workspace):
    pg = page
    _select(pg, "Study", "worse")
    _see(pg, "Worse than the current template on episodes it was not tuned on")
    _main(pg).get_by_role("button", name="Save the tuned weights as fin_fast@2").click()
    _see(pg, workspace["question"])
    assert re.search(r"score \d\.\d{3} on held-out episodes .*, \d\.\d{3} below fin_fast@1's \d\.\d{3}",
                     workspace["question"])
    assert _versions(workspace["root"]) == [1]                 # asked, nothing saved yet
    _shot(pg, "confirm")
    _main(pg).get_by_role("button", name="Yes, save them as fin_fast@2").click()
    _see(pg, re.compile(r"Saved fin_fast@2 from trial \d+"))
    assert _versions(workspace["root"]) == [1, 2]
    _shot(pg, "saved")
