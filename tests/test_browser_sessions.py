"""Sign-ins that last, in a real browser: Playwright driving Debian's Chromium against ``rwb app``.

The app runs as a subprocess (``rwb --workspace WS app --port FREE --headless``) on a tiny
workspace (twelve generated finance episodes, so the app imports no samples; no training
run).  In one browser:

1. a tab opened while the workspace has no users says the local admin acts, and its
   sign-in page's address works and says so too;
2. users are added behind its back: without a reload or a click, the open tab's sidebar
   says nobody is signed in;
3. the sign-in page's address, typed, shows the sign-in form; bob signs in and gets an
   ``rwb_session`` cookie that is HttpOnly and SameSite=Strict (and not Secure: plain http);
4. a typed address of another page, its reload and a second tab are still bob's;
5. signing out deletes the cookie, and a reload is signed out;
6. a password change by an admin ends bob's new session: the next reload says so.

Screenshots go to ``test-output/screens/sessions-*.png``.  Waits are for text on the page,
never fixed sleeps.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from _browser import running_app

ROOT = Path(__file__).resolve().parents[1]
SCREENS = ROOT / "test-output" / "screens"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run"]
PASSWORDS = {"ada": "ada-session-pass", "bob": "bob-session-pass"}
#: Generous per-wait ceiling (a busy 2-core machine); waits end as soon as the text shows.
WAIT_MS = 60_000

playwright = pytest.importorskip("playwright.sync_api")
CHROMIUM = shutil.which("chromium")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A workspace with one tiny dataset and no users yet."""
    from core.data import datasets
    from core.data.importers import import_file
    from core.records.store import Workspace

    base = tmp_path_factory.mktemp("sessions")
    ws = Workspace.open(base / "ws")
    data = datasets.generate_file("finance", 12, 7, base / "finance.jsonl")
    import_file(ws, data.out, dataset="finance-tiny")
    ws.close()
    return base / "ws"


@pytest.fixture(scope="module")
def app_url(workspace) -> str:
    with running_app(workspace, workspace.parent / "app.log") as url:
        yield url


@pytest.fixture(scope="module")
def context(app_url):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        ctx = browser.new_context(viewport={"width": 1300, "height": 900})
        ctx.set_default_timeout(WAIT_MS)
        yield ctx
        ctx.close()
        browser.close()


# --------------------------------------------------------------------------- helpers
_IDLE_JS = """() => !document.querySelector('[data-testid="stStatusWidget"]')
                   && !document.querySelector('[data-stale="true"]')"""


def _idle(pg) -> None:
    """Wait until Streamlit has finished rerunning (twice in a row, a moment apart)."""
    for _ in range(50):
        pg.wait_for_function(_IDLE_JS, timeout=WAIT_MS)
        pg.wait_for_timeout(250)
        if pg.evaluate(_IDLE_JS):
            return


def _sidebar(pg):
    return pg.locator('[data-testid="stSidebar"]')


def _main(pg):
    return pg.locator('[data-testid="stMain"]')


def _page_shows(pg, title: str, who: str) -> None:
    """The page titled ``title`` has rendered and its sidebar says ``who`` (and nothing else
    about who acts); no "page not found" and no exception."""
    pg.locator("h1").filter(has_text=title).first.wait_for()
    _sidebar(pg).get_by_text(who).wait_for()
    _idle(pg)
    sidebar = _sidebar(pg).inner_text()
    for other in ("Acting as", "Not signed in"):
        if not who.startswith(other):
            assert other not in sidebar, f"{title}: the sidebar says {sidebar!r}, expected only {who!r}"
    assert "Page not found" not in pg.locator("body").inner_text()
    assert _main(pg).locator('[data-testid="stException"]').count() == 0


def _shot(pg, name: str) -> None:
    SCREENS.mkdir(parents=True, exist_ok=True)
    _idle(pg)
    pg.screenshot(path=str(SCREENS / f"sessions-{name}.png"), full_page=True)


def _session_cookie(context) -> dict | None:
    found = [c for c in context.cookies() if c["name"] == "rwb_session"]
    return found[0] if found else None


def _wait_cookie(context, present: bool) -> dict | None:
    deadline = time.monotonic() + WAIT_MS / 1000
    while (_session_cookie(context) is not None) != present:
        assert time.monotonic() < deadline, f"the session cookie is {'missing' if present else 'still set'}"
        time.sleep(0.1)
    return _session_cookie(context)


