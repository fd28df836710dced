"""The one place where the app caches models, connections and bundles.

``st.cache_resource`` holds objects that are shared and never mutated by a page
(the workspace connection, the embedder); ``st.cache_data`` holds derived data.
"""

from __future__ import annotations

import os

import streamlit as st

from core.store import Workspace, default_workspace_path


def workspace_path() -> str:
    return str(os.environ.get("RWB_WORKSPACE") or default_workspace_path())


@st.cache_resource(show_spinner=False)
def _workspace(path: str) -> Workspace:
    return Workspace.open(path)


def workspace() -> Workspace:
    """The workspace of this app session (``RWB_WORKSPACE`` or ./workspace)."""
    return _workspace(st.session_state.get("workspace_path") or workspace_path())


def ensure_session() -> None:
    """Shared session state owned by the router."""
    st.session_state.setdefault("workspace_path", workspace_path())
