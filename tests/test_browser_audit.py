"""Audit lists a refused approval, in a real browser (issue 30): Playwright driving Debian's
Chromium against ``rwb app`` on a single-user workspace where, with core functions, a
template was saved and an analyst's approval was refused.  The Audit page opens on the
decisions made in the workbench and shows the refusal with its reason, then only the
refused ones once filtered.  Screenshots go to ``test-output/screens/audit-*.png``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from test_browser import CHROMIUM, WAIT_MS, _idle, _main, _open, _see, _select
from test_browser import _shot as page_shot

from _browser import browser_tab, running_app

playwright = pytest.importorskip("playwright.sync_api")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")

REASON = "ana (analyst) may not approve policies"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    from core.access.users import LOCAL_ADMIN, Actor
    from core.base.errors import PermissionDenied
    from core.govern import registry
    from core.records.store import Workspace
    from core.rewards.versions import get_template, save_template

    base = tmp_path_factory.mktemp("browser-audit")
    ws = Workspace.open(base / "ws")
    seed = get_template(ws, "finance_risk")
    save_template(ws, LOCAL_ADMIN, "finance_risk", seed.yaml, seed.version, "tighter loss cap")
    with pytest.raises(PermissionDenied):
        registry.approve(ws, Actor("ana", "analyst"), "finance_risk", "0.2.0", "it beats the expert")
    ws.close()
    return base / "ws"


@pytest.fixture(scope="module")
def page(workspace):
    with running_app(workspace, workspace.parent / "app.log",
                     env={"RWB_POLICIES_DIR": str(workspace.parent / "policies")}) as url:
        with browser_tab(url, viewport={"width": 1500, "height": 1000}, timeout_ms=WAIT_MS) as pg:
            yield pg


def test_audit_lists_a_refused_approval(page):
    pg = page
    _open(pg, "Audit")
    _see(pg, "Approval refused")
    _see(pg, REASON)
    _see(pg, "Decisions shown")
    _see(pg, "Also from the command line: hover the sign.")     # the tab's last line: all of it is drawn
    page_shot(pg, "audit-refused-approval")

    _select(pg, "Outcome", "refused only")
    _main(pg).get_by_role("button", name="Show", exact=True).click()
    _idle(pg)
    _see(pg, REASON)
    assert _main(pg).get_by_text("Refused", exact=True).count() >= 1
    page_shot(pg, "audit-refused-only")