def _sign_in(pg, name: str) -> None:
    _main(pg).get_by_label("User name").fill(name)
    _main(pg).get_by_role("textbox", name="Password").fill(PASSWORDS[name])
    _main(pg).get_by_role("button", name="Sign in").click()
    _main(pg).get_by_text("Signed in as").wait_for()


# --------------------------------------------------------------------------- the test
@pytest.mark.timeout(600)
def test_sign_in_survives_reload_and_typed_addresses(context, app_url, workspace):
    from core.records.store import Workspace
    from core.access.users import LOCAL_ADMIN, Actor, add_user, set_password

    # 1. No users: the local admin acts, on every page, the sign-in page included.
    first = context.new_page()
    first.goto(app_url)
    _page_shows(first, "Home", "Acting as local (admin)")
    assert first.url.rstrip("/").endswith("/home")
    first.goto(f"{app_url}/sign-in")
    _page_shows(first, "Sign in", "Acting as local (admin)")
    _main(first).get_by_text("You are acting as the local admin").wait_for()
    _shot(first, "01-single-user-sign-in")
    first.goto(f"{app_url}/policies")
    _page_shows(first, "Policies", "Acting as local (admin)")

    # 2. Users appear behind the open tab's back: it says so without a reload or a click.
    ws = Workspace.open(workspace)
    try:
        add_user(ws, LOCAL_ADMIN, "ada", "admin", password=PASSWORDS["ada"])
        add_user(ws, Actor("ada", "admin"), "bob", "approver", password=PASSWORDS["bob"])
    finally:
        ws.close()
    _sidebar(first).get_by_text("Not signed in").wait_for(timeout=30_000)
    _page_shows(first, "Policies", "Not signed in")
    _shot(first, "02-users-appeared")

    # 3. The sign-in page's own address, typed, in multi-user mode; the root opens it too.
    first.goto(app_url)
    _page_shows(first, "Sign in", "Not signed in")
    first.goto(f"{app_url}/sign-in")
    _page_shows(first, "Sign in", "Not signed in")
    _sign_in(first, "bob")
    _page_shows(first, "Sign in", "Acting as bob (approver)")
    cookie = _wait_cookie(context, present=True)
    assert cookie["httpOnly"] is True
    assert cookie["sameSite"] == "Strict"
    assert cookie["secure"] is False          # plain http here; Secure is set over https
    assert cookie["expires"] > time.time() + 6 * 86400   # the session's 7-day absolute life
    assert "rwb_session" not in first.evaluate("() => document.cookie")   # no script can read it
    _shot(first, "03-signed-in")

    # 4. Typed addresses, a reload and a second tab stay bob's.
    first.goto(f"{app_url}/policies")
    _page_shows(first, "Policies", "Acting as bob (approver)")
    first.reload()
    _page_shows(first, "Policies", "Acting as bob (approver)")
    _shot(first, "04-policies-after-reload")
    first.goto(f"{app_url}/sign-in")
    _page_shows(first, "Sign in", "Acting as bob (approver)")
    _main(first).get_by_text("Signed in as bob (approver)").wait_for()
    second = context.new_page()
    second.goto(f"{app_url}/review")
    _page_shows(second, "Review Queue", "Acting as bob (approver)")
    _shot(second, "05-second-tab")

    # 5. Sign out: the cookie goes, a reload is signed out, and so is the other tab.
    _main(first).get_by_role("button", name="Sign out").click()
    _page_shows(first, "Sign in", "Not signed in")
    _wait_cookie(context, present=False)
    first.reload()
    _page_shows(first, "Sign in", "Not signed in")
    _sidebar(second).get_by_text("Not signed in").wait_for(timeout=30_000)
    _shot(first, "06-signed-out-reload")
    second.close()

    # 6. A password change by an admin ends bob's session: the next reload says why.
    _sign_in(first, "bob")
    _wait_cookie(context, present=True)
    ws = Workspace.open(workspace)
    try:
        set_password(ws, Actor("ada", "admin"), "bob", "bob-new-password")
    finally:
        ws.close()
    first.goto(f"{app_url}/policies")
    _page_shows(first, "Policies", "Not signed in")
    _main(first).get_by_text("Your session was ended (password changed)").wait_for()
    _wait_cookie(context, present=False)
    _shot(first, "07-password-changed")
    first.close()
