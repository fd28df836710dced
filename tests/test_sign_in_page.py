"""The sign-in page and the router's "who acts" line (AppTest).

A workspace with users opens on the sign-in page; a wrong password is refused with a
message (no traceback); the right one makes the user the acting user of every page
(``app.resources.acting_user``); signing out makes the pages read-only again.  A
workspace without users says no sign-in is needed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from core.records.store import Workspace
from core.access.users import LOCAL_ADMIN, Actor, add_user

ROOT = Path(__file__).resolve().parents[1]
MAIN = str(ROOT / "app" / "main.py")
TIMEOUT = 120


def _texts(at: AppTest) -> str:
    parts = [m.value for m in at.markdown] + [c.value for c in at.caption] + [i.value for i in at.info]
    parts += [e.value for e in at.error] + [s.value for s in at.success]
    return "\n".join(str(p) for p in parts)


@pytest.fixture
def users_ws(tmp_path, monkeypatch) -> Path:
    ws = Workspace.open(tmp_path / "ws")
    add_user(ws, LOCAL_ADMIN, "ada", "admin", password="ada-password")
    add_user(ws, Actor("ada", "admin"), "bob", "approver", password="bob-password")
    ws.close()
    monkeypatch.setenv("RWB_WORKSPACE", str(tmp_path / "ws"))
    return tmp_path / "ws"


def test_multi_user_workspace_opens_on_sign_in_and_signs_in(users_ws):
    at = AppTest.from_file(MAIN, default_timeout=TIMEOUT).run()
    assert not at.exception
    assert at.title[0].value == "Sign in"
    assert "Not signed in" in _texts(at)

    at.text_input(key="sign_in_name").input("bob")
    at.text_input(key="sign_in_password").input("wrong-password")
    at.button[0].click().run()
    assert not at.exception
    assert "unknown user or wrong password" in _texts(at)
    assert "actor" not in at.session_state

    at.text_input(key="sign_in_name").input("bob")
    at.text_input(key="sign_in_password").input("bob-password")
    at.button[0].click().run()
    assert not at.exception
    assert at.session_state["actor"] == Actor("bob", "approver")
    assert "Acting as **bob** (approver)" in _texts(at)
    assert "Signed in as **bob** (approver)" in _texts(at)

    at.button(key="sign_out").click().run()
    assert not at.exception
    assert "actor" not in at.session_state
    assert "Not signed in" in _texts(at)


def test_embedded_workspace_needs_no_sign_in(tmp_path, monkeypatch):
    Workspace.open(tmp_path / "ws").close()
    monkeypatch.setenv("RWB_WORKSPACE", str(tmp_path / "ws"))
    at = AppTest.from_file(MAIN, default_timeout=TIMEOUT).run()
    assert not at.exception
    assert at.title[0].value != "Sign in"          # the first page opens, not the sign-in
    assert "Acting as **local** (admin)" in _texts(at)
    at.switch_page(str(ROOT / "pages" / "sign_in.py")).run()
    assert not at.exception
    assert "no sign-in needed" in _texts(at)


AUTH = {"redirect_uri": "http://localhost:8501/oauth2callback", "cookie_secret": "test-cookie-secret",
        "client_id": "rwb", "client_secret": "s3cret",
        "server_metadata_url": "https://idp.example.com/.well-known/openid-configuration"}


def _sign_in_page(at: AppTest) -> AppTest:
    return at.switch_page(str(ROOT / "pages" / "sign_in.py")).run()


def test_single_sign_on_is_offered_when_configured(users_ws):
    at = AppTest.from_file(MAIN, default_timeout=TIMEOUT)
    at.secrets["auth"] = AUTH
    at.user = {"is_logged_in": False}
    at.run()
    assert not at.exception
    assert at.button(key="sso_sign_in").label == "Sign in with single sign-on"


def test_single_sign_on_maps_the_identity_to_a_workspace_user(users_ws):
    ws = Workspace.open(users_ws)
    add_user(ws, Actor("ada", "admin"), "cy", "reviewer", email="cy@example.com")
    ws.close()
    at = AppTest.from_file(MAIN, default_timeout=TIMEOUT)
    at.secrets["auth"] = AUTH
    at.user = {"is_logged_in": True, "email": "cy@example.com", "email_verified": True,
               "sub": "idp|123"}
    _sign_in_page(at.run())
    assert not at.exception
    assert at.session_state["actor"] == Actor("cy", "reviewer", email="cy@example.com")

    stranger = AppTest.from_file(MAIN, default_timeout=TIMEOUT)
    stranger.secrets["auth"] = AUTH
    stranger.user = {"is_logged_in": True, "email": "eve@example.com", "email_verified": True,
                     "sub": "idp|666"}
    _sign_in_page(stranger.run())
    assert not stranger.exception
    assert "actor" not in stranger.session_state
    assert "eve@example.com is not a user of this workspace" in _texts(stranger)
