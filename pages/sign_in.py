"""Sign in: who acts in this browser session (multi-user workspaces)."""

from __future__ import annotations

import streamlit as st

from app import resources
from core.errors import RwbError
from core.users import authenticate, multi_user

st.title("Sign in")
st.caption("Sign in to act with your role: analysts import, design rewards and train; reviewers "
           "decide review items; approvers approve, promote and roll back policies. Reading needs no "
           "sign-in.")

ws = resources.workspace()
actor = st.session_state.get("actor")

if not multi_user(ws):
    st.info("This workspace has no users: everyone who opens it is the local admin, no sign-in needed. "
            "Add users with `rwb users add NAME --role ROLE` (the first one an admin) to switch sign-in on.")
    st.stop()

if actor is not None:
    st.success(f"Signed in as **{actor.name}** ({actor.role}).")
    if st.button("Sign out", key="sign_out"):
        del st.session_state["actor"]
        st.rerun()
    st.stop()

with st.form("sign_in_form"):
    name = st.text_input("User name", key="sign_in_name")
    password = st.text_input("Password", type="password", key="sign_in_password")
    submitted = st.form_submit_button("Sign in", type="primary")
if submitted:
    try:
        st.session_state["actor"] = authenticate(ws, name, password)
    except RwbError as exc:
        st.error(str(exc))
    else:
        st.rerun()
st.caption("No account yet? Ask an admin: `rwb users add NAME --role analyst|reviewer|approver`.")
