"""Streamlit entry point: a router over the top-level ``pages/`` (st.navigation).

Run with ``rwb app`` (or ``streamlit run app/main.py``).  The router owns the
shared session state (workspace, acting user); pages only read inputs, call one
``core`` function and render.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `streamlit run app/main.py` from a checkout
    sys.path.insert(0, str(ROOT))

import streamlit as st  # noqa: E402

from rwb_app import resources  # noqa: E402
from core.base.errors import RwbError  # noqa: E402
from core.base.package_data import resource_dir  # noqa: E402
from core.records.store import WorkspaceError  # noqa: E402

# The pages/ folder as installed (rwb_app/page_scripts: a pages/ folder beside this script
# would switch Streamlit to its older multipage mode).
PAGES_DIR = resource_dir("rwb_app", "page_scripts")

# (file in pages/, title, url path, icon) — one line per page, in menu order.  Home comes
# first: it is where the root address opens for whoever may act.
PAGES: list[tuple[str, str, str, str]] = [
    ("home.py", "Home", "home", ":material/home:"),
    ("episodes.py", "Episodes", "episodes", ":material/list_alt:"),
    ("state_explorer.py", "State Explorer", "states", ":material/scatter_plot:"),
    ("reward_pyramid.py", "Reward Pyramid", "rewards", ":material/change_history:"),
    ("reward_export.py", "Export reward", "reward-export", ":material/output:"),
    ("training.py", "Training", "training", ":material/model_training:"),
    ("tuning.py", "Tuning", "tuning", ":material/tune:"),
    ("diagnostics.py", "Diagnostics", "diagnostics", ":material/troubleshoot:"),
    ("policies.py", "Policies", "policies", ":material/verified:"),
    ("review_queue.py", "Review Queue", "review", ":material/rule:"),
    ("audit.py", "Audit", "audit", ":material/receipt_long:"),
    ("glossary.py", "Glossary", "glossary", ":material/menu_book:"),
]

# The sign-in page: it signs a user in (multi-user workspaces) through
# resources.start_session, which resources.acting_user() reads back for every page.  Its
# address works in every mode; without users it says the local admin acts.
SIGN_IN_PAGE = ("sign_in.py", "Sign in", "sign-in", ":material/login:")
#: Seconds between the sidebar's checks that who acts is still who it says (users added
#: to a workspace that had none, a session ended in another tab or by an admin).
WHO_ACTS_RECHECK_S = 5


def _first_start() -> None:
    """Create the workspace and, when it is empty, import the sample datasets (once per
    workspace and server process)."""
    try:
        with st.spinner("Setting up the workspace (first start imports the sample datasets)…"):
            status = resources.initialise_workspace()
    except (RwbError, WorkspaceError) as exc:
        st.error(f"The workspace could not be set up: {exc}")
        return
    if status.imported and not st.session_state.get("samples_announced"):
        st.session_state["samples_announced"] = True
        names = ", ".join(r["dataset"] for r in status.imported)
        st.toast(f"New workspace: imported the sample datasets {names}.")


def _who_acts() -> bool:
    """Say in the sidebar who acts in this session; True when the workspace has users and
    nobody signed in yet (the app's root address then opens the sign-in page)."""
    try:
        actor = resources.acting_user()
    except (RwbError, WorkspaceError):
        return False
    if actor is None:
        st.sidebar.caption("Not signed in: pages are read-only.")
    else:
        st.sidebar.caption(f"Acting as **{actor.name}** ({actor.role}).")
    return actor is None


@st.fragment(run_every=WHO_ACTS_RECHECK_S)
def _recheck_who_acts() -> None:
    """Rerun the whole page as soon as who acts changed under this tab, so that the
    sidebar and the page's buttons tell the truth without a reload."""
    try:
        changed = resources.who_acts_changed()
    except (RwbError, WorkspaceError):
        return
    if changed:
        st.rerun()


def main() -> None:
    st.set_page_config(page_title="Reward Workbench", page_icon=":material/balance:", layout="wide")
    resources.ensure_session()
    _first_start()
    needs_sign_in = _who_acts()
    with st.sidebar:
        resources.hand_off_cookie()
        _recheck_who_acts()
    pages = [st.Page(PAGES_DIR / file, title=title, url_path=url, icon=icon)
             for file, title, url, icon in PAGES]
    sign_in_file, sign_in_title, sign_in_url, sign_in_icon = SIGN_IN_PAGE
    sign_in = st.Page(PAGES_DIR / sign_in_file, title=sign_in_title, url_path=sign_in_url,
                      icon=sign_in_icon)
    # Every page keeps its own address (Streamlit serves its default page at the root only),
    # so the default is a hidden page that sends the root address on to where to start: Home,
    # or the sign-in page while a workspace with users has nobody signed in.
    start = sign_in if needs_sign_in else pages[0]
    entry = st.Page(lambda: st.switch_page(start), title="Reward Workbench", url_path="start",
                   default=True, visibility="hidden")
    # expanded: every page stays in the menu (Streamlit folds a long menu after ten entries)
    nav = st.navigation([entry, *pages, sign_in], expanded=True)
    if nav is not entry:  # the root address goes on at once: say why a session ended there
        resources.show_flash(resources.SESSION_FLASH)
    nav.run()


main()
