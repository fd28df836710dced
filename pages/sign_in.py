"""Sign in: who acts in this browser session (multi-user workspaces)."""

from __future__ import annotations

import streamlit as st

from rwb_app import resources
from rwb_app.messages import cli_equivalent, user_message
from core.base.errors import RwbError
from core.access.users import (PASSWORD_POLICY, multi_user, password_problem, sign_in,
                               sso_sign_in)

st.title("Sign in")
st.caption("Sign in to act with your role: analysts import, design rewards and train; reviewers "
           "decide review items; approvers approve, promote and roll back policies. Reading needs no "
           "sign-in.")

ws = resources.workspace()
actor = st.session_state.get("actor")
# Failed sign-ins back off per user name and per client address (the server's view of the
# peer; behind a proxy that hides it there is no address, and only the user name backs off).
address = st.context.ip_address
address = address if isinstance(address, str) and address else None

if not multi_user(ws):
    st.info("You are acting as the local admin: this workspace has no users, so everyone who opens it "
            "is the local admin, no sign-in needed. Sign-in switches on once the workspace's "
            "owner adds users (the first one an admin).")
    cli_equivalent("rwb users add NAME --role ROLE")
    st.stop()

# Single sign-on is offered when the app's secrets configure Streamlit's OIDC login ([auth]).
sso = st.secrets.load_if_toml_exists() and "auth" in st.secrets
signed_in_sso = sso and bool(st.user.is_logged_in)

if actor is not None:
    st.success(f"Signed in as **{actor.name}** ({actor.role}).")
    if st.session_state.get("password_advice"):
        st.warning(f"Your password does not meet the password policy: "
                   f"{st.session_state['password_advice']}. Please change it.")
        cli_equivalent(f"rwb users passwd {actor.name} --as {actor.name}", "to change it")
    if st.button("Sign out", key="sign_out"):
        st.session_state.pop("password_advice", None)
        resources.sign_out()
        if signed_in_sso:
            st.logout()
        st.rerun()
    st.stop()

if signed_in_sso:
    # The identity provider says who this is; the workspace says which user (and role) that is.
    try:
        resources.start_session(sso_sign_in(ws, st.user.to_dict(), address=address))
    except RwbError as exc:
        st.error(user_message(exc))
        st.button("Sign out of single sign-on", key="sso_sign_out", on_click=st.logout)
    else:
        st.rerun()
    st.stop()

with st.form("sign_in_form"):
    name = st.text_input("User name", key="sign_in_name")
    password = st.text_input("Password", type="password", key="sign_in_password")
    submitted = st.form_submit_button("Sign in", type="primary")
if submitted:
    try:
        resources.start_session(sign_in(ws, name, password, address=address))
    except RwbError as exc:
        st.error(user_message(exc))
    else:
        # a password set before the policy still signs in; say so, once signed in
        st.session_state["password_advice"] = password_problem(password)
        st.rerun()
st.caption(f"Password policy: {PASSWORD_POLICY}.")
if sso:
    st.button("Sign in with single sign-on", key="sso_sign_in", on_click=st.login)
st.caption("No account yet? Ask an admin to add you as an analyst, reviewer or approver "
           "(with your e-mail for single sign-on).")
cli_equivalent("rwb users add NAME --role analyst|reviewer|approver --email ADDRESS", "for the admin")
