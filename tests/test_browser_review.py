"""A reviewer sees what they decide, in a real browser (issue 30, point 5): Playwright driving
Debian's Chromium against ``rwb app`` on a small single-user workspace (the local admin acts).

The admin claims the queued step and reads, before the decision buttons, the user's request,
the call with its arguments, the rule that flagged it, the reward components with plain names
and rounded values, and how an earlier item with the same tool was decided; then rejects it
with a note and the page says "rejected" (not "rejectd").

Screenshots go to ``test-output/screens/review-*.png``.  The app, its helpers and the waits
are those of tests/test_browser.py (waits are for text, never fixed sleeps).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from test_browser import CHROMIUM, WAIT_MS, _idle, _main, _open, _see
from test_browser import _shot as page_shot

from _browser import browser_tab, running_app

playwright = pytest.importorskip("playwright.sync_api")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "datasets" / "finance" / "sample.jsonl"
DATASET = "fin-review"
EPISODES = 40


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> dict:
    """40 finance episodes; one place_order step decided (rejected with a note), another queued."""
    from core import rewards
    from core.access.users import LOCAL_ADMIN
    from core.data.importers import import_file
    from core.guard import review
    from core.records.catalog import catalog_for_dataset
    from core.records.store import Workspace

    base = tmp_path_factory.mktemp("browser-review")
    lines = SAMPLE.read_text(encoding="utf-8").splitlines()
    data = base / f"{DATASET}.jsonl"
    data.write_text("\n".join(lines[:EPISODES + 1]) + "\n", encoding="utf-8")
    ws = Workspace.open(base / "ws")
    import_file(ws, data, dataset=DATASET)
    rewards.score(ws, "finance_risk", dataset=DATASET)   # the component cache an earlier visit leaves
    catalog = catalog_for_dataset(ws, DATASET)
    steps = [s for e in ws.load_episodes(DATASET) for s in review.recorded_steps(e, DATASET, catalog)
             if s.token.tool == "place_order" and s.step_t > 0]
    earlier = review.send_step(ws, LOCAL_ADMIN, DATASET, steps[0].episode_id, steps[0].step_t, "size?")
    review.claim(ws, LOCAL_ADMIN, earlier.id)
    review.decide(ws, LOCAL_ADMIN, earlier.id, "reject", "no market order of that size")
    item = review.send_step(ws, LOCAL_ADMIN, DATASET, steps[1].episode_id, steps[1].step_t,
                            "a large market order: check it")
    episode = ws.get_episode(DATASET, item.episode_id)
    request = episode.steps[0].observation["messages"][0]["content"]
    params = next(s for s in episode.steps if s.t == item.step_t).action.params
    ws.close()
    return {"root": base / "ws", "item": item.id, "request": request, "params": params}


@pytest.fixture(scope="module")
def page(workspace):
    root = workspace["root"]
    with running_app(root, root.parent / "app.log", env={"RWB_POLICIES_DIR": str(root.parent / "policies")}) as url:
        with browser_tab(url, viewport={"width": 1500, "height": 1100}, timeout_ms=WAIT_MS) as pg:
            yield pg


@pytest.mark.timeout(300)
def test_a_reviewer_sees_request_arguments_and_components(page, workspace):
    pg = page
    _open(pg, "Review Queue")
    main = _main(pg)
    main.get_by_role("button", name="Claim next item").click()
    _see(pg, f"Claimed item #{workspace['item']}.")
    _see(pg, "What the user asked")
    page_shot(pg, "review-claimed")

    # the request, the call with its arguments
    assert main.locator("blockquote").filter(has_text=workspace["request"][:60]).count() == 1
    code = main.locator('[data-testid="stCode"]')
    assert code.first.inner_text().startswith("place_order(")
    shown = json.loads(code.nth(1).inner_text())
    assert shown == workspace["params"]
    # the rule and why, the components with plain names and rounded values
    _see(pg, "Sent to review by local.")
    components = main.locator('[data-testid="stTable"]').first
    text = components.inner_text()
    assert "Tool validity" in text and "Duplicate calls" in text
    values = re.findall(r"[+−]\d[\d.,]*", text)
    assert values and all(len(v.strip("+−").replace(".", "").replace(",", "").lstrip("0")) <= 4 for v in values)
    _see(pg, "Scored with finance_risk@0")
    _see(pg, "Items with the tool place_order:")
    assert "no market order of that size" in main.locator('[data-testid="stTable"]').nth(2).inner_text()

    # the decision, in plain words
    main.get_by_label("Comment").fill("not without a risk check first")
    main.get_by_role("button", name="Reject: never in this state").click()
    _see(pg, re.compile(rf"Item #{workspace['item']} rejected: the action is now blocked"))
    _idle(pg)
    assert "rejectd" not in main.inner_text()
    page_shot(pg, "review-decided")
