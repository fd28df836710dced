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

from app import resources  # noqa: E402
from core.errors import RwbError  # noqa: E402
from core.store import WorkspaceError  # noqa: E402

# (file in pages/, title, url path, icon) — one line per page, in menu order.
PAGES: list[tuple[str, str, str, str]] = [
    ("episodes.py", "Episodes", "episodes", ":material/list_alt:"),
    ("state_explorer.py", "State Explorer", "states", ":material/scatter_plot:"),
    ("reward_pyramid.py", "Reward Pyramid", "rewards", ":material/change_history:"),
    ("training.py", "Training", "training", ":material/model_training:"),
    ("diagnostics.py", "Diagnostics", "diagnostics", ":material/troubleshoot:"),
    ("policies.py", "Policies", "policies", ":material/verified:"),
]


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


def main() -> None:
    st.set_page_config(page_title="Reward Workbench", page_icon=":material/balance:", layout="wide")
    resources.ensure_session()
    _first_start()
    nav = st.navigation([
        st.Page(ROOT / "pages" / file, title=title, url_path=url, icon=icon)
        for file, title, url, icon in PAGES
    ])
    nav.run()


main()
